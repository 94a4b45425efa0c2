"""A fast read-only GGUF parser: metadata as Python values, tensors as memory-mapped bytes.

Torch-free: the tokenizer (:mod:`radixkv.text.bpe`) and a model's context length read
the metadata; the model tier (:mod:`radixkv.model.loading`) turns the tensors into
weights.

``gguf.GGUFReader`` builds numpy views for every element of every metadata
array, which takes seconds for a 49k-token vocabulary and its merges; reading
the same fields with ``struct`` and ``np.frombuffer`` takes well under one. The
``gguf`` package is still what dequantizes (``gguf.quants.dequantize``).

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, ``u32`` version, ``u64``
tensor count, ``u64`` metadata count; metadata as (string key, ``u32`` type,
value); tensor infos as (string name, ``u32`` n_dims, ``u64`` dims (ggml
order: fastest first), ``u32`` type, ``u64`` offset); tensor data from the next
multiple of ``general.alignment`` (default 32). Strings are ``u64`` length + UTF-8.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFFile", "GGUFTensor", "open_gguf", "read_gguf"]

# metadata value types -> (struct format, numpy dtype) for scalars and arrays
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor: ``shape`` in numpy order (ggml dims reversed), raw bytes ``[..., row_bytes]``."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray  # uint8, memory-mapped, read-only

    def dequantize(self) -> np.ndarray:
        """A new float32 array of ``shape`` (any type ``gguf.quants`` knows)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(self.data, GGMLQuantizationType(self.tensor_type))
        return np.array(out, dtype=np.float32).reshape(self.shape)


@dataclass
class GGUFFile:
    """A parsed GGUF file: ``fields`` (key -> int/float/bool/str/list) and ``tensors``."""

    path: Path
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype][1])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.unpack(_SCALARS[vtype][0])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s metadata and tensor table; tensor bytes stay memory-mapped.

    Raises ``ValueError`` for a non-GGUF file, a big-endian or v1 file, a metadata
    value nested past the interpreter's recursion limit, or an unknown tensor type.
    Complexity: O(metadata size) Python work; no tensor data is read until used.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} unsupported (little-endian v2/v3 only)")
    num_tensors, num_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(num_fields):
        key = cur.string()
        try:
            fields[key] = cur.value(cur.unpack("<I"))
        except RecursionError:  # arrays of arrays past the interpreter's recursion limit
            raise ValueError(f"{path}: metadata {key!r} nests too deeply") from None
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        ttype, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, dims, ttype, offset))
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, ttype, offset in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name!r} has unknown type {ttype}") from None
        row_bytes = dims[0] // block * type_size
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        lo = start + offset
        data = mm[lo : lo + rows * row_bytes].reshape(*reversed(dims[1:]), row_bytes)
        tensors.append(GGUFTensor(name, tuple(reversed(dims)), ttype, data))
    return GGUFFile(path, version, fields, tensors)


def open_gguf(source: str | Path | GGUFFile) -> GGUFFile:
    """A parsed GGUF file for a path (:func:`read_gguf`), or ``source`` itself if it is one.

    Callers loading both model and tokenizer pass one parsed file to both.
    """
    return source if isinstance(source, GGUFFile) else read_gguf(source)
