"""Independent re-implementation of vLLM's block-FP8 quantization semantics, written from the formula in NumPy.

It shares no code with `jetrl_megatron.fp8`: the E4M3 encoder is built from the format's bit layout, FP32 divisions are
computed in FP64 and rounded once to FP32 (correctly rounded for +-*/ since 53 >= 2*24+2), and pow2 scales use
ceil(log2) in FP64. vLLM's `per_token_group_quant_fp8`: absmax = max(eps, max|x|); s = absmax / 448; optional UE8M0
s = 2**ceil(log2 s); q = clamp(x / s, -448, 448) -> e4m3 (round to nearest, ties to even).
"""

from __future__ import annotations

import numpy as np
import torch

FP8_MAX = 448.0


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """All finite non-negative E4M3 values (sorted) and their byte codes."""
    values, codes = [], []
    for code in range(0x7F):  # 0x7F is NaN
        exp, man = code >> 3, code & 7
        value = (man / 8.0) * 2.0 ** (1 - 7) if exp == 0 else (1 + man / 8.0) * 2.0 ** (exp - 7)
        values.append(value)
        codes.append(code)
    return np.array(values, dtype=np.float64), np.array(codes, dtype=np.uint8)


_VALUES, _CODES = _e4m3_table()


def encode_e4m3(y: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even encoding of values already clamped to [-448, 448] (NaN -> 0x7F | sign)."""
    y = np.asarray(y, dtype=np.float64)
    mag = np.abs(y)
    idx = np.clip(np.searchsorted(_VALUES, mag), 1, len(_VALUES) - 1)
    lo, hi = _VALUES[idx - 1], _VALUES[idx]
    pick_hi = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & (_CODES[idx - 1] & 1 == 1))
    code = np.where(pick_hi, _CODES[idx], _CODES[idx - 1])
    code = np.where(mag == 0, 0, code)
    code = np.where(np.signbit(y), code | 0x80, code).astype(np.uint8)
    return np.where(np.isnan(y), np.uint8(0x7F), code).astype(np.uint8)


def _f32_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.astype(np.float64) / b.astype(np.float64)).astype(np.float32)


def _scale(amax: np.ndarray, eps: float, pow2: bool) -> np.ndarray:
    absmax = np.maximum(amax.astype(np.float32), np.float32(eps))
    s = _f32_div(absmax, np.full_like(absmax, FP8_MAX))
    if pow2:
        s = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    return s


def _quant_with_scale(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    y = _f32_div(x, s)
    return encode_e4m3(np.clip(y, -FP8_MAX, FP8_MAX))


def per_token_group_quant(x: torch.Tensor, eps: float = 1e-10, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """vLLM per_token_group_quant_fp8 (group 128 along the last dim): (uint8 codes, float32 scales)."""
    xn = x.float().numpy()
    g = xn.reshape(*xn.shape[:-1], xn.shape[-1] // 128, 128)
    s = _scale(np.abs(g).max(axis=-1), eps, pow2)
    q = _quant_with_scale(g, s[..., None]).reshape(xn.shape)
    return q, s


def block_quant(w: torch.Tensor, eps: float = 1e-10, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """128x128 block weight quantization with partial edge tiles (amax over the valid elements)."""
    wn = w.float().numpy()
    n, k = wn.shape
    nb, kb = -(-n // 128), -(-k // 128)
    s = np.empty((nb, kb), dtype=np.float32)
    q = np.empty((n, k), dtype=np.uint8)
    for i in range(nb):
        for j in range(kb):
            tile = wn[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s[i, j] = _scale(np.abs(tile).max(keepdims=True), eps, pow2)[0, 0]
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = _quant_with_scale(tile, s[i, j])
    return q, s


def codes(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()
