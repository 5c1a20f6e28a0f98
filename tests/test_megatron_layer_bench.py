"""bench/megatron_layer_bench.py runs end to end at the tiny shape on CPU (its GPU runs cost device time, so a broken
option must show here first): every arm and column, the fused SwiGLU arms under the Triton interpreter with their
MLP gradients bit-identical to the unfused arm's, and ``--cuda-graph`` refused without CUDA with one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "megatron_layer_bench.py"


def _run(args: list[str], tmp_path: Path, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(BENCH), "--tiny", "--seq", "64", "--iters", "1", "--warmup", "1",
                           "--out", str(tmp_path), *args], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


def test_layer_bench_tiny_with_the_swiglu_fusions(tmp_path):
    pytest.importorskip("megatron.core")
    pytest.importorskip("triton")
    proc = _run(["--elementwise", "triton", "--fuse-swiglu-grad-quant", "off,on", "--swiglu-fp8-forms", "off,on"],
                tmp_path, interpret=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "megatron_layer_bench.json").read_text())["rows"]
    fusions = sorted(tuple(r["swiglu_fusion"]) for r in rows if r["mode"] == "jetrl")
    assert fusions == [(False, False), (False, True), (True, False), (True, True)], fusions
    for r in rows:
        assert r["layer_ms"] > 0 and r["fwd_ms"] > 0 and r["mlp_ms"] > 0, r
        if any(r["swiglu_fusion"]):
            assert r["mlp_grads_bit_identical_vs_unfused"] is True, r
    assert "fwd only ms" in (tmp_path / "megatron_layer_bench.md").read_text()


def test_cuda_graph_needs_cuda(tmp_path):
    pytest.importorskip("megatron.core")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the graphed arms run in the GPU bench (bash bench/qwen3_8b_gpu.sh fuse)")
    proc = _run(["--cuda-graph"], tmp_path)
    assert proc.returncode == 2 and "--cuda-graph needs CUDA" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "megatron_layer_bench.json").exists()


def test_another_ffn_size_and_the_gemm_plus_quantization_ratio(tmp_path):
    """``--ffn`` (TransformerEngine's guide shape: FFN 16384 at hidden 4096) reaches the layer, and ``--profile``
    reports each FP8 arm's GEMM + quantization time against the BF16 arm's GEMM time."""
    pytest.importorskip("megatron.core")
    proc = _run(["--ffn", "384", "--profile"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "megatron_layer_bench.json").read_text())
    assert out["info"]["shape"]["ffn_hidden_size"] == 384
    (ratio,) = out["info"]["gemm_plus_quant_speedup"]
    prof = {p["arm"]: p["groups"] for p in out["profiles"]}
    bf16 = next(g for a, g in prof.items() if a.startswith("bf16 "))
    fp8 = prof[ratio["arm"]]
    assert ratio["bf16_gemm_ms"] == bf16["gemm"] > 0
    assert ratio["fp8_gemm_quant_ms"] == pytest.approx(fp8.get("gemm", 0) + fp8.get("fp8 quant", 0))
    assert ratio["speedup"] == pytest.approx(ratio["bf16_gemm_ms"] / ratio["fp8_gemm_quant_ms"])
    assert "TransformerEngine's blockwise FP8 on an H200: 1.40x" in (tmp_path / "megatron_layer_bench.md").read_text()
