"""The rollout engines of a run: how ranks group into engines, starting one, sampling a step's answers, and
validating on held-out prompts (greedy and sampled)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.rl.batch import (
    stop_ids,
)
from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.dist import (
    dist_rank,
    dist_world,
    say,
    torch_dist,
)
from jetrl_megatron.rl.stress_arms import rollout_stress
from jetrl_megatron.rl.tasks import build_task, heldout_split
from jetrl_megatron.rollout import cpu_prefill_rows, invariant_norm, kv_waves, swiglu_forms
from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
from jetrl_megatron.rollout.model_dir import read_config

log = logging.getLogger(__name__)


def engine_groups(cfg: RunConfig) -> tuple[int, int]:
    """(number of engines, this rank's engine index): one engine per rollout-TP group of consecutive ranks."""
    rtp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    world = dist_world()
    if world % rtp:
        raise ValueError(f"world size {world} is not a multiple of rollout TP {rtp}")
    return world // rtp, dist_rank() // rtp


def start_engine(cfg: RunConfig, model_dir: str, recipe=None, load_format: str = "auto"):
    """The run's vLLM engine for ``model_dir``; ``load_format`` "dummy": its weights come from the first refit (the
    directory needs only config.json)."""
    v = cfg.policy.generation.vllm_cfg
    kwargs: dict[str, Any] = dict(cfg.policy.generation.vllm_kwargs)
    kwargs.pop("kv_cache_memory_bytes", None)  # RolloutConfig's (cfg.kv_cache_memory_bytes: the CPU default too)
    # the hosted form of the jetrl switches: the arm and recipe were read from them (rl/config/run_config.py); the
    # engine names its quantization method and writes its quantization_config itself, and its norms and SwiGLU follow
    # policy.jet_rl.cuda_norms and swiglu_fp8_forms
    kwargs.pop("quantization", None)
    ours = ("quantization_config", invariant_norm.HF_KEY, swiglu_forms.HF_KEY, cpu_prefill_rows.HF_KEY)
    overrides = {k: v for k, v in (kwargs.pop("hf_overrides", None) or {}).items() if k not in ours}
    if overrides:
        kwargs["hf_overrides"] = overrides
    if dist_world() > 1 and (torch.cuda.is_available() or v.tensor_parallel_size > 1):
        # The ranks of this job form vLLM's groups (each rank runs its vLLM worker in-process). On CPU only rollout
        # TP > 1 needs this; at TP 1 every rank runs an independent engine.
        kwargs["distributed_executor_backend"] = "external_launcher"
    n_engines, _ = engine_groups(cfg)
    seqs = max(1, cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt // n_engines)
    kv_bytes = cfg.kv_cache_memory_bytes()
    if kv_bytes is not None:  # run at most what the cache holds whole: vLLM never preempts (rollout/kv_waves.py)
        shape = ModelShape.from_hf_config(read_config(model_dir))
        seqs = max(1, min(seqs, kv_waves.sequences_without_preemption(
            kv_bytes, shape, v.tensor_parallel_size, cfg.rollout_sequence_tokens(),
            kv_waves.platform_block_tokens(torch.cuda.is_available()))))
    sw = cfg.switches  # policy.jet_rl's switches, environment overrides applied at load
    return RolloutEngine(RolloutConfig(
        model_dir=model_dir, recipe=recipe or cfg.recipe, tensor_parallel_size=v.tensor_parallel_size,
        verify_refit=sw.verify_refit, refit_cuda_graph=sw.refit_cuda_graph, fp8_gemm_warmup=sw.fp8_gemm_warmup,
        reference_quant=sw.reference_quant, stress_format=None if recipe else rollout_stress(cfg),
        cuda_norms=cfg.policy.jet_rl.cuda_norms, swiglu_fp8_forms=cfg.policy.jet_rl.swiglu_fp8_forms,
        max_model_len=v.max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=v.gpu_memory_utilization, max_num_seqs=seqs, seed=cfg.grpo.seed,
        enforce_eager=v.enforce_eager, enable_sleep_mode=torch.cuda.is_available() and
        cfg.policy.generation.colocated.enabled, in_process=True, load_format=load_format, llm_kwargs=kwargs))


def _vllm_top_k(top_k: int | None) -> int:
    """``policy.generation.top_k`` as vLLM's SamplingParams takes it (0: no filter; NeMo-RL's None / -1)."""
    return top_k if top_k is not None and top_k > 0 else 0


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
                              temperature=g.temperature, top_p=g.top_p, top_k=_vllm_top_k(g.top_k),
                              seed=cfg.grpo.seed * 1_000_003 + step * 10_007 + mine[0] * n,
                              stop_token_ids=stop_ids(cfg, task), ignore_eos=g.ignore_eos)
        samples = [(mine[s.prompt_index], s.sample_index, list(s.token_ids), list(s.logprobs)) for s in out]
    if dist_world() > 1:
        parts: list = [None] * dist_world()
        first_of_engine = dist_rank() % cfg.policy.generation.vllm_cfg.tensor_parallel_size == 0
        torch_dist().all_gather_object(parts, samples if first_of_engine else [])
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
    greedy, texts = _val_scores(cfg, engine, task, val_prompts, n=1, temperature=0.0, top_p=1.0, top_k=0)
    # what the policy answers, not just its score: the first logger.num_val_samples_to_print held-out prompts, greedy
    for i, text in enumerate(texts[:cfg.logger.num_val_samples_to_print]):
        say(f"  held-out sample: {val_prompts[i].text[:60]!r} -> {text[:80]!r}"
             f"{'...' if len(text) > 80 else ''} (reward {greedy[i][0]:.3f})")
    out = {"val/reward": float(np.mean([r for r, _ in greedy])), "val/accuracy": float(np.mean([c for _, c in greedy]))}
    n = cfg.grpo.num_val_generations_per_prompt
    if n > 0:
        sampled, _ = _val_scores(cfg, engine, task, val_prompts, n=n, temperature=g.temperature, top_p=g.top_p,
                                 top_k=_vllm_top_k(g.top_k))
        out.update({"val/reward_sampled": float(np.mean([r for r, _ in sampled])),
                    "val/accuracy_sampled": float(np.mean([c for _, c in sampled]))})
    return out


VAL_KEYS = ("step", "val/reward", "val/accuracy", "val/reward_sampled", "val/accuracy_sampled")


def _val_scores(cfg: RunConfig, engine, task, val_prompts, *, n: int, temperature: float,
                top_p: float, top_k: int) -> tuple[list[tuple[float, bool]], list[str]]:
    """(reward, correct) of every answer to the held-out prompts; each engine answers its share, all ranks get all.
    A fixed seed: the same policy gives the same sampled answers, so curves move only when the policy does."""
    n_engines, my_engine = engine_groups(cfg)
    per = -(-len(val_prompts) // n_engines)
    mine = list(range(my_engine * per, min(len(val_prompts), (my_engine + 1) * per)))
    res, texts = [], []
    if mine:
        out = engine.generate([val_prompts[i].token_ids for i in mine], n=n,
                              max_tokens=cfg.policy.generation.max_new_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, seed=0, stop_token_ids=stop_ids(cfg, task))
        texts = [task.tokenizer.decode(list(s.token_ids)) for s in out]
        res = [task.reward(val_prompts[mine[s.prompt_index]], t) for s, t in zip(out, texts, strict=True)]
    if dist_world() > 1:
        parts: list = [None] * dist_world()
        first = dist_rank() % cfg.policy.generation.vllm_cfg.tensor_parallel_size == 0
        torch_dist().all_gather_object(parts, (res, texts) if first else ([], []))
        res = [x for p in parts for x in p[0]]
        texts = [x for p in parts for x in p[1]]
    return res, texts


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
