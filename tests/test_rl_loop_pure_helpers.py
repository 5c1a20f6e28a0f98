"""The loop's pure helpers, fast and without Megatron or vLLM: padding, the learning-rate schedule, the batch
tensors and their alignment by response position, checked against references written out here."""

from __future__ import annotations

import math

import pytest
import torch

from jetrl_megatron.rl.batch import align_by_position, batch_metrics, importance, make_batch, padded_length
from jetrl_megatron.rl.config import ConfigError, load_config
from jetrl_megatron.rl.tasks import build_task
from jetrl_megatron.rl.trainer import lr_at, model_numerics


@pytest.mark.parametrize("n, div, mb, tok", [(1, 1, 1, 1), (17, 8, 3, 128), (100, 1, 32, 128), (5, 3, 4, 6),
                                            (128, 128, 1, 128), (129, 64, 2, 256)])
def test_padded_length_is_the_smallest_valid_length(n, div, mb, tok):
    want = next(s for s in range(n, n + 10_000) if s % div == 0 and (mb * s) % tok == 0)
    assert padded_length(n, div, mb, tok) == want


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_schedule_matches_its_definition(style):
    cfg = load_config("tiny_cpu", [f"policy.megatron_cfg.scheduler.lr_decay_style={style}",
                                   "policy.megatron_cfg.scheduler.lr_warmup_iters=4",
                                   "policy.megatron_cfg.scheduler.lr_warmup_init=1e-5",
                                   "policy.megatron_cfg.optimizer.lr=1e-3", "policy.megatron_cfg.optimizer.min_lr=1e-4",
                                   "policy.megatron_cfg.scheduler.lr_decay_iters=24"])
    for step in range(0, 30):
        if step < 4:
            want = 1e-5 + (1e-3 - 1e-5) * step / 4
        elif style == "constant":
            want = 1e-3
        else:
            frac = min(1.0, (step - 4) / 20)
            want = 1e-3 + (1e-4 - 1e-3) * frac if style == "linear" else \
                1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * frac))
        assert lr_at(cfg, step) == pytest.approx(want, rel=1e-12), step


def _random_batch(cfg, seed):
    task = build_task(cfg)
    g = torch.Generator().manual_seed(seed)
    prompts = [task.prompt(i) for i in range(6)]
    samples, lengths = [], torch.randint(0, cfg.policy.generation.max_new_tokens + 1, (6,), generator=g).tolist()
    for i, n in enumerate(lengths):
        toks = torch.randint(3, 20, (n,), generator=g).tolist()
        lps = (-torch.rand(n, generator=g, dtype=torch.float64)).tolist()
        samples.append((i, 0, toks, lps))
    return task, prompts, samples, make_batch(cfg, task, prompts, samples)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_make_batch_places_every_response_token_and_logprob(seed):
    cfg = load_config("tiny_cpu", ["policy.generation.max_new_tokens=5", "policy.make_sequence_length_divisible_by=4"])
    task, prompts, samples, b = _random_batch(cfg, seed)
    assert b.tokens.shape[1] % 4 == 0
    for row, (pi, _, toks, lps) in enumerate(samples):
        p = list(prompts[pi].token_ids)
        assert b.tokens[row, :len(p)].tolist() == p
        assert b.tokens[row, len(p):len(p) + len(toks)].tolist() == toks
        # logprob slot t scores token t + 1: the response's logprobs start at the last prompt position
        assert b.mask[row].sum() == len(toks)
        assert torch.allclose(b.gen_logprobs[row][b.mask[row] > 0].double(), torch.tensor(lps, dtype=torch.float64),
                              atol=1e-6) if toks else True
        assert int(b.response_len[row]) == len(toks)


@pytest.mark.parametrize("seed", [0, 1])
def test_align_by_position_indexes_from_the_first_response_token(seed):
    cfg = load_config("tiny_cpu", ["policy.generation.max_new_tokens=5"])
    _, _, samples, b = _random_batch(cfg, seed)
    x = torch.randn(b.mask.shape, generator=torch.Generator().manual_seed(seed))
    out, m = align_by_position(x, b, 5)
    for row in range(b.mask.shape[0]):
        idx = b.mask[row].nonzero().flatten()
        assert m[row].sum() == len(idx)
        assert torch.equal(out[row, :len(idx)], x[row, idx])
        assert (out[row, len(idx):] == 0).all()


def test_batch_metrics_and_importance_without_correction():
    cfg = load_config("tiny_cpu", ["policy.generation.max_new_tokens=5"])
    _, _, samples, b = _random_batch(cfg, 3)
    w, kept = importance(cfg, b, b.gen_logprobs)
    assert w is None and kept is b.mask
    m = batch_metrics(b, kept)
    assert m["reward/mean"] == pytest.approx(float(b.rewards.mean()))
    assert m["policy/response_len"] == pytest.approx(sum(len(s[2]) for s in samples) / len(samples))
    assert m["policy/is_kept_frac"] == 1.0


def test_numerics_switches_come_from_the_config_and_the_environment_wins(monkeypatch):
    for var in ("JETRL_ELEMENTWISE", "JETRL_FP8_REFERENCE_QUANT", "JETRL_VERIFY_SERVED_FP8", "JETRL_VERIFY_REFIT",
                "JETRL_REFIT_CUDA_GRAPH", "JETRL_FP8_GEMM_WARMUP"):
        monkeypatch.delenv(var, raising=False)
    keys = ["policy.jet_rl.elementwise=torch", "policy.jet_rl.fp8_reference_quant=true",
            "policy.jet_rl.verify_refit=false", "policy.jet_rl.fp8_gemm_warmup=true"]
    sw = load_config("tiny_cpu", keys).switches
    assert (sw.elementwise, sw.reference_quant, sw.verify_refit, sw.fp8_gemm_warmup) == ("torch", True, False, True)
    assert sw.verify_served_fp8 is None and sw.refit_cuda_graph is False  # the keys' defaults
    monkeypatch.setenv("JETRL_ELEMENTWISE", "triton")
    monkeypatch.setenv("JETRL_FP8_REFERENCE_QUANT", "0")
    monkeypatch.setenv("JETRL_VERIFY_REFIT", "1")
    monkeypatch.setenv("JETRL_VERIFY_SERVED_FP8", "0")
    cfg = load_config("tiny_cpu", keys)
    sw = cfg.switches
    assert (sw.elementwise, sw.reference_quant, sw.verify_refit, sw.verify_served_fp8) == ("triton", False, True, False)
    assert sw.fp8_gemm_warmup is True  # no variable set: the key
    assert cfg.policy.jet_rl.elementwise == "torch"  # the config keeps what the user wrote
    # resolved once: a later change of the environment changes nothing already loaded
    monkeypatch.setenv("JETRL_ELEMENTWISE", "torch")
    assert cfg.switches.elementwise == "triton"
    assert model_numerics(cfg) == {"attn_impl": None, "elementwise": "triton", "reference_quant": False,
                                   "attn_match": "prefill", "cuda_norms": "batch_invariant",
                                   "fuse_swiglu_grad_quant": False, "swiglu_fp8_forms": False,
                                   "deterministic_backward": False, "stress": None}
    monkeypatch.setenv("JETRL_ELEMENTWISE", "cuda")
    with pytest.raises(ConfigError, match="JETRL_ELEMENTWISE"):
        load_config("tiny_cpu")
    monkeypatch.delenv("JETRL_ELEMENTWISE")
    monkeypatch.setenv("JETRL_VERIFY_REFIT", "yes")
    with pytest.raises(ConfigError, match="JETRL_VERIFY_REFIT"):
        load_config("tiny_cpu")
    monkeypatch.delenv("JETRL_VERIFY_REFIT")
    with pytest.raises(Exception, match="policy.jet_rl.elementwise"):
        load_config("tiny_cpu", ["policy.jet_rl.elementwise=cuda"])
