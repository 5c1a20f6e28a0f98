"""The mismatch dose-response report: held-out accuracy at the end against the trainer-vs-rollout mismatch, per
arm, from a `jetrl compare` over bf16 and the stressed arms (rl/stress_arms.py).

`python -m jetrl_megatron.rl.tools.dose_response <compare dir>` reads ``compare.json`` and writes ``dose_response.md``
(the table and the verdict) and ``dose_response.png`` (accuracy against k3, one point per arm with its seed spread,
BF16's spread as a band). Pure: files in, text and a PNG out.

The outcome measured is held-out accuracy of the policy each arm's trainer optimizes: BF16 weights served in BF16
for bf16 and the off-policy arms (rl/stress_eval.py), so that a format's own inference error does not pass for a
learning difference; the unified arm's own stressed forward (its rollout). Off-policy arms are compared with BF16 on
the accuracy at the end (both are BF16 policies from one warm start), unified arms on the gain over their own start
(their policy is the warm start quantized). Rule, stated once: an arm is *below BF16 beyond the seed spread* when its
best seed is below BF16's worst seed (the min..max ranges do not overlap; undefined with fewer than two seeds).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from jetrl_megatron.rl.stress_arms import parse_arm
from jetrl_megatron.rl.tools import compare
from jetrl_megatron.rl.tools.compare import atomic_write, endpoint, fmt_stats, load_run, spread

BASELINE = "bf16"
Stats = dict[str, Any]
# (label, the arm's own validation key, the BF16-served key of rl/stress_eval.py). "greedy" (exact accuracy) is the
# pre-registered measure; "reward" (the greedy answers' reward) matters where the task gives partial credit (the count
# task's leading correct terms), where exact accuracy is low and coarse.
ACC_KEYS = (("greedy", "val/accuracy", "val_bf16/accuracy"),
            ("sampled", "val/accuracy_sampled", "val_bf16/accuracy_sampled"),
            ("reward", "val/reward", "val_bf16/reward"))
MEASURES = {"greedy": "greedy accuracy", "reward": "greedy reward"}


def _last(rows: list[dict[str, Any]], key: str, last: bool = True) -> float | None:
    p = endpoint(rows, key, last)
    return p[1] if p else None


def seed_values(log_dir: Path, kind: str, bf16_start: dict[str, float | None]) -> dict[str, float | None]:
    """One run's held-out accuracies. ``policy_*``: the policy its trainer optimizes (bf16 and off-policy: BF16
    weights served in BF16, the start being the warm start's BF16 validation, i.e. the bf16 arm's step 0; unified:
    its own stressed forward, served by its rollout). ``served_*``: the arm's own validation. ``bf16_end``: the final
    weights served in BF16 (rl/stress_eval.py)."""
    rows, summary = load_run(log_dir)
    out: dict[str, float | None] = {}
    for label, val_key, bf16_key in ACC_KEYS:
        served_start, served_end = _last(rows, val_key, last=False), _last(rows, val_key)
        bf16_end = served_end if kind == "baseline" else summary.get(bf16_key)
        if kind == "unified":
            start, end = served_start, served_end
        else:
            start, end = (served_start if kind == "baseline" else bf16_start.get(label)), bf16_end
        out.update({f"{label}_start": start, f"{label}_end": end,
                    f"{label}_gain": end - start if start is not None and end is not None else None,
                    f"{label}_served_start": served_start, f"{label}_served_end": served_end,
                    f"{label}_bf16_end": bf16_end})
    return out


def _log_dir(d: str, root: Path | None, arm: str, seed: str) -> Path:
    """A run's log dir as compare.json names it, else its copy under ``root`` (``<arm>/seed<N>``: committed runs)."""
    p = Path(d)
    return p if p.exists() or root is None else compare.run_dir(root, arm, int(seed))


def points_of(arms: dict[str, Stats], root: Path | None = None) -> list[dict[str, Any]]:
    """One row per arm: format, kind, mismatch means (compare.json) and every accuracy across seeds. The other
    production arms a round may hold beside bf16 (jetrl, bf16_train_fp8_rollout) are left to compare.md: the
    dose-response is bf16 against the stressed arms."""
    base_dirs = arms.get(BASELINE, {}).get("log_dirs", {})
    bf16_start = {seed: seed_values(_log_dir(d, root, BASELINE, seed), "baseline", {})
                  for seed, d in base_dirs.items()}
    points = []
    for name, arm in arms.items():
        parsed = parse_arm(name)
        if parsed is None and name != BASELINE:
            continue
        kind = "baseline" if parsed is None else ("unified" if parsed[1] else "off-policy")
        per_seed = [seed_values(_log_dir(d, root, name, seed), kind, {lbl: bf16_start.get(seed, {}).get(f"{lbl}_start")
                                               for lbl, _, _ in ACC_KEYS})
                    for seed, d in arm.get("log_dirs", {}).items()]
        keys = sorted({k for v in per_seed for k in v})
        mm = arm.get("mismatch", {})
        points.append({"arm": name, "format": parsed[0] if parsed else name, "kind": kind,
                       "seeds": arm.get("seeds", []), "k3": mm.get("mismatch/k3_kl"),
                       "tmpe": mm.get("mismatch/token_mult_prob_error"),
                       **{k: spread([v[k] for v in per_seed]) for k in keys}})
    return points


def below(a: Stats | None, b: Stats | None) -> bool | None:
    """Whether ``a`` is below ``b`` beyond the seed spread (a's max < b's min); None without two seeds in both."""
    if not a or not b or a["n"] < 2 or b["n"] < 2:
        return None
    return a["max"] < b["min"]


def compared(p: dict[str, Any], base: dict[str, Any] | None,
             measure: str = "greedy") -> tuple[str, float | None, bool | None]:
    """(what is compared, difference of means, below beyond the spread) of one arm against BF16 on ``measure``
    (a label of ACC_KEYS): the end value of the trainer's policy for off-policy arms (both are BF16 policies from one
    start), the gain over its own start for unified arms (their policy starts from the warm start quantized in their
    format)."""
    what = f"{measure}_gain" if p["kind"] == "unified" else f"{measure}_end"
    a, b = p.get(what), (base or {}).get(what)
    return what, (a["mean"] - b["mean"]) if a and b else None, below(a, b)


def _range(s: Stats | None, fmt: str = "{:.3f}") -> str:
    return "n/a" if not s else f"{fmt_stats(s, fmt)} ({fmt.format(s['min'])}..{fmt.format(s['max'])})"


def _by_k3(p: dict[str, Any]) -> tuple[bool, float]:
    return p["kind"] != "baseline", (p["k3"] or {}).get("mean", 0.0)


def table(points: list[dict[str, Any]]) -> str:
    base = next((p for p in points if p["kind"] == "baseline"), None)
    head = ["arm", "kind", "seeds", "k3 KL", "token_mult_prob_error", "trainer's policy: greedy start",
            "greedy end (min..max)", "gain (min..max)", "sampled end", "vs bf16",
            "served in its format: greedy start -> end", "final weights in BF16: greedy",
            "trainer's policy: greedy reward start -> end (min..max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in sorted(points, key=_by_k3):
        if p["kind"] == "baseline":
            vs = "baseline"
        else:
            what, diff, low = compared(p, base)
            vs = "n/a" if diff is None else (f"{what.split('_')[1]} {diff:+.3f}, "
                                            + {True: "below beyond spread", False: "within spread",
                                               None: "spread undefined"}[low])
        lines.append("| " + " | ".join([
            p["arm"], p["kind"], str(len(p["seeds"])), fmt_stats(p["k3"], "{:.2e}"), fmt_stats(p["tmpe"], "{:.5f}"),
            fmt_stats(p.get("greedy_start")), _range(p.get("greedy_end")), _range(p.get("greedy_gain"), "{:+.3f}"),
            fmt_stats(p.get("sampled_end")), vs,
            f"{fmt_stats(p.get('greedy_served_start'))} -> {fmt_stats(p.get('greedy_served_end'))}",
            fmt_stats(p.get("greedy_bf16_end")),
            f"{fmt_stats(p.get('reward_start'))} -> {_range(p.get('reward_end'))}",
        ]) + " |")
    return "\n".join(lines)


def verdict(points: list[dict[str, Any]], measure: str = "greedy") -> str:
    """The mismatch level at which an off-policy arm first falls below BF16 beyond the seed spread on ``measure`` and
    where the unified arm of that format stands; or that none did, with the largest mismatch tried."""
    base = next((p for p in points if p["kind"] == "baseline"), None)
    off = sorted((p for p in points if p["kind"] == "off-policy" and p["k3"]), key=_by_k3)
    hit = next((p for p in off if compared(p, base, measure)[2]), None)
    if hit is None:
        top = off[-1] if off else None
        reach = (f" up to k3 {top['k3']['mean']:.2e} / token_mult_prob_error {top['tmpe']['mean']:.4f} "
                 f"({top['arm']})") if top else ""
        return (f"No off-policy arm ended below BF16 beyond the seed spread{reach}: a null result at this task "
                f"length and step count ({MEASURES[measure]}).")
    uni = next((p for p in points if p["kind"] == "unified" and p["format"] == hit["format"]), None)
    if uni is None:
        uni_text = "no unified arm of that format was run"
    else:
        _, diff, low = compared(uni, base, measure)
        uni_text = (f"the unified arm in the same format ({uni['arm']}, k3 {fmt_stats(uni['k3'], '{:.2e}')}) "
                    + ("gains less than BF16 beyond the spread too" if low else "gains as BF16 does, within the "
                       "spread") + f" (gain {_range(uni.get(f'{measure}_gain'), '{:+.3f}')} vs BF16's "
                    f"{_range((base or {}).get(f'{measure}_gain'), '{:+.3f}')})")
    return (f"The off-policy arm first falls below BF16 beyond the seed spread at k3 {hit['k3']['mean']:.2e} / "
            f"token_mult_prob_error {hit['tmpe']['mean']:.4f} ({hit['arm']}: {MEASURES[measure]} at the end "
            f"{_range(hit.get(f'{measure}_end'))} vs BF16's {_range((base or {}).get(f'{measure}_end'))}); "
            f"{uni_text}.")


def plot(points: list[dict[str, Any]], out_png: Path, title: str) -> Path:
    """Held-out greedy and sampled accuracy and greedy reward at the end (one panel each) against k3 (symlog: the
    unified arms sit at 0): mean with std bars and min..max whiskers per arm; BF16's min..max as a band and its mean
    as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(ACC_KEYS), 1, figsize=(8, 3.5 * len(ACC_KEYS)), sharex=True)
    formats = sorted({p["format"] for p in points if p["kind"] != "baseline"})
    colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(formats)}
    k3s = [p["k3"]["mean"] for p in points if p["k3"] and p["k3"]["mean"] > 0]
    linthresh = 10 ** math.floor(math.log10(min(k3s))) if k3s else 1e-6
    for ax, (label, _, _) in zip(axes, ACC_KEYS, strict=True):
        key = f"{label}_end"
        base = next((p for p in points if p["kind"] == "baseline" and p.get(key)), None)
        if base:
            s = base[key]
            ax.axhspan(s["min"], s["max"], color="0.85", label=f"bf16 min..max (n={s['n']})")
            ax.axhline(s["mean"], color="0.4", lw=1)
        for p in points:
            s, k3 = p.get(key), p["k3"]
            if p["kind"] == "baseline" or not s or not k3:
                continue
            x = k3["mean"]
            face = colors[p["format"]] if p["kind"] == "off-policy" else "white"
            ax.errorbar([x], [s["mean"]], yerr=[[s["mean"] - s["min"]], [s["max"] - s["mean"]]], fmt="none",
                        ecolor=colors[p["format"]], alpha=0.5, capsize=3)
            ax.plot([x], [s["mean"]], "o" if p["kind"] == "off-policy" else "s", ms=7, mfc=face,
                    mec=colors[p["format"]], label=f"{p['arm']} (n={s['n']})")
        ax.set_xscale("symlog", linthresh=linthresh)
        ax.set_ylabel(f"held-out {label} at the end\n(the trainer's policy)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    axes[-1].set_xlabel("k3 KL (rollout || trainer), mean over GRPO steps (symlog; unified arms at 0)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def report(compare_dir: Path) -> dict[str, Path]:
    """dose_response.md and .png next to ``compare.json``."""
    data = json.loads((compare_dir / "compare.json").read_text())
    meta, arms = data["meta"], data["arms"]
    points = points_of(arms, compare_dir)
    md = compare_dir / "dose_response.md"
    note = (f"recipe `{meta['recipe']}`, overrides `{' '.join(meta.get('overrides', []))}`, {meta['steps']} GRPO "
            f"steps, seeds {meta['seeds']}, one shared BF16 warm start (`{meta['warmstart']}`). k3 and "
            "token_mult_prob_error: mean over GRPO steps of the trainer-vs-rollout mismatch on response tokens, then "
            "mean ± std across seeds. Accuracy on the held-out prompts; 'trainer's policy': BF16 weights served in "
            "BF16 for bf16 and off-policy arms (their start: the warm start's BF16 validation), the stressed forward "
            "for unified arms (their own validation); off-policy arms are compared with BF16 on the end, unified "
            "arms on the gain. Rule: below BF16 beyond the seed spread = the arm's best seed is below BF16's worst.")
    verdicts = [verdict(points)]  # the pre-registered measure
    if any(p.get("reward_end") for p in points):  # where answers earn partial credit, the greedy reward too
        verdicts.append(f"On the greedy reward: {verdict(points, 'reward')}")
    atomic_write(md, table(points) + "\n\n" + "\n\n".join(verdicts) + f"\n\n{note}\n")
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
