"""`python -m jetrl_megatron.cli ...` for the tests, in a fresh process that starts warm
(jetrl_megatron/warm_process.py): the process a user starts, without its ~10 s of imports; a plain subprocess where
the test's environment changes what the imports read (then ``warm`` is False).

One forkserver per test process serves these runs and the spawned Megatron worlds (megatron/cpu.py), with one
preload list (conftest.py sets it for both)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from jetrl_megatron.warm_process import WarmLauncher, default_preload

# The runs' imports, then what the spawned worlds' ranks import (their functions live in test modules: pytest).
PRELOAD = (*default_preload(), "jetrl_megatron.megatron.model", "jetrl_megatron.rl.trainer", "pytest")
LAUNCHER = WarmLauncher(PRELOAD)


def run_cli(args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, jetrl_megatron.cli, *args], capture_output=True, text=True, ...)``, warm."""
    return LAUNCHER.run("jetrl_megatron.cli", list(args), env=env, timeout=timeout, cwd=cwd)[0]
