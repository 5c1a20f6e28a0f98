"""The config loader reads NeMo-RL YAMLs as NeMo-RL does: defaults chains, interpolation, Hydra-style overrides, the
arm from NeMo-RL's switches, and every key accounted for (implemented, ignored with a warning, or refused)."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest
import yaml

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.config.nemo_rl_keys import IGNORED, IMPLEMENTED, REFUSED, RULES, classify, schema_status
from jetrl_megatron.rl.config.run_config import (
    ConfigError,
    arm_overrides,
    load_config,
    load_config_file,
    to_yaml,
    warn_ignored,
)
from jetrl_megatron.rl.config.schema import RunConfigFields

RECIPES = ["tiny_cpu", "count_150m_gpu", "grpo_math_base", "qwen3_8b_tp1", "qwen3_32b_tp2", "llama31_8b_tp1",
           "qwen25_7b_tp2"]


def _write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(textwrap.dedent(text))
    return p


# ------------------------------------------------------------------------------------------------ loading


def test_defaults_list_later_parent_wins_and_interpolation_follows_the_child(tmp_path):
    base = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
    _write(tmp_path, "p1.yaml", f"""
        defaults: {base}
        policy:
          max_total_sequence_length: 48
          generation:
            vllm_cfg:
              max_model_len: ${{policy.max_total_sequence_length}}
        grpo:
          max_num_steps: 7
        """)
    _write(tmp_path, "p2.yaml", """
        grpo:
          max_num_steps: 9
        """)
    child = _write(tmp_path, "child.yaml", """
        defaults: [p1.yaml, p2.yaml]
        policy:
          max_total_sequence_length: 40
        """)
    cfg = load_config_file(child)
    assert cfg.grpo.max_num_steps == 9  # the later parent wins
    assert cfg.policy.generation.vllm_cfg.max_model_len == 40  # interpolation sees the child's value
    assert cfg.name == "child"


def test_override_marker_replaces_a_section(tmp_path):
    base = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
    child = _write(tmp_path, "c.yaml", f"""
        defaults: {base}
        policy:
          generation:
            vllm_kwargs:
              _override_: true
              max_num_seqs: 3
        """)
    cfg = load_config_file(child)
    assert cfg.policy.generation.vllm_kwargs == {"max_num_seqs": 3}  # the parent's kv_cache_memory_bytes is gone


def test_hydra_overrides():
    cfg = load_config("tiny_cpu", ["grpo.max_num_steps=3", "+policy.generation.vllm_kwargs.max_num_seqs=5",
                                   "++grpo.seed=7", "~policy.generation.vllm_kwargs.kv_cache_memory_bytes",
                                   "policy.generation.stop_token_ids=[1,2]", "checkpointing.keep_top_k=null"])
    assert cfg.grpo.max_num_steps == 3 and cfg.grpo.seed == 7
    assert cfg.policy.generation.vllm_kwargs == {"max_num_seqs": 5}
    assert cfg.policy.generation.stop_token_ids == [1, 2]
    assert cfg.checkpointing.keep_top_k is None
    assert cfg.kv_cache_memory_bytes() == 64 << 20  # the CPU default once the recipe's value is deleted


@pytest.mark.parametrize("override, needle", [
    ("grpo.no_such_key=1", "+grpo.no_such_key"),
    ("+grpo.seed=1", "already exists"),
    ("~grpo.no_such_key", "cannot delete"),
    ("grpo.seed=1,2", "sweeps"),
    ("grpo.seed", "override 'grpo.seed'"),
    ("+grpo.typo_key=1", "grpo.typo_key"),
    ("grpo.seed=abc", "grpo.seed: expected an integer"),
    ("jet_rl.mode=bf16", "policy.jet_rl"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config("tiny_cpu", [override])
    assert needle in str(e.value)


def test_unknown_key_suggests_the_closest(tmp_path):
    base = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
    p = _write(tmp_path, "c.yaml", f"defaults: {base}\ngrpo:\n  num_prompts_per_stp: 4\n")
    with pytest.raises(ConfigError, match=r"grpo\.num_prompts_per_stp \(did you mean grpo\.num_prompts_per_step\?\)"):
        load_config_file(p)


def test_failed_interpolation_names_the_key(tmp_path):
    base = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
    p = _write(tmp_path, "c.yaml", f"defaults: {base}\ngrpo:\n  seed: ${{policy.no_such}}\n")
    with pytest.raises(ConfigError, match=r"grpo\.seed: cannot resolve"):
        load_config_file(p)


# ------------------------------------------------------------------------------------------------ the arm


def _switches(fp8_train: bool, precision: str, stated: str | None) -> list[str]:
    ov = [f"policy.megatron_cfg.fp8_cfg.enabled={str(fp8_train).lower()}",
          f"policy.generation.vllm_cfg.precision={precision}"]
    return ov + ([f"policy.jet_rl.arm={stated}"] if stated is not None else [])


@pytest.mark.parametrize("fp8_train, precision, stated, arm", [
    (False, "bfloat16", None, "bf16"),
    (False, "fp8", None, "bf16_train_fp8_rollout"),
    (True, "fp8", None, "jetrl"),
    (False, "bfloat16", "bf16", "bf16"),
    (False, "fp8", "bf16_train_fp8_rollout", "bf16_train_fp8_rollout"),
    (True, "fp8", "jetrl", "jetrl"),
    (False, "fp8", "fake_quant", "fake_quant"),
])
def test_arm_follows_nemo_rl_switches(fp8_train, precision, stated, arm):
    ov = _switches(fp8_train, precision, stated)
    cfg = load_config("tiny_cpu", ov)
    assert cfg.arm == arm and cfg.recipe.mode == arm
    # the switches are never rewritten from the arm
    assert cfg.policy.megatron_cfg.fp8_cfg.enabled is fp8_train
    assert cfg.policy.generation.vllm_cfg.precision == precision


@pytest.mark.parametrize("fp8_train, precision, stated, needle", [
    (True, "bfloat16", None, "an FP8 trainer with a BF16 rollout is not an arm"),
    (False, "bfloat16", "jetrl", "policy.jet_rl.arm: 'jetrl' contradicts"),
    (True, "fp8", "bf16", "policy.jet_rl.arm: 'bf16' contradicts"),
    (False, "fp8", "bf16", "policy.jet_rl.arm: 'bf16' contradicts"),
    (False, "bfloat16", "fake_quant", "policy.jet_rl.arm: 'fake_quant' contradicts"),
    (True, "fp8", "fake_quant", "policy.jet_rl.arm: 'fake_quant' contradicts"),
    (False, "bfloat16", "bf16_train_fp8_rollout", "contradicts"),
])
def test_arm_contradictions_are_errors(fp8_train, precision, stated, needle):
    ov = _switches(fp8_train, precision, stated)
    with pytest.raises(ConfigError) as e:
        load_config("tiny_cpu", ov)
    assert needle in str(e.value)


@pytest.mark.parametrize("arm", ["bf16", "bf16_train_fp8_rollout", "jetrl", "fake_quant"])
def test_arm_overrides_select_the_arm(arm):
    assert load_config("tiny_cpu", arm_overrides(arm)).arm == arm


def test_fp8_recipe_built_from_nemo_rl_keys():
    cfg = load_config("tiny_cpu", ["policy.generation.vllm_cfg.num_first_layers_in_bf16=1",
                                   "policy.generation.vllm_cfg.num_last_layers_in_bf16=1",
                                   "policy.generation.vllm_cfg.pow2_weight_scaling_factors=true",
                                   "policy.generation.vllm_cfg.pow2_activation_scaling_factors=true",
                                   "policy.generation.vllm_cfg.quantization_ignored_layer_kws=[down_proj]",
                                   "policy.jet_rl.gemm_backend=triton"])
    r = cfg.recipe
    assert (r.bf16_first_layers, r.bf16_last_layers, r.scale_fmt, r.bf16_module_keywords, r.gemm_backend) == (
        1, 1, "pow2", ("down_proj",), "triton")
    assert r.layer_is_fp8(1, 4) and not r.layer_is_fp8(0, 4) and not r.layer_is_fp8(3, 4)


def test_use_deep_gemm_means_what_it_means_in_nemo_rl(monkeypatch):
    """NeMo-RL's key puts vLLM's FP8 GEMMs on DeepGEMM. Here the jetrl arm keeps `auto`, whose measured table puts
    FProp (the rollout's too) and DGrad on DeepGEMM and WGrad on cuBLAS (DeepGEMM's WGrad writes FP32 only: a zeroed
    accumulator and a cast per GEMM, 2026-12-06 profile); a CUDA run without DeepGEMM stops naming the key."""
    from jetrl_megatron.fp8 import gemm
    from jetrl_megatron.fp8.backends.auto_table import pick
    from jetrl_megatron.rl.config.run_config import arm_overrides
    from jetrl_megatron.rl.trainer import require_deep_gemm

    cfg = load_config("tiny_cpu", ["policy.generation.vllm_cfg.use_deep_gemm=true"])
    assert cfg.recipe.gemm_backend == "auto"
    m_invariant = gemm.needs_m_invariant_fprop(cfg.recipe)
    assert [pick(form, 4128, m_invariant=m_invariant) for form in ("fprop", "dgrad", "wgrad")] == [
        "deep_gemm", "deep_gemm", "cublas"]
    assert load_config("tiny_cpu", ["policy.generation.vllm_cfg.use_deep_gemm=true",
                                    "policy.jet_rl.gemm_backend=deep_gemm"]).recipe.gemm_backend == "deep_gemm"
    assert cfg.rollout_env() == {"VLLM_USE_DEEP_GEMM": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0"}
    monkeypatch.setattr(gemm, "_loaded", {"deep_gemm": None})  # DeepGEMM not importable on this "GPU" machine
    with pytest.raises(UserError, match=r"use_deep_gemm: true, but DeepGEMM cannot run here"):
        require_deep_gemm(cfg, on_cuda=True)
    require_deep_gemm(cfg, on_cuda=False)  # CPU runs use the emulated GEMMs
    bf16 = load_config("tiny_cpu", ["policy.generation.vllm_cfg.use_deep_gemm=true", *arm_overrides("bf16")])
    require_deep_gemm(bf16, on_cuda=True)  # no FP8 training GEMMs in the bf16 arm
    require_deep_gemm(load_config("tiny_cpu"), on_cuda=True)
    monkeypatch.setattr(gemm, "_loaded", {"deep_gemm": object()})
    require_deep_gemm(cfg, on_cuda=True)
    with pytest.raises(ConfigError, match="use_deep_gemm: true contradicts policy.jet_rl.gemm_backend"):
        load_config("tiny_cpu", ["policy.generation.vllm_cfg.use_deep_gemm=true", "policy.jet_rl.gemm_backend=cublas"])
    assert load_config("tiny_cpu").rollout_env() == {}


@pytest.mark.parametrize("overrides, needle", [
    (["policy.generation.vllm_cfg.pow2_weight_scaling_factors=true"], "must be equal here"),
    (["policy.megatron_cfg.optimizer.clip_grad=0.5"], "optimizer.clip_grad (0.5) differs from policy.max_grad_norm"),
    (["grpo.adv_estimator.normalize_rewards=false"], "grpo.adv_estimator.normalize_rewards (False) differs"),
    (["policy.generation.vllm_cfg.num_first_layers_in_bf16=5"], "num_first_layers_in_bf16: must be in [0, 4]"),
    (["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=64", "policy.train_micro_batch_size=32"],
     "force_on_policy_ratio: needs one optimizer step"),
    (["checkpointing.metric_name=val:nope"], "checkpointing.metric_name"),
    (["data.train.split_validation_size=1.5"], "data.train.split_validation_size: must be in [0, 1)"),
])
def test_cross_key_errors(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_cpu", overrides)
    assert needle in str(e.value)


def test_max_grad_norm_with_clip_grad_interpolated_sets_clipping():
    cfg = load_config("tiny_cpu", ["policy.max_grad_norm=0.25"])  # the recipe has clip_grad: ${policy.max_grad_norm}
    assert cfg.policy.megatron_cfg.optimizer.clip_grad == 0.25


# ------------------------------------------------------------------------------------------------ key accounting


@pytest.mark.parametrize("override, needle", [
    ("+on_policy_distillation.teacher=x", "on-policy distillation is not implemented"),
    ("+policy.dtensor_cfg.enabled=true", "policy.dtensor_cfg.enabled: True is refused"),
    ("policy.megatron_cfg.context_parallel_size=2", "context parallelism is not implemented"),
    ("policy.generation.vllm_cfg.kv_cache_dtype=fp8", "kv_cache_dtype: 'fp8' is refused"),
    ("policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise", "fp8_recipe: 'tensorwise' is refused"),
    ("policy.megatron_cfg.fp8_cfg.fp8_param=true", "fp8_param: True is refused"),
    ("policy.precision=float32", "policy.precision: 'float32' is refused"),
    ("+grpo.async_grpo.enabled=true", "grpo.async_grpo.enabled: True is refused"),
])
def test_refused_values_name_key_and_reason(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_cpu", [override])
    assert needle in str(e.value)


def test_top_k_top_p_load_with_nemo_rls_meaning():
    """NeMo-RL's temp0.8-topp0.9-topk50 sampling loads; the trainer's logprobs follow it (rollout_sampling)."""
    from jetrl_megatron.rl.trainer import rollout_sampling

    cfg = load_config("tiny_cpu", ["policy.generation.temperature=0.8", "policy.generation.top_p=0.9",
                                   "policy.generation.top_k=50"])
    s = rollout_sampling(cfg)
    assert (s.temperature, s.top_k, s.top_p, s.filters) == (0.8, 50, 0.9, True)
    assert not rollout_sampling(load_config("tiny_cpu", ["policy.generation.top_k=-1"])).filters


def test_ignored_keys_load_and_warn_once():
    cfg = load_config("tiny_cpu", ["+policy.dtensor_cfg.enabled=false", "+policy.dtensor_cfg.cpu_offload=false",
                                   "+cluster.segment_size=4", "+policy.sequence_packing.enabled=true"])
    ignored = sorted(v.key for v in cfg.key_report if v.status == IGNORED)
    assert ignored == ["cluster.segment_size", "policy.dtensor_cfg.cpu_offload", "policy.dtensor_cfg.enabled",
                       "policy.sequence_packing.enabled"]
    buf = io.StringIO()
    warn_ignored(cfg, out=buf)
    text = buf.getvalue()
    assert text.count("warning") == 1 and "4 NeMo-RL key(s) have no effect" in text
    assert "policy.dtensor_cfg.enabled, policy.dtensor_cfg.cpu_offload" in text


def test_rules_are_consistent_with_the_schema():
    for rule in RULES:
        assert rule.status in (IMPLEMENTED, IGNORED, REFUSED), rule
        in_schema = schema_status(RunConfigFields, rule.pattern.replace(".**", ".x").replace("*", "x"))
        if rule.status == IMPLEMENTED:
            assert in_schema is not None, f"{rule.pattern}: implemented but not a schema key"
        elif not rule.pattern.startswith(("policy.generation.vllm_kwargs.", "policy.generation.vllm_cfg.env_vars.")):
            assert in_schema is None, f"{rule.pattern}: {rule.status} but the schema declares it"


def test_classify_does_not_confuse_booleans_and_integers():
    assert classify("grpo.max_rollout_turns", True, RunConfigFields).status == REFUSED
    assert classify("grpo.max_rollout_turns", 1, RunConfigFields).status == IMPLEMENTED
    assert classify("grpo.batch_multiplier", 1.0, RunConfigFields).status == IGNORED


@pytest.mark.parametrize("recipe", RECIPES)
def test_project_recipes_have_no_ignored_or_unknown_keys(recipe):
    cfg = load_config(recipe)
    assert [v.key for v in cfg.key_report if v.status != IMPLEMENTED] == []


@pytest.mark.parametrize("recipe", RECIPES)
def test_resolved_config_round_trips(recipe, tmp_path):
    cfg = load_config(recipe, ["policy.generation.vllm_cfg.num_last_layers_in_bf16=1"])
    p = tmp_path / "config.yaml"
    p.write_text(to_yaml(cfg))
    again = load_config_file(p)
    assert again == cfg and again.recipe == cfg.recipe and again.arm == cfg.arm
    assert yaml.safe_load(to_yaml(again)) == yaml.safe_load(p.read_text())


def test_recipes_set_the_jetrl_arm_through_nemo_rl_switches():
    for recipe in RECIPES:
        cfg = load_config(recipe)
        assert cfg.policy.megatron_cfg.fp8_cfg.enabled and cfg.policy.generation.vllm_cfg.precision == "fp8", recipe
        assert cfg.arm == "jetrl"


def test_older_data_keys_read_as_nemo_rl_v070_layout(tmp_path):
    """NeMo-RL's (and this project's) data keys before data.train / data.default load as their new keys."""
    base = Path(__file__).resolve().parents[1] / "recipes" / "grpo_math_base.yaml"
    old = _write(tmp_path, "old.yaml", f"""
        defaults: {base}
        data:
          dataset_name: math_jsonl
          data_path: data/math_sample.jsonl
          prompt_file: null
        """)
    cfg = load_config_file(old, ["~data.train", "~data.default"])
    new = load_config("grpo_math_base", ["data.train.input_key=input", "data.train.output_key=output",
                                         "data.train.split_validation_size=0.015625", "data.train.seed=0"])
    assert cfg.data == new.data
    tiny = load_config("tiny_cpu", ["~data.train.num_items", "+data.synthetic.num_items=5"])
    assert tiny.data.train.num_items == 5
    with pytest.raises(ConfigError, match="data.dataset_name and data.train.dataset_name are both set"):
        load_config("tiny_cpu", ["+data.dataset_name=synthetic_addition"])
