"""Megatron optimizer + the Jet-RL hook: refresh the FP8 weight cache exactly once per successful step.

Built by :func:`jetrl_megatron.megatron.policy.build_policy` (with the model and its DDP wrapper, in that order).

Why a wrapper and a constant loss scale of 1.0: Megatron's BF16 optimizer only checks gradients for NaN/Inf when a
grad scaler exists; ``ConstantGradScaler(1.0)`` turns that check on (the found-inf flag is all-reduced over the
model-parallel group, or over every rank of the distributed optimizer, so every rank agrees) at no numerical cost
(scaling by 1.0 is exact). A step with non-finite grads then returns ``update_successful=False`` before any parameter
is touched, and the wrapper leaves the FP8 cache untouched and records the skip.

Staleness: Megatron copies the updated FP32 main params into the BF16 model params through ``param.data`` (or
all-gathers them into the param buffer), which does not bump ``param._version``, so the cache's version check alone
would not notice the update. After a successful step the wrapper bumps every parameter's version
(``torch.autograd.graph.increment_version``, so anything keyed on a weight's version notices) and then refreshes
the cache; any FP8 forward between Megatron's copy and the refresh
would raise ``StaleFp8WeightError`` rather than silently use old bytes.

Distributed optimizer (``build_policy(use_distributed_optimizer=True)``): FP32 main params and
Adam moments are sharded over the data-parallel group; gradients are reduce-scattered, each rank updates its shard
of the BF16 param buffer and Megatron all-gathers the buffer inside ``step()`` (overlap_param_gather off). With
overlap_param_gather on, Megatron defers that all-gather to the next forward's pre-hooks; the wrapper then forces
it before the refresh, because the FP8 cache must be quantized from the gathered weights, not from a buffer in
which only this rank's shard is new.

CPU offload (``optimizer_cpu_offload``): inside the distributed optimizer Megatron's ``HybridDeviceOptimizer`` holds
this rank's FP32 masters and Adam moments (a fraction on the host) and copies the updated masters into the BF16
shard itself; the distributed optimizer then all-gathers as above, so the refresh is the same. Every call into it
runs in :func:`~jetrl_megatron.megatron.cpu.host_offload_scope` (its real offload path on a CPU-only box). Its
checkpoint loader first takes a throw-away step on random gradients to create the Adam state (``dummy_step``),
which writes into the BF16 weights; the wrapper writes the loaded masters back over them, so a resume is exact.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from jetrl_megatron.megatron.cpu import host_offload_scope
from jetrl_megatron.megatron.grad_buffers import GradBuffersReleasedError
from jetrl_megatron.megatron.host_pinning import PinnedHostMasters
from jetrl_megatron.megatron.host_state import HostStateBuild, build_host_state, check_host_fits, host_state_bytes
from jetrl_megatron.megatron.model import refresh_fp8_cache, unwrap

__all__ = ["Fp8RefreshingOptimizer", "OptimizerStats", "te_fused_adam_available"]

log = logging.getLogger(__name__)


@dataclass
class OptimizerStats:
    steps: int = 0
    skipped: int = 0
    refreshes: int = 0
    skipped_at: list[int] = field(default_factory=list)


def _inner_optimizers(optimizer) -> list:
    """The Megatron optimizers behind a (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _is_distributed(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def _hybrid(opt) -> Any:
    """Megatron's ``HybridDeviceOptimizer`` inside ``opt`` (CPU offload), or None."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, HybridDeviceOptimizer) else None


def _drop_device_fp32_grads(hdo) -> None:
    """Free the hybrid optimizer's FP32 gradient copies of its device-side parameters after its step.

    Why: Megatron's ``HybridDeviceOptimizer`` sets them anew at every step (``_set_sub_optimizer_grads``) and nothing
    reads them after it, but no ``zero_grad`` reaches them, so they stayed through the rollout: 4 B per device-side
    parameter (6.1 GiB at Qwen3-8B with 0.8 on the host), and, allocated mid-step, they pinned 4.4 GiB of torch's
    cache that a colocated engine needed (2026-12-06, rl/memory_pins.py). The host-side copies' gradients are
    staging buffers it assigns once and refills each step: those stay."""
    for param, fp32_param in hdo.param_to_fp32_param.items():
        if param not in hdo.gpu_params_map_cpu_copy:
            fp32_param.grad = None


def _restore_after_hybrid_load(hdo) -> None:
    """After Megatron's checkpoint load into a hybrid optimizer: the loaded state handed to its sub-optimizers, the
    device part's Adam state back on its parameters' device, and the BF16 shards from the loaded FP32 masters.

    Why: Megatron's ``dp_reshardable`` loader writes the loaded tensors into the hybrid optimizer's ``state`` but,
    unlike its other loaders, does not hand them to the sub-optimizers (``_sync_hdo_state_to_sub_optimizers``), so
    they would keep stepping the masters of the loader's ``dummy_step``. That sync moves the state of every optimizer
    of the host class to the host; without TransformerEngine the device part is torch's AdamW too. And the
    ``dummy_step`` (random gradients) wrote into the BF16 shards, which only the masters can restore.
    """
    hdo._sync_hdo_state_to_sub_optimizers()
    for model_param, master in hdo.param_to_fp32_param.items():
        model_param.data.copy_(master)
    gpu = hdo.gpu_optimizer
    if gpu is None:
        return
    for param, state in gpu.state.items():
        orig = hdo.inner_param_to_orig_param.get(param, param)
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device != param.device:  # fused AdamW: 'step' too
                state[k] = hdo.state[orig][k] = v.to(param.device)


def _fp32_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, per_tensor: bool,
                  *args: Any) -> tuple[torch.Tensor, None]:
    """The L2 norm of a list of tensors accumulated in FP32 (what amp_C / TransformerEngine's multi_tensor_l2norm
    return), for Megatron's local fallback, which rounds each tensor's norm and the total to the tensors' dtype."""
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensor_lists[0]])
    return torch.linalg.vector_norm(norms).reshape(1), None


@contextlib.contextmanager
def _fp32_grad_norm():
    """The gradient norm in FP32 under CPU offload without TransformerEngine / Apex.

    Why: the hybrid optimizer clips and measures the BF16 gradients in the grad buffer (Megatron's precision-aware
    path) instead of FP32 copies, and Megatron's local norm fallback would return a BF16-rounded norm (6.0625 for
    6.0728 on the tiny test model): a different clip factor and a wrong logged grad norm.
    """
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is not local_multi_tensor_l2_norm:
        yield
        return
    clip_grads.l2_norm_impl = _fp32_l2_norm
    try:
        yield
    finally:
        clip_grads.l2_norm_impl = local_multi_tensor_l2_norm


def unscale_and_check(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor,
                      native: Any = None) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` for BF16 gradients too: sets ``found_inf`` to 1 when
    any gradient holds a NaN/Inf and multiplies every gradient by ``inv_scale`` in place.

    Why: under CPU offload Megatron's hybrid optimizer checks the BF16 gradients of the grad buffer itself
    (its precision-aware path), and the CUDA kernel of that torch op has no BF16 variant (the CPU one has). FP32 /
    FP16 lists still go to the native op (``native``, the original torch function)."""
    native = native or _NATIVE_UNSCALE
    bf16 = [g for g in grads if g.dtype == torch.bfloat16]
    rest = [g for g in grads if g.dtype != torch.bfloat16]
    if rest:
        native(rest, found_inf, inv_scale)
    if bf16:
        bad = torch.stack([(~torch.isfinite(g)).any() for g in bf16]).any()
        found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype)))
        for g in bf16:
            g.mul_(inv_scale)  # in FP32, rounded to BF16 once: the native op's arithmetic


_NATIVE_UNSCALE = torch._amp_foreach_non_finite_check_and_unscale_


@contextlib.contextmanager
def _bf16_unscale():
    """Routes Megatron's found-inf check through :func:`unscale_and_check` while the hybrid optimizer steps."""
    torch._amp_foreach_non_finite_check_and_unscale_ = unscale_and_check
    try:
        yield
    finally:
        torch._amp_foreach_non_finite_check_and_unscale_ = _NATIVE_UNSCALE


class Fp8RefreshingOptimizer:
    """Wraps a Megatron optimizer; ``step()`` has Megatron's return value ``(ok, grad_norm, num_zeros)``."""

    def __init__(self, optimizer, model_chunks: list[torch.nn.Module]) -> None:
        self.optimizer = optimizer
        self.model_chunks = list(model_chunks)
        self.stats = OptimizerStats()
        self.pinned_masters: list[PinnedHostMasters] = []
        self._pin_kwargs: dict[str, Any] | None = None  # how pin_host_masters was called (None: never)

    @property
    def distributed(self) -> bool:
        """True when the FP32 main params and Adam state are sharded over data-parallel ranks."""
        return any(_is_distributed(o) for o in _inner_optimizers(self.optimizer))

    @property
    def offloaded(self) -> bool:
        """True when Megatron's hybrid CPU-offload optimizer holds the FP32 masters and Adam state."""
        return any(_hybrid(o) is not None for o in _inner_optimizers(self.optimizer))

    def pin_host_masters(self, **kwargs: Any) -> list[PinnedHostMasters]:
        """Page-lock the hybrid optimizers' host FP32 masters in place (``megatron/host_pinning.py``: Megatron's
        ``pin_cpu_params``, which its hybrid optimizer does not apply to them); held by this wrapper, and pinned
        again after a checkpoint load, which replaces the masters (:meth:`load_checkpoint_state`)."""
        self._pin_kwargs = dict(kwargs)
        self.pinned_masters += [PinnedHostMasters.of(h, **kwargs) for o in _inner_optimizers(self.optimizer)
                                if (h := _hybrid(o)) is not None]
        return self.pinned_masters

    def _repin_host_masters(self) -> None:
        """After a load: Megatron's hybrid optimizer rebuilds its host FP32 masters (``_init_sub_optimizers`` in its
        load hook), so the registrations would hold the old ones (memory the step no longer uses) while the new
        ones stay pageable. Unregister the old (once no copy may still read them) and pin the new."""
        if self._pin_kwargs is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for pinned in self.pinned_masters:
            pinned.release()
        self.pinned_masters = []
        self.pin_host_masters(**self._pin_kwargs)

    def build_host_state(self, available_bytes: int | None = None, ranks_on_host: int = 1) -> HostStateBuild | None:
        """Create the CPU-offloaded optimizer's host state (gradient staging buffers, Adam moments) now rather than
        in the first step (``megatron/host_state.py``); None without offload. Call it after any checkpoint load.
        ``available_bytes`` (the host's free memory) and ``ranks_on_host`` (ranks building at once on it): when
        given, a state that cannot fit raises ``HostMemoryError`` before anything is allocated."""
        hybrids = [h for o in _inner_optimizers(self.optimizer) if (h := _hybrid(o)) is not None]
        if not hybrids:
            return None
        check_host_fits(sum(host_state_bytes(h) for h in hybrids), available_bytes, ranks_on_host)
        with self._scope():
            builds = [build_host_state(h) for h in hybrids]
        return HostStateBuild(sum(b.staging_buffers for b in builds), sum(b.moment_tensors for b in builds),
                              sum(b.bytes for b in builds), sum(b.seconds for b in builds))

    def _scope(self) -> contextlib.AbstractContextManager:
        """Calls into the hybrid optimizer: its offload path on a CPU-only box, and an FP32 gradient norm."""
        if not self.offloaded:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(host_offload_scope())
        stack.enter_context(_fp32_grad_norm())
        stack.enter_context(_bf16_unscale())
        return stack

    def step(self) -> tuple[bool, Any, Any]:
        for chunk in self.model_chunks:
            if getattr(chunk, "grad_buffers_released", False):
                raise GradBuffersReleasedError("optimizer step while the DDP grad buffers are released: there are no "
                                               "gradients to apply (run forward/backward after zero_grad_buffer())")
        with self._scope():
            ok, grad_norm, num_zeros = self.optimizer.step()
            self.stats.steps += 1
            # Megatron keeps the FP32 copies of the gradients (main_param.grad: 4 B/param, /DP when distributed)
            # until the next zero_grad(), i.e. through the rollout phase; nothing reads them after the step.
            self.optimizer.zero_grad(set_to_none=True)
            for o in _inner_optimizers(self.optimizer):
                if (hdo := _hybrid(o)) is not None:
                    _drop_device_fp32_grads(hdo)
        if not ok:
            self.stats.skipped += 1
            self.stats.skipped_at.append(self.stats.steps)
            log.warning("optimizer step %d skipped: non-finite gradients; FP8 weight cache left untouched",
                        self.stats.steps)
            return ok, grad_norm, num_zeros
        for chunk in self.model_chunks:
            ddp_config = getattr(chunk, "ddp_config", None)
            if ddp_config is not None and ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)  # the deferred all-gather, now: the cache needs full weights
        for chunk in self.model_chunks:
            for p in unwrap(chunk).parameters():
                torch.autograd.graph.increment_version(p)
            refresh_fp8_cache(chunk)
        self.stats.refreshes += 1
        return ok, grad_norm, num_zeros

    # -------------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's optimizer state for a per-rank checkpoint file.

        Non-distributed: Megatron's ``state_dict()`` (FP32 main params + Adam state, complete on every rank).
        Distributed: Megatron's ``state_dict()`` holds only the param groups and step, not the sharded tensors, so
        this rank's shards (FP32 main params, exp_avg, exp_avg_sq) are added in Megatron's bucket layout
        (``get_parameter_state_dp_reshardable``), with the DP size they were cut for.
        """
        parts = []
        for opt in _inner_optimizers(self.optimizer):
            if not _is_distributed(opt):
                parts.append({"kind": "megatron", "state": opt.state_dict()})
                continue
            if (hdo := _hybrid(opt)) is not None and not hdo.state:
                raise ValueError("optimizer checkpoint before the first step: the CPU-offload optimizer has no state "
                                 "yet (save after a step)")
            with self._scope():
                shards = opt.get_parameter_state_dp_reshardable()
            for key, per_dtype in shards.items():
                if isinstance(key, int):
                    for buckets in per_dtype.values():
                        for bucket in buckets:
                            for entry in bucket:
                                entry["padding"] = False  # Megatron's loader skips padding entries by this flag
            state = opt.state_dict()
            for group in state["optimizer"]["param_groups"]:  # the hybrid optimizer's sub-optimizer classes: a
                for k in [k for k, v in group.items() if isinstance(v, type)]:  # weights-only load refuses them
                    del group[k]
            parts.append({"kind": "distributed", "dp_size": opt.data_parallel_group.size(),
                          "state": state, "param_state": shards})
        return {"format": "jetrl_optimizer_v1", "parts": parts}

    def check_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError, touching nothing, when :meth:`load_checkpoint_state` would refuse ``state``: written for
        another optimizer kind (distributed or not) or DP size."""
        if state.get("format") != "jetrl_optimizer_v1":
            if self.distributed:
                raise ValueError("optimizer checkpoint holds no distributed-optimizer shards (it was written with "
                                 "use_distributed_optimizer=false): set policy.megatron_cfg.optimizer."
                                 "use_distributed_optimizer=false to resume it")
            return  # a plain Megatron state_dict (checkpoints written before this format)
        inner = _inner_optimizers(self.optimizer)
        if len(state["parts"]) != len(inner):
            raise ValueError(f"optimizer checkpoint has {len(state['parts'])} part(s), this optimizer {len(inner)}")
        for opt, part in zip(inner, state["parts"], strict=True):
            kind = "distributed" if _is_distributed(opt) else "megatron"
            if part["kind"] != kind:
                raise ValueError(
                    f"optimizer checkpoint was written with use_distributed_optimizer={part['kind'] == 'distributed'}, "
                    f"this run has use_distributed_optimizer={kind == 'distributed'}: set "
                    "policy.megatron_cfg.optimizer.use_distributed_optimizer as in the run that wrote it")
            if kind == "distributed" and part["dp_size"] != (dp := opt.data_parallel_group.size()):
                raise ValueError(f"distributed-optimizer checkpoint was sharded over DP={part['dp_size']}, this run "
                                 f"has DP={dp}: resharding optimizer state is not supported")

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Inverse of :func:`checkpoint_state`; refuses (:meth:`check_checkpoint_state`, before loading anything) a
        checkpoint cut for another optimizer kind or DP size."""
        self.check_checkpoint_state(state)
        if state.get("format") != "jetrl_optimizer_v1":
            self.optimizer.load_state_dict(state)
            self._repin_host_masters()
            return
        for opt, part in zip(_inner_optimizers(self.optimizer), state["parts"], strict=True):
            if part["kind"] == "megatron":
                opt.load_state_dict(part["state"])
                continue
            if (hdo := _hybrid(opt)) is not None:  # the classes checkpoint_state dropped, from this optimizer
                classes = {k: v for k, v in hdo.defaults.items() if isinstance(v, type)}
                groups = [{**classes, **g} for g in part["state"]["optimizer"]["param_groups"]]
                part = {**part, "state": {**part["state"], "optimizer": {**part["state"]["optimizer"],
                                                                          "param_groups": groups}}}
            with self._scope():
                opt.load_state_dict({**part["state"], "param_state": part["param_state"],
                                     "param_state_sharding_type": "dp_reshardable"})
                if (hdo := _hybrid(opt)) is not None:
                    _restore_after_hybrid_load(hdo)
            # With torch's Adam (no TransformerEngine / Apex), Megatron's loader gives every parameter the *same*
            # 'step' tensor; Adam increments each parameter's step in place, so a shared tensor would advance once
            # per parameter and corrupt the bias correction after a resume.
            for st in opt.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()
        self._repin_host_masters()

    def __getattr__(self, name: str) -> Any:  # zero_grad, scale_loss, state_dict, param_groups, ...
        return getattr(self.optimizer, name)


def te_fused_adam_available() -> bool:
    """Whether TransformerEngine's FusedAdam (needed by Megatron's precision-aware optimizer) can be imported."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        return False
    return True
