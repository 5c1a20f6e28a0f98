"""The ``own_process`` marker (conftest.py) really runs a test in a child process, and its outcome is the child's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import OWN_PROCESS_ENV

FAILING_TEST = "import pytest\n\n\n@pytest.mark.own_process\ndef test_fails():\n    assert False\n"


@pytest.mark.own_process
def test_body_runs_in_a_child_process():
    assert os.environ.get(OWN_PROCESS_ENV) == "1", "the body ran in the parent pytest process"


def test_child_failure_fails_the_parent(tmp_path):
    (tmp_path / "test_x.py").write_text(FAILING_TEST)
    env = {k: v for k, v in os.environ.items() if k != OWN_PROCESS_ENV}
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "in its own process (rc=1)" in proc.stdout, proc.stdout[-2000:]
