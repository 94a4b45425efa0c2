"""ReplayConfig: one validated set of replay parameters (policy, capacity, block size, S3FIFO)."""

from __future__ import annotations

from dataclasses import dataclass

from radixkv.cache.eviction import EVICTION_ORDERS
from radixkv.cache.store.tier import STORE_WRITE_POLICIES
from radixkv.checks import check_int, check_number

__all__ = ["FLAT_POLICIES", "RADIX_POLICIES", "REPLAY_POLICIES", "ReplayConfig"]

FLAT_POLICIES: tuple[str, ...] = ("lru", "lfu", "s3fifo")
# One replay policy per tree eviction order: "radix-" + the order's name.
RADIX_POLICIES: tuple[str, ...] = tuple(f"radix-{name}" for name in EVICTION_ORDERS)
REPLAY_POLICIES: tuple[str, ...] = FLAT_POLICIES + RADIX_POLICIES

# block_size * (blocks in a request) must stay far inside int64.
_MAX_BLOCK_SIZE = 2**31 - 1
_MAX_CAPACITY = 2**31 - 1


@dataclass(frozen=True)
class ReplayConfig:
    """Parameters of one replay. Frozen; ``__post_init__`` raises ``TypeError``/``ValueError``
    naming the field and value.

    - ``policy``: one of ``REPLAY_POLICIES``.
    - ``capacity``: cache size in blocks, >= 1.
    - ``block_size``: tokens per block (hash id), >= 1; hit tokens are
      ``min(hit_blocks * block_size, input_length)``.
    - ``small_ratio``: S3FIFO's small-queue share, 0 < small_ratio < 1;
      ``small_cap = round(capacity * small_ratio)`` (Python's banker's ``round``).
    - ``max_freq``: S3FIFO's saturating frequency cap, >= 0.
    - ``host_capacity``: blocks in a host-memory tier under the radix tree,
      >= 0; 0 (the default) means none. Only the ``radix-*`` policies have
      one: a flat policy with ``host_capacity > 0`` is a ``ValueError``.
    - ``store_capacity``: blocks in a KV store tier below the host tier, >= 0; 0
      (the default) means none. The store hangs below the host (it is filled from
      the host pool and read back through it), so ``store_capacity > 0`` needs
      ``host_capacity > 0`` (a ``ValueError`` otherwise).
    - ``store_write_policy``: when the store is written, one of
      ``STORE_WRITE_POLICIES``: ``"write_back"`` (what host eviction drops, the
      default) or ``"write_through"`` (every backup to the host). Read only with a
      store.

    The S3FIFO fields are validated for every policy, but only S3FIFO reads
    them; for S3FIFO, a capacity that leaves the small or main queue empty is
    a ``ValueError``.

    >>> ReplayConfig("s3fifo", 4096).small_cap
    410
    """

    policy: str
    capacity: int
    block_size: int = 512
    small_ratio: float = 0.1
    max_freq: int = 3
    host_capacity: int = 0
    store_capacity: int = 0
    store_write_policy: str = "write_back"

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in REPLAY_POLICIES:
            raise ValueError(
                f"policy must be one of {', '.join(REPLAY_POLICIES)}, got {self.policy!r}"
            )
        for name, low, high in (
            ("capacity", 1, _MAX_CAPACITY),
            ("block_size", 1, _MAX_BLOCK_SIZE),
            ("max_freq", 0, 2**62),
            ("host_capacity", 0, _MAX_CAPACITY),
            ("store_capacity", 0, _MAX_CAPACITY),
        ):
            value = check_int(name, getattr(self, name), low=low, high=high)
            object.__setattr__(self, name, value)
        if self.host_capacity and self.policy not in RADIX_POLICIES:
            raise ValueError(
                f"host_capacity is for the radix-* policies only, got host_capacity="
                f"{self.host_capacity} with policy {self.policy!r}"
            )
        if self.store_capacity and not self.host_capacity:
            raise ValueError(
                f"store_capacity needs a host tier (the store sits below it), got store_capacity="
                f"{self.store_capacity} with host_capacity=0"
            )
        if self.store_write_policy not in STORE_WRITE_POLICIES:
            raise ValueError(
                f"store_write_policy must be one of {', '.join(STORE_WRITE_POLICIES)}, got "
                f"{self.store_write_policy!r}"
            )
        ratio = check_number("small_ratio", self.small_ratio)
        object.__setattr__(self, "small_ratio", ratio)
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"small_ratio must be a number in (0, 1), got {ratio!r}")
        if self.policy == "s3fifo":
            if self.small_cap < 1:
                raise ValueError(
                    f"capacity={self.capacity} with small_ratio={ratio!r} leaves the S3FIFO small "
                    f"queue empty (round({self.capacity} * {ratio!r}) = {self.small_cap})"
                )
            if self.main_cap < 1:
                raise ValueError(
                    f"capacity={self.capacity} with small_ratio={ratio!r} leaves the S3FIFO main "
                    f"queue empty (small_cap = {self.small_cap})"
                )

    @property
    def small_cap(self) -> int:
        """S3FIFO small-queue size: ``round(capacity * small_ratio)``, banker's rounding."""
        return round(self.capacity * self.small_ratio)

    @property
    def main_cap(self) -> int:
        """S3FIFO main-queue size: ``capacity - small_cap``."""
        return self.capacity - self.small_cap

    @property
    def ghost_cap(self) -> int:
        """S3FIFO ghost-queue size: ``main_cap`` (not ``small_cap``)."""
        return self.main_cap
