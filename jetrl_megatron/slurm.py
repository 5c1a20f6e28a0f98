"""SLURM support shared by `jetrl sbatch` (on the login node: the sbatch line, the submission) and slurm/jetrl.sbatch
(on the job's first node).

Why one module for both sides: the ranks a node runs and whether the virtual environment can serve the job are checked
twice -- before submitting (cheap: package metadata, SLURM's own view of the job) and in the job before ``srun``
(torch itself, on the node that has, or lacks, the GPUs) -- and both must give the same answer and name the same fix.

``python -m jetrl_megatron.slurm --recipe NAME [a.b=c ...]`` is the job's preflight: it loads the recipe, checks the
venv's torch on this node, and prints the number of ranks per node; on a problem it prints one ``jetrl: ...`` line and
exits 2, before ``srun`` starts anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from jetrl_megatron.errors import UserError, one_line
from jetrl_megatron.rl.config import REPO_ROOT, RunConfig, load_config

# Pending reasons of a job that can never start on this cluster as it is configured (SLURM keeps such a job pending
# forever unless the site sets EnforcePartLimits): too many nodes or too long for the partition, unknown features.
NEVER_STARTS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints")

def _is_repo_venv(prefix: str) -> bool:
    """``prefix`` is the repository's own ``.venv`` (what `make setup` builds and the sbatch template defaults to)."""
    return Path(prefix).resolve() == (REPO_ROOT / ".venv").resolve()


def gpu_venv_fix(venv: str | None = None) -> str:
    """How to rebuild ``venv`` (this environment by default) with the GPU build."""
    venv = venv or sys.prefix
    default = _is_repo_venv(venv)
    where = ".venv" if default else venv
    return (f"rebuild it with the GPU build: `rm -rf {where} && make setup DEVICE=gpu"
            f"{'' if default else f' VENV={venv}'}` in the repository (pip needs no GPU, a login node will do), then "
            "resubmit")


def job_venv() -> str | None:
    """The environment the job's ranks should run in: this one (the one `jetrl sbatch` checked), or None when it is
    the repository's own ``.venv``, the template's default."""
    return None if _is_repo_venv(sys.prefix) else sys.prefix


def ranks_per_node(cfg: RunConfig) -> int:
    """Processes torchrun starts on each node.

    GPU recipe: one per GPU. CPU recipe: the fewest processes the layout needs, lcm(trainer TP x PP, rollout TP)
    (TP x PP whenever the rollout TP divides it), so that each node holds whole model-parallel groups and the nodes
    are the data-parallel replicas."""
    if cfg.is_gpu:
        return cfg.cluster.gpus_per_node
    return cfg.min_processes


def gres(cfg: RunConfig) -> str:
    """The ``--gres`` value of the job. ``none`` for a CPU recipe: it overrides the template's GPU line, which a
    cluster without GPU gres would refuse (``Invalid generic resource (gres) specification``)."""
    return f"gpu:{cfg.cluster.gpus_per_node}" if cfg.is_gpu else "none"


def torch_version() -> str | None:
    """The installed torch's version string from package metadata (``2.13.0+cpu`` for the CPU build), without the
    seconds an ``import torch`` costs; None when torch is not installed."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def login_venv_problem(cfg: RunConfig, version: str | None) -> str | None:
    """What is wrong with this environment for the job, seen from the login node (no GPU needed there)."""
    venv = sys.prefix
    if version is None:
        return f"{venv} has no torch: run `make setup` in the repository first"
    if cfg.is_gpu and version.endswith("+cpu"):
        return (f"{venv} has torch {version}, the CPU-only build (`make setup` installs it on a machine without "
                f"nvidia-smi), but recipe {cfg.name!r} is a GPU job whose ranks would all stop with 'CUDA is not "
                f"available'; {gpu_venv_fix()}")
    return None


def node_venv_problem(cfg: RunConfig) -> str | None:
    """What is wrong with this environment for the job, seen from the job's node (imports torch)."""
    try:
        import torch
    except ImportError as e:
        return f"{sys.prefix}: torch does not import ({one_line(e)}): run `make setup` in the repository"
    if not cfg.is_gpu:
        return None
    host = socket.gethostname()
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"{sys.prefix} has torch {torch.__version__}, the CPU-only build (`make setup` installs it on a "
                f"machine without nvidia-smi), so CUDA is not available on {host} for GPU recipe {cfg.name!r}; "
                f"{gpu_venv_fix()}")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        return (f"CUDA is not available on {host} (torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible}): the "
                f"job got no usable GPU for GPU recipe {cfg.name!r}; check the node's driver (nvidia-smi) and that "
                f"the job asks for --gres=gpu:{cfg.cluster.gpus_per_node}")
    return None


def _job_fields(text: str) -> dict[str, str]:
    """``scontrol show ... -o`` / one ``squeue`` record as key -> value (values never contain spaces here)."""
    return dict(tok.split("=", 1) for tok in text.split() if "=" in tok)


def never_starts(job_id: str) -> str | None:
    """Why a just-submitted job can never start, or None. SLURM sets the pending reason while it accepts the job,
    so one ``squeue`` right after ``sbatch`` sees it."""
    r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%r|%P|%D|%l"], capture_output=True, text=True)
    if r.returncode or not r.stdout.strip():
        return None
    reason, partition, nodes, limit = (r.stdout.strip().splitlines()[0].split("|") + ["?"] * 4)[:4]
    if reason not in NEVER_STARTS:
        return None
    p = subprocess.run(["scontrol", "show", "partition", "-o", partition], capture_output=True, text=True)
    part = _job_fields(p.stdout)
    have = ", ".join(f"{k}={part[k]}" for k in ("TotalNodes", "MaxNodes", "MaxTime") if k in part)
    return (f"job {job_id} could never start (Reason={reason}): it asks for {nodes} node(s) and time {limit}, "
            f"partition {partition} has {have or 'other limits'}; ask for fewer nodes (--nodes) or use another "
            "partition (SBATCH_PARTITION=...)")


def sbatch_command(recipe: str, nodes: int, overrides: list[str], gres: str, parsable: bool = False) -> list[str]:
    """The sbatch line for slurm/jetrl.sbatch; ``gres`` is ``gpu:N`` or ``none`` (a CPU recipe: see ``gres``)."""
    env = [f"RECIPE={recipe}"]
    if overrides:
        env.append(f"OVERRIDES={' '.join(overrides)}")
    if (venv := job_venv()) is not None:  # the ranks run in the environment checked here, not the template's default
        env.append(f"VENV={venv}")
    script = str(REPO_ROOT / "slurm" / "jetrl.sbatch")
    return ["env", *env, "sbatch", *(["--parsable"] if parsable else []), f"--nodes={nodes}", f"--gres={gres}",
            f"--chdir={REPO_ROOT}", script]


def submit(recipe: str, nodes: int, overrides: list[str], cfg: RunConfig) -> int:
    """Submit the job (``cfg``: ``recipe`` with ``overrides``) and print its id and where its logs go; a job SLURM
    can never start is cancelled at once (see ``never_starts``). Returns the exit code of `jetrl sbatch --submit`."""
    if shutil.which("sbatch") is None:
        print("jetrl sbatch --submit: `sbatch` is not on PATH (not a SLURM login node)", file=sys.stderr)
        return 2
    (REPO_ROOT / "logs").mkdir(exist_ok=True)
    r = subprocess.run(sbatch_command(recipe, nodes, overrides, gres(cfg), parsable=True),
                       stdout=subprocess.PIPE, text=True)
    if r.returncode:
        return r.returncode
    job_id = r.stdout.strip().split(";")[0]
    why = never_starts(job_id)
    if why:
        subprocess.run(["scancel", job_id])
        print(f"jetrl sbatch: {why}; cancelled it", file=sys.stderr)
        return 2
    print(f"Submitted batch job {job_id}")
    print(f"jetrl sbatch: {ranks_per_node(cfg)} rank(s) per node on {nodes} node(s); batch log "
          f"{REPO_ROOT / 'logs' / f'jetrl-{job_id}.out'}, run logs {REPO_ROOT / 'logs' / f'jetrl-{job_id}'}/")
    return 0


def preflight(argv: list[str] | None = None) -> int:
    """The job's check before ``srun``: prints the ranks per node, or one ``jetrl: ...`` line and returns 2."""
    ap = argparse.ArgumentParser(prog="python -m jetrl_megatron.slurm", description=__doc__)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
    except UserError as e:
        print(f"jetrl: {one_line(e, limit=2000)}", file=sys.stderr)
        return 2
    problem = node_venv_problem(cfg)
    if problem:
        print(f"jetrl: {problem}", file=sys.stderr)
        return 2
    print(ranks_per_node(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(preflight())
