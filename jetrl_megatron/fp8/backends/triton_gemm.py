"""Blockwise-scaled FP8 GEMM in Triton: C (M,N) = sum over 128-wide K blocks of (A_kb . B_kb^T) * sa[m,kb] * sb[n,kb].

A (M,K) and B (N,K) are FP8 with K contiguous (both K-major, what Hopper's FP8 tensor cores need). `sa` is one FP32
scale per (row, K block) (1x128 groups); `sb` is one per (row // B_SCALE_ROWS, K block): B_SCALE_ROWS = 128 for a
128x128-block weight, 1 for a 1x128-grouped operand (WGrad). Each K block's partial product is promoted to the FP32
accumulator with its scales (the per-128 promotion that makes blockwise FP8 accurate; no fast accumulation).

Modes:
- fastest: per-M-bucket tile configs and, for small M, split-K (each split writes an FP32 partial; a second kernel
  sums the splits in a fixed order, so results are deterministic but depend on the split count).
- batch-invariant: one fixed tile config for every M, no split-K, the K blocks reduced in ascending order; M is not a
  compile-time specialization. A row's output bits then depend only on that row's inputs, never on how many rows share
  the launch (decode M = running sequences vs trainer M = all tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_K = 128


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    split_k: int = 1
    pipe: bool = False  # promote the previous K block's partial while the next block's MMA runs

    def key(self) -> str:
        return (f"m{self.block_m}n{self.block_n}g{self.group_m}w{self.num_warps}s{self.num_stages}"
                f"k{self.split_k}{'p' if self.pipe else ''}")


# The configs batch-invariant mode always uses, one per GEMM form, never chosen per M (the configs the H200 batch
# invariance test and bench/RESULTS.md ran with; any fixed config is invariant, these are near the fastest).
BATCH_INVARIANT_CONFIGS = {
    "fprop": GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4, pipe=True),
    "dgrad": GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4, pipe=True),
    "wgrad": GemmConfig(block_m=128, block_n=128, group_m=16, num_warps=8, num_stages=3),
}


@triton.jit
def _promote(acc, part, sa, sb, SA_SCALAR: tl.constexpr, SB_SCALAR: tl.constexpr):
    """acc += part * sa (x) sb, one FFMA per element when either side is a single 128-block scale."""
    if SA_SCALAR and SB_SCALAR:
        acc += part * (sa * sb)
    elif SB_SCALAR:
        acc += part * (sa * sb)[:, None]
    elif SA_SCALAR:
        acc += part * (sb * sa)[None, :]
    else:
        acc += part * (sa[:, None] * sb[None, :])
    return acc


@triton.jit(do_not_specialize=["M", "stride_sam", "stride_sak"])
def _blockwise_fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr,
    M, N, K, k_tiles_per_split,
    stride_am, stride_bn, stride_cs, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ON_M: tl.constexpr,
    PIPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped tile order: GROUP_M row-tiles share each B column-tile while it is hot in L2.
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.where(offs_m < M, offs_m, 0)  # out-of-range rows read row 0 and are never stored
    rows_b = tl.where(offs_n < N, offs_n, 0)
    offs_k = tl.arange(0, BLOCK_K)

    kt_begin = pid_k * k_tiles_per_split
    kt_end = tl.minimum(kt_begin + k_tiles_per_split, K // BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + (kt_begin * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + rows_b[:, None].to(tl.int64) * stride_bn + (kt_begin * BLOCK_K + offs_k)[None, :]
    SA_SCALAR: tl.constexpr = A_SCALE_ROWS >= BLOCK_M  # the whole M tile lies inside one 128-row block
    SB_SCALAR: tl.constexpr = B_SCALE_ROWS >= BLOCK_N
    if SA_SCALAR:
        sa_ptrs = sa_ptr + ((pid_m * BLOCK_M) // A_SCALE_ROWS) * stride_sam + kt_begin * stride_sak
    else:
        sa_ptrs = sa_ptr + (rows_a // A_SCALE_ROWS) * stride_sam + kt_begin * stride_sak
    if SB_SCALAR:
        sb_ptrs = sb_ptr + ((pid_n * BLOCK_N) // B_SCALE_ROWS) * stride_sbn + kt_begin * stride_sbk
    else:
        sb_ptrs = sb_ptr + (rows_b // B_SCALE_ROWS) * stride_sbn + kt_begin * stride_sbk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PIPE:
        prev = tl.dot(tl.load(a_ptrs), tl.trans(tl.load(b_ptrs)))
        prev_sa = tl.load(sa_ptrs)
        prev_sb = tl.load(sb_ptrs)
        for _ in range(kt_begin + 1, kt_end):
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
            sa_ptrs += stride_sak
            sb_ptrs += stride_sbk
            part = tl.dot(tl.load(a_ptrs), tl.trans(tl.load(b_ptrs)))
            acc = _promote(acc, prev, prev_sa, prev_sb, SA_SCALAR, SB_SCALAR)
            prev = part
            prev_sa = tl.load(sa_ptrs)
            prev_sb = tl.load(sb_ptrs)
        acc = _promote(acc, prev, prev_sa, prev_sb, SA_SCALAR, SB_SCALAR)
    else:
        for _ in range(kt_begin, kt_end):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            sa = tl.load(sa_ptrs)
            sb = tl.load(sb_ptrs)
            acc = _promote(acc, tl.dot(a, tl.trans(b)), sa, sb, SA_SCALAR, SB_SCALAR)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
            sa_ptrs += stride_sak
            sb_ptrs += stride_sbk

    if HAS_BIAS:
        if BIAS_ON_M:
            acc += tl.load(bias_ptr + rows_a).to(tl.float32)[:, None]
        else:
            acc += tl.load(bias_ptr + rows_b).to(tl.float32)[None, :]
    c_ptrs = (c_ptr + pid_k.to(tl.int64) * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm
              + offs_n[None, :].to(tl.int64) * stride_cn)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(ws_ptr, c_ptr, bias_ptr, MN, N, stride_cm, stride_cn, SPLIT_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BIAS_ON_M: tl.constexpr, BLOCK: tl.constexpr):
    """c[i, j] = sum_{s ascending} ws[s, i, j] (+ bias): deterministic for a given split count."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    i = offs // N
    j = offs % N
    if HAS_BIAS:
        if BIAS_ON_M:
            acc += tl.load(bias_ptr + i, mask=mask, other=0.0).to(tl.float32)
        else:
            acc += tl.load(bias_ptr + j, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + i.to(tl.int64) * stride_cm + j * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def blockwise_fp8_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, *,
                       b_scale_rows: int, config: GemmConfig, bias: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.bfloat16, a_scale_rows: int = 1,
                       out: torch.Tensor | None = None, transpose_out: bool = False) -> torch.Tensor:
    """C (M,N) = A (M,K) . B (N,K)^T with blockwise scales; A and B must have unit stride along K, K % 128 == 0.

    sa: (ceil(M/a_scale_rows), K/128), sb: (ceil(N/b_scale_rows), K/128), any strides. transpose_out=True stores
    C^T into `out` (N,M) instead (the swap-AB trick for small M: the weight fills the MMA's M side)."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k or k % BLOCK_K:
        raise ValueError(f"blockwise_fp8_gemm: A {tuple(a.shape)} and B {tuple(b.shape)} need equal K, a multiple of "
                         f"{BLOCK_K}")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError(f"blockwise_fp8_gemm: operands must be K-contiguous; strides A {a.stride()} B {b.stride()}")
    k_tiles = k // BLOCK_K
    split = max(1, min(config.split_k, k_tiles))
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)
    out_shape = (n, m) if transpose_out else (m, n)
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if split == 1:
        target, stride_cs = out, 0
        stride_cm, stride_cn = (out.stride(1), out.stride(0)) if transpose_out else (out.stride(0), out.stride(1))
    else:
        target = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        stride_cs, stride_cm, stride_cn = target.stride()
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    has_bias = bias is not None and split == 1
    _blockwise_fp8_gemm_kernel[grid](
        a, b, target, sa, sb, bias if has_bias else sa,
        m, n, k, per_split,
        a.stride(0), b.stride(0), stride_cs, stride_cm, stride_cn,
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        A_SCALE_ROWS=a_scale_rows, B_SCALE_ROWS=b_scale_rows, HAS_BIAS=has_bias, BIAS_ON_M=transpose_out,
        PIPE=config.pipe, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=BLOCK_K, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        ocm, ocn = (out.stride(1), out.stride(0)) if transpose_out else (out.stride(0), out.stride(1))
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            target, out, bias if bias is not None else target, m * n, n, ocm, ocn, SPLIT_K=split,
            HAS_BIAS=bias is not None, BIAS_ON_M=transpose_out, BLOCK=block, num_warps=4)
    return out
