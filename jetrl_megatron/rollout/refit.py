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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from jetrl_megatron.fp8.quant import FP8_DTYPE, quantize_128x128
from jetrl_megatron.recipe import Fp8Recipe

SCALE_SUFFIX = "_scale_inv"
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
        raise RefitError("refit refused, engine unchanged (still serving the previous weights):\n  - "
                         + "\n  - ".join(problems))


def _finite(t: torch.Tensor) -> torch.Tensor:
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
