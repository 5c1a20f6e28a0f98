"""A few GRPO steps per arm on one GPU with a model made on the spot (issue 7's GPU measurement).

The body is a real preset's (default Qwen3-1.7B: hidden 2048, 28 layers, GQA 16/8, FFN 6144) with the synthetic task's
128-token character vocabulary, random init, a short supervised warm-start, then GRPO. Each arm runs in its own
process (`jetrl run`); the table prints the step-time split (rollout / logprob / update / refit), the end-to-end step
speed-up over bf16 (steps after the first, which pays one-time warm-ups) and each arm's mismatch.

The refit is the loop's in-place path (`RolloutEngine.refit_from_shards`): the resharder's compiled copy program
writes the trainer's GPU tensors straight into vLLM's live parameters (nothing goes through the CPU). The second table
splits it: bytes moved, the copy/quantize time, and how often the program was rebuilt after the engine's first refit
(expected 0: the FP8 cache re-quantizes into the same tensors and the BF16 weights stay put; with `--colocated`, a
rebuild means vLLM's wake_up moved the parameters).

    python bench/rl_gpu_steps.py --out $OUT          # needs CUDA, vLLM (GPU) and megatron-core importable
    python bench/rl_gpu_steps.py --out $OUT --colocated --refit-cuda-graph --verify-refit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.rl.config import arm_overrides

ARMS = ("bf16", "bf16_train_fp8_rollout", "jetrl")


def make_model_config(preset: str, out: Path) -> Path:
    cfg = get_model_shape(preset).to_hf_config()
    cfg["vocab_size"] = 128  # the synthetic task's character vocabulary
    cfg["tie_word_embeddings"] = False
    task = get_model_shape("tiny").to_hf_config()  # the task's special tokens live in its 128-token vocabulary
    for key in ("bos_token_id", "eos_token_id"):
        cfg[key] = task.get(key)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run_arm(arm: str, config: Path, log_dir: Path, steps: int, timeout: int, colocated: bool = False,
            env: dict[str, str] | None = None) -> list[dict]:
    overrides = [
        *arm_overrides(arm), f"policy.jet_rl.model_preset={config}", f"policy.model_name={config}",
        f"grpo.max_num_steps={steps}", "grpo.num_prompts_per_step=64", "grpo.num_generations_per_prompt=16",
        "policy.train_global_batch_size=1024", "policy.train_micro_batch_size=512", "policy.logprob_batch_size=512",
        "policy.jet_rl.sft_warmstart.steps=10", "policy.jet_rl.sft_warmstart.lr=1e-4",
        "policy.jet_rl.sft_warmstart.batch_size=256",
        "policy.megatron_cfg.optimizer.lr=1e-5", "policy.megatron_cfg.optimizer.min_lr=1e-5",
        # validation before GRPO and at the last step only (tiny_cpu's val_at_start / val_at_end)
        "policy.jet_rl.final_arm_probe=false", "grpo.val_period=0", "policy.jet_rl.progress_bars=false",
        "logger.tensorboard_enabled=false", "policy.jet_rl.plot_enabled=false", f"logger.log_dir={log_dir}",
        f"policy.generation.colocated.enabled={str(colocated).lower()}",
        "policy.generation.vllm_cfg.gpu_memory_utilization=0.35",
        "policy.generation.vllm_cfg.max_model_len=64", f"cluster.gpus_per_node={int(torch.cuda.is_available())}",
    ]
    cmd = [sys.executable, "-m", "jetrl_megatron.cli", "run", "--recipe", "tiny_cpu", *overrides]
    t0 = time.perf_counter()
    log_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log_dir.parent / f"{arm}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                            env={**os.environ, **(env or {})}).returncode
    print(f"{arm}: rc={rc} wall {time.perf_counter() - t0:.0f}s", flush=True)
    metrics = log_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return [r for r in rows if r["step"] > 0]  # step 0 is the validation before GRPO


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/rl_gpu"))
    ap.add_argument("--colocated", action="store_true", help="vLLM sleeps (level 1) while the trainer runs")
    ap.add_argument("--refit-cuda-graph", action="store_true", help="replay the refit copies as a CUDA graph")
    ap.add_argument("--verify-refit", action="store_true", help="compare every written slab on the live tensors")
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    env = {"JETRL_REFIT_CUDA_GRAPH": "1" if args.refit_cuda_graph else "0",
           "JETRL_VERIFY_REFIT": "1" if args.verify_refit else "0"}
    out = Path(args.out)
    config = make_model_config(args.preset, Path("/tmp/jetrl_rl_gpu_model"))
    results = {}
    for arm in args.arms.split(","):
        rows = run_arm(arm, config, out / "runs" / arm, args.steps, args.timeout, args.colocated, env)
        results[arm] = rows
    (out / "rl_gpu_steps.json").write_text(json.dumps(results))

    def mean(rows, key):
        vals = [r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    base = mean(results.get("bf16", []), "time/step")
    print(f"\nmodel {args.preset} body, vocab 128; {args.steps} GRPO steps per arm; times = mean of steps 2..N (s)")
    print("| arm | steps | rollout | logprob | update | refit | step | speed-up vs bf16 | k3_kl "
          "| token_mult_prob_error | reward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, rows in results.items():
        t = {k: mean(rows, f"time/{k}") for k in ("rollout", "logprob", "update", "refit", "step")}
        print(f"| {arm} | {len(rows)} | {t['rollout']:.2f} | {t['logprob']:.2f} | {t['update']:.2f} | "
              f"{t['refit']:.2f} | {t['step']:.2f} | {base / t['step']:.2f}x | {mean(rows, 'mismatch/k3_kl'):.3e} | "
              f"{mean(rows, 'mismatch/token_mult_prob_error'):.5f} | {mean(rows, 'reward/mean'):.3f} |")
    print(f"\nrefit split (colocated={args.colocated}, cuda graph={args.refit_cuda_graph}, "
          f"verify={args.verify_refit}); times = mean of steps 2..N")
    print("| arm | refit s | exchange s | copy+quant+reload s | refit GB | rebuilt (steps 2..N) | reloaded tensors |")
    print("|---|---|---|---|---|---|---|")
    for arm, rows in results.items():
        later = rows[1:]
        print(f"| {arm} | {mean(rows, 'time/refit'):.3f} | {mean(rows, 'time/refit_gather'):.3f} | "
              f"{mean(rows, 'time/refit_copy'):.3f} | {mean(rows, 'refit/bytes') / 1e9:.2f} | "
              f"{sum(r.get('refit/rebuilt', 0) for r in later):.0f}/{len(later)} | "
              f"{mean(rows, 'refit/reloaded_tensors'):.0f} |")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
