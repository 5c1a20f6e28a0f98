"""The linear layer of the experiment-only stress formats (``fp8/stress.py``): one forward shared by the vLLM
stress method (rollout) and the trainer's unified-arm linears, and a straight-through backward for the trainer.

Why one function on both sides: the unified arm's rollout must be a sub-graph of its training forward, as the FP8
flow's is (``fp8/linear.py``), so that its trainer-vs-rollout mismatch is zero on CPU whatever the format.
"""

from __future__ import annotations

import torch

from jetrl_megatron.fp8 import stress_kernels
from jetrl_megatron.fp8.stress import StressFormat, dequantize, quantize_act, quantize_weight

# formats whose codes are integers: a K group's code products sum exactly in int32, on int8 tensor cores
INTEGER_ELEMENTS = ("int4", "int3")


def _int8_products(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor | None:
    """xq (M, k) @ wq (N, k)^T for integer codes in [-127, 127], exact (int32 accumulation: |sum| < k * 49), as FP64;
    None where ``torch._int_mm`` cannot take these sizes (then the FP64 GEMM computes the same numbers)."""
    products = _int32_products(xq, wq)
    return None if products is None else products.double()


def _int32_products(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor | None:
    """``_int8_products`` as the int32 GEMM output itself."""
    m, k = xq.shape
    n = wq.shape[0]
    if k % 8 or n % 8 or (xq.is_cuda and k <= 16):
        return None
    a = xq.to(torch.int8)
    pad = 17 - m if xq.is_cuda and m <= 16 else 0  # the CUDA kernel takes more than 16 rows; zero rows add nothing
    if pad:
        a = torch.cat((a, a.new_zeros(pad, k)))
    try:
        out = torch._int_mm(a.contiguous(), wq.to(torch.int8).contiguous().t())
    except RuntimeError:  # a build without this int8 GEMM
        return None
    return out[:m]


def stress_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, integer_codes: bool = False) -> torch.Tensor:
    """sum over K groups j of (xs[:, j] ws[:, j]^T) * (xq[:, group j] @ wq[:, group j]^T), in FP64, groups in order.

    Codes: xq (M, K), wq (N, K); scales xs (M, G), ws (N, G). Within a group the partial sum of code products is
    exact (E4M3: multiples of 2**-18 below 2**18 each; E2M1: of 1/4 below 36; INT4: integers), so it cannot depend
    on the summation order BLAS picks for a given M; the scaling and the group sum are element-wise in a fixed order.
    ``integer_codes`` (INT formats): each group's products come from an int8 GEMM with int32 accumulation, the same
    exact integers as the FP64 GEMM (bit-identical result), at tensor-core speed on the GPU.
    """
    m, k = xq.shape
    n, groups = wq.shape[0], ws.shape[1]
    if wq.shape[1] != k or xs.shape != (m, groups) or ws.shape != (n, groups) or k % groups:
        raise ValueError(f"stress_gemm: codes x {tuple(xq.shape)} / w {tuple(wq.shape)} and scales x "
                         f"{tuple(xs.shape)} / w {tuple(ws.shape)} do not fit one another")
    g = k // groups
    if integer_codes and groups == 1 and stress_kernels.runs_on(xq):  # one K group: the scaled sum in one kernel
        products = _int32_products(xq, wq)
        if products is not None and stress_kernels.scaled_products_supported(products, out_dtype):
            return stress_kernels.scaled_int_products(products, xs, ws, bias, out_dtype)
    xs64, ws64 = xs.double(), ws.double()
    acc = torch.zeros(m, n, dtype=torch.float64, device=xq.device)
    for j in range(groups):
        cols = slice(j * g, (j + 1) * g)
        part = _int8_products(xq[:, cols], wq[:, cols]) if integer_codes else None
        if part is None:
            part = xq[:, cols].double() @ wq[:, cols].double().T
        acc += part * (xs64[:, j : j + 1] * ws64[:, j].unsqueeze(0))
    if bias is not None:
        acc = acc + bias.double()
    return acc.to(out_dtype)


def quantize_act_codes(x2d: torch.Tensor, fmt: StressFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act``'s codes and scales; for the INT formats on CUDA from one kernel, as int8 codes (the same
    values: the GEMM reads int8, ``dequantize`` any dtype)."""
    if stress_kernels.int_codes_supported(x2d, fmt):
        return stress_kernels.int_codes(x2d, fmt)
    return quantize_act(x2d, fmt)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, fmt: StressFormat) -> None:
    """x's last dim is the weight's K."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"stress linear ({fmt.name}): x has last dim {x.shape[-1]}, the weight "
                         f"{tuple(weight.shape)} expects {weight.shape[1]}")


def stress_linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          fmt: StressFormat) -> torch.Tensor:
    """y = Q(x) Q(W)^T (+ b) with both operands quantized in ``fmt``, no autograd; x (..., K), weight (N, K)."""
    return stress_linear_forward_quantized(x, *quantize_weight(weight, fmt), bias, fmt)


def weight_code_storage(fmt: StressFormat) -> torch.dtype:
    """The narrowest dtype that holds every weight code of ``fmt`` exactly: int8 for the INT formats (what the int8
    GEMM reads), BF16 for the others (E4M3, E5M2 and E2M1 values need at most 3 mantissa bits and exponents in
    [-16, 15], inside BF16's 7 bits and 8-bit exponent)."""
    return torch.int8 if fmt.element in INTEGER_ELEMENTS else torch.bfloat16


def stress_linear_forward_quantized(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
                                    fmt: StressFormat) -> torch.Tensor:
    """``stress_linear_forward`` with the weight already quantized (``quantize_weight``'s codes, in FP32 or
    ``weight_code_storage``, and scales): the rollout quantizes a weight once per refit, not at every call."""
    _check_operands(x, wq, fmt)
    x2d = x.reshape(-1, x.shape[-1])
    y = stress_gemm(*quantize_act_codes(x2d, fmt), wq, ws, bias, x.dtype, fmt.element in INTEGER_ELEMENTS)
    return y.reshape(*x.shape[:-1], wq.shape[0])


class _StressLinearFunction(torch.autograd.Function):
    """Forward: ``stress_linear_forward``. Backward: straight through the quantizers (their derivative taken as
    1), BF16 GEMMs on the quantize-dequantized operands, dW to the BF16 master."""

    @staticmethod
    def forward(ctx, x, weight, bias, fmt):
        x2d = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_act_codes(x2d, fmt)
        wq, ws = quantize_weight(weight.detach(), fmt)
        y = stress_gemm(xq, xs, wq, ws, bias, x.dtype, fmt.element in INTEGER_ELEMENTS)
        ctx.save_for_backward(dequantize(xq, xs, x.dtype), dequantize(wq, ws, weight.dtype))
        ctx.x_shape, ctx.has_bias, ctx.weight_dtype = x.shape, bias is not None, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x_fq, w_fq = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = (dy2d @ w_fq.to(dy.dtype)).reshape(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw = (dy2d.t() @ x_fq.to(dy.dtype)).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        db = dy2d.float().sum(0).to(ctx.weight_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def stress_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  fmt: StressFormat) -> torch.Tensor:
    """Autograd stress linear (the unified arm's trainer GEMM): fake-quant forward, straight-through gradients."""
    _check_operands(x, weight, fmt)
    return _StressLinearFunction.apply(x, weight, bias, fmt)
