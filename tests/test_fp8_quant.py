"""Reference quantizers: bit identity with an independent vLLM-semantics implementation, error bounds, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fp8_reference import block_quant, codes, per_token_group_quant
from hypothesis import given, settings
from hypothesis import strategies as st

from jetrl_megatron.fp8.quant import (
    FP8_MAX,
    dequantize_1x128,
    dequantize_128x1,
    dequantize_128x128,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
)
from jetrl_megatron.recipe import Fp8Recipe

POW2 = Fp8Recipe(scale_fmt="pow2")


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    normal = torch.randn(64, 512, generator=g)
    heavy = torch.distributions.StudentT(1.5).sample((64, 512))
    tiny = torch.randn(64, 512, generator=g) * 1e-30
    huge = torch.randn(64, 512, generator=g) * 1e4
    mixed = torch.randn(64, 512, generator=g)
    mixed[:, 128:256] = 0.0  # all-zero groups
    mixed[3] = 0.0
    mixed[5, 300] = 1e6  # one outlier dominating its group
    return {"normal": normal, "heavy": heavy, "tiny": tiny, "huge": huge, "zeros_and_outliers": mixed}


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("name", list(_inputs()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_1x128_bit_identical_to_vllm_semantics(name, pow2, dtype):
    x = _inputs()[name].to(dtype)
    q, s = quantize_1x128(x, POW2 if pow2 else None)
    ref_q, ref_s = per_token_group_quant(x, pow2=pow2)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (64, 4)
    assert np.array_equal(s.numpy().view(np.uint32), ref_s.view(np.uint32)), "scales differ"
    assert int((codes(q) != ref_q).sum()) == 0, "FP8 bytes differ"


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32", "pow2"])
@pytest.mark.parametrize("shape", [(384, 512), (200, 300), (1, 129), (128, 128)])
def test_128x128_bit_identical_to_block_reference(shape, pow2):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[1])).to(torch.bfloat16)
    w[: min(128, shape[0]), : min(128, shape[1])] = 0.0  # an all-zero block
    q, s = quantize_128x128(w, POW2 if pow2 else None)
    ref_q, ref_s = block_quant(w, pow2=pow2)
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert np.array_equal(s.numpy().view(np.uint32), ref_s.view(np.uint32))
    assert int((codes(q) != ref_q).sum()) == 0


def test_128x1_equals_1x128_of_transpose():
    x = torch.randn(300, 256, dtype=torch.bfloat16)
    q, s = quantize_128x1(x)
    assert q.shape == (300, 256) and s.shape == (3, 256)
    padded = torch.cat([x, x.new_zeros(84, 256)])
    qt, st_ = quantize_1x128(padded.t())
    assert torch.equal(q.view(torch.uint8), qt.t()[:300].view(torch.uint8))
    assert torch.equal(s, st_.t())


def _grid_bound(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Half an E4M3 ulp in units of x: |y| * 2**-4 in the normal range, 2**-10 in the subnormal range (y = x / s)."""
    y = (x.double() / s.double()).abs().clamp(max=FP8_MAX)
    return s.double() * torch.maximum(y * 2.0 ** -4, torch.full_like(y, 2.0 ** -10))


def test_dequant_error_within_half_ulp():
    for x in _inputs().values():
        q, s = quantize_1x128(x)
        err = (dequantize_1x128(q, s, torch.float64) - x.double()).abs()
        bound = _grid_bound(x, s.repeat_interleave(128, dim=-1))
        assert bool((err <= bound * (1 + 1e-6)).all())
        w = x[:, :300]
        qw, sw = quantize_128x128(w)
        errw = (dequantize_128x128(qw, sw, torch.float64) - w.double()).abs()
        full = sw.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, :300]
        assert bool((errw <= _grid_bound(w, full) * (1 + 1e-6)).all())
        xc = torch.cat([x, x[:37]])  # 101 token rows: a partial last token group
        qc, sc = quantize_128x1(xc)
        errc = (dequantize_128x1(qc, sc, torch.float64) - xc.double()).abs()
        assert bool((errc <= _grid_bound(xc, sc.repeat_interleave(128, 0)[:101]) * (1 + 1e-6)).all())


def test_amax_element_is_represented_exactly_in_fp32_mode():
    x = torch.randn(8, 256)
    q, s = quantize_1x128(x)
    y = q.float().reshape(8, 2, 128)
    # the group's max-magnitude element maps to +-448 up to FP32 rounding of x / s
    assert bool(((y.abs().amax(-1) - FP8_MAX).abs() <= 32).all())  # 448's neighbours on the E4M3 grid are 416/480


def test_non_contiguous_and_leading_dims():
    x = torch.randn(256, 6, 5).permute(2, 1, 0)  # (5, 6, 256), non-contiguous
    assert not x.is_contiguous()
    q, s = quantize_1x128(x)
    q2, s2 = quantize_1x128(x.contiguous())
    assert q.shape == (5, 6, 256) and s.shape == (5, 6, 2)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    w = torch.randn(300, 200).t()
    qw, sw = quantize_128x128(w)
    qw2, sw2 = quantize_128x128(w.contiguous())
    assert torch.equal(qw.view(torch.uint8), qw2.view(torch.uint8)) and torch.equal(sw, sw2)


def test_activation_k_not_multiple_of_128_refused():
    with pytest.raises(ValueError, match=r"\(4, 200\)"):
        quantize_1x128(torch.randn(4, 200))
    with pytest.raises(ValueError, match="2-D"):
        quantize_128x1(torch.randn(2, 3, 128))


def test_nan_and_inf_are_not_hidden():
    x = torch.randn(2, 256)
    x[0, 5] = float("nan")
    x[1, 200] = float("inf")
    q, s = quantize_1x128(x)
    qf = q.float()
    assert torch.isnan(s[0, 0]) and bool(torch.isnan(qf[0, :128]).all())  # NaN poisons its group, visibly
    assert torch.isfinite(s[0, 1]) and bool(torch.isfinite(qf[0, 128:]).all())  # other groups untouched
    assert torch.isinf(s[1, 1]) and torch.isnan(qf[1, 200])  # inf / inf = NaN code, scale inf
    assert bool((qf[1, 128:200] == 0).all())  # finite / inf = 0
    assert bool(torch.isfinite(s[1, 0]))


def test_pow2_scales_are_powers_of_two_and_cover_amax():
    x = torch.randn(16, 512) * torch.logspace(-8, 8, 16).unsqueeze(1)
    _, s = quantize_1x128(x, POW2)
    mant, _ = torch.frexp(s)
    assert bool((mant == 0.5).all())
    amax = x.reshape(16, 4, 128).abs().amax(-1)
    assert bool((s * FP8_MAX >= amax).all()) and bool((s * FP8_MAX < 2 * amax).all())


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    groups=st.integers(1, 3),
    log_scale=st.floats(-30, 4),
    pow2=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_1x128_matches_reference(rows, groups, log_scale, pow2, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, groups * 128, generator=g) * (10.0 ** log_scale)
    q, s = quantize_1x128(x, POW2 if pow2 else None)
    ref_q, ref_s = per_token_group_quant(x, pow2=pow2)
    assert np.array_equal(s.numpy().view(np.uint32), ref_s.view(np.uint32))
    assert np.array_equal(codes(q), ref_q)
    err = (dequantize_1x128(q, s, torch.float64) - x.double()).abs()
    assert bool((err <= _grid_bound(x, s.repeat_interleave(128, -1)) * (1 + 1e-6)).all())


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 300), log_scale=st.floats(-20, 4), seed=st.integers(0, 2**31 - 1))
def test_property_128x128_matches_reference(n, k, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (10.0 ** log_scale)
    q, s = quantize_128x128(w)
    ref_q, ref_s = block_quant(w)
    assert np.array_equal(s.numpy().view(np.uint32), ref_s.view(np.uint32))
    assert np.array_equal(codes(q), ref_q)
