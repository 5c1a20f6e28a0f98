"""Experiment-only stress formats: weight and activation formats coarser than the FP8 contract, for raising the
rollout-vs-trainer mismatch on purpose (the mismatch dose-response of docs/rl.md).

Why they exist: on the CPU task the production FP8 rollout's mismatch (k3 ~2e-4) is too small to change what GRPO
learns, so the question "at which mismatch does an off-policy rollout start to hurt?" needs harsher rollouts. None of
this is part of the FP8 contract (``recipe.py``): no recipe field, no checkpoint format, no production kernel. The
config key ``policy.jet_rl.stress.format`` selects one; GPU recipes refuse it unless the run opts in to a one-GPU
experiment (``policy.jet_rl.stress.gpu``, rl/stress_arms.py), where the INT formats' GEMMs run on int8 tensor cores
and the others in FP64 (``stress_linear.stress_gemm``: the same bits either way).

Every format is "codes times one FP32 scale per (row, K group)": weights (N, K) and activations (M, K) share the
K group, so a GEMM group's products are code x code with one scale pair. Formats (``STRESS_FORMATS``):

    e4m3_tensor  E4M3 codes; weights one scale per tensor, activations one per token row
    e5m2_block   E5M2 codes; weights 128x128 blocks, activations 1x128 groups (FP32 scales)
    mxfp4        E2M1 codes in 1x32 groups with E8M0 (power-of-two) scales, weights and activations (OCP MX rule)
    nvfp4        E2M1 codes in 1x16 groups with E4M3 scales times a second FP32 scale (weights: per tensor,
                 activations: per token row)
    int4_g128    symmetric INT4 codes [-7, 7] in 1x128 groups, FP32 scales, weights and activations
    int4_tensor  symmetric INT4 codes; weights one scale per tensor, activations one per token row
    int3_tensor  symmetric INT3 codes [-3, 3], scaled as int4_tensor (the harshest)

Activation scales never span tokens (no per-batch scale): a token's rollout logits must not depend on the other
sequences in its decode batch, which the trainer could not reproduce.

The GEMM accumulates code products exactly in FP64 within a K group (E4M3 and E2M1 code products are small dyadic
numbers, INT code products integers; see ``stress_gemm``), scales each group's partial sum and adds the groups in a
fixed order, so a row's result does not depend on how many rows are in the batch: decode and the trainer's
full-batch forward agree bit for bit when they see the same inputs (E5M2's code range is wide enough that a group
mixing values 2**-20 below its largest on both operands could round; none was seen in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_E4M3_MAX = 448.0
ELEMENT_MAX = {"e4m3": FP8_E4M3_MAX, "e5m2": 57344.0, "e2m1": 6.0, "int4": 7.0, "int3": 3.0}
SCALE_KINDS = ("fp32", "e8m0", "nvfp4")
AMAX_EPS = 1e-10


class StressShapeError(ValueError):
    """A tensor's K dimension is not a whole number of the format's K groups."""


@dataclass(frozen=True)
class StressFormat:
    """One stress format. ``k_group``: columns sharing a scale (None: the whole row); ``weight_rows``: weight rows
    sharing a scale (1: per row, 128: 128x128 blocks, None: the whole tensor)."""

    name: str
    element: str
    k_group: int | None
    weight_rows: int | None
    scale: str

    def __post_init__(self) -> None:
        if self.element not in ELEMENT_MAX:
            raise ValueError(f"stress format {self.name}: element {self.element!r} not in {sorted(ELEMENT_MAX)}")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"stress format {self.name}: scale {self.scale!r} not in {SCALE_KINDS}")

    def group_of(self, k: int, what: str) -> int:
        """The K group for a K-wide tensor; refuses a K that is not a whole number of groups, naming both."""
        g = k if self.k_group is None else self.k_group
        if k <= 0 or k % g:
            raise StressShapeError(f"stress format {self.name}: {what} has K = {k} columns, not a multiple of the "
                                   f"format's K group {g}")
        return g


STRESS_FORMATS: dict[str, StressFormat] = {f.name: f for f in (
    StressFormat("e4m3_tensor", "e4m3", None, None, "fp32"),
    StressFormat("e5m2_block", "e5m2", 128, 128, "fp32"),
    StressFormat("mxfp4", "e2m1", 32, 1, "e8m0"),
    StressFormat("nvfp4", "e2m1", 16, 1, "nvfp4"),
    StressFormat("int4_g128", "int4", 128, 1, "fp32"),
    StressFormat("int4_tensor", "int4", None, None, "fp32"),
    StressFormat("int3_tensor", "int3", None, None, "fp32"),
)}


def stress_format(name: str) -> StressFormat:
    """The format called ``name``; an unknown name is an error listing the known ones."""
    try:
        return STRESS_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown stress format {name!r}; known: {sorted(STRESS_FORMATS)}") from None


# ------------------------------------------------------------------------------------------------ element grids


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even code), saturating at 6.

    The grid's spacing is 0.5 below 2, 1 in [2, 4) and 2 from 4; within each binade the codes are consecutive
    integers times the spacing, and even integers are the even mantissas, so torch.round (half to even) is RNE.
    """
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(y.dtype)
    return torch.sign(y) * torch.clamp(torch.round(a / step) * step, max=6.0)


def round_element(y: torch.Tensor, element: str) -> torch.Tensor:
    """``y`` (FP32, already divided by its scale) rounded to the element grid, as FP32 values."""
    if element == "e4m3":
        return torch.clamp(y, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    if element == "e5m2":
        return torch.clamp(y, -57344.0, 57344.0).to(torch.float8_e5m2).float()
    if element == "e2m1":
        return round_e2m1(y)
    if element in ("int4", "int3"):
        return torch.clamp(torch.round(y), -ELEMENT_MAX[element], ELEMENT_MAX[element])
    raise ValueError(f"unknown element format {element!r}")


# ------------------------------------------------------------------------------------------------ scales


def _block_amax(x: torch.Tensor, rows: int | None, g: int) -> torch.Tensor:
    """amax of each (rows x g) block of a 2-D FP32 tensor, expanded to one value per (row, K group): (R, K/g).
    ``rows`` None: all rows form one block; a partial last row block uses its valid rows."""
    r, k = x.shape
    groups = x.abs().reshape(r, k // g, g).amax(dim=2)
    if rows == 1:
        return groups
    if rows is None:
        return groups.amax(dim=0, keepdim=True).expand(r, -1)
    nb = -(-r // rows)
    padded = groups.new_zeros(nb * rows, k // g)
    padded[:r] = groups
    return padded.reshape(nb, rows, k // g).amax(dim=1).repeat_interleave(rows, dim=0)[:r]


def _fp32_scale(amax: torch.Tensor, element: str) -> torch.Tensor:
    return torch.clamp(amax, min=AMAX_EPS) / torch.full_like(amax, ELEMENT_MAX[element])


def _e8m0_scale(amax: torch.Tensor, element: str) -> torch.Tensor:
    """OCP MX: 2 ** (floor(log2 amax) - emax of the element), emax(E2M1) = 2; values above the grid saturate."""
    _, e = torch.frexp(torch.clamp(amax, min=AMAX_EPS))  # amax = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
    emax = int(torch.frexp(torch.tensor(ELEMENT_MAX[element]))[1]) - 1
    return torch.ldexp(torch.ones_like(amax), e - 1 - emax)


def _nvfp4_scale(amax: torch.Tensor, outer_amax: torch.Tensor) -> torch.Tensor:
    """NVFP4: an E4M3 scale per block times an FP32 outer scale chosen so the largest block scale is 448."""
    outer = torch.clamp(outer_amax, min=AMAX_EPS) / torch.full_like(outer_amax, FP8_E4M3_MAX * 6.0)
    block = torch.clamp(amax / 6.0 / outer, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    return block * outer


def _scales(x: torch.Tensor, fmt: StressFormat, rows: int | None, g: int, outer_per_row: bool) -> torch.Tensor:
    """One FP32 scale per (row, K group) of ``x``. ``outer_per_row``: NVFP4's outer scale from each row's amax
    (activations) instead of the whole tensor's (weights)."""
    amax = _block_amax(x, rows, g)
    if fmt.scale == "fp32":
        return _fp32_scale(amax, fmt.element)
    if fmt.scale == "e8m0":
        return _e8m0_scale(amax, fmt.element)
    outer = amax.amax(dim=1, keepdim=True) if outer_per_row else amax.amax().reshape(1, 1)
    return _nvfp4_scale(amax, outer.expand_as(amax))


# ------------------------------------------------------------------------------------------------ quantizers


def _quantize(x: torch.Tensor, fmt: StressFormat, rows: int | None, what: str,
              outer_per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise StressShapeError(f"stress format {fmt.name}: {what} must be 2-D, got shape {tuple(x.shape)}")
    g = fmt.group_of(x.shape[1], f"{what} of shape {tuple(x.shape)}")
    xf = x.float()
    s = _scales(xf, fmt, rows, g, outer_per_row)
    full = s.repeat_interleave(g, dim=1)
    # a scale of 0 (an NVFP4 block scale that underflows E4M3) codes its block as 0 instead of dividing by 0
    codes = torch.where(full > 0, round_element(xf / torch.where(full > 0, full, 1.0), fmt.element), 0.0)
    return codes, s


def quantize_weight(w: torch.Tensor, fmt: StressFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, K) FP32 on the element grid, scales (N, K/g) FP32) of an (out, in) weight."""
    return _quantize(w, fmt, fmt.weight_rows, "weight", outer_per_row=False)


def quantize_act(x2d: torch.Tensor, fmt: StressFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (M, K), scales (M, K/g)) of an (tokens, in) activation; every scale comes from its own row."""
    return _quantize(x2d, fmt, 1, "activation", outer_per_row=True)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes x scales (each scale repeated over its K group), in FP32 (FP64 when ``dtype`` is), cast to ``dtype``."""
    g = codes.shape[1] // scales.shape[1]
    calc = torch.float64 if dtype == torch.float64 else torch.float32
    return (codes.to(calc) * scales.to(calc).repeat_interleave(g, dim=1)).to(dtype)


def fake_quant_weight(w: torch.Tensor, fmt: StressFormat) -> torch.Tensor:
    return dequantize(*quantize_weight(w, fmt), w.dtype)


def fake_quant_act(x2d: torch.Tensor, fmt: StressFormat) -> torch.Tensor:
    return dequantize(*quantize_act(x2d, fmt), x2d.dtype)
