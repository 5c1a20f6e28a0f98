"""A throw-away one-node SLURM cluster on localhost for tests: munge, slurmctld and slurmd from Debian's packages,
started as root with their own key, socket, ports, state and logs under a temporary directory.

Why its own everything: the test must neither depend on nor disturb a SLURM or munge the machine may already run (the
packages' services, a real cluster's /etc/slurm), and it must leave nothing running when it stops, even after a
failure. The plugins are the ones that need no cgroup and no database: proctrack/linuxproc, task/none, no accounting.

Where the packages are missing, :func:`ensure_installed` installs them (root with apt-get: one quiet ``apt-get update``
and ``apt-get install``); it returns why not where that is impossible, and the tests skip with that reason -- or fail
where ``$JETRL_REQUIRE_SLURM=1`` (CI sets it: there the real-SLURM tests must run).
"""

from __future__ import annotations

import ctypes
import functools
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged", "mungekey")
REQUIRE_ENV = "JETRL_REQUIRE_SLURM"
NODE = "localhost"
# Job states after which a job does nothing more (scontrol's names).
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED")
# Pending reasons of a job that will not start by itself (a failed launch is requeued held, or never fits).
STUCK_REASONS = ("JobLaunchFailure", "launch_failed_requeued_held", "JobHeldAdmin", "JobHeldUser",
                 "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints")


def _missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


@functools.cache  # one attempt per test session, even where it fails
def ensure_installed(timeout: int = 600) -> tuple[str | None, float]:
    """(None, seconds spent installing) when SLURM and munge are usable, else (why not, seconds)."""
    if not _missing():
        return None, 0.0
    if os.geteuid() != 0:
        return f"SLURM is not installed ({', '.join(_missing())} missing) and this is not root", 0.0
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(_missing())} missing) and there is no apt-get", 0.0
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    t0 = time.time()
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` took longer than {timeout} s", time.time() - t0
        if r.returncode:
            tail = " ".join((r.stdout + r.stderr).split())[-400:]
            return f"`{' '.join(cmd)}` failed (exit {r.returncode}): {tail}", time.time() - t0
    if _missing():
        return f"installed {' '.join(PACKAGES)} but {', '.join(_missing())} are still missing", time.time() - t0
    return None, time.time() - t0


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (ip_local_port_range; 32768 where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_ports(n: int) -> list[int]:
    """n distinct TCP ports free now, below the kernel's ephemeral range: a port the kernel picked for a bind to 0
    is one it may also give any process's next outgoing connection (another test worker's) before the daemon binds
    it ("Address already in use", seen in CI). All bound at once, so that none is handed out twice."""
    socks: list[socket.socket] = []
    try:
        lo = 20000
        hi = max(_ephemeral_low(), lo + 4 * n)
        for port in random.sample(range(lo, hi), k=min(200, hi - lo)):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [x.getsockname()[1] for x in socks]
        raise RuntimeError(f"no {n} free TCP ports found in {lo}..{hi}")
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the daemon's child process before exec: SIGTERM it when the test process dies, so that a killed pytest
    leaves no daemon behind (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def parse_record(text: str) -> dict[str, str]:
    """One ``scontrol show ... -o`` record as key -> value."""
    return dict(tok.split("=", 1) for tok in text.split() if "=" in tok)


class LocalSlurm:
    """One node named ``localhost`` in partition ``debug``, its CPUs and memory as ``slurmd -C`` reports them.

    ``gpus`` > 0 declares that many fake GPUs (``Gres=gpu:N``, gres.conf ``File=`` entries that are character
    devices made here): SLURM then accepts and schedules ``--gres=gpu:N`` jobs on a machine without GPUs.
    ``DefMemPerCPU`` is set like many sites do (here a quarter of the node per job), so that a job's memory is capped
    unless it asks for ``--mem=0``."""

    def __init__(self, root: Path, gpus: int = 0) -> None:
        self.root = root
        self.gpus = gpus
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.first_job_id = random.randint(100_000, 60_000_000)  # unique logs/jetrl-<id> names across runs
        self.cpus = 0
        self.real_memory = 0
        self.def_mem_per_cpu = 0
        self.submitted: list[str] = []  # job ids, for the caller's clean-up

    # -- set-up ---------------------------------------------------------------------------------------------------
    def _node_line(self) -> str:
        r = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60)
        fields = parse_record(r.stdout.splitlines()[0] if r.stdout else "")
        self.cpus = int(fields.get("CPUs", os.cpu_count() or 1))
        self.real_memory = int(fields.get("RealMemory", 1024))
        self.def_mem_per_cpu = max(1, self.real_memory // (4 * self.cpus))
        keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
        hw = " ".join(f"{k}={fields[k]}" for k in keep if k in fields) or f"CPUs={self.cpus}"
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        return f"NodeName={NODE} NodeAddr=127.0.0.1 {hw}{gres} State=UNKNOWN"

    def _fake_gpus(self) -> str:
        d = self.root / "fakegpu"
        d.mkdir()
        for i in range(self.gpus):
            p = d / f"nvidia{i}"
            try:  # slurmd wants character devices; these are /dev/null's numbers and are never opened
                os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            except OSError:
                p.touch()  # where mknod is not allowed: slurmd complains in its log but still schedules the gres
        return f"NodeName={NODE} Name=gpu File={d}/nvidia[0-{self.gpus - 1}]\n"

    def _write_config(self) -> None:
        r = self.root
        for sub in ("state", "spool"):
            (r / sub).mkdir()
        ctld_port, slurmd_port = _free_ports(2)
        lines = [
            "ClusterName=jetrltest", f"SlurmctldHost={NODE}", f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={r / 'munge.socket'}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "MailProg=/bin/true", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            "ReturnToService=2", "MinJobAge=3600", "KillWait=5",
            f"FirstJobId={self.first_job_id}",
        ]
        if self.gpus:
            lines.append("GresTypes=gpu")
            (r / "gres.conf").write_text(self._fake_gpus())
        node = self._node_line()  # sets the CPU and memory sizes used below
        lines += [f"DefMemPerCPU={self.def_mem_per_cpu}", node,
                  f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP"]
        self.conf.write_text("\n".join(lines) + "\n")

    def env(self) -> dict[str, str]:
        """The environment for SLURM commands (and, through sbatch, for the jobs): this cluster's config only; no
        SLURM_*/SBATCH_* variable of an outer job leaks in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / f"{name}.stdout", "w")  # noqa: SIM115 -- the daemon keeps writing to it
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                            preexec_fn=_die_with_parent)
        out.close()

    def start(self, timeout: float = 90.0, attempts: int = 3) -> None:
        """Write the config, start munged, slurmctld and slurmd, and wait until the node is idle. A daemon that could
        not bind its port (taken between the choice and the bind) is started again on new ports, up to
        ``attempts`` times."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except RuntimeError as e:
                if "Address already in use" not in str(e) or attempt == attempts - 1:
                    raise
                self.stop()
                self.procs.clear()
                shutil.rmtree(self.root)

    def _start_once(self, timeout: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged requires its socket's directory to be searchable by all
        self._write_config()
        key = self.root / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=60)
        key.chmod(0o400)
        r = self.root
        self._spawn("munged", ["munged", "--foreground", f"--socket={r / 'munge.socket'}", f"--key-file={key}",
                               f"--pid-file={r / 'munged.pid'}", f"--log-file={r / 'munged.log'}",
                               f"--seed-file={r / 'munge.seed'}"])
        self._wait(lambda: (r / "munge.socket").exists(), timeout, "munged to create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.cmd("scontrol", "ping", check=False).returncode == 0, timeout, "slurmctld to answer")
        self._spawn("slurmd", ["slurmd", "-D", "-N", NODE, "-f", str(self.conf)])
        self._wait(lambda: self.cmd("sinfo", "-h", "-n", NODE, "-o", "%t", check=False).stdout.strip() == "idle",
                   timeout, "the node to be idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        t_end = time.time() + timeout
        while time.time() < t_end:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}\n{self.daemon_logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.daemon_logs()}")

    # -- use ------------------------------------------------------------------------------------------------------
    def cmd(self, *args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(list(args), capture_output=True, text=True, env=kw.pop("env", None) or self.env(),
                           timeout=timeout, **kw)
        if check and r.returncode:
            raise RuntimeError(f"{' '.join(args)} -> exit {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def job(self, job_id: str) -> dict[str, str]:
        """The job's record (kept MinJobAge after it ends), {} when slurmctld does not know it."""
        r = self.cmd("scontrol", "show", "job", "-o", job_id, check=False)
        return parse_record(r.stdout) if r.returncode == 0 else {}

    def wait(self, job_id: str, timeout: float) -> dict[str, str]:
        """Poll until the job is in a final state or stuck pending; cancel it on timeout. Returns its record."""
        t_end = time.time() + timeout
        rec: dict[str, str] = {}
        while time.time() < t_end:
            rec = self.job(job_id)
            state = rec.get("JobState", "")
            if state in FINAL_STATES or (state == "PENDING" and rec.get("Reason") in STUCK_REASONS):
                return rec
            time.sleep(1.0)
        self.cmd("scancel", job_id, check=False)
        raise TimeoutError(f"job {job_id} not finished after {timeout:.0f} s (last record: {rec})")

    def jobs(self) -> list[str]:
        r = self.cmd("squeue", "-h", "-o", "%i", check=False)
        return r.stdout.split() if r.returncode == 0 else []

    def daemon_logs(self, lines: int = 15) -> str:
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "munged.stdout", "slurmctld.stdout",
                     "slurmd.stdout"):
            p = self.root / name
            if p.exists():
                out.append(f"--- {name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    # -- tear-down ------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel every job, wait for them to go, then stop the daemons this object started (by their pids)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            for job_id in self.jobs():
                self.cmd("scancel", job_id, check=False)
            t_end = time.time() + 60
            while self.jobs() and time.time() < t_end:
                time.sleep(1.0)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=20)
