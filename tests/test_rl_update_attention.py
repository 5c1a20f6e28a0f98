"""``policy.jet_rl.update_attention``: the update's attention over each row's real tokens (``packed``, the default)
or over whole right-padded rows (``whole_rows``: no lengths per micro-batch, one layout per (rows, length), what CUDA
graphs of the update need). What the update hands the model under each value, the configuration rule, and the CPU
claim: the trainer's CPU attention always attends whole rows, so both values give the same step bit for bit. Whether
FA3 gives the real tokens the same bytes on a GPU is bench/graph_layout_probe.py's question."""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import hf_state, tiny_shape

from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rl.batch import make_batch
from jetrl_megatron.rl.config import ConfigError, load_config
from jetrl_megatron.rl.tasks import build_task


def test_whole_rows_needs_prefill_matched_attention_and_a_known_value():
    assert load_config("tiny_cpu", ["policy.jet_rl.update_attention=whole_rows"]).policy.jet_rl.update_attention \
        == "whole_rows"
    assert load_config("tiny_cpu", []).policy.jet_rl.update_attention == "packed"
    with pytest.raises(ConfigError, match=r"policy.jet_rl.update_attention: whole_rows needs "
                                          r"policy.jet_rl.attn_match: prefill \(got 'decode'"):
        load_config("tiny_cpu", ["policy.jet_rl.update_attention=whole_rows", "policy.jet_rl.attn_match=decode"])
    with pytest.raises(ConfigError, match="policy.jet_rl.update_attention"):
        load_config("tiny_cpu", ["policy.jet_rl.update_attention=padded"])


def _rollout_batch(cfg, seed: int):
    """A batch of 8 rollouts of random lengths (some rows shorter than the padded length)."""
    task = build_task(cfg)
    g = torch.Generator().manual_seed(seed)
    prompts = [task.prompt(i) for i in range(8)]
    samples = []
    for i, n in enumerate(torch.randint(1, cfg.policy.generation.max_new_tokens + 1, (8,), generator=g).tolist()):
        samples.append((i, 0, torch.randint(3, 20, (n,), generator=g).tolist(),
                        (-torch.rand(n, generator=g, dtype=torch.float64)).tolist()))
    return make_batch(cfg, task, prompts, samples)


@pytest.mark.parametrize("value", ["packed", "whole_rows"])
def test_the_update_hands_the_model_lengths_only_when_packed(mp, monkeypatch, value):
    from jetrl_megatron.megatron import model as model_mod
    from jetrl_megatron.megatron.model import StepResult
    from jetrl_megatron.rl.outputs.metric_log import RunLogger
    from jetrl_megatron.rl.trainer import Trainer, policy_update

    cfg = load_config("tiny_cpu", [f"policy.jet_rl.update_attention={value}", "policy.generation.max_new_tokens=6",
                                   "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2"])
    batch = _rollout_batch(cfg, seed=5)
    assert batch.lengths is not None and int(batch.lengths.min()) < batch.tokens.shape[1]
    seen = []

    def recording_step(model, optimizer, data, loss_fn, **kwargs):
        seen.append({k: v.clone() for k, v in data.items()})
        metrics = {"pg_loss": 0.0, "clip_frac": 0.0, "ratio_mean": 1.0, "kl_ref": 0.0,
                   "ratio_dev_max": 0.125 * len(seen)}
        return StepResult(0.0, False, 1.0, 1, metrics)

    monkeypatch.setattr(model_mod, "train_step", recording_step)
    n, s = batch.tokens.shape
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    logger = RunLogger(cfg.logger.log_dir, tensorboard=False, progress=False, enabled=False)
    m = policy_update(cfg, Trainer(None, opt, None, None, None), batch, torch.randn(n), torch.zeros(n, s - 1), None,
                      None, batch.mask, 1, logger)
    assert len(seen) == n // 4
    assert m["train/ratio_dev_first_step"] == 0.125  # the first optimizer step's, not a later one's
    for i, data in enumerate(seen):
        rows = slice(4 * i, 4 * i + 4)
        assert torch.equal(data["tokens"], batch.tokens[rows])
        if value == "packed":
            assert torch.equal(data["lengths"], batch.lengths[rows])
            assert torch.equal(data["decode_from"], batch.prompt_lengths[rows])
        else:
            assert "lengths" not in data and "decode_from" not in data


def test_on_cpu_both_values_give_the_same_step(mp):
    """The model's forward+backward on right-padded rows with each row's length (packed) and without (whole rows):
    the same loss and the same gradient bytes on CPU, where attention attends whole rows either way."""
    from jetrl_megatron.megatron.model import forward_backward
    from jetrl_megatron.megatron.policy import build_policy

    shape = tiny_shape("qwen3")
    policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=hf_state(shape, seed=11), optimizer={"lr": 1e-3})
    g = torch.Generator().manual_seed(12)
    b, s = 4, 32
    tokens = torch.randint(0, shape.vocab_size, (b, s), generator=g)
    lengths = torch.tensor([32, 7, 19, 30], dtype=torch.int32)
    mask = (torch.arange(s - 1)[None, :] < (lengths[:, None] - 1)).float()
    tokens = tokens.masked_fill(torch.arange(s)[None, :] >= lengths[:, None], 0)  # right-padded rows

    def loss(lp, mb):
        return -(lp * mb["mask"]).sum() / mb["mask"].sum(), {}

    grads = {}
    for name, extra in (("packed", {"lengths": lengths, "decode_from": lengths - 3}), ("whole_rows", {})):
        value, _ = forward_backward(policy.model, {"tokens": tokens, "mask": mask, **extra}, loss, micro_batch_size=2)
        grads[name] = (value, {n: p.main_grad.clone() for n, p in policy.model.named_parameters()})
    (lp, gp), (lw, gw) = grads["packed"], grads["whole_rows"]
    assert lp == lw and gp.keys() == gw.keys()
    for n in gp:
        assert torch.equal(gp[n].view(torch.int16) if gp[n].dtype == torch.bfloat16 else gp[n],
                           gw[n].view(torch.int16) if gw[n].dtype == torch.bfloat16 else gw[n]), n
    assert any(float(g.abs().sum()) > 0 for g in gp.values())
