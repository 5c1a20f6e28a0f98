"""Training-inference mismatch metrics on response tokens (names compatible with verl / NeMo-RL).

With delta_t = logp_train - logp_rollout for every sampled response token (masked means over response tokens):

  mismatch/k3_kl                 mean(exp(delta) - delta - 1)          verl rollout_corr/k3_kl (KL(rollout || train))
  mismatch/kl                    mean(-delta)                           verl rollout_corr/kl (direct estimator)
  mismatch/token_mult_prob_error mean(exp(|delta|))                     NeMo-RL train/token_mult_prob_error (1 = exact)
  mismatch/abs_dp_mean|max       mean / max of |exp(logp_train) - exp(logp_rollout)|  verl rollout_probs_diff
  mismatch/is_oob_frac           fraction of tokens with exp(delta) outside [1/C, C], C = 2
  mismatch/chi2_token            mean(exp(delta)^2) - 1
  mismatch/max_abs_logp_diff     max |delta|

Each is also reported per response-position bin as ``mismatch/<name>/pos_<lo>_<hi>`` (token positions lo..hi-1
within the response), because Jet-RL's claim is length dependent; empty bins are left out.
"""

from __future__ import annotations

import torch

MISMATCH_KEYS = (
    "k3_kl",
    "kl",
    "token_mult_prob_error",
    "abs_dp_mean",
    "abs_dp_max",
    "is_oob_frac",
    "chi2_token",
    "max_abs_logp_diff",
)


def position_bins(max_len: int, num_bins: int = 4) -> list[tuple[int, int]]:
    """Equal-width response-position bins [lo, hi) covering 0..max_len (at least one position each)."""
    num_bins = max(1, min(num_bins, max_len))
    edges = [round(i * max_len / num_bins) for i in range(num_bins + 1)]
    return [(edges[i], edges[i + 1]) for i in range(num_bins) if edges[i + 1] > edges[i]]


def _stats(delta: torch.Tensor, lp_train: torch.Tensor, lp_roll: torch.Tensor, ratio_c: float) -> dict[str, float]:
    d = delta.clamp(-20.0, 20.0)
    rho = torch.exp(d)
    dp = (torch.exp(lp_train) - torch.exp(lp_roll)).abs()
    return {
        "k3_kl": float((rho - d - 1.0).mean()),
        "kl": float((-delta).mean()),
        "token_mult_prob_error": float(torch.exp(d.abs()).mean()),
        "abs_dp_mean": float(dp.mean()),
        "abs_dp_max": float(dp.max()),
        "is_oob_frac": float(((rho < 1.0 / ratio_c) | (rho > ratio_c)).double().mean()),
        "chi2_token": float((rho * rho).mean() - 1.0),
        "max_abs_logp_diff": float(delta.abs().max()),
    }


def mismatch_metrics(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    bins: list[tuple[int, int]] | None = None,
    ratio_c: float = 2.0,
    prefix: str = "mismatch/",
) -> dict[str, float]:
    """All mismatch metrics over masked response tokens (B, T), overall and per position bin. FP64 math."""
    if logp_train.shape != logp_rollout.shape or logp_train.shape != mask.shape:
        raise ValueError(f"shape mismatch: train {tuple(logp_train.shape)}, rollout {tuple(logp_rollout.shape)}, "
                         f"mask {tuple(mask.shape)}")
    lt, lr = logp_train.detach().double(), logp_rollout.detach().double()
    keep = mask.bool()
    if not keep.any():
        return {}
    out = {prefix + k: v for k, v in _stats((lt - lr)[keep], lt[keep], lr[keep], ratio_c).items()}
    pos = torch.arange(lt.shape[1]).unsqueeze(0).expand_as(lt)
    for lo, hi in bins or []:
        sel = keep & (pos >= lo) & (pos < hi)
        if sel.any():
            for k, v in _stats((lt - lr)[sel], lt[sel], lr[sel], ratio_c).items():
                out[f"{prefix}{k}/pos_{lo}_{hi}"] = v
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.to(torch.float64)
    return float((x.double() * m).sum() / m.sum().clamp_min(1.0))
