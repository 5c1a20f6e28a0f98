"""Triton kernels for the rollout-matched element-wise ops of :mod:`jetrl_megatron.megatron.numerics` (GPU path).

Why: on GPU the torch twins in ``numerics.py`` run as chains of unfused FP32 kernels (an RMSNorm on the FP32
residual stream is ~8 passes over a 4-byte-per-element tensor). These kernels do the same arithmetic in one pass
per op, in the twins' op order and with the twins' roundings:

* every FP32 operation the twin does as a separate torch kernel is one separately rounded FP32 operation here
  (kernels are launched with ``enable_fp_fusion=False``, so no multiply-add is contracted into an FMA; checked in
  the sm90 PTX: ``mul.rn`` / ``add.rn`` / ``sub.rn`` only, FMAs only inside libdevice's ``expf``);
* ``exp`` is libdevice's ``expf`` and divisions are IEEE ``div_rn`` (PyTorch's CUDA ``silu`` / ``sigmoid`` use
  ``expf`` and ``/``; Triton's default ``exp`` / ``/`` are approximate); ``rsqrt`` is ``rsqrtf`` like ``torch.rsqrt``;
* casts to BF16 are round-to-nearest-even.

Where bit-exactness cannot hold (bounded and tested in tests/test_megatron_triton_numerics.py):

* **row / column sums** (RMSNorm's ``mean(x^2)``, the backward's ``mean(dn*n)`` and the ``dw`` sum over rows)
  add in a different order than torch's reduction kernels: the FP32 sum differs by at most ``~N * 2^-24`` of the
  sum of magnitudes (usually 0 or 1 ulp), which can flip the last bit of ``1/rms`` and so, rarely, one BF16 ulp of
  an output element (or of ``dw``).
* **transcendentals**: ``expf`` / ``rsqrtf`` are the same CUDA library functions as torch's on GPU, so exact there;
  under the Triton interpreter (CPU tests) they are numpy's, which may differ from torch-CPU's by 1 FP32 ulp.

The interpreter's own FP32->BF16 cast truncates, so under ``TRITON_INTERPRET=1`` the kernels round to BF16 with
integer bit arithmetic instead (``EMU_BF16``); on GPU the hardware's round-to-nearest-even convert is used.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from jetrl_megatron.fp8.linear import attach_input_forms
from jetrl_megatron.fp8.triton_common import interpreting
from jetrl_megatron.fp8.triton_common import launch_opts as _launch_opts
from jetrl_megatron.recipe import Fp8Recipe

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from jetrl_megatron.fp8 import kernels as fp8_kernels  # the FP8 scale rule and cast, for the fused norm + quant
    from jetrl_megatron.fp8.triton_common import round_bf16 as _round_bf16
except ImportError:  # CPU installs without triton: numerics.py keeps using its torch twins
    triton = None

__all__ = ["available", "interpreting", "rms_norm_fwd", "add_rms_norm_fwd", "rms_norm_bwd", "swiglu_fwd",
           "swiglu_bwd", "rope_fwd", "rope_bwd", "residual_add_fwd", "residual_add_bwd", "rms_norm_supported",
           "swiglu_supported", "rope_supported", "residual_add_supported"]

_FLOATS = (torch.float32, torch.bfloat16)


def available() -> bool:
    """True when triton imports (the kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1)."""
    return triton is not None


def _num_programs_cap(t: Tensor) -> int:
    if t.is_cuda:
        return 4 * torch.cuda.get_device_properties(t.device).multi_processor_count
    return 2  # interpreter: two programs, so the strided row loop and the two-stage dw sum are exercised


def _rows(x: Tensor, n: int) -> Tensor:
    """x as a (rows, n) view with unit column stride (a copy only when no such view exists)."""
    try:
        x2 = x.view(-1, n)
    except RuntimeError:
        x2 = x.reshape(-1, n)
    if x2.stride(1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < n):
        x2 = x2.contiguous()
    return x2


if triton is not None:

    @triton.jit
    def _exp(x, INTERP: tl.constexpr):
        """expf (libdevice on GPU: what torch's CUDA kernels call; tl.exp there is ex2.approx-based)."""
        if INTERP:
            return tl.exp(x)
        else:
            return libdevice.exp(x)

    @triton.jit
    def _rsqrt(x, INTERP: tl.constexpr):
        if INTERP:
            return tl.math.rsqrt(x)
        else:
            return libdevice.rsqrt(x)

    @triton.jit
    def _row_group_forms(y, Q, QS, rows, rmask, col0, stride_q, stride_qs, N, amax_eps,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POW2: tl.constexpr, CAST: tl.constexpr):
        """The 1x128 FP8 forms of the FP32 tile ``y`` (rows ``rows`` x BLOCK_N columns from ``col0``, a multiple of
        128; BLOCK_N a power of two >= 128): codes into Q (rows of stride_q), scales into QS (column-major, column
        stride stride_qs), with fp8/kernels.py's scale rule and cast: ``quant_act``'s bytes for the values y holds."""
        cols = col0 + tl.arange(0, BLOCK_N)
        mask = rmask[:, None] & (cols < N)[None, :]
        yg = tl.reshape(y, (BLOCK_M, BLOCK_N // 128, 128))
        sc = fp8_kernels._scale_from_amax(fp8_kernels._nan_aware_amax(yg, 2), amax_eps, POW2)  # (BLOCK_M, groups)
        sc_fin, rc = fp8_kernels._divisor(sc)
        qg = fp8_kernels._codes(yg, sc_fin[:, :, None], rc[:, :, None], CAST)
        tl.store(Q + rows.to(tl.int64)[:, None] * stride_q + cols[None, :], tl.reshape(qg, (BLOCK_M, BLOCK_N)),
                 mask=mask)
        gs = col0 // 128 + tl.arange(0, BLOCK_N // 128)
        tl.store(QS + rows.to(tl.int64)[:, None] + gs[None, :].to(tl.int64) * stride_qs, sc,
                 mask=rmask[:, None] & (gs[None, :] * 128 < N))

    # ------------------------------------------------------------------------------------------------ RMSNorm
    @triton.jit
    def _rms_fwd_kernel(X, R, S, W, Y, RSTD, Q, QS, n_rows, N, group, stride_xo, stride_xi, stride_r, stride_y,
                        stride_qs, eps, inv_n, amax_eps,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_N: tl.constexpr,
                        ROUND_Y: tl.constexpr, HAS_RES: tl.constexpr, ROUND_S: tl.constexpr, QUANT: tl.constexpr,
                        POW2: tl.constexpr, CAST: tl.constexpr, EMU_BF16: tl.constexpr):
        """Row r of X at (r // group) * stride_xo + (r % group) * stride_xi (group > 1: per-head norms read in place
        from a strided view). HAS_RES: first s = X + R in FP32, rounded once to S's dtype and stored in S (rows of
        stride_y), then the norm of s (vLLM's fused add + RMSNorm contract, one launch). QUANT: also y's 1x128 FP8
        codes into Q (rows of stride_y) and scales into QS (column-major, column stride stride_qs), with
        fp8/kernels.py's scale rule and cast on the values y is stored with."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        rmask = rows < n_rows
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x_off = (r64 // group) * stride_xo + (r64 % group) * stride_xi
        x = tl.load(X + x_off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            x = x + tl.load(R + r64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if ROUND_S:
                x = _round_bf16(x, EMU_BF16)
            tl.store(S + r64 * stride_y + cols[None, :], x.to(S.dtype.element_ty), mask=mask)
        ms = tl.sum(x * x, axis=1) * inv_n  # torch: x.pow(2) (x*x), then mean = sum * (1/N)
        rstd = _rsqrt(ms + eps, EMU_BF16)
        n = x * rstd[:, None]
        if ROUND_N:
            n = _round_bf16(n, EMU_BF16)  # n.to(w.dtype) with a BF16 weight
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        y = n * w[None, :]
        if ROUND_Y:
            y = _round_bf16(y, EMU_BF16)
        tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rmask)
        if QUANT:  # (BLOCK_N a power of two >= 128 here: the host enables it for N % 128 == 0 only)
            _row_group_forms(y, Q, QS, rows, rmask, 0, stride_y, stride_qs, N, amax_eps, BLOCK_M, BLOCK_N, POW2,
                             CAST)

    @triton.jit
    def _rms_bwd_kernel(X, W, RSTD, DY, DX, DWP, n_rows, N, stride_x, stride_dy, stride_dx, inv_n,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_N: tl.constexpr,
                        ROUND_DX: tl.constexpr, EMU_BF16: tl.constexpr):
        """Rows pid*BM, (pid+P)*BM, ...: dx per row; this program's partial dw (FP32) into DWP[pid]."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(pid * BLOCK_M, n_rows, nprog * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            r64 = rows.to(tl.int64)[:, None]
            x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            n = x * rstd[:, None]
            nw = n
            if ROUND_N:
                nw = _round_bf16(n, EMU_BF16)
            acc += dy * nw
            dn = dy * w[None, :]
            m = tl.sum(dn * n, axis=1) * inv_n
            dx = rstd[:, None] * (dn - n * m[:, None])
            if ROUND_DX:
                dx = _round_bf16(dx, EMU_BF16)
            tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DWP + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cmask)

    # ------------------------------------------------------------------------------------------------ SwiGLU
    @triton.jit
    def _swiglu_tile(X, n_rows, F, stride_x, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
        """This program's (rows, cols) tile: its row offsets, column indices, mask, and gate / up in FP32."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = (rows < n_rows)[:, None] & (cols < F)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        g = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + r64 * stride_x + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return r64, cols, mask, g, u

    @triton.jit
    def _swiglu_fwd_kernel(X, Y, Q, QS, n_rows, F, stride_x, stride_y, stride_qs, amax_eps,
                           BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, EMU_BF16: tl.constexpr,
                           QUANT: tl.constexpr, POW2: tl.constexpr, CAST: tl.constexpr):
        """QUANT: also the output's 1x128 FP8 forms (``_row_group_forms``; codes in rows of stride_y)."""
        r64, cols, mask, g, u = _swiglu_tile(X, n_rows, F, stride_x, BLOCK_M, BLOCK_F)
        s = _round_bf16(tl.math.div_rn(g, 1.0 + _exp(-g, EMU_BF16)), EMU_BF16)  # F.silu on BF16
        y = _round_bf16(s * u, EMU_BF16)  # BF16 * BF16
        tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        if QUANT:  # (BLOCK_F a power of two >= 128 here: the host enables it for F % 128 == 0 only)
            rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
            _row_group_forms(y, Q, QS, rows, rows < n_rows, tl.program_id(1) * BLOCK_F, stride_y, stride_qs, F,
                             amax_eps, BLOCK_M, BLOCK_F, POW2, CAST)

    @triton.jit
    def _swiglu_bwd_kernel(X, DY, DX, n_rows, F, stride_x, stride_dy, stride_dx,
                           BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, EMU_BF16: tl.constexpr):
        r64, cols, mask, g, u = _swiglu_tile(X, n_rows, F, stride_x, BLOCK_M, BLOCK_F)
        dy = tl.load(DY + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.math.div_rn(1.0, 1.0 + _exp(-g, EMU_BF16))
        dg = dy * u * sig * (1.0 + g * (1.0 - sig))
        du = dy * g * sig
        dg = _round_bf16(dg, EMU_BF16)
        du = _round_bf16(du, EMU_BF16)
        tl.store(DX + r64 * stride_dx + cols[None, :], dg.to(DX.dtype.element_ty), mask=mask)
        tl.store(DX + r64 * stride_dx + F + cols[None, :], du.to(DX.dtype.element_ty), mask=mask)

    # -------------------------------------------------------------------------------------------------- RoPE
    @triton.jit
    def _rope_kernel(X, Y, COS, SIN, S, H, HALF,
                     sxb, sxs, sxh, syb, sys_, syh, stride_cs,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NEG_SIN: tl.constexpr,
                     ROUND_Y: tl.constexpr, EMU_BF16: tl.constexpr):
        """x (B, S, H, 2*HALF) any strides (unit last): y1 = x1*c - x2*s, y2 = x2*c + x1*s at position s_idx."""
        tok = tl.program_id(0)
        b = tok // S
        pos = tok % S
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HALF
        mask = (heads < H)[:, None] & dmask[None, :]
        c = tl.load(COS + pos.to(tl.int64) * stride_cs + d, mask=dmask, other=0.0)[None, :]
        s = tl.load(SIN + pos.to(tl.int64) * stride_cs + d, mask=dmask, other=0.0)[None, :]
        if NEG_SIN:
            s = fp8_kernels._negate(s)  # a true sign flip (-(+0) = -0): Triton 3.6 lowers unary minus as 0 - s
        xo = b.to(tl.int64) * sxb + pos.to(tl.int64) * sxs + heads.to(tl.int64)[:, None] * sxh + d[None, :]
        yo = b.to(tl.int64) * syb + pos.to(tl.int64) * sys_ + heads.to(tl.int64)[:, None] * syh + d[None, :]
        x1 = tl.load(X + xo, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + xo + HALF, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        if ROUND_Y:
            y1 = _round_bf16(y1, EMU_BF16)
            y2 = _round_bf16(y2, EMU_BF16)
        tl.store(Y + yo, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + yo + HALF, y2.to(Y.dtype.element_ty), mask=mask)

    # -------------------------------------------------------------------------------------------- residual add
    @triton.jit
    def _residual_add_kernel(A, R, S, numel, BLOCK: tl.constexpr, ROUND_R: tl.constexpr,
                             EMU_BF16: tl.constexpr):
        """s = float(a) + float(bf16(r))  (FP32 out)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        if ROUND_R:
            r = _round_bf16(r, EMU_BF16)
        tl.store(S + offs, a + r, mask=mask)

    @triton.jit
    def _residual_add_bwd_kernel(DS, DA, DR, numel, BLOCK: tl.constexpr, WRITE_DR: tl.constexpr,
                                 EMU_BF16: tl.constexpr):
        """da = bf16(ds); dr = da in the residual's dtype (FP32 residual only; else dr is da itself)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        g = _round_bf16(tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32), EMU_BF16)
        tl.store(DA + offs, g.to(DA.dtype.element_ty), mask=mask)
        if WRITE_DR:
            tl.store(DR + offs, g.to(DR.dtype.element_ty), mask=mask)


# ================================================================================================= host wrappers
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _inv(n: int) -> float:
    """1/n rounded to FP32 (torch's CUDA mean multiplies the sum by this factor); cached: two host tensors per call
    were ~7 us of each norm launch's host time, and the update's micro-batches are host-bound (bench/RESULTS.md)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(n), dtype=torch.float32))


def _rms_blocks(n: int) -> tuple[int, int, int]:
    block_n = _pow2(n)
    block_m = max(1, min(64, 4096 // block_n))
    warps = 8 if block_m * block_n >= 4096 else 4
    return block_m, block_n, warps


def rms_norm_supported(x: Tensor, w: Tensor, out_dtype: torch.dtype) -> bool:
    return (triton is not None and x.dtype in _FLOATS and w.dtype in _FLOATS and out_dtype in _FLOATS
            and w.dim() == 1 and x.shape[-1] == w.shape[0] and w.shape[0] <= 32768 and x.numel() > 0)


def _row_groups(x: Tensor, n: int) -> tuple[Tensor, int, int, int, int]:
    """(base, rows, group, stride_outer, stride_inner): row r of ``x`` (..., n) starts at element
    (r // group) * stride_outer + (r % group) * stride_inner of ``base``. Plain rows (group 1) wherever ``x`` has a
    (rows, n) view; otherwise no copy for a (tokens, heads, n) view with unit column stride (vLLM's per-head q/k
    norms read the fused QKV output that way)."""
    try:
        x2 = x.view(-1, n)
    except RuntimeError:
        x2 = None
    if x2 is not None and x2.stride(1) == 1 and (x2.shape[0] <= 1 or x2.stride(0) >= n):
        return x2, x2.shape[0], 1, x2.stride(0), 0
    if x.dim() >= 3 and x.stride(-1) == 1:
        try:
            x3 = x.view(-1, x.shape[-2], n)
        except RuntimeError:
            x3 = None
        if x3 is not None and x3.shape[1] > 1 and x3.stride(1) >= n:
            return x3, x3.shape[0] * x3.shape[1], x3.shape[1], x3.stride(0), x3.stride(1)
    x2 = _rows(x, n)
    return x2, x2.shape[0], 1, x2.stride(0), 0


def _launch_rms_fwd(x: Tensor, residual: Tensor | None, w: Tensor, eps: float, out_dtype: torch.dtype,
                    quant: Fp8Recipe | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    n = w.shape[0]
    if residual is None:
        base, rows, group, s_o, s_i = _row_groups(x, n)
        r2 = s2 = base  # unused (HAS_RES off)
    else:
        base = _rows(x, n)
        rows, group, s_o, s_i = base.shape[0], 1, base.stride(0), 0
        r2 = _rows(residual, n)
        s2 = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    y = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    quant = quant if quant is not None and n % 128 == 0 and rows > 0 else None
    if quant is not None:
        q, qs = fp8_kernels._codes_buffer((rows, n), x.device), fp8_kernels._col_major(rows, n // 128, x.device)
    else:
        q = qs = y  # unused (QUANT off)
    bm, bn, warps = _rms_blocks(n)
    round_n = w.dtype == torch.bfloat16
    _rms_fwd_kernel[(triton.cdiv(rows, bm),)](
        base, r2, s2, w, y, rstd, q, qs, rows, n, group, s_o, s_i, r2.stride(0), y.stride(0),
        qs.stride(1) if quant is not None else 0, float(eps), _inv(n), quant.amax_eps if quant is not None else 0.0,
        BLOCK_M=bm, BLOCK_N=bn, ROUND_N=round_n, ROUND_Y=round_n or out_dtype == torch.bfloat16,
        HAS_RES=residual is not None, ROUND_S=x.dtype == torch.bfloat16, QUANT=quant is not None,
        POW2=quant is not None and quant.scale_fmt == "pow2", CAST=not interpreting(), EMU_BF16=interpreting(),
        num_warps=warps, **_launch_opts())
    y = y.view(x.shape)
    if quant is not None:
        attach_input_forms(y, fp8_kernels._finish_codes(q), qs, quant)
    return y, rstd, (None if residual is None else s2.view(x.shape))


def rms_norm_fwd(x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype, quant: Fp8Recipe | None = None
                 ) -> tuple[Tensor, Tensor]:
    """(y shaped like x in ``out_dtype``, rstd (rows,) FP32) with the twin's ops: n = bf16(x*rstd); y = bf16(n*w).
    ``quant`` (a recipe; hidden sizes that are multiples of 128): y also carries its 1x128 FP8 forms for the FP8
    linear that consumes it (fp8/linear.py ``attach_input_forms``), the bytes ``quant_act(y)`` would give."""
    y, rstd, _ = _launch_rms_fwd(x, None, w, eps, out_dtype, quant)
    return y, rstd


def add_rms_norm_fwd(x: Tensor, residual: Tensor, w: Tensor, eps: float, quant: Fp8Recipe | None = None
                     ) -> tuple[Tensor, Tensor]:
    """(rms_norm_fwd(s) in x's dtype, s) with s = (x + residual in FP32) rounded once to x's dtype, in one launch:
    byte for byte what ``rms_norm_fwd`` gives on that s (same reduction, same roundings; tested); ``quant`` as there."""
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}")
    y, _, s = _launch_rms_fwd(x, residual, w, eps, x.dtype, quant)
    return y, s


def rms_norm_bwd(x: Tensor, w: Tensor, rstd: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dw in w's dtype): dx = rstd*(dn - n*mean(dn*n)), dn = dy*w; dw = sum_rows dy*w.dtype(n)."""
    n = w.shape[0]
    x2, dy2 = _rows(x, n), _rows(dy, n)
    rows = x2.shape[0]
    dx = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    bm, bn, warps = _rms_blocks(n)
    progs = max(1, min(triton.cdiv(rows, bm), _num_programs_cap(x)))
    dwp = torch.empty((progs, n), dtype=torch.float32, device=x.device)
    _rms_bwd_kernel[(progs,)](
        x2, w, rstd, dy2, dx, dwp, rows, n, x2.stride(0), dy2.stride(0), dx.stride(0), _inv(n),
        BLOCK_M=bm, BLOCK_N=bn, ROUND_N=w.dtype == torch.bfloat16, ROUND_DX=x.dtype == torch.bfloat16,
        EMU_BF16=interpreting(), num_warps=warps, **_launch_opts())
    return dx.view(x.shape), dwp.sum(dim=0).to(w.dtype)


# ------------------------------------------------------------------------------------------------------ SwiGLU
def swiglu_supported(x: Tensor) -> bool:
    return triton is not None and x.dtype == torch.bfloat16 and x.shape[-1] % 2 == 0 and x.numel() > 0


def _swiglu_grid(rows: int, f: int) -> tuple[tuple[int, int], int, int]:
    bf = min(1024, _pow2(f))
    bm = max(1, min(16, 4096 // bf))
    return (triton.cdiv(rows, bm), triton.cdiv(f, bf)), bm, bf


def swiglu_fwd(x: Tensor, quant: Fp8Recipe | None = None) -> Tensor:
    """bf16(bf16(silu(gate)) * up) for x = [gate | up] on the last dim (BF16). ``quant`` (a recipe; F a multiple
    of 128): the output also carries its 1x128 FP8 forms for the FP8 linear that consumes it (the MLP's fc2), the
    bytes ``quant_act`` of the output would give, written in the same pass (fp8/linear.py ``attach_input_forms``)."""
    f = x.shape[-1] // 2
    x2 = _rows(x, 2 * f)
    rows = x2.shape[0]
    y = torch.empty((rows, f), dtype=x.dtype, device=x.device)
    quant = quant if quant is not None and f % 128 == 0 and rows > 0 else None
    if quant is not None:
        q, qs = fp8_kernels._codes_buffer((rows, f), x.device), fp8_kernels._col_major(rows, f // 128, x.device)
    else:
        q = qs = y  # unused (QUANT off)
    grid, bm, bf = _swiglu_grid(rows, f)
    _swiglu_fwd_kernel[grid](x2, y, q, qs, rows, f, x2.stride(0), y.stride(0),
                             qs.stride(1) if quant is not None else 0, quant.amax_eps if quant is not None else 0.0,
                             BLOCK_M=bm, BLOCK_F=bf, EMU_BF16=interpreting(), QUANT=quant is not None,
                             POW2=quant is not None and quant.scale_fmt == "pow2", CAST=not interpreting(),
                             num_warps=4, **_launch_opts())
    y = y.view(*x.shape[:-1], f)
    if quant is not None:
        attach_input_forms(y, fp8_kernels._finish_codes(q), qs, quant)
    return y


def swiglu_bwd(x: Tensor, dy: Tensor) -> Tensor:
    """[dgate | dup] in BF16, computed in FP32 like numerics._SwiGLUFn.backward."""
    f = x.shape[-1] // 2
    x2, dy2 = _rows(x, 2 * f), _rows(dy, f)
    dx = torch.empty((x2.shape[0], 2 * f), dtype=x.dtype, device=x.device)
    grid, bm, bf = _swiglu_grid(x2.shape[0], f)
    _swiglu_bwd_kernel[grid](x2, dy2, dx, x2.shape[0], f, x2.stride(0), dy2.stride(0), dx.stride(0),
                             BLOCK_M=bm, BLOCK_F=bf, EMU_BF16=interpreting(), num_warps=4, **_launch_opts())
    return dx.view(x.shape)


# -------------------------------------------------------------------------------------------------------- RoPE
def rope_supported(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    return (triton is not None and x.dim() == 4 and x.dtype in _FLOATS and x.stride(-1) == 1 and x.numel() > 0
            and cos.dtype == torch.float32 and sin.dtype == torch.float32 and cos.dim() == 2
            and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and cos.shape[0] >= x.shape[1] and 2 * cos.shape[1] == x.shape[-1])


def rope_fwd(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Neox rotation of x (B, S, H, D) by cos/sin (>=S, D/2) FP32 at positions 0..S-1, one rounding to x's dtype.
    ``inverse`` rotates by -angle (the backward). Output keeps x's memory layout when x is dense."""
    bsz, s, h, d = x.shape
    y = torch.empty_like(x)
    if y.stride(-1) != 1:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    half = d // 2
    bd = _pow2(half)
    bh = max(1, min(_pow2(h), 2048 // bd))
    _rope_kernel[(bsz * s, triton.cdiv(h, bh))](
        x, y, cos, sin, s, h, half, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        cos.stride(0), BLOCK_H=bh, BLOCK_D=bd, NEG_SIN=inverse, ROUND_Y=x.dtype == torch.bfloat16,
        EMU_BF16=interpreting(), num_warps=4, **_launch_opts())
    return y


def rope_bwd(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient's inverse rotation (the backward of :func:`rope_fwd`)."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    return rope_fwd(dy, cos, sin, inverse=True)


# ------------------------------------------------------------------------------------------------ residual add
_ADD_BLOCK = 2048


def residual_add_supported(out: Tensor, residual: Tensor) -> bool:
    return (triton is not None and out.dtype == torch.bfloat16 and residual.dtype in _FLOATS
            and out.shape == residual.shape and out.is_contiguous() and residual.is_contiguous()
            and out.numel() > 0)


def residual_add_fwd(out: Tensor, residual: Tensor) -> Tensor:
    """FP32 ``out.float() + bf16(residual).float()`` in one pass."""
    s = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    numel = out.numel()
    _residual_add_kernel[(triton.cdiv(numel, _ADD_BLOCK),)](
        out, residual, s, numel, BLOCK=_ADD_BLOCK, ROUND_R=residual.dtype != torch.bfloat16,
        EMU_BF16=interpreting(), num_warps=4, **_launch_opts())
    return s


def residual_add_bwd(ds: Tensor, out_dtype: torch.dtype, res_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(d_out, d_residual): both ``bf16(ds)``, the residual's in its own dtype (one pass writes both)."""
    if out_dtype != torch.bfloat16:
        raise ValueError(f"residual_add_bwd: the Triton kernel takes a BF16 output, got {out_dtype}")
    ds = ds.contiguous()
    da = torch.empty(ds.shape, dtype=torch.bfloat16, device=ds.device)
    write_dr = res_dtype != torch.bfloat16
    dr = torch.empty(ds.shape, dtype=res_dtype, device=ds.device) if write_dr else da
    numel = ds.numel()
    _residual_add_bwd_kernel[(triton.cdiv(numel, _ADD_BLOCK),)](
        ds, da, dr, numel, BLOCK=_ADD_BLOCK, WRITE_DR=write_dr, EMU_BF16=interpreting(), num_warps=4,
        **_launch_opts())
    return da, (dr if write_dr else da.clone())
