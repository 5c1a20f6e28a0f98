"""A compiled refit: the byte copies Megatron shards -> one vLLM rank's tensors, planned once and replayed each step.

Why: in RL the trainer's FP8 cache and the rollout engine's parameters are persistent buffers, and the same
few thousand slab copies happen after every optimizer step. Building the copy list once removes the per-step
Python planning cost; on CUDA, contiguous copies go through one `torch._foreach_copy_` call per dtype (batched
multi-tensor launches) and the whole replay can be captured in a CUDA graph. Destinations can be the engine's own
parameter tensors (pass `dst`), so a refit writes in place with no allocation.

The program holds views of the source tensors it was built from: if the trainer reallocates them, build a new
program (`run()` checks the source data pointers and refuses stale ones).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from jetrl_megatron.model import layout
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.reshard.mover import (
    CopyPair,
    DstFactory,
    MegatronShards,
    _whole_pair,
    layer_copy_pairs,
    run_pairs,
    vllm_vocab_rows,
    vocab_copy_pairs,
)


class StaleSourceError(RuntimeError):
    """A source tensor of the program was reallocated since it was built."""


class VllmRefitProgram:
    """Copies for vLLM rank `rank` of rollout TP `rollout_tp` from `src`; `run()` performs them (byte moves)."""

    def __init__(self, src: MegatronShards, rollout_tp: int, rank: int,
                 dst: Mapping[str, torch.Tensor] | None = None, device: torch.device | str | None = None,
                 dst_factory: DstFactory | None = None):
        """`dst`: destination tensors by vLLM name (e.g. the engine's live parameters); `dst_factory`: called as
        (name, shape, dtype, source device) for each destination instead (the caller decides per tensor)."""
        src.validate(rollout_tp)  # block rules for the FP8 tensors the sources hold
        shape = src.shape
        self.tensors: dict[str, torch.Tensor] = {}
        pairs: list[CopyPair] = []
        pads: list[torch.Tensor] = []

        def dst_for(name: str, shp: tuple[int, ...], dtype: torch.dtype, src_device: torch.device) -> torch.Tensor:
            if dst_factory is not None:
                return dst_factory(name, shp, dtype, src_device)
            if dst is not None:
                if name not in dst:
                    raise KeyError(f"destination has no tensor {name!r}")
                return dst[name]
            return torch.empty(shp, dtype=dtype, device=device or src_device)

        factory: DstFactory = dst_for
        emb = layout.embedding_param_map().megatron
        start, stop = vllm_vocab_rows(shape.vocab_size, rollout_tp, rank, emb)
        t, p, pad = vocab_copy_pairs(src.first_shards(emb), shape.vocab_size, start, stop,
                                     "model.embed_tokens.weight", factory)
        self.tensors["model.embed_tokens.weight"] = t
        pairs += p
        pads.append(pad)
        for layer in range(shape.num_layers):
            ts, p = layer_copy_pairs(src, layer, rollout_tp, rank, factory)
            self.tensors.update(ts)
            pairs += p
        norm = layout.final_norm_param_map().megatron
        t, p = _whole_pair(src.last_shards(norm)[0], "model.norm.weight", factory)
        self.tensors["model.norm.weight"] = t
        pairs += p
        out_map = layout.output_param_map(shape)
        if out_map is not None:
            t, p, pad = vocab_copy_pairs(src.last_shards(out_map.megatron), shape.vocab_size, start, stop,
                                         "lm_head.weight", factory)
            self.tensors["lm_head.weight"] = t
            pairs += p
            pads.append(pad)
        for pad in pads:
            pad.zero_()
        # contiguous pairs grouped by dtype for batched copies; strided ones (row-parallel column slabs) apart
        self._groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._strided: list[CopyPair] = []
        for d, s in pairs:
            if d.is_contiguous() and s.is_contiguous():
                g = self._groups.setdefault(d.dtype, ([], []))
                g[0].append(d)
                g[1].append(s)
            else:
                self._strided.append((d, s))
        used = {s.untyped_storage().data_ptr() for _, s in pairs}
        self._src = src
        self._src_ptrs = {(key, name): t.data_ptr() for key, state in src.states.items() for name, t in state.items()
                          if t.untyped_storage().data_ptr() in used}
        self._split: list[CopyPair] = []  # copies split_off hands to the caller (their sources still checked)
        self.num_copies = len(pairs)
        self.bytes = sum(d.numel() * d.element_size() for d, _ in pairs)
        self._graph: torch.cuda.CUDAGraph | None = None

    def rebind_sources(self, src) -> None:
        """Look the source tensors up in ``src`` from now on: the same tensors held by another ``MegatronShards``
        object (the caller's, after the program was planned over a recording view). ``check_sources`` still
        compares every address, so a different tensor is caught, not silently copied from."""
        self._src = src

    def take_pairs(self, streamed: Callable[[torch.Tensor], bool]) -> list[CopyPair]:
        """Remove and return the copies whose source view satisfies `streamed` (e.g. meta-device stand-ins of a peer's
        tensors that arrive in staging rounds): `run()` and the CUDA graph keep the rest, the caller runs these."""
        return self._remove(lambda d, s: streamed(s), keep_source_checks=False)

    def split_off(self, into: Callable[[torch.Tensor], bool]) -> list[CopyPair]:
        """Remove and return the copies whose destination view satisfies `into`, for the caller to run itself (e.g.
        one destination at a time, into a buffer that exists only then); `check_sources` still checks their
        sources, and `run()` and the CUDA graph leave them out."""
        return self._remove(lambda d, s: into(d), keep_source_checks=True)

    def _remove(self, taken_if: Callable[[torch.Tensor, torch.Tensor], bool], keep_source_checks: bool,
                ) -> list[CopyPair]:
        taken: list[CopyPair] = []
        for dtype, (dsts, srcs) in list(self._groups.items()):
            pairs = list(zip(dsts, srcs, strict=True))
            keep = [(d, s) for d, s in pairs if not taken_if(d, s)]
            taken += [(d, s) for d, s in pairs if taken_if(d, s)]
            if keep:
                self._groups[dtype] = ([d for d, _ in keep], [s for _, s in keep])
            else:
                del self._groups[dtype]
        taken += [p for p in self._strided if taken_if(*p)]
        self._strided = [p for p in self._strided if not taken_if(*p)]
        checked = self.copy_pairs() + (taken if keep_source_checks else []) + self._split
        if keep_source_checks:
            self._split += taken
        used = {s.untyped_storage().data_ptr() for _, s in checked if not s.is_meta}
        self._src_ptrs = {(key, name): t.data_ptr() for key, state in self._src.states.items()
                          for name, t in state.items() if not t.is_meta and t.untyped_storage().data_ptr() in used}
        return taken

    @property
    def has_cuda_graph(self) -> bool:
        return self._graph is not None

    def check_sources(self) -> None:
        for (key, name), ptr in self._src_ptrs.items():
            t = self._src.states[key].get(name)
            if t is None or t.data_ptr() != ptr:
                raise StaleSourceError(f"Megatron source tensor {name!r} of (pp, vp, tp) rank {key} was replaced "
                                       f"or reallocated since the refit program was built; rebuild it")

    def run(self, batched: bool = True, check: bool = True) -> dict[str, torch.Tensor]:
        """Perform every copy; returns the destination tensors (vLLM names)."""
        if check:
            self.check_sources()
        if self._graph is not None:
            self._graph.replay()
            return self.tensors
        if batched:
            for dsts, srcs in self._groups.values():
                torch._foreach_copy_(dsts, srcs)
            run_pairs(self._strided)
        else:
            for dsts, srcs in self._groups.values():
                run_pairs(list(zip(dsts, srcs, strict=True)))
            run_pairs(self._strided)
        return self.tensors

    def copy_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every (destination view, source view) byte-move pair, for read-back comparison after run()."""
        return [p for dsts, srcs in self._groups.values() for p in zip(dsts, srcs, strict=True)] + self._strided

    def capture_cuda_graph(self) -> None:
        """Record run() into a CUDA graph; later run() calls replay it (sources and destinations must stay put)."""
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.run(check=False)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(check=False)
        self._graph = graph


def program_sources(src: MegatronShards, rollout_tp: int, rank: int) -> dict[tuple[int, int, int], set[str]]:
    """Which Megatron tensors vLLM rank `rank`'s program copies bytes from, by (pp, vp, tp) key.

    Only names, shapes and dtypes of `src` matter: pass stand-ins (see `stand_in_shards`) to plan what a rank must
    receive before any tensor exists on it. A rank reads more tensors than it copies from (every TP rank's shard shape
    is checked), so the answer comes from the compiled copy list, not from the names read.
    """
    prog = VllmRefitProgram(src, rollout_tp, rank, device="meta")
    owner = {t.untyped_storage().data_ptr(): (key, name) for key, state in src.states.items()
             for name, t in state.items()}
    out: dict[tuple[int, int, int], set[str]] = {}
    for _, s in prog.copy_pairs():
        key, name = owner[s.untyped_storage().data_ptr()]
        out.setdefault(key, set()).add(name)
    return out


def stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor with `shape` and `dtype` backed by a single zero element (stride 0): a placeholder for a Megatron
    tensor a rank never copies from, with its own storage address and finite contents."""
    return torch.zeros(1, dtype=torch.uint8 if dtype.itemsize == 1 else dtype, device=device).view(dtype).expand(shape)


def stand_in_shards(model: ModelShape, tp: int, pp: int,
                    metas: Mapping[tuple[int, int, int], Sequence[tuple[str, torch.dtype, tuple[int, ...]]]],
                    vp: int | None = None) -> MegatronShards:
    """MegatronShards of stand-ins built from each (pp, vp, tp) key's (name, dtype, shape) list."""
    states = {key: {name: stand_in(shape, dtype) for name, dtype, shape in meta} for key, meta in metas.items()}
    return MegatronShards(model, tp, pp, vp, states)
