"""The one-step profile (``policy.jet_rl.profile_step``): only the chosen step is profiled, its phases appear as
ranges, and the top operators are the ones that really ran, ranked by their own time; only the chosen phases and,
in them, the first micro-batches of each pass and what follows it are recorded (``profile_phases``,
``profile_micro_batches``)."""

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


def _marked(name: str) -> None:
    """An operator of a known name, so the table says whether that piece of work was recorded."""
    with record_function(name):
        torch.relu(torch.ones(4))


def _step(prof: StepProfile, micro_batches: int) -> None:
    """A step as the loop runs it: phases opened around the work, passes telling where they stand."""
    for phase in ("rollout", "logprob", "update", "refit"):
        with record_function(f"phase/{phase}"), prof.phase(phase):
            if phase in ("logprob", "update"):
                for i in range(micro_batches):
                    prof.micro_batch(i)
                    _marked(f"{phase}_mb{i}")
                prof.micro_batches_done()
            _marked(f"{phase}_after")


@pytest.mark.parametrize("window", [2, 0])
def test_the_window_records_the_chosen_phases_and_their_first_micro_batches(tmp_path, window):
    prof = StepProfile(1, tmp_path, top=100, phases=("logprob", "update"), micro_batches=window)
    with prof.around(1):
        _step(prof, 5)
    report = json.loads((tmp_path / "profile_step1.json").read_text())
    seen = {r["name"] for r in report["ranges"] + report["top"]}
    kept = window or 5
    for phase in ("logprob", "update"):
        assert {f"{phase}_mb{i}" for i in range(5)} & seen == {f"{phase}_mb{i}" for i in range(kept)}
        assert f"{phase}_after" in seen  # recording resumes when the pass is done (the optimizer step)
    # a phase left out is not recorded inside, but its wall time is, as every phase's
    assert "rollout_after" not in seen and "refit_after" not in seen
    assert {f"phase/{p}" for p in ("rollout", "logprob", "update", "refit")} <= seen
    assert report["recorded"]["rollout"] == "rollout: not recorded (wall time only)"
    assert report["recorded"]["update"] == ("update: whole (5 micro-batches)" if not window else
                                            "update: 2 of its 5 micro-batches (the first of each pass), and what "
                                            "follows each pass")
    assert report["recorded"]["update"] in (tmp_path / "profile_step1.md").read_text()


def test_a_profiler_that_cannot_pause_records_the_whole_step_and_says_so(tmp_path, monkeypatch):
    from torch.profiler import profile

    def refuse(self, enable, activities):
        raise RuntimeError("collection toggling not supported")

    monkeypatch.setattr(profile, "toggle_collection_dynamic", refuse)
    prof = StepProfile(1, tmp_path, top=100, micro_batches=1)
    with pytest.warns(UserWarning, match="could not pause its collection"), prof.around(1):
        _step(prof, 3)
    report = json.loads((tmp_path / "profile_step1.json").read_text())
    seen = {r["name"] for r in report["ranges"] + report["top"]}
    assert {"rollout_after", "update_mb2", "refit_after"} <= seen
    assert report["recorded"]["update"] == ("update: whole (the profiler could not pause: collection toggling not "
                                            "supported)")


def test_outside_the_profiled_step_the_calls_do_nothing(tmp_path):
    prof = StepProfile(2, tmp_path, micro_batches=1)
    with prof.around(1):
        _step(prof, 3)
    assert prof.windows == {} and not list(tmp_path.iterdir())


def test_a_negative_step_is_refused_by_its_key():
    with pytest.raises(ValueError, match="policy.jet_rl.profile_step"):
        StepProfile(-1, ".")


@pytest.mark.parametrize("kw, key", [({"phases": ("update", "optimizer")}, "profile_phases"),
                                     ({"phases": ()}, "profile_phases"),
                                     ({"micro_batches": -1}, "profile_micro_batches")])
def test_a_bad_window_is_refused_by_its_key(kw, key):
    with pytest.raises(ValueError, match=f"policy.jet_rl.{key}"):
        StepProfile(1, ".", **kw)


def test_the_copy_table_names_the_operator_above_each_copy_and_its_shapes(tmp_path):
    prof = StepProfile(1, tmp_path, top=5)
    x = torch.randn(48, 32)
    with prof.around(1), record_function("phase/update"):
        for _ in range(3):
            with record_function("my_transposer"):
                x.t().contiguous()
        with record_function("my_caster"):
            x.to(torch.float64)
    rows = json.loads((tmp_path / "profile_step1.json").read_text())["copies"]
    transposes = [r for r in rows if "my_transposer" in r["origin"]]
    casts = [r for r in rows if "my_caster" in r["origin"]]
    # three transposes of one (32, 48) view (one group) and one cast, each under the range that launched it
    assert len(transposes) == 1 and transposes[0]["calls"] == 3 and "32, 48" in transposes[0]["shapes"]
    assert len(casts) == 1 and casts[0]["calls"] == 1 and "48, 32" in casts[0]["shapes"]
    assert transposes[0]["origin"].index("aten::") < transposes[0]["origin"].index("my_transposer")
    md = (tmp_path / "profile_step1.md").read_text()
    assert "Copies and casts (`aten::copy_`) by origin" in md and "my_transposer" in md
