"""Request traces (Mooncake ``hash_ids`` JSONL) as dense integer arrays.

One request a line: ``{"timestamp", "input_length", "output_length", "hash_ids"}``.
``hash_ids`` names the prompt's blocks in order; the ids are opaque names (any
JSON integers). Loading remaps them to dense ids ``0..num_ids-1`` in order of
first appearance, so replay kernels index plain arrays instead of hashing.

Each id names one block of ``block_size`` tokens (512 in Mooncake's traces), so
``load_trace`` checks Mooncake's rule ``len(hash_ids) == ceil(input_length /
block_size)`` on every line unless told ``block_size=None``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, overload

import numpy as np

from radixkv.checks import check_int

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "Trace",
    "TraceError",
    "TraceLengthError",
    "TraceRequest",
    "load_trace",
]

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_INT64_MAX = 2**63 - 1
_DENSE_MAX = 2**31 - 1  # dense ids are int32


class TraceError(ValueError):
    """A malformed trace: the message names the place (``file:line`` or ``request i``) and why."""


class TraceLengthError(TraceError):
    """A line whose ``hash_ids`` do not cover its ``input_length`` at the trace's block size."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, with its original hash ids."""

    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class Trace(Sequence[TraceRequest]):
    """Requests in file order, hash ids remapped to dense int32 ids.

    Arrays (read-only by convention; replay never mutates them):

    - ``ids``: int32, every request's dense ids concatenated;
    - ``offsets``: int64, ``num_requests + 1`` entries; request ``i`` is
      ``ids[offsets[i]:offsets[i + 1]]``;
    - ``input_lengths`` / ``output_lengths``: int64 per request;
    - ``timestamps``: int64 if every timestamp is an int, else float64;
    - ``hash_values``: the original id of each dense id (``hash_values[d]``).

    ``trace[i]`` rebuilds a ``TraceRequest`` with the original ids. Build one with
    ``load_trace`` or ``Trace.from_requests``.
    """

    __slots__ = (
        "ids",
        "offsets",
        "input_lengths",
        "output_lengths",
        "timestamps",
        "hash_values",
        "source",
    )

    def __init__(
        self,
        ids: np.ndarray,
        offsets: np.ndarray,
        input_lengths: np.ndarray,
        output_lengths: np.ndarray,
        timestamps: np.ndarray,
        hash_values: list[int],
        source: str = "<requests>",
    ) -> None:
        self.ids = ids
        self.offsets = offsets
        self.input_lengths = input_lengths
        self.output_lengths = output_lengths
        self.timestamps = timestamps
        self.hash_values = hash_values
        self.source = source

    @classmethod
    def from_requests(cls, requests: Iterable[TraceRequest | Mapping[str, Any]]) -> Trace:
        """A trace from ``TraceRequest`` objects or mappings with the four trace fields.

        Raises ``TraceError`` naming ``request i`` (0-based) on the first bad one.
        Complexity: O(total hash ids).
        """
        builder = _Builder("<requests>")
        for i, req in enumerate(requests):
            if isinstance(req, TraceRequest):
                req = {f: getattr(req, f) for f in _FIELDS}
            builder.add(req, f"request {i}")
        return builder.build()

    @property
    def num_requests(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_ids(self) -> int:
        """Distinct hash ids in the trace."""
        return len(self.hash_values)

    @property
    def num_accesses(self) -> int:
        """Block accesses in a replay: the total length of all ``hash_ids``."""
        return len(self.ids)

    def request_ids(self, i: int) -> np.ndarray:
        """Dense ids of request ``i`` (a view)."""
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def __len__(self) -> int:
        return self.num_requests

    @overload
    def __getitem__(self, i: int) -> TraceRequest: ...
    @overload
    def __getitem__(self, i: slice) -> Trace: ...
    def __getitem__(self, i: int | slice) -> TraceRequest | Trace:
        if isinstance(i, slice):
            return Trace.from_requests(self[j] for j in range(*i.indices(len(self))))
        n = self.num_requests
        if not -n <= i < n:
            raise IndexError(f"request index {i} out of range for {n} requests")
        i %= n
        hv = self.hash_values
        ts = self.timestamps[i]
        return TraceRequest(
            timestamp=int(ts) if self.timestamps.dtype.kind == "i" else float(ts),
            input_length=int(self.input_lengths[i]),
            output_length=int(self.output_lengths[i]),
            hash_ids=tuple(hv[d] for d in self.request_ids(i).tolist()),
        )

    def __iter__(self) -> Iterator[TraceRequest]:
        for i in range(self.num_requests):
            yield self[i]

    def __repr__(self) -> str:
        return (
            f"Trace(source={self.source!r}, num_requests={self.num_requests}, "
            f"num_accesses={self.num_accesses}, num_ids={self.num_ids})"
        )


def load_trace(
    source: str | os.PathLike[str] | BinaryIO, block_size: int | None = MOONCAKE_BLOCK_SIZE
) -> Trace:
    """Read a JSONL trace from a path or a binary file object, streaming line by line.

    Blank lines are skipped. Each other line must be a JSON object with
    ``timestamp`` (a finite number), ``input_length`` and ``output_length``
    (ints >= 0) and ``hash_ids`` (a list of ints); extra keys are ignored. With
    a ``block_size`` (tokens per hash id; default 512, Mooncake's), each line
    must also have ``len(hash_ids) == ceil(input_length / block_size)``
    (``TraceLengthError`` otherwise); ``block_size=None`` skips that check, for
    traces whose ids are not fixed-size blocks. On the first bad line raises
    ``TraceError("FILE:LINE: problem")`` (a ``ValueError``) and returns nothing
    (no partial trace); a line nested deeper than the JSON parser's recursion
    limit is one such line. ``OSError`` if the file cannot be read.

    A file object (e.g. ``sys.stdin.buffer``) is read to its end and not
    closed; messages call it by its ``name`` (``<stdin>``), else ``<stream>``.
    An empty source gives an empty trace. ``ValueError`` for a bad
    ``block_size``, before reading anything.

    Complexity: O(file size); memory O(total hash ids).
    """
    block_size = check_int("block_size", block_size, low=1, optional=True)
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        with open(name, "rb") as f:
            return _parse(f, name, block_size)
    return _parse(source, str(getattr(source, "name", "<stream>")), block_size)


def _parse(f: Iterable[bytes], name: str, block_size: int | None) -> Trace:
    builder = _Builder(name, block_size)
    for lineno, raw in enumerate(f, start=1):
        if not raw.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(raw, parse_constant=_reject_constant)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
            raise TraceError(f"{where}: invalid JSON: {exc}") from None
        except RecursionError:  # the parser's nesting limit: a record nests two deep
            raise TraceError(f"{where}: invalid JSON: it nests too deeply") from None
        builder.add(obj, where)
    return builder.build()


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid number")


class _Builder:
    """Accumulates validated requests; ``build`` makes the arrays. Nothing escapes on error.

    The record checks stay inline rather than ``radixkv.checks`` calls: they judge a
    file's JSON values, not arguments (a ``TraceError`` naming ``FILE:LINE``), and run
    once per hash id of a trace of millions.
    """

    def __init__(self, source: str, block_size: int | None = None) -> None:
        self.source = source
        self.block_size = block_size
        self.dense: dict[int, int] = {}
        self.hash_values: list[int] = []
        self.ids: list[int] = []
        self.offsets: list[int] = [0]
        self.input_lengths: list[int] = []
        self.output_lengths: list[int] = []
        self.timestamps: list[int | float] = []

    def add(self, obj: object, where: str) -> None:
        if not isinstance(obj, Mapping):
            raise TraceError(f"{where}: expected a JSON object, got {_kind(obj)}")
        missing = [f for f in _FIELDS if f not in obj]
        if missing:
            raise TraceError(f"{where}: missing field {', '.join(missing)}")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise TraceError(f"{where}: timestamp must be a number, got {_kind(ts)}")
        if isinstance(ts, float) and not math.isfinite(ts):
            raise TraceError(f"{where}: timestamp must be finite, got {ts!r}")
        if isinstance(ts, int) and not -_INT64_MAX <= ts <= _INT64_MAX:
            raise TraceError(f"{where}: timestamp {ts} does not fit in int64")
        input_length = _length(obj["input_length"], "input_length", where)
        output_length = _length(obj["output_length"], "output_length", where)
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, (list, tuple)):
            raise TraceError(f"{where}: hash_ids must be a list of ints, got {_kind(hash_ids)}")
        dense, hash_values = self.dense, self.hash_values
        row = []
        for j, h in enumerate(hash_ids):
            if isinstance(h, bool) or not isinstance(h, int):
                raise TraceError(f"{where}: hash_ids[{j}] must be an int, got {_kind(h)}")
            d = dense.get(h)
            if d is None:
                d = len(hash_values)
                if d > _DENSE_MAX:
                    raise TraceError(f"{where}: more than {_DENSE_MAX + 1} distinct hash ids")
                dense[h] = d
                hash_values.append(h)
            row.append(d)
        bs = self.block_size
        if bs is not None and len(hash_ids) != -(-input_length // bs):
            raise TraceLengthError(
                f"{where}: {len(hash_ids)} hash_ids, but input_length {input_length} at block "
                f"size {bs} needs ceil({input_length} / {bs}) = {-(-input_length // bs)}"
            )
        self.ids.extend(row)
        self.offsets.append(len(self.ids))
        self.input_lengths.append(input_length)
        self.output_lengths.append(output_length)
        self.timestamps.append(ts)

    def build(self) -> Trace:
        all_int = all(isinstance(t, int) for t in self.timestamps)
        return Trace(
            ids=np.asarray(self.ids, dtype=np.int32),
            offsets=np.asarray(self.offsets, dtype=np.int64),
            input_lengths=np.asarray(self.input_lengths, dtype=np.int64),
            output_lengths=np.asarray(self.output_lengths, dtype=np.int64),
            timestamps=np.asarray(self.timestamps, dtype=np.int64 if all_int else np.float64),
            hash_values=self.hash_values,
            source=self.source,
        )


def _length(value: object, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {field} must be an int, got {_kind(value)}")
    if value < 0:
        raise TraceError(f"{where}: {field} must be >= 0, got {value}")
    if value > _INT64_MAX:
        raise TraceError(f"{where}: {field} {value} does not fit in int64")
    return value


def _kind(value: object) -> str:
    if isinstance(value, (bool, int, float)):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"string {value[:40]!r}"
    return type(value).__name__
