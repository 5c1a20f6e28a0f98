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

Exactly on-policy (the jetrl arm: the rollout serves the trainer's FP8 bytes and runs the same FProp) also needs the
FProp to give a row the same bytes at decode M and at the trainer's M. `M_INVARIANT_FPROP` lists the backends
measured so (bench/gemm_m_invariance.py: every Qwen3-8B linear shape, M = 1..2048 against M = 8192, bit for bit;
bench/RESULTS.md "FP8 FProp M-invariance"): DeepGEMM's 1D2D kernel (no split-K: one K order per output tile at
every M). cuBLAS is not (its heuristics switch kernels for down_proj, K = 12288, at M = 3, 8 and 16), nor our
Triton FProp's default configs (M <= 64). With `m_invariant=True` auto takes the first measured-invariant backend
that is available, else Triton's batch-invariant mode (invariant by construction, slower): `m_invariant_choice`.
"""

from __future__ import annotations

from collections.abc import Callable

# form -> [(upper bound of M inclusive, backends fastest first)], first bucket that matches wins.
TABLE: dict[str, list[tuple[int | None, tuple[str, ...]]]] = {
    "fprop": [(8, ("deep_gemm", "triton")), (None, ("deep_gemm", "cublas"))],
    "dgrad": [(None, ("deep_gemm", "cublas"))],
    "wgrad": [(None, ("cublas", "deep_gemm"))],
}


# FProp backends measured M-invariant at the Qwen3 shapes (see the module docstring), fastest first.
M_INVARIANT_FPROP: tuple[str, ...] = ("deep_gemm",)


def m_invariant_choice(available: Callable[[str], bool] | None = None) -> tuple[str, bool]:
    """(backend, batch_invariant flag) for an FProp that must not depend on M: the first measured-invariant backend
    `available` reports, else Triton in its batch-invariant mode."""
    for name in M_INVARIANT_FPROP:
        if available is None or available(name):
            return name, False
    return "triton", True


def pick(form: str, m: int, *, batch_invariant: bool = False, m_invariant: bool = False,
         available: Callable[[str], bool] | None = None) -> str:
    """The fastest measured backend for `form` at M rows among those `available` reports (all by default);
    `m_invariant`: for FProp, only a backend measured M-invariant (`m_invariant_choice`)."""
    if form not in TABLE:
        raise ValueError(f"auto_table.pick: unknown GEMM form {form!r}; expected one of {tuple(TABLE)}")
    if batch_invariant:
        return "triton"
    if m_invariant and form == "fprop":
        return m_invariant_choice(available)[0]
    bucket = next(names for bound, names in TABLE[form] if bound is None or m <= bound)
    for name in bucket:
        if available is None or available(name):
            return name
    return bucket[-1]
