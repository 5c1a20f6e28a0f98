"""The GPU memory terms of `jetrl plan` that follow from the code paths a GRPO step runs, one function per term.

Each function returns bytes and says in its docstring which allocation it counts and where the code makes it, so a
reader can check the arithmetic against the code (and the next GPU run's per-phase split metrics against the sum).
:func:`jetrl_megatron.rl.tools.run_plan.memory_estimate` adds them up per phase.
"""

from __future__ import annotations

from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.sampling import LogitsSampling

BLOCK = 128  # FP8 weight blocks are 128 x 128, one FP32 scale each


def trainer_runs_vllm_cuda(cfg: RunConfig) -> bool:
    """Whether a GPU run's trainer forward is GPU vLLM's own (``attn_impl`` auto / vllm_cuda: the default wherever vLLM
    imports, which a GPU run needs for its rollout; megatron/numerics.py ``default_attn_impl``). It decides the
    residual stream's dtype (BF16 instead of FP32) and the logprob kernels (``megatron/model.py``)."""
    return cfg.policy.jet_rl.attn_impl in ("auto", "vllm_cuda")


def _filtered(cfg: RunConfig) -> bool:
    """The rollout samples under a top-k / top-p filter, which the trainer's logprobs then apply too (the same
    ``LogitsSampling.filters`` the trainer's logprob path decides by)."""
    g = cfg.policy.generation
    return LogitsSampling(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p).filters


def _vllm_cuda_logprobs(cfg: RunConfig) -> bool:
    """The logprobs go through GPU vLLM's kernels only without a top-k / top-p filter (``logprobs_from_logits``)."""
    return trainer_runs_vllm_cuda(cfg) and not _filtered(cfg)


def _filtered_work_bytes(tokens: int, vocab: int, update: bool) -> int:
    """The torch logprob path under a top-k / top-p filter, one call over ``tokens`` scored positions, beyond its
    BF16 logits: forward (``sampling_logits``: FP32 upcast, scaling, the filter's mask and fill, then the FP32
    log-softmax) 8 B per entry, plus ``keep_mask``'s sort, cumulative sum and masks over at most ``ROW_CHUNK`` rows
    at a time, 16 B per entry of such a block; the update's backward peaks at 11 B per entry. Fitted to live tensor
    bytes measured op by op at 512 to 6,400 rows (within 10%; tests/test_megatron_logprob_chunks.py)."""
    from jetrl_megatron.sampling import ROW_CHUNK

    entries = tokens * vocab
    forward = 8 * entries + 16 * min(tokens, ROW_CHUNK) * vocab
    return max(forward, 11 * entries) if update else forward


def _logprob_calls(cfg: RunConfig) -> int:
    """How many logprob computations one training micro-batch makes from its logits: two under a filter with the KL
    term, which uses the temperature-only logprobs too (``grpo.PolicyLoss.uses_unfiltered_kl``)."""
    return 2 if _filtered(cfg) and cfg.loss_fn.reference_policy_kl_penalty else 1


def _chunk_positions(cfg: RunConfig, seq: int) -> int | None:
    """Positions per chunk of the logits -> logprobs step (``policy.logprob_chunk_size``), None when one chunk holds
    every scored position (``megatron/logprob_chunks.chunked_shifted_logprobs`` then runs the whole at once)."""
    chunk = cfg.policy.logprob_chunk_size
    return chunk if chunk is not None and chunk < seq - 1 else None


def logprob_logits_bytes(cfg: RunConfig, rows: int, seq: int, vocab: int, tp: int) -> int:
    """The logprob pass's largest transient (forward only, ``torch.no_grad``): one micro-batch's logits.

    ``rows`` x ``seq`` tokens of BF16 logits (the output layer's, ``vocab`` / TP per rank), plus, per chunk of
    positions (the whole micro-batch without ``policy.logprob_chunk_size``), the TP gather's full copy when TP > 1
    and then ``megatron/model.py``: with GPU vLLM's kernels a contiguous BF16 copy of the scored rows
    (``_vllm_cuda_logprobs``; its Triton log-softmax reads it and writes one FP32 value per token), i.e. 2 + 2 B per
    (token, vocab entry) at TP 1 unchunked; otherwise an FP32 upcast and the FP32 ``log_softmax`` of it (2 + 4 + 4 B);
    under a top-k / top-p filter :func:`_filtered_work_bytes`.
    """
    entries = rows * seq * vocab
    chunk = _chunk_positions(cfg, seq)
    scored = rows * (seq if chunk is None else chunk)
    worked = scored * vocab
    gathered = 2 * worked if tp > 1 else 0
    if _filtered(cfg):
        work = _filtered_work_bytes(scored, vocab, update=False)
    else:
        work = (2 if _vllm_cuda_logprobs(cfg) else 8) * worked
    # GPTModel hands out its (s, b, V) logits as a contiguous (b, s, V) copy: both exist for a moment when b > 1
    transposed = 4 * entries // tp if rows > 1 else 0
    return max(transposed, 2 * entries // tp + gathered + work)


def update_logits_bytes(cfg: RunConfig, rows: int, seq: int, vocab: int, tp: int) -> int:
    """The logits' peak in one training micro-batch's backward (it precedes every layer's backward, so it adds to the
    checkpointed layer inputs, not to a recomputed layer).

    GPU vLLM's kernels (``_VllmCudaLogprobFn``): the saved contiguous BF16 logits (2 B per entry), and in its backward
    the FP32 upcast (4), the FP32 softmax it scales in place (4), its division by the temperature (4, a new tensor even
    at T = 1) and the BF16 gradient (2): 16 B per (token, vocab entry) at once. The torch path without a filter: the
    saved FP32 log-softmax output (4) and the gather's backward, FP32 zeros (4) and the out-of-place scatter into them
    (4): 12 B (log-softmax's input gradient and the BF16 cast come after those are freed). Under a top-k / top-p filter:
    the BF16 logits (2 B, held through that path's forward) and :func:`_filtered_work_bytes`. The torch paths measured
    op by op on CPU (tests/test_megatron_logprob_chunks.py). TP > 1 adds the gathered full copy's gradient (2 B) to
    the vocab-parallel one.
    With ``policy.logprob_chunk_size`` (``megatron/logprob_chunks.py``) those are one chunk's, recomputed in turn,
    next to the whole micro-batch's BF16 logits kept for it and a BF16 gradient buffer per logprob computation each
    chunk writes into (2 + 2 B per entry, vocab / TP per rank; 2 + 4 B with the filter's KL term, ``_logprob_calls``).
    """
    entries = rows * seq * vocab
    chunk = _chunk_positions(cfg, seq)
    scored = rows * (seq if chunk is None else chunk)
    worked = scored * vocab
    if _filtered(cfg):
        work = _filtered_work_bytes(scored, vocab, update=True)
    else:
        work = (16 if _vllm_cuda_logprobs(cfg) else 12) * worked
    gathered = 2 * worked if tp > 1 else 0
    if chunk is None:  # the logits themselves are freed once turned into logprobs, except under a filter's forward;
        # the KL term's temperature-only logprobs keep their FP32 log-softmax output (4 B) for their own backward
        second = 4 * worked if _logprob_calls(cfg) == 2 else 0
        return work + gathered + second + (2 * entries // tp if _filtered(cfg) else 0)
    return (2 + 2 * _logprob_calls(cfg)) * entries // tp + work + gathered


def checkpointed_inputs_bytes(cfg: RunConfig, tokens: int, hidden: int, layers: int, tp: int) -> int:
    """Full activation checkpointing (recompute_granularity full, uniform, 1 layer per chunk): each layer's input
    hidden state is kept for its recompute, in the residual stream's dtype (``Fp8ModelContext.residual_dtype``: BF16
    under GPU vLLM's forward, FP32 otherwise); not divided by TP without sequence parallelism."""
    width = 2 if trainer_runs_vllm_cuda(cfg) else 4
    sp = tp if (cfg.policy.megatron_cfg.sequence_parallel and tp > 1) else 1
    return layers * width * tokens * hidden // sp


def dgrad_weight_transposes_bytes(fp8_linear_params: float) -> float:
    """The FP8 arm's K-major copies of every FP8 weight that DGrad reads (``fp8/backends/_layout.derived``, tag
    ``kmajor_t``, on the cuBLAS, DeepGEMM and Triton backends alike) plus their transposed FP32 block scales: made
    by the update's first backward, cached per weight tensor, and dropped by the cache refresh after the optimizer
    step (stale from then on; ``Fp8WeightCache.refresh``), so the update phase only: 1 B/param + 4 B per 128 x 128
    block."""
    return fp8_linear_params * (1 + 4 / (BLOCK * BLOCK))


def fp8_refresh_transient_bytes(fp8_linear_params: float) -> float:
    """The FP8 arm's cache refresh after each optimizer step quantizes every FP8 weight before it copies any into the
    cache's tensors (``fp8/weights.py`` ``Fp8WeightCache.refresh``: all-or-nothing), so for a moment a second FP8
    copy with its scales exists next to the grad buffers: 1 B/param + 4 B per 128 x 128 block, update phase only."""
    return fp8_linear_params * (1 + 4 / (BLOCK * BLOCK))


def streamed_scratch_fraction(tp: int, pp: int, rollout_tp: int) -> float:
    """The share of an engine rank's FP8 weights whose BF16 slabs reach it from trainer peers through the refit
    exchange (the self-quantizing arms' scratches ``InplaceRefit`` keeps allocated): every layer of the other
    pipeline stages, and this stage's too unless its vLLM slice lies inside this rank's own TP shard (trainer TP 1,
    or rollout TP = trainer TP; colocated rank r is trainer TP rank r % TP and vLLM rank r % rollout TP)."""
    own_stage_local = tp == 1 or rollout_tp == tp
    return (pp - 1) / pp if own_stage_local else 1.0


def refit_quantize_scratch_bytes(cfg: RunConfig, fp8_linear_params_per_engine_rank: float,
                                 streamed_fraction: float) -> float:
    """The self-quantizing arms' (bf16_train_fp8_rollout, fake_quant) BF16 scratch of the FP8 weights a trainer
    peer's slabs stream into (``streamed_scratch_fraction``; ``rollout/refit.py`` ``InplaceRefit``): allocated at the
    first refit and kept, 2 B/param in every phase. None for jetrl (FP8 bytes copied as they are) and bf16."""
    if cfg.recipe.rollout_weights != "self_quantized":
        return 0.0
    return 2 * fp8_linear_params_per_engine_rank * streamed_fraction


def refit_quantize_one_weight_bytes(cfg: RunConfig, largest_fp8_weight_per_engine_rank: float,
                                    streamed_fraction: float) -> float:
    """The self-quantizing arms' scratch of the weights quantized one at a time (the rest: every weight whose slabs
    are this rank's own), each allocated, filled, quantized and released in turn during the refit: 2 B x the
    largest FP8 weight, refit phase only."""
    if cfg.recipe.rollout_weights != "self_quantized" or streamed_fraction >= 1.0:
        return 0.0
    return 2 * largest_fp8_weight_per_engine_rank


def optimizer_step_scratch_bytes(largest_param: float, shard: int) -> float:
    """The optimizer step's largest transient beyond the state it keeps: one parameter's FP32 copy at a time — the
    hybrid optimizer's new FP32 gradient of a GPU-stepped parameter before it replaces the held one, the on-device
    FP32 conversion of an offloaded parameter's BF16 gradient on its way to the pinned host buffer (a non-blocking
    copy that changes dtype converts on the GPU): 4 B x the largest parameter tensor of this rank's shard (the
    embedding or the output layer)."""
    return 4 * largest_param / shard
