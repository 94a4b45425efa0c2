"""Multi-turn chat workloads in token ids, and the prefill work an ideal prefix cache leaves.

A workload is ``num_users`` conversations sharing one system prompt, run in
``num_turns`` waves: every user's turn ``t`` is submitted together, and turn
``t + 1``'s prompt is turn ``t``'s prompt + its reply + the new user message.

:class:`IdealPrefill` is the brute-force oracle the engine's counts are held to:
an unbounded cache that holds every prompt from the moment it is prefilled and
every finished ``prompt + output[:-1]`` (the tokens whose K/V exist), matched at
block granularity on ``prompt[:-1]`` exactly as the engine matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixkv.cache.arrays import TOKEN_DTYPE, TokenSeq, as_token_array, common_prefix_len

__all__ = ["ChatWorkload", "IdealPrefill"]


@dataclass(frozen=True)
class ChatWorkload:
    """Random-token chat conversations: a shared system prompt, then user turns.

    Token ids are drawn from ``[low, vocab_size)``; user messages have
    ``user_len`` tokens (an inclusive range). ``seed`` fixes everything.
    """

    system_len: int = 512
    num_users: int = 8
    num_turns: int = 3
    user_len: tuple[int, int] = (16, 64)
    vocab_size: int = 1024
    low: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("system_len", "num_users", "num_turns", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        lo, hi = self.user_len
        if not 1 <= lo <= hi:
            raise ValueError(f"user_len must be (lo, hi) with 1 <= lo <= hi, got {self.user_len}")
        if not 0 <= self.low < self.vocab_size:
            raise ValueError(f"low must be in [0, vocab_size), got {self.low}")

    def system_prompt(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0])
        return rng.integers(self.low, self.vocab_size, self.system_len).astype(TOKEN_DTYPE)

    def user_message(self, user: int, turn: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1, user, turn])
        n = int(rng.integers(self.user_len[0], self.user_len[1] + 1))
        return rng.integers(self.low, self.vocab_size, n).astype(TOKEN_DTYPE)

    def turn_prompts(self, turn: int, histories: Sequence[np.ndarray] | None) -> list[np.ndarray]:
        """Every user's prompt for ``turn``: history (system prompt at turn 0) + a new message.

        ``histories[u]`` is user ``u``'s previous prompt + reply (None at turn 0).
        """
        if histories is None:
            system = self.system_prompt()
            histories = [system] * self.num_users
        if len(histories) != self.num_users:
            raise ValueError(f"need {self.num_users} histories, got {len(histories)}")
        return [np.concatenate([h, self.user_message(u, turn)]) for u, h in enumerate(histories)]


class IdealPrefill:
    """An unbounded block-aligned prefix cache, by brute force (the benchmark's yardstick).

    >>> ideal = IdealPrefill(block_size=4)
    >>> ideal.admit([1, 2, 3, 4, 5, 6, 7, 8, 9])        # nothing cached yet: all 9 computed
    9
    >>> ideal.admit([1, 2, 3, 4, 5, 6, 7, 8, 0, 0])     # 8 shared tokens = 2 blocks cached
    2
    """

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self._seqs: list[np.ndarray] = []

    def cached_len(self, prompt: TokenSeq) -> int:
        """Longest block-aligned prefix of ``prompt[:-1]`` that some held sequence shares."""
        arr = as_token_array(prompt)[:-1]
        best = max((common_prefix_len(arr, s) for s in self._seqs), default=0)
        return (best // self.block_size) * self.block_size

    def admit(self, prompt: TokenSeq) -> int:
        """Prefill tokens ``prompt`` costs now; then hold it (its K/V exist from now on)."""
        arr = as_token_array(prompt)
        computed = arr.size - self.cached_len(arr)
        self._seqs.append(arr.copy())
        return computed

    def finish(self, tokens_with_kv: TokenSeq) -> None:
        """Hold a finished request's ``prompt + output[:-1]``."""
        self._seqs.append(as_token_array(tokens_with_kv).copy())
