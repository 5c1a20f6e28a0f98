"""Page-lock the CPU-offloaded optimizer's FP32 masters where they are, so each step's copy of the new weights back to
the GPU is a DMA from pinned memory instead of a staged copy from pageable memory.

Why: Megatron-Core 0.16's ``HybridDeviceOptimizer`` (``param_update_in_fp32``) pins the BF16 host clone of each
offloaded parameter and then converts it into a new FP32 tensor, which is pageable; those FP32 masters are what its
step post-hook copies into the GPU parameters. Its ``pin_cpu_params`` (default true) is stored but never acted on. On
one H100 at Qwen3-8B (offload 0.8) the copies cost 2.93 s of ``Memcpy HtoD (Pageable -> Device)`` in a 18.4 s update
(bench/qwen3_8b_1gpu/20261205e_h100/len1024_jetrl_profiled/profile_step2.md).

How: ``cuMemHostRegister`` (the driver's ``cudaHostRegister``) on each master's storage, in place: no copy, no
second host buffer (``Tensor.pin_memory()`` would copy into torch's caching host allocator, which rounds blocks up to
a power of two: up to 2x the 26 GB of masters at 8B on a host already 87% full). Tensors under ``MIN_PIN_BYTES`` are
left alone: their copies cost nothing, and small allocations share pages with other heap memory, which a registration
may not overlap. The registrations hold references to the storages, so none is freed while registered; ``release()``
unregisters them (``Fp8RefreshingOptimizer`` releases and re-pins after a checkpoint load, which rebuilds the masters).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Iterable

import torch

__all__ = ["MIN_PIN_BYTES", "PinnedHostMasters", "host_masters"]

log = logging.getLogger(__name__)

MIN_PIN_BYTES = 1 << 20

Register = Callable[[int, int], int]  # (address, bytes) -> CUDA driver error code, 0 = success
Unregister = Callable[[int], int]


def host_masters(hybrid_optimizer) -> list[torch.Tensor]:
    """The FP32 masters the hybrid optimizer's host sub-optimizers step (each tensor once, in their order)."""
    seen: dict[int, torch.Tensor] = {}
    for opt in hybrid_optimizer.cpu_optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


@functools.cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver library (already loaded by torch), with the two calls used here declared."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostRegister_v2.restype = ctypes.c_int
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuMemHostUnregister.restype = ctypes.c_int
    return lib


# Through the driver API, not the runtime's cudaHostRegister (torch.cuda.cudart()): a failed runtime call leaves its
# error pending on the thread, and torch's check after the next kernel launch (cudaGetLastError) would raise it there,
# far from its cause; a driver call's failure is only its return code.
def _cuda_register(address: int, nbytes: int) -> int:
    torch.cuda.synchronize()  # the device's primary context is current on this thread
    return int(_driver().cuMemHostRegister_v2(address, nbytes, 0))


def _cuda_unregister(address: int) -> int:
    return int(_driver().cuMemHostUnregister(address))


class PinnedHostMasters:
    """Host tensors registered as page-locked memory for as long as this object holds them."""

    def __init__(self, tensors: Iterable[torch.Tensor], *, register: Register = _cuda_register,
                 unregister: Unregister = _cuda_unregister, min_bytes: int = MIN_PIN_BYTES) -> None:
        self._unregister = unregister
        self._held: list[tuple[int, torch.UntypedStorage]] = []
        self.bytes = 0
        self.skipped_small = 0
        self.error: str | None = None
        addresses: set[int] = set()
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(f"PinnedHostMasters: a tensor of shape {tuple(t.shape)} is on {t.device}, not the "
                                 "host")
            storage = t.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes < min_bytes or t.is_pinned():
                self.skipped_small += nbytes < min_bytes
                continue
            if address in addresses:  # views of one storage: registered once
                continue
            code = register(address, nbytes)
            if code != 0:  # e.g. the host cannot lock more memory: the rest stay pageable, the step is unchanged
                self.error = (f"cuMemHostRegister of a {nbytes / 2**20:.1f} MiB host master failed (CUDA error "
                              f"{code}); {self.bytes / 2**30:.2f} GiB pinned, the rest stay pageable")
                log.warning("optimizer CPU offload: %s", self.error)
                break
            addresses.add(address)
            self._held.append((address, storage))
            self.bytes += nbytes

    @classmethod
    def of(cls, hybrid_optimizer, **kwargs) -> PinnedHostMasters:
        """Pin the FP32 masters of Megatron's ``HybridDeviceOptimizer`` (its host part)."""
        return cls(host_masters(hybrid_optimizer), **kwargs)

    @property
    def count(self) -> int:
        return len(self._held)

    def release(self) -> None:
        """Unregister every held storage (before it may be freed); idempotent."""
        while self._held:
            address, _ = self._held.pop()
            self._unregister(address)
        self.bytes = 0

    def __del__(self) -> None:
        # a registered range must be unregistered before its memory is freed: the storages go with this object
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter shutdown CUDA may already be gone
            pass

    def summary(self) -> str:
        if self.error:
            return self.error
        return f"{self.count} host FP32 masters page-locked in place ({self.bytes / 2**30:.2f} GiB)"
