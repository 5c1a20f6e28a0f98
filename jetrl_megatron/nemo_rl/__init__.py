"""Jet-RL inside NeMo-RL v0.7.0: a Megatron policy worker that trains this project's FP8 model and refits vLLM with
the trainer's FP8 bytes, and a driver that runs NeMo-RL's own ``examples/run_grpo.py`` with it (docs/nemo_rl.md).

``worker.py`` and ``run_grpo.py`` import NeMo-RL and are used only inside a NeMo-RL installation; ``contract.py``
(what the glue relies on in NeMo-RL, and its checker) and ``registry.py`` do not. Nothing else in
``jetrl_megatron`` imports this package. The logic — model build, FP8 cache refresh, refit stream, config checks —
lives in ``jetrl_megatron.rl.hosted_policy``, ``rl.hf_refit`` and ``rl.nemo_rl_policy_cfg``, tested without NeMo-RL.
"""
