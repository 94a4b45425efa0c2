"""RadixCache with a host tier: examples for each behaviour and regressions for its pitfalls."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv import BlockAllocator, RadixCache
from radixkv.cache import TieredRadixCache
from radixkv.cache.events import BlockRemoved, BlockStored
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.host import HostTier, NullCopier


def tiered(num_device=8, num_host=16, bs=2, **tier):
    dev, host = BlockAllocator(num_device, bs), BlockAllocator(num_host, bs)
    copier = tier.pop("copier", NullCopier())
    extra = tier.pop("cache", {})
    cache = TieredRadixCache(dev, "lru", host=HostTier(host, copier, **tier), **extra)
    return cache, dev, host


def put(cache, dev, tokens, ns=None):
    m = cache.match(tokens, ns)
    need = len(tokens) // dev.block_size - len(m.blocks)
    if need > dev.num_free:
        cache.evict(need - dev.num_free)
    blocks = m.blocks + dev.alloc(need)
    cache.insert(tokens, blocks, ns)
    dev.decref(blocks)
    cache.check()


def test_evicted_node_stays_findable_on_host_and_loads_back():
    cache, dev, host = tiered()
    put(cache, dev, [1, 2, 3, 4, 5, 6])
    assert cache.evict(3) == 3
    assert cache.cached_blocks == 0 and cache.host_cached_blocks == 3
    m = cache.match([1, 2, 3, 4, 5, 6, 7])
    assert (m.num_tokens, m.host_num_tokens) == (0, 6)
    m = cache.load([1, 2, 3, 4, 5, 6, 7])
    assert (m.num_tokens, m.host_num_tokens, len(m.blocks)) == (6, 0, 3)
    assert (dev.refcounts(m.block_array) == 2).all()  # the tree's and the caller's
    cache.check()
    s = cache.stats
    assert (s.backed_up_blocks, s.loaded_blocks, s.host_hit_tokens) == (3, 3, 12)
    assert cache.host_cached_blocks == 3  # the copy stays: a mirror now
    dev.decref(m.blocks)


def test_load_ending_inside_a_node_splits_both_tiers_at_one_boundary():
    cache, dev, _ = tiered()
    put(cache, dev, [1, 2, 3, 4, 5, 6])
    cache.evict(3)
    m = cache.load([1, 2, 3, 4, 9, 9])
    assert (m.num_tokens, m.host_num_tokens) == (4, 0)
    cache.check()
    assert cache.match([1, 2, 3, 4, 5, 6]).host_num_tokens == 2


def test_load_stops_at_the_first_node_the_pool_cannot_take():
    cache, dev, _ = tiered(num_device=3, num_host=16)
    put(cache, dev, [1, 2])
    put(cache, dev, [1, 2, 3, 4, 5, 6])
    cache.evict(3)
    held = dev.alloc(2)  # a request holds most of the pool
    m = cache.load([1, 2, 3, 4, 5, 6])
    assert (m.num_tokens, m.host_num_tokens) == (2, 4)
    cache.check()
    dev.decref(m.blocks + held)


def test_load_says_how_many_of_its_tokens_it_brought_back():
    cache, dev, _ = tiered(num_device=4, num_host=16)
    put(cache, dev, [1, 2, 3, 4])
    put(cache, dev, [1, 2, 3, 4, 5, 6, 7, 8])
    cache.evict(2)  # the leaf [5..8] goes to the host; [1..4] stays on the device
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])
    assert (m.num_tokens, m.host_num_tokens, m.loaded_num_tokens) == (4, 4, 0)  # loads nothing
    dev.decref(m.blocks)
    m = cache.load([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (m.num_tokens, m.host_num_tokens, m.loaded_num_tokens) == (8, 0, 4)
    assert "loaded_num_tokens=4" in repr(m)
    loaded = m.block_array[-(m.loaded_num_tokens // 2) :]
    assert (dev.refcounts(loaded) == 2).all()  # the tree's and the caller's, as for the rest
    dev.decref(m.blocks)
    m = cache.load([1, 2, 3, 4, 5, 6])  # all on the device now: nothing to load
    assert (m.num_tokens, m.loaded_num_tokens) == (6, 0)
    dev.decref(m.blocks)
    cache.check()
    assert dev.num_free == 0 and (dev.refcounts(np.arange(4)) == 1).all()  # the tree's only


def test_write_through_copies_after_k_hits_and_at_insert_for_zero():
    cache, dev, _ = tiered(write_policy="write_through", write_through_hits=2)
    put(cache, dev, [1, 2, 3, 4])
    assert cache.stats.backed_up_blocks == 0
    for _ in range(2):
        dev.decref(cache.match([1, 2, 3, 4]).blocks)
    assert cache.stats.backed_up_blocks == 2
    cache, dev, _ = tiered(write_policy="write_through", write_through_hits=0)
    put(cache, dev, [1, 2, 3, 4])
    assert cache.stats.backed_up_blocks == 2


def test_write_through_never_copies_at_eviction():
    cache, dev, _ = tiered(write_policy="write_through", write_through_hits=5)
    put(cache, dev, [1, 2, 3, 4])
    cache.evict(2)
    assert cache.num_nodes == 0 and cache.stats.backed_up_blocks == 0
    assert cache.stats.skipped_backup_blocks == 0  # not a failure: the policy's choice


def test_no_host_space_deletes_the_node_and_counts_it_never_raises():
    cache, dev, host = tiered(num_host=1)
    put(cache, dev, [1, 2, 3, 4])  # 2 blocks: can never fit 1 host block
    assert cache.evict(2) == 2
    assert cache.num_nodes == 0 and cache.stats.skipped_backup_blocks == 2
    assert host.num_free == 1
    cache.check()


def test_a_host_full_of_mirrors_does_not_starve():
    # write_through at insert fills the host with mirrors of device nodes; host eviction must
    # drop mirrors, or every later backup fails.
    cache, dev, host = tiered(
        num_device=8, num_host=4, write_policy="write_through", write_through_hits=0
    )
    put(cache, dev, [1, 2, 3, 4])
    put(cache, dev, [5, 6, 7, 8])
    assert host.num_free == 0
    put(cache, dev, [9, 9, 8, 8])
    assert cache.stats.backed_up_blocks == 6 and cache.stats.host_evicted_blocks == 2
    cache.check()


def test_host_smaller_than_device_keeps_working():
    cache, dev, host = tiered(num_device=8, num_host=2)
    for i in range(20):
        put(cache, dev, [i, i])
        cache.evict(1)
    assert host.num_free + cache.host_cached_blocks == 2
    assert cache.stats.backed_up_blocks > 0 and cache.stats.host_evicted_blocks > 0


def test_host_eviction_makes_progress_through_nested_host_only_nodes():
    cache, dev, host = tiered(num_device=8, num_host=8)
    put(cache, dev, [1, 1, 2, 2])
    put(cache, dev, [1, 1, 2, 2, 3, 3])
    put(cache, dev, [1, 1, 2, 2, 4, 4])
    cache.evict(8)
    assert cache.host_cached_blocks == 4
    assert cache.evict_host(100) == 4  # leaves first, then the parent they left childless
    assert cache.num_nodes == 0 and host.num_free == 8
    cache.check()


def test_a_node_being_loaded_is_never_deleted():
    # Loading [1..6] needs 3 device blocks; the pool holds 3 other backed-up blocks, whose
    # eviction needs host space; the only host candidates are the loading node's own
    # copies. They must be skipped, not deleted under the load.
    cache, dev, host = tiered(num_device=3, num_host=5)
    put(cache, dev, [1, 2, 3, 4, 5, 6])
    cache.evict(3)
    put(cache, dev, [7, 7, 8, 8, 9, 9])
    m = cache.load([1, 2, 3, 4, 5, 6])
    cache.check()
    assert m.num_tokens + m.host_num_tokens == 6
    dev.decref(m.blocks)
    assert cache.match([1, 2, 3, 4, 5, 6]).host_num_tokens + cache.peek([1, 2, 3, 4, 5, 6]) == 6


def test_insert_through_host_only_nodes_adopts_the_callers_blocks():
    cache, dev, _ = tiered()
    put(cache, dev, [1, 2, 3, 4])
    cache.evict(2)
    blocks = dev.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], blocks) == 0  # nothing was on the device
    assert cache.peek([1, 2, 3, 4, 5, 6]) == 6
    assert cache.host_cached_blocks == 2  # the copy stays, a mirror
    cache.check()
    dev.decref(blocks)


def test_pin_covers_only_the_device_prefix():
    cache, dev, _ = tiered()
    put(cache, dev, [1, 2, 3, 4, 5, 6])
    cache.evict(3)
    put(cache, dev, [1, 2])
    assert cache.pin([1, 2, 3, 4, 5, 6]) == 2
    cache.check()


def test_reset_frees_both_pools():
    cache, dev, host = tiered()
    put(cache, dev, [1, 2, 3, 4])
    cache.evict(2)
    put(cache, dev, [5, 6])
    cache.reset()
    assert dev.num_free == dev.num_blocks and host.num_free == host.num_blocks
    cache.check()


def test_events_name_the_medium_of_each_tier():
    hasher = ChainHasher()
    cache, dev, _ = tiered(cache={"events": hasher})
    put(cache, dev, [1, 2, 3, 4])
    cache.take_events()
    cache.evict(2)
    events = cache.take_events()
    assert [(type(e), e.medium) for e in events] == [
        (BlockStored, "CPU"),
        (BlockRemoved, "GPU"),
        (BlockRemoved, "GPU"),
    ]
    dev.decref(cache.load([1, 2, 3, 4]).blocks)
    assert [(type(e), e.medium) for e in cache.take_events()] == [(BlockStored, "GPU")]
    cache.evict_host(2)
    assert {e.medium for e in cache.take_events()} == {"CPU"}
    cache.check()


def test_copier_is_asked_for_every_move():
    copier = NullCopier()
    cache, dev, _ = tiered(copier=copier)
    put(cache, dev, [1, 2, 3, 4])
    cache.evict(2)
    dev.decref(cache.load([1, 2, 3, 4]).blocks)
    assert (copier.backed_up, copier.discarded, copier.loaded) == (2, 2, 2)


def test_the_plain_tree_has_no_tier_surface():
    """Everything of the host tier is the subclass's: a plain tree has no ``load``,
    ``evict_host`` or ``host``, and its ``stats.host_blocks`` stays 0."""
    dev = BlockAllocator(4, 2)
    cache = RadixCache(dev)
    put(cache, dev, [1, 2])
    for name in ("load", "evict_host", "host", "host_cached_blocks"):
        assert not hasattr(cache, name), name
    assert cache.stats.host_blocks == 0


def test_the_host_tier_is_a_subclass_and_radix_cache_with_host_is_deprecated():
    import warnings

    from radixkv.cache import make_cache

    dev, host = BlockAllocator(4, 2), BlockAllocator(4, 2)
    with pytest.warns(DeprecationWarning, match="TieredRadixCache"):
        cache = RadixCache(dev, "lru", host=HostTier(host))  # the old spelling, one release more
    assert type(cache) is TieredRadixCache and isinstance(cache, RadixCache)
    assert cache.host.allocator is host and cache.eviction == "lru"
    del cache  # its claims go back with it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the spellings that stay warn about nothing
        explicit = TieredRadixCache(dev, "lru", host=HostTier(host))
        assert type(explicit) is TieredRadixCache
        del explicit
        made = make_cache("radix", dev, "lru", host=HostTier(host))
        assert type(made) is TieredRadixCache and made.host.allocator is host
        del made
        assert type(RadixCache(dev)) is RadixCache  # no host: the tree alone
    with pytest.warns(DeprecationWarning):
        assert type(RadixCache(BlockAllocator(4, 2), host=None)) is RadixCache
    with pytest.raises(TypeError, match="host must be a HostTier"):
        TieredRadixCache(BlockAllocator(4, 2))  # the tiered class needs its tier

    class Mine(RadixCache):  # a user's subclass is built as written, and has no tier
        pass

    with pytest.raises(TypeError, match="host"):
        Mine(BlockAllocator(4, 2), host=HostTier(BlockAllocator(4, 2)))
    assert type(Mine(BlockAllocator(4, 2))) is Mine


def test_the_subclass_overrides_only_the_trees_template_hooks():
    """docs/design.md, "The cut": the private methods of the tree that the host tier
    overrides are its template hooks and two eviction steps, nothing else."""
    overridden = {
        name
        for name in vars(TieredRadixCache)
        if name.startswith("_") and not name.startswith("__") and name in vars(RadixCache)
    }
    assert overridden == {
        "_claim_pools",
        "_device_part",
        "_promote",
        "_on_split",
        "_on_new_leaf",
        "_on_freed",
        "_evict_leaf",
        "_unlink",
    }


def test_the_manager_loads_through_the_loading_cache_protocol():
    from radixkv import HashBlockCache, NullCache
    from radixkv.cache import KVCacheManager
    from radixkv.cache.prefix_cache import LoadingCache

    tiered_cache, dev, _ = tiered()
    assert isinstance(tiered_cache, LoadingCache)
    assert not isinstance(RadixCache(BlockAllocator(4, 2)), LoadingCache)  # match suffices
    assert not isinstance(HashBlockCache(BlockAllocator(4, 2)), LoadingCache)
    assert not isinstance(NullCache(BlockAllocator(4, 2)), LoadingCache)
    put(tiered_cache, dev, [1, 2, 3, 4])
    tiered_cache.evict(2)  # host-only now: the manager's lookup loads it back
    kv = KVCacheManager(tiered_cache)
    assert kv.match_prefix("r", [1, 2, 3, 4, 5]) == 4 and tiered_cache.stats.loaded_blocks == 2

    class Loads:  # any PrefixCache with a load: the manager looks prefixes up through it
        def __init__(self, cache):
            self.inner, self.loads = cache, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def load(self, tokens, namespace=None, *, stats=True):
            self.loads += 1
            return self.inner.match(tokens, namespace, stats=stats)

    cache = Loads(HashBlockCache(BlockAllocator(8, 2)))
    kv = KVCacheManager(cache)
    assert kv.match_prefix("a", [1, 2, 3]) == 0 and cache.loads == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"write_policy": "write_around"}, ValueError, "write_policy"),
        ({"write_through_hits": -1}, ValueError, "write_through_hits"),
        ({"write_through_hits": True}, ValueError, "write_through_hits"),
        ({"eviction": "random"}, ValueError, "eviction"),
        ({"copier": object()}, TypeError, "copier"),
    ],
)
def test_host_tier_rejects_bad_fields(kwargs, error, names):
    with pytest.raises(error, match=names):
        HostTier(BlockAllocator(4, 2), **kwargs)


def test_cache_rejects_a_shared_or_mismatched_host_pool():
    dev = BlockAllocator(4, 2)
    with pytest.raises(ValueError, match="host.allocator"):
        TieredRadixCache(dev, host=HostTier(dev))
    with pytest.raises(ValueError, match="block_size"):
        TieredRadixCache(dev, host=HostTier(BlockAllocator(4, 4)))
    with pytest.raises(TypeError, match="host"):
        TieredRadixCache(dev, host=BlockAllocator(4, 2))
    with pytest.raises(TypeError, match="allocator"):
        HostTier(np.zeros(3))


def test_a_dropped_tiered_cache_frees_both_pools_without_the_cycle_collector():
    """The host tier holds the tree's deletion step weakly: the tree is in no reference cycle,
    so dropping it gives both pools back at once (each allocator's finalizer), and a new
    tree may claim them."""
    import gc

    cache, dev, host = tiered()
    put(cache, dev, [1, 2, 3, 4])
    cache.evict(2)  # one node host-only: both pools hold blocks
    assert dev.num_free < dev.num_blocks or host.num_free < host.num_blocks
    gc.disable()
    try:
        del cache
        assert (dev.num_free, host.num_free) == (dev.num_blocks, host.num_blocks)
        TieredRadixCache(dev, host=HostTier(host)).check()  # both claims went with the old tree
    finally:
        gc.enable()


def test_block_hashes_are_what_each_mediums_events_net_out_to():
    hasher = ChainHasher()
    cache, dev, _ = tiered(cache={"events": hasher})
    net = {"GPU": set(), "CPU": set()}

    def settle():
        for e in cache.take_events():
            for h in e.block_hashes:
                (net[e.medium].add if isinstance(e, BlockStored) else net[e.medium].remove)(h)
        for medium, hashes in net.items():
            assert sorted(cache.block_hashes(medium)) == sorted(hashes), medium
        cache.check()

    put(cache, dev, [1, 2, 3, 4])
    put(cache, dev, [1, 2, 5, 6, 7, 8])
    settle()
    assert len(cache.block_hashes()) == cache.cached_blocks == 4 and not net["CPU"]
    cache.evict(2)  # a leaf goes to the host
    settle()
    assert len(cache.block_hashes("CPU")) == cache.host_cached_blocks > 0
    dev.decref(cache.load([1, 2, 5, 6, 7, 8]).blocks)  # back on the device, its copy kept
    settle()
    cache.evict_host(10)
    settle()
    assert cache.block_hashes("CPU") == []
    with pytest.raises(ValueError, match="medium"):
        cache.block_hashes("disk")


def test_host_eviction_keeps_its_index_when_the_index_is_rebuilt_mid_loop(monkeypatch):
    # Regression: the host eviction popped from a local alias of its index. Re-filing a stale
    # entry can rebuild the index (mostly dead entries), after which the entries skipped
    # for a load went back into the discarded list and dropped out of the index. The
    # rebuild is forced here on every re-file to take that path deterministically.
    from sortedcontainers import SortedList

    from radixkv.cache.tiered import TieredRadixCache

    index = TieredRadixCache._host_index

    def index_and_rebuild(self, node):
        index(self, node)
        self._host_leaves = SortedList(e for e in self._host_leaves if e[-1].host_entry is e)

    cache, dev, _ = tiered(num_device=4, num_host=8)
    put(cache, dev, [1, 2])  # leaf a, the older
    put(cache, dev, [3, 4])  # leaf b
    cache.evict(2)  # both go to host only
    # a test's look inside: which host nodes are filed, and in what order
    a, b = sorted((e[-1] for e in cache._host_leaves), key=lambda n: n.last_access)
    b.last_access += 100  # b's filed key is now stale, a's still fresh and first in line
    monkeypatch.setattr(TieredRadixCache, "_host_index", index_and_rebuild)
    cache._loading.add(a)  # a load holds a: evict skips it, re-files b (and rebuilds), frees b
    assert cache.evict_host(1) == 1 and b.host is None
    cache._loading.discard(a)
    cache.check()  # every host candidate is indexed: a was put back into the live index
    assert cache.evict_host(10) == 1 and a.host is None  # and a is still evictable
    cache.check()
