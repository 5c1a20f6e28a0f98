"""cuBLASLt blockwise FP8 GEMMs through `torch.nn.functional.scaled_mm` (torch >= 2.10, SM90, cuBLASLt >= 12.9).

FProp/DGrad are BlockWise1x128 x BlockWise128x128, WGrad is BlockWise1x128 x BlockWise1x128. Layout rules
(docs/precision.md): A row-major, B the `.t()` view of a row-major (out, red) tensor; 1x128 scales column-major;
the 128x128 scale is the `.t()` view of a row-major (ceil(out/128), L4) tensor whose K-block dim is zero-padded
to a multiple of 4.
The old `torch._scaled_mm` is never used here: with 128x128 scales and ceil(K/128) % 4 != 0 it is silently wrong.
cuBLAS may pick different kernels for different M, so this backend has no batch-invariant mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetrl_megatron.fp8.backends._layout import col_major, contiguous_codes, derived, pad_cols4
from jetrl_megatron.fp8.kernels import transpose_fp8

_M_ALIGN = 16
_pad_small_m = False  # learned: set once if cuBLAS rejects an unaligned M


def available() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"))


def _mm(a, b, sa, recipe_b, sb, out_dtype):
    st = F.ScalingType
    return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)


def _mm_any_m(a, b, sa, recipe_b, sb, out_dtype):
    """Run the GEMM; if cuBLAS refuses this M (alignment), pad rows with zero codes and unit scales."""
    global _pad_small_m
    m = a.shape[0]
    if not (_pad_small_m and m % _M_ALIGN):
        try:
            return _mm(a, b, sa, recipe_b, sb, out_dtype)
        except RuntimeError:
            if m % _M_ALIGN == 0:
                raise
            _pad_small_m = True
    extra = -(-m // _M_ALIGN) * _M_ALIGN - m
    a_pad = F.pad(a.view(torch.uint8), (0, 0, 0, extra)).view(a.dtype)
    sa_pad = F.pad(sa.t(), (0, extra), value=1.0)  # (G, Mp) contiguous: its .t() has strides (1, Mp)
    return _mm(a_pad, b, sa_pad.t(), recipe_b, sb, out_dtype)[:m]


def fprop(xq, xs, wq, ws, *, bias=None, out_dtype=torch.bfloat16):
    """Y (M,N) = Xq (M,K) . Wq (N,K)^T, xs 1x128, ws 128x128."""
    wq = contiguous_codes(wq)
    sb = derived(ws, "cublas_fprop_l4", lambda s: pad_cols4(s.float().contiguous())).t()
    out = _mm_any_m(contiguous_codes(xq), wq.t(), col_major(xs), F.ScalingType.BlockWise128x128, sb, out_dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def dgrad(gq, gs, wq, ws, *, out_dtype=torch.bfloat16):
    """dX (M,K) = Gq (M,N) . Wq (N,K): B is the cached K-major copy Wq^T (K,N); the same block scales, transposed."""
    wt = derived(wq, "kmajor_t", transpose_fp8)  # (K, N) row-major
    sb = derived(ws, "cublas_dgrad_l4", lambda s: pad_cols4(s.float().t().contiguous())).t()
    return _mm_any_m(contiguous_codes(gq), wt.t(), col_major(gs), F.ScalingType.BlockWise128x128, sb, out_dtype)


def wgrad(gtq, gts, xtq, xts, *, out_dtype=torch.bfloat16):
    """dW (N,K) = GTq (N,Mp) . XTq (K,Mp)^T with both operands 1x128 along tokens."""
    return _mm_any_m(contiguous_codes(gtq), contiguous_codes(xtq).t(), col_major(gts), F.ScalingType.BlockWise1x128,
                     col_major(xts), out_dtype)
