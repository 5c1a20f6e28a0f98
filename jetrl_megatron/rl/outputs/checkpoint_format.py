"""The on-disk format of `jetrl run` checkpoints, its checks, and reading one back for resume or HF export.

A checkpoint is ``<checkpointing.checkpoint_dir>/step_N/`` with one ``rank_<r>.pt`` per global rank (Megatron model
state dict, optimizer state, RNG states, prompt-stream position, step), ``meta.json`` (step, world size, the parallel
coordinates of every rank, the model's HF config, the ``jet_rl`` recipe, each rank file's size), ``metrics.json``
(the step's metrics under NeMo-RL's ``train:<x>`` / ``val:<x>`` names, for keeping the best ``keep_top_k``) and
``COMPLETE``.

Why tensors and plain Python values only: every rank file loads with ``torch.load(..., weights_only=True)``, so a
checkpoint directory copied from elsewhere cannot run code when it is resumed or exported. The RNG states that
Python and NumPy hand out as tuples / ndarrays are stored as tensors and ints for that reason.
Why meta.json records sizes and coordinates: a truncated rank file is found without unpickling it (the resume then
falls back to the previous complete checkpoint), and `jetrl export` can map rank files to (PP, TP) shards.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetrl_megatron.errors import UserError, one_line
from jetrl_megatron.fp8 import quant_dispatch
from jetrl_megatron.model.layout import pp_layer_range
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard.mover import MegatronShards

FORMAT = 2
_FP8_LINEAR = re.compile(
    r"decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\.linear_proj|mlp\.linear_fc1|mlp\.linear_fc2)"
    r"\.weight")


# ------------------------------------------------------------------------------------------------ RNG states


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU) RNG states as tensors and ints (loadable with weights_only=True)."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])


# ------------------------------------------------------------------------------------------------ writing


def rank_coords() -> tuple[int, int, int]:
    """This rank's (pp_rank, tp_rank, dp_rank) in Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    return (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank())


def gather_coords() -> list[tuple[int, int, int]]:
    """Every global rank's (pp_rank, tp_rank, dp_rank), indexed by global rank (collective when distributed)."""
    mine = rank_coords()
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [mine]
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, mine)
    return [tuple(c) for c in out]


def make_meta(step: int, recipe_name: str, shape, fp8_recipe, coords: list[tuple[int, int, int]],
              ckpt_dir: Path) -> dict[str, Any]:
    """meta.json's contents for the rank files already written into ``ckpt_dir``."""
    from megatron.core import parallel_state as ps

    return {
        "format": FORMAT, "step": step, "world_size": len(coords), "recipe": recipe_name,
        "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
        "ranks": [list(c) for c in coords],
        "model": {"name": shape.name, "hf_config": shape.to_hf_config()},
        "jet_rl": fp8_recipe.to_dict(),
        "files": {f"rank_{r}.pt": (ckpt_dir / f"rank_{r}.pt").stat().st_size for r in range(len(coords))},
    }


# ------------------------------------------------------------------------------------------------ reading


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: meta.json is missing or unreadable ({one_line(e)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int):
        raise UserError(f"{path}: meta.json has no world_size; not a `jetrl run` checkpoint")
    return meta


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed (None when it looks whole), found without unpickling:
    meta.json readable, every rank file present, of the recorded size, with a readable zip directory."""
    try:
        meta = read_meta(path)
    except UserError as e:
        return str(e)
    sizes = meta.get("files") or {}
    for r in range(meta["world_size"]):
        f = path / f"rank_{r}.pt"
        if not f.is_file():
            return f"{f.name} is missing"
        size, want = f.stat().st_size, sizes.get(f.name)
        if want is not None and size != want:
            return f"{f.name} is {size} bytes, meta.json records {want} (truncated or overwritten)"
        try:
            with zipfile.ZipFile(f):
                pass
        except (zipfile.BadZipFile, OSError) as e:
            return f"{f.name} is not a complete torch file ({one_line(e)})"
    return None


def complete_checkpoints(root: Path) -> list[Path]:
    """``step_N`` directories marked COMPLETE, oldest first."""
    if not root.exists():
        return []
    done = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / "COMPLETE").exists()]
    return sorted(done, key=lambda p: int(p.name[5:]))


def latest_usable(root: Path, warn: Callable[[str], None]) -> Path | None:
    """The newest complete checkpoint that passes :func:`checkpoint_problem`; each newer broken one is reported
    through ``warn`` and skipped. None when there is no complete checkpoint; an error when none is usable."""
    done = complete_checkpoints(root)
    problems = []
    for p in reversed(done):
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        problems.append(f"{p.name}: {problem}")
        warn(f"checkpoint {p} is unusable ({problem}); trying the previous complete checkpoint")
    if done:
        raise UserError(f"checkpointing.checkpoint_dir {root}: none of the {len(done)} complete checkpoint(s) can be "
                        f"resumed ({'; '.join(problems)}); remove them or set checkpointing.checkpoint_dir to a new "
                        "directory")
    return None


# ------------------------------------------------------------------------------------------------ keep_top_k


# NeMo-RL name -> this project's key in the step's metrics (metrics.jsonl / the dict passed to RunLogger.log).
# train:reward             NeMo-RL GRPO's own train "reward": the batch's mean reward (grpo.py, np.mean)
# train:total_reward/mean  NeMo-Gym's rollout metric: the same batch mean of total_reward
# train:loss               summed over the step's optimizer updates in both projects
# val:accuracy             held-out fraction correct of the sampled answers (val/accuracy_sampled), as NeMo-RL's
#                          validate() samples (greedy=False); the greedy accuracy (val/accuracy) has no NeMo-RL name
# val:total_reward/mean    held-out mean reward of the sampled answers (val/reward_sampled)
NEMO_RL_METRIC_SOURCES: dict[str, str] = {
    "train:reward": "reward/mean",
    "train:total_reward/mean": "reward/mean",
    "train:loss": "train/loss",
    "val:accuracy": "val/accuracy_sampled",
    "val:total_reward/mean": "val/reward_sampled",
}
NEMO_RL_CHECKPOINT_METRICS: tuple[str, ...] = tuple(NEMO_RL_METRIC_SOURCES)
CHECKPOINT_METRICS_FILE = "metrics.json"


def _finite(v: Any) -> float | None:
    """``v`` as a float, or None when it is not a finite number (NaN has no rank order and JSON has no NaN/Inf)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def nemo_rl_metric_names(train_metrics: dict[str, Any], val_metrics: dict[str, Any] | None) -> dict[str, float]:
    """The step's metrics under NeMo-RL's checkpoint metric names (see :data:`NEMO_RL_METRIC_SOURCES`).

    ``train:*`` names come from ``train_metrics``; ``val:*`` names from ``val_metrics`` (what ``validate`` returned
    this step), or, when that is None, from the ``val/*`` keys of ``train_metrics`` (the loop merges validation into
    the step's dict). A step without validation therefore has no ``val:*`` name, as in NeMo-RL. Absent and
    non-finite values are left out: such a checkpoint ranks as missing the metric."""
    out: dict[str, float] = {}
    for name, key in NEMO_RL_METRIC_SOURCES.items():
        src = train_metrics if name.startswith("train:") or val_metrics is None else val_metrics
        v = _finite(src.get(key))
        if v is not None:
            out[name] = v
    return out


def write_checkpoint_metrics(ckpt_dir: Path, metrics: dict[str, float]) -> None:
    """Write ``metrics`` (NeMo-RL names -> values) to ``<ckpt_dir>/metrics.json`` atomically (temp file + rename),
    so a crash never leaves a half file that would rank the checkpoint as missing its metric."""
    clean = {str(k): f for k, v in metrics.items() if (f := _finite(v)) is not None}
    path = Path(ckpt_dir) / CHECKPOINT_METRICS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean, sort_keys=True))
    os.replace(tmp, path)


def read_checkpoint_metrics(ckpt_dir: Path) -> dict[str, float]:
    """``metrics.json`` of a checkpoint; {} when absent or unreadable (e.g. written before this file existed)."""
    try:
        raw = json.loads((Path(ckpt_dir) / CHECKPOINT_METRICS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {k: f for k, v in raw.items() if (f := _finite(v)) is not None}


def _rank_key(step: int, value: float | None, higher_is_better: bool) -> tuple[float, int]:
    """Ascending sort key, best first: better value, then newer step; a missing value ranks after every value."""
    if value is None:
        return (math.inf, -step)
    return (-value if higher_is_better else value, -step)


def checkpoints_to_remove(root: Path, keep_top_k: int | None, metric_name: str | None,
                          higher_is_better: bool) -> list[Path]:
    """The complete ``step_N`` checkpoints under ``root`` outside the best ``keep_top_k``, oldest first.

    NeMo-RL's ``CheckpointManager.remove_old_checkpoints`` semantics:
    - ``keep_top_k`` None keeps everything.
    - ``metric_name`` None ranks by step: the newest k are kept.
    - Otherwise by ``metrics.json[metric_name]`` (best first by ``higher_is_better``); equal values prefer the newer
      step. A checkpoint missing the metric (a ``val:*`` metric on a step without validation, or no metrics.json)
      counts as -inf when higher is better and +inf when lower is better: it ranks after every checkpoint that has
      it, newer first among themselves, and is removed once k checkpoints rank above it.
    - The newest checkpoint is never removed, even outside the top k (so k+1 may remain).
    Only directories marked COMPLETE take part (NeMo-RL: those with training_info.json); others are left alone."""
    if keep_top_k is None:
        return []
    if keep_top_k < 0:
        raise ValueError(f"keep_top_k must be >= 0 or None, got {keep_top_k}")
    done = complete_checkpoints(root)
    if not done:
        return []
    step = {p: int(p.name[5:]) for p in done}
    if metric_name is None:
        ranked = sorted(done, key=lambda p: -step[p])
    else:
        value = {p: read_checkpoint_metrics(p).get(metric_name) for p in done}
        ranked = sorted(done, key=lambda p: _rank_key(step[p], value[p], higher_is_better))
    newest = done[-1]
    return sorted((p for p in ranked[keep_top_k:] if p != newest), key=lambda p: step[p])


def _unpickling_reason(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    detail = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else type(e).__name__)
    return one_line(detail, limit=200)


def read_rank_file(path: Path, *, map_location: Any = None, mmap: bool = False) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``: tensors and plain values only; anything else is refused unrun."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UserError(f"{path}: refused to load it: it holds objects other than tensors and plain values "
                        f"({_unpickling_reason(e)}), so it was not written by this version of `jetrl run` and "
                        "unpickling it could run code") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise UserError(f"{path}: cannot be read ({one_line(e, limit=200)})") from None
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path}: not a `jetrl run` rank file (no 'model' entry)")
    return state


# ------------------------------------------------------------------------------------------------ export


def is_run_checkpoint(path: Path) -> bool:
    """A directory written by `jetrl run` (meta.json + rank_<r>.pt), as opposed to tp<T>_pp<P>.pt shard files."""
    return (path / "meta.json").is_file() and any(path.glob("rank_*.pt"))


def rollout_state(model: dict[str, Any], shape, recipe, pp: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """One rank's Megatron state dict as the resharder's input: the recipe's FP8 linears quantized 128x128 (the
    trainer's own weight quantizer, so the bytes equal its FP8 cache) with '<name>_scale_inv', the rest as saved."""
    offset = pp_layer_range(shape.num_layers, pp, pp_rank).start
    out: dict[str, torch.Tensor] = {}
    for name, t in model.items():
        if not isinstance(t, torch.Tensor):
            continue  # Megatron's _extra_state entries (None)
        m = _FP8_LINEAR.fullmatch(name)
        if m and recipe.rollout_fp8:
            layer = offset + int(m.group(1))
            if recipe.module_is_fp8(f"decoder.layers.{layer}.{m.group(2)}.weight", layer, shape.num_layers):
                with torch.no_grad():
                    out[name], out[name + "_scale_inv"] = quant_dispatch.quant_weight(t, recipe)
                continue
        out[name] = t
    return out


def load_run_checkpoint(path: Path, recipe_changes: dict[str, Any] | None = None):
    """(MegatronShards, ModelShape, Fp8Recipe) of a run checkpoint at any TP x PP (DP replica 0's rank files).

    The recipe is the run's ``jet_rl`` section with ``recipe_changes`` applied (e.g. another mode)."""
    meta = read_meta(path)
    if meta.get("format") != FORMAT or "ranks" not in meta or "model" not in meta:
        raise UserError(f"{path}: meta.json has no parallel layout / model config (format {meta.get('format', 1)}; "
                        f"this version reads format {FORMAT}): save the checkpoint again with this version of "
                        "`jetrl run`")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise UserError(f"{path}: {problem}")
    shape = ModelShape.from_hf_config(meta["model"]["hf_config"], name=meta["model"]["name"])
    recipe = Fp8Recipe.from_dict({**meta["jet_rl"], **(recipe_changes or {})})
    tp, pp = int(meta["tp"]), int(meta["pp"])
    states = {}
    for rank, (pp_rank, tp_rank, dp_rank) in enumerate(meta["ranks"]):
        if dp_rank == 0:
            model = read_rank_file(path / f"rank_{rank}.pt", map_location="cpu", mmap=True)["model"]
            states[(pp_rank, 0, tp_rank)] = rollout_state(model, shape, recipe, pp, pp_rank)
    return MegatronShards(shape, tp, pp, None, states), shape, recipe
