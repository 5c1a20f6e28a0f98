"""Peak GPU and host memory of each GRPO phase (rollout, logprobs, update, refit), as `jetrl plan` estimates them.

Why not `torch.cuda.max_memory_allocated` alone: the colocated vLLM engine's weights and KV cache live in its own
sleep-mode pool, and the CUDA context, cuBLAS workspaces and NCCL buffers are outside any allocator. The device's own
count (total - free, `torch.cuda.mem_get_info`) sees all of it but only at the instants it is read, while the torch
caching allocator's peak (`max_memory_reserved`) sees the trainer's transient peaks between them. A phase's peak is
taken as the larger of the device count at its start and end and (device - torch reserved at the start) + torch's
reserved peak during the phase: exact when memory outside torch's allocator does not change inside the phase.
Host memory: this process's resident set now and its high-water mark (Linux /proc; NaN elsewhere).

The caching allocator's own calls in a phase are counted too (``ALLOCATOR_COUNTS``): each ``cudaFree`` waits for the
whole device, so a phase near the memory limit, where torch frees cached blocks to fit new ones, runs slower than its
kernels say (the jetrl update at 8B / 4K tokens on an 80 GB card peaked at 73 of 79 GiB, 2026-12-06).

What torch holds beyond its tensors at a phase's end is split by whether ``torch.cuda.empty_cache`` could return it
(:func:`cache_breakdown`): wholly free segments of torch's default pool (returnable), free blocks inside default-pool
segments that still hold a tensor (fragmented: only freeing that tensor returns them), and free blocks of private
pools (vLLM's sleep-mode pool, CUDA-graph pools: never returned while the pool lives). Why: at Qwen3-8B the bf16 arm's
rollout phase held 15.7 GiB of torch cache right after a cache release (2026-12-05), which only one of these explains.
"""

from __future__ import annotations

import math
import resource
import sys
import warnings
from pathlib import Path

import torch

GIB = float(1 << 30)
# torch.cuda.memory_stats() counters -> metric name: cudaMalloc and cudaFree calls of torch's allocator, and the
# allocations it retried after freeing its cache
ALLOCATOR_COUNTS = {"num_device_alloc": "cuda_mallocs", "num_device_free": "cuda_frees",
                    "num_alloc_retries": "alloc_retries"}


def host_rss_gib() -> float:
    """This process's resident set size now, GiB (NaN where /proc is absent)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return math.nan
    return pages * resource.getpagesize() / GIB


def host_available_bytes() -> int | None:
    """Host memory available to a new allocation now (psutil's ``available``: free plus reclaimable), or None where
    psutil cannot tell."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError, RuntimeError):
        return None


def host_peak_gib() -> float:
    """This process's resident-set high-water mark, GiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (GIB if sys.platform == "darwin" else GIB / 1024)


def device_segments(index: int) -> list[dict]:
    """``torch.cuda.memory_snapshot()``'s segments of device ``index`` (the snapshot covers every device)."""
    return [seg for seg in torch.cuda.memory_snapshot() if seg.get("device", index) == index]


def in_default_pool(segment: dict) -> bool:
    """A snapshot segment of torch's default pool (pool id (0, 0)), not a private pool (vLLM's, a CUDA graph's)."""
    return tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)


def cache_breakdown(segments: list[dict]) -> dict[str, float]:
    """GiB of torch-reserved, unallocated memory by what could return it, from ``torch.cuda.memory_snapshot()``'s
    segments (each: ``total_size``, ``allocated_size``, ``segment_pool_id``; pool (0, 0) is torch's default pool):
    ``cache_returnable`` (default-pool segments with no tensor), ``cache_fragmented`` (free bytes of default-pool
    segments that hold one), ``cache_private_pools`` (free bytes of other pools), and ``private_pools_allocated``
    (tensors in other pools: a colocated engine's weights and KV cache, graph-captured buffers)."""
    out = dict.fromkeys(("cache_returnable", "cache_fragmented", "cache_private_pools", "private_pools_allocated"),
                        0.0)
    for seg in segments:
        free = seg["total_size"] - seg["allocated_size"]
        if not in_default_pool(seg):
            out["cache_private_pools"] += free
            out["private_pools_allocated"] += seg["allocated_size"]
        elif seg["allocated_size"] == 0:
            out["cache_returnable"] += free
        else:
            out["cache_fragmented"] += free
    return {k: v / GIB for k, v in out.items()}


class PhaseMemory:
    """Records, per named phase, the peak GPU memory of the whole device and the host memory at its end.

    Usage: ``meter.begin()`` before a phase, ``meter.end("rollout")`` after it; ``meter.metrics()`` gives
    ``memory/gpu_peak_gib_<phase>``, ``memory/host_rss_gib`` and ``memory/host_peak_gib``, and the peak's parts:
    ``memory/gpu_torch_allocated_gib_<phase>`` (the trainer's tensors at their peak), ``..._torch_cached_gib_<phase>``
    (reserved by torch's caching allocator beyond that) and ``..._outside_torch_gib_<phase>`` (the rest of the
    device: vLLM's own pool, CUDA contexts), which is what an estimate such as ``jetrl plan`` is checked against;
    and, at the phase's end, where torch's cache sits (:func:`cache_breakdown`: ``memory/gpu_cache_returnable_gib_
    <phase>`` and the others), and the allocator's calls in the phase (``memory/gpu_cuda_mallocs_<phase>``,
    ``..._cuda_frees_<phase>``, ``..._alloc_retries_<phase>``). On a CPU-only machine the GPU entries are absent
    (there is no device to read)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = torch.cuda.is_available() and (device is None or device.type == "cuda")
        self.device = device if device is not None else (torch.device("cuda") if self.cuda else torch.device("cpu"))
        self._outside_torch = 0
        self._used_at_begin = 0
        self.peaks: dict[str, float] = {}
        self.parts: dict[str, dict[str, float]] = {}
        self.counts: dict[str, dict[str, int]] = {}  # per phase, ALLOCATOR_COUNTS summed over its runs
        self._counts_at_begin: dict[str, int] = {}

    def _allocator_counts(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.device)
        return {name: int(stats.get(key, 0)) for key, name in ALLOCATOR_COUNTS.items()}

    def _device_used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _segments(self) -> list[dict]:
        """This device's allocator segments; none (no breakdown) where the snapshot fails: a diagnostic must not
        stop a run."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        try:
            return device_segments(index)
        except Exception as e:  # noqa: BLE001 - any allocator or binding failure
            warnings.warn(f"phase memory: no cache breakdown ({type(e).__name__}: {e})", stacklevel=2)
            return []

    def begin(self) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        self._used_at_begin = self._device_used()
        self._outside_torch = self._used_at_begin - torch.cuda.memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._counts_at_begin = self._allocator_counts()

    def end(self, phase: str) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        peak = max(self._used_at_begin, self._device_used(), self._outside_torch + reserved)
        if peak / GIB >= self.peaks.get(phase, 0.0):
            allocated = torch.cuda.max_memory_allocated(self.device)
            self.parts[phase] = {"torch_allocated": allocated / GIB, "torch_cached": (reserved - allocated) / GIB,
                                 "outside_torch": max(peak - reserved, 0) / GIB,
                                 **cache_breakdown(self._segments())}
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak / GIB)
        counts = self.counts.setdefault(phase, dict.fromkeys(ALLOCATOR_COUNTS.values(), 0))
        for name, value in self._allocator_counts().items():
            counts[name] += value - self._counts_at_begin.get(name, value)

    def metrics(self) -> dict[str, float]:
        out = {f"memory/gpu_peak_gib_{phase}": value for phase, value in self.peaks.items()}
        for phase, parts in self.parts.items():
            out.update({f"memory/gpu_{part}_gib_{phase}": value for part, value in parts.items()})
        for phase, counts in self.counts.items():
            out.update({f"memory/gpu_{name}_{phase}": float(value) for name, value in counts.items()})
        out["memory/host_rss_gib"] = host_rss_gib()
        out["memory/host_peak_gib"] = host_peak_gib()
        return out
