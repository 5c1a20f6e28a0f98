"""One step's rollout as padded tensors, and the pure functions on it: padding, alignment by response position,
advantages (reward scaling, group baseline, clipping) and the loss mask (overlong filtering).

Why separate: these are the numbers the loss sees; they are unit-tested without Megatron or vLLM."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from jetrl_megatron.rl import grpo
from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.metrics import masked_mean, mismatch_metrics, nemo_rl_mismatch_metrics


def padded_length(n: int, divisible_by: int, micro_batch: int, token_multiple: int) -> int:
    """Smallest length >= n that is a multiple of ``divisible_by`` and makes micro_batch * length a multiple of
    ``token_multiple`` (the FP8 GEMMs' token grouping)."""
    need = token_multiple // math.gcd(token_multiple, micro_batch)
    step = divisible_by * need // math.gcd(divisible_by, need)
    return -(-n // step) * step


@dataclass
class RolloutBatch:
    """All samples of one step on every rank, as padded tensors aligned with the trainer's logprobs.

    tokens (B, S): prompt + response, right-padded; mask / gen_logprobs (B, S-1): position t scores tokens[:, t+1],
    mask 1 on response tokens only; rewards / correct (B,); response_len (B,); truncated (B,): the response used
    all of ``max_new_tokens`` without ending in the end-of-sequence token; lengths (B,): each row's real length,
    handed to the trainer's attention so that each sequence is seen alone, as the rollout engine's prefill sees it.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    gen_logprobs: torch.Tensor
    rewards: torch.Tensor
    correct: torch.Tensor
    response_len: torch.Tensor
    texts: list[str]
    truncated: torch.Tensor
    lengths: torch.Tensor | None = None  # (B,) prompt + response length of each row (None: every row is S long)

    @property
    def prompt_lengths(self) -> torch.Tensor | None:
        """(B,) each row's prompt length: where vLLM's decode steps begin (None without ``lengths``)."""
        return None if self.lengths is None else self.lengths - self.response_len


def stop_ids(cfg: RunConfig, task) -> list[int] | None:
    """Token ids that end an answer: the tokenizer's end of sequence (unless ``policy.generation.ignore_eos``) and
    ``policy.generation.stop_token_ids``."""
    eos = None if cfg.policy.generation.ignore_eos else getattr(task.tokenizer, "eos_token_id", None)
    ids = ([eos] if eos is not None else []) + list(cfg.policy.generation.stop_token_ids or [])
    return ids or None


def make_batch(cfg: RunConfig, task, prompts, samples) -> RolloutBatch:
    pad = getattr(task.tokenizer, "pad_token_id", None) or 0
    rows, rewards, correct, texts = [], [], [], []
    for pi, _, toks, lps in samples:
        p = prompts[pi]
        text = task.tokenizer.decode(toks)
        r, ok = task.reward(p, text)
        rows.append((list(p.token_ids), toks, lps))
        rewards.append(r)
        correct.append(float(ok))
        texts.append(text)
    longest = max(len(a) + len(b) for a, b, _ in rows)
    s = padded_length(longest, cfg.policy.make_sequence_length_divisible_by, cfg.policy.train_micro_batch_size,
                      cfg.fp8_token_multiple())
    if s > cfg.policy.max_total_sequence_length and longest <= cfg.policy.max_total_sequence_length:
        s = longest  # padding for the FP8 token multiple never exceeds the configured maximum length
    b = len(rows)
    tokens = torch.full((b, s), pad, dtype=torch.long)
    mask = torch.zeros(b, s - 1)
    gen = torch.zeros(b, s - 1)
    rlen = torch.zeros(b, dtype=torch.long)
    for i, (pt, rt, lps) in enumerate(rows):
        tokens[i, :len(pt)] = torch.tensor(pt)
        if rt:
            tokens[i, len(pt):len(pt) + len(rt)] = torch.tensor(rt)
            mask[i, len(pt) - 1:len(pt) - 1 + len(rt)] = 1.0
            gen[i, len(pt) - 1:len(pt) - 1 + len(rt)] = torch.tensor(lps, dtype=torch.float32)
        rlen[i] = len(rt)
    stops = set(stop_ids(cfg, task) or ())
    truncated = torch.tensor([len(rt) >= cfg.policy.generation.max_new_tokens and (not rt or rt[-1] not in stops)
                              for _, rt, _ in rows])
    lengths = torch.tensor([len(pt) + len(rt) for pt, rt, _ in rows])
    return RolloutBatch(tokens, mask, gen, torch.tensor(rewards), torch.tensor(correct), rlen, texts, truncated,
                        lengths)


def response_positions(batch: RolloutBatch) -> torch.Tensor:
    """(B, S-1) index of each logprob slot within its response (0 = first response token; -1 outside)."""
    first = batch.mask.argmax(dim=1, keepdim=True)
    pos = torch.arange(batch.mask.shape[1]).unsqueeze(0) - first
    return torch.where(batch.mask.bool(), pos, torch.full_like(pos, -1))


def align_by_position(x: torch.Tensor, batch: RolloutBatch, max_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-index (B, S-1) response values by response position -> (B, max_new) + mask, for position-binned metrics."""
    pos = response_positions(batch)
    out = torch.zeros(x.shape[0], max_new, dtype=x.dtype)
    m = torch.zeros(x.shape[0], max_new)
    sel = pos >= 0
    rows = torch.arange(x.shape[0]).unsqueeze(1).expand_as(pos)[sel]
    out[rows, pos[sel]] = x[sel]
    m[rows, pos[sel]] = 1.0
    return out, m


def scale_rewards(rewards: torch.Tensor, rs) -> torch.Tensor:
    """``grpo.reward_scaling`` (NeMo-RL): clamp to [source_min, source_max], map linearly onto [target_min,
    target_max]. Applied to what the advantages see; logged rewards stay the task's own."""
    if not rs.enabled:
        return rewards
    unit = (rewards.clamp(rs.source_min, rs.source_max) - rs.source_min) / (rs.source_max - rs.source_min)
    return rs.target_min + unit * (rs.target_max - rs.target_min)


def advantages(cfg: RunConfig, rewards: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's order: reward scaling, group-relative advantages, then ``grpo.advantage_clip_low/high``."""
    g = cfg.grpo
    adv = grpo.group_advantages(scale_rewards(rewards, g.reward_scaling), g.num_generations_per_prompt,
                                normalize=g.normalize_rewards, leave_one_out=g.use_leave_one_out_baseline)
    if g.advantage_clip_low is not None or g.advantage_clip_high is not None:
        adv = adv.clamp(g.advantage_clip_low, g.advantage_clip_high)
    return adv


def loss_mask(cfg: RunConfig, batch: RolloutBatch) -> torch.Tensor:
    """The tokens the loss sees. ``grpo.overlong_filtering`` (NeMo-RL): a truncated answer keeps its place in the
    advantages but leaves the loss and its token (or sequence) count."""
    if not cfg.grpo.overlong_filtering:
        return batch.mask
    return batch.mask * (~batch.truncated).to(batch.mask.dtype)[:, None]


def importance(cfg: RunConfig, batch: RolloutBatch, logp_old: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(importance weights or None, kept tokens) of the rollout correction, when ``loss_fn`` asks for one. Tokens a
    filter drops keep weight 0 but stay in the loss (normalizer, KL), as in NeMo-RL; ``kept`` is for logging."""
    lf = cfg.loss_fn
    if not lf.use_importance_sampling_correction:
        return None, batch.mask
    return grpo.importance_weights(logp_old, batch.gen_logprobs, batch.mask, kind=lf.truncated_importance_sampling_type,
                                   ratio_max=lf.truncated_importance_sampling_ratio,
                                   ratio_min=lf.truncated_importance_sampling_ratio_min)


def mismatch(cfg: RunConfig, batch: RolloutBatch, logp_old: torch.Tensor, bins) -> dict[str, float]:
    """Trainer vs rollout on response tokens: this project's metrics overall and by response position, and
    NeMo-RL's (its definitions and per-optimizer-step aggregation)."""
    lf, n = cfg.loss_fn, cfg.policy.generation.max_new_tokens
    lt, m_pos = align_by_position(logp_old, batch, n)
    lr, _ = align_by_position(batch.gen_logprobs, batch, n)
    # is_oob_frac's bound: the TIS ratio, 2 when the recipe sets none
    out = mismatch_metrics(lt, lr, m_pos, bins=bins, ratio_c=lf.truncated_importance_sampling_ratio or 2.0)
    out.update(nemo_rl_mismatch_metrics(
        logp_old, batch.gen_logprobs, batch.mask, kl_type=lf.reference_policy_kl_type,
        tis_type=lf.truncated_importance_sampling_type if lf.use_importance_sampling_correction else None,
        tis_ratio=lf.truncated_importance_sampling_ratio, tis_ratio_min=lf.truncated_importance_sampling_ratio_min,
        global_batch_size=cfg.policy.train_global_batch_size))
    return out


def batch_metrics(batch: RolloutBatch, kept: torch.Tensor) -> dict[str, float]:
    """Rewards and the shape of the answers of one step."""
    return {
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()),
        "reward/accuracy": float(batch.correct.mean()),
        "policy/approx_entropy": masked_mean(-batch.gen_logprobs, batch.mask),
        "policy/response_len": float(batch.response_len.float().mean()),
        "policy/truncated_frac": float(batch.truncated.float().mean()),
        "policy/is_kept_frac": float(kept.sum() / batch.mask.sum().clamp_min(1)),
    }
