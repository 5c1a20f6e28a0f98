"""SwiGLU backward fused with the FP8 quantization of its result, the output gradient dY of the MLP's fc1 linear.

Why: unfused, the backward of ``[gate | up] -> silu(gate) * up`` writes dY = d[gate | up] in BF16 and fc1's
backward reads it back (twice, in ``quant_dual``'s measured two-kernel form) to make its two FP8 copies. Here one
kernel reads gate, up and d(out) and writes the FP8 forms directly; the BF16 dY is written only when a caller still
needs it (fc1's bias gradient):

    swiglu_bwd_quant_dual(x (M,2F), dy (M,F)) -> q (M,2F), s (M,2F/128) col-major,
                                                 qt (2F,Mp), st (2F,Mp/128) col-major, dx (M,2F) BF16 or None

the layouts of :func:`jetrl_megatron.fp8.kernels.quant_dual`. The backward is free of the rollout-exactness
constraint, but this fusion changes no byte: dY is the BF16 result of
:func:`jetrl_megatron.megatron.triton_numerics.swiglu_bwd` (same expression, op order, ``expf``, IEEE division, no
FMA contraction, round-to-nearest-even to BF16) and its codes / scales are ``quant_dual`` of that BF16 tensor (same
device helpers). :func:`swiglu_bwd_quant_dual_reference` is the unfused pure-torch twin.

Column j of dY is d(gate)[j] for j < F and d(up)[j - F] otherwise, so a 128-group may straddle the gate/up boundary
(F need only be a multiple of 64). Status: bit-identity tested under the Triton interpreter; GPU speed unmeasured
(docs/kernels.md), so nothing selects it by default.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetrl_megatron.fp8 import quant_dispatch
from jetrl_megatron.fp8.quant import BLOCK
from jetrl_megatron.recipe import Fp8Recipe

try:
    import triton
    import triton.language as tl

    from jetrl_megatron.fp8.kernels import (
        _codes,
        _codes_buffer,
        _col_major,
        _divisor,
        _finish_codes,
        _interpreting,
        _nan_aware_amax,
        _scale_from_amax,
        _transposed_group_store,
        padded_tokens,
    )
    from jetrl_megatron.megatron.triton_numerics import _exp, _launch_opts, _round_bf16, _rows
except ImportError:  # CPU installs without triton: only the reference twin is usable
    triton = None

__all__ = ["swiglu_bwd_quant_dual", "swiglu_bwd_quant_dual_reference", "fused_supported"]

_DEFAULT_RECIPE = Fp8Recipe()
# Launch shapes, unmeasured: the row-wise pass follows quant_act's, the transposed pass quant_dual's split form.
# Results never depend on them (tests sweep them).
ROW_BLOCK_M = 32
ROW_WARPS = 4
TRANS_FEATS = 64
TRANS_WARPS = 4
TRANS_MODE = 1
# True: two kernels (row-wise codes + BF16 dY, then the transposed codes, each recomputing dY from gate/up/d(out)),
# the form quant_dual measured faster; False: one pass per 128x128 tile writing everything.
SPLIT = True


def fused_supported(x: Tensor, dy: Tensor) -> bool:
    """Whether the fused kernel takes these inputs (BF16 [gate | up] with 2F a multiple of 128, BF16 d(out))."""
    return (triton is not None and x.dtype == torch.bfloat16 and dy.dtype == torch.bfloat16
            and x.shape[-1] % BLOCK == 0 and x.shape[-1] == 2 * dy.shape[-1] and x.shape[:-1] == dy.shape[:-1]
            and (x.is_cuda or _interpreting()))


if triton is not None:

    @triton.jit
    def _swiglu_grad_tile(X, DY, rows, cols, M, F, stride_x, stride_dy, EMU_BF16: tl.constexpr):
        """dY[rows, cols] of the (M, 2F) gradient, BF16-rounded and held in FP32; exactly +0 on rows >= M (the
        zero padding of the token groups). Same expression and roundings as triton_numerics' _swiglu_bwd_kernel."""
        row_ok = rows < M
        is_gate = cols < F
        feat = tl.where(is_gate, cols, cols - F)
        r64 = rows.to(tl.int64)[:, None]
        mask = row_ok[:, None]
        g = tl.load(X + r64 * stride_x + feat[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + r64 * stride_x + F + feat[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * stride_dy + feat[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.math.div_rn(1.0, 1.0 + _exp(-g, EMU_BF16))
        dg = dy * u * sig * (1.0 + g * (1.0 - sig))
        du = dy * g * sig
        d = tl.where(is_gate[None, :], _round_bf16(dg, EMU_BF16), _round_bf16(du, EMU_BF16))
        return tl.where(mask, d, 0.0)

    @triton.jit
    def _row_quant_store(d, rows, cols, g, M, q_ptr, s_ptr, dx_ptr, stride_qm, stride_sm, stride_sg, stride_dxm,
                         eps, POW2: tl.constexpr, CAST: tl.constexpr, WRITE_DX: tl.constexpr):
        """1x128 codes and scales of the (rows, 128-group g) tile d; the BF16 dY too when WRITE_DX."""
        row_ok = rows < M
        r64 = rows.to(tl.int64)[:, None]
        s = _scale_from_amax(_nan_aware_amax(d, 1), eps, POW2)
        s_fin, r = _divisor(s)
        q = _codes(d, s_fin[:, None], r[:, None], CAST)
        tl.store(q_ptr + r64 * stride_qm + cols[None, :], q, mask=row_ok[:, None])
        tl.store(s_ptr + rows * stride_sm + g * stride_sg, s, mask=row_ok)
        if WRITE_DX:
            tl.store(dx_ptr + r64 * stride_dxm + cols[None, :], d.to(tl.bfloat16), mask=row_ok[:, None])

    @triton.jit
    def _swiglu_bwd_rows_kernel(X, DY, q_ptr, s_ptr, dx_ptr, M, F, stride_x, stride_dy, stride_qm, stride_sm,
                                stride_sg, stride_dxm, eps, POW2: tl.constexpr, CAST: tl.constexpr,
                                WRITE_DX: tl.constexpr, EMU_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                                GROUP: tl.constexpr):
        """One program: BLOCK_M rows x one 128-column group of dY: row-wise codes (+ BF16 dY)."""
        g = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = g * GROUP + tl.arange(0, GROUP)
        d = _swiglu_grad_tile(X, DY, rows, cols, M, F, stride_x, stride_dy, EMU_BF16)
        _row_quant_store(d, rows, cols, g, M, q_ptr, s_ptr, dx_ptr, stride_qm, stride_sm, stride_sg, stride_dxm,
                         eps, POW2, CAST, WRITE_DX)

    @triton.jit
    def _swiglu_bwd_trans_kernel(X, DY, qt_ptr, st_ptr, M, F, stride_x, stride_dy, stride_qtn, stride_stn,
                                 stride_stg, eps, POW2: tl.constexpr, CAST: tl.constexpr, EMU_BF16: tl.constexpr,
                                 TOKENS: tl.constexpr, FEATS: tl.constexpr, TRANS_MODE: tl.constexpr):
        """One program: 128 tokens x FEATS columns of dY, quantized along tokens and stored transposed."""
        mb = tl.program_id(0)
        rows = mb * TOKENS + tl.arange(0, TOKENS)
        cols = tl.program_id(1) * FEATS + tl.arange(0, FEATS)
        d = _swiglu_grad_tile(X, DY, rows, cols, M, F, stride_x, stride_dy, EMU_BF16)
        _transposed_group_store(d, qt_ptr, st_ptr, mb * TOKENS, tl.program_id(1) * FEATS, mb, 2 * F, stride_qtn,
                                stride_stn, stride_stg, eps, POW2, CAST, TOKENS, FEATS, TRANS_MODE)

    @triton.jit
    def _swiglu_bwd_dual_kernel(X, DY, q_ptr, s_ptr, qt_ptr, st_ptr, dx_ptr, M, F, stride_x, stride_dy, stride_qm,
                                stride_sm, stride_sg, stride_qtn, stride_stn, stride_stg, stride_dxm, eps,
                                POW2: tl.constexpr, CAST: tl.constexpr, WRITE_DX: tl.constexpr,
                                EMU_BF16: tl.constexpr, TOKENS: tl.constexpr, GROUP: tl.constexpr,
                                TRANS_MODE: tl.constexpr):
        """One program: a 128-token x 128-column tile of dY: both FP8 forms (+ BF16 dY) from one computation."""
        mb = tl.program_id(0)
        g = tl.program_id(1)
        rows = mb * TOKENS + tl.arange(0, TOKENS)
        cols = g * GROUP + tl.arange(0, GROUP)
        d = _swiglu_grad_tile(X, DY, rows, cols, M, F, stride_x, stride_dy, EMU_BF16)
        _row_quant_store(d, rows, cols, g, M, q_ptr, s_ptr, dx_ptr, stride_qm, stride_sm, stride_sg, stride_dxm,
                         eps, POW2, CAST, WRITE_DX)
        _transposed_group_store(d, qt_ptr, st_ptr, mb * TOKENS, g * GROUP, mb, 2 * F, stride_qtn, stride_stn,
                                stride_stg, eps, POW2, CAST, TOKENS, GROUP, TRANS_MODE)


def _check_inputs(x: Tensor, dy: Tensor) -> None:
    if triton is None:
        raise RuntimeError("swiglu_bwd_quant_dual: triton is not installed")
    if not (x.is_cuda or _interpreting()):
        raise ValueError(f"swiglu_bwd_quant_dual: needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
    if x.dtype != torch.bfloat16 or dy.dtype != torch.bfloat16:
        raise TypeError(f"swiglu_bwd_quant_dual: x (fc1 output) and dy must be BF16, got {x.dtype} and {dy.dtype}")
    if x.shape[-1] % BLOCK or x.shape[-1] != 2 * dy.shape[-1] or x.shape[:-1] != dy.shape[:-1]:
        raise ValueError(f"swiglu_bwd_quant_dual: x (fc1 output [gate | up]) of shape {tuple(x.shape)} and dy of "
                         f"shape {tuple(dy.shape)}: need x's last dim 2F a multiple of {BLOCK} and dy = (..., F)")


def swiglu_bwd_quant_dual(x: Tensor, dy: Tensor, recipe: Fp8Recipe | None = None, *, write_dx: bool = False,
                          split: bool | None = None, block_m: int | None = None, feats: int | None = None,
                          trans_mode: int | None = None, num_warps: int | None = None
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """(q, s, qt, st, dx) of dY = SwiGLU backward of x = [gate | up] (..., 2F) given d(out) (..., F), dY flattened
    to (M, 2F). Equals ``quant_dual(swiglu_bwd(x, dy))`` byte for byte; dx (BF16 dY) only with ``write_dx``.

    split / block_m / feats / trans_mode / num_warps are launch knobs (see :data:`SPLIT`); no result depends on them.
    """
    _check_inputs(x, dy)
    recipe = recipe or _DEFAULT_RECIPE
    n = x.shape[-1]
    f = n // 2
    x2, dy2 = _rows(x, n), _rows(dy, f)
    m = x2.shape[0]
    mp = padded_tokens(m)
    dev = x.device
    q, s = _codes_buffer((m, n), dev), _col_major(m, n // BLOCK, dev)
    qt, st = _codes_buffer((n, mp), dev), _col_major(n, mp // BLOCK, dev)
    dx = torch.empty((m, n), dtype=torch.bfloat16, device=dev) if write_dx else None
    dx_arg = dx if dx is not None else q  # never written without WRITE_DX
    common = dict(POW2=recipe.scale_fmt == "pow2", CAST=not _interpreting(), EMU_BF16=_interpreting(),
                  **_launch_opts())
    split = SPLIT if split is None else split
    if m and split:
        bm = block_m or ROW_BLOCK_M
        _swiglu_bwd_rows_kernel[(triton.cdiv(m, bm), n // BLOCK)](
            x2, dy2, q, s, dx_arg, m, f, x2.stride(0), dy2.stride(0), q.stride(0), s.stride(0), s.stride(1),
            dx_arg.stride(0), recipe.amax_eps, WRITE_DX=write_dx, BLOCK_M=bm, GROUP=BLOCK,
            num_warps=num_warps or ROW_WARPS, **common)
        fe = feats or TRANS_FEATS
        _swiglu_bwd_trans_kernel[(mp // BLOCK, n // fe)](
            x2, dy2, qt, st, m, f, x2.stride(0), dy2.stride(0), qt.stride(0), st.stride(0), st.stride(1),
            recipe.amax_eps, TOKENS=BLOCK, FEATS=fe, TRANS_MODE=TRANS_MODE if trans_mode is None else trans_mode,
            num_warps=num_warps or TRANS_WARPS, **common)
    elif m:
        _swiglu_bwd_dual_kernel[(mp // BLOCK, n // BLOCK)](
            x2, dy2, q, s, qt, st, dx_arg, m, f, x2.stride(0), dy2.stride(0), q.stride(0), s.stride(0), s.stride(1),
            qt.stride(0), st.stride(0), st.stride(1), dx_arg.stride(0), recipe.amax_eps, WRITE_DX=write_dx,
            TOKENS=BLOCK, GROUP=BLOCK, TRANS_MODE=TRANS_MODE if trans_mode is None else trans_mode,
            num_warps=num_warps or TRANS_WARPS, **common)
    return _finish_codes(q), s, _finish_codes(qt), st, dx


def swiglu_bwd_quant_dual_reference(x: Tensor, dy: Tensor, recipe: Fp8Recipe | None = None, *, swiglu_bwd=None
                                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The unfused pure-torch twin: ``swiglu_bwd`` (default: numerics' torch twin) then quant_dual's torch reference.
    Returns (q, s, qt, st, dx) with dx the BF16 dY (M, 2F)."""
    if swiglu_bwd is None:
        from jetrl_megatron.megatron.numerics import TWINS

        swiglu_bwd = TWINS["swiglu"].bwd
    dx = swiglu_bwd(x, dy).reshape(-1, x.shape[-1])
    return (*quant_dispatch.quant_dual(dx, recipe, reference_quant=True), dx)
