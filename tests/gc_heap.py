"""Test processes: the garbage collector's full passes skip the objects that live for the whole process.

Why: a test process holds ~0.5-0.8 million tracked objects (torch, vLLM, Megatron-Core), and every full collection
walks them all (~0.45 s each on the 2-core CI box). vLLM runs about nine per engine (two when it loads the model,
one when it freezes its heap after start-up, the rest at shutdown, after it unfreezes everything): 38% of the
wall time of three engine-heavy test files went to them (17.6 of 46.4 s, measured 2026-12-06). Freezing the
survivors (``gc.freeze``: the permanent generation, which collections skip) after each test, and on CPU after each
engine shutdown, leaves vLLM's start-up passes only the objects made since; the shutdown passes are vLLM's and stay.

What is frozen survived a full collection. Frozen objects that die later are not collected until the next
``gc.unfreeze``: after a test whose engine shutdown froze the heap mid-test, the teardown unfreezes and collects
before freezing again (that test's models, still referenced at the shutdown, are freed there); the mid-test freeze is
CPU-only (on a GPU a dead model kept alive until the test's end would hold memory the next engine's start counts);
and everything is unfrozen at exit (left frozen, the interpreter's last collection skips it and triton's nanobind
bindings report "leaked" objects)."""

from __future__ import annotations

import atexit
import functools
import gc

_froze_mid_test = [False]
_installed = [False]


def freeze_survivors() -> None:
    """Collect, then move every surviving tracked object to the permanent generation (after an engine shutdown
    froze the heap during the test: unfreeze first, so what the test dropped since is collected too)."""
    if _froze_mid_test[0]:
        gc.unfreeze()
        _froze_mid_test[0] = False
    gc.collect()
    gc.freeze()


def install() -> None:
    """Freeze the survivors now and, on a machine without CUDA, after every :meth:`RolloutEngine.shutdown` of this
    process; unfreeze at exit (set up once per process)."""
    if not _installed[0]:
        _installed[0] = True
        atexit.register(gc.unfreeze)
        import torch

        if not torch.cuda.is_available():
            from jetrl_megatron.rollout.engine import RolloutEngine

            shutdown = RolloutEngine.shutdown

            @functools.wraps(shutdown)
            def shutdown_then_freeze(self) -> None:
                running = getattr(self, "llm", None) is not None
                shutdown(self)
                if running:  # its last step was a full collection: what is left is alive
                    gc.freeze()
                    _froze_mid_test[0] = True

            RolloutEngine.shutdown = shutdown_then_freeze  # type: ignore[method-assign]
    freeze_survivors()
