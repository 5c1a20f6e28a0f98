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
