"""The one-step profile (``policy.jet_rl.profile_step``): only the chosen step is profiled, its phases appear as
ranges, and the top operators are the ones that really ran, ranked by their own time."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import record_function

from jetrl_megatron.rl.outputs.step_profile import StepProfile


def _work(n: int) -> None:
    a = torch.randn(n, n)
    with record_function("phase/update"):
        for _ in range(3):
            a = torch.mm(a, a) / n
    with record_function("phase/refit"):
        torch.relu(a)


def test_only_the_chosen_step_is_profiled_and_its_table_names_what_ran(tmp_path):
    prof = StepProfile(2, tmp_path, top=5)
    with prof.around(1):
        _work(64)
    assert not list(tmp_path.iterdir())
    with prof.around(2):
        _work(256)
    report = json.loads((tmp_path / "profile_step2.json").read_text())
    names = {r["name"] for r in report["ranges"]}
    assert {"phase/update", "phase/refit"} <= names
    # ranked by own time (which op comes first is the scheduler's business on a busy box: measured, not asserted);
    # the three GEMMs are there, counted once each, and their time is what the profiler measured
    top = report["top"]
    assert report["sorted_by"] == "self_cpu_ms" and [r["self_cpu_ms"] for r in top] == sorted(
        (r["self_cpu_ms"] for r in top), reverse=True)
    mm = next(r for r in top if r["name"] == "aten::mm")
    assert mm["calls"] == 3 and mm["self_cpu_ms"] > 0 and 0 < len(top) <= 5
    assert not any(r["name"].startswith("phase/") for r in report["top"])
    md = (tmp_path / "profile_step2.md").read_text()
    assert "| phase/update | 1 |" in md and "aten::mm" in md


def test_a_negative_step_is_refused_by_its_key():
    with pytest.raises(ValueError, match="policy.jet_rl.profile_step"):
        StepProfile(-1, ".")
