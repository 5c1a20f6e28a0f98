"""NeMo-RL's optimizer CPU offload (``optimizer_cpu_offload``, ``optimizer_offload_fraction``) through Megatron's
``HybridDeviceOptimizer`` inside the distributed optimizer, on CPU (gloo) at DP=1 and DP=2.

On a CPU-only box "device" and host are one memory, but the optimizer runs its real offload path
(``cpu.host_offload_scope``): host copies of the FP32 masters, a D2H copy of the gradients, torch's CPU AdamW, an H2D
copy of the new weights into the BF16 shard, Megatron's all-gather, then the FP8 refresh. Each world trains the same
tiny jetrl model from the same weights on the same batch with the plain distributed optimizer (``base``) and with
offload at fraction 1.0 and 0.5 (a device part and a host part), with and without gradient clipping (DP=2: the
plain and 0.5 runs without clipping, the plain and 1.0 runs with it).

Tolerance (stated and measured). The gradient norm is the same FP32 number bit for bit (the wrapper makes Megatron's
local norm fallback accumulate in FP32; without it the norm was BF16-rounded, 6.0625 for 6.0728). The step is not bit
for bit: Megatron builds the offloaded AdamW with ``fused=True`` (torch's fused kernel; the plain optimizer runs
torch's default AdamW), which rounds some FP32 updates differently, and under clipping the precision-aware path
scales the BF16 gradients in the grad buffer instead of FP32 copies. After one step the BF16 weights differ by at
most 1 BF16 ulp of the step's operands, in at most 1e-4 of the elements without clipping (measured 3.5e-6) and 1e-3
with it (measured 1.8e-4); against an AdamW written from the algorithm the same bound holds. Only the first step is
compared: after it the FP8 requantization turns last-bit weight differences into code flips and trajectories
part (as in test_megatron_distributed_optimizer.py).
A resume from a checkpoint is exact: the step after it equals the continuous
run's bit for bit (loss, grad norm, every weight, FP8 cache).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from megatron_helpers import cache_matches_weights, hf_state, model_params, tiny_shape

from jetrl_megatron.megatron.cpu import spawn

pytestmark = pytest.mark.slow

LR, WD, BETAS, EPS = 3e-3, 0.1, (0.9, 0.999), 1e-8
VARIANTS = {  # name: (offload fraction or None, clip_grad); DP=2 runs DP2_VARIANTS; *_ovl: the overlapped host step
    "base": (None, 0.0), "off05": (0.5, 0.0), "base_clip": (None, 1.0), "off1_clip": (1.0, 1.0), "off1": (1.0, 0.0),
    "off05_ovl": (0.5, 0.0), "off05_lazy": (0.5, 0.0),
}
# Built as `jetrl run` builds them (Fp8RefreshingOptimizer.build_host_state after the optimizer): every offloaded
# variant but off05_lazy, whose host state is created by its first step (Megatron's and torch's own lazy path)
LAZY = ("off05_lazy",)
DP2_VARIANTS = ("base", "off05", "base_clip", "off1_clip")


def _loss(lp, mb):
    return -lp.mean(), {}


def _build(shape, sd, frac: float | None, clip: float, overlap: bool = False):
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.recipe import Fp8Recipe

    opt = {"lr": LR, "weight_decay": WD, "clip_grad": clip, "adam_beta1": BETAS[0], "adam_beta2": BETAS[1],
           "adam_eps": EPS}
    if frac is not None:
        opt |= {"optimizer_cpu_offload": True, "optimizer_offload_fraction": frac,
                "overlap_cpu_optimizer_d2h_h2d": overlap}
    policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=sd, grad_reduce_in_fp32=False,
                          use_distributed_optimizer=True, optimizer=opt)
    return policy.model, policy.optimizer






def _step(ddp, opt, batch, grads: bool = False) -> dict:
    from jetrl_megatron.megatron.model import forward_backward, fp8_context, unwrap

    opt.zero_grad()
    loss, _ = forward_backward([ddp], batch, _loss, micro_batch_size=1, grad_scale_func=opt.scale_loss)
    g = {n: p.main_grad.float().clone() for n, p in unwrap(ddp).named_parameters()} if grads else None
    ok, grad_norm, _ = opt.step()
    return {"loss": float(loss), "ok": ok, "grad_norm": float(grad_norm), "grads": g, "params": model_params(ddp),
            "cache_ok": cache_matches_weights(ddp), "generation": fp8_context(ddp).cache.generation}


def _placement(opt) -> dict:
    """Where the hybrid optimizer put this rank's FP32 masters (elements), read from its own maps."""
    from jetrl_megatron.megatron.host_pinning import host_masters

    hdo = opt.optimizer.optimizer
    host = sum(p.numel() for p in hdo.gpu_params_map_cpu_copy)
    total = sum(p.numel() for g in hdo.param_groups for p in g["params"])
    masters = host_masters(hdo)  # what megatron/host_pinning.py page-locks on CUDA: the host FP32 copies themselves
    return {"type": type(hdo).__name__, "host": host, "total": total, "device_opt": hdo.gpu_optimizer is not None,
            "host_opts": len(hdo.cpu_optimizers),
            "masters_are_host_copies": {id(t) for t in masters} == {id(t) for t in hdo.cpu_copys_map_gpu_param}
            and len(masters) == len(hdo.cpu_copys_map_gpu_param),
            "masters_fp32": all(t.dtype == torch.float32 for t in masters), "masters_numel": sum(
                t.numel() for t in masters)}


def _refusal(opt, available: int, ranks: int) -> str | None:
    """build_host_state's HostMemoryError message with ``available`` bytes for ``ranks`` ranks (None: it built)."""
    from jetrl_megatron.megatron.host_state import HostMemoryError

    try:
        opt.build_host_state(available_bytes=available, ranks_on_host=ranks)
    except HostMemoryError as e:
        return str(e)
    return None


def _host_state(opt) -> dict:
    """The hybrid optimizer's host-side state: {id of each host master: (staging buffer's address, {moment: address,
    'step': value})}; what the first step would create, so equal before and after it when built ahead of it."""
    hdo = opt.optimizer.optimizer
    out = {}
    for sub in hdo.cpu_optimizers:
        for group in sub.param_groups:
            for p in group["params"]:
                buf = hdo.cpu_copy_map_grad.get(p)
                st = sub.state.get(p, {})
                out[id(p)] = (None if buf is None else buf.data_ptr(),
                              {k: float(v) if k == "step" else v.data_ptr() for k, v in st.items()})
    return out


def _grads_after_step(opt) -> dict:
    """How many of the hybrid optimizer's FP32 copies still hold a gradient after the step, device- and host-side."""
    hdo = opt.optimizer.optimizer
    device = [f for p, f in hdo.param_to_fp32_param.items() if p not in hdo.gpu_params_map_cpu_copy]
    host = list(hdo.cpu_copys_map_gpu_param)
    return {"device": len(device), "device_kept": sum(f.grad is not None for f in device),
            "host": len(host), "host_kept": sum(h.grad is not None for h in host)}


def _run(rank: int, world_size: int, out_dir: str) -> None:
    from jetrl_megatron.megatron.host_state import host_state_bytes
    from jetrl_megatron.megatron.model import refresh_fp8_cache, unwrap

    shape = tiny_shape("qwen3")
    sd = hf_state(shape, seed=31, std=0.02)
    toks = torch.randint(0, shape.vocab_size, (2 * world_size, 32), generator=torch.Generator().manual_seed(32))
    batch = {"tokens": toks[2 * rank:2 * rank + 2]}
    rec: dict = {}
    for name, (frac, clip) in VARIANTS.items():
        if world_size > 1 and name not in DP2_VARIANTS:
            continue
        ddp, opt = _build(shape, sd, frac, clip, overlap=name.endswith("_ovl"))
        rec.setdefault("init", model_params(ddp))
        r: dict = {"offloaded": opt.offloaded, "steps": []}
        if frac is not None:
            r["placement"] = _placement(opt)
            if name == "off05":  # refused first, with nothing allocated: 1 byte short, then two ranks sharing the host
                r["need"] = host_state_bytes(opt.optimizer.optimizer)
                r["refused"] = [_refusal(opt, r["need"] - 1, 1), _refusal(opt, 2 * r["need"] - 1, 2)]
                r["after_refusal"] = _host_state(opt)
            r["built"] = None if name in LAZY else opt.build_host_state(available_bytes=r.get("need"))
            r["host_state"] = [_host_state(opt)]
        steps = 2 if name.startswith("off05") else 1
        for i in range(steps):
            r["steps"].append(_step(ddp, opt, batch, grads=name.startswith("base")))
            if frac is not None:
                r["host_state"].append(_host_state(opt))
            if name == "off05" and i == 0:
                torch.save({"model": unwrap(ddp).state_dict(), "optimizer": opt.checkpoint_state()},
                           Path(out_dir) / f"ckpt{rank}.pt")
        if frac is not None:
            r["grads_after_step"] = _grads_after_step(opt)
        rec[name] = r
    # resume: other initial weights, then the step-1 checkpoint; the next step must equal the continuous one
    ddp, opt = _build(shape, hf_state(shape, seed=99, std=0.02), 0.5, 0.0)
    state = torch.load(Path(out_dir) / f"ckpt{rank}.pt", weights_only=True)
    unwrap(ddp).load_state_dict(state["model"], strict=True)
    for p in unwrap(ddp).parameters():
        torch.autograd.graph.increment_version(p)
    opt.load_checkpoint_state(state["optimizer"])
    rec["resumed_built"] = opt.build_host_state()  # where `jetrl run` builds it: after the load
    refresh_fp8_cache(ddp)
    rec["resumed_params"] = model_params(ddp)
    rec["resumed_step2"] = _step(ddp, opt, batch)
    torch.save(rec, Path(out_dir) / f"rank{rank}.pt")


def _world(tmp_path_factory, n: int) -> list[dict]:
    out = tmp_path_factory.mktemp(f"offload_dp{n}")
    spawn(_run, n, str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def ranks(request, tmp_path_factory):
    return _world(tmp_path_factory, request.param)


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, torch.floor(torch.log2(x.float().abs().clamp_min(2.0 ** -126))) - 7)


def _ulp_diff(a: dict, b: dict, prev: dict) -> tuple[float, float]:
    """(max |a - b| in BF16 ulps of max(|a|, |b|, |prev|), fraction of elements that differ)."""
    worst, n_diff, n = 0.0, 0, 0
    for k, x in a.items():
        d = (x.float() - b[k].float()).abs()
        scale = torch.maximum(torch.maximum(x.float().abs(), b[k].float().abs()), prev[k].float().abs())
        worst = max(worst, float((d / _ulp_bf16(scale)).max()))
        n_diff += int((d > 0).sum())
        n += d.numel()
    return worst, n_diff / n


def _reference_adamw(init: dict, grads: dict, clip: float) -> dict:
    """One AdamW step written from the algorithm (FP32 master, global-norm clip, decoupled weight decay on matrices
    only, bias-corrected moments); the BF16 weights after it."""
    b1, b2 = BETAS
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    out = {}
    for k, w0 in init.items():
        w, g = w0.float(), grads[k] * coef
        if w.dim() > 1:
            w = w * (1 - LR * WD)
        m, v = (1 - b1) * g / (1 - b1), (1 - b2) * g * g / (1 - b2)
        out[k] = (w - LR * m / (v.sqrt() + EPS)).to(torch.bfloat16)
    return out


def test_hybrid_optimizer_is_built_and_places_the_fraction_on_the_host(ranks):
    for rec in ranks:
        assert not rec["base"]["offloaded"] and rec["off1_clip"]["offloaded"] and rec["off05"]["offloaded"]
        full, half = rec["off1_clip"]["placement"], rec["off05"]["placement"]
        assert full["type"] == half["type"] == "HybridDeviceOptimizer"
        assert full["host"] == full["total"] and not full["device_opt"] and full["host_opts"] == 1
        # Megatron's rule: parameters in order until the host part reaches the fraction (one parameter past it)
        assert half["device_opt"] and half["host_opts"] == 1
        assert 0.5 * half["total"] <= half["host"] < half["total"], half
        for p in (full, half):  # the tensors host_pinning registers: exactly the host part's FP32 masters
            assert p["masters_are_host_copies"] and p["masters_fp32"] and p["masters_numel"] == p["host"], p


def test_the_device_side_fp32_gradients_are_freed_after_the_step_and_the_host_staging_kept(ranks):
    # off05 took two steps (the second from the refilled host staging: test_offloaded_step_equals_the_plain_step)
    for rec in ranks:
        g = rec["off05"]["grads_after_step"]
        assert g["device"] > 0 and g["device_kept"] == 0, g
        assert g["host"] > 0 and g["host_kept"] == g["host"], g


@pytest.mark.parametrize(("off", "base", "bound"), [("off1", "base", 1e-4), ("off05", "base", 1e-4),
                                                    ("off1_clip", "base_clip", 1e-3)])
def test_offloaded_step_equals_the_plain_step(ranks, off, base, bound):
    for rec in ranks:
        if off not in rec:
            continue  # DP=2 runs fewer variants
        a, b = rec[base]["steps"][0], rec[off]["steps"][0]
        assert a["ok"] and b["ok"] and a["loss"] == b["loss"]
        assert a["grad_norm"] == b["grad_norm"], (a["grad_norm"], b["grad_norm"])  # FP32, bit for bit
        worst, frac = _ulp_diff(a["params"], b["params"], rec["init"])
        print(f"{off} vs {base}: max {worst:.2f} BF16 ulp, {frac:.2e} of elements differ")
        assert worst <= 1.0 and frac <= bound, (worst, frac)
        if len(ranks) > 1:
            continue  # main_grad holds the DP-reduced gradient only on this rank's shard (reduce-scatter)
        clip = VARIANTS[off][1]
        worst, frac = _ulp_diff(_reference_adamw(rec["init"], a["grads"], clip), b["params"], rec["init"])
        print(f"{off} vs independent AdamW: max {worst:.2f} BF16 ulp, {frac:.2e} of elements differ")
        assert worst <= 1.0 and frac <= 1e-3, (worst, frac)


@pytest.mark.parametrize("ranks", [1], ids=["dp1"], indirect=True)
def test_overlapped_host_step_equals_the_serial_one(ranks):
    """Megatron's overlap_cpu_optimizer_d2h_h2d: one host AdamW per parameter (the copies of the next parameters
    overlap the step of this one); two steps give the serial host step's weights, norms and FP8 cache bit for bit
    (run at DP=1)."""
    rec = ranks[0]
    ovl, serial = rec["off05_ovl"], rec["off05"]
    assert ovl["placement"]["host"] == serial["placement"]["host"]
    assert serial["placement"]["host_opts"] == 1 and ovl["placement"]["host_opts"] > 1, ovl["placement"]
    for a, b in zip(serial["steps"], ovl["steps"], strict=True):
        assert a["ok"] and b["ok"] and b["cache_ok"]
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


@pytest.mark.parametrize("ranks", [1], ids=["dp1"], indirect=True)
def test_host_state_built_ahead_is_what_the_first_step_uses_and_steps_like_the_lazy_one(ranks):
    """build_host_state creates every host master's gradient staging buffer and Adam moments before step 1; steps 1
    and 2 use exactly those tensors (same addresses; the step count advances) and give the lazily built run's loss,
    gradient norm, weights and FP8 cache bit for bit; the lazy run creates them in its first step."""
    rec = ranks[0]
    eager, lazy = rec["off05"], rec["off05_lazy"]
    built, host = eager["built"], eager["placement"]["host"]
    n_masters = len(eager["host_state"][0])
    assert lazy["built"] is None and n_masters > 0
    assert built.staging_buffers == n_masters and built.moment_tensors == 2 * n_masters, built
    assert built.bytes == 3 * 4 * host and built.seconds >= 0, (built, host)  # FP32 buffer + two FP32 moments
    assert "host optimizer state built at start-up" in built.summary()
    before, *after = eager["host_state"]
    for i, state in enumerate(after, start=1):
        for key, (buf, moments) in before.items():
            buf_after, moments_after = state[key]
            assert buf is not None and buf_after == buf, key
            assert moments_after["step"] == moments["step"] + i == float(i)
            assert set(moments) == {"step", "exp_avg", "exp_avg_sq"}, moments  # after a step Megatron adds its own
            assert all(moments_after[k] == moments[k] for k in ("exp_avg", "exp_avg_sq")), key
    lazy_before = lazy["host_state"][0]
    assert all(buf is None and not m for buf, m in lazy_before.values())  # the lazy run: nothing until step 1
    assert all(buf is not None and m for buf, m in lazy["host_state"][1].values())
    for a, b in zip(lazy["steps"], eager["steps"], strict=True):
        assert a["ok"] and b["ok"] and b["cache_ok"]
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    resumed = rec["resumed_built"]  # after a load: the moments came with it; only the staging buffers are new
    assert resumed.moment_tensors == 0 and resumed.staging_buffers == n_masters, resumed


@pytest.mark.parametrize("ranks", [1], ids=["dp1"], indirect=True)
def test_host_state_that_cannot_fit_is_refused_naming_the_key_with_nothing_allocated(ranks):
    """With the host's available bytes one short of the state (or of two ranks' states on one host), the build raises
    HostMemoryError naming the offload fraction key and the shortfall, and allocates nothing; with exactly enough
    it builds that many bytes."""
    rec = ranks[0]["off05"]
    one, two = rec["refused"]
    for msg in (one, two):
        assert msg is not None and "policy.megatron_cfg.optimizer.optimizer_offload_fraction" in msg, msg
        assert "nothing was allocated" in msg and "0.0 GiB short" in msg and "\n" not in msg, msg
    assert "x 2 ranks on this host" in two and "ranks on this host" not in one
    assert all(buf is None and not m for buf, m in rec["after_refusal"].values())
    assert rec["built"].bytes == rec["need"] > 0


def test_fp8_cache_refreshed_from_the_offloaded_step_and_replicas_agree(ranks):
    for rec in ranks:
        for name in ("off05", "off1_clip"):
            for s in rec[name]["steps"]:
                assert s["cache_ok"] and s["generation"] > 0
        assert rec["off05"]["steps"][1]["generation"] == rec["off05"]["steps"][0]["generation"] + 1
    for name in ("off05", "off1_clip"):  # the all-gather after the host step: every DP rank holds the same weights
        p0 = ranks[0][name]["steps"][-1]["params"]
        assert all(torch.equal(p0[k], r[name]["steps"][-1]["params"][k]) for r in ranks[1:] for k in p0)


def test_resume_of_offloaded_optimizer_is_exact(ranks):
    for rec in ranks:
        cont = rec["off05"]["steps"]
        assert all(torch.equal(cont[0]["params"][k], rec["resumed_params"][k]) for k in cont[0]["params"])
        a, b = cont[1], rec["resumed_step2"]
        assert b["ok"] and b["cache_ok"]
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_offload_needs_the_distributed_optimizer_and_a_fraction(mp):
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.recipe import Fp8Recipe

    with pytest.raises(ValueError, match="use_distributed_optimizer=true"):
        build_policy(tiny_shape("qwen3"), Fp8Recipe(mode="jetrl"), use_distributed_optimizer=False,
                     optimizer={"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0})
    with pytest.raises(ValueError, match=r"optimizer_offload_fraction must be in \(0, 1\]"):
        build_policy(tiny_shape("qwen3"), Fp8Recipe(mode="jetrl"), use_distributed_optimizer=True,
                     optimizer={"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.0})


# ---------------------------------------------------------------------------------------------- config -> trainer, plan
def test_config_passes_the_offload_keys_and_refuses_bad_ones():
    from jetrl_megatron.rl.config import ConfigError, load_config
    from jetrl_megatron.rl.tools.run_plan import trainer_settings

    s = trainer_settings(load_config("qwen3_8b_1gpu"))
    opt = s.policy_kwargs()["optimizer"]
    assert opt["optimizer_cpu_offload"] is True and opt["optimizer_offload_fraction"] == 0.75
    assert s.policy_kwargs()["use_distributed_optimizer"] and s.host_fraction == 0.75
    assert trainer_settings(load_config("qwen3_8b_tp1")).host_fraction == 0.0
    with pytest.raises(ConfigError, match=r"optimizer_cpu_offload: true needs .*use_distributed_optimizer: true"):
        load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.optimizer.use_distributed_optimizer=false"])
    with pytest.raises(ConfigError, match=r"optimizer_offload_fraction: must be in \(0, 1\]"):
        load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.optimizer.optimizer_offload_fraction=0"])
    with pytest.raises(ConfigError, match=r"optimizer_offload_fraction: must be in \[0, 1\]"):
        load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.optimizer.optimizer_offload_fraction=1.5"])


def test_plan_counts_gpu_and_host_memory_of_the_offload():
    """Offload moves f x (12 + 4) B/param from the GPU to the host, plus the hybrid optimizer's pinned BF16 staging
    (f x 2 B/param, kept by torch's pinned allocator); the host check fails and says by how much."""
    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.tools.run_plan import memory_estimate, model_shape, parallel_layout, plan_report

    off = load_config("qwen3_8b_1gpu")
    on_gpu = load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.optimizer.optimizer_cpu_offload=false"])
    m1, m0 = (memory_estimate(c, model_shape(c), parallel_layout(c), 139.0) for c in (off, on_gpu))
    params = m0["weights_bf16"] / 2  # GiB of parameters (x 2 B)
    assert m0["optimizer_adam"] == pytest.approx(12 * params) and m0["host_optimizer"] == 0.0
    assert m1["optimizer_adam"] == pytest.approx(12 * params * 0.25)
    assert m1["host_optimizer"] == pytest.approx(12 * params * 0.75)
    assert m1["host_grads_fp32"] == pytest.approx(4 * params * 0.75)
    assert m1["host_pinned_staging"] == pytest.approx(2 * params * 0.75) and m0["host_pinned_staging"] == 0.0
    # vLLM's level-1 sleep keeps a host copy of the engine's weights; level 2 discards them (the refit rewrites them)
    level2 = load_config("qwen3_8b_1gpu", ["policy.jet_rl.engine_sleep_level=2"])
    m2 = memory_estimate(level2, model_shape(level2), parallel_layout(level2), 139.0)
    assert m1["vllm_weights"] > 0 and m1["host_vllm_sleep"] == pytest.approx(m1["vllm_weights"])
    assert m2["host_vllm_sleep"] == 0.0
    assert m2["host_per_node"] == pytest.approx(m1["host_per_node"] - m1["vllm_weights"])
    assert m1["host_per_node"] == pytest.approx(18 * params * 0.75 + m1["vllm_weights"])
    text, ok = plan_report(off, 139.0, show_config=False, host_mem_gib=125.0)
    assert ok and "host 111.8 GiB per node of 125 GiB: fits" in text, text
    full = load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.optimizer.optimizer_offload_fraction=1.0"])
    text, ok = plan_report(full, 139.0, show_config=False, host_mem_gib=125.0)
    assert not ok and "host 146.1 GiB per node of 125 GiB: DOES NOT FIT, 21.1 GiB over" in text, text
    full_unchecked = load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.optimizer.optimizer_offload_fraction=1.0",
                                                   "policy.jet_rl.plan_host_mem_gib=null"])
    text, ok = plan_report(full_unchecked, 139.0, show_config=False)  # no host size named anywhere: not checked
    assert ok and "not checked (--host-mem-gib or policy.jet_rl.plan_host_mem_gib)" in text, text
    text, ok = plan_report(full, 139.0, show_config=False)  # the recipe names its host (125 GiB)
    assert not ok and "of 125 GiB: DOES NOT FIT" in text, text
    # fits, but leaves less than the process's own uncounted memory: the bf16 arm (118.2 of 125 GiB; measured 123.5)
    bf16 = load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.fp8_cfg.enabled=false",
                                         "policy.generation.vllm_cfg.precision=bfloat16"])
    text, ok = plan_report(bf16, 139.0, show_config=False, host_mem_gib=125.0)
    assert ok and "host 118.2 GiB per node of 125 GiB: fits, but TIGHT: 6.8 GiB left" in text, text
    text, ok = plan_report(bf16, 139.0, show_config=False, host_mem_gib=128.0)  # 9.8 GiB left: enough
    assert ok and "host 118.2 GiB per node of 128 GiB: fits\n" in text + "\n" and "TIGHT" not in text, text
    text, ok = plan_report(off, 139.0, show_config=False, host_mem_gib=125.0)  # the jetrl arm: 13.2 GiB left
    assert "TIGHT" not in text, text
    # the GPU side too: the 8B run on an 80 GB card (bench/qwen3_8b_gpu.sh CARD=h100) peaks at 70.2 of 79 GiB (74.3
    # before the hybrid optimizer's device-side FP32 gradients were freed after the step); a 74 GiB card would leave
    # less than the up to 5 GiB a GPU process holds that the plan does not count
    h100 = load_config("qwen3_8b_1gpu", ["policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.8",
                                         "policy.jet_rl.engine_sleep_level=2", "policy.train_micro_batch_size=2",
                                         "policy.logprob_batch_size=4",
                                         f"policy.generation.vllm_kwargs.kv_cache_memory_bytes={12 << 30}"])
    text, ok = plan_report(h100, 74.0, show_config=False, host_mem_gib=125.0)
    assert ok and "peak 70.2 GiB of 74 GiB: fits, but TIGHT: 3.8 GiB left" in text, text
    text, ok = plan_report(h100, 79.0, show_config=False, host_mem_gib=125.0)
    assert ok and "peak 70.2 GiB of 79 GiB: fits\n" in text + "\n", text


def test_plan_names_the_offload_fractions_that_fit():
    """`jetrl plan`'s offload line: the smallest fraction on the 0.05 grid whose own estimate fits the GPU with the
    stated spare (the next smaller does not), and the largest that fits the host; on an 80 GiB GPU none keeps both
    margins."""
    import copy

    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.tools import run_plan as rp

    cfg = load_config("qwen3_8b_1gpu")
    shape, layout = rp.model_shape(cfg), rp.parallel_layout(cfg)

    def plan(f):
        trial = copy.deepcopy(cfg)
        trial.policy.megatron_cfg.optimizer.optimizer_offload_fraction = f
        return rp.memory_estimate(trial, shape, layout, 139.0)

    lo, hi = rp.offload_fraction_choice(cfg, shape, layout, 139.0, 125.0)
    assert lo is not None and hi is not None and lo < hi, (lo, hi)
    assert rp.gpu_peak(plan(lo)) + rp.GPU_UNCOUNTED_GIB <= 139.0 < rp.gpu_peak(plan(lo - 0.05)) + rp.GPU_UNCOUNTED_GIB
    spare = rp.HOST_UNCOUNTED_GIB_PER_PROCESS + rp.HOST_SYSTEM_RESERVE_GIB
    assert plan(hi)["host_per_node"] + spare <= 125.0
    assert hi == 1.0 or plan(hi + 0.05)["host_per_node"] + spare > 125.0
    text, ok = rp.plan_report(cfg, 139.0, show_config=False, host_mem_gib=125.0)
    assert ok and f"optimizer_offload_fraction: {lo:g} up to {hi:g} fits this GPU" in text
    text, ok = rp.plan_report(cfg, 80.0, show_config=False, host_mem_gib=125.0)
    assert ok and "fits, but TIGHT" in text and "no value keeps both" in text, text
