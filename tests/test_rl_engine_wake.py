"""The colocated engine's wake-up after the trainer's phase: an out-of-memory failure there (vLLM's
``CUDA Error: out of memory at .../cumem_allocator.cpp``, as the first 8B step on an H100 hit at step 2) becomes one
line naming the memory and the keys to change; any other failure passes unchanged. The real failure on CUDA is in
tests/test_rollout_gpu.py."""

from __future__ import annotations

import pytest

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.config import load_config
from jetrl_megatron.rl.engine_wake import EngineWakeOutOfMemory, wake_engine, wake_message

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
        wake_engine(_raise(RuntimeError(VLLM_OOM)), cfg, trainer_gib=lambda: None)
    msg = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in msg
    for part in ("could not wake up", "kv_cache_memory_bytes = 12.0 GiB", "optimizer_offload_fraction (now 0.8)",
                 "policy.train_micro_batch_size", "jetrl plan", "cumem_allocator.cpp:163"):
        assert part in msg, (part, msg)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_the_message_says_what_the_gpu_and_the_trainer_held():
    cfg = load_config("qwen3_8b_1gpu", H100)
    msg = wake_message(cfg, RuntimeError(VLLM_OOM), (0.4, 79.2), 53.8)
    assert "the GPU had 0.4 of 79.2 GiB free, the trainer holding 53.8 GiB" in msg, msg


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
        wake_engine(_raise(err), cfg, trainer_gib=lambda: None)
    assert info.value is err
    calls = []
    wake_engine(lambda: calls.append("woke"), cfg, trainer_gib=lambda: None)
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
        wake_engine(_raise(RuntimeError(VLLM_OOM)), cfg, trainer_gib=lambda: None)
    assert "GiB free" not in str(info.value) and "kv_cache_memory_bytes" in str(info.value)
