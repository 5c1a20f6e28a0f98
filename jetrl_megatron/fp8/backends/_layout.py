"""Scale/operand re-layouts shared by the GPU backends, and a cache of tensors derived from long-lived weights.

The FP8 weight and its scales live for a whole optimizer step (the weight cache refreshes them in place or replaces
them), so layouts derived from them — the K-major transposed codes DGrad reads, the L4-padded scale blocks cuBLAS
reads — are computed once per tensor version instead of once per GEMM. The weight cache drops a tensor's layouts
when it refreshes the tensor (:func:`forget_derived`): stale from then on, they would otherwise stay until the next
backward replaced them, through the rollout, the logprob pass and the refit (6.5 GiB of K-major codes at Qwen3-8B).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

# id(tensor) -> (weakref to it, {tag: (version, data_ptr, derived tensor)})
_cache: dict[int, tuple[weakref.ref, dict[str, tuple[int, int, torch.Tensor]]]] = {}


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
    key = id(t)
    slot = _cache.get(key)
    if slot is None or slot[0]() is not t:
        slot = (weakref.ref(t, lambda _r, key=key: _cache.pop(key, None)), {})
        _cache[key] = slot
    hit = slot[1].get(tag)
    if hit is not None and hit[0] == version and hit[1] == t.data_ptr():
        return hit[2]
    slot[1].pop(tag, None)  # a stale layout goes before its replacement is made, not after
    out = make(t)
    slot[1][tag] = (version, t.data_ptr(), out)
    return out


def forget_derived(t: torch.Tensor) -> None:
    """Drop every layout derived from ``t`` (they are rebuilt on next use): for a tensor just rewritten in place,
    whose cached layouts are stale but would be held until the next lookup replaced them."""
    slot = _cache.get(id(t))
    if slot is not None and slot[0]() is t:
        slot[1].clear()


def derived_bytes() -> int:
    """Bytes held by the cached layouts (what :func:`forget_derived` can give back)."""
    return sum(out.untyped_storage().nbytes() for _, tags in _cache.values() for _, _, out in tags.values())


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
