"""Training-inference mismatch metrics on response tokens (names compatible with verl / NeMo-RL).

With delta_t = logp_train - logp_rollout for every sampled response token (masked means over response tokens):

  mismatch/k3_kl                 mean(exp(delta) - delta - 1)          verl rollout_corr/k3_kl (KL(rollout || train))
  mismatch/kl                    mean(-delta)                           verl rollout_corr/kl (direct estimator)
  mismatch/token_mult_prob_error mean(exp(|delta|))                     NeMo-RL train/token_mult_prob_error (1 = exact)
                                 (in a run: NeMo-RL's value exactly, from ``nemo_rl_mismatch_metrics``)
  mismatch/abs_dp_mean|max       mean / max of |exp(logp_train) - exp(logp_rollout)|  verl rollout_probs_diff
  mismatch/is_oob_frac           fraction of tokens with exp(delta) outside [1/C, C], C = 2
  mismatch/chi2_token            mean(exp(delta)^2) - 1
  mismatch/max_abs_logp_diff     max |delta|
  mismatch/bit_identical_frac    fraction of tokens with delta exactly 0 (the trainer's logprob is the rollout's bits)

Each is also reported per response-position bin as ``mismatch/<name>/pos_<lo>_<hi>`` (token positions lo..hi-1
within the response), because Jet-RL's claim is length dependent; empty bins are left out.

NeMo-RL v0.7.0's own names and definitions (``nemo_rl_mismatch_metrics``; NeMo-RL logs them as ``train/<name>``),
with lp_train = the trainer's logprob before the update (``prev_logprobs``), lp_gen = the rollout's:

  mismatch/token_mult_prob_error  mean(exp(|lp_train - lp_gen|))
  mismatch/gen_kl_error           mean(KL_est(lp_gen || lp_train)), estimator = loss_fn.reference_policy_kl_type,
                                  u = lp_train - lp_gen: k1 -u, k2 u^2/2, k3 exp(u) - 1 - u (no clamps)
  mismatch/policy_kl_error        the same with the roles swapped (u = lp_gen - lp_train)
  mismatch/js_divergence_error    mean(JSD(p_train, p_gen)) on the sampled token, from k3 terms against the mixture
  mismatch/sampling_importance_ratio  mean of the rollout-correction weights (after tis / icepop / seq-mask-tis)
  mismatch/is_oob_ratio           (only with a truncated_importance_sampling_type) tis: share of tokens with
                                  rho > ratio or rho < ratio_min (ratio_min unset = 0: top side only); icepop: share
                                  of tokens outside [ratio_min, ratio]; seq-mask-tis: share of *sequences* whose
                                  geometric-mean rho is outside [ratio_min, ratio]; rho = exp(lp_train - lp_gen)

Each is a token (sequence) mean within one optimizer step's ``train_global_batch_size`` slice of the batch, then
averaged over the slices, as NeMo-RL aggregates its loss metrics.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from jetrl_megatron.rl.grpo import importance_weights, kl_penalty, ratio_floor, sequence_ratio

MISMATCH_KEYS = (
    "k3_kl",
    "kl",
    "token_mult_prob_error",
    "abs_dp_mean",
    "abs_dp_max",
    "is_oob_frac",
    "chi2_token",
    "max_abs_logp_diff",
    "bit_identical_frac",
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
        "token_mult_prob_error": float(torch.exp(delta.abs()).mean()),  # NeMo-RL's: no clamp
        "abs_dp_mean": float(dp.mean()),
        "abs_dp_max": float(dp.max()),
        "is_oob_frac": float(((rho < 1.0 / ratio_c) | (rho > ratio_c)).double().mean()),
        "chi2_token": float((rho * rho).mean() - 1.0),
        "max_abs_logp_diff": float(delta.abs().max()),
        "bit_identical_frac": float((lp_train == lp_roll).double().mean()),
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


NEMO_RL_MISMATCH_KEYS = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
                         "sampling_importance_ratio")  # + "is_oob_ratio" with a truncated_importance_sampling_type


def nemo_rl_mismatch_metrics(
    logp_train: torch.Tensor,
    logp_gen: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_type: str = "k3",
    tis_type: str | None = None,
    tis_ratio: float = 2.0,
    tis_ratio_min: float | None = None,
    global_batch_size: int | None = None,
    prefix: str = "mismatch/",
) -> dict[str, float]:
    """NeMo-RL v0.7.0's mismatch metrics (module docstring) on (B, T) rows in batch order. FP64 math.

    ``tis_type`` = the rollout correction in use (None when ``use_importance_sampling_correction`` is off);
    ``global_batch_size`` = rows per optimizer step (None: one slice)."""
    if logp_train.shape != logp_gen.shape or logp_train.shape != mask.shape:
        raise ValueError(f"shape mismatch: train {tuple(logp_train.shape)}, rollout {tuple(logp_gen.shape)}, "
                         f"mask {tuple(mask.shape)}")
    lt_all, lg_all, m_all = logp_train.detach().double(), logp_gen.detach().double(), mask.double()
    rows = lt_all.shape[0]
    if rows == 0 or not bool(m_all.any()):
        return {}
    step = global_batch_size or rows
    lo = ratio_floor(tis_type, tis_ratio, tis_ratio_min)
    per_slice: dict[str, list[float]] = defaultdict(list)
    for start in range(0, rows, step):
        lt, lg, m = lt_all[start:start + step], lg_all[start:start + step], m_all[start:start + step]

        def kl(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
            return kl_penalty(a, ref, kl_type, input_clamp=None, output_clamp=None, score_function=False)

        per_slice["token_mult_prob_error"].append(masked_mean(torch.exp((lt - lg).abs()), m))
        per_slice["gen_kl_error"].append(masked_mean(kl(lg, lt), m))
        per_slice["policy_kl_error"].append(masked_mean(kl(lt, lg), m))
        log_mix = torch.logaddexp(lt, lg) - torch.log(torch.tensor(2.0, dtype=lt.dtype))
        k3_to_mix = [torch.exp(a - log_mix) - (a - log_mix) - 1.0 for a in (lt, lg)]
        per_slice["js_divergence_error"].append(masked_mean(0.5 * k3_to_mix[0] + 0.5 * k3_to_mix[1], m))
        w, _ = importance_weights(lt, lg, m, kind=tis_type, ratio_max=tis_ratio, ratio_min=tis_ratio_min)
        per_slice["sampling_importance_ratio"].append(masked_mean(w, m))
        if tis_type is None:
            continue
        rho = torch.nan_to_num(torch.exp(lt - lg), nan=0.0, posinf=0.0, neginf=0.0)
        if tis_type in ("tis", "icepop"):
            per_slice["is_oob_ratio"].append(masked_mean(((rho > tis_ratio) | (rho < lo)).double(), m))
        else:  # seq-mask-tis: share of sequences
            geo = sequence_ratio(lt - lg, m)
            per_slice["is_oob_ratio"].append(float(((geo > tis_ratio) | (geo < lo)).double().mean()))
    return {prefix + k: sum(v) / len(v) for k, v in per_slice.items()}


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of x over mask > 0 (FP64); whatever x holds on masked-out positions (padding, even nan) is ignored."""
    m = mask.to(torch.float64)
    return float(torch.where(m > 0, x.double(), 0.0).sum() / m.sum().clamp_min(1.0))
