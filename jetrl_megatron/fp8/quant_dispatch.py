"""Quantization dispatch for the FP8 linear: fused Triton kernels on CUDA, the pure-torch reference elsewhere.

The kernels in `kernels.py` are bit-identical twins of these references (tested on the GPU), so the trainer and the
rollout quantize to the same bytes whichever path runs. ``reference_quant=True`` (each caller's choice, from its model
context or engine config: ``policy.jet_rl.fp8_reference_quant``) quantizes CUDA tensors with the reference too, for
checking.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from jetrl_megatron.fp8.quant import BLOCK, dequantize_1x128, quantize_1x128, quantize_128x128
from jetrl_megatron.recipe import Fp8Recipe


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """The Triton kernel module, imported on first use (None where triton is not installed)."""
    try:
        from jetrl_megatron.fp8 import kernels
    except ImportError:
        return None
    return kernels


def _cuda_kernels(x: torch.Tensor, reference_quant: bool) -> ModuleType | None:
    """The Triton kernel module for CUDA tensors (None on CPU, or with the reference quantizer selected)."""
    if not x.is_cuda or reference_quant:
        return None
    return _triton_kernels()


def padded_tokens(m: int) -> int:
    return -(-m // BLOCK) * BLOCK


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def quant_act(x2d: torch.Tensor, recipe: Fp8Recipe | None = None, *, reference_quant: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 row-wise quantization of an (M, K) activation or gradient."""
    kernels = _cuda_kernels(x2d, reference_quant)
    if kernels is not None:
        return kernels.quant_act(x2d, recipe)
    return quantize_1x128(x2d, recipe)


def quant_dual(g2d: torch.Tensor, recipe: Fp8Recipe | None = None, *, reference_quant: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(M, N) -> the 1x128 row-wise copy (DGrad) and the transposed token-grouped copy (N, Mp) (WGrad).

    The transposed copy is quantize_1x128 of the zero-padded transpose, i.e. 128x1 groups of the original.
    """
    kernels = _cuda_kernels(g2d, reference_quant)
    if kernels is not None:
        return kernels.quant_dual(g2d, recipe)
    q, s = quantize_1x128(g2d, recipe)
    qt, st = quantize_1x128(_pad_rows(g2d, padded_tokens(g2d.shape[0])).t(), recipe)
    return q, s, qt, st


def regroup_for_wgrad(q: torch.Tensor, s: torch.Tensor, recipe: Fp8Recipe | None = None, *,
                      reference_quant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved 1x128 FP8 activation (M, K) -> transposed token-grouped (K, Mp) form for WGrad.

    Contract: dequantize in FP32 (q * s, one rounding), then quantize 128x1 along tokens.
    """
    kernels = _cuda_kernels(q, reference_quant)
    if kernels is not None:
        return kernels.regroup_for_wgrad(q, s, recipe)
    x = dequantize_1x128(q, s, torch.float32)
    return quantize_1x128(_pad_rows(x, padded_tokens(x.shape[0])).t(), recipe)


def quant_weight(w: torch.Tensor, recipe: Fp8Recipe | None = None, *, reference_quant: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block quantization of an (N, K) weight (once per optimizer step)."""
    kernels = _cuda_kernels(w, reference_quant)
    if kernels is not None:
        return kernels.quant_weight(w, recipe)
    return quantize_128x128(w, recipe)
