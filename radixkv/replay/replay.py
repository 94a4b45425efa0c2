"""replay(): one trace through one cache policy, with per-request and total figures."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixkv.replay import policies_fast
from radixkv.replay.config import FLAT_POLICIES, ReplayConfig
from radixkv.replay.radix_policy import radix_replay
from radixkv.replay.trace import Trace, TraceRequest

__all__ = ["ReplayResult", "hit_tokens_for", "replay"]


@dataclass(frozen=True)
class ReplayResult:
    """What a replay measured. Token figures are ints; arrays are int64, one entry per request.

    - ``prompt_tokens[i]``: request i's ``input_length``;
    - ``hit_blocks[i]``: its prefix hit length k in blocks (ids);
    - ``hit_tokens[i] = min(k * block_size, input_length)``;
    - ``block_hits`` / ``block_misses``: accesses that found / did not find
      their block resident (flat policies decide this per access, so blocks
      past a request's first miss count too; the radix tree's hits are its
      matched prefixes); ``block_hits + block_misses`` is the total number of ids;
    - ``final_cache_blocks``: blocks resident after the last request (S3FIFO:
      ``|S| + |M|``, never the ghost; radix: blocks the tree holds);
    - ``unreachable_blocks``: resident blocks that no request of the trace
      would get as part of its prefix hit now, because some block before them
      on every path is not resident (wasted capacity; always 0 for the tree);
    - ``orphan_blocks``: resident blocks whose parent id (the id before it
      where it first appears in the trace) is not resident: the direct form
      of the same test, ``orphan_blocks <= unreachable_blocks`` on chained ids
      (always 0 for the tree, whose resident set is prefix-closed).
    """

    config: ReplayConfig
    prompt_tokens: np.ndarray
    hit_blocks: np.ndarray
    hit_tokens: np.ndarray
    block_hits: int
    block_misses: int
    final_cache_blocks: int
    unreachable_blocks: int
    orphan_blocks: int

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def num_requests(self) -> int:
        return len(self.prompt_tokens)

    @property
    def total_prompt_tokens(self) -> int:
        return int(self.prompt_tokens.sum())

    @property
    def total_hit_tokens(self) -> int:
        return int(self.hit_tokens.sum())

    @property
    def overall_hit_rate(self) -> float:
        """``total_hit_tokens / total_prompt_tokens`` (0.0 when there are no prompt tokens)."""
        total = self.total_prompt_tokens
        return self.total_hit_tokens / total if total else 0.0

    def to_dict(self, per_request: bool = False) -> dict[str, Any]:
        """The CLI's JSON object; with ``per_request``, a ``per_request`` list in trace order."""
        out: dict[str, Any] = {
            "policy": self.config.policy,
            "cache_capacity_blocks": self.config.capacity,
            "block_size": self.config.block_size,
            "num_requests": self.num_requests,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_hit_tokens": self.total_hit_tokens,
            "overall_hit_rate": self.overall_hit_rate,
            "final_cache_blocks": self.final_cache_blocks,
            "block_hits": self.block_hits,
            "block_misses": self.block_misses,
            "unreachable_blocks": self.unreachable_blocks,
            "orphan_blocks": self.orphan_blocks,
        }
        if per_request:
            out["per_request"] = [
                {"prompt_tokens": p, "hit_tokens": h}
                for p, h in zip(self.prompt_tokens.tolist(), self.hit_tokens.tolist(), strict=True)
            ]
        return out


def hit_tokens_for(
    hit_blocks: np.ndarray, input_lengths: np.ndarray, block_size: int
) -> np.ndarray:
    """``min(k * block_size, input_length)`` per request: the partial last block is capped."""
    return np.minimum(hit_blocks.astype(np.int64) * block_size, input_lengths)


def replay(
    requests: Trace | Iterable[TraceRequest | Mapping[str, Any]],
    policy: str,
    capacity: int,
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
) -> ReplayResult:
    """Replay ``requests`` in order through ``policy`` with room for ``capacity`` blocks.

    ``requests`` is a ``Trace`` (from ``load_trace``) or an iterable of
    ``TraceRequest`` objects or mappings with the trace fields. Per request: the
    prefix hit k is taken at arrival (the longest run of resident ids from
    index 0), then every id is accessed against the policy in order
    (``lru``, ``lfu``, ``s3fifo``), or the radix tree matches and inserts the
    sequence (``radix-level``, ``radix-lru``). See ``ReplayConfig`` for the
    parameters. Raises ``ValueError``/``TypeError`` for bad parameters and
    ``TraceError`` for bad requests, before replaying anything.

    Complexity: O(total ids) time and memory, compiled, for the flat policies;
    the radix policies run the Python tree, O(total ids * log leaves).
    """
    config = ReplayConfig(policy, capacity, block_size, small_ratio, max_freq)
    trace = requests if isinstance(requests, Trace) else Trace.from_requests(requests)
    if config.policy in FLAT_POLICIES:
        hit_blocks, block_hits, resident = _run_flat(trace, config)
        final_cache_blocks = int(resident.sum())
        reach = policies_fast.reachable_mask(trace.ids, trace.offsets, resident)
        unreachable = final_cache_blocks - int(reach.sum())
        orphans = int(policies_fast.orphan_count(trace.ids, trace.offsets, resident))
    else:
        hit_blocks, block_hits, final_cache_blocks, unreachable = radix_replay(
            trace, config.policy, config.capacity
        )
        orphans = 0  # the tree evicts leaves only: every resident block's parent is resident
    block_hits = int(block_hits)
    return ReplayResult(
        config=config,
        prompt_tokens=trace.input_lengths.copy(),
        hit_blocks=hit_blocks,
        hit_tokens=hit_tokens_for(hit_blocks, trace.input_lengths, config.block_size),
        block_hits=block_hits,
        block_misses=trace.num_accesses - block_hits,
        final_cache_blocks=final_cache_blocks,
        unreachable_blocks=unreachable,
        orphan_blocks=orphans,
    )


def _run_flat(trace: Trace, config: ReplayConfig) -> tuple[np.ndarray, int, np.ndarray]:
    ids, offsets, num_ids = trace.ids, trace.offsets, trace.num_ids
    if config.policy == "lru":
        return policies_fast.lru_kernel(ids, offsets, num_ids, config.capacity)
    if config.policy == "lfu":
        return policies_fast.lfu_kernel(ids, offsets, num_ids, config.capacity)
    return policies_fast.s3fifo_kernel(
        ids, offsets, num_ids, config.small_cap, config.main_cap, config.max_freq
    )
