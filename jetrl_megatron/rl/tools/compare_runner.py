"""Runs a `jetrl compare`: the shared BF16 warm start, then every arm x seed, each a fresh `jetrl run` process
(vLLM and Megatron state are process-wide), then the aggregate of `rl/tools/compare.py`. The processes start warm
(`warm_process.py`: forked from a server that imported torch, Megatron-Core and vLLM once, ~10 s of CPU saved per
run), or as plain subprocesses where the environment does not allow it.

The warm start runs first and alone, its output on this terminal; the arm runs follow one at a time the same way,
or ``parallel`` at a time, each writing to ``<run dir>.log`` (interleaved output of several runs would be
unreadable). Every run's configuration is loaded before any starts, so a bad combination fails at once, not after
the warm start.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from jetrl_megatron.rl.config import REPO_ROOT, load_config, to_yaml
from jetrl_megatron.rl.tools import compare
from jetrl_megatron.warm_process import STDOUT, WarmLauncher, WarmProcess

Run = tuple[str, Path, list[str]]  # (label, log dir, overrides)


def run_comparison(recipe: str, overrides: list[str], arms: list[str], num_seeds: int, *, out: str | None,
                   parallel: int, reuse: bool, warmstart_only: bool, reuse_from: str | None = None) -> int:
    """Every arm x ``num_seeds`` seeds of ``recipe`` from one shared BF16 warm start, then compare.md / .json / .png
    in ``out`` (default runs/compare/<recipe>); returns the exit code (that of the first failed run).
    ``reuse_from``: an earlier comparison's output (another machine's, a committed copy): once this warm start is its
    warm start to the last bit (:func:`compare.same_warmstart`), its finished runs are adopted, not run again."""
    src_out = Path(reuse_from).resolve() if reuse_from else None
    if src_out is not None and not (src_out / "warmstart" / "summary.json").is_file():
        print(f"jetrl compare: --reuse-from {reuse_from}: no warmstart/summary.json there (not a comparison's "
              "output)", file=sys.stderr)
        return 2
    base = load_config(recipe, overrides)  # validate once before spending time
    out_dir = Path(out or REPO_ROOT / "runs" / "compare" / base.name).resolve()
    seeds = [base.grpo.seed + i for i in range(num_seeds)]
    tokenizer = None if base.policy.tokenizer.name else base.policy.model_name
    plan = comparison_plan(overrides, out_dir, arms, seeds, tokenizer)
    # every run's configuration, validated now (a bad combination fails here, not after the warm start)
    expected = {d: yaml.safe_load(to_yaml(load_config(recipe, ov))) for _, d, ov in plan}
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher = WarmLauncher()
    t0 = time.time()
    for k, (label, log_dir, ov) in enumerate(plan, 1):
        if k > 1 and parallel > 1:
            rc = run_many(launcher, recipe, plan[1:], expected, reuse, parallel)
            if rc:
                return rc
            break
        print(f"== [{k}/{len(plan)}] {label}", flush=True)
        rc, ran = run_one(launcher, recipe, label, log_dir, ov, expected[log_dir], reuse)
        if rc:
            return rc
        if k == 1:
            if not (compare.warmstart_model(out_dir) / "config.json").is_file():
                print(f"jetrl compare: the warm start wrote no model to {compare.warmstart_model(out_dir)}",
                      file=sys.stderr)
                return 1
            reuse = reuse and not ran  # runs from an earlier warm start are not this comparison's
            if src_out is not None and not warmstart_only:
                reuse = adopt_from(src_out, out_dir, {d: expected[d] for _, d, _ in plan[1:]}, reuse, ran)
            if warmstart_only:
                print(f"warm start ready: {compare.warmstart_model(out_dir)} (the arms: the same command with "
                      f"--reuse instead of --warmstart-only)")
                return 0
    arm_runs = {arm: {s: compare.run_dir(out_dir, arm, s) for s in seeds} for arm in arms}
    agg = compare.aggregate(arm_runs)
    meta = {"recipe": base.name, "overrides": list(overrides), "steps": base.grpo.max_num_steps,
            "seeds": seeds, "arms": arms, "warmstart": str(compare.warmstart_model(out_dir)),
            "warmstart_sft": compare.warmstart_summary(out_dir),
            "wall_s": time.time() - t0}
    paths = compare.write_outputs(agg, meta, out_dir)
    print(paths["md"].read_text())
    print(f"written: {paths['md']}, {paths['json']}, {paths['png']}")
    return 0


def adopt_from(src_out: Path, out_dir: Path, arm_runs: dict[Path, dict[str, Any]], reuse: bool, ran: bool) -> bool:
    """``--reuse-from``: adopt ``src_out``'s finished runs when its warm start is this one; returns the ``reuse``
    the arm runs then get. A warm start made afresh here makes any other earlier run in ``out_dir`` stale: those are
    removed, so reuse keeps only the adopted ones."""
    same, why = compare.same_warmstart(src_out, out_dir)
    if not same:
        print(f"   --reuse-from {src_out}: another warm start ({why}); every run runs here", flush=True)
        return reuse
    if ran:
        for d in arm_runs:
            shutil.rmtree(d, ignore_errors=True)
    adopted = compare.adopt_finished_runs(src_out, out_dir, arm_runs)
    print(f"   --reuse-from {src_out}: the same warm start ({why}); adopted {len(adopted)} of {len(arm_runs)} "
          f"finished runs" + "".join(f"\n     {d}" for d in adopted), flush=True)
    return True


def comparison_plan(overrides: list[str], out: Path, arms: list[str], seeds: list[int],
                    tokenizer: str | None) -> list[Run]:
    """(label, log dir, overrides) of every run, the BF16 warm start first; the user's overrides come first so the
    harness's own (arm, seed, paths, the shared warm start) always win."""
    runs = [("BF16 warm start", out / "warmstart", [*overrides, *compare.warmstart_overrides(out)])]
    runs += [(f"arm {arm} seed {seed}", compare.run_dir(out, arm, seed),
              [*overrides, *compare.arm_overrides(out, arm, seed, tokenizer)]) for seed in seeds for arm in arms]
    return runs


def fresh_run_command(recipe: str, log_dir: Path, overrides: list[str], expected: dict[str, Any],
                      reuse: bool) -> list[str] | None:
    """The `jetrl run` arguments of one run, or None when ``reuse`` finds it already finished with the same
    configuration. With ``reuse``, a run cut before its end with the same configuration and a complete checkpoint
    is continued (`jetrl run` resumes from it; its cut log moves aside as ``<run>.part<N>.log``). Any other earlier
    output of the run is removed first: its checkpoints would otherwise be resumed from, and they may come from
    another warm start or configuration."""
    if reuse and compare.finished(log_dir, expected):
        print(f"   reusing {log_dir} (finished with the same configuration)", flush=True)
        return None
    ckpt = compare.resumable(log_dir, expected) if reuse else None
    if ckpt is not None:
        kept = compare.keep_cut_log(log_dir.with_suffix(".log"))
        print(f"   resuming {log_dir} from {ckpt.name} (cut before its end, same configuration)"
              + (f"; its earlier log: {kept.name}" if kept else ""), flush=True)
        return ["run", "--recipe", recipe, *overrides]
    if log_dir.exists():
        print(f"   removing the earlier output in {log_dir}", flush=True)
        shutil.rmtree(log_dir)
    return ["run", "--recipe", recipe, *overrides]


def _start(launcher: WarmLauncher, argv: list[str], log: Path | None) -> WarmProcess:
    """`python -m jetrl_megatron.cli *argv` in a fresh process; its output to ``log``, or this terminal."""
    return launcher.start("jetrl_megatron.cli", argv, stdout=log, stderr=None if log is None else STDOUT)


def run_one(launcher: WarmLauncher, recipe: str, label: str, log_dir: Path, overrides: list[str],
            expected: dict[str, Any], reuse: bool) -> tuple[int, bool]:
    """One run in a fresh process, its output on this terminal. Returns (exit code, whether it ran)."""
    argv = fresh_run_command(recipe, log_dir, overrides, expected, reuse)
    if argv is None:
        return 0, False
    print(f"   -m jetrl_megatron.cli {shlex.join(argv)}", flush=True)
    rc = _start(launcher, argv, None).wait()
    if rc:
        print(f"jetrl compare: {label} failed (exit {rc}); see {log_dir}", file=sys.stderr)
    return rc, True


def run_many(launcher: WarmLauncher, recipe: str, runs: list[Run], expected: dict[Path, dict[str, Any]], reuse: bool,
             parallel: int) -> int:
    """``runs``, ``parallel`` at a time, each in its own process writing to ``<run dir>.log``. Returns the first
    non-zero exit code, after all have ended."""
    pending, active, failed = list(runs), [], 0
    while pending or active:
        while pending and len(active) < parallel:
            label, log_dir, ov = pending.pop(0)
            print(f"== {label}", flush=True)
            argv = fresh_run_command(recipe, log_dir, ov, expected[log_dir], reuse)
            if argv is None:
                continue
            log_dir.parent.mkdir(parents=True, exist_ok=True)
            log = log_dir.with_suffix(".log")
            proc = _start(launcher, argv, log)
            how = "started warm" if proc.warm else "started"
            print(f"== {label} {how}: -m jetrl_megatron.cli {shlex.join(argv)} > {log}", flush=True)
            active.append((label, log, proc))
        time.sleep(1.0)
        for item in list(active):
            label, log, proc = item
            if proc.poll() is None:
                continue
            active.remove(item)
            rc = proc.wait()
            print(f"== {label} ended (exit {rc})", flush=True)
            if rc and not failed:
                print(f"jetrl compare: {label} failed (exit {rc}); see {log}", file=sys.stderr)
                failed = rc
    return failed
