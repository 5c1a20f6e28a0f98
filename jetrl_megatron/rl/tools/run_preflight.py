"""Checks `jetrl run` makes before it creates anything: the launcher's process count and where the weights come from.

Why before the run: a wrong launcher or a mistyped model path used to surface 20 s later, as a multi-line traceback
from deep inside Megatron or the Hugging Face client, after the log directory had been created. Here they are one
actionable line (``jetrl run: ...``, exit 2) and nothing is written.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.config import RunConfig


def launch_command(cfg: RunConfig, recipe: str, overrides: list[str], nproc: int) -> str:
    """The command that starts this run with ``nproc`` processes on one node (torchrun), or the SLURM route."""
    if cfg.is_gpu and cfg.cluster.num_nodes > 1:
        return shlex.join(["jetrl", "sbatch", "--recipe", recipe, *overrides])
    return shlex.join(["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "jetrl_megatron.cli", "run",
                       "--recipe", recipe, *overrides])


def check_launch(cfg: RunConfig, recipe: str, overrides: list[str], world: int | None = None) -> None:
    """The process count (torchrun's WORLD_SIZE, 1 without torchrun) must fit trainer TP x PP and rollout TP."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    mc = cfg.policy.megatron_cfg
    tp, pp, rtp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size, \
        cfg.policy.generation.vllm_cfg.tensor_parallel_size
    need = cfg.min_processes
    if world % need == 0:
        return
    nproc = cfg.cluster.gpus_per_node if cfg.is_gpu and cfg.cluster.gpus_per_node % need == 0 else need
    what = (f"policy.megatron_cfg.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp}"
            + (f" and policy.generation.vllm_cfg.tensor_parallel_size={rtp}" if rtp > 1 else ""))
    have = "a single process (no torchrun)" if world == 1 else f"{world} processes"
    raise UserError(f"{what} need a multiple of {need} processes, this is {have}; start it with: "
                    f"{launch_command(cfg, recipe, overrides, nproc)}")


def _looks_like_path(name: str) -> bool:
    """A filesystem path rather than a hub id ("org/name") or a preset name."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name))


def check_model_source(cfg: RunConfig) -> None:
    """``policy.model_name`` must be a local model directory, a valid hub id, or the preset (random init)."""
    name, preset = cfg.policy.model_name, cfg.model_preset
    hint = (f"a local Hugging Face checkpoint directory, a hub id such as Qwen/Qwen3-8B, or policy.jet_rl.model_preset "
            f"({preset!r}) for a random init")
    if name == preset:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"policy.model_name: {name} has no config.json; expected {hint}")
        return
    if path.exists() or _looks_like_path(name):
        raise UserError(f"policy.model_name: {name} is not a directory; expected {hint}")
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise UserError(f"policy.model_name: {name!r} is neither a directory nor a valid hub id; expected {hint}") \
            from None


def check_run(cfg: RunConfig, recipe: str, overrides: list[str]) -> None:
    """Every check that needs no model, process group or engine; raises :class:`UserError`."""
    check_launch(cfg, recipe, overrides)
    check_model_source(cfg)
