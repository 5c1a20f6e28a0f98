"""The experiment-only stressed arms: arm names and overrides, the refusals that keep them out of production runs
(GPU recipes, other arms, the final probe), and the dose-response report on synthetic runs (hand-set numbers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetrl_megatron.rl.config import load_config
from jetrl_megatron.rl.stress_arms import (
    StressConfigError,
    compare_arm_overrides,
    is_compare_arm,
    parse_arm,
    rollout_stress,
    stressed_arm_names,
    trainer_stress,
)
from jetrl_megatron.rl.tools import compare, dose_response

NO_PROBE = ["policy.jet_rl.final_arm_probe=false"]


def test_arm_names_parse():
    assert parse_arm("offpolicy_int4_tensor") == ("int4_tensor", False)
    assert parse_arm("unified_mxfp4") == ("mxfp4", True)
    assert parse_arm("unified_fp3") is None and parse_arm("bf16") is None and parse_arm("offpolicy") is None
    assert is_compare_arm("bf16") and is_compare_arm("jetrl") and is_compare_arm("offpolicy_nvfp4")
    assert not is_compare_arm("unified_fp3")
    assert stressed_arm_names(["mxfp4"]) == ["offpolicy_mxfp4", "unified_mxfp4"]


@pytest.mark.parametrize("arm,fmt,trains", [("offpolicy_mxfp4", "mxfp4", False),
                                            ("unified_int4_g128", "int4_g128", True), ("bf16", None, False)])
def test_arm_overrides_select_the_stress_keys_on_the_bf16_arm(arm, fmt, trains):
    cfg = load_config("tiny_cpu", [*compare_arm_overrides(arm), *NO_PROBE])
    assert cfg.arm == "bf16"
    assert rollout_stress(cfg) == fmt
    assert (trainer_stress(cfg).name if trainer_stress(cfg) else None) == (fmt if trains else None)


def test_compare_runs_of_stressed_arms_carry_the_stress_keys(tmp_path):
    ov = compare.arm_overrides(tmp_path, "unified_mxfp4", 42)
    assert "policy.jet_rl.stress.format=mxfp4" in ov and "policy.jet_rl.stress.trainer=true" in ov
    assert "policy.jet_rl.arm=bf16" in ov
    assert "policy.jet_rl.stress.format=null" in compare.arm_overrides(tmp_path, "jetrl", 42)


@pytest.mark.parametrize("arm,overrides,match", [
    ("bf16", ["policy.jet_rl.stress.format=mxfp4"], "final_arm_probe"),  # tiny_cpu runs the probe
    ("bf16", ["policy.jet_rl.stress.format=fp3", *NO_PROBE], r"'fp3' is not one of \[.*'mxfp4'"),
    ("bf16", ["policy.jet_rl.stress.trainer=true", *NO_PROBE], "needs policy.jet_rl.stress.format"),
    ("jetrl", ["policy.jet_rl.stress.format=mxfp4", *NO_PROBE], r"built on the bf16 arm .*, got arm 'jetrl'"),
])
def test_stress_keys_are_refused_outside_the_experiment(arm, overrides, match):
    from jetrl_megatron.rl.config import arm_overrides

    with pytest.raises(StressConfigError, match=match):
        load_config("tiny_cpu", [*arm_overrides(arm), *overrides])


def test_gpu_recipes_refuse_stress_formats_unless_one_gpu_opts_in():
    with pytest.raises(StressConfigError, match=r"refused in GPU recipes \(cluster.gpus_per_node = 1\)"):
        load_config("tiny_cpu", [*compare_arm_overrides("offpolicy_mxfp4"), *NO_PROBE, "cluster.gpus_per_node=1"])
    with pytest.raises(StressConfigError, match="set policy.jet_rl.stress.gpu=true"):
        load_config("count_150m_gpu", [*compare_arm_overrides("unified_mxfp4"), *NO_PROBE])
    cfg = load_config("count_150m_gpu", [*compare_arm_overrides("offpolicy_int4_tensor"), *NO_PROBE,
                                         "policy.jet_rl.stress.gpu=true"])
    assert cfg.policy.jet_rl.stress.format == "int4_tensor" and cfg.arm == "bf16"
    with pytest.raises(StressConfigError, match=r"runs on one GPU, the recipe asks for 1 node\(s\) x 2 GPUs"):
        load_config("count_150m_gpu", [*compare_arm_overrides("offpolicy_int4_tensor"), *NO_PROBE,
                                       "policy.jet_rl.stress.gpu=true", "cluster.gpus_per_node=2"])


# ------------------------------------------------------------------------------------------------ the report

SEEDS = (42, 43, 44)


def _run(root: Path, arm: str, seed: int, start: float, end: float, k3: float, bf16_end: float | None) -> Path:
    d = compare.run_dir(root, arm, seed)
    d.mkdir(parents=True)
    rows = [{"step": 0, "val/accuracy": start, "val/accuracy_sampled": start / 2},
            {"step": 1, "mismatch/k3_kl": k3, "mismatch/token_mult_prob_error": 1 + k3},
            {"step": 2, "mismatch/k3_kl": k3, "mismatch/token_mult_prob_error": 1 + k3,
             "val/accuracy": end, "val/accuracy_sampled": end / 2}]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    summary = {"ok": True}
    if bf16_end is not None:
        summary.update({"val_bf16/accuracy": bf16_end, "val_bf16/accuracy_sampled": bf16_end / 2})
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def _compare_dir(tmp_path: Path, off_bf16_end: list[float], uni_end: list[float]) -> Path:
    """bf16 ends 0.80/0.82/0.84 from 0.70; the off-policy arm's BF16-served ends are given (its own validation is
    lower: the format's inference error); the unified arm starts from 0.60 in its format and ends at ``uni_end``; a
    production jetrl arm rides along (a GPU round runs all arms; the dose-response leaves it to compare.md)."""
    runs = {"bf16": {}, "offpolicy_int4_tensor": {}, "unified_int4_tensor": {}, "jetrl": {}}
    for i, seed in enumerate(SEEDS):
        runs["jetrl"][seed] = _run(tmp_path, "jetrl", seed, 0.70, 0.10, 1e-5, None)
        runs["bf16"][seed] = _run(tmp_path, "bf16", seed, 0.70, 0.80 + 0.02 * i, 0.0, None)
        runs["offpolicy_int4_tensor"][seed] = _run(tmp_path, "offpolicy_int4_tensor", seed, 0.60,
                                                   off_bf16_end[i] - 0.1, 0.01, off_bf16_end[i])
        runs["unified_int4_tensor"][seed] = _run(tmp_path, "unified_int4_tensor", seed, 0.60, uni_end[i], 0.0,
                                                 uni_end[i] + 0.05)
    agg = compare.aggregate(runs)
    meta = {"recipe": "tiny_cpu", "overrides": [], "steps": 2, "seeds": list(SEEDS), "arms": list(runs),
            "warmstart": "w", "wall_s": 1.0}
    (tmp_path / "compare.json").write_text(json.dumps({"meta": meta, "arms": agg}))
    return tmp_path


def test_report_names_the_level_where_off_policy_falls_below(tmp_path):
    d = _compare_dir(tmp_path, off_bf16_end=[0.70, 0.72, 0.75], uni_end=[0.70, 0.72, 0.74])
    points = {p["arm"]: p for p in dose_response.points_of(json.loads((d / "compare.json").read_text())["arms"])}
    assert sorted(points) == ["bf16", "offpolicy_int4_tensor", "unified_int4_tensor"]  # jetrl: compare.md's
    off, uni, base = points["offpolicy_int4_tensor"], points["unified_int4_tensor"], points["bf16"]
    assert off["greedy_start"]["mean"] == pytest.approx(0.70)  # the warm start's BF16 validation (bf16's step 0)
    assert off["greedy_end"]["max"] == pytest.approx(0.75)  # BF16-served, not its own (stressed) validation
    assert uni["greedy_gain"]["mean"] == pytest.approx(0.12)  # its own start (0.60) -> end in its format
    assert base["greedy_gain"]["mean"] == pytest.approx(0.12)
    text = dose_response.verdict(list(points.values()))
    assert "first falls below BF16 beyond the seed spread at k3 1.00e-02" in text
    assert "gains as BF16 does, within the spread" in text
    paths = dose_response.report(d)
    assert paths["png"].stat().st_size > 0 and "below beyond spread" in paths["md"].read_text()


def test_report_says_null_when_ranges_overlap(tmp_path):
    d = _compare_dir(tmp_path, off_bf16_end=[0.79, 0.81, 0.83], uni_end=[0.60, 0.62, 0.63])
    arms = json.loads((d / "compare.json").read_text())["arms"]
    for a in arms.values():  # committed copies: the recorded log dirs are gone, <arm>/seed<N> under the root remain
        a["log_dirs"] = {s: f"/nonexistent/{s}" for s in a["log_dirs"]}
    points = dose_response.points_of(arms, d)
    text = dose_response.verdict(points)
    assert text.startswith("No off-policy arm ended below BF16 beyond the seed spread up to k3 1.00e-02")
    uni = next(p for p in points if p["arm"] == "unified_int4_tensor")
    assert dose_response.compared(uni, next(p for p in points if p["arm"] == "bf16"))[2] is True  # gains 0.02 < 0.10


def test_report_judges_the_greedy_reward_too_where_answers_earn_partial_credit(tmp_path):
    """Exact accuracy overlapping (null) while the off-policy arm's greedy reward ends below BF16's whole range: the
    report keeps the pre-registered verdict and adds the reward's, which names the level."""
    d = _compare_dir(tmp_path, off_bf16_end=[0.79, 0.81, 0.83], uni_end=[0.70, 0.72, 0.74])
    for arm, ends in (("bf16", [0.50, 0.52, 0.54]), ("offpolicy_int4_tensor", [0.40, 0.42, 0.44]),
                      ("unified_int4_tensor", [0.49, 0.50, 0.53])):
        for seed, end in zip(SEEDS, ends, strict=True):
            run = compare.run_dir(d, arm, seed)
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            rows[0]["val/reward"], rows[-1]["val/reward"] = 0.40, end + (0.1 if arm.startswith("off") else 0.0)
            (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
            if arm.startswith("off"):  # the trainer's policy, served in BF16 at the end (rl/stress_eval.py)
                summary = json.loads((run / "summary.json").read_text())
                (run / "summary.json").write_text(json.dumps({**summary, "val_bf16/reward": end}))
    points = dose_response.points_of(json.loads((d / "compare.json").read_text())["arms"])
    off = next(p for p in points if p["arm"] == "offpolicy_int4_tensor")
    assert off["reward_end"]["max"] == pytest.approx(0.44) and off["reward_start"]["mean"] == pytest.approx(0.40)
    assert dose_response.verdict(points).startswith("No off-policy arm ended below BF16")
    text = dose_response.verdict(points, "reward")
    assert "first falls below BF16 beyond the seed spread at k3 1.00e-02" in text and "greedy reward at the end" in text
    md = dose_response.report(d)["md"].read_text()
    assert "On the greedy reward: The off-policy arm first falls below" in md
    assert "0.400 ± 0.000 -> 0.520 ± 0.020 (0.500..0.540)" in md  # bf16's row: reward start -> end
