"""`jetrl compare`: a fair comparison of the training arms, and the aggregation of its runs.

Fair means: one BF16 warm start shared by every arm (so no arm starts from weights warmed up in its own precision),
the same seeds in every arm (the loop seeds data order and sampling from ``grpo.seed``; the held-out prompts come
from ``data.train.seed``, one set for every run), and
several seeds per arm, reported as mean with spread, so a difference between arms can be told from seed noise.

Everything here is pure (files in, numbers / text / a PNG out): no Megatron or vLLM import. Running the runs, one
subprocess each, is ``rl/tools/compare_runner.py`` (behind ``jetrl compare``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from jetrl_megatron.recipe import ARM_BY_SWITCHES
from jetrl_megatron.rl.outputs.checkpoint_format import complete_checkpoints
from jetrl_megatron.rl.outputs.metric_log import read_metrics, save_step_figure
from jetrl_megatron.rl.stress_arms import compare_arm_overrides

COMPARE_ARMS = tuple(ARM_BY_SWITCHES.values())  # the arms NeMo-RL's switches select (fake_quant: --arms)
# per-step curves, averaged over seeds; the *_sampled keys exist only in runs that log sampled validation
CURVE_KEYS = ("reward/mean", "reward/accuracy", "val/accuracy", "val/reward", "val/accuracy_sampled",
              "val/reward_sampled", "mismatch/k3_kl", "mismatch/token_mult_prob_error")
VAL_KEYS = ("val/accuracy", "val/reward", "val/accuracy_sampled", "val/reward_sampled")
MISMATCH_NAMES = ("k3_kl", "token_mult_prob_error", "max_abs_logp_diff", "abs_dp_max")
_BIN = re.compile(r"^mismatch/(?P<name>[a-z0-9_]+)/pos_(?P<lo>\d+)_(?P<hi>\d+)$")
Stats = dict[str, Any]


# ------------------------------------------------------------------------------------------------ the runs


def warmstart_model(out: Path) -> Path:
    return out / "warmstart" / "model"


def warmstart_overrides(out: Path) -> list[str]:
    """The one BF16 warm start every arm starts from: SFT only (no GRPO step), written as an HF model dir."""
    return [*compare_arm_overrides("bf16"), "grpo.max_num_steps=0",
            f"policy.jet_rl.sft_warmstart.save_model_dir={warmstart_model(out)}", f"logger.log_dir={out / 'warmstart'}",
            "policy.jet_rl.final_arm_probe=false", "checkpointing.enabled=false"]


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed{seed}"


def arm_overrides(out: Path, arm: str, seed: int, tokenizer: str | None = None) -> list[str]:
    """One arm x seed run from the shared warm start. ``tokenizer``: the original model's tokenizer, for recipes that
    load it from ``policy.model_name`` (the warm-start dir holds weights and config only)."""
    d = run_dir(out, arm, seed)
    ov = [*compare_arm_overrides(arm), f"policy.model_name={warmstart_model(out)}",
          "policy.jet_rl.sft_warmstart.steps=0", f"grpo.seed={seed}", f"logger.log_dir={d}",
          f"checkpointing.checkpoint_dir={d / 'checkpoints'}", "policy.jet_rl.final_arm_probe=false",
          "policy.jet_rl.plot_enabled=false"]
    return ov + ([f"policy.tokenizer.name={tokenizer}"] if tokenizer else [])


def finished(log_dir: Path, expected_config: dict[str, Any]) -> bool:
    """A run `--reuse` may skip: it ended ok and was started with exactly the configuration it would get now."""
    try:
        summary = json.loads((log_dir / "summary.json").read_text())
        config = yaml.safe_load((log_dir / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return bool(summary.get("ok")) and config == expected_config


def resumable(log_dir: Path, expected_config: dict[str, Any]) -> Path | None:
    """A cut run `--reuse` continues instead of starting over: not finished, started with exactly the configuration
    it would get now (checkpointing on), and holding a complete checkpoint (``jetrl run`` then resumes from its newest
    usable one). That newest complete checkpoint, else None."""
    try:
        config = yaml.safe_load((log_dir / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    ckpt = (config or {}).get("checkpointing") or {}
    if config != expected_config or not ckpt.get("enabled") or finished(log_dir, expected_config):
        return None
    done = complete_checkpoints(Path(ckpt["checkpoint_dir"]))
    return done[-1] if done else None


def keep_cut_log(log: Path) -> Path | None:
    """Before a resumed run writes ``log`` afresh, the cut part's log moves aside as ``<name>.part<N>.log`` (N = 1,
    2, ...: one per earlier part), so every part's output stays. Returns where it went (None: there was no log)."""
    if not log.exists():
        return None
    n = 1
    while (part := log.with_name(f"{log.stem}.part{n}{log.suffix}")).exists():
        n += 1
    log.rename(part)
    return part


def same_warmstart(src_out: Path, out: Path) -> tuple[bool, str]:
    """Whether ``out``'s warm start is ``src_out``'s policy, and why. The weights' SHA-256 decides where both
    summaries record it; for a warm start written before the digest existed, its whole logged loss curve and step
    count, equal to the last bit (every supervised step ran the same arithmetic; the last update is not logged)."""
    try:
        a, b = (json.loads((d / "warmstart" / "summary.json").read_text()) for d in (src_out, out))
    except (OSError, ValueError) as e:
        return False, f"no readable warm-start summary ({e})"
    if not (a.get("ok") and b.get("ok")):
        return False, "a warm start did not end ok"
    if a.get("weights_sha256") and b.get("weights_sha256"):
        same = a["weights_sha256"] == b["weights_sha256"]
        return same, f"weights SHA-256 {'equal' if same else 'differ'}"
    curve_a, curve_b = a.get("sft_loss_curve"), b.get("sft_loss_curve")
    same = bool(curve_a) and curve_a == curve_b and a.get("sft_steps") == b.get("sft_steps")
    verdict = "equal to the last bit" if same else "differ"
    return same, f"no weight digest in both summaries: loss curves ({len(curve_a or [])} points) {verdict}"


def _with_root(x: Any, old: str, new: str) -> Any:
    """``x`` (a loaded config) with every string path under ``old`` moved under ``new``."""
    if isinstance(x, dict):
        return {k: _with_root(v, old, new) for k, v in x.items()}
    if isinstance(x, list):
        return [_with_root(v, old, new) for v in x]
    if isinstance(x, str) and (x == old or x.startswith(old + os.sep)):
        return new + x[len(old):]
    return x


def adopt_finished_runs(src_out: Path, out: Path, runs: dict[Path, dict[str, Any]]) -> list[Path]:
    """Copy into ``out`` each run of ``runs`` ({log dir under out: its expected configuration}) that ``src_out``
    holds finished with the same configuration up to the comparison's root (the warm start's ``model_dir`` says where
    ``src_out``'s runs ran: a committed copy keeps the paths of the machine it ran on). Call only when
    :func:`same_warmstart` holds. The copy's config.yaml is the expected one, so ``finished`` then accepts it here.
    Returns the adopted log dirs."""
    summary = json.loads((src_out / "warmstart" / "summary.json").read_text())
    src_root = str(Path(summary["model_dir"]).parent.parent) if summary.get("model_dir") else str(src_out)
    adopted = []
    for log_dir, expected in runs.items():
        src = src_out / log_dir.relative_to(out)
        if finished(log_dir, expected) or not finished(src, _with_root(expected, str(out), src_root)):
            continue
        if log_dir.exists():
            shutil.rmtree(log_dir)
        shutil.copytree(src, log_dir, ignore=shutil.ignore_patterns("checkpoints", "model*"))
        (log_dir / "config.yaml").write_text(yaml.safe_dump(expected, sort_keys=False))
        if src.with_suffix(".log").is_file():
            shutil.copy2(src.with_suffix(".log"), log_dir.with_suffix(".log"))
        adopted.append(log_dir)
    return adopted


# ------------------------------------------------------------------------------------------------ statistics


def spread(values: list[float]) -> Stats | None:
    """Mean, sample std (ddof 1; None for one value), min, max and count of the finite values; None if none."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return None
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else None, "min": float(v.min()),
            "max": float(v.max()), "n": int(v.size)}


def _value(row: dict[str, Any], key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def step_curve(runs: list[list[dict[str, Any]]], key: str) -> list[Stats]:
    """``key`` per step across seeds: one entry per step that any seed logged it at (``n`` says how many did)."""
    by_step: dict[int, list[float]] = {}
    for rows in runs:
        for r in rows:
            v = _value(r, key)
            if v is not None:
                by_step.setdefault(int(r["step"]), []).append(v)
    return [{"step": s, **spread(vals)} for s, vals in sorted(by_step.items())]


def endpoint(rows: list[dict[str, Any]], key: str, last: bool) -> tuple[int, float] | None:
    """(step, value) of the first or last row holding ``key``: validation before GRPO (step 0) and at the end."""
    pts = [(int(r["step"]), v) for r in rows if (v := _value(r, key)) is not None]
    return (pts[-1] if last else pts[0]) if pts else None


def step_values(rows: list[dict[str, Any]], key: str) -> list[float]:
    """The finite values of ``key`` at GRPO steps (step 0 holds only the validation before GRPO)."""
    return [v for r in rows if r["step"] > 0 and (v := _value(r, key)) is not None]


def step_mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = step_values(rows, key)
    return float(np.mean(vals)) if vals else None


def quarter_means(rows: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    """Mean of ``key`` over the first and the last quarter of GRPO steps (as ``summary.summarize`` reports it)."""
    vals = step_values(rows, key)
    if not vals:
        return None
    k = max(1, len(vals) // 4)
    return float(np.mean(vals[:k])), float(np.mean(vals[-k:]))


def mismatch_means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over GRPO steps of every tracked mismatch key, overall and per response-position bin."""
    keys = {k for r in rows for k in r if _is_mismatch_key(k)}
    return {k: m for k in keys if (m := step_mean(rows, k)) is not None}


def _is_mismatch_key(key: str) -> bool:
    m = _BIN.match(key)
    name = m["name"] if m else key.removeprefix("mismatch/") if key.startswith("mismatch/") else None
    return name in MISMATCH_NAMES


def bins_of(keys: list[str] | set[str]) -> list[tuple[int, int]]:
    """The response-position bins (lo, hi) named by ``mismatch/<name>/pos_<lo>_<hi>`` keys, in position order."""
    return sorted({(int(m["lo"]), int(m["hi"])) for k in keys if (m := _BIN.match(k))})


# ------------------------------------------------------------------------------------------------ aggregation


def load_run(log_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(metrics.jsonl rows, summary.json) of one run; a missing summary is an empty dict."""
    summary_path = Path(log_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return read_metrics(log_dir), summary


def _across(per_seed: list[Any], pick) -> Stats | None:
    return spread([v for x in per_seed if x is not None and (v := pick(x)) is not None])


def aggregate_arm(seed_dirs: dict[int, Path]) -> Stats:
    """One arm: per-step curves, validation at the first and last evaluation, training reward first -> last
    quarter, mismatch means and step time, each across seeds (mean, sample std, min, max, n)."""
    seeds = sorted(seed_dirs)
    runs = {s: load_run(seed_dirs[s]) for s in seeds}
    rows = [runs[s][0] for s in seeds]
    curves = {k: c for k in CURVE_KEYS if (c := step_curve(rows, k))}
    val: dict[str, Stats] = {}
    for key in VAL_KEYS:
        for where, last in (("first", False), ("last", True)):
            pts = [endpoint(r, key, last) for r in rows]
            stats = _across(pts, lambda p: p[1])
            if stats is not None:
                val[f"{key}@{where}"] = {**stats, "steps": sorted({p[0] for p in pts if p is not None})}
    quarters = [quarter_means(r, "reward/mean") for r in rows]
    acc_quarters = [quarter_means(r, "reward/accuracy") for r in rows]
    per_seed_mm = [mismatch_means(r) for r in rows]
    mm_keys = sorted({k for m in per_seed_mm for k in m})
    return {
        "seeds": seeds,
        "log_dirs": {str(s): str(seed_dirs[s]) for s in seeds},
        "steps": {str(s): sum(1 for r in runs[s][0] if r["step"] > 0) for s in seeds},
        "ok": {str(s): runs[s][1].get("ok") for s in seeds},
        "curves": curves,
        "val": val,
        "reward_first_quarter": _across(quarters, lambda q: q[0]),
        "reward_last_quarter": _across(quarters, lambda q: q[1]),
        "accuracy_first_quarter": _across(acc_quarters, lambda q: q[0]),
        "accuracy_last_quarter": _across(acc_quarters, lambda q: q[1]),
        "mismatch": {k: _across(per_seed_mm, lambda m, k=k: m.get(k)) for k in mm_keys},
        "step_time": spread([step_mean(r, "time/step") for r in rows]),
    }


def aggregate(runs: dict[str, dict[int, Path]]) -> dict[str, Stats]:
    """Every arm of ``{arm: {seed: log_dir}}``, in the given arm order."""
    return {arm: aggregate_arm(seed_dirs) for arm, seed_dirs in runs.items()}


# ------------------------------------------------------------------------------------------------ tables


def fmt_stats(s: Stats | None, fmt: str = "{:.3f}") -> str:
    """``mean ± std`` (just the mean for one seed), ``n/a`` when no seed has the value."""
    if s is None:
        return "n/a"
    return fmt.format(s["mean"]) + (f" ± {fmt.format(s['std'])}" if s.get("std") is not None else "")


def _val_steps(arms: dict[str, Stats], key: str) -> str:
    steps = sorted({st for a in arms.values() for st in a["val"].get(key, {}).get("steps", [])})
    return ",".join(map(str, steps)) if steps else "?"


def summary_table(arms: dict[str, Stats]) -> str:
    """Markdown, one row per arm: validation (greedy, and sampled when logged) before and after GRPO -- accuracy,
    and the reward too where it is not the accuracy (partial credit: the count task's correct leading terms) --,
    training reward first -> last quarter, mismatch means over steps, s/step; every number mean ± std across seeds."""
    acc_cols = [("val/accuracy", "greedy")]
    if any("val/accuracy_sampled@first" in a["val"] for a in arms.values()):
        acc_cols.append(("val/accuracy_sampled", "sampled"))
    val_cols = [(key, f"acc {label}") for key, label in acc_cols]
    for key, label in acc_cols:
        reward = key.replace("accuracy", "reward")
        if any(a["val"].get(f"{reward}@last") not in (None, a["val"].get(f"{key}@last")) for a in arms.values()):
            val_cols.append((reward, f"reward {label}"))
    head = ["arm", "seeds"]
    for key, label in val_cols:
        head += [f"val {label} @ step {_val_steps(arms, key + '@first')}",
                 f"val {label} @ step {_val_steps(arms, key + '@last')}"]
    head += ["train reward first q -> last q", "k3 KL", "token_mult_prob_error", "max abs dlogp", "s/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, a in arms.items():
        cells = [arm, str(len(a["seeds"]))]
        for key, _ in val_cols:
            cells += [fmt_stats(a["val"].get(f"{key}@first")), fmt_stats(a["val"].get(f"{key}@last"))]
        cells.append(f"{fmt_stats(a['reward_first_quarter'])} -> {fmt_stats(a['reward_last_quarter'])}")
        mm = a["mismatch"]
        cells += [fmt_stats(mm.get("mismatch/k3_kl"), "{:.2e}"),
                  fmt_stats(mm.get("mismatch/token_mult_prob_error"), "{:.6f}"),
                  fmt_stats(mm.get("mismatch/max_abs_logp_diff"), "{:.2e}"),
                  fmt_stats(a["step_time"], "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def position_table(arms: dict[str, Stats]) -> str:
    """Markdown: k3 KL and token_mult_prob_error by response-position bin, two rows per arm."""
    bins = bins_of({k for a in arms.values() for k in a["mismatch"]})
    if not bins:
        return "(no per-position mismatch logged)"
    head = ["arm", "metric", *[f"pos {lo}" if hi - lo == 1 else f"pos {lo}-{hi - 1}" for lo, hi in bins]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, a in arms.items():
        for name, fmt in (("k3_kl", "{:.2e}"), ("token_mult_prob_error", "{:.6f}")):
            cells = [fmt_stats(a["mismatch"].get(f"mismatch/{name}/pos_{lo}_{hi}"), fmt) for lo, hi in bins]
            lines.append("| " + " | ".join([arm, name, *cells]) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ outputs

PLOT_PANELS = (
    ("reward/mean", "training reward"),
    ("val/accuracy", "val accuracy (greedy)"),
    ("val/accuracy_sampled", "val accuracy (sampled)"),
    ("mismatch/k3_kl", "k3 KL (rollout || train)"),
)


def plot_compare(arms: dict[str, Stats], out_png: Path, title: str = "") -> Path:
    """All arms on shared axes, one panel per metric: the mean across seeds as a line, min..max as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [(k, lbl) for k, lbl in PLOT_PANELS if any(a["curves"].get(k) for a in arms.values())]
    fig, axes = plt.subplots(len(panels) or 1, 1, figsize=(8, 2.4 * max(1, len(panels))), sharex=True,
                             squeeze=False)
    for ax, (key, label) in zip(axes[:, 0], panels, strict=False):
        for arm, a in arms.items():
            c = a["curves"].get(key, [])
            if not c:
                continue
            x = [p["step"] for p in c]
            line, = ax.plot(x, [p["mean"] for p in c], marker="o", ms=3, label=f"{arm} (n={len(a['seeds'])})")
            ax.fill_between(x, [p["min"] for p in c], [p["max"] for p in c], color=line.get_color(), alpha=0.2)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    return save_step_figure(fig, axes, out_png, title)


def atomic_write(path: Path, text: str) -> Path:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def warmstart_summary(out: Path) -> dict[str, Any]:
    """The warm start's own summary (steps run, last loss), or {} when it is missing (an older run dir)."""
    try:
        s = json.loads((out / "warmstart" / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: s[k] for k in ("sft_steps", "sft_loss") if s.get(k) is not None}


def warmstart_note(meta: dict[str, Any]) -> str:
    ws = meta.get("warmstart_sft") or {}
    if "sft_steps" not in ws:
        return ""
    loss = f", last loss {ws['sft_loss']:.4g}" if "sft_loss" in ws else ""
    return f" ({ws['sft_steps']} supervised steps{loss})"


def report(arms: dict[str, Stats], meta: dict[str, Any]) -> str:
    """compare.md: both tables and a note on what was compared."""
    note = (f"recipe `{meta['recipe']}`, {meta['steps']} GRPO steps per run, seeds {meta['seeds']}, arms "
            f"{', '.join(meta['arms'])}. Every arm and seed starts from the one BF16 warm start at "
            f"`{meta['warmstart']}`{warmstart_note(meta)}; the same seed gives every arm the same data order, "
            f"sampling seeds and validation prompts. Numbers are mean ± sample std across seeds (min/max in "
            f"compare.json); mismatch = mean over steps on response tokens (rollout vs trainer log-probs of the "
            f"sampled tokens). Wall {meta['wall_s']:.0f} s.")
    return (f"{summary_table(arms)}\n\nMismatch by response position (mean over steps, mean ± std across seeds):\n\n"
            f"{position_table(arms)}\n\n{note}\n")


def write_outputs(arms: dict[str, Stats], meta: dict[str, Any], out: Path) -> dict[str, Path]:
    """compare.json (every aggregated number), compare.md and compare.png in ``out``, each written atomically."""
    paths = {"json": out / "compare.json", "md": out / "compare.md", "png": out / "compare.png"}
    atomic_write(paths["json"], json.dumps({"meta": meta, "arms": arms}, indent=2))
    atomic_write(paths["md"], report(arms, meta))
    plot_compare(arms, paths["png"], f"{meta['recipe']}: {len(meta['seeds'])} seed(s) per arm, mean and min..max")
    return paths
