"""The weight transport: packed byte buffers (`reshard.packing`) moved between the ranks of one process group.

Why one: the refit exchange (point-to-point rounds through fixed staging buffers), the HF-named refit stream (one
unit's buffer all-gathered over TP and broadcast over PP) and gathering every rank's tensors for an export all move
the trainer's weights the same way: ranks agree on a spec (names, dtype names, shapes; plain data, the only thing
ever pickled), then the bytes travel in flat uint8 buffers through tensor collectives (NCCL on GPU, gloo on CPU),
so FP8 codes and FP32 scales arrive bit for bit and nothing is converted.

Members are named by their index in the group (its order); :class:`Transport` turns them into global ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from jetrl_megatron.reshard.exchange import MemberSchedule
from jetrl_megatron.reshard.packing import PackSpec, aligned, pack_slots


class Transport:
    """Byte-buffer collectives over `group` (None: the default group), addressed by member index."""

    def __init__(self, group=None):
        self.group = group
        self.members: list[int] = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        self.me = self.members.index(dist.get_rank())

    @property
    def size(self) -> int:
        return len(self.members)

    def gather_meta(self, meta: object) -> list:
        """Every member's `meta` (plain data: names, dtypes, shapes, keys; never tensors), in member order."""
        out: list = [None] * self.size
        dist.all_gather_object(out, meta, group=self.group)
        return out

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """One batched point-to-point call: each (member, buffer) of `sends` goes to that member, each of `recvs` is
        filled from it; returns when all are done."""
        ops = [dist.P2POp(dist.isend, buf, self.members[peer], group=self.group) for peer, buf in sends]
        ops += [dist.P2POp(dist.irecv, buf, self.members[peer], group=self.group) for peer, buf in recvs]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    def all_gather(self, parts: list[torch.Tensor], mine: torch.Tensor) -> None:
        """`parts[r]` <- member r's `mine` (every member's buffer has the same size)."""
        dist.all_gather(parts, mine, group=self.group)

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        """`buf` <- member `root`'s `buf`."""
        dist.broadcast(buf, src=self.members[root], group=self.group)

    def total(self, count: int, device: torch.device | str) -> int:
        """The sum of every member's `count` (one all-reduce)."""
        t = torch.tensor([count], dtype=torch.int64, device=device)
        dist.all_reduce(t, group=self.group)
        return int(t.item())

    def gather_tensors(self, tensors: Mapping[str, torch.Tensor], out_device: torch.device | str = "cpu",
                       ) -> list[dict[str, torch.Tensor]]:
        """Every member's `tensors` (each member its own names, dtypes, shapes), bytes exact, on `out_device`, in
        member order: one spec exchange, then each member's packed buffer broadcast in turn, so the tensors' device
        holds this rank's buffer and one received buffer at a time, never the whole group's."""
        spec = PackSpec.of_tensors(tensors)
        device = next(iter(tensors.values())).device if tensors else torch.device(out_device)
        specs = [PackSpec.from_description(d) for d in self.gather_meta(spec.describe())]
        mine = spec.pack(tensors, device=device)
        out = []
        for r, sp in enumerate(specs):
            buf = mine if r == self.me else torch.empty(sp.nbytes, dtype=torch.uint8, device=device)
            if sp.nbytes:
                self.broadcast(buf, r)
            out.append(sp.unpack(buf.to(out_device)))
        return out


class StagedStream:
    """One member's side of a point-to-point stream in rounds (`reshard.exchange.exchange_schedule`) through two
    staging buffers allocated once: the largest round's sends and receives, so what the stream holds stays within
    the budget the schedule was cut for, however many bytes pass through."""

    def __init__(self, transport: Transport, schedule: MemberSchedule, device: torch.device | str):
        self.transport, self.schedule = transport, schedule
        self.send_buf = self._buffer(schedule.send_bytes, device)
        self.recv_buf = self._buffer(schedule.recv_bytes, device)

    @staticmethod
    def _buffer(nbytes: int, device) -> torch.Tensor | None:
        return torch.empty(aligned(nbytes), dtype=torch.uint8, device=device) if nbytes else None

    def buffer_bytes(self) -> tuple[int, int]:
        """(send, receive) bytes of the staging buffers (the storage itself)."""
        return tuple(0 if b is None else b.untyped_storage().nbytes() for b in (self.send_buf, self.recv_buf))

    def run(self, tensors: Mapping[str, torch.Tensor], after_round: Callable[[int], None]) -> None:
        """Every round: pack this member's messages from `tensors` into the send buffer, exchange them in one
        batched call, then `after_round(k)` while the receive buffer holds round k (the next round overwrites it)."""
        for k, (sends, recvs) in enumerate(self.schedule.rounds):
            for m in sends:
                pack_slots(self.send_buf[m.offset:m.offset + m.nbytes], m.pieces, tensors)
            self.transport.exchange([(m.peer, self.send_buf[m.offset:m.offset + m.nbytes]) for m in sends],
                                    [(m.peer, self.recv_buf[m.offset:m.offset + m.nbytes]) for m in recvs])
            after_round(k)


__all__ = ["StagedStream", "Transport"]
