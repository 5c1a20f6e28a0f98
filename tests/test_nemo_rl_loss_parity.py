"""The GRPO loss, advantages and mismatch metrics mean what NeMo-RL v0.7.0's mean for the same config keys.

The references below are written in this file from NeMo-RL's formulas (nemo_rl/algorithms/loss/loss_functions.py,
ClippedPGLossFn; nemo_rl/algorithms/utils.py, calculate_kl / masked_mean / calculate_baseline_and_std_per_prompt;
nemo_rl/algorithms/advantage_estimator.py, GRPOAdvantageEstimator), in plain torch and independent of
jetrl_megatron/rl/grpo.py. The project's loss value and its gradient w.r.t. the current logprobs must match them
to 1e-7 in float64 on random padded batches. Where this project used to mean something else, the old formula is
written here too and the test asserts it differs from the reference on the same data (so the test can fail).
"""

import math

import pytest
import torch

from jetrl_megatron.rl.grpo import clipped_pg_loss, group_advantages, importance_weights
from jetrl_megatron.rl.metrics import mismatch_metrics, nemo_rl_mismatch_metrics

TOL = dict(rtol=1e-7, atol=1e-7)
D = torch.float64


# ------------------------------------------------------------------------------------------------ references


def nm_mean(values, mask, dim=None, norm=None):
    """NeMo-RL's masked_mean: sum(values * mask) / (normaliser + 1e-8), normaliser = sum(mask) or a global count."""
    denom = mask.sum(dim=dim) if norm is None else norm
    return (values * mask).sum(dim=dim) / (denom + 1e-8)


def nm_kl(lp, lp_ref, kind, in_clamp=20.0, out_clamp=10.0, weights=None):
    """NeMo-RL's calculate_kl: estimator on log(pi_ref/pi) (input clamp), times optional weights (detached where
    the input clamp is active), then the output clamp."""
    logr = lp_ref - lp
    if in_clamp is not None:
        clamped = torch.clamp(logr, min=-in_clamp, max=in_clamp)
        if weights is not None:
            weights = torch.where(logr == clamped, weights, weights.detach())
        logr = clamped
    if kind == "k1":
        est = -logr
    elif kind == "k2":
        est = logr.pow(2) / 2
    else:
        est = logr.exp() - 1 - logr
    if weights is not None:
        est = weights * est
    if out_clamp is not None:
        est = torch.clamp(est, min=-out_clamp, max=out_clamp)
    return est


def nm_is_weights(prev, gen, mask, tis_type, tis_max, tis_min):
    """NeMo-RL's token-level actor importance weights with the truncation of ``tis_type``."""
    w = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    if tis_type == "tis":
        w = torch.clamp(w, min=0.0 if tis_min is None else tis_min, max=tis_max)
    elif tis_type == "icepop":
        w = torch.where((w >= tis_min) & (w <= tis_max), w, torch.zeros_like(w))
    elif tis_type == "seq-mask-tis":
        geo = torch.exp(nm_mean(torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0), mask, dim=-1))
        w = w * ((geo >= tis_min) & (geo <= tis_max)).to(w.dtype).unsqueeze(-1)
    return w


def nm_loss(lp, prev, gen, lp_ref, adv, mask, *, clip_min=0.2, clip_max=0.2, clip_c=None, kl_coef=0.0,
            kl_type="k3", is_correction=False, tis_type=None, tis_max=None, tis_min=None, token_level=True,
            on_policy_kl=False):
    """NeMo-RL's ClippedPGLossFn for one global batch (sample_mask all 1), the keys this project shares."""
    n_tok, n_seq = mask.sum(), float(mask.shape[0])
    ones = torch.ones(mask.shape[0], dtype=mask.dtype)

    def reduce(x):
        if token_level:
            return nm_mean(x, mask, norm=n_tok)
        return nm_mean(nm_mean(x, mask, dim=-1), ones, norm=n_seq)

    kl = torch.zeros((), dtype=lp.dtype)
    if kl_coef:
        base = gen if on_policy_kl else lp.detach()  # use_on_policy_kl_approximation: exp(curr - generation)
        score = torch.nan_to_num(torch.exp(lp - base), nan=0.0, posinf=0.0, neginf=0.0)
        kl = reduce(kl_coef * nm_kl(lp, lp_ref, kl_type, weights=score))
    r = torch.exp(lp - prev)
    rc = r.clamp(1 - clip_min, 1 + clip_max)
    per_tok = torch.max(-adv * r, -adv * rc)
    if clip_c is not None:
        per_tok = torch.where(adv < 0, torch.min(per_tok, -adv * clip_c), per_tok)
    w = nm_is_weights(prev, gen, mask, tis_type, tis_max, tis_min) if is_correction else torch.ones_like(prev)
    return reduce(w * per_tok) + kl


def nm_baseline_std(rewards, group_size, leave_one_out):
    """NeMo-RL's calculate_baseline_and_std_per_prompt (all samples valid), one prompt group after another:
    (1 - I) or all-ones matrix times rewards / n, std = sqrt((E[r^2] - E[r]^2) * n / (n - 1)), nan -> 0."""
    baseline, std = [], []
    for grp in rewards.view(-1, group_size):
        mat = (torch.ones(group_size, group_size, dtype=D) - (torch.eye(group_size, dtype=D) if leave_one_out else 0))
        n = group_size - int(leave_one_out)
        b = mat @ grp / n
        sq = mat @ grp.pow(2) / n
        with torch.no_grad():
            s = ((sq - b.square()) * (torch.tensor(float(n), dtype=D) / (n - 1))).sqrt().nan_to_num(0)
        baseline.append(b)
        std.append(s)
    return torch.cat(baseline), torch.cat(std)


def nm_advantages(rewards, group_size, normalize, leave_one_out):
    """NeMo-RL's GRPOAdvantageEstimator: r - baseline, divided by (std + 1e-6) only where std > 0."""
    b, s = nm_baseline_std(rewards, group_size, leave_one_out)
    adv = rewards - b
    if normalize:
        adv = torch.where(s > 0, adv / (s + 1e-6), adv)
    return adv


# ------------------------------------------------------------------------------------------------ data


def make_batch(seed, b=7, t=9, *, kl_far=False, zero_len_row=False):
    """Random float64 batch: ragged response masks, garbage in the padding, ratios across the clip range, IS
    ratios across the truncation bounds, per-token advantages of both signs; ``kl_far`` puts some tokens far from
    the reference (|log pi_ref/pi| up to 26: KL clamp region, incl. beyond the input clamp of 20)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    if zero_len_row:
        lengths[-1] = 0
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(D)
    lp = -torch.rand(b, t, generator=g, dtype=D) * 4 - 0.05
    prev = lp + torch.randn(b, t, generator=g, dtype=D) * 0.35
    prev = torch.where(torch.rand(b, t, generator=g) < 0.2, lp - 1.3 + torch.randn(b, t, generator=g, dtype=D) * 0.2,
                       prev)  # some ratios beyond the dual-clip constant
    gen = prev + torch.randn(b, t, generator=g, dtype=D) * 0.6
    ref = lp + torch.randn(b, t, generator=g, dtype=D) * 0.8
    if kl_far:
        far = torch.rand(b, t, generator=g) < 0.3
        sign = torch.where(torch.rand(b, t, generator=g) < 0.5, -1.0, 1.0).to(D)
        ref = torch.where(far, lp + sign * (4 + torch.rand(b, t, generator=g, dtype=D) * 22), ref)
    adv = torch.randn(b, t, generator=g, dtype=D) * 1.5
    pad = mask == 0
    garbage = torch.randn(b, t, generator=g, dtype=D) * 30
    lp, prev, gen, ref, adv = (torch.where(pad, garbage, x) for x in (lp, prev, gen, ref, adv))
    return lp, prev, gen, ref, adv, mask


def project_loss_and_grad(lp, prev, gen, ref, adv, mask, *, clip_min=0.2, clip_max=0.2, clip_c=None, kl_coef=0.0,
                          kl_type="k3", is_correction=False, tis_type=None, tis_max=2.0, tis_min=None,
                          token_level=True, micro_batches=1, on_policy_kl=False):
    """The project's pipeline as rl/loop.py runs it: importance_weights on (prev, gen), then clipped_pg_loss per
    micro-batch over the full response mask with the global normaliser, summed."""
    x = lp.detach().clone().requires_grad_(True)
    is_w = None
    if is_correction:
        is_w, _ = importance_weights(prev, gen, mask, kind=tis_type, ratio_max=tis_max, ratio_min=tis_min)
    norm = float(mask.sum()) if token_level else float(mask.shape[0])
    total = 0.0
    for rows in torch.arange(lp.shape[0]).chunk(micro_batches):
        out = clipped_pg_loss(x[rows], prev[rows], adv[rows], mask[rows], clip_low=clip_min, clip_high=clip_max,
                              clip_c=clip_c, is_weights=None if is_w is None else is_w[rows], logp_ref=ref[rows],
                              kl_coef=kl_coef, kl_type=kl_type, token_level=token_level, normalizer=norm,
                              kl_logp_gen=gen[rows] if on_policy_kl else None)
        total = total + out.loss
    total.backward()
    return total.detach(), x.grad


def reference_loss_and_grad(lp, prev, gen, ref, adv, mask, **kw):
    x = lp.detach().clone().requires_grad_(True)
    loss = nm_loss(x, prev, gen, ref, adv, mask, **kw)
    loss.backward()
    return loss.detach(), x.grad


def assert_parity(data, **kw):
    p_loss, p_grad = project_loss_and_grad(*data, **kw)
    r_loss, r_grad = reference_loss_and_grad(*data, **{k: v for k, v in kw.items() if k != "micro_batches"})
    torch.testing.assert_close(p_loss, r_loss, **TOL)
    torch.testing.assert_close(p_grad, r_grad, **TOL)
    return r_loss, r_grad


# ------------------------------------------------------------------------------------------------ PG loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("clip", [dict(clip_min=0.2, clip_max=0.2), dict(clip_min=0.2, clip_max=0.28),
                                  dict(clip_min=0.1, clip_max=0.3, clip_c=3.0)],
                         ids=["symmetric", "asymmetric", "dual_clip"])
def test_clipped_pg_loss_matches_nemo_rl(seed, token_level, clip):
    data = make_batch(seed, zero_len_row=seed == 2)
    assert_parity(data, token_level=token_level, **clip)
    # the same with 3 micro-batches and the global normaliser (how rl/loop.py calls it)
    assert_parity(data, token_level=token_level, micro_batches=3, **clip)


def test_clip_variants_are_exercised():
    """The random data reach every clip branch, so the parity above would catch a wrong bound or a missing dual
    clip, and token- vs sequence-level aggregation differ on it."""
    lp, prev, gen, ref, adv, mask = make_batch(0)
    r = torch.exp(lp - prev)[mask > 0]
    a = adv[mask > 0]
    assert ((r > 1.28) & (a > 0)).any() and ((r > 1.2) & (r < 1.28) & (a > 0)).any() and ((r < 0.8) & (a < 0)).any()
    assert ((r > 3.0) & (a < 0)).any()  # dual clip active
    sym = reference_loss_and_grad(lp, prev, gen, ref, adv, mask)
    asym = reference_loss_and_grad(lp, prev, gen, ref, adv, mask, clip_max=0.28)
    dual = reference_loss_and_grad(lp, prev, gen, ref, adv, mask, clip_c=3.0)
    seq = reference_loss_and_grad(lp, prev, gen, ref, adv, mask, token_level=False)
    for other in (asym, dual, seq):
        assert abs(float(other[0] - sym[0])) > 1e-3
    # and the project honours each of them (not just the symmetric default)
    assert abs(float(project_loss_and_grad(lp, prev, gen, ref, adv, mask, clip_c=3.0)[0] - sym[0])) > 1e-3


def test_per_sequence_advantages_broadcast():
    lp, prev, gen, ref, adv, mask = make_batch(5)
    adv_seq = adv[:, 0].clone()
    p = project_loss_and_grad(lp, prev, gen, ref, adv_seq, mask)
    r = reference_loss_and_grad(lp, prev, gen, ref, adv_seq.unsqueeze(1).expand_as(lp), mask)
    torch.testing.assert_close(p[0], r[0], **TOL)
    torch.testing.assert_close(p[1], r[1], **TOL)


# ------------------------------------------------------------------------------------------------ KL penalty


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_kl_penalty_matches_nemo_rl(kl_type, token_level):
    """kl coefficient 0.01, some tokens in the output-clamp region (|KL| > 10) and beyond the input clamp (20)."""
    data = make_batch(3, kl_far=True)
    lp, prev, gen, ref, adv, mask = data
    logr = (ref - lp)[mask > 0]
    est = {"k1": -logr, "k2": logr.pow(2) / 2, "k3": logr.exp() - 1 - logr}[kl_type]
    assert (est.abs() > 10).any() and (est.abs() < 10).any() and (logr.abs() > 20).any()
    assert_parity(data, kl_coef=0.01, kl_type=kl_type, token_level=token_level)
    # KL only (zero advantages): the gradient is the KL's alone
    zero = (lp, prev, gen, ref, torch.zeros_like(adv), mask)
    _, grad = assert_parity(zero, kl_coef=0.01, kl_type=kl_type, token_level=token_level)

    # The project's old KL: d(kl)/dlogp only (no score-function term), no output clamp. Differs from NeMo-RL.
    def old_kl_grad():
        x = lp.detach().clone().requires_grad_(True)
        u = (ref - x).clamp(-20.0, 20.0)
        k = {"k1": -u, "k2": 0.5 * u * u, "k3": torch.exp(u) - u - 1.0}[kl_type]
        per_tok = 0.01 * k
        loss = ((per_tok * mask).sum() / mask.sum()) if token_level else \
            ((per_tok * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
        loss.backward()
        return x.grad

    assert (old_kl_grad() - grad).abs().max() > 1e-4


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_on_policy_kl_approximation_matches_nemo_rl(kl_type):
    """loss_fn.use_on_policy_kl_approximation: the KL weighted by exp(logp - logp_gen), gradient through logp."""
    data = make_batch(5, kl_far=True)
    _, grad = assert_parity(data, kl_coef=0.01, kl_type=kl_type, on_policy_kl=True, micro_batches=2)
    _, plain = reference_loss_and_grad(*data, kl_coef=0.01, kl_type=kl_type)
    assert (grad - plain).abs().max() > 1e-4  # the weights change the gradient: the test can tell them apart


def test_kl_gradient_closed_form_and_clamp():
    """NeMo-RL's gradient per token (coefficient 1, one token, token-level): d/dlp [s * k] with s = exp(lp - sg(lp))
    is k + dk/dlp: k1 -> (lp - ref) + 1, k2 -> (lp - ref)^2 / 2 + (lp - ref), k3 -> lp - ref; 0 once |k| > 10."""
    lp0, ref0 = math.log(0.5), math.log(0.2)
    d = lp0 - ref0
    expected = {"k1": d + 1, "k2": d * d / 2 + d, "k3": d}
    for kind, g in expected.items():
        x = torch.tensor([[lp0]], dtype=D, requires_grad=True)
        clipped_pg_loss(x, x.detach(), torch.zeros(1, dtype=D), torch.ones(1, 1, dtype=D),
                        logp_ref=torch.tensor([[ref0]], dtype=D), kl_coef=1.0, kl_type=kind).loss.backward()
        assert x.grad.item() == pytest.approx(g, abs=1e-12), kind
    # in the clamp region: the value is capped at 10 (k1 also at -10) and the gradient is 0
    for kind, ref_far, val in (("k3", lp0 + 12.0, 10.0), ("k2", lp0 - 5.0, 10.0), ("k1", lp0 - 11.0, 10.0),
                               ("k1", lp0 + 11.0, -10.0)):
        x = torch.tensor([[lp0]], dtype=D, requires_grad=True)
        out = clipped_pg_loss(x, x.detach(), torch.zeros(1, dtype=D), torch.ones(1, 1, dtype=D),
                              logp_ref=torch.tensor([[ref_far]], dtype=D), kl_coef=1.0, kl_type=kind)
        out.loss.backward()
        assert out.loss.item() == pytest.approx(val) and x.grad.item() == 0.0, kind


# ------------------------------------------------------------------------------------------------ rollout correction


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("tis", [("tis", 2.0, None), ("tis", 1.5, 0.8), ("icepop", 1.6, 0.6),
                                 ("seq-mask-tis", 1.15, 0.9)], ids=["tis", "tis_min", "icepop", "seq_mask_tis"])
def test_importance_sampling_matches_nemo_rl(tis, token_level):
    tis_type, tis_max, tis_min = tis
    data = make_batch(4, b=10)
    lp, prev, gen, ref, adv, mask = data
    kw = dict(is_correction=True, tis_type=tis_type, tis_max=tis_max, tis_min=tis_min, kl_coef=0.01,
              token_level=token_level)
    r_loss, _ = assert_parity(data, **kw)
    assert_parity(data, micro_batches=2, **kw)
    # the data exercise the filter: some tokens / sequences dropped, some kept
    w = nm_is_weights(prev, gen, mask, tis_type, tis_max, tis_min)[mask > 0]
    rho = torch.exp(prev - gen)[mask > 0]
    if tis_type == "tis":
        assert (rho > tis_max).any() and (rho < tis_max).any()
    else:
        assert (w == 0).any() and (w > 0).any()
    if tis_type == "icepop":
        # old project semantics: normalise by the kept tokens only, and drop their KL. Differs from NeMo-RL.
        _, keep = importance_weights(prev, gen, mask, kind="icepop", ratio_max=tis_max, ratio_min=tis_min)
        assert keep.sum() < mask.sum()
        w_full, _ = importance_weights(prev, gen, mask, kind="icepop", ratio_max=tis_max, ratio_min=tis_min)
        old = clipped_pg_loss(lp, prev, adv, keep, is_weights=w_full, logp_ref=ref, kl_coef=0.01,
                              token_level=token_level).loss
        assert abs(float(old - r_loss)) > 1e-4
    if tis_type == "seq-mask-tis":
        # kept sequences carry the raw ratio (here some above the bound, so the old clamp would change them)
        w_p, keep = importance_weights(prev, gen, mask, kind="seq-mask-tis", ratio_max=tis_max, ratio_min=tis_min)
        raw = torch.exp(prev - gen)
        kept = keep > 0
        torch.testing.assert_close(w_p[kept], raw[kept], rtol=1e-12, atol=0)
        assert (raw[kept] > tis_max).any()
        old_w = torch.where(kept, raw.clamp(max=tis_max), torch.zeros_like(raw))
        old = clipped_pg_loss(lp, prev, adv, keep, is_weights=old_w, logp_ref=ref, kl_coef=0.01,
                              token_level=token_level).loss
        assert abs(float(old - r_loss)) > 1e-4


def test_plain_importance_weights_and_no_correction():
    data = make_batch(6)
    assert_parity(data, is_correction=True, tis_type=None, kl_coef=0.01, kl_type="k2")
    assert_parity(data, is_correction=False, kl_coef=0.01, kl_type="k1", clip_c=2.5)


# ------------------------------------------------------------------------------------------------ advantages


def test_one_success_in_eight():
    r = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0], dtype=D)
    loo = group_advantages(r, 8, normalize=True, leave_one_out=True)
    # success: its 7 others are all 0 -> std 0 -> r - mean(others) = 1, undivided
    # failure: others = one 1 and six 0: mean 1/7, unbiased std sqrt(1/7) -> -(1/7) / (sqrt(1/7) + 1e-6)
    assert loo[0].item() == pytest.approx(1.0, abs=1e-12)
    assert loo[1].item() == pytest.approx(-(1 / 7) / (math.sqrt(1 / 7) + 1e-6), abs=1e-12)
    assert round(loo[1].item(), 3) == -0.378
    torch.testing.assert_close(loo, nm_advantages(r, 8, True, True), **TOL)
    # the project's old LOO normalisation (whole-group std) gave +2.83 / -0.404
    whole = r.std()
    old = (r - (r.sum() - r) / 7) / (whole + 1e-6)
    assert round(old[0].item(), 2) == 2.83 and round(old[1].item(), 3) == -0.404
    assert (old - loo).abs().max() > 1.0
    # plain normalisation: group mean 1/8, unbiased group std sqrt(1/8)
    plain = group_advantages(r, 8, normalize=True)
    assert plain[0].item() == pytest.approx((7 / 8) / (math.sqrt(1 / 8) + 1e-6), abs=1e-12)
    torch.testing.assert_close(plain, nm_advantages(r, 8, True, False), **TOL)


@pytest.mark.parametrize("group_size", [2, 3, 4, 8])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("leave_one_out", [True, False])
def test_group_advantages_match_nemo_rl(group_size, normalize, leave_one_out):
    g = torch.Generator().manual_seed(100 + group_size)
    levels = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=D)
    r = levels[torch.randint(0, 4, (40 * group_size,), generator=g)]
    r[:group_size] = 0.5  # an all-tied group
    r[group_size:2 * group_size] = 0.0  # all others tied for response 0 of the next group
    r[group_size] = 1.0
    torch.testing.assert_close(group_advantages(r, group_size, normalize=normalize, leave_one_out=leave_one_out),
                               nm_advantages(r, group_size, normalize, leave_one_out), **TOL)


def test_group_advantages_float32_and_non_dyadic_ties():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0], dtype=torch.float32)
    a = group_advantages(r, 4, normalize=True, leave_one_out=True)
    assert a.dtype == torch.float32
    # response 3: the others are tied -> no division (an exact 0 std here, not a rounding residue)
    assert a[3].item() == pytest.approx(0.9, abs=1e-6)


# ------------------------------------------------------------------------------------------------ metrics


def nm_metrics(prev, gen, mask, kl_type, tis_type, tis_max, tis_min, gbs):
    """NeMo-RL's loss-function metrics per global batch (sum over micro-batches of x / global count), then each
    value / num_global_batches summed (megatron_policy_worker + grpo.py aggregation)."""
    out: dict[str, float] = {}
    n_gb = math.ceil(prev.shape[0] / gbs)
    for s in range(0, prev.shape[0], gbs):
        p, q, m = prev[s:s + gbs], gen[s:s + gbs], mask[s:s + gbs]
        n_tok, ones = m.sum(), torch.ones(m.shape[0], dtype=D)
        mix = torch.log(0.5 * p.exp() + 0.5 * q.exp())
        vals = {
            "token_mult_prob_error": nm_mean(torch.exp((q - p).abs() * m), m, norm=n_tok),
            "gen_kl_error": nm_mean(nm_kl(q, p, kl_type, None, None), m, norm=n_tok),
            "policy_kl_error": nm_mean(nm_kl(p, q, kl_type, None, None), m, norm=n_tok),
            "js_divergence_error": nm_mean(0.5 * ((p - mix).exp() - (p - mix) - 1)
                                           + 0.5 * ((q - mix).exp() - (q - mix) - 1), m, norm=n_tok),
            "sampling_importance_ratio": nm_mean(nm_is_weights(p, q, m, tis_type, tis_max, tis_min), m, norm=n_tok),
        }
        w = torch.nan_to_num(torch.exp(p - q), nan=0.0, posinf=0.0, neginf=0.0)
        if tis_type == "tis":
            lo = 0.0 if tis_min is None else tis_min
            vals["is_oob_ratio"] = nm_mean(((w > tis_max) | (w < lo)).to(D), m, norm=n_tok)
        elif tis_type == "icepop":
            vals["is_oob_ratio"] = nm_mean((~((w >= tis_min) & (w <= tis_max))).to(D), m, norm=n_tok)
        elif tis_type == "seq-mask-tis":
            geo = torch.exp(nm_mean(torch.nan_to_num(p - q), m, dim=-1))
            vals["is_oob_ratio"] = nm_mean(1.0 - ((geo >= tis_min) & (geo <= tis_max)).to(D), ones,
                                           norm=float(m.shape[0]))
        for k, v in vals.items():
            out[k] = out.get(k, 0.0) + float(v) / n_gb
    return out


@pytest.mark.parametrize("gbs", [None, 4])
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("tis", [(None, 2.0, None), ("tis", 2.0, None), ("tis", 1.5, 0.7), ("icepop", 1.6, 0.6),
                                 ("seq-mask-tis", 1.15, 0.9)], ids=["none", "tis", "tis_min", "icepop", "seq"])
def test_nemo_rl_metrics(gbs, kl_type, tis):
    tis_type, tis_max, tis_min = tis
    _, prev, gen, _, _, mask = make_batch(7, b=12)
    got = nemo_rl_mismatch_metrics(prev, gen, mask, kl_type=kl_type, tis_type=tis_type, tis_ratio=tis_max,
                                   tis_ratio_min=tis_min, global_batch_size=gbs)
    want = nm_metrics(prev, gen, mask, kl_type, tis_type, tis_max, tis_min, gbs or 12)
    assert set(got) == {f"mismatch/{k}" for k in want}
    for k, v in want.items():
        assert got[f"mismatch/{k}"] == pytest.approx(v, rel=1e-7, abs=1e-7), k
    assert ("mismatch/is_oob_ratio" in got) == (tis_type is not None)


def test_metric_definitions_differ_from_project_ones():
    """The NeMo-RL names are not aliases: is_oob_ratio under TIS counts only the top side (the project's
    is_oob_frac both sides of [1/C, C]); gen_kl_error follows the KL type (mismatch/k3_kl is always k3);
    several global batches average per-batch token means."""
    _, prev, gen, _, _, mask = make_batch(8, b=12)
    ours = mismatch_metrics(prev, gen, mask, ratio_c=2.0)
    nm = nemo_rl_mismatch_metrics(prev, gen, mask, kl_type="k1", tis_type="tis", tis_ratio=2.0)
    rho = torch.exp(prev - gen)[mask > 0]
    assert (rho < 0.5).any() and (rho > 2.0).any()
    assert nm["mismatch/is_oob_ratio"] == pytest.approx(float((rho > 2.0).double().mean()))
    assert ours["mismatch/is_oob_frac"] > nm["mismatch/is_oob_ratio"] + 0.01
    assert abs(nm["mismatch/gen_kl_error"] - ours["mismatch/k3_kl"]) > 1e-3
    assert abs(nm["mismatch/gen_kl_error"] - ours["mismatch/kl"]) < 1e-12  # k1: mean(lp_gen - lp_train)
    k3 = nemo_rl_mismatch_metrics(prev, gen, mask, kl_type="k3")
    assert k3["mismatch/gen_kl_error"] == pytest.approx(ours["mismatch/k3_kl"], rel=1e-12)
    # one global batch: token_mult_prob_error is the token mean over the batch, same as the project's metric
    assert k3["mismatch/token_mult_prob_error"] == pytest.approx(ours["mismatch/token_mult_prob_error"], rel=1e-12)
    split = nemo_rl_mismatch_metrics(prev, gen, mask, global_batch_size=4)
    assert abs(split["mismatch/token_mult_prob_error"] - ours["mismatch/token_mult_prob_error"]) > 1e-6
    # no clamp at |d| = 20 in token_mult_prob_error (NeMo-RL has none)
    far = mismatch_metrics(torch.tensor([[-1.0]], dtype=D), torch.tensor([[-26.0]], dtype=D), torch.ones(1, 1))
    assert far["mismatch/token_mult_prob_error"] == pytest.approx(math.exp(25.0))
