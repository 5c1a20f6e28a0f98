"""HF block-FP8 checkpoint export: canonical tensors -> safetensors shards + index + config.json.

The output is what stock vLLM's block-FP8 loader reads (Fp8Config with weight_block_size [128, 128]: FP8
`*.weight` in float8_e4m3fn plus `*.weight_scale_inv` FP32 [ceil(N/128), ceil(K/128)], BF16 everything else,
`quantization_config.ignored_layers` for BF16-excluded layers). Written into a temp directory next to the target
and renamed into place, so a failed or refused export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard.mover import SCALE_SUFFIX, MegatronShards, iter_canonical
from jetrl_megatron.reshard.preflight import ReshardError

_GEMM_SUFFIXES = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"))
_LAYER = re.compile(r"model\.layers\.\d+\.")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "generation_config.json", "tokenizer.model")


def _layer_of(name: str) -> str | None:
    m = _LAYER.match(name)
    return m.group(0) if m else None


def _check_precision(name: str, t: torch.Tensor, has_scale: bool, shape: ModelShape, recipe: Fp8Recipe) -> None:
    """A GEMM weight must be FP8 with a scale exactly where the recipe says so; everything else BF16/FP32."""
    if name.endswith(SCALE_SUFFIX):
        if t.dtype != torch.float32:
            raise ReshardError(f"{name}: scales must be float32, got {t.dtype}")
        return
    is_gemm = name.endswith(_GEMM_SUFFIXES)
    want_fp8 = is_gemm and recipe.rollout_fp8 and recipe.module_is_fp8(name, None, shape.num_layers)
    is_fp8 = t.dtype == torch.float8_e4m3fn
    if want_fp8 and not (is_fp8 and has_scale):
        raise ReshardError(f"{name}: the recipe makes this projection FP8 but the source tensor is {t.dtype}"
                           f"{'' if has_scale else ' without ' + name + SCALE_SUFFIX}")
    if not want_fp8 and (is_fp8 or has_scale):
        raise ReshardError(f"{name}: the recipe keeps this tensor BF16 but the source is {t.dtype}"
                           f"{' with a scale' if has_scale else ''}")


def write_hf_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], shape: ModelShape, recipe: Fp8Recipe,
                        out_dir: str | os.PathLike, *, max_shard_bytes: int = 4 << 30, overwrite: bool = False,
                        quant_method: str = "fp8", tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Stream canonical (name, tensor) pairs into an HF safetensors checkpoint at `out_dir` (atomically)."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        shard_files: list[str] = []
        pending: dict[str, torch.Tensor] = {}
        pending_bytes = 0
        total = 0
        held: dict[str, torch.Tensor] = {}   # weights waiting for their scale (it streams right after them)

        def flush() -> None:
            nonlocal pending, pending_bytes
            if not pending:
                return
            fname = f"part-{len(shard_files):05d}.safetensors"
            save_file({k: v.contiguous() for k, v in pending.items()}, str(tmp / fname), metadata={"format": "pt"})
            shard_files.append(fname)
            for k in pending:
                weight_map[k] = fname
            pending, pending_bytes = {}, 0

        def add(name: str, t: torch.Tensor) -> None:
            nonlocal pending_bytes, total
            if name in weight_map or name in pending:
                raise ReshardError(f"duplicate tensor {name}")
            nbytes = t.numel() * t.element_size()
            if pending and pending_bytes + nbytes > max_shard_bytes:
                flush()
            pending[name] = t.detach().cpu()
            pending_bytes += nbytes
            total += nbytes

        items = iter(tensors)
        for name, t in items:
            if name.endswith(SCALE_SUFFIX):
                base = name[: -len(SCALE_SUFFIX)]
                if base not in held:
                    raise ReshardError(f"{name}: scale without its weight {base}")
                w = held.pop(base)
                _check_precision(base, w, True, shape, recipe)
                _check_precision(name, t, True, shape, recipe)
                add(base, w)
                add(name, t)
                continue
            for base, w in list(held.items()):  # weights of earlier layers whose scale never came: BF16
                if _layer_of(base) != _layer_of(name):
                    _check_precision(base, w, False, shape, recipe)
                    add(base, w)
                    del held[base]
            if name.endswith(_GEMM_SUFFIXES):
                held[name] = t
            else:
                _check_precision(name, t, False, shape, recipe)
                add(name, t)
        for base, w in held.items():
            _check_precision(base, w, False, shape, recipe)
            add(base, w)
        flush()

        n = len(shard_files)
        final = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(shard_files)}
        if n == 1:
            final = {shard_files[0]: "model.safetensors"}
        for src, dst in final.items():
            os.replace(tmp / src, tmp / dst)
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        cfg = shape.to_hf_config()
        if recipe.rollout_fp8:
            cfg["quantization_config"] = recipe.hf_quantization_config(shape.num_layers, quant_method=quant_method)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                p = Path(tokenizer_dir) / fname
                if p.is_file():
                    shutil.copyfile(p, tmp / fname)
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_hf_fp8(src: MegatronShards, recipe: Fp8Recipe, out_dir: str | os.PathLike, **kwargs) -> Path:
    """Megatron FP8 shards -> HF block-FP8 checkpoint (byte moves; scales are the trainer's, bit for bit)."""
    return write_hf_checkpoint(iter_canonical(src), src.shape, recipe, out_dir, **kwargs)
