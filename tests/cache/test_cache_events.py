"""KV cache events from RadixCache and HashBlockCache (``events=ChainHasher(...)``).

Examples pin each event kind; a hypothesis state machine runs random serving
workloads (shared prefixes, namespaces, splits, held and partly released
requests, evictions, resets) on both caches and checks, after every step, that
the events rebuild exactly the set of wire hashes of the blocks the cache
holds. That set is computed independently: the test records, for every block
an insert adopted, the (namespace, prefix) it was adopted for, and hashes that
prefix with the ChainHasher itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import VLLM_SHA256_CBOR_HASHES
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.cache import BlockAllocator, HashBlockCache, InvariantError, NullCache, RadixCache
from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.cache.hashing import ChainHasher, namespace_extra_keys, vllm_hash_seed

try:
    from radixkv.fleet.index import ExactIndex
except ImportError:  # pragma: no cover - the fleet tier is written alongside
    ExactIndex = None

try:
    import cbor2  # noqa: F401

    RECIPES = ["xxhash", "sha256_cbor"]
except ImportError:  # pragma: no cover - cbor2 is the fleet extra's
    RECIPES = ["xxhash"]

CACHES = {"radix": RadixCache, "hash": HashBlockCache}
XX = ChainHasher("xxhash", seed=0)


def wires(hasher: ChainHasher, tokens, bs: int, namespace=None) -> list[int]:
    """The wire hashes of the full blocks of ``tokens`` from the root, computed directly."""
    digests = hasher.hashes(hasher.root, tokens, bs, namespace_extra_keys(namespace))
    return [hasher.wire(d) for d in digests]


def serve(alloc, cache, tokens, ns=None) -> list[int]:
    m = cache.match(tokens, namespace=ns)
    need = len(tokens) // alloc.block_size - len(m.blocks)
    blocks = list(m.blocks) + alloc.alloc(need)
    cache.insert(tokens, blocks, namespace=ns)
    alloc.decref(blocks)
    cache.check()
    return blocks


def make(kind: str, hasher=XX, num_blocks: int = 64, bs: int = 2):
    alloc = BlockAllocator(num_blocks=num_blocks, block_size=bs)
    return alloc, CACHES[kind](alloc, events=hasher)


# ---------------------------------------------------------------------- examples
@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("ns", [None, "salt"])
def test_one_insert_one_block_stored(kind, ns):
    alloc, cache = make(kind)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    serve(alloc, cache, tokens, ns)
    (ev,) = cache.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == wires(XX, tokens, 2, ns)
    assert ev.parent_block_hash is None
    assert ev.token_ids == tokens[:6]
    assert ev.block_size == 2
    if ns is None:
        assert ev.extra_keys is None
    else:
        assert ev.extra_keys == [("salt",), None, None]
    assert cache.take_events() == []  # taken: the log starts empty again
    assert cache.events_hasher is XX


@pytest.mark.parametrize("kind", CACHES)
def test_extension_chains_from_the_last_cached_block(kind):
    alloc, cache = make(kind)
    serve(alloc, cache, [1, 2, 3, 4], "ns")
    cache.take_events()
    serve(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8], "ns")
    (ev,) = cache.take_events()
    full = wires(XX, [1, 2, 3, 4, 5, 6, 7, 8], 2, "ns")
    assert ev.block_hashes == full[2:]
    assert ev.parent_block_hash == full[1]
    assert ev.token_ids == [5, 6, 7, 8]
    assert ev.extra_keys is None  # not the namespace's first block


@pytest.mark.parametrize("kind", CACHES)
def test_split_emits_only_the_new_blocks(kind):
    alloc, cache = make(kind)
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])
    cache.take_events()
    m = cache.match([1, 2, 3, 4, 9, 9])  # splits the tree's node after 2 blocks
    alloc.decref(m.blocks)
    assert cache.take_events() == []
    serve(alloc, cache, [1, 2, 3, 4, 7, 7, 8, 8])
    (ev,) = cache.take_events()
    full = wires(XX, [1, 2, 3, 4, 7, 7, 8, 8], 2)
    assert ev.block_hashes == full[2:]
    assert ev.parent_block_hash == full[1]
    cache.check()


def test_radix_split_inside_insert_emits_only_new_blocks():
    alloc, cache = make("radix")
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])
    cache.take_events()
    blocks = alloc.alloc(3)
    cache.insert([1, 2, 9, 9, 5, 6], blocks)  # diverges inside the node: split + new leaf
    alloc.decref(blocks)
    (ev,) = cache.take_events()
    full = wires(XX, [1, 2, 9, 9, 5, 6], 2)
    assert ev.block_hashes == full[1:]
    assert ev.parent_block_hash == full[0]
    assert cache.num_nodes == 3
    cache.check()


@pytest.mark.parametrize("kind", CACHES)
def test_evict_removes_exactly_the_evicted_blocks(kind):
    alloc, cache = make(kind)
    serve(alloc, cache, [1, 2, 3, 4])
    serve(alloc, cache, [1, 2, 5, 6, 7, 8])
    cache.take_events()
    before = set(cache.held_blocks().tolist())
    freed = cache.evict(2)
    gone = before - set(cache.held_blocks().tolist())
    assert freed == len(gone) >= 2
    events = cache.take_events()
    assert all(isinstance(e, BlockRemoved) and len(e.block_hashes) == 1 for e in events)
    removed = [e.block_hashes[0] for e in events]
    assert len(removed) == len(gone)
    live = set(wires(XX, [1, 2, 3, 4], 2)) | set(wires(XX, [1, 2, 5, 6, 7, 8], 2))
    assert len(live) == 4
    # What is left is exactly what peek still finds.
    left = set()
    for t in ([1, 2, 3, 4], [1, 2, 5, 6, 7, 8]):
        left |= set(wires(XX, t[: cache.peek(t)], 2))
    assert set(removed) == live - left
    cache.evict(100)
    assert len(cache.take_events()) == len(left)
    cache.check()


@pytest.mark.parametrize("kind", CACHES)
def test_reset_clears_all(kind):
    alloc, cache = make(kind)
    serve(alloc, cache, [1, 2, 3, 4])
    cache.take_events()
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    cache.check()
    serve(alloc, cache, [1, 2, 3, 4])
    (ev,) = cache.take_events()
    assert ev.block_hashes == wires(XX, [1, 2, 3, 4], 2) and ev.parent_block_hash is None


@pytest.mark.parametrize("kind", CACHES)
def test_events_off_cost_nothing(kind):
    alloc = BlockAllocator(num_blocks=32, block_size=2)
    cache = CACHES[kind](alloc)
    assert cache.events_hasher is None
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 9])
    alloc.decref(m.blocks)
    serve(alloc, cache, [1, 2, 7, 7])
    cache.evict(1)
    assert cache.take_events() == []
    cache.reset()
    assert cache.take_events() == []
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])
    if kind == "radix":
        assert all(node.digests is None for node in cache._iter_nodes())
    else:  # the names are the sha256 BlockHasher's (32 bytes), not event digests
        assert all(len(name) == 32 for name in cache._queue.values())
    cache.check()


def test_null_cache_has_no_events():
    cache = NullCache(BlockAllocator(num_blocks=4, block_size=2))
    assert cache.take_events() == [] and cache.events_hasher is None


@pytest.mark.parametrize("kind", CACHES)
def test_events_must_be_a_chain_hasher(kind):
    with pytest.raises(TypeError, match="events"):
        CACHES[kind](BlockAllocator(num_blocks=4, block_size=2), events="xxhash")


def test_radix_check_catches_a_wrong_digest():
    alloc, cache = make("radix")
    serve(alloc, cache, [1, 2, 3, 4])
    (node,) = cache._iter_nodes()
    node.digests = node.digests[::-1]
    with pytest.raises(InvariantError, match="digests"):
        cache.check()


def test_hash_cache_runs_after_an_orphan():
    """A block outliving its evicted parent splits a re-insert into two runs."""
    alloc, cache = make("hash")
    t = [1, 1, 2, 2, 3, 3]
    serve(alloc, cache, t)
    m = cache.match(t)
    alloc.decref(m.blocks[:2])  # hold only the last block
    cache.take_events()
    assert cache.evict(2) == 2  # the first two go; the held third stays (an orphan)
    full = wires(XX, t, 2)
    assert {e.block_hashes[0] for e in cache.take_events()} == set(full[:2])
    blocks = alloc.alloc(3)
    cache.insert(t + [4, 4], blocks + alloc.alloc(1))
    ev1, ev2 = cache.take_events()
    full = wires(XX, t + [4, 4], 2)
    assert (ev1.block_hashes, ev1.parent_block_hash) == (full[:2], None)
    assert (ev2.block_hashes, ev2.parent_block_hash) == (full[3:], full[2])
    cache.check()


# ------------------------------------------------------------ vLLM's own hashes
@pytest.mark.skipif("sha256_cbor" not in RECIPES, reason="needs cbor2")
@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("pythonhashseed", VLLM_SHA256_CBOR_HASHES)
def test_sha256_cbor_events_carry_the_hashes_vllm_computes(monkeypatch, kind, pythonhashseed):
    """A cache hashing with vLLM's seed rule publishes, for the same tokens and salt, the
    block hashes a vLLM server publishes (and an indexer recomputes from the tokens)."""
    if pythonhashseed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", pythonhashseed)
    blocks, salted = VLLM_SHA256_CBOR_HASHES[pythonhashseed]
    hasher = ChainHasher("sha256_cbor", seed=vllm_hash_seed())
    tokens = list(range(1000, 1032))
    alloc, cache = make(kind, hasher, bs=16)
    serve(alloc, cache, tokens)
    serve(alloc, cache, tokens[:16], "tenant-x")
    first, second = cache.take_events()
    assert first.block_hashes == blocks and first.parent_block_hash is None
    assert second.block_hashes == [salted] and second.extra_keys == [("tenant-x",)]


def test_vllm_hash_seed_is_pythonhashseed_else_vllms_fixed_string() -> None:
    assert vllm_hash_seed({}) == "vllm-none-hash"
    assert vllm_hash_seed({"PYTHONHASHSEED": "0"}) == "0"
    assert vllm_hash_seed({"PYTHONHASHSEED": ""}) == ""  # set, though empty: vLLM hashes ""
    if "sha256_cbor" in RECIPES:  # an int seed is its decimal text, as PYTHONHASHSEED is
        assert ChainHasher("sha256_cbor", seed=0).root == ChainHasher("sha256_cbor", "0").root


# ------------------------------------------------------------- state machine
NAMESPACES = [None, "lora-a", ("tenant", 2), 7]
PREFIXES = [[i] * 5 + list(range(10 * i, 10 * i + 11)) for i in range(1, 4)]


def apply_events(rebuilt: set[int], events, bs: int, hasher: ChainHasher) -> None:
    """Apply events to a set, checking each stored block's parent is already there."""
    for ev in events:
        if isinstance(ev, BlockStored):
            assert ev.parent_block_hash is None or ev.parent_block_hash in rebuilt
            assert ev.block_size == bs
            assert len(ev.token_ids) == bs * len(ev.block_hashes) > 0
            assert ev.extra_keys is None or (
                ev.parent_block_hash is None
                and len(ev.extra_keys) == len(ev.block_hashes)
                and ev.extra_keys[1:] == [None] * (len(ev.block_hashes) - 1)
            )
            # The hashes are the chain of the tokens from the parent.
            if ev.parent_block_hash is None:
                extra = None if ev.extra_keys is None else ev.extra_keys[0]
                digests = hasher.hashes(hasher.root, ev.token_ids, bs, extra)
                assert [hasher.wire(d) for d in digests] == ev.block_hashes
            assert not rebuilt & set(ev.block_hashes)
            rebuilt.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            (h,) = ev.block_hashes
            assert h in rebuilt
            rebuilt.remove(h)
        else:
            assert isinstance(ev, AllBlocksCleared)
            rebuilt.clear()


class EventMachine(RuleBasedStateMachine):
    recipe = "xxhash"

    @initialize(kind=st.sampled_from(sorted(CACHES)), bs=st.sampled_from([1, 2, 4]))
    def setup(self, kind, bs):
        self.hasher = ChainHasher(self.recipe, seed="s")
        self.bs = bs
        self.alloc = BlockAllocator(num_blocks=40, block_size=bs)
        self.cache = CACHES[kind](self.alloc, events=self.hasher)
        self.rebuilt: set[int] = set()
        self.index = None if ExactIndex is None else ExactIndex(block_size=bs)
        self.origin: dict[int, int] = {}  # cached block -> wire hash of its (namespace, prefix)
        self.requests: list[list[int]] = []  # blocks held by simulated requests
        self.seen: list[tuple[list[int], object]] = []
        note(f"{kind} bs={bs} {self.recipe}")

    def _tokens(self, data) -> tuple[list[int], object]:
        ns = data.draw(st.sampled_from(NAMESPACES), label="ns")
        if self.seen and data.draw(st.booleans(), label="reuse"):
            base, ns = data.draw(st.sampled_from(self.seen), label="seen")
        else:
            base = data.draw(st.sampled_from(PREFIXES), label="prefix")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        tail = data.draw(st.lists(st.integers(0, 3), max_size=9), label="tail")
        return base[:cut] + tail, ns

    def _insert(self, tokens, blocks, ns) -> None:
        before = set(self.cache.held_blocks().tolist())
        self.cache.insert(tokens, blocks, namespace=ns)
        adopted = set(self.cache.held_blocks().tolist()) - before
        hashes = wires(self.hasher, tokens, self.bs, ns)
        for i, b in enumerate(blocks[: len(hashes)]):
            if b in adopted:
                self.origin[b] = hashes[i]
        self.seen.append((tokens, ns))

    def _alloc(self, n: int) -> list[int] | None:
        if n > self.alloc.num_free:
            self.cache.evict(n - self.alloc.num_free)
        if n > self.alloc.num_free:
            return None
        return self.alloc.alloc(n)

    @rule(data=st.data())
    def serve(self, data):
        tokens, ns = self._tokens(data)
        m = self.cache.match(tokens, namespace=ns)
        new = self._alloc(len(tokens) // self.bs - len(m.blocks))
        if new is not None:
            blocks = list(m.blocks) + new
            self._insert(tokens, blocks, ns)
            self.alloc.decref(blocks)
        else:
            self.alloc.decref(m.blocks)

    @rule(data=st.data())
    def insert_fresh(self, data):
        """Insert with all-new blocks: duplicates of cached positions are not adopted."""
        tokens, ns = self._tokens(data)
        blocks = self._alloc(len(tokens) // self.bs)
        if blocks is not None:
            self._insert(tokens, blocks, ns)
            self.alloc.decref(blocks)

    @rule(data=st.data())
    def probe(self, data):
        """A match that lets go at once (splits tree nodes)."""
        tokens, ns = self._tokens(data)
        self.alloc.decref(self.cache.match(tokens, namespace=ns).blocks)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def hold(self, data):
        """A request matches and keeps its blocks (maybe only a tail of them)."""
        tokens, ns = data.draw(st.sampled_from(self.seen), label="held")
        blocks = list(self.cache.match(tokens, namespace=ns).blocks)
        drop = data.draw(st.integers(0, len(blocks)), label="drop")
        self.alloc.decref(blocks[:drop])
        if blocks[drop:]:
            self.requests.append(blocks[drop:])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release(self, data):
        """Preemption-style release: a held request lets go."""
        i = data.draw(st.integers(0, len(self.requests) - 1), label="request")
        self.alloc.decref(self.requests.pop(i))

    @rule(k=st.integers(0, 12))
    def evict(self, k):
        self.cache.evict(k)

    @rule()
    def reset(self):
        self.cache.reset()

    @invariant()
    def events_rebuild_the_cache(self):
        if not hasattr(self, "cache"):
            return
        events = self.cache.take_events()
        apply_events(self.rebuilt, events, self.bs, self.hasher)
        held = self.cache.held_blocks().tolist()
        self.origin = {b: self.origin[b] for b in held}
        assert self.rebuilt == set(self.origin.values())
        assert len(self.rebuilt) == len(held)
        if self.index is not None:
            self.index.apply("r", events)
            assert self.index.blocks("r") == self.rebuilt
        self.cache.check()


TestEventMachine = EventMachine.TestCase


class Sha256EventMachine(EventMachine):
    recipe = "sha256_cbor"


TestSha256EventMachine = pytest.mark.skipif("sha256_cbor" not in RECIPES, reason="needs cbor2")(
    Sha256EventMachine.TestCase
)
TestSha256EventMachine.settings = settings(max_examples=25, stateful_step_count=30)


# ------------------------------------------------------------ radix == hash
workload = st.lists(
    st.tuples(
        st.sampled_from(range(len(PREFIXES))),
        st.integers(0, 16),
        st.lists(st.integers(0, 3), max_size=8),
        st.sampled_from(NAMESPACES),
    ),
    max_size=25,
)


def _live_hashes(kind: str, recipe: str, bs: int, requests) -> set[int]:
    hasher = ChainHasher(recipe, seed=1)
    alloc = BlockAllocator(num_blocks=2000, block_size=bs)
    cache = CACHES[kind](alloc, events=hasher)
    rebuilt: set[int] = set()
    for p, cut, tail, ns in requests:
        tokens = PREFIXES[p][:cut] + tail
        serve(alloc, cache, tokens, ns)
        if len(tokens) > 3:  # and a probe that splits the tree
            alloc.decref(cache.match(tokens[:-3] + [9, 9, 9], namespace=ns).blocks)
        apply_events(rebuilt, cache.take_events(), bs, hasher)
    return rebuilt


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bs", [1, 3])
def test_radix_and_hash_publish_the_same_hashes(recipe, bs):
    from hypothesis import given

    @settings(max_examples=40 if recipe == "xxhash" else 10)
    @given(requests=workload)
    def check(requests):
        radix = _live_hashes("radix", recipe, bs, requests)
        assert radix == _live_hashes("hash", recipe, bs, requests)
        expected = set()
        for p, cut, tail, ns in requests:
            expected |= set(wires(ChainHasher(recipe, seed=1), PREFIXES[p][:cut] + tail, bs, ns))
        assert radix == expected

    check()


def test_namespace_keys_of_a_value_and_its_one_tuple_differ() -> None:
    """Regression: ``1`` and ``(1,)`` (or ``"a"`` and ``("a",)``) gave one key, so two
    namespaces published the same hashes and an index dropped one's blocks with the other's."""
    from radixkv.cache.hashing import namespace_extra_keys

    pairs = [(1, (1,)), ("a", ("a",)), (b"x", (b"x",)), (1, True), (1, 1.0)]
    for a, b in pairs:
        assert namespace_extra_keys(a) != namespace_extra_keys(b), (a, b)
    h = ChainHasher("xxhash", seed=0)
    tokens = list(range(8))
    assert h.hashes(h.root, tokens, 4, namespace_extra_keys(1)) != h.hashes(
        h.root, tokens, 4, namespace_extra_keys((1,))
    )
    assert namespace_extra_keys("t1") == ("t1",)  # vLLM's cache_salt shape


# ------------------------------------------------- one hash: HashBlockCache's names
@pytest.mark.parametrize("recipe", RECIPES)
def test_hash_cache_names_its_blocks_with_the_hashes_it_emits(recipe):
    hasher = ChainHasher(recipe, seed=3)
    alloc, cache = make("hash", hasher)
    for ns in (None, "t", ("tenant", 2)):
        tokens = [5, 6, 7, 8, 9, 9]
        names = cache.block_names(tokens, ns)
        assert names == hasher.hashes(hasher.root, tokens, 2, namespace_extra_keys(ns))
        serve(alloc, cache, tokens, ns)
        (ev,) = cache.take_events()
        assert ev.block_hashes == [hasher.wire(n) for n in names]
    # the 64-bit xxhash digests may collide: the cache keeps token bytes to check hits
    assert bool(cache._tokens) == (recipe == "xxhash")


class CountingHasher(ChainHasher):
    """Counts the blocks it hashes, through either of its entry points."""

    def __init__(self) -> None:
        super().__init__("xxhash", seed=0)
        self.blocks = 0
        one = self.block_name

        def block_name(parent, block, keys):
            self.blocks += 1
            return one(parent, block, keys)

        self.block_name = block_name

    def hashes(self, parent, tokens, block_size, first_extra=None):
        self.blocks += len(tokens) // block_size
        return super().hashes(parent, tokens, block_size, first_extra)


def test_hash_cache_with_events_hashes_each_block_once():
    """Regression (issue 23): the names and the event digests were two hashes of every block."""
    hasher = CountingHasher()
    named = []

    def names(parent, block, extra):  # events on: the event hash names the blocks
        named.append(block)
        return hash((parent, block, extra))

    alloc = BlockAllocator(num_blocks=32, block_size=2)
    cache = HashBlockCache(alloc, hash_fn=names, events=hasher)
    serve(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])  # a first request: 4 blocks
    assert hasher.blocks == 4
    serve(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9])  # match names 5 (4 hits, a miss)
    assert hasher.blocks == 4 + 5  # and the insert hashes none of them again
    assert named == [] and len(cache.take_events()) == 2


def test_hash_cache_keeps_equal_repr_namespaces_apart_with_events_on():
    """Two namespaces whose extra keys coincide (same type and repr) share event hashes, as in
    the tree, but never blocks: each namespace looks its names up in its own map."""

    class Tenant:
        def __init__(self, name: str) -> None:
            self.name = name

        def __repr__(self) -> str:
            return "Tenant"

    a, b = Tenant("a"), Tenant("b")
    alloc, cache = make("hash")
    serve(alloc, cache, [1, 2, 3, 4], ns=a)
    m = cache.match([1, 2, 3, 4], namespace=b)
    assert m.num_tokens == 0
    serve(alloc, cache, [1, 2, 3, 4], ns=b)
    assert cache.cached_blocks == 4 and cache.num_namespaces == 2
    ev_a, ev_b = (e for e in cache.take_events() if isinstance(e, BlockStored))
    assert ev_a.block_hashes == ev_b.block_hashes == wires(XX, [1, 2, 3, 4], 2, a)
    cache.check()


def test_the_null_event_log_records_nothing():
    from radixkv.cache.events import NO_EVENTS

    NO_EVENTS.check_namespace("\ud800")  # nothing is hashed, so every namespace passes
    NO_EVENTS.stored([b"x" * 8], None, [1, 2], None)
    NO_EVENTS.stored_runs([b"x" * 8], [0], [1, 2], None)
    NO_EVENTS.removed([b"x" * 8])
    NO_EVENTS.cleared()
    assert NO_EVENTS.take() == [] and len(NO_EVENTS) == 0 and NO_EVENTS.hasher is None


def test_stored_runs_records_one_event_per_run_of_positions():
    from radixkv.cache.events import EventLog

    tokens = list(range(10))
    digests = XX.hashes(XX.root, tokens, 2, ("t",))
    log = EventLog(XX, 2)
    log.stored_runs(digests, [0, 1, 3, 4], np.array(tokens), ("t",))
    first, second = log.take()
    assert first.block_hashes == [XX.wire(d) for d in digests[:2]]
    assert (first.parent_block_hash, first.extra_keys) == (None, [("t",), None])
    assert first.token_ids == tokens[:4]
    assert second.block_hashes == [XX.wire(d) for d in digests[3:]]
    assert (second.parent_block_hash, second.extra_keys) == (XX.wire(digests[2]), None)
    assert second.token_ids == tokens[6:]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_entry_point_of_a_chain_hasher_gives_the_same_chain(recipe):
    """hashes, chain (with and without a memo), block_name step by step and the wire ints."""
    from radixkv.cache.hashing import chain_hashes

    h = ChainHasher(recipe, seed="s")
    tokens = np.arange(40, dtype=np.int32)
    for ns in (None, "t", ("a", 1), 7, 1.5):
        want = h.hashes(h.root, tokens, 4, namespace_extra_keys(ns))
        keys = h.first_extra(ns)
        assert h.chain(tokens.tobytes(), 16, keys) == want
        assert h.chain(tokens.tobytes(), 16, keys, want[:3]) == want
        parent, extra, steps = h.root, keys, []
        for i in range(10):
            parent = h.block_name(parent, tokens[4 * i : 4 * i + 4].tobytes(), extra)
            extra = h.no_extra
            steps.append(parent)
        assert steps == want
        assert chain_hashes(h, tokens, 4, ns) == [h.wire(d) for d in want]
        assert h.wire_list(b"".join(want)) == [h.wire(d) for d in want]
