"""`jetrl`: the command line of jetrl_megatron.

  jetrl run     --recipe NAME|PATH [--arm A] [a.b=c ...]  train with GRPO (tiny_cpu by default: CPU, a few minutes)
  jetrl run     --config FILE.yaml [a.b=c ...]    the same, in NeMo-RL's run_grpo.py form (Hydra-style overrides)
  jetrl compare --recipe NAME [--arms a,b,c]      every arm x --seeds N from one BF16 warm start, aggregated
  jetrl plan    --recipe NAME [a.b=c ...]          resolved config, parallel layout, resharder preflight, memory
  jetrl plan    --recommend --recipe NAME [...]    every TP x PP x DP / rollout-TP layout of the cluster, ranked
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
from jetrl_megatron.rl.compare import COMPARE_ARMS
from jetrl_megatron.rl.config import (
    ARM_MODES,
    DEFAULT_RECIPE,
    REPO_ROOT,
    ConfigError,
    arm_overrides,
    load_config,
    warn_ignored,
)
from jetrl_megatron.rl.logging import quiet_libraries


def _recipe_args(p: argparse.ArgumentParser, arm: bool = True) -> None:
    p.add_argument("--recipe", default=None, help=f"recipe name in recipes/ or a YAML path (default {DEFAULT_RECIPE})")
    p.add_argument("--config", default=None, help="a NeMo-RL-layout YAML file (NeMo-RL's run_grpo.py habit; same as "
                   "--recipe PATH)")
    if arm:
        p.add_argument("--arm", choices=ARM_MODES, default=None,
                       help="set NeMo-RL's switches for this arm (fp8_cfg.enabled, vllm_cfg.precision) and "
                            "policy.jet_rl.arm")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides: a.b=1, +a.new=1, ++a.b=1, ~a.b")


def _normalize_recipe_args(args: argparse.Namespace) -> None:
    """--config FILE is --recipe FILE; --arm ARM puts the arm's switches before the user's overrides (a user override
    that contradicts them is then an error, not silently overwritten)."""
    if getattr(args, "config", None) is not None:
        if args.recipe is not None:
            raise UserError("give --recipe or --config, not both")
        if not Path(args.config).is_file():
            raise UserError(f"--config {args.config}: no such file")
        args.recipe = str(Path(args.config).resolve())
    if getattr(args, "recipe", "") is None:
        args.recipe = DEFAULT_RECIPE
    if getattr(args, "arm", None):
        args.overrides = [*arm_overrides(args.arm), *args.overrides]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jetrl", description="On-policy FP8 RL (Jet-RL) on Megatron-Core + vLLM")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _recipe_args(sub.add_parser("run", help="train with GRPO"))
    c = sub.add_parser("compare", help="run several arms of a recipe and tabulate mismatch + reward")
    _recipe_args(c, arm=False)
    c.add_argument("--arms", default=",".join(COMPARE_ARMS), help=f"comma-separated arms {ARM_MODES}")
    c.add_argument("--seeds", type=int, default=3, help="runs per arm, seeds grpo.seed .. grpo.seed + N - 1")
    c.add_argument("--out", default=None, help="output dir (default runs/compare/<recipe>)")
    c.add_argument("--parallel", type=int, default=1,
                   help="arm runs at once after the warm start (each its own process, output to <run dir>.log); on "
                        "one GPU they share it, so set vllm_cfg.gpu_memory_utilization to leave room for all")
    c.add_argument("--reuse", action="store_true",
                   help="skip a run whose log dir holds an ok summary.json and the same configuration (without it, "
                        "every run starts afresh and its earlier output is removed)")
    c.add_argument("--warmstart-only", action="store_true",
                   help="stop after the shared BF16 warm start (run the arms later with --reuse, which keeps it)")
    p = sub.add_parser("plan", help="validate a recipe: config, layout, resharder preflight, memory estimate")
    _recipe_args(p)
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory to check the estimate against")
    p.add_argument("--host-mem-gib", type=float, default=None,
                   help="host memory per node to check the estimate against (optimizer CPU offload, vLLM's sleep "
                        "backup); unchecked when not given")
    p.add_argument("--no-config", action="store_true", help="do not print the resolved config")
    p.add_argument("--recommend", action="store_true",
                   help="try every trainer TP x PP x DP and rollout TP layout of the cluster (cluster.num_nodes, "
                        "cluster.gpus_per_node) through this plan and print them ranked (rule in rl/recommend.py)")
    s = sub.add_parser("sbatch", help="print (or submit) the SLURM command for a GPU or CPU recipe")
    _recipe_args(s)
    s.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the recipe's cluster.num_nodes)")
    s.add_argument("--submit", action="store_true", help="run sbatch instead of printing the command")
    k = sub.add_parser("keys", help="NeMo-RL v0.7.0 GRPO keys and their status here (docs/nemo_rl_keys.md)")
    k.add_argument("--tarball", default=None, help="NeMo-RL v0.7.0 release tarball (default: $JETRL_NEMO_RL_TARBALL "
                   "or shared/upstream/nemo-rl-v0.7.0.tar.gz beside the checkout)")
    sub.add_parser("reshard-check", help="resharder preflight (see docs/reshard.md)", add_help=False)
    sub.add_parser("export", help="HF FP8 export (see docs/reshard.md)", add_help=False)
    return ap


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    warn_ignored(cfg)
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


def _compare_plan(args: argparse.Namespace, out: Path, arms: list[str], seeds: list[int], tokenizer: str | None
                  ) -> list[tuple[str, Path, list[str]]]:
    """(label, log dir, overrides) of every run, the BF16 warm start first; the user's overrides come first so the
    harness's own (arm, seed, paths, the shared warm start) always win."""
    from jetrl_megatron.rl import compare

    runs = [("BF16 warm start", out / "warmstart", [*args.overrides, *compare.warmstart_overrides(out)])]
    runs += [(f"arm {arm} seed {seed}", compare.run_dir(out, arm, seed),
              [*args.overrides, *compare.arm_overrides(out, arm, seed, tokenizer)]) for seed in seeds for arm in arms]
    return runs


def _fresh_run_command(args: argparse.Namespace, log_dir: Path, overrides: list[str], expected: dict,
                       reuse: bool) -> list[str] | None:
    """The command of one run, or None when ``reuse`` finds it already finished with the same configuration. Any
    other earlier output of the run is removed first: its checkpoints would otherwise be resumed from, and they may
    come from another warm start or configuration."""
    from jetrl_megatron.rl.compare import finished

    if reuse and finished(log_dir, expected):
        print(f"   reusing {log_dir} (finished with the same configuration)", flush=True)
        return None
    if log_dir.exists():
        print(f"   removing the earlier output in {log_dir}", flush=True)
        shutil.rmtree(log_dir)
    return [sys.executable, "-m", "jetrl_megatron.cli", "run", "--recipe", args.recipe, *overrides]


def _compare_run(args: argparse.Namespace, label: str, log_dir: Path, overrides: list[str], expected: dict,
                 reuse: bool) -> tuple[int, bool]:
    """One run in a fresh process (vLLM and Megatron state are global), its output on this terminal.
    Returns (exit code, whether it ran)."""
    cmd = _fresh_run_command(args, log_dir, overrides, expected, reuse)
    if cmd is None:
        return 0, False
    print(f"   {shlex.join(cmd[1:])}", flush=True)
    rc = subprocess.call(cmd)
    if rc:
        print(f"jetrl compare: {label} failed (exit {rc}); see {log_dir}", file=sys.stderr)
    return rc, True


def _compare_run_many(args: argparse.Namespace, runs: list[tuple[str, Path, list[str]]], expected: dict,
                      reuse: bool) -> int:
    """The arm runs, ``args.parallel`` at a time, each in its own process writing to ``<run dir>.log`` (interleaved
    output from several runs would be unreadable). Returns the first non-zero exit code, after all have ended."""
    pending, active, failed = list(runs), [], 0
    while pending or active:
        while pending and len(active) < args.parallel:
            label, log_dir, ov = pending.pop(0)
            print(f"== {label}", flush=True)
            cmd = _fresh_run_command(args, log_dir, ov, expected[log_dir], reuse)
            if cmd is None:
                continue
            log_dir.parent.mkdir(parents=True, exist_ok=True)
            log = open(log_dir.with_suffix(".log"), "w")  # noqa: SIM115 (closed when the process ends)
            print(f"== {label} started: {shlex.join(cmd[1:])} > {log.name}", flush=True)
            active.append((label, log_dir, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(1.0)
        for item in list(active):
            label, log_dir, log, proc = item
            if proc.poll() is None:
                continue
            active.remove(item)
            log.close()
            print(f"== {label} ended (exit {proc.returncode})", flush=True)
            if proc.returncode and not failed:
                print(f"jetrl compare: {label} failed (exit {proc.returncode}); see {log.name}", file=sys.stderr)
                failed = proc.returncode
    return failed


def cmd_compare(args: argparse.Namespace) -> int:
    """Every arm x seed from one shared BF16 warm start, then the aggregate (rl/compare.py)."""
    import yaml

    from jetrl_megatron.rl import compare
    from jetrl_megatron.rl.config import to_yaml

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARM_MODES]
    if bad or not arms:
        print(f"jetrl compare: unknown arm(s) {', '.join(map(repr, bad)) or '(none given)'}; choose from "
              f"{', '.join(ARM_MODES)}", file=sys.stderr)
        return 2
    if args.parallel < 1:
        print(f"jetrl compare: --parallel must be >= 1, got {args.parallel}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print(f"jetrl compare: --seeds must be >= 1 (runs per arm), got {args.seeds}", file=sys.stderr)
        return 2
    base = load_config(args.recipe, args.overrides)  # validate once before spending time
    out = Path(args.out or REPO_ROOT / "runs" / "compare" / base.name).resolve()
    seeds = [base.grpo.seed + i for i in range(args.seeds)]
    tokenizer = None if base.policy.tokenizer.name else base.policy.model_name
    plan = _compare_plan(args, out, arms, seeds, tokenizer)
    # every run's configuration, validated now (a bad combination fails here, not after the warm start)
    expected = {d: yaml.safe_load(to_yaml(load_config(args.recipe, ov))) for _, d, ov in plan}
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    reuse = args.reuse
    for k, (label, log_dir, ov) in enumerate(plan, 1):
        if k > 1 and args.parallel > 1:
            rc = _compare_run_many(args, plan[1:], expected, reuse)
            if rc:
                return rc
            break
        print(f"== [{k}/{len(plan)}] {label}", flush=True)
        rc, ran = _compare_run(args, label, log_dir, ov, expected[log_dir], reuse)
        if rc:
            return rc
        if k == 1:
            if not (compare.warmstart_model(out) / "config.json").is_file():
                print(f"jetrl compare: the warm start wrote no model to {compare.warmstart_model(out)}",
                      file=sys.stderr)
                return 1
            reuse = reuse and not ran  # runs from an earlier warm start are not this comparison's
            if args.warmstart_only:
                print(f"warm start ready: {compare.warmstart_model(out)} (the arms: the same command with --reuse "
                      f"instead of --warmstart-only)")
                return 0
    arm_runs = {arm: {s: compare.run_dir(out, arm, s) for s in seeds} for arm in arms}
    agg = compare.aggregate(arm_runs)
    meta = {"recipe": base.name, "overrides": list(args.overrides), "steps": base.grpo.max_num_steps,
            "seeds": seeds, "arms": arms, "warmstart": str(compare.warmstart_model(out)),
            "warmstart_sft": compare.warmstart_summary(out),
            "wall_s": time.time() - t0}
    paths = compare.write_outputs(agg, meta, out)
    print(paths["md"].read_text())
    print(f"written: {paths['md']}, {paths['json']}, {paths['png']}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from jetrl_megatron.rl.plan import plan_report

    if args.recommend:
        return cmd_recommend(args)
    cfg = load_config(args.recipe, args.overrides)
    text, ok = plan_report(cfg, args.gpu_mem_gib, show_config=not args.no_config, host_mem_gib=args.host_mem_gib)
    print(text)
    print(f"# plan: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def cmd_recommend(args: argparse.Namespace) -> int:
    """`jetrl plan --recommend`: the ranked layouts, then the plain plan's command for the recommended one."""
    from jetrl_megatron.rl.recommend import recommend_report

    text, ok, best = recommend_report(args.recipe, list(args.overrides), args.gpu_mem_gib, args.host_mem_gib)
    print(text)
    if best is not None:
        mem = ["--gpu-mem-gib", f"{args.gpu_mem_gib:g}"]
        if args.host_mem_gib is not None:
            mem += ["--host-mem-gib", f"{args.host_mem_gib:g}"]
        cmd = ["jetrl", "plan", "--recipe", args.recipe, "--no-config", *mem, *args.overrides, *best.overrides]
        print(f"#   check it: {shlex.join(cmd)}")
    print(f"# plan --recommend: {'OK' if ok else 'FAILED (no layout fits)'}")
    return 0 if ok else 1


def cmd_keys(args: argparse.Namespace) -> int:
    """Print docs/nemo_rl_keys.md: every key of NeMo-RL v0.7.0's Megatron GRPO YAMLs with its status here."""
    import tempfile

    from jetrl_megatron.rl import nemo_rl_upstream as up

    tarball = Path(args.tarball) if args.tarball else up.find_tarball(REPO_ROOT)
    if tarball is None or not tarball.is_file():
        raise UserError(f"no NeMo-RL v0.7.0 tarball: give --tarball or set JETRL_NEMO_RL_TARBALL ({up.TARBALL_NAME})")
    with tempfile.TemporaryDirectory() as tmp:
        yamls = up.megatron_grpo_yamls(up.unpack(tarball, Path(tmp)))
        print(KEYS_DOC_HEADER + up.markdown_table(up.key_values(yamls)), end="")
    return 0


KEYS_DOC_HEADER = """# NeMo-RL v0.7.0 GRPO keys in jetrl_megatron

Generated by `jetrl keys` from NeMo-RL v0.7.0's release tarball (the GRPO YAMLs of `examples/configs/` and
`examples/configs/recipes/llm/` that use the Megatron backend); `tests/test_nemo_rl_conformance.py` checks it is
current. Statuses (`jetrl_megatron/rl/nemo_rl_keys.py`): **implemented** with NeMo-RL's meaning; **ignored**:
accepted with no effect, for the reason given, listed in one warning at start; **refused**: loading stops with the
key and the reason. How the arm follows NeMo-RL's switches and what `policy.jet_rl` holds: docs/config.md.

"""


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
        _normalize_recipe_args(args)
        return {"run": cmd_run, "compare": cmd_compare, "plan": cmd_plan, "sbatch": cmd_sbatch,
                "keys": cmd_keys}[args.cmd](args)
    except UserError as e:
        print(f"jetrl {args.cmd}: {one_line(e, limit=2000)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
