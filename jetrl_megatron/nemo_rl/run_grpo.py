"""Run NeMo-RL's GRPO with the Jet-RL Megatron policy worker:

    python -m jetrl_megatron.nemo_rl.run_grpo --config recipes/nemo_rl/grpo_math_8B_megatron_jetrl.yaml [overrides]

The driver runs NeMo-RL's own ``examples/run_grpo.py`` unchanged (same arguments, same Hydra overrides) after four
steps in this process: it checks the NeMo-RL source against ``contract.py``, loads the config the way
``run_grpo.py`` does and refuses a policy the Jet-RL worker cannot run (naming the key), adds the Jet-RL actor to
NeMo-RL's actor-environment registry, and makes ``Policy`` start the Jet-RL worker where it would start its
``MegatronPolicyWorker`` (by wrapping ``resolve_policy_worker_cls`` in ``lm_policy``'s namespace). With
``patches/nemo-rl-v0.7.0-jetrl-worker.patch`` applied, stock ``run_grpo.py`` can do the same from the config alone
(``policy.worker_cls``); the driver works with or without the patch.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from jetrl_megatron.errors import UserError
from jetrl_megatron.nemo_rl.contract import NEMO_RL_VERSION, check_source
from jetrl_megatron.nemo_rl.policy_cfg import PolicyPlan, hosted_form, policy_plan
from jetrl_megatron.nemo_rl.registry import MEGATRON_WORKER_FQN, WORKER_FQN, register_actor_environments

__all__ = ["main", "nemo_rl_root", "preflight", "select_jetrl_worker", "install"]


def nemo_rl_root(explicit: str | None = None) -> Path:
    """NeMo-RL's source root (holding ``nemo_rl/`` and ``examples/run_grpo.py``): ``--nemo-rl-root``, else
    ``$NEMO_RL_ROOT``, else the checkout the imported ``nemo_rl`` comes from."""
    if explicit or os.environ.get("NEMO_RL_ROOT"):
        root = Path(explicit or os.environ["NEMO_RL_ROOT"])
    else:
        import nemo_rl

        root = Path(nemo_rl.__file__).resolve().parents[1]
    if not (root / "examples" / "run_grpo.py").is_file():
        raise UserError(f"--nemo-rl-root: {root} has no examples/run_grpo.py; pass NeMo-RL v{NEMO_RL_VERSION}'s "
                        "source checkout (or set NEMO_RL_ROOT)")
    return root


def preflight(config_path: str, overrides: list[str]) -> PolicyPlan:
    """Load the config as ``run_grpo.py`` does and check its policy for the Jet-RL worker."""
    return load_checked(config_path, overrides)[0]


def load_checked(config_path: str, overrides: list[str]) -> tuple[PolicyPlan, dict[str, Any] | None]:
    """(plan, the resolved config with its policy in the hosted form, or None when it is written that way already).

    A config in the standalone form of the jetrl switches (``fp8_cfg.enabled: true``, ``precision: fp8``) must not
    reach NeMo-RL as written: it would turn on TransformerEngine FP8 training and vLLM's re-quantization."""
    from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    try:
        cfg = load_config(config_path)
    except FileNotFoundError as e:
        raise UserError(f"--config {config_path}: {e}; recipes/nemo_rl/*.yaml inherit NeMo-RL's examples/configs/*: "
                        "copy them into that directory") from None
    if overrides:
        cfg = parse_hydra_overrides(cfg, overrides)
    resolved: Any = OmegaConf.to_container(cfg, resolve=True)
    plan = policy_plan(resolved["policy"])
    hosted = hosted_form(resolved["policy"], plan.shape.num_layers)
    return plan, (None if hosted == resolved["policy"] else dict(resolved, policy=hosted))


def select_jetrl_worker(lm_policy: ModuleType) -> None:
    """Make ``lm_policy.Policy`` resolve NeMo-RL's Megatron worker to the Jet-RL worker (idempotent)."""
    original = lm_policy.resolve_policy_worker_cls
    if getattr(original, "jetrl_wrapped", False):
        return

    def resolve_policy_worker_cls(default_cls: str, config: dict) -> str:
        if default_cls == MEGATRON_WORKER_FQN:
            return WORKER_FQN
        return original(default_cls, config)

    resolve_policy_worker_cls.jetrl_wrapped = True
    lm_policy.resolve_policy_worker_cls = resolve_policy_worker_cls


def install() -> None:
    """Register the Jet-RL actor's environment and select it as the Megatron policy worker, in this process."""
    from nemo_rl.distributed import ray_actor_environment_registry
    from nemo_rl.models.policy import lm_policy

    register_actor_environments(ray_actor_environment_registry.ACTOR_ENVIRONMENT_REGISTRY)
    select_jetrl_worker(lm_policy)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="NeMo-RL GRPO with the Jet-RL Megatron policy worker")
    parser.add_argument("--config", required=True, help="NeMo-RL GRPO YAML (see recipes/nemo_rl/)")
    parser.add_argument("--nemo-rl-root", default=None, help="NeMo-RL source checkout (default: $NEMO_RL_ROOT or "
                                                             "the one nemo_rl is imported from)")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    root = nemo_rl_root(args.nemo_rl_root)
    problems = check_source(root)
    if problems:
        raise UserError(f"{root} differs from NeMo-RL v{NEMO_RL_VERSION} where the Jet-RL worker relies on it: "
                        + "; ".join(problems[:5]))
    plan, rewritten = load_checked(args.config, overrides)
    print(f"Jet-RL worker: {plan.shape.name}, recipe {plan.recipe.to_dict()}")
    config, overrides = args.config, list(overrides)
    if rewritten is not None:  # the standalone form of the jetrl switches: NeMo-RL gets the hosted form
        import tempfile

        from omegaconf import OmegaConf

        config = str(Path(tempfile.mkdtemp(prefix="jetrl_hosted_")) / Path(args.config).name)
        OmegaConf.save(OmegaConf.create(rewritten), config)
        overrides = []  # already applied
        print(f"Jet-RL worker: {args.config} selects jetrl in the standalone form; NeMo-RL runs its hosted form, "
              f"written to {config}")
    install()
    script = root / "examples" / "run_grpo.py"
    sys.argv = [str(script), "--config", config, *overrides]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
