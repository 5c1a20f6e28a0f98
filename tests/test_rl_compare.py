"""`jetrl compare`: the aggregation across arms and seeds (synthetic runs, checked against numpy) and one real,
short end-to-end comparison on tiny_cpu (one BF16 warm start, 2 arms x 2 seeds)."""

import json
import math
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from small_run import small_run
from warm_cli import run_cli

from jetrl_megatron.rl.config import load_config
from jetrl_megatron.rl.tools import compare

ARMS = ("bf16", "bf16_train_fp8_rollout", "jetrl")
SEEDS = (42, 43, 44)
STEPS = 8
VAL_PERIOD = 4
BINS = ((0, 1), (1, 2), (2, 4))
MM = ("k3_kl", "token_mult_prob_error", "max_abs_logp_diff", "abs_dp_max")


def _rows(rng: np.random.Generator, sampled: bool) -> list[dict]:
    """One run's metrics.jsonl rows: validation at step 0 and every VAL_PERIOD steps, mismatch overall + per bin."""
    def val():
        v = {"val/accuracy": rng.random(), "val/reward": rng.random()}
        if sampled:
            v.update({"val/accuracy_sampled": rng.random(), "val/reward_sampled": rng.random()})
        return v

    rows = [{"step": 0, **val()}]
    for step in range(1, STEPS + 1):
        r = {"step": step, "reward/mean": rng.random(), "reward/accuracy": rng.random(), "time/step": rng.random() + 1,
             "mismatch/kl": rng.random()}  # a mismatch key the harness does not track
        for name in MM:
            r[f"mismatch/{name}"] = rng.random() * 1e-3
            for lo, hi in BINS:
                r[f"mismatch/{name}/pos_{lo}_{hi}"] = rng.random() * 1e-3
        if step % VAL_PERIOD == 0:
            r.update(val())
        rows.append(r)
    return rows


def _write(d: Path, rows: list[dict]) -> Path:
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"ok": True, "recipe": "tiny_cpu", "steps": STEPS}))
    return d


@pytest.fixture
def runs(tmp_path):
    """3 arms x 3 seeds of random metrics; sampled validation only in the jetrl arm (it is a new key)."""
    rng = np.random.default_rng(0)
    data = {a: {s: _rows(rng, sampled=a == "jetrl") for s in SEEDS} for a in ARMS}
    dirs = {a: {s: _write(tmp_path / a / f"seed{s}", data[a][s]) for s in SEEDS} for a in ARMS}
    return data, dirs


def _np_stats(v: list[float]) -> dict:
    a = np.asarray(v)
    return {"mean": a.mean(), "std": a.std(ddof=1), "min": a.min(), "max": a.max(), "n": a.size}


def _close(got: dict, want: dict) -> None:
    for k in ("mean", "std", "min", "max"):
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-15), (k, got, want)
    assert got["n"] == want["n"]


def test_step_curves_match_numpy(runs):
    data, dirs = runs
    agg = compare.aggregate(dirs)
    assert list(agg) == list(ARMS)
    for arm in ARMS:
        for key in ("reward/mean", "reward/accuracy", "val/accuracy", "val/reward", "mismatch/k3_kl"):
            curve = agg[arm]["curves"][key]
            steps = [r["step"] for r in data[arm][SEEDS[0]] if key in r]
            assert [p["step"] for p in curve] == steps
            for p in curve:
                vals = [next(r[key] for r in data[arm][s] if r["step"] == p["step"]) for s in SEEDS]
                _close(p, _np_stats(vals))


def test_endpoints_quarters_mismatch_and_step_time_match_numpy(runs):
    data, dirs = runs
    agg = compare.aggregate(dirs)
    for arm in ARMS:
        a, rows = agg[arm], [data[arm][s] for s in SEEDS]
        assert a["seeds"] == list(SEEDS)
        val = [[r for r in rs if "val/accuracy" in r] for rs in rows]
        _close(a["val"]["val/accuracy@first"], _np_stats([v[0]["val/accuracy"] for v in val]))
        _close(a["val"]["val/reward@last"], _np_stats([v[-1]["val/reward"] for v in val]))
        assert a["val"]["val/accuracy@first"]["steps"] == [0] and a["val"]["val/accuracy@last"]["steps"] == [STEPS]
        k = STEPS // 4
        rewards = [[r["reward/mean"] for r in rs if r["step"] > 0] for rs in rows]
        _close(a["reward_first_quarter"], _np_stats([np.mean(x[:k]) for x in rewards]))
        _close(a["reward_last_quarter"], _np_stats([np.mean(x[-k:]) for x in rewards]))
        for name in MM:
            for key in [f"mismatch/{name}"] + [f"mismatch/{name}/pos_{lo}_{hi}" for lo, hi in BINS]:
                _close(a["mismatch"][key], _np_stats([np.mean([r[key] for r in rs if r["step"] > 0]) for rs in rows]))
        assert "mismatch/kl" not in a["mismatch"]
        _close(a["step_time"], _np_stats([np.mean([r["time/step"] for r in rs if r["step"] > 0]) for rs in rows]))


def test_missing_keys(runs, tmp_path):
    data, dirs = runs
    # a bin missing in one seed, a non-finite value logged as None in another
    rows = data["bf16"][43]
    for r in rows:
        r.pop("mismatch/k3_kl/pos_2_4", None)
    rows[3]["reward/mean"] = None
    (dirs["bf16"][43] / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    agg = compare.aggregate(dirs)
    a = agg["bf16"]
    key = "mismatch/k3_kl/pos_2_4"
    _close(a["mismatch"][key], _np_stats([np.mean([r[key] for r in data["bf16"][s] if r["step"] > 0])
                                          for s in (42, 44)]))
    step3 = next(p for p in a["curves"]["reward/mean"] if p["step"] == 3)
    _close(step3, _np_stats([data["bf16"][s][3]["reward/mean"] for s in (42, 44)]))
    # sampled validation: only the jetrl arm logged it
    assert "val/accuracy_sampled" not in a["curves"] and "val/accuracy_sampled@first" not in a["val"]
    assert "val/accuracy_sampled@last" in agg["jetrl"]["val"]
    table = compare.summary_table(agg)
    # bf16 logs no sampled validation: n/a in its sampled accuracy and sampled reward columns (first, last)
    assert "val acc sampled" in table and table.splitlines()[2].count("n/a") == 4
    # no arm with sampled validation: no sampled columns at all; one seed: no std, no crash
    only = compare.aggregate({"bf16": {42: dirs["bf16"][42]}})
    table = compare.summary_table(only)
    assert "sampled" not in table and "±" not in table
    assert only["bf16"]["reward_first_quarter"]["std"] is None


def test_tables_hold_the_numbers(runs):
    data, dirs = runs
    agg = compare.aggregate(dirs)
    table = compare.summary_table(agg)
    lines = table.splitlines()
    assert len(lines) == 2 + len(ARMS) and "val acc greedy @ step 0" in lines[0] and f"@ step {STEPS}" in lines[0]
    for arm, line in zip(ARMS, lines[2:], strict=True):
        rows = [data[arm][s] for s in SEEDS]
        v0 = [rs[0]["val/accuracy"] for rs in rows]
        k3 = [np.mean([r["mismatch/k3_kl"] for r in rs if r["step"] > 0]) for rs in rows]
        assert line.startswith(f"| {arm} | 3 | {np.mean(v0):.3f} ± {np.std(v0, ddof=1):.3f} |"), line
        assert f"| {np.mean(k3):.2e} ± {np.std(k3, ddof=1):.2e} |" in line
        assert " -> " in line
        r_last = [rs[-1]["val/reward"] for rs in rows]  # the reward is not the accuracy here: its own columns
        assert f"| {np.mean(r_last):.3f} ± {np.std(r_last, ddof=1):.3f} |" in line
    assert "val reward greedy @ step 0" in lines[0] and "val reward sampled @ step 0" in lines[0]
    for rs in (r for a in data.values() for r in a.values()):  # a binary task: reward == accuracy, no reward columns
        for row in rs:
            for key in [k for k in row if k.startswith("val/reward")]:
                row[key] = row[key.replace("reward", "accuracy")]
    binary = compare.aggregate({a: {s: _write(dirs[a][s].parent / f"bin{s}", data[a][s]) for s in SEEDS}
                                for a in ARMS})
    assert "reward greedy" not in compare.summary_table(binary).splitlines()[0]
    pos = compare.position_table(agg)
    assert pos.splitlines()[0] == "| arm | metric | pos 0 | pos 1 | pos 2-3 |"
    rows = [data["jetrl"][s] for s in SEEDS]
    tm = [np.mean([r["mismatch/token_mult_prob_error/pos_1_2"] for r in rs if r["step"] > 0]) for rs in rows]
    line = next(ln for ln in pos.splitlines() if ln.startswith("| jetrl | token_mult_prob_error |"))
    assert f"{np.mean(tm):.6f} ± {np.std(tm, ddof=1):.6f}" in line


def test_outputs_written_atomically(runs, tmp_path):
    _, dirs = runs
    agg = compare.aggregate(dirs)
    meta = {"recipe": "tiny_cpu", "steps": STEPS, "seeds": list(SEEDS), "arms": list(ARMS),
            "warmstart": "/x/warmstart/model", "wall_s": 12.0}
    out = tmp_path / "out"
    out.mkdir()
    paths = compare.write_outputs(agg, meta, out)
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    saved = json.loads(paths["json"].read_text())
    assert saved["meta"] == meta and list(saved["arms"]) == list(ARMS)
    assert saved["arms"]["jetrl"]["val"]["val/accuracy@first"]["n"] == 3
    md = paths["md"].read_text()
    assert compare.summary_table(agg) in md and compare.position_table(agg) in md
    assert "/x/warmstart/model" in md and "seeds [42, 43, 44]" in md
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "compare.md", "compare.png"]  # no temp files


def test_run_overrides_are_valid_and_fair(tmp_path):
    """Every arm's run differs from the others only by the arm; the warm start is BF16 and writes a model dir."""
    ws = load_config("tiny_cpu", compare.warmstart_overrides(tmp_path))
    assert ws.arm == "bf16" and ws.grpo.max_num_steps == 0
    assert ws.policy.jet_rl.sft_warmstart.save_model_dir == str(tmp_path / "warmstart" / "model")
    cfgs = {a: load_config("tiny_cpu", compare.arm_overrides(tmp_path, a, 7, "tiny")).to_dict() for a in ARMS}
    for a, c in cfgs.items():
        assert c["policy"]["model_name"] == str(tmp_path / "warmstart" / "model") and c["grpo"]["seed"] == 7
        assert c["policy"]["jet_rl"]["sft_warmstart"]["steps"] == 0 and c["policy"]["jet_rl"]["arm"] == a
    assert _differing_keys(cfgs["bf16"], cfgs["jetrl"]) <= ARM_KEYS | PATH_KEYS


def test_finished_needs_ok_and_same_config(tmp_path):
    cfg = {"grpo": {"seed": 42}}
    d = tmp_path / "run"
    d.mkdir()
    assert not compare.finished(d, cfg)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "summary.json").write_text(json.dumps({"ok": False}))
    assert not compare.finished(d, cfg)
    (d / "summary.json").write_text(json.dumps({"ok": True}))
    assert compare.finished(d, cfg) and not compare.finished(d, {"grpo": {"seed": 43}})


def test_a_cut_run_resumes_only_with_the_same_config_and_a_complete_checkpoint(tmp_path):
    d = tmp_path / "arm" / "seed42"
    ckpts = d / "checkpoints"
    cfg = {"grpo": {"seed": 42}, "checkpointing": {"enabled": True, "checkpoint_dir": str(ckpts)}}
    assert compare.resumable(d, cfg) is None  # nothing there
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert compare.resumable(d, cfg) is None  # cut before its first checkpoint
    (ckpts / "step_2").mkdir(parents=True)
    assert compare.resumable(d, cfg) is None  # a checkpoint being written (no COMPLETE mark) is none
    (ckpts / "step_2" / "COMPLETE").write_text("")
    (ckpts / "step_4.tmp").mkdir()
    assert compare.resumable(d, cfg) == ckpts / "step_2"
    (ckpts / "step_10").mkdir()
    (ckpts / "step_10" / "COMPLETE").write_text("")
    assert compare.resumable(d, cfg) == ckpts / "step_10"  # the newest complete one, by step number
    assert compare.resumable(d, {**cfg, "grpo": {"seed": 43}}) is None  # another configuration
    off = {**cfg, "checkpointing": {**cfg["checkpointing"], "enabled": False}}
    (d / "config.yaml").write_text(yaml.safe_dump(off))
    assert compare.resumable(d, off) is None  # checkpointing off: nothing to resume from by design
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "summary.json").write_text(json.dumps({"ok": True}))
    assert compare.resumable(d, cfg) is None  # finished: reused, not resumed


def test_reuse_continues_a_cut_run_and_keeps_each_parts_log(tmp_path, capsys):
    from jetrl_megatron.rl.tools.compare_runner import fresh_run_command

    d = tmp_path / "arm" / "seed42"
    cfg = {"grpo": {"seed": 42}, "checkpointing": {"enabled": True, "checkpoint_dir": str(d / "checkpoints")}}
    (d / "checkpoints" / "step_5").mkdir(parents=True)
    (d / "checkpoints" / "step_5" / "COMPLETE").write_text("")
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    log = d.with_suffix(".log")
    for part in (1, 2):
        log.write_text(f"part {part}\n")
        argv = fresh_run_command("tiny_cpu", d, ["grpo.seed=42"], cfg, reuse=True)
        assert argv == ["run", "--recipe", "tiny_cpu", "grpo.seed=42"]
        assert (d / "checkpoints" / "step_5" / "COMPLETE").exists() and not log.exists()
        assert (d.parent / f"seed42.part{part}.log").read_text() == f"part {part}\n"
        assert f"resuming {d} from step_5" in capsys.readouterr().out
    # without --reuse the run starts afresh: its earlier output (checkpoints included) is removed
    assert fresh_run_command("tiny_cpu", d, [], cfg, reuse=False) is not None and not d.exists()


# ------------------------------------------------------------------------------------------------ end to end

# keys the arm itself sets (NeMo-RL's switches that select it, and the restated arm) and the per-run paths
ARM_KEYS = {"policy.jet_rl.arm", "policy.megatron_cfg.fp8_cfg.enabled", "policy.generation.vllm_cfg.precision"}
PATH_KEYS = {"logger.log_dir", "checkpointing.checkpoint_dir"}
# validation before step 1 and after step 2 (val_period 2: not between; compare reads the first and the last)
FAST = small_run(3, val_period=2, max_num_steps=2, final_arm_probe=None)  # compare sets the probe itself


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _differing_keys(a: dict, b: dict) -> set[str]:
    fa, fb = _flat(a), _flat(b)
    return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, int | float) and not isinstance(x, bool):
        yield x


def _compare(out: Path, *extra: str, overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``extra``: flags; ``overrides``: config overrides after FAST's (the last of a key wins)."""
    args = ["compare", "--recipe", "tiny_cpu", "--arms", "bf16,jetrl", "--seeds", "2", "--out", str(out), *extra,
            *FAST, *overrides]
    r = run_cli(args, timeout=420, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    assert r.returncode == 0, f"jetrl {' '.join(args)}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return r


@pytest.mark.slow
def test_compare_e2e_shared_warmstart(tmp_path):
    out = tmp_path / "cmp"
    t0 = time.time()
    r = _compare(out, "--parallel", "2")  # the warm start alone, then the four arm runs two at a time
    print(f"jetrl compare, 1 warm start + 2 arms x 2 seeds: {time.time() - t0:.0f} s")
    assert "== [1/5] BF16 warm start" in r.stdout
    for arm in ("bf16", "jetrl"):
        for seed in (42, 43):
            assert f"== arm {arm} seed {seed} ended (exit 0)" in r.stdout
            # forked from the comparison's warm server (warm_process.py): its environment is the runs' own
            assert f"== arm {arm} seed {seed} started warm: -m jetrl_megatron.cli run" in r.stdout
            assert "validation before GRPO" in (out / arm / f"seed{seed}.log").read_text()  # each run's own log
    model = out / "warmstart" / "model"
    assert (model / "config.json").is_file() and (model / "model.safetensors").stat().st_size > 0
    ws = json.loads((out / "warmstart" / "summary.json").read_text())
    assert ws["ok"] and ws["steps"] == 0 and ws["mode"] == "bf16"

    configs = {}
    for arm in ("bf16", "jetrl"):
        for seed in (42, 43):
            d = out / arm / f"seed{seed}"
            c = configs[arm, seed] = yaml.safe_load((d / "config.yaml").read_text())
            assert c["policy"]["model_name"] == str(model) and c["policy"]["jet_rl"]["sft_warmstart"]["steps"] == 0
            assert c["grpo"]["seed"] == seed and c["policy"]["jet_rl"]["arm"] == arm
            assert json.loads((d / "summary.json").read_text())["ok"]
    for seed in (42, 43):  # the same seed: everything but the arm is the same (data order, sampling seeds, model)
        assert _differing_keys(configs["bf16", seed], configs["jetrl", seed]) <= ARM_KEYS | PATH_KEYS

    res = json.loads((out / "compare.json").read_text())
    assert res["meta"]["arms"] == ["bf16", "jetrl"] and res["meta"]["seeds"] == [42, 43]
    assert res["meta"]["warmstart"] == str(model)
    for arm in ("bf16", "jetrl"):
        a = res["arms"][arm]
        assert a["seeds"] == [42, 43] and a["steps"] == {"42": 2, "43": 2}
        assert [p["step"] for p in a["curves"]["reward/mean"]] == [1, 2]
        assert all(p["n"] == 2 for p in a["curves"]["reward/mean"])
        assert a["val"]["val/accuracy@first"]["steps"] == [0] and a["val"]["val/accuracy@last"]["steps"] == [2]
        assert a["val"]["val/accuracy@first"]["n"] == 2 and a["mismatch"]["mismatch/k3_kl"]["n"] == 2
        assert any("/pos_" in k for k in a["mismatch"]) and a["step_time"]["n"] == 2
    nums = list(_numbers(res["arms"]))
    assert nums and all(math.isfinite(x) for x in nums)
    md = (out / "compare.md").read_text()
    assert "| bf16 | 2 |" in md and "| jetrl | 2 |" in md and str(model) in md
    assert f"({ws['sft_steps']} supervised steps, last loss" in md and ws["sft_steps"] == 3
    assert md.split("\n\n")[0] in r.stdout  # the tables are printed
    assert (out / "compare.png").stat().st_size > 5000

    # --reuse: every run finished with the same configuration, so nothing runs again
    t1 = time.time()
    r2 = _compare(out, "--reuse")
    assert r2.stdout.count("reusing") == 5 and "jetrl_megatron.cli run" not in r2.stdout
    assert time.time() - t1 < 60

    # --reuse-from: a fresh output dir makes its warm start afresh; it is this one to the last bit (same weights
    # digest), so the three finished runs of `out` are adopted and only the one cut there (no summary) runs
    assert len(ws["weights_sha256"]) == 64
    (out / "jetrl" / "seed43" / "summary.json").unlink()
    out2 = tmp_path / "cmp2"
    r3 = _compare(out2, "--reuse-from", str(out))
    assert json.loads((out2 / "warmstart" / "summary.json").read_text())["weights_sha256"] == ws["weights_sha256"]
    assert "the same warm start (weights SHA-256 equal); adopted 3 of 4 finished runs" in r3.stdout
    ran = [ln for ln in r3.stdout.splitlines() if ln.startswith("   -m jetrl_megatron.cli run")]
    assert len(ran) == 2 and "logger.log_dir=" + str(out2 / "jetrl" / "seed43") in ran[1]  # the warm start, then it
    assert r3.stdout.count("reusing") == 3
    for arm, seed in (("bf16", 42), ("bf16", 43), ("jetrl", 42)):
        assert (out2 / arm / f"seed{seed}" / "metrics.jsonl").read_text() == \
            (out / arm / f"seed{seed}" / "metrics.jsonl").read_text()
    assert json.loads((out2 / "compare.json").read_text())["arms"]["jetrl"]["steps"] == {"42": 2, "43": 2}


@pytest.mark.slow
def test_compare_warmstart_only_stops_at_the_loss_target(tmp_path):
    """--warmstart-only writes the shared warm start and nothing else; stop_at_loss ends it at the first step whose
    window mean reaches the target (here a target any loss meets: the window's end), and --reuse keeps it."""
    out = tmp_path / "cmp"
    stop = ("policy.jet_rl.sft_warmstart.steps=40", "policy.jet_rl.sft_warmstart.stop_at_loss=1000",
            "policy.jet_rl.sft_warmstart.stop_window=4")
    r = _compare(out, "--warmstart-only", overrides=stop)
    assert "warm start ready" in r.stdout and "reached stop_at_loss 1000 at step 4 of at most 40" in r.stdout
    ws = json.loads((out / "warmstart" / "summary.json").read_text())
    assert ws["ok"] and ws["sft_steps"] == 4 and len(ws["sft_loss_curve"]) == 4
    # the loss is per response token: a random-init model (small logits) starts near a uniform guess, ln(vocab)
    vocab = json.loads((out / "warmstart" / "model" / "config.json").read_text())["vocab_size"]
    assert abs(ws["sft_loss_curve"][0] - math.log(vocab)) < 0.3, (ws["sft_loss_curve"][0], math.log(vocab))
    assert not (out / "bf16").exists() and not (out / "compare.json").exists()
    # a target no loss meets runs every step
    r = _compare(tmp_path / "cmp2", "--warmstart-only", overrides=(
        "policy.jet_rl.sft_warmstart.steps=5", "policy.jet_rl.sft_warmstart.stop_at_loss=1e-12",
        "policy.jet_rl.sft_warmstart.stop_window=2"))
    assert "reached stop_at_loss" not in r.stdout
    assert json.loads((tmp_path / "cmp2" / "warmstart" / "summary.json").read_text())["sft_steps"] == 5
    r = _compare(out, "--warmstart-only", "--reuse", overrides=stop)
    assert r.stdout.count("reusing") == 1


def test_stop_at_loss_range_is_checked():
    from jetrl_megatron.rl.config import ConfigError, load_config

    for bad in ("policy.jet_rl.sft_warmstart.stop_at_loss=0", "policy.jet_rl.sft_warmstart.stop_at_loss=-1",
                "policy.jet_rl.sft_warmstart.stop_window=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            load_config("tiny_cpu", [bad])


def test_compare_stops_at_a_failed_run(tmp_path, capsys):
    """A run that fails (here the warm start: no such model) stops the comparison with one line naming it."""
    from jetrl_megatron.cli import main

    rc = main(["compare", "--out", str(tmp_path), "--seeds", "1", f"policy.model_name={tmp_path / 'no_such_model'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "BF16 warm start failed (exit 2)" in err and str(tmp_path / "warmstart") in err
    assert not (tmp_path / "compare.json").exists()


# ------------------------------------------------------------------------------------------------ --reuse-from


def test_weights_digest_is_the_sha256_of_the_safetensors_bytes(tmp_path):
    import hashlib

    import torch

    from jetrl_megatron.rollout.model_dir import weights_sha256, write_model_dir

    g = torch.Generator().manual_seed(3)
    sd = {"a.weight": torch.randn(64, 32, generator=g).bfloat16(), "b.bias": torch.randn(32, generator=g)}
    d1 = Path(write_model_dir(tmp_path / "m1", {"x": 1}, sd))
    d2 = Path(write_model_dir(tmp_path / "m2", {"x": 2}, sd))  # another config.json: not part of the digest
    want = hashlib.sha256(b"model.safetensors\0" + (d1 / "model.safetensors").read_bytes()).hexdigest()
    assert weights_sha256(d1) == want == weights_sha256(d2)
    sd["a.weight"].view(torch.int16)[5, 7] += 1  # one element's last bit
    assert weights_sha256(write_model_dir(tmp_path / "m3", {"x": 1}, sd)) != want
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        weights_sha256(tmp_path)


def _warm(out: Path, **summary) -> Path:
    (out / "warmstart").mkdir(parents=True, exist_ok=True)
    (out / "warmstart" / "summary.json").write_text(json.dumps({"ok": True, "sft_steps": 3, **summary}))
    return out


def test_same_warmstart_by_digest_or_by_the_whole_loss_curve(tmp_path):
    curve = [5.1, 0.3, 0.0091]
    a = _warm(tmp_path / "a", weights_sha256="ab", sft_loss_curve=curve)
    assert compare.same_warmstart(a, _warm(tmp_path / "b", weights_sha256="ab", sft_loss_curve=[9.0]))[0]
    assert not compare.same_warmstart(a, _warm(tmp_path / "c", weights_sha256="cd", sft_loss_curve=curve))[0]
    old = _warm(tmp_path / "old", sft_loss_curve=curve)  # written before the digest existed
    assert compare.same_warmstart(old, _warm(tmp_path / "d", weights_sha256="ef", sft_loss_curve=list(curve)))[0]
    last_bit = [*curve[:2], float(np.nextafter(curve[2], 1.0))]
    same, why = compare.same_warmstart(old, _warm(tmp_path / "e", sft_loss_curve=last_bit))
    assert not same and "differ" in why
    assert not compare.same_warmstart(old, _warm(tmp_path / "f", sft_loss_curve=curve, sft_steps=4))[0]
    assert not compare.same_warmstart(old, _warm(tmp_path / "g", sft_loss_curve=curve, ok=False))[0]
    assert not compare.same_warmstart(old, tmp_path / "none")[0]


def _run(d: Path, cfg: dict, ok: bool | None = True) -> Path:
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.25}) + "\n")
    if ok is not None:
        (d / "summary.json").write_text(json.dumps({"ok": ok}))
    d.with_suffix(".log").write_text(f"log of {d.name}\n")
    return d


def test_adopt_takes_finished_runs_of_the_same_configuration_up_to_the_root(tmp_path):
    """A committed round keeps the paths of the machine it ran on (its warm start's model_dir says which); its finished
    runs are adopted where everything but that root is this comparison's configuration."""
    machine, src, out = "/machine/learn", tmp_path / "committed", tmp_path / "here"
    _warm(src, model_dir=f"{machine}/warmstart/model", sft_loss_curve=[1.0])

    def cfg(root: str, arm: str, seed: int, lr: float = 3e-5) -> dict:
        return {"grpo": {"seed": seed}, "policy": {"model_name": f"{root}/warmstart/model", "lr": lr, "arm": arm},
                "logger": {"log_dir": f"{root}/{arm}/seed{seed}"}}

    _run(src / "bf16" / "seed42", cfg(machine, "bf16", 42))
    _run(src / "jetrl" / "seed42", cfg(machine, "jetrl", 42, lr=1e-4))  # another learning rate
    _run(src / "jetrl" / "seed43", cfg(machine, "jetrl", 43), ok=None)  # cut before its summary
    _run(src / "bf16" / "seed43", cfg(machine, "bf16", 43), ok=False)  # failed
    runs = {out / a / f"seed{s}": cfg(str(out), a, s) for a in ("bf16", "jetrl") for s in (42, 43)}
    adopted = compare.adopt_finished_runs(src, out, runs)
    assert adopted == [out / "bf16" / "seed42"]
    assert compare.finished(out / "bf16" / "seed42", runs[out / "bf16" / "seed42"])
    assert (out / "bf16" / "seed42" / "metrics.jsonl").read_text() == (src / "bf16/seed42/metrics.jsonl").read_text()
    assert (out / "bf16" / "seed42.log").read_text() == "log of seed42\n"
    assert not (out / "jetrl").exists()
    assert compare.adopt_finished_runs(src, out, runs) == []  # already here and finished: nothing to copy


def test_adopt_from_removes_stale_runs_only_for_a_fresh_same_warmstart(tmp_path, capsys):
    from jetrl_megatron.rl.tools.compare_runner import adopt_from

    src, out = tmp_path / "src", tmp_path / "out"
    want = {"grpo": {"seed": 42}}
    _warm(src, weights_sha256="ab", model_dir=str(src / "warmstart" / "model"))
    _run(src / "bf16" / "seed42", want)
    stale = _run(out / "jetrl" / "seed42", {"grpo": {"seed": 42}})  # finished, from an earlier warm start
    runs = {out / "bf16" / "seed42": want, stale: {"grpo": {"seed": 42}}}
    _warm(out, weights_sha256="cd")
    assert adopt_from(src, out, runs, reuse=False, ran=True) is False and stale.exists()
    assert "another warm start (weights SHA-256 differ)" in capsys.readouterr().out
    _warm(out, weights_sha256="ab")
    assert adopt_from(src, out, runs, reuse=False, ran=True) is True
    assert not stale.exists() and compare.finished(out / "bf16" / "seed42", want)
    assert "adopted 1 of 2 finished runs" in capsys.readouterr().out
