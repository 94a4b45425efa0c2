"""A Mooncake Store master on free 127.0.0.1 ports for the tests (tests/cache/test_kv_store.py's
contract suite, tests/cache/test_store_mooncake.py).

``mooncake_master`` comes with the ``mooncake-transfer-engine-non-cuda`` wheel; the client
needs ``libibverbs1``. Where either is missing the tests that need them skip, saying which.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from radixkv.cache.store.mooncake import MooncakeMaster, MooncakeStore, _import_client


def new_master() -> MooncakeMaster:
    """A master not yet started, or skip the test saying why Mooncake cannot run here."""
    try:
        _import_client()
        return MooncakeMaster()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A master for the whole session."""
    with new_master() as master:
        yield master


@pytest.fixture(scope="session")
def mooncake_pool(mooncake_master: MooncakeMaster) -> Iterator[MooncakeStore]:
    """One client in the session master's pool: each test's store shares it
    (:func:`pool_store`), since a client takes ~2 s to close."""
    with MooncakeStore(mooncake_master.address, 1 << 20, key_prefix="root/") as root:
        yield root


_PREFIXES = itertools.count()


def pool_store(pool: MooncakeStore, capacity: int) -> MooncakeStore:
    """A store of ``capacity`` over the session's client, under names no other test uses."""
    return pool.share(capacity, key_prefix=f"test{next(_PREFIXES)}/")
