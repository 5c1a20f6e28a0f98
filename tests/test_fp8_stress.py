"""The experiment-only stress formats (fp8/stress.py, fp8/stress_linear.py) against independent references.

References: element rounding by brute force over every value of the grid (ties to the even code); scales per
group computed in Python floats (math.log2, a loop over blocks); hand-worked codes; a float64 GEMM of the
dequantized operands; a straight-through estimator written with detach().
"""

from __future__ import annotations

import math

import pytest
import torch

from jetrl_megatron.fp8.stress import (
    STRESS_FORMATS,
    StressShapeError,
    dequantize,
    quantize_act,
    quantize_weight,
    round_element,
    stress_format,
)
from jetrl_megatron.fp8.stress_linear import (
    stress_gemm,
    stress_linear,
    stress_linear_forward,
    stress_linear_forward_quantized,
    weight_code_storage,
)

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp8_grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative value of an FP8 dtype with its bit pattern (even pattern = even mantissa)."""
    bits = torch.arange(128, dtype=torch.uint8)
    vals = bits.view(dtype).float()
    keep = torch.isfinite(vals)
    return vals[keep], bits[keep].long()


def _nearest(y: torch.Tensor, grid: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Brute-force round-to-nearest onto a non-negative grid (mirrored for negatives), ties to the even code,
    saturating at the grid's largest value."""
    a = y.abs().double().clamp(max=grid.max().item())
    d = (a.unsqueeze(-1) - grid.double()).abs()
    best = d.min(dim=-1, keepdim=True).values
    tie_ok = (d == best) & (codes % 2 == 0)
    pick = torch.where(tie_ok.any(-1, keepdim=True), tie_ok, d == best).double().argmax(-1)
    return (torch.sign(y.double()) * grid.double()[pick]).float()


def _ties_and_random(grid: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mids = (grid[1:] + grid[:-1]) / 2
    rnd = (torch.rand(n, generator=g) * 2 - 1) * grid.max() * 1.2
    return torch.cat([mids, -mids, grid, rnd])


@pytest.mark.parametrize("element,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_elements_match_brute_force(element, dtype):
    grid, codes = _fp8_grid(dtype)
    order = torch.argsort(grid)
    grid, codes = grid[order], codes[order]
    y = _ties_and_random(grid, 4000, seed=1)
    assert torch.equal(round_element(y, element), _nearest(y, grid, codes))


def test_e2m1_matches_brute_force_with_ties_to_even():
    grid = torch.tensor(E2M1_GRID)
    y = _ties_and_random(grid, 4000, seed=2)
    assert torch.equal(round_element(y, "e2m1"), _nearest(y, grid, torch.arange(8)))
    # hand-worked ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, 7 -> 6 (saturates)
    got = round_element(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -5.0]), "e2m1")
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0]


@pytest.mark.parametrize("element,top", [("int4", 7), ("int3", 3)])
def test_int_elements_match_brute_force(element, top):
    grid = torch.arange(0, top + 1, dtype=torch.float32)
    y = _ties_and_random(grid, 4000, seed=3)
    assert torch.equal(round_element(y, element), _nearest(y, grid, torch.arange(top + 1)))


def test_mxfp4_hand_worked_group():
    """amax 3.0: E8M0 scale 2**(floor(log2 3) - 2) = 0.5; 1.3 / 0.5 = 2.6 -> 3 -> 1.5; 3.0 -> 6; -0.2 -> -0.4 -> -0.5
    -> -0.25; 0.1 -> 0.2 -> 0; 2.9 -> 5.8 -> 6 -> 3.0 (then the second group: all 2**-3 = 0.125, scale 2**-5)."""
    x = torch.zeros(1, 64)
    x[0, :5] = torch.tensor([1.3, 3.0, -0.2, 0.1, 2.9])
    x[0, 32:] = 0.125
    q, s = quantize_act(x, stress_format("mxfp4"))
    assert s.tolist() == [[0.5, 2.0 ** -5]]
    assert q[0, :5].tolist() == [3.0, 6.0, -0.5, 0.0, 6.0]
    assert torch.equal(q[0, 32:], torch.full((32,), 4.0))
    assert dequantize(q, s)[0, :5].tolist() == [1.5, 3.0, -0.25, 0.0, 3.0]


def test_int4_g128_hand_worked_group():
    x = torch.zeros(2, 128)
    x[0, :3] = torch.tensor([7.0, 3.4, -1.5])  # scale 1: codes 7, 3, -2 (ties to even)
    x[1, :2] = torch.tensor([0.7, 0.25])  # scale 0.1: 0.25 / 0.1 = 2.5 (in FP32: 2.4999998) -> 2
    q, s = quantize_act(x, stress_format("int4_g128"))
    assert q[0, :3].tolist() == [7.0, 3.0, -2.0]
    assert s[0, 0].item() == 1.0
    assert q[1, :2].tolist() == [7.0, round(0.25 / (0.7 / 7))]


def _ref_scales(x: torch.Tensor, name: str, rows: int | None, act: bool) -> torch.Tensor:
    """Per (row, K group) scales computed in Python floats, block by block; ``act``: NVFP4's outer scale per row."""
    fmt = stress_format(name)
    r, k = x.shape
    g = k if fmt.k_group is None else fmt.k_group
    rb = r if rows is None else rows
    emax = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0, "int4": 7.0, "int3": 3.0}[fmt.element]
    out = torch.zeros(r, k // g, dtype=torch.float64)
    outer_tensor = float(x.abs().max())
    for i0 in range(0, r, rb):
        for j in range(k // g):
            block = x[i0:i0 + rb, j * g:(j + 1) * g]
            amax = max(float(block.abs().max()), 1e-10)
            if fmt.scale == "fp32":
                s = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(emax, dtype=torch.float32))
            elif fmt.scale == "e8m0":
                s = 2.0 ** (math.floor(math.log2(amax)) - 2)
            else:
                outer_amax = float(x[i0].abs().max()) if act else outer_tensor
                outer = float(torch.tensor(max(outer_amax, 1e-10), dtype=torch.float32)
                              / torch.tensor(448.0 * 6.0, dtype=torch.float32))
                inner = torch.tensor(amax / 6.0 / outer, dtype=torch.float32).clamp(max=448.0)
                s = float(inner.to(torch.float8_e4m3fn).float()) * outer
            out[i0:i0 + rb, j] = s
    return out.float()


@pytest.mark.parametrize("name", sorted(STRESS_FORMATS))
def test_weight_and_activation_scales_match_a_block_loop(name):
    fmt = stress_format(name)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 256, generator=g) * 0.05  # 200 rows: a partial 128-row block
    w[3, 7] = 0.9  # an outlier
    x = torch.randn(5, 256, generator=g) * 3
    _, ws = quantize_weight(w, fmt)
    assert torch.allclose(ws, _ref_scales(w, name, fmt.weight_rows, act=False), rtol=1e-6, atol=0)
    _, xs = quantize_act(x, fmt)
    assert torch.allclose(xs, _ref_scales(x, name, 1, act=True), rtol=1e-6, atol=0)


_HALF_GAP = {"e4m3": 16.0, "e5m2": 4096.0, "e2m1": 1.0, "int4": 0.5, "int3": 0.5}  # half the widest gap of each grid


@pytest.mark.parametrize("name", sorted(STRESS_FORMATS))
def test_round_trip_error_bounds(name):
    """|x - dq(x)| <= scale x half the grid's widest gap (MX: x2 for values E8M0 lets past 6); codes on the grid."""
    fmt = stress_format(name)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-2, 1, 64).unsqueeze(1)
    q, s = quantize_act(x, fmt)
    full = s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
    bound = full * _HALF_GAP[fmt.element] * (2 if fmt.scale == "e8m0" else 1) * (1 + 1e-6)
    assert ((x - dequantize(q, s)).abs() <= bound).all()
    assert torch.equal(round_element(q, fmt.element), q)  # every code is a grid value
    rel = ((x - dequantize(q, s)).norm() / x.norm()).item()
    assert rel < {"e4m3": 0.04, "e5m2": 0.08, "e2m1": 0.16, "int4": 0.4, "int3": 0.8}[fmt.element], rel


@pytest.mark.parametrize("name,k", [("mxfp4", 100), ("nvfp4", 24), ("e5m2_block", 192), ("int4_g128", 64)])
def test_bad_shapes_are_refused_naming_sizes(name, k):
    fmt = stress_format(name)
    with pytest.raises(StressShapeError, match=rf"K = {k} .* K group {fmt.k_group}"):
        quantize_act(torch.randn(3, k), fmt)
    with pytest.raises(StressShapeError, match=r"must be 2-D, got shape \(3, 4, 128\)"):
        quantize_weight(torch.randn(3, 4, 128), fmt)
    with pytest.raises(ValueError, match="unknown stress format 'fp3'"):
        stress_format("fp3")


@pytest.mark.parametrize("name", sorted(STRESS_FORMATS))
def test_gemm_matches_float64_reference_and_is_batch_invariant(name):
    fmt = stress_format(name)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(37, 256, generator=g).bfloat16()
    w = (torch.randn(384, 256, generator=g) * 0.03).bfloat16()
    bias = torch.randn(384, generator=g).bfloat16()
    xq, xs = quantize_act(x, fmt)
    wq, ws = quantize_weight(w, fmt)
    ref = dequantize(xq, xs, torch.float64) @ dequantize(wq, ws, torch.float64).T + bias.double()
    got = stress_gemm(xq, xs, wq, ws, bias, torch.float64)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    full = stress_linear_forward(x, w, bias, fmt)
    rows = torch.cat([stress_linear_forward(x[i:i + 1], w, bias, fmt) for i in range(x.shape[0])])
    assert torch.equal(full, rows)  # a row's bits do not depend on the batch (decode vs the trainer)


@pytest.mark.parametrize("name", sorted(STRESS_FORMATS))
def test_weight_codes_stored_narrow_give_the_same_forward_bits(name):
    """The rollout keeps a weight's codes in ``weight_code_storage`` (int8 / BF16) between refits: every code must
    survive the cast exactly (weights spanning 2**-12 to 2**3, so E5M2's small codes appear too), and the forward
    from stored codes must be ``stress_linear_forward``'s bit for bit."""
    fmt = stress_format(name)
    g = torch.Generator().manual_seed(12)
    w = (torch.randn(256, 256, generator=g) * torch.logspace(-12, 3, 256, base=2.0)).bfloat16()
    x = torch.randn(2, 11, 256, generator=g).bfloat16()
    bias = torch.randn(256, generator=g).bfloat16()
    wq, ws = quantize_weight(w, fmt)
    stored = wq.to(weight_code_storage(fmt))
    assert torch.equal(stored.float(), wq), f"{name}: codes do not survive {stored.dtype}"
    assert len(wq.unique()) > 4  # not a degenerate weight
    want = stress_linear_forward(x, w, bias, fmt)
    assert torch.equal(stress_linear_forward_quantized(x, stored, ws, bias, fmt), want)


def test_straight_through_gradients():
    """Against STE written as x + (fq(x) - x).detach(): the same forward values, dx = dy fq(W), dW = dy^T fq(x)."""
    fmt = stress_format("mxfp4")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 9, 256, generator=g, dtype=torch.float64).bfloat16().requires_grad_()
    w = (torch.randn(128, 256, generator=g) * 0.05).bfloat16().requires_grad_()
    dy = torch.randn(2, 9, 128, generator=g).bfloat16()
    stress_linear(x, w, None, fmt).backward(dy)

    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    xq = dequantize(*quantize_act(x2.detach().reshape(-1, 256), fmt), torch.float64).reshape(x2.shape)
    wq = dequantize(*quantize_weight(w2.detach(), fmt), torch.float64)
    y2 = (x2 + (xq - x2).detach()) @ (w2 + (wq - w2).detach()).T
    y2.backward(dy.double())
    assert torch.allclose(x.grad.double(), x2.grad, rtol=2e-2, atol=2e-2)
    assert torch.allclose(w.grad.double(), w2.grad, rtol=2e-2, atol=2e-2)


def test_int8_products_are_the_fp64_products_bit_for_bit():
    """The INT formats' int8 GEMM path (int32 accumulation) gives the FP64 path's result bit for bit, at batch sizes
    a decode step has (1, 5, 16, 17) and a trainer's (300), and rows do not depend on the batch; on CUDA too when a
    device is present (there the int8 kernel runs on tensor cores and pads batches of 16 rows or fewer)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    g = torch.Generator().manual_seed(11)
    for name in ("int4_tensor", "int3_tensor", "int4_g128"):
        fmt = stress_format(name)
        w = (torch.randn(384, 512, generator=g) * 0.03).bfloat16()
        x = torch.randn(300, 512, generator=g).bfloat16()
        bias = torch.randn(384, generator=g).bfloat16()
        for dev in devices:
            xq, xs = quantize_act(x.to(dev), fmt)
            wq, ws = quantize_weight(w.to(dev), fmt)
            full = stress_gemm(xq, xs, wq, ws, bias.to(dev), torch.float64, integer_codes=True)
            assert torch.equal(full, stress_gemm(xq, xs, wq, ws, bias.to(dev), torch.float64)), (name, dev)
            for m in (1, 5, 16, 17):
                part = stress_gemm(xq[:m], xs[:m], wq, ws, bias.to(dev), torch.float64, integer_codes=True)
                assert torch.equal(part, full[:m]), (name, dev, m)
            y = stress_linear_forward(x.to(dev), w.to(dev), bias.to(dev), fmt)
            assert torch.equal(y.cpu(), full.to(torch.bfloat16).cpu()), (name, dev)
