"""Errors a user can act on, and runs that do not fail silently (issue 12, section 4).

* runtime mistakes (missing model path, broken recipe YAML, TP > 1 without torchrun, a model the hub cannot give)
  end as one ``jetrl run: ...`` line, exit 2, and leave no log directory behind;
* out-of-range values are refused with the key and the range (steps, learning rate, temperature, node count,
  BF16 layers beyond the model's depth);
* skipped optimizer updates are marked, counted and fail a run in which none was applied; a collapsed policy is
  reported;
* a truncated newest checkpoint falls back to the previous one; rank files load with weights_only=True (a foreign
  pickle is refused without running it) and `jetrl export` reads `jetrl run` checkpoints of any TP x PP directly;
* fp8_linear names N when N is not a multiple of 128, at the forward call.

The end-to-end runs are tiny (4 prompts x 4 samples, 1-2 GRPO steps) and marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from small_run import small_run
from warm_cli import run_cli

from jetrl_megatron.cli import main
from jetrl_megatron.errors import UserError

CLI = [sys.executable, "-m", "jetrl_megatron.cli"]
# no warm start, no validation, no TensorBoard or plot
SMALL = small_run(0, tensorboard=False, plot=False)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _cli(*args: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    """`python -m jetrl_megatron.cli *args` in a fresh process (started warm where the environment allows)."""
    return run_cli(args, env=_env(**env), timeout=timeout)


def _one_error_line(r: subprocess.CompletedProcess, cmd: str = "run") -> str:
    """The process failed with exit 2 and a single `jetrl <cmd>: ...` line on stderr (no traceback)."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    assert lines and lines[-1].startswith(f"jetrl {cmd}: "), r.stderr[-4000:]
    return lines[-1]


# ------------------------------------------------------------------------------------------------ runtime errors


def test_missing_model_path_is_one_line_and_writes_nothing(tmp_path):
    log_dir = tmp_path / "run"
    r = _cli("run", "policy.model_name=/nonexistent/path", f"logger.log_dir={log_dir}")
    line = _one_error_line(r)
    assert len(r.stderr.strip().splitlines()) == 1
    assert "policy.model_name" in line and "/nonexistent/path" in line and "not a directory" in line
    assert not log_dir.exists()


def test_recipe_yaml_syntax_error_is_one_line(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("defaults: tiny_cpu\ngrpo:\n  max_num_steps: 2\n seed: [3\n")
    r = _cli("run", "--recipe", str(recipe), f"logger.log_dir={tmp_path / 'run'}")
    line = _one_error_line(r)
    assert len(r.stderr.strip().splitlines()) == 1
    assert str(recipe) in line and "not a valid recipe YAML" in line and "line 4" in line
    assert not (tmp_path / "run").exists()


def test_old_jet_rl_override_names_the_new_switches(tmp_path):
    """The removed `jet_rl.mode=...` override: one line that says where the arm went, before any run starts."""
    r = _cli("run", "jet_rl.mode=bf16", f"logger.log_dir={tmp_path / 'run'}")
    line = _one_error_line(r)
    assert len(r.stderr.strip().splitlines()) == 1
    assert "'jet_rl.mode=bf16'" in line and "policy.jet_rl" in line and "--arm" in line
    assert not (tmp_path / "run").exists()


def test_tp2_without_torchrun_says_which_command(tmp_path):
    r = _cli("run", "policy.megatron_cfg.tensor_model_parallel_size=2", f"logger.log_dir={tmp_path / 'run'}")
    line = _one_error_line(r)
    assert len(r.stderr.strip().splitlines()) == 1
    assert "tensor_model_parallel_size=2" in line and "single process" in line
    assert ("torchrun --standalone --nproc-per-node=2 -m jetrl_megatron.cli run --recipe tiny_cpu "
            "policy.megatron_cfg.tensor_model_parallel_size=2") in line
    assert not (tmp_path / "run").exists()


def test_failure_inside_the_run_removes_its_fresh_log_dir(tmp_path):
    """A hub id that cannot be resolved (offline) fails after the run created its log directory: one line, exit 2,
    and the directory is gone."""
    log_dir = tmp_path / "run"
    r = _cli("run", "policy.model_name=jetrl-no-such-org/no-such-model", f"logger.log_dir={log_dir}",
             *SMALL, HF_HUB_OFFLINE="1", timeout=300)
    line = _one_error_line(r)
    # the key, the id and the cache searched, in one line
    assert "policy.model_name: 'jetrl-no-such-org/no-such-model'" in line and "Hugging Face cache" in line
    assert not log_dir.exists()


# ------------------------------------------------------------------------------------------------ ranges


@pytest.mark.parametrize(("recipe", "override", "expected"), [
    ("tiny_cpu", "grpo.max_num_steps=-3", "grpo.max_num_steps: must be >= 1, got -3"),
    ("tiny_cpu", "policy.megatron_cfg.optimizer.lr=-1e-3",
     "policy.megatron_cfg.optimizer.lr: must be >= 0 and finite, got -0.001"),
    ("tiny_cpu", "policy.jet_rl.sft_warmstart.lr=-1",
     "policy.jet_rl.sft_warmstart.lr: must be >= 0 and finite, got -1.0"),
    ("tiny_cpu", "policy.generation.temperature=-0.5",
     "policy.generation.temperature: must be >= 0 and finite, got -0.5"),
    ("tiny_cpu", "policy.generation.vllm_cfg.gpu_memory_utilization=1.5",
     "policy.generation.vllm_cfg.gpu_memory_utilization: must be in (0, 1], got 1.5"),
    ("tiny_cpu", "policy.jet_rl.amax_eps=0.5", "policy.jet_rl.amax_eps: must be in [1e-20, 0.001), got 0.5"),
    ("tiny_cpu", "cluster.num_nodes=0", "cluster.num_nodes: must be >= 1, got 0"),
    ("qwen3_8b_tp1", "policy.generation.vllm_cfg.num_first_layers_in_bf16=40",
     "policy.generation.vllm_cfg.num_first_layers_in_bf16: must be in [0, 36] (qwen3-8b has 36 layers), got 40"),
    ("qwen3_8b_tp1", "policy.generation.vllm_cfg.num_last_layers_in_bf16=-1",
     "policy.generation.vllm_cfg.num_last_layers_in_bf16: must be >= 0, got -1"),
])
def test_out_of_range_values_name_key_and_range(capsys, recipe, override, expected):
    assert main(["plan", "--recipe", recipe, "--no-config", override]) == 2
    assert capsys.readouterr().err.strip() == f"jetrl plan: {expected}"


def test_refused_values_name_key_and_reason(capsys):
    """A NeMo-RL key whose value this project does not implement is refused with the key, the value and why."""
    assert main(["plan", "--recipe", "tiny_cpu", "--no-config", "policy.precision=float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jetrl plan: policy.precision: 'float32' is refused: ") and "(accepted: 'bfloat16')" in err
    assert "\n" not in err


@pytest.mark.parametrize(("override", "want"), [
    ("policy.generation.top_p=1.5", "policy.generation.top_p: must be in (0, 1], got 1.5"),
    ("policy.generation.top_p=0", "policy.generation.top_p: must be in (0, 1], got 0.0"),
    ("policy.generation.top_k=0", "policy.generation.top_k: must be null or -1 (no top-k filter) or >= 1, got 0"),
])
def test_sampling_values_outside_nemo_rls_range_name_the_key(capsys, override, want):
    assert main(["plan", "--recipe", "tiny_cpu", "--no-config", override]) == 2
    assert capsys.readouterr().err.strip() == f"jetrl plan: {want}"


def test_bf16_layers_together_beyond_depth(capsys):
    first = "policy.generation.vllm_cfg.num_first_layers_in_bf16"
    last = "policy.generation.vllm_cfg.num_last_layers_in_bf16"
    assert main(["plan", "--recipe", "qwen3_8b_tp1", f"{first}=20", f"{last}=20"]) == 2
    err = capsys.readouterr().err
    assert f"{first} + num_last_layers_in_bf16: must be <= 36" in err and "20 + 20 = 40" in err
    assert main(["plan", "--recipe", "qwen3_8b_tp1", "--no-config", f"{first}=18", f"{last}=18"]) == 0


def test_run_refuses_negative_steps_before_starting(tmp_path):
    r = _cli("run", "grpo.max_num_steps=-3", f"logger.log_dir={tmp_path / 'run'}")
    assert "grpo.max_num_steps: must be >= 1, got -3" in _one_error_line(r)
    assert not (tmp_path / "run").exists()


def test_sbatch_node_count_must_be_positive(capsys):
    for nodes in ("-1", "0"):
        assert main(["sbatch", "--recipe", "qwen3_32b_tp2", "--nodes", nodes]) == 2
        assert capsys.readouterr().err.strip() == f"jetrl sbatch: --nodes: must be >= 1, got {nodes}"


# ------------------------------------------------------------------------------------------------ fp8_linear


def test_fp8_linear_names_n_at_the_forward_call():
    from jetrl_megatron.fp8.linear import fake_quant_linear, fp8_linear

    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(100, 128, dtype=torch.bfloat16, requires_grad=True)
    for fn in (fp8_linear, fake_quant_linear):
        with pytest.raises(ValueError, match=r"N \(out features, weight dim 0\) = 100 not a multiple of 128") as e:
            fn(x, w)
        assert "100 x 128" in str(e.value) and "K (" not in str(e.value)
    with pytest.raises(ValueError, match=r"K \(in features, weight dim 1\) = 200"):
        fp8_linear(torch.randn(4, 200, dtype=torch.bfloat16), torch.randn(256, 200, dtype=torch.bfloat16))
    fp8_linear(x, torch.randn(256, 128, dtype=torch.bfloat16, requires_grad=True)).sum().backward()  # aligned: fine
    assert x.grad is not None and x.grad.shape == x.shape


# ------------------------------------------------------------------------------------------------ run health


def test_collapse_needs_an_informed_policy_first():
    """A random init samples uniformly from step 1: not a collapse. Falling back to ln V after a lower entropy is."""
    from jetrl_megatron.rl.health import find_collapse, update_summary

    ln128 = 4.852
    uniform = [{"step": s, "policy/approx_entropy": ln128, "reward/mean": 0.0} for s in (1, 2, 3)]
    assert find_collapse(uniform, 128) is None
    rows = [{"step": 1, "policy/approx_entropy": 2.1, "train/skipped_steps": 0.0},
            {"step": 2, "policy/approx_entropy": ln128, "train/skipped_steps": 1.0, "reward/mean": 0.0}]
    c = find_collapse(rows, 128)
    assert c is not None and c["step"] == 2 and c["step_before"] == 1
    assert update_summary(rows, 2) == {"optimizer_updates": 3, "skipped_updates": 1, "skipped_steps": [2]}


# ------------------------------------------------------------------------------------------------ checkpoints


def _fake_checkpoint(root: Path, step: int, *, record_sizes: bool = True) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    torch.save({"model": {"w": torch.arange(50_000, dtype=torch.float32)}, "step": step}, d / "rank_0.pt")
    meta = {"format": 2, "step": step, "world_size": 1}
    if record_sizes:
        meta["files"] = {"rank_0.pt": (d / "rank_0.pt").stat().st_size}
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "COMPLETE").write_text("")
    return d


def _truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


@pytest.mark.parametrize("record_sizes", [True, False])
def test_truncated_newest_checkpoint_falls_back_with_a_warning(tmp_path, capsys, record_sizes):
    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.outputs.checkpoint_io import latest_checkpoint

    cfg = load_config("tiny_cpu", [f"checkpointing.checkpoint_dir={tmp_path}"])
    step1 = _fake_checkpoint(tmp_path, 1, record_sizes=record_sizes)
    step2 = _fake_checkpoint(tmp_path, 2, record_sizes=record_sizes)
    assert latest_checkpoint(cfg) == step2
    _truncate(step2 / "rank_0.pt", 100_000)
    assert latest_checkpoint(cfg) == step1
    err = capsys.readouterr().err
    assert "jetrl run: warning: checkpoint" in err and str(step2) in err and "rank_0.pt" in err
    _truncate(step1 / "rank_0.pt", 10)
    with pytest.raises(UserError, match="none of the 2 complete checkpoint"):
        latest_checkpoint(cfg)


def test_export_refuses_a_checkpoint_without_its_layout(tmp_path, capsys):
    from jetrl_megatron.reshard_cli import export_main

    d = _fake_checkpoint(tmp_path, 1)  # meta.json without the ranks' coordinates / model config
    assert export_main(["--from-megatron", str(d), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jetrl export: {d}: meta.json has no parallel layout") and "\n" not in err
    assert not (tmp_path / "hf").exists()


class _RunsCode:
    """Unpickling this creates a marker file: what a foreign 'checkpoint' could do under weights_only=False."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_resume_refuses_a_pickle_that_would_run_code(tmp_path):
    from jetrl_megatron.rl.outputs.checkpoint_io import load_checkpoint

    d = _fake_checkpoint(tmp_path, 1)
    marker = tmp_path / "ran"
    torch.save({"model": {}, "rng": _RunsCode(str(marker))}, d / "rank_0.pt")
    with pytest.raises(UserError, match="refused to load it") as e:
        load_checkpoint(d, trainer=None, stream=None)
    assert str(d / "rank_0.pt") in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()
    torch.load(d / "rank_0.pt", weights_only=False)  # the file really runs code when loaded unsafely
    assert marker.exists()


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    import random

    import numpy as np

    from jetrl_megatron.rl.outputs.checkpoint_format import rng_state, set_rng_state

    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached Gaussian in NumPy's state
    torch.save({"rng": rng_state()}, tmp_path / "r.pt")
    want = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    set_rng_state(torch.load(tmp_path / "r.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == want


# ------------------------------------------------------------------------------------------------ end to end


def _run_ok(log_dir: Path, *overrides: str, timeout: int = 400) -> tuple[subprocess.CompletedProcess, list[dict]]:
    r = _cli("run", *SMALL, f"logger.log_dir={log_dir}", f"checkpointing.checkpoint_dir={log_dir / 'ckpt'}",
             *overrides, timeout=timeout)
    return r, [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_run_checkpoint_exports_and_resumes_past_a_truncated_one(tmp_path):
    from safetensors.torch import load_file

    from jetrl_megatron.reshard_cli import export_main

    common = ("policy.jet_rl.sft_warmstart.steps=4", "policy.jet_rl.sft_warmstart.batch_size=16",
              "policy.jet_rl.sft_warmstart.lr=1e-2",
              "grpo.max_num_steps=2", "checkpointing.enabled=true", "checkpointing.save_period=1")
    a = tmp_path / "a"
    r, rows_a = _run_ok(a, *common)
    assert r.returncode == 0, r.stderr[-4000:]
    for step in (1, 2):  # the resume and export loaders' contract: tensors and plain values only
        state = torch.load(a / "ckpt" / f"step_{step}" / "rank_0.pt", weights_only=True)
        assert state["step"] == step and isinstance(state["rng"]["numpy"]["keys"], torch.Tensor)

    # export straight from the run's checkpoint directory: model and recipe come from its meta.json
    out = tmp_path / "hf"
    assert export_main(["--from-megatron", str(a / "ckpt" / "step_2"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["num_hidden_layers"] == 4
    hf = load_file(str(out / "model.safetensors"))
    assert hf["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert hf["model.layers.3.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
    assert hf["model.embed_tokens.weight"].dtype == torch.bfloat16

    # the newest checkpoint's rank file is truncated: resume from step 1 with a warning, reproducing step 2 exactly
    b = tmp_path / "b"
    shutil.copytree(a / "ckpt", b / "ckpt")
    _truncate(b / "ckpt" / "step_2" / "rank_0.pt", 4096)
    r, rows_b = _run_ok(b, *common)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "jetrl run: warning: checkpoint" in r.stderr and "step_2 is unusable" in r.stderr
    assert f"resumed from {b / 'ckpt' / 'step_1'} (step 1)" in r.stdout
    assert [x["step"] for x in rows_b] == [2]
    for k in ("train/loss", "train/grad_norm", "reward/mean", "mismatch/k3_kl", "policy/approx_entropy"):
        assert rows_b[0][k] == rows_a[1][k], (k, rows_b[0][k], rows_a[1][k])
    assert rows_a[0]["train/grad_norm"] > 0 and rows_a[1]["train/grad_norm"] > 0  # real updates: not vacuous


@pytest.mark.slow
def test_run_without_any_applied_update_fails(tmp_path):
    """kl penalty 1e300 overflows FP32: the loss is not finite and Megatron skips every update."""
    log_dir = tmp_path / "run"
    r = _cli("run", *SMALL, "grpo.max_num_steps=1", "loss_fn.reference_policy_kl_penalty=1e300",
             f"logger.log_dir={log_dir}", timeout=400)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-4000:])
    assert "step   1" in r.stdout and "UPDATE SKIPPED (1 of 1" in r.stdout
    assert "skipped optimizer updates: 1 of 1" in r.stdout
    assert "jetrl run: no optimizer update was applied" in r.stderr
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["ok"] is False and summary["optimizer_updates"] == 0 and summary["skipped_updates"] == 1
    assert summary["skipped_steps"] == [1] and "reference_policy_kl_penalty" in summary["error"]


@pytest.mark.slow
def test_collapsed_policy_is_reported(tmp_path):
    """A short warm-start makes the policy informative; lr=1e6 then flattens it to uniform sampling (entropy ln V)."""
    log_dir = tmp_path / "run"
    r = _cli("run", *SMALL, "policy.jet_rl.sft_warmstart.steps=4", "policy.jet_rl.sft_warmstart.batch_size=16",
             "policy.jet_rl.sft_warmstart.lr=1e-2", "grpo.max_num_steps=2", "policy.megatron_cfg.optimizer.lr=1e6",
             f"logger.log_dir={log_dir}", timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]  # step 1 was applied: a warning, not a failure
    assert "jetrl run: warning: the policy collapsed at step 2" in r.stderr and "optimizer.lr (now 1e+06)" in r.stderr
    summary = json.loads((log_dir / "summary.json").read_text())
    c = summary["collapse"]
    assert c["step"] == 2 and c["vocab_size"] == 128 and abs(c["entropy"] - c["ln_vocab"]) < 0.02 * c["ln_vocab"]


def _save_tp_pp_checkpoints(rank: int, world_size: int, root: str) -> None:
    """Each layout: build the tiny trainer, save a run checkpoint, and (rank 0) keep the canonical tensors the
    rollout engine would be served (the FP8 cache's bytes + scales, BF16 rest) as the export's reference."""
    from jetrl_megatron.megatron.cpu import init_parallel
    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.outputs.checkpoint_io import save_checkpoint
    from jetrl_megatron.rl.tasks import PromptStream, build_task
    from jetrl_megatron.rl.trainer import build_trainer, canonical_weights

    for tp, pp in ((2, 1), (1, 2)):
        init_parallel(tp, pp)
        cfg = load_config("tiny_cpu", [f"policy.megatron_cfg.tensor_model_parallel_size={tp}",
                                       f"policy.megatron_cfg.pipeline_model_parallel_size={pp}",
                                       f"checkpointing.checkpoint_dir={root}/tp{tp}_pp{pp}"])
        trainer = build_trainer(cfg)
        save_checkpoint(cfg, trainer, 1, PromptStream(build_task(cfg), seed=0))
        ref = canonical_weights(trainer)
        if rank == 0:
            torch.save(ref, f"{root}/tp{tp}_pp{pp}_reference.pt")


@pytest.mark.slow
def test_export_reads_run_checkpoints_of_any_tp_pp(tmp_path):
    from safetensors.torch import load_file

    from jetrl_megatron.megatron.cpu import spawn
    from jetrl_megatron.reshard_cli import export_main

    spawn(_save_tp_pp_checkpoints, 2, str(tmp_path))
    for layout in ("tp2_pp1", "tp1_pp2"):
        meta = json.loads((tmp_path / layout / "step_1" / "meta.json").read_text())
        assert (meta["tp"], meta["pp"]) == ((2, 1) if layout == "tp2_pp1" else (1, 2))
        out = tmp_path / f"hf_{layout}"
        assert export_main(["--from-megatron", str(tmp_path / layout / "step_1"), "--out", str(out)]) == 0
        got = load_file(str(out / "model.safetensors"))
        ref = torch.load(tmp_path / f"{layout}_reference.pt", weights_only=True)
        assert set(got) == set(ref)
        for name, t in ref.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


def test_resume_refuses_a_checkpoint_of_another_layout_model_or_arm(mp, tmp_path):
    """Before anything is loaded: one line naming what differs and the key that decides it."""
    import json
    from types import SimpleNamespace

    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rl.outputs.checkpoint_io import check_compatible

    shape = get_model_shape("tiny")
    trainer = SimpleNamespace(shape=shape, recipe=Fp8Recipe(mode="jetrl"))
    meta = json.loads(json.dumps({"tp": 1, "pp": 1, "model": {"hf_config": shape.to_hf_config()},
                                  "jet_rl": Fp8Recipe(mode="jetrl", gemm_backend="emulated").to_dict()}))
    check_compatible(tmp_path, meta, trainer)  # another GEMM backend: the same contract, accepted
    cases = [({"tp": 2}, "TP 2, this run has TP 1"),
             ({"model": {"hf_config": {**meta["model"]["hf_config"], "rope_theta": 1.0}}}, "its rope_theta is 1.0"),
             ({"jet_rl": {**meta["jet_rl"], "mode": "bf16"}}, "mode 'bf16' there, 'jetrl' here")]
    for change, want in cases:
        with pytest.raises(UserError, match=want) as e:
            check_compatible(tmp_path, {**meta, **change}, trainer)
        assert "\n" not in str(e.value) and "checkpointing.checkpoint_dir" in str(e.value)


def test_a_misspelled_override_names_the_closest_key():
    from jetrl_megatron.rl.config import load_config

    with pytest.raises(UserError, match=r"did you mean policy\.train_micro_batch_size\?") as e:
        load_config("tiny_cpu", ["policy.train_micro_batch_szie=2"])
    assert "\n" not in str(e.value) and "+policy.train_micro_batch_szie=" in str(e.value)
