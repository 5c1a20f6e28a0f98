"""Releasing Megatron DDP's grad buffers between updates (megatron/grad_buffers.py), on CPU with gloo.

Spawned worlds of 1 rank (DP=1; BF16 and FP32 grad buffers) and of 2 ranks (TP=PP=1, so DP=2, distributed optimizer)
each train the same tiny jetrl model from the same weights twice: ``kept`` (buffers never released) and ``released``
(released after every step, then a forward-only logprob pass as in the GRPO loop, then restored: explicitly before
step 2, by ``zero_grad_buffer()`` inside ``forward_backward`` before step 3). Every step must be bit-identical. The
DP=1 world also records what each use of released buffers raises (backward, optimizer step, ``param.main_grad``,
grad sync), before step 3 of ``released``, so that step also shows a refused use leaves nothing behind. Workers run
in child processes because such a use without the guards is a write through a null pointer (a segfault on CPU).

A tiny `jetrl run` (world 1) measures the grad buffers' bytes in every phase of the GRPO loop through wrappers
around the loop's own functions and the engine's ``generate``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from megatron_helpers import hf_state, tiny_shape

from jetrl_megatron.megatron.cpu import spawn
from jetrl_megatron.rl.config import arm_overrides

pytestmark = pytest.mark.slow

STEPS = 3


def _loss(lp, mb):
    return -lp.mean(), {}


def _build(shape, sd, dist: bool, fp32: bool):
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.recipe import Fp8Recipe

    policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=sd, grad_reduce_in_fp32=fp32,
                          use_distributed_optimizer=dist,
                          optimizer={"lr": 3e-3, "weight_decay": 0.1, "clip_grad": 1.0})
    return policy.model, policy.optimizer


def _step(ddp, opt, batch) -> dict:
    from jetrl_megatron.megatron.model import forward_backward, unwrap

    opt.zero_grad()
    loss, _ = forward_backward([ddp], batch, _loss, micro_batch_size=1, grad_scale_func=opt.scale_loss)
    grads = {n: p.main_grad.float().clone() for n, p in unwrap(ddp).named_parameters()}
    ok, grad_norm, _ = opt.step()
    return {"loss": loss, "ok": ok, "grad_norm": float(grad_norm), "grads": grads,
            "params": {n: p.detach().clone() for n, p in unwrap(ddp).named_parameters()}}


def _storage_bytes(ddp) -> list[int]:
    """nbytes of the storage behind every buffer's and every bucket's grad_data and every param.main_grad view."""
    from jetrl_megatron.megatron.model import unwrap

    out = []
    for b in ddp.buffers:
        out.append(b.grad_data.untyped_storage().nbytes())
        out += [bucket.grad_data.untyped_storage().nbytes() for bucket in b.buckets]
    restored = getattr(ddp, "_jetrl_released", None)
    views = restored.main_grads if restored is not None else {p: p.main_grad for p in unwrap(ddp).parameters()}
    return out + [v.untyped_storage().nbytes() for v in views.values()]


def _misuse(ddp, opt, batch) -> dict[str, str]:
    """What each use of released buffers raises (the type name and message), and what it left behind."""
    from jetrl_megatron.megatron.grad_buffers import GradBuffersReleasedError
    from jetrl_megatron.megatron.model import unwrap

    def attempt(fn) -> str:
        try:
            fn()
        except GradBuffersReleasedError as e:
            return f"GradBuffersReleasedError: {e}"
        except Exception as e:  # noqa: BLE001 - recorded, the test names the expected type
            return f"{type(e).__name__}: {e}"
        return "no error"

    def backward():
        ddp.train()
        out = ddp(input_ids=batch["tokens"], position_ids=None, attention_mask=None)
        out.float().sum().backward()

    p = next(unwrap(ddp).parameters())
    got = {"backward": attempt(backward), "optimizer_step": attempt(opt.step),
           "main_grad": attempt(lambda: p.main_grad.float()), "finish_grad_sync": attempt(ddp.finish_grad_sync),
           "scale_gradients": attempt(lambda: ddp.scale_gradients(0.5))}
    got["param_grads_left"] = str(sum(q.grad is not None for q in unwrap(ddp).parameters()))
    return got


def _train(rank: int, world_size: int, out_dir: str, dist: bool, variants: tuple[bool, ...]) -> None:
    from jetrl_megatron.megatron.grad_buffers import grad_buffer_bytes, release_grad_buffers, restore_grad_buffers
    from jetrl_megatron.megatron.model import token_logprobs, unwrap

    shape = tiny_shape("qwen3")
    sd = hf_state(shape, seed=41, std=0.02)
    toks = torch.randint(0, shape.vocab_size, (2 * world_size, 32), generator=torch.Generator().manual_seed(42))
    batch = {"tokens": toks[2 * rank:2 * rank + 2]}  # this DP rank's half
    rec: dict = {}
    for fp32 in variants:
        for name in ("kept", "released"):
            ddp, opt = _build(shape, sd, dist, fp32)
            r: dict = {"full": grad_buffer_bytes(ddp), "n_params": sum(p.numel() for p in unwrap(ddp).parameters()),
                       "steps": [], "released": []}
            for i in range(STEPS):
                if i > 0:
                    if name == "released":
                        freed = release_grad_buffers(ddp)
                        r["released"].append({"freed": freed, "held": grad_buffer_bytes(ddp),
                                              "storages": _storage_bytes(ddp)})
                    token_logprobs(ddp, batch["tokens"])  # the loop's logprob pass (released: without grads)
                    if name == "released" and i == 1:
                        restore_grad_buffers(ddp)  # explicit; before step 3 forward_backward's zero_grad_buffer does it
                    if name == "released" and i == 2 and world_size == 1 and not fp32:
                        r["misuse"] = _misuse(ddp, opt, batch)
                        r["held_after_misuse"] = grad_buffer_bytes(ddp)
                r["steps"].append(_step(ddp, opt, batch))
            r["held_end"] = grad_buffer_bytes(ddp)
            rec[(fp32, name)] = r
    torch.save(rec, Path(out_dir) / f"rank{rank}.pt")


def _world(tmp_path_factory, name: str, world_size: int, dist: bool, variants: tuple[bool, ...]) -> list[dict]:
    out = tmp_path_factory.mktemp(name)
    spawn(_train, world_size, str(out), dist, variants)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def dp1(tmp_path_factory):
    return _world(tmp_path_factory, "release_dp1", 1, False, (False, True))[0]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return _world(tmp_path_factory, "release_dp2", 2, True, (False,))


def _assert_identical(kept: dict, released: dict, what: str) -> None:
    for i, (a, b) in enumerate(zip(kept["steps"], released["steps"], strict=True)):
        assert a["ok"] and b["ok"], (what, i)
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (what, i, a["loss"], b["loss"])
        for k in a["grads"]:
            assert torch.equal(a["grads"][k], b["grads"][k]), (what, i, "grad", k)
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), (what, i, "param", k)
    first, last = kept["steps"][0]["params"], kept["steps"][-1]["params"]
    assert any(not torch.equal(first[k], last[k]) for k in first), what  # the steps moved the weights


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("fp32", [False, True])
def test_release_leaves_zero_bytes(dp1, fp32):
    r = dp1[(fp32, "released")]
    assert r["full"] == (4 if fp32 else 2) * r["n_params"]  # DP=1, replicated optimizer: no padding
    assert len(r["released"]) == STEPS - 1
    for rel in r["released"]:
        assert rel["freed"] == r["full"] and rel["held"] == 0
        assert len(rel["storages"]) > 2 and set(rel["storages"]) == {0}  # buffers, buckets and main_grad views
    assert r["held_end"] == r["full"] and dp1[(fp32, "kept")]["held_end"] == r["full"]


@pytest.mark.parametrize("fp32", [False, True])
def test_step_after_release_and_restore_is_bit_identical_dp1(dp1, fp32):
    _assert_identical(dp1[(fp32, "kept")], dp1[(fp32, "released")], f"DP=1 fp32={fp32}")


def test_step_after_release_and_restore_is_bit_identical_dp2_distributed_optimizer(dp2):
    for rank, rec in enumerate(dp2):
        r = rec[(False, "released")]
        assert all(x["held"] == 0 and x["freed"] == r["full"] > 0 for x in r["released"]), rank
        _assert_identical(rec[(False, "kept")], r, f"DP=2 rank {rank}")
    for k, p in dp2[0][(False, "released")]["steps"][-1]["params"].items():
        assert torch.equal(p, dp2[1][(False, "released")]["steps"][-1]["params"][k]), k  # replicas agree


def test_use_of_released_buffers_raises_a_clear_error(dp1):
    r = dp1[(False, "released")]
    got = r["misuse"]
    for what in ("backward", "optimizer_step", "main_grad", "finish_grad_sync", "scale_gradients"):
        assert got[what].startswith("GradBuffersReleasedError: "), (what, got[what])
        assert "released" in got[what], got[what]
    assert "backward while the DDP grad buffers are released" in got["backward"]
    assert "restore_grad_buffers" in got["backward"] and "zero_grad_buffer" in got["backward"]
    assert got["param_grads_left"] == "0" and r["held_after_misuse"] == 0  # refused before anything was written


def test_only_the_ddp_model_of_build_policy_is_accepted():
    from jetrl_megatron.megatron.grad_buffers import release_grad_buffers

    with pytest.raises(TypeError, match="build_policy"):
        release_grad_buffers(torch.nn.Linear(2, 2))


def test_plan_counts_grad_buffers_in_the_train_phase_only(monkeypatch):
    import dataclasses

    from jetrl_megatron.rl.config import load_config
    from jetrl_megatron.rl.tools import run_plan as plan

    cfg = load_config("qwen3_8b_tp1")
    shape, layout = plan.model_shape(cfg), plan.parallel_layout(cfg)
    base = plan.memory_estimate(cfg, shape, layout)
    text, _ = plan.plan_report(cfg, show_config=False)
    assert "grad buffers: BF16 (2 B/param, grad_reduce_in_fp32=false)" in text and "train phase only" in text
    real = plan.trainer_settings
    monkeypatch.setattr(plan, "trainer_settings",
                        lambda c: dataclasses.replace(real(c), release_grad_buffers=False, grad_reduce_in_fp32=True))
    kept = plan.memory_estimate(cfg, shape, layout)
    assert kept["grad_buffers"] == pytest.approx(2 * base["grad_buffers"])  # FP32 instead of BF16
    assert kept["train_phase_total"] - base["train_phase_total"] == pytest.approx(base["grad_buffers"])
    assert kept["rollout_phase_total"] - base["rollout_phase_total"] == pytest.approx(kept["grad_buffers"])
    text = plan.plan_report(cfg, show_config=False)[0]
    assert "grad buffers: FP32 (4 B/param, grad_reduce_in_fp32=true)" in text and "held in all phases" in text


# ------------------------------------------------------------------------------------------------ the GRPO loop
LOOP = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8", "policy.jet_rl.sft_warmstart.steps=1",
        "policy.jet_rl.sft_warmstart.batch_size=16", "policy.jet_rl.final_arm_probe=false",
        "policy.jet_rl.progress_bars=false", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        *arm_overrides("jetrl"), "grpo.max_num_steps=2", "logger.tensorboard_enabled=false",
        "policy.jet_rl.plot_enabled=false"]


def _loop(rank: int, world_size: int, log_dir: str) -> None:
    """`jetrl run`'s loop with every phase wrapped to record the bytes the trainer's grad buffers hold in it."""
    from jetrl_megatron.megatron.grad_buffers import grad_buffer_bytes
    from jetrl_megatron.rl import loop
    from jetrl_megatron.rl.config import load_config

    held: dict = {"seen": []}

    def measure(name: str, fn):
        def wrapped(*a, **k):
            held["seen"].append((f"{name}:enter", grad_buffer_bytes(held["trainer"].model)))
            out = fn(*a, **k)
            held["seen"].append((f"{name}:exit", grad_buffer_bytes(held["trainer"].model)))
            return out
        return wrapped

    build, start = loop.build_trainer, loop.start_engine

    def build_trainer(cfg):
        held["trainer"] = build(cfg)
        held["full"] = grad_buffer_bytes(held["trainer"].model)
        return held["trainer"]

    def start_engine(*a, **k):
        held["seen"].append(("start_engine:enter", grad_buffer_bytes(held["trainer"].model)))
        engine = start(*a, **k)
        engine.generate = measure("generate", engine.generate)  # inside the rollout, while vLLM samples
        return engine

    loop.build_trainer, loop.start_engine = build_trainer, start_engine
    for name in ("sft_warmstart", "rollout", "policy_logprobs", "policy_update"):
        setattr(loop, name, measure(name, getattr(loop, name)))
    loop.RefitSource.shards = measure("refit", loop.RefitSource.shards)
    loop.run(load_config("tiny_cpu", [*LOOP, f"logger.log_dir={log_dir}"]))
    Path(log_dir, "grad_bytes.json").write_text(json.dumps({"full": held["full"], "seen": held["seen"]}))
    # Exit now, as `jetrl run` would: after spawn's teardown, the engine's exit hook would try to destroy vLLM's
    # process groups again and print a (harmless) traceback.
    os._exit(0)


def test_grpo_loop_holds_grad_buffers_only_during_updates(tmp_path):
    spawn(_loop, 1, str(tmp_path))
    got = json.loads((tmp_path / "grad_bytes.json").read_text())
    full, seen = got["full"], [tuple(x) for x in got["seen"]]
    names = {n for n, _ in seen}
    assert {"generate:enter", "generate:exit", "policy_logprobs:enter", "refit:enter", "start_engine:enter",
            "policy_update:enter", "sft_warmstart:exit"} <= names, names
    assert full > 0
    for n, b in seen:
        expected = full if n.split(":")[0] in ("sft_warmstart", "policy_update") else 0
        assert b == expected, (n, b, full, seen)
    assert sum(n == "policy_update:enter" for n, _ in seen) == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    # one optimizer step applied per GRPO step (the wrapper refreshed the FP8 cache once each), none skipped
    assert all(r["train/skipped_steps"] == 0 for r in rows)
    assert rows[1]["train/fp8_generation"] == rows[0]["train/fp8_generation"] + 1
