"""Per-phase memory meter (rl/phase_memory.py): host readings follow a real allocation; on CUDA a transient
allocation freed before the phase ends still shows in that phase's peak, and not in the next phase's."""

from __future__ import annotations

import math
import mmap
import os

import pytest
import torch

from jetrl_megatron.rl.phase_memory import PhaseMemory, host_peak_gib, host_rss_gib


def test_host_memory_follows_an_allocation():
    before = host_rss_gib()
    if math.isnan(before):
        pytest.skip("no /proc/self/statm on this platform")
    # fresh anonymous pages, every one written: a torch or malloc allocation may be served from memory the process
    # already holds (an allocator's cache after an earlier test), and then the RSS rightly does not grow
    block = mmap.mmap(-1, 384 << 20)
    block.write(b"\x01" * (384 << 20))
    grown = host_rss_gib() - before
    assert 0.3 < grown < 0.6, grown
    assert host_peak_gib() >= host_rss_gib() - 1e-3
    block.close()
    assert host_rss_gib() - before < 0.2


def test_cpu_meter_reports_host_only():
    meter = PhaseMemory(torch.device("cpu"))
    meter.begin()
    meter.end("rollout")
    m = meter.metrics()
    assert not any(k.startswith("memory/gpu_peak") for k in m)
    assert m["memory/host_rss_gib"] > 0 and m["memory/host_peak_gib"] >= m["memory/host_rss_gib"] - 1e-3


@pytest.mark.gpu
def test_gpu_phase_peak_sees_a_freed_transient():
    meter = PhaseMemory(torch.device("cuda"))
    # blocks an earlier test left in torch's cache would serve the 2 GiB without the device count moving (the meter
    # is right to see no new device memory then): start from an empty cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    meter.begin()
    used0 = (total - free) / 2**30
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # 2 GiB
    x.fill_(1)
    del x
    torch.cuda.empty_cache()
    meter.end("update")
    meter.begin()
    meter.end("refit")
    m = meter.metrics()
    assert m["memory/gpu_peak_gib_update"] >= used0 + 1.99, (m, used0)
    assert m["memory/gpu_peak_gib_refit"] < m["memory/gpu_peak_gib_update"] - 1.9, m
    # the peak's parts: the 2 GiB tensor is the trainer's (torch-allocated), and it is gone by the next phase
    assert m["memory/gpu_torch_allocated_gib_update"] >= 2.0 - 1e-6, m
    assert m["memory/gpu_torch_allocated_gib_refit"] < m["memory/gpu_torch_allocated_gib_update"] - 1.99, m
    for phase in ("update", "refit"):
        parts = sum(m[f"memory/gpu_{p}_gib_{phase}"] for p in ("torch_allocated", "torch_cached", "outside_torch"))
        assert parts <= m[f"memory/gpu_peak_gib_{phase}"] + 1e-6, (phase, m)


class _Engine:
    """Records the loop's calls to the colocated engine (sleep/wake), in order with the cache releases."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def sleep(self, level: int) -> bool:
        self.calls.append(f"sleep{level}")
        return True

    def wake_up(self) -> None:
        self.calls.append("wake_up")


def _train_phase(calls: list[str], colocated: bool = True, sleep_level: int = 1):
    from types import SimpleNamespace

    from jetrl_megatron.rl.loop import TrainPhase

    cfg = SimpleNamespace(policy=SimpleNamespace(generation=SimpleNamespace(colocated=SimpleNamespace(
        enabled=colocated)), jet_rl=SimpleNamespace(engine_sleep_level=sleep_level, record_memory_history=False)))
    ro = SimpleNamespace(engine=_Engine(calls), release_grads=False)
    return TrainPhase(cfg, SimpleNamespace(model=None), ro)


def test_the_update_returns_its_cached_blocks_before_the_engine_wakes(monkeypatch):
    """The order the 8B round asked for: the engine's transients go back when it sleeps, the update's before it
    wakes for the refit (a refit phase that began holding them counted 22.5 GiB of cache on 2026-12-05)."""
    from jetrl_megatron.rl import loop

    calls: list[str] = []
    monkeypatch.setattr(loop, "release_cached_gpu_memory", lambda: calls.append("release"))
    with _train_phase(calls) as phase:
        calls.append("logprob")
        with phase.grad_buffers_held():
            calls.append("update")
        phase.wake_up()
    assert calls == ["sleep1", "release", "logprob", "update", "release", "wake_up"], calls
    calls.clear()  # not colocated: no engine sleeps or wakes, the update keeps its cache for the next step
    with _train_phase(calls, colocated=False) as phase:
        with phase.grad_buffers_held():
            calls.append("update")
    assert calls == ["release", "update"], calls
    calls.clear()  # policy.jet_rl.engine_sleep_level reaches the engine
    with _train_phase(calls, sleep_level=2):
        pass
    assert calls[0] == "sleep2", calls


@pytest.mark.gpu
def test_the_refit_phase_does_not_hold_the_updates_freed_blocks():
    """A 2 GiB transient of the update, freed (cached by torch), is not in the refit phase's peak or its cache."""
    meter = PhaseMemory(torch.device("cuda"))
    torch.cuda.empty_cache()
    with _train_phase([]) as phase:
        meter.begin()
        with phase.grad_buffers_held():
            x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
            x.fill_(1)
            del x
        meter.end("update")
        meter.begin()
        phase.wake_up()
        meter.end("refit")
    m = meter.metrics()
    assert m["memory/gpu_torch_cached_gib_refit"] < 0.1, m
    assert m["memory/gpu_peak_gib_refit"] < m["memory/gpu_peak_gib_update"] - 1.9, m


def test_cache_breakdown_sorts_free_bytes_by_what_could_return_them():
    from jetrl_megatron.rl.phase_memory import GIB, cache_breakdown

    mib = 1 << 20
    segments = [
        {"total_size": 64 * mib, "allocated_size": 0, "segment_pool_id": (0, 0)},      # wholly free
        {"total_size": 64 * mib, "allocated_size": 16 * mib, "segment_pool_id": (0, 0)},  # holds a tensor
        {"total_size": 2 * mib, "allocated_size": 0},                                   # no pool id: default
        {"total_size": 96 * mib, "allocated_size": 32 * mib, "segment_pool_id": (1, 7)},  # a private pool
    ]
    got = {k: v * GIB / mib for k, v in cache_breakdown(segments).items()}
    assert got == {"cache_returnable": 66, "cache_fragmented": 48, "cache_private_pools": 64,
                   "private_pools_allocated": 32}, got


@pytest.mark.gpu
def test_gpu_cache_breakdown_of_real_allocations():
    """A segment re-used by a smaller tensor leaves fragmented bytes; a private pool's freed tensor stays in the pool
    after empty_cache; the meter reports both at the phase's end."""
    torch.cuda.empty_cache()
    mib = 1 << 20
    meter = PhaseMemory(torch.device("cuda"))
    meter.begin()
    big = torch.empty(64 * mib, dtype=torch.uint8, device="cuda")
    del big
    small = torch.empty(16 * mib, dtype=torch.uint8, device="cuda")  # split out of the cached 64 MiB segment
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        private = torch.empty(32 * mib, dtype=torch.uint8, device="cuda")
    del private
    torch.cuda.empty_cache()
    meter.end("rollout")
    m = meter.metrics()
    assert m["memory/gpu_cache_fragmented_gib_rollout"] * 1024 >= 48 - 1e-6, m
    assert m["memory/gpu_cache_private_pools_gib_rollout"] * 1024 >= 32 - 1e-6, m
    assert m["memory/gpu_cache_returnable_gib_rollout"] * 1024 < 2, m
    del small, pool


@pytest.mark.gpu
@pytest.mark.skipif(bool(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")), reason="needs torch's default allocator "
                    "settings (expandable segments or max_split_size change when it frees and splits)")
def test_the_allocators_frees_in_a_phase_near_the_memory_limit_are_counted():
    """Under a memory cap a 2.5 GiB block cannot sit beside a cached 2 GiB one: torch frees its cache (cudaFree waits
    for the whole device) and allocates again. The phase where that happened counts it; the next phase does not."""
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    cap = torch.cuda.memory_reserved() + (3 << 30)
    meter = PhaseMemory(torch.device("cuda"))
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        meter.begin()
        x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        del x  # cached by torch, not returned
        y = torch.empty(5 << 29, dtype=torch.uint8, device="cuda")  # 2.5 GiB: only fits once the cache is freed
        del y
        meter.end("update")
        meter.begin()
        # 64 MiB: a large-pool block, split off the cached 2.5 GiB one (1 MiB or less would open a small-pool segment)
        z = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del z
        meter.end("refit")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    m = meter.metrics()
    assert m["memory/gpu_cuda_mallocs_update"] >= 2 and m["memory/gpu_cuda_frees_update"] >= 1, m
    assert m["memory/gpu_cuda_mallocs_refit"] == 0 and m["memory/gpu_cuda_frees_refit"] == 0, m
    assert m["memory/gpu_alloc_retries_refit"] == 0, m


def test_a_cpu_meter_has_no_allocator_counts():
    meter = PhaseMemory(torch.device("cpu"))
    meter.begin()
    meter.end("update")
    assert not any("cuda_" in k or "alloc_retries" in k for k in meter.metrics())
