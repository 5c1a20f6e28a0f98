"""CPU: backend plumbing that needs no GPU: the measured auto table, scale re-layouts, the derived-tensor cache."""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.fp8.backends import _layout, auto_table
from jetrl_megatron.recipe import GEMM_BACKENDS


def test_auto_table_picks_known_backends_for_every_m():
    for form in ("fprop", "dgrad", "wgrad"):
        for m in (1, 4, 8, 9, 16, 64, 65, 1000, 8192, 16384, 10**6):
            assert auto_table.pick(form, m) in GEMM_BACKENDS
            assert auto_table.pick(form, m, batch_invariant=True) == "triton"
    # measured order: DeepGEMM first where it is installed, else Triton's swap-AB split-K at M=1, cuBLAS at 8192
    assert auto_table.pick("fprop", 1) == "deep_gemm"
    assert auto_table.pick("fprop", 8192) == "deep_gemm"
    no_dg = lambda name: name != "deep_gemm"  # noqa: E731
    assert auto_table.pick("fprop", 1, available=no_dg) == "triton"
    assert auto_table.pick("fprop", 8192, available=no_dg) == "cublas"
    assert auto_table.pick("dgrad", 8192, available=no_dg) == "cublas"
    assert auto_table.pick("wgrad", 8192) == "cublas"
    with pytest.raises(ValueError, match="unknown GEMM form"):
        auto_table.pick("bprop", 4)


def test_m_invariant_fprop_policy_of_the_jetrl_arm():
    """The jetrl arm's auto FProp is only a backend the table lists as measured M-invariant, at every M; without
    one it is Triton's batch-invariant mode. DGrad / WGrad (never compared with the rollout) keep the speed table."""
    from jetrl_megatron.fp8.gemm import _batch_invariant_mode, needs_m_invariant_fprop
    from jetrl_megatron.recipe import Fp8Recipe

    assert auto_table.M_INVARIANT_FPROP and "cublas" not in auto_table.M_INVARIANT_FPROP
    everything = lambda name: True  # noqa: E731
    nothing_invariant = lambda name: name not in auto_table.M_INVARIANT_FPROP  # noqa: E731
    for m in (1, 3, 8, 16, 64, 8192):
        assert auto_table.pick("fprop", m, m_invariant=True) == auto_table.M_INVARIANT_FPROP[0]
        assert auto_table.pick("fprop", m, m_invariant=True, available=nothing_invariant) == "triton"
        assert auto_table.pick("dgrad", m, m_invariant=True) == auto_table.pick("dgrad", m)
        assert auto_table.pick("wgrad", m, m_invariant=True) == auto_table.pick("wgrad", m)
    assert auto_table.m_invariant_choice(everything) == (auto_table.M_INVARIANT_FPROP[0], False)
    assert auto_table.m_invariant_choice(nothing_invariant) == ("triton", True)
    assert needs_m_invariant_fprop(Fp8Recipe(mode="jetrl"))
    for arm in ("bf16", "bf16_train_fp8_rollout", "fake_quant"):
        assert not needs_m_invariant_fprop(Fp8Recipe(mode=arm)), arm
    # the batch-invariant flag: asked for, or the jetrl arm's auto fallback to Triton; never for an explicit Triton
    jet = Fp8Recipe(mode="jetrl")
    assert _batch_invariant_mode("fprop", "triton", None, jet)
    assert not _batch_invariant_mode("fprop", "triton", "triton", jet)
    assert not _batch_invariant_mode("fprop", "triton", None, Fp8Recipe(mode="bf16_train_fp8_rollout"))
    assert not _batch_invariant_mode("dgrad", "triton", None, jet)
    assert _batch_invariant_mode("dgrad", "triton", None, Fp8Recipe(mode="jetrl", batch_invariant=True))


def test_pad_cols4_and_col_major():
    s = torch.arange(15, dtype=torch.float32).reshape(3, 5) + 1
    p = _layout.pad_cols4(s)
    assert p.shape == (3, 8) and torch.equal(p[:, :5], s) and torch.count_nonzero(p[:, 5:]) == 0
    c = _layout.col_major(s)
    assert c.stride() == (1, 3) and torch.equal(c, s)
    assert _layout.col_major(c) is c  # already column-major: no copy
    one = torch.ones(1, 4)
    assert torch.equal(_layout.col_major(one), one)


def test_derived_cache_recomputes_after_in_place_change_and_forgets_freed_tensors():
    calls = []

    def make(t):
        calls.append(1)
        return t * 2

    w = torch.randn(4, 4)
    a = _layout.derived(w, "double", make)
    b = _layout.derived(w, "double", make)
    assert a is b and len(calls) == 1
    w.add_(1.0)  # in-place update bumps the version: the derived tensor must be rebuilt
    c = _layout.derived(w, "double", make)
    assert len(calls) == 2 and torch.equal(c, w * 2)
    key = id(w)
    assert key in _layout._cache and _layout.derived_bytes() >= c.numel() * 4
    _layout.forget_derived(w)  # dropped now, rebuilt on next use
    assert _layout._cache[key][1] == {}
    d = _layout.derived(w, "double", make)
    assert len(calls) == 3 and torch.equal(d, w * 2)
    del w, a, b, c, d
    assert key not in _layout._cache
    with torch.inference_mode():
        v = torch.randn(2, 2)
    _layout.derived(v, "double", make)
    _layout.derived(v, "double", make)
    assert len(calls) == 5  # inference tensors carry no version: never cached
