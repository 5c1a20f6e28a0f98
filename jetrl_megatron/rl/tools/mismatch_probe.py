"""Measure one arm's rollout-vs-trainer mismatch on a given policy (a fresh process per arm).

    python -m jetrl_megatron.rl.tools.mismatch_probe --recipe tiny_cpu --model-dir runs/tiny_cpu/final_model \
        --arm jetrl --out m.json

builds the Megatron trainer of that arm from the model directory, starts that arm's vLLM engine with the trainer's
weights (refit through the resharder), samples one rollout batch and writes the mismatch metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from jetrl_megatron.rl import batch as batching
from jetrl_megatron.rl import dist, generation
from jetrl_megatron.rl import trainer as trainers
from jetrl_megatron.rl.config import arm_overrides, load_config
from jetrl_megatron.rl.metrics import mismatch_metrics, position_bins
from jetrl_megatron.rl.outputs.metric_log import quiet_libraries
from jetrl_megatron.rl.tasks import PromptStream, build_task


def probe(recipe: str, model_dir: str, arm: str, overrides: list[str] | None = None, step: int = 10_000) -> dict:
    cfg = load_config(recipe, [*(overrides or []), *arm_overrides(arm), f"policy.model_name={model_dir}",
                               "policy.megatron_cfg.tensor_model_parallel_size=1",
                               "policy.megatron_cfg.pipeline_model_parallel_size=1",
                               "policy.generation.vllm_cfg.tensor_parallel_size=1"])
    dist.init_distributed(cfg)
    dist.seed_everything(cfg.grpo.seed)
    task = build_task(cfg)
    stream = PromptStream(task, seed=cfg.grpo.seed + 1, shuffle=True)
    trainer = trainers.build_trainer(cfg)
    engine = generation.start_engine(cfg, model_dir)
    engine.refit(trainers.canonical_weights(trainer))
    prompts = stream.take(cfg.grpo.num_prompts_per_step)
    samples, _ = generation.rollout(cfg, engine, task, prompts, step)
    batch = batching.make_batch(cfg, task, prompts, samples)
    logp, filtered_out = trainers.policy_logprobs(cfg, trainer.model, batch)
    n = cfg.policy.generation.max_new_tokens
    lt, m = batching.align_by_position(logp, batch, n)
    lr, _ = batching.align_by_position(batch.gen_logprobs, batch, n)
    out = mismatch_metrics(lt, lr, m, bins=position_bins(n, 4))
    out["reward/mean"] = float(batch.rewards.mean())
    out["num_tokens"] = float(batch.mask.sum())
    out["filtered_out_tokens"] = float(filtered_out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--arm", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    quiet_libraries()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    res = probe(a.recipe, a.model_dir, a.arm, a.overrides)
    tmp = Path(a.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=2))
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
