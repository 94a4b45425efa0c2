"""The wire format: vLLM's KV event batch payload, byte for byte (radixkv.fleet.wire).

The BlockStored golden vector is a payload captured from vLLM 0.33; the
BlockRemoved and AllBlocksCleared ones are written out from the msgpack rules
the module docstring states, so they pin the rules rather than msgspec's
current behaviour.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventLog
from radixkv.cache.hashing import ChainHasher
from radixkv.fleet.wire import decode_batch, encode_batch

HASH = 0x08F5C656CA3C3A75

# A real vLLM payload: ts 1.5, one BlockStored of tokens 0..15, data_parallel_rank 0.
VLLM_BLOCK_STORED = bytes.fromhex(
    "93cb3ff800000000000091de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173"
    "68657391cf08f5c656ca3c3a75b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69"
    "6473dc0010000102030405060708090a0b0c0d0e0faa626c6f636b5f73697a6510a76c6f72615f69"
    "64c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739191a27431"
    "a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f61747465"
    "6e74696f6e00"
)
STORED = BlockStored(
    block_hashes=[HASH],
    parent_block_hash=None,
    token_ids=list(range(16)),
    block_size=16,
    lora_id=None,
    medium="GPU",
    lora_name=None,
    extra_keys=[("t1",)],
    group_idx=0,
    kv_cache_spec_kind="full_attention",
)


def fixstr(s: str) -> bytes:
    """msgpack fixstr: 0xa0 | length, then the utf-8 bytes (every key here is < 32 bytes)."""
    b = s.encode()
    assert len(b) < 32
    return bytes([0xA0 | len(b)]) + b


BATCH_HEAD = bytes.fromhex("93cb3ff800000000000091")  # [ts=1.5 (float64), [one event], ...
DP0 = b"\x00"  # ..., data_parallel_rank=0]

# BlockRemoved as vLLM emits it: one hash, medium "GPU", group_idx 0. Four keys:
# "type", the two fields without a default (always), group_idx (defaulted, not None).
VLLM_BLOCK_REMOVED = (
    BATCH_HEAD
    + b"\x84"
    + fixstr("type")
    + fixstr("BlockRemoved")
    + fixstr("block_hashes")
    + b"\x91\xcf"  # [uint64]
    + HASH.to_bytes(8, "big")
    + fixstr("medium")
    + fixstr("GPU")
    + fixstr("group_idx")
    + b"\x00"
    + DP0
)
REMOVED = BlockRemoved(block_hashes=[HASH], medium="GPU", group_idx=0)


# ------------------------------------------------------------ golden vectors
def test_block_stored_encodes_to_vllms_bytes() -> None:
    assert len(VLLM_BLOCK_STORED) == 207
    assert encode_batch([STORED], ts=1.5, data_parallel_rank=0) == VLLM_BLOCK_STORED


def test_vllms_block_stored_decodes_to_the_struct() -> None:
    batch = decode_batch(VLLM_BLOCK_STORED)
    assert batch == EventBatch(ts=1.5, events=[STORED], data_parallel_rank=0)
    assert type(batch.events[0]) is BlockStored
    assert batch.events[0].extra_keys == [("t1",)]


def test_block_removed_golden() -> None:
    assert encode_batch([REMOVED], ts=1.5, data_parallel_rank=0) == VLLM_BLOCK_REMOVED
    assert decode_batch(VLLM_BLOCK_REMOVED) == EventBatch(1.5, [REMOVED], 0)


def test_all_blocks_cleared_golden_and_nil_rank() -> None:
    cleared = b"\x81" + fixstr("type") + fixstr("AllBlocksCleared")
    assert cleared.hex() == "81a474797065b0416c6c426c6f636b73436c6561726564"
    payload = encode_batch([AllBlocksCleared()], ts=1.5)
    assert payload == BATCH_HEAD + cleared + b"\xc0"  # rank None is nil, not left out
    assert decode_batch(payload) == EventBatch(1.5, [AllBlocksCleared()], None)


def test_block_stored_always_has_a_map16_header() -> None:
    bare = BlockStored([1], None, [], 16, None, None, None)  # 8 keys: fits a fixmap, still map16
    payload = encode_batch([bare], ts=0.0)
    assert payload[10:14] == b"\x91\xde\x00\x08"  # [one event], map16 of 8 keys


def test_older_and_newer_payloads_decode() -> None:
    """A 2-element batch (no rank) and an event with a key this schema lacks both decode."""
    old = msgspec.msgpack.encode([2.0, [{"type": "AllBlocksCleared"}]])
    assert decode_batch(old) == EventBatch(2.0, [AllBlocksCleared()], None)
    newer = msgspec.msgpack.encode(
        [2.0, [{"type": "BlockRemoved", "block_hashes": [7], "medium": None, "future": 1}], 3]
    )
    assert decode_batch(newer) == EventBatch(2.0, [BlockRemoved([7], None)], 3)


def test_event_log_output_round_trips() -> None:
    log = EventLog(ChainHasher("sha256_cbor", seed=0), block_size=4)
    h = log.hasher
    digests = h.hashes(h.root, np.arange(8), 4, first_extra=("t1",))
    log.stored(digests, None, np.arange(8), ("t1",))
    log.removed(digests[1:])
    log.cleared()
    events = log.take()
    assert decode_batch(encode_batch(events, ts=3.25)).events == events


def test_a_store_tiers_events_round_trip_with_their_medium() -> None:
    """A tiered cache's events, "STORAGE" ones included, come back from the wire unchanged."""
    from cache_helpers import cache_with_store

    dev, cache = cache_with_store(ChainHasher("xxhash", seed=0), 4, 8, "write_through")
    blocks = dev.alloc(3)
    cache.insert(np.arange(12), blocks)
    dev.decref(blocks)
    cache.evict(3)
    events = cache.take_events()
    assert [e.medium for e in events if isinstance(e, BlockStored)] == ["GPU", "CPU", "STORAGE"]
    payload = encode_batch(events, ts=4.5, data_parallel_rank=1)
    assert b"\xa7STORAGE" in payload  # fixstr of 7 bytes
    assert decode_batch(payload) == EventBatch(4.5, events, 1)


# ------------------------------------------------------------ the encoding rules
u64 = st.integers(0, 2**64 - 1)
small = st.integers(-(2**31), 2**31 - 1)
text = st.text(max_size=6)


def opt(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


key_part = text | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=6)
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(u64, max_size=4),
    parent_block_hash=opt(u64),
    token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=40),
    block_size=st.integers(1, 256),
    lora_id=opt(small),
    medium=opt(text),
    lora_name=opt(text),
    extra_keys=opt(st.lists(opt(st.lists(key_part, max_size=3).map(tuple)), max_size=4)),
    group_idx=opt(small),
    kv_cache_spec_kind=opt(text),
    kv_cache_spec_sliding_window=opt(small),
    locality=opt(text),
    ownership=opt(text),
    session_id=opt(text),
    lookahead_token_ids=opt(st.lists(small, max_size=8)),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(u64, max_size=4),
    medium=opt(text),
    group_idx=opt(small),
    locality=opt(text),
    ownership=opt(text),
)
events = st.lists(stored | removed | st.just(AllBlocksCleared()), max_size=6)
timestamps = st.floats(allow_nan=False, allow_infinity=False)
ranks = opt(st.integers(0, 2**16))


@given(events=events, ts=timestamps, rank=ranks)
def test_round_trip(events: list, ts: float, rank: int | None) -> None:
    payload = encode_batch(events, ts, rank)
    batch = decode_batch(payload)
    assert batch == EventBatch(ts, events, rank)
    assert encode_batch(batch.events, batch.ts, batch.data_parallel_rank) == payload


@given(events=events, ts=timestamps, rank=ranks)
def test_event_maps_follow_the_rules(events: list, ts: float, rank: int | None) -> None:
    """Read back untyped: "type" first, then required fields always, defaulted ones iff not None."""
    raw = msgspec.msgpack.decode(encode_batch(events, ts, rank))
    assert len(raw) == 3 and raw[0] == ts and raw[2] == rank
    for event, obj in zip(events, raw[1]):
        info = msgspec.structs.fields(type(event))
        expected = ["type"] + [
            f.encode_name
            for f in info
            if f.required or getattr(event, f.name) is not None  # every default here is None
        ]
        assert list(obj) == expected
        assert obj["type"] == type(event).__name__


# ------------------------------------------------------------ errors
# A BlockRemoved with an unknown field 5,000 arrays deep (0x91: a msgpack array of one),
# which the decoder walks to skip.
DEEP_FIELD = msgspec.msgpack.encode(
    [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": None, "x": [127]}], 0]
).replace(b"\x91\x7f", b"\x91" * 5000 + b"\x7f")


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"", "truncated"),
        (VLLM_BLOCK_STORED[:-5], "truncated"),
        (VLLM_BLOCK_STORED + b"\x00", "trailing"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}], 0]), "$[1][0].type"),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}], 0]),
            "$[1][0].block_hashes[0]",
        ),
        (msgspec.msgpack.encode({"ts": 1.0}), "array"),
        (b"\xc1", "invalid"),
        (DEEP_FIELD, "recursion"),
    ],
)
def test_garbage_raises_a_clear_value_error(payload: bytes, words: str) -> None:
    with pytest.raises(ValueError, match="payload is not a KV event batch") as info:
        decode_batch(payload)
    assert words in str(info.value).lower()
    assert f"({len(payload)} bytes" in str(info.value)


def test_decode_wants_bytes() -> None:
    with pytest.raises(TypeError, match="payload must be bytes, got str"):
        decode_batch("93")  # type: ignore[arg-type]
    assert decode_batch(memoryview(VLLM_BLOCK_STORED)) == decode_batch(bytearray(VLLM_BLOCK_STORED))


def test_encode_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match=r"events\[1\] must be a BlockStored.*got 3"):
        encode_batch([REMOVED, 3], ts=0.0)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="events must be a sequence"):
        encode_batch(REMOVED, ts=0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ts must be a finite number, got True"):
        encode_batch([], ts=True)
    with pytest.raises(ValueError, match="ts must be a finite number, got nan"):
        encode_batch([], ts=math.nan)
    with pytest.raises(
        ValueError, match="data_parallel_rank must be a non-negative int or None, got -1"
    ):
        encode_batch([], ts=0.0, data_parallel_rank=-1)
    with pytest.raises(
        TypeError, match="data_parallel_rank must be a non-negative int or None, got '0'"
    ):
        encode_batch([], ts=0.0, data_parallel_rank="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be encoded as msgpack"):
        encode_batch([BlockRemoved([2**64], None)], ts=0.0)
    assert encode_batch((), ts=1) == encode_batch([], ts=1.0)  # an int ts is a float64
