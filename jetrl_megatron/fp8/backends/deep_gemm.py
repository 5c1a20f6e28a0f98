"""DeepGEMM backend (import-guarded): the `deep_gemm` package, or the copy vLLM bundles as vllm.third_party.deep_gemm.

FProp/DGrad use the SM90 1D2D kernel (A 1x128, B 128x128, BF16 out); WGrad the 1D1D kernel (both 1x128 along tokens),
which DeepGEMM only offers with an FP32 accumulator (D = C + A.B^T), cast to the requested dtype afterwards.
DeepGEMM wants the A scales column-major with the M stride padded to a multiple of 4 (16-byte TMA alignment).
Our scales are FP32 and must be used as they are: every call passes `disable_ue8m0_cast=True` (DeepGEMM would
otherwise round them to powers of two, UE8M0, on architectures that want it), so the GEMM computes with exactly the
scales the trainer and the rollout engine hold.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from jetrl_megatron.fp8.backends._layout import contiguous_codes, derived
from jetrl_megatron.fp8.kernels import transpose_fp8

_module: ModuleType | None | bool = False


def _dg() -> ModuleType | None:
    global _module
    if _module is False:
        _module = None
        for name in ("deep_gemm", "vllm.third_party.deep_gemm"):
            try:
                candidate = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - any import failure means "not available"
                continue
            if hasattr(candidate, "fp8_gemm_nt"):
                _module = candidate
                if hasattr(candidate, "set_pdl"):  # programmatic dependent launch on Hopper, as vLLM enables it
                    candidate.set_pdl(True)
                break
    return _module  # type: ignore[return-value]


def available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _dg() is not None


def _tma_col_major(s: torch.Tensor) -> torch.Tensor:
    """(R, G) scales -> the same values with strides (1, round_up(R, 4)); no copy when they already are."""
    rows, groups = s.shape
    ld = -(-rows // 4) * 4
    if s.dtype == torch.float32 and s.stride(0) == 1 and (groups == 1 or s.stride(1) == ld):
        return s
    out = torch.empty((groups, ld), dtype=torch.float32, device=s.device)
    out[:, :rows] = s.t()
    return out.t()[:rows]


def fprop(xq, xs, wq, ws, *, bias=None, out_dtype=torch.bfloat16):
    m, n = xq.shape[0], wq.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    _dg().fp8_gemm_nt((contiguous_codes(xq), _tma_col_major(xs)), (contiguous_codes(wq), ws.float().contiguous()),
                      out, disable_ue8m0_cast=True)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)


def dgrad(gq, gs, wq, ws, *, out_dtype=torch.bfloat16):
    wt = derived(wq, "kmajor_t", transpose_fp8)
    wts = derived(ws, "deep_gemm_t", lambda s: s.float().t().contiguous())
    out = torch.empty((gq.shape[0], wt.shape[0]), dtype=torch.bfloat16, device=gq.device)
    _dg().fp8_gemm_nt((contiguous_codes(gq), _tma_col_major(gs)), (wt, wts), out, disable_ue8m0_cast=True)
    return out.to(out_dtype)


def wgrad(gtq, gts, xtq, xts, *, out_dtype=torch.bfloat16):
    n, k = gtq.shape[0], xtq.shape[0]
    acc = torch.zeros((n, k), dtype=torch.float32, device=gtq.device)
    _dg().fp8_gemm_nt((contiguous_codes(gtq), _tma_col_major(gts)), (contiguous_codes(xtq), _tma_col_major(xts)),
                      acc, c=acc, recipe=(1, 1, 128), disable_ue8m0_cast=True)
    return acc.to(out_dtype)
