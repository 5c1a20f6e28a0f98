"""A refit stream in HF names: the model cut into units (embedding, each decoder layer, final norm, output layer),
each unit's Megatron TP shards turned into full-size HF-named tensors.

Why units: a trainer that hands weights to another framework's refit (NeMo-RL's weight generator yields full,
TP-gathered ``(HF name, tensor)`` pairs) should gather one unit at a time, not the whole model. Why here: the
conversion is the resharder's own (``canonical_layer_tensors`` for decoder layers, the layout's byte moves for the
vocabulary and norm tensors), so the stream carries exactly the bytes an HF FP8 export holds: the trainer's E4M3
codes and FP32 128x128 ``weight_scale_inv`` unchanged, BF16 tensors unchanged, vocab padding trimmed.

Pure functions of tensors: the collective gathering lives with the trainer (``jetrl_megatron.nemo_rl.hf_refit``, over
``reshard.transport``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from jetrl_megatron.fp8.format import SCALE_SUFFIX
from jetrl_megatron.model import layout
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.reshard.mover import MegatronShards, canonical_layer_tensors
from jetrl_megatron.reshard.packing import raw
from jetrl_megatron.reshard.preflight import ReshardError

__all__ = ["StreamUnit", "stream_units", "unit_names", "unit_hf_tensors", "hf_stream_metadata",
           "check_stage_coverage"]

EMBEDDING, LAYER, FINAL_NORM, OUTPUT = "embedding", "layer", "final_norm", "output"


@dataclass(frozen=True)
class StreamUnit:
    """One piece of the stream: what it is, which pipeline stage owns it, and (layers) its global index."""

    kind: str
    pp_rank: int
    layer: int | None = None
    local_layer: int | None = None

    def describe(self) -> str:
        return f"decoder layer {self.layer}" if self.kind == LAYER else self.kind


def stream_units(shape: ModelShape, pp: int = 1) -> list[StreamUnit]:
    """The stream's units in HF checkpoint order: embedding, layers 0..L-1, final norm, lm_head (untied only)."""
    layout.pp_layer_range(shape.num_layers, pp, 0)  # validates the PP split
    units = [StreamUnit(EMBEDDING, 0)]
    for g in range(shape.num_layers):
        pp_rank, _, local = layout.pp_stage_of_layer(g, shape.num_layers, pp)
        units.append(StreamUnit(LAYER, pp_rank, g, local))
    units.append(StreamUnit(FINAL_NORM, pp - 1))
    if layout.output_param_map(shape) is not None:
        units.append(StreamUnit(OUTPUT, pp - 1))
    return units


def _single_map(unit: StreamUnit, shape: ModelShape) -> layout.ParamMap:
    if unit.kind == EMBEDDING:
        return layout.embedding_param_map()
    if unit.kind == FINAL_NORM:
        return layout.final_norm_param_map()
    out = layout.output_param_map(shape)
    if unit.kind != OUTPUT or out is None:
        raise ValueError(f"{unit.describe()}: not a single-tensor unit")
    return out


def unit_names(unit: StreamUnit, shape: ModelShape, stage_names: Iterable[str]) -> list[str]:
    """The owning stage's Megatron names (local layer index) that make up ``unit``, in the stage's order."""
    if unit.kind == LAYER:
        expected = set()
        for pmap in layout.layer_param_maps(shape, unit.layer, unit.local_layer):
            expected.add(pmap.megatron)
            if pmap.gemm:
                expected.add(pmap.megatron + SCALE_SUFFIX)
    else:
        expected = {_single_map(unit, shape).megatron}
    return [n for n in stage_names if n in expected]


def _global_layer_state(state: Mapping[str, torch.Tensor], unit: StreamUnit) -> dict[str, torch.Tensor]:
    offset = unit.layer - unit.local_layer
    return {layout.megatron_name_to_global(n, offset): t for n, t in state.items()}


def unit_hf_tensors(shape: ModelShape, unit: StreamUnit, tp_states: Sequence[Mapping[str, torch.Tensor]],
                    ) -> list[tuple[str, torch.Tensor]]:
    """HF-named full tensors of ``unit`` from its TP shards (``tp_states[r]``: rank r's tensors, local names).

    FP8 GEMM weights come with ``<name>_scale_inv``; a GEMM weight without a scale is BF16 (a recipe's BF16
    layers). Every tensor is a byte copy: no value is converted or rounded.
    """
    if not tp_states:
        raise ValueError(f"{unit.describe()}: no TP shards given")
    if unit.kind == LAYER:
        tp = len(tp_states)
        src = MegatronShards(shape, tp, 1, None,
                             {(0, 0, r): _global_layer_state(s, unit) for r, s in enumerate(tp_states)})
        return list(canonical_layer_tensors(src, unit.layer).items())
    pmap = _single_map(unit, shape)
    try:
        shards = [s[pmap.megatron] for s in tp_states]
    except KeyError:
        raise ReshardError(f"{unit.describe()}: the trainer has no tensor {pmap.megatron!r}") from None
    (hf,) = layout.megatron_shards_to_hf(pmap, [raw(s) for s in shards], shape)
    out = torch.empty(hf.shape, dtype=shards[0].dtype, device=hf.device)
    raw(out).copy_(hf)
    return [(pmap.hf[0], out)]


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def hf_stream_metadata(shape: ModelShape, stage_meta: Sequence[Mapping[str, tuple[torch.dtype, tuple[int, ...]]]],
                       tp: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(HF name, dtype, shape) of every tensor the stream yields, from each stage's (name -> dtype, shape); no data.

    ``stage_meta[p]``: pipeline stage p's local tensors (the same on each of its TP ranks).
    """
    out = []
    for unit in stream_units(shape, len(stage_meta)):
        meta = stage_meta[unit.pp_rank]
        names = unit_names(unit, shape, meta)
        state = {n: _stand_in(tuple(meta[n][1]), meta[n][0]) for n in names}
        out += [(n, t.dtype, tuple(t.shape)) for n, t in unit_hf_tensors(shape, unit, [state] * tp)]
    return out


def check_stage_coverage(shape: ModelShape, pp: int, pp_rank: int, names: Iterable[str]) -> None:
    """Every local tensor of stage ``pp_rank`` belongs to one unit (else the stream would silently drop it)."""
    covered: set[str] = set()
    for unit in stream_units(shape, pp):
        if unit.pp_rank == pp_rank:
            covered.update(unit_names(unit, shape, names))
    extra = [n for n in names if n not in covered]
    if shape.tie_word_embeddings and pp > 1 and pp_rank == pp - 1:
        extra = [n for n in extra if n != "output_layer.weight"]  # the last stage's copy of the tied embedding
    if extra:
        raise ReshardError(f"pipeline stage {pp_rank}: tensors {extra[:8]} have no HF name in the refit stream "
                           f"({shape.name}); expected only the layout's parameters and their {SCALE_SUFFIX} scales")
