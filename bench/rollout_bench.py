"""GPU rollout checks and throughput for the `jetrl_fp8` plugin (run on the H200 with vLLM 0.26 installed).

    python bench/rollout_bench.py agree     # plugin via the entry point; logprobs vs the trainer-side forward
    python bench/rollout_bench.py throughput --arm jetrl --preset qwen3-8b --prompts 256 --prompt-len 256 --new 1024
    python bench/rollout_bench.py compare --preset qwen3-32b --arms stock_fp8,jetrl:deep_gemm,jetrl,bf16 --out r.json

`agree`: a small random Qwen3 in canonical FP8 form served by RolloutEngine (plugin, eager). It compares the sampled
token logprobs (decode) and prompt logprobs (prefill) against a trainer-side forward on the same GPU. That forward is
the pure-torch reference of tests/test_rollout_reference.py with `fp8_linear_forward` (GPU backends); its attention is
BF16 SDPA (the trainer's CUDA default) or FP32 SDPA. It then refits new weights and compares again.
`throughput`: random (dummy) weights of a preset shape, CUDA graphs for decode (FULL_DECODE_ONLY), one arm per process.
`--gemm-backend` sets the plugin's GEMM backend (the config's `policy.jet_rl.gemm_backend`; `auto` by default).
`compare`: the listed arms one after another, each in a fresh process with the same settings (same GPU, same prompts);
prints a table with each arm's tokens/s and its ratio to BF16 and to stock block-FP8. An arm `jetrl:deep_gemm` is the
plugin with that GEMM backend; `jetrl:auto:vllm` the plugin with vLLM's own RMSNorm kernels (the engines of a GRPO run
use the batch-invariant ones, `policy.jet_rl.cuda_norms`, and so do the `jetrl` and `bf16` arms here; `stock_fp8`
keeps vLLM's).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _metrics(train: torch.Tensor, rollout: torch.Tensor) -> dict[str, float]:
    d = train.double() - rollout.double()
    return {"k3_kl": (d.exp() - d - 1).mean().item(), "token_mult_prob_error": d.abs().exp().mean().item(),
            "max_abs": d.abs().max().item(), "mean_abs": d.abs().mean().item(),
            "exact_frac": (d == 0).double().mean().item()}


def _bf16_sdpa(q, k, v):
    t, h, d = q.shape
    rep = h // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    a = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True)
    return a.transpose(0, 1).reshape(t, h * d)


def agree(args) -> dict:
    from test_rollout_reference import ReferenceModel, sdpa_fp32_attention

    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import (
        load_state_dict,
        quantize_state_dict,
        random_hf_state_dict,
        write_tiny_model_dir,
    )

    out: dict = {}
    from importlib.metadata import entry_points

    out["entry_point"] = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}.get("jetrl_fp8")
    recipe = Fp8Recipe()
    shape = get_model_shape(args.preset)
    tmp = tempfile.mkdtemp()
    model_dir = write_tiny_model_dir(tmp, preset=args.preset, seed=0, recipe=recipe)
    t0 = time.perf_counter()
    engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=recipe, kv_cache_memory_bytes=1 << 30,
                                         max_num_seqs=64))
    out["engine_start_s"] = time.perf_counter() - t0
    model = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    out["quant_method"] = type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape.vocab_size, (8, 16), generator=g).tolist()

    def compare(sd, tag):
        samples = engine.generate(prompts, n=2, max_tokens=32, seed=3, ignore_eos=True)
        seqs = [s.prompt_token_ids + s.token_ids for s in samples]
        prompt_lp = torch.tensor(engine.score(seqs))
        decode_lp = torch.tensor([s.logprobs for s in samples])
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        dev_sd = {k: v.to(dev) for k, v in sd.items()}
        for name, attn in (("bf16_sdpa", _bf16_sdpa), ("fp32_sdpa", sdpa_fp32_attention)):
            ref = ReferenceModel(dev_sd, shape, recipe, attention=attn)
            full = torch.tensor([ref.token_logprobs(s) for s in seqs])
            out[f"{tag}/{name}/decode"] = _metrics(full[:, 15:], decode_lp)
            out[f"{tag}/{name}/prefill"] = _metrics(full, prompt_lp)
        out[f"{tag}/decode_vs_prefill_rollout"] = _metrics(prompt_lp[:, 15:], decode_lp)

    compare(load_state_dict(model_dir), "initial")
    sd1 = quantize_state_dict(random_hf_state_dict(shape, seed=1), shape, recipe)
    rep = engine.refit(sd1)
    out["refit"] = {"verified": rep.verified, "seconds": rep.seconds, "unverifiable": len(rep.unverifiable)}
    compare(sd1, "after_refit")
    engine.shutdown()
    return out


def throughput(args) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout import invariant_norm, plugin
    from jetrl_megatron.rollout.model_dir import hf_config_for

    plugin.register()
    shape = get_model_shape(args.preset)
    recipe = Fp8Recipe(gemm_backend=args.gemm_backend)
    tmp = tempfile.mkdtemp()
    quant = {"jetrl": "jetrl_fp8", "stock_fp8": "fp8"}.get(args.arm)
    cfg = hf_config_for(shape, recipe if quant else None, quant_method=quant or "fp8")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f)
    kwargs = dict(model=tmp, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, seed=0,
                  gpu_memory_utilization=0.85, max_model_len=args.prompt_len + args.new + 16,
                  max_num_seqs=args.prompts, tensor_parallel_size=args.tp)
    norms = args.cuda_norms or ("vllm" if args.arm == "stock_fp8" else "batch_invariant")
    kwargs["hf_overrides"] = invariant_norm.engine_overrides(norms, on_cuda=torch.cuda.is_available())
    if args.eager:
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 32000, (args.prompt_len,), generator=g).tolist()}
               for _ in range(args.prompts)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    sp = SamplingParams(max_tokens=args.new, temperature=1.0, ignore_eos=True, seed=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    gc.collect()
    return {"arm": args.arm, "gemm_backend": args.gemm_backend if args.arm == "jetrl" else None, "cuda_norms": norms,
            "preset": args.preset, "tp": args.tp, "init_s": init_s, "gen_s": dt, "new_tokens": n,
            "tok_per_s": n / dt, "cuda_graphs": not args.eager}


def compare(args) -> dict:
    """Each arm in its own process (a clean GPU, no allocator state shared), same settings; a table at the end."""
    import subprocess

    rows = []
    for spec in args.arms.split(","):
        arm, _, rest = spec.partition(":")
        backend, _, norms = rest.partition(":")
        cmd = [sys.executable, os.path.abspath(__file__), "throughput", "--arm", arm, "--preset", args.preset,
               "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--new", str(args.new),
               "--tp", str(args.tp), "--gemm-backend", backend or "auto"] + (["--eager"] if args.eager else []) \
            + (["--cuda-norms", norms] if norms else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.arm_timeout)
        row = {"spec": spec, "rc": proc.returncode, "wall_s": time.perf_counter() - t0}
        text = proc.stdout
        if proc.returncode == 0 and "RESULT " in text:
            row.update(json.loads(text.split("RESULT ", 1)[1]))
        else:
            row["error"] = (proc.stderr or text)[-1500:]
        rows.append(row)
        print(f"{spec}: rc={proc.returncode} tok/s={row.get('tok_per_s', float('nan')):.0f} "
              f"init={row.get('init_s', float('nan')):.1f}s wall={row['wall_s']:.0f}s", flush=True)
    by = {r["spec"]: r.get("tok_per_s") for r in rows}
    print(f"\n{args.preset}, TP{args.tp}, {args.prompts} prompts x {args.prompt_len} tokens, {args.new} new tokens")
    print(f"{'arm':<20} {'tok/s':>9} {'vs bf16':>8} {'vs stock_fp8':>13} {'init s':>7}")
    for r in rows:
        tps = r.get("tok_per_s")
        rel = [f"{tps / by[b]:.3f}x" if tps and by.get(b) else "-" for b in ("bf16", "stock_fp8")]
        init = r.get("init_s", float("nan"))
        print(f"{r['spec']:<20} {tps or float('nan'):>9.0f} {rel[0]:>8} {rel[1]:>13} {init:>7.1f}")
    return {"preset": args.preset, "tp": args.tp, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("agree", "throughput", "compare"))
    p.add_argument("--arm", default="jetrl", choices=("jetrl", "bf16", "stock_fp8"))
    p.add_argument("--arms", default="stock_fp8,jetrl:deep_gemm,jetrl,bf16",
                   help="compare: comma-separated ARM[:GEMM_BACKEND[:NORMS]] (NORMS batch_invariant | vllm)")
    p.add_argument("--cuda-norms", default=None, choices=("batch_invariant", "vllm"),
                   help="the engine's RMSNorm kernels (default: batch_invariant, as GRPO engines run; stock_fp8: vllm)")
    p.add_argument("--gemm-backend", default="auto", help="the plugin's GEMM backend (jetrl arm)")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor_parallel_size")
    p.add_argument("--arm-timeout", type=float, default=560.0, help="compare: seconds per arm")
    p.add_argument("--preset", default=None)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.preset = args.preset or ("tiny" if args.what == "agree" else "qwen3-8b")
    res = {"agree": agree, "throughput": throughput, "compare": compare}[args.what](args)
    text = json.dumps(res, indent=1, default=str)
    print("RESULT", text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
