"""The SwiGLU backward fused with the FP8 quantization of fc1's dY (megatron/swiglu_fp8.py) and its wiring.

Kernel: byte-identical to the unfused path it replaces (triton_numerics.swiglu_bwd, then fp8.kernels.quant_dual) and,
given its own BF16 dY, to quant_dual's torch reference; its BF16 dY within 1 BF16 ulp of the torch twin (exact on
GPU, where both use CUDA's expf; under the interpreter numpy's expf may differ by 1 FP32 ulp). Random inputs over
many decades, ragged token counts (1, 127, 200), a gate/up boundary inside a 128-group (F = 64, 192), zero rows,
huge values, NaN, strided input, pow2 and FP32 scales, every launch variant.

Wiring: an fc1 -> SwiGLU -> fc2 block and a Megatron-Core layer from our spec, fwd+bwd with the fusion on and off,
give bit-identical gradients, and the fused kernel really replaced fc1's quant_dual; a dY that autograd summed
with another consumer's is refused (placeholder) or re-quantized (BF16 dY handed over, fc1 with bias).

CPU: under TRITON_INTERPRET=1, in a subprocess (it must be set before triton is imported). GPU (``gpu``): the kernel
at Qwen3-8B size.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from interpreter_child import run_module_under_interpreter
from megatron_helpers import same, same_up_to_nan_sign
from torch import Tensor

BF16 = torch.bfloat16


def inputs(m: int, f: int, device: str, seed: int, *, strided: bool = False) -> tuple[Tensor, Tensor]:
    """x = [gate | up] (m, 2F) and d(out) (m, F): magnitudes over 8 decades per row, a zero d(out) row, a row of
    huge values, one NaN; ``strided``: x a column slice of a wider tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * f, generator=g) * 4
    dy = torch.randn(m, f, generator=g) * torch.logspace(-4, 4, m)[torch.randperm(m, generator=g)][:, None]
    if m > 3:
        dy[1] = 0.0
        x[2] *= 1e15
        dy[3, f // 3] = float("nan")
    if strided:
        wide = torch.randn(m, 2 * f + 128, generator=g)
        wide[:, 64:64 + 2 * f] = x
        x = wide.to(BF16)[:, 64:64 + 2 * f]
    return x.to(BF16).to(device), dy.to(BF16).to(device)


def check_kernel(m: int, f: int, device: str, seed: int = 0, *, strided: bool = False, variants: bool = False
                 ) -> dict:
    from jetrl_megatron.fp8 import kernels as K
    from jetrl_megatron.fp8 import quant_dispatch
    from jetrl_megatron.megatron import swiglu_fp8 as S
    from jetrl_megatron.megatron import triton_numerics as tn
    from jetrl_megatron.megatron.numerics import TWINS
    from jetrl_megatron.recipe import Fp8Recipe

    x, dy = inputs(m, f, device, seed, strided=strided)
    tag = f"swiglu_bwd_quant_dual m={m} F={f} strided={strided}"
    twin_dx = TWINS["swiglu"].bwd(x, dy).reshape(m, 2 * f)
    unfused_dx = tn.swiglu_bwd(x, dy).reshape(m, 2 * f)
    launches = [dict(split=True), dict(split=False)]
    if variants:
        launches += [dict(split=True, block_m=16, feats=32, trans_mode=0), dict(split=True, feats=128, trans_mode=2),
                     dict(split=False, trans_mode=0, num_warps=8), dict(split=False, trans_mode=2)]
    for fmt in ("fp32", "pow2"):
        r = Fp8Recipe(scale_fmt=fmt)
        unfused = K.quant_dual(unfused_dx, r)
        for launch in launches:
            q, s, qt, st, dx = S.swiglu_bwd_quant_dual(x, dy, r, write_dx=True, **launch)
            what = f"{tag} {fmt} {launch}"
            for name, a, b in zip(("q", "s", "qt", "st"), (q, s, qt, st), unfused, strict=True):
                assert same(a, b), f"{what}: {name} differs from swiglu_bwd + quant_dual"
            assert s.stride() == unfused[1].stride() and st.stride() == unfused[3].stride(), what
            assert same(dx, unfused_dx), f"{what}: BF16 dY differs from triton_numerics.swiglu_bwd"
            ref = quant_dispatch.quant_dual(dx, r, reference_quant=True)
            for name, a, b in zip(("q", "s", "qt", "st"), (q, s, qt, st), ref, strict=True):
                assert same_up_to_nan_sign(a, b), f"{what}: {name} differs from quant_dual's torch reference of dY"
            no_dx = S.swiglu_bwd_quant_dual(x, dy, r, **launch)
            assert no_dx[4] is None and all(same(a, b) for a, b in zip(no_dx[:4], (q, s, qt, st), strict=True))
        twin = S.swiglu_bwd_quant_dual_reference(x, dy, r, swiglu_bwd=tn.swiglu_bwd)
        assert all(same_up_to_nan_sign(a, b) for a, b in zip(twin[:4], unfused, strict=True)), f"{tag} {fmt}: twin"
    finite = twin_dx.isfinite() & unfused_dx.isfinite()
    assert same(twin_dx.isnan(), unfused_dx.isnan()), f"{tag}: NaN positions differ from the torch twin"
    a, b = unfused_dx[finite].double(), twin_dx[finite].double()
    _, e = torch.frexp(b.abs().clamp_min(torch.finfo(BF16).tiny))
    assert bool(((a - b).abs() <= torch.exp2((e - 8).double())).all()), f"{tag}: BF16 dY > 1 ulp from the twin"
    return {"case": tag, "dY exact vs torch twin": (a == b).double().mean().item()}


def mlp_block(device: str, m: int, bias: bool, fuse: bool, seed: int = 0, extra_consumer: bool = False
              ) -> tuple[list[Tensor], dict[str, int]]:
    """fc1 (FP8) -> SwiGLU module (Triton kernels) -> fc2 (FP8), fwd+bwd: the gradients and the call counts of the
    fused kernel and of quant_dual. ``extra_consumer``: fc1's output is also used elsewhere (its dY is a sum)."""
    from jetrl_megatron.fp8 import linear as L
    from jetrl_megatron.fp8 import quant_dispatch
    from jetrl_megatron.megatron import numerics as N
    from jetrl_megatron.megatron import swiglu_fp8 as S
    from jetrl_megatron.recipe import Fp8Recipe

    h, f = 128, 256
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(BF16).to(device).requires_grad_()
    w1 = (torch.randn(2 * f, h, generator=g) * 0.1).to(BF16).to(device).requires_grad_()
    b1 = (torch.randn(2 * f, generator=g) * 0.1).to(BF16).to(device).requires_grad_() if bias else None
    w2 = (torch.randn(h, f, generator=g) * 0.1).to(BF16).to(device).requires_grad_()
    gout = torch.randn(m, h, generator=g).to(BF16).to(device)
    calls = {"fused": 0, "quant_dual": 0}
    fused_fn, dual_fn = S.swiglu_bwd_quant_dual, quant_dispatch.quant_dual

    def counted(key, fn):
        def run(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return run

    S.swiglu_bwd_quant_dual = counted("fused", fused_fn)
    quant_dispatch.quant_dual = counted("quant_dual", dual_fn)
    try:
        recipe = Fp8Recipe(mode="jetrl")
        y1 = L.fp8_linear(x, w1, b1, recipe)
        act = N.SwiGLU(elementwise=N.ElementwiseKernels("triton"), fuse_fc1_grad_quant=fuse)(y1)
        out = L.fp8_linear(act, w2, None, recipe)
        loss = (out.float() * gout.float()).sum()
        if extra_consumer:
            loss = loss + (y1.float() ** 2).sum() * 1e-3
        loss.backward()
    finally:
        S.swiglu_bwd_quant_dual, quant_dispatch.quant_dual = fused_fn, dual_fn
    return [t.grad for t in (x, w1, b1, w2) if t is not None], calls


def check_mlp_block(device: str) -> dict:
    for m, bias in ((200, False), (37, True)):
        off, calls_off = mlp_block(device, m, bias, fuse=False)
        on, calls_on = mlp_block(device, m, bias, fuse=True)
        assert calls_off == {"fused": 0, "quant_dual": 2}, calls_off
        assert calls_on == {"fused": 1, "quant_dual": 1}, f"fused path not taken: {calls_on}"
        for name, a, b in zip(("dx", "dw1", "db1", "dw2") if bias else ("dx", "dw1", "dw2"), on, off, strict=True):
            assert same(a, b), f"mlp block m={m} bias={bias}: {name} differs with the fused SwiGLU backward"
    # fc1's output with a second consumer: autograd sums the gradients, so the handed-over forms do not apply
    off, _ = mlp_block(device, 37, True, fuse=False, extra_consumer=True)
    on, calls = mlp_block(device, 37, True, fuse=True, extra_consumer=True)
    assert calls == {"fused": 1, "quant_dual": 2}, f"a summed dY must be re-quantized: {calls}"
    assert all(same(a, b) for a, b in zip(on, off, strict=True)), "bias + second consumer: gradients differ"
    try:
        mlp_block(device, 37, False, fuse=True, extra_consumer=True)
    except RuntimeError as e:
        assert "not the gradient its producer quantized" in str(e), e
    else:
        raise AssertionError("a summed dY with only a placeholder handed over must raise")
    return {"case": "fc1 -> SwiGLU -> fc2 fused on/off", "bit-identical": True}


def check_megatron_layer(device: str, seq: int, batch: int = 2) -> dict:
    """A Megatron-Core TransformerLayer from our spec (tiny Qwen3 shape, FP8 (jetrl) mode, Triton element-wise
    kernels): output and gradients bit-identical with the fusion on and off, and the fused kernel ran."""
    from megatron_helpers import layer_off_on_off

    from jetrl_megatron.fp8 import quant_dispatch
    from jetrl_megatron.megatron import swiglu_fp8 as S

    calls, summary = layer_off_on_off(device, seq, batch, "fuse_swiglu_grad_quant",
                                      {"fused": (S, "swiglu_bwd_quant_dual"),
                                       "quant_dual": (quant_dispatch, "quant_dual")})
    assert calls[0] == calls[2] == {"fused": 0, "quant_dual": 4}, calls
    assert calls[1] == {"fused": 1, "quant_dual": 3}, f"fused path not taken in the layer: {calls}"
    return summary


# ----------------------------------------------------------------------------------------------------- tests
def test_fused_swiglu_grad_quant_under_interpreter():
    run_module_under_interpreter(__file__, "fused SwiGLU gradient quantization failed", timeout=600)


def test_fusion_is_off_by_default_and_needs_the_swiglu_module():
    from jetrl_megatron.megatron import numerics as N
    from jetrl_megatron.megatron.context import Fp8ModelContext

    assert Fp8ModelContext.__dataclass_fields__["fuse_swiglu_grad_quant"].default is False
    assert N.SwiGLU().fuse_fc1_grad_quant is False


def test_cpu_tensors_without_interpreter_keep_the_unfused_backward(monkeypatch):
    """Plain CPU tensors (no interpreter): the torch twins run and nothing is handed to fc1, even with the option."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from jetrl_megatron.fp8 import linear as L
    from jetrl_megatron.megatron import numerics as N

    x = torch.randn(5, 128).to(BF16).requires_grad_()
    w = (torch.randn(256, 128) * 0.1).to(BF16).requires_grad_()
    y = L.fp8_linear(x, w)
    act = N.SwiGLU(fuse_fc1_grad_quant=True)(y)
    assert act.grad_fn.fc1 is None
    act.float().sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_swiglu_grad_quant_gpu_real_sizes():
    """Qwen3-8B fc1 (F = 12288) at 8k tokens plus ragged and boundary shapes: every byte as the unfused path."""
    for m, f, strided, variants in ((8192, 12288, False, False), (1000, 1536, True, True), (127, 192, False, True),
                                    (1, 64, False, False)):
        print(check_kernel(m, f, "cuda", strided=strided, variants=variants))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_swiglu_grad_quant_wiring_gpu(request):
    pytest.importorskip("megatron.core")
    print(check_mlp_block("cuda"))
    request.getfixturevalue("mp")  # Megatron's TP=PP=1 state
    print(check_megatron_layer("cuda", seq=1024))


def _interpreter_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jetrl_megatron.megatron import triton_numerics as tn

    assert tn.interpreting()
    for m, f, strided, variants in ((200, 192, False, True), (127, 64, True, False), (1, 64, False, False),
                                    (130, 128, False, False)):
        print(check_kernel(m, f, "cpu", strided=strided, variants=variants))
    print(check_mlp_block("cpu"))
    from jetrl_megatron.megatron import cpu

    cpu.init_parallel(1, 1)
    print(check_megatron_layer("cpu", seq=12))
    print("INTERP-OK")


if __name__ == "__main__":
    _interpreter_main()
