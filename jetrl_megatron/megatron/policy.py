"""One call that builds a trainable policy on this rank: model, DDP wrapper, optimizer and FP8 cache, wired in the
only order that keeps the cache right.

Why one call: the FP8 cache must be quantized from the weights the forward reads. DDP moves the parameters into its
contiguous buffers (so the cache is refilled after wrapping), and the optimizer must wrap exactly those buffers and
refresh the cache after each step. Built separately, a caller could wrap twice, build the optimizer over an
unwrapped model or disagree between DDP and the optimizer on the distributed optimizer; here there is one flag and
one order, so none of that can be written.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from jetrl_megatron.megatron.context import Fp8ModelContext
from jetrl_megatron.megatron.convert import load_hf_checkpoint
from jetrl_megatron.megatron.grad_buffers import ReleasableGradDDP
from jetrl_megatron.megatron.model import build_gpt, fp8_context, refresh_fp8_cache, unwrap
from jetrl_megatron.megatron.optim import Fp8RefreshingOptimizer, te_fused_adam_available
from jetrl_megatron.megatron.optimizer_settings import OptimizerSettings
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe

__all__ = ["OptimizerSettings", "Policy", "build_policy"]


@dataclass(frozen=True)
class Policy:
    """This rank's trainable policy: the DDP-wrapped model chunk and its FP8-refreshing optimizer."""

    model: ReleasableGradDDP
    optimizer: Fp8RefreshingOptimizer

    @property
    def gpt(self) -> torch.nn.Module:
        """The unwrapped model (an ``Fp8GPTModel``)."""
        return unwrap(self.model)

    @property
    def context(self) -> Fp8ModelContext:
        """Shape, recipe, global layers, numerics choices and the FP8 weight cache of the chunk."""
        return fp8_context(self.model)


def build_policy(shape: ModelShape, recipe: Fp8Recipe, *,
                 weights: str | os.PathLike | Mapping[str, torch.Tensor] | None = None,
                 grad_reduce_in_fp32: bool = True, use_distributed_optimizer: bool | None = None,
                 overlap_param_gather: bool = False, optimizer: OptimizerSettings | Mapping[str, Any] | None = None,
                 **model_kwargs: Any) -> Policy:
    """Build the model (:func:`~jetrl_megatron.megatron.model.build_gpt` with ``model_kwargs``), load ``weights``
    (an HF checkpoint directory or a name->tensor dict; None keeps the seeded random init), wrap it in Megatron's DDP
    and build Megatron's mixed-precision Adam over it, the FP8 cache refilled at each step that moved the weights.

    ``optimizer``: the :class:`OptimizerSettings` (the config's ``policy.megatron_cfg.optimizer``), or a mapping of
    its fields (the others keep their defaults) plus ``use_precision_aware_optimizer`` and any other keyword of
    Megatron's ``OptimizerConfig``. DDP: gradients reduced in FP32 unless ``grad_reduce_in_fp32=False``;
    ``use_distributed_optimizer`` (the settings' flag; given here, it must agree with them) reduce-scatters them and
    shards the FP32 main params and Adam moments over DP (the BF16 params then live in a buffer the optimizer
    all-gathers after its step, lazily in the next forward's pre-hooks with ``overlap_param_gather``; the optimizer
    forces that gather before it re-quantizes the cache).
    """
    settings, extra = _optimizer_settings(optimizer, use_distributed_optimizer)
    if overlap_param_gather and not settings.use_distributed_optimizer:
        raise ValueError("build_policy: overlap_param_gather needs use_distributed_optimizer=True")
    gpt = build_gpt(shape, recipe, **model_kwargs)
    if weights is not None:
        load_hf_checkpoint(gpt, weights)
    model = _wrap_ddp(gpt, grad_reduce_in_fp32=grad_reduce_in_fp32,
                      use_distributed_optimizer=settings.use_distributed_optimizer,
                      overlap_param_gather=overlap_param_gather)
    return Policy(model, _megatron_adam(model, settings, **extra))


def _optimizer_settings(optimizer: OptimizerSettings | Mapping[str, Any] | None,
                        use_distributed_optimizer: bool | None) -> tuple[OptimizerSettings, dict[str, Any]]:
    """The settings object and the further ``OptimizerConfig`` keywords from ``build_policy``'s arguments."""
    if isinstance(optimizer, OptimizerSettings):
        settings, extra = optimizer, {}
    else:
        extra = dict(optimizer or {})
        given = {f.name: extra.pop(f.name) for f in dataclasses.fields(OptimizerSettings) if f.name in extra}
        if use_distributed_optimizer is not None:
            given.setdefault("use_distributed_optimizer", use_distributed_optimizer)
        settings = OptimizerSettings(**given)
    if use_distributed_optimizer is not None and use_distributed_optimizer != settings.use_distributed_optimizer:
        raise ValueError(f"build_policy: use_distributed_optimizer={use_distributed_optimizer} contradicts the "
                         f"optimizer settings' use_distributed_optimizer={settings.use_distributed_optimizer}")
    return settings, extra


def _wrap_ddp(gpt: torch.nn.Module, *, grad_reduce_in_fp32: bool, use_distributed_optimizer: bool,
              overlap_param_gather: bool) -> ReleasableGradDDP:
    """Megatron DDP (no grad-reduce overlap) with grad buffers the GRPO loop can free during rollouts
    (:mod:`jetrl_megatron.megatron.grad_buffers`)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer,
                                               overlap_param_gather=overlap_param_gather, check_for_nan_in_grad=False)
    ddp = ReleasableGradDDP(config=gpt.config, ddp_config=ddp_config, module=gpt)
    refresh_fp8_cache(ddp)  # params were moved into the contiguous grad/param buffers
    return ddp


def _megatron_adam(model: ReleasableGradDDP, settings: OptimizerSettings, *,
                   use_precision_aware_optimizer: bool = False, **optimizer_config: Any) -> Fp8RefreshingOptimizer:
    """Megatron's mixed-precision Adam (FP32 main params, constant loss scale 1.0) with the FP8 refresh hook.

    ``use_precision_aware_optimizer`` needs TransformerEngine's FusedAdam (not a dependency here): refused
    without it. ``optimizer_cpu_offload``: Megatron's ``HybridDeviceOptimizer`` keeps ``optimizer_offload_fraction``
    of this rank's FP32 master params and Adam moments on the host and steps them there (torch's CPU AdamW), the rest
    on the GPU. Megatron runs it only inside its distributed optimizer, through the precision-aware code path
    (the hybrid optimizer holds the FP32 masters itself, so that path needs no TransformerEngine); both are required
    and set here.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from jetrl_megatron.megatron.cpu import host_offload_scope

    s = settings
    if (s.optimizer, s.bf16, s.fp16, s.params_dtype) != ("adam", True, False, "float32"):
        raise ValueError(f"build_policy: optimizer={s.optimizer!r}, bf16={s.bf16}, fp16={s.fp16}, params_dtype="
                         f"{s.params_dtype!r}; the trainer runs Megatron's mixed-precision Adam only ('adam', True, "
                         "False, 'float32': BF16 model, FP32 master weights)")
    common = dict(optimizer="adam", lr=s.lr, weight_decay=s.weight_decay, clip_grad=s.clip_grad,
                  adam_beta1=s.adam_beta1, adam_beta2=s.adam_beta2, adam_eps=s.adam_eps, bf16=True,
                  params_dtype=torch.bfloat16, loss_scale=1.0)
    if s.optimizer_cpu_offload:
        if not s.use_distributed_optimizer:
            raise ValueError("policy.megatron_cfg.optimizer.optimizer_cpu_offload needs "
                             "policy.megatron_cfg.optimizer.use_distributed_optimizer=true (Megatron runs its hybrid "
                             "CPU-offload optimizer only inside the distributed optimizer)")
        if not 0.0 < s.optimizer_offload_fraction <= 1.0:
            raise ValueError("policy.megatron_cfg.optimizer.optimizer_offload_fraction must be in (0, 1] with "
                             f"optimizer_cpu_offload=true, got {s.optimizer_offload_fraction}")
        cfg = OptimizerConfig(**common, use_distributed_optimizer=True, optimizer_cpu_offload=True,
                              optimizer_offload_fraction=s.optimizer_offload_fraction,
                              overlap_cpu_optimizer_d2h_h2d=s.overlap_cpu_optimizer_d2h_h2d,
                              pin_cpu_params=s.pin_cpu_params, **optimizer_config)
        # The precision-aware path, set after construction: OptimizerConfig's check of it asks TransformerEngine's
        # version even with CPU offload (which does not use TransformerEngine) and fails on None without it. These
        # are the values its __post_init__ gives with offload on and no TransformerEngine 2.1.
        cfg.use_precision_aware_optimizer = True
        cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
        cfg.store_param_remainders = False
        with host_offload_scope():
            wrapped = Fp8RefreshingOptimizer(get_megatron_optimizer(cfg, [model]), [model])
        if s.pin_cpu_params and torch.cuda.is_available():
            wrapped.pin_host_masters()  # what it pinned: wrapped.pinned_masters (the run reports it, rl/trainer.py)
        return wrapped
    if use_precision_aware_optimizer:
        if not s.use_distributed_optimizer:
            raise ValueError("use_precision_aware_optimizer needs use_distributed_optimizer (Megatron's rule)")
        if not te_fused_adam_available():
            raise ValueError("use_precision_aware_optimizer needs TransformerEngine's FusedAdam, which is not "
                             "installed (jetrl_megatron does not depend on TransformerEngine); set "
                             "policy.megatron_cfg.optimizer.use_precision_aware_optimizer=false")
    cfg = OptimizerConfig(**common, use_distributed_optimizer=s.use_distributed_optimizer,
                          use_precision_aware_optimizer=use_precision_aware_optimizer, **optimizer_config)
    return Fp8RefreshingOptimizer(get_megatron_optimizer(cfg, [model]), [model])
