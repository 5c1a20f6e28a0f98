"""The linear layer of the experiment-only stress formats (``fp8/stress.py``): one forward shared by the vLLM
stress method (rollout) and the trainer's unified-arm linears, and a straight-through backward for the trainer.

Why one function on both sides: the unified arm's rollout must be a sub-graph of its training forward, as the FP8
flow's is (``fp8/linear.py``), so that its trainer-vs-rollout mismatch is zero on CPU whatever the format.
"""

from __future__ import annotations

import torch

from jetrl_megatron.fp8.stress import StressFormat, dequantize, quantize_act, quantize_weight


def refuse_cuda(t: torch.Tensor, fmt: StressFormat) -> None:
    """The stress formats are CPU experiments (emulated GEMMs, no kernels): a CUDA tensor is an error."""
    if t.is_cuda:
        raise RuntimeError(f"stress format {fmt.name}: experiment-only and CPU-only (emulated FP64 GEMM); got a CUDA "
                           f"tensor of shape {tuple(t.shape)}. Unset policy.jet_rl.stress.format for GPU runs")


def stress_gemm(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """sum over K groups j of (xs[:, j] ws[:, j]^T) * (xq[:, group j] @ wq[:, group j]^T), in FP64, groups in order.

    Codes: xq (M, K), wq (N, K); scales xs (M, G), ws (N, G). Within a group the partial sum of code products is
    exact (E4M3: multiples of 2**-18 below 2**18 each; E2M1: of 1/4 below 36; INT4: integers), so it cannot depend
    on the summation order BLAS picks for a given M; the scaling and the group sum are element-wise in a fixed order.
    """
    m, k = xq.shape
    n, groups = wq.shape[0], ws.shape[1]
    if wq.shape[1] != k or xs.shape != (m, groups) or ws.shape != (n, groups) or k % groups:
        raise ValueError(f"stress_gemm: codes x {tuple(xq.shape)} / w {tuple(wq.shape)} and scales x "
                         f"{tuple(xs.shape)} / w {tuple(ws.shape)} do not fit one another")
    g = k // groups
    x64, w64, xs64, ws64 = xq.double(), wq.double(), xs.double(), ws.double()
    acc = torch.zeros(m, n, dtype=torch.float64, device=xq.device)
    for j in range(groups):
        cols = slice(j * g, (j + 1) * g)
        acc += (x64[:, cols] @ w64[:, cols].T) * (xs64[:, j : j + 1] * ws64[:, j].unsqueeze(0))
    if bias is not None:
        acc = acc + bias.double()
    return acc.to(out_dtype)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, fmt: StressFormat) -> None:
    """CPU only (the formats have no GPU kernel), and x's last dim is the weight's K."""
    refuse_cuda(x, fmt)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"stress linear ({fmt.name}): x has last dim {x.shape[-1]}, the weight "
                         f"{tuple(weight.shape)} expects {weight.shape[1]}")


def stress_linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          fmt: StressFormat) -> torch.Tensor:
    """y = Q(x) Q(W)^T (+ b) with both operands quantized in ``fmt``, no autograd; x (..., K), weight (N, K)."""
    _check_operands(x, weight, fmt)
    x2d = x.reshape(-1, x.shape[-1])
    y = stress_gemm(*quantize_act(x2d, fmt), *quantize_weight(weight, fmt), bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _StressLinearFunction(torch.autograd.Function):
    """Forward: ``stress_linear_forward``. Backward: straight through the quantizers (their derivative taken as
    1), BF16 GEMMs on the quantize-dequantized operands, dW to the BF16 master."""

    @staticmethod
    def forward(ctx, x, weight, bias, fmt):
        x2d = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_act(x2d, fmt)
        wq, ws = quantize_weight(weight.detach(), fmt)
        y = stress_gemm(xq, xs, wq, ws, bias, x.dtype)
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
