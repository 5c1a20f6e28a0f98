"""A stressed arm's final policy validated in BF16 (experiment only, rl/stress_arms.py).

Why: a stressed arm's own validation runs on its stressed rollout, so its accuracy mixes what GRPO learned with the
format's inference error. Serving the trainer's final BF16 weights through a plain BF16 engine, on the same held-out
prompts with the same seed as every arm's validation, measures the learning outcome alone; for the bf16 arm it is
exactly its own last validation.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.generation import start_engine, validate
from jetrl_megatron.rl.trainer import write_model_dir

PREFIX = "val_bf16/"  # summary.json key prefix: val_bf16/accuracy, val_bf16/accuracy_sampled, ...


def bf16_validation(cfg: RunConfig, trainer: Any, engine: Any, val_task: Any, val_prompts: list) -> dict[str, float]:
    """Shut the run's (stressed) engine down, serve the trainer's weights in BF16, validate; keys ``val_bf16/*``."""
    engine.shutdown()
    with tempfile.TemporaryDirectory(prefix="jetrl_bf16_eval_") as tmp:
        bf16 = start_engine(cfg, write_model_dir(cfg, trainer, Path(tmp) / "model"), recipe=cfg.recipe)
        try:
            out = validate(cfg, bf16, val_task, val_prompts)
        finally:
            bf16.shutdown()
    return {PREFIX + k.split("/", 1)[1]: v for k, v in out.items()}
