"""The model-parallel refit exchange's staging buffers: `jetrl plan` counts exactly what `RefitSource` allocates.

Real Megatron trainers on gloo ranks (TP2, TP2 x PP2), real `RefitSource` staging buffers (their storage bytes)
compared with `reshard.exchange.refit_buffer_bytes` and the plan's ``refit_buffers`` line for the same tiny config
(``policy.refit_buffer_size_gb`` small enough to need several rounds); the tensors a rank copies from itself are the
trainer's own tensors (no buffer) and stay at the same addresses across an optimizer step (distributed optimizer), so
the engine's compiled program is never rebuilt; rollout TP 1 still receives the canonical weights byte for byte.
"""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.recipe import Fp8Recipe

SHAPE = get_model_shape("tiny")
BUFFER_GB = 0.0005  # ~0.5 MiB of staging: the tiny model's exchange takes several rounds
ROLLOUT_TPS = (1, 2)
ARMS = {"jetrl": Fp8Recipe(mode="jetrl", bf16_last_layers=1), "bf16": Fp8Recipe(mode="bf16")}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def _exchange_rank(rank: int, world_size: int, tp: int, pp: int, out_dir: str) -> None:
    from jetrl_megatron.megatron.cpu import init_parallel
    from jetrl_megatron.megatron.model import train_step
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.reshard import iter_vllm_rank, megatron_from_canonical
    from jetrl_megatron.reshard.exchange import budget_bytes, rollout_tensor_meta
    from jetrl_megatron.reshard.program import VllmRefitProgram
    from jetrl_megatron.rl.refit_source import RefitSource
    from jetrl_megatron.rl.trainer import Trainer, canonical_weights, local_rollout_tensors
    from jetrl_megatron.rollout.refit import source_signature

    init_parallel(tp, pp)
    result: dict = {}
    toks = torch.randint(0, SHAPE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for arm, recipe in ARMS.items():
        policy = build_policy(SHAPE, recipe, seed=0, use_distributed_optimizer=True, optimizer={"lr": 1e-2})
        trainer = Trainer(policy.model, policy.optimizer, None, SHAPE, recipe)
        sources = {rtp: RefitSource(trainer, rtp, budget_bytes(BUFFER_GB)) for rtp in ROLLOUT_TPS}
        local = local_rollout_tensors(trainer)
        real = {n: (t.dtype, tuple(t.shape)) for n, t in local.items()}
        key = next(iter(sources.values())).key
        predicted = {n: (dt, shp) for n, dt, shp in rollout_tensor_meta(SHAPE, tp, pp, recipe)[key]}
        row: dict = {"meta_differs": sorted(n for n in predicted if real.get(n) != predicted[n])}
        steps = 2
        signatures: dict[int, tuple] = {}
        for step in range(steps):
            reference = canonical_weights(trainer)  # collective: the object-pickling path
            local = local_rollout_tensors(trainer)
            for rtp, source in sources.items():
                shards = source.shards()
                sig = source_signature(shards)
                own = shards.states[source.key]
                r = row.setdefault(rtp, {"stable": True, "own_in_place": True, "canonical_differs": []})
                r["stable"] &= signatures.setdefault(rtp, sig) == sig  # the compiled program stays valid
                r["own_in_place"] &= bool(source._own) and all(
                    own[n].data_ptr() == local[n].data_ptr() for n in source._own)
                r["buffers"] = source.buffer_bytes()
                r["received"] = source.received_bytes
                if rtp == 1:  # vLLM rank 0 copies from every shard: streamed, they make the whole checkpoint
                    want = dict(iter_vllm_rank(megatron_from_canonical(reference, SHAPE, tp=1), 1, 0))
                    prog = VllmRefitProgram(shards, 1, 0, device="cpu")
                    streamed = source.exchange.attach(prog)  # the copies from the peers' stand-ins
                    prog.run()
                    source.exchange.run(streamed)
                    got = prog.tensors
                    r["canonical_differs"] += sorted(n for n in want if not _same_bytes(got[n], want[n]))
                    r["names_equal"] = set(got) == set(want)
            if step + 1 < steps:
                res = train_step([trainer.model], trainer.optimizer, {"tokens": toks}, lambda lp, mb: (-lp.mean(), {}),
                                 micro_batch_size=1)
                assert not res.skipped
        result[arm] = row
    torch.save(result, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_plan_counts_the_refit_buffers_refit_source_allocates(tmp_path, tp, pp):
    from deadline import deadline

    from jetrl_megatron.megatron.cpu import spawn
    from jetrl_megatron.reshard.exchange import budget_bytes, refit_buffer_bytes
    from jetrl_megatron.rl.config import arm_overrides, load_config
    from jetrl_megatron.rl.tools.run_plan import GiB, memory_estimate, model_shape, parallel_layout

    world = tp * pp
    with deadline(600, f"TP{tp} x PP{pp} exchange"):
        spawn(_exchange_rank, world, tp, pp, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for arm, recipe in ARMS.items():
        for rtp in ROLLOUT_TPS:
            planned = refit_buffer_bytes(SHAPE, tp, pp, 1, rtp, recipe, budget_bytes(BUFFER_GB))
            for rank, res in enumerate(results):
                row = res[arm]
                assert row["meta_differs"] == [], (arm, rank)
                r = row[rtp]
                assert r["stable"] and r["own_in_place"], (arm, rtp, rank)
                assert r.get("canonical_differs", []) == [] and r.get("names_equal", True), (arm, rtp, rank)
                send, recv = r["buffers"]
                want = planned[rank]
                assert (send, recv) == (want.send, want.recv), (arm, rtp, rank, (send, recv), want)
                assert r["received"] == want.received + want.own
            assert max(p.buffers for p in planned.values()) > 0  # the model-parallel case is exercised
            assert max(p.buffers for p in planned.values()) <= budget_bytes(BUFFER_GB)
            assert rtp > 1 or max(p.rounds for p in planned.values()) > 1  # rollout TP 1: the whole model streams
            # the plan's line: the busiest rank of the same tiny config
            cfg = load_config("tiny_cpu", [*arm_overrides(arm),
                                           f"policy.generation.vllm_cfg.num_last_layers_in_bf16={recipe.bf16_last_layers}",
                                           f"policy.megatron_cfg.tensor_model_parallel_size={tp}",
                                           f"policy.megatron_cfg.pipeline_model_parallel_size={pp}",
                                           f"policy.generation.vllm_cfg.tensor_parallel_size={rtp}",
                                           "policy.train_global_batch_size=128",
                                           f"policy.refit_buffer_size_gb={BUFFER_GB}"])
            assert cfg.recipe == recipe  # the plan's recipe is the one the exchange ran with
            est = memory_estimate(cfg, model_shape(cfg), parallel_layout(cfg))
            busiest = max(sum(res[arm][rtp]["buffers"]) for res in results)
            assert est["refit_buffers"] * GiB == busiest, (arm, rtp, est["refit_buffers"] * GiB, busiest)
