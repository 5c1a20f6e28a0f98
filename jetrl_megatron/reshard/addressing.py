"""Block addressing: where each 128x128 block of a canonical (HF-named, full-size) projection lives in the
Megatron-Core TP layout and in the vLLM TP' layout, and the coalesced copy plans built from those addresses.

Units: a "block" is 128 rows (or columns) of a weight, one row (column) of its 128x128 scale tensor, or 128 entries
of a bias. Column-parallel projections (q, k, v, gate, up) are split along rows, so only their row block moves;
row-parallel projections (o, down) are split along columns, so only their column block moves. The other block
index is unchanged on both sides. Preflight (reshard.preflight) guarantees every shard boundary is a block boundary.

`unit` (default 128) is the row count of one addressing step. FP8 tensors move in 128 units (their scales index
128x128 blocks); BF16 tensors carry no scales, so they may move in a smaller unit (`bf16_unit`) that divides the
head size and every shard: that is how a head_dim-64 model (Llama-3.2-1B) reshards in the BF16 arm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from jetrl_megatron.fp8.format import BLOCK
from jetrl_megatron.fp8.format import cdiv as _cdiv
from jetrl_megatron.model.layout import qkv_slot_of_k, qkv_slot_of_q, qkv_slot_of_v
from jetrl_megatron.model.shapes import ModelShape

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
ROW_SPLIT = ("q", "k", "v", "gate", "up")   # column-parallel: rows split over TP
COL_SPLIT = ("o", "down")                   # row-parallel: columns split over TP

HF_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
MEGATRON_PARAM = {"q": "self_attention.linear_qkv", "k": "self_attention.linear_qkv",
                  "v": "self_attention.linear_qkv", "o": "self_attention.linear_proj", "gate": "mlp.linear_fc1",
                  "up": "mlp.linear_fc1", "down": "mlp.linear_fc2"}
VLLM_PARAM = {"q": "self_attn.qkv_proj", "k": "self_attn.qkv_proj", "v": "self_attn.qkv_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_up_proj", "up": "mlp.gate_up_proj",
              "down": "mlp.down_proj"}




def proj_shape(shape: ModelShape, proj: str) -> tuple[int, int]:
    """(out, in) of a canonical HF projection weight."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return {"q": (shape.q_size, h), "k": (shape.kv_size, h), "v": (shape.kv_size, h), "o": (h, shape.q_size),
            "gate": (f, h), "up": (f, h), "down": (h, f)}[proj]


def proj_blocks(shape: ModelShape, proj: str, unit: int = BLOCK) -> tuple[int, int]:
    """(row blocks, col blocks) = shape of the canonical projection's weight_scale_inv (at unit 128)."""
    n, k = proj_shape(shape, proj)
    return _cdiv(n, unit), _cdiv(k, unit)


def split_blocks(shape: ModelShape, proj: str, unit: int = BLOCK) -> int:
    """Number of blocks along the TP-split dimension of a canonical projection."""
    rows, cols = proj_blocks(shape, proj, unit)
    return rows if proj in ROW_SPLIT else cols


def _bph(shape: ModelShape, unit: int = BLOCK) -> int:
    return shape.head_dim // unit


def bf16_unit(shape: ModelShape, train_tp: int, rollout_tp: int) -> int:
    """Largest step <= 128 that divides the head size and every TP shard of both sides (128 for the usual
    head_dim-128 models, so their BF16 plans equal the FP8 ones); BF16 tensors need no 128 alignment."""
    f = shape.ffn_hidden_size
    return math.gcd(BLOCK, shape.head_dim, f // max(train_tp, 1), f // max(rollout_tp, 1))


# ----------------------------------------------------------------------------------------------------------------
# Megatron (TP) addresses


@dataclass(frozen=True)
class Address:
    """Where a block lives: parameter (suffix within the layer), TP rank, block index along the split dim."""

    param: str
    rank: int
    index: int


def megatron_param_blocks(shape: ModelShape, tp: int, param: str, unit: int = BLOCK) -> int:
    """Per-rank number of blocks along the split dim of a Megatron layer parameter."""
    if param == "self_attention.linear_qkv":
        return (shape.num_attention_heads + 2 * shape.num_kv_heads) * _bph(shape, unit) // tp
    if param == "mlp.linear_fc1":
        return 2 * split_blocks(shape, "gate", unit) // tp
    if param == "self_attention.linear_proj":
        return split_blocks(shape, "o", unit) // tp
    if param == "mlp.linear_fc2":
        return split_blocks(shape, "down", unit) // tp
    raise KeyError(param)


def megatron_address(shape: ModelShape, tp: int, proj: str, b: int, unit: int = BLOCK) -> Address:
    """Megatron location of canonical block `b` (along the split dim) of projection `proj` at train TP `tp`."""
    param = MEGATRON_PARAM[proj]
    if proj in ("q", "k", "v"):
        bph = _bph(shape, unit)
        head, sub = divmod(b, bph)
        nh, ng = shape.num_attention_heads, shape.num_kv_heads
        slot = {"q": qkv_slot_of_q, "k": qkv_slot_of_k, "v": qkv_slot_of_v}[proj](head, nh, ng)
        fused = slot * bph + sub
        per_rank = megatron_param_blocks(shape, tp, param, unit)
        return Address(param, fused // per_rank, fused % per_rank)
    if proj in ("gate", "up"):
        per = split_blocks(shape, "gate", unit) // tp
        rank, local = divmod(b, per)
        return Address(param, rank, local + (per if proj == "up" else 0))
    per = split_blocks(shape, proj, unit) // tp
    rank, local = divmod(b, per)
    return Address(param, rank, local)


# ----------------------------------------------------------------------------------------------------------------
# vLLM (TP') addresses


def vllm_kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads each vLLM rank holds (1 when TP' >= num_kv_heads: heads are replicated)."""
    return max(1, shape.num_kv_heads // tp)


def vllm_param_blocks(shape: ModelShape, tp: int, param: str, unit: int = BLOCK) -> int:
    bph = _bph(shape, unit)
    if param == "self_attn.qkv_proj":
        return (shape.num_attention_heads // tp + 2 * vllm_kv_heads_per_rank(shape, tp)) * bph
    if param == "mlp.gate_up_proj":
        return 2 * split_blocks(shape, "gate", unit) // tp
    if param == "self_attn.o_proj":
        return split_blocks(shape, "o", unit) // tp
    if param == "mlp.down_proj":
        return split_blocks(shape, "down", unit) // tp
    raise KeyError(param)


def vllm_addresses(shape: ModelShape, tp: int, proj: str, b: int, unit: int = BLOCK) -> list[Address]:
    """vLLM location(s) of canonical block `b` of `proj` at rollout TP `tp` (several ranks for replicated KV)."""
    param = VLLM_PARAM[proj]
    if proj in ("q", "k", "v"):
        bph = _bph(shape, unit)
        head, sub = divmod(b, bph)
        q_heads = shape.num_attention_heads // tp
        if proj == "q":
            rank, local_head = divmod(head, q_heads)
            return [Address(param, rank, local_head * bph + sub)]
        kv_local = vllm_kv_heads_per_rank(shape, tp)
        base = q_heads * bph + (kv_local * bph if proj == "v" else 0)
        if tp > shape.num_kv_heads:
            replicas = tp // shape.num_kv_heads
            return [Address(param, r, base + sub) for r in range(head * replicas, (head + 1) * replicas)]
        rank, local_head = divmod(head, kv_local)
        return [Address(param, rank, base + local_head * bph + sub)]
    if proj in ("gate", "up"):
        per = split_blocks(shape, "gate", unit) // tp
        rank, local = divmod(b, per)
        return [Address(param, rank, local + (per if proj == "up" else 0))]
    per = split_blocks(shape, proj, unit) // tp
    rank, local = divmod(b, per)
    return [Address(param, rank, local)]


# ----------------------------------------------------------------------------------------------------------------
# Copy plans: Megatron TP ranks -> one vLLM TP' rank, coalesced into contiguous runs


@dataclass(frozen=True)
class Segment:
    """Copy `length` blocks from Megatron rank `src_rank` at block `src_start` to the vLLM tensor at `dst_start`."""

    src_rank: int
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class ParamPlan:
    """How one vLLM layer parameter of one rank is assembled from one Megatron layer parameter's TP shards."""

    vllm_param: str
    megatron_param: str
    dim: int            # 0: rows split (column-parallel), 1: columns split (row-parallel)
    dst_blocks: int     # vLLM local size along `dim`, in blocks
    src_blocks: int     # Megatron local size along `dim`, in blocks
    segments: tuple[Segment, ...]
    unit: int = BLOCK   # rows (columns) per block: 128, or `bf16_unit` for BF16 tensors


def _coalesce(pairs: list[tuple[int, int, int]]) -> tuple[Segment, ...]:
    """(dst, src_rank, src) sorted by dst -> maximal runs contiguous on both sides."""
    segs: list[Segment] = []
    for dst, rank, src in sorted(pairs):
        if segs:
            last = segs[-1]
            if (last.src_rank == rank and last.src_start + last.length == src
                    and last.dst_start + last.length == dst):
                segs[-1] = Segment(rank, last.src_start, last.dst_start, last.length + 1)
                continue
        segs.append(Segment(rank, src, dst, 1))
    return tuple(segs)


@lru_cache(maxsize=256)
def vllm_rank_plans(shape: ModelShape, train_tp: int, rollout_tp: int, rank: int,
                    unit: int = BLOCK) -> tuple[ParamPlan, ...]:
    """Copy plans for the four GEMM parameters of one decoder layer on vLLM rank `rank` (same for every layer);
    `unit` 128 for FP8 tensors (whole scale blocks), `bf16_unit` for BF16 ones."""
    plans = []
    for vparam, projs in (("self_attn.qkv_proj", ("q", "k", "v")), ("self_attn.o_proj", ("o",)),
                          ("mlp.gate_up_proj", ("gate", "up")), ("mlp.down_proj", ("down",))):
        pairs: list[tuple[int, int, int]] = []
        for proj in projs:
            for b in range(split_blocks(shape, proj, unit)):
                for dst in vllm_addresses(shape, rollout_tp, proj, b, unit):
                    if dst.rank == rank:
                        src = megatron_address(shape, train_tp, proj, b, unit)
                        pairs.append((dst.index, src.rank, src.index))
        dst_blocks = vllm_param_blocks(shape, rollout_tp, vparam, unit)
        if sorted(p[0] for p in pairs) != list(range(dst_blocks)):
            raise AssertionError(f"{vparam} rank {rank}: plan does not cover the {dst_blocks} destination blocks")
        mparam = MEGATRON_PARAM[projs[0]]
        plans.append(ParamPlan(vparam, mparam, 0 if projs[0] in ROW_SPLIT else 1, dst_blocks,
                               megatron_param_blocks(shape, train_tp, mparam, unit), _coalesce(pairs), unit))
    return tuple(plans)


# ----------------------------------------------------------------------------------------------------------------
# Vocab rows (embedding / lm_head: BF16, row units, no blocks)


def vllm_padded_vocab(vocab_size: int, pad_to: int = 64) -> int:
    """vLLM's VocabParallelEmbedding / ParallelLMHead pads the vocab to a multiple of 64, then splits it evenly."""
    return _cdiv(vocab_size, pad_to) * pad_to
