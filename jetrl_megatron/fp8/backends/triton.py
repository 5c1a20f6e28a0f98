"""Triton blockwise FP8 GEMM backend: the portable fallback (any GPU with FP8 tensor cores) and the batch-invariant one.

`batch_invariant=True` (the dispatch passes it when recipe.batch_invariant) uses one fixed tile config, no split-K and
a fixed K order, so a row's output is bitwise the same for any M. The default fastest mode picks a config per M: for
small M (decode) it swaps operands so the weight fills the 128-row MMA side and splits K across the SMs
(deterministic fixed-order split reduction); for large M it uses the tile config measured fastest on the H200.
"""

from __future__ import annotations

import torch

from jetrl_megatron.fp8.backends._layout import contiguous_codes, derived
from jetrl_megatron.fp8.backends.triton_gemm import BATCH_INVARIANT_CONFIGS, BLOCK_K, GemmConfig, blockwise_fp8_gemm
from jetrl_megatron.fp8.kernels import transpose_fp8

# Fastest-mode tile configs per GEMM form for M > SWAP_AB_MAX_M (H200 sweep at M=8192, bench/kernels_bench.py,
# geometric mean over 8B.gate_up, 8B.o, 32B.down): the software-pipelined promotion wins for the 128x128-weight forms
# (869/881 TFLOP/s vs 707 without); WGrad (two 1x128 operands, an outer-product scale) loses with it (599 vs 344).
TUNED: dict[str, GemmConfig] = {
    "fprop": GemmConfig(block_m=64, block_n=128, group_m=16, num_warps=4, num_stages=3, pipe=True),
    "dgrad": GemmConfig(block_m=64, block_n=128, group_m=16, num_warps=4, num_stages=3, pipe=True),
    "wgrad": GemmConfig(block_m=64, block_n=128, group_m=8, num_warps=4, num_stages=4),
}
SWAP_AB_MAX_M = 64
_NUM_SMS: int | None = None


def available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _num_sms(device: torch.device) -> int:
    global _NUM_SMS
    if _NUM_SMS is None:
        _NUM_SMS = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    return _NUM_SMS


def small_m_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Swap-AB config: 128 weight rows x a token tile of 16..64, K split until the grid covers the SMs."""
    token_tile = 16 if m <= 16 else (32 if m <= 32 else 64)
    tiles = -(-n // 128)
    k_tiles = k // BLOCK_K
    split = 1
    while tiles * split < _num_sms(device) and split * 2 <= max(1, k_tiles // 4):
        split *= 2
    return GemmConfig(block_m=128, block_n=token_tile, group_m=1, num_warps=4, num_stages=4, split_k=split)


def _run(form: str, a, sa, b, sb, a_rows: int, b_rows: int, bias, out_dtype, batch_invariant: bool,
         config: GemmConfig | None, tokens_on_a: bool):
    """tokens_on_a: A holds the token rows (FProp/DGrad); small-M fastest mode then swaps A and B."""
    m = a.shape[0]
    if batch_invariant:
        return blockwise_fp8_gemm(a, sa, b, sb, a_scale_rows=a_rows, b_scale_rows=b_rows,
                                  config=BATCH_INVARIANT_CONFIGS[form], bias=bias, out_dtype=out_dtype)
    if config is None and tokens_on_a and m <= SWAP_AB_MAX_M:
        cfg = small_m_config(m, b.shape[0], a.shape[1], a.device)
        return blockwise_fp8_gemm(b, sb, a, sa, a_scale_rows=b_rows, b_scale_rows=a_rows, config=cfg, bias=bias,
                                  out_dtype=out_dtype, transpose_out=True)
    cfg = config or TUNED[form]
    return blockwise_fp8_gemm(a, sa, b, sb, a_scale_rows=a_rows, b_scale_rows=b_rows, config=cfg, bias=bias,
                              out_dtype=out_dtype)


def fprop(xq, xs, wq, ws, *, bias=None, out_dtype=torch.bfloat16, batch_invariant: bool = False,
          config: GemmConfig | None = None):
    """Y (M,N) = Xq (M,K) . Wq (N,K)^T; xs 1x128 (any strides), ws 128x128."""
    return _run("fprop", contiguous_codes(xq), xs, contiguous_codes(wq), ws, 1, 128, bias, out_dtype,
                batch_invariant, config, True)


def dgrad(gq, gs, wq, ws, *, out_dtype=torch.bfloat16, batch_invariant: bool = False,
          config: GemmConfig | None = None):
    """dX (M,K) = Gq (M,N) . Wq (N,K), reading the cached K-major copy Wq^T (K,N) and the transposed block scales."""
    wt = derived(wq, "kmajor_t", transpose_fp8)
    return _run("dgrad", contiguous_codes(gq), gs, wt, ws.t(), 1, 128, None, out_dtype, batch_invariant, config, True)


def wgrad(gtq, gts, xtq, xts, *, out_dtype=torch.bfloat16, batch_invariant: bool = False,
          config: GemmConfig | None = None):
    """dW (N,K) = GTq (N,Mp) . XTq (K,Mp)^T, both 1x128 along tokens."""
    return _run("wgrad", contiguous_codes(gtq), gts, contiguous_codes(xtq), xts, 1, 1, None, out_dtype,
                batch_invariant, config, False)
