"""Reference FP8 quantizers (pure torch, CPU and CUDA): the precision contract in code.

Every kernel in `kernels.py` and every backend is tested bit-for-bit against these functions, and vLLM's
`per_token_group_quant_fp8` semantics are tested bit-for-bit against them too. The formula (docs/precision.md):

    amax = max(|x_group|) in FP32;   s = max(amax, eps) / 448   (FP32 *tensor* division)
    pow2: s = 2 ** ceil(log2(s))     (exact, via frexp)
    q = clamp(x / s, -448, 448) -> float8_e4m3fn (round to nearest even)

`s` is the dequantization multiplier (x ~= q * s), stored as `weight_scale_inv` for weights, as in vLLM.

NaN/Inf are not hidden: a NaN in a group makes that group's scale and codes NaN; an Inf makes the scale Inf and the
group's codes 0 (finite/Inf) or NaN (Inf/Inf). Callers (the weight cache, the trainer) check finiteness and refuse.
"""

from __future__ import annotations

import torch

from jetrl_megatron.fp8.format import BLOCK
from jetrl_megatron.recipe import Fp8Recipe

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

_DEFAULT_RECIPE = Fp8Recipe()


def _recipe(recipe: Fp8Recipe | None) -> Fp8Recipe:
    return _DEFAULT_RECIPE if recipe is None else recipe


def compute_scale(amax: torch.Tensor, recipe: Fp8Recipe | None = None) -> torch.Tensor:
    """Scale (dequant multiplier) from an FP32 amax tensor.

    The divisor is an FP32 tensor, not a Python float: CUDA lowers `tensor / python_scalar` to a reciprocal multiply,
    which differs from CPU in the last bit (measured: 2538 of 16.8M codes).
    """
    recipe = _recipe(recipe)
    amax = amax.float()
    s = torch.clamp(amax, min=recipe.amax_eps) / torch.full_like(amax, FP8_MAX)
    if recipe.scale_fmt == "pow2":
        s = _ceil_pow2(s)
    return s


def _ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(s)) computed exactly: s = m * 2**e with m in [0.5, 1); s is a power of two iff m == 0.5."""
    mantissa, exponent = torch.frexp(s)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    out = torch.ldexp(torch.ones_like(s), exponent)
    return torch.where(torch.isfinite(s), out, s)  # NaN/Inf stay visible


def _cast(y: torch.Tensor) -> torch.Tensor:
    # Clamp before the cast: torch's cast turns |y| > ~464 into NaN, Triton's saturates; clamped, both agree.
    return torch.clamp(y, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_groupable(x: torch.Tensor, dim_size: int, what: str) -> None:
    if dim_size % BLOCK != 0:
        raise ValueError(
            f"{what}: size {dim_size} of tensor with shape {tuple(x.shape)} is not divisible by the FP8 group size "
            f"{BLOCK}; activations and gradients must have a reduction dim that is a multiple of 128"
        )


def quantize_1x128(x: torch.Tensor, recipe: Fp8Recipe | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of 128 along the last dim (activations, gradients). q: x's shape; s: x.shape[:-1] + (K/128,)."""
    if x.dim() < 1:
        raise ValueError(f"quantize_1x128: expected at least 1 dim, got a scalar of shape {tuple(x.shape)}")
    k = x.shape[-1]
    _check_groupable(x, k, "quantize_1x128 (last dim K)")
    xf = x.float().reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    s = compute_scale(xf.abs().amax(dim=-1), recipe)
    q = _cast(xf / s.unsqueeze(-1))
    return q.reshape(x.shape), s


def quantize_128x1(x: torch.Tensor, recipe: Fp8Recipe | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of 128 along dim 0 (tokens) of a 2-D (M, K) tensor, for WGrad. q: (M, K); s: (ceil(M/128), K).

    A partial last group (M % 128 != 0) uses the amax of its valid rows, which equals zero-padding to 128.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_128x1: expected a 2-D (tokens, features) tensor, got shape {tuple(x.shape)}")
    m, k = x.shape
    mb = -(-m // BLOCK)
    xf = _pad_to(x.float(), mb * BLOCK, k).reshape(mb, BLOCK, k)
    s = compute_scale(xf.abs().amax(dim=1), recipe)
    q = _cast(xf / s.unsqueeze(1)).reshape(mb * BLOCK, k)[:m]
    return q, s


def quantize_128x128(w: torch.Tensor, recipe: Fp8Recipe | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights in 128x128 blocks. q: (N, K); s: (ceil(N/128), ceil(K/128)), partial edge tiles allowed."""
    if w.dim() != 2:
        raise ValueError(f"quantize_128x128: expected a 2-D (out, in) weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    wf = _pad_to(w.float(), nb * BLOCK, kb * BLOCK).reshape(nb, BLOCK, kb, BLOCK)
    s = compute_scale(wf.abs().amax(dim=(1, 3)), recipe)
    q = _cast(wf / s[:, None, :, None]).reshape(nb * BLOCK, kb * BLOCK)[:n, :k]
    return q.contiguous(), s


def dequantize_1x128(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = q.shape[-1]
    _check_groupable(q, k, "dequantize_1x128 (last dim K)")
    _check_scale_shape(s, (*q.shape[:-1], k // BLOCK), "dequantize_1x128")
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    out = q.to(calc).reshape(*q.shape[:-1], k // BLOCK, BLOCK) * s.to(calc).unsqueeze(-1)
    return out.reshape(q.shape).to(dtype)


def dequantize_128x1(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    m, k = q.shape
    _check_scale_shape(s, (-(-m // BLOCK), k), "dequantize_128x1")
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    rows = s.to(calc).repeat_interleave(BLOCK, dim=0)[:m]
    return (q.to(calc) * rows).to(dtype)


def dequantize_128x128(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = q.shape
    _check_scale_shape(s, (-(-n // BLOCK), -(-k // BLOCK)), "dequantize_128x128")
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    full = s.to(calc).repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
    return (q.to(calc) * full).to(dtype)


def _check_scale_shape(s: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(s.shape) != tuple(expected):
        raise ValueError(f"{what}: scale shape {tuple(s.shape)} does not match expected {tuple(expected)}")


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if x.shape == (rows, cols):
        return x
    out = x.new_zeros(rows, cols)
    out[: x.shape[0], : x.shape[1]] = x
    return out
