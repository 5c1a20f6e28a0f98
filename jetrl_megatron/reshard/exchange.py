"""The model-parallel refit exchange, planned from names, dtypes and shapes only (no tensors).

Why: with trainer TP x PP > 1 a rank's vLLM slice is copied from Megatron tensors that other ranks of its
model-parallel group hold. Holding a whole copy of every peer's tensors costs the model's size again (for an 8B
model at PP2, 7.5 GiB received + 7.5 GiB sent per GPU), so the exchange streams them in rounds through two fixed
staging buffers per rank, one for sending and one for receiving, whose sum is at most the budget
(``policy.refit_buffer_size_gb``; :func:`budget_bytes`). Each round carries one message per (sender, receiver)
pair, many tensors (or row ranges of a large one) packed into it (`reshard.packing` slots), so the cost is one
batched point-to-point call per round, not one per tensor. The receiving rank's compiled refit program copies each
round's rows straight from its staging buffer into the engine's tensors before the next round overwrites them.

`reshard.transport.StagedStream` (driven by `rl.refit_source.RefitExchange`) allocates exactly what
:func:`exchange_schedule` says, from the tensor lists the ranks exchange; `jetrl plan` runs the same functions over
the tensor lists :func:`rollout_tensor_meta` predicts (:func:`refit_buffer_bytes`), so the memory estimate counts
the buffers the loop holds. What a rank's vLLM rank copies from its own tensors needs no buffer: the program reads
them in place.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from jetrl_megatron.fp8.format import cdiv as _cdiv
from jetrl_megatron.model import layout
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard.addressing import BLOCK
from jetrl_megatron.reshard.mover import SCALE_SUFFIX, CopyPair
from jetrl_megatron.reshard.packing import ALIGN, PackSpec, Slot, aligned, rows_of
from jetrl_megatron.reshard.program import program_sources, stand_in_shards

Key = tuple[int, int, int]  # (pp_rank, vp_stage, tp_rank)
TensorMeta = tuple[str, torch.dtype, tuple[int, ...]]
GiB = 1 << 30
DEFAULT_BUDGET_GB = 2.0  # staging (send + receive) per GPU when policy.refit_buffer_size_gb is unset


def budget_bytes(refit_buffer_size_gb: float | None) -> int:
    """Send + receive staging bytes per rank: ``policy.refit_buffer_size_gb`` GiB, or `DEFAULT_BUDGET_GB` unset.

    NeMo-RL reads the key as the fixed size of its refit staging buffer per GPU (its IPC path uses half to fill and
    half to drain); here it bounds the same thing: the exchange's send and receive buffers (7/16 of it each) and
    the scratch of the finiteness check of what a rank sends (:func:`finite_chunk`, 1/8)."""
    gb = DEFAULT_BUDGET_GB if refit_buffer_size_gb is None else float(refit_buffer_size_gb)
    if not gb > 0:
        raise ValueError(f"policy.refit_buffer_size_gb must be > 0, got {refit_buffer_size_gb}")
    return int(gb * GiB)


def staging_side(budget: int) -> int:
    """Bytes a rank may send (and, separately, receive) per round under `budget`."""
    return budget * 7 // 16


def finite_chunk(budget: int) -> int:
    """Elements per step of the finiteness check of what a rank sends: at most 2 bytes of scratch each (FP8: the
    masked bytes + the flags), 1/8 of the budget."""
    return max(1, budget // 16)


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


def split_stream(names: Sequence[str], meta: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], cap: int,
                 what: str = "refit exchange") -> list[list[Slot]]:
    """`names`' bytes, in order, cut into messages of at most `cap` bytes: packer slots of whole rows, each
    `ALIGN`-aligned (`reshard.packing.pack_slots` fills a message from them)."""
    messages: list[list[Slot]] = []
    cur: list[Slot] = []
    used = 0
    for name in names:
        dtype, shape = meta[name]
        rows, row_bytes = rows_of(shape, dtype)
        if row_bytes > cap:
            raise ValueError(f"{what}: one row of {name} {tuple(shape)} {dtype} is {row_bytes} bytes, more than the "
                             f"{cap}-byte message cap; raise policy.refit_buffer_size_gb")
        row = 0
        while row < rows:
            start = aligned(used)
            fit = (cap - start) // row_bytes if start < cap else 0
            if fit == 0:
                messages.append(cur)
                cur, used = [], 0
                continue
            n = min(fit, rows - row)
            cur.append(Slot(name, dtype, tuple(shape), start, row, row + n, n * row_bytes))
            used = start + n * row_bytes
            row += n
    if cur:
        messages.append(cur)
    return messages


@dataclass(frozen=True)
class Message:
    """One round's message between this rank and group member `peer`, at `offset` of this rank's staging buffer
    (the send buffer for sends, the receive buffer for receives)."""

    peer: int
    offset: int
    nbytes: int
    pieces: tuple[Slot, ...]


@dataclass(frozen=True)
class MemberSchedule:
    """One member's exchange: per round (sends, receives); staging sizes = the largest round's total."""

    rounds: tuple[tuple[tuple[Message, ...], tuple[Message, ...]], ...]
    send_bytes: int
    recv_bytes: int
    received: int  # payload bytes this rank receives per refit (pieces, no padding)


def exchange_schedule(metas: Mapping[Key, Sequence[TensorMeta]], members: Sequence[tuple[Key, int]],
                      names: Mapping[tuple[int, int], Sequence[str]], budget: int) -> list[MemberSchedule]:
    """Every member's rounds, the same on every rank (deterministic from the same inputs).

    A rank may send and receive :func:`staging_side` bytes per round: each (src, dst) pair's stream is cut into
    messages of at most that divided by the busier end's number of peers, so no round overflows either buffer.
    """
    by_name = {key: {n: (dt, shp) for n, dt, shp in meta} for key, meta in metas.items()}
    n = len(members)
    pairs = {p: ns for p, ns in names.items() if p[0] != p[1] and ns}
    out_deg, in_deg = [0] * n, [0] * n
    for src, dst in pairs:
        out_deg[src] += 1
        in_deg[dst] += 1
    side = staging_side(budget)
    streams: dict[tuple[int, int], list[list[Slot]]] = {}
    for (src, dst), ns in sorted(pairs.items()):
        cap = side // max(out_deg[src], in_deg[dst]) // ALIGN * ALIGN
        # by name: the same rounds whatever order a rank lists its tensors in (the plan predicts them from shapes)
        streams[(src, dst)] = split_stream(sorted(ns), by_name[members[src][0]], cap)
    n_rounds = max((len(m) for m in streams.values()), default=0)
    out: list[MemberSchedule] = []
    for me in range(n):
        rounds = []
        send_max = recv_max = received = 0
        for k in range(n_rounds):
            sends, recvs = [], []
            s_off = r_off = 0
            for peer in range(n):
                msg = streams.get((me, peer))
                if msg is not None and k < len(msg):
                    size = msg[k][-1].offset + msg[k][-1].nbytes
                    sends.append(Message(peer, s_off, size, tuple(msg[k])))
                    s_off += aligned(size)
                msg = streams.get((peer, me))
                if msg is not None and k < len(msg):
                    size = msg[k][-1].offset + msg[k][-1].nbytes
                    recvs.append(Message(peer, r_off, size, tuple(msg[k])))
                    r_off += aligned(size)
                    received += sum(p.nbytes for p in msg[k])
            rounds.append((tuple(sends), tuple(recvs)))
            send_max, recv_max = max(send_max, s_off), max(recv_max, r_off)
        out.append(MemberSchedule(tuple(rounds), send_max, recv_max, received))
    return out


@dataclass(frozen=True)
class ExchangeBytes:
    """One rank's refit exchange, in bytes."""

    send: int  # the send staging buffer
    recv: int  # the receive staging buffer
    own: int   # this rank's own tensors its vLLM rank copies from: read in place, no buffer
    received: int = 0  # what arrives from peers per refit, streamed through `recv`
    rounds: int = 0

    @property
    def buffers(self) -> int:
        """What the exchange keeps allocated on the rank from the first refit on."""
        return self.send + self.recv


def exchange_bytes(metas: Mapping[Key, Sequence[TensorMeta]], members: Sequence[tuple[Key, int]],
                   names: Mapping[tuple[int, int], Sequence[str]], budget: int) -> list[ExchangeBytes]:
    """Per member (group order): the staging bytes `RefitExchange` allocates for `names` (:func:`exchange_names`)."""
    by_name = {key: {n: (dt, shp) for n, dt, shp in meta} for key, meta in metas.items()}
    own = [0] * len(members)
    for (src, dst), ns in names.items():
        if src == dst:
            meta = by_name[members[src][0]]
            own[src] += PackSpec.of((n, *meta[n]) for n in ns).payload_bytes
    return [ExchangeBytes(m.send_bytes, m.recv_bytes, o, m.received, len(m.rounds))
            for m, o in zip(exchange_schedule(metas, members, names, budget), own, strict=True)]


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
                       recipe: Fp8Recipe, budget: int) -> dict[int, ExchangeBytes]:
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
            cache[sig] = exchange_bytes(metas, members, exchange_names(metas, members, sources), budget)
        out.update({g: b for (g, _), b in zip(group, cache[sig], strict=True)})
    return out


__all__ = ["ALIGN", "DEFAULT_BUDGET_GB", "ExchangeBytes", "MemberSchedule", "Message",
           "budget_bytes", "copy_sources", "exchange_bytes", "exchange_names", "exchange_schedule",
           "model_parallel_groups", "refit_buffer_bytes", "rollout_tensor_meta", "rows_of",
           "finite_chunk", "split_stream", "staging_side", "stream_pairs", "VirtualSources"]


# ---------------------------------------------------------------------------------------------------- receiver side


class VirtualSources:
    """Peers' tensors as meta-device views of one virtual byte space: the refit program is planned over them (they
    have names, shapes, dtypes and distinct addresses, but no memory), and each copy it plans from them is then
    re-pointed at the receive staging buffer, round by round (:func:`stream_pairs`)."""

    def __init__(self, items: Sequence[tuple[Key, str, torch.dtype, tuple[int, ...]]]):
        self.meta: dict[tuple[Key, str], tuple[torch.dtype, tuple[int, ...]]] = {}
        starts, off = [], 0
        for key, name, dtype, shape in items:
            starts.append((off, key, name))
            self.meta[(key, name)] = (dtype, tuple(shape))
            off += aligned(max(1, math.prod(shape) * dtype.itemsize))
        space = torch.empty(max(off, ALIGN), dtype=torch.uint8, device="meta")
        self.tensors: dict[tuple[Key, str], torch.Tensor] = {}
        for (start, key, name), (dtype, shape) in zip(starts, self.meta.values(), strict=True):
            n = math.prod(shape) * dtype.itemsize
            self.tensors[(key, name)] = space[start:start + n].view(dtype).view(shape)
        self._starts = [s for s, _, _ in starts]
        self._names = [(k, n) for _, k, n in starts]

    def locate(self, view: torch.Tensor) -> tuple[Key, str, int]:
        """(key, name, byte offset inside that tensor) of a view of one of these tensors."""
        b = view.storage_offset() * view.element_size()
        i = bisect.bisect_right(self._starts, b) - 1
        key, name = self._names[i]
        return key, name, b - self._starts[i]


def stream_pairs(pairs: Sequence[CopyPair], virtual: VirtualSources, recv_rounds: Sequence[Sequence[Message]],
                 peer_keys: Sequence[Key], staging: torch.Tensor) -> list[list[CopyPair]]:
    """Per round: the copies of `pairs` (sources: views of `virtual`) re-pointed at the rows of the receive staging
    buffer that round holds; a copy spanning rows of several rounds is cut into one copy per round."""
    where: dict[tuple[Key, str], list[tuple[int, int, int, int]]] = {}
    for k, recvs in enumerate(recv_rounds):
        for m in recvs:
            for p in m.pieces:
                where.setdefault((peer_keys[m.peer], p.name), []).append((k, p.row0, p.row1, m.offset + p.offset))
    out: list[list[CopyPair]] = [[] for _ in recv_rounds]
    for d, s in pairs:
        if s.numel() == 0:
            continue
        key, name, rel = virtual.locate(s)
        dtype, shape = virtual.meta[(key, name)]
        _, row_bytes = rows_of(shape, dtype)
        es = s.element_size()
        if len(shape) >= 2:
            if s.dim() < 2 or (s.shape[0] > 1 and s.stride(0) * es != row_bytes):
                raise ValueError(f"{name} of {key}: a copy whose rows are not the tensor's rows cannot be streamed")
            first, col = divmod(rel, row_bytes)
            n = s.shape[0]
        else:
            first, col, n = 0, rel, 1
        typed = staging.view(s.dtype)
        covered = 0
        for k, p0, p1, pos in where.get((key, name), ()):
            lo, hi = max(first, p0), min(first + n, p1)
            if lo >= hi:
                continue
            byte = pos + (lo - p0) * row_bytes + col
            if byte % es:
                raise ValueError(f"{name}: staging offset {byte} is not aligned to {es} bytes")
            if len(shape) >= 2:
                dst, shp = d.narrow(0, lo - first, hi - lo), (hi - lo, *s.shape[1:])
            else:
                dst, shp = d, tuple(s.shape)
            out[k].append((dst, typed.as_strided(shp, s.stride(), byte // es)))
            covered += hi - lo
        if covered != n:
            raise ValueError(f"{name} of {key}: the exchange schedule delivers {covered} of the {n} rows a copy needs")
    return out
