"""Side-by-side table of GRPO runs' last step: phase seconds, the mismatch, and (from the run's profiled step) how
busy the device was in the logprob pass's and the update's recorded micro-batches.

Why: the 8B rounds compare arms run one after another in one device call (bench/qwen3_8b_gpu.sh arms); the table is
read from each run's own files (metrics.jsonl, profile_step<N>.json), so it can be recomputed from the committed runs.
With more than two steps a run also shows its update's forward+backward over every step after the first (median and
range): two runs one after another differed by 2.3 s in one step on 2026-12-07, so one step per run cannot settle a
difference of that size.

Usage: python3 bench/step_table.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

COLUMNS = (("rollout s", "time/rollout"), ("logprob s", "time/logprob"), ("update s", "time/update"),
           ("optimizer s", "time/optimizer"), ("refit s", "time/refit"), ("step s", "time/step"),
           ("k3", "mismatch/k3_kl"), ("update cudaFree", "memory/gpu_cuda_frees_update"),
           ("update peak GiB", "memory/gpu_peak_gib_update"))


def step_rows(run: Path) -> list[dict]:
    """The run's metrics rows, one per step (empty when the run wrote none)."""
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def last_step(run: Path) -> dict:
    """The last metrics row of a run (empty when the run wrote none)."""
    rows = step_rows(run)
    return rows[-1] if rows else {}


def busy(run: Path) -> tuple[int | None, dict[str, tuple[float, float]]]:
    """The run's profiled step (its last profile_step<N>.json) and per recorded stretch of it (``update``: the
    micro-batches; ``update/after_pass``: the optimizer step) the device's busy ms and the wall ms."""
    profiles = sorted(run.glob("profile_step*.json"), key=lambda p: int(p.stem.removeprefix("profile_step") or 0))
    if not profiles:
        return None, {}
    step = int(profiles[-1].stem.removeprefix("profile_step"))
    windows = json.loads(profiles[-1].read_text()).get("windows", {})
    return step, {phase: (w["busy_ms"], w["wall_ms"]) for phase, w in windows.items()}


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and value != 0 and abs(value) < 1e-2:
        return f"{value:.2e}"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _fwd_bwd(row: dict) -> float | None:
    """The update without its optimizer step (the micro-batches' forward and backward), seconds."""
    update, opt = row.get("time/update"), row.get("time/optimizer")
    return None if update is None or opt is None else update - opt


def later_fwd_bwd(run: Path) -> str:
    """The update's forward+backward over every step after the first (its JIT and first-touch costs excluded):
    median [min-max] and how many steps, so two runs' spread can be told from their difference."""
    values = sorted(v for row in step_rows(run) if (row.get("step") or 0) > 1 and (v := _fwd_bwd(row)) is not None)
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} [{values[0]:.2f}-{values[-1]:.2f}] n={len(values)}"


def table(runs: list[Path]) -> str:
    head = ["run", "step", *(name for name, _ in COLUMNS), "update fwd+bwd s", "fwd+bwd steps 2+ s",
            "profiled step", "logprob busy", "update busy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        row = last_step(run)
        profiled, shares = busy(run)
        cells = [run.name, _fmt(row.get("step")), *(_fmt(row.get(key)) for _, key in COLUMNS), _fmt(_fwd_bwd(row)),
                 later_fwd_bwd(run), _fmt(profiled)]
        for phase in ("logprob", "update"):
            b, w = shares.get(phase, (None, None))
            cells.append(f"{b / w:.0%} of {w:.0f} ms" if b is not None and w else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    missing = [a for a in argv if not Path(a).is_dir()]
    if missing:
        print(f"step_table: not a run directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(table([Path(a) for a in argv]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
