"""GPU: is the trainer's forward GPU vLLM's own forward? Trainer logprobs (``attn_impl="vllm_cuda"``) against vLLM's
decode (the sampled tokens' logprobs) and prefill (``prompt_logprobs``), bit for bit, per arm; where they differ, a
per-layer probe names the first op whose output differs.

Random weights of a preset shape (no hub on the test machine), written from the trainer's own weights (the FP8
cache's bytes for jetrl), served by the in-process engine; prompts of random lengths, fixed-length responses
(``ignore_eos``), temperature 1 by default.

    python3 bench/vllm_cuda_exact.py --preset tiny --arms jetrl bf16 --out $OUT/exact_tiny.json
    python3 bench/vllm_cuda_exact.py --preset qwen3-0.6b --new-tokens 1024 --cuda-graphs --out $OUT/exact_06b.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jetrl_megatron.megatron import cpu  # noqa: E402
from jetrl_megatron.megatron.convert import load_hf_checkpoint  # noqa: E402
from jetrl_megatron.megatron.model import build_gpt, rollout_weights, token_logprobs, unwrap  # noqa: E402
from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical  # noqa: E402
from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine  # noqa: E402
from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir  # noqa: E402


def trainer_and_weights(shape, recipe: Fp8Recipe, seed: int, attn_impl: str | None):
    """The trainer model with seeded random weights, and the canonical (HF-named) weights the engine serves."""
    gpt = build_gpt(shape, recipe, attn_impl=attn_impl)
    load_hf_checkpoint(gpt, random_hf_state_dict(shape, seed=seed, logit_std=1.0))
    local = {k: v.cpu().clone() for k, v in rollout_weights(gpt).items()}
    return gpt, dict(iter_canonical(MegatronShards(shape, 1, 1, None, {(0, 0, 0): local})))


def prompts_of(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lens]


def trainer_rows(gpt, seqs: list[list[int]], micro_batch: int) -> list[torch.Tensor]:
    """Trainer logprobs of every sequence (right-padded batch, real lengths handed to attention)."""
    s = max(len(q) for q in seqs)
    tokens = torch.zeros(len(seqs), s, dtype=torch.long)
    for i, q in enumerate(seqs):
        tokens[i, :len(q)] = torch.tensor(q)
    lengths = torch.tensor([len(q) for q in seqs])
    lp = token_logprobs(gpt, tokens.cuda(), micro_batch_size=math.gcd(micro_batch, len(seqs)), lengths=lengths)
    return [lp[i, :len(q) - 1].float().cpu() for i, q in enumerate(seqs)]


def stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).double()
    return {"tokens": int(a.numel()), "bit_identical": float((a == b).float().mean()),
            "max_abs": float(d.abs().max()), "mean_abs": float(d.abs().mean()),
            "k3": float((torch.exp(d) - d - 1).mean()), "token_mult_prob_error": float(torch.exp(d.abs()).mean())}


def by_position(a: torch.Tensor, b: torch.Tensor, n_bins: int = 4) -> list[dict]:
    """Stats per quarter of the response (rows: samples, cols: response position)."""
    cols = a.shape[1]
    edges = [round(cols * i / n_bins) for i in range(n_bins + 1)]
    return [{"from": edges[i], "to": edges[i + 1], **stats(a[:, edges[i]:edges[i + 1]].reshape(-1),
                                                          b[:, edges[i]:edges[i + 1]].reshape(-1))}
            for i in range(n_bins) if edges[i + 1] > edges[i]]


# ------------------------------------------------------------------------------------------ per-layer probe
VLLM_SITES = {  # our name -> (vLLM submodule path under model.model.layers[i], output picker)
    "input_norm": ("input_layernorm", lambda o: o[0] if isinstance(o, tuple) else o),
    "q_norm": ("self_attn.q_norm", lambda o: o),
    "k_norm": ("self_attn.k_norm", lambda o: o),
    "attention": ("self_attn.attn", lambda o: o),
    "o_proj": ("self_attn.o_proj", lambda o: o[0]),
    "post_attn_norm": ("post_attention_layernorm", lambda o: o[0]),
    "silu_and_mul": ("mlp.act_fn", lambda o: o),
    "down_proj": ("mlp.down_proj", lambda o: o[0]),
}
TRAINER_SITES = {
    "input_norm": ("input_layernorm", lambda o: o),
    "q_norm": ("self_attention.q_layernorm", lambda o: o),
    "k_norm": ("self_attention.k_layernorm", lambda o: o),
    "attention": ("self_attention.core_attention", lambda o: o),
    "o_proj": ("self_attention.linear_proj", lambda o: o[0]),
    "post_attn_norm": ("pre_mlp_layernorm", lambda o: o),
    "silu_and_mul": ("mlp.activation_func", lambda o: o),
    "down_proj": ("mlp.linear_fc2", lambda o: o[0]),
}


def _hook_all(root, layers_path: str, sites: dict, store: dict) -> list:
    handles = []
    layers = root.get_submodule(layers_path)
    for i, layer in enumerate(layers):
        for name, (path, pick) in sites.items():
            try:
                mod = layer.get_submodule(path)
            except AttributeError:
                continue

            def hook(_m, _inp, out, key=(i, name), pick=pick):
                t = pick(out).detach()
                store[key] = t.reshape(-1, t.shape[-1]).float().cpu()

            handles.append(mod.register_forward_hook(hook))
    return handles


def layer_probe(engine: RolloutEngine, gpt, seq: list[int]) -> list[dict]:
    """One sequence through vLLM's prefill and the trainer with hooks at every op; per layer and op: the fraction of
    equal values and the max difference (first differing op = the culprit)."""
    got_v: dict = {}
    got_t: dict = {}
    vllm_handles: list = []  # the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    engine.llm.apply_model(lambda m: vllm_handles.extend(_hook_all(m, "model.layers", VLLM_SITES, got_v)))
    if not vllm_handles:
        raise RuntimeError("no vLLM module was hooked: is the engine in this process?")
    try:
        engine.score([seq])
    finally:
        for h in vllm_handles:
            h.remove()
    hs = _hook_all(unwrap(gpt), "decoder.layers", TRAINER_SITES, got_t)
    try:
        trainer_rows(gpt, [seq], 1)
    finally:
        for h in hs:
            h.remove()
    rows = []
    for (i, name), t in sorted(got_t.items()):
        v = got_v.get((i, name))
        if v is None or v.shape != t.shape:
            rows.append({"layer": i, "op": name, "note": f"shapes {None if v is None else tuple(v.shape)} vs "
                                                           f"{tuple(t.shape)}"})
            continue
        rows.append({"layer": i, "op": name, "equal": float((v == t).float().mean()),
                     "max_abs": float((v - t).abs().max())})
    return rows


# ------------------------------------------------------------------------------------------ one arm
def run_arm(args, arm: str, workdir: str) -> dict:
    shape = get_model_shape(args.preset)
    recipe = Fp8Recipe(mode=arm, gemm_backend=args.gemm_backend)
    gpt, weights = trainer_and_weights(shape, recipe, args.seed, args.attn_impl)
    model_dir = write_model_dir(os.path.join(workdir, arm), hf_config_for(shape, recipe if arm != "bf16" else None),
                                weights)
    llm_kwargs = {"enable_prefix_caching": False}
    if args.cuda_graphs:
        llm_kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    if args.fa_max_splits is not None:  # FA3's KV-split cap for decode inside full CUDA graphs (vLLM's default 32)
        llm_kwargs["attention_config"] = {"flash_attn_max_num_splits_for_cuda_graph": args.fa_max_splits}
    engine = RolloutEngine(RolloutConfig(
        model_dir=model_dir, recipe=recipe, kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        max_num_seqs=max(args.prompts, 8), max_model_len=args.prompt_max + args.new_tokens + 8,
        enforce_eager=not args.cuda_graphs, fp8_gemm_warmup=False, llm_kwargs=llm_kwargs))
    out: dict = {"arm": arm}
    try:
        prompts = prompts_of(args.prompts, args.prompt_min, args.prompt_max, shape.vocab_size, args.seed + 1)
        t0 = time.perf_counter()
        samples = engine.generate(prompts, n=1, max_tokens=args.new_tokens, temperature=args.temperature,
                                  seed=args.seed, ignore_eos=True)
        out["rollout_seconds"] = time.perf_counter() - t0
        out["rollout_tokens_per_s"] = sum(len(s.token_ids) for s in samples) / out["rollout_seconds"]
        seqs = [s.prompt_token_ids + s.token_ids for s in samples]
        decode = torch.tensor([s.logprobs for s in samples], dtype=torch.float32)
        plen = [len(s.prompt_token_ids) for s in samples]
        pre = engine.score(seqs)
        prefill = torch.stack([torch.tensor(p[n - 1:], dtype=torch.float32) for p, n in zip(pre, plen, strict=True)])
        t0 = time.perf_counter()
        rows = trainer_rows(gpt, seqs, args.micro_batch)
        out["trainer_seconds"] = time.perf_counter() - t0
        trainer = torch.stack([r[n - 1:] for r, n in zip(rows, plen, strict=True)])
        out["trainer_vs_decode"] = stats(trainer.reshape(-1), decode.reshape(-1))
        out["trainer_vs_decode_by_position"] = by_position(trainer, decode)
        if args.temperature == 1.0:  # vLLM's prompt logprobs are raw (no temperature)
            out["trainer_vs_prefill"] = stats(trainer.reshape(-1), prefill.reshape(-1))
            out["decode_vs_prefill"] = stats(decode.reshape(-1), prefill.reshape(-1))
        prompt_rows = [r[:n - 1] for r, n in zip(rows, plen, strict=True)]
        prompt_pre = [torch.tensor(p[:n - 1], dtype=torch.float32) for p, n in zip(pre, plen, strict=True)]
        out["trainer_vs_prefill_prompt_tokens"] = stats(torch.cat(prompt_rows), torch.cat(prompt_pre))
        if args.probe and out["trainer_vs_decode"]["bit_identical"] < 1.0:
            out["layer_probe"] = layer_probe(engine, gpt, seqs[0][: args.prompt_max])
        if args.refit:  # new weights into the running engine (in place), then decode again against the trainer
            load_hf_checkpoint(gpt, random_hf_state_dict(shape, seed=args.seed + 7, logit_std=1.0))
            local = {k: v.cpu().clone() for k, v in rollout_weights(gpt).items()}
            report = engine.refit(dict(iter_canonical(MegatronShards(shape, 1, 1, None, {(0, 0, 0): local}))))
            samples = engine.generate(prompts, n=1, max_tokens=args.new_tokens, temperature=args.temperature,
                                      seed=args.seed + 1, ignore_eos=True)
            seqs = [s.prompt_token_ids + s.token_ids for s in samples]
            decode = torch.tensor([s.logprobs for s in samples], dtype=torch.float32)
            rows = trainer_rows(gpt, seqs, args.micro_batch)
            trainer = torch.stack([r[n - 1:] for r, n in zip(rows, plen, strict=True)])
            out["after_refit_trainer_vs_decode"] = stats(trainer.reshape(-1), decode.reshape(-1))
            out["refit_seconds"] = report.seconds
    finally:
        engine.shutdown()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--arms", nargs="+", default=["jetrl", "bf16"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-min", type=int, default=8)
    p.add_argument("--prompt-max", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--gemm-backend", default="cublas")
    p.add_argument("--attn-impl", default=None, help="trainer attention/numerics (default: vllm_cuda where vLLM is)")
    p.add_argument("--kv-cache-gib", type=float, default=8.0, help="the engine's KV cache (an exact size: with "
                   "gpu_memory_utilization vLLM 0.26 profiles CUDA-graph memory, which failed beside the trainer)")
    p.add_argument("--cuda-graphs", action="store_true", help="engine with FULL_DECODE_ONLY CUDA graphs, mode 0")
    p.add_argument("--fa-max-splits", type=int, default=None,
                   help="vLLM attention_config.flash_attn_max_num_splits_for_cuda_graph (default: vLLM's, 32)")
    p.add_argument("--no-probe", dest="probe", action="store_false")
    p.add_argument("--refit", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    cpu.init_parallel(1, 1)
    import vllm

    result = {"preset": args.preset, "vllm": vllm.__version__, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(), "args": vars(args), "arms": []}
    with tempfile.TemporaryDirectory() as work:
        for arm in args.arms:
            r = run_arm(args, arm, work)
            result["arms"].append(r)
            brief = {k: v for k, v in r.items() if k not in ("layer_probe", "trainer_vs_decode_by_position")}
            print(json.dumps(brief, indent=1), flush=True)
            for row in r.get("layer_probe", [])[:40]:
                print("  probe", row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
