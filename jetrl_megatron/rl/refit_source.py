"""Where each rank's vLLM shard refits from: the trainer's tensors in place, or (model parallel) the Megatron shards
exchanged point-to-point over the model-parallel group; and the check that vLLM serves the trainer's FP8 bytes."""

from __future__ import annotations

import math
import time

import torch

from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.dist import (
    dist_rank,
    env_flag,
    torch_dist,
)
from jetrl_megatron.rl.trainer import (
    Trainer,
    local_rollout_tensors,
    mp_group,
)


class RefitSource:
    """The Megatron shards this rank's vLLM engine rank refits from, as a `reshard.MegatronShards`.

    Trainer TP x PP == 1: the trainer's own tensors, in place, on their device (nothing is copied here).
    Model parallel: rank r needs the tensors that vLLM rank r % rollout_tp copies from - planned once by
    `reshard.exchange` (the resharder's compiled copy list over stand-ins) after exchanging names, dtypes and
    shapes; `jetrl plan` counts the same buffers. Every step each rank packs what each peer needs into a persistent
    byte buffer per peer and the MP group exchanges them with point-to-point tensor sends on the tensors' device
    (NCCL on GPU, gloo on CPU; FP8 as bytes). What a rank needs from itself is not copied: the shards hold the
    trainer's own tensors there, which stay at fixed addresses (the FP8 cache re-quantizes into the same tensors;
    parameters keep the storage DDP's param buffer gave them), so the engine's compiled program stays valid, and a
    moved tensor changes the source signature and rebuilds it. Received tensors are views of persistent receive
    buffers; tensors never copied from are stand-ins with a single zero element.
    """

    def __init__(self, trainer: Trainer, rollout_tp: int = 1):
        from megatron.core import parallel_state

        self.trainer = trainer
        self.rollout_tp = rollout_tp
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.key = (parallel_state.get_pipeline_model_parallel_rank(), 0,
                    parallel_state.get_tensor_model_parallel_rank())
        self._shards = None
        self._sends: list[tuple[int, torch.Tensor, list[torch.Tensor], list[str]]] = []
        self._recvs: list[tuple[int, torch.Tensor]] = []
        self._own: list[str] = []
        self.gather_seconds = 0.0
        self.received_bytes = 0  # per step: what this rank's vLLM rank takes from trainer shards, its own included

    def shards(self):
        from jetrl_megatron.reshard.mover import MegatronShards

        local = local_rollout_tensors(self.trainer)
        if self.tp * self.pp == 1:
            return MegatronShards(self.trainer.shape, 1, 1, None, {self.key: local})
        t0 = time.perf_counter()
        if self._shards is None:
            self._setup(local)
        self._exchange(local)
        self.gather_seconds = time.perf_counter() - t0
        return self._shards

    def buffer_bytes(self) -> tuple[int, int]:
        """(send, receive) bytes of the persistent exchange buffers allocated on this rank (the storage itself)."""
        return (sum(buf.untyped_storage().nbytes() for _, buf, _, _ in self._sends),
                sum(buf.untyped_storage().nbytes() for _, buf in self._recvs))

    @staticmethod
    def _meta(local: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in local.items()]

    def _setup(self, local: dict[str, torch.Tensor]) -> None:
        from jetrl_megatron.reshard.exchange import copy_sources, exchange_names, packed_layout
        from jetrl_megatron.reshard.mover import MegatronShards
        from jetrl_megatron.reshard.program import stand_in

        group = mp_group()
        members = torch_dist().get_process_group_ranks(group)  # global ranks, in MP-group order
        n = len(members)
        gathered: list = [None] * n
        torch_dist().all_gather_object(gathered, (self.key, self._meta(local)), group=group)  # names/shapes, once
        metas = {key: [(name, getattr(torch, dt), shape) for name, dt, shape in meta] for key, meta in gathered}
        by_name = {key: {name: (dt, shape) for name, dt, shape in meta} for key, meta in metas.items()}
        roles = [(key, g % self.rollout_tp) for (key, _), g in zip(gathered, members, strict=True)]
        # deterministic: every rank computes the same plan (and `jetrl plan` the same bytes)
        sources = copy_sources(self.trainer.shape, self.tp, self.pp, self.rollout_tp, metas, [v for _, v in roles])
        names = exchange_names(metas, roles, sources)
        me = members.index(dist_rank())
        device = next(iter(local.values())).device
        states: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {
            key: {name: stand_in(shape, dt, device) for name, dt, shape in meta} for key, meta in metas.items()}
        self._sends, self._recvs = [], []
        for peer in range(n):
            if peer == me:
                continue
            out = names.get((me, peer))  # my tensors its vLLM rank copies from
            if out:
                lay, size = packed_layout(out, by_name[self.key])
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                self._sends.append((members[peer], buf, [buf[p.offset:p.offset + p.nbytes] for p in lay], out))
            src_key = roles[peer][0]
            inc = names.get((peer, me))  # its tensors my vLLM rank copies from
            if inc:
                lay, size = packed_layout(inc, by_name[src_key])
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                for p in lay:
                    states[src_key][p.name] = buf[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)
                self._recvs.append((members[peer], buf))
        self._own = names.get((me, me), [])
        self.received_bytes = (self.buffer_bytes()[1]
                               + sum(p.nbytes for p in packed_layout(self._own, by_name[self.key])[0]))
        self._local_meta = self._meta(local)
        self._shards = MegatronShards(self.trainer.shape, self.tp, self.pp, None, states)

    def _exchange(self, local: dict[str, torch.Tensor]) -> None:
        if self._meta(local) != self._local_meta:
            raise RuntimeError(f"rank {dist_rank()}: the trainer's rollout tensors changed names, dtypes or shapes "
                               "since the refit exchange was planned")
        own = self._shards.states[self.key]
        for x in self._own:  # the trainer's tensors themselves (same addresses every step: see the class docstring)
            own[x] = local[x]
        ops = []
        for peer, buf, views, names in self._sends:
            torch._foreach_copy_(views, [local[x].reshape(-1).view(torch.uint8) for x in names])
            ops.append(torch_dist().P2POp(torch_dist().isend, buf, peer, group=mp_group()))
        for peer, buf in self._recvs:
            ops.append(torch_dist().P2POp(torch_dist().irecv, buf, peer, group=mp_group()))
        if ops:
            for req in torch_dist().batch_isend_irecv(ops):
                req.wait()


def verify_served_fp8(cfg: RunConfig, trainer: Trainer, engine, states: dict) -> float:
    """1.0 when vLLM's live FP8 linears equal the trainer's cache byte for byte, 0.0 otherwise, NaN if not checked.

    Checked in the jetrl arm when rollout TP = 1 and PP = 1, on CPU or with ``policy.jet_rl.verify_served_fp8``
    (``JETRL_VERIFY_SERVED_FP8`` wins when set; it reads every FP8 weight back from the engine)."""
    from jetrl_megatron.rl.verify import served_fp8_equal

    want = env_flag("JETRL_VERIFY_SERVED_FP8", cfg.policy.jet_rl.verify_served_fp8)
    want = not torch.cuda.is_available() if want is None else want
    one_shard = cfg.policy.generation.vllm_cfg.tensor_parallel_size == 1 and \
        cfg.policy.megatron_cfg.pipeline_model_parallel_size == 1
    if not (want and cfg.recipe.rollout_weights == "trainer_fp8" and one_shard):
        return math.nan
    tp_states = [states[k] for k in sorted(states)]
    ok, bad = served_fp8_equal(engine, tp_states, trainer.shape)
    if not ok:
        raise RuntimeError(f"vLLM serves FP8 bytes that differ from the trainer's cache: {bad[:8]}")
    return 1.0
