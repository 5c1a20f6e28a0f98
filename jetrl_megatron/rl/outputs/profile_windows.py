"""Where a profiled phase's wall time went: the device's busy time inside it, and its kernels by kind.

Why: at Qwen3-8B with 4K-token responses the jetrl arm's update ran 0.85x the bf16 arm's (2026-12-06) while its FP8
linears took less device time than bf16's GEMMs; a table of operators cannot tell whether the GPU sat waiting for the
host. Each recorded stretch of a phase is a ``window/<phase>`` range, or ``window/<phase>/after_pass`` for what
follows its micro-batches (``StepProfile`` opens them, synchronized at both ends); inside those windows the device's
busy time is the union of its kernel, copy and memset intervals, so ``wall - busy`` is the time the GPU was idle
(host-bound launches, synchronizations, allocator work).
"""

from __future__ import annotations

from collections.abc import Iterable

WINDOW_PREFIX = "window/"
AFTER_PASS = "/after_pass"  # a phase's stretch after its micro-batches (the update's optimizer step)

# A kernel's kind from its name (lower-cased; the first rule that matches wins): what the precision contract makes
# FP8 (the GEMMs and their quantization), what stays BF16 in both arms (attention, norms, element-wise), and the
# traffic (copies, host-device transfers).
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the project's Triton FP8 GEMM sums its split-K partials in _sum_splits_kernel
    ("fp8_gemm", ("deep_gemm", "fp8_gemm", "e4m3", "scaled_mm", "sum_splits")),
    ("fp8_quant", ("quant", "regroup")),
    ("attention", ("flash", "fmha", "attn", "sdpa")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass")),
    ("memcpy", ("memcpy",)),
    ("memset", ("memset",)),
    # before the norms: the optimizer's and gradient clipping's kernels (Adam, multi-tensor apply, L2 norms)
    ("optimizer", ("adam", "multi_tensor", "lpnorm", "l2norm", "norm_two", "normtwo")),
    ("norm", ("rms", "layer_norm", "layernorm")),
    ("swiglu", ("swiglu", "silu", "act_and_mul")),
    ("rope", ("rope", "rotary")),
    ("softmax_logprob", ("softmax", "logprob", "cross_entropy", "topk")),
    ("copy_cast", ("copy",)),
    ("elementwise", ("elementwise", "reduce", "residual_add", "triton")),
)


def classify(name: str, rules: tuple[tuple[str, tuple[str, ...]], ...], default: str) -> str:
    """The label of the first rule one of whose lower-case fragments is in ``name`` (``default`` when none is)."""
    low = name.lower()
    return next((label for label, needles in rules if any(n in low for n in needles)), default)


def kernel_kind(name: str) -> str:
    """The kind of a device event by its name (``other`` when no rule names it)."""
    return classify(name, KERNEL_KINDS, "other")


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by half-open intervals ``[start, end)`` (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _clipped(events: list[tuple[str, float, float]], windows: list[tuple[float, float]]
             ) -> list[tuple[str, float, float]]:
    """Each device event's parts inside the windows (a window is a recorded stretch; windows do not overlap)."""
    out = []
    for name, start, end in events:
        for w_start, w_end in windows:
            s, e = max(start, w_start), min(end, w_end)
            if e > s:
                out.append((name, s, e))
    return out


def window_report(windows: dict[str, list[tuple[float, float]]], device_events: list[tuple[str, float, float]],
                  top: int = 12) -> dict[str, dict]:
    """Per phase (times in microseconds in, milliseconds out): ``wall_ms`` of its recorded windows, the device's
    ``busy_ms`` (union of its events' intervals there), ``idle_ms`` = wall - busy, ``kernel_sum_ms`` (events added up:
    above busy when streams overlap), ``kinds_ms`` (that sum by :func:`kernel_kind`) and its ``top`` events by
    summed time (name, calls, ms)."""
    report = {}
    for phase, spans in windows.items():
        inside = _clipped(device_events, spans)
        wall = sum(e - s for s, e in spans)
        busy = union_length((s, e) for _, s, e in inside)
        per_name: dict[str, list[float]] = {}
        for name, s, e in inside:
            entry = per_name.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += e - s
        kinds: dict[str, float] = {}
        for name, (_, t) in per_name.items():  # each distinct name classified once
            kind = kernel_kind(name)
            kinds[kind] = kinds.get(kind, 0.0) + t
        ranked = sorted(per_name.items(), key=lambda item: item[1][1], reverse=True)[:top]
        report[phase] = {
            "windows": len(spans), "wall_ms": wall / 1e3, "busy_ms": busy / 1e3, "idle_ms": (wall - busy) / 1e3,
            "kernel_sum_ms": sum(e - s for _, s, e in inside) / 1e3,
            "kinds_ms": {k: v / 1e3 for k, v in sorted(kinds.items(), key=lambda kv: kv[1], reverse=True)},
            "top": [{"name": n, "calls": int(c), "ms": t / 1e3} for n, (c, t) in ranked],
        }
    return report


def device_us(evt, self_only: bool) -> float:
    """An event's device (CUDA) time in microseconds (its own kernels' with ``self_only``, else with its children's),
    under the attribute names of either torch release line."""
    names = ("self_device_time_total", "self_cuda_time_total") if self_only else ("device_time_total",
                                                                                   "cuda_time_total")
    for name in names:
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _device_name(evt) -> str:
    device_type = getattr(evt, "device_type", None)
    return "CPU" if device_type is None else getattr(device_type, "name", str(device_type)).upper()


def _is_device_work(evt) -> bool:
    """A kernel, copy or memset on the device (not a CPU op, nor the device-side shadow of a ``record_function``)."""
    if _device_name(evt) not in ("CUDA", "PRIVATEUSE1"):
        return False
    return not getattr(evt, "is_user_annotation", False) and not evt.name.startswith(
        ("phase/", "part/", WINDOW_PREFIX, "Optimizer.", "ProfilerStep"))


def split_events(events) -> tuple[dict[str, list[tuple[float, float]]], list[tuple[str, float, float]]]:
    """From ``torch.profiler.profile.events()``: the host-side ``window/<phase>`` ranges per phase, and the device's
    work as (name, start, end), all in the profiler's microseconds."""
    windows: dict[str, list[tuple[float, float]]] = {}
    device: list[tuple[str, float, float]] = []
    for evt in events:
        start, end = float(evt.time_range.start), float(evt.time_range.end)
        if _is_device_work(evt):
            device.append((evt.name, start, end))
        elif evt.name.startswith(WINDOW_PREFIX) and _device_name(evt) == "CPU":  # not its device-side shadow
            windows.setdefault(evt.name[len(WINDOW_PREFIX):], []).append((start, end))
    return windows, device
