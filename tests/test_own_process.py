"""The ``own_process`` marker (conftest.py) really runs a test in a child process, and its outcome is the child's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import OWN_PROCESS_ENV

CHILD_TESTS = '''import sys

import pytest


@pytest.mark.own_process
def test_fails():
    assert False


@pytest.mark.own_process
def test_passes_with_stderr_noise():
    print("engine log line", file=sys.stderr)


@pytest.mark.own_process
def test_skips():
    pytest.skip("no such device")
'''


@pytest.mark.own_process
def test_body_runs_in_a_child_process():
    assert os.environ.get(OWN_PROCESS_ENV) == "1", "the body ran in the parent pytest process"


def test_child_outcomes_become_the_parents(tmp_path):
    (tmp_path / "test_x.py").write_text(CHILD_TESTS)
    env = {k: v for k, v in os.environ.items() if k != OWN_PROCESS_ENV}
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "conftest", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out[-2000:]
    assert "1 failed, 1 passed, 1 skipped" in out and "in its own process (rc=1)" in out, out[-2000:]
    assert "no such device" in out, out[-2000:]
