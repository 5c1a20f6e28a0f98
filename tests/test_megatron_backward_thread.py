"""Where autograd runs the trainer's backward (``train_step`` / ``forward_backward(backward_thread=)``,
``policy.jet_rl.backward_thread``).

Why: on CUDA autograd runs a backward on its own per-device worker thread, and there every op of the FP8 linear's
backward took about twice the host time it takes on the training thread (H100, 2026-12-07, bench/RESULTS.md: the four
FP8 linears of a Qwen3-8B layer at 2,048 tokens 4.28 -> 2.48 ms of host time per fwd+bwd; the layer eager 6.73 ->
4.69 ms). At the update's micro-batch that host time is what the GPU waits for. The default is the calling thread.

GPU (``gpu``): the backward's hooks run on the training thread by default and on another thread with ``device``, and
the gradients are the same bytes either way (the deterministic attention backward, so that only the thread
differs), with and without activation checkpointing (whose recompute runs a backward inside the backward). CPU: the
switch as the backward sees it (autograd's thread-local flag, handed to the hooks) and the refusal of an unknown
value are in tests/test_megatron_model.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _loss_recording_threads(threads: list[int]):
    def loss(lp, mb):
        import threading

        lp.register_hook(lambda g: threads.append(threading.get_ident()))
        return -lp.mean(), {}
    return loss


def _run(rank: int, world_size: int, out_dir: str) -> None:
    import threading
    from pathlib import Path

    from megatron_helpers import hf_state, tiny_shape

    from jetrl_megatron.megatron.model import forward_backward, unwrap
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.recipe import Fp8Recipe

    shape = tiny_shape("qwen3")
    tokens = torch.randint(0, shape.vocab_size, (4, 256), generator=torch.Generator().manual_seed(6))
    out = {"main": threading.get_ident()}
    # as the loop builds it, without and with activation checkpointing (Megatron's recompute runs a reentrant
    # backward inside the backward: on the calling thread too)
    for recompute in (False, True):
        extra = ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
                 if recompute else {"recompute_granularity": None})
        policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=hf_state(shape, seed=5, std=0.02),
                              optimizer={"lr": 1e-4}, deterministic_backward=True, **extra)
        for where in ("calling", "device"):
            threads: list[int] = []
            forward_backward([policy.model], {"tokens": tokens}, _loss_recording_threads(threads),
                             micro_batch_size=2, backward_thread=where)
            torch.cuda.synchronize()
            out[(recompute, where)] = {"threads": threads,
                                       "grads": {n: p.main_grad.detach().cpu().clone()
                                                 for n, p in unwrap(policy.model).named_parameters()}}
        del policy
    torch.save(out, Path(out_dir) / "threads.pt")


def test_the_backward_runs_on_the_training_thread_by_default_and_gives_the_same_gradients(tmp_path, monkeypatch):
    from jetrl_megatron.megatron import cpu

    monkeypatch.setattr(cpu, "SPAWN_START_METHOD", "spawn")  # a fresh interpreter: CUDA in a forked child fails
    cpu.spawn(_run, 1, str(tmp_path))
    got = torch.load(tmp_path / "threads.pt")
    main = got["main"]
    for recompute in (False, True):
        calling, device = got[(recompute, "calling")], got[(recompute, "device")]
        assert len(calling["threads"]) == 2 and set(calling["threads"]) == {main}, (recompute, calling["threads"])
        assert len(device["threads"]) == 2 and main not in device["threads"], (recompute, device["threads"])
        a, b = calling["grads"], device["grads"]
        assert set(a) == set(b) and a
        for name in a:
            assert torch.equal(a[name], b[name]), (recompute, name)
    # recompute changes nothing either (same forward, recomputed: the same gradients)
    for name, g in got[(False, "calling")]["grads"].items():
        assert torch.equal(g, got[(True, "calling")]["grads"][name]), name
