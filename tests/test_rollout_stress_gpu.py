"""The experiment-only `jetrl_stress` engine on the GPU: CUDA-graph decode reads weight codes that follow each refit.

The stress method quantizes a weight once per load or refit into codes kept in place (rollout/stress_method.py), so
a decode step replayed from a CUDA graph must see the codes of the weights the last refit wrote. The unified trainer
(its linears in the same format, the decode-matched attention) must recompute the sampled tokens' logprobs bit for
bit before and after an in-place refit to other weights. Printed beside it: the stress engine's decode seconds
against a BF16 engine's on the same prompts (what the learning round's stressor arms pay per rollout).
"""

from __future__ import annotations

import importlib.util
import math
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

GRAPH_KWARGS = {"enable_prefix_caching": False,
                "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
                "attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}}


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(x),), generator=g).tolist()
            for x in torch.randint(6, 40, (n,), generator=g)]


@pytest.mark.own_process
@pytest.mark.parametrize("fmt", ["int4_tensor", "mxfp4"])
def test_stress_engine_under_cuda_graphs_follows_each_refit(tmp_path, fmt):
    from jetrl_megatron.fp8.stress import stress_format
    from jetrl_megatron.megatron import cpu
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, rollout_weights, token_logprobs
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir

    shape, recipe = get_model_shape("tiny"), Fp8Recipe(mode="bf16")
    cpu.init_parallel(1, 1)
    gpt = build_gpt(shape, recipe, stress=stress_format(fmt), attn_match="decode")

    def load(seed: int) -> dict:
        load_hf_checkpoint(gpt, random_hf_state_dict(shape, seed=seed, logit_std=1.0))
        return {k: v.detach().clone() for k, v in rollout_weights(gpt).items()}  # on the GPU, as the loop's are

    def canonical(local: dict) -> dict:
        return {k: v.cpu() for k, v in iter_canonical(MegatronShards(shape, 1, 1, None, {(0, 0, 0): local}))}

    model_dir = write_model_dir(tmp_path / "m", hf_config_for(shape, None), canonical(load(0)))
    seconds = {}
    for stress in (None, fmt):  # the BF16 engine first: its decode time is the comparison's baseline
        engine = RolloutEngine(RolloutConfig(model_dir=str(model_dir), recipe=recipe, gpu_memory_utilization=0.2,
                                             max_num_seqs=16, max_model_len=512, enforce_eager=False,
                                             stress_format=stress, llm_kwargs=GRAPH_KWARGS))
        try:
            for round_ in range(2 if stress else 1):
                if round_:  # other weights, written in place through the GRPO loop's path; the graphs stay
                    src = MegatronShards(shape, 1, 1, None, {(0, 0, 0): load(1)})
                    assert engine.refit_from_shards(src, rank=0, verify=True).verified
                prompts = _prompts(16, shape.vocab_size, seed=round_)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                samples = engine.generate(prompts, n=1, max_tokens=400, seed=round_, ignore_eos=True)
                seconds[stress or "bf16", round_] = time.perf_counter() - t0
                if stress is None:
                    continue
                seqs = [s.prompt_token_ids + s.token_ids for s in samples]
                width = max(map(len, seqs))
                tokens = torch.zeros(len(seqs), width, dtype=torch.long)
                for i, q in enumerate(seqs):
                    tokens[i, :len(q)] = torch.tensor(q)
                plens = [len(s.prompt_token_ids) for s in samples]
                lp = token_logprobs(gpt, tokens.cuda(), micro_batch_size=math.gcd(4, len(seqs)),
                                    lengths=torch.tensor(list(map(len, seqs))), decode_from=torch.tensor(plens))
                for i, s in enumerate(samples):
                    want = torch.tensor(s.logprobs, dtype=torch.float32)
                    got = lp[i, plens[i] - 1:len(seqs[i]) - 1].float().cpu()
                    assert torch.equal(got, want), (fmt, round_, i, (got - want).abs().max().item())
        finally:
            engine.shutdown()
    print(f"\n{fmt}: 16 x 400 tokens decoded in {seconds[fmt, 0]:.2f} s (after the refit {seconds[fmt, 1]:.2f} s), "
          f"BF16 engine {seconds['bf16', 0]:.2f} s")


def _cuda_seconds(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _linear_seconds(x: torch.Tensor, w: torch.Tensor, fmt) -> dict[str, float]:
    """Seconds per call: BF16 ``F.linear`` and the stress linear, forward (no grad) and forward + backward, and the
    stress forward's two parts (the activation quantizer, the scaled group sum)."""
    import torch.nn.functional as F

    from jetrl_megatron.fp8.stress import quantize_act, quantize_weight
    from jetrl_megatron.fp8.stress_linear import quantize_act_codes, stress_gemm, stress_linear

    xq, xs = quantize_act_codes(x.detach(), fmt)
    wq, ws = quantize_weight(w.detach(), fmt)
    t = {}
    with torch.no_grad():
        t["bf16 fwd"] = _cuda_seconds(lambda: F.linear(x, w))
        t["stress fwd"] = _cuda_seconds(lambda: stress_linear(x, w, None, fmt))
        t["quantize x"] = _cuda_seconds(lambda: quantize_act_codes(x, fmt))
        t["quantize x (torch twin)"] = _cuda_seconds(lambda: quantize_act(x, fmt))
        t["group sum"] = _cuda_seconds(lambda: stress_gemm(xq, xs, wq, ws, None, torch.bfloat16, True))
        t["group sum (torch twin)"] = _cuda_seconds(
            lambda: stress_gemm(xq.float(), xs, wq, ws, None, torch.bfloat16, False))
    t["bf16 fwd+bwd"] = _cuda_seconds(lambda: F.linear(x, w).sum().backward())
    t["stress fwd+bwd"] = _cuda_seconds(lambda: stress_linear(x, w, None, fmt).sum().backward())
    return t


def test_the_int_stress_gemm_runs_on_int8_tensor_cores_at_the_150m_shapes():
    """The unified INT4 arm's trainer linear on the GPU at count_150m_gpu's linear shapes and logprob micro-batch
    (16 x 1,032 tokens): each K group's code products come from ``torch._int_mm`` (int8 tensor cores), not the FP64
    fallback, and the result is the FP64 GEMM's bit for bit. Printed per shape: the stress linear's forward, its
    forward + backward, the quantizer's and the scaled group sum's share, against BF16's ``F.linear`` (what the
    learning round's unified arm pays per linear; its logprob pass took ~8x BF16's on an H100, 2026-12-06)."""
    from jetrl_megatron.fp8.stress import quantize_act, quantize_weight, stress_format
    from jetrl_megatron.fp8.stress_linear import _int8_products, stress_gemm
    from jetrl_megatron.model.shapes import get_model_shape

    shape, fmt, m = get_model_shape("qwen3-150m-char"), stress_format("int4_tensor"), 16 * 1032
    h, hd = shape.hidden_size, shape.head_dim
    linears = {"qkv": ((shape.num_attention_heads + 2 * shape.num_kv_heads) * hd, h),
               "proj": (h, shape.num_attention_heads * hd), "fc1": (2 * shape.ffn_hidden_size, h),
               "fc2": (h, shape.ffn_hidden_size)}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (n, k) in linears.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
        xq, xs = quantize_act(x.detach(), fmt)
        wq, ws = quantize_weight(w.detach(), fmt)
        products = _int8_products(xq, wq)
        assert products is not None, (name, n, k)
        assert torch.equal(products, xq.double() @ wq.double().T), name  # exact integers either way
        y = stress_gemm(xq, xs, wq, ws, None, torch.bfloat16, integer_codes=True)
        assert torch.equal(y, stress_gemm(xq, xs, wq, ws, None, torch.bfloat16, integer_codes=False)), name
        rows.append((name, n, k, _linear_seconds(x, w, fmt)))
    print(f"\nint4_tensor stress linear at {m} tokens, ms per call:")
    for name, n, k, t in rows:
        print(f"  {name} {n}x{k}: " + ", ".join(f"{key} {v * 1e3:.2f}" for key, v in t.items()))
