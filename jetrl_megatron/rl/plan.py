"""`jetrl plan`: validate a recipe on CPU before spending GPU hours.

Prints the resolved config, the parallel layout (trainer TP x PP x DP and the colocated vLLM engines, one per rollout-TP
group of GPUs), the resharder preflight (every projection whose shard boundary would cut a 128 block or a head), and a
per-GPU memory estimate for the two colocated phases. The estimate is arithmetic from the model shape, not a
measurement; its formulas are in :func:`memory_estimate` so a reader can check them.
"""

from __future__ import annotations

from dataclasses import dataclass

from jetrl_megatron.rl.config import RunConfig, to_yaml

GiB = 1024**3


def model_shape(cfg: RunConfig):
    from jetrl_megatron.megatron.models import get_model_shape

    return get_model_shape(cfg.policy.model_preset or cfg.policy.model_name)


@dataclass
class Layout:
    world: int
    tp: int
    pp: int
    dp: int
    rollout_tp: int
    engines: int
    micro_batches_per_step: int

    def describe(self) -> list[str]:
        lines = [
            f"world size {self.world}: trainer TP{self.tp} x PP{self.pp} x DP{self.dp} (Megatron-Core)",
            f"rollout: {self.engines} vLLM engine(s) x TP{self.rollout_tp}, colocated (one per rollout-TP group of "
            "ranks; vLLM frees its KV cache while the trainer runs, weights are refit in place each step)",
            f"micro-batches per DP rank per optimizer step: {self.micro_batches_per_step}",
            "refit each step: every rank receives, over its model-parallel group (point-to-point), only the Megatron "
            f"TP{self.tp} x PP{self.pp} tensors its vLLM TP{self.rollout_tp} slice copies from, then a compiled "
            "copy program writes them into the engine's live parameters (FP8 bytes + scales unchanged in jetrl)",
        ]
        show = min(self.world, 16)
        for r in range(show):
            tp_rank = r % self.tp
            dp_rank = (r // self.tp) % self.dp  # Megatron-Core's default rank order: tp fastest, then dp, then pp
            pp_rank = r // (self.tp * self.dp)
            eng, eng_rank = divmod(r, self.rollout_tp)
            lines.append(f"  rank {r:3d}: train tp{tp_rank} pp{pp_rank} dp{dp_rank} | "
                         f"vLLM engine {eng} tp-rank {eng_rank}")
        if self.world > show:
            lines.append(f"  ... ({self.world - show} more ranks, same pattern)")
        return lines


def parallel_layout(cfg: RunConfig) -> Layout:
    mc = cfg.policy.megatron_cfg
    tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
    world = cfg.world_size if cfg.is_gpu else tp * pp
    dp = max(1, world // (tp * pp))
    rtp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    gbs, mbs = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    if gbs % (mbs * dp):
        raise ValueError(f"policy.train_global_batch_size {gbs} is not a multiple of train_micro_batch_size {mbs} x "
                         f"DP {dp}")
    return Layout(world, tp, pp, dp, rtp, max(1, world // rtp), gbs // (mbs * dp))


def _param_counts(shape) -> dict[str, int]:
    h, f, v = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    linear_per_layer = h * (q + 2 * kv) + q * h + h * 2 * f + f * h
    other_per_layer = 2 * h + (2 * shape.head_dim if shape.qk_norm else 0) + ((q + 2 * kv) if shape.qkv_bias else 0)
    embed = v * h
    head = 0 if shape.tie_word_embeddings else v * h
    return {"linear_per_layer": linear_per_layer, "other_per_layer": other_per_layer, "embed": embed, "head": head,
            "final_norm": h}


def memory_estimate(cfg: RunConfig, shape, layout: Layout, gpu_mem_gib: float = 80.0) -> dict[str, float]:
    """Per-GPU GiB for the busiest pipeline stage. Assumptions (stated so they can be argued with):

    - BF16 model weights (2 B/param); the jetrl arm adds its per-step FP8 copy of every FP8 linear (1 B/param +
      FP32 scale per 128x128 block); gradients in BF16 grad buffers (2 B/param; Megatron DDP with
      grad_reduce_in_fp32 off, NeMo-RL's default);
    - Adam: FP32 master + 2 moments = 12 B/param, divided by DP under the distributed optimizer;
    - activations of one micro-batch (S = max_total_sequence_length tokens x micro-batch): without recompute
      34 x S x h bytes per layer / TP (flash attention, no S^2 term; Korthikanti et al.), the jetrl arm saving its
      linear inputs in FP8 instead of BF16 (-(2h + q + f) bytes per token per layer / TP); with full activation
      checkpointing 2 x S x h per layer plus one layer's full set; plus FP32 logits S x vocab / TP x 4 bytes;
    - KV cache: vLLM may use gpu_memory_utilization of the GPU for its weights + KV (colocated; freed while training);
      the batch needs 2 x layers x kv_heads/rollout_TP x head_dim x 2 B per token for all sequences of one engine.
    """
    pc = _param_counts(shape)
    tp, pp = layout.tp, layout.pp
    layers_per_stage = shape.num_layers // pp
    stage_extra = max(pc["embed"] + (pc["head"] if pp == 1 else 0) + pc["final_norm"] * (pp == 1),
                      pc["head"] + pc["final_norm"] if pp > 1 else 0)
    lin = layers_per_stage * pc["linear_per_layer"] / tp
    params = lin + layers_per_stage * pc["other_per_layer"] + stage_extra / tp
    fp8_train = cfg.mode == "jetrl"
    mbs, seq = cfg.policy.train_micro_batch_size, cfg.policy.max_total_sequence_length
    tokens = mbs * seq
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q = shape.num_attention_heads * shape.head_dim
    full_layer = 34 * tokens * h / tp - (tokens * (2 * h + q + f) / tp if fp8_train else 0)
    if cfg.policy.megatron_cfg.activation_checkpointing:
        acts = layers_per_stage * 2 * tokens * h + full_layer
    else:
        acts = layers_per_stage * full_layer
    acts += tokens * shape.vocab_size / tp * 4
    dist = cfg.policy.megatron_cfg.optimizer.use_distributed_optimizer
    out = {
        "weights_bf16": 2 * params,
        "fp8_weight_copies": (lin * (1 + 4 / (128 * 128))) if fp8_train else 0.0,
        "grads_bf16": 2 * params,
        "optimizer_adam": 12 * params / (layout.dp if dist else 1),
        "activations": acts,
    }
    out = {k: v / GiB for k, v in out.items()}
    out["train_phase_total"] = sum(out.values())
    # Rollout phase: the trainer's weights, FP8 copies and optimizer stay resident; grads/activations are freed.
    rtp = layout.rollout_tp
    kv_heads_rank = max(1, shape.num_kv_heads // rtp)
    kv_per_token = 2 * shape.num_layers * kv_heads_rank * shape.head_dim * 2
    seqs_per_engine = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt / layout.engines
    out["kv_cache_full_batch"] = kv_per_token * seqs_per_engine * cfg.policy.generation.vllm_cfg.max_model_len / GiB
    vllm_budget = cfg.policy.generation.vllm_cfg.gpu_memory_utilization * gpu_mem_gib
    rollout_w = (pc["linear_per_layer"] * shape.num_layers * (1 if cfg.mode != "bf16" else 2)
                 + 2 * (pc["embed"] + pc["head"])) / rtp / GiB
    out["vllm_weights"] = rollout_w
    out["kv_cache_budget"] = max(0.0, vllm_budget - rollout_w)
    resident = out["weights_bf16"] + out["fp8_weight_copies"] + out["optimizer_adam"]
    out["rollout_phase_total"] = resident + vllm_budget
    return out


def plan_report(cfg: RunConfig, gpu_mem_gib: float = 80.0, show_config: bool = True) -> tuple[str, bool]:
    """The text `jetrl plan` prints and whether the recipe passed (resharder preflight and memory)."""
    from jetrl_megatron.reshard.preflight import check_reshard

    shape = model_shape(cfg)
    layout = parallel_layout(cfg)
    lines: list[str] = []
    if show_config:
        lines += [f"# resolved config: {cfg.name} (jet_rl.mode = {cfg.mode})", to_yaml(cfg).rstrip(), ""]
    lines.append(f"# model: {shape.name} ({shape.family}; hidden {shape.hidden_size}, {shape.num_layers} layers, "
                 f"{shape.num_attention_heads} heads / {shape.num_kv_heads} KV, ffn {shape.ffn_hidden_size}, "
                 f"vocab {shape.vocab_size})")
    lines.append("# parallel layout" + ("" if cfg.is_gpu else " (CPU run: gloo processes instead of GPUs)"))
    lines += layout.describe()
    ok = True
    viol = check_reshard(shape, layout.tp, layout.pp, layout.rollout_tp)
    lines.append(f"# resharder preflight: Megatron TP{layout.tp} x PP{layout.pp} -> vLLM TP{layout.rollout_tp}")
    if viol:
        ok = False
        lines += [f"  REFUSED {v}" for v in viol]
    else:
        lines.append("  ok: every FP8 shard holds whole 128x128 blocks and whole heads on both sides")
    mem = memory_estimate(cfg, shape, layout, gpu_mem_gib)
    unit = "GPU" if cfg.is_gpu else "process (CPU RAM)"
    lines.append(f"# memory estimate per {unit}, GiB (busiest pipeline stage; assumptions in rl/plan.py)")
    for k, v in mem.items():
        lines.append(f"  {k:22s} {v:10.3f}")
    if cfg.is_gpu:
        peak = max(mem["train_phase_total"], mem["rollout_phase_total"])
        verdict = "fits" if peak <= gpu_mem_gib else "DOES NOT FIT"
        lines.append(f"  peak {peak:.1f} GiB of {gpu_mem_gib:.0f} GiB: {verdict}")
        if mem["kv_cache_full_batch"] > mem["kv_cache_budget"]:
            lines.append("  note: the full rollout batch needs more KV than the budget; vLLM will schedule it in waves")
        ok = ok and peak <= gpu_mem_gib
    return "\n".join(lines), ok
