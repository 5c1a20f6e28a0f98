"""The run's numerics and checking switches, with their environment overrides applied once, when the config loads.

Why one place: each switch is a ``policy.jet_rl`` key that an environment variable may override (for a quick
experiment on a submitted job without editing its YAML). Read once here into :class:`RunSwitches` (held by
``RunConfig.switches``), every consumer - the trainer's model context, the rollout engine's config, the per-step
checks - sees the same resolved value; nothing reads the environment later. Precedence (docs/config.md): the
variable when it is set, else the config key, else the key's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jetrl_megatron.recipe import ELEMENTWISE_IMPLS
from jetrl_megatron.rl.config.schema import JetRlCfg
from jetrl_megatron.rl.config.yaml_tree import ConfigError

__all__ = ["RunSwitches", "SWITCH_ENV", "resolve_switches"]

# RunSwitches field -> (environment variable, policy.jet_rl key)
SWITCH_ENV: dict[str, tuple[str, str]] = {
    "elementwise": ("JETRL_ELEMENTWISE", "elementwise"),
    "reference_quant": ("JETRL_FP8_REFERENCE_QUANT", "fp8_reference_quant"),
    "verify_served_fp8": ("JETRL_VERIFY_SERVED_FP8", "verify_served_fp8"),
    "verify_refit": ("JETRL_VERIFY_REFIT", "verify_refit"),
    "refit_cuda_graph": ("JETRL_REFIT_CUDA_GRAPH", "refit_cuda_graph"),
    "fp8_gemm_warmup": ("JETRL_FP8_GEMM_WARMUP", "fp8_gemm_warmup"),
}


@dataclass(frozen=True)
class RunSwitches:
    """The resolved switches. ``None`` for the two verify switches keeps their device default (on for CPU)."""

    elementwise: str = "auto"  # element-wise kernels of the trainer's models (megatron.numerics.ElementwiseKernels)
    reference_quant: bool = False  # torch reference quantizer for CUDA tensors (trainer and rollout)
    verify_served_fp8: bool | None = None  # read vLLM's FP8 weights back each step (None: CPU only)
    verify_refit: bool | None = None  # compare every refit's written bytes (None: CPU only)
    refit_cuda_graph: bool = False
    fp8_gemm_warmup: bool = False


def _flag(env: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    value = env.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ConfigError(f"${name}={value!r}: must be 0 or 1 (or unset to use the config key)")
    return value == "1"


def resolve_switches(jr: JetRlCfg, env: Mapping[str, str]) -> RunSwitches:
    """``policy.jet_rl``'s switches with ``env``'s overrides (the variable wins when set)."""
    values = {}
    for name, (var, key) in SWITCH_ENV.items():
        default = getattr(jr, key)
        if name == "elementwise":
            value = env.get(var) or default
            if value not in ELEMENTWISE_IMPLS:
                where = f"${var}" if env.get(var) else f"policy.jet_rl.{key}"
                raise ConfigError(f"{where}: {value!r} is not one of {ELEMENTWISE_IMPLS}")
            values[name] = value
        elif name in ("verify_served_fp8", "verify_refit"):
            values[name] = _flag(env, var, default)
        else:
            values[name] = bool(_flag(env, var, default))
    return RunSwitches(**values)
