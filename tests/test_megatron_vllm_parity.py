"""The Megatron trainer (default CPU numerics) reproduces vllm-cpu's logprobs bit for bit.

vLLM (real vllm-cpu 0.32, in-process, our jetrl_fp8 plugin) serves a tiny Qwen3 quantized with the trainer's
quantizer and samples responses; the trainer, built from the same BF16 weights, computes the logprobs of prompt +
response with `token_logprobs`. In jetrl mode sampled-token logprobs (vLLM's decode path, M = running sequences)
and rescored prompt logprobs (prefill path) must equal the trainer's exactly. In bf16 mode only the prefill path is
required to be exact: vLLM's BF16 GEMMs on CPU give row results that depend on M for M < 8 (docs/vllm_cpu.md), so
decoding 4 sequences differs in the last bits (the FP8 GEMMs are FP64-accumulated and batch-invariant). With the
rollout's temperature / top-k / top-p (``parity_report.FILTERS``) the trainer's processed logprobs stay exact in jetrl.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from parity_report import assert_exact, host_default_combination, parity_report  # noqa: E402

from jetrl_megatron.vllm_cpu.build import BUILDS  # noqa: E402


@pytest.mark.slow
def test_trainer_logprobs_equal_vllm_cpu_bit_for_bit(tmp_path, monkeypatch):
    """Also the check of the host's own build and attention ISA, which test_vllm_cpu_builds.py's forced children
    leave out: it must be the pair ``host_default_combination`` names."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    report = parity_report(os.fspath(tmp_path))
    print(f"\nparity on this host's default build: {report}")
    default = host_default_combination()
    if default is not None:
        build, isa = default
        assert report["kernels"] == {"build": BUILDS[build][0], "attn_isa": isa}, (default, report["kernels"])
    assert_exact(report)
