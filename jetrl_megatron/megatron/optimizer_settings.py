"""The trainer's optimizer settings: NeMo-RL's ``policy.megatron_cfg.optimizer`` section, as one object.

Why one object: the config loads this section into it (``rl/config/schema.py`` uses it as the section's type),
``jetrl plan`` estimates memory from it and :func:`jetrl_megatron.megatron.policy.build_policy` builds Megatron's
optimizer from it, so no layer can assume a setting, or a default, another does not use. The field names are
Megatron's ``OptimizerConfig`` names, which NeMo-RL's section uses too. No torch import: the config reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from jetrl_megatron.config_key import above, at_least, key, within


@dataclass
class OptimizerSettings:
    """Megatron's mixed-precision Adam (BF16 model, FP32 master weights and moments). Defaults: the tiny CPU
    recipe's values; recipes set the rest."""

    optimizer: str = key("adam", note="Adam(W)", allowed=("adam",))
    lr: float = key(1e-3, bounds=at_least(0, finite=True))
    min_lr: float = key(1e-3, bounds=at_least(0, finite=True))  # the schedule's floor (rl/trainer.py: lr_at)
    weight_decay: float = key(0.0, bounds=at_least(0, finite=True))
    adam_beta1: float = key(0.9, bounds=within(0, 1, hi_open=True))
    adam_beta2: float = key(0.999, bounds=within(0, 1, hi_open=True))
    adam_eps: float = key(1e-8, bounds=above(0))
    bf16: bool = key(True, note="BF16 model, FP32 master weights", allowed=(True,))
    fp16: bool = key(False, note="FP16 training is not supported", allowed=(False,))
    params_dtype: str = key("float32", note="FP32 master weights", allowed=("float32",))
    # One flag for DDP and the optimizer: the distributed optimizer reduce-scatters the gradients it shards
    use_distributed_optimizer: bool = False
    # must equal policy.max_grad_norm (NeMo-RL interpolates it from there)
    clip_grad: float = key(1.0, bounds=at_least(0, finite=True))
    optimizer_cpu_offload: bool = key(
        False, note="Megatron's HybridDeviceOptimizer inside the distributed optimizer (use_distributed_optimizer: "
        "true required): FP32 masters and Adam moments on the host, updated there by torch's AdamW, the new weights "
        "copied back before the FP8 refresh")
    optimizer_offload_fraction: float = key(
        0.0, bounds=within(0, 1), note="with optimizer_cpu_offload: the share of each rank's optimizer state on the "
        "host, in (0, 1] (Megatron's meaning); NeMo-RL v0.7.0 accepts only 1.0, because its worker moves the GPU part "
        "to the host around generation; in `jetrl run` the GPU part stays resident, so a split works (under NeMo-RL's "
        "driver a split is refused before start). No effect without offload")
    overlap_cpu_optimizer_d2h_h2d: bool = key(
        False, note="with optimizer_cpu_offload: one host AdamW per parameter, each stepping as soon as its own "
        "gradient has reached the host while the next ones are still copied, and its new weights copied back while "
        "the next ones step (Megatron's meaning; the same update bit for bit). No effect without offload")

    pin_cpu_params: bool = key(
        True, note="with optimizer_cpu_offload on CUDA: the host FP32 masters page-locked in place (cuMemHostRegister; "
        "again after a checkpoint load, which rebuilds them), so each step's copy of the new weights back to the GPU "
        "is a DMA instead of a staged pageable copy (Megatron's key and default; its hybrid optimizer pins only the "
        "BF16 clone it converts them from). No effect without offload or CUDA")

    @property
    def host_fraction(self) -> float:
        """The share of the optimizer state (and its FP32 gradient copies) held and stepped on the host."""
        return self.optimizer_offload_fraction if self.optimizer_cpu_offload else 0.0
