"""The model-parallel refit exchange streams in bounded rounds: same bytes as the single-process resharder, bounded
staging memory, measured.

Two gloo ranks hold fingerprinted Megatron shards of the `tiny` model (TP2 or PP2, jetrl: FP8 codes + scales,
BF16 elsewhere; every tensor's bytes random and distinct); each rank's vLLM rank is refit through `RefitExchange`
into destination tensors, and every byte is compared with `reshard.iter_vllm_rank` over all shards in one process
(the reference: no exchange at all). Budgets: one that holds everything in one round, and one whose message cap
is smaller than one tensor (rows of a tensor travel in several rounds). The peak of what the CPU allocator hands
out during planning, staging and every round (torch profiler memory events, not the intended sizes) stays within
the budget plus a fixed few KiB of bookkeeping, while the bytes moved are over 30 times the small budget.
"""

from __future__ import annotations

import gc
import hashlib
import math

import pytest
import torch

from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard.exchange import (
    ALIGN,
    budget_bytes,
    exchange_names,
    exchange_schedule,
    model_parallel_groups,
    refit_buffer_bytes,
    rollout_tensor_meta,
    split_stream,
)

SHAPE = get_model_shape("tiny")
RECIPE = Fp8Recipe(mode="jetrl", bf16_last_layers=1)
SMALL = 64 << 10   # 28 KiB per side: a message holds less than one FP8 fc1 weight (1536 x 256 bytes at TP1)
LARGE = 64 << 20   # everything in one round
# profiler-visible allocations besides the staging: pickled metadata, stand-ins, flags (the shared transport's spec
# exchange took 82,610 - 65,536 = 17,074 B at the 64 KiB budget, 20,866 B once with three test workers on two cores:
# the profiler also sees what gloo's threads allocate meanwhile): 32 KiB, a constant, still ~1/60 of the bytes moved
BOOKKEEPING = 32 << 10


def _fingerprint(key, name: str, dtype: torch.dtype, shape) -> torch.Tensor:
    """Random finite bytes, distinct per tensor, reproducible on every rank (the reference rebuilds all shards)."""
    seed = int.from_bytes(hashlib.sha256(f"{key}/{name}".encode()).digest()[:8], "little") % (1 << 62)
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.float8_e4m3fn:  # never 0x7f / 0xff (NaN)
        return (torch.randint(0, 0x7F, (n,), generator=g, dtype=torch.uint8)
                | (torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8) << 7)).view(dtype).reshape(shape)
    if dtype == torch.bfloat16:
        bits = torch.randint(0, 0x7F00, (n,), generator=g, dtype=torch.int16)
        return torch.where(torch.rand(n, generator=g) < 0.5, bits, bits | -0x8000).view(dtype).reshape(shape)
    return (torch.rand(n, generator=g) + 0.5).to(dtype).reshape(shape)


def _shards(tp: int, pp: int) -> dict:
    return {key: {n: _fingerprint(key, n, dt, shp) for n, dt, shp in meta}
            for key, meta in rollout_tensor_meta(SHAPE, tp, pp, RECIPE).items()}


def _peak_allocated(events) -> int:
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


CASES = [(tp, pp, rtp, budget) for tp, pp, rtp in [(2, 1, 1), (1, 2, 1), (1, 2, 2)] for budget in (SMALL, LARGE)]


def _rank(rank: int, world: int, out_dir: str) -> None:
    """Every case in one pair of processes (spawning costs more than the exchanges)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from jetrl_megatron.reshard import MegatronShards, iter_vllm_rank
    from jetrl_megatron.reshard.program import VllmRefitProgram
    from jetrl_megatron.rl.refit_source import RefitExchange

    results = {}
    for tp, pp, rollout_tp, budget in CASES:
        key = dict(model_parallel_groups(tp, pp, 1)[0])[rank]
        everything = _shards(tp, pp)
        local = everything[key]
        vllm_rank = rank % rollout_tp
        want = dict(iter_vllm_rank(MegatronShards(SHAPE, tp, pp, None, everything), rollout_tp, vllm_rank))
        dst = {n: torch.full_like(t.view(torch.uint8) if t.element_size() == 1 else t, 3).view(t.dtype)
               for n, t in want.items()}  # filled with a pattern that is not the answer
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            exchange = RefitExchange(SHAPE, tp, pp, rollout_tp, key, dist.group.WORLD, budget)
            prog = VllmRefitProgram(exchange.shards(local), rollout_tp, vllm_rank, dst=dst)
            streamed = exchange.attach(prog)
            for _ in range(2):  # a second refit reuses the plan and the buffers
                exchange.agree_finite([])
                prog.run()
                exchange.run(streamed)
        mem = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        differs = sorted(n for n, t in want.items()
                         if not torch.equal(dst[n].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)))
        results[(tp, pp, rollout_tp, budget)] = {
            "differs": differs, "names": sorted(want) == sorted(dst), "peak": _peak_allocated(mem),
            "buffers": exchange.buffer_bytes(), "received": exchange.schedule.received,
            "rounds": len(exchange.schedule.rounds)}
        del exchange, prog, streamed, prof, mem  # freed here, not inside the next case's profile
        gc.collect()
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_streamed_exchange_moves_the_resharders_bytes_within_the_budget(tmp_path):
    """TP2 -> TP1, PP2 -> TP1 and PP2 -> TP2, each with a budget below one tensor and one above the model."""
    from deadline import deadline

    from jetrl_megatron.megatron.cpu import spawn

    with deadline(240, "streamed refit exchange"):
        spawn(_rank, 2, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for tp, pp, rollout_tp, budget in CASES:
        case = (tp, pp, rollout_tp, budget)
        planned = refit_buffer_bytes(SHAPE, tp, pp, 1, rollout_tp, RECIPE, budget)
        for rank in range(2):
            r = results[rank][case]
            assert r["names"] and r["differs"] == [], (case, rank, r["differs"][:5])
            send, recv = r["buffers"]
            assert send + recv <= budget and (send, recv) == (planned[rank].send, planned[rank].recv), case
            assert r["received"] == planned[rank].received > 0 and r["rounds"] == planned[rank].rounds, case
            # measured: the staging is allocated (the profiler sees it) and nothing of the model's size is
            assert send + recv <= r["peak"] <= budget + BOOKKEEPING, (case, rank, r["peak"])
            if budget == SMALL:
                assert r["received"] > 30 * budget and r["rounds"] > 30, case
            else:
                assert r["rounds"] == 1, case


def test_split_stream_cuts_rows_within_the_cap():
    """Every row of every tensor lands in exactly one message, in order, aligned, no message over the cap; a row
    bigger than the cap is an error naming the key."""
    meta = {"a": (torch.bfloat16, (10, 64)), "b": (torch.float32, (7,)), "c": (torch.float8_e4m3fn, (33, 100))}
    cap = 512
    messages = split_stream(list(meta), meta, cap)
    seen: dict[str, list[tuple[int, int]]] = {}
    for msg in messages:
        assert msg and msg[-1].offset + msg[-1].nbytes <= cap
        for p in msg:
            assert p.offset % ALIGN == 0
            seen.setdefault(p.name, []).append((p.row0, p.row1))
    # a fills the first two messages (4 rows of 128 bytes each); the third holds a's rest, b, and 2 rows of c
    c = [(0, 2)] + [(2 + 5 * i, 7 + 5 * i) for i in range(6)] + [(32, 33)]
    assert seen == {"a": [(0, 4), (4, 8), (8, 10)], "b": [(0, 1)], "c": c}
    with pytest.raises(ValueError, match="refit_buffer_size_gb"):
        split_stream(["a"], meta, 100)


def test_schedule_rounds_fit_each_ranks_buffers():
    """With four members all needing each other (rollout TP 1, trainer TP2 x PP2), no round asks a rank to send or
    receive more than its 7/16 of the budget, and each peer's tensors arrive whole."""
    metas = rollout_tensor_meta(SHAPE, 2, 2, RECIPE)
    group = model_parallel_groups(2, 2, 1)[0]
    members = [(key, 0) for _, key in group]
    names = exchange_names(metas, members, {0: {k: {n for n, _, _ in m} for k, m in metas.items()}})
    budget = 64 << 10
    for me, sched in enumerate(exchange_schedule(metas, members, names, budget)):
        assert sched.send_bytes <= budget * 7 // 16 and sched.recv_bytes <= budget * 7 // 16
        got: dict = {}
        for sends, recvs in sched.rounds:
            assert sum(m.nbytes for m in sends) <= budget * 7 // 16
            assert sum(m.nbytes for m in recvs) <= budget * 7 // 16
            for m in recvs:
                for p in m.pieces:
                    got.setdefault((m.peer, p.name), []).append((p.row0, p.row1))
        for peer, (key, _) in enumerate(members):
            if peer == me:
                continue
            for name, _, shp in metas[key]:
                rows = shp[0] if len(shp) >= 2 else 1
                spans = got[(peer, name)]
                assert spans[0][0] == 0 and spans[-1][1] == rows and all(
                    a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), (peer, name)


def test_plan_refit_staging_is_bounded_at_8b():
    """NeMo-RL's 8B Megatron layout (TP1 x PP2 x DP4, rollout TP1) and a TP2 x PP2 one: at most the budget per GPU
    (2 GiB unset, or policy.refit_buffer_size_gb), while a whole model half streams through."""
    shape = get_model_shape("llama3.1-8b")
    recipe = Fp8Recipe(mode="bf16")
    for (tp, pp, dp, rtp), gb in [((1, 2, 4, 1), None), ((2, 2, 2, 1), 0.5)]:
        budget = budget_bytes(gb)
        per = refit_buffer_bytes(shape, tp, pp, dp, rtp, recipe, budget)
        assert max(b.buffers for b in per.values()) <= budget
        assert min(b.received for b in per.values()) > 3 * budget
    with pytest.raises(ValueError, match="refit_buffer_size_gb"):
        budget_bytes(0)
