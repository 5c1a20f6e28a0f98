"""The FP8 linear layer: FProp, DGrad and WGrad all in E4M3, BF16 in and out.

`fp8_linear_forward` is the whole forward math and is shared verbatim by the trainer (inside the autograd Function)
and by the vLLM `jetrl_fp8` plugin, so the rollout forward is literally a sub-graph of the training forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetrl_megatron.fp8 import quant_dispatch
from jetrl_megatron.fp8.gemm import fp8_gemm_dgrad, fp8_gemm_fprop, fp8_gemm_wgrad
from jetrl_megatron.fp8.quant import BLOCK, dequantize_1x128, dequantize_128x128, quantize_1x128, quantize_128x128
from jetrl_megatron.recipe import Fp8Recipe


def _flatten(x: torch.Tensor, weight_in: int, name: str = "x") -> torch.Tensor:
    if x.shape[-1] != weight_in:
        raise ValueError(f"fp8_linear: {name} has last dim {x.shape[-1]} but the weight expects {weight_in} inputs")
    return x.reshape(-1, x.shape[-1])


def check_trainable_shape(weight: torch.Tensor, x: torch.Tensor, fn: str) -> None:
    """N and K of a trainable FP8 linear must be multiples of 128. Checked at the forward call because the
    backward pass quantizes the output gradient (N) and the input gradient (K) in 1x128 groups, and a bad N used to
    surface only there, reported as the gradient's "last dim K"."""
    if weight.dim() != 2:
        raise ValueError(f"{fn}: weight must be 2-D (N out x K in), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    bad = [f"{what} = {size}" for what, size in (("N (out features, weight dim 0)", n),
                                                 ("K (in features, weight dim 1)", k)) if size % BLOCK]
    if bad:
        raise ValueError(f"{fn}: weight is {n} x {k} (N x K) and x is {tuple(x.shape)}: {' and '.join(bad)} not a "
                         f"multiple of {BLOCK}; FP8 training groups N and K by {BLOCK} (1x128 gradients, 128x128 "
                         "weight blocks). Pad the layer to a multiple of 128 or keep it in BF16")


@dataclass(frozen=True)
class PrequantizedAct:
    """An FP8 linear's input x, already quantized 1x128 by the op that produced it: the codes (M, K) and scales
    (M, K/128) ``quant_act`` would give for that very tensor, under one recipe's scale rule.

    Why: the producer (the batch-invariant RMSNorm, megatron/triton_numerics.py) has the values in registers and
    writes the codes in the same pass, so the linear skips a launch and a read of x (a decode step runs two such
    norm -> linear pairs per layer). The forms ride on the tensor object; ``matches`` refuses them for any other
    tensor, a tensor changed in place since, or another scale rule, and the linear then quantizes as usual."""

    q: torch.Tensor
    s: torch.Tensor
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    version: int
    scale_fmt: str
    amax_eps: float

    def matches(self, x: torch.Tensor, recipe: Fp8Recipe | None) -> bool:
        r = recipe or Fp8Recipe()
        return (x.data_ptr() == self.data_ptr and tuple(x.shape) == self.shape and tuple(x.stride()) == self.stride
                and _version(x) == self.version and r.scale_fmt == self.scale_fmt and r.amax_eps == self.amax_eps)


_INPUT_FORMS = "_jetrl_fp8_input_forms"


def _version(x: torch.Tensor) -> int:
    """x's in-place version counter; -1 for inference tensors (vLLM runs its model under ``torch.inference_mode``,
    whose tensors have none: there the forms are trusted from producer to consumer, as nothing runs in between)."""
    return -1 if x.is_inference() else x._version


def attach_input_forms(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, recipe: Fp8Recipe | None) -> None:
    """Hand ``x``'s 1x128 FP8 forms (as ``quant_act`` gives them) to the FP8 linear that will consume ``x``."""
    r = recipe or Fp8Recipe()
    setattr(x, _INPUT_FORMS, PrequantizedAct(q, s, x.data_ptr(), tuple(x.shape), tuple(x.stride()), _version(x),
                                             r.scale_fmt, r.amax_eps))


def _input_forms(x: torch.Tensor, recipe: Fp8Recipe | None, reference_quant: bool
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The forms attached to ``x`` when they are x's under ``recipe`` (never with ``reference_quant``: its point is
    to run the reference quantizer)."""
    pre = getattr(x, _INPUT_FORMS, None)
    if pre is None or reference_quant or not pre.matches(x, recipe):
        return None
    return pre.q, pre.s


def _fprop(x2d: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
           recipe: Fp8Recipe | None, out_dtype: torch.dtype, reference_quant: bool,
           forms: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xq, xs = forms or quant_dispatch.quant_act(x2d, recipe, reference_quant=reference_quant)
    y = fp8_gemm_fprop(xq, xs, wq, ws, bias=bias, out_dtype=out_dtype, recipe=recipe)
    return y, xq, xs


def fp8_linear_forward(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None = None,
                       recipe: Fp8Recipe | None = None, *, reference_quant: bool = False) -> torch.Tensor:
    """y = x W^T with x quantized 1x128 (or its forms, when its producer attached them: ``attach_input_forms``)
    and W given as its FP8 128x128 copy (no autograd). ``reference_quant``: quantize CUDA tensors with the torch
    reference instead of the Triton kernels (bit-identical; for checking)."""
    y, _, _ = _fprop(_flatten(x, wq.shape[1]), wq, ws, bias, recipe, x.dtype, reference_quant,
                     _input_forms(x, recipe, reference_quant))
    return y.reshape(*x.shape[:-1], wq.shape[0])


@dataclass(frozen=True)
class PrequantizedGrad:
    """An FP8 linear's output gradient dY, already quantized by the op that produced it (both forms of
    ``quant_dual``: q, s, qt, st), with ``grad``, the tensor that op hands autograd as dY: the BF16 dY itself, or
    (``placeholder``) a zero-stride stand-in when the linear needs only the FP8 forms.

    Why: the producer (the fused SwiGLU backward, megatron/swiglu_fp8.py) writes the FP8 forms directly and the
    linear skips its own quantization; autograd passes only tensors, so the forms travel on the linear's node."""

    grad: torch.Tensor
    forms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    placeholder: bool

    def is_for(self, dy: torch.Tensor) -> bool:
        """Whether ``dy`` is the very gradient these forms quantize (not, e.g., a sum with another consumer's)."""
        g = self.grad
        return dy.data_ptr() == g.data_ptr() and dy.shape == g.shape and dy.stride() == g.stride()


def prequantized_grad_target(y: torch.Tensor):
    """The autograd node of the FP8 linear whose output ``y`` is, when that linear may take its dY prequantized
    (:func:`hand_over_grad`): a trainable FP8 linear quantizing with the kernels (not ``reference_quant``, whose
    point is to run the reference). None otherwise (another op produced ``y``, or a view of it)."""
    node = y.grad_fn
    if isinstance(node, _Fp8LinearFunction._backward_cls) and not node.reference_quant:
        return node
    return None


def hand_over_grad(node, grad: PrequantizedGrad) -> None:
    """Give the linear's node (from :func:`prequantized_grad_target`) its dY's FP8 forms, for its next backward."""
    node.prequantized_dy = grad


def _quantized_dy(ctx, dy: torch.Tensor, dy2d: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 forms of dY (``dy2d``: dy as (M, N)): handed over by its producer when they quantize this very
    ``dy``, else quant_dual's."""
    pre, ctx.prequantized_dy = getattr(ctx, "prequantized_dy", None), None
    if pre is not None:
        if pre.is_for(dy) and tuple(pre.forms[0].shape) == tuple(dy2d.shape):
            return pre.forms
        if pre.placeholder:
            raise RuntimeError(
                f"fp8_linear backward: dY {tuple(dy2d.shape)} is not the gradient its producer quantized (autograd "
                "summed it with another consumer's, or an op sits between this linear and its producer); the "
                "producer handed over only FP8 forms with a placeholder dY. Turn off the fused SwiGLU gradient "
                "quantization (Fp8ModelContext.fuse_swiglu_grad_quant) for this model")
    return quant_dispatch.quant_dual(dy2d, ctx.recipe, reference_quant=ctx.reference_quant)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, wq, ws, recipe, reference_quant):
        x2d = _flatten(x, wq.shape[1])
        y, xq, xs = _fprop(x2d, wq, ws, bias, recipe, x.dtype, reference_quant,
                           _input_forms(x, recipe, reference_quant))
        # Saved for backward: the FP8 activation and its scales (~0.52x the BF16 input), plus the cached FP8 weight.
        ctx.save_for_backward(xq, xs, wq, ws)
        ctx.recipe, ctx.reference_quant, ctx.x_shape, ctx.x_dtype = recipe, reference_quant, x.shape, x.dtype
        ctx.weight_dtype, ctx.has_bias = weight.dtype, bias is not None
        return y.reshape(*x.shape[:-1], wq.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xq, xs, wq, ws = ctx.saved_tensors
        recipe, reference = ctx.recipe, ctx.reference_quant
        dy2d = dy.reshape(-1, dy.shape[-1])
        gq, gs, gtq, gts = _quantized_dy(ctx, dy, dy2d)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm_dgrad(gq, gs, wq, ws, out_dtype=ctx.x_dtype, recipe=recipe).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            xtq, xts = quant_dispatch.regroup_for_wgrad(xq, xs, recipe, reference_quant=reference)
            dw = fp8_gemm_wgrad(gtq, gts, xtq, xts, out_dtype=ctx.weight_dtype, recipe=recipe)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.float().sum(0).to(ctx.weight_dtype)
        return dx, dw, db, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: Fp8Recipe | None = None, *,
               weight_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
               reference_quant: bool = False) -> torch.Tensor:
    """Autograd FP8 linear. `weight` is the BF16 master (it receives dW); `weight_fp8` its per-step FP8 copy.

    Without `weight_fp8` the weight is quantized on the fly (tests, one-off use); the trainer passes the cache's copy so
    that DGrad and the rollout use the very same bytes. `reference_quant`: the torch reference quantizer for CUDA
    tensors too (forward and backward; bit-identical to the kernels).

    With grad disabled (the trainer's logprob and reference passes) this is :func:`fp8_linear_forward` itself: the
    same forward, without the autograd Function around it (5.5 us less host time per call on the 2-core development
    box, kernels stubbed out; 144 calls per Qwen3-8B forward) and without the backward's shape rule.
    """
    grad = torch.is_grad_enabled()
    if grad:
        check_trainable_shape(weight, x, "fp8_linear")
    if weight_fp8 is None:
        weight_fp8 = quant_dispatch.quant_weight(weight.detach(), recipe, reference_quant=reference_quant)
    wq, ws = weight_fp8
    if not grad:
        return fp8_linear_forward(x, wq, ws, bias, recipe, reference_quant=reference_quant)
    if tuple(wq.shape) != tuple(weight.shape):
        raise ValueError(f"fp8_linear: FP8 weight shape {tuple(wq.shape)} != master weight shape {tuple(weight.shape)}")
    return _Fp8LinearFunction.apply(x, weight, bias, wq, ws, recipe, reference_quant)


# ------------------------------------------------------------------------------------------------ fake-quant ablation
def _fake_1x128(t: torch.Tensor, recipe: Fp8Recipe | None) -> torch.Tensor:
    q, s = quantize_1x128(t, recipe)
    return dequantize_1x128(q, s, t.dtype)


def _fake_tokens(t2d: torch.Tensor, recipe: Fp8Recipe | None) -> torch.Tensor:
    """Quantize-dequantize with 128 groups along tokens (WGrad operands), returned as the (features, Mp) transpose."""
    q, s = quantize_1x128(quant_dispatch._pad_rows(t2d, quant_dispatch.padded_tokens(t2d.shape[0])).t(), recipe)
    return dequantize_1x128(q, s, t2d.dtype)


class _FakeQuantLinearFunction(torch.autograd.Function):
    """BF16 GEMMs on quantize-dequantized operands, with the same grouping as the FP8 flow for all three GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        x2d = _flatten(x, weight.shape[1])
        wq, ws = quantize_128x128(weight.detach(), recipe)
        w_fq = dequantize_128x128(wq, ws, x.dtype)
        x_fq = _fake_1x128(x2d, recipe)
        y = torch.nn.functional.linear(x_fq, w_fq, bias)
        ctx.save_for_backward(x_fq, w_fq)
        ctx.recipe, ctx.x_shape, ctx.has_bias = recipe, x.shape, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x_fq, w_fq = ctx.saved_tensors
        recipe = ctx.recipe
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = (_fake_1x128(dy2d, recipe) @ w_fq).reshape(ctx.x_shape)
        dw = _fake_tokens(dy2d, recipe) @ _fake_tokens(x_fq, recipe).t()
        db = dy2d.float().sum(0).to(dy.dtype) if ctx.has_bias else None
        return dx, dw.to(w_fq.dtype), db, None


def fake_quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      recipe: Fp8Recipe | None = None) -> torch.Tensor:
    """Ablation arm: the FP8 grouping and rounding, but BF16 GEMMs (no FP8 tensor-core math)."""
    check_trainable_shape(weight, x, "fake_quant_linear")
    return _FakeQuantLinearFunction.apply(x, weight, bias, recipe)
