"""The trainer's forward as GPU vLLM's own forward (``attn_impl="vllm_cuda"``), on the H200 with vLLM 0.26.

- Each vLLM op the trainer calls keeps a torch twin: the op's output is within rounding of the twin, and the
  backward the trainer uses for it (twin backward; PyTorch's flash backward fed with FA3's output and log-sum-exp;
  the log-softmax gradient) matches an FP32 autograd reference on random inputs within a stated tolerance.
- The trainer's logprobs equal the engine's, bit for bit, per arm (jetrl: FP8 weights served byte for byte; bf16),
  for the sampled tokens (decode) and for prompt_logprobs (prefill), before and after an in-place refit.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

# FP32-reference bounds, relative to the reference's largest magnitude: BF16 inputs and outputs (8-bit mantissa,
# 2^-8 = 3.9e-3 relative per rounding) plus FP32 accumulation-order differences between flash kernels.
ATTN_REL_BOUND = 2e-2
LOGPROB_GRAD_REL_BOUND = 2 ** -8  # the gradient is returned in BF16 (as autograd returns it for BF16 logits)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


def _ops():
    from jetrl_megatron.vllm_cuda import ops

    if not ops.available():
        pytest.skip(f"GPU vLLM ops unavailable: {ops.unavailable_reason()}")
    return ops


def _reference_attention(q, k, v, lens, scale):
    """FP32 causal attention per sequence (GQA by repeating K/V), packed like the inputs."""
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
                    .transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_attention_and_its_backward_match_an_fp32_reference(head_dim):
    ops = _ops()
    from jetrl_megatron.megatron.numerics import _VllmCudaAttentionFn

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [37, 300, 129, 16]
    t, h, kvh = sum(lens), 8, 2
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(t, n, head_dim, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for n in (h, kvh, kvh))
    scale = head_dim ** -0.5
    out = _VllmCudaAttentionFn.apply(q, k, v, ops.PagedLayout.build(cu, max(lens)), scale, ops.PrefillAttention())
    dout = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.bfloat16)
    out.backward(dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = _reference_attention(qf, kf, vf, lens, scale)
    ref.backward(dout.float())
    assert _rel(out, ref) < ATTN_REL_BOUND
    for name, got, want in (("dq", q.grad, qf.grad), ("dk", k.grad, kf.grad), ("dv", v.grad, vf.grad)):
        assert _rel(got, want) < ATTN_REL_BOUND, (name, _rel(got, want))


def test_the_deterministic_flash_backward_repeats_its_bytes_and_stays_the_gradient():
    """``deterministic_backward``: PyTorch's fixed-order flash backward gives the same dq / dk / dv bytes on every
    call (its default adds each key block's dQ share with atomics: a 2-layer step in two processes gave other weights
    on an H100, 2026-12-06), and they are still the gradient (FP32 reference). Sequences of many key blocks, GQA."""
    ops = _ops()
    from jetrl_megatron.megatron.numerics import _VllmCudaAttentionFn

    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [1500, 700, 2048, 33]
    t, h, kvh, hd = sum(lens), 16, 4, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    layout = ops.PagedLayout.build(cu, max(lens))
    q0, k0, v0 = (torch.randn(t, n, hd, generator=g, device="cuda", dtype=torch.bfloat16) for n in (h, kvh, kvh))
    dout = torch.randn(t, h, hd, generator=g, device="cuda", dtype=torch.bfloat16)

    def grads(deterministic: bool) -> tuple[torch.Tensor, ...]:
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        _VllmCudaAttentionFn.apply(q, k, v, layout, hd ** -0.5, ops.PrefillAttention(), deterministic).backward(dout)
        return q.grad, k.grad, v.grad

    first = grads(True)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, grads(True), strict=True))
    default_repeats = all(torch.equal(a, b) for a, b in zip(grads(False), grads(False), strict=True))
    print(f"PyTorch's default flash backward repeated its bytes: {default_repeats}")
    qf, kf, vf = (x.float().requires_grad_() for x in (q0, k0, v0))
    _reference_attention(qf, kf, vf, lens, hd ** -0.5).backward(dout.float())
    for name, got, want in zip(("dq", "dk", "dv"), first, (qf.grad, kf.grad, vf.grad), strict=True):
        assert _rel(got, want) < ATTN_REL_BOUND, (name, _rel(got, want))
    assert torch.are_deterministic_algorithms_enabled() is False  # the switch was the call's only


def test_decode_split_attention_matches_an_fp32_reference():
    """Prompts as one prefill call, every later token as one decode call: the same attention (within rounding),
    and its backward (the flash backward over whole sequences) too."""
    ops = _ops()
    from jetrl_megatron.megatron.numerics import _VllmCudaAttentionFn

    g = torch.Generator(device="cuda").manual_seed(1)
    lens, prompts = [37, 300, 129, 16], [5, 40, 129, 1]  # a sequence all prompt, one with a 1-token prompt
    t, h, kvh, d = sum(lens), 8, 2, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(t, n, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for n in (h, kvh, kvh))
    layout = ops.PagedLayout.build(cu, max(lens), decode_from=torch.tensor(prompts, device="cuda"))
    assert layout.decode.decode_rows.shape[0] == sum(n - p for n, p in zip(lens, prompts, strict=True))
    out = _VllmCudaAttentionFn.apply(q, k, v, layout, d ** -0.5, ops.PrefillAttention())
    dout = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.bfloat16)
    out.backward(dout)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = _reference_attention(qf, kf, vf, lens, d ** -0.5)
    ref.backward(dout.float())
    assert _rel(out, ref) < ATTN_REL_BOUND
    for name, got, want in (("dq", q.grad, qf.grad), ("dk", k.grad, kf.grad), ("dv", v.grad, vf.grad)):
        assert _rel(got, want) < ATTN_REL_BOUND, (name, _rel(got, want))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprob_kernels_and_their_backward(temperature):
    _ops()
    from jetrl_megatron.megatron.model import _VllmCudaLogprobFn

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (3 * torch.randn(64, 5000, generator=g, device="cuda")).to(torch.bfloat16).requires_grad_()
    tok = torch.randint(0, 5000, (64,), generator=g, device="cuda")
    lp = _VllmCudaLogprobFn.apply(logits, tok, temperature)
    w = torch.randn(64, generator=g, device="cuda")
    (lp * w).sum().backward()
    ref_in = logits.detach().float().requires_grad_()
    scaled = ref_in / temperature
    if temperature != 1.0:  # vLLM stores the scaled logits back in BF16 before the log-softmax
        scaled = scaled + (scaled.detach().to(torch.bfloat16).float() - scaled.detach())
    ref = torch.log_softmax(scaled, -1).gather(-1, tok[:, None]).squeeze(1)
    (ref * w).sum().backward()
    assert float((lp - ref).abs().max()) < 1e-4
    assert _rel(logits.grad, ref_in.grad) < LOGPROB_GRAD_REL_BOUND


def test_element_wise_ops_agree_with_their_twins():
    ops = _ops()
    from jetrl_megatron.megatron.numerics import (
        _rms_fwd_twin,
        _rope_fwd_twin,
        _swiglu_fwd_twin,
        rope_cos_sin_cache,
    )

    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(513, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(1024, generator=g, device="cuda")).to(torch.bfloat16)
    twin, _ = _rms_fwd_twin(x, w, 1e-6, torch.bfloat16)
    for got in (ops.rms_norm(x, w, 1e-6), ops.fused_rms_norm_of_sum(x, w, 1e-6)):
        assert _rel(got, twin) < 2 ** -7  # one BF16 rounding apart at most
    fused, res = ops.fused_add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(res, (x.float() + x.float()).to(torch.bfloat16))  # the BF16 residual convention
    gu = torch.randn(77, 2 * 256, generator=g, device="cuda", dtype=torch.bfloat16)
    assert _rel(ops.silu_and_mul(gu), _swiglu_fwd_twin(gu)) < 2 ** -7
    cache = ops.rope_cache(128, 4096, 1e6, None, torch.device("cuda"))
    cos, sin = rope_cos_sin_cache(128, 1e6, 4096)
    assert _rel(cache.float().cpu(), torch.cat((cos, sin), -1)) < 2 ** -7  # the GPU's cos/sin vs the CPU's
    qx = torch.randn(300, 4, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(300, device="cuda")
    flat = qx.reshape(300, -1).clone()
    ops.rope_neox_(pos, flat, None, 128, cache)
    c, s = cache[:300].float().chunk(2, -1)
    assert _rel(flat.view_as(qx), _rope_fwd_twin(qx[None], c, s)[0]) < 2 ** -6  # BF16 arithmetic in the kernel


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(x),), generator=g).tolist()
            for x in torch.randint(6, 40, (n,), generator=g)]


def _trainer_logprobs(gpt, seqs, prompt_lens=None):
    from jetrl_megatron.megatron.model import token_logprobs

    s = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), s, dtype=torch.long)
    for i, q in enumerate(seqs):
        tokens[i, :len(q)] = torch.tensor(q)
    lp = token_logprobs(gpt, tokens.cuda(), micro_batch_size=math.gcd(4, len(seqs)),
                        lengths=torch.tensor(list(map(len, seqs))),
                        decode_from=None if prompt_lens is None else torch.tensor(prompt_lens))
    return [lp[i, :len(q) - 1].float().cpu() for i, q in enumerate(seqs)]


@pytest.mark.own_process
@pytest.mark.parametrize("arm", ["jetrl", "bf16"])
def test_trainer_logprobs_equal_vllm_decode_and_prefill_bit_for_bit(tmp_path, arm):
    _ops()
    from jetrl_megatron.megatron import cpu
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, fp8_context, rollout_weights
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir

    shape, recipe = get_model_shape("tiny"), Fp8Recipe(mode=arm, gemm_backend="cublas")
    cpu.init_parallel(1, 1)
    gpt = build_gpt(shape, recipe)
    assert fp8_context(gpt).attn_impl == "vllm_cuda"  # the default wherever GPU vLLM imports

    def weights(seed: int) -> dict:
        load_hf_checkpoint(gpt, random_hf_state_dict(shape, seed=seed, logit_std=1.0))
        local = {k: v.cpu().clone() for k, v in rollout_weights(gpt).items()}
        return dict(iter_canonical(MegatronShards(shape, 1, 1, None, {(0, 0, 0): local})))

    model_dir = write_model_dir(tmp_path / arm, hf_config_for(shape, None if arm == "bf16" else recipe), weights(0))
    engine = RolloutEngine(RolloutConfig(model_dir=str(model_dir), recipe=recipe, gpu_memory_utilization=0.2,
                                         max_num_seqs=16, max_model_len=256, fp8_gemm_warmup=False,
                                         llm_kwargs={"enable_prefix_caching": False}))
    try:
        for round_ in range(2):
            if round_:
                engine.refit(weights(1))  # in place; the trainer now holds the same new weights
            prompts = _prompts(12, shape.vocab_size, seed=round_)
            samples = engine.generate(prompts, n=1, max_tokens=48, seed=round_, ignore_eos=True)
            seqs = [s.prompt_token_ids + s.token_ids for s in samples]
            trainer = _trainer_logprobs(gpt, seqs)
            prefill = engine.score(seqs)
            for s, tr, pre in zip(samples, trainer, prefill, strict=True):
                n = len(s.prompt_token_ids)
                decode = torch.tensor(s.logprobs, dtype=torch.float32)
                assert torch.equal(tr[n - 1:], decode), (round_, (tr[n - 1:] - decode).abs().max())
                assert torch.equal(tr, torch.tensor(pre, dtype=torch.float32)), round_
    finally:
        engine.shutdown()


@pytest.mark.own_process
def test_decode_matched_trainer_equals_vllm_decode_under_cuda_graphs(tmp_path):
    """``attn_match="decode"``: the trainer computes each response token's query as vLLM's decode step does (CUDA
    graphs FULL_DECODE_ONLY, decode KV splits 1), so its logprobs of the sampled tokens are the engine's, bit for bit,
    over long responses, with 4 query heads per KV head (the Qwen3-8B ratio). What whole-sequence prefill matching
    gives on the same tokens is printed beside it."""
    _ops()
    import dataclasses

    from jetrl_megatron.megatron import cpu
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, rollout_weights
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir

    shape = dataclasses.replace(get_model_shape("tiny"), name="tiny-gqa4", num_attention_heads=8, num_kv_heads=2,
                                max_position_embeddings=1024)
    recipe = Fp8Recipe(mode="jetrl", gemm_backend="auto")
    cpu.init_parallel(1, 1)
    models = {m: build_gpt(shape, recipe, attn_match=m) for m in ("decode", "prefill")}
    sd = random_hf_state_dict(shape, seed=0, logit_std=1.0)
    for gpt in models.values():
        load_hf_checkpoint(gpt, sd)
    local = {k: v.cpu().clone() for k, v in rollout_weights(models["decode"]).items()}
    model_dir = write_model_dir(tmp_path / "m", hf_config_for(shape, recipe),
                                dict(iter_canonical(MegatronShards(shape, 1, 1, None, {(0, 0, 0): local}))))
    engine = RolloutEngine(RolloutConfig(
        model_dir=str(model_dir), recipe=recipe, gpu_memory_utilization=0.2, max_num_seqs=16, max_model_len=1024,
        enforce_eager=False, fp8_gemm_warmup=False,
        llm_kwargs={"enable_prefix_caching": False, "compilation_config": {"mode": 0,
                                                                           "cudagraph_mode": "FULL_DECODE_ONLY"},
                    "attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}}))
    try:
        prompts = _prompts(16, shape.vocab_size, seed=3)
        samples = engine.generate(prompts, n=1, max_tokens=600, seed=3, ignore_eos=True)
        seqs = [s.prompt_token_ids + s.token_ids for s in samples]
        plens = [len(s.prompt_token_ids) for s in samples]
        got = {m: _trainer_logprobs(gpt, seqs, plens if m == "decode" else None) for m, gpt in models.items()}
        same = {m: 0 for m in got}
        total = 0
        for i, s in enumerate(samples):
            decode = torch.tensor(s.logprobs, dtype=torch.float32)
            total += decode.numel()
            for m in got:
                same[m] += int((got[m][i][plens[i] - 1:] == decode).sum())
        print(f"\nsampled tokens bit-identical: decode-matched {same['decode']}/{total}, "
              f"prefill-matched {same['prefill']}/{total}")
        assert same["decode"] == total, same
    finally:
        engine.shutdown()


def _note_forms(seen: list, want: bool, _module, _inputs, out) -> None:
    """Forward hook: whether a norm's output carries FP8 forms for its linear, next to whether it should."""
    seen.append((want, hasattr(out, "_jetrl_fp8_input_forms")))


@pytest.mark.own_process
def test_batch_invariant_norms_make_the_trainer_equal_vllm_decode_at_hidden_4096(tmp_path):
    """At the Qwen3-8B width (hidden 4096, 32/8 heads) vLLM 0.26's own RMSNorm kernels give a row other bytes in a
    decode step (the running batch, padded to a CUDA-graph size) than in a prefill (bench/RESULTS.md, op by op), so a
    trainer equal to vLLM's prefill is not equal to what sampled the tokens. With ``cuda_norms: batch_invariant`` the
    engine's norms and the trainer's are one batch-invariant kernel: the trainer's logprobs of the sampled tokens are
    the engine's decode logprobs bit for bit (CUDA graphs FULL_DECODE_ONLY, vLLM's defaults otherwise); also with
    ``swiglu_fp8_forms``, where engine and trainer run the project's SwiGLU kernel and hand its FP8 forms to the down
    projection. (vLLM's own norms at this width are measured op by op by bench/decode_invariance.py; an engine on
    them is started by tests/test_rollout_gpu.py's export test: a third engine here cost ~20 s of the suite.)"""
    _ops()
    import dataclasses

    from jetrl_megatron.megatron import cpu
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, fp8_context, rollout_weights, unwrap
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.reshard.mover import MegatronShards, iter_canonical
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir

    shape = dataclasses.replace(get_model_shape("qwen3-8b"), name="qwen3-8b-2l", num_layers=2, vocab_size=8192,
                                max_position_embeddings=1024)
    recipe = Fp8Recipe(mode="jetrl", gemm_backend="auto")
    cpu.init_parallel(1, 1)
    sd = random_hf_state_dict(shape, seed=0, logit_std=1.0)
    same, total = {}, 0
    norms = "batch_invariant"
    for swiglu in (False, True):
        tag = norms + ("+swiglu_fp8_forms" if swiglu else "")
        gpt = build_gpt(shape, recipe, cuda_norms=norms, swiglu_fp8_forms=swiglu)
        assert (fp8_context(gpt).cuda_norms, fp8_context(gpt).swiglu_fp8_forms) == (norms, swiglu)
        load_hf_checkpoint(gpt, sd)
        local = {k: v.cpu().clone() for k, v in rollout_weights(gpt).items()}
        model_dir = write_model_dir(tmp_path / tag, hf_config_for(shape, recipe),
                                    dict(iter_canonical(MegatronShards(shape, 1, 1, None, {(0, 0, 0): local}))))
        engine = RolloutEngine(RolloutConfig(
            model_dir=str(model_dir), recipe=recipe, gpu_memory_utilization=0.3, max_num_seqs=64,
            max_model_len=1024, enforce_eager=False, fp8_gemm_warmup=False, cuda_norms=norms,
            swiglu_fp8_forms=swiglu, llm_kwargs={"enable_prefix_caching": False,
                                                 "compilation_config": {"mode": 0,
                                                                        "cudagraph_mode": "FULL_DECODE_ONLY"}}))
        try:
            layers = 2 * 4 + 1  # per layer input, post-attention, q and k norms; the final norm
            # the hidden-sized ones hand their output's FP8 forms to the plugin's linears (the trainer quantizes
            # its own: the tokens below being identical checks that the forms are quant_act's bytes)
            assert engine.norms == {"batch_invariant": layers, "vllm": 0, "fp8_input": 2 * 2 + 1}, engine.norms
            assert engine.swiglu == ({"project": 2, "vllm": 0, "fp8_output": 2} if swiglu
                                     else {"project": 0, "vllm": 2, "fp8_output": 0}), engine.swiglu
            samples = engine.generate(_prompts(48, shape.vocab_size, seed=3), n=1, max_tokens=300, seed=3,
                                      ignore_eos=True)
            seqs = [s.prompt_token_ids + s.token_ids for s in samples]
            # the trainer's hidden-sized norms write FP8 forms with the batch-invariant norms, as the engine's do (and
            # the tokens below being identical says the linears that take them compute the engine's bytes)
            seen, hooks = [], []
            for layer in unwrap(gpt).decoder.layers:
                for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
                    hooks.append(norm.register_forward_hook(functools.partial(_note_forms, seen, True)))
                hooks.append(layer.mlp.activation_func.register_forward_hook(
                    functools.partial(_note_forms, seen, swiglu)))  # the SwiGLU's forms for the down projection
            try:
                got = _trainer_logprobs(gpt, seqs)
            finally:
                for h in hooks:
                    h.remove()
            assert seen and all(w == h for w, h in seen), (tag, seen)
            same[tag], total = 0, 0
            for i, s in enumerate(samples):
                decode = torch.tensor(s.logprobs, dtype=torch.float32)
                total += decode.numel()
                same[tag] += int((got[i][len(s.prompt_token_ids) - 1:] == decode).sum())
        finally:
            engine.shutdown()
            del gpt
            torch.cuda.empty_cache()
    print(f"\nsampled tokens bit-identical at hidden 4096 (of {total}): {same}")
    assert same["batch_invariant"] == same["batch_invariant+swiglu_fp8_forms"] == total, same
