"""Megatron optimizer + the Jet-RL hook: refresh the FP8 weight cache exactly once per successful step.

Why a wrapper and a constant loss scale of 1.0: Megatron's BF16 optimizer only checks gradients for NaN/Inf when a
grad scaler exists; ``ConstantGradScaler(1.0)`` turns that check on (the found-inf flag is all-reduced over the
model-parallel group, so every rank agrees) at no numerical cost (scaling by 1.0 is exact). A step with non-finite
grads then returns ``update_successful=False`` before any parameter is touched, and the wrapper leaves the FP8
cache untouched and records the skip.

Staleness: Megatron copies the updated FP32 main params into the BF16 model params through ``param.data``, which
does not bump ``param._version``, so the cache's version check alone would not notice the update. After a
successful step the wrapper bumps each FP8 parameter's version (``torch.autograd.graph.increment_version``)
and then refreshes the cache; any FP8 forward between Megatron's copy and the refresh would raise
``StaleFp8WeightError`` rather than silently use old bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from jetrl_megatron.megatron.model import fp8_linears, refresh_fp8_cache, unwrap

__all__ = ["Fp8RefreshingOptimizer", "build_optimizer", "OptimizerStats"]

log = logging.getLogger(__name__)


@dataclass
class OptimizerStats:
    steps: int = 0
    skipped: int = 0
    refreshes: int = 0
    skipped_at: list[int] = field(default_factory=list)


class Fp8RefreshingOptimizer:
    """Wraps a Megatron optimizer; ``step()`` has Megatron's return value ``(ok, grad_norm, num_zeros)``."""

    def __init__(self, optimizer, model_chunks: list[torch.nn.Module]) -> None:
        self.optimizer = optimizer
        self.model_chunks = list(model_chunks)
        self.stats = OptimizerStats()

    def step(self) -> tuple[bool, Any, Any]:
        ok, grad_norm, num_zeros = self.optimizer.step()
        self.stats.steps += 1
        if not ok:
            self.stats.skipped += 1
            self.stats.skipped_at.append(self.stats.steps)
            log.warning("optimizer step %d skipped: non-finite gradients; FP8 weight cache left untouched",
                        self.stats.steps)
            return ok, grad_norm, num_zeros
        for chunk in self.model_chunks:
            for _, module in fp8_linears(chunk):
                torch.autograd.graph.increment_version(module.weight)
            refresh_fp8_cache(chunk)
        self.stats.refreshes += 1
        return ok, grad_norm, num_zeros

    def __getattr__(self, name: str) -> Any:  # zero_grad, scale_loss, state_dict, param_groups, ...
        return getattr(self.optimizer, name)


def build_optimizer(model_chunks, *, lr: float = 1e-5, weight_decay: float = 0.0, clip_grad: float = 1.0,
                    adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8,
                    **optimizer_config: Any) -> Fp8RefreshingOptimizer:
    """Megatron's mixed-precision Adam (FP32 main params) over DDP-wrapped chunks, with the FP8 refresh hook."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for c in chunks:
        unwrap(c)  # type check
        if not hasattr(c, "zero_grad_buffer"):
            raise TypeError("build_optimizer needs DDP-wrapped chunks (jetrl_megatron.megatron.model.wrap_ddp)")
    cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                          adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps, bf16=True,
                          params_dtype=torch.bfloat16, loss_scale=1.0, use_distributed_optimizer=False,
                          **optimizer_config)
    return Fp8RefreshingOptimizer(get_megatron_optimizer(cfg, chunks), chunks)
