"""The mover: Megatron-Core per-rank FP8 weights + 128x128 scales (+ BF16 non-GEMM tensors) -> per-rank vLLM
tensors for rollout TP', or -> canonical HF-named tensors. Pure byte moves, streamed layer by layer.

Every copy goes through an integer view of the same item size (FP8 -> uint8, BF16 -> int16, FP32 scales -> int32),
so no value is ever converted, rounded or canonicalised (NaN payloads and -0.0 survive). The vLLM path copies
coalesced slabs straight from the Megatron rank tensors into the destination rank's tensor
(reshard.addressing.vllm_rank_plans); no full-size tensor is built.

Input: `MegatronShards` — the plain (local-layer-index) state dicts of every (pp_rank, vp_stage, tp_rank), with
names from the Megatron-Core local spec and FP8 copies' scales under "<name>_scale_inv".
A GEMM weight without "<name>_scale_inv" is treated as BF16 (e.g. a recipe's BF16 first/last layers, or every
linear in the BF16 arms) and moved the same way, without scales, in rows (`addressing.bf16_unit`) rather than 128
blocks: only FP8 tensors need whole 128 blocks, so a head_dim-64 model moves in the BF16 arms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from jetrl_megatron.fp8.format import SCALE_SUFFIX
from jetrl_megatron.fp8.format import cdiv as _cdiv
from jetrl_megatron.model import layout
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.reshard.addressing import (
    BLOCK,
    MEGATRON_PARAM,
    ParamPlan,
    bf16_unit,
    vllm_padded_vocab,
    vllm_rank_plans,
)
from jetrl_megatron.reshard.packing import raw, widen
from jetrl_megatron.reshard.preflight import validate_reshard

# ----------------------------------------------------------------------------------------------------------------
# Source: Megatron shards


@dataclass
class MegatronShards:
    """All Megatron ranks' local state dicts, keyed (pp_rank, vp_stage, tp_rank).

    Each dict holds its chunk's layers under local indices (decoder.layers.0 is the chunk's first layer); the
    global index is the chunk's PP/VPP offset + local (model.layout.pp_layer_range).
    """

    shape: ModelShape
    tp: int
    pp: int = 1
    vp: int | None = None
    states: dict[tuple[int, int, int], Mapping[str, torch.Tensor]] = field(default_factory=dict)
    # Test/planning aid: weights are stand-ins in block units (one element per 128x128 block, same shape as the
    # scales). The moves are identical; only the weight-vs-scale shape checks change.
    block_units: bool = False

    def __post_init__(self) -> None:
        want = {(p, v, t) for p in range(self.pp) for v in range(self.vp or 1) for t in range(self.tp)}
        missing = sorted(want - set(self.states))
        if missing:
            raise ValueError(f"Megatron shards for TP{self.tp} x PP{self.pp} x VPP{self.vp or 1} are missing "
                             f"(pp_rank, vp_stage, tp_rank) = {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    @classmethod
    def from_tp_list(cls, shape: ModelShape, states: Sequence[Mapping[str, torch.Tensor]]) -> MegatronShards:
        """PP = 1 convenience: one state dict per TP rank."""
        return cls(shape, len(states), 1, None, {(0, 0, r): s for r, s in enumerate(states)})

    def _get(self, key: tuple[int, int, int], name: str) -> torch.Tensor:
        try:
            return self.states[key][name]
        except KeyError:
            raise KeyError(f"Megatron shard (pp_rank, vp_stage, tp_rank)={key} has no tensor {name!r}") from None

    def _has(self, key: tuple[int, int, int], name: str) -> bool:
        return name in self.states[key]

    def layer_key(self, layer: int) -> tuple[int, int, str]:
        """(pp_rank, vp_stage, local layer prefix) of global decoder layer `layer`."""
        pp_rank, vp_stage, local = layout.pp_stage_of_layer(layer, self.shape.num_layers, self.pp, self.vp)
        return pp_rank, vp_stage, layout.megatron_layer_prefix(local)

    def layer_shards(self, layer: int, suffix: str) -> list[torch.Tensor] | None:
        """TP shards (rank order) of a layer parameter, or None when the chunk does not have it."""
        pp_rank, vp_stage, prefix = self.layer_key(layer)
        if not self._has((pp_rank, vp_stage, 0), prefix + suffix):
            return None
        return [self._get((pp_rank, vp_stage, t), prefix + suffix) for t in range(self.tp)]

    def first_shards(self, name: str) -> list[torch.Tensor]:
        return [self._get((0, 0, t), name) for t in range(self.tp)]

    def last_shards(self, name: str) -> list[torch.Tensor]:
        return [self._get((self.pp - 1, (self.vp or 1) - 1, t), name) for t in range(self.tp)]

    def fp8_projections(self) -> frozenset[str]:
        """Projections (q, k, v, o, gate, up, down) held as FP8 with scales in some layer: only their moves need
        whole 128 blocks (preflight's `moved`). Reads names only (a recording state dict marks nothing read)."""
        params = {p + ".weight" + SCALE_SUFFIX for p in MEGATRON_PARAM.values()}
        held = {p for state in self.states.values() for name in state for p in params if name.endswith(p)}
        return frozenset(proj for proj, p in MEGATRON_PARAM.items() if p + ".weight" + SCALE_SUFFIX in held)

    def validate(self, rollout_tp: int) -> None:
        """Preflight for these shards to vLLM TP `rollout_tp`: block rules for the FP8 tensors they hold only."""
        fp8 = self.fp8_projections()
        validate_reshard(self.shape, self.tp, self.pp, rollout_tp, self.vp, fp8, fp8)


def _trim_scale(s: torch.Tensor, cols: int, name: str) -> torch.Tensor:
    """TE pads blockwise scale columns to a multiple of 4; keep the first ceil(K/128) (the real blocks)."""
    if s.dim() != 2 or s.shape[1] < cols:
        raise ValueError(f"{name}{SCALE_SUFFIX}: shape {tuple(s.shape)} has fewer than the {cols} block columns "
                         f"its weight needs")
    return s if s.shape[1] == cols else s[:, :cols]


def _gemm_shards(src: MegatronShards, layer: int, mparam: str,
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """(weight shards, scale shards or None for BF16) of a layer's GEMM parameter, scales trimmed."""
    name = mparam + ".weight"
    weights = src.layer_shards(layer, name)
    if weights is None:
        raise KeyError(f"layer {layer}: Megatron parameter {name!r} not found in its PP stage")
    scales = src.layer_shards(layer, name + SCALE_SUFFIX)
    if scales is None:
        if weights[0].dtype == torch.float8_e4m3fn:
            raise ValueError(f"layer {layer}: {name} is FP8 but has no {name}{SCALE_SUFFIX}")
        return weights, None
    unit = 1 if src.block_units else BLOCK
    cols = _cdiv(weights[0].shape[1], unit)
    scales = [_trim_scale(s, cols, f"layer {layer} {name}") for s in scales]
    for r, (w, s) in enumerate(zip(weights, scales, strict=True)):
        if s.shape[0] != _cdiv(w.shape[0], unit):
            raise ValueError(f"layer {layer} {name} TP rank {r}: weight {tuple(w.shape)} needs "
                             f"{_cdiv(w.shape[0], unit)} scale rows, got {tuple(s.shape)}")
    return weights, scales


# ----------------------------------------------------------------------------------------------------------------
# Megatron -> vLLM (one rollout rank)


CopyPair = tuple[torch.Tensor, torch.Tensor]   # (destination view, source view), both integer views
DstFactory = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _allocate(device: torch.device | str | None) -> DstFactory:
    def make(name: str, shape: tuple[int, ...], dtype: torch.dtype, src_device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device or src_device)
    return make


def _check_dst(t: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name}: destination is {tuple(t.shape)} {t.dtype}, the reshard produces "
                         f"{tuple(shape)} {dtype}")
    return t


def _plan_pairs(plan: ParamPlan, shards: Sequence[torch.Tensor], name: str, dst_for: DstFactory,
                ) -> tuple[torch.Tensor, list[CopyPair]]:
    """Destination tensor + slab copies building one vLLM tensor from Megatron TP shards (weight, scale or bias)."""
    dim = plan.dim if shards[0].dim() > 1 else 0
    size = shards[0].shape[dim]
    unit, rem = divmod(size, plan.src_blocks)
    if rem or unit == 0:
        raise ValueError(f"{name}: Megatron shard size {size} along dim {dim} is not {plan.src_blocks} blocks")
    for r, sh in enumerate(shards):
        if sh.shape != shards[0].shape or sh.dtype != shards[0].dtype:
            raise ValueError(f"{name}: TP rank {r} shard {tuple(sh.shape)} {sh.dtype} differs from rank 0 "
                             f"{tuple(shards[0].shape)} {shards[0].dtype}")
    out_shape = list(shards[0].shape)
    out_shape[dim] = plan.dst_blocks * unit
    out = _check_dst(dst_for(name, tuple(out_shape), shards[0].dtype, shards[0].device), name, tuple(out_shape),
                     shards[0].dtype)
    dst = raw(out)
    srcs = [raw(sh) for sh in shards]
    pairs = [widen((dst.narrow(dim, seg.dst_start * unit, seg.length * unit),
                    srcs[seg.src_rank].narrow(dim, seg.src_start * unit, seg.length * unit))) for seg in plan.segments]
    return out, pairs


def _whole_pair(t: torch.Tensor, name: str, dst_for: DstFactory) -> tuple[torch.Tensor, list[CopyPair]]:
    out = _check_dst(dst_for(name, tuple(t.shape), t.dtype, t.device), name, tuple(t.shape), t.dtype)
    return out, [widen((raw(out), raw(t)))]


def run_pairs(pairs: Sequence[CopyPair]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def _copy(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    out, pairs = _whole_pair(t, "", _allocate(device))
    run_pairs(pairs)
    return out


def layer_copy_pairs(src: MegatronShards, layer: int, rollout_tp: int, rank: int, dst_for: DstFactory,
                     ) -> tuple[dict[str, torch.Tensor], list[CopyPair]]:
    """Destination tensors and byte copies of decoder layer `layer` on vLLM rank `rank` (nothing copied yet)."""
    shape = src.shape
    prefix = layout.hf_layer_prefix(layer)
    out: dict[str, torch.Tensor] = {}
    pairs: list[CopyPair] = []

    def add(name: str, made: tuple[torch.Tensor, list[CopyPair]]) -> None:
        out[name] = made[0]
        pairs.extend(made[1])

    unit = BLOCK if src.block_units else bf16_unit(shape, src.tp, rollout_tp)
    for i, plan in enumerate(vllm_rank_plans(shape, src.tp, rollout_tp, rank, unit)):
        weights, scales = _gemm_shards(src, layer, plan.megatron_param)
        if scales is not None and plan.unit != BLOCK:
            plan = vllm_rank_plans(shape, src.tp, rollout_tp, rank)[i]  # FP8: whole 128x128 blocks
        name = prefix + plan.vllm_param + ".weight"
        add(name, _plan_pairs(plan, weights, name, dst_for))
        if scales is not None:
            add(name + SCALE_SUFFIX, _plan_pairs(plan, scales, name + SCALE_SUFFIX, dst_for))
        if plan.vllm_param == "self_attn.qkv_proj" and shape.qkv_bias:
            bias = src.layer_shards(layer, plan.megatron_param + ".bias")
            if bias is None:
                raise KeyError(f"layer {layer}: {shape.name} has q/k/v bias but linear_qkv.bias is missing")
            add(prefix + "self_attn.qkv_proj.bias", _plan_pairs(plan, bias, prefix + "self_attn.qkv_proj.bias",
                                                                  dst_for))
    norms = [("input_layernorm.weight", "input_layernorm.weight"),
             ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")]
    if shape.qk_norm:
        norms += [("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                  ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
    for mname, hname in norms:
        shards = src.layer_shards(layer, mname)
        if shards is None:
            raise KeyError(f"layer {layer}: Megatron parameter {mname!r} not found")
        add(prefix + hname, _whole_pair(shards[0], prefix + hname, dst_for))
    return out, pairs


def vllm_layer_tensors(src: MegatronShards, layer: int, rollout_tp: int, rank: int,
                       device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """vLLM rank `rank`'s tensors of decoder layer `layer` (vLLM module names, global layer index)."""
    out, pairs = layer_copy_pairs(src, layer, rollout_tp, rank, _allocate(device))
    run_pairs(pairs)
    return out


def vocab_copy_pairs(shards: Sequence[torch.Tensor], vocab_size: int, start: int, stop: int, name: str,
                     dst_for: DstFactory) -> tuple[torch.Tensor, list[CopyPair], torch.Tensor]:
    """Rows [start, stop) of the unpadded vocab from Megatron vocab shards: (dst, copies, padding rows to zero)."""
    per = shards[0].shape[0]
    if per * len(shards) < vocab_size:
        raise ValueError(f"{name}: {len(shards)} shards x {per} rows < vocab_size {vocab_size}")
    shape = (stop - start, *shards[0].shape[1:])
    out = _check_dst(dst_for(name, shape, shards[0].dtype, shards[0].device), name, shape, shards[0].dtype)
    dst = raw(out)
    lo, hi = start, min(stop, vocab_size)
    pad = dst[max(hi - start, 0):]
    pairs = []
    while lo < hi:
        r, off = divmod(lo, per)
        n = min(hi - lo, per - off)
        pairs.append(widen((dst.narrow(0, lo - start, n), raw(shards[r]).narrow(0, off, n))))
        lo += n
    return out, pairs, pad


def _vocab_rows(shards: Sequence[torch.Tensor], vocab_size: int, start: int, stop: int,
                device: torch.device | str | None, what: str) -> torch.Tensor:
    """Rows [start, stop) of the unpadded vocab gathered from Megatron vocab shards; rows >= vocab_size are zero."""
    out, pairs, pad = vocab_copy_pairs(shards, vocab_size, start, stop, what, _allocate(device))
    pad.zero_()
    run_pairs(pairs)
    return out


def vllm_vocab_rows(vocab_size: int, rollout_tp: int, rank: int, what: str = "vocab") -> tuple[int, int]:
    """[start, stop) of a vLLM rank's embedding / lm_head rows: vocab padded to a multiple of 64, split evenly."""
    padded = vllm_padded_vocab(vocab_size)
    if padded % rollout_tp:
        raise ValueError(f"{what}: vLLM padded vocab {padded} is not divisible by TP {rollout_tp}")
    per = padded // rollout_tp
    return rank * per, (rank + 1) * per


def vllm_vocab_tensor(shards: Sequence[torch.Tensor], vocab_size: int, rollout_tp: int, rank: int,
                      device: torch.device | str | None = None, what: str = "vocab") -> torch.Tensor:
    """vLLM rank's rows of an embedding / lm_head (pad rows zero)."""
    start, stop = vllm_vocab_rows(vocab_size, rollout_tp, rank, what)
    return _vocab_rows(shards, vocab_size, start, stop, device, what)


def iter_vllm_rank(src: MegatronShards, rollout_tp: int, rank: int,
                   device: torch.device | str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream vLLM rank `rank`'s tensors: embedding, layers in order, final norm, lm_head (untied models)."""
    shape = src.shape
    src.validate(rollout_tp)
    if not 0 <= rank < rollout_tp:
        raise ValueError(f"rollout rank {rank} outside [0, {rollout_tp})")
    emb = layout.embedding_param_map().megatron
    yield "model.embed_tokens.weight", vllm_vocab_tensor(src.first_shards(emb), shape.vocab_size, rollout_tp,
                                                         rank, device, emb)
    for layer in range(shape.num_layers):
        yield from vllm_layer_tensors(src, layer, rollout_tp, rank, device).items()
    yield "model.norm.weight", _copy(src.last_shards(layout.final_norm_param_map().megatron)[0], device)
    out_map = layout.output_param_map(shape)
    if out_map is not None:
        yield "lm_head.weight", vllm_vocab_tensor(src.last_shards(out_map.megatron), shape.vocab_size,
                                                  rollout_tp, rank, device, out_map.megatron)


# ----------------------------------------------------------------------------------------------------------------
# Megatron -> canonical (HF names, full size)


def _bytes_copy(t: torch.Tensor) -> torch.Tensor:
    return _copy(t.contiguous() if not t.is_contiguous() else t, None)


def canonical_layer_tensors(src: MegatronShards, layer: int) -> dict[str, torch.Tensor]:
    """Canonical HF-named tensors of decoder layer `layer` (FP8 weights + "<name>_scale_inv", BF16 others)."""
    shape = src.shape
    out: dict[str, torch.Tensor] = {}
    for pmap in layout.layer_param_maps(shape, layer, 0):
        suffix = layout.split_megatron_layer_name(pmap.megatron)[1]
        if pmap.gemm:
            weights, scales = _gemm_shards(src, layer, suffix.removesuffix(".weight"))
            hf_w = layout.megatron_shards_to_hf(pmap, [raw(w) for w in weights], shape)
            for name, t in zip(pmap.hf, hf_w, strict=True):
                out[name] = t.contiguous().view(weights[0].dtype)
            if scales is not None:
                hf_s = layout.megatron_shards_to_hf(pmap, [raw(s) for s in scales], shape,
                                                    rows_per_head=shape.head_dim // BLOCK)
                for name, t in zip(pmap.hf, hf_s, strict=True):
                    out[name + SCALE_SUFFIX] = t.contiguous().view(scales[0].dtype)
        else:
            shards = src.layer_shards(layer, suffix)
            if shards is None:
                raise KeyError(f"layer {layer}: Megatron parameter {suffix!r} not found in its PP stage")
            hf_t = layout.megatron_shards_to_hf(pmap, [raw(s) for s in shards], shape)
            for name, t in zip(pmap.hf, hf_t, strict=True):
                out[name] = _bytes_copy(t).view(shards[0].dtype)
    return out


def iter_canonical(src: MegatronShards) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the canonical checkpoint: embedding, layers in order, final norm, lm_head (untied only)."""
    shape = src.shape
    layout.pp_layer_range(shape.num_layers, src.pp, 0, src.vp, 0)  # validates the PP split
    emb = layout.embedding_param_map()
    shards = src.first_shards(emb.megatron)
    yield emb.hf[0], _vocab_rows(shards, shape.vocab_size, 0, shape.vocab_size, None, emb.megatron)
    for layer in range(shape.num_layers):
        yield from canonical_layer_tensors(src, layer).items()
    norm = layout.final_norm_param_map()
    yield norm.hf[0], _copy(src.last_shards(norm.megatron)[0], None)
    out_map = layout.output_param_map(shape)
    if out_map is not None:
        shards = src.last_shards(out_map.megatron)
        yield out_map.hf[0], _vocab_rows(shards, shape.vocab_size, 0, shape.vocab_size, None, out_map.megatron)


# ----------------------------------------------------------------------------------------------------------------
# canonical -> Megatron (the inverse; used for round trips and for loading an exported checkpoint into the trainer)


def megatron_from_canonical(canonical: Mapping[str, torch.Tensor], shape: ModelShape, tp: int, pp: int = 1,
                            vp: int | None = None, block_units: bool = False) -> MegatronShards:
    """Split canonical HF-named tensors (with optional "<name>_scale_inv") into Megatron TP x PP (x VPP) shards."""
    padded = layout.padded_vocab_size(shape.vocab_size, tp)
    states: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    for p in range(pp):
        for v in range(vp or 1):
            maps = layout.stage_param_maps(shape, pp, p, vp, v)
            for t in range(tp):
                state: dict[str, torch.Tensor] = {}
                for pmap in maps:
                    try:
                        hf = [canonical[n] for n in pmap.hf]
                    except KeyError as err:
                        raise KeyError(f"canonical checkpoint has no tensor {err.args[0]!r} "
                                       f"(needed for {pmap.megatron})") from None
                    dtype = hf[0].dtype
                    state[pmap.megatron] = layout.hf_to_megatron_shard(
                        pmap, [raw(x) for x in hf], shape, tp, t, padded_vocab=padded).contiguous().view(dtype)
                    if pmap.gemm and pmap.hf[0] + SCALE_SUFFIX in canonical:
                        sc = [canonical[n + SCALE_SUFFIX] for n in pmap.hf]
                        state[pmap.megatron + SCALE_SUFFIX] = layout.hf_to_megatron_shard(
                            pmap, [raw(x) for x in sc], shape, tp, t,
                            rows_per_head=shape.head_dim // BLOCK).contiguous().view(sc[0].dtype)
                states[(p, v, t)] = state
    return MegatronShards(shape, tp, pp, vp, states, block_units)
