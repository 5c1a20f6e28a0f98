"""The GPU-vLLM residual add (``bf16(out + residual)``, one rounding of the FP32 sum) in one kernel gives the bytes
of the spelled-out form (two FP32 upcasts, the FP32 add, one downcast) on every input, on the CPU and on CUDA."""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.megatron.numerics import BF16_RESIDUAL_ADD, _ResidualAddFn


def _wide_bf16(n: int, seed: int, device: str) -> torch.Tensor:
    """Random BF16 values over the whole exponent range (tiny, subnormal, huge), both signs, with exact zeros and
    values that cancel against their partners, so every rounding case of the sum shows up."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g) + 0.5
    expo = torch.randint(-135, 128, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * mant * torch.exp2(expo)).to(torch.bfloat16)
    x[torch.rand(n, generator=g) < 0.02] = 0.0
    return x.to(device)


def _spelled_out(out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return (out.float() + residual.float()).to(torch.bfloat16)


def _check(device: str) -> None:
    for seed in range(4):
        a = _wide_bf16(1 << 16, seed, device)
        b = _wide_bf16(1 << 16, seed + 100, device)
        b[:4096] = -a[:4096] * 0.999  # near-cancellation: the sum's rounding decides every bit
        b[4096:8192] = a[4096:8192]  # doubling, and sums that overflow to inf at the top of the range
        got = BF16_RESIDUAL_ADD.fwd(a, b)
        want = _spelled_out(a, b)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"seed {seed}"
    # ordinary activations, as the layer adds them
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(4, 33, 512, generator=g) * 3).to(torch.bfloat16).to(device)
    b = torch.randn(4, 33, 512, generator=g).to(torch.bfloat16).to(device)
    assert torch.equal(BF16_RESIDUAL_ADD.fwd(a, b).view(torch.int16), _spelled_out(a, b).view(torch.int16))


def test_one_kernel_bf16_residual_add_gives_the_spelled_out_bytes_on_cpu():
    _check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_kernel_bf16_residual_add_gives_the_spelled_out_bytes_on_cuda():
    _check("cuda")


def test_the_residual_add_keeps_its_gradients_and_mixed_dtypes():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(8, 64, generator=g).to(torch.bfloat16).requires_grad_()
    r = torch.randn(8, 64, generator=g).to(torch.bfloat16).requires_grad_()
    s = _ResidualAddFn.apply(a, r, BF16_RESIDUAL_ADD)
    ds = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    s.backward(ds)
    assert torch.equal(a.grad, ds) and torch.equal(r.grad, ds)
    # an FP32 residual (not the GPU stream's, but accepted): the spelled-out form, rounded to the output's dtype
    r32 = torch.randn(8, 64, generator=g)
    got = BF16_RESIDUAL_ADD.fwd(a.detach(), r32)
    assert got.dtype == torch.bfloat16 and torch.equal(got, (a.detach().float() + r32).to(torch.bfloat16))
