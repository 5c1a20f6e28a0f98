"""Run Megatron-Core on CPU with gloo (CI and the embedded default), plus process-group helpers.

Why: Megatron-Core 0.16 hard-codes CUDA in a few places (``device=torch.cuda.current_device()`` factory calls,
``torch.cuda.synchronize()`` in schedules, the model-parallel RNG tracker's ``fork()``). Four small runtime patches
were measured to be enough for GPTModel + TP/PP layers + p2p + ``get_forward_backward_func()`` on CPU:

1. a ``TorchFunctionMode`` that maps ``device="cuda"`` (and ``.cuda()`` / ``.to("cuda")``) to CPU,
2. ``torch.cuda.current_device`` -> ``"cpu"``,
3. ``torch.cuda.synchronize`` -> no-op,
4. ``CudaRNGStatesTracker.fork`` -> null context (dropout is 0 in our configs, so no RNG state is forked).

A fifth, for the optimizer only: inside the same mode ``Tensor.type()`` (no arguments) reports CPU tensors under
their ``torch.cuda.*Tensor`` name, because Megatron's mixed-precision optimizer accepts parameters by that name.

They are applied only when CUDA is absent, at most once per process, and can be undone (tests).
Megatron's files are never edited; this module only rebinds attributes at runtime.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = [
    "enable_cpu_mode",
    "disable_cpu_mode",
    "cpu_mode_active",
    "init_parallel",
    "teardown_parallel",
    "free_port",
    "spawn",
]


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA placements to CPU: ``device=`` kwargs, ``Tensor.cuda()`` and ``Tensor.to(cuda)``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's mixed-precision optimizer accepts only 'torch.cuda.*Tensor' type names.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        dev = kwargs.get("device")
        if dev is not None and (_is_cuda_device(dev) or (isinstance(dev, int) and not isinstance(dev, bool))):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and (_is_cuda_device(args[1]) or type(args[1]) is int):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_STATE: dict[str, Any] = {"active": False}


def cpu_mode_active() -> bool:
    """True while the CPU patches are installed in this process."""
    return bool(_STATE["active"])


def enable_cpu_mode() -> bool:
    """Install the four CPU patches if CUDA is absent. Idempotent. Returns whether CPU mode is active."""
    if torch.cuda.is_available():
        return False
    if _STATE["active"]:
        return True
    from megatron.core.tensor_parallel import random as mp_random

    mode = _CudaToCpuMode()
    mode.__enter__()
    _STATE.update(
        active=True,
        mode=mode,
        current_device=torch.cuda.current_device,
        synchronize=torch.cuda.synchronize,
        fork=mp_random.CudaRNGStatesTracker.fork,
    )
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    mp_random.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    return True


def disable_cpu_mode() -> None:
    """Undo :func:`enable_cpu_mode` (no-op when inactive)."""
    if not _STATE["active"]:
        return
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = _STATE["current_device"]
    torch.cuda.synchronize = _STATE["synchronize"]
    mp_random.CudaRNGStatesTracker.fork = _STATE["fork"]
    _STATE["mode"].__exit__(None, None, None)
    _STATE.clear()
    _STATE["active"] = False


def free_port() -> int:
    """A free TCP port on localhost for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_port: int | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Initialise torch.distributed (gloo on CPU, nccl on CUDA) if needed, then Megatron's parallel state.

    Without ``rank``/``world_size`` the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) is used, or a
    single process. Calling it again with other sizes re-creates only Megatron's model-parallel groups.
    DP = world_size / (tp * pp).
    """
    from megatron.core import parallel_state

    enable_cpu_mode()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        # Rendezvous by an explicit tcp:// address rather than by writing MASTER_PORT into os.environ: a port left in
        # the environment leaks into child processes (a CLI run launched from a test, a colocated engine) and
        # collides with the socket this process still holds.
        if master_port is not None:
            init_method = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{master_port}"
        elif "MASTER_PORT" in os.environ:
            init_method = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
        elif world_size > 1:
            raise ValueError("init_parallel: world_size > 1 needs master_port or MASTER_PORT")
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    ws = dist.get_world_size()
    if ws % (tp * pp):
        raise ValueError(f"init_parallel: world size {ws} is not divisible by tp*pp = {tp}*{pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def teardown_parallel(destroy_process_group: bool = True) -> None:
    """Destroy Megatron's parallel state and (optionally) the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()


def _spawn_entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init_parallel(1, 1, rank=rank, world_size=world_size, master_port=port)
    try:
        fn(rank, world_size, *args)
    finally:
        teardown_parallel()


def spawn(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with gloo initialised.

    ``fn`` must be importable (module level) and may call :func:`init_parallel` with other TP/PP sizes.
    An exception in any rank is re-raised here.
    """
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
