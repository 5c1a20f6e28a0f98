"""The INT stress formats' Triton kernels (fp8/stress_kernels.py) against their torch twins, byte for byte.

CPU: under the Triton interpreter, in a child process (tests/interpreter_child.py). GPU: the same checks on CUDA at
count_150m_gpu's linear shapes. Inputs are random, with rows that hold exact rounding ties (x / scale = k + 1/2),
all-zero rows, a NaN, and scales of very different sizes per row.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from jetrl_megatron.fp8 import stress_kernels
from jetrl_megatron.fp8.stress import quantize_act, quantize_weight, stress_format
from jetrl_megatron.fp8.stress_linear import quantize_act_codes, stress_gemm, stress_linear_forward

INT_FORMATS = ("int4_tensor", "int3_tensor", "int4_g128")


def _activation(m: int, k: int, device: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m).unsqueeze(1)  # row magnitudes 1e-3 .. 1e2
    if m > 3:
        # row 1: amax 7 (scale 1 for int4: ties at every half-integer), row 2: all zeros, row 3: one NaN
        x[1] = torch.arange(k).remainder(15).float() * 0.5 - 3.5
        x[1, 0] = 7.0
        x[2] = 0.0
        x[3, k // 2] = float("nan")
    return x.to(dtype).to(device)


def check_codes(device: str, shapes=((37, 256), (1, 128), (130, 768), (5, 3072))) -> str:
    """int_codes == quantize_act (codes as values, scales bit for bit, NaN where the twin has NaN)."""
    done = 0
    for fmt_name in INT_FORMATS:
        fmt = stress_format(fmt_name)
        for i, (m, k) in enumerate(shapes):
            for dtype in (torch.bfloat16, torch.float32):
                x = _activation(m, k, device, dtype, seed=i)
                assert stress_kernels.int_codes_supported(x, fmt)
                q, s = stress_kernels.int_codes(x, fmt)
                q_ref, s_ref = quantize_act(x, fmt)
                assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == s_ref.shape
                assert torch.equal(q.float(), q_ref), (fmt_name, m, k, dtype, (q.float() - q_ref).abs().max())
                assert torch.equal(s.isnan(), s_ref.isnan()), (fmt_name, m, k, dtype)
                assert torch.equal(s.nan_to_num(), s_ref.nan_to_num()), (fmt_name, m, k, dtype)
                if m > 3 and fmt_name == "int4_tensor":  # the tie row: -2.5, -1.5, -0.5 -> the even -2, -2, 0
                    assert s[1].item() == 1.0 and q[1, 1:8].tolist() == [-3, -2, -2, -2, -1, 0, 0], q[1, :8]
                done += 1
    return f"int codes: {done} cases equal the torch twin"


def check_scaled_products(device: str, shapes=((37, 256, 384), (17, 128, 128), (200, 1024, 96))) -> str:
    """The one-group INT GEMM through the kernel (stress_gemm's integer path) == the FP64 GEMM and torch's scaled
    sum (integer_codes=False), with and without bias, BF16 and FP32 outputs; and the whole stress linear."""
    done = 0
    for fmt_name in ("int4_tensor", "int3_tensor"):
        fmt = stress_format(fmt_name)
        for i, (m, k, n) in enumerate(shapes):
            x = _activation(m, k, device, torch.bfloat16, seed=10 + i).nan_to_num()
            w = (torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.05).to(torch.bfloat16).to(device)
            bias = torch.randn(n, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16).to(device)
            xq, xs = quantize_act_codes(x, fmt)
            wq, ws = quantize_weight(w, fmt)
            for b in (None, bias):
                for out in (torch.bfloat16, torch.float32):
                    y = stress_gemm(xq, xs, wq, ws, b, out, integer_codes=True)
                    ref = stress_gemm(xq.float(), xs, wq, ws, b, out, integer_codes=False)
                    assert y.dtype == out and torch.equal(y, ref), (fmt_name, m, k, n, out, (y - ref).abs().max())
                    done += 1
            # the linear as the rollout and the trainer call it, against the twins composed by hand in torch
            y = stress_linear_forward(x, w, bias, fmt)
            ref = stress_gemm(*quantize_act(x, fmt), wq.float(), ws, bias, x.dtype, integer_codes=False)
            assert torch.equal(y, ref), (fmt_name, m, k, n)
    return f"scaled int products: {done} cases equal the torch twin"


# ----------------------------------------------------------------------------------------------------- tests
def test_int_stress_kernels_under_interpreter():
    from interpreter_child import run_module_under_interpreter

    out = run_module_under_interpreter(__file__, "the INT stress kernels differ from their torch twins",
                                       timeout=300)
    assert "int codes:" in out and "scaled int products:" in out


def test_plain_cpu_tensors_take_the_torch_twins(monkeypatch):
    """No interpreter, CPU tensors: the kernels are not offered, and the linear runs the twins."""
    if stress_kernels.triton is not None and stress_kernels.interpreting():
        pytest.skip("this process runs the Triton interpreter")
    fmt = stress_format("int4_tensor")
    x = _activation(8, 256, "cpu", torch.bfloat16, seed=0)
    assert not stress_kernels.int_codes_supported(x, fmt)
    q, _ = quantize_act_codes(x, fmt)
    assert q.dtype == torch.float32  # the twin's FP32 codes


def test_the_kernels_refuse_what_they_do_not_take():
    fmt = stress_format("mxfp4")
    x = torch.zeros(4, 128)
    with pytest.raises(ValueError, match="int_codes: format mxfp4"):
        stress_kernels.int_codes(x, fmt)
    with pytest.raises(ValueError, match="scaled_int_products: products torch.float32"):
        stress_kernels.scaled_int_products(torch.zeros(4, 8), torch.ones(4, 1), torch.ones(8, 1), None,
                                           torch.bfloat16)


def _sm90_ptx(fn, signature: dict[str, str], constexprs: dict) -> str:
    """``fn`` compiled for sm_90 with the project's launch options (Triton's CUDA backend compiles without a GPU)."""
    pytest.importorskip("triton")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        pytest.skip(f"this triton cannot compile for CUDA here: {e}")
    from jetrl_megatron.fp8.triton_common import launch_opts

    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, **launch_opts()}).asm["ptx"]


def test_the_compiled_kernels_round_as_the_twins():
    """The sm_90 PTX rounds every step as the torch twins: IEEE FP32 division (``div.rn``, no approximate one) in
    the codes kernel; in the epilogue FP64 multiplies and adds each rounded on its own (no FMA), then FP64 -> FP32 ->
    BF16 with round-to-nearest-even conversions (torch's cast from FP64)."""
    ints = dict.fromkeys(("M", "GROUP", "stride_xm", "stride_qm", "stride_sm"), "i32")
    codes = _sm90_ptx(stress_kernels._int_codes_kernel,
                      {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", **ints, "eps": "fp32", "qmax": "fp32"},
                      {"BLOCK_M": 4, "CHUNK": 1024})
    assert "div.rn.f32" in codes and "div.full" not in codes and "div.approx" not in codes and "fma." not in codes
    for has_bias, out in ((True, "bf16"), (False, "fp32")):
        epi = _sm90_ptx(stress_kernels._scaled_products_kernel,
                        {"p_ptr": "*i32", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": f"*{out}",
                         **dict.fromkeys(("M", "N", "stride_pm", "stride_ym"), "i32")},
                        {"HAS_BIAS": has_bias, "OUT_BF16": out == "bf16", "EMU_BF16": False, "BLOCK_M": 32,
                         "BLOCK_N": 128})
        assert "fma." not in epi and "mul.rn.f64" in epi and "cvt.rn.f32.f64" in epi, (has_bias, out)
        assert ("add.rn.f64" in epi) == has_bias and ("cvt.rn.bf16.f32" in epi) == (out == "bf16"), (has_bias, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int_stress_kernels_gpu():
    print(check_codes("cuda", shapes=((16512, 1024), (16512, 3072), (37, 256), (1, 128), (5, 3072))))
    print(check_scaled_products("cuda", shapes=((16512, 1024, 6144), (33, 3072, 1024), (17, 128, 128),
                                                (1, 256, 384))))


def _interpreter_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert stress_kernels.interpreting()
    print(check_codes("cpu"))
    print(check_scaled_products("cpu"))
    print("INTERP-OK")


if __name__ == "__main__":
    _interpreter_main()
