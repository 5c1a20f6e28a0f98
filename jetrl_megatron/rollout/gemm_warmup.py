"""Warm the plugin's FP8 GEMMs up front, so JIT-compiling backends (DeepGEMM) do not stall the first rollouts.

Why: DeepGEMM compiles a kernel the first time a (N, K) shape meets a new tile configuration, and the configuration
depends on M (the number of tokens in the batch). Stock vLLM warms its own block-FP8 layers at start; the plugin's
layers are ours, so nobody else does it. Measured on the H200 (bench/RESULTS.md, GRPO run 2): an arm that met
DeepGEMM cold spent 27, 19 and 9 s in rollouts that take 0.2 s warm. Compiled kernels persist in DG_JIT_CACHE_DIR,
so a second run on the same machine finds them there. It is opt-in (`policy.generation.vllm_cfg.fp8_gemm_warmup:
true`, JETRL_FP8_GEMM_WARMUP=1, RolloutConfig.fp8_gemm_warmup): on a cold cache it compiles every configuration the
M list can reach, more than a run meets on demand (H200, Qwen3-1.7B body: 1,456 calls in 4.6 min against ~1 min of
on-demand stalls), so it pays off for benchmarks and with a warm, shared cache.

The M values: every M up to 64 (decode batches), then every 16 up to 1024, every 64 up to the engine's token budget,
and the budget itself. Tile boundaries between those points can still meet a cold configuration later; that costs one
compile, never correctness.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch


def warmup_m_values(max_tokens: int) -> list[int]:
    """Batch sizes (rows M) to run each FP8 linear shape at, ascending, all <= max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"warmup_m_values: max_tokens must be >= 1, got {max_tokens}")
    ms = set(range(1, min(64, max_tokens) + 1))
    ms.update(range(64, min(1024, max_tokens) + 1, 16))
    ms.update(range(1024, max_tokens + 1, 64))
    ms.add(max_tokens)
    return sorted(ms)


def fp8_linear_layers(model: torch.nn.Module) -> dict[tuple[int, int], torch.nn.Module]:
    """One plugin-served linear per distinct (N, K) weight shape (their GEMMs compile per shape)."""
    from jetrl_megatron.rollout.quant_method import JetRLFp8LinearMethod

    layers: dict[tuple[int, int], torch.nn.Module] = {}
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), JetRLFp8LinearMethod):
            layers.setdefault(tuple(module.weight.shape), module)
    return layers


@torch.no_grad()
def warm_up_fp8_linears(model: torch.nn.Module, m_values: Iterable[int]) -> dict[str, float]:
    """Run every distinct plugin linear once at each M on random BF16 rows; returns counts and seconds.

    On a machine whose DeepGEMM cache is cold this takes minutes (one NVCC compile per new tile configuration), hence
    the progress bar; with the cache warm it takes seconds."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    layers = fp8_linear_layers(model)
    calls = 0
    ms = list(m_values)
    bar = tqdm(total=len(layers) * len(ms), desc="FP8 GEMM warm-up", unit="gemm", mininterval=5.0,
               disable=not layers, leave=False)
    for (_, k), layer in layers.items():
        x = torch.randn(max(ms), k, dtype=torch.bfloat16, device=layer.weight.device)
        for m in ms:
            layer.quant_method.apply(layer, x[:m])
            calls += 1
            bar.update(1)
    bar.close()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {"shapes": float(len(layers)), "calls": float(calls), "seconds": time.perf_counter() - t0}
