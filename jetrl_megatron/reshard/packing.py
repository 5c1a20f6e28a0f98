"""The packer: named tensors <-> one flat byte buffer, laid out by a small spec (name, dtype, shape, offset).

Why one: every path that moves trainer weights between ranks (the refit exchange, the HF-named refit stream,
gathering every rank's tensors for an export) moves bytes, never values. A collective then carries one buffer
instead of one message per tensor, and every copy goes through an integer view of the tensor's own item size, so
E4M3 codes, FP32 scales, BF16 values, NaN payloads and -0.0 arrive unchanged: nothing is converted or quantized.

A :class:`Slot` holds whole rows ``[row0, row1)`` of one tensor (dim 0 of a matrix; a vector or a scalar is one
row), so a stream may cut a large tensor across several buffers (`reshard.exchange.split_stream`); a
:class:`PackSpec` holds whole tensors. Every slot starts at an `ALIGN`-byte offset, so a typed view of it is valid
for any dtype. The spec's :meth:`PackSpec.describe` is plain data (names, dtype names, shapes): that, never a
tensor, is what ranks exchange before the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

ALIGN = 16  # bytes: every slot starts at a multiple of this offset of its buffer
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                "bfloat16", "float16", "float32", "float64", "bool", "uint8", "int8", "int16", "int32", "int64",
                "uint16", "uint32", "uint64")
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
"""The dtypes the packer moves (by name): those whose bytes an integer view of the same item size carries."""
_NAME_OF = {dt: n for n, dt in DTYPES.items()}

TensorItem = tuple[str, torch.dtype, Sequence[int]]


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def dtype_name(dtype: torch.dtype, what: str = "tensor") -> str:
    """The spec's name of `dtype`; a dtype the packer does not move is an error naming `what`."""
    name = _NAME_OF.get(dtype)
    if name is None:
        raise ValueError(f"packer: {what} has dtype {dtype}, which is not moved as bytes; supported: "
                         f"{', '.join(DTYPES)}")
    return name


def raw(t: torch.Tensor) -> torch.Tensor:
    """Integer view with the same item size: copies through it are exact byte moves (works on strided views)."""
    return t.view(_INT_VIEW[t.element_size()])


def widen(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-view a (dst, src) byte-move pair with the widest integer type both allow (int64 > int32 > int16).

    Same bytes, fewer and wider elements: element-wise copy kernels (strided slabs, multi-tensor copies) move
    8 bytes per element instead of 1.
    """
    dst, src = pair
    for dtype in (torch.int64, torch.int32, torch.int16):
        if dtype.itemsize <= dst.element_size():
            break
        try:
            return dst.view(dtype), src.view(dtype)
        except RuntimeError:
            continue
    return dst, src


def rows_of(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
    """(rows, bytes per row) a tensor is split by: dim 0 of a matrix; a vector or scalar is one row."""
    nbytes = math.prod(shape) * dtype.itemsize
    if len(shape) >= 2 and shape[0] > 0:
        return shape[0], nbytes // shape[0]
    return 1, nbytes


@dataclass(frozen=True)
class Slot:
    """Rows [row0, row1) of tensor `name` (`dtype`, full `shape`), `nbytes` bytes at byte `offset` of a buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    row0: int
    row1: int
    nbytes: int


def _source_rows(slot: Slot, t: torch.Tensor) -> torch.Tensor:
    """The slot's rows of `t` as an integer view (no copy), after checking `t` is the tensor the spec names."""
    if t.dtype != slot.dtype or tuple(t.shape) != slot.shape:
        raise ValueError(f"packer: tensor {slot.name!r} is {tuple(t.shape)} {t.dtype}, the spec says "
                         f"{slot.shape} {slot.dtype}")
    r = raw(t.detach())
    if (slot.row0, slot.row1) == (0, rows_of(slot.shape, slot.dtype)[0]):
        return r
    return r.narrow(0, slot.row0, slot.row1 - slot.row0)


def pack_slots(out: torch.Tensor, slots: Sequence[Slot], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy each slot's rows of `tensors` into the uint8 buffer `out` at the slot's offset (byte moves, nothing
    allocated: contiguous sources in one multi-tensor copy, strided ones copied through a shaped view)."""
    end = max((s.offset + s.nbytes for s in slots), default=0)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < end:
        raise ValueError(f"packer: the buffer is {tuple(out.shape)} {out.dtype}; the slots need {end} uint8 bytes")
    dsts, srcs = [], []
    for s in slots:
        if s.name not in tensors:
            raise KeyError(f"packer: no tensor {s.name!r} to pack (the spec names it)")
        src = _source_rows(s, tensors[s.name])
        dst = out[s.offset:s.offset + s.nbytes]
        if src.is_contiguous():
            d, c = widen((dst, src.reshape(-1).view(torch.uint8)))
            dsts.append(d)
            srcs.append(c)
        else:
            dst.view(src.dtype).view(src.shape).copy_(src)
    if dsts:
        torch._foreach_copy_(dsts, srcs)


@dataclass(frozen=True)
class PackSpec:
    """Whole tensors packed in order into one byte buffer of `nbytes` (each start `ALIGN`-aligned)."""

    slots: tuple[Slot, ...]
    nbytes: int

    @classmethod
    def of(cls, items: Iterable[TensorItem]) -> PackSpec:
        """The layout of (name, dtype, shape) items, in order; an unsupported dtype or a repeated name is an error."""
        slots, offset, seen = [], 0, set()
        for name, dtype, shape in items:
            dtype_name(dtype, f"tensor {name!r}")
            if name in seen:
                raise ValueError(f"packer: tensor {name!r} is listed twice")
            seen.add(name)
            shape = tuple(int(d) for d in shape)
            nbytes = math.prod(shape) * dtype.itemsize
            slots.append(Slot(name, dtype, shape, offset, 0, rows_of(shape, dtype)[0], nbytes))
            offset += aligned(nbytes)
        return cls(tuple(slots), offset)

    @classmethod
    def of_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> PackSpec:
        return cls.of((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())

    def describe(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """The spec as plain data, (name, dtype name, shape) per tensor: what ranks exchange (no tensor pickled)."""
        return [(s.name, dtype_name(s.dtype), s.shape) for s in self.slots]

    @classmethod
    def from_description(cls, description: Iterable[tuple[str, str, Sequence[int]]]) -> PackSpec:
        items = []
        for name, dt, shape in description:
            if dt not in DTYPES:
                raise ValueError(f"packer: tensor {name!r} has dtype {dt!r}, which is not moved as bytes; "
                                 f"supported: {', '.join(DTYPES)}")
            items.append((name, DTYPES[dt], shape))
        return cls.of(items)

    def _check(self, buf: torch.Tensor) -> None:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes:
            raise ValueError(f"packer: the buffer is {tuple(buf.shape)} {buf.dtype}; the spec needs {self.nbytes} "
                             "uint8 bytes")

    @property
    def payload_bytes(self) -> int:
        """The tensors' bytes, without alignment padding."""
        return sum(s.nbytes for s in self.slots)

    def pack(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
        """`tensors`' bytes in one uint8 buffer (`out`, or a new one on `device`: default the tensors' device)."""
        if out is None:
            if device is None:
                device = next(iter(tensors.values())).device if tensors else "cpu"
            out = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._check(out)
        pack_slots(out, self.slots, tensors)
        return out

    def unpack(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of `buf` (no copy), one per tensor, with the spec's dtypes and shapes."""
        self._check(buf)
        return {s.name: buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.slots}


__all__ = ["ALIGN", "DTYPES", "PackSpec", "Slot", "aligned", "dtype_name", "pack_slots", "raw", "rows_of", "widen"]
