"""`make test-gpu` runs the GPU suite, or the files ``GPU_TESTS`` names: on a cold GPU machine the whole suite does not
fit one call of the device's time limit, so it is run in parts (docs/vllm_gpu.md; bench/qwen3_8b_gpu.sh suite with
SUITE_FROM / SUITE_TO)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _make_n(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_TESTS", "ENV")}
    r = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), "test-gpu", "ENV=system", *args],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if " -m pytest " in line]
    assert len(lines) == 1, r.stdout  # ENV=system: no install step, the one pytest command
    return lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_test_gpu_runs_the_whole_suite_or_the_files_named():
    whole = _make_n()
    assert whole.startswith("python3 -m pytest") and whole.endswith("-m gpu tests"), whole
    part = _make_n("GPU_TESTS=tests/test_fp8_kernels_gpu.py tests/test_rollout_gpu.py")
    # only the named files, not the whole folder beside them
    assert part.endswith("-m gpu tests/test_fp8_kernels_gpu.py tests/test_rollout_gpu.py"), part
