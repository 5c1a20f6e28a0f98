"""Where a profiled phase's wall time went (rl/outputs/profile_windows.py): the device's busy time is the union of its
events inside the recorded windows, checked against a brute-force count on random intervals; each recorded stretch of
a profiled phase becomes one window, and an unrecorded stretch is not counted; on CUDA, host time spent between
kernels shows as idle."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from jetrl_megatron.rl.outputs.profile_windows import kernel_kind, union_length, window_report
from jetrl_megatron.rl.outputs.step_profile import StepProfile


def _covered(intervals, lo=0, hi=400) -> set[int]:
    """Brute force: the unit cells [t, t+1) some interval covers (integer endpoints)."""
    return {t for t in range(lo, hi) if any(s <= t < e for s, e in intervals)}


@pytest.mark.parametrize("seed", range(20))
def test_union_length_counts_overlaps_once(seed):
    rng = random.Random(seed)
    intervals = [(s, s + rng.randint(0, 40)) for s in (rng.randint(0, 350) for _ in range(rng.randint(0, 30)))]
    assert union_length(intervals) == len(_covered(intervals))


@pytest.mark.parametrize("seed", range(20))
def test_window_report_matches_a_brute_force_count(seed):
    rng = random.Random(100 + seed)
    cuts = sorted(rng.sample(range(0, 400), 6))  # three non-overlapping windows
    windows = {"update": [(cuts[0], cuts[1]), (cuts[4], cuts[5])], "logprob": [(cuts[2], cuts[3])]}
    names = ["void deep_gemm::sm90_fp8_gemm_1d2d_impl<>", "nvjet_sm90_tst_256x128", "_regroup_kernel",
             "Memcpy DtoH (Device -> Pinned)", "void pytorch_flash::flash_bwd_dq_dk_dv_loop"]
    events = []
    for _ in range(rng.randint(5, 40)):
        s = rng.randint(0, 390)
        events.append((rng.choice(names), s, s + rng.randint(1, 30)))
    report = window_report({k: [(float(a), float(b)) for a, b in v] for k, v in windows.items()},
                           [(n, float(s), float(e)) for n, s, e in events], top=100)
    for phase, spans in windows.items():
        inside = set().union(*(_covered([(s, e)]) for s, e in spans))
        busy = _covered([(s, e) for _, s, e in events]) & inside
        clipped = [(n, max(s, a), min(e, b)) for n, s, e in events for a, b in spans if min(e, b) > max(s, a)]
        r = report[phase]
        assert r["wall_ms"] * 1e3 == pytest.approx(len(inside))
        assert r["busy_ms"] * 1e3 == pytest.approx(len(busy))
        assert r["idle_ms"] * 1e3 == pytest.approx(len(inside) - len(busy))
        assert r["kernel_sum_ms"] * 1e3 == pytest.approx(sum(e - s for _, s, e in clipped))
        assert sum(r["kinds_ms"].values()) == pytest.approx(r["kernel_sum_ms"])
        assert sum(t["calls"] for t in r["top"]) == len(clipped)


def test_kernel_kinds_of_names_seen_in_the_8b_profiles():
    """Names from bench/qwen3_8b_1gpu/20261206c_h100's profiles (an H100, both arms), the project's own Triton kernels
    and the optimizer's (gradient clipping's L2 norm is no RMSNorm)."""
    seen = {
        "void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 24576u, 4096u, 1u, 256u,": "fp8_gemm",
        "void deep_gemm::sm90_fp8_gemm_1d1d_impl<0u, 4096u, 4224u, 1u, 128u, 152u, 128u, 128u, 128u": "fp8_gemm",
        "nvjet_sm90_tst_192x208_64x4_2x1_v_bz_coopB_TNT": "gemm",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<1": "attention",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::Col": "attention",
        "_regroup_kernel": "fp8_quant", "_quant_rows_kernel": "fp8_quant", "_quant_dual_kernel": "fp8_quant",
        "Memcpy DtoH (Device -> Pinned)": "memcpy", "Memcpy HtoD (Pinned -> Device)": "memcpy",
        "void vllm::act_and_mul_kernel<c10::BFloat16, __nv_bfloat162, &(c10::BFloat16 vllm::silu_ke": "swiglu",
        "_topk_log_softmax_kernel": "softmax_logprob", "_rms_fwd_kernel": "norm", "_rope_kernel": "rope",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at": "copy_cast",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std:": "elementwise",
        "_sum_splits_kernel": "fp8_gemm", "_residual_add_bwd_kernel": "elementwise",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<LpNormFunctor<float>>": "optimizer",
        "void at::native::normal_kernel<float>": "other",
    }
    assert {name: kernel_kind(name) for name in seen} == seen
    assert kernel_kind("some_kernel_nobody_named") == "other"


def _step_with_sleeps(prof: StepProfile, work, sleep_s: float) -> None:
    """Five update micro-batches each sleeping ``sleep_s`` around ``work``; a rollout phase that is not profiled."""
    with prof.phase("rollout"):
        time.sleep(sleep_s)
    with prof.phase("update"):
        for i in range(5):
            prof.micro_batch(i)
            work()
            time.sleep(sleep_s)
        prof.micro_batches_done()
        work()


def test_the_recorded_stretches_of_a_phase_are_its_windows(tmp_path):
    prof = StepProfile(1, tmp_path, phases=("update",), micro_batches=2)
    a = torch.randn(64, 64)
    t0 = time.perf_counter()
    with prof.around(1):
        _step_with_sleeps(prof, lambda: torch.mm(a, a), 0.05)
    total = time.perf_counter() - t0
    report = json.loads((tmp_path / "profile_step1.json").read_text())
    w = report["windows"]
    # the rollout is not profiled: no window; the update's recorded micro-batches (0-1) and what follows its pass
    # are two stretches, kept apart; the three unrecorded micro-batches (0.15 s of sleep) are in neither
    assert set(w) == {"update", "update/after_pass"}
    assert w["update"]["windows"] == w["update/after_pass"]["windows"] == 1
    assert 0.1 <= w["update"]["wall_ms"] / 1e3 < 0.1 + (total - 0.15 - 0.05 - 0.1)
    assert w["update/after_pass"]["wall_ms"] / 1e3 < total - 0.15 - 0.05 - 0.1  # no sleep after the pass
    assert w["update"]["busy_ms"] == 0.0 and w["update"]["kinds_ms"] == {}  # no device on this run
    assert not any(r["name"].startswith("window/") for r in report["top"] + report["host_top"])
    assert {"window/update", "window/update/after_pass"} <= {r["name"] for r in report["ranges"]}
    assert report["host_top"][0]["self_cpu_ms"] >= report["host_top"][-1]["self_cpu_ms"]
    assert "| update | 1 |" in (tmp_path / "profile_step1.md").read_text()


def test_a_second_pass_in_a_phase_gets_its_micro_batches_back_in_the_pass_window(tmp_path):
    """The logprob phase runs a policy and a reference pass: each pass's micro-batches go to ``<phase>``, what follows
    each pass to ``<phase>/after_pass``."""
    prof = StepProfile(1, tmp_path, phases=("logprob",), micro_batches=1)
    with prof.around(1), prof.phase("logprob"):
        for _ in range(2):
            for i in range(3):
                prof.micro_batch(i)
                time.sleep(0.02)
            prof.micro_batches_done()
            time.sleep(0.01)
    w = json.loads((tmp_path / "profile_step1.json").read_text())["windows"]
    assert w["logprob"]["windows"] == 2 and w["logprob/after_pass"]["windows"] == 2
    assert 0.04 <= w["logprob"]["wall_ms"] / 1e3 < 0.04 + 0.04  # micro-batch 0 of each pass, not 1-2 (0.08 s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_time_between_kernels_shows_as_idle_device_time(tmp_path):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(4096, 4096, dtype=torch.bfloat16, pin_memory=True)

    def work():
        b = a @ a
        host.copy_(b, non_blocking=True)
        torch.cuda.synchronize()

    for _ in range(2):
        work()  # cuBLAS's first call out of the window
    prof = StepProfile(1, tmp_path, phases=("update",), micro_batches=0)
    with prof.around(1):
        _step_with_sleeps(prof, work, 0.05)
    w = json.loads((tmp_path / "profile_step1.json").read_text())["windows"]["update"]
    assert w["windows"] == 1
    # five GEMMs and copies, each followed by 50 ms of host sleep: idle >= 0.25 s; the device was busy for the
    # GEMMs and copies (~1-2 ms each on a Hopper card), not for the sleeps
    assert 0 < w["busy_ms"] < 100 and w["idle_ms"] >= 250, w
    assert w["kinds_ms"].get("gemm", 0) > 0 and w["kinds_ms"].get("memcpy", 0) > 0, w["kinds_ms"]
    assert sum(t["calls"] for t in w["top"] if kernel_kind(t["name"]) == "gemm") >= 5, w["top"]
