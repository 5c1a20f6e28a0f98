"""Jet-RL inside NeMo-RL v0.7.0: a Megatron policy worker that trains this project's FP8 model and refits vLLM with
the trainer's FP8 bytes, and a driver that runs NeMo-RL's own ``examples/run_grpo.py`` with it (docs/nemo_rl.md).

``worker.py`` and ``run_grpo.py`` import NeMo-RL and are used only inside a NeMo-RL installation; ``contract.py``
(what the glue relies on in NeMo-RL, and its checker) and ``registry.py`` do not. Nothing else in
``jetrl_megatron`` imports this package: it imports ``jetrl_megatron.rl`` and the layers below, never the other way.
The logic — model build, FP8 cache refresh, refit stream, config checks — lives in ``hosted_policy.py``,
``hf_refit.py`` and ``policy_cfg.py``, which import nothing of NeMo-RL and are tested without it.
"""
