"""keep_top_k by a metric (NeMo-RL's CheckpointManager semantics) against an independent pairwise reference.

Why a pairwise reference: the implementation sorts by a key with +-inf for missing values; the reference instead
counts, for each checkpoint, how many others beat it under the rules written out one by one, so a wrong sentinel,
sort direction or tie-break shows up as a difference."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from jetrl_megatron.rl.outputs.checkpoint_format import (
    NEMO_RL_CHECKPOINT_METRICS,
    checkpoints_to_remove,
    nemo_rl_metric_names,
    read_checkpoint_metrics,
    write_checkpoint_metrics,
)

METRIC = "val:accuracy"


def _make(root: Path, step: int, metrics: dict[str, float] | None, complete: bool = True) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    if metrics is not None:
        (d / "metrics.json").write_text(json.dumps(metrics))
    if complete:
        (d / "COMPLETE").write_text("")
    return d


def _beats(a: tuple[int, float | None], b: tuple[int, float | None], higher_is_better: bool) -> bool:
    """Whether checkpoint a (step, value) ranks above b: having the metric beats lacking it; a better value beats a
    worse one; otherwise (equal values, or both missing) the newer step wins."""
    (sa, va), (sb, vb) = a, b
    if (va is None) != (vb is None):
        return va is not None
    if va is not None and va != vb:
        return va > vb if higher_is_better else va < vb
    return sa > sb


def _reference(ckpts: list[tuple[int, float | None]], k: int, by_metric: bool, higher_is_better: bool) -> list[int]:
    """Steps to remove: those with at least k checkpoints ranked above them, except the newest step."""
    newest = max(s for s, _ in ckpts)
    out = []
    for c in ckpts:
        if by_metric:
            above = sum(_beats(o, c, higher_is_better) for o in ckpts if o is not c)
        else:
            above = sum(o[0] > c[0] for o in ckpts)
        if above >= k and c[0] != newest:
            out.append(c[0])
    return sorted(out)


def _random_case(root: Path, rng: random.Random) -> list[tuple[int, float | None]]:
    """Complete checkpoints at random distinct steps with values from a small set (ties), some missing the metric
    (no metrics.json, or a metrics.json without it); plus incomplete directories that must never be touched."""
    steps = sorted(rng.sample(range(1, 200), rng.randint(1, 12)))
    ckpts = []
    for s in steps:
        kind = rng.random()
        if kind < 0.15:
            _make(root, s, None)
            ckpts.append((s, None))
        elif kind < 0.3:
            _make(root, s, {"train:reward": rng.random()})
            ckpts.append((s, None))
        else:
            v = float(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0, rng.random()]))
            _make(root, s, {METRIC: v, "train:reward": rng.random()})
            ckpts.append((s, v))
    for s in rng.sample([x for x in range(200, 260)], 2):
        _make(root, s, {METRIC: 99.0}, complete=False)  # newer but not COMPLETE: neither kept-counted nor removed
    (root / f"step_{steps[-1] + 1}.tmp").mkdir()
    return ckpts


@pytest.mark.parametrize("higher_is_better", [True, False])
@pytest.mark.parametrize("by_metric", [True, False])
def test_random_against_reference(tmp_path, higher_is_better, by_metric):
    rng = random.Random(2 * higher_is_better + by_metric)
    for trial in range(60):
        root = tmp_path / f"t{trial}"
        ckpts = _random_case(root, rng)
        k = rng.randint(0, len(ckpts) + 2)
        got = checkpoints_to_remove(root, k, METRIC if by_metric else None, higher_is_better)
        want = _reference(ckpts, k, by_metric, higher_is_better)
        assert [int(p.name[5:]) for p in got] == want, (trial, k, ckpts)
        assert all(p.parent == root and (p / "COMPLETE").exists() for p in got)


def test_hand_case_higher_is_better(tmp_path):
    """val:accuracy 0.5, 0.9, 0.9, missing, 0.1 at steps 10..50, k=2: keep 30 and 20 (ties -> newer first) and the
    newest (50) even though it ranks last; a newest-k rule would keep 40 and 50 instead."""
    for s, v in [(10, 0.5), (20, 0.9), (30, 0.9), (40, None), (50, 0.1)]:
        _make(tmp_path, s, {METRIC: v} if v is not None else {})
    got = [p.name for p in checkpoints_to_remove(tmp_path, 2, METRIC, True)]
    assert got == ["step_10", "step_40"]
    got = [p.name for p in checkpoints_to_remove(tmp_path, 2, METRIC, False)]  # lower better: 50 (0.1), 10 (0.5)
    assert got == ["step_20", "step_30", "step_40"]
    got = [p.name for p in checkpoints_to_remove(tmp_path, 2, None, True)]
    assert got == ["step_10", "step_20", "step_30"]


def test_missing_metric_everywhere_keeps_newest_k(tmp_path):
    """A val metric that no checkpoint has (no validation ran): all tie as missing, so the newer ones are kept."""
    for s in (1, 2, 3, 4):
        _make(tmp_path, s, {"train:reward": float(s)})
    got = [p.name for p in checkpoints_to_remove(tmp_path, 2, METRIC, True)]
    assert got == ["step_1", "step_2"]


def test_k_at_least_count_and_none(tmp_path):
    for s in (1, 2, 3):
        _make(tmp_path, s, {METRIC: float(-s)})
    assert checkpoints_to_remove(tmp_path, 3, METRIC, True) == []
    assert checkpoints_to_remove(tmp_path, 7, None, True) == []
    assert checkpoints_to_remove(tmp_path, None, METRIC, True) == []
    assert checkpoints_to_remove(tmp_path / "absent", 1, METRIC, True) == []
    with pytest.raises(ValueError):
        checkpoints_to_remove(tmp_path, -1, METRIC, True)


def test_write_read_metrics(tmp_path):
    write_checkpoint_metrics(tmp_path, {"val:accuracy": 0.75, "train:loss": float("nan"), "train:reward": 1})
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"val:accuracy": 0.75, "train:reward": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]  # no temp file left behind
    write_checkpoint_metrics(tmp_path, {"val:accuracy": 0.5})
    assert read_checkpoint_metrics(tmp_path) == {"val:accuracy": 0.5}
    (tmp_path / "metrics.json").write_text("{not json")
    assert read_checkpoint_metrics(tmp_path) == {}


def test_nemo_rl_metric_names():
    train = {"reward/mean": 0.4, "reward/std": 0.1, "reward/accuracy": 0.3, "train/loss": 1.5,
             "mismatch/k3_kl": 1e-4}
    val = {"val/reward": 0.6, "val/accuracy": 0.55, "val/reward_sampled": 0.5, "val/accuracy_sampled": 0.45}
    want_train = {"train:reward": 0.4, "train:total_reward/mean": 0.4, "train:loss": 1.5}
    assert nemo_rl_metric_names(train, None) == want_train  # no validation this step: no val:* names
    assert nemo_rl_metric_names(train, {}) == want_train
    want = {**want_train, "val:accuracy": 0.45, "val:total_reward/mean": 0.5}  # sampled, as NeMo-RL validates
    assert nemo_rl_metric_names(train, val) == want
    assert nemo_rl_metric_names({**train, **val}, None) == want  # the loop's merged dict
    assert nemo_rl_metric_names({**train, "train/loss": float("nan")}, val).get("train:loss") is None
    assert set(want) == set(NEMO_RL_CHECKPOINT_METRICS)
    assert all(n.split(":", 1)[0] in ("train", "val") for n in NEMO_RL_CHECKPOINT_METRICS)
