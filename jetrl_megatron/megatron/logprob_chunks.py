"""Token logprobs computed a chunk of positions at a time (NeMo-RL's ``policy.logprob_chunk_size``).

Why: turning a micro-batch's BF16 logits into FP32 token logprobs, and the backward of that, holds FP32 copies of the
whole (rows x positions x vocabulary) logits at once: 14-16 B per (token, vocabulary entry), 9.3 GiB for one
4K-token Qwen3 sequence, as much as all the checkpointed layer inputs. In chunks of positions the forward keeps only a
reference to the logits and computes each chunk's logprobs under ``no_grad``; the backward recomputes one chunk at a
time with autograd and writes its gradient into one buffer of the logits' shape. The peak becomes the logits and
their gradient (2 + 2 B per entry in BF16) plus one chunk's FP32 work.

Same numbers, bit for bit, where the function handed in is row-local (a position's logprob and its gradient depend on
that position's logits alone, computed by kernels whose per-row work does not depend on how many rows they are given):
GPU vLLM's logprob kernels (one Triton program per row; the trainer's exact path on CUDA) and its temperature kernel,
torch's log-softmax and, on CPU, every path (``tests/test_megatron_logprob_chunks.py`` checks each against the whole
computation, the CUDA one on the GPU). Not on CUDA under a top-k / top-p filter or with ``vocab_parallel``: torch's
cumulative sum and row sums there pick their kernel by the number of rows, so a chunk's last bits may differ from the
whole's (as they already differ between micro-batch sizes); neither path is bit-exact against vLLM's sampler anyway.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

# fn(logits (b, c + 1, V), tokens (b, c + 1)) -> (b, c) FP32 logprobs of tokens[:, 1:] under logits[:, :-1]
ShiftedLogprobs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _ChunkedShiftedLogprobs(torch.autograd.Function):
    """Forward: ``fn`` on each chunk of positions, no autograd graph kept. Backward: each chunk recomputed with
    autograd, its gradient copied into one zero-initialized buffer shaped like the logits (the last position, whose
    logits no token is scored under, keeps gradient 0, as in the whole computation)."""

    @staticmethod
    def forward(ctx, logits, tokens, fn, chunk):
        out = _in_chunks(logits, tokens, fn, chunk)
        ctx.save_for_backward(logits, tokens)
        ctx.fn, ctx.chunk = fn, chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, tokens = ctx.saved_tensors
        grad = torch.zeros_like(logits, memory_format=torch.contiguous_format)
        for p0, p1 in _spans(tokens.shape[1] - 1, ctx.chunk):
            piece = logits[:, p0:p1 + 1].detach().requires_grad_(True)
            with torch.enable_grad():
                lp = ctx.fn(piece, tokens[:, p0:p1 + 1])
            (d,) = torch.autograd.grad(lp, piece, grad_out[:, p0:p1])
            grad[:, p0:p1] = d[:, :p1 - p0]
            del piece, lp, d
        return grad, None, None, None


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(p0, min(n, p0 + chunk)) for p0 in range(0, n, chunk)]


def _in_chunks(logits: torch.Tensor, tokens: torch.Tensor, fn: ShiftedLogprobs, chunk: int) -> torch.Tensor:
    """``fn`` on each chunk of positions without an autograd graph, into one (b, s-1) FP32 tensor."""
    out = torch.empty((tokens.shape[0], tokens.shape[1] - 1), dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for p0, p1 in _spans(tokens.shape[1] - 1, chunk):
            out[:, p0:p1] = fn(logits[:, p0:p1 + 1], tokens[:, p0:p1 + 1])
    return out


def chunked_shifted_logprobs(logits: torch.Tensor, tokens: torch.Tensor, fn: ShiftedLogprobs,
                             chunk: int | None) -> torch.Tensor:
    """``fn(logits, tokens)`` -- the (b, s-1) FP32 logprobs of ``tokens[:, 1:]`` under ``logits[:, :-1]`` (b, s, V)
    -- computed ``chunk`` positions at a time; None, or a chunk covering every position: ``fn`` on the whole, as
    before. ``fn`` must be row-local (module docstring). Without autograd (the logprob pass) nothing is recomputed."""
    if tokens.dim() != 2 or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(tokens.shape):
        raise ValueError(f"chunked logprobs: logits {tuple(logits.shape)} must be (b, s, V) over tokens "
                         f"{tuple(tokens.shape)} (b, s)")
    if chunk is not None and chunk < 1:
        raise ValueError(f"logprob_chunk_size must be a positive number of positions or null, got {chunk}")
    if chunk is None or chunk >= tokens.shape[1] - 1:
        return fn(logits, tokens)
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return _in_chunks(logits, tokens, fn, chunk)
    return _ChunkedShiftedLogprobs.apply(logits, tokens, fn, chunk)
