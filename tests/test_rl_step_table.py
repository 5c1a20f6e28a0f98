"""bench/step_table.py, the side-by-side table of GRPO runs (the rl layer's metrics.jsonl and step profiles): it
reads each run's own last metrics row and its last profile's windows."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import step_table  # noqa: E402

COMMITTED = ROOT / "bench" / "qwen3_8b_1gpu" / "20261206c_h100"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_the_committed_8b_runs_table_their_own_last_step():
    runs = sorted(p for p in COMMITTED.iterdir() if (p / "metrics.jsonl").exists())
    assert len(runs) == 2
    lines = step_table.table(runs).splitlines()
    head = _cells(lines[0])
    for run, line in zip(runs, lines[2:], strict=True):
        row = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
        cells = dict(zip(head, _cells(line), strict=True))
        assert cells["run"] == run.name
        assert float(cells["update s"]) == pytest.approx(row["time/update"], abs=0.006)
        assert float(cells["step s"]) == pytest.approx(row["time/step"], abs=0.006)
        # profiles written before the per-phase windows existed: no busy share to show
        assert cells["update busy"] == "-"


def test_a_profiled_run_shows_the_busy_share_of_its_windows(tmp_path):
    run = tmp_path / "len4096_jetrl"
    run.mkdir()
    rows = [{"step": 1, "time/update": 30.0}, {"step": 2, "time/update": 20.5, "mismatch/k3_kl": 0.0}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    windows = {"update": {"busy_ms": 300.0, "wall_ms": 400.0}, "logprob": {"busy_ms": 95.0, "wall_ms": 100.0},
               "update/after_pass": {"busy_ms": 10.0, "wall_ms": 3000.0}}
    (run / "profile_step1.json").write_text(json.dumps({"windows": {}}))
    (run / "profile_step2.json").write_text(json.dumps({"windows": windows}))
    rows[-1]["time/optimizer"] = 3.0
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    lines = step_table.table([run]).splitlines()
    cells = dict(zip(_cells(lines[0]), _cells(lines[2]), strict=True))
    assert cells["step"] == "2" and cells["update s"] == "20.50" and cells["k3"] == "0.00"
    # the last profile's micro-batch stretches, not the optimizer step after them
    assert cells["profiled step"] == "2" and cells["update fwd+bwd s"] == "17.50"
    assert cells["update busy"] == "75% of 400 ms" and cells["logprob busy"] == "95% of 100 ms"
    assert cells["rollout s"] == "-"


def test_a_missing_directory_is_named(tmp_path, capsys):
    assert step_table.main([str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_later_steps_give_the_median_and_range_of_the_forward_backward(tmp_path):
    """Steps after the first: update minus optimizer, median [min-max] n; step 1 (JIT, first touch) left out."""
    run = tmp_path / "len1024_jetrl_calling"
    run.mkdir()
    rng = random.Random(7)
    rows = [{"step": k, "time/update": rng.uniform(5, 12), "time/optimizer": rng.uniform(2, 3)} for k in range(1, 6)]
    rows.insert(3, {"step": 0, "time/update": 99.0, "time/optimizer": 1.0})  # a warm-start row: not a GRPO step
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    want = sorted(r["time/update"] - r["time/optimizer"] for r in rows if r["step"] > 1)
    lines = step_table.table([run]).splitlines()
    cell = dict(zip(_cells(lines[0]), _cells(lines[2]), strict=True))["fwd+bwd steps 2+ s"]
    assert cell == f"{(want[1] + want[2]) / 2:.2f} [{want[0]:.2f}-{want[-1]:.2f}] n=4"
    only_first = tmp_path / "one_step"
    only_first.mkdir()
    (only_first / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    lines = step_table.table([only_first]).splitlines()
    assert dict(zip(_cells(lines[0]), _cells(lines[2]), strict=True))["fwd+bwd steps 2+ s"] == "-"
