"""Preflight validator: refuse (model, train TP x PP, rollout TP) combinations where a shard boundary would cut a
128 block or a head, before anything is moved or written.

Why: the resharder only moves whole 128x128 blocks so the trainer's scales stay valid bit for bit. A shard of
1216 rows (Qwen3-4B intermediate 9728 / TP 8) would need a half block on each rank, i.e. requantization; a rank
boundary inside a head (Qwen2.5-7B: 28 heads / TP 8) is not a layout either engine supports.

The block rules bind only the projections that are FP8: `moved` (the trainer's FP8 bytes and scales travel, arm
jetrl) need whole blocks on both sides and, for q/k/v, whole heads per block; `served` (the rollout holds them FP8,
also when it quantizes BF16 it received) need whole blocks per vLLM rank, as vLLM's own block-FP8 loader does.
BF16 projections move as rows (reshard.addressing.bf16_unit), so the BF16 arm of a head_dim-64 model reshards.
`None` (the default) means every projection is both: the FP8 export and `jetrl reshard-check` use that.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jetrl_megatron.fp8.format import BLOCK
from jetrl_megatron.model.shapes import ModelShape

if TYPE_CHECKING:
    from jetrl_megatron.recipe import Fp8Recipe

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_HF_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


class ReshardError(ValueError):
    """A resharding request that cannot be served block-exactly; the message lists every violation."""


@dataclass(frozen=True)
class Violation:
    side: str       # "train" (Megatron) | "rollout" (vLLM) | "model"
    projection: str
    message: str

    def __str__(self) -> str:
        return f"[{self.side}] {self.projection}: {self.message}"


def _blocks(n: int) -> str:
    q = n / BLOCK
    return f"{q:g} blocks" if q != int(q) else f"{int(q)} blocks"


def fp8_projections(shape: ModelShape, recipe: Fp8Recipe) -> tuple[frozenset[str], frozenset[str]]:
    """(moved, served): the projections whose trainer FP8 blocks the refit moves, and those the rollout holds in
    FP8, in at least one layer under `recipe` (its arm and its BF16 exclusions)."""
    if not recipe.rollout_fp8:
        return frozenset(), frozenset()
    n = shape.num_layers
    served = frozenset(p for p in PROJECTIONS if any(
        recipe.module_is_fp8(f"model.layers.{i}.{_HF_PROJ[p]}.weight", i, n) for i in range(n)))
    return (served if recipe.rollout_weights == "trainer_fp8" else frozenset()), served


def _tp_violations(shape: ModelShape, tp: int, side: str, blocks: Collection[str]) -> list[Violation]:
    """Head and shard rules at one TP; `blocks`: the projections that must split into whole 128 blocks there."""
    out: list[Violation] = []
    engine = "Megatron" if side == "train" else "vLLM"
    nh, ng, f = shape.num_attention_heads, shape.num_kv_heads, shape.ffn_hidden_size
    hd = shape.head_dim
    if tp < 1:
        return [Violation(side, "tp", f"{engine} TP must be >= 1, got {tp}")]
    if nh % tp:
        out.append(Violation(side, "self_attn.q_proj/o_proj",
                             f"{nh} attention heads are not divisible by {engine} TP {tp} "
                             f"({nh}/{tp} = {nh / tp:g} heads per rank; a shard boundary cuts a head)"))
    if side == "train":
        slots = nh + 2 * ng
        if slots % tp:
            out.append(Violation(side, "linear_qkv (q/k/v_proj)",
                                 f"fused QKV has {slots} heads ({nh} q + 2x{ng} kv); {slots}/{tp} = {slots / tp:g} "
                                 f"per Megatron rank: a rank boundary cuts a head"))
        if ng < tp and tp % ng:
            out.append(Violation(side, "linear_qkv (k/v_proj)",
                                 f"{ng} KV heads with Megatron TP {tp}: TP must be a multiple of the KV heads"))
    else:
        if tp >= ng and tp % ng:
            out.append(Violation(side, "self_attn.k_proj/v_proj",
                                 f"{ng} KV heads cannot be replicated evenly over vLLM TP {tp}"))
        if tp < ng and ng % tp:
            out.append(Violation(side, "self_attn.k_proj/v_proj",
                                 f"{ng} KV heads are not divisible by vLLM TP {tp}"))
        if hd % BLOCK and not nh % tp and ({"q", "k", "v"} & set(blocks)):
            q_rows, kv_rows = nh // tp * hd, max(1, ng // tp) * hd
            bad = [f"{x} {r}" for x, r in (("q", q_rows), ("k/v", kv_rows)) if r % BLOCK]
            if bad:
                out.append(Violation(side, "self_attn.q/k/v_proj",
                                     f"FP8 rows per vLLM rank ({', '.join(bad)}; head_dim {hd}) are not whole "
                                     f"{BLOCK} blocks"))
    if hd % BLOCK and "o" in blocks and not nh % tp and tp > 1 and (nh // tp * hd) % BLOCK:
        out.append(Violation(side, "self_attn.o_proj",
                             f"FP8 input columns per {engine} rank {nh // tp * hd} ({nh // tp} heads x {hd}) are "
                             f"not whole {BLOCK} blocks"))
    if f % tp:
        out.append(Violation(side, "mlp.gate_proj/up_proj/down_proj",
                             f"intermediate {f} is not divisible by {engine} TP {tp}"))
    elif (f // tp) % BLOCK and {"gate", "up", "down"} & set(blocks):
        per = f / tp
        out.append(Violation(side, "mlp.gate_proj/up_proj/down_proj",
                             f"intermediate {f} / {engine} TP {tp} = {per:g} rows per rank is not a multiple of "
                             f"{BLOCK} ({_blocks(int(per)) if per == int(per) else f'{per / BLOCK:g} blocks'}): "
                             f"a shard boundary cuts a 128 block"))
    return out


def check_reshard(shape: ModelShape, train_tp: int, train_pp: int, rollout_tp: int,
                  train_vp: int | None = None, moved: Collection[str] | None = None,
                  served: Collection[str] | None = None) -> list[Violation]:
    """Every reason (model, train TP x PP [x VPP], rollout TP) cannot be resharded block-exactly; [] if it can.

    `moved` / `served`: the FP8 projections (`fp8_projections`); None = all (the FP8 resharder's full contract)."""
    moved = set(PROJECTIONS if moved is None else moved)
    served = set(PROJECTIONS if served is None else served) | moved
    out: list[Violation] = []
    qkv = sorted({"q", "k", "v"} & moved, key=PROJECTIONS.index)
    if shape.head_dim % BLOCK and qkv:
        names = "/".join(f"{p}_proj" for p in qkv)
        out.append(Violation("model", f"self_attn.{names}",
                             f"head_dim {shape.head_dim} is not a multiple of {BLOCK}: the trainer's FP8 128x128 "
                             f"blocks of the fused QKV straddle heads (q_size {shape.q_size}, kv_size "
                             f"{shape.kv_size}), so no Megatron/vLLM TP keeps them whole; run the bf16 arm, or "
                             f"bf16_train_fp8_rollout (the rollout quantizes its own shards), or keep attention "
                             f"BF16 (policy.jet_rl.bf16_module_keywords: [self_attention, self_attn])"))
    if shape.hidden_size % BLOCK and served:
        out.append(Violation("model", "hidden",
                             f"hidden_size {shape.hidden_size} is not a multiple of {BLOCK}"))
    out += _tp_violations(shape, train_tp, "train", moved)
    out += _tp_violations(shape, rollout_tp, "rollout", served)
    vp = train_vp or 1
    if train_pp < 1 or vp < 1 or shape.num_layers % (train_pp * vp):
        out.append(Violation("train", "decoder.layers",
                             f"{shape.num_layers} layers are not divisible by PP {train_pp} x VPP {vp} "
                             f"(uneven pipelines are not supported)"))
    return out


def format_violations(shape: ModelShape, violations: list[Violation], train_tp: int, train_pp: int,
                      rollout_tp: int) -> str:
    head = (f"cannot reshard {shape.name} block-exactly from Megatron TP{train_tp} x PP{train_pp} "
            f"to vLLM TP{rollout_tp}:")
    return "\n".join([head] + [f"  - {v}" for v in violations])


def validate_reshard(shape: ModelShape, train_tp: int, train_pp: int, rollout_tp: int,
                     train_vp: int | None = None, moved: Collection[str] | None = None,
                     served: Collection[str] | None = None) -> None:
    """Raise ReshardError listing every violation (nothing should be moved or written after a refusal)."""
    violations = check_reshard(shape, train_tp, train_pp, rollout_tp, train_vp, moved, served)
    if violations:
        raise ReshardError(format_violations(shape, violations, train_tp, train_pp, rollout_tp))
