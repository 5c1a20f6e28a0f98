"""CPU: the quant kernels' division-free quotient (fp8/kernels.py `_quotient`) gives IEEE division's E4M3 codes.

Why: every quant kernel divides each value by its group's scale; a correctly rounded division costs ~10 GPU instructions
and a slow-path branch per element, the reciprocal-and-two-FMA form three. It must not change a single code (the
rollout is served the trainer's bytes, and the references in fp8/quant.py divide). Runs the real Triton helpers under
TRITON_INTERPRET=1 (numpy FP32 arithmetic and a fused multiply-add that rounds once, as the GPU's): every FP32
mantissa of x in one binade for hard scales, random pairs over the whole domain (scales from amax_eps' floor / 448 up,
values down to subnormals and zeros of both signs), and the special values through the kernels themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import torch, triton, triton.language as tl
    from jetrl_megatron.fp8 import kernels as K, quant as Q
    from jetrl_megatron.recipe import AMAX_EPS_MIN, Fp8Recipe

    @triton.jit
    def quotient_kernel(x_ptr, s_ptr, q_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        s = tl.load(s_ptr + offs, mask=ok, other=1.0)
        s_fin, r = K._divisor(s)
        tl.store(q_ptr + offs, K._quotient(x, s_fin, r), mask=ok)

    def quotient(x, s):
        q = torch.empty_like(x)
        quotient_kernel[(triton.cdiv(x.numel(), 1 << 20),)](x, s, q, x.numel(), BLOCK=1 << 20)
        return q

    def codes(v):  # the kernels' cast: clamp, then E4M3 round-to-nearest-even, as bytes
        return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)

    def check(x, s, what):
        got, want = quotient(x, s), x / s
        bad = codes(got) != codes(want)
        first = f"x={x[bad][0].item()!r} s={s[bad][0].item()!r}" if bad.any() else ""
        assert not bad.any(), f"{what}: {int(bad.sum())} E4M3 codes differ, first {first}"
        # the FP32 quotient itself is IEEE's wherever the residual cannot underflow (|x| >= 2^-100)
        big = x.abs() >= 2.0 ** -100
        diff = big & (got.view(torch.int32) != want.view(torch.int32))
        assert not diff.any(), f"{what}: FP32 quotient differs at x={x[diff][0].item()!r} s={s[diff][0].item()!r}"
        return x.numel()

    g = torch.Generator().manual_seed(0)
    n = 0
    # 1) every mantissa of x in [s, 2s) for scales with mantissa 0 (pow2), all ones and 0x400001, both signs alternating
    mant = torch.arange(1 << 23, dtype=torch.int32)
    for s_bits in (0x3C000000, 0x3C7FFFFF, 0x3C400001):
        s = torch.tensor([s_bits], dtype=torch.int32).view(torch.float32)
        for shift in (0, 5 << 23):  # x / s in [1, 2) and [32, 64)
            x = ((torch.tensor(s_bits & 0x7F800000) + shift) | mant).view(torch.float32)
            x = torch.where(mant % 2 == 0, x, -x)
            n += check(x, s.expand_as(x).contiguous(), f"every mantissa, s bits {s_bits:#x}, shift {shift >> 23}")
    # 2) random pairs over the domain: s in [AMAX_EPS_MIN/448, 2^117], |x| <= 448 s down to subnormals and zeros
    m = 1 << 22
    lo = torch.log2(torch.tensor(AMAX_EPS_MIN / 448.0)).item()
    s = torch.exp2(torch.rand(m, generator=g, dtype=torch.float64) * (117 - lo) + lo).float()
    ratio = torch.exp2(-torch.rand(m, generator=g, dtype=torch.float64) * 200 + 8.8).float()  # x / s from 2^-191 to 448
    x = (s.double() * ratio.double()).float() * torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)
    x[:: 97] = 0.0
    x[1:: 97] = -0.0
    x[2:: 97] = torch.tensor([1], dtype=torch.int32).view(torch.float32)  # the smallest subnormal
    n += check(x, s, "random pairs")
    # 3) s = inf (a column holding inf): finite / inf = +-0, +-inf / inf = NaN, as IEEE division
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    got = quotient(x, torch.full_like(x, float("inf")))
    want = x / float("inf")
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "inf scale: NaN positions"
    fin = ~torch.isnan(want)
    assert torch.equal(got[fin].view(torch.int32), want[fin].view(torch.int32)), "inf scale: +-0 with x's sign"

    # 4) the kernels on a tile of special values: +-0, subnormals, NaN, +-inf, huge and tiny groups
    for fmt in ("fp32", "pow2"):
        r = Fp8Recipe(scale_fmt=fmt)
        x = torch.randn(256, 384, generator=g) * torch.logspace(-30, 30, 256)[:, None]
        x[5, :128] = 0.0
        x[6, :128] = -0.0
        x[7, 3] = -0.0
        x[8, :] = torch.tensor([1], dtype=torch.int32).view(torch.float32) * (torch.arange(384) % 5 - 2)
        x[9, 10] = float("nan")
        x[10, 200] = float("inf")
        x[11, 300] = float("-inf")
        x[12, :128] = 3.0e38
        xb = x.bfloat16()
        q, sc = K.quant_act(xb, r)
        qr, sr = Q.quantize_1x128(xb, r)
        # a NaN code's sign is the platform's (x86 division makes -NaN, the GPU's +NaN): compared as NaN, both
        nan_free = lambda a: torch.where((a.view(torch.uint8) & 0x7F) == 0x7F, 0x7F, a.view(torch.uint8))
        same = lambda a, b: torch.equal(nan_free(a), nan_free(b.contiguous()))
        bits = lambda a: torch.where(torch.isnan(a), torch.full_like(a, float("nan")), a).contiguous().view(torch.int32)
        assert same(q, qr) and torch.equal(bits(sc), bits(sr)), f"quant_act specials {fmt}"
        # the regroup reads FP8 codes back: without the NaN / inf rows, whose NaN codes the interpreter's FP8 -> FP32
        # conversion does not decode (tests/test_fp8_kernels_gpu.py checks them on the GPU)
        finite_rows = torch.ones(256, dtype=torch.bool)
        finite_rows[9:12] = False
        qr, sr = Q.quantize_1x128(xb[finite_rows], r)
        qt, st = K.regroup_for_wgrad(qr, sr, r)
        xd = Q.dequantize_1x128(qr, sr)
        padded = torch.cat([xd, xd.new_zeros(256 - xd.shape[0], xd.shape[1])])  # tokens padded to 128 with zeros
        qtr, str_ = Q.quantize_1x128(padded.t().contiguous(), r)
        assert same(qt, qtr) and torch.equal(bits(st), bits(str_)), f"regroup specials {fmt}"
        qw, sw = K.quant_weight(xb[:, :256], r)
        qwr, swr = Q.quantize_128x128(xb[:, :256], r)
        assert same(qw, qwr) and torch.equal(bits(sw), bits(swr)), f"quant_weight specials {fmt}"
    print(f"QUOTIENT-OK {n}")
    """
)


def test_division_free_quotient_gives_ieee_codes_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert "QUOTIENT-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert int(proc.stdout.split("QUOTIENT-OK")[1].split()[0]) > 50_000_000
