"""The ``vllm_cuda`` attention's token packing (Megatron's (sq, b) token grid <-> vLLM's packed sequences): one gather
with the rotary applied in place on it, and the output written straight back into the grid, give the bytes (forward
and gradients; where one full row needs no gather, a gradient of -0 keeps its sign) of the spelled-out form it
replaced (transpose to batch-major, gather, rotate a clone, scatter into a batch-major grid, transpose back). Checked
with the torch twin of the rotary; on the GPU the same buffers go through vLLM's rotary kernel
(tests/test_vllm_cuda_gpu.py checks the trainer against the engine there)."""

from __future__ import annotations

import functools

import pytest
import torch

from jetrl_megatron.megatron.numerics import (
    TWINS,
    PackedRowsCache,
    _PackedRopeFn,
    _rope_bwd_twin,
    _rope_fwd_twin,
    _RopeFn,
    pack_tokens,
    token_grid,
    unpack_tokens,
)

HEADS, KV_HEADS, HD = 4, 2, 16


class _Packed:
    def __init__(self, lengths):
        self.cu_seqlens_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(sq: int, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as Megatron hands them to core attention: views into one fused QKV output (v strided), BF16."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(sq, b, KV_HEADS, (HEADS // KV_HEADS + 2) * HD, generator=g).to(torch.bfloat16)
    q, k, v = mixed.split([HEADS // KV_HEADS * HD, HD, HD], dim=-1)
    q = q.reshape(sq, b, HEADS, HD)  # Megatron's reshape copies q; the q/k norms' outputs are fresh tensors too
    return q.clone().requires_grad_(), k.clone().requires_grad_(), v


def _spelled_out_pack(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    sq, b, h, d = t.shape
    return t.transpose(0, 1).reshape(b * sq, h, d).index_select(0, idx)


def _spelled_out_unpack(out: torch.Tensor, idx: torch.Tensor, sq: int, b: int) -> torch.Tensor:
    t, h, d = out.shape
    return out.new_zeros(b * sq, h, d).index_copy(0, idx, out).view(b, sq, h * d).transpose(0, 1).contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16)


@pytest.mark.parametrize("sq,lengths", [(12, [12]), (12, [7]), (10, [10, 10]), (9, [3, 9, 1]), (16, [16, 5, 11, 2])])
def test_gather_and_rotate_in_place_equals_the_spelled_out_form(sq, lengths):
    b = len(lengths)
    rows = PackedRowsCache().get(_Packed(lengths), b, sq, torch.device("cpu"))
    assert (rows.grid_idx is None) == (b == 1 and lengths[0] == sq)
    g = torch.Generator().manual_seed(sq * 10 + b)
    cache = torch.randn(64, HD, generator=g).to(torch.bfloat16)
    cos, sin = rows.cos_sin(cache)

    def rotate_(buf):  # the twin standing in for vLLM's in-place kernel
        buf.copy_(_rope_fwd_twin(buf, cos, sin))

    for which in ("q", "k"):
        q, k, v = _qkv(sq, b, seed=b + sq)
        x = q if which == "q" else k
        x_ref = x.detach().clone().requires_grad_()
        got = _PackedRopeFn.apply(token_grid(x), rows.grid_idx, cos, sin, rotate_, _rope_bwd_twin)
        want = _RopeFn.apply(_spelled_out_pack(x_ref, rows.idx), cos, sin, TWINS["rope"])
        assert got.shape == want.shape == (sum(lengths), x.shape[2], HD) and got.is_contiguous()
        assert torch.equal(_bits(got), _bits(want))
        dy = torch.randn(got.shape, generator=g).to(torch.bfloat16)
        got.backward(dy)
        want.backward(dy)
        assert torch.equal(_bits(x.grad), _bits(x_ref.grad))
        assert x.grad.abs().sum() > 0


@pytest.mark.parametrize("sq,lengths", [(12, [12]), (12, [5]), (9, [3, 9, 1]), (8, [8, 8])])
def test_value_packing_and_the_output_unpacking_equal_the_spelled_out_form(sq, lengths):
    b = len(lengths)
    rows = PackedRowsCache().get(_Packed(lengths), b, sq, torch.device("cpu"))
    _, _, v = _qkv(sq, b, seed=3 + sq)
    assert not v.is_contiguous()  # a strided view of the fused QKV output, as Megatron's split leaves it
    assert torch.equal(_bits(pack_tokens(v, rows.grid_idx)), _bits(_spelled_out_pack(v, rows.idx)))
    g = torch.Generator().manual_seed(sq + b)
    out = torch.randn(sum(lengths), HEADS, HD, generator=g).to(torch.bfloat16).requires_grad_()
    out_ref = out.detach().clone().requires_grad_()
    got = unpack_tokens(out, rows.grid_idx, sq, b)
    want = _spelled_out_unpack(out_ref, rows.idx, sq, b)
    assert got.shape == want.shape == (sq, b, HEADS * HD) and torch.equal(_bits(got), _bits(want))
    dy = torch.randn(got.shape, generator=g).to(torch.bfloat16)
    got.backward(dy)
    want.backward(dy)
    assert torch.equal(_bits(out.grad), _bits(out_ref.grad))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vllms_rotary_in_place_on_the_gathered_buffer_equals_the_spelled_out_form_on_cuda():
    """The same comparison with vLLM's own CUDA rotary kernel at a Qwen3-8B head layout (32/8 heads of 128, 4K
    positions, two rows, one padded): the kernel rotates the one gathered buffer in place, where it used to rotate a
    clone of the transposed-and-gathered tensor."""
    pytest.importorskip("vllm")
    from jetrl_megatron.megatron.numerics import _rope_vllm_cuda_
    from jetrl_megatron.vllm_cuda import ops

    if not ops.available():
        pytest.skip(f"GPU vLLM ops unavailable: {ops.unavailable_reason()}")
    dev = torch.device("cuda")
    sq, lengths, heads, hd = 4128, [4128, 3001], 32, 128
    rows = PackedRowsCache().get(_Packed(lengths), 2, sq, dev)
    cache = ops.rope_cache(hd, 8192, 1e6, None, dev)
    cos, sin = rows.cos_sin(cache)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(sq, 2, heads, hd, generator=g, device=dev).to(torch.bfloat16).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    rotate_ = functools.partial(_rope_vllm_cuda_, positions=rows.positions, cache=cache)
    got = _PackedRopeFn.apply(token_grid(x), rows.grid_idx, cos, sin, rotate_, _rope_bwd_twin)

    class _SpelledOutRope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, packed):
            flat = packed.reshape(packed.shape[0], heads * hd).clone()
            ops.rope_neox_(rows.positions, flat, None, hd, cache)
            return flat.view(packed.shape)

        @staticmethod
        def backward(ctx, dy):
            return _rope_bwd_twin(dy, cos, sin)

    want = _SpelledOutRope.apply(_spelled_out_pack(x_ref, rows.idx))
    assert torch.equal(_bits(got), _bits(want))
    dy = torch.randn(got.shape, generator=g, device=dev).to(torch.bfloat16)
    got.backward(dy)
    want.backward(dy)
    assert torch.equal(_bits(x.grad), _bits(x_ref.grad))
