"""What a KV cache smaller than the rollout batch costs, and what it does to the samples (rollout/kv_waves.py).

    python bench/rollout_waves.py --preset qwen3-0.6b --prompts 8 --n 16 --prompt-len 32 --new 1024 --kv-gib 4,20

For each KV budget, one engine (random weights, `load_format: dummy`, the jetrl recipe unless `--arm bf16`, CUDA
graphs on a GPU) samples the same batch twice: in the waves the engine submits by default (the cache holds every
running sequence whole: vLLM never preempts), and as one submission (vLLM preempts and recomputes when the cache
fills; the preemptions are counted by wrapping the in-process scheduler's preempt call). It prints the KV blocks vLLM
reports against the project's estimate, the waves, the preemptions, each way's seconds and new tokens/s, and how many
samples are the same bit for bit both ways (with a seed, a sample's tokens depend only on its logits: a sample that
differs saw other logits, i.e. a recomputed KV).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import torch

from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rollout import kv_waves
from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
from jetrl_megatron.rollout.model_dir import hf_config_for, write_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from vllm_preemption import count_preemptions, one_submission  # noqa: E402


def _sample(engine: RolloutEngine, prompts, args, at_once: bool):
    t0 = time.perf_counter()
    with one_submission(engine) if at_once else contextlib.nullcontext():
        out = engine.generate(prompts, n=args.n, max_tokens=args.new, seed=args.seed, ignore_eos=True)
    return out, time.perf_counter() - t0


def run_budget(kv_gib: float, args) -> dict:
    shape = get_model_shape(args.preset)
    recipe = Fp8Recipe(mode="bf16") if args.arm == "bf16" else Fp8Recipe()
    kv_bytes = int(kv_gib * (1 << 30))
    seq_tokens = args.prompt_len + args.new
    batch = args.prompts * args.n
    estimate = kv_waves.sequences_without_preemption(kv_bytes, shape, 1, seq_tokens)
    on_cuda = torch.cuda.is_available()
    llm_kwargs = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}} if on_cuda else {}
    with tempfile.TemporaryDirectory() as d:
        write_config(d, hf_config_for(shape, recipe if recipe.rollout_fp8 else None))
        engine = RolloutEngine(RolloutConfig(
            model_dir=d, recipe=recipe, max_model_len=seq_tokens, kv_cache_memory_bytes=kv_bytes,
            max_num_seqs=max(1, min(batch, estimate)), enforce_eager=not on_cuda, load_format="dummy",
            seed=0, llm_kwargs=llm_kwargs))
        try:
            blocks, block_tokens = kv_waves.engine_kv_blocks(engine.llm) or (0, 0)
            g = torch.Generator().manual_seed(args.seed)
            prompts = [torch.randint(0, min(shape.vocab_size, 1000), (args.prompt_len,), generator=g).tolist()
                       for _ in range(args.prompts)]
            preemptions = count_preemptions(engine)
            waved, t_waves = _sample(engine, prompts, args, at_once=False)
            waves, waved_preemptions = engine.last_waves, preemptions[0]
            preemptions[0] = 0
            single, t_single = _sample(engine, prompts, args, at_once=True)
        finally:
            engine.shutdown()
    same = sum(a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(waved, single, strict=True))
    new_tokens = sum(len(s.token_ids) for s in waved)
    return {"kv_gib": kv_gib, "kv_blocks": blocks, "block_tokens": block_tokens,
            "estimated_blocks": (kv_bytes // (block_tokens * kv_waves.kv_bytes_per_token(shape)) - kv_waves.NULL_BLOCKS
                                 if block_tokens else 0),
            "sequences_at_once": blocks // kv_waves.blocks_per_sequence(seq_tokens, block_tokens) if blocks else 0,
            "estimated_sequences": estimate, "batch": batch, "waves": waves,
            "preemptions_waves": waved_preemptions, "preemptions_one_submission": preemptions[0],
            "seconds_waves": t_waves, "seconds_one_submission": t_single,
            "tokens_per_s_waves": new_tokens / t_waves, "tokens_per_s_one_submission": new_tokens / t_single,
            "samples_identical": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--arm", choices=("jetrl", "bf16"), default="jetrl")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new", type=int, default=200)
    p.add_argument("--kv-gib", default="0.004,0.05", help="comma-separated KV budgets, GiB")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [run_budget(float(k), args) for k in args.kv_gib.split(",")]
    keys = ["kv_gib", "kv_blocks", "estimated_blocks", "sequences_at_once", "batch", "waves", "preemptions_waves",
            "preemptions_one_submission", "seconds_waves", "seconds_one_submission", "samples_identical"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
