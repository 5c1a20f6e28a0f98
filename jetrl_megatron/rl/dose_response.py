"""The mismatch dose-response report: held-out accuracy at the end against the trainer-vs-rollout mismatch, per
arm, from a `jetrl compare` over bf16 and the stressed arms (rl/stress_arms.py).

`python -m jetrl_megatron.rl.dose_response <compare dir>` reads ``compare.json`` and writes ``dose_response.md``
(the table and the verdict) and ``dose_response.png`` (accuracy against k3, one point per arm with its seed spread,
BF16's spread as a band). Pure: files in, text and a PNG out.

The verdict's rule, stated once: an arm is *below BF16 beyond the seed spread* when its best seed ends below BF16's
worst seed on held-out greedy accuracy (the min..max ranges do not overlap); otherwise it is *with BF16*.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from jetrl_megatron.rl.compare import atomic_write, fmt_stats
from jetrl_megatron.rl.stress_arms import parse_arm

BASELINE = "bf16"
ACC_KEYS = (("val/accuracy@last", "greedy"), ("val/accuracy_sampled@last", "sampled"))
Stats = dict[str, Any]


def arm_point(name: str, arm: Stats) -> dict[str, Any]:
    """One arm's row: its format and kind, mismatch means and end-of-run held-out accuracy (stats across seeds)."""
    parsed = parse_arm(name)
    fmt, unified = parsed if parsed else (None, None)
    kind = "baseline" if parsed is None else ("unified" if unified else "off-policy")
    mm = arm.get("mismatch", {})
    return {"arm": name, "format": fmt or name, "kind": kind, "seeds": arm.get("seeds", []),
            "k3": mm.get("mismatch/k3_kl"), "tmpe": mm.get("mismatch/token_mult_prob_error"),
            **{label: arm.get("val", {}).get(key) for key, label in ACC_KEYS},
            "start": arm.get("val", {}).get("val/accuracy@first")}


def below(a: Stats | None, b: Stats | None) -> bool | None:
    """Whether ``a`` ends below ``b`` beyond the seed spread (a's max < b's min); None without both."""
    if not a or not b:
        return None
    return a["max"] < b["min"]


def verdict_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each stressed arm compared with BF16 on greedy accuracy; sorted by mean k3 (lowest first)."""
    base = next((p for p in points if p["arm"] == BASELINE), None)
    rows = []
    for p in points:
        if p["kind"] == "baseline":
            continue
        diff = (p["greedy"]["mean"] - base["greedy"]["mean"]) if base and p["greedy"] and base["greedy"] else None
        rows.append({**p, "below_bf16": below(p["greedy"], base["greedy"] if base else None), "diff": diff})
    return sorted(rows, key=lambda r: (r["k3"] or {}).get("mean", 0.0))


def threshold(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The lowest-k3 off-policy arm below BF16 beyond the seed spread, or None (a null result)."""
    hits = [r for r in rows if r["kind"] == "off-policy" and r["below_bf16"]]
    return hits[0] if hits else None


def _range(s: Stats | None) -> str:
    return "n/a" if not s else f"{fmt_stats(s)} ({s['min']:.3f}..{s['max']:.3f})"


def table(points: list[dict[str, Any]]) -> str:
    head = ["arm", "format", "kind", "seeds", "k3 KL", "token_mult_prob_error", "held-out greedy @ start",
            "held-out greedy @ end (min..max)", "held-out sampled @ end (min..max)", "greedy vs bf16"]
    rows = {r["arm"]: r for r in verdict_rows(points)}
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in sorted(points, key=lambda p: (p["kind"] != "baseline", (p["k3"] or {}).get("mean", 0.0))):
        r = rows.get(p["arm"])
        vs = "baseline" if r is None else (
            f"{r['diff']:+.3f}, " + ("below beyond spread" if r["below_bf16"] else "within spread")
            if r["diff"] is not None else "n/a")
        lines.append("| " + " | ".join([p["arm"], p["format"], p["kind"], str(len(p["seeds"])),
                                        fmt_stats(p["k3"], "{:.2e}"), fmt_stats(p["tmpe"], "{:.5f}"),
                                        fmt_stats(p["start"]), _range(p["greedy"]), _range(p["sampled"]), vs]) + " |")
    return "\n".join(lines)


def verdict(points: list[dict[str, Any]]) -> str:
    """One paragraph: the mismatch level at which off-policy falls below BF16, and where the unified arm of that
    format stands; or that no arm did (with the largest mismatch tried)."""
    rows = verdict_rows(points)
    hit = threshold(rows)
    off = [r for r in rows if r["kind"] == "off-policy" and r["k3"]]
    if hit is None:
        top = max(off, key=lambda r: r["k3"]["mean"]) if off else None
        reach = (f" up to k3 {top['k3']['mean']:.2e} / token_mult_prob_error {top['tmpe']['mean']:.4f} "
                 f"({top['arm']})") if top else ""
        return (f"No off-policy arm ended below BF16 beyond the seed spread{reach}: a null result at this task "
                "length and step count.")
    uni = next((r for r in rows if r["kind"] == "unified" and r["format"] == hit["format"]), None)
    uni_text = "no unified arm of that format was run" if uni is None else (
        f"the unified arm in the same format ({uni['arm']}, k3 {fmt_stats(uni['k3'], '{:.2e}')}) "
        + ("is below BF16 beyond the spread too" if uni["below_bf16"] else "stays with BF16")
        + f" (greedy {fmt_stats(uni['greedy'])})")
    return (f"The off-policy arm first falls below BF16 beyond the seed spread at k3 {hit['k3']['mean']:.2e} / "
            f"token_mult_prob_error {hit['tmpe']['mean']:.4f} ({hit['arm']}: greedy {fmt_stats(hit['greedy'])} vs "
            f"BF16's min); {uni_text}.")


def plot(points: list[dict[str, Any]], out_png: Path, title: str) -> Path:
    """Held-out greedy (top) and sampled (bottom) accuracy at the end against k3 (symlog: the unified arms sit at
    0): mean with std bars and min..max whiskers per arm; BF16's min..max as a band and its mean as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    formats = sorted({p["format"] for p in points if p["kind"] != "baseline"})
    colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(formats)}
    k3s = [p["k3"]["mean"] for p in points if p["k3"] and p["k3"]["mean"] > 0]
    linthresh = 10 ** math.floor(math.log10(min(k3s))) if k3s else 1e-6
    for ax, (_, label) in zip(axes, ACC_KEYS, strict=True):
        base = next((p for p in points if p["kind"] == "baseline" and p[label]), None)
        if base:
            s = base[label]
            ax.axhspan(s["min"], s["max"], color="0.85", label=f"bf16 min..max (n={s['n']})")
            ax.axhline(s["mean"], color="0.4", lw=1)
        for p in points:
            s, k3 = p[label], p["k3"]
            if p["kind"] == "baseline" or not s or not k3:
                continue
            x = k3["mean"]
            face = colors[p["format"]] if p["kind"] == "off-policy" else "white"
            ax.errorbar([x], [s["mean"]], yerr=[[s["mean"] - s["min"]], [s["max"] - s["mean"]]], fmt="none",
                        ecolor=colors[p["format"]], alpha=0.5, capsize=3)
            ax.plot([x], [s["mean"]], "o" if p["kind"] == "off-policy" else "s", ms=7, mfc=face,
                    mec=colors[p["format"]], label=f"{p['arm']} (n={s['n']})")
        ax.set_xscale("symlog", linthresh=linthresh)
        ax.set_ylabel(f"held-out accuracy ({label}) at the end", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    axes[1].set_xlabel("k3 KL (rollout || trainer), mean over GRPO steps (symlog; unified arms at 0)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def report(compare_dir: Path) -> dict[str, Path]:
    """dose_response.md and .png next to ``compare.json``."""
    data = json.loads((compare_dir / "compare.json").read_text())
    meta, arms = data["meta"], data["arms"]
    points = [arm_point(name, a) for name, a in arms.items()]
    md = compare_dir / "dose_response.md"
    note = (f"recipe `{meta['recipe']}`, overrides `{' '.join(meta.get('overrides', []))}`, {meta['steps']} GRPO "
            f"steps, seeds {meta['seeds']}, one shared BF16 warm start (`{meta['warmstart']}`). k3 and "
            "token_mult_prob_error: mean over GRPO steps of the trainer-vs-rollout mismatch on response tokens, then "
            "mean ± std across seeds. Accuracy: held-out (200 prompts) at the last validation. Rule: below BF16 "
            "beyond the seed spread = the arm's best seed ends below BF16's worst seed.")
    atomic_write(md, f"{table(points)}\n\n{verdict(points)}\n\n{note}\n")
    png = plot(points, compare_dir / "dose_response.png",
               f"{meta['recipe']}: held-out accuracy vs mismatch, {len(meta['seeds'])} seeds per arm")
    return {"md": md, "png": png}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("compare_dir", type=Path, help="a `jetrl compare --out` directory holding compare.json")
    paths = report(ap.parse_args().compare_dir)
    print(paths["md"].read_text())
    print(f"written: {paths['md']}, {paths['png']}")


if __name__ == "__main__":
    main()
