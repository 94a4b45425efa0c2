"""The fast GGUF parser against the `gguf` package's own reader (a differential test)."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match=f"{path}: metadata 'general.deep' nests too deeply"):
        read_gguf(path)
