"""A Jet-RL policy model run by another framework's Megatron trainer (NeMo-RL): how its chunks are built, and when
its FP8 weight cache is re-quantized.

The host owns parallel state, DDP, the optimizer and checkpoints; this project owns the model. Three things make
that work, each a plain function tested on CPU with a real Megatron-Core model:

* :func:`build_policy_chunk` — the model a host's ``provide(pre_process, post_process, vp_stage)`` must return:
  :func:`jetrl_megatron.megatron.model.build_gpt` (this project's spec: FP8 blockwise linears, rollout-matched
  numerics, BF16 output layer), with Megatron-Core's local-spec checkpoint names (``input_layernorm`` saved as
  ``self_attention.linear_qkv.layer_norm_weight``, as the TransformerEngine spec names it), so distributed
  checkpoints written by a TE-spec model (Megatron-Bridge's HF import) load into it and ours load into theirs.
* :func:`refresh_fp8_after_each_step` — the host's optimizer re-quantizes the cache once after every successful
  step, after forcing the parameter all-gather that Megatron's ``overlap_param_gather`` would otherwise defer to the
  next forward (the cache must be quantized from the gathered weights, not from a buffer in which only this rank's
  shard is new).
* :func:`refresh_fp8_now` — after the host writes weights by other means (checkpoint load, a reference-policy
  swap): the next FP8 forward must not see a stale cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from jetrl_megatron.megatron.model import build_gpt, refresh_fp8_cache, unwrap
from jetrl_megatron.model.shapes import ModelShape
from jetrl_megatron.recipe import Fp8Recipe

if TYPE_CHECKING:
    from jetrl_megatron.nemo_rl.policy_cfg import PolicyPlan

__all__ = ["TE_CHECKPOINT_KEYS", "use_te_checkpoint_names", "build_policy_chunk", "ChunkBuilder",
           "refresh_fp8_now", "refresh_fp8_after_each_step", "force_param_gather"]

# Megatron-Core's own local-spec mapping (get_gpt_layer_local_spec): separate norms saved under the names of the
# TransformerEngine spec's fused norm + linear.
TE_CHECKPOINT_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                      "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def use_te_checkpoint_names(model: torch.nn.Module) -> int:
    """Make every decoder layer save / load its norms under the TE spec's names; returns the number of layers."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    n = 0
    for module in unwrap(model).modules():
        if isinstance(module, TransformerLayer):
            sub = module.submodules_config
            keys = {**(sub.sharded_state_dict_keys_map or {}), **TE_CHECKPOINT_KEYS}
            module.submodules_config = dataclasses.replace(sub, sharded_state_dict_keys_map=keys)
            n += 1
    return n


def build_policy_chunk(shape: ModelShape, recipe: Fp8Recipe, *, pre_process: bool | None = None,
                       post_process: bool | None = None, vp_stage: int | None = None, sequence_parallel: bool = False,
                       **build_kwargs: Any) -> torch.nn.Module:
    """This rank's model chunk for a host trainer: ``build_gpt`` + TE checkpoint names (FP8 cache filled)."""
    from megatron.core import parallel_state

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if (vpp or 1) > 1 or vp_stage not in (None, 0):
        raise ValueError(f"virtual pipeline parallelism (vp_stage={vp_stage}, {vpp} chunks per rank) is not supported "
                         "by the Jet-RL model; set virtual_pipeline_model_parallel_size to null")
    if not (recipe.trains_fp8 and recipe.rollout_weights == "trainer_fp8"):
        raise ValueError(f"the hosted Jet-RL policy trains in FP8 and serves the trainer's FP8 bytes (mode 'jetrl'); "
                         f"the recipe says mode={recipe.mode!r} (trainer_gemm={recipe.trainer_gemm}, "
                         f"rollout_weights={recipe.rollout_weights})")
    model = build_gpt(shape, recipe, pre_process=pre_process, post_process=post_process,
                      sequence_parallel=sequence_parallel, **build_kwargs)
    use_te_checkpoint_names(model)
    return model


@dataclasses.dataclass(frozen=True)
class ChunkBuilder:
    """``provide(pre_process, post_process, vp_stage)`` for a Megatron-Bridge model provider (deep-copyable)."""

    shape: ModelShape
    recipe: Fp8Recipe
    sequence_parallel: bool = False
    elementwise: str = "auto"  # the chunk's element-wise kernels (Fp8ModelContext.elementwise)
    reference_quant: bool = False  # the torch reference quantizer on CUDA too (Fp8ModelContext.reference_quant)
    cuda_norms: str = "batch_invariant"  # the GPU engines' norms (Fp8ModelContext.cuda_norms)
    swiglu_fp8_forms: bool = False  # the GPU engines' SwiGLU (Fp8ModelContext.swiglu_fp8_forms)
    deterministic_backward: bool = False  # policy.jet_rl's (Fp8ModelContext.deterministic_backward)
    fuse_swiglu_grad_quant: bool = False  # policy.jet_rl's (Fp8ModelContext.fuse_swiglu_grad_quant)

    @classmethod
    def for_plan(cls, plan: PolicyPlan) -> ChunkBuilder:
        """The builder of a checked hosted policy's chunks (its numerics switches and engine ops included)."""
        return cls(plan.shape, plan.recipe, plan.sequence_parallel, plan.switches.elementwise,
                   plan.switches.reference_quant, plan.cuda_norms, plan.swiglu_fp8_forms,
                   plan.deterministic_backward, plan.fuse_swiglu_grad_quant)

    def __call__(self, pre_process: bool | None = None, post_process: bool | None = None,
                 vp_stage: int | None = None) -> torch.nn.Module:
        return build_policy_chunk(self.shape, self.recipe, pre_process=pre_process, post_process=post_process,
                                  vp_stage=vp_stage, sequence_parallel=self.sequence_parallel,
                                  elementwise=self.elementwise, reference_quant=self.reference_quant,
                                  cuda_norms=self.cuda_norms, swiglu_fp8_forms=self.swiglu_fp8_forms,
                                  deterministic_backward=self.deterministic_backward,
                                  fuse_swiglu_grad_quant=self.fuse_swiglu_grad_quant)


def _chunks(chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    return list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]


def force_param_gather(chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> int:
    """All-gather now the parameters that Megatron's distributed optimizer left for the next forward's pre-hooks
    (``overlap_param_gather``); returns how many chunks needed it."""
    n = 0
    for chunk in _chunks(chunks):
        cfg = getattr(chunk, "ddp_config", None)
        if cfg is not None and cfg.use_distributed_optimizer and cfg.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
            n += 1
    return n


def refresh_fp8_now(chunks: torch.nn.Module | Sequence[torch.nn.Module]) -> list[int]:
    """Re-quantize every chunk's FP8 cache from its current master weights; returns the cache generations.

    The weights' version counters are bumped first: hosts write parameters through ``param.data`` or views of a
    contiguous buffer, which does not bump them, and anything keyed on a weight's version must notice the change.
    """
    gens = []
    for chunk in _chunks(chunks):
        for p in unwrap(chunk).parameters():
            torch.autograd.graph.increment_version(p)
        gens.append(refresh_fp8_cache(chunk))
    return gens


def refresh_fp8_after_each_step(optimizer: Any, chunks: torch.nn.Module | Sequence[torch.nn.Module],
                                on_refresh: Callable[[list[int]], None] | None = None) -> None:
    """Wrap ``optimizer.step`` (this instance only): after a successful step, gather the parameters if Megatron
    deferred it, then re-quantize the FP8 cache once. A skipped step (non-finite gradients: Megatron's
    ``update_successful`` False) leaves the cache untouched. Installing twice is an error.

    Megatron's optimizers return ``(update_successful, grad_norm, num_zeros_in_grad)`` from ``step()``; the
    wrapper returns it unchanged. ``on_refresh(generations)`` is called after each refresh (metrics, tests).
    """
    if getattr(optimizer, "_fp8_refresh_installed", False):
        raise RuntimeError("refresh_fp8_after_each_step: already installed on this optimizer")
    chunks = _chunks(chunks)
    inner = optimizer.step

    @functools.wraps(inner)
    def step(*args: Any, **kwargs: Any) -> Any:
        result = inner(*args, **kwargs)
        ok = result[0] if isinstance(result, tuple) else result
        if ok:
            force_param_gather(chunks)
            gens = refresh_fp8_now(chunks)
            if on_refresh is not None:
                on_refresh(gens)
        return result

    optimizer.step = step
    optimizer._fp8_refresh_installed = True
