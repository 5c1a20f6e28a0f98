"""HF safetensors <-> sharded Megatron GPTModel, at any TP x PP (Qwen3, Llama-3.1, Qwen2.5).

All layout math (QKV group interleave, per-rank [gate_r; up_r], vocab padding, PP layer ranges, names) lives in
``jetrl_megatron.model.layout`` and is shared with the resharder; this module only moves tensors between files,
ranks and parameters. Loading reads just the tensors of this rank's PP stage. Saving is collective (every rank
calls it): TP shards are all-gathered, PP stages are gathered into global rank 0, which writes ``model.safetensors``
and ``config.json`` atomically. Values are never changed, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from jetrl_megatron.megatron.model import fp8_context, refresh_fp8_cache, unwrap
from jetrl_megatron.model.layout import (
    ParamMap,
    hf_to_megatron_shard,
    megatron_shards_to_hf,
    padded_vocab_size,
    stage_param_maps,
)

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "hf_state_dict", "HfCheckpointError"]

_VOCAB_KIND = "vocab"


class HfCheckpointError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape; the message names it."""


class _Reader:
    """Lazy tensor access over one directory of safetensors files (or an in-memory dict)."""

    def __init__(self, source: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
        self._mem = source if isinstance(source, Mapping) else None
        self._where: dict[str, str] = {}
        if self._mem is None:
            root = os.fspath(source)
            files = sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))
            if not files:
                raise HfCheckpointError(f"{root}: no *.safetensors files")
            for f in files:
                with safe_open(os.path.join(root, f), framework="pt") as h:
                    for k in h.keys():
                        self._where[k] = os.path.join(root, f)

    def __contains__(self, key: str) -> bool:
        return key in (self._mem if self._mem is not None else self._where)

    def get(self, key: str) -> torch.Tensor:
        if key not in self:
            raise HfCheckpointError(f"checkpoint has no tensor {key!r}")
        if self._mem is not None:
            return self._mem[key]
        with safe_open(self._where[key], framework="pt") as h:
            return h.get_tensor(key)


def _stage_maps(gpt) -> list[ParamMap]:
    shape = fp8_context(gpt).shape
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    maps = stage_param_maps(shape, pp, parallel_state.get_pipeline_model_parallel_rank())
    if shape.tie_word_embeddings and gpt.post_process and not gpt.pre_process:
        # the last stage's copy of the tied embedding
        maps.append(ParamMap("output_layer.weight", ("model.embed_tokens.weight",), _VOCAB_KIND, False))
    return maps


@torch.no_grad()
def load_hf_checkpoint(model, source: str | os.PathLike | Mapping[str, torch.Tensor]) -> None:
    """Copy an HF checkpoint (directory of safetensors or a name->tensor dict) into this rank's shard, refresh FP8.

    Every parameter of the stage must be provided, with exactly the expected shape (else HfCheckpointError naming
    it). Values are cast to the parameter dtype (BF16) — bit-exact for BF16 checkpoints.
    """
    gpt = unwrap(model)
    shape = fp8_context(gpt).shape
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    reader = _Reader(source)
    params = dict(gpt.named_parameters())
    seen = set()
    for pmap in _stage_maps(gpt):
        if pmap.megatron not in params:
            raise HfCheckpointError(f"model has no parameter {pmap.megatron!r} (expected for {pmap.hf})")
        hf = [reader.get(k) for k in pmap.hf]
        shard = hf_to_megatron_shard(pmap, hf, shape, tp, rank, padded_vocab=padded_vocab_size(shape.vocab_size, tp))
        p = params[pmap.megatron]
        if tuple(shard.shape) != tuple(p.shape):
            raise HfCheckpointError(f"{pmap.megatron}: HF {pmap.hf} give shard {tuple(shard.shape)}, parameter is "
                                    f"{tuple(p.shape)} (TP={tp} rank {rank})")
        p.data.copy_(shard.to(device=p.device, dtype=p.dtype))
        torch.autograd.graph.increment_version(p)
        seen.add(pmap.megatron)
    missing = sorted(set(params) - seen)
    if missing:
        raise HfCheckpointError(f"parameters not covered by the HF name map: {missing}")
    refresh_fp8_cache(gpt)


def _gather_tp(t: torch.Tensor) -> list[torch.Tensor]:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(out, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return out


@torch.no_grad()
def hf_state_dict(model, *, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """Collective: the full HF-named state dict (CPU tensors) on global rank 0, None elsewhere.

    ``grads=True`` returns the gradients instead (``param.main_grad`` of a DDP-wrapped model, else ``.grad``) in
    the same HF layout — for checking that TP/PP layouts produce the same gradients.
    """
    gpt = unwrap(model)
    shape = fp8_context(gpt).shape
    params = dict(gpt.named_parameters())
    local: dict[str, torch.Tensor] = {}
    for pmap in _stage_maps(gpt):
        if pmap.megatron == "output_layer.weight" and shape.tie_word_embeddings:
            continue  # tied: HF has no lm_head
        p = params[pmap.megatron]
        p = (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad) if grads \
            else p.detach()
        if p is None:
            raise ValueError(f"{pmap.megatron}: no gradient")
        shards = [p] if pmap.kind == "replicated" else _gather_tp(p)
        tensors = megatron_shards_to_hf(pmap, [s.cpu() for s in shards], shape)
        for name, t in zip(pmap.hf, tensors, strict=True):
            local[name] = t.contiguous().clone()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:
        parts: list = [None] * pp
        dist.all_gather_object(parts, local, group=parallel_state.get_pipeline_model_parallel_group())
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        local = merged
    return local if dist.get_rank() == 0 else None


def save_hf_checkpoint(model, out_dir: str | os.PathLike) -> None:
    """Collective: write ``model.safetensors`` + ``config.json`` (HF layout) from global rank 0, atomically."""
    gpt = unwrap(model)
    sd = hf_state_dict(gpt)
    if sd is None:
        return
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    _atomic(out_dir, "model.safetensors", lambda path: save_file(sd, path, metadata={"format": "pt"}))
    cfg = fp8_context(gpt).shape.to_hf_config()

    def write_cfg(path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)

    _atomic(out_dir, "config.json", write_cfg)


def _atomic(out_dir: str, name: str, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out_dir)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, os.path.join(out_dir, name))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
