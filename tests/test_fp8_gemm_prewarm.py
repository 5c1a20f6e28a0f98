"""`jetrl prewarm`: the GEMMs and M values a run's FP8 linears meet, and the workers that run them.

The shapes are checked against numbers written out from Qwen3-8B's published config (and against the Megatron spec's
own per-rank shapes), the M values against every M of a range, and the worker against a spy on the GEMM dispatch.
On the GPU: one process per GEMM fills DeepGEMM's disk cache.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from jetrl_megatron.cli import main
from jetrl_megatron.fp8 import gemm as gemm_mod
from jetrl_megatron.fp8 import gemm_prewarm
from jetrl_megatron.fp8.gemm_prewarm import GemmTask, prewarm, representative_m_values, run_task
from jetrl_megatron.megatron.spec import per_rank_gemm_shapes
from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rl.config.run_config import arm_overrides, load_config
from jetrl_megatron.rl.tools.gemm_prewarm_plan import linear_gemms, prewarm_tasks

LONG = ["policy.generation.max_new_tokens=4096", "policy.max_total_sequence_length=4128",
        "policy.generation.vllm_cfg.max_model_len=4128"]


def _classes(ms, m_class=64, thresholds=(256, 512)):
    """What a tile heuristic keyed on ceil(M / m_class) and on thresholds at its multiples can tell apart."""
    return {(-(-m // m_class), *(m >= t for t in thresholds)) for m in ms}


@pytest.mark.parametrize("seed", range(6))
def test_representative_m_values_cover_every_tile_class(seed):
    rng = random.Random(seed)
    m_max = rng.choice([1, 63, 64, 65, 255, 256, 257, rng.randrange(300, 40000)])
    reps = representative_m_values(m_max)
    assert reps == sorted(set(reps)) and reps[0] == 1 and reps[-1] == m_max
    assert set(range(1, min(m_max, 256) + 1)) <= set(reps)  # every decode batch and short prefill exactly
    assert _classes(range(1, m_max + 1)) == _classes(reps)
    assert len(reps) <= 256 + 2 * (m_max // 64) + 1  # and not every M


def test_representative_m_values_refuses_an_empty_range():
    with pytest.raises(ValueError, match="m_max must be >= 1"):
        representative_m_values(0)


def test_gemm_task_names_its_bad_shape():
    with pytest.raises(ValueError, match="fc9: in_features 100 is not a multiple of 128"):
        GemmTask("fc9", 256, 100, "fprop", (1,))
    with pytest.raises(ValueError, match="form 'wgrad'"):
        GemmTask("fc9", 256, 128, "wgrad", (1,))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_linear_gemms_match_the_megatron_spec(tp):
    shape = get_model_shape("qwen3-8b")
    spec = per_rank_gemm_shapes(shape, tp)
    ours = linear_gemms(shape, tp)
    assert ours["qkv"] == spec["self_attention.linear_qkv"]
    assert ours["proj"] == spec["self_attention.linear_proj"]
    assert ours["fc1"] == (2 * spec["mlp.linear_fc1"][0], spec["mlp.linear_fc1"][1])  # gate and up, fused
    assert ours["fc2"] == spec["mlp.linear_fc2"]


def _tasks(arm, *extra):
    cfg = load_config("qwen3_8b_1gpu", [*arm_overrides(arm), *LONG, *extra])
    return {t.gemm_nk: t.m_values[-1] for t in prewarm_tasks(cfg)}


def test_jetrl_4k_tasks_are_qwen3_8b_gemms_at_the_recipe_token_bounds():
    # Qwen3-8B: hidden 4096, 32 query heads and 8 KV heads of 128, FFN 12288. The recipe: update micro-batches of 4
    # rows, logprob micro-batches of 8, rows of 4128 tokens padded to 33 x 128 = 4224.
    fprop_max, dgrad_max = 8 * 4224, 4 * 4224
    assert _tasks("jetrl") == {
        (6144, 4096): fprop_max, (4096, 4096): fprop_max, (24576, 4096): fprop_max, (4096, 12288): fprop_max,
        # DGrad multiplies by W: N is the weight's input, K its output; the square proj weight's DGrad is its
        # FProp's kernel (same N, K), warmed once
        (4096, 6144): dgrad_max, (4096, 24576): dgrad_max, (12288, 4096): dgrad_max,
    }


def test_rollout_only_fp8_arms_warm_the_rollout_fprop_and_bf16_nothing():
    rollout = {nk: 16384 for nk in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]}
    assert _tasks("bf16_train_fp8_rollout") == rollout
    assert _tasks("fake_quant") == rollout
    assert _tasks("bf16") == {}
    budget = _tasks("bf16_train_fp8_rollout", "++policy.generation.vllm_kwargs.max_num_batched_tokens=2048")
    assert set(budget.values()) == {2048}


def test_trainer_and_rollout_at_different_tp_warm_both_shapes():
    tp2 = ["policy.megatron_cfg.tensor_model_parallel_size=2", "cluster.gpus_per_node=2",
           "policy.generation.vllm_cfg.tensor_parallel_size=1"]
    cfg = load_config("qwen3_8b_1gpu", [*arm_overrides("jetrl"), *LONG, *tp2])
    tasks = {t.gemm_nk: t for t in prewarm_tasks(cfg)}
    fprop_tp2, dgrad_tp2, rollout = 8 * 4224, 4 * 4224, 16384
    assert {nk: t.m_values[-1] for nk, t in tasks.items()} == {
        (3072, 4096): fprop_tp2, (4096, 2048): fprop_tp2, (12288, 4096): fprop_tp2, (4096, 6144): fprop_tp2,
        (4096, 3072): dgrad_tp2, (2048, 4096): dgrad_tp2,
        # the rollout's TP1 FProps; two of them are a TP2 DGrad's (N, K): qkv 6144 x 4096 is fc2's DGrad (N = F/2),
        # down 4096 x 12288 is fc1's (K = 2F/2): run up to the larger M of the two
        (4096, 12288): max(rollout, dgrad_tp2), (6144, 4096): max(rollout, dgrad_tp2),
        (4096, 4096): rollout, (24576, 4096): rollout,
    }
    assert tasks[(6144, 4096)].covers == ("qkv@tp1 fprop",) and tasks[(4096, 12288)].covers == ("fc2@tp1 fprop",)


def test_run_task_calls_the_dispatch_at_every_m(monkeypatch):
    seen = []
    real = {"fprop": gemm_mod.fp8_gemm_fprop, "dgrad": gemm_mod.fp8_gemm_dgrad}

    def spy(form):
        def call(a_q, a_s, w_q, w_s, **kw):
            out = real[form](a_q, a_s, w_q, w_s, **kw)
            seen.append((form, a_q.shape[0], tuple(out.shape)))
            return out
        return call

    monkeypatch.setattr(gemm_prewarm, "fp8_gemm_fprop", spy("fprop"))
    monkeypatch.setattr(gemm_prewarm, "fp8_gemm_dgrad", spy("dgrad"))
    ms = (1, 5, 64, 130)
    for form, nk in (("fprop", (256, 128)), ("dgrad", (128, 256))):
        seen.clear()
        result = run_task(GemmTask("t", 256, 128, form, ms), Fp8Recipe(), "cpu")
        assert result.error is None and result.calls == len(ms) and result.backends == ["emulated"]
        assert seen == [(form, m, (m, nk[0])) for m in ms]


def test_prewarm_runs_each_task_in_its_own_process():
    tasks = [GemmTask("a", 256, 128, "fprop", (1, 3)), GemmTask("b", 128, 256, "dgrad", (2,)),
             GemmTask("c", 128, 128, "fprop", (1,))]
    done = []
    results = prewarm(tasks, Fp8Recipe(), processes=2, device="cpu", on_done=done.append)
    assert sorted(r.task.linear for r in results) == ["a", "b", "c"] == sorted(r.task.linear for r in done)
    assert all(r.error is None and r.calls == len(r.task.m_values) for r in results)
    failed = gemm_prewarm._worker(GemmTask("x", 128, 128, "fprop", (1,)), Fp8Recipe(), "meta")  # what a process runs
    assert failed.error and failed.calls == 0  # reported per task, not raised


def test_cli_dry_run_prints_the_plan(capsys):
    assert main(["prewarm", "--recipe", "qwen3_8b_1gpu", "--arm", "jetrl", "--dry-run", *LONG]) == 0
    out = capsys.readouterr().out
    assert "update 16896, logprob 33792, rollout 16384" in out and out.count(" M values ") == 7
    assert main(["prewarm", "--recipe", "qwen3_8b_1gpu", "--arm", "bf16", "--dry-run"]) == 0
    assert "nothing to compile" in capsys.readouterr().out
    assert main(["prewarm", "--recipe", "tiny_cpu"]) == 0  # the SLURM template's step on a CPU recipe: a no-op
    assert "CPU recipe" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_cli_without_cuda_says_why(capsys):
    assert main(["prewarm", "--recipe", "qwen3_8b_1gpu", "--arm", "jetrl"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


@pytest.mark.gpu
def test_prewarm_fills_deep_gemm_cache_on_gpu(tmp_path):
    """Two GEMMs in two processes with a fresh DG_JIT_CACHE_DIR: the cache holds kernels afterwards, and a process
    that runs the same GEMMs next finds them there (much faster than compiling)."""
    from jetrl_megatron.fp8.gemm import load_backend

    if load_backend("deep_gemm") is None:
        pytest.skip("DeepGEMM (vLLM's bundle) is not installed")
    script = textwrap.dedent("""
        import json, sys, time
        from jetrl_megatron.fp8.gemm_prewarm import GemmTask, prewarm
        from jetrl_megatron.recipe import Fp8Recipe
        tasks = [GemmTask("a", 512, 256, "fprop", (1, 64, 300)), GemmTask("b", 256, 512, "dgrad", (200,))]
        t0 = time.perf_counter()
        res = prewarm(tasks, Fp8Recipe(gemm_backend="deep_gemm"), processes=2)
        print(json.dumps({"s": time.perf_counter() - t0, "errors": [r.error for r in res],
                          "backends": sorted({b for r in res for b in r.backends})}))
    """)
    env = {**os.environ, "DG_JIT_CACHE_DIR": str(tmp_path / "dg")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["errors"] == [None, None] and runs[0]["backends"] == ["deep_gemm"]
    cached = [p for p in (tmp_path / "dg").rglob("*") if p.is_file()]
    assert cached, "DeepGEMM's cache directory stayed empty"
    assert runs[1]["s"] < runs[0]["s"], runs
