"""The SwiGLU forward that also writes fc2's FP8 input (triton_numerics.swiglu_fwd(quant=...), the model context's
``swiglu_fp8_forms``) and its wiring.

Kernel: its output is the plain kernel's, byte for byte; its codes and scales are ``quantize_1x128`` of that output
(the torch reference; NaN codes up to sign, the project's kernel contract) in ``quant_act``'s layout (column-major
scales), for FP32 and pow2 scales, ragged token counts, an F whose groups do not fill the kernel's power-of-two
block (384) or span two column programs (1152), zero rows, huge values, NaN and a strided input. The FP8 linear
takes the forms (no quantization call) and gives the result it gives without them.

Wiring: an fc1 -> SwiGLU -> fc2 block and a Megatron-Core layer from our spec give bit-identical outputs and
gradients with the option on and off (also with the fused SwiGLU backward), with one quantization pass fewer per
layer; the spec hands the forms only to an FP8 fc2 quantizing with the kernels; CPU tensors without the interpreter
keep the torch twin.

CPU: under TRITON_INTERPRET=1, in a subprocess. GPU (``gpu``): the kernel at Qwen3-8B / 32B sizes against
``kernels.quant_act``; engine and trainer with the switch: tests/test_vllm_cuda_gpu.py (the 8B-width norms test).
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
FORMS = "_jetrl_fp8_input_forms"


def swiglu_input(m: int, f: int, device: str, seed: int, *, strided: bool = False) -> Tensor:
    """[gate | up] (m, 2F) BF16: magnitudes over 8 decades per row, a zero row, a row of huge values, one NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * f, generator=g) * torch.logspace(-4, 4, m)[torch.randperm(m, generator=g)][:, None]
    if m > 3:
        x[1] = 0.0
        x[2] *= 1e30
        x[3, f // 3] = float("nan")
    if strided:
        wide = torch.randn(m, 2 * f + 128, generator=g)
        wide[:, 64:64 + 2 * f] = x
        return wide.to(BF16).to(device)[:, 64:64 + 2 * f]
    return x.to(BF16).to(device)


def check_kernel(m: int, f: int, device: str, seed: int = 0, *, strided: bool = False) -> dict:
    from jetrl_megatron.fp8.quant import quantize_1x128
    from jetrl_megatron.megatron import triton_numerics as tn
    from jetrl_megatron.recipe import Fp8Recipe

    x = swiglu_input(m, f, device, seed, strided=strided)
    plain = tn.swiglu_fwd(x)
    assert not hasattr(plain, FORMS)
    for recipe in (Fp8Recipe(), Fp8Recipe(scale_fmt="pow2")):
        y = tn.swiglu_fwd(x, quant=recipe)
        tag = f"m={m} f={f} strided={strided} {recipe.scale_fmt}"
        assert same(y, plain), f"{tag}: the output changed with the forms"
        forms = getattr(y, FORMS)
        q_ref, s_ref = quantize_1x128(plain.float(), recipe)  # the torch reference on the plain kernel's bytes
        assert same_up_to_nan_sign(forms.q, q_ref), f"{tag}: codes differ from quantize_1x128 of the output"
        assert same(forms.s, s_ref), f"{tag}: scales differ from quantize_1x128 of the output"
        assert forms.s.stride() == (1, m), f"{tag}: scales not column-major ({forms.s.stride()})"
        if device == "cuda":  # and the very bytes of the quantizer the linear would run otherwise
            from jetrl_megatron.fp8 import kernels

            q_k, s_k = kernels.quant_act(plain, recipe)
            assert same(forms.q, q_k) and same(forms.s, s_k), f"{tag}: differs from kernels.quant_act"
    return {"case": f"m={m} f={f} strided={strided}", "forms == quantize_1x128(output)": True}


def check_linear_takes_them(device: str) -> dict:
    """fc2 takes the forms (no quant_act call) with the result it gives without them; a changed tensor or another
    scale rule is quantized again."""
    from jetrl_megatron.fp8 import linear as fl
    from jetrl_megatron.fp8 import quant_dispatch
    from jetrl_megatron.fp8.quant import quantize_128x128
    from jetrl_megatron.megatron import triton_numerics as tn
    from jetrl_megatron.recipe import Fp8Recipe

    calls = []
    real = quant_dispatch.quant_act

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    quant_dispatch.quant_act = counting
    try:
        x = swiglu_input(37, 256, device, 3)
        for recipe in (Fp8Recipe(), Fp8Recipe(scale_fmt="pow2")):
            y = tn.swiglu_fwd(x, quant=recipe)
            wq, ws = quantize_128x128((torch.randn(128, 256) * 0.1).to(BF16).to(device), recipe)
            calls.clear()
            got = fl.fp8_linear_forward(y, wq, ws, recipe=recipe)
            assert not calls, "the linear quantized its input again"
            assert same(got, fl.fp8_linear_forward(y.clone(), wq, ws, recipe=recipe)) and len(calls) == 1
            calls.clear()
            fl.fp8_linear_forward(y, wq, ws, recipe=Fp8Recipe(scale_fmt="pow2" if recipe.scale_fmt == "fp32"
                                                               else "fp32"))
            assert calls, "another scale rule must be quantized again"
            y.mul_(2)
            calls.clear()
            assert same(fl.fp8_linear_forward(y, wq, ws, recipe=recipe),
                        fl.fp8_linear_forward(y.clone(), wq, ws, recipe=recipe)) and len(calls) == 2
    finally:
        quant_dispatch.quant_act = real
    return {"case": "fc2 takes the forms", "ok": True}


def mlp_block(device: str, m: int, forms: bool, fuse_bwd: bool) -> tuple[list[Tensor], int]:
    """fc1 (FP8) -> SwiGLU module (Triton kernels) -> fc2 (FP8), fwd+bwd: output, gradients, quant_act calls."""
    from jetrl_megatron.fp8 import linear as L
    from jetrl_megatron.fp8 import quant_dispatch
    from jetrl_megatron.megatron import numerics as N
    from jetrl_megatron.recipe import Fp8Recipe

    h, f = 128, 384
    g = torch.Generator().manual_seed(11)
    x = torch.randn(m, h, generator=g).to(BF16).to(device).requires_grad_()
    w1 = (torch.randn(2 * f, h, generator=g) * 0.1).to(BF16).to(device).requires_grad_()
    w2 = (torch.randn(h, f, generator=g) * 0.1).to(BF16).to(device).requires_grad_()
    gout = torch.randn(m, h, generator=g).to(BF16).to(device)
    n = [0]
    real = quant_dispatch.quant_act

    def counting(*a, **k):
        n[0] += 1
        return real(*a, **k)

    recipe = Fp8Recipe(mode="jetrl")
    quant_dispatch.quant_act = counting
    try:
        act = N.SwiGLU(elementwise=N.ElementwiseKernels("triton"), fuse_fc1_grad_quant=fuse_bwd,
                       fp8_output=recipe if forms else None)(L.fp8_linear(x, w1, None, recipe))
        assert act.grad_fn.kernels.impl == ("triton_fp8_forms" if forms else "triton"), act.grad_fn.kernels
        out = L.fp8_linear(act, w2, None, recipe)
        out.backward(gout)
    finally:
        quant_dispatch.quant_act = real
    return [out.detach(), x.grad, w1.grad, w2.grad], n[0]


def check_mlp_block(device: str) -> dict:
    for m in (200, 37):
        for fuse_bwd in (False, True):
            off, n_off = mlp_block(device, m, False, fuse_bwd)
            on, n_on = mlp_block(device, m, True, fuse_bwd)
            assert n_on == n_off - 1, f"m={m}: quant_act calls {n_off} -> {n_on}, expected one fewer (fc2's input)"
            for name, a, b in zip(("out", "dx", "dw1", "dw2"), on, off, strict=True):
                assert same(a, b), f"mlp block m={m} fused bwd={fuse_bwd}: {name} differs with the SwiGLU forms"
    return {"case": "fc1 -> SwiGLU -> fc2, forms on/off", "bit-identical": True}


def check_megatron_layer(device: str, seq: int, batch: int = 2) -> dict:
    """A Megatron-Core TransformerLayer from our spec: output and gradients bit-identical with ``swiglu_fp8_forms``
    on and off, one quant_act call fewer per forward."""
    from megatron_helpers import layer_off_on_off

    from jetrl_megatron.fp8 import quant_dispatch

    calls, summary = layer_off_on_off(device, seq, batch, "swiglu_fp8_forms",
                                      {"quant_act": (quant_dispatch, "quant_act")})
    n = [c["quant_act"] for c in calls.values()]
    assert n[0] == n[2] and n[1] == n[0] - 1, f"quant_act calls off/on/off: {n}"
    return summary


# ----------------------------------------------------------------------------------------------------- tests
def test_swiglu_forms_under_interpreter():
    run_module_under_interpreter(__file__, "the SwiGLU forward's FP8 forms broke their contract", timeout=600)


def test_off_by_default_and_given_only_to_an_fp8_fc2_quantizing_with_the_kernels():
    """The switch makes every layer's SwiGLU run the project's kernel (what the engine then runs: every arm, whatever
    fc2 is), and hands the recipe for FP8 forms only to an FP8 fc2 that quantizes with the kernels."""
    pytest.importorskip("megatron.core")
    from jetrl_megatron.megatron import numerics as N
    from jetrl_megatron.megatron.context import Fp8ModelContext
    from jetrl_megatron.megatron.spec import gpt_layer_spec
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe

    assert Fp8ModelContext.__dataclass_fields__["swiglu_fp8_forms"].default is False
    assert N.SwiGLU().fp8_output is None and N.SwiGLU().project_kernel is False
    assert N.SwiGLU(fp8_output=Fp8Recipe()).project_kernel is True  # forms only come from the project's kernel
    shape = get_model_shape("tiny")
    n = shape.num_layers

    def swiglu_params(recipe, **kw):
        ctx = Fp8ModelContext.create(shape, recipe, range(n), "fp32", **kw)
        return [gpt_layer_spec(ctx, i, lean_swiglu=True).submodules.mlp.submodules.activation_func.params
                for i in range(n)]

    def forms(params):
        return [p["fp8_output"] for p in params]

    def project(params):
        return [p["project_kernel"] for p in params]

    jetrl = Fp8Recipe(mode="jetrl")
    off = swiglu_params(jetrl)
    assert forms(off) == [None] * n and project(off) == [False] * n  # off by default
    on = swiglu_params(jetrl, swiglu_fp8_forms=True)
    fp8_layers = [jetrl.module_is_fp8(f"decoder.layers.{i}.mlp.linear_fc2.weight", i, n) for i in range(n)]
    assert [r is jetrl for r in forms(on)] == fp8_layers and any(fp8_layers) and project(on) == [True] * n
    bf16 = swiglu_params(Fp8Recipe(mode="bf16"), swiglu_fp8_forms=True)
    assert forms(bf16) == [None] * n and project(bf16) == [True] * n
    ref = swiglu_params(jetrl, swiglu_fp8_forms=True, reference_quant=True)
    assert forms(ref) == [None] * n and project(ref) == [True] * n


def test_build_gpt_refuses_the_forms_without_the_swiglu_module(mp):
    from jetrl_megatron.megatron.model import build_gpt
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe

    shape, jetrl = get_model_shape("tiny"), Fp8Recipe(mode="jetrl")
    for key in ("swiglu_fp8_forms", "fuse_swiglu_grad_quant"):
        with pytest.raises(ValueError, match=f"{key} needs lean_swiglu"):
            build_gpt(shape, jetrl, lean_swiglu=False, **{key: True})
    if not torch.cuda.is_available():  # the default lean_swiglu: no SwiGLU module on CPU, the switches are dropped
        ctx = build_gpt(shape, jetrl, swiglu_fp8_forms=True, fuse_swiglu_grad_quant=True).fp8_context
        assert (ctx.swiglu_fp8_forms, ctx.fuse_swiglu_grad_quant) == (False, False)


def test_cpu_tensors_without_interpreter_keep_the_torch_twin(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from jetrl_megatron.megatron import numerics as N
    from jetrl_megatron.recipe import Fp8Recipe

    x = swiglu_input(5, 128, "cpu", 0)
    y = N.SwiGLU(fp8_output=Fp8Recipe())(x)
    assert y.grad_fn is None or y.grad_fn.kernels.impl == "torch"
    assert not hasattr(y, FORMS) and same(y, N.SwiGLU()(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_forms_gpu_real_sizes():
    """Qwen3-8B's F (12288) at 8k tokens, 32B's per-TP2 F (12800), decode-sized and ragged calls."""
    for m, f, strided in ((8192, 12288, False), (1000, 12800, True), (1, 12288, False), (127, 384, False)):
        print(check_kernel(m, f, "cuda", strided=strided))
    print(check_linear_takes_them("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swiglu_forms_wiring_gpu(request):
    pytest.importorskip("megatron.core")
    print(check_mlp_block("cuda"))
    request.getfixturevalue("mp")
    print(check_megatron_layer("cuda", seq=1024))


def _interpreter_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jetrl_megatron.megatron import triton_numerics as tn

    assert tn.interpreting()
    for m, f, strided in ((130, 384, False), (7, 128, True), (1, 256, False), (64, 128, False), (5, 1152, False)):
        print(check_kernel(m, f, "cpu", strided=strided))
    print(check_linear_takes_them("cpu"))
    print(check_mlp_block("cpu"))
    from jetrl_megatron.megatron import cpu

    cpu.init_parallel(1, 1)
    print(check_megatron_layer("cpu", seq=12))
    print("INTERP-OK")


if __name__ == "__main__":
    _interpreter_main()
