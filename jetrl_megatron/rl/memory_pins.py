"""Which live tensors pin torch's cached GPU blocks: a report of the default pool's fragmented segments.

Why: a colocated engine wakes into the memory torch's caching allocator gives back, and ``torch.cuda.empty_cache``
returns only segments with no tensor left in them. At Qwen3-8B with 4K-token responses on an H100 (2026-12-06) 21.2
GiB of the trainer's cache sat in segments that also held tensors, with a cache release before the optimizer step
in place; the totals alone cannot say which tensors. This report names each such segment's live blocks by size and,
when torch records its allocation history (``policy.jet_rl.record_memory_history``), by where they were allocated.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from jetrl_megatron.rl.phase_memory import device_segments, in_default_pool

__all__ = ["allocation_site", "pinned_segments_report", "start_recording", "write_pins"]

GIB = float(1 << 30)
MIB = float(1 << 20)
# frames inside these folders say how, not who: the site reported is the first frame outside them
_MACHINERY = ("/torch/nn/", "/torch/autograd/", "/torch/utils/", "/torch/_", "/contextlib.py", "/functools.py")


def start_recording() -> bool:
    """Have torch keep each live block's allocation stack (Python frames), so reports name where pins come from;
    the live state only, no event history (a snapshot then stays small). Costs host time per allocation; a
    diagnostic, off by default. False without CUDA."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
    return True


def allocation_site(frames: Iterable[dict]) -> str:
    """``file:line function`` of the innermost frame outside torch's machinery ('' without recorded frames)."""
    frames = [f for f in frames if f.get("filename")]
    chosen = next((f for f in frames if not any(m in f["filename"] for m in _MACHINERY)), frames[0] if frames else None)
    if chosen is None:
        return ""
    parts = Path(chosen["filename"]).parts
    return f"{'/'.join(parts[-2:])}:{chosen.get('line', '?')} {chosen.get('name', '?')}"


def _live(block: dict) -> bool:
    """An allocated tensor (what ``allocated_size`` counts; a block pending free is neither live nor free yet)."""
    return block.get("state") == "active_allocated"


def pinned_segments_report(segments: list[dict], top: int = 8, blocks_per_segment: int = 4) -> list[str]:
    """Lines: the default pool's segments holding both tensors and free bytes, most free bytes first (``top`` of
    them), each with its live blocks (largest first, ``blocks_per_segment`` of them) and their allocation sites;
    then the sites that pin the most free bytes in all such segments. Empty when nothing is fragmented."""
    pinned = [s for s in segments if in_default_pool(s) and 0 < s["allocated_size"] < s["total_size"]]
    if not pinned:
        return []
    pinned.sort(key=lambda s: s["total_size"] - s["allocated_size"], reverse=True)
    free_total = sum(s["total_size"] - s["allocated_size"] for s in pinned)
    lines = [f"{free_total / GIB:.2f} GiB free in {len(pinned)} default-pool segments that also hold tensors "
             "(torch.cuda.empty_cache cannot return them):"]
    by_site: dict[str, float] = {}
    for seg in pinned:
        free = seg["total_size"] - seg["allocated_size"]
        live = sorted(((b["size"], allocation_site(b.get("frames", []))) for b in seg.get("blocks", []) if _live(b)),
                      reverse=True)
        for size, site in live:  # a segment's free bytes are charged to each site pinning it, by its share of bytes
            key = site or "(no recorded frames)"
            by_site[key] = by_site.get(key, 0.0) + free * size / max(seg["allocated_size"], 1)
        if len(lines) > top:
            continue
        shown = ", ".join(f"{size / MIB:.1f} MiB" + (f" at {site}" if site else "")
                          for size, site in live[:blocks_per_segment])
        more = f" and {len(live) - blocks_per_segment} more" if len(live) > blocks_per_segment else ""
        lines.append(f"  segment {seg['total_size'] / GIB:.2f} GiB: {free / GIB:.2f} free, {len(live)} live "
                     f"block(s) {seg['allocated_size'] / GIB:.2f} GiB: {shown}{more}")
    lines.append("  free bytes pinned, by the allocation site of the tensors that pin them:")
    for site, nbytes in sorted(by_site.items(), key=lambda kv: kv[1], reverse=True)[:top]:
        lines.append(f"    {nbytes / GIB:6.2f} GiB  {site}")
    return lines


def write_pins(path: Path, heading: str) -> list[str]:
    """Append this device's report under ``heading`` to ``path`` (a no-op without CUDA); returns its lines."""
    if not torch.cuda.is_available():
        return []
    lines = pinned_segments_report(device_segments(torch.cuda.current_device())) or ["nothing fragmented"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(f"## {heading}\n" + "\n".join(lines) + "\n\n")
    return lines
