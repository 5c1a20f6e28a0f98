"""GPU vLLM's own CUDA ops (vLLM 0.26 with compilation mode 0: custom ops on, ``vllm_c`` IR kernels first), called
by the trainer's forward so that its activations are the bytes vLLM's prefill produces.

Why call them rather than re-implement: FP8 activation quantization turns a 1-ulp BF16 difference upstream into
flipped E4M3 codes, and vLLM's CUDA kernels round in ways no torch expression reproduces: the fused add + RMSNorm
adds in BF16 (the residual is a BF16 tensor) and reduces the sum of squares with a block size that depends on the
token count, the rotary kernel rotates in BF16 arithmetic, FlashAttention 3 tiles its reductions by the paged
KV-cache layout. Calling the op vLLM calls, with the arguments its prefill passes, is exact by construction.

What vLLM's Qwen3 / Llama forward runs per layer on CUDA (``models/qwen3.py``, ``layers/layernorm.py``,
``kernels/vllm_c.py``, ``layers/rotary_embedding/base.py``, ``layers/activation.py``,
``v1/attention/backends/flash_attn.py``):

* layer 0's input norm: ``_C.rms_norm`` of the BF16 embedding; every later norm (input, post-attention, the
  final norm): ``_C.fused_add_rms_norm(x, residual)``, which stores ``bf16(x + residual)`` as the new residual and
  normalises that BF16 sum. The trainer's residual add rounds the same sum once to BF16 (one rounding: exact), and
  its norm runs the fused kernel on ``(sum, zeros)``: the same sum, the same reduction, the same output;
* q/k norms: ``_C.rms_norm`` per head;
* RoPE: ``_C.rotary_embedding`` in place on (tokens, heads * head_dim) with vLLM's BF16 cos/sin cache, built by
  vLLM's own ``get_rope`` on the GPU (the cache's cos/sin are CUDA's, not the CPU's);
* attention: ``flash_attn_varlen_func`` (FA3 on Hopper) over a paged BF16 KV cache of vLLM's block size, causal,
  scale ``head_dim ** -0.5``, with FA3's ahead-of-time scheduler metadata;
* SwiGLU: ``_C.silu_and_mul``; lm_head: ``F.linear`` in BF16 (vLLM's unquantized GEMM on CUDA).

Each op here is forward-only; the autograd wrappers in :mod:`jetrl_megatron.megatron.numerics` take the backward
from a torch twin (RMSNorm, RoPE, SwiGLU) or from a flash-attention backward fed with FA3's output and log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["available", "unavailable_reason", "rms_norm", "fused_add_rms_norm", "fused_rms_norm_of_sum",
           "rope_neox_", "silu_and_mul", "rope_cache", "flash_attention_module", "PagedLayout", "DecodeSplit",
           "PrefillAttention", "KV_BLOCK", "token_logprobs"]

KV_BLOCK = 16  # vLLM's default KV-cache block size for the FlashAttention backend on CUDA
_STATE: dict = {}


def _probe() -> str | None:
    """None when GPU vLLM's ops can run here, else why not (one line)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import vllm._custom_ops  # noqa: F401 - loads torch.ops._C
        from vllm.v1.attention.backends import fa_utils
    except Exception as e:  # noqa: BLE001 - any import problem means "not available"
        return f"vLLM's CUDA ops do not import ({type(e).__name__}: {e})"
    missing = [n for n in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")
               if not hasattr(torch.ops._C, n)]
    if missing:
        return f"vLLM's _C library lacks {missing}"
    try:
        version = fa_utils.get_flash_attn_version()
    except Exception as e:  # noqa: BLE001
        return f"vLLM's flash-attention is not usable ({type(e).__name__}: {e})"
    if version is None:
        return "vLLM's flash-attention does not support this GPU"
    _STATE["fa"] = fa_utils
    _STATE["fa_version"] = version
    return None


def unavailable_reason() -> str | None:
    """None when :func:`available`, else the reason (for errors that name what is missing)."""
    if "reason" not in _STATE:
        _STATE["reason"] = _probe()
    return _STATE["reason"]


def flash_attention_module() -> tuple:
    """(vLLM's flash-attention module, its FA version): the kernels vLLM's FlashAttention backend calls."""
    if not available():
        raise RuntimeError(f"GPU vLLM attention is not available: {unavailable_reason()}")
    return _STATE["fa"], _STATE["fa_version"]


# The RMSNorm choices of GPU engines and of the trainer's vLLM-matched forward (policy.jet_rl.cuda_norms):
# one batch-invariant kernel in both (rollout/invariant_norm.py), or vLLM's own norm kernels
CUDA_NORMS = ("batch_invariant", "vllm")


def available() -> bool:
    """Whether GPU vLLM's CUDA ops (norms, rotary, SiLU-and-mul, flash attention) can be called in this process."""
    return unavailable_reason() is None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """vLLM's plain RMSNorm kernel (layer 0's input norm, q/k norms): ``bf16(bf16(x * rstd) * w)`` per row."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops._C.rms_norm(out, x.contiguous(), weight, eps)
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """vLLM's fused add + RMSNorm on copies: (normalised ``bf16(x + residual)``, ``bf16(x + residual)``)."""
    out = x.contiguous().clone()
    res = residual.contiguous().clone()
    torch.ops._C.fused_add_rms_norm(out, res, weight, eps)
    return out, res


def fused_rms_norm_of_sum(s: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The fused kernel's normalised output for a residual sum ``s`` the caller already rounded to BF16: the kernel
    on ``(s, zeros)`` forms ``s + 0 = s`` and normalises it with its own reduction (one copy of ``s``, one zero
    buffer the kernel overwrites, no further copies)."""
    out = s.contiguous().clone()
    torch.ops._C.fused_add_rms_norm(out, torch.zeros_like(out), weight, eps)
    return out


def rope_neox_(positions: Tensor, q: Tensor, k: Tensor, head_size: int, cos_sin_cache: Tensor) -> None:
    """vLLM's neox rotary kernel in place on q (tokens, heads * head_size) and k (tokens, groups * head_size)."""
    torch.ops._C.rotary_embedding(positions, q, k, head_size, cos_sin_cache, True)


def silu_and_mul(x: Tensor) -> Tensor:
    """vLLM's SiLU-and-mul kernel: (..., 2d) ``[gate | up]`` -> (..., d) ``bf16(bf16(silu(gate)) * up)``."""
    d = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    torch.ops._C.silu_and_mul(out, x.contiguous())
    return out


def rope_cache(head_dim: int, max_positions: int, theta: float, scaling: dict | None, device: torch.device
               ) -> Tensor:
    """vLLM's BF16 ``cat(cos, sin)`` table (max_positions, head_dim), computed by vLLM's own rotary classes on
    ``device``, as vLLM's model loader computes it inside a ``torch.device`` context (so cos/sin are the GPU's).

    Why not ``get_rope``: that runs the CustomOp constructor, which needs a live engine config; the table itself
    comes from two plain methods (``_compute_inv_freq``, ``_compute_cos_sin_cache``), run here on an instance of
    vLLM's class holding just the attributes they read (``nn.Module.__init__`` only, no CustomOp set-up)."""
    from vllm.model_executor.layers.rotary_embedding import Llama3RotaryEmbedding, RotaryEmbedding

    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    cls = {"default": RotaryEmbedding, "llama3": Llama3RotaryEmbedding}.get(kind)
    if cls is None:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
    rope = cls.__new__(cls)
    torch.nn.Module.__init__(rope)
    rope.base, rope.rotary_dim, rope.max_position_embeddings = theta, head_dim, max_positions
    if kind == "llama3":
        rope.scaling_factor = float(scaling["factor"])
        rope.low_freq_factor = float(scaling["low_freq_factor"])
        rope.high_freq_factor = float(scaling["high_freq_factor"])
        rope.orig_max_position = int(scaling["original_max_position_embeddings"])
    with torch.device(device):
        cache = rope._compute_cos_sin_cache()
    return cache.to(torch.bfloat16)


@dataclass
class PagedLayout:
    """One batch's paged KV-cache layout, as vLLM's block manager gives fresh requests: one run of ``block_size``-token
    blocks per sequence, each token's cache slot, and FA3's ahead-of-time schedule per head configuration.

    Why an object: it depends only on the batch's sequence lengths, so it is built once per micro-batch and shared
    by every layer (vLLM, too, builds its attention metadata once per step); built per layer it cost host syncs and
    small kernels in each of a model's layers."""

    cu_seqlens: Tensor  # (b + 1,) int32 start offsets of the packed sequences
    lens: Tensor  # (b,) int32
    max_seqlen: int
    block_table: Tensor  # (b, max blocks) int32, rows padded with block 0 (never read)
    slot: Tensor  # (T,) int64 cache slot of each packed token
    total_blocks: int
    block_size: int
    # which tokens vLLM computed in decode steps (None: all in prefill, as vLLM re-scores whole sequences)
    decode: DecodeSplit | None = None
    _schedules: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, cu_seqlens: Tensor, max_seqlen: int, block_size: int = KV_BLOCK, decode_from: Tensor | None = None,
              decode_num_splits: int = 1) -> PagedLayout:
        """``decode_from`` (b,): per sequence, the first position whose query vLLM ran as a decode step (its prompt
        length: the prompt is prefilled, every later token is the query of one decode step); None: none."""
        cu = cu_seqlens.to(torch.int32)
        dev = cu.device
        lens = cu[1:] - cu[:-1]
        blocks_per_seq = (lens + block_size - 1) // block_size
        nseq = lens.shape[0]
        # one host read per batch: the token and block totals size the slot map and the cache
        total_tokens, total_blocks = (int(x) for x in torch.stack((cu[-1], blocks_per_seq.sum())).tolist())
        first_block = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
        col = torch.arange(-(-max_seqlen // block_size), device=dev, dtype=torch.int32)
        block_table = torch.where(col[None, :] < blocks_per_seq[:, None], first_block[:, None] + col[None, :], 0)
        block_table = block_table.to(torch.int32).contiguous()
        # slot of token i of sequence j: block_table[j, i // bs] * bs + i % bs
        seq_of = torch.repeat_interleave(torch.arange(nseq, device=dev), lens.long(), output_size=total_tokens)
        pos = torch.arange(total_tokens, device=dev, dtype=torch.int32) - cu[:-1][seq_of]
        slot = block_table[seq_of, (pos // block_size).long()].long() * block_size + (pos % block_size).long()
        decode = None
        if decode_from is not None:
            decode = DecodeSplit.build(cu, lens, decode_from.to(device=dev, dtype=torch.int32), seq_of, pos,
                                       block_table, decode_num_splits)
        return cls(cu.contiguous(), lens.contiguous(), int(max_seqlen), block_table, slot, total_blocks, block_size,
                   decode)

    def schedule(self, fa, heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype, part: str = "all"
                 ) -> Tensor:
        """FA3's scheduler metadata for one call over this batch and head configuration: ``all`` every token as
        prefill (``num_splits=0``: FA3's own split heuristic, what vLLM's builder passes for a batch larger than its
        CUDA-graph capture sizes), ``prefill`` the prompts, ``decode`` one query per decode token."""
        key = (part, heads_q, heads_kv, head_dim, dtype)
        if key not in self._schedules:
            d = self.decode
            batch, cu_q, used, max_q, max_k, splits = {
                "all": (self.lens.shape[0], self.cu_seqlens, self.lens, self.max_seqlen, self.max_seqlen, 0),
                "prefill": None if d is None else (self.lens.shape[0], d.prefill_cu, d.prefill_lens, d.prefill_max,
                                                   d.prefill_max, 0),
                "decode": None if d is None else (d.decode_rows.shape[0], d.decode_cu, d.decode_used, 1,
                                                  d.decode_max, d.num_splits),
            }[part]
            self._schedules[key] = fa.get_scheduler_metadata(
                batch_size=batch, max_seqlen_q=max_q, max_seqlen_k=max_k, num_heads_q=heads_q, num_heads_kv=heads_kv,
                headdim=head_dim, cache_seqlens=used, qkv_dtype=dtype, cu_seqlens_q=cu_q, page_size=self.block_size,
                causal=True, window_size=(-1, -1), num_splits=splits)
        return self._schedules[key]


@dataclass
class DecodeSplit:
    """The tokens of a batch as vLLM computed them while sampling: each prompt in one prefill (its queries over the
    prompt), every later token as the query of one decode step (over the sequence up to itself: ``seqused_k`` its
    position + 1, the sequence's blocks, one query per "sequence" of the call, ``num_splits`` as the engine's decode
    runs: 1 under CUDA graphs with ``attention_config.flash_attn_max_num_splits_for_cuda_graph: 1``).

    Why: the first response token's logprob comes from the prefill's last position, every later one from a decode
    step, and FA3's decode call need not give a query the bytes its prefill call gives (bench/decode_invariance.py
    measures it)."""

    prefill_rows: Tensor  # (Tp,) packed rows of prompt tokens, sequence by sequence
    prefill_cu: Tensor  # (b + 1,) int32 offsets of the prompts among those rows
    prefill_lens: Tensor  # (b,) int32
    prefill_max: int
    decode_rows: Tensor  # (Td,) packed rows of the decode-step queries
    decode_cu: Tensor  # (Td + 1,) int32: one query per call "sequence"
    decode_used: Tensor  # (Td,) int32 KV length each query reads (its position + 1)
    decode_table: Tensor  # (Td, max blocks) int32: its sequence's block-table row
    decode_max: int
    num_splits: int

    @classmethod
    def build(cls, cu: Tensor, lens: Tensor, decode_from: Tensor, seq_of: Tensor, pos: Tensor, block_table: Tensor,
              num_splits: int) -> DecodeSplit:
        if decode_from.shape != lens.shape:
            raise ValueError(f"decode_from has shape {tuple(decode_from.shape)}, expected ({lens.shape[0]},)")
        if bool((decode_from < 1).any()):
            raise ValueError(f"decode_from must be >= 1 (a prompt has a token), got {decode_from.tolist()}")
        prefill_lens = torch.minimum(decode_from, lens).to(torch.int32)
        is_decode = pos >= decode_from[seq_of]
        prefill_rows = (~is_decode).nonzero().squeeze(1)
        decode_rows = is_decode.nonzero().squeeze(1)
        prefill_cu = torch.zeros_like(cu)
        prefill_cu[1:] = torch.cumsum(prefill_lens, 0)
        used = (pos[decode_rows] + 1).to(torch.int32)
        n_dec = decode_rows.shape[0]
        prefill_max, decode_max = (int(x) for x in torch.stack(
            (prefill_lens.max(), used.max() if n_dec else prefill_lens.max())).tolist())
        return cls(prefill_rows, prefill_cu, prefill_lens, prefill_max, decode_rows,
                   torch.arange(n_dec + 1, dtype=torch.int32, device=cu.device), used,
                   block_table[seq_of[decode_rows]].contiguous(), decode_max, int(num_splits))


class PrefillAttention:
    """vLLM's prefill attention call: causal FlashAttention over a paged BF16 KV cache.

    ``__call__(q, k, v, layout, scale)`` with packed q (T, h, d), k/v (T, g, d) and the batch's
    :class:`PagedLayout` returns (out (T, h, d), lse (h, T) FP32). K/V are written into a fresh cache of the
    layout's blocks and the kernel reads them through the block table with FA3's scheduler metadata, as vLLM's
    prefill does.
    """

    def __init__(self) -> None:
        if not available():
            raise RuntimeError(f"GPU vLLM attention is not available: {unavailable_reason()}")
        self.fa, self.fa_version = flash_attention_module()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layout: PagedLayout, scale: float) -> tuple[Tensor, Tensor]:
        t, h, d = q.shape
        g = k.shape[1]
        if layout.slot.shape[0] != t:
            raise ValueError(f"the layout holds {layout.slot.shape[0]} tokens, q has {t}")
        bs = layout.block_size
        k_cache = k.new_zeros(layout.total_blocks * bs, g, d)
        v_cache = v.new_zeros(layout.total_blocks * bs, g, d)
        k_cache[layout.slot] = k
        v_cache[layout.slot] = v
        k_cache = k_cache.view(layout.total_blocks, bs, g, d)
        v_cache = v_cache.view(layout.total_blocks, bs, g, d)
        if layout.decode is None:
            return self._call(q, k_cache, v_cache, layout, scale, "all", layout.cu_seqlens, layout.max_seqlen,
                              layout.lens, layout.max_seqlen, layout.block_table, 0)
        dec = layout.decode
        out = torch.empty_like(q)
        lse = torch.empty(h, t, dtype=torch.float32, device=q.device)
        for part, rows, cu_q, max_q, used, max_k, table, splits in (
                ("prefill", dec.prefill_rows, dec.prefill_cu, dec.prefill_max, dec.prefill_lens, dec.prefill_max,
                 layout.block_table, 0),
                ("decode", dec.decode_rows, dec.decode_cu, 1, dec.decode_used, dec.decode_max, dec.decode_table,
                 dec.num_splits)):
            if rows.shape[0] == 0:
                continue
            o, s = self._call(q.index_select(0, rows), k_cache, v_cache, layout, scale, part, cu_q, max_q, used,
                              max_k, table, splits)
            out.index_copy_(0, rows, o)
            lse.index_copy_(1, rows, s)
        return out, lse

    def _call(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, layout: PagedLayout, scale: float, part: str,
              cu_q: Tensor, max_q: int, used: Tensor, max_k: int, table: Tensor, splits: int) -> tuple[Tensor, Tensor]:
        """One FA3 call as vLLM's attention backend makes it (varlen queries, paged causal KV, scheduler metadata)."""
        h, d, g = q.shape[1], q.shape[2], k_cache.shape[2]
        meta = layout.schedule(self.fa, h, g, d, q.dtype, part) if self.fa_version == 3 else None
        out = torch.empty_like(q)
        _, lse = self.fa.flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=used,
            max_seqlen_k=max_k, softmax_scale=scale, causal=True, window_size=None, block_table=table, softcap=0.0,
            scheduler_metadata=meta, fa_version=self.fa_version, num_splits=splits, return_softmax_lse=True)
        return out, lse


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """GPU vLLM's processed logprobs of ``tokens`` (N,) under BF16 ``logits`` (N, V): its model runner's (V2, the
    0.26 default) temperature kernel (FP32 division stored back to BF16; skipped at 0 and 1) and its Triton
    log-softmax kernel (FP32, 1024-wide blocks). Returns (N,) FP32; ``logits`` is not modified."""
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (N, V) with unit stride in V, got shape {tuple(logits.shape)}")
    if temperature not in (0.0, 1.0):
        n = logits.shape[0]
        logits = logits.clone()
        apply_temperature(logits, torch.zeros(n, dtype=torch.int32, device=logits.device),
                          torch.tensor([temperature], dtype=torch.float32, device=logits.device))
    return compute_token_logprobs(logits, tokens.reshape(-1, 1)).reshape(-1)
