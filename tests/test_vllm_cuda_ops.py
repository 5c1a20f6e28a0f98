"""CPU checks of the GPU-vLLM numerics (``attn_impl="vllm_cuda"``): what can be checked without a GPU.

- vLLM's own rotary classes, run on the CPU, build the same cos/sin table as the trainer's twin, bit for bit (so on
  the GPU the only difference left is the device's cos/sin, which is why the GPU path takes vLLM's table);
- the model spec wires each norm to the vLLM kernel vLLM runs at that place (layer 0's input norm plain, every later
  norm fused with the residual add, q/k norms plain) and the residual stream is BF16, as in vLLM's Qwen3 forward;
- real row lengths reach attention only in a well-formed shape.
The GPU behaviour itself (bit-identity with the engine) is tests/test_vllm_cuda_gpu.py on the H200.
"""

from __future__ import annotations

import functools

import pytest
import torch

from jetrl_megatron.megatron.context import Fp8ModelContext
from jetrl_megatron.megatron.numerics import (
    PackedRowsCache,
    RolloutRMSNorm,
    _row_lengths,
    fp32_residual_add,
    get_bf16_residual_bda,
    rope_cos_sin_cache,
)
from jetrl_megatron.megatron.spec import gpt_block_spec, gpt_layer_spec, layer_gemm_modes
from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.vllm_cuda import ops as vllm_cuda_ops

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("theta,scaling", [(1e6, None), (5e5, LLAMA3), (1e4, None)])
def test_vllms_rotary_table_on_the_cpu_equals_the_twin(theta, scaling):
    pytest.importorskip("vllm")
    got = vllm_cuda_ops.rope_cache(128, 2048, theta, scaling, torch.device("cpu"))
    cos, sin = rope_cos_sin_cache(128, theta, 2048, scaling)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), torch.cat((cos, sin), -1))


def test_unknown_rope_scaling_is_refused_by_name():
    pytest.importorskip("vllm")
    with pytest.raises(ValueError, match="yarn"):
        vllm_cuda_ops.rope_cache(128, 64, 1e4, {"rope_type": "yarn", "factor": 2.0}, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_without_cuda_the_gpu_ops_say_why():
    assert not vllm_cuda_ops.available()
    assert "CUDA" in vllm_cuda_ops.unavailable_reason()


def _norm_kind(spec, ctx: Fp8ModelContext) -> str | None:
    """The vllm_cuda kernel a norm submodule spec asks for (None: the twins); every norm gets the model's own
    element-wise kernels."""
    assert spec.module is RolloutRMSNorm
    assert spec.params["elementwise"] is ctx.elementwise
    return spec.params.get("vllm_cuda")


@pytest.mark.parametrize("layers", [range(0, 4), range(2, 4)])  # a whole model, and a later PP stage
def test_spec_follows_vllms_qwen3_op_sequence(layers):
    shape = get_model_shape("tiny")
    ctx = Fp8ModelContext.create(shape, Fp8Recipe(), layers, "vllm_cuda", cuda_norms="vllm")
    assert ctx.residual_dtype == torch.bfloat16
    # the default: every norm is the batch-invariant kernel the GPU engines then run (either form)
    inv = Fp8ModelContext.create(shape, Fp8Recipe(), layers, "vllm_cuda")
    for g in layers:
        sub = gpt_layer_spec(inv, g, lean_swiglu=True).submodules
        attn = sub.self_attention.submodules
        kinds = {_norm_kind(m, inv) for m in (sub.input_layernorm, sub.pre_mlp_layernorm, attn.q_layernorm,
                                              attn.k_layernorm)}
        assert kinds == {"batch_invariant"}, kinds
    assert _norm_kind(gpt_block_spec(inv, lean_swiglu=True).layer_norm, inv) == "batch_invariant"
    # cuda_norms "vllm": vLLM's own kernel per norm, in the order Qwen3 runs them
    for g in layers:
        sub = gpt_layer_spec(ctx, g, lean_swiglu=True).submodules
        assert _norm_kind(sub.input_layernorm, ctx) == ("plain" if g == 0 else "fused")
        assert _norm_kind(sub.pre_mlp_layernorm, ctx) == "fused"
        attn = sub.self_attention.submodules
        assert _norm_kind(attn.q_layernorm, ctx) == _norm_kind(attn.k_layernorm, ctx) == "plain"
        assert sub.self_attn_bda is sub.mlp_bda is get_bf16_residual_bda
        assert sub.mlp.submodules.activation_func.params == {"vllm_cuda": True, "elementwise": ctx.elementwise,
                                                            "fuse_fc1_grad_quant": False,  # fusions off by default
                                                            "project_kernel": False, "fp8_output": None}
        assert isinstance(attn.core_attention, functools.partial)
        assert attn.core_attention.keywords["attn_impl"] == "vllm_cuda"
        assert attn.core_attention.keywords["elementwise"] is ctx.elementwise
    assert _norm_kind(gpt_block_spec(ctx, lean_swiglu=True).layer_norm, ctx) == "fused"


def test_hidden_sized_norms_write_fp8_forms_where_the_engine_does():
    """Where the engine serves the jetrl_fp8 plugin (an FP8 rollout, no stress format, no reference quantizer), its
    hidden-sized batch-invariant norms write their output's FP8 forms, and the trainer's input, pre-MLP and final
    norms run that same kernel variant (its sum of squares adds in another order than the plain one's), whatever
    their consumer; the per-head q/k norms never; nothing with vLLM's own norms or a BF16 rollout."""
    shape = get_model_shape("tiny")
    for recipe in (Fp8Recipe(mode="jetrl"), Fp8Recipe(mode="bf16_train_fp8_rollout")):
        ctx = Fp8ModelContext.create(shape, recipe, range(0, 4), "vllm_cuda")
        for g in range(4):
            sub = gpt_layer_spec(ctx, g, lean_swiglu=True).submodules
            attn = sub.self_attention.submodules
            assert sub.input_layernorm.params["fp8_input"] is recipe and sub.pre_mlp_layernorm.params["fp8_input"] \
                is recipe, (recipe.mode, g, layer_gemm_modes(shape, recipe, g))
            assert "fp8_input" not in attn.q_layernorm.params and "fp8_input" not in attn.k_layernorm.params
        assert gpt_block_spec(ctx, lean_swiglu=True).layer_norm.params["fp8_input"] is recipe
    jetrl = Fp8Recipe(mode="jetrl")
    for other in (Fp8ModelContext.create(shape, Fp8Recipe(mode="bf16"), range(4), "vllm_cuda"),
                  Fp8ModelContext.create(shape, jetrl, range(4), "vllm_cuda", cuda_norms="vllm"),
                  Fp8ModelContext.create(shape, jetrl, range(4), "vllm_cuda", reference_quant=True)):
        for g in range(4):
            sub = gpt_layer_spec(other, g, lean_swiglu=True).submodules
            assert "fp8_input" not in sub.input_layernorm.params and "fp8_input" not in sub.pre_mlp_layernorm.params
        assert "fp8_input" not in gpt_block_spec(other, lean_swiglu=True).layer_norm.params


def test_cpu_contexts_keep_the_fp32_residual_stream():
    shape = get_model_shape("tiny")
    for impl in ("vllm_cpu", "fp32", "bf16"):
        ctx = Fp8ModelContext.create(shape, Fp8Recipe(), range(4), impl)
        sub = gpt_layer_spec(ctx, 0).submodules
        assert ctx.residual_dtype == torch.float32
        assert _norm_kind(sub.input_layernorm, ctx) is _norm_kind(sub.pre_mlp_layernorm, ctx) is None
        for bda in (sub.self_attn_bda, sub.mlp_bda):  # the FP32 add, with this model's element-wise kernels
            fn = bda(False, False)
            assert fn.func is fp32_residual_add and fn.keywords == {"kernels": ctx.elementwise}


class _Packed:
    qkv_format = "sbhd"

    def __init__(self, cu):
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32)


def test_row_lengths_come_from_cu_seqlens_and_are_checked():
    assert _row_lengths(None, 3, 10, torch.device("cpu")).tolist() == [10, 10, 10]
    assert _row_lengths(_Packed([0, 4, 14, 15]), 3, 10, torch.device("cpu")).tolist() == [4, 10, 1]
    with pytest.raises(ValueError, match="expected \\(4,\\)"):
        _row_lengths(_Packed([0, 4, 14]), 3, 10, torch.device("cpu"))
    with pytest.raises(ValueError, match="row lengths"):
        _row_lengths(_Packed([0, 4, 15, 16]), 3, 10, torch.device("cpu"))


_INTERP_CHECK = r'''
import torch
from jetrl_megatron.megatron import numerics as N

torch.manual_seed(0)
x = torch.randn(6, 3, 64, dtype=torch.bfloat16, requires_grad=True)
w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16).requires_grad_()
twin = N.OpKernels("vllm_cuda", N._rms_fwd_twin, N._rms_bwd_twin)
mixed = N.ElementwiseKernels("triton").with_triton_backward(twin, "rms_norm", x)
assert mixed.bwd is not twin.bwd, "the Triton backward was not selected"
g = torch.randn(6, 3, 64, dtype=torch.bfloat16)
grads = []
for k in (mixed, twin):
    x.grad = w.grad = None
    y = N._RMSNormFn.apply(x, w, 1e-6, torch.bfloat16, k)
    y.backward(g)
    grads.append((y.detach(), x.grad.float(), w.grad.float()))
(y1, dx1, dw1), (y2, dx2, dw2) = grads
assert torch.equal(y1, y2)
for a, b in ((dx1, dx2), (dw1, dw2)):
    assert float((a - b).abs().max() / b.abs().max()) < 2 ** -7, float((a - b).abs().max())
cos, sin = N.rope_cos_sin_cache(64, 1e4, 64)
pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])  # two packed sequences
cg, sg = cos[pos].contiguous(), sin[pos].contiguous()
dy = torch.randn(10, 2, 64, dtype=torch.bfloat16)
assert torch.equal(N._rope_bwd_packed_triton(dy, cg, sg), N._rope_bwd_twin(dy, cg, sg))
print("VLLM-CUDA-BWD-OK")
'''


def test_triton_backwards_behind_vllm_forwards_match_the_twins_under_the_interpreter():
    """The vLLM-forward ops take their backward from the Triton kernels (speed): same gradients as the twins',
    with the norm's 1/rms handed over in the Triton layout and the packed RoPE gradient rotated per token."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERP_CHECK], env=env, capture_output=True, text=True,
                          timeout=300, cwd=root)
    if "VLLM-CUDA-BWD-OK" not in proc.stdout:
        tail = (proc.stderr or proc.stdout)[-3000:]
        if "AssertionError" in tail or "jetrl_megatron" in tail:
            pytest.fail(tail)
        pytest.skip(f"the Triton interpreter could not run the kernels here:\n{tail}")


def _reference_slots(lens: list[int], bs: int) -> tuple[list[list[int]], list[int]]:
    """Block table rows and token slots of fresh requests laid out one after another, written out by hand."""
    table, slots, next_block = [], [], 0
    for n in lens:
        blocks = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks)
        table.append(blocks)
        slots += [blocks[i // bs] * bs + i % bs for i in range(n)]
    return table, slots


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_layout_matches_a_hand_written_block_manager(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 70, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    layout = vllm_cuda_ops.PagedLayout.build(cu, max(lens), block_size=16)
    table, slots = _reference_slots(lens, 16)
    assert layout.slot.tolist() == slots
    assert layout.total_blocks == sum(len(r) for r in table)
    for row, want in zip(layout.block_table.tolist(), table, strict=True):
        assert row[:len(want)] == want and all(x == 0 for x in row[len(want):])
    assert layout.lens.tolist() == lens and layout.max_seqlen == max(lens)


def test_packed_rows_are_built_once_per_micro_batch_and_rebuilt_when_it_changes():
    cache = PackedRowsCache()
    dev = torch.device("cpu")
    p1 = _Packed([0, 4, 14, 15])
    rows = cache.get(p1, 3, 10, dev)
    assert rows.idx.tolist() == [*range(0, 4), *range(10, 20), 20]
    assert rows.positions.tolist() == [0, 1, 2, 3, *range(10), 0]
    assert cache.get(p1, 3, 10, dev) is rows  # the next layer of the same forward
    p2 = _Packed([0, 4, 14, 15])  # the next micro-batch: equal values, a new tensor
    assert cache.get(p2, 3, 10, dev) is not rows
    again = cache.get(p2, 3, 10, dev)
    p2.cu_seqlens_q[1:] = torch.tensor([2, 12, 13], dtype=torch.int32)  # changed in place
    changed = cache.get(p2, 3, 10, dev)
    assert changed is not again and changed.lengths.tolist() == [2, 10, 1]
    full = cache.get(None, 2, 5, dev)
    assert full.idx.tolist() == list(range(10)) and cache.get(None, 2, 5, dev) is full
    assert cache.get(None, 2, 6, dev) is not full
    table = torch.randn(16, 8).to(torch.bfloat16)
    cos, sin = changed.cos_sin(table)
    at = table[changed.positions].float()
    assert torch.equal(cos, at[:, :4]) and torch.equal(sin, at[:, 4:])
    assert changed.cos_sin(table)[0] is cos


class _PackedWithPrompts(_Packed):
    def __init__(self, cu, prompts):
        super().__init__(cu)
        self.decode_from = torch.tensor(prompts, dtype=torch.int32)


@pytest.mark.parametrize("seed", [0, 1])
def test_decode_split_puts_each_token_where_vllms_sampling_computed_it(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 60, (5,), generator=g).tolist()
    prompts = [int(torch.randint(1, n + 1, (1,), generator=g)) for n in lens]  # some rows all prompt
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    layout = vllm_cuda_ops.PagedLayout.build(cu, max(lens), decode_from=torch.tensor(prompts))
    d = layout.decode
    table, _ = _reference_slots(lens, 16)
    want_prefill, want_decode, want_used, want_rows = [], [], [], []
    for j, (n, p) in enumerate(zip(lens, prompts, strict=True)):
        start = int(cu[j])
        want_prefill += range(start, start + p)
        want_decode += range(start + p, start + n)
        want_used += range(p + 1, n + 1)  # a decode query at position t reads t + 1 keys
        want_rows += [table[j]] * (n - p)
    assert d.prefill_rows.tolist() == want_prefill and d.decode_rows.tolist() == want_decode
    assert d.prefill_lens.tolist() == prompts and d.prefill_cu.tolist() == [0, *torch.tensor(prompts).cumsum(0)]
    assert d.decode_used.tolist() == want_used and d.decode_cu.tolist() == list(range(len(want_decode) + 1))
    for row, blocks in zip(d.decode_table.tolist(), want_rows, strict=True):
        assert row[:len(blocks)] == blocks
    assert d.prefill_max == max(prompts) and d.decode_max == max(want_used or [max(prompts)])
    assert d.num_splits == 1
    with pytest.raises(ValueError, match="decode_from must be >= 1"):
        vllm_cuda_ops.PagedLayout.build(cu, max(lens), decode_from=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="decode_from has shape"):
        vllm_cuda_ops.PagedLayout.build(cu, max(lens), decode_from=torch.ones(4, dtype=torch.int32))


def test_packed_rows_follow_decode_from_only_when_asked():
    cache = PackedRowsCache()
    dev = torch.device("cpu")
    p = _PackedWithPrompts([0, 4, 14, 15], [2, 3, 1])
    assert cache.get(p, 3, 10, dev).paged.decode is None  # prefill matching ignores it
    rows = cache.get(p, 3, 10, dev, decode=True)
    assert rows.paged.decode.prefill_lens.tolist() == [2, 3, 1]
    assert cache.get(p, 3, 10, dev, decode=True) is rows
    p.decode_from[0] = 3  # changed in place: rebuilt
    assert cache.get(p, 3, 10, dev, decode=True).paged.decode.prefill_lens.tolist() == [3, 3, 1]
