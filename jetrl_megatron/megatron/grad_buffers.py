"""Free Megatron DDP's gradient buffers between optimizer updates, so a colocated rollout engine gets that memory.

Why: Megatron's ``DistributedDataParallel`` keeps one contiguous gradient buffer per dtype (``buffers[*].grad_data``:
FP32 with ``grad_reduce_in_fp32``, else BF16), full-size on every model-parallel rank even under the distributed
optimizer; ``param.main_grad``, the buckets' ``grad_data`` and the distributed optimizer's gradient shards are views
into it. Nothing in it is needed between an optimizer step and the next ``zero_grad_buffer()``, yet it stays
allocated through rollout, where vLLM needs the memory (2 or 4 B per parameter of this rank's shard).

How: :class:`ReleasableGradDDP` is Megatron's DDP using Megatron 0.16's own ``offload_grad_buffers`` /
``restore_grad_buffers`` (``storage.resize_(0)``; later ``resize_(nbytes)`` and zero). The storage object stays the
same, so every view (``main_grad``, bucket and shard views) sees the new memory once restored and nothing is rebuilt.
Megatron does not check for use in between, and that use is a write through a null pointer (a segfault on CPU, an
illegal address on CUDA), so this class adds guards while the buffers are released:

- a backward raises :class:`GradBuffersReleasedError` from a hook on every parameter's gradient, which runs before
  DDP's hook would accumulate into ``param.main_grad``;
- ``param.main_grad`` is a stand-in whose every use raises the same error (an optimizer step, a gradient export);
- ``start_grad_sync`` / ``finish_grad_sync`` / ``scale_gradients`` raise;
- ``zero_grad_buffer()``, which starts every accumulation, restores (zeroed) first, so Megatron's usual sequence
  (zero_grad_buffer, forward/backward, optimizer step) needs no extra call.

On CUDA the release also empties PyTorch's allocator cache: freed blocks that stay cached are not usable by vLLM's
own allocator (sleep mode), which is the point of releasing them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel

__all__ = [
    "GradBuffersReleasedError",
    "ReleasableGradDDP",
    "release_grad_buffers",
    "restore_grad_buffers",
    "grad_buffer_bytes",
    "grad_buffers_released",
]


class GradBuffersReleasedError(RuntimeError):
    """Gradients were used while the DDP grad buffers were released (their memory is gone)."""


_HOW = "call restore_grad_buffers(model) or model.zero_grad_buffer() first"


class _ReleasedMainGrad(torch.Tensor):
    """What ``param.main_grad`` is while the buffers are released: any tensor operation raises instead of touching
    freed memory (``main_grad is None`` and ``hasattr`` still work, so the failure is the use, not the lookup)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise GradBuffersReleasedError(f"param.main_grad used ({getattr(func, '__name__', func)}) while the DDP "
                                       f"grad buffers are released: {_HOW}")

    def __repr__(self) -> str:
        return "<main_grad: DDP grad buffers released>"


_STAND_IN: list[torch.Tensor] = []


def _stand_in() -> torch.Tensor:
    if not _STAND_IN:
        _STAND_IN.append(torch.Tensor._make_subclass(_ReleasedMainGrad, torch.empty(0, device="meta")))
    return _STAND_IN[0]


def _raise_on_backward(_grad: torch.Tensor) -> None:
    raise GradBuffersReleasedError(f"backward while the DDP grad buffers are released: {_HOW}")


@dataclass
class _Released:
    main_grads: dict[torch.nn.Parameter, torch.Tensor] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)


class ReleasableGradDDP(DistributedDataParallel):
    """Megatron DDP whose grad buffers can be released (0 bytes) and restored (zeroed), with guards in between."""

    _jetrl_released: _Released | None = None

    def _grad_buffers(self) -> list:
        return list(self.buffers) + list(self.expert_parallel_buffers)

    @property
    def grad_buffers_released(self) -> bool:
        return self._jetrl_released is not None

    def grad_buffer_bytes(self) -> int:
        """Bytes the grad buffers hold now (0 while released)."""
        return sum(b.grad_data.untyped_storage().nbytes() for b in self._grad_buffers())

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        """Release the grad buffers (Megatron's name; nothing is copied to CPU: gradients are not kept).
        Idempotent. ``synchronize`` / ``empty_cache`` apply on CUDA only."""
        if self.grad_buffers_released:
            return
        for b in self._grad_buffers():
            if b.param_data is not None and (b.param_data.untyped_storage().data_ptr()
                                             == b.grad_data.untyped_storage().data_ptr()):
                raise RuntimeError("the DDP grad buffer shares its storage with the parameters (Megatron's MXFP8 "
                                   "shared buffer): releasing it would free the weights")
        state = _Released()
        stand_in = _stand_in()
        for p in self.params_with_grad:
            state.hooks.append(p.register_hook(_raise_on_backward))
            if getattr(p, "main_grad", None) is not None:
                state.main_grads[p] = p.main_grad
                p.main_grad = stand_in
        self._jetrl_released = state
        cuda = torch.cuda.is_available()
        with warnings.catch_warnings():  # Megatron sizes the storage through the deprecated TypedStorage API
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            super().offload_grad_buffers(synchronize=synchronize and cuda, empty_cache=empty_cache and cuda)

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """Re-allocate the grad buffers, zeroed, and lift the guards. Idempotent."""
        state = self._jetrl_released
        if state is None:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            super().restore_grad_buffers(synchronize=synchronize and torch.cuda.is_available())
        for p, g in state.main_grads.items():
            p.main_grad = g
        for h in state.hooks:
            h.remove()
        self._jetrl_released = None

    def zero_grad_buffer(self) -> None:
        """Megatron's start of an accumulation; restores released buffers first."""
        self.restore_grad_buffers()
        super().zero_grad_buffer()

    def _check_allocated(self, what: str) -> None:
        if self.grad_buffers_released:
            raise GradBuffersReleasedError(f"{what} while the DDP grad buffers are released: {_HOW}")

    def start_grad_sync(self, *args: Any, **kwargs: Any) -> None:
        self._check_allocated("start_grad_sync")
        super().start_grad_sync(*args, **kwargs)

    def finish_grad_sync(self, *args: Any, **kwargs: Any) -> None:
        self._check_allocated("finish_grad_sync")
        super().finish_grad_sync(*args, **kwargs)

    def scale_gradients(self, *args: Any, **kwargs: Any) -> None:
        self._check_allocated("scale_gradients")
        super().scale_gradients(*args, **kwargs)


def _chunks(model: Any) -> list[ReleasableGradDDP]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for c in chunks:
        if not isinstance(c, ReleasableGradDDP):
            raise TypeError("expected the model chunk of jetrl_megatron.megatron.policy.build_policy, got "
                            f"{type(c).__name__}")
    return chunks


def release_grad_buffers(model: ReleasableGradDDP | Iterable[ReleasableGradDDP]) -> int:
    """Free the grad buffers of ``model`` (a chunk or a list of chunks); returns the bytes freed."""
    freed = 0
    for c in _chunks(model):
        before = c.grad_buffer_bytes()
        c.offload_grad_buffers()
        freed += before - c.grad_buffer_bytes()
    return freed


def restore_grad_buffers(model: ReleasableGradDDP | Iterable[ReleasableGradDDP]) -> None:
    """Re-allocate (zeroed) the grad buffers released by :func:`release_grad_buffers`."""
    for c in _chunks(model):
        c.restore_grad_buffers()


def grad_buffer_bytes(model: ReleasableGradDDP | Iterable[ReleasableGradDDP]) -> int:
    """Bytes held by the grad buffers of ``model`` right now."""
    return sum(c.grad_buffer_bytes() for c in _chunks(model))


def grad_buffers_released(model: ReleasableGradDDP | Iterable[ReleasableGradDDP]) -> bool:
    return any(c.grad_buffers_released for c in _chunks(model))
