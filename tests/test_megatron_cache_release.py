"""torch's cache returned between the backward and the optimizer step (``train_step(release_cache_before_step=)``).

Why: the first optimizer step creates what it keeps (Adam's moments on the GPU) after the backward has freed the
activations; torch's caching allocator then places that state in the activations' freed blocks, and the segments stay
pinned for the rest of the run. At Qwen3-8B with 4K-token responses on an H100 (2026-12-05) that left 21.3 GiB of
cache none of which ``empty_cache`` could return, and the colocated engine could not wake.

(What pinned those 21 GiB turned out to be mostly the last micro-batch's packed cos/sin, 15.95 GiB, and the hybrid
optimizer's device FP32 grads, 4.37 GiB: rl/memory_pins.py, fixed since; with all three fixes the same run had
2.03 GiB pinned before the wake-up, 2026-12-06.)

GPU (``gpu``): a two-layer model at Qwen3-0.6B's width (parameters past the allocator's 1 MiB small-block limit, as at
8B), one step each way in a fresh process: with the release, the default pool's fragmented cache after the step is
small and a fraction of what it is without (H100, 2026-12-06: 85 MiB with, 133 MiB without); the weights and FP8
cache are the same bytes either way. Both runs take the deterministic attention backward
(``deterministic_backward``): with PyTorch's default one the same step in two processes already differs in the last
bits (that H100 run: the embedding's weights), which says nothing about the release.
The CPU test of the call order is in tests/test_megatron_model.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MIB = float(1 << 20)


def _loss(lp, mb):
    return -lp.mean(), {}


def _step_run(rank: int, world_size: int, out_dir: str, release: bool) -> None:
    from pathlib import Path

    from megatron_helpers import hf_state, model_params

    from jetrl_megatron.megatron.model import fp8_context, train_step
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rl.phase_memory import cache_breakdown, device_segments

    shape = dataclasses.replace(get_model_shape("qwen3-0.6b"), num_layers=2, vocab_size=16384)
    policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=hf_state(shape, seed=3, std=0.02),
                          grad_reduce_in_fp32=False, use_distributed_optimizer=True, optimizer={"lr": 1e-4},
                          deterministic_backward=True)
    tokens = torch.randint(0, shape.vocab_size, (8, 1024), generator=torch.Generator().manual_seed(4))
    result = train_step([policy.model], policy.optimizer, {"tokens": tokens}, _loss, micro_batch_size=2,
                        release_cache_before_step=release)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    parts = cache_breakdown(device_segments(torch.cuda.current_device()))
    cache = fp8_context(policy.model).cache.named_fp8()
    torch.save({"skipped": result.skipped, "fragmented_mib": parts["cache_fragmented"] * 1024,
                "params": {k: v.cpu() for k, v in model_params(policy.model).items()},
                "fp8": {k: (q.view(torch.uint8).cpu(), s.cpu()) for k, (q, s) in cache.items()}},
               Path(out_dir) / f"release_{int(release)}.pt")


def test_the_release_keeps_the_step_state_out_of_the_activations_blocks(tmp_path, monkeypatch):
    from jetrl_megatron.megatron import cpu

    # a fresh interpreter per run: the test session's forkserver may have initialised CUDA (the GPU run of
    # 2026-12-06: "Cannot re-initialize CUDA in forked subprocess"), and each run must start from an empty cache
    monkeypatch.setattr(cpu, "SPAWN_START_METHOD", "spawn")
    for release in (False, True):
        cpu.spawn(_step_run, 1, str(tmp_path), release)
    without, with_ = (torch.load(tmp_path / f"release_{i}.pt") for i in (0, 1))
    assert not without["skipped"] and not with_["skipped"]
    print(f"fragmented cache after the first step: {without['fragmented_mib']:.0f} MiB without the release, "
          f"{with_['fragmented_mib']:.0f} MiB with it")
    assert with_["fragmented_mib"] <= 64 + 0.25 * without["fragmented_mib"], (without["fragmented_mib"],
                                                                             with_["fragmented_mib"])
    for name, p in without["params"].items():
        assert torch.equal(p, with_["params"][name]), name
    for name, (q, s) in without["fp8"].items():
        assert torch.equal(q, with_["fp8"][name][0]) and torch.equal(s, with_["fp8"][name][1]), name
