"""The colocated engine's wake-up after the trainer's phase: an out-of-memory failure there (vLLM's
``CUDA Error: out of memory at .../cumem_allocator.cpp``, as the first 8B step on an H100 hit at step 2) becomes one
line naming the memory and the keys to change; any other failure passes unchanged. The real failure on CUDA is in
tests/test_rollout_gpu.py."""

from __future__ import annotations

import pytest

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.config import load_config
from jetrl_megatron.rl.engine_wake import EngineWakeOutOfMemory, TrainerPool, wake_engine, wake_message

VLLM_OOM = "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163"
H100 = [f"policy.generation.vllm_kwargs.kv_cache_memory_bytes={12 << 30}",
        "policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.8"]


def _raise(exc: BaseException):
    def wake():
        raise exc
    return wake


def test_vllms_out_of_memory_at_wake_names_the_kv_budget_and_the_offload_share():
    cfg = load_config("qwen3_8b_1gpu", H100)
    with pytest.raises(EngineWakeOutOfMemory) as info:
        wake_engine(_raise(RuntimeError(VLLM_OOM)), cfg, pool=lambda: None)
    msg = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in msg
    for part in ("could not wake up", "kv_cache_memory_bytes = 12.0 GiB", "optimizer_offload_fraction (now 0.8)",
                 "policy.train_micro_batch_size", "jetrl plan", "cumem_allocator.cpp:163"):
        assert part in msg, (part, msg)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_the_message_says_what_the_gpu_and_the_trainer_held():
    """Before the wake-up: free of total, the trainer's tensors, torch's cache, and the rest of the device (what
    neither explains: the ~10 GiB of the 8B micro-batch-4 run on 2026-12-05)."""
    cfg = load_config("qwen3_8b_1gpu", H100)
    pool = TrainerPool(tensors=47.3, cached=6.25, returnable=0.5)
    msg = wake_message(cfg, RuntimeError(VLLM_OOM), (12.5, 79.2), pool)
    assert ("before waking the GPU had 12.5 of 79.2 GiB free: the trainer's tensors 47.3 GiB, torch's cache 6.2 GiB "
            "(0.5 of it returnable), 13.2 GiB outside torch's default pool") in msg, msg
    assert "before waking the GPU had 12.5 of 79.2 GiB free. Lower" in wake_message(cfg, RuntimeError(VLLM_OOM),
                                                                              (12.5, 79.2), None)


def test_the_free_memory_is_read_before_the_wake_up(monkeypatch):
    """A failed wake-up holds part of what it took: the figure in the message is the one read before it."""
    import torch

    free = iter([(30 << 30, 80 << 30), (1 << 28, 80 << 30)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: next(free))
    cfg = load_config("qwen3_8b_1gpu", H100)
    with pytest.raises(EngineWakeOutOfMemory) as info:
        wake_engine(_raise(RuntimeError(VLLM_OOM)), cfg, pool=lambda: None)
    assert "before waking the GPU had 30.0 of 80.0 GiB free" in str(info.value), str(info.value)


def test_without_offload_or_kv_bytes_the_other_levers_are_named():
    cfg = load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.optimizer.optimizer_cpu_offload=false",
                                        "policy.generation.vllm_kwargs.kv_cache_memory_bytes=null"])
    msg = wake_message(cfg, RuntimeError(VLLM_OOM), None, None)
    assert "turn on policy.megatron_cfg.optimizer.optimizer_cpu_offload" in msg, msg
    assert "gpu_memory_utilization = " in msg, msg


def test_other_failures_pass_unchanged():
    cfg = load_config("qwen3_8b_1gpu", H100)
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as info:
        wake_engine(_raise(err), cfg, pool=lambda: None)
    assert info.value is err
    calls = []
    wake_engine(lambda: calls.append("woke"), cfg, pool=lambda: None)
    assert calls == ["woke"]


def test_a_failing_memory_query_does_not_replace_the_out_of_memory_error(monkeypatch):
    """The free/total query runs inside the error path: when it fails too (a device in a bad state), the one-line
    error still comes, without the figures."""
    import torch

    def broken():
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    cfg = load_config("qwen3_8b_1gpu", H100)
    with pytest.raises(EngineWakeOutOfMemory) as info:
        wake_engine(_raise(RuntimeError(VLLM_OOM)), cfg, pool=lambda: None)
    assert "GiB free" not in str(info.value) and "kv_cache_memory_bytes" in str(info.value)
