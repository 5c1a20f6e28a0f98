"""The trainer's top-k / top-p / temperature transform (jetrl_megatron/sampling.py) against an independent per-row
reference, against vLLM's own sampler functions on tie-heavy BF16 logits, and NeMo-RL's handling of -inf logprobs.

Why: the trainer's logprobs must be the processed logprobs vLLM returns; a wrong boundary rule (>= vs >, the
cumulative sum's direction, 1 - p's rounding, ties at the k-th logit) shows up as -inf or a renormalisation error on
a few tokens, which a loop-level test can miss."""

from __future__ import annotations

import math

import pytest
import torch

from jetrl_megatron.sampling import LogitsSampling, keep_mask, mask_filtered_out, sampling_logits


def _reference_keep(row: list[float], k: int | None, p: float) -> list[bool]:
    """Per row, in Python floats: top-k keeps values >= the k-th largest; top-p keeps a value when the probability
    mass (after top-k) of all values <= it exceeds 1 - p (ties are absent in the data this is used on); the largest
    value always stays."""
    v = len(row)
    keep = [True] * v
    if k is not None and 0 < k < v:
        kth = sorted(row, reverse=True)[k - 1]
        keep = [x >= kth for x in row]
    if p < 1.0:
        finite = [x for x, kp in zip(row, keep, strict=True) if kp]
        top = max(finite)
        z = sum(math.exp(x - top) for x in finite)
        prob = [math.exp(x - top) / z if kp else 0.0 for x, kp in zip(row, keep, strict=True)]
        bar = 1.0 - float(torch.tensor(p, dtype=torch.float32))
        for i in range(v):
            below = sum(prob[j] for j in range(v) if row[j] <= row[i])
            keep[i] = keep[i] and (below > bar or row[i] == top)
    return keep


@pytest.mark.parametrize(("k", "p"), [(None, 0.9), (7, 1.0), (12, 0.8), (None, 0.3), (40, 0.95), (1, 0.5),
                                      (64, 0.9), (200, 0.7)])
def test_keep_mask_matches_an_independent_reference_on_random_logits(k, p):
    g = torch.Generator().manual_seed(11 + (k or 0))
    logits = torch.randn(24, 64, generator=g, dtype=torch.float64).mul(2.5).float()  # continuous: no ties
    keep = keep_mask(logits, k, p)
    ref = torch.tensor([_reference_keep(r, k, p) for r in logits.double().tolist()])
    assert keep is not None and torch.equal(keep, ref)
    assert keep.any(dim=-1).all()
    if k is not None and k < 64:
        assert bool((keep.sum(-1) <= k).all())
    if p < 1.0:  # what survives holds more than p of the (top-k) mass, and dropping its smallest member would not
        probs = torch.softmax(logits.masked_fill(~keep_mask(logits, k, 1.0), float("-inf")) if k and k < 64
                              else logits, dim=-1).double()
        kept_mass = (probs * keep).sum(-1)
        assert bool((kept_mass >= p - 1e-6).all())


def test_no_filter_returns_none_and_keeps_scaling_exact():
    x = torch.randn(3, 10)
    assert keep_mask(x, None, 1.0) is None and keep_mask(x, 0, 1.0) is None and keep_mask(x, 10, 1.0) is None
    assert torch.equal(sampling_logits(x, LogitsSampling()), x)
    assert torch.equal(sampling_logits(x, LogitsSampling(temperature=0.0, top_k=2, top_p=0.5)), x)  # greedy: raw
    assert torch.equal(sampling_logits(x, LogitsSampling(temperature=0.7)), x / 0.7)


def test_top_k_keeps_every_logit_tied_with_the_kth():
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5, 2.0]])
    assert keep_mask(x, 2, 1.0).tolist() == [[False, True, True, True, False, True]]


@pytest.mark.parametrize("temperature", [1.0, 0.8, 1.3])
@pytest.mark.parametrize(("k", "p"), [(None, 0.9), (50, 1.0), (50, 0.9), (5, 0.6), (None, 0.5)])
def test_sampling_logits_equal_vllms_sampler_bit_for_bit(temperature, k, p):
    """vLLM's CPU sampler path (temperature division, apply_top_k_top_p, FP32 log_softmax) on BF16-valued logits,
    which tie often, so top-p boundaries fall inside groups of equal logits."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    g = torch.Generator().manual_seed(3)
    raw = torch.randn(96, 128, generator=g).mul(1.5).to(torch.bfloat16).float()
    n = raw.shape[0]
    temp = torch.full((n,), temperature, dtype=torch.float32)
    theirs = Sampler.apply_temperature(raw.clone(), temp, all_random=True)
    theirs = apply_top_k_top_p(theirs, None if k is None else torch.full((n,), k, dtype=torch.int32),
                               None if p >= 1.0 else torch.full((n,), p, dtype=torch.float32))
    ours = sampling_logits(raw, LogitsSampling(temperature=temperature, top_k=k, top_p=p))
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours.log_softmax(-1), theirs.log_softmax(-1, dtype=torch.float32))
    assert bool(torch.isinf(ours).any())  # the filter really removed tokens
    # ours as a (b, s, V) batch of rows: the same rows, the same result (the trainer's logits are 3-D)
    assert torch.equal(sampling_logits(raw.view(8, 12, 128), LogitsSampling(temperature, k, p)).view(n, 128), ours)


def test_sampling_logits_gradient_flows_only_through_kept_logits():
    x = torch.randn(4, 32, requires_grad=True)
    s = LogitsSampling(temperature=0.5, top_k=8, top_p=0.9)
    lp = sampling_logits(x, s).log_softmax(-1)
    kept = torch.isfinite(lp)
    target = lp.masked_fill(~kept, 0.0).sum()
    target.backward()
    assert torch.isfinite(x.grad).all() and bool((x.grad[~kept] == 0).all()) and bool((x.grad[kept] != 0).any())


def test_mask_filtered_out_is_nemo_rl_meaning():
    lp = torch.tensor([[-1.0, float("-inf"), -2.0, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    out, n = mask_filtered_out(lp, mask)
    assert out.tolist() == [[-1.0, 0.0, 0.0, 0.0]] and n == 1


@pytest.mark.parametrize(("kw", "msg"), [({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                         ({"top_k": -2}, "top_k"), ({"temperature": -1.0}, "temperature")])
def test_bad_values_name_the_setting(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LogitsSampling(**kw)


def test_vllm_kwargs_and_flags():
    s = LogitsSampling(temperature=0.8, top_k=-1, top_p=1.0)
    assert not s.filters and not s.is_identity and s.vllm_kwargs() == {"temperature": 0.8, "top_p": 1.0, "top_k": 0}
    f = LogitsSampling(temperature=0.8, top_k=50, top_p=0.9)
    assert f.filters and f.unfiltered() == LogitsSampling(temperature=0.8) and f.top_k_for(40) is None
    assert LogitsSampling().is_identity and LogitsSampling(temperature=0.0, top_p=0.5).is_identity


@pytest.mark.parametrize(("n", "p", "kept"), [(4, 0.5, 2), (2, 0.5, 1), (5, 0.8, 5), (10, 0.6, 7), (25, 0.92, 24)])
def test_top_p_boundary_rule_and_fp32_one_minus_p(n, p, kept):
    """n equal logits: the cumulative mass lands exactly on 1 - p (4 x 0.25 at p 0.5), where the rule is "drop while
    the mass is <= 1 - p", or between 1 - p in FP64 and in FP32 (5 x 0.2 at p 0.8: FP32's 1 - p is 0.20000002, so
    the first 0.2 stays), where the sampler's FP32 arithmetic decides. vLLM must agree on each."""
    keep = keep_mask(torch.zeros(1, n), None, p)
    assert int(keep.sum()) == kept
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    theirs = apply_top_k_top_p(torch.zeros(1, n), None, torch.tensor([p], dtype=torch.float32))
    assert torch.equal(torch.isfinite(theirs), keep)
