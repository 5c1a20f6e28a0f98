"""A torch.profiler profile of one GRPO step (``policy.jet_rl.profile_step``), written as a table of where the time
goes: the step's phases and parts (the ranges ``StepMeter`` opens: ``phase/rollout``, ``part/policy_logprob``, ...)
and the top operators and kernels by their own device time (CPU time on a CPU run).

Why a table and not only a trace: an 8B step's trace is hundreds of MB; the question a profile answers here is
"which costs are the top ones", and the table answers it in a file small enough to commit beside the run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

RANGE_PREFIXES = ("phase/", "part/")


def _device_us(evt, self_only: bool) -> float:
    """An event's device (CUDA) time in microseconds, under the attribute names of either torch release line."""
    names = ("self_device_time_total", "self_cuda_time_total") if self_only else ("device_time_total",
                                                                                   "cuda_time_total")
    for name in names:
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


class StepProfile:
    """Profiles step ``step`` (1-based; 0: none) and writes ``<log_dir>/profile_step<N>.md`` and ``.json``."""

    def __init__(self, step: int, log_dir: Path, top: int = 30, write: bool = True) -> None:
        if step < 0:
            raise ValueError(f"policy.jet_rl.profile_step must be >= 0 (0: no profile), got {step}")
        self.step, self.log_dir, self.top, self.write = step, Path(log_dir), top, write

    @contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step != self.step:
            yield
            return
        cuda = torch.cuda.is_available()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            yield
            if cuda:
                torch.cuda.synchronize()
        if self.write:
            self.save(prof.key_averages(), cuda)

    def table(self, averages, cuda: bool) -> dict:
        """The step's ranges and its top operators, times in ms."""
        ranges, ops = [], []
        for evt in averages:
            row = {"name": evt.key, "calls": int(evt.count), "cpu_total_ms": evt.cpu_time_total / 1e3,
                   "self_cpu_ms": evt.self_cpu_time_total / 1e3, "device_total_ms": _device_us(evt, False) / 1e3,
                   "self_device_ms": _device_us(evt, True) / 1e3}
            (ranges if evt.key.startswith(RANGE_PREFIXES) else ops).append(row)
        key = "self_device_ms" if cuda else "self_cpu_ms"
        ops.sort(key=lambda r: r[key], reverse=True)
        ranges.sort(key=lambda r: r["cpu_total_ms"], reverse=True)
        total = sum(r[key] for r in ops)
        return {"step": self.step, "device": "cuda" if cuda else "cpu", "sorted_by": key, "total_self_ms": total,
                "ranges": ranges, "top": ops[: self.top]}

    def save(self, averages, cuda: bool) -> Path:
        report = self.table(averages, cuda)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / f"profile_step{self.step}.json").write_text(json.dumps(report, indent=1))
        key = report["sorted_by"]
        lines = [f"# Profile of GRPO step {self.step} ({report['device']}; torch.profiler)", "",
                 "| range | calls | wall ms (CPU side) | device ms |", "|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['calls']} | {r['cpu_total_ms']:.1f} | {r['device_total_ms']:.1f} |"
                  for r in report["ranges"]]
        lines += ["", f"Top {len(report['top'])} operators and kernels by {key.replace('_', ' ')} "
                  f"(all: {report['total_self_ms']:.1f} ms):", "",
                  "| # | name | calls | self device ms | self CPU ms | share |", "|---|---|---|---|---|---|"]
        for i, r in enumerate(report["top"], 1):
            share = r[key] / report["total_self_ms"] if report["total_self_ms"] else 0.0
            lines.append(f"| {i} | {r['name'][:90]} | {r['calls']} | {r['self_device_ms']:.1f} | "
                         f"{r['self_cpu_ms']:.1f} | {share:.1%} |")
        path = self.log_dir / f"profile_step{self.step}.md"
        path.write_text("\n".join(lines) + "\n")
        return path
