"""The resharder's commands, `jetrl reshard-check` and `jetrl export`: each takes the namespace the one `jetrl` parser
(`cli_args.parser`) made and returns an exit code; ``reshard_check_main`` / ``export_main`` take an argument list
(the command's flags) and parse it with that same parser."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from jetrl_megatron.cli_args import FP8_RECIPE_FLAGS, parser
from jetrl_megatron.errors import one_line
from jetrl_megatron.model.shapes import ModelShape, get_model_shape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard.export import write_hf_checkpoint
from jetrl_megatron.reshard.mover import SCALE_SUFFIX, MegatronShards, iter_canonical
from jetrl_megatron.reshard.plan import build_plan, format_plan
from jetrl_megatron.reshard.preflight import ReshardError, check_reshard, format_violations
from jetrl_megatron.rl.outputs.checkpoint_format import is_run_checkpoint, load_run_checkpoint

_MEGATRON_FILE = re.compile(r"tp(\d+)_pp(\d+)(?:_vp(\d+))?\.pt$")


def _recipe_changes(ns: argparse.Namespace) -> dict:
    """The recipe flags given on the command line."""
    return {k: getattr(ns, k) for k in FP8_RECIPE_FLAGS if getattr(ns, k) is not None}


def _recipe(ns: argparse.Namespace) -> Fp8Recipe:
    return Fp8Recipe(**_recipe_changes(ns))


def reshard_check_main(argv: list[str]) -> int:
    """`jetrl reshard-check` with these flags."""
    return reshard_check(parser().parse_args(["reshard-check", *argv]))


def export_main(argv: list[str]) -> int:
    """`jetrl export` with these flags."""
    return export(parser().parse_args(["export", *argv]))


def reshard_check(ns: argparse.Namespace) -> int:
    """Print the Megatron TP x PP -> vLLM TP' plan (exit 0), every violation (exit 1), or a bad argument (exit 2)."""
    try:
        shape = get_model_shape(ns.model)
        recipe = _recipe(ns)
    except ValueError as err:
        print(f"jetrl reshard-check: {one_line(err, limit=2000)}", file=sys.stderr)
        return 2
    plan = build_plan(shape, ns.train_tp, ns.train_pp, ns.rollout_tp, ns.train_vpp, recipe)
    if not plan.ok:
        print(format_violations(shape, plan.violations, ns.train_tp, ns.train_pp, ns.rollout_tp))
        return 1
    if ns.json:
        print(json.dumps({
            "model": shape.name, "train_tp": ns.train_tp, "train_pp": ns.train_pp, "train_vpp": ns.train_vpp,
            "rollout_tp": ns.rollout_tp, "fp8_layers": plan.fp8_layers,
            "bytes_per_rollout_rank": [{"fp8": b.fp8, "scales": b.scales, "bf16": b.bf16, "total": b.total}
                                       for b in plan.rank_bytes],
            "segments_per_layer_per_rank": [{x.vllm_param: x.segments for x in lines} for lines in plan.rank_params],
        }, indent=2))
    else:
        print(format_plan(plan))
    return 0


def load_megatron_dir(path: Path, shape: ModelShape) -> MegatronShards:
    """Read `tp{T}_pp{P}[_vp{V}].pt` files (each a plain local state dict; FP8 scales under '<name>_scale_inv')."""
    files = {}
    for f in sorted(path.glob("tp*_pp*.pt")):
        m = _MEGATRON_FILE.search(f.name)
        if m:
            files[(int(m.group(2)), int(m.group(3) or 0), int(m.group(1)))] = f
    if not files:
        raise FileNotFoundError(f"{path}: no tp<T>_pp<P>[_vp<V>].pt Megatron shard files, and not a `jetrl run` "
                                "checkpoint (meta.json + rank_<r>.pt)")
    tp = 1 + max(k[2] for k in files)
    pp = 1 + max(k[0] for k in files)
    vp = 1 + max(k[1] for k in files)
    states = {}
    for key, f in files.items():
        sd = torch.load(f, map_location="cpu", weights_only=True)
        states[key] = sd.get("model", sd) if isinstance(sd, dict) else sd
    return MegatronShards(shape, tp, pp, vp if vp > 1 else None, states)


def _iter_hf_quantized(path: Path, shape: ModelShape, recipe: Fp8Recipe) -> Iterator[tuple[str, torch.Tensor]]:
    """A BF16 HF checkpoint, with the recipe's FP8 projections quantized 128x128 (the trainer's weight quantizer)."""
    from safetensors import safe_open

    from jetrl_megatron.fp8.quant import quantize_128x128

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    gemm = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
            "up_proj.weight", "down_proj.weight")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name.endswith(SCALE_SUFFIX):
                    raise ReshardError(f"{f}: {name}: --from-hf expects a BF16 checkpoint, this one is already FP8")
                t = sf.get_tensor(name)
                if name.endswith(gemm) and recipe.rollout_fp8 and recipe.module_is_fp8(name, None, shape.num_layers):
                    q, s = quantize_128x128(t, recipe)
                    yield name, q
                    yield name + SCALE_SUFFIX, s
                else:
                    yield name, t.to(torch.bfloat16) if t.is_floating_point() else t


def export(ns: argparse.Namespace) -> int:
    """Write an HF block-FP8 checkpoint (safetensors + config.json with quantization_config) atomically."""
    try:
        source = ns.from_megatron or ns.from_hf
        run_ckpt = ns.from_megatron is not None and is_run_checkpoint(ns.from_megatron)
        if run_ckpt:
            if ns.model:
                raise ValueError("--model: not used with a `jetrl run` checkpoint (its meta.json records the model)")
            shards, shape, recipe = load_run_checkpoint(ns.from_megatron, _recipe_changes(ns))
        else:
            recipe = _recipe(ns)
            shape = get_model_shape(ns.model if ns.model else source)
        if ns.from_megatron:
            if not run_ckpt:
                shards = load_megatron_dir(ns.from_megatron, shape)
            violations = check_reshard(shape, shards.tp, shards.pp, ns.rollout_tp or 1, shards.vp)
            if violations:
                print(format_violations(shape, violations, shards.tp, shards.pp, ns.rollout_tp or 1))
                return 1
            tensors = iter_canonical(shards)
        else:
            violations = check_reshard(shape, 1, 1, ns.rollout_tp or 1)
            if violations:
                print(format_violations(shape, violations, 1, 1, ns.rollout_tp or 1))
                return 1
            tensors = _iter_hf_quantized(ns.from_hf, shape, recipe)
        tok = ns.tokenizer_dir or (ns.from_hf if ns.from_hf else None)
        out = write_hf_checkpoint(tensors, shape, recipe, ns.out, overwrite=ns.overwrite,
                                  max_shard_bytes=int(ns.max_shard_gb * (1 << 30)), quant_method=ns.quant_method,
                                  tokenizer_dir=tok)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as err:
        print(f"jetrl export: {one_line(err, limit=2000)}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    print(stock_vllm_note(recipe, ns.quant_method))
    return 0


def stock_vllm_note(recipe: Fp8Recipe, quant_method: str) -> str:
    """What stock vLLM does with these scales on Hopper, where vLLM 0.26 defaults to ``VLLM_USE_DEEP_GEMM_E8M0=1``
    and rounds every block scale (weights and activations) up to a power of two before its DeepGEMM kernels."""
    if quant_method != "fp8":
        return f"serve with the {quant_method} plugin: it uses the scales as written"
    if recipe.scale_fmt == "pow2":
        return ("scales are powers of two: stock vLLM serves them unchanged with its defaults (tested on H200 with "
                "VLLM_USE_DEEP_GEMM_E8M0 unset: logprobs bit-identical to the jetrl_fp8 plugin)")
    return ("FP32 scales: stock vLLM on Hopper keeps them only with VLLM_USE_DEEP_GEMM_E8M0=0; its default (1) rounds "
            "them up to powers of two, a slightly different model. Export with --scale-fmt pow2 (and train with "
            "jet_rl.scale_fmt: pow2) for a checkpoint stock vLLM serves exactly with its defaults")
