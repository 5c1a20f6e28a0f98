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
from typing import Any

import torch

from jetrl_megatron.sampling import mask_filtered_out


def _spread(x: torch.Tensor, n: int) -> torch.Tensor:
    """Unbiased std of the last dim's n values, exactly 0 when they are all equal (or n < 2)."""
    if n < 2:
        return torch.zeros(x.shape[:-1], dtype=x.dtype)
    centred = x - x.mean(dim=-1, keepdim=True)
    std = (centred.square().sum(dim=-1) / (n - 1)).sqrt()
    tied = x.amax(dim=-1) == x.amin(dim=-1)
    return torch.where(tied, torch.zeros_like(std), std)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-response advantage from its prompt group's rewards (NeMo-RL v0.7.0's GRPO advantage estimator).

    ``rewards`` is (num_prompts * group_size,), grouped contiguously (all responses of prompt 0 first).

    * ``leave_one_out=False``: A_i = r_i - mean(group); with ``normalize`` divided by (s + eps), s = the unbiased
      (ddof 1) std of the whole group.
    * ``leave_one_out=True`` (RLOO): A_i = r_i - mean(others_i), others_i = the group without response i; with
      ``normalize`` divided by (s_i + eps), s_i = the unbiased std of those group_size - 1 *other* rewards (so it
      differs per response). group_size 2 leaves one other reward: s_i = 0.

    Where s (s_i) is 0, i.e. the rewards it is taken over are all equal, the advantage stays r - baseline
    undivided (NeMo-RL: "don't sharpen the ones with no variation"). NeMo-RL computes the variance in one pass
    (E[x^2] - E[x]^2), which can leave a rounding residue instead of an exact 0 for non-dyadic tied rewards; here
    ties give exactly 0. Example, one success in 8 with LOO + normalize: +1.0 (the 7 others are all 0) and
    -(1/7) / sqrt(1/7) = -0.378 for each failure.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards shape {tuple(rewards.shape)} is not (num_prompts * group_size={group_size},)")
    if group_size < 2:
        raise ValueError("group_size must be >= 2 for group-relative advantages")
    r = rewards.double().view(-1, group_size)
    if leave_one_out:
        # others[p, i, :] = the group_size - 1 rewards of prompt p other than response i
        others = torch.stack([torch.cat([r[:, :i], r[:, i + 1:]], dim=1) for i in range(group_size)], dim=1)
        baseline = others.mean(dim=-1)
        std = _spread(others, group_size - 1)
    else:
        baseline = r.mean(dim=1, keepdim=True).expand_as(r)
        std = _spread(r, group_size).unsqueeze(1).expand_as(r)
    adv = r - baseline
    if normalize:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return adv.reshape(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


KL_INPUT_CLAMP = 20.0  # NeMo-RL ClippedPGLossConfig.kl_input_clamp_value
KL_OUTPUT_CLAMP = 10.0  # NeMo-RL ClippedPGLossConfig.kl_output_clamp_value


def kl_penalty(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    kind: str = "k3",
    *,
    input_clamp: float | None = KL_INPUT_CLAMP,
    output_clamp: float | None = KL_OUTPUT_CLAMP,
    score_function: bool = True,
    logp_gen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) penalty as NeMo-RL v0.7.0 puts it in the loss (Schulman's estimators).

    With u = clamp(logp_ref - logp, -input_clamp, input_clamp):
    k1 = -u; k2 = u^2 / 2; k3 = exp(u) - 1 - u (>= 0). The estimate is multiplied by s = exp(logp - sg(logp))
    (``score_function``; value 1), so d/dlogp = k + dk/dlogp: the tokens were sampled from pi itself, and the
    score-function term E[k * grad logp] belongs to the gradient of E_pi[k]. Where the input clamp is active, s is
    detached (zero gradient there); the product is then clamped to [-output_clamp, output_clamp], so a token whose
    |k| exceeds output_clamp (10) contributes the cap and no gradient. ``logp_ref`` is treated as a constant.
    ``logp_gen`` (NeMo-RL's ``use_on_policy_kl_approximation``): s = exp(logp - logp_gen) instead, the importance
    weight from the sampler to the current policy, still carrying the score-function gradient.
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"unknown KL estimator {kind!r} (k1 | k2 | k3)")
    u = logp_ref.detach() - logp
    base = logp.detach() if logp_gen is None else logp_gen.detach().to(logp.dtype)
    s = torch.nan_to_num(torch.exp(logp - base), nan=0.0, posinf=0.0, neginf=0.0) if score_function \
        else torch.ones_like(logp)
    if input_clamp is not None:
        u_c = u.clamp(-input_clamp, input_clamp)
        s = torch.where(u_c == u, s, s.detach())
        u = u_c
    if kind == "k1":
        k = -u
    elif kind == "k2":
        k = 0.5 * u * u
    else:
        k = torch.exp(u) - 1.0 - u
    k = s * k
    if output_clamp is not None:
        k = k.clamp(-output_clamp, output_clamp)
    return k


def ratio_floor(kind: str | None, ratio_max: float | None, ratio_min: float | None) -> float:
    """The lower bound on pi_old / pi_rollout: ``ratio_min`` when set, else 0 for 'tis' (NeMo-RL's default) and
    for plain IS (``kind`` None: no truncation), 1 / ratio_max for the masking kinds (a project default; NeMo-RL
    requires ratio_min for them)."""
    if ratio_min is not None:
        return ratio_min
    if kind in (None, "tis"):
        return 0.0
    if ratio_max is None:
        raise ValueError(f"truncated_importance_sampling_type {kind!r} needs truncated_importance_sampling_ratio")
    return 1.0 / ratio_max


def sequence_ratio(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) geometric-mean importance ratio exp(mean_t log rho_t) of each sequence over its valid tokens; padding and
    non-finite log-ratios count as 0."""
    valid = mask > 0
    log_rho = torch.where(valid, torch.nan_to_num(log_rho, nan=0.0, posinf=0.0, neginf=0.0), 0.0)
    return torch.exp(log_rho.sum(dim=1) / mask.to(log_rho.dtype).sum(dim=1).clamp_min(1.0))


def importance_weights(
    logp_old: torch.Tensor,
    logp_gen: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str | None,
    ratio_max: float = 2.0,
    ratio_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout-correction weights w_t on pi_train_old / pi_rollout (no gradient), NeMo-RL v0.7.0's meaning.

    rho_t = exp(logp_old - logp_gen) (non-finite -> 0).
    kind None: w = rho.
    'tis' (truncated IS): w = clamp(rho, lo, ratio_max), lo = ratio_min or 0.
    'icepop' (token-masked IS): w = rho where lo <= rho <= ratio_max, else 0.
    'seq-mask-tis' (sequence-masked IS): w = rho (raw, not truncated) in sequences whose geometric-mean ratio
        exp(mean_t log rho_t) lies in [lo, ratio_max], else 0.
    lo for the masking kinds: ratio_min, or 1 / ratio_max when unset (see ``ratio_floor``).

    Dropped tokens stay in the loss with weight 0: the loss is still normalized by all valid response tokens
    (sequences), and their KL penalty still counts. Returns (weights, kept): weights with ``logp_old``'s dtype,
    0 on padding; kept (``mask``'s dtype) = the valid tokens the filter did not drop, for reporting only.
    """
    if kind not in (None, "tis", "icepop", "seq-mask-tis"):
        raise ValueError(f"unknown truncated_importance_sampling_type {kind!r} (tis | icepop | seq-mask-tis | None)")
    dtype = torch.promote_types(logp_old.dtype, torch.float32)
    m = mask.to(dtype)
    valid = m > 0
    diff = (logp_old.detach() - logp_gen.detach()).to(dtype)
    rho = torch.where(valid, torch.nan_to_num(torch.exp(diff), nan=0.0, posinf=0.0, neginf=0.0), 0.0)
    lo = ratio_floor(kind, ratio_max, ratio_min)
    keep = m
    if kind is None:
        w = rho
    elif kind == "tis":
        w = rho.clamp(lo, ratio_max)
    elif kind == "icepop":
        keep = m * ((rho >= lo) & (rho <= ratio_max)).to(dtype)
        w = rho
    else:
        seq_ratio = sequence_ratio(diff, m)
        keep = m * ((seq_ratio >= lo) & (seq_ratio <= ratio_max)).to(dtype).unsqueeze(1)
        w = rho
    return (w * keep).to(logp_old.dtype), keep.to(mask.dtype)


@dataclass
class PgLossOut:
    loss: torch.Tensor  # scalar, differentiable w.r.t. logp
    pg_loss: torch.Tensor  # detached parts, for logging
    kl: torch.Tensor
    clip_frac: torch.Tensor
    ratio_mean: torch.Tensor
    num_tokens: torch.Tensor
    # max |ratio - 1| over the valid tokens: 0 when the update's logprobs are the old ones bit for bit
    ratio_dev_max: torch.Tensor


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
    kl_input_clamp: float | None = KL_INPUT_CLAMP,
    kl_output_clamp: float | None = KL_OUTPUT_CLAMP,
    token_level: bool = True,
    normalizer: float | None = None,
    kl_logp_gen: torch.Tensor | None = None,
    kl_logp: torch.Tensor | None = None,
) -> PgLossOut:
    """PPO-clip surrogate + KL penalty, NeMo-RL v0.7.0's ClippedPGLossFn (the keys it shares with this project).

    ratio = exp(logp - logp_old); per token  L = max(-ratio * A, -clip(ratio, 1 - clip_low, 1 + clip_high) * A),
    with dual clip (clip_c > 1) capping L at -clip_c * A for negative advantages; times the detached
    importance weights (``importance_weights``; 0 on tokens a filter dropped, which still count in the
    normalizer); plus, not importance-weighted, kl_coef * ``kl_penalty(logp, logp_ref, kl_type)`` per token
    (score-function gradient, per-token KL capped at ``kl_output_clamp``; weighted by exp(logp - kl_logp_gen) when
    ``kl_logp_gen`` is given: NeMo-RL's on-policy KL approximation). ``kl_logp``: the current policy's logprobs the
    KL term uses instead of ``logp`` (NeMo-RL under top-k / top-p: the temperature-only ones, as the reference's).

    ``advantages`` is per sequence (B,) or per token (B, T); ``mask`` = every valid response token. Token-level
    aggregation divides the masked sum by ``normalizer`` when given (the *global* token count, so micro-batches add
    up to the global mean) else by the masked token count here. Sequence-level aggregation (NeMo-RL
    ``token_level_loss: false``) averages each sequence's tokens, then divides the sum over sequences by
    ``normalizer`` (global sequence count) or B. The PG and KL parts are aggregated the same way.
    """
    if logp.shape != logp_old.shape or logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, "
                         f"mask {tuple(mask.shape)}")
    m = mask.to(logp.dtype)
    adv = advantages.unsqueeze(1).expand_as(logp) if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)
    # (padding: ratio 1, so whatever the model returns there cannot turn the masked sums into nan)
    ratio = torch.exp(torch.where(m > 0, logp - logp_old.detach(), torch.zeros_like(logp)))
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
        kl_tok = kl_penalty(logp if kl_logp is None else kl_logp, logp_ref.detach(), kl_type,
                            input_clamp=kl_input_clamp, output_clamp=kl_output_clamp, logp_gen=kl_logp_gen)
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
            ratio_dev_max=torch.where(m > 0, (ratio - 1.0).abs(), torch.zeros_like(ratio)).amax().detach(),
        )


@dataclass(frozen=True)
class PolicyLoss:
    """GRPO's training objective of one run (``loss_fn``), as the micro-batch loss Megatron's schedule calls.

    Why an object: the settings of ``clipped_pg_loss`` and the normalization of a global batch are fixed for the
    whole run, so the trainer's update loop only slices tensors and hands this over (``for_batch``).
    """

    clip_low: float
    clip_high: float
    clip_c: float | None
    kl_coef: float
    kl_type: str
    kl_input_clamp: float | None
    kl_output_clamp: float | None
    token_level: bool
    force_on_policy_ratio: bool  # ratio = pi / stop_grad(pi) = 1, with pi's gradient (NeMo-RL)
    on_policy_kl: bool  # the KL term weighted by exp(logp - logp_gen) (``use_on_policy_kl_approximation``)
    overlong_filtering: bool  # sequence-level: truncated answers do not count in the normalizer
    filtered_sampling: bool  # the rollout samples under top-k / top-p: -inf logprobs of filtered tokens become 0

    @classmethod
    def from_config(cls, loss_fn: Any, *, overlong_filtering: bool, filtered_sampling: bool) -> PolicyLoss:
        """From the ``loss_fn`` section, ``grpo.overlong_filtering`` and whether the rollout's sampling filters."""
        return cls(clip_low=loss_fn.ratio_clip_min, clip_high=loss_fn.ratio_clip_max, clip_c=loss_fn.ratio_clip_c,
                   kl_coef=loss_fn.reference_policy_kl_penalty, kl_type=loss_fn.reference_policy_kl_type,
                   kl_input_clamp=loss_fn.kl_input_clamp_value, kl_output_clamp=loss_fn.kl_output_clamp_value,
                   token_level=loss_fn.token_level_loss, force_on_policy_ratio=loss_fn.force_on_policy_ratio,
                   on_policy_kl=loss_fn.use_on_policy_kl_approximation, overlong_filtering=overlong_filtering,
                   filtered_sampling=filtered_sampling)

    def uses_unfiltered_kl(self, has_reference: bool) -> bool:
        """NeMo-RL: under top-k / top-p the KL term uses the current policy's temperature-only logprobs, like the
        reference's (``kl_logp``)."""
        return self.filtered_sampling and has_reference and bool(self.kl_coef)

    def normalizer(self, keep: torch.Tensor, truncated: torch.Tensor, global_batch_size: int,
                   num_micro_batches: int, dp: int) -> float:
        """The divisor of one global batch's loss sum (``keep``, ``truncated``: that batch's rows), so the optimised
        objective is the sum over its response tokens (sequences) / their global count. Megatron's schedule divides
        each micro-batch loss by the number of micro-batches and DDP averages over DP: the divisor undoes both."""
        tokens = float(keep.sum().clamp_min(1.0))
        seqs = float((~truncated).sum().clamp_min(1)) if self.overlong_filtering else float(global_batch_size)
        return (tokens if self.token_level else seqs) / (num_micro_batches * dp)

    def for_batch(self, normalizer: float):
        """``loss_fn(logp, micro_batch) -> (loss, metrics)`` for Megatron's schedule, dividing by ``normalizer``."""
        return lambda lp, mb: self(lp, mb, normalizer)

    def __call__(self, lp: torch.Tensor, mb: dict[str, torch.Tensor],
                 normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch ``mb`` (``mask``, ``adv``, ``logp_old`` and, when used, ``is_w``,
        ``logp_ref``, ``logp_gen``, ``logp_unfiltered``) given the policy's logprobs ``lp``, and its logged parts."""
        if self.filtered_sampling:  # a sampled token outside the trainer's filter: -inf -> 0, as NeMo-RL
            lp, _ = mask_filtered_out(lp, mb["mask"])
        old = lp.detach() if self.force_on_policy_ratio else mb["logp_old"]
        out = clipped_pg_loss(
            lp, old, mb["adv"], mb["mask"], clip_low=self.clip_low, clip_high=self.clip_high, clip_c=self.clip_c,
            is_weights=mb.get("is_w"), logp_ref=mb.get("logp_ref"), kl_coef=self.kl_coef, kl_type=self.kl_type,
            kl_input_clamp=self.kl_input_clamp, kl_output_clamp=self.kl_output_clamp, token_level=self.token_level,
            normalizer=normalizer, kl_logp_gen=mb.get("logp_gen"), kl_logp=mb.get("logp_unfiltered"))
        return out.loss, {"pg_loss": out.pg_loss, "kl_ref": out.kl, "clip_frac": out.clip_frac,
                          "ratio_mean": out.ratio_mean, "ratio_dev_max": out.ratio_dev_max}


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Negative log-likelihood of the target tokens (the supervised warm-start), token-mean."""
    m = mask.to(logp.dtype)
    denom = normalizer if normalizer is not None else m.sum().clamp_min(1.0)
    return -(logp * m).sum() / denom
