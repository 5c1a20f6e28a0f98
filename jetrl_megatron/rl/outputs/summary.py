"""The end of a run: ``summary.json`` from the metrics, and the probe of every arm's mismatch on the trained
policy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jetrl_megatron.recipe import ARM_BY_SWITCHES
from jetrl_megatron.rl import health
from jetrl_megatron.rl.config import RunConfig
from jetrl_megatron.rl.dist import (
    is_main,
    say,
)
from jetrl_megatron.rl.generation import (
    VAL_KEYS,
)
from jetrl_megatron.rl.metrics import (
    MISMATCH_KEYS,
)
from jetrl_megatron.rl.outputs.metric_log import RunLogger, plot_run, read_metrics
from jetrl_megatron.rl.trainer import (
    optimizer_updates_per_step,
)


def summarize(cfg: RunConfig, logger: RunLogger, sft_losses: list[float], wall: float,
              vocab_size: int | None = None, startup: dict[str, float] | None = None) -> dict[str, Any]:
    """summary.json from metrics.jsonl; ``ok`` is false (and ``error`` says why) when no optimizer update was
    applied. Skipped updates and a collapsed policy (needs ``vocab_size``) are counted / recorded. ``startup``:
    seconds per start-up stage (``startup_s``: where a run's time goes before its first step)."""
    if not is_main():
        return {"ok": True}
    all_rows = read_metrics(logger.path) if logger.path.exists() else []
    rows = [r for r in all_rows if r["step"] > 0]
    val = [r for r in all_rows if "val/accuracy" in r]
    s: dict[str, Any] = {"ok": True, "recipe": cfg.name, "mode": cfg.arm, "steps": len(rows), "wall_s": wall,
                         "sft_loss": sft_losses[-1] if sft_losses else None}
    if startup:
        s["startup_s"] = {k: round(v, 3) for k, v in startup.items()}
    if rows:
        k = max(1, len(rows) // 4)
        s["reward_first"] = float(np.mean([r["reward/mean"] for r in rows[:k]]))
        s["reward_last"] = float(np.mean([r["reward/mean"] for r in rows[-k:]]))
        s["accuracy_first"] = float(np.mean([r["reward/accuracy"] for r in rows[:k]]))
        s["accuracy_last"] = float(np.mean([r["reward/accuracy"] for r in rows[-k:]]))
        s["mismatch_mean"] = {f"mismatch/{m}": float(np.mean([r[f"mismatch/{m}"] for r in rows]))
                              for m in MISMATCH_KEYS if all(r.get(f"mismatch/{m}") is not None for r in rows)}
        if val:
            s["val_first"] = {k: val[0][k] for k in VAL_KEYS if k in val[0]}
            s["val_last"] = {k: val[-1][k] for k in VAL_KEYS if k in val[-1]}
        for t in ("rollout", "logprob", "update", "refit", "step"):
            s[f"{t}_time_mean"] = float(np.mean([r[f"time/{t}"] for r in rows]))
        if cfg.policy.jet_rl.plot_enabled:
            s["plot"] = str(plot_run(all_rows, logger.log_dir / "reward_mismatch.png", f"{cfg.name} ({cfg.arm})"))
    s.update(health.update_summary(rows, optimizer_updates_per_step(cfg)))
    collapse = health.find_collapse(rows, vocab_size) if vocab_size else None
    if collapse is not None:
        s["collapse"] = collapse
    if rows and s["optimizer_updates"] == 0:
        s["ok"] = False
        s["error"] = health.no_update_error(s, len(rows), cfg.loss_fn.reference_policy_kl_penalty,
                                            cfg.policy.megatron_cfg.optimizer.lr)
    (logger.log_dir / "summary.json").write_text(json.dumps(s, indent=2))
    if s["skipped_updates"]:
        say(f"skipped optimizer updates: {s['skipped_updates']} of {s['skipped_updates'] + s['optimizer_updates']}"
             f" (non-finite loss or gradients) at GRPO step(s) {s['skipped_steps']}")
    if rows:
        say(f"summary: reward {s['reward_first']:.3f} -> {s['reward_last']:.3f} (first/last quarter of steps), "
             f"accuracy {s['accuracy_first']:.3f} -> {s['accuracy_last']:.3f}, "
             f"step {s['step_time_mean']:.2f}s (rollout {s['rollout_time_mean']:.2f} / logprob "
             f"{s['logprob_time_mean']:.2f} / update {s['update_time_mean']:.2f} / refit {s['refit_time_mean']:.2f})")
        if val:
            v0, v1 = s["val_first"], s["val_last"]
            say(f"validation ({len(val)} evaluations, step {v0['step']} -> {v1['step']}): accuracy greedy "
                 f"{v0['val/accuracy']:.3f} -> {v1['val/accuracy']:.3f}, sampled "
                 f"{v0.get('val/accuracy_sampled', math.nan):.3f} -> {v1.get('val/accuracy_sampled', math.nan):.3f}")
        mm = s["mismatch_mean"]
        say(f"mismatch ({cfg.arm}): k3 {mm.get('mismatch/k3_kl', math.nan):.3e}, token_mult_prob_error "
             f"{mm.get('mismatch/token_mult_prob_error', math.nan):.6f}")
    return s


def run_arm_probe(cfg: RunConfig, model_dir: Path) -> dict[str, dict[str, float]]:
    """Every arm's mismatch on the trained policy, each in a fresh process (vLLM and Megatron state are global)."""
    out: dict[str, dict[str, float]] = {}
    for arm in ARM_BY_SWITCHES.values():
        res = model_dir.parent / f"probe_{arm}.json"
        cmd = [sys.executable, "-m", "jetrl_megatron.rl.tools.mismatch_probe",
               "--recipe", str(model_dir.parent / "config.yaml"),
               "--model-dir", str(model_dir),
               "--arm", arm, "--out", str(res)]
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            env.pop(k, None)
        rc = subprocess.call(cmd, env=env)
        out[arm] = json.loads(res.read_text()) if rc == 0 and res.exists() else {"error": f"exit {rc}"}
    return out


def print_probe(probe: dict[str, dict[str, float]]) -> None:
    print("arm mismatch on the trained policy (one rollout batch, response tokens):")
    print(f"  {'arm':24s} {'k3_kl':>12s} {'token_mult_prob_error':>22s} {'abs_dp_max':>12s}")
    for arm, m in probe.items():
        if "error" in m:
            print(f"  {arm:24s} {m['error']}")
            continue
        print(f"  {arm:24s} {m['mismatch/k3_kl']:12.3e} {m['mismatch/token_mult_prob_error']:22.6f} "
              f"{m['mismatch/abs_dp_max']:12.3e}")
