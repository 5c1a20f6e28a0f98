"""The `jetrl` command line: plan, run's GPU guard, sbatch, compare table and argument errors, resharder dispatch."""

import subprocess
import time

from warm_cli import run_cli

from jetrl_megatron.cli import main
from jetrl_megatron.rl.tools.compare import summary_table


def test_plan_ok(capsys):
    assert main(["plan", "--recipe", "qwen3_8b_tp1"]) == 0
    out = capsys.readouterr().out
    assert "grpo:" in out and "resharder preflight" in out and "optimizer_adam" in out and "plan: OK" in out


def test_plan_checks_the_machine_the_recipe_names_unless_told_otherwise(capsys):
    """The one-H200 recipe names its machine (policy.jet_rl.plan_*_mem_gib): a bare `jetrl plan` checks against it
    and passes; --gpu-mem-gib wins, and 72 GiB is too small for that recipe (peak ~77.1 GiB). A recipe naming none
    is checked against an assumed 80 GiB GPU on a machine without one, and says so."""
    import torch

    assert main(["plan", "--recipe", "qwen3_8b_1gpu", "--no-config"]) == 0
    out = capsys.readouterr().out
    assert "# checked against: GPU 139 GiB (policy.jet_rl.plan_gpu_mem_gib), host 125 GiB per node" in out, out
    assert "of 139 GiB: fits" in out and "of 125 GiB: fits" in out
    assert main(["plan", "--recipe", "qwen3_8b_1gpu", "--no-config", "--gpu-mem-gib", "72"]) == 1
    out = capsys.readouterr().out
    assert "GPU 72 GiB (--gpu-mem-gib)" in out and "of 72 GiB: DOES NOT FIT" in out, out
    assert main(["plan", "--recipe", "qwen3_8b_1gpu", "--no-config", "policy.jet_rl.plan_gpu_mem_gib=-1"]) == 2
    assert "policy.jet_rl.plan_gpu_mem_gib" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["plan", "--recipe", "qwen3_8b_tp1", "--no-config"]) == 0
        out = capsys.readouterr().out
        assert "GPU 80 GiB (assumed: an H100-80GB" in out and "host not checked" in out, out


def test_plan_machine_precedence():
    from jetrl_megatron.rl.config import ConfigError, load_config
    from jetrl_megatron.rl.tools.run_plan import plan_machine

    def sizes(*args):
        m = plan_machine(*args)
        return m.gpu_mem_gib, m.host_mem_gib

    named = load_config("qwen3_8b_1gpu")
    bare = load_config("qwen3_8b_tp1")
    def h100_here():
        return 93.0

    def no_gpu_here():
        return None

    assert sizes(named, 70.0, 50.0, h100_here) == (70.0, 50.0)  # the command line first
    assert sizes(named, None, None, h100_here) == (139.0, 125.0)  # then the recipe
    assert sizes(bare, None, None, h100_here) == (93.0, None)  # then this machine's GPU; host unchecked
    assert sizes(bare, None, None, no_gpu_here) == (80.0, None)
    try:
        plan_machine(bare, 0.0)
    except ConfigError as e:
        assert "--gpu-mem-gib: must be > 0" in str(e)
    else:
        raise AssertionError("a zero GPU size was accepted")


def test_plan_bad_key_exit_2(capsys):
    assert main(["plan", "policy.megatron_cfg.bogus=1"]) == 2
    assert "policy.megatron_cfg.bogus" in capsys.readouterr().err


def test_arm_flag_sets_nemo_rl_switches(capsys):
    """`--arm` sets fp8_cfg.enabled / vllm_cfg.precision (and restates the arm); an override that contradicts it is
    an error, not silently overwritten; the old `jet_rl.mode=` override says where the arm went."""
    assert main(["plan", "--recipe", "tiny_cpu", "--arm", "bf16_train_fp8_rollout"]) == 0
    out = capsys.readouterr().out
    assert "(arm bf16_train_fp8_rollout)" in out and "precision: fp8" in out and "arm: bf16_train_fp8_rollout" in out
    assert main(["plan", "--recipe", "tiny_cpu", "--arm", "bf16", "policy.generation.vllm_cfg.precision=fp8"]) == 2
    assert "policy.jet_rl.arm: 'bf16' contradicts" in capsys.readouterr().err
    assert main(["plan", "--recipe", "tiny_cpu", "jet_rl.mode=bf16"]) == 2
    err = capsys.readouterr().err
    assert "moved to policy.jet_rl" in err and "--arm" in err
    from jetrl_megatron.rl.config.run_config import RECIPES_DIR

    cfg = ("--config", str(RECIPES_DIR / "tiny_cpu.yaml"))
    assert main(["plan", *cfg, "--no-config", "--arm", "jetrl"]) == 0  # NeMo-RL's run_grpo.py form
    capsys.readouterr()
    assert main(["plan", *cfg, "--recipe", "tiny_cpu"]) == 2
    assert "give --recipe or --config, not both" in capsys.readouterr().err


def test_run_gpu_recipe_without_cuda_stops_at_once():
    t0 = time.time()
    r = run_cli(["run", "--recipe", "qwen3_32b_tp2"], timeout=120)
    import torch

    if torch.cuda.is_available():
        return
    assert r.returncode == 2 and "CUDA is not available" in r.stderr
    assert time.time() - t0 < 60


def test_sbatch_prints_command(capsys):
    assert main(["sbatch", "--recipe", "qwen3_32b_tp2", "--nodes", "8", "--arm", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "sbatch --nodes=8" in out and "RECIPE=qwen3_32b_tp2" in out
    # --arm travels to the job as NeMo-RL's switches (the job's `jetrl run` gets plain overrides)
    assert ("policy.megatron_cfg.fp8_cfg.enabled=false policy.generation.vllm_cfg.precision=bfloat16 "
            "policy.jet_rl.arm=bf16") in out and "cluster.num_nodes=8" in out
    assert main(["sbatch", "--recipe", "tiny_cpu"]) == 0  # the CPU path (tests/test_cli_slurm.py)
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
    """One row per arm, mean ± sample std across seeds, the mean alone for one seed, n/a where no seed has a value."""
    def st(mean, std=None):
        return {"mean": mean, "std": std, "min": mean, "max": mean, "n": 2 if std is not None else 1}

    jetrl = {"seeds": [42, 43], "val": {"val/accuracy@first": {**st(0.5, 0.1), "steps": [0]},
                                        "val/accuracy@last": {**st(0.7, 0.05), "steps": [20]}},
             "reward_first_quarter": st(0.2, 0.01), "reward_last_quarter": st(0.5, 0.02),
             "mismatch": {"mismatch/k3_kl": st(0.0, 0.0), "mismatch/token_mult_prob_error": st(1.0, 0.0)},
             "step_time": st(4.2, 0.3)}
    bf16 = {"seeds": [42], "val": {}, "reward_first_quarter": st(0.25), "reward_last_quarter": None, "mismatch": {},
            "step_time": None}
    lines = summary_table({"jetrl": jetrl, "bf16": bf16}).splitlines()
    assert "val acc greedy @ step 0" in lines[0] and "val acc greedy @ step 20" in lines[0]
    assert "sampled" not in lines[0]
    assert lines[2].startswith("| jetrl | 2 | 0.500 ± 0.100 | 0.700 ± 0.050 | 0.200 ± 0.010 -> 0.500 ± 0.020 | "
                               "0.00e+00 ± 0.00e+00 | 1.000000 ± 0.000000 | n/a | 4.20 ± 0.30 |"), lines[2]
    assert lines[3] == "| bf16 | 1 | n/a | n/a | 0.250 -> n/a | n/a | n/a | n/a | n/a |"


def test_compare_refuses_bad_arms_and_seeds(capsys):
    assert main(["compare", "--arms", "bf16,fp4"]) == 2
    err = capsys.readouterr().err
    assert "'fp4'" in err and "bf16, bf16_train_fp8_rollout, jetrl, fake_quant" in err and len(err.splitlines()) == 1
    assert main(["compare", "--seeds", "0"]) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err


def test_reshard_check_dispatch(capsys):
    import pytest

    pytest.importorskip("jetrl_megatron.reshard_cli")
    assert main(["reshard-check", "--model", "qwen3-32b", "--train-tp", "2", "--train-pp", "2",
                 "--rollout-tp", "4"]) == 0
    assert main(["reshard-check", "--model", "qwen2.5-7b", "--train-tp", "8", "--train-pp", "1",
                 "--rollout-tp", "8"]) != 0
