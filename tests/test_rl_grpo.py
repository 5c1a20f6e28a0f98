"""GRPO math and mismatch metrics on hand-computed cases (values worked out on paper in the comments)."""

import math

import pytest
import torch

from jetrl_megatron.rl.grpo import clipped_pg_loss, group_advantages, importance_weights, kl_penalty, sft_loss
from jetrl_megatron.rl.metrics import mismatch_metrics, position_bins

L = math.log


def test_group_advantages_mean_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4, normalize=True)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    exp = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0, 0, 0, 0]
    torch.testing.assert_close(a, torch.tensor(exp), rtol=0, atol=1e-6)
    torch.testing.assert_close(group_advantages(r, 4, normalize=False), torch.tensor([.5, -.5, -.5, .5, 0, 0, 0, 0]))


def test_group_advantages_leave_one_out():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # baseline_i = mean of the other three: [1/3, 2/3, 2/3, 1/3]
    torch.testing.assert_close(group_advantages(r, 4, normalize=False, leave_one_out=True),
                               torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # Changed semantics (NeMo-RL): LOO + normalize divides by the unbiased std of the *other* three rewards, no
    # longer the whole group's. Here both are sqrt(1/3) (others {0, 0, 1} or {0, 1, 1}), so the numbers stay.
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(group_advantages(r, 4, normalize=True, leave_one_out=True),
                               torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]) / (s + 1e-6), rtol=0, atol=1e-6)
    # where they differ: one success in 4 -> success: others {0, 0, 0}, std 0, undivided +1; failure: others
    # {1, 0, 0}: -(1/3) / (sqrt(1/3) + 1e-6). (The old whole-group std sqrt(1/4) gave +2 and -2/3.)
    one = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, normalize=True, leave_one_out=True)
    torch.testing.assert_close(one, torch.tensor([1.0] + [-(1 / 3) / (s + 1e-6)] * 3), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.ones(6), 4)


def test_clipped_pg_loss_hand_case():
    # seq0: ratio 1.5, A=+1 -> clipped to 1.2 -> L=-1.2 ; ratio 1.5, A=-1 -> min(-1.5,-1.2) -> L=1.5
    # seq1: ratio 0.5, A=-1 -> min(-0.5,-0.8) -> L=0.8 (clipped) ; padding
    old = torch.full((2, 2), L(0.5))
    new = torch.tensor([[L(0.75), L(0.75)], [L(0.25), L(0.9)]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0], [-1.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = clipped_pg_loss(new, old, adv, mask)
    assert out.loss.item() == pytest.approx((-1.2 + 1.5 + 0.8) / 3, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(2 / 3)
    assert out.ratio_mean.item() == pytest.approx((1.5 + 1.5 + 0.5) / 3, abs=1e-6)
    assert out.ratio_dev_max.item() == pytest.approx(0.5, abs=1e-6)  # seq1's 0.5 (its padded 1.8 is masked)
    assert clipped_pg_loss(old.clone(), old, adv, mask).ratio_dev_max.item() == 0.0
    out.loss.backward()
    # dL/dlogp = -ratio * A / 3 where unclipped, 0 where clipped or masked
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 1.5 / 3], [0.0, 0.0]]), rtol=0, atol=1e-6)
    seq = clipped_pg_loss(new, old, adv, mask, token_level=False)
    assert seq.loss.item() == pytest.approx(((-1.2 + 1.5) / 2 + 0.8) / 2, abs=1e-6)
    glob = clipped_pg_loss(new, old, adv, mask, normalizer=10.0)
    assert glob.loss.item() == pytest.approx((-1.2 + 1.5 + 0.8) / 10, abs=1e-6)


def test_dual_clip_and_unclipped_positive():
    old = torch.full((1, 2), L(0.1))
    new = torch.tensor([[L(0.5), L(0.05)]])  # ratios 5 and 0.5
    adv = torch.tensor([[-1.0, 1.0]])
    m = torch.ones(1, 2)
    plain = clipped_pg_loss(new, old, adv, m)  # [5, -0.5]
    assert plain.loss.item() == pytest.approx((5 - 0.5) / 2, abs=1e-6)
    dual = clipped_pg_loss(new, old, adv, m, clip_c=3.0)  # [3, -0.5]
    assert dual.loss.item() == pytest.approx((3 - 0.5) / 2, abs=1e-6)


def test_kl_estimators():
    lp, ref = torch.tensor([L(0.5)]), torch.tensor([L(0.25)])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(L(2))
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * L(2) ** 2)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 + L(2) - 1)
    assert kl_penalty(lp, lp, "k3").item() == 0.0
    # Changed (NeMo-RL): each token's KL is capped at 10 (k1 also at -10), and the gradient carries the
    # score-function term: d/dlp = k + dk/dlp, for k3 = lp - ref (was 1 - exp(ref - lp), dk/dlp alone)
    assert kl_penalty(lp, ref - 30.0, "k1").item() == 10.0 and kl_penalty(lp, ref + 30.0, "k1").item() == -10.0
    x = lp.clone().requires_grad_(True)
    kl_penalty(x, ref, "k3").backward()
    assert x.grad.item() == pytest.approx(L(2))
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")
    # KL term enters the loss: zero advantages, coefficient 0.1 -> loss = 0.1 * k3
    out = clipped_pg_loss(lp.view(1, 1), lp.view(1, 1), torch.zeros(1), torch.ones(1, 1), logp_ref=ref.view(1, 1),
                          kl_coef=0.1)
    assert out.loss.item() == pytest.approx(0.1 * (0.5 + L(2) - 1), abs=1e-6)


def test_importance_weights_tis_icepop_seqmask():
    old = torch.tensor([[L(0.3), L(0.1), L(0.3)], [L(0.3), L(0.3), L(0.3)]])
    gen = torch.tensor([[L(0.1), L(0.3), L(0.2)], [L(0.1), L(0.2), L(0.2)]])
    # rho = [[3, 1/3, 1.5], [3, 1.5, (masked)]]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, k = importance_weights(old, gen, mask, kind=None)
    torch.testing.assert_close(w, torch.tensor([[3, 1 / 3, 1.5], [3, 1.5, 0]]), rtol=1e-5, atol=1e-6)
    w, k = importance_weights(old, gen, mask, kind="tis", ratio_max=2.0)
    torch.testing.assert_close(w, torch.tensor([[2, 1 / 3, 1.5], [2, 1.5, 0]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, mask)
    # icepop: keep 0.5 <= rho <= 2. ``k`` is now only the kept-token report (policy/is_kept_frac): the loss keeps
    # every valid token in its normalizer with weight 0 on the dropped ones (NeMo-RL), no longer mask = k.
    w, k = importance_weights(old, gen, mask, kind="icepop", ratio_max=2.0)
    torch.testing.assert_close(k, torch.tensor([[0.0, 0, 1], [0, 1, 0]]))
    torch.testing.assert_close(w, torch.tensor([[0.0, 0, 1.5], [0, 1.5, 0]]), rtol=1e-5, atol=1e-6)
    # seq0 geometric mean (3 * 1/3 * 1.5)^(1/3) = 1.145 -> kept; seq1 sqrt(3 * 1.5) = 2.12 > 2 -> masked.
    # Changed: kept sequences carry the raw ratio (3, not min(3, 2) = 2), as NeMo-RL's seq-mask-tis does.
    w, k = importance_weights(old, gen, mask, kind="seq-mask-tis", ratio_max=2.0)
    torch.testing.assert_close(k, torch.tensor([[1.0, 1, 1], [0, 0, 0]]))
    torch.testing.assert_close(w, torch.tensor([[3, 1 / 3, 1.5], [0, 0, 0]]), rtol=1e-5, atol=1e-6)


def test_is_weights_scale_loss():
    lp = torch.tensor([[L(0.5)]], requires_grad=True)
    out = clipped_pg_loss(lp, lp.detach(), torch.tensor([2.0]), torch.ones(1, 1), is_weights=torch.tensor([[0.5]]))
    assert out.loss.item() == pytest.approx(-1.0)  # -(ratio 1 * A 2) * w 0.5


def test_sft_loss():
    lp = torch.tensor([[L(0.5), L(0.25)], [L(0.1), 0.0]])
    assert sft_loss(lp, torch.tensor([[1, 1], [1, 0]])).item() == pytest.approx(-(L(.5) + L(.25) + L(.1)) / 3)


def test_mismatch_metrics_hand_case():
    # token A at position 0: train 0.3, rollout 0.2 -> delta = ln 1.5, rho 1.5 (inside [1/2, 2])
    # token B at position 2: train 0.1, rollout 0.4 -> delta = ln 1/4, rho 0.25 (outside)
    # a masked token with a wild value must not count
    lt = torch.tensor([[L(0.3), L(1e-9), L(0.1)]])
    lr = torch.tensor([[L(0.2), L(0.9), L(0.4)]])
    mask = torch.tensor([[1, 0, 1]])
    m = mismatch_metrics(lt, lr, mask, bins=[(0, 2), (2, 4)])
    k3a, k3b = 1.5 - L(1.5) - 1, 0.25 + L(4) - 1
    assert m["mismatch/k3_kl"] == pytest.approx((k3a + k3b) / 2)
    assert m["mismatch/kl"] == pytest.approx((-L(1.5) + L(4)) / 2)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx((1.5 + 4) / 2)
    assert m["mismatch/abs_dp_mean"] == pytest.approx((0.1 + 0.3) / 2)
    assert m["mismatch/abs_dp_max"] == pytest.approx(0.3)
    assert m["mismatch/is_oob_frac"] == pytest.approx(0.5)
    assert m["mismatch/chi2_token"] == pytest.approx((2.25 + 1 / 16) / 2 - 1)
    assert m["mismatch/max_abs_logp_diff"] == pytest.approx(L(4))
    assert m["mismatch/k3_kl/pos_0_2"] == pytest.approx(k3a)
    assert m["mismatch/k3_kl/pos_2_4"] == pytest.approx(k3b)
    assert m["mismatch/is_oob_frac/pos_0_2"] == 0.0
    exact = mismatch_metrics(lt, lt, mask)
    assert exact["mismatch/k3_kl"] == 0 and exact["mismatch/token_mult_prob_error"] == 1.0


def test_mismatch_metrics_random_vs_loop():
    g = torch.Generator().manual_seed(0)
    lt = -torch.rand(4, 9, generator=g) * 3
    lr = lt + torch.randn(4, 9, generator=g) * 0.1
    mask = (torch.rand(4, 9, generator=g) > 0.3).int()
    m = mismatch_metrics(lt, lr, mask)
    ds = [(float(lt[i, j]) - float(lr[i, j])) for i in range(4) for j in range(9) if mask[i, j]]
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.exp(d) - d - 1 for d in ds) / len(ds), rel=1e-9)
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(d)) for d in ds) / len(ds))
    assert m["mismatch/k3_kl"] > 0


def test_position_bins():
    assert position_bins(16, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert position_bins(3, 4) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("kl_clamps", [(0.5, 10.0), (20.0, 0.1)])  # (input, output): each one active in turn
def test_policy_loss_passes_the_run_settings_and_normalizes_the_global_batch(kl_clamps):
    """``PolicyLoss`` from a loaded config: the same loss and logged parts as ``clipped_pg_loss`` called with the
    overridden values by hand (asymmetric clips, so a swap shows), -inf logprobs of filtered tokens as 0, and the
    normalizer counted by hand (tokens; sequences without the truncated ones)."""
    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.grpo import PolicyLoss

    kl_in, kl_out = kl_clamps
    cfg = load_config("tiny_cpu", [
        "loss_fn.ratio_clip_min=0.1", "loss_fn.ratio_clip_max=0.3", "loss_fn.ratio_clip_c=3.0",
        "loss_fn.reference_policy_kl_penalty=0.05", "loss_fn.reference_policy_kl_type=k2",
        f"loss_fn.kl_input_clamp_value={kl_in}", f"loss_fn.kl_output_clamp_value={kl_out}",
        "loss_fn.token_level_loss=false", "grpo.overlong_filtering=true"])
    loss = PolicyLoss.from_config(cfg.loss_fn, overlong_filtering=cfg.grpo.overlong_filtering, filtered_sampling=True)
    g = torch.Generator().manual_seed(3)
    b, t = 6, 7
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    mb = {"mask": mask, "adv": torch.randn(b, generator=g), "logp_old": -torch.rand(b, t, generator=g) * 2,
          "logp_ref": -torch.rand(b, t, generator=g) * 2, "is_w": torch.rand(b, t, generator=g) + 0.5}
    lp = (mb["logp_old"] + torch.randn(b, t, generator=g) * 0.4).requires_grad_(True)
    filtered = torch.zeros(b, t, dtype=torch.bool)
    filtered[0, 1] = filtered[3, 4] = True
    mask[0, 1] = mask[3, 4] = 1.0
    lp_in = torch.where(filtered, torch.full_like(lp, -math.inf), lp)
    got, parts = loss(lp_in, mb, 4.0)
    ref = clipped_pg_loss(torch.where(filtered, torch.zeros_like(lp), lp), mb["logp_old"], mb["adv"], mask,
                          clip_low=0.1, clip_high=0.3, clip_c=3.0, is_weights=mb["is_w"], logp_ref=mb["logp_ref"],
                          kl_coef=0.05, kl_type="k2", kl_input_clamp=kl_in, kl_output_clamp=kl_out,
                          token_level=False, normalizer=4.0)
    assert torch.equal(got, ref.loss) and got.item() != 0
    for name, want in (("pg_loss", ref.pg_loss), ("kl_ref", ref.kl), ("clip_frac", ref.clip_frac),
                       ("ratio_mean", ref.ratio_mean), ("ratio_dev_max", ref.ratio_dev_max)):
        assert torch.equal(parts[name], want), name
    (g1,) = torch.autograd.grad(got, lp)
    assert torch.all(g1[filtered] == 0) and g1.abs().sum() > 0
    assert loss.for_batch(4.0)(lp_in, mb)[0].item() == got.item()
    truncated = torch.tensor([True, False, False, True, False, False])
    assert loss.normalizer(mask, truncated, 6, 2, 2) == 4 / 4  # 4 untruncated sequences / (2 micro x 2 DP)
    token = PolicyLoss.from_config(load_config("tiny_cpu", []).loss_fn, overlong_filtering=False,
                                   filtered_sampling=False)
    assert token.normalizer(mask, truncated, 6, 3, 1) == float(mask.sum()) / 3
    assert loss.uses_unfiltered_kl(True) and not loss.uses_unfiltered_kl(False) and not token.uses_unfiltered_kl(True)
