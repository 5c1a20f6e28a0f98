"""Preflight validator: refuse (model, train TP x PP, rollout TP) combinations where a shard boundary would cut a
128 block or a head, before anything is moved or written.

Why: the resharder only moves whole 128x128 blocks so the trainer's scales stay valid bit for bit. A shard of
1216 rows (Qwen3-4B intermediate 9728 / TP 8) would need a half block on each rank, i.e. requantization; a rank
boundary inside a head (Qwen2.5-7B: 28 heads / TP 8) is not a layout either engine supports.
"""

from __future__ import annotations

from dataclasses import dataclass

from jetrl_megatron.fp8.format import BLOCK
from jetrl_megatron.model.shapes import ModelShape


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


def _tp_violations(shape: ModelShape, tp: int, side: str) -> list[Violation]:
    out: list[Violation] = []
    engine = "Megatron" if side == "train" else "vLLM"
    nh, ng, f = shape.num_attention_heads, shape.num_kv_heads, shape.ffn_hidden_size
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
    if f % tp or (f // tp) % BLOCK:
        per = f / tp
        out.append(Violation(side, "mlp.gate_proj/up_proj/down_proj",
                             f"intermediate {f} / {engine} TP {tp} = {per:g} rows per rank is not a multiple of "
                             f"{BLOCK} ({_blocks(int(per)) if per == int(per) else f'{per / BLOCK:g} blocks'}): "
                             f"a shard boundary cuts a 128 block"))
    return out


def check_reshard(shape: ModelShape, train_tp: int, train_pp: int, rollout_tp: int,
                  train_vp: int | None = None) -> list[Violation]:
    """Every reason (model, train TP x PP [x VPP], rollout TP) cannot be resharded block-exactly; [] if it can."""
    out: list[Violation] = []
    if shape.head_dim % BLOCK:
        out.append(Violation("model", "self_attn.q/k/v/o_proj",
                             f"head_dim {shape.head_dim} is not a multiple of {BLOCK}: 128-row blocks straddle heads"))
    if shape.hidden_size % BLOCK:
        out.append(Violation("model", "hidden",
                             f"hidden_size {shape.hidden_size} is not a multiple of {BLOCK}"))
    out += _tp_violations(shape, train_tp, "train")
    out += _tp_violations(shape, rollout_tp, "rollout")
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
                     train_vp: int | None = None) -> None:
    """Raise ReshardError listing every violation (nothing should be moved or written after a refusal)."""
    violations = check_reshard(shape, train_tp, train_pp, rollout_tp, train_vp)
    if violations:
        raise ReshardError(format_violations(shape, violations, train_tp, train_pp, rollout_tp))
