"""HF <-> Megatron layout math, checked against direct constructions written independently in the tests."""

import types

import pytest
import torch

from jetrl_megatron.model import layout as L
from jetrl_megatron.model.shapes import PRESETS, ModelShape

SMALL = ModelShape(name="small", family="qwen3", hidden_size=48, num_layers=8, num_attention_heads=8, num_kv_heads=2,
                   head_dim=4, ffn_hidden_size=24, vocab_size=50, rms_norm_eps=1e-6, rope_theta=1e4,
                   rope_scaling=None, tie_word_embeddings=False, qk_norm=True, qkv_bias=True,
                   max_position_embeddings=64)


def _direct_interleave(q, k, v, nh, ng):
    """Group by group: p query heads, then the group's k head, then its v head."""
    p, rph = nh // ng, q.shape[0] // nh
    parts = []
    for g in range(ng):
        parts.append(q[g * p * rph:(g + 1) * p * rph])
        parts.append(k[g * rph:(g + 1) * rph])
        parts.append(v[g * rph:(g + 1) * rph])
    return torch.cat(parts)


@pytest.mark.parametrize("nh,ng,rph", [(8, 2, 4), (4, 4, 3), (6, 1, 2), (32, 8, 1)])
def test_qkv_interleave_matches_direct(nh, ng, rph):
    g = torch.Generator().manual_seed(nh * 100 + ng)
    q = torch.randn(nh * rph, 5, generator=g)
    k = torch.randn(ng * rph, 5, generator=g)
    v = torch.randn(ng * rph, 5, generator=g)
    fused = L.qkv_interleave(q, k, v, nh, ng, rph)
    assert torch.equal(fused, _direct_interleave(q, k, v, nh, ng))
    assert torch.equal(L.qkv_interleave(q, k, v, nh, ng), fused)  # rows_per_head inferred
    q2, k2, v2 = L.qkv_deinterleave(fused, nh, ng)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    # 1-D (bias) works too
    qb, kb, vb = q[:, 0].contiguous(), k[:, 0].contiguous(), v[:, 0].contiguous()
    assert torch.equal(L.qkv_interleave(qb, kb, vb, nh, ng), _direct_interleave(qb, kb, vb, nh, ng))


def test_qkv_slots_match_documented_example():
    # Qwen3-8B: q8..11 -> slots 12..15, k2 -> 16, v2 -> 17 (RESHARD notes worked example)
    assert [L.qkv_slot_of_q(j, 32, 8) for j in range(8, 12)] == [12, 13, 14, 15]
    assert L.qkv_slot_of_k(2, 32, 8) == 16 and L.qkv_slot_of_v(2, 32, 8) == 17


def test_qkv_on_weights_and_block_scales_agree():
    """Interleaving the weight rows and interleaving its 128-row block scales (rows_per_head=1) move blocks alike."""
    nh, ng, hd = 4, 2, 128
    ids = torch.arange((nh + 2 * ng) * 2, dtype=torch.float32).reshape(nh + 2 * ng, 2)  # id per (row blk, col blk)
    full = ids.repeat_interleave(128, 0).repeat_interleave(128, 1)  # weight whose block (i,j) holds its id
    q, k, v = full[:nh * hd], full[nh * hd:(nh + ng) * hd], full[(nh + ng) * hd:]
    sq, sk, sv = ids[:nh], ids[nh:nh + ng], ids[nh + ng:]
    fw = L.qkv_interleave(q, k, v, nh, ng, hd)
    fs = L.qkv_interleave(sq, sk, sv, nh, ng, hd // 128)
    assert torch.equal(fw[::128, ::128], fs)


def test_splits_and_fc1():
    g = torch.Generator().manual_seed(1)
    # small integers: every product and sum is exact, so matmuls of different shapes compare bit for bit
    gate = torch.randint(-8, 8, (24, 6), generator=g).double()
    up = torch.randint(-8, 8, (24, 6), generator=g).double()
    x = torch.randint(-8, 8, (3, 6), generator=g).double()
    tp = 4
    shards = [L.fc1_shard(gate, up, tp, r) for r in range(tp)]
    for r, s in enumerate(shards):
        # Megatron's forward chunks the local fc1 output in two: first half gate, second half up
        yg, yu = torch.chunk(x @ s.T, 2, dim=-1)
        assert torch.equal(yg, x @ gate[r * 6:(r + 1) * 6].T) and torch.equal(yu, x @ up[r * 6:(r + 1) * 6].T)
    g2, u2 = L.fc1_unshard(shards)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    w = torch.randn(6, 24, generator=g)
    assert torch.equal(L.cat_cols([L.split_cols(w, tp, r) for r in range(tp)]), w)
    assert torch.equal(L.split_cols(w, 3, 1), w[:, 8:16])
    with pytest.raises(ValueError, match="not divisible"):
        L.split_rows(torch.zeros(10, 2), 4, 0, "gate_proj")


def test_padded_vocab():
    assert [L.padded_vocab_size(151936, t) for t in (1, 2, 4, 8)] == [151936, 152064, 152064, 152576]
    assert [L.padded_vocab_size(128256, t) for t in (1, 2, 4, 8)] == [128256, 128256, 128512, 129024]
    assert L.padded_vocab_size(152064, 4) == 152064 and L.padded_vocab_size(128, 2) == 256
    e = torch.randn(50, 3)
    p = L.pad_vocab_rows(e, L.padded_vocab_size(50, 2, divisible_by=8))
    assert p.shape[0] == 64 and torch.equal(p[:50], e) and not p[50:].any()
    assert torch.equal(L.trim_vocab_rows(p, 50), e)


def _megatron_offset(num_layers, pp, pp_rank, vp, vp_stage):
    mod = pytest.importorskip("megatron.core.transformer.transformer_layer")
    cfg = types.SimpleNamespace(
        num_layers=num_layers, pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=None,
        num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
        account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
        virtual_pipeline_model_parallel_size=vp)
    return mod.get_transformer_layer_offset(cfg, vp_stage=vp_stage if vp else None, pp_rank=pp_rank)


@pytest.mark.parametrize("num_layers,pp,vp", [(32, 2, 2), (36, 4, None), (64, 4, 2), (28, 1, None), (40, 2, None)])
def test_pp_ranges_match_megatron_core(num_layers, pp, vp):
    seen = []
    for vs in range(vp or 1):
        for r in range(pp):
            rng = L.pp_layer_range(num_layers, pp, r, vp, vs)
            assert rng.start == _megatron_offset(num_layers, pp, r, vp, vs)
            for local, g in enumerate(rng):
                assert L.pp_stage_of_layer(g, num_layers, pp, vp) == (r, vs, local)
            seen += list(rng)
    assert sorted(seen) == list(range(num_layers))
    assert L.pp_layer_range(32, 2, 1, 2, 0) == range(8, 16) and L.pp_layer_range(32, 2, 0, 2, 1) == range(16, 24)
    with pytest.raises(ValueError, match="uneven"):
        L.pp_layer_range(36, 8, 0)


def test_name_maps():
    maps = L.stage_param_maps(SMALL, pp=2, pp_rank=1)
    names = [m.megatron for m in maps]
    assert names[0] == "decoder.layers.0.input_layernorm.weight"
    assert maps[0].hf == ("model.layers.4.input_layernorm.weight",)
    assert "output_layer.weight" in names and "embedding.word_embeddings.weight" not in names
    qkv_b = [m for m in maps if m.megatron == "decoder.layers.0.self_attention.linear_qkv.bias"][0]
    assert qkv_b.hf == tuple(f"model.layers.4.self_attn.{x}_proj.bias" for x in "qkv") and not qkv_b.gemm
    assert sum(m.gemm for m in maps) == 4 * 4
    tied = L.stage_param_maps(PRESETS["qwen3-0.6b"], pp=2, pp_rank=1)
    assert "output_layer.weight" not in [m.megatron for m in tied]
    llama = L.layer_param_maps(PRESETS["llama3.1-8b"], 3)
    assert not any("layernorm.weight" in m.megatron and "self_attention" in m.megatron for m in llama)
    assert L.split_megatron_layer_name("decoder.layers.3.mlp.linear_fc1.weight") == (3, "mlp.linear_fc1.weight")
    assert L.megatron_name_to_global("decoder.layers.3.mlp.linear_fc1.weight", 10).startswith("decoder.layers.13.")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_whole_model_round_trip_random(tp):
    """HF tensors -> Megatron shards -> HF is exact for every parameter kind; shards match direct slicing."""
    gen = torch.Generator().manual_seed(tp)
    s = SMALL
    hf = {}
    for m in L.stage_param_maps(s):
        for name in m.hf:
            if "embed" in name or "lm_head" in name:
                shp = (s.vocab_size, s.hidden_size)
            elif "q_proj" in name:
                shp = (s.q_size,) + ((s.hidden_size,) if name.endswith("weight") else ())
            elif "k_proj" in name or "v_proj" in name:
                shp = (s.kv_size,) + ((s.hidden_size,) if name.endswith("weight") else ())
            elif "o_proj" in name:
                shp = (s.hidden_size, s.q_size)
            elif "gate" in name or "up_proj" in name:
                shp = (s.ffn_hidden_size, s.hidden_size)
            elif "down" in name:
                shp = (s.hidden_size, s.ffn_hidden_size)
            elif "q_norm" in name or "k_norm" in name:
                shp = (s.head_dim,)
            else:
                shp = (s.hidden_size,)
            hf[name] = torch.randn(shp, generator=gen)
    for m in L.stage_param_maps(s):
        src = [hf[n] for n in m.hf]
        shards = [L.hf_to_megatron_shard(m, src, s, tp, r, padded_vocab=L.padded_vocab_size(s.vocab_size, tp, 8))
                  for r in range(tp)]
        back = L.megatron_shards_to_hf(m, shards, s)
        for a, b in zip(back, src, strict=True):
            assert torch.equal(a, b), m.megatron
        if m.kind == L.ROW_PARALLEL:
            w = src[0].shape[1] // tp
            assert torch.equal(shards[tp - 1], src[0][:, (tp - 1) * w:])
        if m.kind == L.QKV and tp == 2:
            # rank 1 holds group 1: q heads 4..7, k_1, v_1 (ng=2, p=4)
            rph = s.head_dim
            q, k, v = src
            want = torch.cat([q[4 * rph:8 * rph], k[rph:2 * rph], v[rph:2 * rph]])
            assert torch.equal(shards[1], want)
