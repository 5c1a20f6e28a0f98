"""The reshard plan as numbers: bytes each rollout rank receives, per-layer block / copy-segment counts.

Computed from shapes alone (no tensors), so `jetrl reshard-check` can size a 32B model instantly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jetrl_megatron.fp8.format import cdiv as _cdiv
from jetrl_megatron.model import layout
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard.addressing import (
    BLOCK,
    MEGATRON_PARAM,
    bf16_unit,
    proj_shape,
    vllm_padded_vocab,
    vllm_rank_plans,
)
from jetrl_megatron.reshard.preflight import Violation, check_reshard, fp8_projections

_VLLM_PROJS = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",),
               "mlp.gate_up_proj": ("gate", "up"), "mlp.down_proj": ("down",)}




@dataclass
class ParamLine:
    vllm_param: str
    megatron_param: str
    megatron_shape: tuple[int, int]
    vllm_shape: tuple[int, int]
    segments: int        # copy segments per layer for the rank
    src_ranks: tuple[int, ...]


@dataclass
class RankBytes:
    fp8: int = 0
    scales: int = 0
    bf16: int = 0

    @property
    def total(self) -> int:
        return self.fp8 + self.scales + self.bf16


@dataclass
class ReshardPlan:
    shape: ModelShape
    train_tp: int
    train_pp: int
    rollout_tp: int
    train_vp: int | None
    violations: list[Violation]
    fp8_layers: list[int] = field(default_factory=list)
    rank_bytes: list[RankBytes] = field(default_factory=list)
    rank_params: list[list[ParamLine]] = field(default_factory=list)
    stage_layers: dict[tuple[int, int], range] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations


def _vllm_local_shape(shape: ModelShape, rollout_tp: int, vparam: str, dst_blocks: int,
                      unit: int = BLOCK) -> tuple[int, int]:
    n, k = proj_shape(shape, _VLLM_PROJS[vparam][0])
    if vparam in ("self_attn.o_proj", "mlp.down_proj"):
        return n, dst_blocks * unit
    return dst_blocks * unit, k


def build_plan(shape: ModelShape, train_tp: int, train_pp: int, rollout_tp: int, train_vp: int | None = None,
               recipe: Fp8Recipe | None = None) -> ReshardPlan:
    recipe = recipe or Fp8Recipe()
    moved, served = fp8_projections(shape, recipe)
    plan = ReshardPlan(shape, train_tp, train_pp, rollout_tp, train_vp,
                       check_reshard(shape, train_tp, train_pp, rollout_tp, train_vp, moved, served))
    if not plan.ok:
        return plan
    L = shape.num_layers
    plan.fp8_layers = [i for i in range(L) if recipe.rollout_fp8 and recipe.layer_is_fp8(i, L)]
    n_fp8 = len(plan.fp8_layers)
    for p in range(train_pp):
        for v in range(train_vp or 1):
            plan.stage_layers[(p, v)] = layout.pp_layer_range(L, train_pp, p, train_vp, v)
    h = shape.hidden_size
    vocab_rows = vllm_padded_vocab(shape.vocab_size) // rollout_tp
    for r in range(rollout_tp):
        rb = RankBytes()
        lines = []
        fine = vllm_rank_plans(shape, train_tp, rollout_tp, r, bf16_unit(shape, train_tp, rollout_tp))
        for i, pp in enumerate(fine):
            if set(_VLLM_PROJS[pp.vllm_param]) & moved:
                pp = vllm_rank_plans(shape, train_tp, rollout_tp, r)[i]  # FP8 bytes move as 128x128 blocks
            mshape_blocks = pp.src_blocks
            vshape = _vllm_local_shape(shape, rollout_tp, pp.vllm_param, pp.dst_blocks, pp.unit)
            mshape = _vllm_local_shape(shape, train_tp, pp.vllm_param, mshape_blocks, pp.unit)
            elems = vshape[0] * vshape[1]
            rb.fp8 += elems * n_fp8
            rb.bf16 += 2 * elems * (L - n_fp8)
            rb.scales += 4 * _cdiv(vshape[0], BLOCK) * _cdiv(vshape[1], BLOCK) * n_fp8
            if pp.vllm_param == "self_attn.qkv_proj" and shape.qkv_bias:
                rb.bf16 += 2 * vshape[0] * L
            lines.append(ParamLine(pp.vllm_param, pp.megatron_param, mshape, vshape, len(pp.segments),
                                   tuple(sorted({s.src_rank for s in pp.segments}))))
        norms = 2 * h + (2 * shape.head_dim if shape.qk_norm else 0)
        rb.bf16 += 2 * norms * L + 2 * h  # layer norms + final norm
        rb.bf16 += 2 * vocab_rows * h * (1 if shape.tie_word_embeddings else 2)
        plan.rank_bytes.append(rb)
        plan.rank_params.append(lines)
    return plan


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def format_plan(plan: ReshardPlan) -> str:
    s = plan.shape
    vp = f" x VPP{plan.train_vp}" if plan.train_vp else ""
    lines = [f"reshard plan: {s.name}  Megatron TP{plan.train_tp} x PP{plan.train_pp}{vp} -> vLLM TP{plan.rollout_tp}"
             f"  (128x128 FP8 blocks + FP32 scales, byte moves only)"]
    if not plan.ok:
        return "\n".join(lines + ["REFUSED:"] + [f"  - {v}" for v in plan.violations])
    L = s.num_layers
    lines.append(f"layers: {L} ({len(plan.fp8_layers)} FP8, {L - len(plan.fp8_layers)} BF16); "
                 f"heads {s.num_attention_heads} q / {s.num_kv_heads} kv"
                 + (f" (KV heads replicated x{plan.rollout_tp // s.num_kv_heads} on vLLM)"
                    if plan.rollout_tp > s.num_kv_heads else ""))
    lines.append("pipeline stages (pp_rank, vp_stage) -> global layers: "
                 + ", ".join(f"{k}: {r.start}-{r.stop - 1}" for k, r in plan.stage_layers.items()))
    lines.append("per decoder layer, per rollout rank:")
    lines.append(f"  {'rank':>4}  {'vLLM param':<20} {'vLLM local':>13} {'from Megatron':<26} {'local':>13} "
                 f"{'blocks':>7} {'segments':>8}  src TP ranks")
    for r, params in enumerate(plan.rank_params):
        for p in params:
            blocks = _cdiv(p.vllm_shape[0], BLOCK) * _cdiv(p.vllm_shape[1], BLOCK)
            lines.append(f"  {r:>4}  {p.vllm_param:<20} {str(p.vllm_shape):>13} {p.megatron_param:<26} "
                         f"{str(p.megatron_shape):>13} {blocks:>7} {p.segments:>8}  {list(p.src_ranks)}")
    lines.append("bytes moved per rollout rank (whole model):")
    lines.append(f"  {'rank':>4} {'fp8 weights':>14} {'fp32 scales':>14} {'bf16':>14} {'total':>14}")
    for r, rb in enumerate(plan.rank_bytes):
        lines.append(f"  {r:>4} {_fmt_bytes(rb.fp8):>14} {_fmt_bytes(rb.scales):>14} {_fmt_bytes(rb.bf16):>14} "
                     f"{_fmt_bytes(rb.total):>14}")
    total = sum(rb.total for rb in plan.rank_bytes)
    lines.append(f"  total {_fmt_bytes(total)}")
    return "\n".join(lines)


__all__ = ["build_plan", "format_plan", "ReshardPlan", "RankBytes", "ParamLine", "MEGATRON_PARAM"]
