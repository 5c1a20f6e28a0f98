"""GPU: the fused Triton quantization kernels are bit-identical to the pure-torch reference twins in fp8/quant.py.

0 differing bytes in the FP8 codes and 0 differing scales, on >= 16M fresh random values per kernel, for FP32 and
pow2 scales, plus ragged token counts, non-contiguous inputs, edge weight tiles, pow2 boundary cases and NaN/Inf.
"""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.fp8 import quant as Q
from jetrl_megatron.recipe import Fp8Recipe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RECIPES = [Fp8Recipe(scale_fmt="fp32"), Fp8Recipe(scale_fmt="pow2")]


def _kernels():
    from jetrl_megatron.fp8 import kernels

    return kernels


def rand_groups(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Normal values with per-row magnitudes over 12 decades and a heavy-tailed sprinkle (never zeros)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g)
    rows = torch.logspace(-6, 6, m, device="cuda")[torch.randperm(m, device="cuda", generator=g)]
    x = x * rows[:, None]
    tail = torch.rand(m, k, device="cuda", generator=g) < 1e-3
    x = torch.where(tail, x * 1e3, x)
    return x.to(dtype)


def pad_t(x: torch.Tensor) -> torch.Tensor:
    m = x.shape[0]
    mp = -(-m // 128) * 128
    out = x.new_zeros((mp, x.shape[1]))
    out[:m] = x
    return out.t()


def _assert_codes(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float8_e4m3fn, what
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    diff = (got.view(torch.uint8) != ref.contiguous().view(torch.uint8)).sum().item()
    assert diff == 0, f"{what}: {diff} of {ref.numel()} FP8 bytes differ"


def _assert_scales(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.float32 and got.shape == ref.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    same = (got == ref) | (torch.isnan(got) & torch.isnan(ref))
    assert bool(same.all()), f"{what}: {(~same).sum().item()} scales differ"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.scale_fmt)
def test_quant_act_bit_identical_16m(recipe):
    k = _kernels()
    x = rand_groups(4096, 4096, seed=1)  # 16.8M values
    q, s = k.quant_act(x, recipe)
    qr, sr = Q.quantize_1x128(x, recipe)
    _assert_codes(q, qr, "quant_act q")
    _assert_scales(s, sr, "quant_act s")
    assert s.stride() == (1, 4096), f"scales must be column-major, got strides {s.stride()}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.scale_fmt)
def test_quant_dual_bit_identical_16m(recipe):
    k = _kernels()
    g = rand_groups(4000, 4224, seed=2)  # ragged token count, 16.9M values
    q, s, qt, st = k.quant_dual(g, recipe)
    qr, sr = Q.quantize_1x128(g, recipe)
    qtr, str_ = Q.quantize_1x128(pad_t(g), recipe)
    _assert_codes(q, qr, "quant_dual q")
    _assert_scales(s, sr, "quant_dual s")
    _assert_codes(qt, qtr, "quant_dual qt")
    _assert_scales(st, str_, "quant_dual st")
    assert qt.shape == (4224, 4096) and qt.is_contiguous()
    assert st.stride() == (1, 4224) and s.stride() == (1, 4000)
    # the transposed copy equals the 128x1 reference too
    q1, s1 = Q.quantize_128x1(g, recipe)
    _assert_codes(qt[:, :4000], q1.t(), "quant_dual qt vs quantize_128x1")
    _assert_scales(st, s1.t(), "quant_dual st vs quantize_128x1")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.scale_fmt)
def test_regroup_for_wgrad_bit_identical_16m(recipe):
    k = _kernels()
    x = rand_groups(4100, 4096, seed=3)
    qr, sr = Q.quantize_1x128(x, recipe)
    s_colmajor = sr.t().contiguous().t()  # the layout quant_act hands to autograd
    qt, st = k.regroup_for_wgrad(qr, s_colmajor, recipe)
    ref_q, ref_s = Q.quantize_1x128(pad_t(Q.dequantize_1x128(qr, sr, torch.float32)), recipe)
    _assert_codes(qt, ref_q, "regroup qt")
    _assert_scales(st, ref_s, "regroup st")
    assert st.stride() == (1, 4096)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.scale_fmt)
def test_quant_weight_bit_identical_16m_and_edges(recipe):
    k = _kernels()
    for shape, seed in (((4096, 4096), 4), ((1000, 700), 5), ((129, 130), 6)):
        w = (torch.randn(*shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
             * 0.02).to(torch.bfloat16)
        q, s, qt = k.quant_weight(w, recipe, with_transpose=True)
        qr, sr = Q.quantize_128x128(w, recipe)
        _assert_codes(q, qr, f"quant_weight q {shape}")
        _assert_scales(s, sr, f"quant_weight s {shape}")
        _assert_codes(qt, qr.t().contiguous(), f"quant_weight transposed {shape}")
        q2, s2 = k.quant_weight(w, recipe)
        _assert_codes(q2, qr, "quant_weight (no transpose)")


@pytest.mark.parametrize("trans_mode", [0, 1, 2])
def test_launch_variants_identical(trans_mode):
    """Every launch shape (warps, transposed-store mode, regroup feature slice) gives the reference bytes."""
    k = _kernels()
    x = rand_groups(1000, 1024, seed=21)
    for recipe in RECIPES:
        qtr, str_ = Q.quantize_1x128(pad_t(x), recipe)
        qr, sr = Q.quantize_1x128(x, recipe)
        for nw, split in ((4, False), (8, False), (4, True)):
            q, s, qt, st = k.quant_dual(x, recipe, num_warps=nw, trans_mode=trans_mode, split=split)
            _assert_codes(qt, qtr, f"dual t={trans_mode} w={nw} split={split}")
            _assert_scales(st, str_, f"dual st t={trans_mode} w={nw} split={split}")
            _assert_codes(q, qr, f"dual q split={split}")
            _assert_scales(s, sr, f"dual s split={split}")
        ref_q, ref_s = Q.quantize_1x128(pad_t(Q.dequantize_1x128(qr, sr)), recipe)
        for feats in (32, 64, 128):
            for nw in (4, 8):
                for vec in (0, 2, 4):
                    qt, st = k.regroup_for_wgrad(qr, sr, recipe, trans_mode=trans_mode, feats=feats, num_warps=nw,
                                                 load_vec=vec)
                    _assert_codes(qt, ref_q, f"regroup t={trans_mode} f={feats} w={nw} v={vec}")
                    _assert_scales(st, ref_s, f"regroup st t={trans_mode} f={feats} w={nw} v={vec}")
        for bm, nw in ((16, 4), (64, 8), (128, 8)):
            q, s = k.quant_act(x, recipe, block_m=bm, num_warps=nw)
            _assert_codes(q, qr, f"act bm={bm}")


def test_fp32_input_and_noncontiguous():
    k = _kernels()
    base = rand_groups(512, 2048, seed=7, dtype=torch.float32)
    x = base[:, :1024]  # row stride 2048: non-contiguous view
    for recipe in RECIPES:
        q, s = k.quant_act(x, recipe)
        qr, sr = Q.quantize_1x128(x, recipe)
        _assert_codes(q, qr, "fp32 non-contiguous q")
        _assert_scales(s, sr, "fp32 non-contiguous s")
        xt = base.t()[:1024]  # column-major input
        q, s, qt, st = k.quant_dual(xt, recipe)
        qr, sr = Q.quantize_1x128(xt, recipe)
        _assert_codes(q, qr, "transposed-view dual q")
        _assert_codes(qt, Q.quantize_1x128(pad_t(xt), recipe)[0], "transposed-view dual qt")


def test_ragged_small_token_counts():
    k = _kernels()
    for m in (1, 7, 127, 129):
        x = rand_groups(m, 384, seed=100 + m)
        for recipe in RECIPES:
            q, s, qt, st = k.quant_dual(x, recipe)
            _assert_codes(q, Q.quantize_1x128(x, recipe)[0], f"M={m} q")
            qtr, str_ = Q.quantize_1x128(pad_t(x), recipe)
            _assert_codes(qt, qtr, f"M={m} qt")
            _assert_scales(st, str_, f"M={m} st")


def test_pow2_boundaries_exact():
    """Scales exactly at, just above and just below a power of two: the pow2 rounding must match frexp's exactness."""
    k = _kernels()
    recipe = RECIPES[1]
    amax = []
    for e in range(-20, 10):
        p = 448.0 * 2.0**e
        amax += [p, p * (1 + 2**-23), p * (1 - 2**-24), p * (1 + 2**-20)]
    amax_t = torch.tensor(amax, dtype=torch.float32, device="cuda")
    x = torch.rand(len(amax), 128, device="cuda") * amax_t[:, None] * 0.5
    x[:, 5] = amax_t
    x[:, 9] = -amax_t
    for rec in (recipe, RECIPES[0]):
        q, s = k.quant_act(x, rec)
        qr, sr = Q.quantize_1x128(x, rec)
        _assert_codes(q, qr, f"boundary q {rec.scale_fmt}")
        _assert_scales(s, sr, f"boundary s {rec.scale_fmt}")


def test_nan_inf_match_reference():
    """NaN poisons its group (scale and codes NaN), Inf makes the scale Inf: the kernels hide nothing."""
    k = _kernels()
    x = rand_groups(256, 512, seed=9, dtype=torch.float32)
    x[3, 10] = float("nan")
    x[40, 300] = float("inf")
    x[200, 129] = float("-inf")
    for recipe in RECIPES:
        q, s = k.quant_act(x, recipe)
        qr, sr = Q.quantize_1x128(x, recipe)
        _assert_scales(s, sr, "nan/inf s")
        assert torch.equal(torch.isnan(q.float()), torch.isnan(qr.float())), "NaN code positions differ"
        finite = ~torch.isnan(qr.float())
        assert torch.equal(q.float()[finite], qr.float()[finite])
        assert torch.isnan(s[3, 0]) and torch.isinf(s[40, 2])
        qw, sw = k.quant_weight(x, recipe)
        qwr, swr = Q.quantize_128x128(x, recipe)
        _assert_scales(sw, swr, "nan/inf weight s")
        assert torch.equal(torch.isnan(qw.float()), torch.isnan(qwr.float()))


def _nan_free(codes: torch.Tensor) -> torch.Tensor:
    """FP8 bytes with every NaN code as 0x7F (a NaN's sign is the platform's; its position is what must match)."""
    b = codes.contiguous().view(torch.uint8)
    return torch.where((b & 0x7F) == 0x7F, 0x7F, b)


def specials(with_nonfinite: bool = True) -> torch.Tensor:
    """(384, 512) FP32: rows over 60 decades, groups of +0 and -0, -0 sprinkled, subnormals, a huge group, and (with
    `with_nonfinite`) NaN / +-inf groups."""
    g = torch.Generator(device="cuda").manual_seed(31)
    x = torch.randn(384, 512, device="cuda", generator=g) * torch.logspace(-30, 30, 384, device="cuda")[:, None]
    x[5, :128] = 0.0
    x[6, :128] = -0.0
    x[7, ::3] = -0.0
    x[8] = torch.tensor([1], dtype=torch.int32).view(torch.float32).item() * (torch.arange(512, device="cuda") % 5 - 2)
    x[9, :128] = 3.0e38
    if with_nonfinite:
        x[10, 130] = float("nan")
        x[11, 300] = float("inf")
        x[12, 400] = float("-inf")
    return x


def test_signed_zeros_subnormals_and_specials_in_every_kernel():
    """+-0 keeps its sign (0x00 / 0x80), subnormal inputs, groups of zeros, huge groups, NaN / +-inf groups: every
    kernel gives the reference's bytes (NaN codes compared by position). Random-value tests never hold zeros."""
    k = _kernels()
    x = specials()
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for recipe in RECIPES:
            qr, sr = Q.quantize_1x128(xd, recipe)
            q, s = k.quant_act(xd, recipe)
            assert torch.equal(_nan_free(q), _nan_free(qr)), f"quant_act {dtype} {recipe.scale_fmt}"
            _assert_scales(s, sr, "quant_act specials")
            qtr, str_ = Q.quantize_1x128(pad_t(xd), recipe)
            for split in (False, True):
                q, s, qt, st = k.quant_dual(xd, recipe, split=split)
                assert torch.equal(_nan_free(qt), _nan_free(qtr)), f"quant_dual qt split={split} {recipe.scale_fmt}"
                _assert_scales(st, str_, "quant_dual specials")
            ref_q, ref_s = Q.quantize_1x128(pad_t(Q.dequantize_1x128(qr, sr)), recipe)
            qt, st = k.regroup_for_wgrad(qr, sr, recipe)
            assert torch.equal(_nan_free(qt), _nan_free(ref_q)), f"regroup {dtype} {recipe.scale_fmt}"
            _assert_scales(st, ref_s, "regroup specials")
            qw, sw = k.quant_weight(xd, recipe)
            qwr, swr = Q.quantize_128x128(xd, recipe)
            assert torch.equal(_nan_free(qw), _nan_free(qwr)), f"quant_weight {dtype} {recipe.scale_fmt}"
            _assert_scales(sw, swr, "quant_weight specials")
    assert (k.quant_act(x, RECIPES[0])[0][6, :128].view(torch.uint8) == 0x80).all(), "-0 lost its sign"


def test_errors_name_the_shape():
    k = _kernels()
    with pytest.raises(ValueError, match="100"):
        k.quant_act(torch.randn(4, 100, device="cuda"))
    with pytest.raises(ValueError, match="CUDA"):
        k.quant_act(torch.randn(4, 128))
