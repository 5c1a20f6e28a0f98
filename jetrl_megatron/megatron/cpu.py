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

A sixth, scoped (:func:`host_offload_scope`): Megatron's hybrid CPU-offload optimizer decides what to offload by
``tensor.is_cuda`` and moves state with ``.cpu()`` / ``pin_memory()`` / CUDA streams. Inside the scope, on a CPU-only
box, every tensor counts as device memory except host copies (results of ``.cpu()``, ``.to("cpu")``,
``pin_memory()``, ``device="cpu"`` factories, and whatever is computed from them); moving between the two makes a
copy, as it would on a GPU, and the stream calls are no-ops. So the optimizer runs its real offload path (a host
copy, a D2H gradient copy, a host Adam step, an H2D parameter copy) on one device.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import weakref
from collections.abc import Callable, Iterator
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
    "host_offload_scope",
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
        host = _STATE.get("host")
        if host is not None:
            return host.call(_redirect, func, args, kwargs)
        return _redirect(func, args, kwargs)


def _redirect(func, args, kwargs):
    """The CUDA -> CPU rewrite of one call. A module function, not a static method: torch.compile'd code (vLLM's
    CPU sampler) traces through this mode, and dynamo cannot guard on a static method looked up on the mode."""
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


_IS_CUDA_GET = torch.Tensor.is_cuda.__get__
_TO_HOST = (torch.Tensor.cpu, torch.Tensor.pin_memory)


class _HostTensors:
    """The CPU tensors that stand for host memory inside :func:`host_offload_scope` (all others are "device")."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def __contains__(self, t: Any) -> bool:
        r = self._refs.get(id(t)) if isinstance(t, torch.Tensor) else None
        return r is not None and r() is t

    def add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            key = id(t)
            self._refs[key] = weakref.ref(t, lambda _r, k=key: self._refs.pop(k, None))
        elif isinstance(t, (list, tuple)):
            for x in t:
                self.add(x)

    def _any_host(self, xs: Any) -> bool:
        for x in xs:
            if x in self or (isinstance(x, (list, tuple)) and self._any_host(x)):
                return True
        return False

    def call(self, redirect: Callable, func, args: tuple, kwargs: dict) -> Any:
        if func == _IS_CUDA_GET:
            return args[0] not in self
        dev = kwargs.get("device")
        to_dev = args[1] if func is torch.Tensor.to and len(args) > 1 else kwargs.get("device") \
            if func is torch.Tensor.to else None
        kwargs.pop("pin_memory", None)
        src_host = bool(args) and args[0] in self
        if func in _TO_HOST or (func is torch.Tensor.to and _is_cpu_device(to_dev)):
            # a D2H move is a copy; pinning has no meaning without an accelerator
            out = args[0] if func is torch.Tensor.pin_memory else redirect(func, args, kwargs)
            out = out.clone() if out is args[0] and not src_host else out
            self.add(out)
            return out
        if func is torch.Tensor.cuda or (func is torch.Tensor.to and _is_cuda_device(to_dev)):
            out = redirect(func, args, kwargs)
            return out.clone() if out is args[0] and src_host else out  # an H2D move is a copy
        out = redirect(func, args, kwargs)
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.endswith("__")
        if not in_place and (_is_cpu_device(dev) or self._any_host(args) or self._any_host(kwargs.values())):
            self.add(out)
        return out


def _is_cpu_device(dev: Any) -> bool:
    return (isinstance(dev, torch.device) and dev.type == "cpu") or dev == "cpu"


class _NoStream:
    """Stands for a CUDA stream or event on a CPU-only box: ordering is already sequential."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _NoStream:
        return self

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def host_offload_scope() -> Iterator[None]:
    """Run Megatron's hybrid CPU-offload optimizer on a CPU-only box through its real offload path (module doc).

    A no-op with CUDA or outside CPU mode. Re-entrant: an inner scope keeps the outer scope's host tensors.
    """
    if not _STATE["active"] or _STATE.get("host") is not None:
        yield
        return
    saved = (torch.cuda.current_stream, torch.cuda.Stream, torch.cuda.stream)
    _STATE["host"] = _STATE.setdefault("host_tensors", _HostTensors())
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.Stream = _NoStream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_stream, torch.cuda.Stream, torch.cuda.stream = saved
        _STATE["host"] = None


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


# How :func:`spawn` starts its ranks: "spawn" (a fresh interpreter each) or "forkserver" (forked from one server
# process per caller, started once with the modules of SPAWN_PRELOAD imported). Why the knob: the tests start dozens
# of worlds, and a fresh rank spends ~7 s of CPU importing torch, Megatron and vLLM before it does anything
# (tests/conftest.py sets "forkserver").
SPAWN_START_METHOD = "spawn"
SPAWN_PRELOAD = ("torch", "megatron.core.parallel_state", "megatron.core.models.gpt", "jetrl_megatron.megatron.model",
                 "jetrl_megatron.rl.trainer", "pytest")


def _spawn_entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple,
                 env: dict[str, str] | None = None) -> None:
    if env is not None:  # a forkserver's child starts with the server's environment: take the caller's
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init_parallel(1, 1, rank=rank, world_size=world_size, master_port=port)
    try:
        fn(rank, world_size, *args)
    finally:
        teardown_parallel()


def spawn(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes (``SPAWN_START_METHOD``) with gloo
    initialised, in the caller's environment.

    ``fn`` must be importable (module level) and may call :func:`init_parallel` with other TP/PP sizes.
    An exception in any rank is re-raised here.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    env = None
    if SPAWN_START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(list(SPAWN_PRELOAD))  # read when the server starts (once)
        env = dict(os.environ)
    mp.start_processes(_spawn_entry, args=(fn, world_size, free_port(), args, env), nprocs=world_size, join=True,
                       start_method=SPAWN_START_METHOD)
