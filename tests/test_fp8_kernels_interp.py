"""CPU: the Triton quant kernels and the Triton blockwise GEMM run under TRITON_INTERPRET=1 against the references.

The interpreter's own FP32->E4M3 and FP32->BF16 conversions are not round-to-nearest-even (it rounds half-up without
mantissa carry, and truncates to BF16), so under it the quant kernels store clamped FP32 and torch casts (see
kernels.py), and the GEMM is checked with FP32 output. The hardware casts are covered by tests/test_fp8_kernels_gpu.py.
Runs in a subprocess because TRITON_INTERPRET must be set before the kernels are defined.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import torch
    from jetrl_megatron.fp8 import gemm as G, kernels as K, quant as Q
    from jetrl_megatron.fp8.backends import triton as TB
    from jetrl_megatron.fp8.backends.triton_gemm import GemmConfig
    from jetrl_megatron.recipe import Fp8Recipe

    torch.manual_seed(0)

    def same(a, b):
        if a.dtype == torch.float8_e4m3fn:
            return a.shape == b.shape and bool((a.view(torch.uint8) == b.contiguous().view(torch.uint8)).all())
        return a.shape == b.shape and bool(torch.equal(a, b))

    def pad_t(x):
        mp = -(-x.shape[0] // 128) * 128
        out = x.new_zeros((mp, x.shape[1])); out[: x.shape[0]] = x
        return out.t()

    for fmt in ("fp32", "pow2"):
        r = Fp8Recipe(scale_fmt=fmt)
        x = (torch.randn(200, 384) * torch.logspace(-4, 4, 200)[:, None]).bfloat16()
        q, s = K.quant_act(x, r); qr, sr = Q.quantize_1x128(x, r)
        assert same(q, qr) and same(s, sr) and s.stride() == (1, 200), f"quant_act {fmt}"
        q, s, qt, st = K.quant_dual(x, r); qtr, str_ = Q.quantize_1x128(pad_t(x), r)
        assert same(q, qr) and same(s, sr) and same(qt, qtr) and same(st, str_), f"quant_dual {fmt}"
        ref = Q.quantize_1x128(pad_t(Q.dequantize_1x128(qr, sr)), r)
        for tm in (0, 1, 2):
            for split in (False, True):
                q, s, qt, st = K.quant_dual(x, r, trans_mode=tm, split=split)
                assert same(q, qr) and same(s, sr), f"quant_dual q trans_mode={tm} split={split} {fmt}"
                assert same(qt, qtr) and same(st, str_), f"quant_dual trans_mode={tm} split={split} {fmt}"
            for feats in (32, 128):
                qt, st = K.regroup_for_wgrad(qr, sr.t().contiguous().t(), r, trans_mode=tm, feats=feats)
                assert same(qt, ref[0]) and same(st, ref[1]), f"regroup trans_mode={tm} feats={feats} {fmt}"
        w = torch.randn(300, 200).bfloat16()
        qw, sw, qwt = K.quant_weight(w, r, with_transpose=True); qwr, swr = Q.quantize_128x128(w, r)
        assert same(qw, qwr) and same(sw, swr) and same(qwt, qwr.t().contiguous()), f"quant_weight {fmt}"

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    m, n, k = 70, 256, 384
    x = torch.randn(m, k).bfloat16(); w = (torch.randn(n, k) * 0.05).bfloat16(); g = torch.randn(m, n).bfloat16()
    xq, xs = K.quant_act(x); wq, ws = K.quant_weight(w); gq, gs, gtq, gts = K.quant_dual(g)
    xtq, xts = K.regroup_for_wgrad(xq, xs)
    f32 = torch.float32
    small = GemmConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    checks = {
        "fprop": (TB.fprop(xq, xs, wq, ws, config=small, out_dtype=f32),
                  G.emulated_fprop(xq, xs, wq, ws, out_dtype=f32)),
        "fprop_splitk_pipe": (TB.fprop(xq, xs, wq, ws, out_dtype=f32,
                                       config=GemmConfig(block_m=64, block_n=64, num_warps=4, split_k=2, pipe=True)),
                              G.emulated_fprop(xq, xs, wq, ws, out_dtype=f32)),
        "fprop_swap_ab": (TB.fprop(xq[:5], xs[:5], wq, ws, out_dtype=f32),
                          G.emulated_fprop(xq[:5], xs[:5], wq, ws, out_dtype=f32)),
        "dgrad": (TB.dgrad(gq, gs, wq, ws, config=small, out_dtype=f32),
                  G.emulated_dgrad(gq, gs, wq, ws, out_dtype=f32)),
        "wgrad": (TB.wgrad(gtq, gts, xtq, xts, config=small, out_dtype=f32),
                  G.emulated_wgrad(gtq, gts, xtq, xts, out_dtype=f32)),
    }
    for form, cfg in TB.TUNED.items():  # the measured fastest configs (tile/order logic; warps/stages ignored here)
        args = {"fprop": (xq, xs, wq, ws), "dgrad": (gq, gs, wq, ws), "wgrad": (gtq, gts, xtq, xts)}[form]
        checks[f"{form}_tuned"] = (getattr(TB, form)(*args, config=cfg, out_dtype=f32),
                                   getattr(G, f"emulated_{form}")(*args, out_dtype=f32))
    for name, (got, ref) in checks.items():
        assert torch.isfinite(got).all(), name
        assert rel(got, ref) < 1e-6, f"{name}: rel {rel(got, ref):.2e}"
    print("INTERP-OK")
    """
)


SMOKE = textwrap.dedent(
    """
    import torch, triton, triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)

    x = torch.zeros(5)
    add_one[(1,)](x, 5, BLOCK=8)
    assert x.tolist() == [1.0] * 5
    print("SMOKE-OK")
    """
)


def _interpret(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


def test_triton_kernels_under_interpreter():
    """Our kernels under Triton's interpreter against the emulated reference. Skipped only when the interpreter
    cannot run a trivial kernel on this machine; any failure of ours (a crash inside a kernel included) fails."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    smoke = _interpret(SMOKE)
    if "SMOKE-OK" not in smoke.stdout:
        pytest.skip("the Triton interpreter cannot run a trivial kernel on this machine:\n"
                    + (smoke.stderr or smoke.stdout)[-2000:])
    proc = _interpret(SCRIPT)
    if proc.returncode != 0 or "INTERP-OK" not in proc.stdout:
        pytest.fail("Triton kernels failed or disagree with the reference under the interpreter:\n"
                    + (proc.stderr or proc.stdout)[-3000:])
