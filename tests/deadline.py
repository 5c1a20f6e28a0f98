"""A wall-clock limit for test steps that start vLLM: it can hang instead of raising (docs/vllm_cpu.md)."""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def deadline(seconds: int, what: str):
    """Raise TimeoutError in the main thread if the block runs longer than `seconds`."""
    def boom(*_):
        raise TimeoutError(f"{what} took longer than {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
