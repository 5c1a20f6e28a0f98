"""Every key of NeMo-RL v0.7.0's GRPO configs, accounted for: implemented, ignored (no effect, warned) or refused.

Why a table and not silence: a NeMo-RL user's YAML carries hundreds of keys; a key that is read with another meaning,
or dropped without a word, changes an experiment behind the user's back. Each key of a loaded config therefore lands
in exactly one status:

- ``implemented``: a field of ``rl/config/schema.py``, read with NeMo-RL's meaning (a note or the accepted values,
  when there are any, are declared on the field itself: ``jetrl_megatron/config_key.py``);
- ``ignored``: accepted with no effect, for the reason given (a Ray or DTensor knob that this runtime makes moot);
  one warning at start lists them;
- ``refused``: the value asks for something this project does not do; loading stops with the key and the reason.

A rule may accept some values and refuse others (``allowed``): ``data_plane.enabled: false`` is ignored, ``true`` is
refused. The ignored and refused keys are not in the schema; their rules are the table below. Keys that match no rule
and are not in the schema are unknown: an error, with the closest known key. ``docs/nemo_rl_keys.md`` is generated
from :data:`RULES` (``jetrl keys``).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from jetrl_megatron.config_key import IGNORED, IMPLEMENTED, REFUSED, KeyRule, field_keys, section_of
from jetrl_megatron.rl.config.schema import MOE_NOTE as _MOE
from jetrl_megatron.rl.config.schema import RunConfigFields

__all__ = ["IGNORED", "IMPLEMENTED", "OFF_SCHEMA_RULES", "REFUSED", "RULES", "KeyRule", "KeyVerdict", "classify",
           "rule_for", "schema_rules", "schema_status"]

OFF = (False, None)
EMPTY = (None, {}, [])


def _r(pattern: str, status: str, note: str, allowed: tuple[Any, ...] | None = None) -> KeyRule:
    return KeyRule(pattern, status, note, allowed)


_RAY = "Ray placement/networking; this project runs under torchrun (or SLURM's srun), one process per GPU"
_DTENSOR = "DTensor (PyTorch-native) trainer; this project trains with Megatron-Core only"
_MCORE_GEN = "Megatron-Core inference engine; rollouts run on vLLM here (policy.generation.backend: vllm)"
_GYM = "NeMo-Gym environments are not part of this project (env.should_use_nemo_gym is refused)"
_THROUGHPUT = "a throughput knob with no effect on the loss; this runtime batches its own way"

# NeMo-RL's keys that are not in the schema: each ignored (no effect) or refused, with the reason.
OFF_SCHEMA_RULES: tuple[KeyRule, ...] = (
    # ---------------------------------------------------------------- grpo
    _r("grpo.async_grpo.enabled", IGNORED, "asynchronous GRPO is refused: Jet-RL's point is on-policy FP8", OFF),
    _r("grpo.async_grpo.**", IGNORED, "asynchronous GRPO settings; async GRPO itself is refused"),
    _r("grpo.use_dynamic_sampling", IGNORED, "DAPO dynamic sampling (drop zero-variance groups) is not implemented",
       OFF),
    _r("grpo.dynamic_sampling_max_gen_batches", IGNORED, "used only with dynamic sampling (refused)"),
    _r("grpo.batch_multiplier", IGNORED, "used only with dynamic sampling (refused)", (1,)),
    _r("grpo.reward_shaping.enabled", IGNORED, "DAPO overlong reward shaping is not implemented", OFF),
    _r("grpo.reward_shaping.**", IGNORED, "reward shaping settings; reward shaping itself is refused when enabled"),
    _r("grpo.seq_logprob_error_threshold", IGNORED, "sequence masking by logprob error is not implemented", OFF),
    _r("grpo.calculate_advantages_on_gpu", IGNORED, "where advantages are computed; same numbers"),
    _r("grpo.val_batch_size", IGNORED, _THROUGHPUT),
    _r("grpo.skip_reference_policy_logprobs_calculation", IGNORED,
       "reference logprobs are computed only when loss_fn.reference_policy_kl_penalty > 0 anyway"),
    _r("grpo.penalize_invalid_tool_call", IGNORED, "tool-calling environments only; no tool calls here"),
    _r("grpo.invalid_tool_call_advantage", IGNORED, "tool-calling environments only; no tool calls here"),
    _r("grpo.invalid_tool_call_strategy", IGNORED, "tool-calling environments only; no tool calls here"),
    _r("grpo.penalize_malformed_thinking", IGNORED, "thinking-format penalty of chat environments; not used here"),
    _r("grpo.malformed_thinking_advantage", IGNORED, "thinking-format penalty of chat environments; not used here"),
    # ---------------------------------------------------------------- loss_fn
    _r("loss_fn.sequence_level_importance_ratios", IGNORED, "GSPO sequence-level ratios are not implemented", OFF),
    _r("loss_fn.use_cispo", IGNORED, "CISPO is not implemented", OFF),
    _r("loss_fn.disable_ppo_ratio", IGNORED, "the PPO ratio is always used", OFF),
    _r("loss_fn.use_kl_in_reward", IGNORED, "KL as a reward term is not implemented (use the KL penalty)", OFF),
    _r("loss_fn.positive_example_nll_weight", IGNORED, "VAPO's positive-example NLL term is not implemented",
       (0, None)),
    # ---------------------------------------------------------------- checkpointing
    _r("checkpointing.model_save_format", IGNORED,
       "checkpoints are this project's own per-rank files (resumable); `jetrl export` writes HF safetensors"),
    _r("checkpointing.save_consolidated", IGNORED,
       "checkpoints are per rank; `jetrl export` writes a consolidated HF model directory"),
    _r("checkpointing.save_optimizer", IGNORED, "the optimizer state is always saved (a resume needs it)", (True,)),
    _r("checkpointing.checkpoint_must_save_by", IGNORED,
       "time-limited final save is not implemented; use checkpointing.save_period"),
    # ---------------------------------------------------------------- policy
    _r("policy.hf_config_overrides", IGNORED, "changing the HF config (e.g. YaRN rope scaling) is not "
       "supported: trainer and rollout must build the same model", EMPTY),
    _r("policy.hf_config_overrides.**", REFUSED, "changing the HF config (e.g. YaRN rope scaling) is not "
       "supported: trainer and rollout must build the same model", ()),
    _r("policy.dtensor_cfg.enabled", IGNORED, _DTENSOR, OFF),
    _r("policy.dtensor_cfg.**", IGNORED, _DTENSOR),
    _r("policy.optimizer.**", IGNORED, "the DTensor trainer's optimizer; Megatron's is policy.megatron_cfg.optimizer"),
    _r("policy.scheduler.**", IGNORED, "the DTensor trainer's scheduler; Megatron's is policy.megatron_cfg.scheduler"),
    _r("policy.dynamic_batching.**", IGNORED, "token-budget micro-batching: " + _THROUGHPUT),
    _r("policy.sequence_packing.**", IGNORED, "sequence packing: " + _THROUGHPUT
       + " (micro-batches are padded; the loss is normalized over the global batch either way)"),
    _r("policy.offload_optimizer_for_logprob", IGNORED, "a memory knob for colocated Ray workers"),
    _r("policy.worker_cls", IGNORED, "the Jet-RL worker for NeMo-RL's driver (read by NeMo-RL with patches/nemo-rl-"
       "v0.7.0-jetrl-worker.patch); the standalone runner is its own loop", (
           "jetrl_megatron.nemo_rl.worker.JetRLMegatronPolicyWorker", None)),
    _r("policy.generation_batch_size", IGNORED, "vLLM schedules the whole rollout batch itself"),
    _r("policy.draft.enabled", IGNORED, "speculative decoding with a draft model is not implemented", OFF),
    _r("policy.draft.**", IGNORED, "draft-model settings; speculative decoding is refused when enabled"),
    _r("policy.router_replay.enabled", IGNORED, _MOE, OFF),
    _r("policy.disable_modelopt_layer_spec", IGNORED, "ModelOpt quantization is not used"),
    _r("policy.quant_cfg", IGNORED, "ModelOpt quantization (e.g. NVFP4) is not implemented", (None,)),
    _r("policy.quant_*", IGNORED, "ModelOpt calibration settings; ModelOpt itself is refused"),
    # policy.megatron_cfg
    _r("policy.megatron_cfg.expert_model_parallel_size", IGNORED, _MOE, (1,)),
    _r("policy.megatron_cfg.expert_tensor_parallel_size", IGNORED, _MOE, (1, None)),
    _r("policy.megatron_cfg.moe_*", IGNORED, _MOE),
    _r("policy.megatron_cfg.freeze_moe_router", IGNORED, _MOE),
    _r("policy.megatron_cfg.track_moe_metrics", IGNORED, _MOE),
    _r("policy.megatron_cfg.mtp_num_layers", IGNORED, "multi-token prediction heads are not implemented", (0, None)),
    _r("policy.megatron_cfg.mtp_*", IGNORED, "multi-token prediction settings; MTP itself is refused"),
    _r("policy.megatron_cfg.peft.enabled", IGNORED, "LoRA / PEFT is not implemented", OFF),
    _r("policy.megatron_cfg.peft.**", IGNORED, "LoRA settings; LoRA itself is refused when enabled"),
    _r("policy.megatron_cfg.num_layers_in_first_pipeline_stage", IGNORED,
       "uneven pipeline stages are not implemented: layers split evenly over pipeline_model_parallel_size", (None,)),
    _r("policy.megatron_cfg.num_layers_in_last_pipeline_stage", IGNORED,
       "uneven pipeline stages are not implemented: layers split evenly over pipeline_model_parallel_size", (None,)),
    _r("policy.megatron_cfg.pipeline_dtype", IGNORED, "pipeline messages are BF16 (policy.precision)",
       ("bfloat16", None)),
    _r("policy.megatron_cfg.recompute_granularity", IGNORED, "activation_checkpointing recomputes full layers",
       ("full", None)),
    _r("policy.megatron_cfg.recompute_modules", IGNORED, "activation_checkpointing recomputes full layers"),
    _r("policy.megatron_cfg.apply_rope_fusion", IGNORED, "kernel fusion choice; the project's RoPE kernel is fixed by"
       " the rollout-matched numerics"),
    _r("policy.megatron_cfg.bias_activation_fusion", IGNORED, "kernel fusion choice; the SwiGLU kernel is fixed by "
       "the rollout-matched numerics"),
    _r("policy.megatron_cfg.gradient_accumulation_fusion", IGNORED, "TransformerEngine fusion; the FP8 WGrad "
       "accumulates in FP32 and writes BF16 gradients"),
    _r("policy.megatron_cfg.use_fused_weighted_squared_relu", IGNORED, "not used by the supported models"),
    _r("policy.megatron_cfg.attention_backend", IGNORED, "attention runs the project's rollout-matched kernel"),
    _r("policy.megatron_cfg.defer_fp32_logits", IGNORED, "logprobs are always computed from FP32 logits"),
    _r("policy.megatron_cfg.empty_unused_memory_level", IGNORED, "a memory knob; same numbers"),
    _r("policy.megatron_cfg.converter_type", IGNORED, "the HF <-> Megatron converter is chosen from config.json"),
    _r("policy.megatron_cfg.force_reconvert_from_hf", IGNORED, "HF weights are converted in memory at every start"),
    _r("policy.megatron_cfg.train_iters", IGNORED, "Megatron's iteration cap; the run length is grpo.max_num_steps"),
    _r("policy.megatron_cfg.distributed_data_parallel_config.**", IGNORED,
       "gradients are reduced by the project's own BF16 gradient buffers (overlap and FSDP knobs do not apply)"),
    _r("policy.megatron_cfg.optimizer.use_precision_aware_optimizer", IGNORED,
       "with NeMo-RL's defaults (FP32 master weights, FP32 Adam moments) Megatron's precision-aware optimizer only "
       "moves where the FP32 state lives; the update is the same as this project's FP32 Adam"),
    _r("policy.megatron_cfg.optimizer.sgd_momentum", IGNORED, "SGD only; the optimizer is Adam"),
    _r("policy.megatron_cfg.scheduler.override_opt_param_scheduler", IGNORED,
       "the schedule always comes from this config (Megatron's checkpointed schedule is not used)"),
    # policy.generation
    _r("policy.generation.colocated.resources.**", IGNORED, _RAY),
    _r("policy.generation.port_range_*", IGNORED, _RAY),
    _r("policy.generation.mcore_generation_config.**", IGNORED, _MCORE_GEN),
    _r("policy.generation.quant_cfg", IGNORED, "ModelOpt rollout quantization is not implemented", (None,)),
    _r("policy.generation.real_quant", IGNORED, "ModelOpt rollout quantization settings"),
    _r("policy.generation.vllm_cfg.enable_expert_parallel", IGNORED, _MOE, OFF),
    _r("policy.generation.vllm_cfg.async_engine", IGNORED, "vLLM's async engine: " + _THROUGHPUT),
    _r("policy.generation.vllm_cfg.enable_prefix_caching", IGNORED, "prefix caching: " + _THROUGHPUT
       + " (set vllm_kwargs.enable_prefix_caching to pass it to vLLM)"),
    _r("policy.generation.vllm_cfg.skip_tokenizer_init", IGNORED, "the engine takes token ids; its tokenizer is not "
       "used"),
    _r("policy.generation.vllm_cfg.use_tqdm", IGNORED, "progress is shown by policy.jet_rl.progress_bars"),
    _r("policy.generation.vllm_cfg.enforce_monotonicity", IGNORED, "multi-turn token monotonicity checks; single "
       "turn here"),
    _r("policy.generation.vllm_cfg.enable_thinking", IGNORED, "chat-template switch; no chat template is applied"),
    _r("policy.generation.vllm_cfg.expose_http_server", IGNORED, "an HTTP server for agent environments is not "
       "implemented", OFF),
    _r("policy.generation.vllm_cfg.http_server_serving_chat_kwargs.**", IGNORED, "HTTP server settings (refused "
       "when enabled)"),
    _r("policy.generation.vllm_cfg.enable_vllm_metrics_logger", IGNORED, "vLLM's metrics logger is not wired in"),
    _r("policy.generation.vllm_cfg.vllm_metrics_logger_interval", IGNORED, "vLLM's metrics logger is not wired in"),
    _r("policy.generation.vllm_cfg.reasoning_parser_plugin", IGNORED, "reasoning parsers are for chat "
       "environments; answers are verified directly"),
    # ---------------------------------------------------------------- data
    _r("data.default.dataset_name", IGNORED, "the dataset is named in data.train / data.validation"),
    _r("data.num_workers", IGNORED, "prompts are built in the trainer process"),
    _r("data.use_multiple_dataloader", IGNORED, "one training dataset per run", OFF),
    # ---------------------------------------------------------------- env
    _r("env.dapo.**", IGNORED, "the DAPO environment is used only when data.default.env_name is dapo (refused)"),
    _r("env.should_use_nemo_gym", IGNORED, _GYM, OFF),
    _r("env.should_log_nemo_gym_responses", IGNORED, _GYM),
    _r("env.nemo_gym.**", IGNORED, _GYM),
    # ---------------------------------------------------------------- logger
    _r("logger.tensorboard.**", IGNORED, "TensorBoard events go to <log_dir>/tb"),
    _r("logger.mlflow_enabled", IGNORED, "MLflow logging is not implemented (TensorBoard and W&B are)", OFF),
    _r("logger.mlflow.**", IGNORED, "MLflow settings; MLflow itself is refused when enabled"),
    _r("logger.swanlab_enabled", IGNORED, "SwanLab logging is not implemented (TensorBoard and W&B are)", OFF),
    _r("logger.swanlab.**", IGNORED, "SwanLab settings; SwanLab itself is refused when enabled"),
    _r("logger.monitor_gpus", IGNORED, "GPU monitoring is not implemented; step times and memory are logged"),
    _r("logger.gpu_monitoring.**", IGNORED, "GPU monitoring is not implemented"),
    # ---------------------------------------------------------------- cluster and others
    _r("cluster.master_port_range_*", IGNORED, _RAY),
    _r("cluster.segment_size", IGNORED, _RAY),
    _r("data_plane.**", IGNORED, "NeMo-RL's transfer queue between Ray actors; batches move between torchrun "
       "ranks here, with the same contents"),
    _r("on_policy_distillation", IGNORED, "distillation settings; this is a GRPO runner", (None,)),
    _r("on_policy_distillation.**", REFUSED, "on-policy distillation is not implemented", ()),
    _r("jet_rl", REFUSED, "the Jet-RL block moved to policy.jet_rl; the arm follows "
       "policy.megatron_cfg.fp8_cfg.enabled and policy.generation.vllm_cfg.precision (docs/config.md)", ()),
    _r("jet_rl.**", REFUSED, "the Jet-RL block moved to policy.jet_rl; the arm follows "
       "policy.megatron_cfg.fp8_cfg.enabled and policy.generation.vllm_cfg.precision (docs/config.md)", ()),
)


def schema_rules(root: type = RunConfigFields) -> tuple[KeyRule, ...]:
    """The rules the schema's fields declare (their notes, accepted values and the keys inside free mappings)."""
    return tuple(r for path, _, k in field_keys(root) for r in k.rules(path))


# The whole table: the schema's own rules, then the others (no pattern of one matches a key of the other).
RULES: tuple[KeyRule, ...] = schema_rules() + OFF_SCHEMA_RULES


def rule_for(key: str) -> KeyRule | None:
    return next((r for r in RULES if r.matches(key)), None)


# ----------------------------------------------------------------------------------------------------------------
# The schema's own keys
# ----------------------------------------------------------------------------------------------------------------


def _free_mapping(tp: Any) -> bool:
    """A ``dict[...]`` field (vllm_kwargs, env_vars): any key below it is implemented (passed through)."""
    if typing.get_origin(tp) is dict:
        return True
    return any(typing.get_origin(a) is dict for a in typing.get_args(tp) if a is not type(None))


def schema_status(root: Any, key: str) -> str | None:
    """``implemented`` when ``key`` is a field of the schema rooted at dataclass ``root`` (or inside one of its
    free mappings), ``section`` when it names a whole section, None when the schema has no such key."""
    tp: Any = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        dc = section_of(tp)
        if dc is None:
            return None
        hints = typing.get_type_hints(dc)
        if part not in hints:
            return None
        tp = hints[part]
        if _free_mapping(tp):
            return IMPLEMENTED
        if i == len(parts) - 1:
            return "section" if section_of(tp) is not None else IMPLEMENTED
    return None


@dataclass(frozen=True)
class KeyVerdict:
    key: str
    value: Any
    status: str  # implemented | ignored | refused | unknown
    note: str


def classify(key: str, value: Any, schema_root: Any) -> KeyVerdict:
    rule = rule_for(key)
    in_schema = schema_status(schema_root, key)
    if rule is not None:
        if not rule.accepts(value):
            allowed = ", ".join(repr(a) for a in rule.allowed or ())
            note = rule.note + (f" (accepted: {allowed})" if allowed else "")
            return KeyVerdict(key, value, REFUSED, note)
        return KeyVerdict(key, value, rule.status, rule.note)
    if in_schema is not None:
        return KeyVerdict(key, value, IMPLEMENTED, "")
    return KeyVerdict(key, value, "unknown", "")
