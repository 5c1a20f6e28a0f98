"""Where each rank's vLLM shard refits from: the trainer's tensors in place, or (model parallel) the Megatron shards
streamed point-to-point over the model-parallel group in rounds through two fixed staging buffers; and the check
that vLLM serves the trainer's FP8 bytes."""

from __future__ import annotations

import math
import time

import torch

from jetrl_megatron.reshard.exchange import (
    VirtualSources,
    budget_bytes,
    copy_sources,
    exchange_names,
    exchange_schedule,
    finite_chunk,
    stream_pairs,
)
from jetrl_megatron.reshard.mover import MegatronShards
from jetrl_megatron.reshard.packing import PackSpec
from jetrl_megatron.reshard.program import stand_in
from jetrl_megatron.reshard.transport import StagedStream, Transport
from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.dist import (
    dist_rank,
)
from jetrl_megatron.rl.tools.served_fp8_check import served_fp8_equal
from jetrl_megatron.rl.trainer import (
    Trainer,
    local_rollout_tensors,
    megatron_states,
    mp_group,
)
from jetrl_megatron.rollout.refit import RefitError, _finite


class StreamedCopies:
    """The refit program's copies from peers' tensors, re-pointed at the receive staging buffer, per round; grouped
    like the program's own copies (contiguous pairs batched per dtype, strided ones apart)."""

    def __init__(self, rounds: list[list[tuple[torch.Tensor, torch.Tensor]]]):
        self.rounds = []
        for pairs in rounds:
            groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            strided = []
            for d, s in pairs:
                if d.is_contiguous() and s.is_contiguous():
                    g = groups.setdefault(d.dtype, ([], []))
                    g[0].append(d)
                    g[1].append(s)
                else:
                    strided.append((d, s))
            self.rounds.append((list(groups.values()), strided))
        self.checks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, differs) of the last recorded run

    def run_round(self, k: int, record: bool) -> None:
        groups, strided = self.rounds[k]
        for dsts, srcs in groups:
            torch._foreach_copy_(dsts, srcs)
        for d, s in strided:
            d.copy_(s)
        if record:  # the staging rows are overwritten by the next round: compare now
            self.checks += [(d, (d != s).any()) for dsts, srcs in groups for d, s in zip(dsts, srcs, strict=True)]
            self.checks += [(d, (d != s).any()) for d, s in strided]


class RefitExchange:
    """Streams the peers' Megatron tensors a rank's vLLM rank copies from, through two fixed staging buffers.

    Planned once from the names, dtypes and shapes every member of the model-parallel group holds (one exchange of
    packer specs): `reshard.exchange` picks which tensors each vLLM rank copies from and cuts each (sender,
    receiver) stream into rounds that fit the budget (``policy.refit_buffer_size_gb``); `jetrl plan` runs the same
    functions. The peers' tensors appear in :meth:`shards` as meta-device stand-ins: the engine plans its compiled
    program over them, hands the copies from them to :meth:`attach`, and :meth:`run` then drives the
    `reshard.transport.StagedStream`: each round packs what this rank sends into the send buffer, exchanges one
    message per peer in one batched point-to-point call (NCCL on GPU, gloo on CPU; bytes), and copies the received
    rows into the engine's tensors. What a rank copies from itself is read in place: the shards hold the trainer's
    own tensors, which stay at fixed addresses (the FP8 cache re-quantizes into the same tensors; parameters keep
    the storage DDP's param buffer gave them).
    """

    def __init__(self, shape, tp: int, pp: int, rollout_tp: int, key: tuple[int, int, int], group, budget: int):
        self.shape, self.tp, self.pp, self.rollout_tp, self.key = shape, tp, pp, rollout_tp, key
        self.budget = budget
        self.transport = Transport(group)
        self.me = self.transport.me
        self._shards = None
        self._stream: StagedStream | None = None
        self._local: dict[str, torch.Tensor] = {}
        self.seconds = 0.0  # the last run's packing + communication + copies
        self.received_bytes = 0  # per refit: what this rank's vLLM rank takes from trainer shards, its own included

    def _plan(self, local: dict[str, torch.Tensor]) -> None:
        spec = PackSpec.of_tensors(local)
        gathered = self.transport.gather_meta((self.key, spec.describe()))
        metas = {key: [(s.name, s.dtype, s.shape) for s in PackSpec.from_description(desc).slots]
                 for key, desc in gathered}
        by_name = {key: {name: (dt, shape) for name, dt, shape in meta} for key, meta in metas.items()}
        roles = [(key, g % self.rollout_tp) for (key, _), g in zip(gathered, self.transport.members, strict=True)]
        sources = copy_sources(self.shape, self.tp, self.pp, self.rollout_tp, metas, [v for _, v in roles])
        names = exchange_names(metas, roles, sources)
        self.schedule = exchange_schedule(metas, roles, names, self.budget)[self.me]
        self.peer_keys = [key for key, _ in roles]
        device = next(iter(local.values())).device
        self.virtual = VirtualSources([(roles[peer][0], name, *by_name[roles[peer][0]][name])
                                       for peer in range(self.transport.size) if peer != self.me
                                       for name in names.get((peer, self.me), [])])
        states = {key: {name: stand_in(shape, dt, device) for name, dt, shape in meta} for key, meta in metas.items()}
        for (key, name), t in self.virtual.tensors.items():
            states[key][name] = t
        self._own = names.get((self.me, self.me), [])
        self._sent = sorted({x for (src, dst), ns in names.items() if src == self.me != dst for x in ns})
        self._stream = StagedStream(self.transport, self.schedule, device)
        self.received_bytes = self.schedule.received + PackSpec.of(
            (n, *by_name[self.key][n]) for n in self._own).payload_bytes
        self._local_spec = spec
        self._shards = MegatronShards(self.shape, self.tp, self.pp, None, states)

    @property
    def send_buf(self) -> torch.Tensor | None:
        return None if self._stream is None else self._stream.send_buf

    @property
    def recv_buf(self) -> torch.Tensor | None:
        return None if self._stream is None else self._stream.recv_buf

    def shards(self, local: dict[str, torch.Tensor]):
        """The `reshard.MegatronShards` the engine plans its refit over: this rank's own tensors, the peers' as
        meta stand-ins (planned once, on the first call)."""
        if self._shards is None:
            self._plan(local)
        elif PackSpec.of_tensors(local) != self._local_spec:
            raise RuntimeError(f"rank {dist_rank()}: the trainer's rollout tensors changed names, dtypes or shapes "
                               "since the refit exchange was planned")
        own = self._shards.states[self.key]
        for x in self._own:  # the trainer's tensors themselves (same addresses every step)
            own[x] = local[x]
        self._local = local
        return self._shards

    def buffer_bytes(self) -> tuple[int, int]:
        """(send, receive) bytes of the staging buffers allocated on this rank (the storage itself)."""
        return (0, 0) if self._stream is None else self._stream.buffer_bytes()

    def attach(self, program) -> StreamedCopies:
        """Take the copies from the peers' stand-ins out of a refit program planned over :meth:`shards`."""
        pairs = program.take_pairs(lambda s: s.is_meta)
        if pairs and self.recv_buf is None:
            raise RuntimeError("the refit program copies from peers' tensors the exchange does not deliver")
        rounds = [recvs for _, recvs in self.schedule.rounds]
        staging = self.recv_buf if self.recv_buf is not None else torch.empty(0, dtype=torch.uint8)
        return StreamedCopies(stream_pairs(pairs, self.virtual, rounds, self.peer_keys, staging))

    def agree_finite(self, local_bad: list[str]) -> None:
        """Every member refuses the refit, before anything is written, if any member holds a non-finite tensor its
        engine copies from or that it sends (one all-reduce of a count over the group)."""
        flags = [_finite(self._local[x], finite_chunk(self.budget)) for x in self._sent]
        bad = list(local_bad)
        if flags:
            ok = torch.stack([f.to(self._local[self._sent[0]].device) for f in flags]).tolist()
            bad += [f"{x} (sent)" for x, good in zip(self._sent, ok, strict=True) if not good]
        device = self.send_buf.device if self.send_buf is not None else next(iter(self._local.values())).device
        total = self.transport.total(len(bad), device)
        if total:
            mine = f": {', '.join(bad[:8])}" if bad else ""
            raise RefitError.refused([f"{total} trainer tensor(s) contain NaN/Inf across the model-parallel group, "
                                      f"{len(bad)} on rank {dist_rank()}{mine}"])

    def run(self, copies: StreamedCopies, record: bool = False) -> None:
        """Every round: pack, exchange, copy the received rows into the engine's tensors (collective)."""
        t0 = time.perf_counter()
        copies.checks = []
        self._stream.run(self._local, lambda k: copies.run_round(k, record))
        self.seconds = time.perf_counter() - t0


class RefitSource:
    """The Megatron shards this rank's vLLM engine rank refits from, as a `reshard.MegatronShards`.

    Trainer TP x PP == 1: the trainer's own tensors, in place, on their device (nothing is copied, `exchange` is
    None). Model parallel: the peers' tensors stream through a :class:`RefitExchange` (``exchange``), which the
    engine's refit drives; at most `budget` bytes of staging per rank (``policy.refit_buffer_size_gb``).
    """

    def __init__(self, trainer: Trainer, rollout_tp: int = 1, budget: int | None = None):
        from megatron.core import parallel_state

        self.trainer = trainer
        self.rollout_tp = rollout_tp
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.key = (parallel_state.get_pipeline_model_parallel_rank(), 0,
                    parallel_state.get_tensor_model_parallel_rank())
        self.exchange: RefitExchange | None = None
        if self.tp * self.pp > 1:
            self.exchange = RefitExchange(trainer.shape, self.tp, self.pp, rollout_tp, self.key, mp_group(),
                                          budget_bytes(None) if budget is None else budget)

    @property
    def gather_seconds(self) -> float:
        return 0.0 if self.exchange is None else self.exchange.seconds

    @property
    def received_bytes(self) -> int:
        return 0 if self.exchange is None else self.exchange.received_bytes

    @property
    def _own(self) -> list[str]:
        return [] if self.exchange is None else self.exchange._own

    def shards(self):
        local = local_rollout_tensors(self.trainer)
        if self.exchange is None:
            return MegatronShards(self.trainer.shape, 1, 1, None, {self.key: local})
        return self.exchange.shards(local)

    def buffer_bytes(self) -> tuple[int, int]:
        """(send, receive) bytes of the exchange's staging buffers allocated on this rank (the storage itself)."""
        return (0, 0) if self.exchange is None else self.exchange.buffer_bytes()


def verify_served_fp8(cfg: RunConfig, trainer: Trainer, engine, states: dict) -> float:
    """1.0 when vLLM's live FP8 linears equal the trainer's cache byte for byte, 0.0 otherwise, NaN if not checked.

    Checked in the jetrl arm when rollout TP = 1 and PP = 1, on CPU or with ``policy.jet_rl.verify_served_fp8``
    (``JETRL_VERIFY_SERVED_FP8`` wins when set, resolved at config load into ``cfg.switches``; it reads every FP8
    weight back from the engine)."""
    want = cfg.switches.verify_served_fp8
    want = not torch.cuda.is_available() if want is None else want
    one_shard = cfg.policy.generation.vllm_cfg.tensor_parallel_size == 1 and \
        cfg.policy.megatron_cfg.pipeline_model_parallel_size == 1
    if not (want and cfg.recipe.rollout_weights == "trainer_fp8" and one_shard):
        return math.nan
    if any(t.is_meta for st in states.values() for t in st.values()):
        # the exchange streamed the peers' tensors and kept none: gather the trainer's own shards for the check
        # (a second, independent path: whole tensors to CPU, only when verifying)
        states = megatron_states(trainer)
    tp_states = [states[k] for k in sorted(states)]
    ok, bad = served_fp8_equal(engine, tp_states, trainer.shape)
    if not ok:
        raise RuntimeError(f"vLLM serves FP8 bytes that differ from the trainer's cache: {bad[:8]}")
    return 1.0
