"""bench/host_overhead.py (issue 29 item 3: where the FP8 linear's host time goes) runs end to end on CPU under the
Triton interpreter before its GPU run spends device time: every op of every linear is timed, the per-layer sums are
the sums of the rows, and without CUDA or the interpreter it stops with one clear line and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER_ARMS = ("fp8_linear fwd+bwd", "bf16 linear fwd+bwd", "fp8_linear fwd+bwd, backward on the calling thread",
              "bf16 linear fwd+bwd, backward on the calling thread", "fp8 pieces fwd+bwd, no autograd",
              "bf16 pieces fwd+bwd, no autograd", "fp8_linear backward body (timed inside)")
BENCH = ROOT / "bench" / "host_overhead.py"


def _run(tmp_path: Path, interpret: bool, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(BENCH), "--tiny", "--tokens", "128", "--iters", "1",
                           "--out", str(tmp_path / "host.json"), *extra], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_every_op_of_every_linear_is_timed(tmp_path):
    pytest.importorskip("triton")
    proc = _run(tmp_path, True, "--torch-profile", "--thread-probe")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "host.json").read_text())
    rows = result["rows"]
    linears = sorted({r["linear"] for r in rows} - {"-"})
    assert [name.split()[0] for name in linears] == ["fc1", "fc2", "proj", "qkv"], linears
    per_linear = {name: {r["op"] for r in rows if r["linear"] == name} for name in linears}
    for name, ops in per_linear.items():
        assert {"quant_act x", "quant_dual dY", "regroup x for WGrad", "fprop via dispatch (emulated)",
                "dgrad via dispatch (emulated)", "wgrad via dispatch (emulated)", "fp8_linear fwd+bwd",
                "bf16 linear fwd+bwd", "fp8 pieces fwd+bwd, no autograd", "bf16 pieces fwd+bwd, no autograd",
                "fp8_linear backward body (timed inside)", "quant_dual dY one pass", "fp8 backward body, main thread",
                "fp8 backward body, worker thread", "fp8_linear fwd+bwd, GIL switch interval 1 s",
                "fp8_linear fwd+bwd, backward on the calling thread",
                "bf16 linear fwd+bwd, backward on the calling thread"} <= ops, (name, ops)
        assert {op for op in ops if op.endswith(" direct")} == {f"{form} emulated direct"
                                                               for form in ("fprop", "dgrad", "wgrad")}, ops
    assert {r["op"] for r in rows if r["linear"] == "-"} == {"triton empty kernel launch", "torch.empty 1 MiB"}
    assert all(r["host_us"] > 0 and r["device_us"] is None for r in rows)  # no CUDA here: host times only
    assert set(result["layer"]) == set(LAYER_ARMS)
    for arm in LAYER_ARMS:
        total = sum(r["host_us"] for r in rows if r["op"] == arm)
        assert result["layer"][arm]["host_us"] == pytest.approx(total), arm
    # the body is timed inside the whole fwd+bwd, so it cannot exceed it by much (one call each, no CUDA: same thread)
    body = {r["linear"]: r["host_us"] for r in rows if r["op"] == "fp8_linear backward body (timed inside)"}
    whole = {r["linear"]: r["host_us"] for r in rows if r["op"] == "fp8_linear fwd+bwd"}
    assert set(body) == set(whole) and all(0 < body[k] < 3 * whole[k] for k in body), (body, whole)
    md = (tmp_path / "host.md").read_text()
    assert "| the layer's four linears, fwd+bwd |" in md
    # torch.profiler's table for both arms, with the FP8 linear's own autograd node among the ops it saw
    profiles = result["torch_profile"]
    assert set(profiles) == {"fp8_linear fwd+bwd", "bf16 linear fwd+bwd",
                             "cProfile: fp8 backward body on autograd's thread",
                             "cProfile: fp8 backward body on the main thread"}
    assert "_Fp8LinearFunction" in profiles["fp8_linear fwd+bwd"]
    assert "torch.profiler, CPU self time, fp8_linear fwd+bwd" in md
    # cProfile ran around the body wherever it ran: one body per call (--iters 1, after the warm-up), its line says so
    for name in ("cProfile: fp8 backward body on autograd's thread", "cProfile: fp8 backward body on the main thread"):
        assert "fp8 backward bodies profiled: 1 calls, " in profiles[name], profiles[name][-2000:]
        assert "function calls" in profiles[name] and name in md
    assert "MainThread" in result["env"]["python_threads"] and "Python threads alive: " in md


def test_without_cuda_or_the_interpreter_it_refuses(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the bench runs there (bash bench/qwen3_8b_gpu.sh hostops)")
    proc = _run(tmp_path, interpret=False)
    assert proc.returncode != 0 and "need CUDA (or TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "host.json").exists()
