"""Fused Triton FP8 quantization kernels, bit-identical to the pure-torch twins in `fp8/quant.py`.

Why fused: an eager 1x128 quant of a 4096x4096 activation costs more than the FP8 GEMM that consumes it
(docs/precision.md).
Each kernel here reads its input once and writes every output directly in the layout the GEMMs consume:

    quant_act(x (M,K))          -> q (M,K) row-major, s (M,K/128) column-major (strides (1, M))
    quant_dual(g (M,N))         -> q, s as above  +  qt (N,Mp) row-major, st (N,Mp/128) column-major (strides (1, N));
                                   one fused pass (split=False) or, the measured default, two kernels
    regroup_for_wgrad(q, s)     -> qt (K,Mp), st (K,Mp/128): the saved 1x128 FP8 activation re-grouped along tokens,
                                   dequantized (q*s in FP32) and requantized in registers, no BF16 copy in memory
    quant_weight(w (N,K))       -> q (N,K) row-major, s (ceil(N/128), ceil(K/128)) row-major ("weight_scale_inv")
    transpose_fp8(q (R,C))      -> (C,R) contiguous copy (the K-major weight copy the DGrad GEMM reads)

Mp = M rounded up to a multiple of 128; padded tokens are zeros (they change neither amax nor sums).

Bit-identity with the reference: the scale is `max(amax, eps) / 448` with an IEEE round-to-nearest FP32 division
(`tl.div_rn`; Triton's plain `/` on FP32 lowers to an approximate division), pow2 rounds the scale's bits up to the
next power of two (exact, as the reference's frexp), `q = x / s` is the correctly rounded FP32 quotient (computed as
Markstein's corrected product with the correctly rounded 1/s, one reciprocal per scale: `_quotient`), and the cast to
E4M3 is the hardware round-to-nearest-even conversion. NaN in a group makes the group's scale and codes NaN, as the
reference.

Under TRITON_INTERPRET=1 (CPU) Triton's emulated FP32->E4M3 conversion rounds half-up and mishandles mantissa carry,
so there the kernels store the clamped FP32 values and torch does the (RNE) cast; everything else runs as on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl_megatron.fp8.quant import BLOCK, FP8_DTYPE, FP8_MAX
from jetrl_megatron.recipe import Fp8Recipe

_DEFAULT_RECIPE = Fp8Recipe()
# Launch shapes (rows per program, warps, transposed-store modes, the regroup's feature slice and load vector), picked
# by bench/kernels_bench.py's sweep on the H100 (2026-12-08: regroup 62.5 us at 16384x4096, 0.73 of copy, vs 112 us
# at the earlier compiler-chosen loads / mode 1; quant_dual 152 vs 179 us); results never depend on them.
ACT_BLOCK_M = 32
ACT_WARPS = 4
DUAL_WARPS = 4
REGROUP_WARPS = 4
REGROUP_FEATS = 64
# The regroup's load vector in features (0: the compiler's choice, 16 bytes): fewer features per thread means more
# tokens per thread and fewer per-feature scale computations (an offline sm_90 compile: 29 -> 19 SASS instructions
# per element at 4 features).
REGROUP_VEC = 4
TRANS_MODE = 2
REGROUP_TRANS_MODE = 2
# quant_dual as two kernels (row-wise quant_act, then a token-grouped transposed pass over the same BF16 input):
# reads the input twice but ran 1.8x faster on the H200 than the single-pass kernel (158 vs 285 us at 16384x4096),
# whose 128x128 register tile with two reductions and a transposed store is latency-bound. split=False selects it.
DUAL_SPLIT = True


def _interpreting() -> bool:
    """Whether Triton runs its interpreter (its own ``TRITON_INTERPRET`` switch, asked from Triton)."""
    return bool(triton.knobs.runtime.interpret)


# ------------------------------------------------------------------------------------------------ device helpers
@triton.jit
def _nan_aware_amax(xf, axis: tl.constexpr):
    """max |x| along `axis`, NaN if any element is NaN (tl.max alone may drop NaN, torch.amax propagates it), in one
    integer reduction: |x|'s bits order as integers as the values do, and every NaN's above +inf's."""
    bits = tl.max(xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=axis)
    amax = bits.to(tl.float32, bitcast=True)
    return tl.where(amax != amax, float("nan"), amax)


@triton.jit
def _scale_from_amax(amax, eps, POW2: tl.constexpr):
    """s = max(amax, eps) / 448 (IEEE FP32 division); pow2: the next power of two >= s, exactly."""
    clamped = tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL)
    s = tl.div_rn(clamped, tl.full(clamped.shape, 448.0, tl.float32))
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        finite = (bits & 0x7F800000) != 0x7F800000
        has_mantissa = (bits & 0x007FFFFF) != 0
        up = (bits & 0x7F800000) + 0x00800000
        bits = tl.where(finite & has_mantissa, up, bits)
        s = bits.to(tl.float32, bitcast=True)
    return s


@triton.jit
def _divisor(s):
    """What `_codes` needs to divide many values by one scale s (computed once per scale, not per element):
    r = 1/s correctly rounded, and s with +inf replaced by 0 (then the quotient is x*r: +-0 for finite x, NaN for
    +-inf, as x/inf)."""
    r = tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    return tl.where(s == float("inf"), 0.0, s), r


@triton.jit
def _negate(v):
    """-v with IEEE's sign of zero (-(+0) = -0), as a multiply by -1 that the compiler folds into the FMA's operand
    negation: Triton 3.6 lowers unary minus as 0 - v, which makes -(+0) = +0 and lost the sign of every -0 input's
    code on the GPU (tests/test_fp8_kernels_gpu.py, H100, 2026-12-07)."""
    return v * -1.0


@triton.jit
def _quotient(x, s_fin, r):
    """RN(x / s) in FP32, bit-identical to `tl.div_rn(x, s)`, at three operations per element instead of a division:
    q0 = RN(x*r), the negated residual e = s*q0 - x (exact) by one FMA, then RN(q0 - e*r) by a second: Markstein's
    correction with the correctly rounded reciprocal r (checked against IEEE division over every FP32 mantissa of x
    for many s: bench/quotient_check.c, docs/kernels.md). The residual is negated so that x = -0 keeps its sign:
    x - s*q0 would be +0 there, and +0 + -0 rounds to +0 (both negations through `_negate`)."""
    q0 = x * r
    return tl.fma(_negate(tl.fma(q0, s_fin, _negate(x))), r, q0)


@triton.jit
def _cast_codes(y, CAST: tl.constexpr):
    """E4M3 codes (round-to-nearest-even) of quotients y = x / (amax/448): no clamp before the GPU's cast, as |y|
    never exceeds 448 * (1 + 2^-24), which rounds to 448 (and the conversion saturates); CAST=False (interpreter)
    clamps the FP32 values torch casts afterwards."""
    if CAST:
        y = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return y


@triton.jit
def _codes(x, s_fin, r, CAST: tl.constexpr):
    """E4M3 codes of x / s, the reference's clamp(x / s) cast with round-to-nearest-even (s_fin, r from `_divisor`)."""
    return _cast_codes(_quotient(x, s_fin, r), CAST)


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_xk, stride_qm, stride_sm, stride_sg, eps,
                       POW2: tl.constexpr, CAST: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """One program: BLOCK_M rows x one 128-group. Scales stored at s[row, g] with any strides (column-major here)."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * GROUP + tl.arange(0, GROUP)
    row_ok = rows < M
    mask = row_ok[:, None]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    s = _scale_from_amax(_nan_aware_amax(xf, 1), eps, POW2)
    s_fin, r = _divisor(s)
    q = _codes(xf, s_fin[:, None], r[:, None], CAST)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, s, mask=row_ok)


@triton.jit
def _transposed_group_store(xf, qt_ptr, st_ptr, tok0, feat0, mb, N, stride_qtn, stride_stn, stride_stg, eps,
                            POW2: tl.constexpr, CAST: tl.constexpr, TOKENS: tl.constexpr, FEATS: tl.constexpr,
                            TRANS_MODE: tl.constexpr):
    """xf: (TOKENS, FEATS) FP32 tile (padded tokens are 0). Quantize each feature column over the 128 tokens and store
    the transposed codes qt[feat, tok] and the scales st[feat, mb].

    TRANS_MODE 0: transpose the FP8 register tile (tl.trans) and store rows; 1: store the untransposed tile through
    transposed addresses and let the compiler pick a coalesced layout for the token-contiguous store; 2: transpose
    the FP32 quotients, then clamp, cast and store rows."""
    st = _scale_from_amax(_nan_aware_amax(xf, 0), eps, POW2)  # (FEATS,)
    feats = feat0 + tl.arange(0, FEATS)
    toks = tok0 + tl.arange(0, TOKENS)
    feat_ok = feats < N
    s_fin, r = _divisor(st)
    if TRANS_MODE == 2:
        yt = _cast_codes(tl.trans(_quotient(xf, s_fin[None, :], r[None, :])), CAST)
        tl.store(qt_ptr + feats[:, None].to(tl.int64) * stride_qtn + toks[None, :], yt, mask=feat_ok[:, None])
    y = _codes(xf, s_fin[None, :], r[None, :], CAST)  # (TOKENS, FEATS)
    if TRANS_MODE == 0:
        tl.store(qt_ptr + feats[:, None].to(tl.int64) * stride_qtn + toks[None, :], tl.trans(y),
                 mask=feat_ok[:, None])
    elif TRANS_MODE == 1:
        tl.store(qt_ptr + feats[None, :].to(tl.int64) * stride_qtn + toks[:, None], y, mask=feat_ok[None, :])
    tl.store(st_ptr + feats * stride_stn + mb * stride_stg, st, mask=feat_ok)


@triton.jit
def _quant_dual_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, stride_xm, stride_xn, stride_qm, stride_sm,
                       stride_sg, stride_qtn, stride_stn, stride_stg, eps,
                       POW2: tl.constexpr, CAST: tl.constexpr, TOKENS: tl.constexpr, GROUP: tl.constexpr,
                       TRANS_MODE: tl.constexpr):
    """One program: a 128-token x 128-feature tile; writes the 1x128 row-wise codes and the transposed 128x1 codes."""
    mb = tl.program_id(0)
    g = tl.program_id(1)
    rows = mb * TOKENS + tl.arange(0, TOKENS)
    cols = g * GROUP + tl.arange(0, GROUP)
    row_ok = rows < M
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :] * stride_xn,
                mask=row_ok[:, None], other=0.0)
    xf = x.to(tl.float32)
    s = _scale_from_amax(_nan_aware_amax(xf, 1), eps, POW2)
    s_fin, r = _divisor(s)
    q = _codes(xf, s_fin[:, None], r[:, None], CAST)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q, mask=row_ok[:, None])
    tl.store(s_ptr + rows * stride_sm + g * stride_sg, s, mask=row_ok)
    _transposed_group_store(xf, qt_ptr, st_ptr, mb * TOKENS, g * GROUP, mb, N, stride_qtn, stride_stn, stride_stg,
                            eps, POW2, CAST, TOKENS, GROUP, TRANS_MODE)


@triton.jit
def _regroup_kernel(q_ptr, s_ptr, qt_ptr, st_ptr, M, K, stride_qm, stride_qk, stride_sm, stride_sg,
                    stride_qtn, stride_stn, stride_stg, eps,
                    POW2: tl.constexpr, CAST: tl.constexpr, TOKENS: tl.constexpr, GROUP: tl.constexpr,
                    FEATS: tl.constexpr, TRANS_MODE: tl.constexpr, HAS_SCALE: tl.constexpr, LOAD_VEC: tl.constexpr):
    """One program: 128 tokens x FEATS features (a slice of one 128-group) of the saved FP8 activation:
    x = q*s (FP32), requantized along tokens and stored transposed. HAS_SCALE=False: q is a BF16/FP32 input
    quantized along tokens directly (the transposed half of quant_dual's two-kernel form)."""
    mb = tl.program_id(0)
    f = tl.program_id(1)
    g = (f * FEATS) // GROUP
    rows = mb * TOKENS + tl.arange(0, TOKENS)
    cols = f * FEATS + tl.arange(0, FEATS)
    if LOAD_VEC:  # loads of LOAD_VEC features: each thread then holds more tokens of fewer features (see REGROUP_VEC)
        cols = tl.max_contiguous(tl.multiple_of(cols, LOAD_VEC), LOAD_VEC)
    row_ok = rows < M
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :] * stride_qk,
                mask=row_ok[:, None], other=0.0)
    if HAS_SCALE:
        s = tl.load(s_ptr + rows * stride_sm + g * stride_sg, mask=row_ok, other=0.0)
        xf = q.to(tl.float32) * s[:, None]
    else:
        xf = q.to(tl.float32)
    _transposed_group_store(xf, qt_ptr, st_ptr, mb * TOKENS, f * FEATS, mb, K, stride_qtn, stride_stn, stride_stg,
                            eps, POW2, CAST, TOKENS, FEATS, TRANS_MODE)


@triton.jit
def _quant_weight_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, N, K, stride_wn, stride_wk, stride_qn, stride_sn, stride_qtk,
                         eps, POW2: tl.constexpr, CAST: tl.constexpr, WRITE_T: tl.constexpr, TILE: tl.constexpr,
                         TRANS_MODE: tl.constexpr):
    """One program: one 128x128 weight tile (edge tiles masked); optional transposed (K,N) copy of the codes."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    rows = nb * TILE + tl.arange(0, TILE)
    cols = kb * TILE + tl.arange(0, TILE)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :] * stride_wk, mask=mask, other=0.0)
    wf = w.to(tl.float32)
    amax = _nan_aware_amax(_nan_aware_amax(wf, 1), 0)
    s = _scale_from_amax(amax, eps, POW2)
    s_fin, r = _divisor(s)
    q = _codes(wf, s_fin, r, CAST)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qn + cols[None, :], q, mask=mask)
    tl.store(s_ptr + nb * stride_sn + kb, s)
    if WRITE_T:
        if TRANS_MODE == 0:
            tl.store(qt_ptr + cols[:, None].to(tl.int64) * stride_qtk + rows[None, :], tl.trans(q),
                     mask=tl.trans(mask))
        else:
            tl.store(qt_ptr + cols[None, :].to(tl.int64) * stride_qtk + rows[:, None], q, mask=mask)


# ------------------------------------------------------------------------------------------------ host wrappers
def _recipe(recipe: Fp8Recipe | None) -> Fp8Recipe:
    return _DEFAULT_RECIPE if recipe is None else recipe


def _check_cuda_or_interp(t: torch.Tensor, name: str) -> None:
    if not (t.is_cuda or _interpreting()):
        raise ValueError(f"{name}: Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1), got device {t.device}")


def _check_2d_groups(t: torch.Tensor, name: str) -> tuple[int, int]:
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    m, k = t.shape
    if k % BLOCK:
        raise ValueError(f"{name}: last dim {k} of shape {tuple(t.shape)} is not divisible by the FP8 group size "
                         f"{BLOCK}")
    return m, k


def _codes_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """FP8 output, or FP32 under the interpreter (cast by torch afterwards, see module docstring)."""
    return torch.empty(shape, dtype=torch.float32 if _interpreting() else FP8_DTYPE, device=device)


def _finish_codes(q: torch.Tensor) -> torch.Tensor:
    if q.dtype == FP8_DTYPE:
        return q
    return torch.clamp(q, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _col_major(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """(rows, cols) FP32 with strides (1, rows): the layout cuBLAS/CUTLASS read 1x128 scales in."""
    return torch.empty((cols, rows), dtype=torch.float32, device=device).t()


def padded_tokens(m: int) -> int:
    return -(-m // BLOCK) * BLOCK


def quant_act(x2d: torch.Tensor, recipe: Fp8Recipe | None = None, *, block_m: int | None = None,
              num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 group quant of a 2-D activation/gradient: q (M,K) row-major, s (M,K/128) column-major.

    block_m/num_warps are tuning knobs (rows per program, warps); they do not change the result."""
    _check_cuda_or_interp(x2d, "quant_act")
    m, k = _check_2d_groups(x2d, "quant_act")
    recipe = _recipe(recipe)
    q = _codes_buffer((m, k), x2d.device)
    s = _col_major(m, k // BLOCK, x2d.device)
    block_m = block_m or ACT_BLOCK_M
    num_warps = num_warps or ACT_WARPS
    if m:
        grid = (triton.cdiv(m, block_m), k // BLOCK)
        _quant_rows_kernel[grid](x2d, q, s, m, x2d.stride(0), x2d.stride(1), q.stride(0), s.stride(0), s.stride(1),
                                 recipe.amax_eps, POW2=recipe.scale_fmt == "pow2", CAST=not _interpreting(),
                                 BLOCK_M=block_m, GROUP=BLOCK, num_warps=num_warps)
    return _finish_codes(q), s


def quant_dual(g2d: torch.Tensor, recipe: Fp8Recipe | None = None, *, num_warps: int | None = None,
               trans_mode: int | None = None, split: bool | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """g (M,N) -> the 1x128 row-wise copy (q, s) and the token-grouped transposed copy qt (N,Mp) row-major with
    st (N,Mp/128) column-major (zero-padded tokens). split=False: one fused pass over g; split=True (default,
    DUAL_SPLIT): quant_act plus a transposed pass in 128x64 tiles, faster on the H200 (see DUAL_SPLIT)."""
    _check_cuda_or_interp(g2d, "quant_dual")
    m, n = _check_2d_groups(g2d, "quant_dual")
    recipe = _recipe(recipe)
    split = DUAL_SPLIT if split is None else split
    trans_mode = (REGROUP_TRANS_MODE if split else TRANS_MODE) if trans_mode is None else trans_mode
    mp = padded_tokens(m)
    if split:
        q, s = quant_act(g2d, recipe)
        qt = _codes_buffer((n, mp), g2d.device)
        st = _col_major(n, mp // BLOCK, g2d.device)
        if m:
            grid = (mp // BLOCK, n // REGROUP_FEATS)
            _regroup_kernel[grid](g2d, st, qt, st, m, n, g2d.stride(0), g2d.stride(1), 0, 0,
                                  qt.stride(0), st.stride(0), st.stride(1), recipe.amax_eps,
                                  POW2=recipe.scale_fmt == "pow2", CAST=not _interpreting(), TOKENS=BLOCK,
                                  GROUP=BLOCK, FEATS=REGROUP_FEATS, TRANS_MODE=trans_mode, HAS_SCALE=False,
                                  LOAD_VEC=REGROUP_VEC, num_warps=num_warps or REGROUP_WARPS)
        return q, s, _finish_codes(qt), st
    num_warps = num_warps or DUAL_WARPS
    q = _codes_buffer((m, n), g2d.device)
    s = _col_major(m, n // BLOCK, g2d.device)
    qt = _codes_buffer((n, mp), g2d.device)
    st = _col_major(n, mp // BLOCK, g2d.device)
    if m:
        grid = (mp // BLOCK, n // BLOCK)
        _quant_dual_kernel[grid](g2d, q, s, qt, st, m, n, g2d.stride(0), g2d.stride(1), q.stride(0), s.stride(0),
                                 s.stride(1), qt.stride(0), st.stride(0), st.stride(1), recipe.amax_eps,
                                 POW2=recipe.scale_fmt == "pow2", CAST=not _interpreting(), TOKENS=BLOCK,
                                 GROUP=BLOCK, TRANS_MODE=trans_mode, num_warps=num_warps)
    return _finish_codes(q), s, _finish_codes(qt), st


def regroup_for_wgrad(q: torch.Tensor, s: torch.Tensor, recipe: Fp8Recipe | None = None, *,
                      num_warps: int | None = None, trans_mode: int | None = None, feats: int | None = None,
                      load_vec: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Saved 1x128 FP8 activation (q (M,K), s (M,K/128), any scale strides) -> qt (K,Mp), st (K,Mp/128) col-major.

    Equals quantize_1x128(pad_tokens(dequantize_1x128(q, s)).t()) bit for bit; the FP32 dequantized tile lives only
    in registers."""
    _check_cuda_or_interp(q, "regroup_for_wgrad")
    m, k = _check_2d_groups(q, "regroup_for_wgrad")
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"regroup_for_wgrad: q must be {FP8_DTYPE}, got {q.dtype}")
    if tuple(s.shape) != (m, k // BLOCK) or s.dtype != torch.float32:
        raise ValueError(f"regroup_for_wgrad: scale must be float32 of shape {(m, k // BLOCK)}, got "
                         f"{s.dtype} {tuple(s.shape)} for q of shape {tuple(q.shape)}")
    recipe = _recipe(recipe)
    num_warps = num_warps or REGROUP_WARPS
    trans_mode = REGROUP_TRANS_MODE if trans_mode is None else trans_mode
    feats = feats or REGROUP_FEATS
    load_vec = REGROUP_VEC if load_vec is None else load_vec
    mp = padded_tokens(m)
    qt = _codes_buffer((k, mp), q.device)
    st = _col_major(k, mp // BLOCK, q.device)
    if m:
        q_in = q
        grid = (mp // BLOCK, k // feats)
        _regroup_kernel[grid](q_in, s, qt, st, m, k, q_in.stride(0), q_in.stride(1), s.stride(0), s.stride(1),
                              qt.stride(0), st.stride(0), st.stride(1), recipe.amax_eps,
                              POW2=recipe.scale_fmt == "pow2", CAST=not _interpreting(), TOKENS=BLOCK, GROUP=BLOCK,
                              FEATS=feats, TRANS_MODE=trans_mode, HAS_SCALE=True, LOAD_VEC=load_vec,
                              num_warps=num_warps)
    return _finish_codes(qt), st


def quant_weight(w: torch.Tensor, recipe: Fp8Recipe | None = None, *, with_transpose: bool = False):
    """128x128 block quant of a weight (N,K): (q, s) with s (ceil(N/128), ceil(K/128)) row-major.

    with_transpose=True also returns the (K,N) contiguous copy of the codes that the DGrad GEMM reads
    (128x128 blocks are transpose-invariant: the same codes and scales, no requantization)."""
    _check_cuda_or_interp(w, "quant_weight")
    if w.dim() != 2:
        raise ValueError(f"quant_weight: expected a 2-D (out, in) weight, got shape {tuple(w.shape)}")
    recipe = _recipe(recipe)
    n, k = w.shape
    nb, kb = triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)
    q = _codes_buffer((n, k), w.device)
    s = torch.empty((nb, kb), dtype=torch.float32, device=w.device)
    qt = _codes_buffer((k, n), w.device) if with_transpose else q
    if n and k:
        _quant_weight_kernel[(nb, kb)](w, q, s, qt, n, k, w.stride(0), w.stride(1), q.stride(0), s.stride(0),
                                       qt.stride(0), recipe.amax_eps, POW2=recipe.scale_fmt == "pow2",
                                       CAST=not _interpreting(), WRITE_T=with_transpose, TILE=BLOCK,
                                       TRANS_MODE=min(TRANS_MODE, 1), num_warps=8)
    if with_transpose:
        return _finish_codes(q), s, _finish_codes(qt)
    return _finish_codes(q), s


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    """(R,C) FP8 -> (C,R) contiguous FP8 (byte copy through uint8, which every torch build can transpose)."""
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"transpose_fp8: expected {FP8_DTYPE}, got {q.dtype}")
    return q.view(torch.uint8).t().contiguous().view(FP8_DTYPE)
