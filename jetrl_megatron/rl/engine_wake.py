"""Waking the colocated rollout engine after the trainer's phase, with a message a user can act on when the GPU
cannot give vLLM its memory back.

Why: the engine's wake-up is where a colocated run that planned too tightly fails, and vLLM's own message there
(``CUDA Error: out of memory at .../cumem_allocator.cpp:163`` and a 20-frame traceback) names neither what holds the
memory nor which key to change. The first 8B step on an 80 GB H100 (2026-12-05) failed exactly there, at step 2: after
the first update the trainer holds state the first rollout did not see (the GPU part of the Adam state), so a run can
pass step 1 and stop at step 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from jetrl_megatron.errors import UserError, one_line
from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.phase_memory import cache_breakdown, device_segments

__all__ = ["EngineWakeOutOfMemory", "TrainerPool", "trainer_pool", "wake_engine"]

GiB = float(1 << 30)


class EngineWakeOutOfMemory(UserError):
    """The rollout engine could not take its weights and KV cache back after the trainer's phase."""


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _gpu_free_total() -> tuple[float, float] | None:
    if not torch.cuda.is_available():
        return None
    try:
        free, total = torch.cuda.mem_get_info()
    except Exception:  # noqa: BLE001 - a diagnostic inside an error message must not replace the error
        return None
    return free / GiB, total / GiB


@dataclass(frozen=True)
class TrainerPool:
    """GiB in torch's default pool (the trainer's: vLLM's sleep-mode pool and CUDA-graph pools are private pools):
    its tensors, and its cached blocks, ``returnable`` of them by ``torch.cuda.empty_cache``. An in-process engine's
    own buffers outside its pools (a sampler's, an activation scratch) count here too."""

    tensors: float
    cached: float
    returnable: float


def trainer_pool() -> TrainerPool | None:
    """The default pool's split now; None without CUDA or when the allocator snapshot fails. torch's counts of the
    private pools do not move when vLLM maps or unmaps its sleeping pool, so this read after a failed wake-up is the
    trainer's share before it."""
    if not torch.cuda.is_available():
        return None
    try:
        parts = cache_breakdown(device_segments(torch.cuda.current_device()))
        tensors = torch.cuda.memory_allocated() / GiB - parts["private_pools_allocated"]
    except Exception:  # noqa: BLE001 - a diagnostic inside an error message must not replace the error
        return None
    return TrainerPool(tensors, parts["cache_returnable"] + parts["cache_fragmented"], parts["cache_returnable"])


def _memory_picture(gpu: tuple[float, float] | None, pool: TrainerPool | None) -> str:
    """``gpu``: (free, total) GiB read just before the wake-up."""
    if gpu is None:
        return ""
    out = f"; before waking the GPU had {gpu[0]:.1f} of {gpu[1]:.1f} GiB free"
    if pool is not None:
        outside = gpu[1] - gpu[0] - pool.tensors - pool.cached
        out += (f": the trainer's tensors {pool.tensors:.1f} GiB, torch's cache {pool.cached:.1f} GiB "
                f"({pool.returnable:.1f} of it returnable), {max(outside, 0.0):.1f} GiB outside torch's default pool "
                "(the CUDA context, CUDA-graph pools, NCCL)")
        if pool.cached - pool.returnable >= 1.0:  # free bytes that live tensors keep: say how to find which
            out += (f"; {pool.cached - pool.returnable:.1f} GiB of that cache is pinned by live tensors "
                    "(policy.jet_rl.record_memory_history=true writes which ones to <log_dir>/memory_pins.txt)")
    return out


def wake_message(cfg: RunConfig, cause: BaseException, gpu: tuple[float, float] | None,
                 pool: TrainerPool | None) -> str:
    """One line: what was asked, what the GPU had, which keys lower the engine's share or the trainer's."""
    kv = cfg.kv_cache_memory_bytes()
    budget = (f"its KV cache (policy.generation.vllm_kwargs.kv_cache_memory_bytes = {kv / GiB:.1f} GiB)" if kv
              else "its KV cache (policy.generation.vllm_cfg.gpu_memory_utilization = "
                   f"{cfg.policy.generation.vllm_cfg.gpu_memory_utilization})")
    have = _memory_picture(gpu, pool)
    offload = cfg.policy.megatron_cfg.optimizer
    lever = ("raise policy.megatron_cfg.optimizer.optimizer_offload_fraction (now "
             f"{offload.optimizer_offload_fraction})" if offload.optimizer_cpu_offload
             else "turn on policy.megatron_cfg.optimizer.optimizer_cpu_offload")
    return one_line(
        f"the rollout engine could not wake up after the trainer's phase: out of GPU memory taking back its weights "
        f"and {budget}{have}. Lower the KV cache (the rollout then runs in waves, still exact), {lever}, or lower "
        f"policy.train_micro_batch_size; `jetrl plan` prints each phase's estimate for this config (vLLM: "
        f"{one_line(cause, 120)})", limit=1100)


def wake_engine(wake: Callable[[], object], cfg: RunConfig,
                pool: Callable[[], TrainerPool | None] = trainer_pool) -> None:
    """``wake()``, with an out-of-memory failure turned into :class:`EngineWakeOutOfMemory` (other errors pass). The
    free memory is read before the wake-up (one driver query): after a failed one the engine holds part of it."""
    before = _gpu_free_total()
    try:
        wake()
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        if not _is_out_of_memory(exc):
            raise
        raise EngineWakeOutOfMemory(wake_message(cfg, exc, before, pool())) from exc
