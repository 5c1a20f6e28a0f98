"""A frozen model's weights in host memory between its passes, on the device only inside one.

Why: the KL term's reference policy is a second copy of the model. Held on the GPU it costs its BF16 weights and, in
the FP8-training arms, its FP8 weight cache in every phase of every step: 21.7 GiB at Qwen3-8B, next to a rollout
engine and a trainer that already fill an 80 GB card. NeMo-RL keeps its reference state dict on the host and swaps it
in for the reference pass; here the reference keeps its own module, whose parameters point at page-locked host copies
between passes and at fresh device copies during one. The FP8 cache is rebuilt from the uploaded weights by the same
quantizer the policy's refresh uses (the same bytes as a reference kept on the device) and dropped after the pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from jetrl_megatron.megatron.host_pinning import PinnedHostMasters

__all__ = ["HostResidentWeights"]


class HostResidentWeights:
    """Moves ``model``'s parameters to host memory now (page-locked in place where the model is on CUDA:
    ``host_pinning.PinnedHostMasters``, no power-of-two rounding of torch's pinned allocator) and back onto their
    device only inside :meth:`on_device`. The model must not be trained: its parameters are swapped by ``.data``.
    ``fp8_cache``: the model is a ``build_gpt`` chunk with FP8 linears, whose weight cache is rebuilt for each pass
    and dropped after it."""

    def __init__(self, model: torch.nn.Module, *, fp8_cache: bool = False) -> None:
        self.model = model
        params = list({id(p): p for p in model.parameters()}.values())
        if not params:
            raise ValueError("HostResidentWeights: the model has no parameters")
        if any(p.requires_grad for p in params):
            raise ValueError("HostResidentWeights: the model's parameters must be frozen (requires_grad=False)")
        self.device = params[0].device
        self._fp8 = fp8_cache
        with torch.no_grad():
            self._pairs = [(p, torch.empty_like(p, device="cpu").copy_(p.data)) for p in params]
            for p, host in self._pairs:
                p.data = host
        self._drop_fp8_cache()
        self.host_bytes = sum(host.numel() * host.element_size() for _, host in self._pairs)
        # page-locked for fast uploads (a host that cannot lock more keeps the rest pageable: slower, same bytes)
        self.pinned = PinnedHostMasters(host for _, host in self._pairs) if self.device.type == "cuda" else None

    def _drop_fp8_cache(self) -> None:
        if self._fp8:
            from jetrl_megatron.megatron.model import fp8_context

            fp8_context(self.model).cache.clear()

    @contextmanager
    def on_device(self) -> Iterator[torch.nn.Module]:
        """The model with its weights uploaded (and its FP8 cache quantized from them) for one pass; afterwards the
        device copies and the cache are released to the allocator."""
        from jetrl_megatron.megatron.model import refresh_fp8_cache

        try:
            with torch.no_grad():
                for p, host in self._pairs:
                    p.data = host.to(self.device, non_blocking=True, copy=True)
                if self._fp8:
                    refresh_fp8_cache(self.model)
            yield self.model
        finally:
            for p, host in self._pairs:
                p.data = host
            self._drop_fp8_cache()
