"""Scale/operand re-layouts shared by the GPU backends, and a cache of tensors derived from long-lived weights.

The FP8 weight and its scales live for a whole optimizer step (the weight cache refreshes them in place or replaces
them), so layouts derived from them — the K-major transposed codes DGrad reads, the L4-padded scale blocks cuBLAS
reads — are computed once per tensor version instead of once per GEMM.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

_cache: dict[tuple[int, str], tuple[weakref.ref, int, int, torch.Tensor]] = {}


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: never cache them
        return None


def derived(t: torch.Tensor, tag: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """make(t), cached per (tensor object, tag) and invalidated when t is modified in place or freed."""
    version = _version(t)
    if version is None:
        return make(t)
    key = (id(t), tag)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is t and hit[1] == version and hit[2] == t.data_ptr():
        return hit[3]
    out = make(t)
    ref = weakref.ref(t, lambda _r, key=key: _cache.pop(key, None))
    _cache[key] = (ref, version, t.data_ptr(), out)
    return out


def col_major(s: torch.Tensor) -> torch.Tensor:
    """The same (R, G) scale values with strides (1, R) (copy only if needed)."""
    rows = s.shape[0]
    if s.stride(0) == 1 and (s.stride(1) == rows or s.shape[1] == 1):
        return s
    return s.t().contiguous().t()


def pad_cols4(s: torch.Tensor) -> torch.Tensor:
    """Row-major (R, G) -> row-major (R, round_up(G, 4)) with zero columns: cuBLAS's K-block padding rule (L4)."""
    rows, groups = s.shape
    l4 = -(-groups // 4) * 4
    out = torch.zeros((rows, l4), dtype=torch.float32, device=s.device)
    out[:, :groups] = s
    return out


def contiguous_codes(q: torch.Tensor) -> torch.Tensor:
    """Row-major FP8 codes (byte copy through uint8 only when needed)."""
    return q if q.is_contiguous() else q.view(torch.uint8).contiguous().view(q.dtype)
