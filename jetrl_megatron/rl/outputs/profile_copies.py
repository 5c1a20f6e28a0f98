"""Where a profiled step's copies and casts come from: each ``aten::copy_`` grouped by the operators that called it
and the shapes it copied.

Why: in the Qwen3-8B update at 4K tokens copies and casts were ~10% of a micro-batch's device time and ~21% of a
logprob micro-batch's (2026-12-06, H200), and a kernel name (``direct_copy_kernel_cuda``) says nothing of which
transpose, ``contiguous()`` or dtype conversion launched it. The profiler's operator tree does: ``aten::copy_``'s
ancestors (``aten::clone`` < ``aten::contiguous`` < ``_RopeFn``, or an autograd node's backward) name its origin,
and with ``record_shapes`` its input shapes name the tensor.
"""

from __future__ import annotations

from jetrl_megatron.rl.outputs.profile_windows import device_us

COPY_OP = "aten::copy_"


def origin(evt, depth: int = 4) -> str:
    """The names of an event's nearest ``depth`` ancestors, nearest first (``a < b < c``); ``-`` at the top."""
    names, parent = [], getattr(evt, "cpu_parent", None)
    while parent is not None and len(names) < depth:
        names.append(parent.name)
        parent = getattr(parent, "cpu_parent", None)
    return " < ".join(names) or "-"


def copy_origins(events, on_device: bool, top: int = 30) -> list[dict]:
    """``aten::copy_`` events grouped by (origin, input shapes): calls and own time in ms (device time on a CUDA
    run, CPU time otherwise), the largest first."""
    groups: dict[tuple[str, str], list[float]] = {}
    for evt in events:
        if evt.name != COPY_OP:
            continue
        shapes = str(getattr(evt, "input_shapes", None) or [])
        entry = groups.setdefault((origin(evt), shapes), [0, 0.0])
        entry[0] += 1
        entry[1] += device_us(evt, self_only=True) if on_device else float(evt.self_cpu_time_total)
    ranked = sorted(groups.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return [{"origin": o, "shapes": s, "calls": int(c), "ms": t / 1e3} for (o, s), (c, t) in ranked]


def copy_lines(rows: list[dict], on_device: bool) -> list[str]:
    """The copy-origin table as markdown lines (none when nothing was copied)."""
    if not rows:
        return []
    unit = "device ms" if on_device else "CPU ms"
    lines = ["", f"Copies and casts (`{COPY_OP}`) by origin, the operators above it nearest first, and the shapes it "
             f"copied (largest {len(rows)} by {unit}):", "", f"| origin | shapes | calls | {unit} |",
             "|---|---|---|---|"]
    lines += [f"| {r['origin'][:120]} | {r['shapes'][:80]} | {r['calls']} | {r['ms']:.1f} |" for r in rows]
    return lines
