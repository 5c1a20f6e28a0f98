"""Compile the FP8 GEMM kernels a run will need before it needs them, in parallel processes.

Why: DeepGEMM compiles one kernel per (N, K, tile config) with NVCC the first time a shape meets a new config, one
after another in the process that calls it: ~4 minutes for the Qwen3-8B shapes on a fresh machine (measured with
vLLM's bundled DeepGEMM 2.5 on H100 and H200), paid inside the first rollout engine start and the first update. Its
disk cache (``DG_JIT_CACHE_DIR``) is shared by every process on the machine and installed by rename, so separate
processes can fill it side by side: each task here is one GEMM (N, K) pair, run through the same dispatch the run
uses (:func:`jetrl_megatron.fp8.gemm.fp8_gemm_fprop` / ``fp8_gemm_dgrad`` with the run's recipe), at one
representative M per tile-count class (:func:`representative_m_values`), in its own process.

A task also runs the FP8 linear's quantizers (Triton) at a few M, so their kernels are compiled and cached too
(``TRITON_CACHE_DIR``). Nothing here changes numerics: it only calls the kernels the run calls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from jetrl_megatron.fp8 import quant_dispatch
from jetrl_megatron.fp8.gemm import fp8_gemm_dgrad, fp8_gemm_fprop, resolve_backend
from jetrl_megatron.fp8.quant import BLOCK
from jetrl_megatron.recipe import Fp8Recipe

FORMS = ("fprop", "dgrad")
# M classes: DeepGEMM's SM90 tile heuristics see M only through ceil(M / BLOCK_M) for BLOCK_M in {64, 128, 256} and
# through thresholds at such multiples; below EXHAUSTIVE_UP_TO every M is run (decode batches, short prefills).
M_CLASS = 64
EXHAUSTIVE_UP_TO = 256
# M values at which the quantizers run (Triton specializes integer arguments on == 1 and on divisibility by 16)
QUANTIZER_M = (1, 17, 128)


def representative_m_values(m_max: int, exhaustive_up_to: int = EXHAUSTIVE_UP_TO, m_class: int = M_CLASS
                            ) -> list[int]:
    """Every M up to ``exhaustive_up_to``, then each multiple of ``m_class`` and the M just below it, and ``m_max``."""
    if m_max < 1:
        raise ValueError(f"representative_m_values: m_max must be >= 1, got {m_max}")
    ms = set(range(1, min(m_max, exhaustive_up_to) + 1))
    for top in range(m_class, m_max + 1, m_class):
        ms.update((top - 1, top))
    ms.add(m_max)
    return sorted(m for m in ms if 1 <= m <= m_max)


@dataclass(frozen=True)
class GemmTask:
    """One GEMM of a linear: ``form`` fprop (out = x W^T, N = out_features, K = in_features) or dgrad (dx = dy W,
    N = in_features, K = out_features), at every M of ``m_values``."""

    linear: str
    out_features: int
    in_features: int
    form: str
    m_values: tuple[int, ...]
    covers: tuple[str, ...] = ()  # other "linear form" GEMMs with this (N, K): the same kernels

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"GemmTask {self.linear}: form {self.form!r} is not one of {FORMS}")
        for name in ("out_features", "in_features"):
            if getattr(self, name) % BLOCK:
                raise ValueError(f"GemmTask {self.linear}: {name} {getattr(self, name)} is not a multiple of {BLOCK}")
        if not self.m_values:
            raise ValueError(f"GemmTask {self.linear} {self.form}: no M values")

    @property
    def gemm_nk(self) -> tuple[int, int]:
        """The (N, K) the GEMM kernel is compiled for."""
        if self.form == "fprop":
            return self.out_features, self.in_features
        return self.in_features, self.out_features

    def describe(self) -> str:
        n, k = self.gemm_nk
        also = f" (also {', '.join(self.covers)})" if self.covers else ""
        return (f"{self.linear} {self.form}{also}: N {n}, K {k}, {len(self.m_values)} M values "
                f"({self.m_values[0]}..{self.m_values[-1]})")


@dataclass
class TaskResult:
    task: GemmTask
    seconds: float
    calls: int
    backends: list[str] = field(default_factory=list)
    error: str | None = None


def run_task(task: GemmTask, recipe: Fp8Recipe, device: str | torch.device = "cuda") -> TaskResult:
    """Run ``task``'s GEMM at each of its M values (random FP8 operands; one buffer of the largest M, sliced)."""
    start = time.perf_counter()
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    k = task.gemm_nk[1]
    m_max = task.m_values[-1]
    weight = torch.randn(task.out_features, task.in_features, generator=gen, device=device).to(torch.bfloat16)
    wq, ws = quant_dispatch.quant_weight(weight, recipe)
    a = torch.randn(m_max, k, generator=gen, device=device).to(torch.bfloat16)
    for m in QUANTIZER_M:  # the quantizers' kernels at this K: activation (fprop) or the gradient's two forms (dgrad)
        if m <= m_max:
            if task.form == "fprop":
                quant_dispatch.quant_act(a[:m], recipe)
            else:
                quant_dispatch.regroup_for_wgrad(*quant_dispatch.quant_dual(a[:m], recipe)[:2], recipe)
    aq, as_ = quant_dispatch.quant_act(a, recipe)
    gemm = fp8_gemm_fprop if task.form == "fprop" else fp8_gemm_dgrad
    backends: set[str] = set()
    for m in task.m_values:
        backends.add(resolve_backend(task.form, device, m, None, recipe))
        gemm(aq[:m], as_[:m], wq, ws, recipe=recipe)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return TaskResult(task, time.perf_counter() - start, len(task.m_values), sorted(backends))


def _worker(task: GemmTask, recipe: Fp8Recipe, device: str) -> TaskResult:
    try:
        return run_task(task, recipe, device)
    except Exception as e:  # noqa: BLE001 - reported per task; the other tasks still warm their kernels
        return TaskResult(task, 0.0, 0, error=f"{type(e).__name__}: {e}")


def prewarm(tasks: Sequence[GemmTask], recipe: Fp8Recipe, *, processes: int | None = None, device: str = "cuda",
            on_done: Callable[[TaskResult], None] | None = None) -> list[TaskResult]:
    """Run ``tasks`` in up to ``processes`` fresh (spawned) processes, largest first; ``on_done`` per finished task."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    if not tasks:
        return []
    workers = max(1, min(processes or os.cpu_count() or 1, len(tasks)))
    ordered = sorted(tasks, key=lambda t: -t.out_features * t.in_features)
    results = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_worker, t, recipe, device) for t in ordered]
        for fut in as_completed(futures):
            result = fut.result()
            results.append(result)
            if on_done is not None:
                on_done(result)
    return results
