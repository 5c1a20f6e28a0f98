"""The trainer's weights as a stream of full (TP-gathered) HF-named tensors, for a refit driven by another framework.

NeMo-RL (and similar trainers) refit vLLM from a generator of ``(HF name, tensor)`` pairs that every training rank
runs in lockstep; each rank ends up with every full tensor and hands it to its rollout engine, whose weight loader
takes its own TP shard. :class:`HfRefitStream` is that generator for a Jet-RL model: FP8 linears yield the
trainer's FP8 cache bytes (E4M3 ``weight`` + FP32 128x128 ``weight_scale_inv``, the codes every forward of the step
used; nothing is re-quantized), BF16 tensors their BF16 bytes.

One unit (embedding, decoder layer, final norm, output layer) at a time: the owning pipeline stage packs its local
tensors into one byte buffer, the TP group all-gathers it, and the pipeline group broadcasts it from the owner, so
peak extra memory is one unit (one layer) and each unit costs one collective per group. Names, dtypes and shapes are
exchanged once (the first iteration) and checked on every later one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from jetrl_megatron.megatron.model import rollout_weights
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.reshard.hf_stream import (
    StreamUnit,
    check_stage_coverage,
    hf_stream_metadata,
    stream_units,
    unit_hf_tensors,
    unit_names,
)
from jetrl_megatron.reshard.packing import PackSpec
from jetrl_megatron.reshard.preflight import ReshardError
from jetrl_megatron.reshard.transport import Transport

__all__ = ["HfRefitStream"]

Meta = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class _UnitPlan:
    unit: StreamUnit
    spec: PackSpec  # one TP rank's tensors of the unit, packed


def _meta_of(local: dict[str, torch.Tensor]) -> Meta:
    return {n: (t.dtype, tuple(t.shape)) for n, t in local.items()}


class HfRefitStream:
    """Iterate it on every rank of the model-parallel group (collective): yields ``(HF name, full tensor)``.

    ``model``: this rank's (possibly DDP / Float16Module-wrapped) Jet-RL model chunk; ``shape``: its architecture.
    Yielded tensors are fresh (not views of live parameters or of the FP8 cache) on the model's device; consumers
    may keep or copy them. Virtual pipeline stages (several chunks per rank) are not supported.
    """

    def __init__(self, model: torch.nn.Module, shape: ModelShape) -> None:
        from megatron.core import parallel_state

        self.model = model
        self.shape = shape
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.tp_transport = Transport(parallel_state.get_tensor_model_parallel_group()) if self.tp > 1 else None
        self.pp_transport = Transport(parallel_state.get_pipeline_model_parallel_group()) if self.pp > 1 else None
        self._local_meta: Meta | None = None
        self._stage_meta: list[Meta] | None = None
        self._plans: list[_UnitPlan] | None = None

    # ------------------------------------------------------------------------------------------------ planning
    def _plan(self, local: dict[str, torch.Tensor]) -> list[_UnitPlan]:
        meta = _meta_of(local)
        if self._plans is not None:
            if meta != self._local_meta:
                changed = sorted(set(meta) ^ set(self._local_meta or {})) or \
                    [n for n in meta if meta[n] != self._local_meta[n]]
                raise ReshardError(f"refit stream: the trainer's tensors changed since the first refit "
                                   f"(names, dtypes or shapes), e.g. {changed[:4]}")
            return self._plans
        if self.tp_transport is not None:
            peers = self.tp_transport.gather_meta(meta)
            for r, other in enumerate(peers):
                if other != meta:
                    bad = sorted(set(other) ^ set(meta)) or [n for n in meta if other[n] != meta[n]]
                    raise ReshardError(f"refit stream: TP rank {r} of pipeline stage {self.pp_rank} holds different "
                                       f"tensors than this rank, e.g. {bad[:4]}")
        stages = [meta] if self.pp_transport is None else self.pp_transport.gather_meta(meta)
        check_stage_coverage(self.shape, self.pp, self.pp_rank, meta)
        plans = []
        for unit in stream_units(self.shape, self.pp):
            names = unit_names(unit, self.shape, stages[unit.pp_rank])
            if not names:
                raise ReshardError(f"refit stream: pipeline stage {unit.pp_rank} has no tensor of {unit.describe()}")
            stage = stages[unit.pp_rank]
            plans.append(_UnitPlan(unit, PackSpec.of((n, *stage[n]) for n in names)))
        self._local_meta, self._stage_meta, self._plans = meta, stages, plans
        return plans

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(HF name, dtype, shape) of every yielded tensor, in order; collective the first time (plans the stream)."""
        self._plan(rollout_weights(self.model))
        return hf_stream_metadata(self.shape, self._stage_meta, self.tp)

    # ------------------------------------------------------------------------------------------------ streaming
    def _gather(self, plan: _UnitPlan, local: dict[str, torch.Tensor], device: torch.device
                ) -> list[dict[str, torch.Tensor]]:
        """Every TP rank's tensors of the unit, on every rank (views of one fresh byte buffer)."""
        nbytes = plan.spec.nbytes
        buf = torch.empty(self.tp * nbytes, dtype=torch.uint8, device=device)
        parts = [buf[r * nbytes:(r + 1) * nbytes] for r in range(self.tp)]
        if self.pp_rank == plan.unit.pp_rank:
            if self.tp_transport is None:
                plan.spec.pack(local, out=parts[0])
            else:
                self.tp_transport.all_gather(parts, plan.spec.pack(local, device=device))
        if self.pp_transport is not None:
            self.pp_transport.broadcast(buf, root=plan.unit.pp_rank)
        return [plan.spec.unpack(part) for part in parts]

    @torch.no_grad()
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        local = rollout_weights(self.model)
        plans = self._plan(local)
        device = next(iter(local.values())).device
        for plan in plans:
            yield from unit_hf_tensors(self.shape, plan.unit, self._gather(plan, local, device))

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self)
