"""Saving and resuming a run: atomic per-rank checkpoints, the best-k rule, and finding the newest usable one.
The file format and its pure helpers are in ``rl/outputs/checkpoint_format.py``."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.dist import (
    dist_rank,
    dist_world,
    is_main,
    torch_dist,
    warn,
)
from jetrl_megatron.rl.outputs.checkpoint_format import (
    checkpoints_to_remove,
    gather_coords,
    latest_usable,
    make_meta,
    nemo_rl_metric_names,
    read_meta,
    read_rank_file,
    rng_state,
    write_checkpoint_metrics,
)
from jetrl_megatron.rl.tasks import PromptStream
from jetrl_megatron.rl.trainer import (
    Trainer,
)


def ckpt_root(cfg: RunConfig) -> Path:
    return Path(cfg.checkpointing.checkpoint_dir)


def latest_checkpoint(cfg: RunConfig) -> Path | None:
    """The newest complete checkpoint whose files are whole; a newer broken one (e.g. a truncated rank file) is
    skipped with a warning, so the run resumes from the previous complete checkpoint."""
    return latest_usable(ckpt_root(cfg), warn=lambda m: warn(f"warning: {m}"))


def save_checkpoint(cfg: RunConfig, trainer: Trainer, step: int, stream: PromptStream,
                    metrics: dict[str, Any] | None = None) -> Path:
    """Atomic: every rank writes into step_N.tmp, rank 0 renames to step_N and marks it COMPLETE. The step's metrics
    (NeMo-RL names) go with it, and checkpointing.keep_top_k / metric_name decide which older ones are removed."""
    from jetrl_megatron.megatron.model import fp8_context

    root = ckpt_root(cfg)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if dist_world() > 1:
        torch_dist().barrier()
    # optimizer: this rank's shard of the FP32 master params and Adam moments under the distributed optimizer
    state = {"model": trainer.gpt.state_dict(), "optimizer": trainer.optimizer.checkpoint_state(),
             "rng": rng_state(), "stream": stream.state(), "step": step}
    if trainer.ref_model is not None:  # the KL term's frozen policy: the run's start, not what a resume loads
        state["reference"] = trainer.ref_model.state_dict()
    state["fp8_generation"] = fp8_context(trainer.gpt).cache.generation
    part = tmp / f"rank_{dist_rank()}.pt"
    torch.save(state, str(part) + ".part")
    os.replace(str(part) + ".part", part)
    if dist_world() > 1:
        torch_dist().barrier()
    coords = gather_coords()  # collective: every rank's (pp, tp, dp) for meta.json
    if is_main():
        meta = make_meta(step, cfg.name, trainer.shape, trainer.recipe, coords, tmp)
        (tmp / "meta.json").write_text(json.dumps(meta))
        write_checkpoint_metrics(tmp, nemo_rl_metric_names(metrics or {}, None))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (final / "COMPLETE").write_text("")
        ck = cfg.checkpointing
        for p in checkpoints_to_remove(root, ck.keep_top_k, ck.metric_name, ck.higher_is_better):
            shutil.rmtree(p, ignore_errors=True)
    if dist_world() > 1:
        torch_dist().barrier()
    return final


@dataclass
class Resumed:
    """What :func:`load_checkpoint` hands the loop beyond the state it loads in place."""

    step: int
    reference: dict[str, torch.Tensor] | None  # the KL term's reference policy (None: the checkpoint has none)
    rng: dict[str, Any]  # restored by the loop once start-up (which reseeds) is over: :func:`set_rng_state`


# The precision contract's fields (Fp8Recipe.to_dict): a resumed run must share them with the run that wrote the
# checkpoint (which kernels compute it, gemm_backend / batch_invariant, may change).
CONTRACT_KEYS = ("mode", "fmt", "weight_block", "group_size", "scale_fmt", "amax_eps", "bf16_first_layers",
                 "bf16_last_layers", "bf16_module_keywords")


def _as_json(x: Any) -> Any:
    return json.loads(json.dumps(x))


def check_compatible(path: Path, meta: dict[str, Any], trainer: Trainer) -> None:
    """Refuse, before anything is loaded, a checkpoint written for another parallel layout, model or arm: one
    UserError naming the first difference and the key that decides it."""
    from megatron.core import parallel_state as ps

    layout = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size()}
    for key, now in layout.items():
        if meta.get(key) != now:
            raise UserError(f"checkpoint {path} was written with {key.upper()} {meta.get(key)}, this run has "
                            f"{key.upper()} {now} (policy.megatron_cfg.{'tensor' if key == 'tp' else 'pipeline'}_"
                            "model_parallel_size): resume it with the same layout, or set "
                            "checkpointing.checkpoint_dir elsewhere")
    saved, now = meta.get("model", {}).get("hf_config", {}), _as_json(trainer.shape.to_hf_config())
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            raise UserError(f"checkpoint {path} holds another model: its {key} is {saved.get(key)!r}, this run's "
                            f"{now.get(key)!r} (policy.model_name / policy.jet_rl.model_preset); set "
                            "checkpointing.checkpoint_dir elsewhere to start this model fresh")
    saved, now = meta.get("jet_rl", {}), _as_json(trainer.recipe.to_dict())
    for key in CONTRACT_KEYS:
        if saved.get(key) != now.get(key):
            raise UserError(f"checkpoint {path} was trained under another precision recipe: {key} "
                            f"{saved.get(key)!r} there, {now.get(key)!r} here (the arm: --arm, or NeMo-RL's "
                            "policy.megatron_cfg.fp8_cfg / policy.generation.vllm_cfg.precision; the block and scale "
                            "keys: policy.jet_rl); resume it under the same one, or set checkpointing.checkpoint_dir "
                            "elsewhere")


def load_checkpoint(path: Path, trainer: Trainer, stream: PromptStream) -> Resumed:
    """Load ``path`` into ``trainer`` and ``stream`` after checking that it fits this run (layout, model, arm,
    optimizer kind and DP size; nothing is loaded when it does not)."""
    from jetrl_megatron.megatron.model import fp8_context, refresh_fp8_cache

    meta = read_meta(path)
    if meta["world_size"] != dist_world():
        raise UserError(f"checkpoint {path} was written by {meta['world_size']} ranks, this run has {dist_world()}; "
                        "resume it with the same process count, or set checkpointing.checkpoint_dir elsewhere")
    state = read_rank_file(path / f"rank_{dist_rank()}.pt")  # weights_only=True: a foreign file cannot run code
    check_compatible(path, meta, trainer)
    try:
        trainer.optimizer.check_checkpoint_state(state["optimizer"])
    except ValueError as e:
        raise UserError(f"checkpoint {path}: {e}") from None
    trainer.gpt.load_state_dict(state["model"], strict=True)
    for p in trainer.gpt.parameters():
        torch.autograd.graph.increment_version(p)
    trainer.optimizer.load_checkpoint_state(state["optimizer"])
    refresh_fp8_cache(trainer.model)
    if "fp8_generation" in state:  # checkpoints before 2026-12-05 lack it: the count restarts there
        fp8_context(trainer.gpt).cache.continue_count(int(state["fp8_generation"]))
    stream.load_state(state["stream"])
    return Resumed(int(state["step"]), state.get("reference"), state["rng"])
