"""Shared test configuration: GPU tests skip without CUDA (and say so); the CPU suite runs single-threaded BLAS-free."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: run on the H200 test machine (results in bench/RESULTS.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def mp():
    """TP=PP=1 Megatron parallel state for one test module; the process group is destroyed only if it created it."""
    import torch.distributed as dist

    from jetrl_megatron.megatron import cpu

    created = not dist.is_initialized()
    cpu.init_parallel(1, 1)
    yield
    cpu.teardown_parallel(destroy_process_group=created)
    cpu.disable_cpu_mode()
