"""Per-step FP8 weight cache: master weights are quantized once per optimizer step, then reused by every forward,
every DGrad and every refit of that step — the bytes vLLM serves are the bytes the trainer computed with.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from jetrl_megatron.fp8 import quant_dispatch
from jetrl_megatron.fp8.backends._layout import forget_derived
from jetrl_megatron.recipe import Fp8Recipe


class StaleFp8WeightError(RuntimeError):
    """The FP8 copy is older than its master weight (or missing): refresh after optimizer.step()."""


class NonFiniteWeightError(ValueError):
    """A master weight holds NaN/Inf; it is never written into the cache."""


@dataclass
class _Entry:
    name: str
    param: weakref.ref
    q: torch.Tensor
    s: torch.Tensor
    version: int
    generation: int


def _same_layout(a: _Entry, b: _Entry) -> bool:
    return all(x.shape == y.shape and x.dtype == y.dtype and x.stride() == y.stride() and x.device == y.device
               for x, y in ((a.q, b.q), (a.s, b.s)))


class Fp8WeightCache:
    """Maps master parameters to their FP8 (q, weight_scale_inv) copies for the current optimizer step.

    Staleness is detected with the parameter's version counter (bumped by in-place updates such as `param.add_`).
    Updates through `param.data` do not bump it, so optimizers that write `param.data` must call `refresh` (or
    `invalidate`) after stepping — the Megatron optimizer hook does exactly that. `reference_quant`: quantize CUDA
    weights with the torch reference instead of the Triton kernel (bit-identical; the model context's choice).
    """

    def __init__(self, recipe: Fp8Recipe | None = None, *, reference_quant: bool = False) -> None:
        self.recipe = recipe or Fp8Recipe()
        self.reference_quant = bool(reference_quant)
        self.generation = 0
        self._entries: dict[int, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def refresh(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Quantize every given master weight. All-or-nothing: a non-finite weight aborts before any entry changes.

        An entry that exists already is overwritten in place (same tensors, same storage), so anything planned on
        the cache's tensors - the resharder's refit program, a CUDA graph of it - stays valid across steps. The
        layouts derived from an overwritten entry (DGrad's K-major codes, re-laid-out scales) are stale and dropped
        here, before the rollout, not held until the next backward rebuilds them.
        """
        items = list(named_params)
        for name, p in items:
            if not bool(torch.isfinite(p.detach()).all()):
                raise NonFiniteWeightError(
                    f"master weight {name!r} (shape {tuple(p.shape)}) contains NaN/Inf; the FP8 cache was not updated"
                )
        generation = self.generation + 1
        fresh = {}
        with torch.no_grad():
            for name, p in items:
                q, s = quant_dispatch.quant_weight(p.detach(), self.recipe, reference_quant=self.reference_quant)
                fresh[id(p)] = _Entry(name, weakref.ref(p), q, s, p._version, generation)
            for key, entry in fresh.items():
                old = self._entries.get(key)
                if old is not None and old.param() is entry.param() and _same_layout(old, entry):
                    # Same storage every step: consumers that planned copies from these tensors (the resharder's
                    # refit program, a captured CUDA graph) stay valid; in-place writes bump the version counters
                    # that derived layouts (e.g. DGrad's transposed codes) are keyed on.
                    old.q.copy_(entry.q)
                    old.s.copy_(entry.s)
                    forget_derived(old.q)
                    forget_derived(old.s)
                    entry.q, entry.s = old.q, old.s
        self._entries.update(fresh)
        self.generation = generation

    def continue_count(self, generation: int) -> None:
        """Number the current entries ``generation`` and count on from there: a resumed run's refreshes continue the
        count of the run it resumes (the metric ``train/fp8_generation``), not restart at the load's own refresh."""
        self.generation = generation
        for entry in self._entries.values():
            entry.generation = generation

    def clear(self) -> None:
        """Drop every entry and the layouts derived from it (a model whose weights leave the device between passes:
        megatron/host_resident.py); the next forward needs a ``refresh``."""
        for entry in self._entries.values():
            forget_derived(entry.q)
            forget_derived(entry.s)
        self._entries.clear()

    def invalidate(self) -> None:
        """Mark every entry stale (e.g. after an out-of-band weight load through `param.data`)."""
        for entry in self._entries.values():
            entry.version = -1

    def get(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self._entries.get(id(param))
        if entry is None or entry.param() is not param:
            raise StaleFp8WeightError(
                f"no FP8 copy for parameter of shape {tuple(param.shape)}; call Fp8WeightCache.refresh() after "
                "optimizer.step()"
            )
        if entry.version != param._version:
            raise StaleFp8WeightError(
                f"FP8 copy of {entry.name!r} is stale: the master weight changed after refresh #{entry.generation}; "
                "call refresh() after optimizer.step()"
            )
        return entry.q, entry.s

    def named_fp8(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """name -> (q, weight_scale_inv) of the live entries (what the resharder ships to vLLM)."""
        return {e.name: (e.q, e.s) for e in self._entries.values() if e.param() is not None}
