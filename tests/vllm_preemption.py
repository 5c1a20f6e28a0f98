"""Test and bench aids for the rollout's waves (rollout/kv_waves.py): count vLLM's preemptions, and submit a batch
as one request list. Both reach into vLLM's in-process engine: measurement aids, not product code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def count_preemptions(engine) -> list[int]:
    """A counter (``[n]``) of the in-process scheduler's preemptions from now on, by wrapping its preempt call."""
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    count, preempt = [0], scheduler._preempt_request

    def counted(*args, **kwargs):
        count[0] += 1
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counted
    return count


@contextmanager
def one_submission(engine) -> Iterator[None]:
    """Inside: ``engine.generate`` submits the whole batch at once, as before the waves (vLLM may preempt)."""
    engine._waves = lambda lengths, n, max_tokens: [[(i, 0, n) for i in range(len(lengths))]]
    try:
        yield
    finally:
        del engine._waves
