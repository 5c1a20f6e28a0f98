"""`jetrl plan`: validate a recipe on CPU before spending GPU hours.

Prints the resolved config, the parallel layout (trainer TP x PP x DP and the colocated vLLM engines, one per rollout-TP
group of GPUs), the resharder preflight (every projection whose shard boundary would cut a 128 block or a head), and a
per-GPU memory estimate for each phase of a GRPO step (logprob, update, refit, rollout). The estimate is arithmetic
from the model shape and the code paths a step runs, not a measurement; its formulas are in :func:`memory_estimate`
and :mod:`jetrl_megatron.rl.tools.plan_terms` so a reader can check them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from jetrl_megatron.megatron.optimizer_settings import OptimizerSettings
from jetrl_megatron.model.hub import HubLookupError, is_hub_id, snapshot
from jetrl_megatron.model.shapes import get_model_shape, preset_names
from jetrl_megatron.rl.config import ConfigError, RunConfig, to_yaml
from jetrl_megatron.rl.config.nemo_rl_keys import IGNORED, IMPLEMENTED
from jetrl_megatron.rollout import kv_waves

if TYPE_CHECKING:
    from jetrl_megatron.reshard.exchange import ExchangeBytes

GiB = 1024**3


def model_shape(cfg: RunConfig):
    """The model's shape from ``policy.jet_rl.model_preset``, else ``policy.model_name``: a preset, a local HF
    directory / config.json, or a hub id whose ``config.json`` is read from the Hugging Face cache (``cfg.hub``;
    downloaded only when online and not cached, as transformers would)."""
    name = cfg.model_preset or cfg.policy.model_name
    try:
        return get_model_shape(name)
    except ValueError as e:
        if not is_hub_id(name):
            raise ConfigError(f"policy.model_name: {e}; set policy.jet_rl.model_preset=<preset> or point "
                              "policy.model_name at a local HF model directory or a hub id") from None
    try:
        folder = snapshot(name, cfg.hub, key="policy.model_name")
    except HubLookupError as e:  # the plan needs only the architecture: a preset stands in for config.json
        raise HubLookupError(f"{e}; to plan without it, name its architecture: policy.jet_rl.model_preset=<one of "
                             f"{', '.join(preset_names())}>") from None
    try:
        return get_model_shape(folder).with_name(name)
    except ValueError as e:
        raise ConfigError(f"policy.model_name: {name!r} ({folder / 'config.json'}): {e}") from None


@dataclass(frozen=True)
class TrainerSettings:
    """How the trainer's DDP wrapper and optimizer are built: the config's optimizer settings (the object Megatron's
    optimizer is built from) and what is not a recipe key. ``build_trainer`` builds them from this object and
    :func:`memory_estimate` reads the same object, so the plan cannot assume a setting the trainer does not use."""

    optimizer: OptimizerSettings
    grad_reduce_in_fp32: bool
    use_precision_aware_optimizer: bool = False
    # The GRPO loop frees the DDP grad buffers after each update and re-allocates them (zeroed) before the next
    # (megatron/grad_buffers.py). Not a recipe key: NeMo-RL's Megatron worker frees them unconditionally too.
    release_grad_buffers: bool = True

    @property
    def use_distributed_optimizer(self) -> bool:
        return self.optimizer.use_distributed_optimizer

    @property
    def host_fraction(self) -> float:
        """The share of the optimizer state (and its FP32 gradient copies) held on the host."""
        return self.optimizer.host_fraction

    def policy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``megatron.policy.build_policy`` (DDP and optimizer settings)."""
        optimizer = {**asdict(self.optimizer), "use_precision_aware_optimizer": self.use_precision_aware_optimizer}
        return {"grad_reduce_in_fp32": self.grad_reduce_in_fp32,
                "use_distributed_optimizer": self.use_distributed_optimizer, "optimizer": optimizer}

    def describe(self, dp: int) -> str:
        """One line for `jetrl plan`: which optimizer layout the memory estimate assumed, and the keys behind it."""
        if self.use_distributed_optimizer:
            how = f"Megatron distributed optimizer: FP32 master + Adam moments sharded over DP={dp}"
        else:
            how = "Megatron Float16 optimizer: FP32 master + Adam moments replicated on every DP rank"
        if self.optimizer.optimizer_cpu_offload:
            how += (f"; {self.optimizer.optimizer_offload_fraction:g} of it on the host, stepped there by Megatron's "
                    "HybridDeviceOptimizer (optimizer_cpu_offload=true)")
        return (f"{how} (policy.megatron_cfg.optimizer.use_distributed_optimizer="
                f"{str(self.use_distributed_optimizer).lower()}, use_precision_aware_optimizer="
                f"{str(self.use_precision_aware_optimizer).lower()}); "
                f"grads reduced in {'FP32' if self.grad_reduce_in_fp32 else 'BF16'}")

    def describe_grad_buffers(self) -> str:
        """One line for `jetrl plan`: what the DDP grad buffers hold in which phase."""
        dtype, nbytes = ("FP32", 4) if self.grad_reduce_in_fp32 else ("BF16", 2)
        when = ("held in the train phase only: freed after each update, re-allocated zeroed before the next (not "
                "during the logprob pass, refit or rollout)" if self.release_grad_buffers else "held in all phases")
        return (f"{dtype} ({nbytes} B/param, grad_reduce_in_fp32={str(self.grad_reduce_in_fp32).lower()}), this "
                f"rank's whole shard (not divided by DP); {when}")


def trainer_settings(cfg: RunConfig) -> TrainerSettings:
    """The trainer's DDP/optimizer settings: ``policy.megatron_cfg.optimizer`` as loaded, and the fixed choices."""
    # use_precision_aware_optimizer is accepted without effect (rl/config/nemo_rl_keys.py): with NeMo-RL's FP32 master
    # weights and moments it only moves where that state lives, and it needs TransformerEngine's FusedAdam.
    # grad_reduce_in_fp32 off: BF16 grad buffers, NeMo-RL's default (distributed_data_parallel_config)
    return TrainerSettings(optimizer=cfg.policy.megatron_cfg.optimizer, grad_reduce_in_fp32=False,
                           use_precision_aware_optimizer=False)


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
    """The trainer and rollout layout of ``cfg`` (a batch that does not split over DP is a ConfigError naming the key,
    not a traceback)."""
    mc = cfg.policy.megatron_cfg
    tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
    world = cfg.world_size if cfg.is_gpu else tp * pp
    dp = max(1, world // (tp * pp))
    rtp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    gbs, mbs = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    if gbs % (mbs * dp):
        raise ConfigError(f"policy.train_global_batch_size: {gbs} is not a multiple of train_micro_batch_size {mbs} "
                          f"x DP {dp} (world {world} / TP{tp} x PP{pp})")
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


@lru_cache(maxsize=32)
def _busiest_refit_rank(shape, tp: int, pp: int, dp: int, rollout_tp: int,
                        recipe, budget: int) -> tuple[int, ExchangeBytes] | None:
    from jetrl_megatron.reshard.exchange import refit_buffer_bytes
    from jetrl_megatron.reshard.preflight import check_reshard, fp8_projections

    if check_reshard(shape, tp, pp, rollout_tp, None, *fp8_projections(shape, recipe)):
        return None  # no refit program exists for this layout (the plan reports the refusal)
    per_rank = refit_buffer_bytes(shape, tp, pp, dp, rollout_tp, recipe, budget)
    return max(per_rank.items(), key=lambda kv: (kv[1].buffers, -kv[0]))


def refit_buffers(cfg: RunConfig, shape, layout: Layout) -> tuple[int, ExchangeBytes] | None:
    """(global rank, `reshard.exchange.ExchangeBytes`) of the rank whose refit exchange buffers are largest; None
    when the resharder refuses the layout.

    The bytes come from the functions `RefitExchange` allocates its staging buffers with (`reshard.exchange`), run
    over the tensor lists this recipe's trainer ranks hold and ``policy.refit_buffer_size_gb``, so the plan counts
    what the loop keeps.
    """
    from jetrl_megatron.reshard.exchange import budget_bytes

    return _busiest_refit_rank(shape, layout.tp, layout.pp, layout.dp, layout.rollout_tp, cfg.recipe,
                               budget_bytes(cfg.policy.refit_buffer_size_gb))


def describe_refit_buffers(cfg: RunConfig, shape, layout: Layout) -> str:
    """One line for `jetrl plan`: what the ``refit_buffers`` line holds and when."""
    if layout.tp * layout.pp == 1:
        return "none: trainer TP x PP = 1, the engine's refit program reads the trainer's tensors in place"
    busiest = refit_buffers(cfg, shape, layout)
    if busiest is None:
        return "not counted: the resharder refuses this layout"
    from jetrl_megatron.reshard.exchange import budget_bytes, finite_chunk
    from jetrl_megatron.reshard.plan import _fmt_bytes

    rank, b = busiest
    budget = budget_bytes(cfg.policy.refit_buffer_size_gb)
    return (f"the model-parallel refit exchange's two staging buffers (policy.refit_buffer_size_gb), allocated at "
            f"the first refit and held in every phase after it (the engine's compiled refit program is built on "
            f"their addresses); busiest rank {rank}: {_fmt_bytes(b.recv)} receive + {_fmt_bytes(b.send)} send, "
            f"streaming {_fmt_bytes(b.received)} from its peers in {b.rounds} round(s), plus at most "
            f"{_fmt_bytes(2 * finite_chunk(budget))} of scratch while it checks that what it sends is finite, within "
            f"the {_fmt_bytes(budget)} budget (the tensors its own vLLM rank copies from it, {_fmt_bytes(b.own)}, "
            f"are read in place)")


def kv_waves_line(cfg: RunConfig, shape, layout: Layout, kv_budget_gib: float) -> str:
    """What a KV budget below the rollout batch means: the engine runs what the cache holds whole at once (the waves
    of rollout/kv_waves.py; vLLM never preempts), so the rollout takes that many passes."""
    rtp = layout.rollout_tp
    seqs = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt // layout.engines
    tokens = cfg.rollout_sequence_tokens()
    whole = kv_waves.sequences_without_preemption(int(kv_budget_gib * GiB), shape, rtp, tokens)
    if whole <= 0:
        return (f"the KV budget ({kv_budget_gib:.1f} GiB) holds no sequence of {tokens} tokens: vLLM will refuse to "
                "start")
    passes = -(-seqs // whole)
    return (f"the KV budget ({kv_budget_gib:.1f} GiB) holds {whole} of the {seqs} sequences per engine at {tokens} "
            f"tokens: the rollout runs them {whole} at a time (~{passes} passes; never preempted, which would cost "
            "exactness); more vllm_kwargs.kv_cache_memory_bytes runs it in one")


def memory_estimate(cfg: RunConfig, shape, layout: Layout, gpu_mem_gib: float = 80.0) -> dict[str, float]:
    """Per-GPU GiB for the busiest pipeline stage in a steady GRPO step (the second on: every buffer the first update
    creates exists), per phase: ``logprob_phase_total``, ``train_phase_total`` (the update), ``refit_phase_total``
    and ``rollout_phase_total``. Assumptions (stated so they can be argued with); the terms that follow from a
    particular code path are derived in :mod:`jetrl_megatron.rl.tools.plan_terms`.

    The optimizer and DDP settings are :func:`trainer_settings` of ``cfg`` — the object ``build_trainer`` builds
    the trainer from.

    - BF16 model weights (2 B/param); the jetrl arm adds its per-step FP8 copy of every FP8 linear (1 B/param +
      FP32 scale per 128x128 block) and, in the update only, DGrad's cached K-major copies of them
      (``dgrad_weight_transposes``, the same size, made by its first backward, dropped by the refresh); gradients
      in the DDP grad buffers (2 B/param in BF16, 4 with grad_reduce_in_fp32; full-size under the distributed
      optimizer too), held in the train phase only when
      ``release_grad_buffers`` (the loop frees them after each update: megatron/grad_buffers.py);
    - Adam: FP32 master + 2 moments = 12 B/param, divided by DP under the distributed optimizer;
    - FP32 copies of the gradients (4 B/param, /DP distributed): Megatron's distributed optimizer makes them in the
      step and the optimizer wrapper frees them after it (train phase only, max(activations, main_grads_fp32)). Under
      CPU offload Megatron's HybridDeviceOptimizer sets the (1 - f) share on the FP32 masters of its GPU part, which
      no ``zero_grad`` reaches; the wrapper frees those after the step too (megatron/optim.py), so the same holds;
    - CPU offload (``optimizer_cpu_offload``, share f = ``optimizer_offload_fraction``): the GPU keeps (1 - f) of the
      Adam state and of the FP32 gradient copies; the host holds f x 12 B/param (/DP) of FP32 masters + moments and
      f x 4 B/param (/DP) of pinned FP32 gradient copies, allocated at the first step and kept (Megatron's
      HybridDeviceOptimizer). Host memory per node also counts each colocated vLLM engine's weights, which its
      level-1 sleep copies to the host while the trainer runs, times the GPUs of the node (not counted: the
      processes' own memory, CUDA contexts and libraries; leave headroom for them);
    - the update's micro-batch (S = max_total_sequence_length tokens x train_micro_batch_size): with full activation
      checkpointing each layer's input in the residual stream's dtype (``checkpointed_inputs``) plus the larger of one
      recomputed layer's full set (34 x S x h bytes / TP, flash attention, Korthikanti et al.; the jetrl arm saving its
      linear inputs in FP8: -(2h + q + f) B per token / TP) and the logits' backward peak (``update_logits``: 16 B
      per token and vocab entry with GPU vLLM's logprob kernels, 4 B plus one chunk's 16 with
      ``policy.logprob_chunk_size``); without checkpointing every layer's full set plus
      the logits' peak; the optimizer step adds one parameter's FP32 copy at a time (``optimizer_step_scratch``), and
      the jetrl arm's cache refresh after it a second FP8 copy (``fp8_refresh_transient``);
    - the reference policy (``loss_fn.reference_policy_kl_penalty`` > 0; ``rl/trainer.py make_reference``): a frozen
      copy of the model, its BF16 weights and, in the FP8-training arms, its own FP8 cache (no gradients, no
      optimizer state, no DGrad copies: it runs forward only). With ``policy.jet_rl.reference_on_host`` (default) its
      weights wait in host memory (2 B/param per rank) and are on the GPU, with the FP8 cache made from them, only
      during its logprob pass; otherwise on the GPU in every phase. Its pass runs after the policy's, so its logits
      add nothing to that phase's peak;
    - the logprob pass (forward only, no autograd graph): one logprob_batch_size micro-batch's logits
      (``logprob_logits``), the largest transient next to the resident state;
    - refit exchange buffers (trainer TP x PP > 1): the busiest rank's send + receive staging buffers, exactly as
      `RefitExchange` allocates them (:func:`refit_buffers`; at most ``policy.refit_buffer_size_gb``, 2 GiB unset);
      allocated at the first refit, before the first step, and held in every phase; the self-quantizing arms' BF16
      scratch of the engine's FP8 weights that a trainer peer's slabs stream into (``refit_quantize_scratch``)
      likewise, and in the refit phase the scratch of the largest weight quantized on its own
      (``refit_quantize_one_weight``);
    - KV cache: vLLM may use gpu_memory_utilization of the GPU for its weights + KV (colocated; freed while training),
      or exactly vllm_kwargs.kv_cache_memory_bytes of KV plus its weights when that key is set;
      the batch needs 2 x layers x kv_heads/rollout_TP x head_dim x 2 B per token for all sequences of one engine;
    - an engine that does not sleep (``policy.generation.colocated.enabled: false``: several runs sharing one GPU, whose
      free memory vLLM's sleep mode checks) holds its weights + KV budget in the logprob and train phases too
      (``engine_in_trainer_phases``);
    - refit and rollout phases: the engine awake (its weights + KV budget) next to the trainer's resident state; the
      loop returns torch's cached blocks after the update (colocated), the refit and at the engine's sleep
      (``release_cached_gpu_memory``), so none are counted (a phase's own fragmentation is not: the run's
      ``memory/gpu_torch_cached_gib_<phase>``).
    Not counted (measure them: the run's ``memory/gpu_outside_torch_gib_<phase>``): the CUDA context, vLLM's buffers
    outside its sleep pool (CUDA-graph pool, persistent inputs) and the engine's own activations and sampler.
    """
    from jetrl_megatron.rl.tools import plan_terms

    pc = _param_counts(shape)
    tp, pp = layout.tp, layout.pp
    layers_per_stage = shape.num_layers // pp
    stage_extra = max(pc["embed"] + (pc["head"] if pp == 1 else 0) + pc["final_norm"] * (pp == 1),
                      pc["head"] + pc["final_norm"] if pp > 1 else 0)
    lin = layers_per_stage * pc["linear_per_layer"] / tp
    params = lin + layers_per_stage * pc["other_per_layer"] + stage_extra / tp
    fp8_train = cfg.recipe.trains_fp8
    mbs, seq = cfg.policy.train_micro_batch_size, cfg.policy.max_total_sequence_length
    tokens = mbs * seq
    h, f, vocab = shape.hidden_size, shape.ffn_hidden_size, shape.vocab_size
    q = shape.num_attention_heads * shape.head_dim
    # the logits are the last stage's; at PP > 1 they are added to the busiest stage's state, which may be the first
    # (embedding) stage: an overestimate by at most the logits there
    last_stage = True
    full_layer = 34 * tokens * h / tp - (tokens * (2 * h + q + f) / tp if fp8_train else 0)
    update_logits = plan_terms.update_logits_bytes(cfg, mbs, seq, vocab, tp) if last_stage else 0
    if cfg.policy.megatron_cfg.activation_checkpointing:
        ckpt = plan_terms.checkpointed_inputs_bytes(cfg, tokens, h, layers_per_stage, tp)
        acts = ckpt + max(full_layer, update_logits)
    else:
        ckpt, acts = 0, layers_per_stage * full_layer + update_logits
    rows_per_rank = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt // layout.dp
    lp_rows = math.gcd(cfg.policy.logprob_batch_size, max(1, rows_per_rank))  # rl/trainer.py trainer_logprobs
    settings = trainer_settings(cfg)
    shard = layout.dp if settings.use_distributed_optimizer else 1
    rtp = layout.rollout_tp
    fp8_lin_engine = pc["linear_per_layer"] * shape.num_layers / rtp if cfg.recipe.rollout_fp8 else 0.0
    kv_width = shape.num_kv_heads * shape.head_dim
    largest_fp8_engine = (max(2 * f * h, (q + 2 * kv_width) * h, q * h, f * h) / rtp) if cfg.recipe.rollout_fp8 \
        else 0.0
    streamed = plan_terms.streamed_scratch_fraction(tp, pp, rtp)
    out = {
        "weights_bf16": 2 * params,
        "fp8_weight_copies": (lin * (1 + 4 / (128 * 128))) if fp8_train else 0.0,
        "dgrad_weight_transposes": plan_terms.dgrad_weight_transposes_bytes(lin) if fp8_train else 0.0,
        "grad_buffers": (4 if settings.grad_reduce_in_fp32 else 2) * params,
        "optimizer_adam": 12 * params / shard * (1 - settings.host_fraction),
        "main_grads_fp32": 4 * params / shard * (1 - settings.host_fraction),
        "optimizer_step_scratch": plan_terms.optimizer_step_scratch_bytes(max(pc["embed"], pc["head"]) / tp, shard),
        "fp8_refresh_transient": plan_terms.fp8_refresh_transient_bytes(lin) if fp8_train else 0.0,
        "checkpointed_inputs": ckpt,
        "update_logits": update_logits,
        "activations": acts,
        "logprob_logits": plan_terms.logprob_logits_bytes(cfg, lp_rows, seq, vocab, tp) if last_stage else 0,
        "refit_buffers": busiest[1].buffers if (busiest := refit_buffers(cfg, shape, layout)) else 0,
        "refit_quantize_scratch": plan_terms.refit_quantize_scratch_bytes(cfg, fp8_lin_engine, streamed),
        "refit_quantize_one_weight": plan_terms.refit_quantize_one_weight_bytes(cfg, largest_fp8_engine, streamed),
    }
    with_reference = cfg.loss_fn.reference_policy_kl_penalty > 0
    ref_on_host = with_reference and cfg.policy.jet_rl.reference_on_host
    out["reference_model"] = out["weights_bf16"] + out["fp8_weight_copies"] if with_reference else 0.0
    out = {k: v / GiB for k, v in out.items()}
    # held in every phase of a steady step (the grad buffers too when the loop keeps them)
    resident = (out["weights_bf16"] + out["fp8_weight_copies"] + out["optimizer_adam"] + out["refit_buffers"]
                + out["refit_quantize_scratch"] + (0.0 if ref_on_host else out["reference_model"]))
    if not settings.release_grad_buffers:
        resident += out["grad_buffers"]
    out["resident_all_phases"] = resident
    out["logprob_phase_total"] = resident + out["logprob_logits"] + (out["reference_model"] if ref_on_host else 0.0)
    # the step, then the FP8 cache refresh after it (one at a time, both after the activations are gone)
    step_extra = max(out["optimizer_step_scratch"] + out["main_grads_fp32"], out["fp8_refresh_transient"])
    out["train_phase_total"] = (resident + (out["grad_buffers"] if settings.release_grad_buffers else 0.0)
                                + out["dgrad_weight_transposes"] + max(out["activations"], step_extra))
    kv_per_token = kv_waves.kv_bytes_per_token(shape, rtp)
    seqs_per_engine = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt / layout.engines
    out["kv_cache_full_batch"] = kv_per_token * seqs_per_engine * cfg.policy.generation.vllm_cfg.max_model_len / GiB
    rollout_w = (pc["linear_per_layer"] * shape.num_layers * (1 if cfg.recipe.rollout_fp8 else 2)
                 + 2 * (pc["embed"] + pc["head"])) / rtp / GiB
    out["vllm_weights"] = rollout_w
    kv_bytes = cfg.kv_cache_memory_bytes()
    if kv_bytes is not None:  # the engine sizes its KV cache from this key on CUDA too (rl/generation.py start_engine)
        out["kv_cache_budget"] = kv_bytes / GiB
        vllm_budget = rollout_w + out["kv_cache_budget"]
    else:
        vllm_budget = cfg.policy.generation.vllm_cfg.gpu_memory_utilization * gpu_mem_gib
        out["kv_cache_budget"] = max(0.0, vllm_budget - rollout_w)
    # the refit runs with the engine awake (wake_up first); its copies go straight into the live parameters
    out["refit_phase_total"] = resident + vllm_budget + out["refit_quantize_one_weight"]
    out["rollout_phase_total"] = resident + vllm_budget
    # an engine that never sleeps (policy.generation.colocated.enabled=false: rl/loop.py TrainPhase) keeps its weights
    # and KV cache next to the trainer's logprob pass and update too
    out["engine_in_trainer_phases"] = 0.0 if cfg.policy.generation.colocated.enabled else vllm_budget
    out["logprob_phase_total"] += out["engine_in_trainer_phases"]
    out["train_phase_total"] += out["engine_in_trainer_phases"]
    # host memory (per rank, then per node): the offloaded optimizer share, the pinned BF16 copy Megatron's hybrid
    # optimizer makes of each offloaded parameter on its way to the FP32 master (freed, but kept by torch's pinned
    # host allocator: Qwen3-8B at 0.75 measured 115.2 GiB RSS against 100.3 without it), vLLM's sleep backup
    out["host_optimizer"] = 12 * params / shard * settings.host_fraction / GiB
    out["host_grads_fp32"] = 4 * params / shard * settings.host_fraction / GiB
    out["host_pinned_staging"] = 2 * params / shard * settings.host_fraction / GiB
    # vLLM's level-1 sleep backs its weights up on the host; level 2 discards them (the refit rewrites them)
    out["host_vllm_sleep"] = (rollout_w if cfg.policy.generation.colocated.enabled
                              and cfg.policy.jet_rl.engine_sleep_level == 1 else 0.0)
    out["host_reference"] = out["weights_bf16"] if ref_on_host else 0.0
    per_node = per_node_processes(cfg, layout)
    out["host_per_node"] = per_node * (out["host_optimizer"] + out["host_grads_fp32"] + out["host_pinned_staging"]
                                       + out["host_vllm_sleep"] + out["host_reference"])
    return out


# in the order a GRPO step runs them (rl/loop.py grpo_step): a tie names the earlier phase
PHASE_TOTALS = ("rollout_phase_total", "logprob_phase_total", "train_phase_total", "refit_phase_total")


def gpu_peak(mem: dict[str, float]) -> float:
    """The largest per-phase total of :func:`memory_estimate` (what must fit the GPU)."""
    return max(mem[k] for k in PHASE_TOTALS)


def key_accounting(cfg: RunConfig) -> list[str]:
    """Which keys the recipe set (implemented / ignored), and which the schema filled in with its defaults."""
    set_keys = [v for v in cfg.key_report if v.status == IMPLEMENTED]
    ignored = [v for v in cfg.key_report if v.status == IGNORED]
    lines = [f"# keys (docs/nemo_rl_keys.md): {len(set_keys)} set and implemented, {len(cfg.defaulted)} defaulted, "
             f"{len(ignored)} ignored (no effect here), 0 refused"]
    if cfg.defaulted:
        lines.append("  defaulted: " + ", ".join(cfg.defaulted))
    lines += [f"  ignored: {v.key} = {v.value!r}: {v.note}" for v in ignored]
    return [*lines, ""]


DEFAULT_GPU_MEM_GIB = 80.0  # an H100-80GB, what a plan assumes with no GPU named and none on this machine


@dataclass(frozen=True)
class PlanMachine:
    """The machine a plan is checked against: one GPU's memory, host memory per node (None: unchecked), and where
    each came from (one line for the report)."""

    gpu_mem_gib: float
    host_mem_gib: float | None
    source: str


def local_gpu_mem_gib() -> float | None:
    """Total memory of this machine's first visible GPU, GiB (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / float(1 << 30)


def plan_machine(cfg: RunConfig, gpu_mem_gib: float | None = None, host_mem_gib: float | None = None,
                 local_gpu_gib: Callable[[], float | None] = local_gpu_mem_gib) -> PlanMachine:
    """Which memory sizes a plan checks: the command line's (--gpu-mem-gib / --host-mem-gib), else the recipe's
    ``policy.jet_rl.plan_gpu_mem_gib`` / ``plan_host_mem_gib``, else for the GPU this machine's (``local_gpu_gib()``,
    asked only then), else 80 GiB; the host stays unchecked unless named."""
    jr = cfg.policy.jet_rl
    for flag, value in (("--gpu-mem-gib", gpu_mem_gib), ("--host-mem-gib", host_mem_gib)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag}: must be > 0, got {value:g}")
    if gpu_mem_gib is not None:
        gpu, gpu_from = gpu_mem_gib, "--gpu-mem-gib"
    elif jr.plan_gpu_mem_gib is not None:
        gpu, gpu_from = jr.plan_gpu_mem_gib, "policy.jet_rl.plan_gpu_mem_gib"
    elif (local := local_gpu_gib()) is not None:
        gpu, gpu_from = local, "this machine's GPU"
    else:
        gpu = DEFAULT_GPU_MEM_GIB
        gpu_from = "assumed: an H100-80GB; set --gpu-mem-gib or policy.jet_rl.plan_gpu_mem_gib"
    if host_mem_gib is not None:
        host, host_from = host_mem_gib, "--host-mem-gib"
    elif jr.plan_host_mem_gib is not None:
        host, host_from = jr.plan_host_mem_gib, "policy.jet_rl.plan_host_mem_gib"
    else:
        host, host_from = None, "not checked: set --host-mem-gib or policy.jet_rl.plan_host_mem_gib"
    host_text = f"host {host:g} GiB per node ({host_from})" if host is not None else f"host {host_from}"
    return PlanMachine(gpu, host, f"GPU {gpu:g} GiB ({gpu_from}), {host_text}")


def plan_report(cfg: RunConfig, gpu_mem_gib: float | None = None, show_config: bool = True,
                host_mem_gib: float | None = None) -> tuple[str, bool]:
    """The text `jetrl plan` prints and whether the recipe passed (resharder preflight, GPU memory, and host memory
    per node when one is named). The memory sizes: :func:`plan_machine`."""
    from jetrl_megatron.reshard.preflight import check_reshard, fp8_projections

    machine = plan_machine(cfg, gpu_mem_gib, host_mem_gib)
    gpu_mem_gib, host_mem_gib = machine.gpu_mem_gib, machine.host_mem_gib
    shape = model_shape(cfg)
    layout = parallel_layout(cfg)
    lines: list[str] = []
    if show_config:
        lines += [f"# resolved config: {cfg.name} (arm {cfg.arm})", to_yaml(cfg).rstrip(), ""]
    lines += key_accounting(cfg)
    lines.append(f"# model: {shape.name} ({shape.family}; hidden {shape.hidden_size}, {shape.num_layers} layers, "
                 f"{shape.num_attention_heads} heads / {shape.num_kv_heads} KV, ffn {shape.ffn_hidden_size}, "
                 f"vocab {shape.vocab_size})")
    lines.append("# parallel layout" + ("" if cfg.is_gpu else " (CPU run: gloo processes instead of GPUs)"))
    lines += layout.describe()
    ok = True
    moved, served = fp8_projections(shape, cfg.recipe)
    viol = check_reshard(shape, layout.tp, layout.pp, layout.rollout_tp, None, moved, served)
    lines.append(f"# resharder preflight: Megatron TP{layout.tp} x PP{layout.pp} -> vLLM TP{layout.rollout_tp}")
    if viol:
        ok = False
        lines += [f"  REFUSED {v}" for v in viol]
    elif served:
        lines.append("  ok: every FP8 shard holds whole 128x128 blocks and whole heads on both sides")
    else:
        lines.append(f"  ok: whole heads on both sides (arm {cfg.arm}: BF16 rows move, no 128 blocks needed)")
    mem = memory_estimate(cfg, shape, layout, gpu_mem_gib)
    unit = "GPU" if cfg.is_gpu else "process (CPU RAM)"
    if cfg.is_gpu:
        lines.append(f"# checked against: {machine.source}")
    lines.append(f"# memory estimate per {unit}, GiB (busiest pipeline stage; assumptions in rl/tools/run_plan.py)")
    settings = trainer_settings(cfg)
    lines.append(f"  optimizer: {settings.describe(layout.dp)}")
    lines.append(f"  grad buffers: {settings.describe_grad_buffers()}")
    lines.append(f"  refit buffers: {describe_refit_buffers(cfg, shape, layout)}")
    for k, v in mem.items():
        lines.append(f"  {k:24s} {v:10.3f}")
    if cfg.is_gpu:
        peak = gpu_peak(mem)
        verdict = "fits" if peak <= gpu_mem_gib else "DOES NOT FIT"
        if peak <= gpu_mem_gib < peak + GPU_UNCOUNTED_GIB:
            verdict += (f", but TIGHT: {gpu_mem_gib - peak:.1f} GiB left for what the plan does not count (up to "
                        f"{GPU_UNCOUNTED_GIB:g} GiB per GPU process measured at 8B: the CUDA context, vLLM's graph "
                        "pool, torch's cache)")
        lines.append(f"  peak {peak:.1f} GiB of {gpu_mem_gib:.0f} GiB: {verdict}")
        if mem["kv_cache_full_batch"] > mem["kv_cache_budget"]:
            lines.append(f"  note: {kv_waves_line(cfg, shape, layout, mem['kv_cache_budget'])}")
        ok = ok and peak <= gpu_mem_gib
        if host_mem_gib is None:
            lines.append(f"  host {mem['host_per_node']:.1f} GiB per node: not checked (--host-mem-gib or "
                         "policy.jet_rl.plan_host_mem_gib)")
        elif mem["host_per_node"] > host_mem_gib:
            lines.append(f"  host {mem['host_per_node']:.1f} GiB per node of {host_mem_gib:.0f} GiB: DOES NOT FIT, "
                         f"{mem['host_per_node'] - host_mem_gib:.1f} GiB over")
            ok = False
        else:
            lines.append(f"  host {mem['host_per_node']:.1f} GiB per node of {host_mem_gib:.0f} GiB: fits"
                         + host_headroom_note(mem["host_per_node"], host_mem_gib, per_node_processes(cfg, layout)))
        if settings.optimizer.optimizer_cpu_offload:
            lines.append("  " + describe_offload_choice(cfg, shape, layout, gpu_mem_gib, host_mem_gib))
        lines.append("  " + describe_recompute_choice(cfg, shape, layout, gpu_mem_gib))
    return "\n".join(lines), ok


# What a GPU process holds on the device beyond the plan's terms, measured at Qwen3-8B on one H200 (2026-12-05):
# 2.1 GiB outside torch's allocator (CUDA context, vLLM's graph pool and buffers) and up to 2.6 GiB of torch's cache
# inside a phase. The offload choice below keeps this much free.
GPU_UNCOUNTED_GIB = 5.0
OFFLOAD_STEP = 0.05


def offload_fraction_choice(cfg: RunConfig, shape, layout: Layout, gpu_mem_gib: float,
                            host_mem_gib: float | None = None) -> tuple[float | None, float | None]:
    """(smallest, largest) ``optimizer_offload_fraction`` on a 0.05 grid whose plan fits: the GPU peak with
    ``GPU_UNCOUNTED_GIB`` to spare, and (with ``host_mem_gib``) the host per node with the uncounted host memory and
    the system's reserve to spare; None where no grid value fits. Why the smallest matters: the host steps f of the
    Adam update on its CPUs (5.1 s of the 8B step at f = 0.75), so less on the host is a faster step."""
    import copy

    procs = per_node_processes(cfg, layout)
    host_spare = procs * HOST_UNCOUNTED_GIB_PER_PROCESS + HOST_SYSTEM_RESERVE_GIB
    gpu_ok, host_ok = [], []
    for i in range(1, round(1 / OFFLOAD_STEP) + 1):
        f = round(i * OFFLOAD_STEP, 2)
        trial = copy.deepcopy(cfg)
        trial.policy.megatron_cfg.optimizer.optimizer_offload_fraction = f
        mem = memory_estimate(trial, shape, layout, gpu_mem_gib)
        if gpu_peak(mem) + GPU_UNCOUNTED_GIB <= gpu_mem_gib:
            gpu_ok.append(f)
        if host_mem_gib is None or mem["host_per_node"] + host_spare <= host_mem_gib:
            host_ok.append(f)
    return (min(gpu_ok) if gpu_ok else None), (max(host_ok) if host_ok else None)


def describe_offload_choice(cfg: RunConfig, shape, layout: Layout, gpu_mem_gib: float,
                            host_mem_gib: float | None) -> str:
    """One line for `jetrl plan`: the range of ``optimizer_offload_fraction`` that fits this GPU and host."""
    lo, hi = offload_fraction_choice(cfg, shape, layout, gpu_mem_gib, host_mem_gib)
    now = cfg.policy.megatron_cfg.optimizer.optimizer_offload_fraction
    spare = f"{GPU_UNCOUNTED_GIB:g} GiB of the GPU left for what the plan does not count"
    if lo is None:
        return f"optimizer_offload_fraction: no value fits {gpu_mem_gib:.0f} GiB with {spare} (now {now:g})"
    host = "" if host_mem_gib is None else f" and the host ({host_mem_gib:.0f} GiB, margin as above)"
    if hi is not None and lo > hi:
        return (f"optimizer_offload_fraction: with both margins kept ({spare}; the host's as above) the GPU needs "
                f">= {lo:g} and the host <= {hi:g}: no value keeps both (now {now:g}; the fit above is without the "
                "GPU margin)")
    upper = "" if hi is None or host_mem_gib is None else f" up to {hi:g}"
    return (f"optimizer_offload_fraction: {lo:g}{upper} fits this GPU ({spare}){host} (now {now:g}); the smallest "
            "steps the least Adam on the host CPUs, the fastest step")


def describe_recompute_choice(cfg: RunConfig, shape, layout: Layout, gpu_mem_gib: float) -> str:
    """One line for `jetrl plan`: whether the run fits this GPU with ``activation_checkpointing`` the other way. Why:
    full recompute runs every layer's forward twice per micro-batch in the update; where memory allows none is
    needed, and the jetrl arm's FP8 saved inputs make that true at longer micro-batches than BF16."""
    import copy

    now = cfg.policy.megatron_cfg.activation_checkpointing
    trial = copy.deepcopy(cfg)
    trial.policy.megatron_cfg.activation_checkpointing = not now
    peak = gpu_peak(memory_estimate(trial, shape, layout, gpu_mem_gib))
    fits = peak + GPU_UNCOUNTED_GIB <= gpu_mem_gib
    spare = f"with {GPU_UNCOUNTED_GIB:g} GiB to spare"
    if now:
        if peak <= gpu_peak(memory_estimate(cfg, shape, layout, gpu_mem_gib)) + 0.05:
            return (f"activation_checkpointing: false leaves the peak where it is ({peak:.1f} GiB, another phase's): "
                    "the update would skip the recompute (one layer forward per micro-batch fewer)")
        return (f"activation_checkpointing: false fits this GPU too (peak {peak:.1f} GiB {spare}): the update would "
                "skip the recompute (one layer forward per micro-batch fewer)" if fits else
                f"activation_checkpointing: needed here (false peaks at {peak:.1f} GiB)")
    return (f"activation_checkpointing: false; true would peak at {peak:.1f} GiB (for longer sequences or larger "
            "micro-batches)")


# What each GPU process holds on the host beyond the counted terms (Python, torch, CUDA and vLLM libraries, the
# loop's buffers), measured on one H200 at Qwen3-8B (bench/RESULTS.md, 2026-12-03 and 2026-12-05): 3.5 GiB in the
# jetrl arm (115.3 RSS vs 111.8 planned), 5.3 GiB in the bf16 arm (123.5 vs 118.2); and what a node keeps for its
# system and page cache (the bf16 run left it 2 GiB of 125.6 and its rollout ran 2x slower; the jetrl run 10 GiB, fine)
HOST_UNCOUNTED_GIB_PER_PROCESS = 5.3
HOST_SYSTEM_RESERVE_GIB = 4.0


def per_node_processes(cfg: RunConfig, layout: Layout) -> int:
    """GPU processes per node (a CPU run: the whole world on one host)."""
    return max(1, cfg.cluster.gpus_per_node) if cfg.is_gpu else layout.world


def host_headroom_note(planned_gib: float, host_mem_gib: float, processes: int) -> str:
    """A warning when what the plan leaves of the host is less than the processes' own uncounted memory plus the
    system's reserve: the 8B bf16 arm planned 118.2 of 125 GiB, used 123.5, and its rollout ran 2x slower."""
    needed = processes * HOST_UNCOUNTED_GIB_PER_PROCESS + HOST_SYSTEM_RESERVE_GIB
    left = host_mem_gib - planned_gib
    if left >= needed:
        return ""
    return (f", but TIGHT: {left:.1f} GiB left for what the plan does not count (~{HOST_UNCOUNTED_GIB_PER_PROCESS} "
            f"GiB per GPU process measured at 8B, {HOST_SYSTEM_RESERVE_GIB:.0f} for the system: {needed:.1f} here); "
            f"the 8B bf16 arm's rollout ran 2x slower with its host full: lower optimizer_offload_fraction if the GPU "
            f"has room")
