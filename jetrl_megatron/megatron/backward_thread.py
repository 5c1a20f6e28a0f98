"""Where autograd runs the trainer's backward (``policy.jet_rl.backward_thread``).

On CUDA autograd hands a backward to its own per-device worker thread; there every call of the FP8 linear's backward
took about twice the host time it takes on the training thread (H100, 2026-12-07, bench/RESULTS.md), and at the
update's micro-batch the GPU waits for that host time. ``calling`` keeps the backward on the thread that calls it:
the same kernels in the same order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# No torch import at module level: the run config (rl/config/schema.py) reads BACKWARD_THREADS.
BACKWARD_THREADS = ("calling", "device")


def backward_thread_scope(where: str) -> contextlib.AbstractContextManager[None]:
    """The context in which a backward runs on ``where``: ``"calling"`` (this thread) or ``"device"`` (autograd's
    per-device worker, PyTorch's default). An unknown value is refused here, when the scope is made; the switch is
    thread-local, set on entering and the caller's own setting back on exit."""
    if where not in BACKWARD_THREADS:
        raise ValueError(f"backward_thread: {where!r} is not one of {BACKWARD_THREADS}")
    return _multithreading(where == "device")


@contextlib.contextmanager
def _multithreading(enabled: bool) -> Iterator[None]:
    import torch

    with torch.autograd.set_multithreading_enabled(enabled):
        yield
