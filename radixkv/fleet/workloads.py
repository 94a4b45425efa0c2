"""Synthetic fleet workloads, as :class:`~radixkv.fleet.sim.SimRequest` lists.

Tokens are ids of 512-token blocks, like a Mooncake trace's hash ids (so the
simulator's units are the same for both), drawn from disjoint ranges so two
prompts share exactly the prefix the workload gives them. Arrivals are a
seeded Poisson process of ``arrival_rate`` requests per second.

- :func:`grouped_prompts`: ``groups`` system prompts of ``system_len`` blocks,
  ``prompts_per_group`` requests each (own question of ``question_len``
  blocks), in random order: prefix affinity pays ``groups``-fold.
  :func:`group_sizes` splits a total request count over the groups.
- :func:`hot_prompt`: one system prompt in a ``hot_fraction`` (e.g. 90%) of
  the requests, unique prompts for the rest: the case where naive prefix
  affinity sends almost everything to one replica. A router must spread the
  hot prefix (each replica computes it once) rather than melt one replica.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixkv.checks import check_int, check_ints, check_number
from radixkv.fleet.sim import SimRequest
from radixkv.replay.trace import MOONCAKE_BLOCK_SIZE

__all__ = ["SYNTHETIC_WORKLOADS", "group_sizes", "grouped_prompts", "hot_prompt"]

SYNTHETIC_WORKLOADS = ("groups", "hot")


class _Ids:
    """Fresh ids, never repeated: a workload's own token space."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int32)
        self.next += n
        return out


def _build(
    prefixes: list[np.ndarray | None],
    question_len: int,
    output_tokens: int,
    arrival_rate: float,
    rng: np.random.Generator,
    ids: _Ids,
    sessions: list[object] | None = None,
) -> list[SimRequest]:
    gaps = rng.exponential(1.0 / arrival_rate, size=len(prefixes))
    arrivals = np.cumsum(gaps) - gaps[0]
    out = []
    for i, prefix in enumerate(prefixes):
        q = ids.take(question_len)
        tokens = q if prefix is None else np.concatenate((prefix, q))
        out.append(
            SimRequest(
                request_id=i,
                arrival=float(arrivals[i]),
                tokens=tokens,
                prompt_tokens=len(tokens) * MOONCAKE_BLOCK_SIZE,
                output_tokens=output_tokens,
                session=None if sessions is None else sessions[i],
            )
        )
    return out


def group_sizes(num_requests: int, groups: int) -> list[int]:
    """``num_requests`` split over ``groups`` as evenly as it goes, the first groups one more.

    ``ValueError`` naming ``num_requests`` when it is below ``groups`` (a
    group would have no prompt). Complexity: O(groups).

    >>> group_sizes(20, 16)
    [2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    """
    groups = check_int("groups", groups, low=1)
    n = check_int("num_requests", num_requests, low=1)
    if n < groups:
        raise ValueError(
            f"num_requests must be >= groups ({groups}) so every group has a prompt, got {n}"
        )
    per, extra = divmod(n, groups)
    return [per + (g < extra) for g in range(groups)]


def grouped_prompts(
    groups: int,
    prompts_per_group: int | Sequence[int],
    *,
    system_len: int = 8,
    question_len: int = 2,
    output_tokens: int = 128,
    arrival_rate: float = 1.0,
    seed: int = 0,
) -> list[SimRequest]:
    """``groups x prompts_per_group`` requests; a group's prompts share its system prompt.

    ``prompts_per_group`` is one count for every group or a count per group
    (``groups`` of them, each >= 1: :func:`group_sizes` gives a total exactly).
    Lengths in blocks (512 tokens each). The session is the group (so session
    affinity keeps a group together). ``ValueError`` for bad sizes.
    """
    groups = check_int("groups", groups, low=1)
    if isinstance(prompts_per_group, Sequence):
        if len(prompts_per_group) != groups:
            raise ValueError(
                f"prompts_per_group must have one count per group ({groups}), "
                f"got {len(prompts_per_group)}: {list(prompts_per_group)!r}"
            )
        per = check_ints("prompts_per_group", prompts_per_group, low=1)
    else:
        per = [check_int("prompts_per_group", prompts_per_group, low=1)] * groups
    system_len = check_int("system_len", system_len, low=0)
    question_len = check_int("question_len", question_len, low=1)
    output_tokens = check_int("output_tokens", output_tokens, low=0)
    rate = check_number("arrival_rate", arrival_rate, low=0, strict=True)
    rng = np.random.default_rng(seed)
    ids = _Ids()
    systems = [ids.take(system_len) for _ in range(groups)]
    order = rng.permutation(np.repeat(np.arange(groups), per))
    prefixes = [systems[g] for g in order]
    sessions = [f"group-{g}" for g in order]
    return _build(prefixes, question_len, output_tokens, rate, rng, ids, sessions=sessions)


def hot_prompt(
    num_requests: int,
    *,
    hot_fraction: float = 0.9,
    system_len: int = 8,
    question_len: int = 2,
    output_tokens: int = 128,
    arrival_rate: float = 1.0,
    seed: int = 0,
) -> list[SimRequest]:
    """``num_requests`` requests, each with the one hot system prompt with probability
    ``hot_fraction``, else an unshared prompt of the same length. Lengths in blocks."""
    n = check_int("num_requests", num_requests, low=1)
    if not 0.0 <= check_number("hot_fraction", hot_fraction) <= 1.0:
        raise ValueError(f"hot_fraction must be a number in [0, 1], got {hot_fraction!r}")
    system_len = check_int("system_len", system_len, low=0)
    question_len = check_int("question_len", question_len, low=1)
    output_tokens = check_int("output_tokens", output_tokens, low=0)
    rate = check_number("arrival_rate", arrival_rate, low=0, strict=True)
    rng = np.random.default_rng(seed)
    ids = _Ids()
    hot = ids.take(system_len)
    is_hot = rng.random(n) < hot_fraction
    prefixes = [hot if h else ids.take(system_len) for h in is_hot]
    return _build(prefixes, question_len, output_tokens, rate, rng, ids)
