"""The loop's NeMo-RL keys, on random inputs against references written from NeMo-RL's definitions: reward scaling,
advantage clipping, overlong filtering (truncation flag and loss mask), the held-out split and max_num_epochs."""

from __future__ import annotations

import torch

from jetrl_megatron.rl.batch import advantages, loss_mask, make_batch, scale_rewards
from jetrl_megatron.rl.config import load_config
from jetrl_megatron.rl.generation import validation_split
from jetrl_megatron.rl.tasks import build_task


def _ref_scale(r, smin, smax, tmin, tmax):
    out = []
    for x in r.tolist():
        x = min(max(x, smin), smax)
        out.append(tmin + (x - smin) / (smax - smin) * (tmax - tmin))
    return torch.tensor(out, dtype=r.dtype)


def test_reward_scaling_clamps_then_maps():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(64, generator=g, dtype=torch.float64) * 3 - 1  # some below 0, some above 1
    cfg = load_config("tiny_cpu", ["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.source_min=0.0",
                                   "grpo.reward_scaling.source_max=1.0", "grpo.reward_scaling.target_min=-1.0",
                                   "grpo.reward_scaling.target_max=1.0"])
    got = scale_rewards(r, cfg.grpo.reward_scaling)
    torch.testing.assert_close(got, _ref_scale(r, 0.0, 1.0, -1.0, 1.0))
    assert torch.equal(scale_rewards(r, load_config("tiny_cpu").grpo.reward_scaling), r)  # disabled: unchanged


def test_advantages_scale_group_and_clip():
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(16 * 8, generator=g, dtype=torch.float64).round(decimals=1) * 4
    cfg = load_config("tiny_cpu", ["grpo.advantage_clip_low=-0.5", "grpo.advantage_clip_high=0.7",
                                   "grpo.reward_scaling.enabled=true", "grpo.reward_scaling.source_max=2.0"])
    got = advantages(cfg, rewards)
    scaled = _ref_scale(rewards, 0.0, 2.0, 0.0, 1.0).view(16, 8)
    centred = scaled - scaled.mean(dim=1, keepdim=True)  # tiny_cpu: no leave-one-out, normalized by the group std
    std = scaled.std(dim=1, keepdim=True)
    want = torch.where(std > 0, centred / (std + 1e-6), centred).clamp(-0.5, 0.7).reshape(-1)
    torch.testing.assert_close(got, want)
    assert (got == -0.5).any() and (got == 0.7).any()  # both clips bind on this data


def _samples(task, prompts, lengths, eos_last):
    g = torch.Generator().manual_seed(2)
    out = []
    for i, (n, eos) in enumerate(zip(lengths, eos_last, strict=True)):
        toks = torch.randint(3, 20, (n,), generator=g).tolist()
        if eos and n:
            toks[-1] = task.tokenizer.eos_token_id
        out.append((i, 0, toks, [-0.5] * n))
    return out


def test_overlong_filtering_masks_truncated_answers_only():
    cfg = load_config("tiny_cpu", ["grpo.overlong_filtering=true"])
    task = build_task(cfg)
    n = cfg.policy.generation.max_new_tokens
    prompts = [task.prompt(i) for i in range(5)]
    lengths, eos_last = [n, n, 2, n - 1, 0], [True, False, True, False, False]
    batch = make_batch(cfg, task, prompts, _samples(task, prompts, lengths, eos_last))
    assert batch.truncated.tolist() == [False, True, False, False, False]  # full length without EOS only
    m = loss_mask(cfg, batch)
    assert torch.equal(m[1], torch.zeros_like(m[1])) and batch.mask[1].sum() == n
    keep = [0, 2, 3, 4]
    assert torch.equal(m[keep], batch.mask[keep])
    assert torch.equal(loss_mask(load_config("tiny_cpu"), batch), batch.mask)  # off by default: nothing masked


def test_held_out_split_follows_split_validation_size_and_caps_evaluation():
    cfg = load_config("tiny_cpu", ["data.train.split_validation_size=0.05", "grpo.max_val_samples=30"])
    task = build_task(cfg)
    val_task, val_idx, train_idx = validation_split(cfg, task)
    assert val_task is task and len(val_idx) == 30
    held_out = round(0.05 * len(task))
    texts = {task.prompt(i).text for i in val_idx}
    assert not texts & {task.prompt(i).text for i in train_idx}  # no held-out text is trained on
    everything = load_config("tiny_cpu", ["data.train.split_validation_size=0.05", "grpo.max_val_samples=null"])
    _, all_val, _ = validation_split(everything, task)
    assert len(all_val) == held_out and all_val[:30] == val_idx


def test_no_tis_ratio_is_fine_without_truncation():
    """NeMo-RL's YAMLs set truncated_importance_sampling_ratio: null when no truncation is used."""
    from jetrl_megatron.rl.grpo import importance_weights
    from jetrl_megatron.rl.metrics import nemo_rl_mismatch_metrics

    g = torch.Generator().manual_seed(3)
    lt, lg = torch.randn(4, 6, generator=g) * 0.1 - 1, torch.randn(4, 6, generator=g) * 0.1 - 1
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    w, _ = importance_weights(lt, lg, mask, kind=None, ratio_max=None, ratio_min=None)
    torch.testing.assert_close(w, torch.exp(lt - lg) * mask)
    m = nemo_rl_mismatch_metrics(lt, lg, mask, tis_type=None, tis_ratio=None)
    assert all(v == v for v in m.values()) and "mismatch/is_oob_ratio" not in m
    cfg = load_config("tiny_cpu", ["loss_fn.truncated_importance_sampling_ratio=null"])
    assert cfg.loss_fn.truncated_importance_sampling_ratio is None
    import pytest

    from jetrl_megatron.rl.config import ConfigError

    with pytest.raises(ConfigError, match="truncated_importance_sampling_ratio: required"):
        load_config("tiny_cpu", ["loss_fn.truncated_importance_sampling_ratio=null",
                                 "loss_fn.use_importance_sampling_correction=true",
                                 "loss_fn.truncated_importance_sampling_type=tis"])
