"""A torch.profiler profile of one GRPO step (``policy.jet_rl.profile_step``), written as a table of where the time
goes: the step's phases and parts (the ranges ``StepMeter`` opens: ``phase/rollout``, ``part/policy_logprob``, ...)
and the top operators and kernels by their own device time (CPU time on a CPU run).

Why a table and not only a trace: an 8B step's trace is hundreds of MB; the question a profile answers here is
"which costs are the top ones", and the table answers it in a file small enough to commit beside the run.

Why a window: recording every op of an 8B step (32 micro-batches x 36 layers, fwd + recompute + bwd, and a rollout
of ~1000 decode steps) is ~1M events, and the profiler's own table of 200K ops took 43 s on a 2-core box: the first
profiled 8B step did not finish inside a 390 s device call. So only the chosen phases are recorded
(``profile_phases``; the rollout, vLLM's own decode loop, is left out by default: its rate is measured anyway) and in
them the first ``profile_micro_batches`` micro-batches of each pass and what follows the pass (the optimizer step);
the phases' wall times are recorded whole.

Why windows: whether a phase is host-bound shows only against its recorded wall time, so each recorded stretch of a
phase is a ``window/<phase>`` range (``window/<phase>/after_pass`` after its micro-batches) and the report gives, per
stretch, the device's busy time inside it and its kernels by kind (``profile_windows``), and the host's top operators
by their own CPU time (synchronizations and allocator calls show there)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from jetrl_megatron.rl.outputs.profile_copies import copy_lines, copy_origins
from jetrl_megatron.rl.outputs.profile_windows import (
    AFTER_PASS,
    WINDOW_PREFIX,
    device_us,
    split_events,
    window_report,
)

RANGE_PREFIXES = ("phase/", "part/", WINDOW_PREFIX)
PHASES = ("rollout", "logprob", "update", "refit")  # the phases StepMeter opens, in step order
DEFAULT_PHASES = ("logprob", "update", "refit")


@dataclass
class PhaseWindow:
    """What of one phase the profile recorded: its micro-batches (of every pass in it) begun and recorded."""

    profiled: bool
    micro_batches: int = 0
    recorded_micro_batches: int = 0

    def describe(self, name: str) -> str:
        if not self.profiled:
            return f"{name}: not recorded (wall time only)"
        if self.micro_batches == self.recorded_micro_batches:
            return f"{name}: whole" + (f" ({self.micro_batches} micro-batches)" if self.micro_batches else "")
        return (f"{name}: {self.recorded_micro_batches} of its {self.micro_batches} micro-batches (the first of each "
                "pass), and what follows each pass")


class StepProfile:
    """Profiles step ``step`` (1-based; 0: none) and writes ``<log_dir>/profile_step<N>.md`` and ``.json``.

    ``phases``: the phases recorded (of :data:`PHASES`); ``micro_batches``: in each pass over micro-batches of a
    recorded phase (a logprob pass, an update's forward/backward) the first this many are recorded (0: all), then
    recording resumes when the pass is done. The step's code tells it where it stands: :meth:`phase` around each
    phase, and the :class:`jetrl_megatron.megatron.model.PassObserver` calls (``micro_batch``,
    ``micro_batches_done``) from the passes; outside the profiled step they do nothing."""

    def __init__(self, step: int, log_dir: Path, top: int = 30, write: bool = True,
                 phases: Iterable[str] = DEFAULT_PHASES, micro_batches: int = 4) -> None:
        if step < 0:
            raise ValueError(f"policy.jet_rl.profile_step must be >= 0 (0: no profile), got {step}")
        phases = tuple(phases)
        unknown = [p for p in phases if p not in PHASES]
        if unknown or not phases:
            raise ValueError(f"policy.jet_rl.profile_phases must name some of {', '.join(PHASES)}; got "
                             f"{list(phases)}")
        if micro_batches < 0:
            raise ValueError(f"policy.jet_rl.profile_micro_batches must be >= 0 (0: all), got {micro_batches}")
        self.step, self.log_dir, self.top, self.write = step, Path(log_dir), top, write
        self.phases, self.micro_batches = phases, micro_batches
        self.windows: dict[str, PhaseWindow] = {}
        self._prof: profile | None = None
        self._acts: list[ProfilerActivity] = []
        self._recording = False
        self._phase: str | None = None
        self._window: tuple[str, record_function] | None = None  # the open window/<phase> range
        self._after_pass = False  # the phase's last pass is done: what runs now follows it
        self.window_failed: str | None = None  # why the profiler could not pause (then it records everything)

    @contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step != self.step:
            yield
            return
        cuda = torch.cuda.is_available()
        self._acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.windows = {}
        # record_shapes: the copy-origin table names the tensors copied (profile_copies)
        with profile(activities=self._acts, record_shapes=True) as prof:
            self._prof, self._recording = prof, True
            try:
                yield
            finally:
                self._phase = None
                self._record(True)
                if cuda:
                    torch.cuda.synchronize()
                self._prof = None
        if self.write:
            events = prof.events()
            self.save(prof.key_averages(), cuda, window_report(*split_events(events)), copy_origins(events, cuda))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Around one of the step's phases: recorded when it is one of ``phases``; recording resumes after it."""
        if self._prof is None:
            yield
            return
        window = self.windows.setdefault(name, PhaseWindow(profiled=name in self.phases))
        self._phase, self._after_pass = name, False
        self._record(window.profiled)
        try:
            yield
        finally:
            self._phase = None
            self._record(True)

    def _recorded_window(self) -> PhaseWindow | None:
        """The window of the phase now running, when it is being profiled and recorded."""
        window = self.windows.get(self._phase) if self._prof is not None and self._phase else None
        return window if window is not None and window.profiled else None

    def micro_batch(self, index: int) -> None:
        """A pass's micro-batch ``index`` begins: past the window, recording stops until the pass is done."""
        if (window := self._recorded_window()) is None:
            return
        window.micro_batches += 1
        self._after_pass = False
        if self.micro_batches and index >= self.micro_batches:
            self._record(False)
        else:
            window.recorded_micro_batches += 1
            self._match_window()

    def micro_batches_done(self) -> None:
        if self._recorded_window() is not None:
            self._after_pass = True
            self._record(True)

    def _record(self, on: bool) -> None:
        """Turn the profiler's collection on or off; the GPU's queued work first lands on the side it was issued.
        Then a ``window/<phase>`` range is open exactly while a profiled phase is being recorded."""
        if self._prof is None:
            return
        if on != self._recording and not self.window_failed:
            if not on and self._window is not None:
                self._close_window()  # synchronizes first
            elif torch.cuda.is_available():
                torch.cuda.synchronize()
            try:
                self._prof.toggle_collection_dynamic(on, self._acts)
                self._recording = on
            except (RuntimeError, AttributeError) as err:  # a profiler build without it: record everything, go on
                self.window_failed = str(err) or type(err).__name__
                warnings.warn(f"step profile: the profiler could not pause its collection ({self.window_failed}); "
                              "the whole step is recorded", stacklevel=2)
        self._match_window()

    def _match_window(self) -> None:
        """Open or switch the window to the stretch now recorded: ``<phase>`` (its micro-batches and what precedes
        them) or ``<phase>/after_pass`` (what follows a pass: the update's optimizer step), kept apart so that the
        optimizer's host work does not blur whether the micro-batches keep the device busy."""
        want = None
        if self._recording and self._recorded_window() is not None:
            want = self._phase + (AFTER_PASS if self._after_pass else "")
        if self._window is not None and self._window[0] == want:
            return
        self._close_window()
        if want is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the window holds only work issued inside it
            rng = record_function(WINDOW_PREFIX + want)
            rng.__enter__()
            self._window = (want, rng)

    def _close_window(self) -> None:
        """End the open window, once the device has finished what was issued in it (its wall time covers that)."""
        if self._window is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._window[1].__exit__(None, None, None)
        self._window = None

    def table(self, averages, cuda: bool, windows: dict | None = None, copies: list | None = None) -> dict:
        """The step's ranges, its top operators by own device time (CPU time on a CPU run) and by own host time, and
        per recorded phase the device's busy time and kernels by kind (``windows``: ``window_report``); ms."""
        ranges, ops = [], []
        for evt in averages:
            row = {"name": evt.key, "calls": int(evt.count), "cpu_total_ms": evt.cpu_time_total / 1e3,
                   "self_cpu_ms": evt.self_cpu_time_total / 1e3, "device_total_ms": device_us(evt, False) / 1e3,
                   "self_device_ms": device_us(evt, True) / 1e3}
            (ranges if evt.key.startswith(RANGE_PREFIXES) else ops).append(row)
        key = "self_device_ms" if cuda else "self_cpu_ms"
        ops.sort(key=lambda r: r[key], reverse=True)
        ranges.sort(key=lambda r: r["cpu_total_ms"], reverse=True)
        total = sum(r[key] for r in ops)
        recorded = {name: self.windows[name].describe(name) if name in self.windows else f"{name}: did not run"
                    for name in PHASES}
        if self.window_failed:
            recorded = {name: f"{name}: whole (the profiler could not pause: {self.window_failed})"
                        for name in PHASES}
        host_top = sorted(ops, key=lambda r: r["self_cpu_ms"], reverse=True)[: self.top]
        return {"step": self.step, "device": "cuda" if cuda else "cpu", "sorted_by": key, "total_self_ms": total,
                "recorded": recorded, "ranges": ranges, "top": ops[: self.top], "host_top": host_top,
                "windows": windows or {}, "copies": copies or []}

    def save(self, averages, cuda: bool, windows: dict | None = None, copies: list | None = None) -> Path:
        report = self.table(averages, cuda, windows, copies)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / f"profile_step{self.step}.json").write_text(json.dumps(report, indent=1))
        key = report["sorted_by"]
        lines = [f"# Profile of GRPO step {self.step} ({report['device']}; torch.profiler)", "",
                 "Recorded (`policy.jet_rl.profile_phases`, `profile_micro_batches`; phase wall times are whole, the "
                 "rest covers what was recorded):", ""]
        lines += [f"- {line}" for line in report["recorded"].values()]
        lines += ["", "| range | calls | wall ms (CPU side) | device ms |", "|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['calls']} | {r['cpu_total_ms']:.1f} | {r['device_total_ms']:.1f} |"
                  for r in report["ranges"]]
        lines += ["", f"Top {len(report['top'])} operators and kernels by {key.replace('_', ' ')} "
                  f"(all: {report['total_self_ms']:.1f} ms):", "",
                  "| # | name | calls | self device ms | self CPU ms | share |", "|---|---|---|---|---|---|"]
        for i, r in enumerate(report["top"], 1):
            share = r[key] / report["total_self_ms"] if report["total_self_ms"] else 0.0
            lines.append(f"| {i} | {r['name'][:90]} | {r['calls']} | {r['self_device_ms']:.1f} | "
                         f"{r['self_cpu_ms']:.1f} | {share:.1%} |")
        lines += _window_lines(report["windows"], cuda)
        lines += copy_lines(report["copies"], cuda)
        lines += ["", f"Top {len(report['host_top'])} operators by self CPU ms (the host's side: launches, "
                  "synchronizations, allocator calls):", "", "| # | name | calls | self CPU ms | self device ms |",
                  "|---|---|---|---|---|"]
        lines += [f"| {i} | {r['name'][:90]} | {r['calls']} | {r['self_cpu_ms']:.1f} | {r['self_device_ms']:.1f} |"
                  for i, r in enumerate(report["host_top"], 1)]
        path = self.log_dir / f"profile_step{self.step}.md"
        path.write_text("\n".join(lines) + "\n")
        return path


def _window_lines(windows: dict, cuda: bool) -> list[str]:
    """The per-phase busy table and each phase's kernels by kind and top kernels, as markdown lines."""
    if not windows:
        return []
    intro = ("Per recorded stretch (`window/<phase>`: its micro-batches; `<phase>/after_pass`: what follows a pass, "
             "the update's optimizer step): wall time, the device's busy time inside it (union of kernels, copies, "
             "memsets) and what is left idle: the device waited for the host (launches, synchronizations, allocator "
             "calls)" + ("" if cuda else " (a CPU run: no device events, so busy is 0)") + ". The profile's own "
             "synchronizations at each stretch's ends show as `cudaDeviceSynchronize` in the host table below.")
    lines = ["", intro, "",
             "| phase | windows | wall ms | device busy ms | idle ms (share) | kernel sum ms |",
             "|---|---|---|---|---|---|"]
    for phase, w in windows.items():
        idle_share = w["idle_ms"] / w["wall_ms"] if w["wall_ms"] else 0.0
        lines.append(f"| {phase} | {w['windows']} | {w['wall_ms']:.1f} | {w['busy_ms']:.1f} | {w['idle_ms']:.1f} "
                     f"({idle_share:.0%}) | {w['kernel_sum_ms']:.1f} |")
    for phase, w in windows.items():
        if not w["kinds_ms"]:
            continue
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in w["kinds_ms"].items())
        lines += ["", f"{phase}: device ms by kind: {kinds}", "", "| kernel | calls | ms |", "|---|---|---|"]
        lines += [f"| {t['name'][:100]} | {t['calls']} | {t['ms']:.1f} |" for t in w["top"]]
    return lines
