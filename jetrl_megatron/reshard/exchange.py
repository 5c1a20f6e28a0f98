"""The model-parallel refit exchange, planned from names, dtypes and shapes only (no tensors).

Why: with trainer TP x PP > 1 a rank's vLLM slice is copied from Megatron tensors that other ranks of its
model-parallel group hold, so each rank keeps one persistent byte buffer per peer it sends to and one per peer it
receives from; they are allocated at the first refit and never freed, because the engine's compiled refit program
is built against their addresses. `rl.refit_source.RefitSource` allocates exactly what :func:`exchange_names` and
:func:`packed_layout` say, from the tensor lists its ranks exchange; `jetrl plan` runs the same two functions over
the tensor lists :func:`rollout_tensor_meta` predicts (:func:`refit_buffer_bytes`), so the memory estimate counts
the buffers the loop holds. What a rank's vLLM rank copies from its own tensors needs no buffer: the program reads
them in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from jetrl_megatron.fp8.format import cdiv as _cdiv
from jetrl_megatron.model import layout
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard.addressing import BLOCK
from jetrl_megatron.reshard.mover import SCALE_SUFFIX
from jetrl_megatron.reshard.program import program_sources, stand_in_shards

Key = tuple[int, int, int]  # (pp_rank, vp_stage, tp_rank)
TensorMeta = tuple[str, torch.dtype, tuple[int, ...]]
ALIGN = 16  # bytes: every tensor starts at an aligned offset of its buffer, so its typed view is valid




@dataclass(frozen=True)
class Packed:
    """One tensor's place in a packed byte buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def packed_layout(names: Sequence[str], meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                  ) -> tuple[list[Packed], int]:
    """`names` packed in order into one byte buffer (each start aligned to `ALIGN`); returns (layout, buffer size)."""
    out, off = [], 0
    for name in names:
        dtype, shape = meta[name]
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(Packed(name, dtype, tuple(shape), off, nbytes))
        off += _cdiv(nbytes, ALIGN) * ALIGN
    return out, off


def copy_sources(model: ModelShape, tp: int, pp: int, rollout_tp: int, metas: Mapping[Key, Sequence[TensorMeta]],
                 vllm_ranks: Iterable[int]) -> dict[int, dict[Key, set[str]]]:
    """For each vLLM rank: the Megatron tensors (by key) its compiled refit program copies bytes from, planned over
    stand-ins of `metas` (`reshard.program.program_sources`)."""
    src = stand_in_shards(model, tp, pp, metas)
    return {r: program_sources(src, rollout_tp, r) for r in sorted(set(vllm_ranks))}


def exchange_names(metas: Mapping[Key, Sequence[TensorMeta]], members: Sequence[tuple[Key, int]],
                   sources: Mapping[int, Mapping[Key, set[str]]]) -> dict[tuple[int, int], list[str]]:
    """(src, dst) member indices -> the names of src's tensors that dst's vLLM rank copies from, in src's order.

    `members`: each model-parallel group member's (Megatron key, vLLM rank), in group order; `sources`: from
    :func:`copy_sources`. (i, i) is what a rank copies from itself. Pairs with nothing to copy are absent.
    """
    out: dict[tuple[int, int], list[str]] = {}
    for dst, (_, vllm_rank) in enumerate(members):
        need = sources[vllm_rank]
        for src, (key, _) in enumerate(members):
            want = need.get(key, set())
            names = [name for name, _, _ in metas[key] if name in want]
            if names:
                out[(src, dst)] = names
    return out


@dataclass(frozen=True)
class ExchangeBytes:
    """One rank's refit exchange, in bytes."""

    send: int  # persistent send buffers: this rank's tensors each peer's vLLM rank copies from
    recv: int  # persistent receive buffers: each peer's tensors this rank's vLLM rank copies from
    own: int   # this rank's own tensors its vLLM rank copies from: read in place, no buffer

    @property
    def buffers(self) -> int:
        """What the exchange keeps allocated on the rank from the first refit on."""
        return self.send + self.recv


def exchange_bytes(metas: Mapping[Key, Sequence[TensorMeta]], members: Sequence[tuple[Key, int]],
                   names: Mapping[tuple[int, int], Sequence[str]]) -> list[ExchangeBytes]:
    """Per member (group order): the buffer bytes `RefitSource` allocates for `names` (:func:`exchange_names`)."""
    by_name = {key: {n: (dt, shp) for n, dt, shp in meta} for key, meta in metas.items()}
    send, recv, own = [0] * len(members), [0] * len(members), [0] * len(members)
    for (src, dst), ns in names.items():
        lay, size = packed_layout(ns, by_name[members[src][0]])
        if src == dst:
            own[src] += sum(p.nbytes for p in lay)
        else:
            send[src] += size
            recv[dst] += size
    return [ExchangeBytes(s, r, o) for s, r, o in zip(send, recv, own, strict=True)]


def _local_shape(model: ModelShape, tp: int, pmap: layout.ParamMap) -> tuple[int, ...]:
    """Shape of one Megatron TP rank's tensor of `pmap` (Megatron-Core local spec)."""
    h = model.hidden_size
    suffix = layout.split_megatron_layer_name(pmap.megatron)[1]
    if pmap.kind == layout.QKV:
        rows = model.qkv_size // tp
        return (rows, h) if suffix.endswith(".weight") else (rows,)
    if pmap.kind == layout.FC1:
        return 2 * model.ffn_hidden_size // tp, h
    if pmap.kind == layout.ROW_PARALLEL:
        return h, (model.q_size if "linear_proj" in suffix else model.ffn_hidden_size) // tp
    if pmap.kind == layout.VOCAB:
        return layout.padded_vocab_size(model.vocab_size, tp) // tp, h
    if pmap.kind == layout.REPLICATED:
        return (model.head_dim,) if suffix.endswith(("q_layernorm.weight", "k_layernorm.weight")) else (h,)
    raise ValueError(f"{pmap.megatron}: unknown kind {pmap.kind!r}")


def rollout_tensor_meta(model: ModelShape, tp: int, pp: int, recipe: Fp8Recipe) -> dict[Key, list[TensorMeta]]:
    """What `rl.trainer.local_rollout_tensors` returns on each (pp, 0, tp) rank, for every tensor the refit reads.

    jetrl: each FP8 linear (the recipe's `module_is_fp8`) as E4M3 codes + "<name>_scale_inv" FP32 128x128 block
    scales (the FP8 cache), everything else BF16; the other arms: the BF16 parameters. Parameters the refit never
    reads (an output layer holding tied embeddings) are not listed; they do not change what is exchanged.
    """
    out: dict[Key, list[TensorMeta]] = {}
    n_layers = model.num_layers
    for p in range(pp):
        layers = layout.pp_layer_range(n_layers, pp, p)
        maps = layout.stage_param_maps(model, pp, p)
        for t in range(tp):
            meta: list[TensorMeta] = []
            for pmap in maps:
                shape = _local_shape(model, tp, pmap)
                local, suffix = layout.split_megatron_layer_name(pmap.megatron)
                fp8 = False
                if pmap.gemm and recipe.rollout_weights == "trainer_fp8" and local is not None:
                    g = layers[local]
                    fp8 = recipe.module_is_fp8(f"decoder.layers.{g}.{suffix}", g, n_layers)
                if fp8:
                    meta.append((pmap.megatron, torch.float8_e4m3fn, shape))
                    meta.append((pmap.megatron + SCALE_SUFFIX, torch.float32,
                                 (_cdiv(shape[0], BLOCK), _cdiv(shape[1], BLOCK))))
                else:
                    meta.append((pmap.megatron, torch.bfloat16, shape))
            out[(p, 0, t)] = meta
    return out


def model_parallel_groups(tp: int, pp: int, dp: int) -> list[list[tuple[int, Key]]]:
    """(global rank, (pp, 0, tp) key) of every model-parallel group's members, in Megatron-Core's default rank
    order (TP fastest, then DP, then PP)."""
    return [[(t + tp * d + tp * dp * p, (p, 0, t)) for p in range(pp) for t in range(tp)] for d in range(dp)]


def refit_buffer_bytes(model: ModelShape, tp: int, pp: int, dp: int, rollout_tp: int,
                       recipe: Fp8Recipe) -> dict[int, ExchangeBytes]:
    """Every global rank's refit exchange (rank r drives vLLM rank r % rollout_tp); all zero at TP x PP 1, where
    the engine reads the trainer's tensors in place."""
    groups = model_parallel_groups(tp, pp, dp)
    if tp * pp == 1:
        return {g: ExchangeBytes(0, 0, 0) for group in groups for g, _ in group}
    metas = rollout_tensor_meta(model, tp, pp, recipe)
    sources = copy_sources(model, tp, pp, rollout_tp, metas, {g % rollout_tp for group in groups for g, _ in group})
    out: dict[int, ExchangeBytes] = {}
    cache: dict[tuple, list[ExchangeBytes]] = {}
    for group in groups:
        members = [(key, g % rollout_tp) for g, key in group]
        sig = tuple(members)
        if sig not in cache:
            cache[sig] = exchange_bytes(metas, members, exchange_names(metas, members, sources))
        out.update({g: b for (g, _), b in zip(group, cache[sig], strict=True)})
    return out


__all__ = ["ALIGN", "ExchangeBytes", "Packed", "copy_sources", "exchange_bytes", "exchange_names",
           "model_parallel_groups", "packed_layout", "refit_buffer_bytes", "rollout_tensor_meta"]
