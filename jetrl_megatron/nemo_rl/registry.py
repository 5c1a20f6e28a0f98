"""Which Python environment NeMo-RL starts the Jet-RL actor in: the one of NeMo-RL's own Megatron policy worker.

NeMo-RL refuses to start an actor whose dotted class name is not in its ``ACTOR_ENVIRONMENT_REGISTRY``. This module
imports nothing of NeMo-RL: the driver passes it the registry dict, and NeMo-RL patched with
``patches/nemo-rl-v0.7.0-jetrl-worker.patch`` reads :data:`ACTOR_ENVIRONMENTS` through the
``nemo_rl.actor_environments`` entry-point group.
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["WORKER_FQN", "MEGATRON_WORKER_FQN", "ACTOR_ENVIRONMENTS", "register_actor_environments"]

WORKER_FQN = "jetrl_megatron.nemo_rl.worker.JetRLMegatronPolicyWorker"
MEGATRON_WORKER_FQN = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"

# actor class -> the NeMo-RL actor whose Python environment it runs in
ACTOR_ENVIRONMENTS: dict[str, str] = {WORKER_FQN: MEGATRON_WORKER_FQN}


def register_actor_environments(registry: MutableMapping[str, str]) -> list[str]:
    """Add the Jet-RL actors to NeMo-RL's registry dict (idempotent); returns their names."""
    for actor, same_as in ACTOR_ENVIRONMENTS.items():
        if same_as not in registry:
            raise KeyError(f"NeMo-RL's actor registry has no {same_as!r}, whose environment {actor} should use "
                           "(is this NeMo-RL v0.7.0?)")
        registry[actor] = registry[same_as]
    return list(ACTOR_ENVIRONMENTS)
