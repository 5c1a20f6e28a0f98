"""Every `jetrl` command's flags, in one argparse parser: `cli.main` parses with it, and so do the argument-list
entry points of the resharder's commands (`reshard_cli`), so `jetrl --help`, each command's ``--help`` and the
usage errors come from one place.

Only argparse and the config's name lists here (no torch): building the parser costs nothing, whichever command
runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jetrl_megatron.rl.config.run_config import ARM_MODES, DEFAULT_RECIPE
from jetrl_megatron.rl.tools.compare import COMPARE_ARMS

# the resharder commands' recipe flags (argparse dests), each an Fp8Recipe field
FP8_RECIPE_FLAGS = ("mode", "bf16_first_layers", "bf16_last_layers", "scale_fmt")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jetrl", description="On-policy FP8 RL (Jet-RL) on Megatron-Core + vLLM")
    sub = ap.add_subparsers(dest="cmd", required=True)
    _recipe_args(sub.add_parser("run", help="train with GRPO"))
    _compare_args(sub.add_parser("compare", help="run several arms of a recipe and tabulate mismatch + reward"))
    _plan_args(sub.add_parser("plan", help="validate a recipe: config, layout, resharder preflight, memory estimate"))
    s = sub.add_parser("sbatch", help="print (or submit) the SLURM command for a GPU or CPU recipe")
    _recipe_args(s)
    s.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the recipe's cluster.num_nodes)")
    s.add_argument("--submit", action="store_true", help="run sbatch instead of printing the command")
    w = sub.add_parser("prewarm", help="compile the run's FP8 GEMM kernels (DeepGEMM's JIT) in parallel before it runs")
    _recipe_args(w)
    w.add_argument("--processes", type=int, default=8, help="GEMMs compiled at once, one process each (default 8)")
    w.add_argument("--dry-run", action="store_true", help="print the GEMMs and M values only (no GPU needed)")
    k = sub.add_parser("keys", help="NeMo-RL v0.7.0 GRPO keys and their status here (docs/nemo_rl_keys.md)")
    k.add_argument("--tarball", default=None, help="NeMo-RL v0.7.0 release tarball (default: $JETRL_NEMO_RL_TARBALL "
                   "or shared/upstream/nemo-rl-v0.7.0.tar.gz beside the checkout)")
    _reshard_check_args(sub.add_parser(
        "reshard-check", help="resharder preflight (see docs/reshard.md)",
        description="Check that FP8 weights reshard block-exactly and print the plan."))
    _export_args(sub.add_parser("export", help="HF FP8 export (see docs/reshard.md)",
                                description="Export an HF block-FP8 checkpoint for vLLM."))
    return ap


def _recipe_args(p: argparse.ArgumentParser, arm: bool = True) -> None:
    p.add_argument("--recipe", default=None, help=f"recipe name in recipes/ or a YAML path (default {DEFAULT_RECIPE})")
    p.add_argument("--config", default=None, help="a NeMo-RL-layout YAML file (NeMo-RL's run_grpo.py habit; same as "
                   "--recipe PATH)")
    if arm:
        p.add_argument("--arm", choices=ARM_MODES, default=None,
                       help="set NeMo-RL's switches for this arm (fp8_cfg.enabled, vllm_cfg.precision) and "
                            "policy.jet_rl.arm")
    p.add_argument("overrides", nargs="*", help="Hydra-style overrides: a.b=1, +a.new=1, ++a.b=1, ~a.b")


def _compare_args(c: argparse.ArgumentParser) -> None:
    _recipe_args(c, arm=False)
    c.add_argument("--arms", default=",".join(COMPARE_ARMS), help=f"comma-separated arms {ARM_MODES}")
    c.add_argument("--seeds", type=int, default=3, help="runs per arm, seeds grpo.seed .. grpo.seed + N - 1")
    c.add_argument("--out", default=None, help="output dir (default runs/compare/<recipe>)")
    c.add_argument("--parallel", type=int, default=1,
                   help="arm runs at once after the warm start (each its own process, output to <run dir>.log); on "
                        "one GPU they share it, so set vllm_cfg.gpu_memory_utilization to leave room for all")
    c.add_argument("--reuse", action="store_true",
                   help="skip a run whose log dir holds an ok summary.json and the same configuration, and continue "
                        "one cut before its end from its newest checkpoint (same configuration, checkpointing "
                        "enabled); without it, every run starts afresh and its earlier output is removed")
    c.add_argument("--reuse-from", default=None, metavar="DIR",
                   help="an earlier comparison's output (another machine's, a committed copy): when this run's warm "
                        "start is the same (weights SHA-256; loss curve for older summaries), its finished runs with "
                        "the same configuration are copied in and not run again")
    c.add_argument("--warmstart-only", action="store_true",
                   help="stop after the shared BF16 warm start (run the arms later with --reuse, which keeps it)")


def _plan_args(p: argparse.ArgumentParser) -> None:
    _recipe_args(p)
    p.add_argument("--gpu-mem-gib", type=float, default=None,
                   help="memory of one GPU to check the estimate against (default: the recipe's "
                        "policy.jet_rl.plan_gpu_mem_gib, else this machine's GPU, else 80)")
    p.add_argument("--host-mem-gib", type=float, default=None,
                   help="host memory per node to check the estimate against (optimizer CPU offload, vLLM's sleep "
                        "backup; default: the recipe's policy.jet_rl.plan_host_mem_gib, else unchecked)")
    p.add_argument("--no-config", action="store_true", help="do not print the resolved config")
    p.add_argument("--recommend", action="store_true",
                   help="try every trainer TP x PP x DP and rollout TP layout of the cluster (cluster.num_nodes, "
                        "cluster.gpus_per_node) through this plan and print them ranked "
                        "(rule in rl/tools/recommend_layout.py)")


def _fp8_recipe_args(p: argparse.ArgumentParser) -> None:
    # default None: "not given", so a run checkpoint's own jet_rl section can fill what the command line leaves out
    p.add_argument("--mode", default=None,
                   help="recipe mode (bf16 | bf16_train_fp8_rollout | jetrl | fake_quant; default jetrl, or the run's)")
    p.add_argument("--bf16-first-layers", type=int, default=None)
    p.add_argument("--bf16-last-layers", type=int, default=None)
    p.add_argument("--scale-fmt", default=None, choices=("fp32", "pow2"))


def _reshard_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name or path to an HF config.json / model directory")
    p.add_argument("--train-tp", type=int, required=True)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--train-vpp", type=int, default=None, help="virtual pipeline stages per PP rank")
    p.add_argument("--rollout-tp", type=int, required=True)
    p.add_argument("--json", action="store_true", help="print the plan's numbers as JSON")
    _fp8_recipe_args(p)


def _export_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-megatron", type=Path,
                     help="a `jetrl run` checkpoint (<checkpointing.checkpoint_dir>/step_N, any TP x PP; model and "
                          "recipe from its meta.json), or a directory of tp<T>_pp<P>[_vp<V>].pt Megatron state dicts "
                          "(FP8 weights + scales)")
    src.add_argument("--from-hf", type=Path, help="BF16 HF checkpoint directory: quantize its projections 128x128")
    p.add_argument("--model", default=None, help="preset or config.json (default: the source's config.json; a run "
                                                 "checkpoint's meta.json)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--rollout-tp", type=int, default=None, help="also refuse if vLLM at this TP cannot load it")
    p.add_argument("--quant-method", default="fp8", help="quantization_config.quant_method (fp8 | jetrl_fp8)")
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="copy tokenizer files from here")
    p.add_argument("--max-shard-gb", type=float, default=4.0)
    _fp8_recipe_args(p)
