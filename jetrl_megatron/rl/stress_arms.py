"""The experiment-only stressed arms of the mismatch dose-response (docs/rl.md), and the checks that keep them out
of production runs.

Two arms per stress format (fp8/stress.py), both on the bf16 arm (BF16 refit, BF16 masters):

    offpolicy_<format>   BF16 trainer, the rollout's linears in <format>: the trainer-vs-rollout mismatch grows
                         with the format's coarseness
    unified_<format>     the trainer's forward in <format> too (straight-through gradients to the BF16 master), the
                         rollout serving the same weights the same way: the mismatch stays zero on CPU

They are selected by ``policy.jet_rl.stress.format`` / ``.trainer``; ``jetrl compare --arms`` takes the arm names
above next to the production arms. GPU recipes refuse them: the formats are emulated (FP64 GEMMs on CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jetrl_megatron.rl.config.yaml_tree import ConfigError

if TYPE_CHECKING:
    from jetrl_megatron.fp8.stress import StressFormat
    from jetrl_megatron.rl.config import RunConfig

ARM_KINDS = {"offpolicy": False, "unified": True}  # arm prefix -> whether the trainer runs the format


class StressConfigError(ConfigError):
    """A stress key is set where the experiment cannot run (GPU recipe, another arm, the final probe)."""


def _format_names() -> tuple[str, ...]:
    from jetrl_megatron.fp8.stress import STRESS_FORMATS

    return tuple(STRESS_FORMATS)


def parse_arm(arm: str) -> tuple[str, bool] | None:
    """``offpolicy_mxfp4`` -> ("mxfp4", False), ``unified_mxfp4`` -> ("mxfp4", True); None for any other name."""
    kind, _, fmt = arm.partition("_")
    if kind in ARM_KINDS and fmt in _format_names():
        return fmt, ARM_KINDS[kind]
    return None


def stressed_arm_names(formats: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """Both arms of each format (all formats by default), off-policy first."""
    return [f"{kind}_{fmt}" for fmt in (formats or _format_names()) for kind in ARM_KINDS]


def is_compare_arm(arm: str) -> bool:
    from jetrl_megatron.rl.config.run_config import ARM_MODES

    return arm in ARM_MODES or parse_arm(arm) is not None


def compare_arm_overrides(arm: str) -> list[str]:
    """The overrides that select ``arm``: a production arm (its NeMo-RL switches, stress off) or a stressed one
    (the bf16 arm's switches plus the stress keys)."""
    from jetrl_megatron.rl.config import arm_overrides

    parsed = parse_arm(arm)
    if parsed is None:
        return [*arm_overrides(arm), "policy.jet_rl.stress.format=null", "policy.jet_rl.stress.trainer=false"]
    fmt, trainer = parsed
    return [*arm_overrides("bf16"), f"policy.jet_rl.stress.format={fmt}",
            f"policy.jet_rl.stress.trainer={str(trainer).lower()}"]


def check_stress(cfg: RunConfig) -> None:
    """Refuse stress keys outside the experiment: an unknown format, a GPU recipe, an arm other than bf16, the
    trainer switch without a format, the final arm probe (it measures the production arms); GPU runs only with
    ``stress.gpu`` (one GPU)."""
    s = cfg.policy.jet_rl.stress
    if s.format is None:
        if s.trainer:
            raise StressConfigError("policy.jet_rl.stress.trainer: true needs policy.jet_rl.stress.format (one of "
                                    f"{list(_format_names())})")
        return
    if s.format not in _format_names():
        raise StressConfigError(f"policy.jet_rl.stress.format: {s.format!r} is not one of {list(_format_names())}")
    if cfg.is_gpu and not s.gpu:
        raise StressConfigError(f"policy.jet_rl.stress.format={s.format}: the stress formats are an experiment "
                                f"(emulated GEMMs, no production kernels) and are refused in GPU recipes "
                                f"(cluster.gpus_per_node = {cfg.cluster.gpus_per_node}); unset it, or set "
                                "policy.jet_rl.stress.gpu=true to run the experiment on one GPU")
    if cfg.is_gpu and cfg.cluster.gpus_per_node * cfg.cluster.num_nodes != 1:
        raise StressConfigError(f"policy.jet_rl.stress.gpu: a stress experiment runs on one GPU, the recipe asks for "
                                f"{cfg.cluster.num_nodes} node(s) x {cfg.cluster.gpus_per_node} GPUs")
    if cfg.arm != "bf16":
        raise StressConfigError(f"policy.jet_rl.stress.format={s.format}: stressed arms are built on the bf16 arm "
                                f"(BF16 masters and refit), got arm {cfg.arm!r}; use `--arm bf16` or the compare arms "
                                f"{stressed_arm_names([s.format])}")
    if cfg.policy.jet_rl.final_arm_probe:
        raise StressConfigError(f"policy.jet_rl.stress.format={s.format}: policy.jet_rl.final_arm_probe measures the "
                                "production arms and cannot run a stressed one; set it to false")


def trainer_stress(cfg: RunConfig) -> StressFormat | None:
    """The format of the trainer's FP8-eligible linears (the unified arm), or None."""
    s = cfg.policy.jet_rl.stress
    if s.format is None or not s.trainer:
        return None
    from jetrl_megatron.fp8.stress import stress_format

    return stress_format(s.format)


def rollout_stress(cfg: RunConfig) -> str | None:
    """The rollout engine's stress format (both stressed arms), or None."""
    return cfg.policy.jet_rl.stress.format
