"""Megatron-Core's GPTModel carrying its FP8 context and building its output layer from the spec.

Why a subclass: GPTModel builds its output layer as a plain ``ColumnParallelLinear`` with no spec hook, and the
logits must be computed like vLLM's lm_head (:class:`~jetrl_megatron.megatron.layers.RolloutOutputLinear`). The
subclass builds the spec'd output layer at the one point GPTModel offers, ``setup_embeddings_and_output_layer``
(called once from GPTModel's constructor, right after the output layer exists and before its weight is tied or
shared), adopting the parameter GPTModel allocated and initialised, so weights, RNG draws and tying are exactly
GPTModel's own.
"""

from __future__ import annotations

from typing import Any

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from jetrl_megatron.megatron.context import Fp8ModelContext

__all__ = ["Fp8GPTModel"]


class Fp8GPTModel(GPTModel):
    """GPTModel whose modules share one :class:`Fp8ModelContext` (``self.fp8_context``) and whose output layer is
    ``output_layer_spec`` (a ColumnParallelLinear subclass taking Megatron's constructor arguments)."""

    def __init__(self, *args: Any, fp8_context: Fp8ModelContext, output_layer_spec: ModuleSpec,
                 **kwargs: Any) -> None:
        self._output_layer_spec = output_layer_spec
        self._fp8_context = fp8_context
        super().__init__(*args, **kwargs)

    @property
    def fp8_context(self) -> Fp8ModelContext:
        """Shape, recipe, this chunk's global layers, attention kernels and the FP8 weight cache."""
        return self._fp8_context

    def setup_embeddings_and_output_layer(self) -> None:
        if self.post_process and not isinstance(self.output_layer, self._output_layer_spec.module):
            self.output_layer = self._spec_output_layer(self.output_layer)
        super().setup_embeddings_and_output_layer()

    def _spec_output_layer(self, built):
        """The spec's output layer with GPTModel's arguments, holding the weight GPTModel allocated (or none, when
        the weight is the tied embedding on this stage)."""
        layer = build_module(
            self._output_layer_spec, self.config.hidden_size, self.vocab_size, config=self.config,
            init_method=self.config.init_method, bias=False, skip_bias_add=False, gather_output=built.gather_output,
            skip_weight_param_allocation=True, embedding_activation_buffer=built.embedding_activation_buffer,
            grad_output_buffer=built.grad_output_buffer, tp_group=built.tp_group)
        layer.weight = built.weight
        return layer
