"""The packer (`reshard/packing.py`) and the transport's gathering (`reshard/transport.py`): bytes in, same bytes out.

Random tensors of every supported dtype (FP8 E4M3 with every byte pattern, NaN codes included; BF16 with NaN
payloads and -0.0; FP32 scales; integers, bool), odd shapes, a scalar, an empty tensor and non-contiguous views
(transposed, strided, narrowed, broadcast) are packed and unpacked; the bytes that come back are compared with a
NumPy reference built from the random bytes the tensors were made of (the same indexing on a byte array, not a torch
copy). Row slots cut by the exchange's `split_stream` reassemble each tensor exactly. Two gloo ranks with different
tensor sets gather each other's bytes through `Transport.gather_tensors`. Unsupported dtypes, wrong tensors and
short buffers are errors naming the tensor and sizes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jetrl_megatron.reshard.exchange import split_stream
from jetrl_megatron.reshard.packing import ALIGN, DTYPES, PackSpec, pack_slots

# (dtype, base shape, view of the base: how the packed tensor is taken from it)
CASES = [
    ("w_fp8", torch.float8_e4m3fn, (256, 384), lambda t: t),
    ("w_fp8_t", torch.float8_e4m3fn, (64, 96), lambda t: t.t()),
    ("w_scale_inv", torch.float32, (2, 3), lambda t: t),
    ("e5m2_cols", torch.float8_e5m2, (9, 20), lambda t: t[:, 3:17:2]),
    ("bf16", torch.bfloat16, (33, 7), lambda t: t),
    ("bf16_rows", torch.bfloat16, (40, 12), lambda t: t.narrow(0, 5, 17)),
    ("fp16_3d", torch.float16, (3, 5, 11), lambda t: t.permute(2, 0, 1)),
    ("f64", torch.float64, (13,), lambda t: t[::3]),
    ("i8", torch.int8, (17,), lambda t: t),
    ("u8", torch.uint8, (5, 5), lambda t: t),
    ("i16", torch.int16, (6, 4), lambda t: t),
    ("i32", torch.int32, (7,), lambda t: t),
    ("i64", torch.int64, (3, 2), lambda t: t),
    ("flag", torch.bool, (10,), lambda t: t),
    ("scalar", torch.float32, (), lambda t: t),
    ("empty", torch.bfloat16, (0, 8), lambda t: t),
    ("broadcast", torch.float32, (1, 6), lambda t: t.expand(4, 6)),
]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, np.ndarray]:
    """A tensor whose bytes are random (any pattern, NaNs and -0.0 included; bool: 0 / 1) and those bytes as a
    NumPy array of shape ``shape + (itemsize,)``."""
    size = dtype.itemsize
    n = math.prod(shape) * size
    hi = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, hi, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    if dtype == torch.float8_e4m3fn and n >= 256:
        raw[:256] = torch.arange(256, dtype=torch.uint8)  # every E4M3 code, 0x7f / 0xff (NaN) and 0x80 (-0.0)
    if dtype == torch.bfloat16 and n >= 8:
        raw[:8] = torch.tensor([0x01, 0x7F, 0x00, 0x80, 0xC1, 0xFF, 0x80, 0x7F], dtype=torch.uint8)  # NaN, -0, NaN
    ref = raw.numpy().copy().reshape((*shape, size))
    return raw.view(dtype).reshape(shape), ref


def _ref_view(ref: np.ndarray, name: str) -> np.ndarray:
    """The same view as CASES takes, on the byte array (element dims first, the item's bytes last)."""
    if name == "w_fp8_t":
        return ref.transpose(1, 0, 2)
    if name == "e5m2_cols":
        return ref[:, 3:17:2]
    if name == "bf16_rows":
        return ref[5:22]
    if name == "fp16_3d":
        return ref.transpose(2, 0, 1, 3)
    if name == "f64":
        return ref[::3]
    if name == "broadcast":
        return np.broadcast_to(ref, (4, 6, ref.shape[-1]))
    return ref


def _inputs(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    g = torch.Generator().manual_seed(seed)
    tensors, refs = {}, {}
    for name, dtype, shape, view in CASES:
        base, ref = _random_tensor(dtype, shape, g)
        tensors[name] = view(base)
        refs[name] = np.ascontiguousarray(_ref_view(ref, name))
    return tensors, refs


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of an unpacked tensor (a contiguous view of the buffer), as NumPy, shape + (itemsize,)."""
    assert t.is_contiguous()
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return flat.numpy().reshape((*t.shape, t.element_size()))


def test_views_are_non_contiguous_where_intended():
    tensors, _ = _inputs()
    strided = {n for n, t in tensors.items() if not t.is_contiguous()}
    assert {"w_fp8_t", "e5m2_cols", "fp16_3d", "f64", "broadcast"} <= strided


def test_round_trip_is_bit_exact_for_every_dtype_and_view():
    tensors, refs = _inputs()
    spec = PackSpec.of_tensors(tensors)
    buf = spec.pack(tensors)
    assert buf.dtype == torch.uint8 and buf.numel() == spec.nbytes
    out = spec.unpack(buf)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        got = out[name]
        assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape), name
        assert np.array_equal(_bytes_of(got), refs[name]), name
    # views of the buffer, not copies
    assert all(t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for t in out.values())


def test_layout_is_aligned_dense_and_described_as_plain_data():
    tensors, _ = _inputs()
    spec = PackSpec.of_tensors(tensors)
    end = 0
    for s in spec.slots:
        assert s.offset % ALIGN == 0 and s.offset >= end and s.offset - end < ALIGN, s.name
        assert s.nbytes == math.prod(s.shape) * s.dtype.itemsize
        end = s.offset + s.nbytes
    assert spec.nbytes == -(-end // ALIGN) * ALIGN
    assert spec.payload_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    desc = spec.describe()
    assert all(isinstance(dt, str) and isinstance(shape, tuple) for _, dt, shape in desc)
    assert PackSpec.from_description(desc) == spec


def test_pack_into_a_given_buffer_slice():
    """A spec packs into part of a larger buffer (the HF stream's per-rank parts) and unpacks from it."""
    tensors, refs = _inputs(seed=3)
    spec = PackSpec.of_tensors(tensors)
    big = torch.full((3 * spec.nbytes,), 0xAB, dtype=torch.uint8)
    part = big[spec.nbytes:2 * spec.nbytes]
    spec.pack(tensors, out=part)
    assert bool((big[:spec.nbytes] == 0xAB).all()) and bool((big[2 * spec.nbytes:] == 0xAB).all())
    out = spec.unpack(part)
    for name in tensors:
        assert np.array_equal(_bytes_of(out[name]), refs[name]), name


def test_row_slots_of_a_split_stream_reassemble_every_tensor():
    """`split_stream` cuts tensors into messages of whole rows below a cap; packing each message and reading the
    rows back gives every tensor's bytes, strided sources included."""
    tensors, refs = _inputs(seed=5)
    names = ["w_fp8", "w_fp8_t", "w_scale_inv", "bf16_rows", "fp16_3d", "f64", "scalar", "broadcast"]
    meta = {n: (tensors[n].dtype, tuple(tensors[n].shape)) for n in names}
    messages = split_stream(names, meta, cap=4096)
    assert len(messages) > 10  # w_fp8 alone is 24 messages
    got: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for msg in messages:
        buf = torch.zeros(4096, dtype=torch.uint8)
        pack_slots(buf, msg, tensors)
        for s in msg:
            got[s.name].append(buf[s.offset:s.offset + s.nbytes].numpy().copy())
    for n in names:
        assert np.array_equal(np.concatenate(got[n]), refs[n].reshape(-1)), n


def test_unsupported_dtypes_are_refused_by_name():
    assert "float8_e4m3fn" in DTYPES and "bfloat16" in DTYPES
    with pytest.raises(ValueError, match=r"'z'.*complex64"):
        PackSpec.of_tensors({"a": torch.zeros(2), "z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match=r"'q'.*quint8"):
        PackSpec.of([("q", torch.quint8, (4,))])
    with pytest.raises(ValueError, match=r"'c'.*'complex128'"):
        PackSpec.from_description([("c", "complex128", (2,))])


def test_wrong_inputs_are_errors_naming_the_tensor_and_sizes():
    spec = PackSpec.of([("a", torch.bfloat16, (4, 8)), ("b", torch.float32, (3,))])
    good = {"a": torch.zeros(4, 8, dtype=torch.bfloat16), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"'a' is \(8, 4\) torch.bfloat16.*\(4, 8\)"):
        spec.pack({**good, "a": torch.zeros(8, 4, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"'b' is \(3,\) torch.float16"):
        spec.pack({**good, "b": torch.zeros(3, dtype=torch.float16)})
    with pytest.raises(KeyError, match="'b'"):
        spec.pack({"a": good["a"]})
    with pytest.raises(ValueError, match=f"needs {spec.nbytes} uint8 bytes"):
        spec.pack(good, out=torch.empty(spec.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"needs {spec.nbytes} uint8 bytes"):
        spec.unpack(torch.empty(spec.nbytes, dtype=torch.int16))
    with pytest.raises(ValueError, match="'a' is listed twice"):
        PackSpec.of([("a", torch.float32, (1,)), ("a", torch.float32, (2,))])


def _gather_rank(rank: int, world: int, out_dir: str) -> None:
    from jetrl_megatron.reshard.transport import Transport

    tensors, _ = _inputs(seed=10 + rank)
    mine = {f"r{rank}.{n}": t for n, t in tensors.items() if (len(n) + rank) % 3 or n.startswith("w_")}
    gathered = Transport().gather_tensors(mine)
    torch.save({"mine": sorted(mine), "gathered": [{n: (t.dtype, tuple(t.shape), _bytes_of(t.contiguous()))
                                                    for n, t in g.items()} for g in gathered]},
               f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_gather_tensors_moves_every_ranks_bytes(tmp_path):
    """Two gloo ranks, each with its own names, dtypes and shapes (FP8, strided views): both get both sets, bit
    for bit, in rank order."""
    from deadline import deadline

    from jetrl_megatron.megatron.cpu import spawn

    with deadline(300, "gather_tensors"):
        spawn(_gather_rank, 2, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in range(2):
        got = results[rank]["gathered"]
        assert len(got) == 2
        for src in range(2):
            tensors, refs = _inputs(seed=10 + src)
            names = results[src]["mine"]
            assert sorted(got[src]) == names and names
            for full in names:
                n = full.split(".", 1)[1]
                dtype, shape, data = got[src][full]
                assert dtype == tensors[n].dtype and shape == tuple(tensors[n].shape), (rank, src, full)
                assert np.array_equal(data, refs[n]), (rank, src, full)
