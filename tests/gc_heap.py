"""Test processes: the garbage collector's full passes skip the objects that live for the whole process.

Why: a test process holds ~0.5-0.8 million tracked objects (torch, vLLM, Megatron-Core), and every full collection
walks them all (~0.45 s each on the 2-core CI box). vLLM runs about nine per engine (two when it loads the model,
one when it freezes its heap after start-up, the rest at shutdown, after it unfreezes everything): 38% of the
wall time of three engine-heavy test files went to them (17.6 of 46.4 s, measured 2026-12-06). Freezing the
survivors (``gc.freeze``: the permanent generation, which collections skip) after each test and after each engine
shutdown leaves vLLM's start-up passes only the objects made since; the shutdown passes are vLLM's and stay.
Only what survived a full collection is frozen, so nothing that was garbage then is kept; a cycle that dies later
is collected at the next unfreeze (vLLM's, at the next engine shutdown), and at exit everything is unfrozen again
(left frozen, the interpreter's last collection skips it and triton's nanobind bindings report "leaked" objects)."""

from __future__ import annotations

import atexit
import gc


def freeze_survivors() -> None:
    """Collect, then move every surviving tracked object to the permanent generation."""
    gc.collect()
    gc.freeze()


def install() -> None:
    """Freeze the survivors now and after every :meth:`RolloutEngine.shutdown` of this process (once per process)."""
    from jetrl_megatron.rollout.engine import RolloutEngine

    if not getattr(RolloutEngine.shutdown, "_freezes_survivors", False):
        shutdown = RolloutEngine.shutdown

        def shutdown_then_freeze(self) -> None:
            shutdown(self)  # its last step is a full collection: what is left is alive
            gc.freeze()

        shutdown_then_freeze._freezes_survivors = True  # type: ignore[attr-defined]
        RolloutEngine.shutdown = shutdown_then_freeze  # type: ignore[method-assign]
        atexit.register(gc.unfreeze)
    freeze_survivors()
