"""Every recipe loads, resolves and passes `jetrl plan`; bad keys and values are rejected with the key path."""

import pytest

from jetrl_megatron.rl.config import RECIPES_DIR, ConfigError, load_config
from jetrl_megatron.rl.plan import plan_report

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
REQUIRED = {"tiny_cpu", "qwen3_8b_tp1", "qwen3_32b_tp2", "llama31_8b_tp1", "qwen25_7b_tp2"}


def test_required_recipes_present():
    assert REQUIRED <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_and_passes_plan(name):
    cfg = load_config(name)
    text, ok = plan_report(cfg)
    assert ok, text
    assert "resharder preflight" in text and "REFUSED" not in text
    for arm in ("bf16", "bf16_train_fp8_rollout", "jetrl", "fake_quant"):
        c = load_config(name, [f"jet_rl.mode={arm}"])
        assert c.mode == arm
        assert c.policy.megatron_cfg.fp8_cfg.enabled == (arm == "jetrl")
        assert c.policy.generation.vllm_cfg.precision == ("bfloat16" if arm == "bf16" else "fp8")


GPU_RECIPES = [n for n in RECIPES if load_config(n).is_gpu]


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_fits_80gib_counting_refit_buffers(name):
    """Both colocated phases fit an 80 GiB GPU, with the refit exchange's persistent buffers counted in each
    (present exactly when the trainer is model-parallel)."""
    from jetrl_megatron.rl.plan import memory_estimate, model_shape, parallel_layout

    cfg = load_config(name)
    layout = parallel_layout(cfg)
    mem = memory_estimate(cfg, model_shape(cfg), layout, gpu_mem_gib=80.0)
    assert (mem["refit_buffers"] > 0) == (layout.tp * layout.pp > 1), mem
    assert mem["train_phase_total"] >= mem["refit_buffers"] + mem["weights_bf16"] + mem["optimizer_adam"]
    assert mem["rollout_phase_total"] >= mem["refit_buffers"] + mem["weights_bf16"] + mem["optimizer_adam"]
    peak = max(mem["train_phase_total"], mem["rollout_phase_total"])
    assert peak <= 80.0, f"{name}: peak {peak:.1f} GiB of 80\n{mem}"


def test_nemo_rl_hyperparameters():
    q8, q32, ll = load_config("qwen3_8b_tp1"), load_config("qwen3_32b_tp2"), load_config("llama31_8b_tp1")
    assert q8.policy.megatron_cfg.optimizer.lr == 1e-6 and q8.policy.megatron_cfg.optimizer.weight_decay == 0.1
    assert q32.policy.megatron_cfg.optimizer.lr == 3e-7 and q32.policy.megatron_cfg.tensor_model_parallel_size == 2
    assert q32.policy.generation.vllm_cfg.tensor_parallel_size == 2 and q32.policy.train_global_batch_size == 2048
    assert ll.policy.megatron_cfg.optimizer.lr == 3e-7 and ll.loss_fn.truncated_importance_sampling_type == "tis"
    assert q8.grpo.num_prompts_per_step == 64 and q8.grpo.num_generations_per_prompt == 32
    assert q8.policy.megatron_cfg.env_vars["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] == "1"


@pytest.mark.parametrize("override, needle", [
    ("policy.megatron_cfg.optimzer.lr=1", "policy.megatron_cfg.optimzer"),
    ("grpo.bogus=1", "grpo.bogus"),
    ("nonsection.x=1", "nonsection"),
    ("jet_rl.nope=1", "nope"),
    ("grpo.max_num_steps=ten", "grpo.max_num_steps"),
    ("grpo.normalize_rewards=3", "grpo.normalize_rewards"),
    ("jet_rl.mode=fp4", "jet_rl.mode"),
    ("loss_fn.truncated_importance_sampling_type=foo", "truncated_importance_sampling_type"),
    ("policy.train_global_batch_size=60", "train_global_batch_size"),
    ("grpo.num_generations_per_prompt=1", "num_generations_per_prompt"),
])
def test_bad_overrides_rejected(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config("tiny_cpu", [override])


def test_typed_overrides_and_inheritance(tmp_path):
    c = load_config("tiny_cpu", ["policy.megatron_cfg.optimizer.lr=2e-4", "grpo.max_num_steps=3",
                                 "loss_fn.ratio_clip_c=3", "policy.tokenizer.name=null"])
    assert c.policy.megatron_cfg.optimizer.lr == 2e-4 and isinstance(c.loss_fn.ratio_clip_c, float)
    assert c.grpo.max_num_steps == 3
    child = tmp_path / "child.yaml"
    child.write_text("defaults: tiny_cpu\ngrpo:\n  max_num_steps: 99\n")
    cc = load_config(str(child))
    assert cc.grpo.max_num_steps == 99
    assert cc.grpo.num_prompts_per_step == load_config("tiny_cpu").grpo.num_prompts_per_step
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("defaults: b.yaml\n")
    b.write_text("defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(a))
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_recipe")
    with pytest.raises(ConfigError, match="a.b=c"):
        load_config("tiny_cpu", ["novalue"])


def test_plan_refuses_bad_layout():
    cfg = load_config("qwen25_7b_tp2", ["policy.megatron_cfg.tensor_model_parallel_size=8",
                                        "policy.generation.vllm_cfg.tensor_parallel_size=8"])
    text, ok = plan_report(cfg, show_config=False)
    assert not ok and "REFUSED" in text and "28 attention heads" in text


def test_model_weights_resolution(tmp_path, monkeypatch):
    from jetrl_megatron.rl.loop import resolve_model_weights

    assert resolve_model_weights(load_config("tiny_cpu")) is None  # preset: random init
    assert resolve_model_weights(load_config("tiny_cpu", [f"policy.model_name={tmp_path}"])) == str(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="policy.model_name"):  # never a silent random init
        resolve_model_weights(load_config("qwen3_8b_tp1"))


def test_plan_counts_a_sized_kv_cache():
    """With vllm_cfg.kv_cache_memory_bytes set, the engine sizes its KV cache from it (CUDA too), so the plan's KV
    budget is that size and the rollout phase is weights + that size, not gpu_memory_utilization of the GPU."""
    from jetrl_megatron.rl.plan import memory_estimate, model_shape, parallel_layout

    base = load_config("count_150m_gpu", ["policy.generation.vllm_cfg.kv_cache_memory_bytes=null"])
    sized = load_config("count_150m_gpu", [f"policy.generation.vllm_cfg.kv_cache_memory_bytes={3 << 30}"])
    m0 = memory_estimate(base, model_shape(base), parallel_layout(base), gpu_mem_gib=80.0)
    m1 = memory_estimate(sized, model_shape(sized), parallel_layout(sized), gpu_mem_gib=80.0)
    assert m1["kv_cache_budget"] == pytest.approx(3.0)
    assert m0["kv_cache_budget"] == pytest.approx(0.08 * 80.0 - m0["vllm_weights"])
    grown = m1["rollout_phase_total"] - m0["rollout_phase_total"]
    assert grown == pytest.approx(3.0 - 0.08 * 80.0 + m1["vllm_weights"])
