"""The found-inf check and unscale that CPU offload routes BF16 gradients through (megatron/optim.py): the same
flag and the same bytes as torch's own op, which has a BF16 kernel on CPU (the reference here) but not on CUDA."""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.megatron.optim import _NATIVE_UNSCALE, unscale_and_check


def _grads(seed: int, poison: str | None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g).to(torch.bfloat16) * 3 for n in (7, 128, 1000)]
    out.append(torch.randn(33, generator=g))  # an FP32 gradient in the same list goes to the native op
    if poison:
        out[1][17] = float(poison)
    return out


@pytest.mark.parametrize("poison", [None, "inf", "-inf", "nan"])
@pytest.mark.parametrize("inv_scale", [1.0, 0.37])
def test_matches_torch_native_op(poison, inv_scale):
    ours, ref = _grads(3, poison), _grads(3, poison)
    f_ours, f_ref = torch.zeros(1), torch.zeros(1)
    s = torch.tensor([inv_scale])
    unscale_and_check(ours, f_ours, s)
    _NATIVE_UNSCALE(ref, f_ref, s)
    assert f_ours.item() == f_ref.item() == (0.0 if poison is None else 1.0)
    for a, b in zip(ours, ref, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))
