"""`jetrl prewarm`: which FP8 GEMMs a run compiles, at which M, for :mod:`jetrl_megatron.fp8.gemm_prewarm`.

From the resolved config: the trainer's linears at its TP (FProp up to the larger of the update's and the logprob
pass's micro-batch tokens, DGrad up to the update's) when the arm trains in FP8, and the rollout engine's linears at
the rollout TP (FProp up to vLLM's token budget per step) when it rolls out in FP8. The token grid a micro-batch's
linears see is its rows times its longest row padded to the FP8 token group (``FP8_SEQ_MULTIPLE``); the bound here
takes every row at ``policy.max_total_sequence_length``.
"""

from __future__ import annotations

from jetrl_megatron.fp8.gemm_prewarm import GemmTask, representative_m_values
from jetrl_megatron.megatron.spec import per_rank_gemm_shapes
from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.config.run_config import FP8_SEQ_MULTIPLE
from jetrl_megatron.rl.tools.run_plan import model_shape

# vLLM's own default token budget per engine step for the offline LLM class (vLLM 0.26), used when vllm_kwargs does
# not set max_num_batched_tokens
VLLM_DEFAULT_BATCHED_TOKENS = 16384


def linear_gemms(shape, tp: int) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) per rank of each FP8 linear at TP=tp, from the Megatron spec's per-rank shapes:
    fused QKV, attention output, fused gate+up (fc1: the spec counts gate and up apiece), down (fc2); vLLM's qkv_proj
    and gate_up_proj fuse the same way."""
    spec = per_rank_gemm_shapes(shape, tp)
    fc1_half, hidden = spec["mlp.linear_fc1"]
    return {"qkv": spec["self_attention.linear_qkv"], "proj": spec["self_attention.linear_proj"],
            "fc1": (2 * fc1_half, hidden), "fc2": spec["mlp.linear_fc2"]}


def _padded(tokens: int) -> int:
    return -(-tokens // FP8_SEQ_MULTIPLE) * FP8_SEQ_MULTIPLE


def token_bounds(cfg: RunConfig) -> dict[str, int]:
    """The most tokens one GEMM call sees in each pass: ``update`` and ``logprob`` micro-batches, ``rollout`` step."""
    p = cfg.policy
    seq = _padded(p.max_total_sequence_length)
    rollout = p.generation.vllm_kwargs.get("max_num_batched_tokens") or max(VLLM_DEFAULT_BATCHED_TOKENS,
                                                                            p.max_total_sequence_length)
    return {"update": p.train_micro_batch_size * seq, "logprob": p.logprob_batch_size * seq, "rollout": int(rollout)}


def prewarm_tasks(cfg: RunConfig) -> list[GemmTask]:
    """One task per distinct GEMM (N, K) the run's FP8 linears meet; none for an arm without FP8 GEMMs."""
    recipe, shape, bounds = cfg.recipe, model_shape(cfg), token_bounds(cfg)
    mc = cfg.policy.megatron_cfg
    wanted: dict[tuple[str, int, int, str], int] = {}  # (linear, out, in, form) -> largest M

    def want(tp: int, form: str, m_max: int) -> None:
        for name, (out_f, in_f) in linear_gemms(shape, tp).items():
            key = (name if tp == mc.tensor_model_parallel_size else f"{name}@tp{tp}", out_f, in_f, form)
            wanted[key] = max(wanted.get(key, 0), m_max)

    if recipe.trains_fp8:
        want(mc.tensor_model_parallel_size, "fprop", max(bounds["update"], bounds["logprob"]))
        want(mc.tensor_model_parallel_size, "dgrad", bounds["update"])
    if recipe.rollout_fp8:
        want(cfg.policy.generation.vllm_cfg.tensor_parallel_size, "fprop", bounds["rollout"])
    # a GEMM reached twice (the rollout's FProp at the trainer's TP; a square weight's DGrad, the same kernel as its
    # FProp) compiles once: one task per (N, K), up to the larger M
    groups: dict[tuple[int, int], list[GemmTask]] = {}  # (N, K) -> the GEMMs with it, each at its largest M
    for (name, out_f, in_f, form), m_max in wanted.items():
        task = GemmTask(name, out_f, in_f, form, (m_max,))
        groups.setdefault(task.gemm_nk, []).append(task)
    return [GemmTask(group[0].linear, group[0].out_features, group[0].in_features, group[0].form,
                     tuple(representative_m_values(max(t.m_values[0] for t in group))),
                     tuple(f"{t.linear} {t.form}" for t in group[1:]))
            for group in groups.values()]


def describe_plan(cfg: RunConfig, tasks: list[GemmTask]) -> str:
    b = token_bounds(cfg)
    lines = [f"# prewarm: arm {cfg.arm}, model {model_shape(cfg).name}, backend {cfg.recipe.gemm_backend}; tokens per "
             f"GEMM call at most: update {b['update']}, logprob {b['logprob']}, rollout {b['rollout']}"]
    if not tasks:
        lines.append("# nothing to compile: this arm runs no FP8 GEMM")
    lines += [f"  {t.describe()}" for t in tasks]
    return "\n".join(lines)
