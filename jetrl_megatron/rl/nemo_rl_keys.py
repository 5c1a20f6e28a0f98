"""Every key of NeMo-RL v0.7.0's GRPO configs, accounted for: implemented, ignored (no effect, warned) or refused.

Why a table and not silence: a NeMo-RL user's YAML carries hundreds of keys; a key that is read with another meaning,
or dropped without a word, changes an experiment behind the user's back. Each key of a loaded config therefore lands
in exactly one status:

- ``implemented``: a field of ``rl/config_schema.py``, read with NeMo-RL's meaning (a rule here only adds a note or
  restricts the values);
- ``ignored``: accepted with no effect, for the reason given (a Ray or DTensor knob that this runtime makes moot);
  one warning at start lists them;
- ``refused``: the value asks for something this project does not do; loading stops with the key and the reason.

A rule may accept some values and refuse others (``allowed``): ``data_plane.enabled: false`` is ignored, ``true`` is
refused. Keys that match no rule and are not in the schema are unknown: an error, with the closest known key.
``docs/nemo_rl_keys.md`` is generated from this table (``jetrl keys --markdown``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"


@dataclass(frozen=True)
class KeyRule:
    pattern: str  # dotted key; "*" matches one segment, a trailing "**" any number (zero included)
    status: str
    note: str
    allowed: tuple[Any, ...] | None = None  # values accepted under ``status``; any other value is refused

    def matches(self, key: str) -> bool:
        pat, parts = self.pattern.split("."), key.split(".")
        if pat[-1] == "**":
            pat = pat[:-1]
            parts = parts[: len(pat)] if len(parts) >= len(pat) else parts + [""]
        return len(pat) == len(parts) and all(fnmatchcase(k, p) for p, k in zip(pat, parts, strict=True))

    def accepts(self, value: Any) -> bool:
        return self.allowed is None or any(_same(value, a) for a in self.allowed)


def _same(value: Any, allowed: Any) -> bool:
    """Equality that does not confuse True with 1 (YAML booleans and integers are different answers)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    if isinstance(value, int | float) and isinstance(allowed, int | float):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


OFF = (False, None)
EMPTY = (None, {}, [])


def _r(pattern: str, status: str, note: str, allowed: tuple[Any, ...] | None = None) -> KeyRule:
    return KeyRule(pattern, status, note, allowed)


_RAY = "Ray placement/networking; this project runs under torchrun (or SLURM's srun), one process per GPU"
_DTENSOR = "DTensor (PyTorch-native) trainer; this project trains with Megatron-Core only"
_MCORE_GEN = "Megatron-Core inference engine; rollouts run on vLLM here (policy.generation.backend: vllm)"
_MOE = "mixture-of-experts knob: the supported models (Qwen3, Llama-3.1, Qwen2.5 dense) have no experts"
_GYM = "NeMo-Gym environments are not part of this project (env.should_use_nemo_gym is refused)"
_THROUGHPUT = "a throughput knob with no effect on the loss; this runtime batches its own way"

RULES: tuple[KeyRule, ...] = (
    # ---------------------------------------------------------------- grpo
    _r("grpo.adv_estimator.name", IMPLEMENTED, "GRPO's group-relative advantage only", ("grpo",)),
    _r("grpo.adv_estimator.minus_baseline", IMPLEMENTED, "the baseline is always subtracted", (True,)),
    _r("grpo.max_rollout_turns", IMPLEMENTED, "single-turn rollouts only", (1,)),
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
    _r("loss_fn.reference_policy_kl_type", IMPLEMENTED, "k1 | k2 | k3, NeMo-RL's estimators and clamps",
       ("k1", "k2", "k3")),
    _r("loss_fn.truncated_importance_sampling_type", IMPLEMENTED, "tis | icepop | seq-mask-tis (NeMo-RL semantics)",
       (None, "tis", "icepop", "seq-mask-tis")),
    _r("loss_fn.sequence_level_importance_ratios", IGNORED, "GSPO sequence-level ratios are not implemented", OFF),
    _r("loss_fn.use_cispo", IGNORED, "CISPO is not implemented", OFF),
    _r("loss_fn.disable_ppo_ratio", IGNORED, "the PPO ratio is always used", OFF),
    _r("loss_fn.use_kl_in_reward", IGNORED, "KL as a reward term is not implemented (use the KL penalty)", OFF),
    _r("loss_fn.positive_example_nll_weight", IGNORED, "VAPO's positive-example NLL term is not implemented",
       (0, None)),
    _r("grpo.val_period", IMPLEMENTED, "validate every val_period steps; <= 0: never (val_at_start / val_at_end "
       "still apply)"),
    _r("grpo.max_val_samples", IMPLEMENTED, "held-out prompts evaluated (null: all); each gets one greedy answer and "
       "num_val_generations_per_prompt sampled ones"),
    _r("grpo.max_num_epochs", IMPLEMENTED, "the run stops after this many passes over the training prompts, or at "
       "max_num_steps, whichever comes first"),
    _r("grpo.overlong_filtering", IMPLEMENTED, "answers that use all max_new_tokens without an end-of-sequence token "
       "leave the loss and its token count (they keep their place in the group's advantages)"),
    _r("loss_fn.force_on_policy_ratio", IMPLEMENTED, "ratio = pi / stop_grad(pi); needs train_global_batch_size = "
       "the rollout batch"),
    _r("loss_fn.use_on_policy_kl_approximation", IMPLEMENTED, "the KL term weighted by exp(logp - logp_generation),"
       " gradient through logp"),
    # ---------------------------------------------------------------- checkpointing
    _r("checkpointing.keep_top_k", IMPLEMENTED, "the best k by metric_name (newest k when metric_name is null; the "
       "newest checkpoint is never removed; null keeps all)"),
    _r("checkpointing.metric_name", IMPLEMENTED, "train:reward, train:total_reward/mean, train:loss, val:accuracy "
       "(sampled held-out answers, as NeMo-RL validates), val:total_reward/mean; a checkpoint without the metric "
       "ranks last"),
    _r("checkpointing.model_save_format", IGNORED,
       "checkpoints are this project's own per-rank files (resumable); `jetrl export` writes HF safetensors"),
    _r("checkpointing.save_consolidated", IGNORED,
       "checkpoints are per rank; `jetrl export` writes a consolidated HF model directory"),
    _r("checkpointing.save_optimizer", IGNORED, "the optimizer state is always saved (a resume needs it)", (True,)),
    _r("checkpointing.checkpoint_must_save_by", IGNORED,
       "time-limited final save is not implemented; use checkpointing.save_period"),
    # ---------------------------------------------------------------- policy
    _r("policy.precision", IMPLEMENTED, "the trainer's compute dtype: BF16 (FP8 GEMMs come from fp8_cfg)",
       ("bfloat16",)),
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
    _r("policy.logprob_chunk_size", IGNORED, "a memory knob of the logprob pass; same numbers"),
    _r("policy.offload_optimizer_for_logprob", IGNORED, "a memory knob for colocated Ray workers"),
    _r("policy.worker_cls", IGNORED, "the Jet-RL worker for NeMo-RL's driver (read by NeMo-RL with patches/nemo-rl-"
       "v0.7.0-jetrl-worker.patch); the standalone runner is its own loop", (
           "jetrl_megatron.nemo_rl.worker.JetRLMegatronPolicyWorker", None)),
    _r("policy.refit_buffer_size_gb", IMPLEMENTED, "GiB of refit staging per GPU, as in NeMo-RL: with trainer TP x "
       "PP > 1 the peers' weights stream in rounds through one send and one receive buffer (7/16 of it each; 1/8 "
       "checks that what is sent is finite), counted by jetrl plan; unset: 2 GiB (NeMo-RL takes 30% of free "
       "memory); TP x PP = 1 copies in place, no staging. Under NeMo-RL's driver, NeMo-RL's own refit reads it"),
    _r("policy.generation_batch_size", IGNORED, "vLLM schedules the whole rollout batch itself"),
    _r("policy.draft.enabled", IGNORED, "speculative decoding with a draft model is not implemented", OFF),
    _r("policy.draft.**", IGNORED, "draft-model settings; speculative decoding is refused when enabled"),
    _r("policy.router_replay.enabled", IGNORED, _MOE, OFF),
    _r("policy.disable_modelopt_layer_spec", IGNORED, "ModelOpt quantization is not used"),
    _r("policy.quant_cfg", IGNORED, "ModelOpt quantization (e.g. NVFP4) is not implemented", (None,)),
    _r("policy.quant_*", IGNORED, "ModelOpt calibration settings; ModelOpt itself is refused"),
    _r("policy.tokenizer.chat_template_kwargs.**", IMPLEMENTED, "passed to the tokenizer's chat template, which "
       "wraps each math prompt as NeMo-RL's math_hf_data_processor does"),
    _r("policy.max_grad_norm", IMPLEMENTED, "gradient clipping; must equal megatron_cfg.optimizer.clip_grad (NeMo-RL "
       "recipes interpolate one from the other)"),
    _r("policy.make_sequence_length_divisible_by", IMPLEMENTED, "each batch is padded to a length divisible by it "
       "(NeMo-RL's rule without sequence packing; FP8 runs also pad micro-batch tokens to 128)"),
    _r("policy.logprob_batch_size", IMPLEMENTED, "sequences per forward pass of the logprob computation"),
    _r("policy.tokenizer.name", IMPLEMENTED, "the HF tokenizer; presets use the character tokenizer"),
    # policy.megatron_cfg
    _r("policy.megatron_cfg.enabled", IMPLEMENTED, "the Megatron-Core trainer (the only one here)", (True,)),
    _r("policy.megatron_cfg.context_parallel_size", IMPLEMENTED, "context parallelism is not implemented", (1,)),
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
    _r("policy.megatron_cfg.activation_checkpointing", IMPLEMENTED, "full recompute of each decoder layer"),
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
    _r("policy.megatron_cfg.fp8_cfg.fp8", IMPLEMENTED, "E4M3 everywhere (Jet-RL's contract)", ("e4m3",)),
    _r("policy.megatron_cfg.fp8_cfg.fp8_recipe", IMPLEMENTED, "128x128 weight blocks, 1x128 activation and gradient "
       "groups (Jet-RL's contract); served by this project's FP8 linears, not TransformerEngine", ("blockwise",)),
    _r("policy.megatron_cfg.fp8_cfg.fp8_param", IMPLEMENTED, "BF16 master weights with an FP8 copy refreshed once "
       "per optimizer step; FP8 primary weights are not implemented", (False,)),
    _r("policy.megatron_cfg.optimizer.optimizer", IMPLEMENTED, "Adam(W)", ("adam",)),
    _r("policy.megatron_cfg.optimizer.bf16", IMPLEMENTED, "BF16 model, FP32 master weights", (True,)),
    _r("policy.megatron_cfg.optimizer.fp16", IMPLEMENTED, "FP16 training is not supported", (False,)),
    _r("policy.megatron_cfg.optimizer.params_dtype", IMPLEMENTED, "FP32 master weights", ("float32",)),
    _r("policy.megatron_cfg.optimizer.use_precision_aware_optimizer", IGNORED,
       "with NeMo-RL's defaults (FP32 master weights, FP32 Adam moments) Megatron's precision-aware optimizer only "
       "moves where the FP32 state lives; the update is the same as this project's FP32 Adam"),
    _r("policy.megatron_cfg.optimizer.optimizer_cpu_offload", IMPLEMENTED, "Megatron's HybridDeviceOptimizer "
       "inside the distributed optimizer (use_distributed_optimizer: true required): FP32 masters and Adam moments "
       "on the host, updated there by torch's AdamW, the new weights copied back before the FP8 refresh"),
    _r("policy.megatron_cfg.optimizer.optimizer_offload_fraction", IMPLEMENTED, "with optimizer_cpu_offload: the "
       "share of each rank's optimizer state on the host, in (0, 1] (Megatron's meaning); NeMo-RL v0.7.0 accepts "
       "only 1.0, because its worker moves the GPU part to the host around generation; here the GPU part stays "
       "resident, so a split works. No effect without offload"),
    _r("policy.megatron_cfg.optimizer.sgd_momentum", IGNORED, "SGD only; the optimizer is Adam"),
    _r("policy.megatron_cfg.scheduler.weight_decay_incr_style", IMPLEMENTED, "constant weight decay only",
       ("constant",)),
    _r("policy.megatron_cfg.scheduler.override_opt_param_scheduler", IGNORED,
       "the schedule always comes from this config (Megatron's checkpointed schedule is not used)"),
    # policy.generation
    _r("policy.generation.backend", IMPLEMENTED, "vLLM rollouts", ("vllm",)),
    _r("policy.generation.stop_strings", IMPLEMENTED, "stop strings need detokenization inside the engine, which "
       "the rollout skips; use stop_token_ids", (None, [])),
    _r("policy.generation.stop_token_ids", IMPLEMENTED, "extra token ids that end an answer (besides end of "
       "sequence)"),
    _r("policy.generation.colocated.enabled", IMPLEMENTED, "true: vLLM sleeps (frees its KV cache) while the "
       "trainer runs; false: both stay resident (runs sharing a GPU)"),
    _r("policy.generation.ignore_eos", IMPLEMENTED, "true: the end-of-sequence token does not end an answer (every "
       "response runs to max_new_tokens, stop_token_ids still stop it)"),
    _r("policy.generation.vllm_kwargs", IMPLEMENTED, "passed to vllm.LLM(...); kv_cache_memory_bytes sizes the KV "
       "cache (CPU default 64 MiB)"),
    _r("policy.generation.temperature", IMPLEMENTED, "the rollout samples at it and the trainer divides its FP32 "
       "logits by it for every logprob (policy and reference), as vLLM's processed logprobs; 0 = greedy (raw logits)"),
    _r("policy.generation.top_p", IMPLEMENTED, "in (0, 1]: nucleus filter in the rollout and, with vLLM's "
       "semantics, on the trainer's temperature-scaled logits for the policy's logprobs (not the reference's nor the "
       "KL term's); a sampled token the trainer filters out counts with logprob 0 (NeMo-RL)"),
    _r("policy.generation.top_k", IMPLEMENTED, "null or -1 (off) or >= 1: top-k filter in the rollout and on the "
       "trainer's logits, like top_p (logits tied with the k-th are kept)"),
    _r("policy.generation.vllm_kwargs.speculative_config.**", REFUSED, "speculative decoding is not implemented "
       "(the rollout must sample from the policy the trainer optimizes, token by token)", ()),
    _r("policy.generation.vllm_kwargs.quantization", IMPLEMENTED, "jetrl_fp8 selects jetrl in the hosted form "
       "(fp8_cfg.enabled: false, precision: bfloat16), the form NeMo-RL's driver runs; with the standalone form "
       "(true, fp8) it restates it; any other method is refused (the method follows the arm; docs/config.md)",
       ("jetrl_fp8", None)),
    _r("policy.generation.vllm_kwargs.hf_overrides.quantization_config.**", IMPLEMENTED, "the hosted form's recipe "
       "(jet_rl block): must equal the recipe the NeMo-RL keys and policy.jet_rl build, field by field (an error "
       "names both keys); the engine writes its own quantization_config"),
    _r("policy.generation.colocated.resources.**", IGNORED, _RAY),
    _r("policy.generation.port_range_*", IGNORED, _RAY),
    _r("policy.generation.mcore_generation_config.**", IGNORED, _MCORE_GEN),
    _r("policy.generation.quant_cfg", IGNORED, "ModelOpt rollout quantization is not implemented", (None,)),
    _r("policy.generation.real_quant", IGNORED, "ModelOpt rollout quantization settings"),
    _r("policy.generation.vllm_cfg.precision", IMPLEMENTED, "with fp8_cfg.enabled, selects the arm", ("bfloat16",
                                                                                                       "fp8")),
    _r("policy.generation.vllm_cfg.kv_cache_dtype", IMPLEMENTED, "an FP8 KV cache would quantize attention in the "
       "rollout only, a mismatch outside Jet-RL's contract", ("auto",)),
    _r("policy.generation.vllm_cfg.pipeline_parallel_size", IMPLEMENTED, "rollout engines are tensor-parallel only",
       (1,)),
    _r("policy.generation.vllm_cfg.expert_parallel_size", IMPLEMENTED, _MOE, (1,)),
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
    _r("policy.generation.vllm_cfg.env_vars.NRL_*", IGNORED, "NeMo-RL's refit buffer settings; the refit writes in "
       "place"),
    # ---------------------------------------------------------------- data
    _r("data.default.processor", IMPLEMENTED, "math prompts with math-verify rewards (the synthetic tasks have their "
       "own)", ("math_hf_data_processor", None)),
    _r("data.default.env_name", IMPLEMENTED, "the math environment (math-verify)", ("math", None)),
    _r("data.default.system_prompt_file", IMPLEMENTED, "a system message before the problem, in the tokenizer's "
       "chat template (NeMo-RL's math_hf_data_processor)"),
    _r("data.default.dataset_name", IGNORED, "the dataset is named in data.train / data.validation"),
    _r("data.num_workers", IGNORED, "prompts are built in the trainer process"),
    _r("data.use_multiple_dataloader", IGNORED, "one training dataset per run", OFF),
    # ---------------------------------------------------------------- env
    _r("env.math.math_verify_impl", IMPLEMENTED, "math-verify's parse/verify", ("hf_math_verify",)),
    _r("env.dapo.**", IGNORED, "the DAPO environment is used only when data.default.env_name is dapo (refused)"),
    _r("env.should_use_nemo_gym", IGNORED, _GYM, OFF),
    _r("env.should_log_nemo_gym_responses", IGNORED, _GYM),
    _r("env.nemo_gym.**", IGNORED, _GYM),
    # ---------------------------------------------------------------- logger
    _r("logger.wandb.**", IMPLEMENTED, "passed to wandb.init (offline mode; `wandb sync` uploads)"),
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


def _dataclass_of(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return next((a for a in args if dataclasses.is_dataclass(a)), None)


def schema_status(root: Any, key: str) -> str | None:
    """``implemented`` when ``key`` is a field of the schema rooted at dataclass ``root`` (or inside one of its
    free mappings), ``section`` when it names a whole section, None when the schema has no such key."""
    tp: Any = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        dc = _dataclass_of(tp)
        if dc is None:
            return None
        hints = typing.get_type_hints(dc)
        if part not in hints:
            return None
        tp = hints[part]
        if _free_mapping(tp):
            return IMPLEMENTED
        if i == len(parts) - 1:
            return "section" if _dataclass_of(tp) is not None else IMPLEMENTED
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
