"""Megatron-Core (TP x PP) -> vLLM (TP') FP8 weight resharding with bit-identical 128x128 scales; HF FP8 export."""

from jetrl_megatron.reshard.addressing import (
    Address,
    megatron_address,
    vllm_addresses,
    vllm_rank_plans,
)
from jetrl_megatron.reshard.export import export_hf_fp8, write_hf_checkpoint
from jetrl_megatron.reshard.mover import (
    MegatronShards,
    canonical_layer_tensors,
    iter_canonical,
    iter_vllm_rank,
    megatron_from_canonical,
    vllm_layer_tensors,
)
from jetrl_megatron.reshard.plan import build_plan, format_plan
from jetrl_megatron.reshard.preflight import ReshardError, Violation, check_reshard, validate_reshard
from jetrl_megatron.reshard.program import StaleSourceError, VllmRefitProgram

__all__ = [
    "Address", "megatron_address", "vllm_addresses", "vllm_rank_plans", "export_hf_fp8", "write_hf_checkpoint",
    "MegatronShards", "canonical_layer_tensors", "iter_canonical", "iter_vllm_rank", "megatron_from_canonical",
    "vllm_layer_tensors", "build_plan", "format_plan", "ReshardError", "Violation", "check_reshard",
    "validate_reshard", "VllmRefitProgram", "StaleSourceError",
]
