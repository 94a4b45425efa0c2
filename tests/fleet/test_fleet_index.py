"""The router's indexes: ApproxIndex (from routing decisions) and ExactIndex (from KV events).

Unit tests pin each behaviour (prefix lengths, namespaces, TTL, the per-replica
LRU and the global cap, speculative entries); two hypothesis state machines
run each index against a plain-Python oracle and call ``check()`` after every
step. The hashes are real chained hashes (``chain_hashes``), so prefix sharing
is the caches' own.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.cache.hashing import ChainHasher, namespace_extra_keys
from radixkv.errors import InvariantError
from radixkv.fleet.index import ApproxIndex, ExactIndex, chain_hashes

BS = 4
HASHER = ChainHasher("xxhash", seed=0)


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def chain(tokens: list[int], namespace: Hashable = None, hasher: ChainHasher = HASHER) -> list[int]:
    return chain_hashes(hasher, np.array(tokens, dtype=np.int32), BS, namespace)


def stored(hashes: list[int], parent: int | None = None, block_size: int = BS) -> BlockStored:
    tokens = [0] * (block_size * len(hashes))
    return BlockStored(hashes, parent, tokens, block_size, None, "GPU", None)


def removed(*hashes: int) -> list[BlockRemoved]:
    return [BlockRemoved([h], "GPU") for h in hashes]


A = list(range(1, 41))  # ten blocks
B = A[:12] + list(range(100, 128))  # shares three blocks with A


# ------------------------------------------------------------------ chain_hashes
@pytest.mark.parametrize("recipe", ["xxhash", "sha256_cbor"])
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=70),
    block_size=st.integers(1, 9),
    namespace=st.sampled_from([None, "lora", 7, ("t", 2), b"salt", 1.5]),
    seed=st.sampled_from([0, 1, "s"]),
)
def test_chain_hashes_are_the_hashers_wire_hashes(
    recipe: str, tokens: list[int], block_size: int, namespace: Hashable, seed: int | str
) -> None:
    hasher = ChainHasher(recipe, seed=seed)
    extra = namespace_extra_keys(namespace)
    want = [hasher.wire(d) for d in hasher.hashes(hasher.root, tokens, block_size, extra)]
    got = chain_hashes(hasher, np.array(tokens, dtype=np.int32), block_size, namespace)
    assert got == want
    assert chain_hashes(hasher, tokens, block_size, namespace) == want  # a list works too


def test_chain_hashes_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        chain_hashes(HASHER, [1, 2], 0, None)
    with pytest.raises(ValueError, match="tokens must be 1-D"):
        chain_hashes(HASHER, np.zeros((2, 4), dtype=np.int32), BS, None)
    assert chain_hashes(HASHER, [1, 2, 3], BS, None) == []  # no full block


def test_namespaces_never_share_a_hash() -> None:
    plain, salted = chain(A), chain(A, "tenant-b")
    assert len(plain) == len(salted) == 10
    assert not set(plain) & set(salted)


# ------------------------------------------------------------------ ApproxIndex
def test_approx_matches_the_longest_recorded_prefix_per_replica() -> None:
    idx = ApproxIndex(clock=FakeClock())
    idx.record("r0", chain(A))
    assert idx.match(chain(A)) == {"r0": 10}
    assert idx.match(chain(B)) == {"r0": 3}
    assert idx.match(chain(A[:9])) == {"r0": 2}  # only full blocks
    assert idx.match(chain([9] + A[1:])) == {}  # first block differs: nothing shared
    idx.record("r1", chain(B))
    assert idx.match(chain(B)) == {"r0": 3, "r1": 10}
    assert idx.match([]) == {}
    idx.check()


def test_approx_namespaces_isolate() -> None:
    idx = ApproxIndex(clock=FakeClock())
    idx.record("r0", chain(A, "tenant-a"))
    assert idx.match(chain(A, "tenant-a")) == {"r0": 10}
    assert idx.match(chain(A, "tenant-b")) == {}
    assert idx.match(chain(A)) == {}


def test_approx_entries_expire_after_ttl_unless_touched() -> None:
    clock = FakeClock()
    idx = ApproxIndex(ttl=10.0, clock=clock)
    idx.record("r0", chain(A))
    clock.now = 6.0
    idx.record("r0", chain(A[:8]))  # touches the first two blocks only
    clock.now = 16.0  # 16 s after the first record, 10 s after the touch
    assert idx.match(chain(A)) == {"r0": 2}
    assert len(idx) == 2
    clock.now = 16.5
    assert idx.match(chain(A)) == {}
    assert len(idx) == 0 and idx.num_entries("r0") == 0
    idx.check()


def test_approx_now_must_not_go_back_but_the_clock_may() -> None:
    clock = FakeClock(5.0)
    idx = ApproxIndex(clock=clock)
    idx.record("r0", chain(A), now=5.0)
    with pytest.raises(ValueError, match="now must not go back: got now=4.0"):
        idx.record("r0", chain(A), now=4.0)
    clock.now = 1.0  # a clock stepping back is clamped to the latest time seen
    idx.record("r0", chain(B))
    assert set(idx.hashes("r0").values()) == {5.0}
    idx.check()


def test_approx_replica_lru_keeps_its_capacity_and_drops_deepest_first() -> None:
    idx = ApproxIndex(clock=FakeClock())
    idx.set_capacity("r0", 12)
    idx.record("r0", chain(A))
    idx.record("r0", chain(B))  # 7 new blocks: 17 > 12, the oldest 5 (A's tail) go
    assert idx.num_entries("r0") == 12
    assert idx.match(chain(A)) == {"r0": 5}
    assert idx.match(chain(B)) == {"r0": 10}
    idx.set_capacity("r0", 4)  # shrinking drops the oldest now
    assert idx.num_entries("r0") == 4
    assert idx.match(chain(B)) == {"r0": 4}
    long = list(range(500, 600))  # 25 blocks: only the first 4 are kept
    idx.record("r0", chain(long))
    assert idx.match(chain(long)) == {"r0": 4}
    idx.check()


def test_approx_unknown_capacity_falls_back_to_the_default() -> None:
    idx = ApproxIndex(default_capacity_blocks=5, clock=FakeClock())
    idx.set_capacity("r0", 0)
    assert idx.capacity("r0") == 5 and idx.capacity("never-seen") == 5
    idx.record("r0", chain(A))
    assert idx.num_entries("r0") == 5
    assert ApproxIndex().capacity("r0") is None
    with pytest.raises(ValueError, match="capacity_blocks must be a non-negative int, got -1"):
        idx.set_capacity("r0", -1)


def test_approx_global_cap_drops_the_fleets_oldest() -> None:
    clock = FakeClock()
    idx = ApproxIndex(max_entries=15, clock=clock)
    idx.record("r0", chain(A))
    clock.now = 1.0
    idx.record("r1", chain(B))  # 20 entries > 15: r0's oldest 5 go
    assert len(idx) == 15
    assert idx.num_entries("r0") == 5 and idx.num_entries("r1") == 10
    assert idx.match(chain(A)) == {"r0": 5, "r1": 3}
    clock.now = 2.0
    idx.record("r1", chain(list(range(300, 372))))  # 18 blocks: only 15 fit, all r1's
    assert len(idx) == 15 and idx.num_entries("r0") == 0
    idx.check()


def test_approx_drop_replica_forgets_it() -> None:
    idx = ApproxIndex(clock=FakeClock())
    idx.set_capacity("r0", 50)
    idx.record("r0", chain(A))
    idx.record("r1", chain(A))
    idx.drop_replica("r0")
    assert idx.match(chain(A)) == {"r1": 10}
    assert len(idx) == 10 and idx.capacity("r0") is None
    idx.drop_replica("never-seen")
    idx.check()


def test_approx_check_names_a_broken_invariant() -> None:
    idx = ApproxIndex(clock=FakeClock())
    idx.set_capacity("r0", 20)
    idx.record("r0", chain(A))
    idx._num_entries += 1
    with pytest.raises(InvariantError, match="entry count 11 != 10"):
        idx.check()
    idx._num_entries -= 1
    idx._capacity["r0"] = 3
    with pytest.raises(InvariantError, match="over its capacity 3"):
        idx.check()


def test_approx_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="ttl must be a positive number, got 0"):
        ApproxIndex(ttl=0)
    with pytest.raises(ValueError, match="max_entries must be a positive int, got 0"):
        ApproxIndex(max_entries=0)
    with pytest.raises(ValueError, match="default_capacity_blocks must be a positive int"):
        ApproxIndex(default_capacity_blocks=-3)
    with pytest.raises(ValueError, match="clock must be a callable"):
        ApproxIndex(clock=3.0)  # type: ignore[arg-type]
    assert ApproxIndex(ttl=math.inf).ttl == math.inf


def test_approx_memory_is_measured_per_entry() -> None:
    idx = ApproxIndex(clock=FakeClock())
    empty = idx.memory_bytes()
    rng = np.random.default_rng(0)
    for r in range(4):
        for _ in range(25):
            idx.record(r, chain_hashes(HASHER, rng.integers(0, 1000, 400), BS, None))
    per_entry = (idx.memory_bytes() - empty) / len(idx)
    assert len(idx) == 10_000
    assert 60 < per_entry < 400, per_entry


# ------------------------------------------------------------------ ExactIndex
def test_exact_index_from_hand_built_events() -> None:
    idx = ExactIndex(block_size=BS, clock=FakeClock())
    a, b = chain(A), chain(B)
    idx.apply("r0", [stored(a[:4]), stored(a[4:], parent=a[3])])
    idx.apply("r1", [stored(b[:6])])
    assert idx.blocks("r0") == set(a) and idx.blocks("r1") == set(b[:6])
    assert idx.match(a) == {"r0": 10, "r1": 3}
    assert idx.match(b) == {"r0": 3, "r1": 6}
    idx.apply("r0", removed(a[5]))  # an interior block: the chain stops there
    assert idx.match(a) == {"r0": 5, "r1": 3}
    idx.apply("r0", [AllBlocksCleared()])
    assert idx.blocks("r0") == set() and idx.match(a) == {"r1": 3}
    idx.apply("r1", removed(12345))  # a block never stored: nothing to undo
    assert idx.match(chain(A, "other")) == {}
    idx.check()


def test_exact_index_tracks_the_device_tier_of_a_replica_with_a_host_tier() -> None:
    """Host-tier events (medium "CPU") neither add a block nor keep one the device dropped."""
    from radixkv.cache.allocator import BlockAllocator
    from radixkv.cache.host import HostTier
    from radixkv.cache.tiered import TieredRadixCache

    dev = BlockAllocator(16, BS)
    cache = TieredRadixCache(dev, "lru", events=HASHER, host=HostTier(BlockAllocator(32, BS)))
    idx = ExactIndex(block_size=BS, clock=FakeClock())
    blocks = dev.alloc(10)
    cache.insert(A, blocks)
    dev.decref(blocks)
    idx.apply("r0", cache.take_events())
    assert idx.match(chain(A)) == {"r0": 10}
    cache.evict(10)  # to the host: CPU stored, then GPU removed
    events = cache.take_events()
    assert {e.medium for e in events if isinstance(e, BlockStored)} == {"CPU"}
    idx.apply("r0", events)
    assert idx.match(chain(A)) == {}
    m = cache.load(A)  # back on the device: GPU stored
    dev.decref(m.blocks)
    idx.apply("r0", cache.take_events())
    assert idx.match(chain(A)) == {"r0": 10}
    cache.evict_host(100)  # the mirrors go: CPU removed, the device still holds the blocks
    idx.apply("r0", cache.take_events())
    assert idx.match(chain(A)) == {"r0": 10}
    idx.check()


def test_exact_index_skips_a_replicas_storage_events() -> None:
    """A store tier's BlockStored (medium "STORAGE") is no device hit: it neither adds a block
    nor keeps one the device dropped, whatever order it comes in."""
    from cache_helpers import cache_with_store

    idx = ExactIndex(block_size=BS, clock=FakeClock())
    idx.apply("r1", [BlockStored(chain(A), None, A, BS, None, "STORAGE", None)])
    assert idx.match(chain(A)) == {} and idx.blocks("r1") == set()
    idx.apply("r1", [BlockStored(chain(A)[:2], None, A[:8], BS, None, None, None)])
    assert idx.match(chain(A)) == {"r1": 2}  # no medium: vLLM's device
    idx.drop_replica("r1")
    dev, cache = cache_with_store(HASHER, BS, 16)
    blocks = dev.alloc(10)
    cache.insert(A, blocks)
    dev.decref(blocks)
    cache.evict(10)  # to the host: GPU removed
    cache.evict_host(100)  # to the store (write_back): STORAGE stored, then CPU removed
    events = cache.take_events()
    assert [e.medium for e in events if isinstance(e, BlockStored)] == ["GPU", "CPU", "STORAGE"]
    idx.apply("r0", events)
    assert idx.match(chain(A)) == {} and idx.blocks("r0") == set()
    idx.check()


def test_exact_blocks_stored_after_a_clear_in_the_same_batch_are_kept() -> None:
    """An ``AllBlocksCleared`` empties the replica where it stands; what follows it applies."""
    idx = ExactIndex(block_size=BS, clock=FakeClock())
    a, b = chain(A), chain(B)
    idx.apply("r0", [stored(a)])
    idx.apply("r1", [stored(b[:3])])  # a[:3] == b[:3]: both replicas in those masks
    idx.apply("r0", [AllBlocksCleared(), stored(b[:5]), *removed(b[4])])
    assert idx.blocks("r0") == set(b[:4])
    assert idx.match(b) == {"r0": 4, "r1": 3} and idx.match(a) == {"r0": 3, "r1": 3}
    idx.check()
    # The batch: a block the replica held before the clear, stored again, then removed.
    idx.apply("r0", [AllBlocksCleared(), stored(b[:1]), *removed(b[0])])
    assert idx.blocks("r0") == set() and idx.match(b) == {"r1": 3}
    idx.check()
    idx.apply("r0", [stored(a[:2]), AllBlocksCleared(), AllBlocksCleared(), stored(a[:1])])
    assert idx.blocks("r0") == {a[0]} and idx.match(a) == {"r0": 1, "r1": 3}
    idx.check()


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_exact_follows_a_cache_reset_and_inserts_in_one_batch(kind: str) -> None:
    """``cache.reset()`` then inserts before the next ``take_events``: one batch spans both."""
    from radixkv.cache import BlockAllocator, HashBlockCache, RadixCache

    alloc = BlockAllocator(32, BS)
    cache = (RadixCache if kind == "radix" else HashBlockCache)(alloc, events=HASHER)
    idx = ExactIndex(block_size=BS, clock=FakeClock())

    def insert(tokens: list[int]) -> None:
        blocks = alloc.alloc(len(tokens) // BS)
        cache.insert(tokens, blocks)
        alloc.decref(blocks)

    insert(A)
    idx.apply("r0", cache.take_events())
    cache.reset()
    insert(B)
    insert(A[:8])
    events = cache.take_events()
    assert isinstance(events[0], AllBlocksCleared) and len(events) > 1
    idx.apply("r0", events)
    assert idx.blocks("r0") == set(chain(B)) | set(chain(A[:8]))
    assert idx.match(chain(A)) == {"r0": 3}  # not the 10 blocks the reset dropped
    idx.check()


def test_exact_rejects_foreign_events() -> None:
    idx = ExactIndex(block_size=BS, clock=FakeClock())
    with pytest.raises(ValueError, match="block_size must be 4 in replica 'r0'.*got 16"):
        idx.apply("r0", [stored([1, 2], block_size=16)])
    with pytest.raises(TypeError, match="events must be KV cache events, got 'oops'"):
        idx.apply("r0", ["oops"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="spec_ttl must be a positive number"):
        ExactIndex(spec_ttl=-1.0)
    with pytest.raises(ValueError, match="spec_ttl_factor must be a positive number, got 0"):
        ExactIndex(spec_ttl_factor=0)


def test_speculation_lasts_until_the_request_ends() -> None:
    clock = FakeClock()
    idx = ExactIndex(clock=clock)
    a = chain(A)
    idx.apply("r0", [stored(a[:3])])
    assert idx.speculate("r0", a, "q1") == 7  # the three real ones are not speculative
    assert idx.match(a) == {"r0": 10}
    assert idx.speculative("r0") == set(a[3:]) and idx.blocks("r0") == set(a[:3])
    assert idx.ttl_now == math.inf  # no lifetime observed yet: no safety bound
    idx.check()
    clock.now = 1e6  # however long it queues
    assert idx.match(a) == {"r0": 10}
    assert idx.release("r0", "q1") == 7
    assert idx.match(a) == {"r0": 3} and idx.speculative("r0") == set()
    assert idx.num_speculating() == 0 and idx.safety_expired == 0
    assert idx.release("r0", "q1") == 0  # nothing left to end
    idx.check()


def test_a_claim_lasts_while_any_request_holds_it() -> None:
    idx = ExactIndex(clock=FakeClock())
    a = chain(A)
    idx.speculate("r1", a[:4], "q1")
    assert idx.speculate("r1", a, "q2") == 6  # the first four were claimed already
    assert idx.release("r1", "q1") == 0  # q2 still claims all ten
    assert idx.match(a) == {"r1": 10}
    idx.speculate("r1", a[:2], "q2")  # a retry of the same request: its own ticket
    assert idx.num_speculating("r1") == 2
    assert idx.release("r1", "q2") == 8  # the oldest ticket of q2: its ten, but two held on
    assert idx.match(a) == {"r1": 2}
    assert idx.release("r1", "q2") == 2 and idx.match(a) == {}
    idx.check()


def test_a_chain_may_run_real_speculative_real() -> None:
    idx = ExactIndex(clock=FakeClock())
    a = chain(A)
    idx.apply("r0", [stored(a[:3])])
    idx.speculate("r0", a, "q")
    idx.apply("r0", [stored(a[6:], parent=a[5])])  # the replica reports the tail first
    assert idx.speculative("r0") == set(a[3:6])
    assert idx.match(a) == {"r0": 10}
    idx.check()


def test_block_stored_confirms_a_claim() -> None:
    clock = FakeClock()
    idx = ExactIndex(clock=clock)
    a = chain(A)
    idx.speculate("r0", a, "q")
    idx.apply("r0", [stored(a[:6])])
    assert idx.blocks("r0") == set(a[:6]) and idx.speculative("r0") == set(a[6:])
    idx.check()
    assert idx.release("r0", "q") == 4  # finished without the last four reported
    assert idx.match(a) == {"r0": 6}  # the real ones stay
    idx.apply("r0", removed(a[0]))
    assert idx.match(a) == {}  # confirmed, then evicted: gone
    idx.check()


def test_block_removed_keeps_the_claim_of_a_queued_request() -> None:
    idx = ExactIndex(clock=FakeClock())
    a = chain(A)
    idx.apply("r0", [stored(a)])
    assert idx.speculate("r0", a, "q") == 0  # all real: nothing new is speculative
    idx.apply("r0", removed(a[2]))  # evicted before q ran: q will compute it again
    assert idx.match(a) == {"r0": 10} and idx.speculative("r0") == {a[2]}
    idx.apply("r0", [AllBlocksCleared()])  # a reset voids what the index knew, claims too
    assert idx.match(a) == {} and idx.speculative("r0") == set()
    assert idx.num_speculating("r0") == 1  # the request itself still runs there
    assert idx.release("r0", "q") == 0
    idx.check()


def test_a_claim_counts_until_capacity_more_blocks_were_routed_after_it() -> None:
    idx = ExactIndex(clock=FakeClock())
    idx.set_capacity("r0", 4)
    a, b = chain(A), chain(B)
    idx.speculate("r0", a[:2], "q1")  # routed: 2
    idx.speculate("r0", b[3:6], "q2")  # 3 more after q1's: still held
    assert idx.match(a) == {"r0": 2}
    idx.speculate("r0", b[6:7], "q3")  # 4 = capacity after it: evicted before one routed now
    assert idx.match(a) == {}
    assert idx.speculative("r0") >= set(a[:2])  # the claim itself stays
    idx.speculate("r0", a[:2], "q4")  # a newer claimant, nothing routed after it
    assert idx.match(a) == {"r0": 2}
    idx.set_capacity("r0", 0)  # unknown: no bound
    idx.release("r0", "q4")
    assert idx.match(a) == {"r0": 2}
    with pytest.raises(ValueError, match="capacity_blocks"):
        idx.set_capacity("r0", -1)
    idx.check()


def test_a_claim_on_the_last_block_counts() -> None:
    idx = ExactIndex(clock=FakeClock())
    a = chain(A)
    idx.speculate("r0", a[:1], "q1")
    assert idx.match(a[:1]) == {"r0": 1}  # a one-block request
    idx.apply("r1", [stored(a[:9])])
    idx.speculate("r1", a, "q2")
    assert idx.match(a) == {"r0": 1, "r1": 10}  # the tenth, claimed, after nine real


def test_a_dropped_replica_comes_back_without_its_old_capacity() -> None:
    idx = ExactIndex(clock=FakeClock())
    a, b = chain(A), chain(B)
    idx.set_capacity("r0", 2)
    idx.drop_replica("r0")
    idx.speculate("r0", a, "q1")
    idx.speculate("r0", b[3:], "q2")  # 7 more blocks: past the old bound of 2
    assert idx.match(a) == {"r0": 10}  # unknown capacity again: no bound
    idx.check()


def test_the_safety_net_follows_the_observed_lifetimes() -> None:
    clock = FakeClock()
    idx = ExactIndex(spec_ttl_factor=4.0, clock=clock)
    a, b = chain(A), chain(B)
    idx.speculate("r0", a, "q1")
    clock.now = 5.0
    idx.release("r0", "q1")  # lived 5 s: the bound is 20 s
    assert idx.ttl_now == 20.0
    clock.now = 10.0
    idx.speculate("r0", b, "q2")  # its release will be lost
    idx.speculate("r0", a, "q3")
    clock.now = 100.0
    assert idx.match(b) == {"r0": 10}  # old, but nothing routed after it has finished
    idx.release("r0", "q3")  # q3, routed after q2, finished: q2's prefill has run
    assert idx.ttl_now == 360.0  # q3 lived 90 s
    clock.now = 369.9
    assert idx.match(b) == {"r0": 10}
    clock.now = 370.0
    assert idx.match(b) == {} and idx.safety_expired == 1
    assert idx.num_speculating() == 0
    idx.check()
    clock = FakeClock()
    fixed = ExactIndex(spec_ttl=2.0, clock=clock)  # a plain time bound, no other condition
    fixed.speculate("r0", a, "q")
    assert fixed.ttl_now == 2.0
    clock.now = 2.0
    assert fixed.match(a) == {} and fixed.safety_expired == 1


def test_exact_reset_and_drop_replica() -> None:
    idx = ExactIndex(clock=FakeClock())
    a = chain(A)
    for r in ("r0", "r1", "r2"):
        idx.apply(r, [stored(a)])
    idx.speculate("r0", chain(B), "q")
    idx.reset_replica("r0")
    assert idx.match(a) == {"r1": 10, "r2": 10} and "r0" in idx.replicas()
    idx.drop_replica("r1")
    assert idx.match(a) == {"r2": 10} and idx.replicas() == ["r0", "r2"]
    idx.apply("r3", [stored(a[:2])])  # takes the freed slot
    assert idx.match(a) == {"r2": 10, "r3": 2}
    idx.drop_replica("never-seen")
    idx.check()


def test_exact_check_names_a_broken_invariant() -> None:
    idx = ExactIndex(clock=FakeClock())
    a = chain(A)
    idx.apply("r0", [stored(a)])
    idx._real["r0"].discard(a[0])
    with pytest.raises(InvariantError, match="the table holds 10 .* real sets 9"):
        idx.check()


def test_exact_memory_grows_with_blocks() -> None:
    idx = ExactIndex(clock=FakeClock())
    empty = idx.memory_bytes()
    idx.apply("r0", [stored(chain(list(range(4000))))])
    assert idx.memory_bytes() - empty > 1000 * 32  # at least the thousand hash ints


# ------------------------------------------------------------------ state machines
PREFIXES = [list(range(k * 50, k * 50 + 12)) for k in range(3)]  # three blocks each
REPLICAS = ["r0", "r1", "r2"]

prompts = st.builds(
    lambda p, tail, ns: (PREFIXES[p][: 4 * tail[0]] + tail[1], ns),
    st.integers(0, 2),
    st.tuples(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=14)),
    st.sampled_from([None, "ns"]),
)


def walk(held: set[int] | dict[int, float], hashes: list[int]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class ApproxMachine(RuleBasedStateMachine):
    """ApproxIndex against an oracle: per replica a list of (hash, time), oldest first."""

    @initialize(
        ttl=st.sampled_from([3.0, 50.0]),
        max_entries=st.integers(4, 40),
        default=st.sampled_from([None, 6]),
    )
    def setup(self, ttl: float, max_entries: int, default: int | None) -> None:
        self.clock = FakeClock()
        self.idx = ApproxIndex(
            ttl=ttl, max_entries=max_entries, default_capacity_blocks=default, clock=self.clock
        )
        self.ttl, self.max_entries, self.default = ttl, max_entries, default
        self.lrus: dict[str, list[tuple[int, float]]] = {}
        self.caps: dict[str, int] = {}

    def cap(self, r: str) -> float:
        c = self.caps.get(r, 0)
        return c if c > 0 else (math.inf if self.default is None else self.default)

    def expire(self) -> None:
        cutoff = self.clock.now - self.ttl
        for r in list(self.lrus):
            lru = self.lrus[r] = [(h, t) for h, t in self.lrus[r] if t >= cutoff]
            if not lru:
                del self.lrus[r]

    def pop_oldest(self, r: str) -> None:
        self.lrus[r].pop(0)
        if not self.lrus[r]:
            del self.lrus[r]

    @rule(dt=st.sampled_from([0.0, 0.5, 2.0, 4.0]))
    def advance(self, dt: float) -> None:
        self.clock.now += dt

    @rule(r=st.sampled_from(REPLICAS), prompt=prompts)
    def record(self, r: str, prompt: tuple[list[int], object]) -> None:
        hashes = chain(*prompt)
        self.idx.record(r, hashes)
        self.expire()
        keep = min(self.cap(r), self.max_entries)
        hashes = hashes[: int(min(keep, len(hashes)))]
        if not hashes:
            return
        lru = self.lrus.setdefault(r, [])
        for h in reversed(hashes):
            lru[:] = [(x, t) for x, t in lru if x != h]
            lru.append((h, self.clock.now))
        while len(lru) > self.cap(r):
            self.pop_oldest(r)
        while sum(map(len, self.lrus.values())) > self.max_entries:
            order = {q: i for i, q in enumerate(self.lrus)}
            oldest = min(self.lrus, key=lambda q: (self.lrus[q][0][1], order[q]))
            self.pop_oldest(oldest)

    @rule(r=st.sampled_from(REPLICAS), cap=st.integers(0, 12))
    def set_capacity(self, r: str, cap: int) -> None:
        self.idx.set_capacity(r, cap)
        self.caps[r] = cap
        while r in self.lrus and len(self.lrus[r]) > self.cap(r):
            self.pop_oldest(r)

    @rule(r=st.sampled_from(REPLICAS))
    def drop(self, r: str) -> None:
        self.idx.drop_replica(r)
        self.lrus.pop(r, None)
        self.caps.pop(r, None)

    @rule(prompt=prompts)
    def match(self, prompt: tuple[list[int], object]) -> None:
        hashes = chain(*prompt)
        got = self.idx.match(hashes)
        self.expire()
        want = {r: walk(dict(lru), hashes) for r, lru in self.lrus.items()}
        assert got == {r: n for r, n in want.items() if n}, (got, want)

    @precondition(lambda self: hasattr(self, "idx"))
    @invariant()
    def same_state(self) -> None:
        self.idx.check()
        for r in REPLICAS:
            want = self.lrus.get(r, [])
            assert list(self.idx.hashes(r).items()) == want, r
        assert len(self.idx) == sum(map(len, self.lrus.values()))


TestApproxMachine = ApproxMachine.TestCase


class ExactMachine(RuleBasedStateMachine):
    """ExactIndex against an oracle: per replica its real hashes; per live request (ticket) the
    hashes it claims and when it was routed; the safety net (the bound from released
    lifetimes, and whether a later request on the replica was released)."""

    @initialize()
    def setup(self) -> None:
        self.clock = FakeClock()
        self.idx = ExactIndex(spec_ttl_factor=4.0, block_size=BS, clock=self.clock)
        self.real: dict[str, set[int]] = {}
        self.tickets: list[dict] = []  # {"id", "r", "owner", "claims", "time"}, oldest first
        self.max_life = -math.inf
        self.next_owner = 0
        self.next_id = 0
        self.done_upto: dict[str, int] = {}  # replica -> newest ticket released there

    def ttl(self) -> float:
        return 4.0 * self.max_life if self.max_life > 0 else math.inf

    def expire(self) -> None:
        """Presumed lost: older than the bound and overtaken by a later release there."""
        cutoff = self.clock.now - self.ttl()
        self.tickets = [
            t
            for t in self.tickets
            if t["time"] > cutoff or self.done_upto.get(t["r"], -1) < t["id"]
        ]

    def claimed(self, r: str) -> set[int]:
        return set().union(*(t["claims"] for t in self.tickets if t["r"] == r))

    def confirm(self, r: str, hashes: list[int]) -> None:
        self.real.setdefault(r, set()).update(hashes)  # claims stay until their requests end

    def void(self, r: str) -> None:
        self.real[r] = set()
        for t in self.tickets:
            if t["r"] == r:
                t["claims"] = set()

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 10.0]))
    def advance(self, dt: float) -> None:
        self.clock.now += dt

    @rule(r=st.sampled_from(REPLICAS), prompt=prompts, cut=st.integers(0, 6))
    def store(self, r: str, prompt: tuple[list[int], object], cut: int) -> None:
        hashes = chain(*prompt)[cut:]  # a replica may store a chain's tail later
        self.idx.apply(r, [stored(hashes)])
        self.confirm(r, hashes)

    @rule(r=st.sampled_from(REPLICAS), prompt=prompts, data=st.data())
    def remove(self, r: str, prompt: tuple[list[int], object], data: st.DataObject) -> None:
        hashes = chain(*prompt)
        gone = data.draw(st.lists(st.sampled_from(hashes), max_size=3)) if hashes else []
        self.idx.apply(r, removed(*gone))
        self.real.setdefault(r, set()).difference_update(gone)

    @rule(r=st.sampled_from(REPLICAS))
    def clear(self, r: str) -> None:
        self.idx.apply(r, [AllBlocksCleared()])
        self.void(r)

    @rule(
        r=st.sampled_from(REPLICAS),
        steps=st.lists(
            st.tuples(st.sampled_from(["store", "remove", "clear"]), prompts, st.integers(0, 6)),
            min_size=1,
            max_size=5,
        ),
    )
    def batch(self, r: str, steps: list[tuple[str, tuple[list[int], object], int]]) -> None:
        """Several events in one ``apply``, clears among them (a batch that spans a reset)."""
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for kind, prompt, cut in steps:
            hashes = chain(*prompt)
            if kind == "clear":
                events.append(AllBlocksCleared())
                self.void(r)
            elif kind == "store":
                events.append(stored(hashes[cut:]))
                self.confirm(r, hashes[cut:])
            else:
                events += removed(*hashes[cut : cut + 2])
                self.real.setdefault(r, set()).difference_update(hashes[cut : cut + 2])
        self.idx.apply(r, events)

    @rule(r=st.sampled_from(REPLICAS), prompt=prompts, retry=st.booleans())
    def speculate(self, r: str, prompt: tuple[list[int], object], retry: bool) -> None:
        hashes = chain(*prompt)
        self.expire()
        mine = [t["owner"] for t in self.tickets if t["r"] == r]
        if retry and mine:
            owner = mine[0]
        else:
            owner = self.next_owner
            self.next_owner += 1
        before = self.claimed(r) | self.real.get(r, set())
        got = self.idx.speculate(r, hashes, owner)
        assert got == len(set(hashes) - before)
        self.tickets.append(
            {
                "id": self.next_id,
                "r": r,
                "owner": owner,
                "claims": set(hashes),
                "time": self.clock.now,
            }
        )
        self.next_id += 1

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.expire()
        if not self.tickets:
            return
        t = data.draw(st.sampled_from(self.tickets))
        r, owner = t["r"], t["owner"]
        first = next(x for x in self.tickets if x["r"] == r and x["owner"] == owner)
        self.max_life = max(self.max_life, self.clock.now - first["time"])
        self.done_upto[r] = max(self.done_upto.get(r, -1), first["id"])
        before = self.claimed(r) - self.real.get(r, set())
        self.tickets.remove(first)
        after = self.claimed(r) - self.real.get(r, set())
        self.expire()  # the longer bound, then the safety net (not counted by release)
        assert self.idx.release(r, owner) == len(before - after)

    @rule(r=st.sampled_from(REPLICAS))
    def drop(self, r: str) -> None:
        self.idx.drop_replica(r)
        self.real.pop(r, None)
        self.done_upto.pop(r, None)
        self.tickets = [t for t in self.tickets if t["r"] != r]

    @rule(prompt=prompts)
    def match(self, prompt: tuple[list[int], object]) -> None:
        hashes = chain(*prompt)
        got = self.idx.match(hashes)
        self.expire()
        want = {}
        for r in REPLICAS:
            n = walk(self.real.get(r, set()) | self.claimed(r), hashes)
            if n:
                want[r] = n
        note(f"match {got} want {want}")
        assert got == want

    @precondition(lambda self: hasattr(self, "idx"))
    @invariant()
    def same_state(self) -> None:
        self.expire()
        for r in REPLICAS:
            assert self.idx.blocks(r) == self.real.get(r, set()), r
            assert self.idx.speculative(r) == self.claimed(r) - self.real.get(r, set()), r
        assert self.idx.num_speculating() == len(self.tickets)
        assert self.idx.ttl_now == self.ttl()
        self.idx.check()


TestExactMachine = ExactMachine.TestCase


class ExactVsCacheMachine(RuleBasedStateMachine):
    """ExactIndex fed a real cache's events against what the cache holds.

    Events are taken only when the ``publish`` rule runs, so one batch may span
    any mix of inserts, evictions and resets (a reset followed by inserts
    included). What the cache holds is computed independently: for every block
    an insert adopted, the chained hash of the prefix it was adopted for.
    """

    @initialize(kind=st.sampled_from(["radix", "hash"]), bs=st.sampled_from([1, 2, 4]))
    def setup(self, kind: str, bs: int) -> None:
        from radixkv.cache import BlockAllocator, HashBlockCache, RadixCache

        self.bs = bs
        self.alloc = BlockAllocator(num_blocks=24, block_size=bs)
        self.cache = (RadixCache if kind == "radix" else HashBlockCache)(self.alloc, events=HASHER)
        self.idx = ExactIndex(block_size=bs, clock=FakeClock())
        self.origin: dict[int, int] = {}  # cached block -> hash of the prefix it was adopted for
        note(f"{kind} bs={bs}")

    @rule(prompt=prompts)
    def serve(self, prompt: tuple[list[int], object]) -> None:
        tokens, ns = prompt
        alloc, cache = self.alloc, self.cache
        m = cache.match(tokens, namespace=ns)
        need = len(tokens) // self.bs - len(m.blocks)
        if need > alloc.num_free:
            cache.evict(need - alloc.num_free)
        if need > alloc.num_free:
            alloc.decref(m.blocks)
            return
        blocks = list(m.blocks) + alloc.alloc(need)
        before = set(cache.held_blocks().tolist())
        cache.insert(tokens, blocks, namespace=ns)
        hashes = chain_hashes(HASHER, np.array(tokens, dtype=np.int32), self.bs, ns)
        for b, h in zip(blocks, hashes, strict=True):
            if b not in before:
                self.origin[b] = h
        alloc.decref(blocks)

    @rule(k=st.integers(0, 10))
    def evict(self, k: int) -> None:
        self.cache.evict(k)

    @rule()
    def reset(self) -> None:
        self.cache.reset()

    @rule()
    def publish(self) -> None:
        events = self.cache.take_events()
        note(f"batch {[type(e).__name__ for e in events]}")
        self.idx.apply("r", events)
        held = self.cache.held_blocks().tolist()
        self.origin = {b: self.origin[b] for b in held}
        assert self.idx.blocks("r") == set(self.origin.values())
        self.idx.check()


TestExactVsCacheMachine = ExactVsCacheMachine.TestCase


def test_the_fleet_and_the_caches_share_one_chain_hash() -> None:
    """One implementation (issue 23): the fleet's chain_hashes is radixkv.cache.hashing's, and
    the events module keeps no hash recipe of its own."""
    import radixkv.cache.events as events
    import radixkv.cache.hashing as hashing
    import radixkv.fleet.index as index

    assert index.chain_hashes is hashing.chain_hashes
    assert not {"CHAIN_HASHES", "namespace_extra_keys", "chain_hashes"} & set(events.__all__)
    assert hashing.CHAIN_HASHES == ("sha256_cbor", "xxhash")
