"""head_dim 64 (Llama-3.2-1B): the BF16 arms reshard it, the FP8 ones are refused naming the projection.

Why: FP8 tensors move as whole 128x128 blocks (their scales index blocks), and a 128-row block of a head_dim-64
fused QKV straddles heads, so the trainer's FP8 bytes cannot be moved for it. BF16 tensors carry no scales and
move as rows; these tests show those moves are exact (bitwise against the canonical HF tensors) at TP2 -> TP1 and
other layouts, through both the streaming mover and the compiled refit program, and that the preflight's block
rules follow the recipe (arm and BF16 exclusions) instead of the model alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jetrl_megatron.model.shapes import PRESETS, ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard import (
    ReshardError,
    VllmRefitProgram,
    check_reshard,
    iter_canonical,
    iter_vllm_rank,
    megatron_from_canonical,
)
from jetrl_megatron.reshard.addressing import bf16_unit
from jetrl_megatron.reshard.mover import MegatronShards
from jetrl_megatron.reshard.plan import build_plan
from jetrl_megatron.reshard.preflight import fp8_projections

# 4 q heads / 2 KV heads of 64; intermediate 320 = 160 rows per rank at TP 2 (not a 128 multiple either): the BF16
# step is gcd(128, 64, 320, 160) = 32. Vocab 300 is padded by vLLM to 320.
HD64 = ModelShape(name="hd64", family="llama", hidden_size=256, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                  head_dim=64, ffn_hidden_size=320, vocab_size=300, rms_norm_eps=1e-5, rope_theta=5e5,
                  rope_scaling=None, tie_word_embeddings=False, qk_norm=False, qkv_bias=False,
                  max_position_embeddings=64)
# The published Llama-3.2-1B geometry (hidden 2048, 32 q / 8 KV heads of 64, intermediate 8192, tied embeddings).
LLAMA32_1B = dataclasses.replace(PRESETS["llama3.1-8b"], name="llama3.2-1b", hidden_size=2048, num_layers=16,
                                 num_attention_heads=32, num_kv_heads=8, head_dim=64, ffn_hidden_size=8192,
                                 tie_word_embeddings=True)


def _canonical(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random BF16 HF-named tensors, with NaN / -0.0 payloads that only a byte move keeps."""
    g = torch.Generator().manual_seed(seed)
    h, f = shape.hidden_size, shape.ffn_hidden_size
    sizes = {"self_attn.q_proj": (shape.q_size, h), "self_attn.k_proj": (shape.kv_size, h),
             "self_attn.v_proj": (shape.kv_size, h), "self_attn.o_proj": (h, shape.q_size),
             "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    out: dict[str, torch.Tensor] = {}

    def rnd(*shp: int) -> torch.Tensor:
        return torch.randn(*shp, generator=g).to(torch.bfloat16)

    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        for name, shp in sizes.items():
            out[p + name + ".weight"] = rnd(*shp)
        out[p + "input_layernorm.weight"] = rnd(h)
        out[p + "post_attention_layernorm.weight"] = rnd(h)
    out["model.layers.0.self_attn.k_proj.weight"][63, 5] = float("nan")   # last row of KV head 0
    out["model.layers.1.self_attn.v_proj.weight"][64, 0] = -0.0          # first row of KV head 1
    out["model.embed_tokens.weight"] = rnd(shape.vocab_size, h)
    out["model.norm.weight"] = rnd(h)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = rnd(shape.vocab_size, h)
    return out


def _vllm_reference(shape: ModelShape, canon: dict[str, torch.Tensor], tp: int, rank: int,
                    ) -> dict[str, torch.Tensor]:
    """vLLM rank `rank`'s tensors cut straight from the canonical ones (TP <= KV heads: no replication)."""
    hd, f = shape.head_dim, shape.ffn_hidden_size // tp
    q, kv = shape.num_attention_heads // tp * hd, shape.num_kv_heads // tp * hd
    out: dict[str, torch.Tensor] = {}
    rows = slice(rank * 320 // tp, (rank + 1) * 320 // tp)  # vLLM pads the vocab to 320 and splits it evenly

    def vocab(t: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(320, t.shape[1], dtype=t.dtype)
        padded[: shape.vocab_size] = t
        return padded[rows]

    out["model.embed_tokens.weight"] = vocab(canon["model.embed_tokens.weight"])
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."

        def w(name: str, p: str = p) -> torch.Tensor:
            return canon[p + name + ".weight"]

        out[p + "self_attn.qkv_proj.weight"] = torch.cat([
            w("self_attn.q_proj")[rank * q:(rank + 1) * q], w("self_attn.k_proj")[rank * kv:(rank + 1) * kv],
            w("self_attn.v_proj")[rank * kv:(rank + 1) * kv]])
        out[p + "self_attn.o_proj.weight"] = w("self_attn.o_proj")[:, rank * q:(rank + 1) * q]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([w("mlp.gate_proj")[rank * f:(rank + 1) * f],
                                                        w("mlp.up_proj")[rank * f:(rank + 1) * f]])
        out[p + "mlp.down_proj.weight"] = w("mlp.down_proj")[:, rank * f:(rank + 1) * f]
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = canon[p + n]
    out["model.norm.weight"] = canon["model.norm.weight"]
    out["lm_head.weight"] = vocab(canon["lm_head.weight"])
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16),
                                                                     b.contiguous().view(torch.int16))


@pytest.mark.parametrize("train_tp, pp, rollout_tp", [(2, 1, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_bf16_head_dim_64_reshards_bitwise(train_tp: int, pp: int, rollout_tp: int) -> None:
    """Megatron TP x PP BF16 shards -> every vLLM rank, streamed and compiled, equal the canonical cut byte for byte;
    the canonical export of the shards equals the canonical tensors."""
    canon = _canonical(HD64, seed=train_tp * 10 + pp + rollout_tp)
    src = megatron_from_canonical(canon, HD64, train_tp, pp)
    assert bf16_unit(HD64, train_tp, rollout_tp) == 32
    for rank in range(rollout_tp):
        want = _vllm_reference(HD64, canon, rollout_tp, rank)
        got = dict(iter_vllm_rank(src, rollout_tp, rank))
        assert set(got) == set(want)
        for name, t in want.items():
            assert _same_bytes(got[name], t), (name, rank)
        dst = {k: torch.full_like(v, 3.0) for k, v in want.items()}
        ran = VllmRefitProgram(src, rollout_tp, rank, dst=dst).run()
        for name, t in want.items():
            assert ran[name] is dst[name] and _same_bytes(ran[name], t), (name, rank, "program")
    back = dict(iter_canonical(src))
    assert set(back) == set(canon) and all(_same_bytes(back[k], v) for k, v in canon.items())


def test_fp8_sources_at_head_dim_64_are_refused_before_any_move() -> None:
    """A trainer FP8 fused QKV (weight + scales) of a head_dim-64 model: refused naming the projection and sizes."""
    src = megatron_from_canonical(_canonical(HD64), HD64, 2)
    states = {k: dict(v) for k, v in src.states.items()}
    for state in states.values():
        w = state["decoder.layers.1.self_attention.linear_qkv.weight"]
        state["decoder.layers.1.self_attention.linear_qkv.weight_scale_inv"] = torch.ones(
            -(-w.shape[0] // 128), -(-w.shape[1] // 128))
    fp8 = MegatronShards(HD64, 2, 1, None, states)
    assert fp8.fp8_projections() == {"q", "k", "v"}
    with pytest.raises(ReshardError, match=r"self_attn\.q_proj/k_proj/v_proj: head_dim 64 is not a multiple of 128"):
        next(iter_vllm_rank(fp8, 1, 0))
    with pytest.raises(ReshardError, match="q_size 256, kv_size 128"):
        VllmRefitProgram(fp8, 1, 0)


def test_preflight_block_rules_follow_the_recipe() -> None:
    """Llama-3.2-1B: the BF16 arm passes at every TP that keeps heads whole; jetrl is refused naming q/k/v and what
    to do; BF16-excluded attention lifts the head rule; a self-quantizing rollout needs whole blocks per vLLM rank."""
    shape = LLAMA32_1B

    def viol(mode: str, tp: int, rollout_tp: int, **kw: object) -> list[str]:
        moved, served = fp8_projections(shape, Fp8Recipe(mode=mode, **kw))
        return [str(v) for v in check_reshard(shape, tp, 1, rollout_tp, None, moved, served)]

    for tp in (1, 2, 4, 8):
        assert viol("bf16", tp, tp) == [] and viol("bf16", tp, 1) == []
        assert build_plan(shape, tp, 1, 1, recipe=Fp8Recipe(mode="bf16")).ok
    (msg,) = viol("jetrl", 1, 1)
    assert msg.startswith("[model] self_attn.q_proj/k_proj/v_proj: head_dim 64 is not a multiple of 128")
    assert "no Megatron/vLLM TP keeps them whole" in msg and "bf16 arm" in msg
    assert check_reshard(shape, 1, 1, 1)  # no recipe: every projection FP8 (the export's contract)
    assert viol("jetrl", 2, 1, bf16_module_keywords=("self_attention", "self_attn")) == []
    assert fp8_projections(shape, Fp8Recipe(bf16_module_keywords=("self_attention", "self_attn")))[0] == {
        "gate", "up", "down"}
    assert viol("bf16_train_fp8_rollout", 8, 1) == []       # trainer sends BF16; 512 K/V rows per vLLM rank
    (msg,) = viol("bf16_train_fp8_rollout", 1, 8)          # 1 KV head of 64 rows per vLLM rank
    assert msg == ("[rollout] self_attn.q/k/v_proj: FP8 rows per vLLM rank (k/v 64; head_dim 64) are not whole "
                   "128 blocks")
