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

import math
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
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 2  # an array of arrays; GGUF files in use nest none


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
    """Reads values off ``buf``; every count, length and offset is checked against what is
    left of it first, so a corrupt header is a ``ValueError``, never a huge allocation."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def need(self, nbytes: int, what: str) -> None:
        """``ValueError`` unless ``nbytes`` of ``what`` are left at the current position."""
        left = len(self.buf) - self.pos
        if nbytes > left:
            raise ValueError(
                f"{what} at byte {self.pos} needs {nbytes} bytes but the file ends "
                f"{left} bytes later (truncated or corrupt)"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def count(self, fmt: str, item_bytes: int, what: str) -> int:
        """A count of items of at least ``item_bytes`` each, which must all fit the file."""
        n = self.unpack(fmt, what)
        self.need(n * item_bytes, f"{what} {n}")
        return n

    def string(self, what: str) -> str:
        n = self.count("<Q", 1, f"{what} length")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= _MAX_ARRAY_DEPTH:
                raise ValueError(f"{what} nests arrays deeper than {_MAX_ARRAY_DEPTH}")
            etype = self.unpack("<I", f"{what} element type")
            if etype not in _SCALARS and etype not in (_STRING, _ARRAY):
                raise ValueError(f"{what} has unknown element type {etype}")
            count = self.count("<Q", _min_value_bytes(etype), f"{what} element count")
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype][1])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            return [self.value(etype, what, depth + 1) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{what} has unknown value type {vtype}")
        return self.unpack(_SCALARS[vtype][0], what)


def _min_value_bytes(vtype: int) -> int:
    """The fewest bytes a value of ``vtype`` takes: a string's length, an array's header."""
    if vtype == _STRING:
        return 8
    if vtype == _ARRAY:
        return 12
    return struct.calcsize(_SCALARS[vtype][0])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s metadata and tensor table; tensor bytes stay memory-mapped.

    ``ValueError`` naming ``path`` for a non-GGUF file, a big-endian or v1 file, an
    unknown value or tensor type, and for a truncated or corrupt one: every count,
    length, offset and tensor extent is checked against the file's size before it is
    used, so a corrupt header cannot make the parser allocate more than a few times
    the file's metadata bytes. Complexity: O(metadata size) Python work; no tensor
    data is read until used.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        raise ValueError(
            f"{path} is not a GGUF file: {size} bytes, shorter than a GGUF header "
            f"({_HEADER_BYTES} bytes)"
        )
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return _parse(path, mm)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _parse(path: Path, mm: np.memmap) -> GGUFFile:
    """:func:`read_gguf` over the mapped bytes ``mm``; errors do not name ``path``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    cur = _Cursor(memoryview(mm))
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} unsupported (little-endian v2/v3 only)")
    # smallest field: key length, value type, one byte; smallest tensor info: name
    # length, n_dims, type, offset
    num_tensors = cur.unpack("<Q", "tensor count")
    num_fields = cur.count("<Q", 8 + 4 + 1, "metadata count")
    cur.need(num_tensors * (8 + 4 + 4 + 8), f"tensor count {num_tensors}")
    fields: dict[str, Any] = {}
    for i in range(num_fields):
        key = cur.string(f"metadata key {i}")
        fields[key] = cur.value(cur.unpack("<I", f"{key!r}'s type"), f"metadata {key!r}")
    infos = []
    for i in range(num_tensors):
        name = cur.string(f"tensor {i}'s name")
        n_dims = cur.unpack("<I", f"tensor {name!r}'s n_dims")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dims (GGUF allows 1 to {_MAX_DIMS})")
        dims = [cur.unpack("<Q", f"tensor {name!r}'s dims") for _ in range(n_dims)]
        ttype = cur.unpack("<I", f"tensor {name!r}'s type")
        offset = cur.unpack("<Q", f"tensor {name!r}'s offset")
        infos.append((name, dims, ttype, offset))
    align = fields.get("general.alignment", 32)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise ValueError(f"general.alignment must be a power of two, got {align!r}")
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, ttype, offset in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {ttype}") from None
        if dims[0] % block:
            raise ValueError(f"tensor {name!r}'s row of {dims[0]} is not a multiple of {block}")
        row_bytes = dims[0] // block * type_size
        nbytes = math.prod(dims[1:]) * row_bytes  # Python ints: no overflow
        lo = start + offset
        if lo + nbytes > len(mm):
            raise ValueError(
                f"tensor {name!r} ({nbytes} bytes at byte {lo}) runs past the end of the "
                f"file at byte {len(mm)} (truncated or corrupt)"
            )
        data = mm[lo : lo + nbytes].reshape(*reversed(dims[1:]), row_bytes)
        tensors.append(GGUFTensor(name, tuple(reversed(dims)), ttype, data))
    return GGUFFile(path, version, fields, tensors)


def open_gguf(source: str | Path | GGUFFile) -> GGUFFile:
    """A parsed GGUF file for a path (:func:`read_gguf`), or ``source`` itself if it is one.

    Callers loading both model and tokenizer pass one parsed file to both.
    """
    return source if isinstance(source, GGUFFile) else read_gguf(source)
