"""`jetrl`: the command line of jetrl_megatron.

  jetrl run     --recipe NAME|PATH [a.b=c ...]    train with GRPO (tiny_cpu by default: CPU, a few minutes)
  jetrl compare --recipe NAME [--arms a,b,c]      run several jet_rl.mode arms and tabulate mismatch + reward
  jetrl plan    --recipe NAME [a.b=c ...]          resolved config, parallel layout, resharder preflight, memory
  jetrl sbatch  --recipe NAME --nodes N [--submit] the SLURM command for slurm/jetrl.sbatch (GPU or CPU recipe)
  jetrl reshard-check ... / jetrl export ...       the resharder's commands (see docs/reshard.md)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from jetrl_megatron.errors import UserError, one_line
from jetrl_megatron.rl.config import ARM_MODES, DEFAULT_RECIPE, REPO_ROOT, ConfigError, load_config
from jetrl_megatron.rl.logging import quiet_libraries

COMPARE_ARMS = ("bf16", "bf16_train_fp8_rollout", "jetrl")


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="recipe name in recipes/ or a YAML path")
    p.add_argument("overrides", nargs="*", help="a.b=c overrides of recipe keys (values parsed as YAML)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jetrl", description="On-policy FP8 RL (Jet-RL) on Megatron-Core + vLLM")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _recipe_args(sub.add_parser("run", help="train with GRPO"))
    c = sub.add_parser("compare", help="run several arms of a recipe and tabulate mismatch + reward")
    _recipe_args(c)
    c.add_argument("--arms", default=",".join(COMPARE_ARMS), help=f"comma-separated jet_rl.mode values {ARM_MODES}")
    c.add_argument("--out", default=None, help="output dir (default runs/compare/<recipe>)")
    p = sub.add_parser("plan", help="validate a recipe: config, layout, resharder preflight, memory estimate")
    _recipe_args(p)
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory to check the estimate against")
    p.add_argument("--no-config", action="store_true", help="do not print the resolved config")
    s = sub.add_parser("sbatch", help="print (or submit) the SLURM command for a GPU or CPU recipe")
    _recipe_args(s)
    s.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the recipe's cluster.num_nodes)")
    s.add_argument("--submit", action="store_true", help="run sbatch instead of printing the command")
    sub.add_parser("reshard-check", help="resharder preflight (see docs/reshard.md)", add_help=False)
    sub.add_parser("export", help="HF FP8 export (see docs/reshard.md)", add_help=False)
    return ap


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    quiet_libraries()
    if cfg.is_gpu:
        import torch

        if not torch.cuda.is_available():
            print(f"jetrl run: recipe {cfg.name!r} is a GPU recipe (cluster.gpus_per_node = "
                  f"{cfg.cluster.gpus_per_node}) but CUDA is not available on this machine. Run it on a GPU node "
                  f"(`make sbatch RECIPE={cfg.name}`), or validate it here with `make plan RECIPE={cfg.name}`.",
                  file=sys.stderr)
            return 2
    from jetrl_megatron.rl.preflight import check_run

    check_run(cfg, args.recipe, args.overrides)
    from jetrl_megatron.rl.loop import run

    log_dir = Path(cfg.logger.log_dir)
    fresh = not log_dir.exists()
    try:
        summary = run(cfg)
    except BaseException:
        if fresh:
            _remove_unused_log_dir(log_dir)
        raise
    if not summary.get("ok", True):
        print(f"jetrl run: {summary.get('error', 'the run failed')}", file=sys.stderr)
        return 1
    return 0


def _remove_unused_log_dir(log_dir: Path) -> None:
    """A run that failed before its first GRPO step leaves no log directory behind (rank 0 removes the one it
    created); once a step is logged the directory holds real history and stays."""
    if os.environ.get("RANK", "0") != "0" or not log_dir.is_dir():
        return
    metrics = log_dir / "metrics.jsonl"
    if metrics.exists():
        try:
            if any(json.loads(ln).get("step", 0) > 0 for ln in metrics.read_text().splitlines() if ln.strip()):
                return
        except (OSError, ValueError):
            return
    shutil.rmtree(log_dir, ignore_errors=True)


def _arm_summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


COMPARE_COLUMNS = (
    ("mismatch/k3_kl", "k3 KL", "{:.3e}"),
    ("mismatch/kl", "KL", "{:.3e}"),
    ("mismatch/token_mult_prob_error", "token_mult_prob_error", "{:.6f}"),
    ("mismatch/abs_dp_max", "max abs dp", "{:.3e}"),
    ("mismatch/is_oob_frac", "IS out of [0.5, 2]", "{:.4f}"),
)


def compare_table(rows: list[tuple[str, dict]]) -> str:
    """Markdown table: one row per arm, mismatch means over steps, reward first -> last."""
    head = ["arm", *[c[1] for c in COMPARE_COLUMNS], "reward first -> last", "accuracy first -> last", "s/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, s in rows:
        mean = s.get("mismatch_mean", {})
        cells = [arm] + [fmt.format(mean[k]) if k in mean else "n/a" for k, _, fmt in COMPARE_COLUMNS]
        r0, r1 = s.get("reward_first"), s.get("reward_last")
        a0, a1 = s.get("accuracy_first"), s.get("accuracy_last")
        cells.append(f"{r0:.3f} -> {r1:.3f}" if r0 is not None and r1 is not None else "n/a")
        cells.append(f"{a0:.3f} -> {a1:.3f}" if a0 is not None and a1 is not None else "n/a")
        cells.append(f"{s['step_time_mean']:.1f}" if "step_time_mean" in s else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cmd_compare(args: argparse.Namespace) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARM_MODES]
    if bad:
        print(f"jetrl compare: unknown arm(s) {bad}; choose from {ARM_MODES}", file=sys.stderr)
        return 2
    base = load_config(args.recipe, args.overrides)  # validate once before spending time
    out = Path(args.out or REPO_ROOT / "runs" / "compare" / base.name)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.time()
    for arm in arms:
        run_dir = out / arm
        ov = [*args.overrides, f"jet_rl.mode={arm}", f"logger.log_dir={run_dir}",
              "grpo.final_arm_probe=false", f"checkpointing.checkpoint_dir={run_dir / 'checkpoints'}"]
        cmd = [sys.executable, "-m", "jetrl_megatron.cli", "run", "--recipe", args.recipe, *ov]
        print(f"== arm {arm}: {shlex.join(cmd[1:])}", flush=True)
        rc = subprocess.call(cmd)
        if rc:
            print(f"jetrl compare: arm {arm} failed (exit {rc}); see {run_dir}", file=sys.stderr)
            return rc
        rows.append((arm, _arm_summary(run_dir)))
    table = compare_table(rows)
    steps = base.grpo.max_num_steps
    note = (f"recipe `{base.name}`, {steps} GRPO steps per arm, mismatch = mean over steps on response tokens "
            f"(rollout vs trainer log-probs of the sampled tokens); wall {time.time() - t0:.0f} s")
    text = f"{table}\n\n{note}\n"
    tmp = out / "compare.md.tmp"
    tmp.write_text(text)
    os.replace(tmp, out / "compare.md")
    print(text)
    print(f"written to {out / 'compare.md'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from jetrl_megatron.rl.plan import plan_report

    cfg = load_config(args.recipe, args.overrides)
    text, ok = plan_report(cfg, args.gpu_mem_gib, show_config=not args.no_config)
    print(text)
    print(f"# plan: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def sbatch_command(recipe: str, nodes: int, overrides: list[str], gres: str, parsable: bool = False) -> list[str]:
    """The sbatch line for slurm/jetrl.sbatch; ``gres`` is ``gpu:N`` or ``none`` (a CPU recipe: see slurm.gres)."""
    env = [f"RECIPE={recipe}"]
    if overrides:
        env.append(f"OVERRIDES={' '.join(overrides)}")
    script = str(REPO_ROOT / "slurm" / "jetrl.sbatch")
    return ["env", *env, "sbatch", *(["--parsable"] if parsable else []), f"--nodes={nodes}", f"--gres={gres}",
            f"--chdir={REPO_ROOT}", script]


def cmd_sbatch(args: argparse.Namespace) -> int:
    from jetrl_megatron import slurm

    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes: must be >= 1, got {args.nodes}")
    cfg = load_config(args.recipe, args.overrides)
    nodes = cfg.cluster.num_nodes if args.nodes is None else args.nodes
    overrides = list(args.overrides)
    if nodes != cfg.cluster.num_nodes:
        overrides.append(f"cluster.num_nodes={nodes}")
        cfg = load_config(args.recipe, overrides)  # the layout must still be valid at this node count
    problem = slurm.login_venv_problem(cfg, slurm.torch_version())
    if not args.submit:
        print(shlex.join(sbatch_command(args.recipe, nodes, overrides, slurm.gres(cfg))))
        if problem:
            print(f"jetrl sbatch: warning: {problem}", file=sys.stderr)
        return 0
    if problem:
        print(f"jetrl sbatch: {problem}", file=sys.stderr)
        return 2
    if shutil.which("sbatch") is None:
        print("jetrl sbatch --submit: `sbatch` is not on PATH (not a SLURM login node)", file=sys.stderr)
        return 2
    (REPO_ROOT / "logs").mkdir(exist_ok=True)
    r = subprocess.run(sbatch_command(args.recipe, nodes, overrides, slurm.gres(cfg), parsable=True),
                       stdout=subprocess.PIPE, text=True)
    if r.returncode:
        return r.returncode
    job_id = r.stdout.strip().split(";")[0]
    why = slurm.never_starts(job_id)
    if why:
        subprocess.run(["scancel", job_id])
        print(f"jetrl sbatch: {why}; cancelled it", file=sys.stderr)
        return 2
    print(f"Submitted batch job {job_id}")
    print(f"jetrl sbatch: {slurm.ranks_per_node(cfg)} rank(s) per node on {nodes} node(s); batch log "
          f"{REPO_ROOT / 'logs' / f'jetrl-{job_id}.out'}, run logs {REPO_ROOT / 'logs' / f'jetrl-{job_id}'}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("reshard-check", "export"):
        from jetrl_megatron import reshard_cli as commands  # lazy: only these subcommands need the resharder

        fn = commands.reshard_check_main if argv[0] == "reshard-check" else commands.export_main
        return int(fn(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    try:
        return {"run": cmd_run, "compare": cmd_compare, "plan": cmd_plan, "sbatch": cmd_sbatch}[args.cmd](args)
    except UserError as e:
        print(f"jetrl {args.cmd}: {one_line(e, limit=2000)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
