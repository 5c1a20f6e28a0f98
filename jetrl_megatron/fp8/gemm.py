"""FP8 GEMM dispatch for the three linear-layer forms, and the emulated reference every backend is tested against.

Operand layouts at this interface (scales may have any strides; backends re-layout as they need):

    FProp  Y  (M,N) = Xq (M,K) [1x128, xs (M,K/128)]   . Wq (N,K)^T [128x128, ws (ceil(N/128),ceil(K/128))]
    DGrad  dX (M,K) = Gq (M,N) [1x128, gs (M,N/128)]   . Wq (N,K)   [the same FP8 weight and scales, never requantized]
    WGrad  dW (N,K) = GTq (N,Mp) [1x128 along tokens]  . XTq (K,Mp)^T [1x128 along tokens]   (Mp = tokens padded to 128)

The emulated path accumulates exactly: within one 128-group the products of two E4M3 values are multiples of 2**-18
below 2**25, so their sum is exact in FP64 in any order; the per-group partials are then scaled and added in a fixed
group order with elementwise ops. A row's result therefore cannot depend on how many rows are in the batch (FP32
sgemm on this CPU changes row results for M < 8), which is what makes decode (M = running sequences) and the trainer
(M = all tokens) bitwise identical.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import torch

from jetrl_megatron.fp8.backends.auto_table import M_INVARIANT_FPROP, pick
from jetrl_megatron.fp8.quant import BLOCK, FP8_DTYPE
from jetrl_megatron.recipe import GEMM_BACKENDS, Fp8Recipe

FORMS = ("fprop", "dgrad", "wgrad")
GPU_BACKENDS = ("cublas", "triton", "deep_gemm")
_loaded: dict[str, ModuleType | None] = {}


# --------------------------------------------------------------------------------------------- emulated reference
def _grouped_scaled_dot(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor) -> torch.Tensor:
    """sum_g (a_s[:, g] x b_s[:, g]) * (a[:, g] @ b[:, g]^T) in FP64.

    a (R, G*128), a_s (R, G), b (C, G*128), b_s (C, G).
    """
    groups = a_s.shape[1]
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    as64, bs64 = a_s.to(torch.float64), b_s.to(torch.float64)
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for g in range(groups):
        cols = slice(g * BLOCK, (g + 1) * BLOCK)
        partial = a64[:, cols] @ b64[:, cols].T  # exact: see module docstring
        acc += partial * (as64[:, g : g + 1] * bs64[:, g].unsqueeze(0))
    return acc


def _block_rows(ws: torch.Tensor, rows: int) -> torch.Tensor:
    """Expand a (ceil(R/128), G) block-scale tensor to one row per weight row: (R, G)."""
    return ws.repeat_interleave(BLOCK, dim=0)[:rows]


def _finish(acc: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        acc = acc + bias.to(torch.float64)
    return acc.to(out_dtype)


def emulated_fprop(xq, xs, wq, ws, *, bias=None, out_dtype=torch.bfloat16):
    _check_fp8("fprop", xq=xq, wq=wq)
    m, k = xq.shape
    n = wq.shape[0]
    _check_shapes("fprop", xq=(xq, (m, k)), xs=(xs, (m, k // BLOCK)), wq=(wq, (n, k)),
                  ws=(ws, (-(-n // BLOCK), -(-k // BLOCK))))
    return _finish(_grouped_scaled_dot(xq, xs, wq, _block_rows(ws, n)), bias, out_dtype)


def emulated_dgrad(gq, gs, wq, ws, *, out_dtype=torch.bfloat16):
    _check_fp8("dgrad", gq=gq, wq=wq)
    m, n = gq.shape
    k = wq.shape[1]
    if n % BLOCK:
        raise ValueError(f"dgrad: output-gradient width N={n} must be a multiple of {BLOCK} (1x128 groups along N)")
    _check_shapes("dgrad", gq=(gq, (m, n)), gs=(gs, (m, n // BLOCK)), wq=(wq, (n, k)),
                  ws=(ws, (n // BLOCK, -(-k // BLOCK))))
    return _finish(_grouped_scaled_dot(gq, gs, wq.T, _block_rows(ws.T, k)), None, out_dtype)


def emulated_wgrad(gtq, gts, xtq, xts, *, out_dtype=torch.bfloat16):
    _check_fp8("wgrad", gtq=gtq, xtq=xtq)
    n, mp = gtq.shape
    k = xtq.shape[0]
    if mp % BLOCK:
        raise ValueError(f"wgrad: token dim Mp={mp} must be padded to a multiple of {BLOCK}")
    _check_shapes("wgrad", gtq=(gtq, (n, mp)), gts=(gts, (n, mp // BLOCK)), xtq=(xtq, (k, mp)),
                  xts=(xts, (k, mp // BLOCK)))
    return _finish(_grouped_scaled_dot(gtq, gts, xtq, xts), None, out_dtype)


_EMULATED = {"fprop": emulated_fprop, "dgrad": emulated_dgrad, "wgrad": emulated_wgrad}


def _check_fp8(form: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"{form}: operand {name} must be {FP8_DTYPE}, got {t.dtype}")


def _check_shapes(form: str, **items: tuple[torch.Tensor, tuple[int, ...]]) -> None:
    for name, (t, shape) in items.items():
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{form}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


# --------------------------------------------------------------------------------------------- dispatch
def load_backend(name: str) -> ModuleType | None:
    """Import jetrl_megatron.fp8.backends.<name> lazily; None if it is missing or reports unavailable."""
    if name not in _loaded:
        try:
            module = importlib.import_module(f"jetrl_megatron.fp8.backends.{name}")
            _loaded[name] = module if module.available() else None
        except ImportError:
            _loaded[name] = None
    return _loaded[name]


def resolve_backend(form: str, device: torch.device, m: int, requested: str | None = None,
                    recipe: Fp8Recipe | None = None) -> str:
    """Which backend computes `form` for M rows on `device`: explicit > recipe > auto.

    `auto` is the emulated reference on CPU and, on CUDA, the pick of the measured table in
    `backends/auto_table.py` (falling back to cuBLAS, then Triton, then emulated). In the jetrl arm the FProp must
    be M-invariant (:func:`needs_m_invariant_fprop`): auto then picks only measured-invariant backends.
    """
    name = requested or (recipe.gemm_backend if recipe is not None else "auto")
    if name not in GEMM_BACKENDS:
        raise ValueError(f"gemm_backend {name!r} is not one of {GEMM_BACKENDS}")
    if device.type != "cuda":
        if name in GPU_BACKENDS:
            raise ValueError(
                f"gemm_backend {name!r} needs CUDA tensors; these are on {device}. Use 'auto' or 'emulated'."
            )
        return "emulated"
    if name != "auto":
        if name != "emulated" and load_backend(name) is None:
            raise RuntimeError(f"gemm_backend {name!r} is not available on this machine")
        return name
    batch_invariant = bool(recipe is not None and recipe.batch_invariant)
    choice = pick(form, m, batch_invariant=batch_invariant, m_invariant=needs_m_invariant_fprop(recipe),
                  available=lambda n: load_backend(n) is not None)
    if choice == "emulated" or load_backend(choice) is not None:
        return choice
    for fallback in (("triton",) if batch_invariant else ("cublas", "triton")):
        if load_backend(fallback) is not None:
            return fallback
    return "emulated"


def needs_m_invariant_fprop(recipe: Fp8Recipe | None) -> bool:
    """The jetrl arm serves the trainer's FP8 weights to a rollout that runs this same FProp at decode M: exactly
    on-policy needs a row's bytes not to depend on M (the BF16-trainer arms do not compare FP8 FProps)."""
    return recipe is not None and recipe.trains_fp8 and recipe.rollout_weights == "trainer_fp8"


def _batch_invariant_mode(form: str, name: str, requested: str | None, recipe: Fp8Recipe | None) -> bool:
    """Triton's fixed-order mode: asked for, or auto's fallback when no measured M-invariant FProp is available."""
    if recipe is None:
        return False
    if recipe.batch_invariant:
        return True
    auto = (requested or recipe.gemm_backend) == "auto"
    return (auto and form == "fprop" and name == "triton" and "triton" not in M_INVARIANT_FPROP
            and needs_m_invariant_fprop(recipe))


def _run(form: str, m: int, device: torch.device, args: tuple, kwargs: dict, backend: str | None,
         recipe: Fp8Recipe | None) -> torch.Tensor:
    name = resolve_backend(form, device, m, backend, recipe)
    if name == "emulated":
        return _EMULATED[form](*args, **kwargs)
    fn = getattr(load_backend(name), form)
    if _batch_invariant_mode(form, name, backend, recipe):
        if "batch_invariant" not in inspect.signature(fn).parameters:
            raise ValueError(f"gemm_backend {name!r} has no batch-invariant mode; use 'triton' or 'emulated'")
        kwargs = {**kwargs, "batch_invariant": True}
    return fn(*args, **kwargs)


def fp8_gemm_fprop(xq, xs, wq, ws, *, bias=None, out_dtype=torch.bfloat16, backend=None, recipe=None):
    return _run("fprop", xq.shape[0], xq.device, (xq, xs, wq, ws), {"bias": bias, "out_dtype": out_dtype},
                backend, recipe)


def fp8_gemm_dgrad(gq, gs, wq, ws, *, out_dtype=torch.bfloat16, backend=None, recipe=None):
    return _run("dgrad", gq.shape[0], gq.device, (gq, gs, wq, ws), {"out_dtype": out_dtype}, backend, recipe)


def fp8_gemm_wgrad(gtq, gts, xtq, xts, *, out_dtype=torch.bfloat16, backend=None, recipe=None):
    return _run("wgrad", gtq.shape[0], gtq.device, (gtq, gts, xtq, xts), {"out_dtype": out_dtype}, backend, recipe)
