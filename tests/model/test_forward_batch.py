"""ForwardBatch.build: the one path from block ids to tensors, and the validation before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import CPU_BACKENDS, DEVICES

from radixkv.model import DECODER_BACKENDS, ForwardBatch
from radixkv.model.attention import ATTENTION_BACKENDS, AttentionMetadata
from radixkv.model.forward_batch import triton_backend_runs_on

torch.set_num_threads(1)

BS = 4


def _build(
    input_ids=range(6),
    query_lens=(6,),
    context_lens=(6,),
    block_tables=([5, 2],),
    **kwargs: object,
) -> ForwardBatch:
    options = {
        "block_size": BS,
        "num_blocks": 8,
        "backend": "loop",
        "group_size": 3,
        "device": "cpu",
    }
    options.update(kwargs)
    return ForwardBatch.build(
        input_ids, list(query_lens), list(context_lens), list(block_tables), **options
    )


def test_positions_slots_and_last_tokens_of_a_mixed_step() -> None:
    # a 3-token chunk ending at position 6 over blocks 5, 2; a decode at position 4 over 1, 7
    batch = _build([9, 8, 7, 6], [3, 1], [7, 5], [np.array([5, 2, 0]), [1, 7]])
    assert batch.positions.tolist() == [4, 5, 6, 4]
    assert batch.slot_mapping.tolist() == [8, 9, 10, 28]
    assert batch.input_ids.tolist() == [9, 8, 7, 6]
    assert batch.last_token_index.tolist() == [2, 3]
    assert (batch.num_seqs, batch.num_tokens) == (2, 4)
    assert (batch.block_size, batch.num_blocks) == (BS, 8)
    assert batch.attention.ctx_blocks is not None
    assert batch.attention.ctx_blocks.tolist() == [5, 2, 1, 7]  # only the blocks in use
    for t in (batch.input_ids, batch.positions, batch.slot_mapping, batch.last_token_index):
        assert t.dtype == torch.int64 and t.device == torch.device("cpu")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"query_lens": (), "context_lens": (), "block_tables": ()}, "at least one sequence"),
        ({"context_lens": (6, 6)}, "context_lens 2"),
        ({"block_tables": ([5, 2], [1])}, "block_tables 2"),
        ({"query_lens": (0,), "input_ids": ()}, r"query_lens\[0\] = 0"),
        ({"context_lens": (5,)}, r"query_lens\[0\] = 6 with context_lens\[0\] = 5"),
        ({"input_ids": range(5)}, "input_ids has 5 tokens, sum"),
        ({"input_ids": [[0, 1, 2], [3, 4, 5]]}, "input_ids must be 1-D"),
        ({"input_ids": np.zeros(6)}, "input_ids must hold integers"),
        ({"input_ids": [0, 1, 2, -4, 4, 5]}, r"input_ids\[3\] = -4 \(sequence 0\)"),
        ({"block_tables": ([5],)}, r"block_tables\[0\] has 1 blocks, needs >= 2"),
        ({"block_tables": ([],)}, r"block_tables\[0\] has 0 blocks"),
        ({"block_tables": ([5, 8],)}, r"block_tables\[0\]\[1\] = 8 is outside .*\[0, 8\)"),
        ({"block_tables": ([-1, 2],)}, r"block_tables\[0\]\[0\] = -1"),
        ({"block_tables": ([5.0, 2.0],)}, r"block_tables\[0\] must hold integers"),
        ({"query_lens": (6.0,)}, r"query_lens\[0\] must be an int"),
        ({"backend": "flash"}, "backend"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": True}, "num_blocks"),
        ({"group_size": -1}, "group_size"),
    ],
)
def test_each_bad_input_rejected_naming_field_and_value(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        _build(**kwargs)


def test_bad_block_named_in_its_own_sequence() -> None:
    """The error points at the sequence and entry holding the block, not the flat index."""
    with pytest.raises(ValueError, match=r"block_tables\[2\]\[1\] = 99"):
        _build([1, 1, 1], [1, 1, 1], [4, 5, 8], [[0], [1, 2], [3, 99, 5]])


def test_unused_table_entries_are_not_checked() -> None:
    """Entries past ceil(context_len / block_size) are ignored, even out of range."""
    batch = _build(block_tables=([5, 2, -1, 1000],))
    assert batch.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9]


def test_inputs_are_copied() -> None:
    ids, table = np.arange(6), np.array([5, 2])
    batch = _build(input_ids=ids, block_tables=(table,))
    ids[:] = 0
    table[:] = 0
    assert batch.input_ids.tolist() == list(range(6))
    assert batch.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_backend_gets_its_metadata(backend: str) -> None:
    batch = _build([1, 2, 3], [2, 1], [9, 9], [[0, 1, 2], [0, 1, 3]], backend=backend)
    assert batch.group_size == 3
    if backend == "triton":
        kernel = batch.kernel
        assert batch.attention is None and kernel is not None
        assert kernel.query_starts.tolist() == [0, 2] and kernel.query_lens.tolist() == [2, 1]
        assert kernel.context_lens.tolist() == [9, 9]
        assert kernel.block_tables.tolist() == [[0, 1, 2], [0, 1, 3]]
        assert kernel.max_query_len == 2 and kernel.max_splits == 1
        return
    meta = batch.attention
    assert meta.backend == ("loop" if backend == "cascade" else backend)
    assert meta.group_size == 3 and meta.query_lens == [2, 1] and meta.context_lens == [9, 9]
    assert batch.cascade is None  # two shared blocks, but the chunk's new tokens sit in block 1
    if backend == "padded":
        assert meta.pad_mask is not None and meta.pad_mask.shape == (2, 1, 3 * 2, 9)
    if backend == "varlen":
        assert meta.varlen_mask is not None and meta.varlen_mask.shape == (3 * 3, 18)


def test_cascade_backend_plans_from_the_host_tables() -> None:
    batch = _build([1, 2, 3], [1, 2], [9, 11], [[0, 1, 2], [0, 1, 3]], backend="cascade")
    assert batch.cascade is not None
    assert batch.cascade.groups == [[0, 1]] and batch.cascade.prefix_lens == [8]
    assert batch.cascade.gather_blocks.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_metadata_alone_equals_the_batch_s(backend: str) -> None:
    """``AttentionMetadata.build`` from host data is what ``ForwardBatch.build`` makes."""
    args = ([3, 1], [7, 5], [[5, 2], [1, 7]])
    batch = _build([9, 8, 7, 6], *args, backend=backend)
    alone = AttentionMetadata.build(
        *args, block_size=BS, group_size=3, backend=backend, device="cpu"
    )
    for name in ("ctx_blocks", "pad_q_index", "pad_slots", "pad_mask", "ctx_slots"):
        a, b = getattr(alone, name), getattr(batch.attention, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert alone.key_starts == batch.attention.key_starts


@pytest.mark.parametrize("device", DEVICES)
def test_everything_lands_on_the_device(device: str) -> None:
    for backend in DECODER_BACKENDS:
        if backend == "triton" and not triton_backend_runs_on(device):
            continue
        batch = _build(
            [1, 2, 3], [1, 2], [9, 11], [[0, 1, 2], [0, 1, 3]], backend=backend, device=device
        )
        tensors = [batch.input_ids, batch.positions, batch.slot_mapping, batch.last_token_index]
        meta, kernel = batch.attention, batch.kernel
        if meta is not None:
            tensors += [
                t for t in (meta.ctx_blocks, meta.pad_slots, meta.pad_mask) if t is not None
            ]
            tensors += [t for t in (meta.ctx_slots, meta.varlen_mask) if t is not None]
        if kernel is not None:
            tensors += [kernel.query_starts, kernel.query_lens, kernel.context_lens]
            tensors.append(kernel.block_tables)
        if batch.cascade is not None:
            tensors.append(batch.cascade.gather_blocks)
        assert all(t.device.type == device for t in tensors), backend


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 9),
    data=st.data(),
)
def test_slot_mapping_equals_a_per_position_brute_force(block_size: int, data) -> None:
    """For random tables and lengths, every new token's slot is its table's block and offset."""
    num_blocks = data.draw(st.integers(1, 40), label="num_blocks")
    num_seqs = data.draw(st.integers(1, 5), label="num_seqs")
    qls, cls_, tables = [], [], []
    for _ in range(num_seqs):
        c = data.draw(st.integers(1, 30))
        q = data.draw(st.integers(1, c))
        need = -(-c // block_size)
        extra = data.draw(st.integers(0, 3))
        tables.append(
            data.draw(
                st.lists(
                    st.integers(0, num_blocks - 1), min_size=need + extra, max_size=need + extra
                )
            )
        )
        qls.append(q)
        cls_.append(c)
    backend = data.draw(st.sampled_from(CPU_BACKENDS))
    ids = list(range(sum(qls)))
    batch = ForwardBatch.build(
        ids, qls, cls_, tables, block_size=block_size, num_blocks=num_blocks,
        backend=backend, group_size=2, device="cpu",
    )  # fmt: skip
    want_pos, want_slots = [], []
    for q, c, table in zip(qls, cls_, tables, strict=True):
        for p in range(c - q, c):
            want_pos.append(p)
            want_slots.append(table[p // block_size] * block_size + p % block_size)
    assert batch.positions.tolist() == want_pos
    assert batch.slot_mapping.tolist() == want_slots
    assert batch.input_ids.tolist() == ids
