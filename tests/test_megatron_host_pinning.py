"""Page-locking the CPU-offloaded optimizer's FP32 masters in place (megatron/host_pinning.py).

CPU: which storages are registered (large ones once each, small ones and views left alone), what a failed
registration leaves (the rest pageable, one message) and that release unregisters exactly what was registered, with
a registrar that records addresses (no CUDA here), and a checkpoint load pinning the masters it rebuilds. GPU
(``gpu``): the real driver registration (``cuMemHostRegister``) on the masters of Megatron's hybrid optimizer built on
CUDA: they report ``is_pinned()`` (after a resume too), two steps with them pinned give every weight and the FP8 cache
the same bytes as two steps without, and a refused registration leaves no error for the next kernel.
"""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.megatron.host_pinning import MIN_PIN_BYTES, PinnedHostMasters, host_masters


class _Registrar:
    def __init__(self, fail_at: int | None = None) -> None:
        self.live: dict[int, int] = {}
        self.calls = 0
        self.fail_at = fail_at

    def register(self, address: int, nbytes: int) -> int:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        assert all(address + nbytes <= a or a + n <= address for a, n in self.live.items()), "overlapping ranges"
        self.live[address] = nbytes
        return 0

    def unregister(self, address: int) -> int:
        del self.live[address]
        return 0


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    big = [torch.randn(n, generator=g) for n in (MIN_PIN_BYTES // 4, 3 * MIN_PIN_BYTES // 4 + 17)]
    small = torch.randn(MIN_PIN_BYTES // 4 - 1, generator=g)
    return [big[0], small, big[1], big[1][5:]]  # the view shares big[1]'s storage


def test_large_storages_registered_once_small_ones_left_and_release_unregisters():
    reg = _Registrar()
    ts = _tensors()
    pinned = PinnedHostMasters(ts, register=reg.register, unregister=reg.unregister)
    want = {ts[0].untyped_storage().data_ptr(): ts[0].untyped_storage().nbytes(),
            ts[2].untyped_storage().data_ptr(): ts[2].untyped_storage().nbytes()}
    assert reg.live == want and pinned.count == 2 and pinned.bytes == sum(want.values())
    assert pinned.skipped_small == 1 and pinned.error is None
    assert "2 host FP32 masters page-locked" in pinned.summary()
    pinned.release()
    pinned.release()  # idempotent
    assert reg.live == {} and pinned.count == 0 and pinned.bytes == 0
    again = PinnedHostMasters(ts, register=reg.register, unregister=reg.unregister)
    assert again.count == 2
    del again  # collected: unregistered before its storages can be freed
    assert reg.live == {}


def test_a_failed_registration_stops_with_one_message_and_keeps_what_was_pinned(caplog):
    reg = _Registrar(fail_at=2)
    ts = _tensors()
    with caplog.at_level("WARNING"):
        pinned = PinnedHostMasters(ts, register=reg.register, unregister=reg.unregister)
    assert pinned.count == 1 and list(reg.live) == [ts[0].untyped_storage().data_ptr()]
    assert "CUDA error 2" in pinned.error and "the rest stay pageable" in pinned.error
    assert sum("cuMemHostRegister" in r.message for r in caplog.records) == 1
    pinned.release()
    assert reg.live == {}


def test_a_device_tensor_is_refused_by_shape():
    t = torch.empty(4, 8, device="meta")
    reg = _Registrar()
    with pytest.raises(ValueError, match=r"shape \(4, 8\) is on meta"):
        PinnedHostMasters([t], register=reg.register, unregister=reg.unregister)


def _loss(lp, mb):
    return -lp.mean(), {}


def _resume_run(rank: int, world_size: int, out_dir: str) -> None:
    from pathlib import Path

    from megatron_helpers import hf_state, tiny_shape

    from jetrl_megatron.megatron.model import forward_backward
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.recipe import Fp8Recipe

    shape = tiny_shape("qwen3")
    batch = {"tokens": torch.randint(0, shape.vocab_size, (2, 32), generator=torch.Generator().manual_seed(32))}
    policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=hf_state(shape, seed=31, std=0.02),
                          grad_reduce_in_fp32=False, use_distributed_optimizer=True,
                          optimizer={"lr": 3e-3, "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0})
    ddp, opt = policy.model, policy.optimizer
    reg = _Registrar()
    opt.pin_host_masters(register=reg.register, unregister=reg.unregister, min_bytes=1)

    def storages() -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in host_masters(opt.optimizer.optimizer)}

    before = storages()
    registered_before = dict(reg.live)
    opt.zero_grad()
    forward_backward([ddp], batch, _loss, micro_batch_size=1, grad_scale_func=opt.scale_loss)
    assert opt.step()[0]
    opt.load_checkpoint_state(opt.checkpoint_state())
    after = storages()
    torch.save({"before": before, "registered_before": registered_before, "after": after,
                "registered_after": dict(reg.live), "count": sum(p.count for p in opt.pinned_masters)},
               Path(out_dir) / "resume.pt")


def test_a_checkpoint_load_pins_the_new_masters_and_releases_the_old(tmp_path):
    """Megatron's hybrid optimizer rebuilds its host FP32 masters when a checkpoint is loaded: after the load exactly
    the new masters are registered (the old ones released, not kept alive and locked)."""
    from jetrl_megatron.megatron.cpu import spawn

    spawn(_resume_run, 1, str(tmp_path))
    rec = torch.load(tmp_path / "resume.pt")
    assert rec["registered_before"] == rec["before"] and rec["before"]
    assert set(rec["after"]).isdisjoint(rec["before"]), "the load was expected to rebuild the masters"
    assert rec["registered_after"] == rec["after"] and rec["count"] == len(rec["after"])


def _pinned_run(rank: int, world_size: int, out_dir: str) -> None:
    from pathlib import Path

    from megatron_helpers import hf_state, model_params, tiny_shape

    from jetrl_megatron.megatron.model import forward_backward, fp8_context
    from jetrl_megatron.megatron.policy import build_policy
    from jetrl_megatron.recipe import Fp8Recipe

    shape = tiny_shape("qwen3")
    sd = hf_state(shape, seed=31, std=0.02)
    batch = {"tokens": torch.randint(0, shape.vocab_size, (2, 32), generator=torch.Generator().manual_seed(32))}
    rec = {}
    for pin in (False, True):
        policy = build_policy(shape, Fp8Recipe(mode="jetrl"), weights=sd, grad_reduce_in_fp32=False,
                              use_distributed_optimizer=True, optimizer={
                                  "lr": 3e-3, "weight_decay": 0.1, "optimizer_cpu_offload": True,
                                  "optimizer_offload_fraction": 1.0, "pin_cpu_params": pin})
        ddp, opt = policy.model, policy.optimizer
        for _ in range(2):
            opt.zero_grad()
            forward_backward([ddp], batch, _loss, micro_batch_size=1, grad_scale_func=opt.scale_loss)
            assert opt.step()[0]
        if pin:  # a resume rebuilds the masters: pinned again
            opt.load_checkpoint_state(opt.checkpoint_state())
        cache = fp8_context(ddp).cache.named_fp8()
        rec[pin] = {"params": model_params(ddp),
                    "fp8": {k: (q.view(torch.uint8).cpu(), s.cpu()) for k, (q, s) in cache.items()},
                    "pinned_bytes": sum(pm.bytes for pm in opt.pinned_masters),
                    "masters_pinned": [t.is_pinned() for t in host_masters(opt.optimizer.optimizer)
                                       if t.untyped_storage().nbytes() >= MIN_PIN_BYTES]}
    torch.save(rec, Path(out_dir) / "pinned.pt")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_masters_on_cuda_step_the_same_bytes(tmp_path):
    from jetrl_megatron.megatron.cpu import spawn

    spawn(_pinned_run, 1, str(tmp_path))
    rec = torch.load(tmp_path / "pinned.pt")
    assert rec[False]["pinned_bytes"] == 0 and rec[True]["pinned_bytes"] > 0
    assert rec[True]["masters_pinned"] and all(rec[True]["masters_pinned"])
    assert not any(rec[False]["masters_pinned"])  # Megatron's own FP32 masters are pageable: the before
    for name, p in rec[False]["params"].items():
        assert torch.equal(p, rec[True]["params"][name]), name
    for name, (q, s) in rec[False]["fp8"].items():
        assert torch.equal(q, rec[True]["fp8"][name][0]) and torch.equal(s, rec[True]["fp8"][name][1]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_refused_registration_leaves_no_error_for_the_next_kernel():
    """The same range registered twice: the second is refused (its code returned) and the next kernel launch and
    synchronize still succeed (a runtime-API failure would stay pending and surface there)."""
    from jetrl_megatron.megatron.host_pinning import _cuda_register, _cuda_unregister

    t = torch.empty(4 * MIN_PIN_BYTES // 4, dtype=torch.float32)
    address, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    assert _cuda_register(address, nbytes) == 0 and t.is_pinned()
    try:
        assert _cuda_register(address, nbytes) != 0
        x = torch.ones(1024, device="cuda") * 2
        torch.cuda.synchronize()
        assert float(x.sum()) == 2048.0
    finally:
        assert _cuda_unregister(address) == 0
    assert not t.is_pinned()
