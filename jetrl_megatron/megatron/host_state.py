"""The CPU-offloaded optimizer's host state, built at start-up instead of inside the first optimizer step.

Why: Megatron-Core's ``HybridDeviceOptimizer`` allocates, in its first step, one FP32 staging buffer per host-side
parameter for the gradient's copy (page-locked with ``pin_cpu_grads``, its default), and torch's AdamW creates its
two FP32 moments on first use. At Qwen3-8B with 0.8 of the state on the host that is ~79 GB (12 B per host
parameter) allocated and touched inside step 1: its optimizer step took 23.5 s against step 2's 2.1 s (one H100,
bench/RESULTS.md, 2026-12-07), so step 1's time was not the run's step time, and a host too small for the state
failed only after the first rollout. Built at start-up, step 1 steps in the state later steps use, and a host that
cannot hold it fails before any rollout.

What: the objects the first step would create, created the same way: the staging buffer allocated and bound to the
host parameter's ``.grad`` as Megatron's gradient copy does on first use (it refills a bound buffer and never
re-binds it), and the moments by the host optimizer's own lazy initialization (torch's ``Adam._init_group``: its
layout, fused or not). The first step then fills and steps them; its result is the lazily built run's bit for bit
(tests/test_megatron_optimizer_offload.py). What already exists is left as it is: after an earlier step both; after a
checkpoint load the moments (loaded), while the staging buffers are new (Megatron's load rebuilds its sub-optimizers).

Given the host memory available (``available_bytes``) and the ranks that build at once on this host, it first checks
that their state fits and raises :class:`HostMemoryError` before allocating anything: a host that runs out while
pinning or zeroing ~79 GB is ended by the kernel's OOM killer without a message.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch

from jetrl_megatron.errors import UserError

__all__ = ["HostMemoryError", "HostStateBuild", "build_host_state", "check_host_fits", "host_state_bytes"]

log = logging.getLogger(__name__)

# torch.optim.Adam._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
# the lazy initialization every torch release since 2.0 runs at the top of step()
_INIT_GROUP_ARGS = 7


@dataclass(frozen=True)
class HostStateBuild:
    """What :func:`build_host_state` created: tensors, bytes (staging buffers + moments), wall seconds."""

    staging_buffers: int
    moment_tensors: int
    bytes: int
    seconds: float

    def summary(self) -> str:
        if not (self.staging_buffers or self.moment_tensors):
            return "host optimizer state already built (nothing created)"
        return (f"host optimizer state built at start-up: {self.bytes / 2**30:.2f} GiB ({self.staging_buffers} "
                f"gradient staging buffers, {self.moment_tensors} Adam moment tensors) in {self.seconds:.1f} s")


class HostMemoryError(UserError):
    """The host cannot hold the CPU-offloaded optimizer's state; nothing was allocated."""


def _host_params(hdo):
    """(host optimizer, host FP32 master) pairs, in the hybrid optimizer's order."""
    for opt in hdo.cpu_optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                yield opt, param


def _lazy_init(opt: torch.optim.Optimizer):
    """The optimizer's own lazy state initialization (torch's ``Adam._init_group``; AdamW is an Adam), or None where
    there is no known one (another class, or another torch's signature): its moments are then left to its first
    step."""
    init = getattr(opt, "_init_group", None)
    if not isinstance(opt, torch.optim.Adam) or init is None \
            or len(inspect.signature(init).parameters) != _INIT_GROUP_ARGS:
        return None
    return init


def host_state_bytes(hdo) -> int:
    """Bytes :func:`build_host_state` would allocate for ``hdo`` now: a staging buffer per host master that has none
    and, where the build makes them, two moments of its size per master without optimizer state."""
    total = 0
    for opt, param in _host_params(hdo):
        size = param.numel() * param.element_size()
        moments = 0 if opt.state.get(param) or _lazy_init(opt) is None else 2 * size
        total += (0 if param in hdo.cpu_copy_map_grad else size) + moments
    return total


def _staging_buffers(hdo) -> tuple[int, int]:
    """Megatron's gradient staging buffer for every host parameter that has none yet: (count, bytes)."""
    count = nbytes = 0
    for _, param in _host_params(hdo):
        if param in hdo.cpu_copy_map_grad:
            continue
        buf = torch.empty(param.shape, dtype=param.dtype, pin_memory=hdo.pin_cpu_grads, device="cpu")
        hdo.cpu_copy_map_grad[param] = buf
        param.grad = buf
        count += 1
        nbytes += buf.numel() * buf.element_size()
    return count, nbytes


def _moments(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """The host optimizer's state for every parameter that has a ``.grad`` and no state yet, by its own lazy init:
    (tensors created, bytes)."""
    init = _lazy_init(opt)
    if init is None:
        log.warning("optimizer host state: %s's moments are left to its first step (no known lazy init)",
                    type(opt).__name__)
        return 0, 0

    def moments() -> list[torch.Tensor]:  # not the step counter: a scalar
        return [t for s in opt.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)]

    before = {id(t) for t in moments()}
    for group in opt.param_groups:
        init(group, [], [], [], [], [], [])
    made = [t for t in moments() if id(t) not in before]
    return len(made), sum(t.numel() * t.element_size() for t in made)


def check_host_fits(need_bytes: int, available_bytes: int | None, ranks_on_host: int = 1) -> None:
    """Raise :class:`HostMemoryError` when ``ranks_on_host`` ranks each allocating ``need_bytes`` exceed
    ``available_bytes`` (None: not known, no check). A necessary condition only: what the engine's sleep and the
    rest of the run add later is ``jetrl plan``'s to count."""
    total = need_bytes * max(1, ranks_on_host)
    if available_bytes is None or total <= available_bytes:
        return
    ranks = f"{need_bytes / 2**30:.1f} GiB per rank x {ranks_on_host} ranks on this host = " \
        if ranks_on_host > 1 else ""
    raise HostMemoryError(
        f"optimizer CPU offload: the host optimizer state (gradient staging buffers and Adam moments, 12 B per "
        f"host parameter) needs {ranks}{total / 2**30:.1f} GiB, but this host has {available_bytes / 2**30:.1f} GiB "
        f"available ({(total - available_bytes) / 2**30:.1f} GiB short); nothing was allocated. Lower "
        "policy.megatron_cfg.optimizer.optimizer_offload_fraction (`jetrl plan --host-mem-gib N` names the "
        "fractions that fit) or free host memory")


def build_host_state(hdo) -> HostStateBuild:
    """Create ``hdo``'s (a ``HybridDeviceOptimizer``) host-side first-step state now; see the module doc."""
    t0 = time.perf_counter()
    staged, nbytes = _staging_buffers(hdo)
    moments = 0
    for opt in hdo.cpu_optimizers:
        made, made_bytes = _moments(opt)
        moments += made
        nbytes += made_bytes
    return HostStateBuild(staged, moments, nbytes, time.perf_counter() - t0)
