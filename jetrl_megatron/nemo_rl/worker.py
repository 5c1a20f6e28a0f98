"""The Jet-RL Megatron policy worker for NeMo-RL v0.7.0 (NeMo-RL's ``MegatronPolicyWorkerImpl``, four methods
overridden; every NeMo-RL name used here is listed in ``contract.py``).

* the model: NeMo-RL builds its chunks through Megatron-Bridge's ``provider.provide``; while it does, ``provide``
  is :class:`~jetrl_megatron.nemo_rl.hosted_policy.ChunkBuilder` (this project's spec: FP8 blockwise linears,
  rollout-matched numerics, TE-compatible checkpoint names), set by wrapping ``setup_model_and_optimizer`` and
  ``setup_reference_model_state`` in NeMo-RL's worker module, the one point between NeMo-RL's config and its
  model build;
* the FP8 weight cache: re-quantized once after each successful optimizer step (the deferred
  ``overlap_param_gather`` all-gather forced first), after the checkpoint load, and around the reference-policy
  weight swap;
* the refit: ``_iter_params_with_optional_kv_scales`` yields :class:`~jetrl_megatron.nemo_rl.hf_refit.HfRefitStream`:
  full HF-named tensors, FP8 linears as the trainer's E4M3 ``weight`` + FP32 ``weight_scale_inv`` (no
  re-quantization), BF16 tensors as BF16. vLLM loads them with the ``jetrl_fp8`` method named in
  ``policy.generation.vllm_kwargs``.

Imported by NeMo-RL's Ray worker builder, by dotted name, in the policy workers' Python environment.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import nemo_rl.models.policy.workers.megatron_policy_worker as mpw
import ray
import torch
from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker

from jetrl_megatron.megatron.backward_thread import backward_thread_scope
from jetrl_megatron.nemo_rl.hf_refit import HfRefitStream
from jetrl_megatron.nemo_rl.hosted_policy import ChunkBuilder, refresh_fp8_after_each_step, refresh_fp8_now
from jetrl_megatron.nemo_rl.policy_cfg import PolicyConfigError, policy_plan, uses_jetrl

__all__ = ["JetRLMegatronPolicyWorkerImpl", "JetRLMegatronPolicyWorker", "install_model_build"]


@contextmanager
def _provider_builds(provider: Any, builder: ChunkBuilder) -> Iterator[None]:
    """``provider.provide`` is ``builder`` while NeMo-RL builds chunks; afterwards the provider is its own again
    (it is saved with checkpoints as part of the run config)."""
    own = vars(provider).get("provide")  # an instance-level provide set by someone else, kept as it was
    provider.provide = builder
    try:
        yield
    finally:
        if own is None:
            del provider.provide
        else:
            provider.provide = own


def install_model_build() -> None:
    """Wrap NeMo-RL's ``setup_model_and_optimizer`` and ``setup_reference_model_state`` (in the worker module's
    namespace, once per process) so that Jet-RL policy configs get Jet-RL chunks; other configs pass through."""
    if getattr(mpw.setup_model_and_optimizer, "jetrl_wrapped", False):
        return
    setup_policy, setup_reference = mpw.setup_model_and_optimizer, mpw.setup_reference_model_state

    @functools.wraps(setup_policy)
    def setup_model_and_optimizer(policy_cfg: Any, megatron_cfg: Any, *args: Any, **kwargs: Any) -> Any:
        if not uses_jetrl(policy_cfg):
            return setup_policy(policy_cfg, megatron_cfg, *args, **kwargs)
        plan = policy_plan(policy_cfg)
        with _provider_builds(megatron_cfg.model, ChunkBuilder.for_plan(plan)):
            state = setup_policy(policy_cfg, megatron_cfg, *args, **kwargs)
        refresh_fp8_now(state.model)  # the checkpoint was loaded into the parameters after the build
        if state.optimizer is not None:
            refresh_fp8_after_each_step(state.optimizer, state.model)
        return state

    @functools.wraps(setup_reference)
    def setup_reference_model_state(config: Any, megatron_cfg: Any, *args: Any, **kwargs: Any) -> Any:
        if not uses_jetrl(config):
            return setup_reference(config, megatron_cfg, *args, **kwargs)
        plan = policy_plan(config)
        with _provider_builds(megatron_cfg.model, ChunkBuilder.for_plan(plan)):
            return setup_reference(config, megatron_cfg, *args, **kwargs)

    setup_model_and_optimizer.jetrl_wrapped = True
    mpw.setup_model_and_optimizer = setup_model_and_optimizer
    mpw.setup_reference_model_state = setup_reference_model_state


class JetRLMegatronPolicyWorkerImpl(mpw.MegatronPolicyWorkerImpl):
    """NeMo-RL's Megatron policy worker training the Jet-RL FP8 model and refitting vLLM with its FP8 bytes."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        if not uses_jetrl(config):
            raise PolicyConfigError("policy.generation.vllm_kwargs.quantization: the Jet-RL worker needs "
                                    "'jetrl_fp8' (see docs/nemo_rl.md)")
        self._hosted_plan = policy_plan(config)  # refuse a config it cannot run before the expensive set-up
        install_model_build()
        super().__init__(config, *args, **kwargs)
        self._refit_stream = HfRefitStream(self.model, self._hosted_plan.shape)

    def train(self, data: Any, loss_fn: Any, eval_mode: bool = False, gbs: int | None = None,
              mbs: int | None = None, check_dim_skip_keys: Any = None) -> Any:
        """NeMo-RL's train(), with autograd's backward on this thread unless policy.jet_rl.backward_thread says
        ``device`` (the same kernels in the same order; the FP8 linear's backward issues in about half the host time
        here: docs/config.md)."""
        with backward_thread_scope(self._hosted_plan.backward_thread):
            return super().train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs,
                                 check_dim_skip_keys=check_dim_skip_keys)

    def _calculate_refit_param_info(self) -> list[tuple[str, int]]:
        return [(name, dtype.itemsize * math.prod(shape)) for name, dtype, shape in self._refit_stream.metadata()]

    def _iter_params_with_optional_kv_scales(self, kv_scales: dict[str, float] | None = None,
                                             ) -> Iterator[tuple[str, torch.Tensor]]:
        if kv_scales:
            raise ValueError("the refit was given FP8 KV-cache scales, but the Jet-RL precision flow has no FP8 KV "
                             "cache: set policy.generation.vllm_cfg.kv_cache_dtype to 'auto'")
        yield from self._refit_stream

    @contextmanager
    def use_reference_model(self) -> Iterator[None]:
        with super().use_reference_model():
            refresh_fp8_now(self.model)  # the reference weights were copied into the parameters
            yield
        refresh_fp8_now(self.model)  # the policy's weights are back: the same bytes as before the swap


@ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))  # pragma: no cover
class JetRLMegatronPolicyWorker(JetRLMegatronPolicyWorkerImpl):
    """The Ray actor NeMo-RL starts (by dotted name) in place of its ``MegatronPolicyWorker``."""
