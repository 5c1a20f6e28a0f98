"""Block fingerprint test: every 128x128 block (one unique id, its scale the same id) lands where predicted.

Works in block units (a stand-in "weight" of shape (row blocks, col blocks) holding one id per block), so all
(train TP, rollout TP) in {1,2,4,8}^2 x PP {1,2,4} over six real model shapes run in seconds. The expected vLLM
tensors are built here directly from vLLM's documented layout ([q_r; k_r; v_r] with KV replication, [gate_r; up_r],
column split of o/down), independently of the resharder's addressing code.
"""

import dataclasses
import itertools

import pytest
import torch

from jetrl_megatron.model.shapes import PRESETS
from jetrl_megatron.reshard import (
    MegatronShards,
    ReshardError,
    check_reshard,
    megatron_address,
    megatron_from_canonical,
    validate_reshard,
    vllm_addresses,
    vllm_layer_tensors,
)
from jetrl_megatron.reshard.addressing import PROJECTIONS, proj_blocks

MODELS = ["qwen3-0.6b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "llama3.1-8b", "qwen2.5-7b"]
TPS = [1, 2, 4, 8]
LAYERS = 4  # enough for PP 4; the layer structure is identical for every layer


def _canonical_ids(shape):
    """HF-named block-unit stand-ins: weight (int32 id per block) and scale (the same id as float32)."""
    canon, next_id = {}, 1
    for layer in range(shape.num_layers):
        for proj in PROJECTIONS:
            rb, cb = proj_blocks(shape, proj)
            ids = torch.arange(next_id, next_id + rb * cb, dtype=torch.int32).reshape(rb, cb)
            next_id += rb * cb
            name = f"model.layers.{layer}.{'self_attn' if proj in 'qkvo' else 'mlp'}.{proj}_proj.weight"
            canon[name] = ids
            canon[name + "_scale_inv"] = ids.float()
        p = f"model.layers.{layer}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            canon[p + n] = torch.full((2,), layer, dtype=torch.int16)
        if shape.qk_norm:
            canon[p + "self_attn.q_norm.weight"] = torch.full((2,), -layer, dtype=torch.int16)
            canon[p + "self_attn.k_norm.weight"] = torch.full((2,), 100 + layer, dtype=torch.int16)
        if shape.qkv_bias:
            for x in "qkv":
                rb = proj_blocks(shape, x)[0]
                canon[p + f"self_attn.{x}_proj.bias"] = -torch.arange(next_id, next_id + rb, dtype=torch.int32)
                next_id += rb
    vocab = torch.arange(shape.vocab_size, dtype=torch.int32).reshape(-1, 1)
    canon["model.embed_tokens.weight"] = vocab
    canon["model.norm.weight"] = torch.ones(2, dtype=torch.int16)
    if not shape.tie_word_embeddings:
        canon["lm_head.weight"] = -vocab
    return canon


def _expected_vllm_layer(shape, canon, layer, tp, rank):
    """vLLM's layout written out directly from its documented semantics."""
    p = f"model.layers.{layer}."
    nh, ng = shape.num_attention_heads, shape.num_kv_heads
    bph = shape.head_dim // 128
    hq = nh // tp
    if tp >= ng:
        kv_heads = [rank // (tp // ng)]
    else:
        kv_heads = list(range(rank * ng // tp, (rank + 1) * ng // tp))

    def heads(t, hs):
        return torch.cat([t[h * bph:(h + 1) * bph] for h in hs])

    out = {}
    for suffix in (".weight", ".weight_scale_inv", ".bias"):
        qn = p + "self_attn.q_proj" + suffix
        if qn not in canon:
            continue
        q, k, v = canon[qn], canon[p + "self_attn.k_proj" + suffix], canon[p + "self_attn.v_proj" + suffix]
        out[p + "self_attn.qkv_proj" + suffix] = torch.cat(
            [q[rank * hq * bph:(rank + 1) * hq * bph], heads(k, kv_heads), heads(v, kv_heads)])
        if suffix == ".bias":
            continue
        o = canon[p + "self_attn.o_proj" + suffix]
        w = o.shape[1] // tp
        out[p + "self_attn.o_proj" + suffix] = o[:, rank * w:(rank + 1) * w]
        g, u = canon[p + "mlp.gate_proj" + suffix], canon[p + "mlp.up_proj" + suffix]
        f = g.shape[0] // tp
        out[p + "mlp.gate_up_proj" + suffix] = torch.cat([g[rank * f:(rank + 1) * f], u[rank * f:(rank + 1) * f]])
        d = canon[p + "mlp.down_proj" + suffix]
        w = d.shape[1] // tp
        out[p + "mlp.down_proj" + suffix] = d[:, rank * w:(rank + 1) * w]
    return out


def _check_addresses(shape, src: MegatronShards, vllm_by_rank, train_tp, rollout_tp, canon):
    """Every block of layer 0 sits at megatron_address / vllm_addresses (checked a whole block row at a time)."""
    p = "model.layers.0."
    for proj in PROJECTIONS:
        name = f"{p}{'self_attn' if proj in 'qkvo' else 'mlp'}.{proj}_proj.weight"
        ids = canon[name]
        row_split = proj not in ("o", "down")
        n_split = ids.shape[0] if row_split else ids.shape[1]
        for b in range(n_split):
            want = ids[b] if row_split else ids[:, b]
            m = megatron_address(shape, train_tp, proj, b)
            mt = src.states[(0, 0, m.rank)][f"decoder.layers.0.{m.param}.weight"]
            got = mt[m.index] if row_split else mt[:, m.index]
            assert torch.equal(got, want), (proj, b, m)
            ms = src.states[(0, 0, m.rank)][f"decoder.layers.0.{m.param}.weight_scale_inv"]
            assert torch.equal((ms[m.index] if row_split else ms[:, m.index]), want.float())
            dests = vllm_addresses(shape, rollout_tp, proj, b)
            if proj in ("k", "v") and rollout_tp > shape.num_kv_heads:
                assert len(dests) == rollout_tp // shape.num_kv_heads
            for a in dests:
                vt = vllm_by_rank[a.rank][f"{p}{a.param}.weight"]
                assert torch.equal(vt[a.index] if row_split else vt[:, a.index], want), (proj, b, a)


@pytest.mark.parametrize("model", MODELS)
def test_block_fingerprint_all_layouts(model):
    base = PRESETS[model]
    shape = dataclasses.replace(base, num_layers=LAYERS)
    canon = _canonical_ids(shape)
    checked = refused = 0
    for train_tp, rollout_tp, pp in itertools.product(TPS, TPS, (1, 2, 4)):
        violations = check_reshard(base, train_tp, pp, rollout_tp)
        expect_refusal = model == "qwen2.5-7b" and 8 in (train_tp, rollout_tp)
        assert bool(violations) == expect_refusal, (train_tp, rollout_tp, pp, violations)
        if expect_refusal:
            refused += 1
            text = " ".join(str(v) for v in violations)
            assert "28 attention heads are not divisible" in text and "2368 rows per rank" in text
            with pytest.raises(ReshardError, match="cannot reshard qwen2.5-7b"):
                validate_reshard(base, train_tp, pp, rollout_tp)
            continue
        src = megatron_from_canonical(canon, shape, train_tp, pp, block_units=True)
        vllm_by_rank = []
        for rank in range(rollout_tp):
            layers = {}
            for layer in range(LAYERS):
                got = vllm_layer_tensors(src, layer, rollout_tp, rank)
                want = _expected_vllm_layer(shape, canon, layer, rollout_tp, rank)
                for name, t in want.items():
                    assert torch.equal(got[name], t), (model, train_tp, rollout_tp, pp, rank, name)
                # scales land exactly where their weight blocks land
                for name in want:
                    if name.endswith(".weight") and name + "_scale_inv" in got:
                        assert torch.equal(got[name].float(), got[name + "_scale_inv"])
                layers.update(got)
            vllm_by_rank.append(layers)
        if pp == 1:
            _check_addresses(shape, src, vllm_by_rank, train_tp, rollout_tp, canon)
        checked += 1
    assert checked + refused == 48
    assert refused == (21 if model == "qwen2.5-7b" else 0)  # 7 (tp, tp') pairs with an 8, x 3 PP
