"""Run a test module's own ``__main__`` under the Triton interpreter, in a child process.

Why a child: TRITON_INTERPRET must be set before triton is imported, and this process imported it already. The
child prints ``INTERP-OK`` at its end; an assertion, a missing module or a traceback through this project or the test
module fails the test, while a child that died inside the interpreter itself is a skip that names why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_module_under_interpreter(module_file: str, what: str, timeout: int = 300) -> str:
    """The child's stdout; fails with ``what`` and the child's tail when its checks failed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(module_file)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.abspath(module_file)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=root)
    print(proc.stdout[-4000:])
    if "INTERP-OK" not in proc.stdout:
        tail = (proc.stderr or proc.stdout)[-4000:]
        ours = ("AssertionError", "jetrl_megatron", os.path.basename(module_file), "ModuleNotFoundError")
        if any(mark in tail for mark in ours):  # the checks, this project or the test's own code failed
            pytest.fail(f"{what} under the interpreter:\n{tail}")
        pytest.skip(f"the Triton interpreter itself could not run the kernels on this machine:\n{tail}")
    return proc.stdout
