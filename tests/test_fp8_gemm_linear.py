"""Emulated FP8 GEMMs, the FP8 linear's forward/backward, saved-tensor memory and batch invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetrl_megatron.fp8 import quant_dispatch as ops
from jetrl_megatron.fp8.gemm import fp8_gemm_dgrad, fp8_gemm_fprop, fp8_gemm_wgrad, resolve_backend
from jetrl_megatron.fp8.linear import fake_quant_linear, fp8_linear, fp8_linear_forward
from jetrl_megatron.fp8.quant import (
    dequantize_1x128,
    dequantize_128x1,
    dequantize_128x128,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
)
from jetrl_megatron.recipe import Fp8Recipe

BF16_HALF_ULP = 2.0 ** -8  # relative rounding error of one BF16 cast (2**-9), with margin for tiny values


def _rand(*shape, seed=0, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _close_to_fp64(out: torch.Tensor, ref64: torch.Tensor) -> None:
    """`out` is `ref64` rounded once to BF16: elementwise within half a BF16 ulp (plus an absolute floor)."""
    err = (out.double() - ref64).abs()
    assert bool((err <= ref64.abs() * BF16_HALF_ULP + 1e-30).all()), float((err / ref64.abs().clamp(min=1e-30)).max())


def test_fprop_dgrad_wgrad_equal_fp64_dequant_reference():
    x, w, dy = _rand(200, 384, seed=1), _rand(256, 384, seed=2, scale=0.05), _rand(200, 256, seed=3)
    xq, xs = quantize_1x128(x)
    wq, ws = quantize_128x128(w)
    y = fp8_gemm_fprop(xq, xs, wq, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (200, 256)
    x64, w64 = dequantize_1x128(xq, xs, torch.float64), dequantize_128x128(wq, ws, torch.float64)
    _close_to_fp64(y, x64 @ w64.T)

    gq, gs = quantize_1x128(dy)
    dx = fp8_gemm_dgrad(gq, gs, wq, ws)
    _close_to_fp64(dx, dequantize_1x128(gq, gs, torch.float64) @ w64)

    gtq, gts = quantize_128x1(torch.cat([dy, dy.new_zeros(56, 256)]))
    xtq, xts = quantize_128x1(torch.cat([x, x.new_zeros(56, 384)]))
    dw = fp8_gemm_wgrad(gtq.t().contiguous(), gts.t(), xtq.t().contiguous(), xts.t(), out_dtype=torch.float32)
    ref = dequantize_128x1(gtq, gts, torch.float64).T @ dequantize_128x1(xtq, xts, torch.float64)
    assert torch.allclose(dw.double(), ref, rtol=2 ** -22, atol=0)


def test_fprop_bias_and_fp32_output():
    x, w, b = _rand(7, 256, seed=4), _rand(130, 256, seed=5), _rand(130, seed=6)
    xq, xs = quantize_1x128(x)
    wq, ws = quantize_128x128(w)  # N=130: a partial edge tile
    y = fp8_gemm_fprop(xq, xs, wq, ws, bias=b, out_dtype=torch.float32)
    ref = dequantize_1x128(xq, xs, torch.float64) @ dequantize_128x128(wq, ws, torch.float64).T + b.double()
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, rtol=2 ** -22, atol=1e-6)


def test_rows_are_batch_invariant():
    """Row i of the output is bitwise the same for M = 1..9 and a large M (decode vs trainer)."""
    x, w = _rand(257, 512, seed=7), _rand(384, 512, seed=8, scale=0.03)
    wq, ws = quantize_128x128(w)
    full = fp8_linear_forward(x, wq, ws)
    for m in list(range(1, 10)) + [64]:
        part = fp8_linear_forward(x[:m], wq, ws)
        assert torch.equal(part, full[:m]), f"rows differ for M={m}"
    dy = _rand(257, 384, seed=9)
    gq, gs = quantize_1x128(dy)
    dx_full = fp8_gemm_dgrad(gq, gs, wq, ws)
    for m in (1, 3, 8):
        assert torch.equal(fp8_gemm_dgrad(gq[:m], gs[:m], wq, ws), dx_full[:m])


def test_fp8_linear_forward_backward_vs_fp64_reference():
    """The autograd linear equals the precision contract evaluated in FP64, rounded once to BF16.

    Tolerance: half a BF16 ulp elementwise — the emulated GEMM is exact until its single final cast. (A finite-
    difference
    gradcheck cannot apply: quantization is piecewise constant, and the FP8 backward is the contract's STE by design.)
    """
    x = _rand(2, 75, 256, seed=10).requires_grad_()
    w = _rand(384, 256, seed=11, scale=0.05).requires_grad_()
    b = _rand(384, seed=12).requires_grad_()
    y = fp8_linear(x, w, b)
    dy = _rand(2, 75, 384, seed=13)
    y.backward(dy)

    xq, xs = quantize_1x128(x.detach().reshape(150, 256))
    wq, ws = quantize_128x128(w.detach())
    x64, w64 = dequantize_1x128(xq, xs, torch.float64), dequantize_128x128(wq, ws, torch.float64)
    _close_to_fp64(y.reshape(150, 384), x64 @ w64.T + b.detach().double())

    gq, gs = quantize_1x128(dy.reshape(150, 384))
    _close_to_fp64(x.grad.reshape(150, 256), dequantize_1x128(gq, gs, torch.float64) @ w64)

    xd = dequantize_1x128(xq, xs, torch.float32)  # the saved FP8 activation, re-grouped along tokens
    gtq, gts = quantize_128x1(dy.reshape(150, 384))
    xtq, xts = quantize_128x1(xd)
    dw_ref = dequantize_128x1(gtq, gts, torch.float64).T @ dequantize_128x1(xtq, xts, torch.float64)
    _close_to_fp64(w.grad, dw_ref)
    assert torch.equal(b.grad, dy.reshape(150, 384).float().sum(0).to(torch.bfloat16))
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16


def test_fp8_linear_close_to_bf16_linear():
    """FP8 vs BF16: relative Frobenius errors of y, dX, dW bounded by E4M3's 3-bit mantissa (~2-4% expected)."""
    x = _rand(512, 512, seed=20).requires_grad_()
    w = _rand(768, 512, seed=21, scale=0.04).requires_grad_()
    dy = _rand(512, 768, seed=22)
    fp8_linear(x, w).backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(x2.float(), w2.float()).backward(dy.float())
    y8 = fp8_linear(x.detach(), w.detach()).float()
    y_ref = F.linear(x.detach().float(), w.detach().float())

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    for name, err in {"y": rel(y8, y_ref), "dx": rel(x.grad, x2.grad), "dw": rel(w.grad, w2.grad)}.items():
        assert 0.005 < err < 0.06, (name, err)  # non-zero: FP8 really ran; bounded: it is the right computation


def test_fake_quant_matches_fp8_forward_closely():
    x, w = _rand(64, 256, seed=30), _rand(256, 256, seed=31, scale=0.05)
    y_fake = fake_quant_linear(x, w)
    y_fp8 = fp8_linear(x, w)
    rel = float((y_fake.float() - y_fp8.float()).norm() / y_fp8.float().norm())
    assert rel < 0.01  # same quantized operands; differs only in BF16 operand rounding and accumulation


def test_non_contiguous_input_and_leading_dims():
    base = _rand(256, 4, 3, seed=40)
    x = base.permute(2, 1, 0)  # (3, 4, 256) non-contiguous: Megatron passes [s, b, h]
    w = _rand(128, 256, seed=41)
    y = fp8_linear(x, w)
    assert y.shape == (3, 4, 128)
    assert torch.equal(y, fp8_linear(x.contiguous(), w))


def test_without_grad_it_is_the_forward_alone():
    """Under no_grad (the logprob passes) fp8_linear is fp8_linear_forward: the same bytes as with grad and no
    autograd node."""
    x = _rand(2, 64, 256, seed=45)
    w = _rand(384, 256, seed=46).requires_grad_()
    wq, ws = quantize_128x128(w.detach())
    with_grad = fp8_linear(x, w, weight_fp8=(wq, ws))
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        without = fp8_linear(x, w, weight_fp8=(wq, ws))
        direct = fp8_linear_forward(x, wq, ws)
        on_the_fly = fp8_linear(x, w)  # the weight quantized on the fly: the same 128x128 codes
    assert without.grad_fn is None and not without.requires_grad
    for got in (without, direct, on_the_fly):
        assert got.shape == (2, 64, 384) and torch.equal(got, with_grad.detach())


def test_saved_activation_is_fp8_and_small():
    """Autograd saves the FP8 activation + scales (<= 0.55x the BF16 input's bytes), never the BF16 input."""
    x = _rand(1024, 1024, seed=50).requires_grad_()
    w = _rand(512, 1024, seed=51).requires_grad_()
    wq, ws = quantize_128x128(w.detach())
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8_linear(x, w, weight_fp8=(wq, ws))
    weight_ptrs = {wq.data_ptr(), ws.data_ptr()}
    activation = [t for t in saved if t.data_ptr() not in weight_ptrs]
    act_bytes = sum(t.numel() * t.element_size() for t in activation)
    assert act_bytes <= 0.55 * x.numel() * x.element_size(), act_bytes
    assert not any(t.dtype == torch.bfloat16 and t.shape == x.shape for t in saved)
    assert {t.dtype for t in activation} == {torch.float8_e4m3fn, torch.float32}
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_bad_inputs_name_sizes():
    w = _rand(128, 256, seed=60)
    with pytest.raises(ValueError, match="last dim 200"):
        fp8_linear(_rand(4, 200, seed=61), w)
    wq, ws = quantize_128x128(w)
    with pytest.raises(TypeError, match="float8"):
        fp8_gemm_fprop(_rand(4, 256, seed=62), ws.new_ones(4, 2), wq, ws)
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("fprop", torch.device("cpu"), 4, "cublas")
    assert resolve_backend("fprop", torch.device("cpu"), 4, None, Fp8Recipe()) == "emulated"


def test_ops_dual_and_regroup_match_reference_definitions():
    g = _rand(200, 256, seed=70)
    q, s, qt, st = ops.quant_dual(g)
    q_ref, s_ref = quantize_1x128(g)
    qt_ref, st_ref = quantize_128x1(g)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert qt.shape == (256, 256) and st.shape == (256, 2)
    assert torch.equal(qt[:, :200].view(torch.uint8), qt_ref.t().view(torch.uint8)) and torch.equal(st, st_ref.t())
    assert bool((qt[:, 200:].float() == 0).all())
    xt, xst = ops.regroup_for_wgrad(q, s)
    xt_ref, xst_ref = quantize_128x1(dequantize_1x128(q, s, torch.float32))
    assert torch.equal(xt[:, :200].view(torch.uint8), xt_ref.t().view(torch.uint8)) and torch.equal(xst, xst_ref.t())
