"""Saving and resuming a run: atomic per-rank checkpoints, the best-k rule, and finding the newest usable one.
The file format and its pure helpers are in ``rl/outputs/checkpoint_format.py``."""

from __future__ import annotations

import json
import os
import shutil
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
    set_rng_state,
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


def load_checkpoint(path: Path, trainer: Trainer, stream: PromptStream) -> int:
    from jetrl_megatron.megatron.model import refresh_fp8_cache

    meta = read_meta(path)
    if meta["world_size"] != dist_world():
        raise UserError(f"checkpoint {path} was written by {meta['world_size']} ranks, this run has {dist_world()}; "
                        "resume it with the same process count, or set checkpointing.checkpoint_dir elsewhere")
    state = read_rank_file(path / f"rank_{dist_rank()}.pt")  # weights_only=True: a foreign file cannot run code
    trainer.gpt.load_state_dict(state["model"], strict=True)
    for p in trainer.gpt.parameters():
        torch.autograd.graph.increment_version(p)
    trainer.optimizer.load_checkpoint_state(state["optimizer"])
    refresh_fp8_cache(trainer.model)
    set_rng_state(state["rng"])
    stream.load_state(state["stream"])
    return int(state["step"])
