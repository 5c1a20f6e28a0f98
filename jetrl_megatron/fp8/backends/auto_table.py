"""Measured backend choice for gemm_backend="auto" on CUDA: per GEMM form and M bucket (bench/kernels_bench.py).

Filled from the H200 measurements in bench/RESULTS.md (torch 2.11+cu130, triton 3.6, DeepGEMM 2.5.0 as bundled by
vLLM 0.26): for each form and M bucket, an ordered list of backends, fastest first; the first one available on the
machine is used. Training M (8192, 16384), summed over the eight Qwen3-8B / Qwen3-32B-TP2 linear shapes:
DeepGEMM FProp 1.91x / 1.77x BF16 (cuBLAS 1.60x), DGrad 1.97x / 1.84x (cuBLAS 1.65x / 1.69x); WGrad cuBLAS 1.28x /
1.33x vs DeepGEMM 1.21x / 1.37x (cuBLAS kept: it wins at M = 8192 and needs no FP32 accumulator pass). Rollout
(vLLM 0.26, Qwen3-8B and -32B, 1024 new tokens): the plugin with DeepGEMM FProp at every M ran 1.02x stock
block-FP8, with the table below minus DeepGEMM 0.95x. Without DeepGEMM: Triton's swap-AB split-K path wins decode
FProp at M = 1 and 4 (cuBLAS needs M padded to 16 there), cuBLAS from M = 16; the bound 8 is an interpolation.
Batch-invariant mode always picks the Triton backend (the only one with a fixed, M-independent reduction order).
"""

from __future__ import annotations

from collections.abc import Callable

# form -> [(upper bound of M inclusive, backends fastest first)], first bucket that matches wins.
TABLE: dict[str, list[tuple[int | None, tuple[str, ...]]]] = {
    "fprop": [(8, ("deep_gemm", "triton")), (None, ("deep_gemm", "cublas"))],
    "dgrad": [(None, ("deep_gemm", "cublas"))],
    "wgrad": [(None, ("cublas", "deep_gemm"))],
}


def pick(form: str, m: int, *, batch_invariant: bool = False,
         available: Callable[[str], bool] | None = None) -> str:
    """The fastest measured backend for `form` at M rows among those `available` reports (all by default)."""
    if form not in TABLE:
        raise ValueError(f"auto_table.pick: unknown GEMM form {form!r}; expected one of {tuple(TABLE)}")
    if batch_invariant:
        return "triton"
    bucket = next(names for bound, names in TABLE[form] if bound is None or m <= bound)
    for name in bucket:
        if available is None or available(name):
            return name
    return bucket[-1]
