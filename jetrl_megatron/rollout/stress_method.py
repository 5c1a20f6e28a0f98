"""The `jetrl_stress` vLLM quantization method: experiment-only rollout linears in a stress format (fp8/stress.py).

The engine keeps BF16 weights (refit is the BF16 arm's byte copy, read back as such) and every linear computes
``stress_linear_forward``, the very function the unified arm's trainer runs: the input quantized in the format at
each call, the weight through codes and scales that ``requantize_model`` rewrites in place after every load and
refit (the engine calls it; in place, so captured CUDA graphs read the new codes). With the weight quantized at
every decode step instead, the 150M GPU model's INT4 rollout took ~7x the BF16 arm's time (35 vs 5 s per step, four
runs sharing one H100, 2026-12-06; that quantization's share not profiled). Registered by the engine only when a run
asks for a stress format (in-process engines; on a GPU only with policy.jet_rl.stress.gpu); the vLLM plugin entry
point (plugin.py) never registers it, so no production engine can select it.

This module imports vLLM at the top; only the engine imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.parameter import ModelWeightParameter

from jetrl_megatron.fp8.stress import StressFormat, quantize_weight, stress_format
from jetrl_megatron.fp8.stress_linear import stress_linear_forward_quantized, weight_code_storage
from jetrl_megatron.rollout.quant_method import LinearsOnlyConfig

STRESS_METHOD = "jetrl_stress"
CODES, SCALES = "jetrl_stress_codes", "jetrl_stress_scales"  # per-layer attributes, not parameters: never refit
_registered = False


def register() -> None:
    """Register `JetRLStressConfig` under `jetrl_stress` (once per process)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(STRESS_METHOD)(JetRLStressConfig)
    _registered = True


def stress_quant_config(fmt: str, ignored_layers: list[str]) -> dict[str, Any]:
    """The hf_overrides `quantization_config` that makes a BF16 checkpoint's linears run ``fmt``."""
    stress_format(fmt)  # unknown names fail here, before vLLM starts
    return {"quant_method": STRESS_METHOD, "format": fmt, "ignored_layers": list(ignored_layers)}


class JetRLStressConfig(LinearsOnlyConfig):
    """Keys: `format` (a name of fp8.stress.STRESS_FORMATS) and `ignored_layers` (HF prefixes that stay BF16)."""

    def __init__(self, fmt: StressFormat, ignored_layers: list[str]):
        super().__init__()
        self.fmt = fmt
        self.ignored_layers = list(ignored_layers)

    def __repr__(self) -> str:
        return f"JetRLStressConfig(format={self.fmt.name}, ignored_layers={len(self.ignored_layers)} modules)"

    @classmethod
    def get_name(cls) -> str:
        return STRESS_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> JetRLStressConfig:
        if "format" not in config:
            raise ValueError(f"{STRESS_METHOD}: quantization_config needs a 'format' key, got {sorted(config)}")
        return cls(stress_format(config["format"]), list(config.get("ignored_layers") or []))

    def linear_method(self) -> LinearMethodBase:
        return JetRLStressLinearMethod(self.fmt)


class JetRLStressLinearMethod(LinearMethodBase):
    """BF16 weight as loaded; weight and input quantized in the stress format at every call."""

    def __init__(self, fmt: StressFormat):
        self.fmt = fmt

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        prefix = getattr(layer, "prefix", type(layer).__name__)
        self.fmt.group_of(input_size_per_partition, f"{STRESS_METHOD} {prefix} input (per partition)")
        rows = sum(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = rows
        weight = ModelWeightParameter(data=torch.empty(rows, input_size_per_partition, dtype=params_dtype),
                                      input_dim=1, output_dim=0, weight_loader=extra_weight_attrs["weight_loader"])
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """The BF16 bytes stay the runtime weight (a refit is a byte copy and reads back); its codes are derived."""
        self.requantize(layer)

    def requantize(self, layer: torch.nn.Module) -> None:
        """Quantize ``layer.weight`` into its codes and scales, in place where they exist (a captured graph keeps
        reading the same tensors); made on first use, and after vLLM re-created the weight with another shape."""
        wq, ws = quantize_weight(layer.weight.data, self.fmt)
        wq = wq.to(weight_code_storage(self.fmt))
        old_q = getattr(layer, CODES, None)  # the scales' shape follows the codes' (the format's groups)
        if old_q is not None and (old_q.shape, old_q.dtype, old_q.device) == (wq.shape, wq.dtype, wq.device):
            old_q.copy_(wq)
            getattr(layer, SCALES).copy_(ws)
        else:
            setattr(layer, CODES, wq)
            setattr(layer, SCALES, ws)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return stress_linear_forward_quantized(x, getattr(layer, CODES), getattr(layer, SCALES), bias, self.fmt)


def requantize_model(model: torch.nn.Module) -> int:
    """Re-derive every stress linear's weight codes from its (refit) BF16 weight; returns how many layers. Run in
    the worker through ``LLM.apply_model`` after each write of weights."""
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, JetRLStressLinearMethod):
            method.requantize(module)
            count += 1
    return count
