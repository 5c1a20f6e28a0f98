"""bench/graph_layout_probe.py's fixed whole-row layout: on a CPU, the layout it builds without reading any length is
the one vLLM's block manager layout (vllm_cuda.ops.PagedLayout.build) gives the same rows as whole sequences, and the
packed rows it compares against are the grid's real tokens in sequence order. The FA3 comparison itself needs a GPU
(`bash bench/qwen3_8b_gpu.sh graphprobe`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from jetrl_megatron.megatron.numerics import PackedRows
from jetrl_megatron.vllm_cuda.ops import KV_BLOCK, PagedLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import graph_layout_probe as probe  # noqa: E402


@pytest.mark.parametrize("b, sq", [(1, 16), (1, 2048), (3, 1100), (8, 17), (5, 300)])
def test_whole_row_layout_is_the_block_managers_for_full_rows(b, sq):
    dev = torch.device("cpu")
    got = probe.full_row_layout(b, sq, dev)
    cu = torch.arange(b + 1, dtype=torch.int32) * sq
    want = PagedLayout.build(cu, sq)
    assert torch.equal(got.cu_seqlens, want.cu_seqlens) and torch.equal(got.lens, want.lens)
    assert got.max_seqlen == want.max_seqlen == sq and got.block_size == want.block_size == KV_BLOCK
    assert torch.equal(got.block_table, want.block_table) and got.block_table.dtype == want.block_table.dtype
    assert torch.equal(got.slot, want.slot) and got.slot.dtype == want.slot.dtype
    assert got.total_blocks == want.total_blocks
    # every slot once, each row in its own blocks
    assert torch.equal(got.slot.sort().values, torch.unique(got.slot))


def test_the_packed_rows_are_the_grids_real_tokens_in_sequence_order():
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        b, sq = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 400, (1,), generator=gen))
        lengths = probe._lengths((b, sq, None), gen)
        assert max(lengths) == sq and min(lengths) >= 1 and len(lengths) == b
        idx = PackedRows.build(torch.tensor(lengths, dtype=torch.int32), sq).idx
        want = [r * sq + p for r, n in enumerate(lengths) for p in range(n)]
        assert idx.tolist() == want


def test_bits_equal_tells_signed_zeros_and_dtypes_apart():
    x = torch.randn(64, dtype=torch.bfloat16)
    assert probe._bits_equal(x, x.clone())
    assert not probe._bits_equal(torch.zeros(3), -torch.zeros(3))
    assert not probe._bits_equal(x, x.float())
    y = x.clone()
    y.view(torch.int16)[7] += 1  # one unit in the last place
    assert not probe._bits_equal(x, y) and torch.allclose(x.float(), y.float(), rtol=1e-2)


def test_the_probe_refuses_a_machine_without_gpu_vllm():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the probe runs (bench/qwen3_8b_gpu.sh graphprobe)")
    with pytest.raises(SystemExit, match="needs GPU vLLM's ops"):
        probe.main(["--iters", "1"])
