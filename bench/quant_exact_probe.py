"""GPU: which part of the FP8 quantization kernels departs from the torch reference (a diagnosis aid).

Variants of fp8/kernels.py are built by replacing one device helper at a time (the quotient by IEEE division, the amax
by the two-reduction form, the clamp before the E4M3 cast) and each is run on the inputs of
tests/test_fp8_kernels_gpu.py; differing bytes are counted, and for the tree's kernels the first differing elements
are printed with their input, scales and the float64 quotient. Each variant is also timed at a Qwen3-8B shape.
`--pytest` runs the GPU test file against one variant (several processes can run side by side on one GPU).

Written when the division-free quotient lost the sign of -0 on the GPU under Triton 3.6 (its unary minus is 0 - v;
fp8/kernels.py `_negate`): exact zeros are where such a difference shows, and random-value tests rarely hold them.

    python bench/quant_exact_probe.py [--out DIR] [--variants tree,amax] [--no-time]
    python bench/quant_exact_probe.py --variants amax --pytest tests/test_fp8_kernels_gpu.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile

import torch

from jetrl_megatron.fp8 import quant as Q
from jetrl_megatron.recipe import Fp8Recipe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_fp8_kernels_gpu import pad_t, rand_groups, specials  # noqa: E402  (the GPU tests' own inputs)

RECIPES = {"fp32": Fp8Recipe(scale_fmt="fp32"), "pow2": Fp8Recipe(scale_fmt="pow2")}
DIV_QUOTIENT = '''def _quotient(x, s_fin, r):
    """IEEE division (probe variant)."""
    return tl.div_rn(x, tl.where(s_fin == 0.0, float("inf"), s_fin))
'''
OLD_AMAX = '''def _nan_aware_amax(xf, axis: tl.constexpr):
    """two reductions (probe variant)."""
    amax = tl.max(tl.abs(xf), axis=axis)
    has_nan = tl.max((xf != xf).to(tl.int32), axis=axis)
    return tl.where(has_nan > 0, float("nan"), amax)
'''


def _variant(src: str, name: str) -> object:
    if "div" in name:
        src = re.sub(r"def _quotient\(x, s_fin, r\):\n(?:    .*\n|\n)+?(?=\n@triton)", DIV_QUOTIENT, src)
    if "amax" in name:
        src = re.sub(r"def _nan_aware_amax\(xf, axis: tl.constexpr\):\n(?:    .*\n)+?(?=\n\n@triton)", OLD_AMAX, src)
    if "clamp" in name:
        src = src.replace("    if CAST:\n        y = y.to(tl.float8e4nv",
                          "    if CAST:\n        y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)"
                          ".to(tl.float8e4nv")
    path = os.path.join(tempfile.mkdtemp(), f"k_{name}.py")
    with open(path, "w") as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location(f"k_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _diff(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got.contiguous().view(torch.uint8) != ref.contiguous().view(torch.uint8)).nonzero()


def _show(idx, x, got, ref, s_got, s_ref, group_axis) -> list[str]:
    lines = []
    for i, j in idx[:6].tolist():
        g = (j // 128) if group_axis == 1 else None
        sg = s_got[i, g].item() if g is not None else float("nan")
        sr = s_ref[i, g].item() if g is not None else float("nan")
        xv = x[i, j].item()
        code_k, code_r = got.view(torch.uint8)[i, j].item(), ref.view(torch.uint8)[i, j].item()
        lines.append(f"    [{i},{j}] x={xv!r} s_kernel={sg!r} s_ref={sr!r} x/s(f64)={xv / sr if sr else 0:.10g} "
                     f"code kernel={code_k:#04x} ref={code_r:#04x}")
    return lines


def cases(k, verbose: bool) -> dict:
    out = {}
    for fmt, recipe in RECIPES.items():
        x = rand_groups(4100, 4096, seed=3)
        qr, sr = Q.quantize_1x128(x, recipe)
        qt, st = k.regroup_for_wgrad(qr, sr.t().contiguous().t(), recipe)
        xd = pad_t(Q.dequantize_1x128(qr, sr, torch.float32)).contiguous()
        ref_q, ref_s = Q.quantize_1x128(xd, recipe)
        d = _diff(qt, ref_q)
        out[f"regroup_16m_{fmt}"] = {"bytes": len(d), "scales": int((st != ref_s).sum())}
        if verbose and len(d):
            print(f"  regroup {fmt}:")
            print("\n".join(_show(d, xd, qt, ref_q, st, ref_s, 1)))
        for vec in (0, 4):
            qt, st = k.regroup_for_wgrad(qr, sr, recipe, trans_mode=2, feats=32, num_warps=4, load_vec=vec)
            out[f"regroup_t2f32v{vec}_{fmt}"] = {"bytes": len(_diff(qt, ref_q))}
        for dt in (torch.float32, torch.bfloat16):
            xs = specials(with_nonfinite=False).to(dt)
            qr2, sr2 = Q.quantize_1x128(xs, recipe)
            q2, s2 = k.quant_act(xs, recipe)
            d = _diff(q2, qr2)
            out[f"specials_act_{fmt}_{str(dt)[6:]}"] = {"bytes": len(d), "scales": int((s2 != sr2).sum())}
            if verbose and len(d):
                print(f"  specials quant_act {fmt} {dt}:")
                print("\n".join(_show(d, xs.float(), q2, qr2, s2, sr2, 1)))
    return out


def _ms(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def timings(k) -> dict:
    """Microseconds of each kernel at a Qwen3-8B shape (16384 tokens x 4096; the 24576 x 4096 gate/up weight)."""
    recipe = RECIPES["fp32"]
    x = torch.randn(16384, 4096, device="cuda").to(torch.bfloat16)
    xq, xs = k.quant_act(x, recipe)
    w = (torch.randn(24576, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    cases = {"quant_act": lambda: k.quant_act(x, recipe), "quant_dual": lambda: k.quant_dual(x, recipe),
             "regroup t2 f32 w4 v4": lambda: k.regroup_for_wgrad(xq, xs, recipe, trans_mode=2, feats=32, num_warps=4,
                                                                  load_vec=4),
             "quant_weight+T": lambda: k.quant_weight(w, recipe, with_transpose=True)}
    return {name: round(1e3 * _ms(fn), 1) for name, fn in cases.items()}


VARIANTS = ("tree", "div", "amax", "clamp", "div_amax_clamp")


def _module(name: str):
    from jetrl_megatron.fp8 import kernels

    return kernels if name == "tree" else _variant(open(kernels.__file__).read(), name)


def run_tests(name: str, test_file: str) -> int:
    """The GPU test file against one variant: the variant stands in for jetrl_megatron.fp8.kernels."""
    import pytest

    import jetrl_megatron.fp8 as fp8_pkg

    mod = _module(name)
    sys.modules["jetrl_megatron.fp8.kernels"] = mod
    fp8_pkg.kernels = mod
    return int(pytest.main(["-q", "-p", "no:cacheprovider", test_file]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    ap.add_argument("--pytest", default=None, metavar="TEST_FILE", help="run this test file against --variants (one)")
    ap.add_argument("--no-time", action="store_true", help="skip the timings (other GPU work runs alongside)")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    if args.pytest:
        return run_tests(names[0], args.pytest)
    results = {}
    for name in names:
        mod = _module(name)
        print(f"== {name}", flush=True)
        results[name] = cases(mod, verbose=name == "tree")
        if not args.no_time:
            results[name]["us"] = timings(mod)
        print(json.dumps(results[name]), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quant_exact_probe.json"), "w") as fh:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
