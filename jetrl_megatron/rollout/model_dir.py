"""Model directories vLLM can load: config.json + model.safetensors in the canonical form.

Canonical form (COMMON conventions): HF names; FP8 projections as float8_e4m3fn `weight` + FP32 `weight_scale_inv`
(128x128 blocks); BF16 for embeddings, norms, lm_head, biases and the linears of the recipe's BF16 layers.
Used by tests and the embedded CPU default to make a tiny random model, and by the engine to quantize a BF16
directory for the `bf16_train_fp8_rollout` arm. No vLLM import here.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping

import torch
from safetensors.torch import load_file, save_file

from jetrl_megatron.fp8.format import BLOCK, SCALE_SUFFIX
from jetrl_megatron.fp8.quant import FP8_DTYPE, quantize_128x128
from jetrl_megatron.model.shapes import ModelShape, get_model_shape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rollout.refit import TensorSpec

LINEAR_PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def linear_weight_names(shape: ModelShape) -> list[str]:
    """HF names of every decoder projection weight, layer-major."""
    return [f"model.layers.{i}.{proj}.weight" for i in range(shape.num_layers) for proj in LINEAR_PROJS]


def fp8_weight_names(shape: ModelShape, recipe: Fp8Recipe) -> list[str]:
    """The projection weights that the recipe stores as FP8 (the rest of the model is BF16)."""
    return [n for n in linear_weight_names(shape) if recipe.module_is_fp8(n, None, shape.num_layers)]


def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of a BF16 HF checkpoint of ``shape`` (canonical names) and its shape, in the order a random
    checkpoint draws them: what a model directory holds, known without writing one."""
    h, hd = shape.hidden_size, shape.head_dim
    out_sizes = {"self_attn.q_proj": shape.q_size, "self_attn.k_proj": shape.kv_size, "self_attn.v_proj": shape.kv_size,
                 "self_attn.o_proj": h, "mlp.gate_proj": shape.ffn_hidden_size, "mlp.up_proj": shape.ffn_hidden_size,
                 "mlp.down_proj": h}
    in_sizes = {"self_attn.o_proj": shape.q_size, "mlp.down_proj": shape.ffn_hidden_size}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        pre = f"model.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
        if shape.qk_norm:
            shapes[pre + "self_attn.q_norm.weight"] = (hd,)
            shapes[pre + "self_attn.k_norm.weight"] = (hd,)
        for proj in LINEAR_PROJS:
            shapes[pre + proj + ".weight"] = (out_sizes[proj], in_sizes.get(proj, h))
        if shape.qkv_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                shapes[pre + f"self_attn.{proj}.bias"] = (out_sizes["self_attn." + proj],)
    shapes["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        shapes["lm_head.weight"] = (shape.vocab_size, h)
    return shapes


def random_hf_state_dict(shape: ModelShape, seed: int = 0, logit_std: float = 4.0) -> dict[str, torch.Tensor]:
    """A random BF16 HF state dict whose next-token distributions are far from uniform.

    Standard small-std init gives near-uniform logits, which would hide logprob mismatches; here the residual stream is
    O(1), projections are variance-preserving, and lm_head is scaled so logits have std ~ `logit_std`.
    """
    g = torch.Generator().manual_seed(seed)

    def draw(name: str, size: tuple[int, ...]) -> torch.Tensor:
        if len(size) == 1 and not name.endswith(".bias"):  # a norm's weight, around 1
            return (1.0 + 0.1 * torch.randn(*size, generator=g)).to(torch.bfloat16)
        if name == "model.embed_tokens.weight":
            std = 1.0
        elif name == "lm_head.weight":
            std = logit_std * shape.hidden_size ** -0.5
        elif name.endswith(".bias"):
            std = 0.1
        else:  # a projection: variance-preserving
            std = size[1] ** -0.5
        return (torch.randn(*size, generator=g) * std).to(torch.bfloat16)

    return {name: draw(name, size) for name, size in hf_tensor_shapes(shape).items()}


def checkpoint_spec_for(shape: ModelShape, recipe: Fp8Recipe | None) -> dict[str, TensorSpec]:
    """Names, dtypes and shapes of the model directory :func:`write_tiny_model_dir` (or a trainer) writes for
    ``shape``: BF16, or with ``recipe`` the canonical FP8 form (each FP8 weight with its FP32 128x128 block scales).
    What an engine started without reading weights (``load_format: dummy``) accepts from its first refit."""
    fp8 = set(fp8_weight_names(shape, recipe)) if recipe is not None else set()
    spec: dict[str, TensorSpec] = {}
    for name, size in hf_tensor_shapes(shape).items():
        if name in fp8:
            spec[name] = TensorSpec(FP8_DTYPE, size)
            spec[name + SCALE_SUFFIX] = TensorSpec(torch.float32, tuple(-(-d // BLOCK) for d in size))
        else:
            spec[name] = TensorSpec(torch.bfloat16, size)
    return spec


def quantize_state_dict(sd: Mapping[str, torch.Tensor], shape: ModelShape, recipe: Fp8Recipe
                        ) -> dict[str, torch.Tensor]:
    """BF16 HF state dict -> canonical FP8 form (the recipe's FP8 projections quantized 128x128, rest unchanged)."""
    fp8 = set(fp8_weight_names(shape, recipe))
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name in fp8:
            q, s = quantize_128x128(t, recipe)
            out[name], out[name + SCALE_SUFFIX] = q, s
        else:
            out[name] = t
    return out


def hf_config_for(shape: ModelShape, recipe: Fp8Recipe | None, quant_method: str = "jetrl_fp8") -> dict:
    """config.json contents; with a recipe the `quantization_config` describes the FP8 checkpoint."""
    cfg = shape.to_hf_config()
    if recipe is not None:
        cfg["quantization_config"] = recipe.hf_quantization_config(shape.num_layers, quant_method=quant_method)
    return cfg


def write_config(path: str | os.PathLike, config: Mapping) -> str:
    """Write config.json into `path` (via a temp file and an atomic rename): all a directory needs for an engine that
    starts without reading weights (``load_format: dummy``)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path, suffix=".json.tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2)
    os.replace(tmp, os.path.join(path, "config.json"))
    return path


def write_model_dir(path: str | os.PathLike, config: Mapping, state_dict: Mapping[str, torch.Tensor]) -> str:
    """Write config.json + model.safetensors into `path` (each via a temp file and an atomic rename)."""
    path = write_config(path, config)
    fd, tmp = tempfile.mkstemp(dir=path, suffix=".safetensors.tmp")
    os.close(fd)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    return path


def write_tiny_model_dir(path: str | os.PathLike, *, preset: str = "tiny", seed: int = 0,
                         recipe: Fp8Recipe | None = None, quant_method: str = "jetrl_fp8",
                         logit_std: float = 4.0) -> str:
    """A random model of a preset shape; FP8 canonical form when `recipe` is given, plain BF16 otherwise."""
    shape = get_model_shape(preset)
    sd = random_hf_state_dict(shape, seed, logit_std)
    if recipe is not None:
        sd = quantize_state_dict(sd, shape, recipe)
    return write_model_dir(path, hf_config_for(shape, recipe, quant_method), sd)


def read_config(model_dir: str | os.PathLike) -> dict:
    with open(os.path.join(os.fspath(model_dir), "config.json"), encoding="utf-8") as f:
        return json.load(f)


def weights_sha256(model_dir: str | os.PathLike) -> str:
    """SHA-256 over the directory's *.safetensors files (sorted by name, whole bytes). Why: two warm starts made on
    two machines are the same policy only if their weights are the same bytes (`jetrl compare --reuse-from`)."""
    model_dir = os.fspath(model_dir)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.encode() + b"\0")
        with open(os.path.join(model_dir, f), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def load_state_dict(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in the directory."""
    model_dir = os.fspath(model_dir)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(os.path.join(model_dir, f)))
    return sd


def quantize_model_dir(src: str | os.PathLike, dst: str | os.PathLike, recipe: Fp8Recipe,
                       quant_method: str = "jetrl_fp8") -> str:
    """A BF16 model directory -> an FP8 canonical copy (what the `bf16_train_fp8_rollout` rollout serves)."""
    cfg = read_config(src)
    if cfg.get("quantization_config"):
        raise ValueError(f"{src}: already quantized ({cfg['quantization_config'].get('quant_method')}); "
                         "quantize_model_dir expects a BF16 checkpoint")
    shape = ModelShape.from_hf_config(cfg)
    sd = quantize_state_dict(load_state_dict(src), shape, recipe)
    cfg["quantization_config"] = recipe.hf_quantization_config(shape.num_layers, quant_method=quant_method)
    return write_model_dir(dst, cfg, sd)
