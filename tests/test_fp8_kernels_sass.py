"""CPU: the quant kernels compiled offline for sm_90 (bench/sass_counts.py) keep one division per scale, not per value.

Why: a correctly rounded FP32 division per element was ~40% of the instructions of the token-grouped kernels, which
are instruction-bound on Hopper; `_quotient` replaced it with a reciprocal per scale and two FMAs (bit-identical:
tests/test_fp8_kernels_quotient.py). A change that brings a per-element division back shows here as the division's
slow-path calls, one per element. Also: the quotient's negations compile to true sign flips (the PTX), which
Triton 3.6's unary minus did not. Needs only Triton's bundled ptxas / cuobjdump, no GPU.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

triton = pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))


def test_quant_weight_divides_once_per_tile_offline_sm90():
    import sass_counts

    from jetrl_megatron.fp8 import kernels

    if not os.path.exists(os.path.join(sass_counts.TOOLS, "cuobjdump")):
        pytest.skip("this Triton build ships no cuobjdump")
    label, kernel, consts, ptrs, warps, per_thread = next(v for v in sass_counts.variants(kernels)
                                                          if v[0].startswith("quant_weight"))
    compiled = sass_counts.compile_sm90(getattr(kernels, kernel), consts, ptrs, warps)
    counts = sass_counts.op_counts(sass_counts.sass_of(compiled))
    # 128 values per thread; two divisions per tile (the scale and its reciprocal), each with one slow-path call
    assert counts["CALL"] <= 4, counts
    assert counts["instr"] < 20 * per_thread, counts
    # The quotient's negations are true sign flips: a negation lowered as 0 - v (Triton 3.6's unary minus) makes
    # -(+0) = +0 and lost every -0 code's sign on the GPU; it shows in the PTX as a subtraction (the kernel has no
    # other), where each value's two negations should be neg.f32 (this fails under Triton 3.6 before the fix).
    ptx = compiled.asm["ptx"]
    assert not re.findall(r"^\s*sub(?:\.rn)?\.f32\s", ptx, re.M), "a float subtraction: a negation lowered as 0 - v?"
    assert len(re.findall(r"^\s*neg\.f32\s", ptx, re.M)) >= 2 * per_thread
