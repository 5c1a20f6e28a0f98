"""A few GRPO steps per arm on one GPU with a model made on the spot (issue 7's GPU measurement).

The body is a real preset's (default Qwen3-1.7B: hidden 2048, 28 layers, GQA 16/8, FFN 6144) with the synthetic task's
128-token character vocabulary, random init, a short supervised warm-start, then GRPO. Each arm runs in its own
process (`jetrl run`); the table prints the step-time split (rollout / logprob / update / refit), the end-to-end step
speed-up over bf16 (steps after the first, which pays one-time warm-ups) and each arm's mismatch.

    python bench/rl_gpu_steps.py --out $OUT          # needs CUDA, vLLM (GPU) and megatron-core importable
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

from jetrl_megatron.megatron.models import get_model_shape

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


def run_arm(arm: str, config: Path, log_dir: Path, steps: int, timeout: int) -> list[dict]:
    overrides = [
        f"jet_rl.mode={arm}", f"policy.model_preset={config}", f"policy.model_name={config}",
        f"grpo.max_num_steps={steps}", "grpo.num_prompts_per_step=64", "grpo.num_generations_per_prompt=16",
        "policy.train_global_batch_size=1024", "policy.train_micro_batch_size=512", "policy.logprob_batch_size=512",
        "grpo.sft_warmstart.steps=10", "grpo.sft_warmstart.lr=1e-4", "grpo.sft_warmstart.batch_size=256",
        "policy.megatron_cfg.optimizer.lr=1e-5", "policy.megatron_cfg.optimizer.min_lr=1e-5",
        "grpo.final_arm_probe=false", "grpo.val_period=1000", "logger.progress_bars=false",
        "logger.tensorboard_enabled=false", "logger.plot_enabled=false", f"logger.log_dir={log_dir}",
        "policy.generation.colocated.enabled=false", "policy.generation.vllm_cfg.gpu_memory_utilization=0.35",
        "policy.generation.vllm_cfg.max_model_len=64", f"cluster.gpus_per_node={int(torch.cuda.is_available())}",
    ]
    cmd = [sys.executable, "-m", "jetrl_megatron.cli", "run", "--recipe", "tiny_cpu", *overrides]
    t0 = time.perf_counter()
    log_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log_dir.parent / f"{arm}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=os.environ).returncode
    print(f"{arm}: rc={rc} wall {time.perf_counter() - t0:.0f}s", flush=True)
    metrics = log_dir / "metrics.jsonl"
    return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/rl_gpu"))
    args = ap.parse_args()
    out = Path(args.out)
    config = make_model_config(args.preset, Path("/tmp/jetrl_rl_gpu_model"))
    results = {}
    for arm in ARMS:
        rows = run_arm(arm, config, out / "runs" / arm, args.steps, args.timeout)
        results[arm] = rows
    (out / "rl_gpu_steps.json").write_text(json.dumps(results))

    def mean(rows, key):
        vals = [r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    base = mean(results["bf16"], "time/step")
    print(f"\nmodel {args.preset} body, vocab 128; {args.steps} GRPO steps per arm; times = mean of steps 2..N (s)")
    print("| arm | steps | rollout | logprob | update | refit | step | speed-up vs bf16 | k3_kl "
          "| token_mult_prob_error | reward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, rows in results.items():
        t = {k: mean(rows, f"time/{k}") for k in ("rollout", "logprob", "update", "refit", "step")}
        print(f"| {arm} | {len(rows)} | {t['rollout']:.2f} | {t['logprob']:.2f} | {t['update']:.2f} | "
              f"{t['refit']:.2f} | {t['step']:.2f} | {base / t['step']:.2f}x | {mean(rows, 'mismatch/k3_kl'):.3e} | "
              f"{mean(rows, 'mismatch/token_mult_prob_error'):.5f} | {mean(rows, 'reward/mean'):.3f} |")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
