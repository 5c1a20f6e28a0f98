"""Two models with different numerics share one process: each model's numerics live in its own Fp8ModelContext.

Model A runs the torch twins (``elementwise="torch"``), model B the Triton element-wise kernels (``"triton"``, on CPU
tensors under the Triton interpreter), both FP8 (jetrl recipe) with the same seeded weights. In one process A is
built and run, then B, then A again; the reference for each is a process in which only that model was ever built.
Checked: each model's logprobs equal its own reference bit for bit, A's second forward equals its first (building B
changed nothing of A), and every norm / RoPE / residual add of each model ran the forward kernels its context chose
(so a process-wide switch, which B's build would have flipped for A, fails the test even where the two kernels agree
on these inputs). Runs in subprocesses: TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r'''
import collections, dataclasses, json, sys
import torch
from jetrl_megatron.megatron import cpu, numerics as N, triton_numerics as tn
from jetrl_megatron.megatron.model import build_gpt, fp8_context, token_logprobs
from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.recipe import Fp8Recipe

cpu.init_parallel(1, 1)
shape = dataclasses.replace(get_model_shape("tiny"), num_layers=2)
tokens = torch.randint(0, shape.vocab_size, (2, 10), generator=torch.Generator().manual_seed(7))


calls = collections.Counter()


def counting(tag, fn):
    def wrapped(*args, **kwargs):
        calls[tag] += 1
        return fn(*args, **kwargs)
    return wrapped


# observe which forward kernels run (the twins are looked up in N.TWINS, the Triton ones on the module, per call)
for op in ("rms_norm", "rope", "residual_add"):
    k = N.TWINS[op]
    N.TWINS[op] = N.OpKernels(k.impl, counting(f"torch.{op}", k.fwd), k.bwd)
    setattr(tn, f"{op}_fwd", counting(f"triton.{op}", getattr(tn, f"{op}_fwd")))


def run(model):
    calls.clear()
    lp = token_logprobs(model, tokens)
    return lp, sorted(calls)


def build(impl):
    return build_gpt(shape, Fp8Recipe(), attn_impl="fp32", elementwise=impl, seed=3)


out = {}
order = sys.argv[1].split(",")
models = {}
for step, name in enumerate(order):
    impl = {"A": "torch", "B": "triton"}[name]
    if name not in models:
        models[name] = build(impl)
    m = models[name]
    assert fp8_context(m).elementwise.impl == impl
    lp, seen = run(m)
    out[f"{step}:{name}"] = {"lp": lp.double().tolist(), "kernels": seen,
                             "finite": bool(torch.isfinite(lp).all()), "std": float(lp.std())}
print("RESULT " + json.dumps(out))
'''


def _children(*orders: str) -> list[dict]:
    """Run one child per order, concurrently (one thread each); their RESULT dicts."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, order], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for order in orders]
    outs = [(order, *p.communicate(timeout=600), p.returncode) for order, p in zip(orders, procs, strict=True)]
    results = []
    for order, stdout, stderr, rc in outs:
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        if rc != 0 or not lines:
            tail = stderr[-4000:]
            if "jetrl_megatron" in tail or "AssertionError" in tail:
                pytest.fail(f"child {order} failed:\n{tail}")
            pytest.skip(f"the Triton interpreter could not run here:\n{tail}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def test_two_models_with_different_numerics_share_one_process():
    pytest.importorskip("triton")
    shared, alone_a, alone_b = _children("A,B,A", "A", "B")
    ref_a, ref_b = alone_a["0:A"], alone_b["0:B"]
    a1, b, a2 = shared["0:A"], shared["1:B"], shared["2:A"]
    for r in (a1, b, a2, ref_a, ref_b):
        assert r["finite"] and r["std"] > 0.1, r["std"]  # real, non-degenerate logprobs
    # each model ran the kernels of its own context, before and after the other was built
    ops = ("residual_add", "rms_norm", "rope")
    assert a1["kernels"] == a2["kernels"] == ref_a["kernels"] == [f"torch.{op}" for op in ops]
    assert b["kernels"] == ref_b["kernels"] == [f"triton.{op}" for op in ops]
    # and gave its own independent run's logprobs, bit for bit
    assert torch.equal(torch.tensor(a1["lp"]), torch.tensor(ref_a["lp"]))
    assert torch.equal(torch.tensor(a2["lp"]), torch.tensor(a1["lp"]))
    assert torch.equal(torch.tensor(b["lp"]), torch.tensor(ref_b["lp"]))
    # the two numerics agree closely (same op order; only the reductions' summation order differs)
    diff = (torch.tensor(b["lp"]) - torch.tensor(a1["lp"])).abs().max().item()
    assert diff < 0.1, diff
