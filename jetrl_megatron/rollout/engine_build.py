"""What the engine whose model vLLM is building now asked for, read by the project's out-of-tree vLLM ops.

Why here: the batch-invariant RMSNorm (``invariant_norm``) and the SwiGLU that writes fc2's FP8 input
(``swiglu_forms``) replace vLLM's op classes process-wide (vLLM's custom-op registry), but each engine decides for
itself: every instance reads, in its constructor (which vLLM runs inside the model build, with that engine's config
current), whether its engine set the op's ``hf_overrides`` key and whether it serves the ``jetrl_fp8`` plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from jetrl_megatron.fp8.format import QUANT_METHOD
from jetrl_megatron.recipe import Fp8Recipe

log = logging.getLogger(__name__)


def current_vllm_config() -> Any:
    """The config of the engine whose model vLLM is building now (None outside a model build)."""
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config()
    except (ImportError, AssertionError):
        return None


def _hf_config() -> Any:
    return getattr(getattr(current_vllm_config(), "model_config", None), "hf_config", None)


def asked(hf_key: str) -> bool:
    """Whether the engine being built set ``hf_key`` in its ``hf_overrides`` (False outside a model build)."""
    return bool(getattr(_hf_config(), hf_key, False))


def hidden_size() -> int | None:
    """The model's hidden size (None outside a model build)."""
    return getattr(_hf_config(), "hidden_size", None)


def fp8_recipe() -> Fp8Recipe | None:
    """The recipe of the engine being built when it serves the ``jetrl_fp8`` plugin with the Triton quantizer, i.e.
    when its FP8 linears can take an input's FP8 forms from the op producing it (not with ``fp8_reference_quant``,
    whose point is to run the reference quantizer). None otherwise."""
    quant_config = getattr(current_vllm_config(), "quant_config", None)
    if (quant_config is None or quant_config.get_name() != QUANT_METHOD
            or getattr(quant_config, "reference_quant", True)):
        return None
    return quant_config.recipe


def replace_op(base: type, subclass_of: Callable[[type], type], what: str) -> type | None:
    """Put ``subclass_of(base)`` (a subclass of vLLM's op class ``base``) into vLLM's out-of-tree op registry under
    ``base``'s name, so every model vLLM builds from now on gets it where it asked for ``base``. None (and a warning
    naming ``what`` is unavailable) when another plugin already replaced ``base``. The class keeps vLLM's op name, so
    vLLM's ``custom_ops`` switches ("+rms_norm" / "-silu_and_mul") still reach these layers."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    if base.__name__ in op_registry_oot:
        log.warning("vLLM's %s is already replaced by %s: %s is not available", base.__name__,
                    op_registry_oot[base.__name__], what)
        return None
    cls = subclass_of(base)
    CustomOp.register_oot(name=base.__name__)(cls)
    cls.name = base.name  # register_oot named it after the registry key
    return cls


def served_counts(model: Any, flag: str, vllm_class: str, ours: str, forms: str) -> dict[str, int]:
    """How many of a served model's layers of one replaced op run the project's kernel (``ours``: the instance's
    ``flag`` is set) and how many vLLM's own (``"vllm"``: flag unset, or vLLM's class ``vllm_class`` itself); and how
    many of the former hand their output's FP8 forms to the next linear (``forms``, on CUDA tensors)."""
    counts = {ours: 0, "vllm": 0, forms: 0}
    for m in model.modules():
        if hasattr(m, flag):
            counts[ours if getattr(m, flag) else "vllm"] += 1
            counts[forms] += getattr(m, "jetrl_fp8_recipe", None) is not None
        elif type(m).__name__ == vllm_class:
            counts["vllm"] += 1
    return counts
