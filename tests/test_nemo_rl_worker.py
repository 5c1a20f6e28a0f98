"""``jetrl_megatron/nemo_rl/worker.py`` itself, on CPU with a real Megatron-Core model, over stand-ins for the NeMo-RL
pieces it subclasses and wraps (``tests/nemo_rl_standin.py``: they follow ``contract.TOUCHES``; no NeMo-RL code).

In a process of its own (the stand-ins are modules named ``ray`` and ``nemo_rl``): the worker builds the Jet-RL
chunk through the provider, NeMo-RL's default DDP (distributed optimizer, ``overlap_param_gather``) wraps it and a
checkpoint is loaded after the build; then, against independent references (the 128x128 reference quantizer on the
HF weights that were loaded):

* the policy and the reference policy are built through the provider, which is left as it was;
* the refit metadata and the refit stream are the checkpoint's tensors — FP8 linears as E4M3 codes + FP32 scales,
  BF16 tensors unchanged (so the cache was refreshed after the load, and NeMo-RL's own generator never ran);
* inside ``use_reference_model`` the stream is the reference policy's, and after it the policy's exact bytes again;
* an optimizer step re-quantizes the cache once, from the updated weights; FP8 KV-cache scales are refused;
* NeMo-RL's ``train()`` runs its backward with autograd's device threads off (``policy.jet_rl.backward_thread``'s
  default, ``calling``), on with ``device``, and the caller's own setting is back afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from megatron_helpers import hf_state, tiny_shape

from jetrl_megatron.fp8.quant import quantize_128x128
from jetrl_megatron.megatron.cpu import spawn
from jetrl_megatron.model import layout
from jetrl_megatron.recipe import Fp8Recipe

RECIPE = Fp8Recipe(bf16_last_layers=1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _hf_weights(worker, shape) -> dict[str, torch.Tensor]:
    """The worker's current master weights in HF layout (TP1), for the reference quantization."""
    from jetrl_megatron.megatron.model import unwrap

    params = dict(unwrap(worker.model).named_parameters())
    out = {}
    for pmap in layout.stage_param_maps(shape):
        for name, t in zip(pmap.hf, layout.megatron_shards_to_hf(pmap, [params[pmap.megatron].detach()], shape),
                           strict=True):
            out[name] = t.clone()
    return out


def _run(rank: int, world_size: int, out_dir: str, model_dir: str) -> None:
    import nemo_rl_standin as standin

    from jetrl_megatron.megatron.model import fp8_linears, rollout_weights

    standin.install()
    shape = tiny_shape("qwen3")
    standin.CHECKPOINTS.update(policy=hf_state(shape, seed=41, std=0.02), reference=hf_state(shape, seed=42,
                                                                                             std=0.02))
    import jetrl_megatron.nemo_rl.worker as w

    config = standin.policy_config(RECIPE, shape.num_layers, model_name=model_dir)
    worker = w.JetRLMegatronPolicyWorker(config, None, worker_sharding_annotations=None, shape=shape)
    res: dict = {"provider": "jetrl"}
    try:
        worker.megatron_cfg.model.provide()
    except AssertionError:
        res["provider"] = "stock"  # the provider is its own again after the build (it is saved with checkpoints)
    res["info"] = {n: (tuple(s), d) for n, (s, d) in worker.prepare_refit_info().items()}
    res["sizes"] = worker.refit_param_info_mcore
    res["stream"] = [(n, t.clone()) for n, t in worker._iter_params_with_optional_kv_scales()]
    try:
        next(worker._iter_params_with_optional_kv_scales({"model.layers.0.self_attn.k_scale": 1.0}))
        res["kv_error"] = None
    except ValueError as e:
        res["kv_error"] = str(e)
    with worker.use_reference_model():
        res["reference"] = [(n, t.clone()) for n, t in worker._iter_params_with_optional_kv_scales()]
    res["after_reference"] = [(n, t.clone()) for n, t in worker._iter_params_with_optional_kv_scales()]
    toks = torch.randint(0, shape.vocab_size, (2, 128), generator=torch.Generator().manual_seed(7))
    res["train_threads"] = {"default": worker.train(toks, None)["backward_multithreading"],
                            "after": torch._C._is_multithreading_enabled()}
    worker._hosted_plan = dataclasses.replace(worker._hosted_plan, backward_thread="device")
    res["train_threads"]["device"] = worker.train(toks, None)["backward_multithreading"]
    gen = []
    for _ in range(2):
        toks = torch.randint(0, shape.vocab_size, (2, 128), generator=torch.Generator().manual_seed(len(gen)))
        assert worker.train_step(toks)
        names = [f"{n}.weight" for n, _ in fp8_linears(worker.model)]
        served = rollout_weights(worker.model)
        gen.append({n: (served[n].clone(), served[n + "_scale_inv"].clone()) for n in names})
    res["trained"] = [(n, t.clone()) for n, t in worker._iter_params_with_optional_kv_scales()]
    res["trained_hf"] = _hf_weights(worker, shape)
    res["steps"] = gen
    torch.save(res, os.path.join(out_dir, "worker.pt"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nemo_rl_worker")
    model_dir = out / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(tiny_shape("qwen3").to_hf_config()))
    spawn(_run, 1, str(out), str(model_dir))
    return torch.load(out / "worker.pt")


def _check_stream(stream, sd, what: str) -> None:
    shape = tiny_shape("qwen3")
    names = [n for n, _ in stream]
    want = set(sd) | {n + "_scale_inv" for n in sd if n.endswith(".weight") and
                      RECIPE.module_is_fp8(n, None, shape.num_layers)}
    assert set(names) == want and len(names) == len(want), what
    got = dict(stream)
    for n, w in sd.items():
        if n.endswith(".weight") and RECIPE.module_is_fp8(n, None, shape.num_layers):
            q, s = quantize_128x128(w, RECIPE)
            assert torch.equal(_bytes(got[n]), _bytes(q)) and torch.equal(got[n + "_scale_inv"], s), f"{what}: {n}"
        else:
            assert got[n].dtype == w.dtype and torch.equal(got[n], w), f"{what}: {n}"


@pytest.mark.slow
def test_refit_is_the_loaded_checkpoint_in_fp8(run):
    shape = tiny_shape("qwen3")
    _check_stream(run["stream"], hf_state(shape, seed=41, std=0.02), "policy")
    assert run["info"] == {n: (tuple(t.shape), t.dtype) for n, t in run["stream"]}
    assert run["sizes"] == [(n, t.numel() * t.element_size()) for n, t in run["stream"]]
    assert sum(n.endswith("_scale_inv") for n, _ in run["stream"]) == 7 * (shape.num_layers - 1)
    assert "kv_cache_dtype" in run["kv_error"]
    assert run["provider"] == "stock"


@pytest.mark.slow
def test_reference_swap_streams_the_reference_then_the_policys_bytes(run):
    _check_stream(run["reference"], hf_state(tiny_shape("qwen3"), seed=42, std=0.02), "reference")
    for (n, a), (m, b) in zip(run["stream"], run["after_reference"], strict=True):
        assert n == m and torch.equal(_bytes(a), _bytes(b)), f"{n} changed across the reference swap"


@pytest.mark.slow
def test_each_step_requantizes_the_updated_weights(run):
    steps = run["steps"]
    first, second = steps
    assert any(not torch.equal(_bytes(first[n][0]), _bytes(second[n][0])) for n in first), "the step changed nothing"
    _check_stream(run["trained"], run["trained_hf"], "after two steps")
    stream = dict(run["trained"])
    before = dict(run["stream"])
    moved = [n for n in stream if n.endswith("_proj.weight") and stream[n].dtype == torch.float8_e4m3fn
             and not torch.equal(_bytes(stream[n]), _bytes(before[n]))]
    assert len(moved) >= math.ceil(0.5 * sum(t.dtype == torch.float8_e4m3fn for t in stream.values()))


@pytest.mark.slow
def test_train_runs_its_backward_on_the_calling_thread_unless_told_otherwise(run):
    """The switch as the backward itself saw it (a hook on the logits), not as the wrapper set it: off by default
    (the backward of CUDA tensors then runs on the training thread), on with backward_thread: device, and the
    caller's thread-local setting (on, PyTorch's default) restored after train() returns."""
    threads = run["train_threads"]
    assert threads["default"] == [False], threads
    assert threads["device"] == [True], threads
    assert threads["after"] is True
