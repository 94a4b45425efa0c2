"""KV event batches as bytes: vLLM's (0.33) msgpack payload, byte for byte.

One published message is the msgpack array ``[ts, events, data_parallel_rank]``:
``ts`` a float64, ``data_parallel_rank`` an int or nil, ``events`` an array of
maps. Each event map's first key is ``"type"`` (the class name: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), then the class's fields in declared
order: the ones without a default always (nil for None), the defaulted ones
only when not None. ``BlockStored`` always has a map16 header (it can hold more
than 15 keys). These are the rules msgspec follows for the structs of
:mod:`radixkv.cache.events`, which copy vLLM's field for field, so encoding
them with msgspec is what makes the bytes vLLM's: nothing here writes msgpack
by hand.

Decoding ignores map keys it does not know (a newer vLLM's added fields) but
rejects an event ``type`` it does not know.

:class:`Reset` is the other thing a stream of batches delivers: the marker where a
replica's view must start over. It lives here, not beside the ZMQ transport that
emits it, so that its consumers (the routing state) need no pyzmq.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from radixkv.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)
from radixkv.checks import check_int, check_number

__all__ = ["Reset", "decode_batch", "encode_batch"]

_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)

# Built once: msgspec caches per-type encoding plans on these objects.
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(
    events: Sequence[KVCacheEvent], ts: float, data_parallel_rank: int | None = None
) -> bytes:
    """The msgpack payload of one batch: ``[ts, events, data_parallel_rank]``.

    ``events`` (read, not kept) are :class:`BlockStored`, :class:`BlockRemoved`
    or :class:`AllBlocksCleared`, oldest first; their fields are not checked
    beyond what msgpack can hold (msgspec structs are not validated on
    construction: :func:`decode_batch` is where a field's type is checked).
    ``ts`` is a finite real number (seconds since the epoch, by convention).

    Raises ``TypeError`` for an event of another type, a non-number ``ts`` or a
    non-int ``data_parallel_rank``; ``ValueError`` for a non-finite ``ts``, a
    negative ``data_parallel_rank`` or a field msgpack cannot hold (an int
    outside [-2**63, 2**64)). Complexity: O(size of the payload).
    """
    ts = check_number("ts", ts)
    rank = check_int("data_parallel_rank", data_parallel_rank, low=0, optional=True)
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise TypeError(f"events must be a sequence of KV events, got {type(events).__name__}")
    for i, event in enumerate(events):
        if not isinstance(event, _EVENT_TYPES):
            raise TypeError(
                f"events[{i}] must be a BlockStored, BlockRemoved or AllBlocksCleared, "
                f"got {event!r} ({type(event).__name__})"
            )
    batch = EventBatch(ts=ts, events=list(events), data_parallel_rank=rank)
    try:
        return _ENCODER.encode(batch)
    except (OverflowError, msgspec.EncodeError) as exc:
        raise ValueError(f"events cannot be encoded as msgpack: {exc}") from exc


def decode_batch(payload: bytes | bytearray | memoryview) -> EventBatch:
    """The batch in ``payload`` (one message's msgpack bytes; read, not kept).

    Returns a new :class:`EventBatch` whose events are the typed structs.
    Raises ``TypeError`` if ``payload`` is not bytes-like; ``ValueError`` naming
    the payload's size, its first bytes and what msgspec found wrong (truncated
    data, a field of the wrong type with its path such as
    ``$[1][0].block_hashes[0]``, an unknown event type, nesting deeper than the
    decoder's recursion limit) when it is not a batch.
    Complexity: O(len(payload)).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:  # an extra key nested too deeply
        head = bytes(payload[:16]).hex()
        more = "..." if len(payload) > 16 else ""
        raise ValueError(
            f"payload is not a KV event batch ({len(payload)} bytes: {head}{more}): {exc}"
        ) from exc


@dataclass(frozen=True)
class Reset:
    """A marker in a subscriber's output: the replica's view must start over here.

    The consumer drops everything it derived from this replica's earlier
    batches (the exact router clears the replica's index), then applies the
    batches after the marker. An index rebuilt that way holds only blocks the
    replica stored since, so it never claims a prefix the replica evicted
    during the blind spot.

    - ``reason="restart"``: the seq went backwards, so the publisher restarted
      and its cache with it; ``seq`` is the new publisher's first seq seen.
    - ``reason="lost"``: ``num_lost`` batches, ending just before ``seq`` (the
      next one delivered), could not be recovered (the replay ring had dropped
      them, the replay socket did not answer, there is none, or a payload did
      not decode).
    """

    reason: Literal["restart", "lost"]
    seq: int
    num_lost: int = 0
