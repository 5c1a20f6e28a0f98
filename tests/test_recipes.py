"""Every recipe loads, resolves and passes `jetrl plan`; bad keys and values are rejected with the key path."""

import pytest

from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rl.config.run_config import ARM_MODES, RECIPES_DIR, ConfigError, arm_overrides, load_config
from jetrl_megatron.rl.tools.run_plan import plan_report

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
REQUIRED = {"tiny_cpu", "qwen3_8b_tp1", "qwen3_32b_tp2", "llama31_8b_tp1", "qwen25_7b_tp2"}


def test_required_recipes_present():
    assert REQUIRED <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_and_passes_plan(name):
    cfg = load_config(name)
    text, ok = plan_report(cfg, gpu_mem_gib(name))
    assert ok, text
    assert "resharder preflight" in text and "REFUSED" not in text
    for arm in ("bf16", "bf16_train_fp8_rollout", "jetrl", "fake_quant"):
        c = load_config(name, arm_overrides(arm))
        assert c.arm == arm and c.recipe.mode == arm and c.policy.jet_rl.arm == arm
        assert c.policy.megatron_cfg.fp8_cfg.enabled == (arm == "jetrl")
        assert c.policy.generation.vllm_cfg.precision == ("bfloat16" if arm == "bf16" else "fp8")


@pytest.mark.parametrize(("fp8_train", "precision", "stated", "arm"), [
    (False, "bfloat16", None, "bf16"),
    (False, "fp8", None, "bf16_train_fp8_rollout"),
    (True, "fp8", None, "jetrl"),
    (False, "fp8", "fake_quant", "fake_quant"),  # the ablation: only by name, on the bf16_train_fp8_rollout switches
    (True, "fp8", "jetrl", "jetrl"),  # a restated arm that agrees
])
def test_nemo_rl_switches_derive_the_arm(fp8_train, precision, stated, arm):
    """The arm follows NeMo-RL's own switches (fp8_cfg.enabled, vllm_cfg.precision); the FP8 recipe is built once
    from it."""
    ov = [f"policy.megatron_cfg.fp8_cfg.enabled={str(fp8_train).lower()}",
          f"policy.generation.vllm_cfg.precision={precision}"]
    c = load_config("tiny_cpu", ov + ([f"policy.jet_rl.arm={stated}"] if stated else []))
    assert c.arm == arm and isinstance(c.recipe, Fp8Recipe) and c.recipe.mode == arm
    assert c.recipe.trains_fp8 == (arm == "jetrl") and c.recipe.rollout_fp8 == (arm != "bf16")
    assert c.fp8_token_multiple() == (128 if arm in ("jetrl", "fake_quant") else 1)


@pytest.mark.parametrize(("override", "needle"), [
    (["policy.megatron_cfg.fp8_cfg.enabled=true", "policy.generation.vllm_cfg.precision=bfloat16"],
     "FP8 trainer with a BF16 rollout is not an arm"),
    (["policy.jet_rl.arm=bf16"], "policy.jet_rl.arm: 'bf16' contradicts policy.megatron_cfg.fp8_cfg.enabled: true"),
    (["policy.jet_rl.arm=fake_quant"], "'fake_quant' needs fp8_cfg.enabled: false, precision: fp8"),
    ([*arm_overrides("bf16"), "policy.generation.vllm_cfg.precision=fp8"], "contradicts"),
])
def test_contradicting_arm_switches_refused(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("tiny_cpu", override)


def test_arm_overrides_cover_every_arm():
    assert arm_overrides("jetrl") == ["policy.megatron_cfg.fp8_cfg.enabled=true",
                                      "policy.generation.vllm_cfg.precision=fp8", "policy.jet_rl.arm=jetrl"]
    for arm in ARM_MODES:
        assert load_config("qwen3_8b_tp1", arm_overrides(arm)).arm == arm
    with pytest.raises(ConfigError, match="fp4"):
        arm_overrides("fp4")


def test_top_level_jet_rl_block_refused(tmp_path):
    """The removed `jet_rl:` section: refused with where its keys went, never silently ignored."""
    old = tmp_path / "old.yaml"
    old.write_text("defaults: tiny_cpu\njet_rl:\n  mode: bf16\n  gemm_backend: cublas\n")
    with pytest.raises(ConfigError, match=r"jet_rl\.mode: 'bf16' is refused: the Jet-RL block moved to policy\.jet_rl"):
        load_config(str(old))


GPU_RECIPES = [n for n in RECIPES if load_config(n).is_gpu]
def gpu_mem_gib(name: str) -> float:
    """The GPU a recipe is written for: its policy.jet_rl.plan_gpu_mem_gib, else an 80 GiB one."""
    return load_config(name).policy.jet_rl.plan_gpu_mem_gib or 80.0


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_fits_its_gpu_counting_refit_buffers(name):
    """Every phase fits the recipe's GPU (its plan_gpu_mem_gib, else 80 GiB), with the refit exchange's
    persistent buffers counted in each (present exactly when the trainer is model-parallel)."""
    from jetrl_megatron.rl.tools.run_plan import memory_estimate, model_shape, parallel_layout

    cfg = load_config(name)
    layout = parallel_layout(cfg)
    gib = gpu_mem_gib(name)
    mem = memory_estimate(cfg, model_shape(cfg), layout, gpu_mem_gib=gib)
    assert (mem["refit_buffers"] > 0) == (layout.tp * layout.pp > 1), mem
    assert mem["train_phase_total"] >= mem["refit_buffers"] + mem["weights_bf16"] + mem["optimizer_adam"]
    assert mem["rollout_phase_total"] >= mem["refit_buffers"] + mem["weights_bf16"] + mem["optimizer_adam"]
    peak = max(mem[k] for k in ("logprob_phase_total", "train_phase_total", "refit_phase_total",
                                "rollout_phase_total"))
    assert peak <= gib, f"{name}: peak {peak:.1f} GiB of {gib:g}\n{mem}"


def test_nemo_rl_hyperparameters():
    q8, q32, ll = load_config("qwen3_8b_tp1"), load_config("qwen3_32b_tp2"), load_config("llama31_8b_tp1")
    assert q8.policy.megatron_cfg.optimizer.lr == 1e-6 and q8.policy.megatron_cfg.optimizer.weight_decay == 0.1
    assert q32.policy.megatron_cfg.optimizer.lr == 3e-7 and q32.policy.megatron_cfg.tensor_model_parallel_size == 2
    assert q32.policy.generation.vllm_cfg.tensor_parallel_size == 2 and q32.policy.train_global_batch_size == 2048
    assert ll.policy.megatron_cfg.optimizer.lr == 3e-7 and ll.loss_fn.truncated_importance_sampling_type == "tis"
    assert q8.grpo.num_prompts_per_step == 64 and q8.grpo.num_generations_per_prompt == 32
    # grpo_math_8B_megatron_fp8.yaml's FP8 flow: blockwise FP8 trainer + FP8 rollout on DeepGEMM (auto's FProp and
    # DGrad pick; WGrad on cuBLAS), FP32 block scales
    assert q8.arm == "jetrl" and q8.recipe.scale_fmt == "fp32" and q8.recipe.gemm_backend == "auto"
    assert q8.rollout_env() == {"VLLM_USE_DEEP_GEMM": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0"}
    # NeMo-RL's interpolations resolve against the child's values
    assert q32.policy.make_sequence_length_divisible_by == 2 and q8.policy.make_sequence_length_divisible_by == 1
    assert q8.policy.generation.max_new_tokens == q8.policy.max_total_sequence_length == 4096
    assert q8.policy.megatron_cfg.optimizer.clip_grad == q8.policy.max_grad_norm
    assert q8.checkpointing.metric_name == "val:accuracy" and q8.checkpointing.keep_top_k == 3


@pytest.mark.parametrize("override, needle", [
    ("policy.megatron_cfg.optimzer.lr=1", "policy.megatron_cfg.optimzer"),
    ("grpo.bogus=1", "grpo.bogus"),
    ("nonsection.x=1", "nonsection"),
    ("policy.jet_rl.nope=1", "policy.jet_rl.nope"),  # not in the config: `+` would add it...
    ("+policy.jet_rl.nope=1", "policy.jet_rl.nope"),  # ... and then it is an unknown key
    ("jet_rl.nope=1", "moved to policy.jet_rl"),
    ("jet_rl.mode=bf16", "moved to policy.jet_rl"),
    ("grpo.max_num_steps=ten", "grpo.max_num_steps"),
    ("grpo.normalize_rewards=3", "grpo.normalize_rewards"),
    ("policy.jet_rl.arm=fp4", "policy.jet_rl.arm"),
    ("policy.jet_rl.gemm_backend=cutlass", "policy.jet_rl.gemm_backend"),
    ("policy.generation.vllm_cfg.num_first_layers_in_bf16=-1", "policy.generation.vllm_cfg.num_first_layers_in_bf16"),
    ("policy.generation.vllm_cfg.pow2_weight_scaling_factors=true", "pow2_activation_scaling_factors"),
    ("data.dataset_name=synthetic_sort", "data.dataset_name"),  # moved to data.train.dataset_name
    ("data.synthetic.num_items=4", "data.synthetic"),  # moved to data.train.num_items
    ("data.train.dataset_name=ResponseDataset", "data.train.data_path"),  # ResponseDataset needs its JSONL
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
    with pytest.raises(ConfigError, match="override 'novalue'.*EQUAL"):
        load_config("tiny_cpu", ["novalue"])


def test_hydra_override_grammar():
    """NeMo-RL's run_grpo.py rules: `a.b=v` changes a key that exists (the schema's defaults count), `+a.b=v` adds,
    `++a.b=v` sets either way, `~a.b` deletes."""
    base = load_config("tiny_cpu")
    assert "force_on_policy_ratio" not in (RECIPES_DIR / "tiny_cpu.yaml").read_text()
    assert load_config("tiny_cpu", ["loss_fn.force_on_policy_ratio=true"]).loss_fn.force_on_policy_ratio  # a default
    with pytest.raises(ConfigError, match=r"already exists; change it with grpo\.max_num_steps="):
        load_config("tiny_cpu", ["+grpo.max_num_steps=3"])
    assert load_config("tiny_cpu", ["++grpo.max_num_steps=3"]).grpo.max_num_steps == 3
    assert load_config("tiny_cpu", ["+policy.generation.vllm_kwargs.seed=3"]).policy.generation.vllm_kwargs["seed"] == 3
    with pytest.raises(ConfigError, match=r"add it with \+policy\.generation\.vllm_kwargs\.seed="):
        load_config("tiny_cpu", ["policy.generation.vllm_kwargs.seed=3"])
    # kv_cache_memory_bytes lives in vllm_kwargs (NeMo-RL's pass-through to vllm.LLM); deleted, a CPU engine gets
    # the 64 MiB default
    assert base.kv_cache_memory_bytes() == 64 << 20 == base.policy.generation.vllm_kwargs["kv_cache_memory_bytes"]
    kv = "policy.generation.vllm_kwargs.kv_cache_memory_bytes"
    gone = load_config("tiny_cpu", [f"~{kv}"])
    assert "kv_cache_memory_bytes" not in gone.policy.generation.vllm_kwargs
    assert gone.kv_cache_memory_bytes() == 64 << 20
    assert load_config("tiny_cpu", [f"{kv}=1024"]).kv_cache_memory_bytes() == 1024
    with pytest.raises(ConfigError, match=r"cannot delete grpo\.bogus"):
        load_config("tiny_cpu", ["~grpo.bogus"])
    with pytest.raises(ConfigError, match="sweeps"):
        load_config("tiny_cpu", ["grpo.seed=1,2"])
    # RunConfig equality ignores what is derived (recipe, key accounting)
    again = load_config("tiny_cpu")
    again.recipe, again.key_report, again.defaulted = Fp8Recipe(mode="bf16"), [], []
    assert again == base and again.recipe != base.recipe
    assert again != load_config("tiny_cpu", ["grpo.max_num_steps=41"])


def test_plan_refuses_bad_layout():
    cfg = load_config("qwen25_7b_tp2", ["policy.megatron_cfg.tensor_model_parallel_size=8",
                                        "policy.generation.vllm_cfg.tensor_parallel_size=8"])
    text, ok = plan_report(cfg, show_config=False)
    assert not ok and "REFUSED" in text and "28 attention heads" in text


def test_model_weights_resolution(tmp_path, monkeypatch):
    from jetrl_megatron.rl.trainer import resolve_model_weights

    assert resolve_model_weights(load_config("tiny_cpu")) is None  # preset: random init
    assert resolve_model_weights(load_config("tiny_cpu", [f"policy.model_name={tmp_path}"])) == str(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="policy.model_name"):  # never a silent random init
        resolve_model_weights(load_config("qwen3_8b_tp1"))


def test_plan_counts_a_sized_kv_cache():
    """With vllm_kwargs.kv_cache_memory_bytes set, the engine sizes its KV cache from it (CUDA too), so the plan's KV
    budget is that size and the rollout phase is weights + that size, not gpu_memory_utilization of the GPU."""
    from jetrl_megatron.rl.tools.run_plan import memory_estimate, model_shape, parallel_layout

    base = load_config("count_150m_gpu", ["~policy.generation.vllm_kwargs.kv_cache_memory_bytes"])
    sized = load_config("count_150m_gpu", [f"policy.generation.vllm_kwargs.kv_cache_memory_bytes={3 << 30}"])
    assert base.kv_cache_memory_bytes() is None and sized.kv_cache_memory_bytes() == 3 << 30  # GPU: no default
    m0 = memory_estimate(base, model_shape(base), parallel_layout(base), gpu_mem_gib=80.0)
    m1 = memory_estimate(sized, model_shape(sized), parallel_layout(sized), gpu_mem_gib=80.0)
    assert m1["kv_cache_budget"] == pytest.approx(3.0)
    assert m0["kv_cache_budget"] == pytest.approx(0.08 * 80.0 - m0["vllm_weights"])
    grown = m1["rollout_phase_total"] - m0["rollout_phase_total"]
    assert grown == pytest.approx(3.0 - 0.08 * 80.0 + m1["vllm_weights"])


@pytest.mark.parametrize("name", ["synthetic_srot", "math_jsonl"])
def test_unknown_dataset_name_refused_at_load(name):
    with pytest.raises(ConfigError, match=r"data\.train\.dataset_name"):
        load_config("tiny_cpu", [f"data.train.dataset_name={name}"])
