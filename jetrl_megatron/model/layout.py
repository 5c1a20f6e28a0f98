"""HF <-> Megatron-Core tensor layout math, in one place (pure torch; no megatron import).

Why one module: the HF<->Megatron checkpoint converter and the FP8 resharder must agree on every permutation
(fused QKV interleave per query group, per-rank [gate_r; up_r] fc1, row/column splits, vocab padding, pipeline
layer offsets). Every function here only moves rows/columns (index/cat/narrow); none does arithmetic on values,
so the same code serves BF16 weights, FP8 weights and their 128x128 block scales (pass rows_per_head = head_dim for
weights and biases, head_dim // 128 for scales, or leave it None to infer it from the tensor's size).

Megatron layouts (Megatron-Core local spec, one TP rank):
  linear_qkv  rows = contiguous TP chunk of the group-interleaved tensor [q_{g*p..g*p+p-1}; k_g; v_g] for g = 0..ng-1
  linear_fc1  rows = [gate_r; up_r] with gate_r / up_r the rank's contiguous F/tp rows of gate / up
  linear_proj, linear_fc2   columns split (row-parallel); embedding / output_layer rows split over the padded vocab
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jetrl_megatron.model.shapes import ModelShape

# ----------------------------------------------------------------------------------------------------------------
# Divisibility helpers


def _divide(n: int, d: int, what: str) -> int:
    if d <= 0 or n % d:
        raise ValueError(f"{what}: {n} is not divisible by {d}")
    return n // d


# ----------------------------------------------------------------------------------------------------------------
# Fused QKV (per query group interleave)


def qkv_slot_of_q(head: int, num_heads: int, num_kv_heads: int) -> int:
    """Head slot (in units of one head) of query head `head` inside Megatron's fused linear_qkv."""
    p = num_heads // num_kv_heads
    return (head // p) * (p + 2) + head % p


def qkv_slot_of_k(group: int, num_heads: int, num_kv_heads: int) -> int:
    p = num_heads // num_kv_heads
    return group * (p + 2) + p


def qkv_slot_of_v(group: int, num_heads: int, num_kv_heads: int) -> int:
    p = num_heads // num_kv_heads
    return group * (p + 2) + p + 1


def qkv_slot_permutation(num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """perm[s] = index of fused slot s in the HF concatenation [q_0..q_{nh-1}; k_0..k_{ng-1}; v_0..v_{ng-1}]."""
    _divide(num_heads, num_kv_heads, "num_attention_heads / num_kv_heads")
    perm = torch.empty(num_heads + 2 * num_kv_heads, dtype=torch.long)
    for j in range(num_heads):
        perm[qkv_slot_of_q(j, num_heads, num_kv_heads)] = j
    for g in range(num_kv_heads):
        perm[qkv_slot_of_k(g, num_heads, num_kv_heads)] = num_heads + g
        perm[qkv_slot_of_v(g, num_heads, num_kv_heads)] = num_heads + num_kv_heads + g
    return perm


def _rows_per_head(t: torch.Tensor, heads: int, rows_per_head: int | None, what: str) -> int:
    if rows_per_head is None:
        return _divide(t.shape[0], heads, f"{what} rows {tuple(t.shape)} per head")
    if t.shape[0] != heads * rows_per_head:
        raise ValueError(f"{what}: expected {heads} heads x {rows_per_head} rows, got shape {tuple(t.shape)}")
    return rows_per_head


def qkv_interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int,
                   rows_per_head: int | None = None) -> torch.Tensor:
    """HF q/k/v (weights, biases or block scales) -> Megatron's full fused linear_qkv (all TP ranks concatenated)."""
    rph = _rows_per_head(q, num_heads, rows_per_head, "q")
    _rows_per_head(k, num_kv_heads, rph, "k")
    _rows_per_head(v, num_kv_heads, rph, "v")
    if not (q.shape[1:] == k.shape[1:] == v.shape[1:]):
        raise ValueError(f"q/k/v trailing shapes differ: {tuple(q.shape)} {tuple(k.shape)} {tuple(v.shape)}")
    hf = torch.cat([q, k, v], dim=0).reshape(num_heads + 2 * num_kv_heads, rph, *q.shape[1:])
    perm = qkv_slot_permutation(num_heads, num_kv_heads).to(hf.device)
    return hf.index_select(0, perm).reshape(-1, *q.shape[1:])


def qkv_deinterleave(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                     rows_per_head: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's full fused linear_qkv -> HF (q, k, v)."""
    slots = num_heads + 2 * num_kv_heads
    rph = _rows_per_head(qkv, slots, rows_per_head, "linear_qkv")
    fused = qkv.reshape(slots, rph, *qkv.shape[1:])
    inv = torch.argsort(qkv_slot_permutation(num_heads, num_kv_heads)).to(qkv.device)
    hf = fused.index_select(0, inv).reshape(-1, *qkv.shape[1:])
    nq, nk = num_heads * rph, num_kv_heads * rph
    return hf[:nq], hf[nq:nq + nk], hf[nq + nk:]


# ----------------------------------------------------------------------------------------------------------------
# Tensor-parallel splits


def split_rows(t: torch.Tensor, tp: int, rank: int, what: str = "tensor") -> torch.Tensor:
    """Rank `rank`'s contiguous row chunk (column-parallel weights, biases, vocab rows)."""
    n = _divide(t.shape[0], tp, f"{what} rows {tuple(t.shape)} over TP {tp}")
    return t.narrow(0, rank * n, n)


def split_cols(t: torch.Tensor, tp: int, rank: int, what: str = "tensor") -> torch.Tensor:
    """Rank `rank`'s contiguous column chunk (row-parallel weights: linear_proj / linear_fc2)."""
    n = _divide(t.shape[1], tp, f"{what} cols {tuple(t.shape)} over TP {tp}")
    return t.narrow(1, rank * n, n)


def cat_rows(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(shards), dim=0)


def cat_cols(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(shards), dim=1)


def fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """HF gate/up (weights or block scales) -> Megatron rank's linear_fc1 rows [gate_r; up_r]."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} shapes differ")
    return torch.cat([split_rows(gate, tp, rank, "gate_proj"), split_rows(up, tp, rank, "up_proj")], dim=0)


def fc1_unshard(shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron linear_fc1 per-rank shards (rank order) -> HF (gate, up)."""
    gates, ups = [], []
    for r, s in enumerate(shards):
        half = _divide(s.shape[0], 2, f"linear_fc1 rank {r} rows {tuple(s.shape)}")
        gates.append(s[:half])
        ups.append(s[half:])
    return torch.cat(gates, 0), torch.cat(ups, 0)


# ----------------------------------------------------------------------------------------------------------------
# Vocab padding (Megatron: padded vocab divisible by make_vocab_size_divisible_by * tp)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def pad_vocab_rows(t: torch.Tensor, padded: int) -> torch.Tensor:
    """Append zero rows up to `padded` (Megatron's padded embedding / output layer)."""
    if t.shape[0] > padded:
        raise ValueError(f"vocab rows {t.shape[0]} exceed padded size {padded}")
    if t.shape[0] == padded:
        return t
    return torch.cat([t, t.new_zeros((padded - t.shape[0], *t.shape[1:]))], dim=0)


def trim_vocab_rows(t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if t.shape[0] < vocab_size:
        raise ValueError(f"vocab rows {t.shape[0]} smaller than vocab_size {vocab_size}")
    return t[:vocab_size]


# ----------------------------------------------------------------------------------------------------------------
# Pipeline-parallel layer ranges


def pp_layer_range(num_layers: int, pp: int, pp_rank: int, vp: int | None = None, vp_stage: int = 0) -> range:
    """Global decoder layer indices held by (pp_rank, vp_stage); even split as Megatron-Core does.

    With virtual PP the model chunk (pp_rank, vp_stage) holds L/(pp*vp) layers at offset
    vp_stage*(L/vp) + pp_rank*(L/(pp*vp)).
    """
    vp = vp or 1
    if not (0 <= pp_rank < pp and 0 <= vp_stage < vp):
        raise ValueError(f"pp_rank {pp_rank} / vp_stage {vp_stage} out of range for PP {pp} x VPP {vp}")
    per_chunk = _divide(num_layers, pp * vp, f"num_layers over PP {pp} x VPP {vp} (uneven pipelines unsupported)")
    offset = vp_stage * (num_layers // vp) + pp_rank * per_chunk
    return range(offset, offset + per_chunk)


def pp_layer_offset(num_layers: int, pp: int, pp_rank: int, vp: int | None = None, vp_stage: int = 0) -> int:
    return pp_layer_range(num_layers, pp, pp_rank, vp, vp_stage).start


def pp_stage_of_layer(layer: int, num_layers: int, pp: int, vp: int | None = None) -> tuple[int, int, int]:
    """(pp_rank, vp_stage, local index) holding global layer `layer`."""
    vp = vp or 1
    per_chunk = _divide(num_layers, pp * vp, f"num_layers over PP {pp} x VPP {vp}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range [0, {num_layers})")
    vp_stage, rest = divmod(layer, num_layers // vp)
    pp_rank, local = divmod(rest, per_chunk)
    return pp_rank, vp_stage, local


# ----------------------------------------------------------------------------------------------------------------
# Parameter name maps

# Kinds of Megatron parameters and how they split over TP.
QKV = "qkv"            # fused q/k/v rows (weight or bias), group-interleaved
FC1 = "fc1"            # fused [gate_r; up_r] rows per rank
ROW_PARALLEL = "row"   # columns split (linear_proj, linear_fc2)
VOCAB = "vocab"        # rows split over the padded vocab (embedding, output_layer)
REPLICATED = "replicated"  # norms: identical on every rank


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and the HF tensors it is built from.

    megatron / hf are full names (layer index filled in: local index for Megatron, global for HF).
    gemm: True for the four linear weights (FP8 candidates with "<name>_scale_inv" 128x128 block scales).
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str
    gemm: bool


def megatron_layer_prefix(local_layer: int) -> str:
    return f"decoder.layers.{local_layer}."


def hf_layer_prefix(global_layer: int) -> str:
    return f"model.layers.{global_layer}."


def layer_param_maps(shape: ModelShape, global_layer: int, local_layer: int | None = None) -> list[ParamMap]:
    """Megatron <-> HF names of one decoder layer (Megatron-Core local spec names)."""
    m = megatron_layer_prefix(global_layer if local_layer is None else local_layer)
    h = hf_layer_prefix(global_layer)
    maps = [
        ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), REPLICATED, False),
        ParamMap(m + "self_attention.linear_qkv.weight",
                 tuple(h + f"self_attn.{x}_proj.weight" for x in "qkv"), QKV, True),
    ]
    if shape.qkv_bias:
        maps.append(ParamMap(m + "self_attention.linear_qkv.bias",
                             tuple(h + f"self_attn.{x}_proj.bias" for x in "qkv"), QKV, False))
    if shape.qk_norm:
        maps.append(ParamMap(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",),
                             REPLICATED, False))
        maps.append(ParamMap(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",),
                             REPLICATED, False))
    maps += [
        ParamMap(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), ROW_PARALLEL, True),
        ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), REPLICATED, False),
        ParamMap(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), FC1, True),
        ParamMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), ROW_PARALLEL, True),
    ]
    return maps


def embedding_param_map() -> ParamMap:
    return ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB, False)


def final_norm_param_map() -> ParamMap:
    return ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED, False)


def output_param_map(shape: ModelShape) -> ParamMap | None:
    """lm_head <-> output_layer; None when embeddings are tied (HF then has no lm_head.weight)."""
    if shape.tie_word_embeddings:
        return None
    return ParamMap("output_layer.weight", ("lm_head.weight",), VOCAB, False)


def stage_param_maps(shape: ModelShape, pp: int = 1, pp_rank: int = 0, vp: int | None = None,
                     vp_stage: int = 0) -> list[ParamMap]:
    """All Megatron parameters of one pipeline chunk (local layer names) with their HF sources.

    Embedding on the first chunk, final norm + output layer on the last; with tied embeddings and PP > 1 the
    last stage's output_layer copy of the embedding is not listed (HF has no lm_head to map it to).
    """
    vp = vp or 1
    layers = pp_layer_range(shape.num_layers, pp, pp_rank, vp, vp_stage)
    maps: list[ParamMap] = []
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == pp - 1 and vp_stage == vp - 1
    if first:
        maps.append(embedding_param_map())
    for local, g in enumerate(layers):
        maps += layer_param_maps(shape, g, local)
    if last:
        maps.append(final_norm_param_map())
        out = output_param_map(shape)
        if out is not None:
            maps.append(out)
    return maps


def split_megatron_layer_name(name: str) -> tuple[int | None, str]:
    """'decoder.layers.3.mlp.linear_fc1.weight' -> (3, 'mlp.linear_fc1.weight'); non-layer names -> (None, name)."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        idx, _, rest = name[len(prefix):].partition(".")
        if idx.isdigit():
            return int(idx), rest
    return None, name


def megatron_name_to_global(name: str, offset: int) -> str:
    """Local-index Megatron name of a PP chunk -> the same name with the global layer index."""
    local, rest = split_megatron_layer_name(name)
    return name if local is None else f"decoder.layers.{local + offset}.{rest}"


# ----------------------------------------------------------------------------------------------------------------
# Whole-parameter conversion (one TP rank at a time)


def hf_to_megatron_shard(pmap: ParamMap, hf_tensors: Sequence[torch.Tensor], shape: ModelShape, tp: int, rank: int,
                         rows_per_head: int | None = None, padded_vocab: int | None = None) -> torch.Tensor:
    """Build Megatron TP rank `rank`'s tensor for `pmap` from its HF tensors (weights, biases or block scales)."""
    if len(hf_tensors) != len(pmap.hf):
        raise ValueError(f"{pmap.megatron}: expected {len(pmap.hf)} HF tensors {pmap.hf}, got {len(hf_tensors)}")
    if pmap.kind == QKV:
        full = qkv_interleave(*hf_tensors, shape.num_attention_heads, shape.num_kv_heads, rows_per_head)
        return split_rows(full, tp, rank, pmap.megatron).contiguous()
    if pmap.kind == FC1:
        return fc1_shard(hf_tensors[0], hf_tensors[1], tp, rank).contiguous()
    if pmap.kind == ROW_PARALLEL:
        return split_cols(hf_tensors[0], tp, rank, pmap.megatron).contiguous()
    if pmap.kind == VOCAB:
        padded = padded_vocab or padded_vocab_size(shape.vocab_size, tp)
        return split_rows(pad_vocab_rows(hf_tensors[0], padded), tp, rank, pmap.megatron).contiguous()
    if pmap.kind == REPLICATED:
        return hf_tensors[0]
    raise ValueError(f"{pmap.megatron}: unknown kind {pmap.kind!r}")


def megatron_shards_to_hf(pmap: ParamMap, shards: Sequence[torch.Tensor], shape: ModelShape,
                          rows_per_head: int | None = None) -> tuple[torch.Tensor, ...]:
    """Megatron TP shards (rank order) of `pmap` -> its HF tensors (vocab padding trimmed)."""
    if pmap.kind == QKV:
        return qkv_deinterleave(cat_rows(shards), shape.num_attention_heads, shape.num_kv_heads, rows_per_head)
    if pmap.kind == FC1:
        return fc1_unshard(shards)
    if pmap.kind == ROW_PARALLEL:
        return (cat_cols(shards),)
    if pmap.kind == VOCAB:
        return (trim_vocab_rows(cat_rows(shards), shape.vocab_size),)
    if pmap.kind == REPLICATED:
        return (shards[0],)
    raise ValueError(f"{pmap.megatron}: unknown kind {pmap.kind!r}")
