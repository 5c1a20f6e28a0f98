"""Check that vLLM serves the trainer's FP8 bytes: the on-policy promise of the `jetrl` arm, verified end to end.

After a refit, every FP8 linear that vLLM computes with (fused qkv_proj / gate_up_proj, o_proj, down_proj: weight
and weight_scale_inv) is read back from the live engine and compared byte for byte with the trainer's FP8 weight
cache, re-assembled here from the Megatron shards by direct slicing (independent of the resharder's code path):

  Megatron linear_qkv (per TP rank: its query groups, each [q heads of the group; k; v]) -> vLLM [q; k; v]
  Megatron linear_fc1 (per TP rank: [gate_r; up_r])                                    -> vLLM [gate; up]
  Megatron linear_proj / linear_fc2 (column shards)                                   -> vLLM o_proj / down_proj

Covers a rollout TP of 1 and a trainer with PP 1 (what the CPU tests run); returns per-tensor results.
"""

from __future__ import annotations

import torch

from jetrl_megatron.fp8.format import BLOCK


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def _qkv_to_vllm(shards: list[torch.Tensor], nh: int, ng: int, rows_per_head: int) -> torch.Tensor:
    """Megatron per-rank fused QKV rows (rows_per_head rows per head) -> vLLM [q; k; v]."""
    full = torch.cat(shards, 0)
    per_group = (nh // ng + 2) * rows_per_head
    q, k, v = [], [], []
    for g in range(ng):
        rows = full[g * per_group:(g + 1) * per_group]
        nq = nh // ng * rows_per_head
        q.append(rows[:nq])
        k.append(rows[nq:nq + rows_per_head])
        v.append(rows[nq + rows_per_head:])
    return torch.cat(q + k + v, 0)


def _fc1_to_vllm(shards: list[torch.Tensor]) -> torch.Tensor:
    gates = [s[: s.shape[0] // 2] for s in shards]
    ups = [s[s.shape[0] // 2:] for s in shards]
    return torch.cat(gates + ups, 0)


def expected_vllm_fp8(tp_states: list[dict[str, torch.Tensor]], shape) -> dict[str, torch.Tensor]:
    """vLLM-named FP8 weights + scales built from the trainer's per-TP-rank Megatron FP8 tensors (PP 1)."""
    out: dict[str, torch.Tensor] = {}
    nh, ng, hd = shape.num_attention_heads, shape.num_kv_heads, shape.head_dim
    for layer in range(shape.num_layers):
        m = f"decoder.layers.{layer}."
        v = f"model.layers.{layer}."
        if m + "self_attention.linear_qkv.weight_scale_inv" not in tp_states[0]:
            continue  # a BF16-excluded layer
        for suf, rph in (("weight", hd), ("weight_scale_inv", hd // BLOCK)):
            out[v + "self_attn.qkv_proj." + suf] = _qkv_to_vllm(
                [s[m + "self_attention.linear_qkv." + suf] for s in tp_states], nh, ng, rph)
            out[v + "mlp.gate_up_proj." + suf] = _fc1_to_vllm([s[m + "mlp.linear_fc1." + suf] for s in tp_states])
            out[v + "self_attn.o_proj." + suf] = torch.cat(
                [s[m + "self_attention.linear_proj." + suf] for s in tp_states], 1)
            out[v + "mlp.down_proj." + suf] = torch.cat([s[m + "mlp.linear_fc2." + suf] for s in tp_states], 1)
    return out


def served_fp8_equal(engine, tp_states: list[dict[str, torch.Tensor]], shape) -> tuple[bool, list[str]]:
    """(all equal, names that differ) comparing the live engine's FP8 tensors with the trainer's shards."""
    expected = expected_vllm_fp8(tp_states, shape)
    if not expected:
        return False, ["no FP8 linears in the trainer state"]
    live = engine.llm.apply_model(
        lambda model: {n: p.detach().clone() for n, p in model.named_parameters() if n in expected})[0]
    bad = []
    for name, want in expected.items():
        got = live.get(name)
        if got is None or got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) \
                or not torch.equal(_bytes(got.cpu()), _bytes(want.cpu())):
            bad.append(name)
    return not bad, bad
