"""The Megatron trainer of a run: building it (and the reference policy), its logprobs, the learning-rate schedule,
the policy update over micro-batches, the supervised warm start, and writing the policy as an HF model directory."""

from __future__ import annotations

import math
import random
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from jetrl_megatron.errors import UserError
from jetrl_megatron.megatron.host_resident import HostResidentWeights
from jetrl_megatron.model.hub import WEIGHT_FILES, is_hub_id, snapshot
from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical
from jetrl_megatron.reshard.transport import Transport
from jetrl_megatron.rl import grpo
from jetrl_megatron.rl.batch import (
    RolloutBatch,
    padded_length,
)
from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.dist import (
    dist_rank,
    dist_world,
    dp_coords,
    dp_gather,
    dp_slice,
    say,
    torch_dist,
    warn,
)
from jetrl_megatron.rl.outputs.metric_log import RunLogger
from jetrl_megatron.rl.stress_arms import trainer_stress
from jetrl_megatron.rl.tools.run_plan import model_shape, trainer_settings
from jetrl_megatron.rollout.model_dir import hf_config_for, write_config
from jetrl_megatron.rollout.model_dir import write_model_dir as write_hf_model_dir
from jetrl_megatron.sampling import LogitsSampling, mask_filtered_out

if TYPE_CHECKING:
    from jetrl_megatron.megatron.model import PassObserver


def lr_at(cfg: RunConfig, step: int) -> float:
    """Warmup then constant / linear / cosine decay to min_lr (NeMo-RL's megatron scheduler keys)."""
    o, s = cfg.policy.megatron_cfg.optimizer, cfg.policy.megatron_cfg.scheduler
    if s.lr_warmup_iters and step < s.lr_warmup_iters:
        return s.lr_warmup_init + (o.lr - s.lr_warmup_init) * step / s.lr_warmup_iters
    if s.lr_decay_style == "constant":
        return o.lr
    total = max(1, (s.lr_decay_iters or cfg.grpo.max_num_steps) - s.lr_warmup_iters)
    frac = min(1.0, (step - s.lr_warmup_iters) / total)
    if s.lr_decay_style == "linear":
        return o.lr + (o.min_lr - o.lr) * frac
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * frac))


def set_lr(optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


@dataclass
class Trainer:
    """This rank's Megatron model (DDP-wrapped), its optimizer, and an optional frozen reference model."""

    model: Any
    optimizer: Any
    ref_model: ReferencePolicy | None
    shape: Any
    recipe: Any

    @property
    def gpt(self):
        from jetrl_megatron.megatron.model import unwrap

        return unwrap(self.model)


def require_deep_gemm(cfg: RunConfig, on_cuda: bool) -> None:
    """``policy.generation.vllm_cfg.use_deep_gemm: true`` asks for DeepGEMM's FP8 GEMMs, which ``gemm_backend:
    auto`` picks where they were measured fastest (FProp, DGrad) but would quietly replace by cuBLAS or Triton where
    DeepGEMM cannot be imported: a CUDA run of an FP8-training arm without it stops here, naming the key."""
    if not (on_cuda and cfg.policy.generation.vllm_cfg.use_deep_gemm and cfg.recipe.trains_fp8):
        return
    from jetrl_megatron.fp8.gemm import load_backend

    if load_backend("deep_gemm") is None:
        raise UserError("policy.generation.vllm_cfg.use_deep_gemm: true, but DeepGEMM cannot run here (neither "
                        "`deep_gemm` nor vLLM's bundled vllm.third_party.deep_gemm imports, or the GPU is not "
                        "SM90); install it or set use_deep_gemm: false (the FP8 GEMMs then run on cuBLAS / Triton)")


def build_trainer(cfg: RunConfig) -> Trainer:
    from jetrl_megatron.megatron.policy import build_policy

    require_deep_gemm(cfg, torch.cuda.is_available())
    shape, recipe = model_shape(cfg), cfg.recipe
    mc = cfg.policy.megatron_cfg
    settings = trainer_settings(cfg)  # the same object `jetrl plan` estimates memory from
    recompute = ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
                 if mc.activation_checkpointing else {"recompute_granularity": None})
    policy = build_policy(shape, recipe, weights=resolve_model_weights(cfg), sequence_parallel=mc.sequence_parallel,
                          seed=cfg.grpo.seed, **model_numerics(cfg), **recompute, **settings.policy_kwargs())
    for pinned in policy.optimizer.pinned_masters:  # optimizer CPU offload on CUDA (megatron/host_pinning.py)
        (warn if pinned.error else say)(f"optimizer CPU offload: {pinned.summary()}")
    return Trainer(policy.model, policy.optimizer, None, shape, recipe)


def trainer_attn_impl(cfg: RunConfig) -> str | None:
    """``policy.jet_rl.attn_impl`` for ``build_gpt`` (None: the device's default, vLLM's own ops)."""
    impl = cfg.policy.jet_rl.attn_impl
    return None if impl == "auto" else impl


def model_numerics(cfg: RunConfig) -> dict[str, Any]:
    """The numerics keywords of ``build_gpt`` for this run's models (they become fields of each model's
    ``Fp8ModelContext``): attention kernels, element-wise kernels, reference quantizer (environment overrides
    applied at config load, ``cfg.switches``)."""
    return {"attn_impl": trainer_attn_impl(cfg), "elementwise": cfg.switches.elementwise,
            "reference_quant": cfg.switches.reference_quant, "attn_match": cfg.policy.jet_rl.attn_match,
            "cuda_norms": cfg.policy.jet_rl.cuda_norms,
            "fuse_swiglu_grad_quant": cfg.policy.jet_rl.fuse_swiglu_grad_quant,
            "swiglu_fp8_forms": cfg.policy.jet_rl.swiglu_fp8_forms,
            "deterministic_backward": cfg.policy.jet_rl.deterministic_backward, "stress": trainer_stress(cfg)}


class ModelSourceError(UserError, FileNotFoundError):
    """``policy.model_name`` names no weights this machine can read."""


def resolve_model_weights(cfg: RunConfig) -> str | None:
    """The HF checkpoint directory to start from, or None for a random init of a preset (``model_name`` equal to
    ``model_preset``, e.g. ``tiny``). A hub id is read from the Hugging Face cache (``cfg.hub``; downloaded when
    online and not cached); failing that the run stops instead of silently training a random model."""
    name = cfg.policy.model_name
    if Path(name).is_dir():
        return name
    if name == cfg.model_preset:
        return None
    if not is_hub_id(name):
        raise ModelSourceError(f"policy.model_name {name!r}: not a local directory and not a hub id; point it at a "
                               f"local HF checkpoint, or set it to policy.jet_rl.model_preset ({cfg.model_preset!r}) "
                               "for a random init")
    return str(snapshot(name, cfg.hub, key="policy.model_name", need=WEIGHT_FILES))


@dataclass
class ReferencePolicy:
    """The KL term's frozen reference model; ``host``: its weights live in host memory between its passes
    (``policy.jet_rl.reference_on_host``), else on the device throughout."""

    model: Any
    host: HostResidentWeights | None

    def on_device(self) -> AbstractContextManager:
        """The reference model, its weights on the device, for one pass."""
        return self.host.on_device() if self.host is not None else nullcontext(self.model)

    def state_dict(self) -> dict[str, Any]:
        """The reference's weights (host tensors between passes when on the host) for a checkpoint."""
        return self.model.state_dict()


def make_reference(cfg: RunConfig, trainer: Trainer, weights: dict[str, torch.Tensor] | None = None
                   ) -> ReferencePolicy:
    """A frozen copy of the current policy (for the KL penalty), same shards and arm; ``weights``: a saved
    reference's instead (a resumed run keeps the reference of the run it continues)."""
    from jetrl_megatron.megatron.model import build_gpt, fp8_linears, refresh_fp8_cache

    ref = build_gpt(trainer.shape, trainer.recipe, seed=cfg.grpo.seed, **model_numerics(cfg))
    ref.load_state_dict(trainer.gpt.state_dict() if weights is None else weights, strict=True)
    for p in ref.parameters():
        p.requires_grad_(False)
        torch.autograd.graph.increment_version(p)
    if not cfg.policy.jet_rl.reference_on_host:
        refresh_fp8_cache(ref)
        return ReferencePolicy(ref, None)
    host = HostResidentWeights(ref, fp8_cache=bool(fp8_linears(ref)))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the upload's blocks, before the engine sizes its memory
    return ReferencePolicy(ref, host)


def rollout_sampling(cfg: RunConfig) -> LogitsSampling:
    """The distribution the rollout samples from (``policy.generation``'s temperature, top_k, top_p): the trainer's
    logprobs of the policy are of the same one (NeMo-RL's TrainingSamplingParams)."""
    g = cfg.policy.generation
    return LogitsSampling(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)


def trainer_logprobs(cfg: RunConfig, model, tokens: torch.Tensor, sampling: LogitsSampling | None = None,
                     lengths: torch.Tensor | None = None, prompt_lengths: torch.Tensor | None = None,
                     observer: PassObserver | None = None) -> torch.Tensor:
    """Logprobs of ``tokens`` under ``model``, of the ``sampling`` distribution (None: raw). With a top-k / top-p
    filter a token the trainer filters out is -inf (``mask_filtered_out``). ``lengths``: each row's real length;
    ``prompt_lengths``: where its response (vLLM's decode steps) begins; ``observer``: told as micro-batches begin
    (a step profile's window)."""
    from jetrl_megatron.megatron.model import token_logprobs

    mine = dp_slice(tokens)
    mbs = math.gcd(cfg.policy.logprob_batch_size, mine.shape[0])
    lp = token_logprobs(model, mine, micro_batch_size=mbs, sampling=sampling,
                        lengths=None if lengths is None else dp_slice(lengths),
                        decode_from=None if prompt_lengths is None else dp_slice(prompt_lengths), observer=observer,
                        logprob_chunk=cfg.policy.logprob_chunk_size)
    return dp_gather(lp.float().cpu())


def policy_logprobs(cfg: RunConfig, model, batch: RolloutBatch, observer: PassObserver | None = None
                    ) -> tuple[torch.Tensor, int]:
    """The trainer's logprobs of the rollout's tokens under the rollout's distribution (``prev_logprobs``), and how
    many sampled tokens the trainer's top-k / top-p filter removed: those get logprob 0 (NeMo-RL's
    ``mask_out_neg_inf_logprobs``), in the mismatch metrics, the rollout correction and the loss alike."""
    sampling = rollout_sampling(cfg)
    logp = trainer_logprobs(cfg, model, batch.tokens, sampling, batch.lengths, batch.prompt_lengths, observer)
    return mask_filtered_out(logp, batch.mask) if sampling.filters else (logp, 0)


def reference_logprobs(cfg: RunConfig, reference: ReferencePolicy, batch: RolloutBatch,
                       observer: PassObserver | None = None) -> torch.Tensor:
    """The reference policy's logprobs for the KL penalty: at the rollout temperature, never filtered (NeMo-RL: its
    top-k / top-p set differs from the policy's, so filtered values would be -inf where the policy's are not)."""
    with reference.on_device() as model:
        return trainer_logprobs(cfg, model, batch.tokens, rollout_sampling(cfg).unfiltered(), batch.lengths,
                                batch.prompt_lengths, observer)


def policy_loss(cfg: RunConfig) -> grpo.PolicyLoss:
    """The run's GRPO loss (``loss_fn``; the rollout's sampling filter and ``grpo.overlong_filtering`` decide what
    it masks and how it normalizes)."""
    return grpo.PolicyLoss.from_config(cfg.loss_fn, overlong_filtering=cfg.grpo.overlong_filtering,
                                       filtered_sampling=rollout_sampling(cfg).filters)


def policy_update(cfg: RunConfig, trainer: Trainer, batch: RolloutBatch, adv: torch.Tensor, logp_old: torch.Tensor,
                  logp_ref: torch.Tensor | None, is_w: torch.Tensor | None, keep: torch.Tensor,
                  step: int, logger: RunLogger, observer: PassObserver | None = None) -> dict[str, float]:
    """One optimizer step per ``train_global_batch_size`` slice of the rollout batch (micro-batched, DP-sharded);
    ``observer``: told as micro-batches begin (a step profile's window)."""
    from jetrl_megatron.megatron.model import train_step

    gbs, mbs = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    dp, _, _ = dp_coords()
    sampling, loss = rollout_sampling(cfg), policy_loss(cfg)
    unfiltered = loss.uses_unfiltered_kl(logp_ref is not None)
    n_micro = gbs // (mbs * dp)
    results = []
    for mb_start in logger.bar(range(0, batch.tokens.shape[0], gbs), "update", total=batch.tokens.shape[0] // gbs):
        sl = slice(mb_start, mb_start + gbs)
        data = {"tokens": batch.tokens[sl], "mask": keep[sl], "adv": adv[sl], "logp_old": logp_old[sl]}
        if logp_ref is not None:
            data["logp_ref"] = logp_ref[sl]
        if is_w is not None:
            data["is_w"] = is_w[sl]
        if batch.lengths is not None and cfg.policy.jet_rl.update_attention == "packed":
            data["lengths"] = batch.lengths[sl]  # whole_rows: no lengths, every padded row attended whole
            data["decode_from"] = batch.prompt_lengths[sl]
        if loss.on_policy_kl and logp_ref is not None:
            data["logp_gen"] = batch.gen_logprobs[sl]
        data = {k: dp_slice(v) for k, v in data.items()}
        norm = loss.normalizer(keep[sl], batch.truncated[sl], gbs, n_micro, dp)
        set_lr(trainer.optimizer, lr_at(cfg, step))
        results.append(train_step(trainer.model, trainer.optimizer, data, loss.for_batch(norm), micro_batch_size=mbs,
                                  sampling=sampling, unfiltered=unfiltered, observer=observer,
                                  logprob_chunk=cfg.policy.logprob_chunk_size,
                                  release_cache_before_step=cfg.policy.generation.colocated.enabled,
                                  backward_thread=cfg.policy.jet_rl.backward_thread))
    m = {
        "train/loss": sum(r.loss for r in results) * 1.0,
        # the micro-batch metrics are not divided by Megatron (only the loss is): their mean is already the token
        # mean over this rank's share, scaled like train/loss
        "train/pg_loss": float(np.mean([r.metrics["pg_loss"] for r in results])),
        "train/clip_frac": float(np.mean([r.metrics["clip_frac"] for r in results])),
        "train/ratio_mean": float(np.mean([r.metrics["ratio_mean"] for r in results])),
        # the first optimizer step's micro-batches run the weights the logprob pass ran: 0 = the update's forward
        # gave every valid token the logprob pass's bytes (each micro-batch's max |ratio - 1|, averaged)
        "train/ratio_dev_first_step": float(results[0].metrics["ratio_dev_max"]),
        "train/kl_ref": float(np.mean([r.metrics["kl_ref"] for r in results])),
        "train/grad_norm": float(np.mean([r.grad_norm for r in results if r.grad_norm is not None] or [math.nan])),
        "train/skipped_steps": float(sum(r.skipped for r in results)),
        "train/fp8_generation": float(results[-1].fp8_generation),
        "train/lr": lr_at(cfg, step),
        "time/optimizer": float(sum(r.optimizer_seconds for r in results)),
    }
    return m


def sft_warmstart(cfg: RunConfig, trainer: Trainer, task, indices: list[int], logger: RunLogger) -> list[float]:
    """A few supervised steps on the reference answers of the training prompts ``indices`` (never the held-out
    ones) so the first GRPO rewards are not all zero."""
    from jetrl_megatron.megatron.model import train_step

    w = cfg.policy.jet_rl.sft_warmstart
    if w.steps <= 0 or not hasattr(task, "sft_target"):
        return []
    rng = random.Random(cfg.grpo.seed + 17)
    mbs = math.gcd(cfg.policy.train_micro_batch_size, w.batch_size)
    dp, _, _ = dp_coords()
    losses = []
    for _ in logger.bar(range(w.steps), "sft warm-start"):
        rows = []
        for _ in range(w.batch_size):
            p = task.prompt(indices[rng.randrange(len(indices))])
            rows.append((list(p.token_ids), task.sft_target(p)))
        longest = max(len(a) + len(b) for a, b in rows)
        s = padded_length(longest, cfg.policy.make_sequence_length_divisible_by, mbs, cfg.fp8_token_multiple())
        tokens = torch.zeros(len(rows), s, dtype=torch.long)
        mask = torch.zeros(len(rows), s - 1)
        for i, (a, b) in enumerate(rows):
            tokens[i, :len(a) + len(b)] = torch.tensor(a + b)
            mask[i, len(a) - 1:len(a) - 1 + len(b)] = 1.0
        n_micro = w.batch_size // (mbs * dp)
        norm = float(mask.sum()) / (n_micro * dp)
        set_lr(trainer.optimizer, w.lr)
        res = train_step(trainer.model, trainer.optimizer, {"tokens": dp_slice(tokens), "mask": dp_slice(mask)},
                         lambda lp, mb, norm=norm: (grpo.sft_loss(lp, mb["mask"], norm), {}), micro_batch_size=mbs,
                         logprob_chunk=cfg.policy.logprob_chunk_size, backward_thread=cfg.policy.jet_rl.backward_thread)
        losses.append(per_token_loss(res.loss))
        if w.stop_at_loss is not None and len(losses) >= w.stop_window \
                and sum(losses[-w.stop_window:]) / w.stop_window <= w.stop_at_loss:
            say(f"sft warm-start: mean loss of the last {w.stop_window} steps reached stop_at_loss "
                f"{w.stop_at_loss:g} at step {len(losses)} of at most {w.steps}")
            break
    say(f"sft warm-start: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


def per_token_loss(rank_loss: float) -> float:
    """The batch's mean loss per response token, the same on every DP rank (so all ranks stop at the same step).

    ``train_step`` returns this rank's micro-batch mean of sum(nll) / norm, with norm = the batch's response tokens
    / (micro-batches x DP): that is DP x (this rank's nll sum) / (the batch's tokens), whose mean over DP ranks is
    the per-token loss. (Until 2026-12-02 the warm start logged it times micro-batches x DP: 4x in count_150m_gpu.)"""
    from jetrl_megatron.megatron.model import compute_device

    x = torch.tensor([rank_loss], dtype=torch.float64, device=compute_device())
    return float(dp_gather(x).mean())


def write_model_dir(cfg: RunConfig, trainer: Trainer, path: Path, only_rank0: bool = False,
                    weights: bool = True) -> str:
    """A BF16 HF model directory of the current policy (collective). Written by every engine's first rank (each
    passes its own path), or by global rank 0 only. ``weights`` False: config.json alone, all an engine started
    without weights reads (its first in-place refit writes every tensor)."""
    sd = canonical_weights(bf16_view(trainer)) if weights else None
    writer = dist_rank() == 0 if only_rank0 else dist_rank() % cfg.policy.generation.vllm_cfg.tensor_parallel_size == 0
    if writer:
        config = hf_config_for(trainer.shape, None)
        write_hf_model_dir(path, config, sd) if sd is not None else write_config(path, config)
    if dist_world() > 1:
        torch_dist().barrier()
    return str(path)


def bf16_view(trainer: Trainer) -> Trainer:
    return replace(trainer, recipe=trainer.recipe.replace(mode="bf16"))


def optimizer_updates_per_step(cfg: RunConfig) -> int:
    """Optimizer updates in one GRPO step: its responses split into global training batches."""
    g = cfg.grpo
    return g.num_prompts_per_step * g.num_generations_per_prompt // cfg.policy.train_global_batch_size


def mp_group():
    from megatron.core import parallel_state

    return parallel_state.get_model_parallel_group()


@torch.no_grad()
def megatron_states(trainer: Trainer) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """Every model-parallel rank's rollout tensors (`local_rollout_tensors`, bytes exact, on CPU), keyed
    (pp_rank, 0, tp_rank); collective over the MP group (`reshard.transport.Transport.gather_tensors`: each rank's
    tensors packed into one buffer and broadcast in turn). Used for whole-model exports (initial model dir, probes);
    the per-step refit exchanges only what each rank needs (`RefitSource`)."""
    from megatron.core import parallel_state

    local = local_rollout_tensors(trainer)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    key = (parallel_state.get_pipeline_model_parallel_rank(), 0, parallel_state.get_tensor_model_parallel_rank())
    if tp * pp == 1:
        return {key: {k: v.cpu().clone() for k, v in local.items()}}
    transport = Transport(mp_group())
    keys = transport.gather_meta(key)
    return dict(zip(keys, transport.gather_tensors(local), strict=True))


def local_rollout_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's tensors for the rollout engine, Megatron local names, as detached views (no copies).

    jetrl: the FP8 cache's bytes + 128x128 scales (exactly what the trainer computes with) and BF16 non-GEMM tensors.
    Other arms: the BF16 model weights (the engine of bf16_train_fp8_rollout / fake_quant quantizes them itself).
    """
    from jetrl_megatron.megatron.model import rollout_weights

    if trainer.recipe.rollout_weights == "trainer_fp8":
        return dict(rollout_weights(trainer.model))
    return {k: p.detach() for k, p in trainer.gpt.named_parameters()}


def canonical_weights(trainer: Trainer, states: dict | None = None) -> dict[str, torch.Tensor]:
    """The full HF-named state dict the rollout engine serves, made by the resharder (byte moves only)."""
    from megatron.core import parallel_state

    states = megatron_states(trainer) if states is None else states
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return dict(iter_canonical(MegatronShards(trainer.shape, tp, pp, None, states)))
