"""GRPO math: group advantages, the clipped policy-gradient loss, importance-sampling corrections, KL penalties.

All functions are pure torch on tensors shaped (num_sequences, num_response_tokens) with a float/bool ``mask`` of
the response tokens (1 = a sampled token that counts, 0 = padding), so they can be unit-tested by hand and called
unchanged inside Megatron's forward-backward schedule for any micro-batch.

Notation (as in NeMo-RL / verl): ``logp`` = log-prob of the sampled token under the policy being trained (with grad),
``logp_old`` = the trainer's log-prob of the same token before this step's update (``prev_logprobs``), ``logp_gen`` =
the rollout engine's log-prob (``generation_logprobs``), ``logp_ref`` = the reference policy's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-response advantage from its prompt group's rewards.

    ``rewards`` is (num_prompts * group_size,), grouped contiguously (all responses of prompt 0 first).
    Baseline = group mean, or with ``leave_one_out`` the mean of the *other* group_size - 1 rewards (unbiased
    REINFORCE-LOO). With ``normalize`` the centred reward is divided by (group std + eps), std being the unbiased
    std of the whole group; groups whose rewards are all equal (std 0) keep advantage r - baseline (= 0 for the mean
    baseline) instead of being divided by eps.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} is not (num_prompts * group_size={group_size},)")
    if group_size < 2:
        raise ValueError("group_size must be >= 2 for group-relative advantages")
    r = rewards.double().view(-1, group_size)
    total = r.sum(dim=1, keepdim=True)
    baseline = (total - r) / (group_size - 1) if leave_one_out else total / group_size
    adv = r - baseline
    if normalize:
        std = r.std(dim=1, keepdim=True, unbiased=True)
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return adv.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3), with the gradient of logp.

    k1 = logp - logp_ref; k2 = (logp - logp_ref)^2 / 2; k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1 (>= 0).
    """
    d = logp_ref - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        d = d.clamp(-20.0, 20.0)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {kind!r} (k1 | k2 | k3)")


def importance_weights(
    logp_old: torch.Tensor,
    logp_gen: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str | None,
    ratio_max: float = 2.0,
    ratio_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout-correction weights w_t = pi_train_old / pi_rollout (detached) and the mask of tokens that keep counting.

    kind None: plain IS weights rho_t = exp(logp_old - logp_gen).
    'tis' (truncated IS, Yao et al.): w = clamp(rho, ratio_min or 0, ratio_max).
    'icepop' (token-level masked IS): w = rho where ratio_min <= rho <= ratio_max, else the token is masked out.
    'seq-mask-tis' (sequence-level masked IS, Liu et al.): sequences whose geometric-mean ratio
        exp(mean_t log rho_t) lies outside [ratio_min, ratio_max] are masked out; kept tokens get
        w = min(rho, ratio_max).
    ratio_min defaults to 0 for 'tis' and 1 / ratio_max for the masking kinds.
    Returns (weights, mask) with the input mask's dtype; masked tokens have weight 0.
    """
    m = mask.to(torch.float32)
    log_rho = (logp_old - logp_gen).detach().float().clamp(-20.0, 20.0) * m
    rho = torch.exp(log_rho)
    lo = ratio_min if ratio_min is not None else (0.0 if kind == "tis" else 1.0 / ratio_max)
    if kind is None:
        w, keep = rho, m
    elif kind == "tis":
        w, keep = rho.clamp(lo, ratio_max), m
    elif kind == "icepop":
        keep = m * ((rho >= lo) & (rho <= ratio_max)).float()
        w = rho
    elif kind == "seq-mask-tis":
        n = m.sum(dim=1).clamp_min(1.0)
        seq_ratio = torch.exp(log_rho.sum(dim=1) / n)
        seq_keep = ((seq_ratio >= lo) & (seq_ratio <= ratio_max)).float().unsqueeze(1)
        keep = m * seq_keep
        w = rho.clamp(max=ratio_max)
    else:
        raise ValueError(f"unknown truncated_importance_sampling_type {kind!r} (tis | icepop | seq-mask-tis | None)")
    return (w * keep).to(logp_old.dtype), keep.to(mask.dtype)


@dataclass
class PgLossOut:
    loss: torch.Tensor  # scalar, differentiable w.r.t. logp
    pg_loss: torch.Tensor  # detached parts, for logging
    kl: torch.Tensor
    clip_frac: torch.Tensor
    ratio_mean: torch.Tensor
    num_tokens: torch.Tensor


def clipped_pg_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    is_weights: torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
    token_level: bool = True,
    normalizer: float | None = None,
) -> PgLossOut:
    """PPO-clip surrogate, token level (DAPO-style aggregation) or sequence-mean then batch-mean.

    ratio = exp(logp - logp_old); per token  L = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A),
    with dual clip (clip_c > 1) capping L at -clip_c * A for negative advantages; times the detached
    importance weights; plus kl_coef * KL(pi || pi_ref) (estimator ``kl_type``) per token.

    ``advantages`` is per sequence (B,) or per token (B, T). Token-level aggregation divides the masked sum by
    ``normalizer`` when given (the *global* token count, so micro-batches add up to the global mean) else by the
    masked token count here. Sequence-level aggregation averages each sequence's tokens, then divides the sum over
    sequences by ``normalizer`` (global sequence count) or B.
    """
    if logp.shape != logp_old.shape or logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, "
                         f"mask {tuple(mask.shape)}")
    m = mask.to(logp.dtype)
    adv = advantages.unsqueeze(1).expand_as(logp) if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)
    log_ratio = (logp - logp_old.detach()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    tok = -torch.minimum(surr1, surr2)
    if clip_c is not None:
        tok = torch.where(adv < 0, torch.minimum(tok, -clip_c * adv), tok)
    clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    if is_weights is not None:
        tok = tok * is_weights.detach().to(logp.dtype)
    kl_tok = torch.zeros_like(tok)
    if kl_coef and logp_ref is not None:
        kl_tok = kl_penalty(logp, logp_ref.detach(), kl_type)
        tok = tok + kl_coef * kl_tok

    def agg(x: torch.Tensor) -> torch.Tensor:
        if token_level:
            denom = normalizer if normalizer is not None else m.sum().clamp_min(1.0)
            return (x * m).sum() / denom
        per_seq = (x * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
        denom = normalizer if normalizer is not None else float(x.shape[0])
        return per_seq.sum() / denom

    loss = agg(tok)
    with torch.no_grad():
        n = m.sum().clamp_min(1.0)
        pg_only = -torch.minimum(surr1, surr2)
        return PgLossOut(
            loss=loss,
            pg_loss=agg(pg_only).detach(),
            kl=((kl_tok * m).sum() / n).detach(),
            clip_frac=((clipped.to(m.dtype) * m).sum() / n).detach(),
            ratio_mean=((ratio * m).sum() / n).detach(),
            num_tokens=m.sum().detach(),
        )


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Negative log-likelihood of the target tokens (the supervised warm-start), token-mean."""
    m = mask.to(logp.dtype)
    denom = normalizer if normalizer is not None else m.sum().clamp_min(1.0)
    return -(logp * m).sum() / denom
