"""The fast GGUF parser against the `gguf` package's own reader (a differential test), and
against truncated and corrupt files: each is a ``ValueError`` naming the file, found before
anything the header claims is allocated."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from radixkv.text.gguf import read_gguf

gguf = pytest.importorskip("gguf")


def _write(path: Path) -> dict[str, np.ndarray]:
    w = gguf.GGUFWriter(str(path), "llama")
    V = gguf.GGUFValueType
    w.add_key_value("t.u8", 7, V.UINT8)
    w.add_key_value("t.i8", -7, V.INT8)
    w.add_key_value("t.u16", 700, V.UINT16)
    w.add_key_value("t.i16", -700, V.INT16)
    w.add_key_value("t.u32", 70000, V.UINT32)
    w.add_key_value("t.i32", -70000, V.INT32)
    w.add_key_value("t.f32", 0.25, V.FLOAT32)
    w.add_key_value("t.bool", True, V.BOOL)
    w.add_key_value("t.str", "héllo ✓", V.STRING)
    w.add_key_value("t.u64", 2**40, V.UINT64)
    w.add_key_value("t.i64", -(2**40), V.INT64)
    w.add_key_value("t.f64", 1e-300, V.FLOAT64)
    w.add_key_value("t.arr_i32", [1, -2, 3], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("t.arr_f32", [0.5, 1.5], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("t.arr_str", ["a", "", "Ġb c"], V.ARRAY, sub_type=V.STRING)
    g = np.random.default_rng(0)
    arrays = {
        "a.f32": g.standard_normal((3, 5)).astype(np.float32),
        "b.f16": g.standard_normal((4, 8)).astype(np.float16),
        "c.vec": g.standard_normal(7).astype(np.float32),
        "d.q8": g.standard_normal((6, 64)).astype(np.float32),
        "e.q41": g.standard_normal((2, 3, 32)).astype(np.float32),
    }
    for name, a in arrays.items():
        if name == "d.q8":
            w.add_tensor(
                name,
                gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        elif name == "e.q41":
            w.add_tensor(
                name,
                gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_1),
                raw_dtype=gguf.GGMLQuantizationType.Q4_1,
            )
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def test_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    arrays = _write(path)
    ours = read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    assert ours.version == 3
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.fields[key] == field.contents(), key
    assert ours.fields["t.str"] == "héllo ✓" and ours.fields["t.i64"] == -(2**40)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        assert t.tensor_type == int(r.tensor_type)
        assert t.shape == tuple(reversed(r.shape.tolist()))
        assert np.array_equal(t.data.view(np.uint8).ravel(), r.data.view(np.uint8).ravel())
        want = gguf.quants.dequantize(r.data, r.tensor_type).reshape(t.shape)
        assert np.array_equal(t.dequantize(), want)
    assert np.array_equal(ours.tensors[0].dequantize(), arrays["a.f32"])
    assert np.array_equal(ours.tensors[1].dequantize(), arrays["b.f16"].astype(np.float32))
    assert ours.tensors[4].shape == (2, 3, 32)


def test_not_gguf_rejected(tmp_path: Path) -> None:
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf(p)


def test_metadata_nested_too_deeply_is_a_value_error(tmp_path: Path) -> None:
    """An array of arrays 3,000 deep: a ValueError naming the file and the key, not a
    RecursionError."""
    import struct

    path = tmp_path / "deep.gguf"
    key = b"general.deep"
    nested = struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) * 2999
    path.write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
        + nested + struct.pack("<IQ", 4, 0)
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"{path}: metadata 'general.deep' nests arrays deeper"):
        read_gguf(path)


def test_every_truncation_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    """An interrupted download: the file cut at every byte (was ``struct.error`` in the
    header, and a numpy reshape error in the tensor data)."""
    whole = tmp_path / "whole.gguf"
    _write(whole)
    data = whole.read_bytes()
    # the last tensor's end; past it the file holds only alignment padding
    end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(str(whole)).tensors)
    assert end < len(data)
    cut = tmp_path / "cut.gguf"
    for size in range(len(data)):
        cut.write_bytes(data[:size])
        if size >= end:
            assert len(read_gguf(cut).tensors) == 5
            continue
        with pytest.raises(ValueError, match=f"^{cut}") as caught:
            read_gguf(cut)
        assert "\n" not in str(caught.value), size


def test_every_flipped_header_byte_parses_or_is_a_value_error(tmp_path: Path) -> None:
    """A corrupt header: each byte before the tensor data flipped (two ways) either still
    parses or is a ``ValueError`` naming the file, never another exception."""
    whole = tmp_path / "whole.gguf"
    _write(whole)
    data = whole.read_bytes()
    header = min(t.data.ctypes.data for t in read_gguf(whole).tensors)
    header -= np.asarray(np.memmap(whole, dtype=np.uint8, mode="r")).ctypes.data
    bad = tmp_path / "bad.gguf"
    failed = 0
    for pos in range(header):
        for value in (data[pos] ^ 0xFF, data[pos] ^ 0x01):
            bad.write_bytes(data[:pos] + bytes([value]) + data[pos + 1 :])
            try:
                read_gguf(bad)
            except ValueError as exc:
                assert str(exc).startswith(str(bad)), exc
                failed += 1
    assert failed > header  # most flips are caught


def _header(num_tensors: int, num_fields: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, num_tensors, num_fields)


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_header(2**62, 0), "tensor count 4611686018427387904 .* needs"),
        (_header(0, 2**62), "metadata count 4611686018427387904 .* needs"),
        (_header(0, 1) + _string(b"k") + struct.pack("<IIQ", 9, 8, 2**60), "element count"),
        (_header(0, 1) + _string(b"k") + struct.pack("<IIQ", 9, 4, 2**61), "element count"),
        (_header(0, 1) + struct.pack("<Q", 2**63), "metadata key 0 length"),
        (_header(0, 1) + _string(b"k") + struct.pack("<I", 99), "unknown value type 99"),
        (_header(0, 1) + _string(b"k") + struct.pack("<II", 9, 99) + bytes(8), "element type"),
        (_header(0, 1) + _string(b"k") + struct.pack("<IIQIQ", 9, 9, 1, 9, 1),
         "nests arrays deeper than 2"),  # fmt: skip
        (_header(0, 1) + _string(b"general.alignment") + struct.pack("<II", 4, 0),
         "general.alignment must be a power of two, got 0"),  # fmt: skip
        (_header(1, 0) + _string(b"t") + struct.pack("<I", 2**31), "has 2147483648 dims"),
        (_header(1, 0) + _string(b"t") + struct.pack("<IQQIQ", 2, 2**40, 2**40, 0, 0),
         "tensor 't' .* runs past the end of the file"),  # fmt: skip
    ],
    ids=lambda v: v.split(" ")[0] if isinstance(v, str) else "",
)
def test_a_corrupt_header_is_refused_before_anything_it_claims_is_allocated(
    tmp_path: Path, body: bytes, message: str
) -> None:
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(body + bytes(64))
    with pytest.raises(ValueError, match=f"^{path}: .*{message}"):
        read_gguf(path)


def test_a_file_shorter_than_a_header_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "short.gguf"
    for data in (b"", b"GGUF", _header(0, 0)[:-1]):
        path.write_bytes(data)
        with pytest.raises(ValueError, match=f"^{path} is not a GGUF file: {len(data)} bytes"):
            read_gguf(path)
