"""The report of torch cache segments pinned by live tensors (rl/memory_pins.py).

CPU: the report's arithmetic on allocator snapshots in torch's format (segments, blocks, frames), a segment shape a
caching allocator produces: a freed large block with a smaller live tensor carved out of it. GPU (``gpu``): the real
allocator, a tensor carved out of a freed block, named by the report with this file as its allocation site.
"""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.rl.memory_pins import allocation_site, pinned_segments_report

MIB = 1 << 20


def _segment(total_mib: int, live: list[tuple[int, str]], pool=(0, 0)) -> dict:
    blocks = [{"size": size * MIB, "state": "active_allocated",
               "frames": [{"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"},
                          {"filename": f"/x/pkg/{site}.py", "line": 7, "name": site}]} for size, site in live]
    used = sum(size for size, _ in live)
    blocks.append({"size": (total_mib - used) * MIB, "state": "inactive", "frames": []})
    return {"total_size": total_mib * MIB, "allocated_size": used * MIB, "segment_pool_id": pool, "blocks": blocks}


def test_the_report_ranks_pinned_segments_and_charges_their_free_bytes_to_allocation_sites():
    segments = [
        _segment(1024, [(100, "adam"), (28, "fp8")]),   # 896 MiB free, pinned by two sites
        _segment(512, [(512, "weights")]),              # full: not fragmented
        _segment(2048, [(48, "adam")]),                 # 2000 MiB free
        _segment(300, []),                              # wholly free: returnable, not pinned
        _segment(4096, [(96, "kv")], pool=(1, 7)),      # a private pool: not torch's default
    ]
    lines = pinned_segments_report(segments, top=8)
    assert lines[0].startswith(f"{(896 + 2000) / 1024:.2f} GiB free in 2 default-pool segments")
    assert lines[1].lstrip().startswith("segment 2.00 GiB: 1.95 free, 1 live")  # most free first
    assert "pkg/adam.py:7 adam" in lines[1]  # the frame outside torch's machinery
    assert lines[2].lstrip().startswith("segment 1.00 GiB: 0.88 free, 2 live") and "fp8" in lines[2]
    by_site = {ln.split()[-1]: float(ln.split()[0]) for ln in lines[lines.index(
        "  free bytes pinned, by the allocation site of the tensors that pin them:") + 1:]}
    # adam: all of segment 3's 2000 MiB and 100/128 of segment 1's 896; fp8: the remaining 28/128 of 896
    assert by_site["adam"] == pytest.approx(round((2000 + 896 * 100 / 128) / 1024, 2), abs=0.006)
    assert by_site["fp8"] == pytest.approx(round(896 * 28 / 128 / 1024, 2), abs=0.006)
    assert pinned_segments_report([_segment(512, [(512, "weights")]), _segment(300, [])]) == []


def test_the_site_skips_torch_machinery_and_falls_back_to_the_innermost_frame():
    frames = [{"filename": "/x/torch/autograd/function.py", "line": 3, "name": "apply"},
              {"filename": "/x/megatron/core/optimizer/hybrid.py", "line": 93, "name": "step"}]
    assert allocation_site(frames) == "optimizer/hybrid.py:93 step"
    assert allocation_site(frames[:1]) == "autograd/function.py:3 apply"
    assert allocation_site([]) == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tensor_carved_out_of_a_freed_block_is_named_with_its_allocation_site():
    from jetrl_megatron.rl.memory_pins import start_recording
    from jetrl_megatron.rl.phase_memory import device_segments

    torch.cuda.empty_cache()
    assert start_recording()
    try:
        big = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        del big  # its 256 MiB segment stays cached
        pin = torch.empty(40 * MIB, dtype=torch.uint8, device="cuda")  # best fit: carved out of that segment
        torch.cuda.empty_cache()  # returns only wholly free segments
        lines = pinned_segments_report(device_segments(torch.cuda.current_device()), top=10_000)
        print("\n".join(lines))
        # best fit may carve it out of another cached block an earlier test left in a used segment: any segment
        site = "40.0 MiB at tests/test_rl_memory_pins.py"
        assert any(ln.lstrip().startswith("segment ") and site in ln for ln in lines), lines
        assert any(ln.endswith("test_a_tensor_carved_out_of_a_freed_block_is_named_with_its_allocation_site")
                   and "GiB  tests/test_rl_memory_pins.py:" in ln for ln in lines), lines
        del pin
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
