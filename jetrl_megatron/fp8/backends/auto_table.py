"""Measured backend choice for gemm_backend="auto" on CUDA: per GEMM form and M bucket (bench/kernels_bench.py).

Filled from the H200 measurements in bench/RESULTS.md (torch 2.11+cu130, triton 3.6): the backend with the
least total time over the eight Qwen3-8B / Qwen3-32B-TP2 linear shapes in each bucket. Training M (8192, 16384):
cuBLAS wins every form by 1.4-1.7x over our Triton GEMM. Decode FProp (CUDA graphs): Triton's swap-AB split-K path
wins at M = 1 and 4 (cuBLAS needs M padded to 16 there); cuBLAS wins at M = 16 (by 4% in total) and 64. The bound 8
between the measured M = 4 and 16 is an interpolation. Batch-invariant mode always picks
the Triton backend (the only one with a fixed, M-independent reduction order).
"""

from __future__ import annotations

# form -> [(upper bound of M inclusive, backend)], first match wins; the last entry has no bound.
TABLE: dict[str, list[tuple[int | None, str]]] = {
    "fprop": [(8, "triton"), (None, "cublas")],
    "dgrad": [(None, "cublas")],
    "wgrad": [(None, "cublas")],
}


def pick(form: str, m: int, *, batch_invariant: bool = False) -> str:
    if form not in TABLE:
        raise ValueError(f"auto_table.pick: unknown GEMM form {form!r}; expected one of {tuple(TABLE)}")
    if batch_invariant:
        return "triton"
    for bound, backend in TABLE[form]:
        if bound is None or m <= bound:
            return backend
    return TABLE[form][-1][1]
