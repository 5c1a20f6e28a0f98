"""The KL term's reference policy with its weights in host memory between passes (megatron/host_resident.py,
``policy.jet_rl.reference_on_host``): the same logprobs, bit for bit, as a reference held on the device throughout,
its weights off the device between passes, and `jetrl plan`'s reference terms equal to the bytes it holds."""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.megatron.cpu import init_parallel
from jetrl_megatron.megatron.host_resident import HostResidentWeights
from jetrl_megatron.megatron.model import fp8_context
from jetrl_megatron.rl.batch import RolloutBatch
from jetrl_megatron.rl.config import load_config
from jetrl_megatron.rl.config.run_config import arm_overrides
from jetrl_megatron.rl.tools.run_plan import GiB, memory_estimate, model_shape, parallel_layout
from jetrl_megatron.rl.trainer import build_trainer, make_reference, reference_logprobs

KL = ["loss_fn.reference_policy_kl_penalty=0.01"]


def _cfg(arm: str, on_host: bool, device_overrides: tuple[str, ...] = ()):
    return load_config("tiny_cpu", [*KL, *arm_overrides(arm), f"policy.jet_rl.reference_on_host={str(on_host).lower()}",
                                    *device_overrides])


def _batch(cfg, rows: int = 3, seq: int = 24, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    vocab = model_shape(cfg).vocab_size
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    lengths = torch.tensor([seq, seq - 5, seq - 9][:rows])
    zeros = torch.zeros(rows)
    return RolloutBatch(tokens=tokens, mask=torch.ones(rows, seq - 1), gen_logprobs=torch.zeros(rows, seq - 1),
                        rewards=zeros, correct=zeros, response_len=torch.full((rows,), 8), texts=[""] * rows,
                        truncated=zeros.bool(), lengths=lengths)


@pytest.fixture(scope="module")
def parallel():
    init_parallel(1, 1)


@pytest.mark.parametrize("arm", ["jetrl", "bf16"])
def test_reference_on_host_gives_the_device_references_logprobs_and_leaves_the_device(parallel, arm):
    cfg_dev, cfg_host = _cfg(arm, False), _cfg(arm, True)
    trainer = build_trainer(cfg_dev)
    # a trained-looking policy: the reference copies whatever the policy holds now
    with torch.no_grad():
        for p in trainer.gpt.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    on_dev, on_host = make_reference(cfg_dev, trainer), make_reference(cfg_host, trainer)
    assert on_dev.host is None and isinstance(on_host.host, HostResidentWeights)
    batch = _batch(cfg_dev)
    want = reference_logprobs(cfg_dev, on_dev, batch)
    for _ in range(2):  # a second pass uploads again and gives the same bytes
        got = reference_logprobs(cfg_host, on_host, batch)
        assert torch.equal(got, want)
        assert torch.isfinite(got).all() and got.std() > 0
    host = on_host.host
    # between passes every parameter is its host copy and no FP8 copy is kept
    pairs = host._pairs
    assert all(p.data.data_ptr() == h.data_ptr() for p, h in pairs)
    fp8 = arm == "jetrl"
    if fp8:
        assert len(fp8_context(on_host.model).cache) == 0
    with on_host.on_device() as model:  # during a pass: fresh copies with the host bytes, the FP8 cache rebuilt
        assert all(p.data.data_ptr() != h.data_ptr() and torch.equal(p.data, h) for p, h in pairs)
        if fp8:
            dev_cache = fp8_context(on_dev.model).cache.named_fp8()
            host_cache = fp8_context(model).cache.named_fp8()
            assert host_cache.keys() == dev_cache.keys() and len(host_cache) > 0
            for name, (q, s) in host_cache.items():
                assert torch.equal(q.view(torch.uint8), dev_cache[name][0].view(torch.uint8))
                assert torch.equal(s, dev_cache[name][1])
    # a checkpoint of the reference holds the same weights either way
    a, b = on_dev.state_dict(), on_host.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


@pytest.mark.parametrize("arm", ["jetrl", "bf16", "bf16_train_fp8_rollout"])
def test_plan_reference_terms_equal_the_bytes_the_reference_holds(parallel, arm):
    cfg = _cfg(arm, True)
    trainer = build_trainer(cfg)
    ref = make_reference(cfg, trainer)
    with ref.on_device() as model:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        try:
            cache = fp8_context(model).cache.named_fp8()
        except TypeError:
            cache = {}
        fp8 = sum(q.numel() * q.element_size() + s.numel() * s.element_size() for q, s in cache.values())
    m = memory_estimate(cfg, model_shape(cfg), parallel_layout(cfg))
    assert m["reference_model"] * GiB == weights + fp8 and (fp8 > 0) == (arm == "jetrl")
    assert m["host_reference"] * GiB == ref.host.host_bytes == weights
    # on the host: the GPU holds it in the logprob phase only; on the device: in every phase, nothing on the host
    dev = memory_estimate(_cfg(arm, False), model_shape(cfg), parallel_layout(cfg))
    assert dev["host_reference"] == 0.0
    for phase in ("rollout", "refit", "train"):
        assert dev[f"{phase}_phase_total"] - m[f"{phase}_phase_total"] == pytest.approx(m["reference_model"])
    assert dev["logprob_phase_total"] == pytest.approx(m["logprob_phase_total"])
    assert m["host_per_node"] - dev["host_per_node"] == pytest.approx(m["host_reference"])
    off = memory_estimate(load_config("tiny_cpu", arm_overrides(arm)), model_shape(cfg), parallel_layout(cfg))
    assert off["reference_model"] == 0.0 and off["host_reference"] == 0.0


def test_host_resident_weights_refuse_a_trainable_model(parallel):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="frozen"):
        HostResidentWeights(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copies_are_page_locked_and_the_device_is_freed_between_passes_on_cuda():
    """On CUDA: the host copies are page-locked (large ones; registered in place), the device holds none of the
    weights between passes, and a pass computes what the model computed before it left the device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 256)).cuda().bfloat16()
    model.requires_grad_(False)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    want = model(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    host = HostResidentWeights(model)
    assert before - torch.cuda.memory_allocated() == weights
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters() if p.numel() * 2 >= 1 << 20)
    assert host.pinned is not None and host.pinned.bytes >= 2048 * 4096 * 2
    for _ in range(2):
        with host.on_device() as m:
            assert torch.cuda.memory_allocated() == before  # the weights are back
            got = m(x)
        assert torch.equal(got, want)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before - weights + got.numel() * got.element_size()
        del got
