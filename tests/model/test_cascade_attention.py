"""Cascade attention: the grouping plan, and results equal to the dense reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_helpers import GQA, PagedSession, check_against_dense

import radixkv.model.cascade as cascade
from radixkv.model import random_model
from radixkv.model.cascade import MIN_PREFIX_BLOCKS, _attend, plan_cascade
from radixkv.model.gather import causal_mask

torch.set_num_threads(1)


def _plan(tables: list[list[int]], lens: list[tuple[int, int]], bs: int = 4):
    """The plan for sequences ``(query_len, context_len)`` over the given block tables."""
    return plan_cascade(
        [q for q, _ in lens],
        [c for _, c in lens],
        tables,
        block_size=bs,
        group_size=3,
        device="cpu",
    )


def test_plan_groups_by_shared_leading_blocks() -> None:
    tables = [
        [7, 8, 9, 1],  # shares 7, 8, 9 with the next one
        [7, 8, 9, 2, 3],
        [7, 8, 4],  # shares 7, 8
        [5, 6, 10],  # alone
    ]
    lens = [(1, 16), (3, 19), (2, 11), (4, 12)]
    plan = _plan(tables, lens)
    assert plan is not None
    assert plan.groups == [[0, 1, 2]]
    assert plan.prefix_lens == [8]  # blocks 7, 8: the common run of all three members
    assert plan.group_of == [0, 0, 0, -1]
    # gathered: the prefix once, then each sequence's blocks after it (all of them if alone)
    assert plan.gather_blocks.tolist() == [7, 8, 9, 1, 9, 2, 3, 4, 5, 6, 10]
    assert plan.prefix_starts == [0]
    assert plan.seq_starts == [8, 16, 28, 32]
    assert plan.masks[0] is None and plan.masks[1] is not None


def test_prefix_ends_before_any_member_s_new_tokens() -> None:
    # the second sequence's new tokens start at position 8 (block 2): the prefix stops there
    tables = [[7, 8, 9, 1], [7, 8, 9, 2]]
    plan = _plan(tables, [(1, 16), (6, 14)])
    assert plan is not None and plan.prefix_lens == [8]


def test_no_plan_below_the_minimum_prefix() -> None:
    tables = [[7] + list(range(10, 10 + MIN_PREFIX_BLOCKS)), [7] + list(range(20, 23))]
    assert _plan(tables, [(1, 12), (1, 12)]) is None  # one shared block only
    assert _plan([[1, 2, 3], [4, 5, 6]], [(1, 12), (1, 12)]) is None


def test_member_masks_are_the_causal_mask_past_the_prefix() -> None:
    """A member's chunk reads its suffix keys under the loop mask's columns past the prefix."""
    tables = [[7, 8, 9, 1], [7, 8, 9, 2, 3]]
    plan = _plan(tables, [(1, 16), (3, 19)])
    assert plan is not None and plan.prefix_lens == [12]
    member = plan.masks[1]
    assert member is not None and member.dtype == torch.float32
    loop = causal_mask(3, 19, 3, torch.device("cpu"))
    assert torch.equal(member == 0, loop[:, 12:])
    assert torch.isneginf(member[~loop[:, 12:]]).all()


def _shared_session(model, bs: int, prefix_blocks: int, tails: list[int], seed: int):
    """Sequence 0 holds a prefix; sequences 1.. start on its blocks with their own tails."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 97, (prefix_blocks * bs,), generator=g).tolist()
    s = PagedSession(model, block_size=bs, num_blocks=prefix_blocks + 4 * len(tails) + 40)
    s.add(0, prefix + torch.randint(0, 97, (tails[0],), generator=g).tolist())
    s.step({0: prefix_blocks * bs})
    for sid, n in enumerate(tails[1:], start=1):
        s.add(
            sid, prefix + torch.randint(0, 97, (n,), generator=g).tolist(), share=(0, prefix_blocks)
        )
    return s


@pytest.mark.parametrize("flash", [True, False])
def test_cascade_matches_dense_with_a_shared_prefix(flash: bool, monkeypatch) -> None:
    if not flash:
        monkeypatch.setattr(cascade, "_FLASH_CPU", None)  # the plain-math path (non-CPU)
    model = random_model(GQA, seed=3, attention_backend="cascade")
    s = _shared_session(model, bs=4, prefix_blocks=5, tails=[9, 6, 11, 3], seed=4)
    plans = []
    real = cascade.plan_cascade

    def spy(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr("radixkv.model.forward_batch.plan_cascade", spy)
    # prefill tails in chunks alongside each other, then decode all four together
    for plan in ({0: 9, 1: 4, 2: 5}, {1: 2, 2: 6, 3: 3}):
        check_against_dense(model, s, s.step(plan))
    for _ in range(3):
        for sid in range(4):
            s.append(sid, (7 * sid + len(s.tokens[sid])) % 97)
        check_against_dense(model, s, s.step(dict.fromkeys(range(4), 1)))
    assert all(p is not None for p in plans[1:])  # every step after the first had a group


def test_attend_paths_agree() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 12, 8, generator=g)
    k, v = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g)
    seen = causal_mask(4, 20, 3, torch.device("cpu"))
    mask = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
    o1, l1 = _attend(q, k, v, mask)
    saved = cascade._FLASH_CPU
    try:
        cascade._FLASH_CPU = None
        o2, l2 = _attend(q, k, v, mask)
    finally:
        cascade._FLASH_CPU = saved
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(o1, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    prefix_blocks=st.integers(0, 6),
    tails=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_cascade_matches_dense_property(
    block_size: int, prefix_blocks: int, tails: list[int], seed: int
) -> None:
    model = random_model(
        dataclasses.replace(GQA, num_layers=1), seed=5, attention_backend="cascade"
    )
    if prefix_blocks == 0:
        s = PagedSession(model, block_size, num_blocks=sum(tails) + 8, seed=seed)
        for sid, n in enumerate(tails):
            s.add(sid, list(range(1, n + 1)))
    else:
        s = _shared_session(model, block_size, prefix_blocks, tails, seed)
    g = torch.Generator().manual_seed(seed)
    while any(s.remaining(i) for i in s.tokens):
        plan = {}
        for sid in s.tokens:
            left = s.remaining(sid)
            if left:
                plan[sid] = int(torch.randint(1, left + 1, (1,), generator=g))
        check_against_dense(model, s, s.step(plan))


def test_prefix_ends_before_the_block_where_new_tokens_start_mid_block() -> None:
    """Issue 26: at block size 4, context 14 with 5 new tokens starts them at position 9,
    inside block 2 (positions 8-11): the prefix is blocks 0-1, 8 tokens, not 12 (rounding
    the start up would put keys of the member's own chunk into the unmasked prefix call)."""
    tables = [[7, 8, 9, 1], [7, 8, 9, 2]]  # three blocks in common
    plan = _plan(tables, [(1, 16), (5, 14)])
    assert plan is not None and plan.prefix_lens == [8]
    # block 9 holds the member's new tokens, so each sequence gathers it after the prefix
    assert plan.gather_blocks.tolist() == [7, 8, 9, 1, 9, 2]
    assert plan.seq_starts == [8, 16]
    member = plan.masks[1]
    assert member is not None
    loop = causal_mask(5, 14, 3, torch.device("cpu"))
    assert torch.equal(member == 0, loop[:, 8:])  # new tokens at 9..13 stay causally masked
