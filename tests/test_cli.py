"""The `jetrl` command line: plan, run's GPU guard, sbatch, compare table, resharder dispatch."""

import subprocess
import sys
import time

from jetrl_megatron.cli import compare_table, main


def test_plan_ok(capsys):
    assert main(["plan", "--recipe", "qwen3_8b_tp1"]) == 0
    out = capsys.readouterr().out
    assert "grpo:" in out and "resharder preflight" in out and "optimizer_adam" in out and "plan: OK" in out


def test_plan_bad_key_exit_2(capsys):
    assert main(["plan", "policy.megatron_cfg.bogus=1"]) == 2
    assert "policy.megatron_cfg.bogus" in capsys.readouterr().err


def test_run_gpu_recipe_without_cuda_stops_at_once():
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "jetrl_megatron.cli", "run", "--recipe", "qwen3_32b_tp2"],
                       capture_output=True, text=True, timeout=120)
    import torch

    if torch.cuda.is_available():
        return
    assert r.returncode == 2 and "CUDA is not available" in r.stderr
    assert time.time() - t0 < 60


def test_sbatch_prints_command(capsys):
    assert main(["sbatch", "--recipe", "qwen3_32b_tp2", "--nodes", "8", "jet_rl.mode=bf16"]) == 0
    out = capsys.readouterr().out
    assert "sbatch --nodes=8" in out and "RECIPE=qwen3_32b_tp2" in out and "jet_rl.mode=bf16" in out
    assert main(["sbatch", "--recipe", "tiny_cpu"]) == 0  # the CPU path (tests/test_slurm.py)
    assert "--gres=none" in capsys.readouterr().out


def test_sbatch_template_contents():
    from jetrl_megatron.rl.config import REPO_ROOT

    text = (REPO_ROOT / "slurm" / "jetrl.sbatch").read_text()
    for needle in ("srun", "torchrun", "--rdzv-endpoint", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1",
                   "VLLM_USE_DEEP_GEMM_E8M0=0", "RECIPE", "OVERRIDES", "node-%n.log"):
        assert needle in text
    r = subprocess.run(["bash", "-n", str(REPO_ROOT / "slurm" / "jetrl.sbatch")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_compare_table_format():
    s = {"mismatch_mean": {"mismatch/k3_kl": 0.0, "mismatch/kl": 0.0, "mismatch/token_mult_prob_error": 1.0,
                           "mismatch/abs_dp_max": 0.0, "mismatch/is_oob_frac": 0.0},
         "reward_first": 0.2, "reward_last": 0.5, "accuracy_first": 0.1, "accuracy_last": 0.3, "step_time_mean": 4.2}
    t = compare_table([("jetrl", s), ("bf16", {})])
    assert "| jetrl | 0.000e+00 |" in t and "0.200 -> 0.500" in t and "| bf16 | n/a" in t


def test_reshard_check_dispatch(capsys):
    import pytest

    pytest.importorskip("jetrl_megatron.reshard_cli")
    assert main(["reshard-check", "--model", "qwen3-32b", "--train-tp", "2", "--train-pp", "2",
                 "--rollout-tp", "4"]) == 0
    assert main(["reshard-check", "--model", "qwen2.5-7b", "--train-tp", "8", "--train-pp", "1",
                 "--rollout-tp", "8"]) != 0
