"""Triton kernels of the INT stress formats (experiment only, fp8/stress.py), bit-identical to their torch twins:

    int_codes(x (M,K), fmt)            -> codes (M,K) int8, scales (M,K/g) FP32   (twin: stress.quantize_act)
    scaled_int_products(p, xs, ws, b)  -> out (M,N): p (M,N) int32 code products of one K group, scaled by
                                          xs (M,1) x ws (N,1) in FP64, + bias, cast   (twin: stress_linear.stress_gemm)

Why: the torch twins are a dozen element-wise passes each, over FP32 copies of the activation and FP64 (M,N)
temporaries; at the count_150m_gpu shapes the stress linear took 11 ms per layer against BF16's 0.6 (16,512 tokens,
H100, 2026-12-07), so the unified INT4 arm's trainer and the stressed rollout were the learning round's slowest runs.
Each kernel reads its input once per pass and writes only what the GEMM or the next layer reads.

Bit-identity: the scale is ``max(amax, 1e-10) / qmax`` and the code ``clamp(rint(x / s), -qmax, qmax)``, both with IEEE
round-to-nearest FP32 division (``div_rn``; Triton's ``/`` is approximate) and round half to even (torch.round);
NaN in a group makes its scale NaN and its codes 0, as the twin's ``where(scale > 0, ...)``. The epilogue multiplies
in FP64 in the twin's order, ``p * (xs * ws)`` then ``+ bias``, without FMA contraction, and casts FP64 -> FP32 ->
the output dtype, as torch's cast from FP64 does (two round-to-nearest-even steps). Inputs with an infinity have no
INT code either way (the twin's code is NaN): not part of the contract.
"""

from __future__ import annotations

import torch

from jetrl_megatron.fp8.stress import AMAX_EPS, ELEMENT_MAX, StressFormat
from jetrl_megatron.fp8.triton_common import interpreting, launch_opts

try:
    import triton
    import triton.language as tl

    from jetrl_megatron.fp8.triton_common import round_bf16
except ImportError:  # CPU installs without triton: the torch twins run
    triton = None

INT_ELEMENTS = ("int4", "int3")
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1}
# launch shapes; results never depend on them
CODES_BLOCK_M, CODES_CHUNK = 4, 1024
EPI_BLOCK_M, EPI_BLOCK_N = 32, 128


def runs_on(t: torch.Tensor) -> bool:
    """Whether these kernels can take ``t``'s device: CUDA, or any device under the Triton interpreter."""
    return triton is not None and (t.is_cuda or interpreting())


def int_codes_supported(x2d: torch.Tensor, fmt: StressFormat) -> bool:
    """Whether ``int_codes`` takes this activation: an INT format with FP32 scales, a BF16 / FP32 2-D tensor with unit
    column stride, on a device the kernels run on."""
    return (runs_on(x2d) and fmt.element in INT_ELEMENTS and fmt.scale == "fp32" and x2d.dim() == 2
            and x2d.dtype in _OUT_KINDS and x2d.stride(-1) == 1)


def scaled_products_supported(p: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return runs_on(p) and p.dtype == torch.int32 and p.dim() == 2 and out_dtype in _OUT_KINDS


if triton is not None:

    @triton.jit
    def _round_half_even(y):
        """torch.round (half to even) in exact FP32 arithmetic, the same on the GPU and in the interpreter (which has
        no libdevice): a = |y| = r + d with r = floor(a) and d = a - r exact (Sterbenz, a >= 1; d = a below); up
        where d > 1/2, or d = 1/2 and r is odd."""
        a = tl.abs(y)
        r = tl.floor(a)
        d = a - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
        return tl.where(y < 0, -r, r)

    @triton.jit(do_not_specialize=["M"])
    def _int_codes_kernel(x_ptr, q_ptr, s_ptr, M, GROUP, stride_xm, stride_qm, stride_sm, eps, qmax,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
        """Program (row block, K group): the group's amax (first pass), its scale, then its codes (second pass)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        j = tl.program_id(1)
        rmask = rows < M
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        nan = tl.zeros([BLOCK_M], dtype=tl.int32)
        for c in range(0, GROUP, CHUNK):
            cols = c + tl.arange(0, CHUNK)
            m = rmask[:, None] & (cols < GROUP)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (j * GROUP + cols)[None, :], mask=m, other=0.0)
            x = x.to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
            nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))
        scale = tl.div_rn(tl.maximum(amax, eps), qmax)
        scale = tl.where(nan > 0, float("nan"), scale)
        tl.store(s_ptr + rows * stride_sm + j, scale, mask=rmask)
        ok = scale > 0  # False for NaN: the group's codes are 0
        safe = tl.where(ok, scale, 1.0)
        for c in range(0, GROUP, CHUNK):
            cols = c + tl.arange(0, CHUNK)
            m = rmask[:, None] & (cols < GROUP)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (j * GROUP + cols)[None, :], mask=m, other=0.0)
            r = _round_half_even(tl.div_rn(x.to(tl.float32), safe[:, None]))
            r = tl.minimum(tl.maximum(r, -qmax), qmax)
            code = tl.where(ok[:, None], r, 0.0)
            tl.store(q_ptr + rows[:, None] * stride_qm + (j * GROUP + cols)[None, :], code.to(tl.int8), mask=m)

    @triton.jit(do_not_specialize=["M"])
    def _scaled_products_kernel(p_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, M, N, stride_pm, stride_ym,
                                HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, EMU_BF16: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < M, cols < N
        m = rmask[:, None] & cmask[None, :]
        p = tl.load(p_ptr + rows[:, None] * stride_pm + cols[None, :], mask=m, other=0).to(tl.float64)
        xs = tl.load(xs_ptr + rows, mask=rmask, other=0.0).to(tl.float64)
        ws = tl.load(ws_ptr + cols, mask=cmask, other=0.0).to(tl.float64)
        acc = p * (xs[:, None] * ws[None, :])
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float64)[None, :]
        y = acc.to(tl.float32)
        if OUT_BF16:
            y = round_bf16(y, EMU_BF16)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def int_codes(x2d: torch.Tensor, fmt: StressFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act(x2d, fmt)`` of an INT format in one kernel: int8 codes (the values the twin's FP32 codes hold)
    and FP32 scales (M, K/g), bit for bit."""
    if not int_codes_supported(x2d, fmt):
        raise ValueError(f"int_codes: format {fmt.name} on a {x2d.dtype} tensor of shape {tuple(x2d.shape)} "
                         f"({x2d.device}) is not one the kernel takes (int_codes_supported)")
    m, k = x2d.shape
    g = fmt.group_of(k, f"activation of shape {tuple(x2d.shape)}")
    q = torch.empty(m, k, dtype=torch.int8, device=x2d.device)
    s = torch.empty(m, k // g, dtype=torch.float32, device=x2d.device)
    if m:
        _int_codes_kernel[(triton.cdiv(m, CODES_BLOCK_M), k // g)](
            x2d, q, s, m, g, x2d.stride(0), q.stride(0), s.stride(0), AMAX_EPS, ELEMENT_MAX[fmt.element],
            BLOCK_M=CODES_BLOCK_M, CHUNK=min(CODES_CHUNK, triton.next_power_of_2(g)), **launch_opts())
    return q, s


def scaled_int_products(p: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """One K group's exact int32 code products ``p`` (M,N) scaled by ``xs`` (M,1) x ``ws`` (N,1) in FP64, plus
    ``bias``, cast to ``out_dtype``: ``stress_gemm``'s result for a one-group format, bit for bit."""
    m, n = p.shape
    if not scaled_products_supported(p, out_dtype) or xs.shape != (m, 1) or ws.shape != (n, 1):
        raise ValueError(f"scaled_int_products: products {p.dtype} {tuple(p.shape)}, scales x {tuple(xs.shape)} / "
                         f"w {tuple(ws.shape)}, output {out_dtype}: not one group's operands the kernel takes")
    p = p if p.stride(1) == 1 else p.contiguous()
    xs, ws = xs.float().contiguous(), ws.float().contiguous()
    b = bias.contiguous() if bias is not None else xs
    y = torch.empty(m, n, dtype=out_dtype, device=p.device)
    if m and n:
        _scaled_products_kernel[(triton.cdiv(m, EPI_BLOCK_M), triton.cdiv(n, EPI_BLOCK_N))](
            p, xs, ws, b, y, m, n, p.stride(0), y.stride(0), HAS_BIAS=bias is not None,
            OUT_BF16=out_dtype == torch.bfloat16, EMU_BF16=interpreting(), BLOCK_M=EPI_BLOCK_M, BLOCK_N=EPI_BLOCK_N,
            **launch_opts())
    return y
