"""`jetrl`: the command line of jetrl_megatron.

  jetrl run     --recipe NAME|PATH [--arm A] [a.b=c ...]  train with GRPO (tiny_cpu by default: CPU, a few minutes)
  jetrl run     --config FILE.yaml [a.b=c ...]    the same, in NeMo-RL's run_grpo.py form (Hydra-style overrides)
  jetrl compare --recipe NAME [--arms a,b,c]      every arm x --seeds N from one BF16 warm start, aggregated
  jetrl plan    --recipe NAME [a.b=c ...]          resolved config, parallel layout, resharder preflight, memory
  jetrl plan    --recommend --recipe NAME [...]    every TP x PP x DP / rollout-TP layout of the cluster, ranked
  jetrl sbatch  --recipe NAME --nodes N [--submit] the SLURM command for slurm/jetrl.sbatch (GPU or CPU recipe)
  jetrl prewarm --recipe NAME [--arm A] [a.b=c ...] compile the run's FP8 GEMM kernels first, in parallel processes
  jetrl reshard-check ... / jetrl export ...       the resharder's commands (see docs/reshard.md)

Every command's flags: `cli_args.py` (one parser). The commands here check their flags and hand over to the module
that does the work: rl/loop.py, rl/tools/compare_runner.py, rl/tools/run_plan.py, slurm.py, reshard_cli.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from jetrl_megatron import slurm
from jetrl_megatron.cli_args import parser
from jetrl_megatron.errors import UserError, one_line
from jetrl_megatron.rl.config.run_config import (
    ARM_MODES,
    DEFAULT_RECIPE,
    REPO_ROOT,
    ConfigError,
    arm_overrides,
    load_config,
    warn_ignored,
)
from jetrl_megatron.rl.outputs.metric_log import quiet_libraries
from jetrl_megatron.rl.tools.compare_runner import run_comparison


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
    from jetrl_megatron.rl.tools.run_preflight import check_run  # each command's module loads when it runs

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


def cmd_compare(args: argparse.Namespace) -> int:
    """Every arm x seed from one shared BF16 warm start, then the aggregate (rl/tools/compare_runner.py)."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    from jetrl_megatron.rl.stress_arms import is_compare_arm

    bad = [a for a in arms if not is_compare_arm(a)]
    if bad or not arms:
        print(f"jetrl compare: unknown arm(s) {', '.join(map(repr, bad)) or '(none given)'}; choose from "
              f"{', '.join(ARM_MODES)}, or the experiment-only offpolicy_<format> / unified_<format> "
              "(rl/stress_arms.py)", file=sys.stderr)
        return 2
    if args.parallel < 1:
        print(f"jetrl compare: --parallel must be >= 1, got {args.parallel}", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print(f"jetrl compare: --seeds must be >= 1 (runs per arm), got {args.seeds}", file=sys.stderr)
        return 2
    return run_comparison(args.recipe, list(args.overrides), arms, args.seeds, out=args.out, parallel=args.parallel,
                          reuse=args.reuse, warmstart_only=args.warmstart_only, reuse_from=args.reuse_from)


def cmd_plan(args: argparse.Namespace) -> int:
    from jetrl_megatron.rl.tools.run_plan import plan_report

    if args.recommend:
        return cmd_recommend(args)
    cfg = load_config(args.recipe, args.overrides)
    text, ok = plan_report(cfg, args.gpu_mem_gib, show_config=not args.no_config, host_mem_gib=args.host_mem_gib)
    print(text)
    print(f"# plan: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def cmd_recommend(args: argparse.Namespace) -> int:
    """`jetrl plan --recommend`: the ranked layouts, then the plain plan's command for the recommended one."""
    from jetrl_megatron.rl.tools.recommend_layout import recommend_report

    text, ok, best, machine = recommend_report(args.recipe, list(args.overrides), args.gpu_mem_gib,
                                               args.host_mem_gib)
    print(text)
    if best is not None:
        mem = ["--gpu-mem-gib", f"{machine.gpu_mem_gib:g}"]
        if machine.host_mem_gib is not None:
            mem += ["--host-mem-gib", f"{machine.host_mem_gib:g}"]
        cmd = ["jetrl", "plan", "--recipe", args.recipe, "--no-config", *mem, *args.overrides, *best.overrides]
        print(f"#   check it: {shlex.join(cmd)}")
    print(f"# plan --recommend: {'OK' if ok else 'FAILED (no layout fits)'}")
    return 0 if ok else 1


def cmd_keys(args: argparse.Namespace) -> int:
    """Print docs/nemo_rl_keys.md: every key of NeMo-RL v0.7.0's Megatron GRPO YAMLs with its status here."""
    from jetrl_megatron.rl.config import nemo_rl_upstream as up

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
current. Statuses (`jetrl_megatron/rl/config/nemo_rl_keys.py`): **implemented** with NeMo-RL's meaning; **ignored**:
accepted with no effect, for the reason given, listed in one warning at start; **refused**: loading stops with the
key and the reason. How the arm follows NeMo-RL's switches and what `policy.jet_rl` holds: docs/config.md.

"""


def cmd_sbatch(args: argparse.Namespace) -> int:
    """Print the sbatch line of the recipe at ``--nodes`` (default its own), or submit it (slurm.py)."""
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
        print(shlex.join(slurm.sbatch_command(args.recipe, nodes, overrides, slurm.gres(cfg))))
        if problem:
            print(f"jetrl sbatch: warning: {problem}", file=sys.stderr)
        return 0
    if problem:
        print(f"jetrl sbatch: {problem}", file=sys.stderr)
        return 2
    return slurm.submit(args.recipe, nodes, overrides, cfg)


def cmd_prewarm(args: argparse.Namespace) -> int:
    """Fill DeepGEMM's (and Triton's) kernel caches with every FP8 GEMM the run will call, one process per GEMM
    (fp8/gemm_prewarm.py), so the run's first engine start and first update do not compile them one by one."""
    from jetrl_megatron.rl.tools.gemm_prewarm_plan import describe_plan, prewarm_tasks

    cfg = load_config(args.recipe, args.overrides)
    if not cfg.is_gpu:
        print(f"# prewarm: {cfg.name} is a CPU recipe (cluster.gpus_per_node 0): no GPU kernels to compile")
        return 0
    tasks = prewarm_tasks(cfg)
    print(describe_plan(cfg, tasks), flush=True)
    if args.dry_run or not tasks:
        return 0
    import torch

    if not torch.cuda.is_available():
        print("jetrl prewarm: needs CUDA (the kernels compile for the GPU they run on); --dry-run prints the plan",
              file=sys.stderr)
        return 2
    if args.processes < 1:
        print(f"jetrl prewarm: --processes must be >= 1, got {args.processes}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from jetrl_megatron.fp8.gemm_prewarm import prewarm

    caches = {k: os.environ.get(k, "(library default)") for k in ("DG_JIT_CACHE_DIR", "TRITON_CACHE_DIR")}
    print("# caches: " + ", ".join(f"{k}={v}" for k, v in caches.items()), flush=True)
    with tqdm(total=len(tasks), desc="prewarm", unit="gemm") as bar:
        results = prewarm(tasks, cfg.recipe, processes=args.processes,
                          on_done=lambda r: (bar.update(1), bar.set_postfix_str(r.task.linear + " " + r.task.form)))
    failed = [r for r in results if r.error]
    for r in sorted(results, key=lambda r: -r.seconds):
        state = f"FAILED {r.error}" if r.error else f"{r.seconds:6.1f} s, {r.calls} calls on {'/'.join(r.backends)}"
        print(f"  {r.task.linear} {r.task.form} (N {r.task.gemm_nk[0]}, K {r.task.gemm_nk[1]}): {state}")
    print(f"# prewarm: {len(results) - len(failed)} of {len(results)} GEMMs warm"
          + (f"; {len(failed)} failed (the run compiles those itself)" if failed else ""))
    return 1 if failed else 0


def cmd_reshard_check(args: argparse.Namespace) -> int:
    from jetrl_megatron import reshard_cli  # torch and the resharder: only these two commands need them

    return reshard_cli.reshard_check(args)


def cmd_export(args: argparse.Namespace) -> int:
    from jetrl_megatron import reshard_cli

    return reshard_cli.export(args)


COMMANDS = {"run": cmd_run, "compare": cmd_compare, "plan": cmd_plan, "sbatch": cmd_sbatch, "keys": cmd_keys,
            "prewarm": cmd_prewarm, "reshard-check": cmd_reshard_check, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        _normalize_recipe_args(args)
        return COMMANDS[args.cmd](args)
    except UserError as e:
        print(f"jetrl {args.cmd}: {one_line(e, limit=2000)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
