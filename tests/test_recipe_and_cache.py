"""Fp8Recipe validation/round trip, the run recipe built from the config keys, and the per-step FP8 weight cache.

Fp8Recipe's own error messages name its fields as ``jet_rl.<field>`` (the recipe dict a checkpoint's meta.json and an
exported ``quantization_config`` carry); through the config, the user's key is named instead."""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.fp8.quant import quantize_128x128
from jetrl_megatron.fp8.weights import Fp8WeightCache, NonFiniteWeightError, StaleFp8WeightError
from jetrl_megatron.recipe import Fp8Recipe, RecipeError


def test_round_trip_and_defaults():
    r = Fp8Recipe()
    assert (r.mode, r.scale_fmt, r.amax_eps, r.weight_block, r.group_size) == ("jetrl", "fp32", 1e-10, (128, 128), 128)
    custom = Fp8Recipe.from_dict({"mode": "bf16_train_fp8_rollout", "scale_fmt": "pow2", "bf16_first_layers": 1,
                                  "bf16_last_layers": 2, "bf16_module_keywords": ["down_proj"],
                                  "gemm_backend": "cublas",
                                  "weight_block": [128, 128]})
    assert Fp8Recipe.from_dict(custom.to_dict()) == custom
    assert custom.bf16_module_keywords == ("down_proj",)


@pytest.mark.parametrize("bad, key", [
    ({"modee": "jetrl"}, "modee"),
    ({"mode": "fp4"}, "jet_rl.mode"),
    ({"scale_fmt": "ue8m0x"}, "jet_rl.scale_fmt"),
    ({"weight_block": [64, 64]}, "jet_rl.weight_block"),
    ({"bf16_first_layers": -1}, "jet_rl.bf16_first_layers"),
    ({"bf16_last_layers": True}, "jet_rl.bf16_last_layers"),
    ({"gemm_backend": "cutlass"}, "jet_rl.gemm_backend"),
    ({"amax_eps": 0.5}, "jet_rl.amax_eps"),
    ({"fmt": "e5m2"}, "jet_rl.fmt"),
])
def test_bad_values_name_the_key(bad, key):
    with pytest.raises(RecipeError, match=key):
        Fp8Recipe.from_dict(bad)


# ------------------------------------------------------------------------------------------------ config -> recipe
# The run's Fp8Recipe (cfg.recipe) is built once from NeMo-RL's keys and policy.jet_rl; a bad value is named by the
# config key the user wrote, never by the recipe's internal field.
FLOW = ["policy.generation.vllm_cfg.pow2_weight_scaling_factors=true",
        "policy.generation.vllm_cfg.pow2_activation_scaling_factors=true",
        "policy.generation.vllm_cfg.num_first_layers_in_bf16=1", "policy.generation.vllm_cfg.num_last_layers_in_bf16=2",
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws=[down_proj]", "policy.jet_rl.gemm_backend=cublas",
        "policy.jet_rl.batch_invariant=true", "policy.jet_rl.amax_eps=1e-8"]


def test_config_keys_build_the_run_recipe():
    from jetrl_megatron.rl.config import load_config

    r = load_config("tiny_cpu", FLOW).recipe
    assert r == Fp8Recipe(mode="jetrl", scale_fmt="pow2", amax_eps=1e-8, bf16_first_layers=1, bf16_last_layers=2,
                          bf16_module_keywords=("down_proj",), gemm_backend="cublas", batch_invariant=True)
    assert load_config("tiny_cpu").recipe == Fp8Recipe()  # tiny_cpu: the Jet-RL defaults
    # use_deep_gemm (NeMo-RL: DeepGEMM for vLLM's FP8 GEMMs) keeps auto, which picks DeepGEMM for FProp and DGrad
    assert load_config("tiny_cpu", ["policy.generation.vllm_cfg.use_deep_gemm=true"]).recipe.gemm_backend == "auto"


@pytest.mark.parametrize("override, key", [
    ("policy.jet_rl.arm=fp4", "policy.jet_rl.arm"),
    ("policy.jet_rl.gemm_backend=cutlass", "policy.jet_rl.gemm_backend"),
    ("policy.jet_rl.amax_eps=0.5", "policy.jet_rl.amax_eps"),
    ("policy.jet_rl.batch_invariant=1", "policy.jet_rl.batch_invariant"),
    ("policy.generation.vllm_cfg.num_first_layers_in_bf16=-1", "policy.generation.vllm_cfg.num_first_layers_in_bf16"),
    ("policy.generation.vllm_cfg.num_last_layers_in_bf16=true", "policy.generation.vllm_cfg.num_last_layers_in_bf16"),
    ("policy.generation.vllm_cfg.pow2_weight_scaling_factors=true",
     "policy.generation.vllm_cfg.pow2_weight_scaling_factors and pow2_activation_scaling_factors"),
    ("policy.generation.vllm_cfg.quantization_ignored_layer_kws=down_proj",
     "policy.generation.vllm_cfg.quantization_ignored_layer_kws"),
    ("policy.generation.vllm_cfg.quantization_ignored_layer_kws=['']",
     "policy.generation.vllm_cfg.quantization_ignored_layer_kws"),
])
def test_bad_config_values_name_the_config_key(override, key):
    from jetrl_megatron.rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny_cpu", [override])


def test_exclusions_and_module_names():
    r = Fp8Recipe(bf16_first_layers=1, bf16_last_layers=1, bf16_module_keywords=("gate_up",))
    assert [r.layer_is_fp8(i, 4) for i in range(4)] == [False, True, True, False]
    assert r.module_is_fp8("model.layers.1.self_attn.qkv_proj", None, 4)
    assert r.module_is_fp8("decoder.layers.2.mlp.linear_fc2.weight", None, 4)
    assert not r.module_is_fp8("model.layers.0.self_attn.q_proj.weight", None, 4)  # first layer BF16
    assert not r.module_is_fp8("model.layers.1.mlp.gate_up_proj", None, 4)  # keyword
    assert not r.module_is_fp8("lm_head", None, 4)
    assert not r.module_is_fp8("model.layers.1.input_layernorm.weight", None, 4)
    assert not r.module_is_fp8("model.embed_tokens.weight", None, 4)


def test_hf_quantization_config():
    cfg = Fp8Recipe(bf16_last_layers=1).hf_quantization_config(num_layers=3)
    assert cfg["quant_method"] == "fp8" and cfg["fmt"] == "e4m3" and cfg["activation_scheme"] == "dynamic"
    assert cfg["weight_block_size"] == [128, 128]
    assert "lm_head" in cfg["ignored_layers"] and "model.layers.2.mlp.down_proj" in cfg["ignored_layers"]
    assert not any(name.startswith("model.layers.1.") for name in cfg["ignored_layers"])


def _params():
    g = torch.Generator().manual_seed(0)
    return {name: torch.nn.Parameter(torch.randn(256, 128, generator=g).to(torch.bfloat16)) for name in ("a", "b")}


def test_cache_refresh_get_and_staleness():
    params = _params()
    cache = Fp8WeightCache()
    cache.refresh(params.items())
    assert cache.generation == 1 and len(cache) == 2
    q, s = cache.get(params["a"])
    q_ref, s_ref = quantize_128x128(params["a"].detach())
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    with torch.no_grad():
        params["a"].add_(1.0)  # an optimizer-style in-place update
    with pytest.raises(StaleFp8WeightError, match="'a' is stale"):
        cache.get(params["a"])
    cache.get(params["b"])  # untouched parameter still fresh
    q1 = q.clone()
    cache.refresh(params.items())
    q2, s2 = cache.get(params["a"])
    assert not torch.equal(q2.view(torch.uint8), q1.view(torch.uint8))
    q2_ref, s2_ref = quantize_128x128(params["a"].detach())
    assert torch.equal(q2.view(torch.uint8), q2_ref.view(torch.uint8)) and torch.equal(s2, s2_ref)
    # refreshed in place: the same storage every step (planned refit copies and CUDA graphs stay valid)
    assert q2.data_ptr() == q.data_ptr() and s2.data_ptr() == s.data_ptr()
    assert cache.generation == 2
    cache.invalidate()
    with pytest.raises(StaleFp8WeightError):
        cache.get(params["b"])
    with pytest.raises(StaleFp8WeightError, match="no FP8 copy"):
        cache.get(torch.nn.Parameter(torch.zeros(128, 128)))


def test_cache_refuses_non_finite_and_stays_untouched():
    params = _params()
    cache = Fp8WeightCache()
    cache.refresh(params.items())
    before = {k: (q.clone(), s.clone()) for k, (q, s) in cache.named_fp8().items()}
    with torch.no_grad():
        params["b"][3, 4] = float("nan")
    with pytest.raises(NonFiniteWeightError, match="'b'"):
        cache.refresh(params.items())
    assert cache.generation == 1
    for k, (q, s) in cache.named_fp8().items():
        assert torch.equal(q.view(torch.uint8), before[k][0].view(torch.uint8)) and torch.equal(s, before[k][1])
        assert bool(torch.isfinite(s).all())


def test_named_modes_of_each_arm():
    """The questions the code asks of an arm, answered by the recipe (no arm string is compared elsewhere)."""
    from jetrl_megatron.recipe import ARM_BY_SWITCHES, FP8_MODES

    table = {  # arm: (trainer_gemm, rollout_weights, NeMo-RL switches)
        "bf16": ("bf16", "bf16", (False, False)),
        "bf16_train_fp8_rollout": ("bf16", "self_quantized", (False, True)),
        "jetrl": ("fp8", "trainer_fp8", (True, True)),
        "fake_quant": ("fake_quant", "self_quantized", (False, True)),
    }
    assert set(table) == set(FP8_MODES)
    for arm, (gemm, weights, switches) in table.items():
        r = Fp8Recipe(mode=arm)
        assert (r.trainer_gemm, r.rollout_weights, r.switches) == (gemm, weights, switches), arm
        assert r.trains_fp8 == (gemm == "fp8") and r.rollout_fp8 == (weights != "bf16")
    assert all(Fp8Recipe(mode=arm).switches == switches for switches, arm in ARM_BY_SWITCHES.items())


def test_refresh_drops_the_layouts_derived_from_the_old_bytes():
    """DGrad's K-major codes of a cached FP8 weight are stale once the step's refresh rewrites it: dropped there
    (not held through the rollout until the next backward replaces them) and rebuilt from the new bytes on use."""
    from jetrl_megatron.fp8.backends._layout import _cache, derived, derived_bytes

    def kmajor(q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.uint8).t().contiguous()

    params = _params()
    cache = Fp8WeightCache()
    cache.refresh(params.items())
    q, _ = cache.get(params["a"])
    before = derived_bytes()
    old = derived(q, "kmajor_t", kmajor)
    assert derived_bytes() == before + old.numel()
    with torch.no_grad():
        params["a"].mul_(-3.0)
    cache.refresh(params.items())
    assert derived_bytes() == before and _cache[id(q)][1] == {}
    new = derived(q, "kmajor_t", kmajor)
    assert torch.equal(new, q.view(torch.uint8).t()) and not torch.equal(new, old)
