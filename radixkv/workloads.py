"""Multi-turn chat workloads in token ids, and the prefill work an ideal prefix cache leaves.

A workload (:class:`ChatWorkload`, the one chat generator of the package: the tests,
the engine benchmarks, the serving load generator and ``radixkv demo`` draw from it)
is ``num_users`` conversations sharing ``num_groups`` system prompts, run in
``num_turns`` waves: every user's turn ``t`` is submitted together, and turn
``t + 1``'s prompt is turn ``t``'s prompt + its reply + the new user message. Its
messages are random token ids; :class:`WordText` writes them as words (for a server
that takes text), and :class:`TemplateChat` runs the conversations as text through a
tokenizer's chat template, for a model that reads text.

:class:`IdealPrefill` is the brute-force oracle the engine's counts are held to:
an unbounded cache that holds every prompt from the moment it is prefilled and
every finished ``prompt + output[:-1]`` (the tokens whose K/V exist), matched at
block granularity on ``prompt[:-1]`` exactly as the engine matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from radixkv.cache.arrays import TOKEN_DTYPE, TokenSeq, as_token_array, common_prefix_len
from radixkv.checks import check_int, check_ints
from radixkv.text.tokenizer import Tokenizer, extend_chat, render_chat

__all__ = ["ChatText", "ChatWorkload", "IdealPrefill", "TemplateChat", "WordText"]

# What TemplateChat renders for an earlier reply: the reply itself stays in ids, and only
# the template's text around an assistant message is taken from the rendering.
REPLY_STAND_IN = "ok"


@dataclass(frozen=True)
class ChatWorkload:
    """Random-token chat conversations: a shared system prompt, then user turns.

    Token ids are drawn from ``[low, vocab_size)``; user messages have
    ``user_len`` tokens (an inclusive range). User ``u`` shares system prompt
    ``u % num_groups`` (:meth:`group`) with the other users of its group. ``seed``
    fixes everything; each message is drawn from its own seed, so it does not depend
    on ``num_users``, ``num_turns`` or which other messages were drawn.
    """

    system_len: int = 512
    num_users: int = 8
    num_turns: int = 3
    user_len: tuple[int, int] = (16, 64)
    vocab_size: int = 1024
    low: int = 0
    seed: int = 0
    num_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("system_len", "num_users", "num_turns", "vocab_size", "num_groups"):
            check_int(name, getattr(self, name), low=1)
        check_int("seed", self.seed, low=0)
        try:
            lo, hi = self.user_len
        except (TypeError, ValueError):
            raise ValueError(f"user_len must be a (lo, hi) pair, got {self.user_len!r}") from None
        lo, hi = check_ints("user_len", (lo, hi), low=1)
        if lo > hi:
            raise ValueError(f"user_len must be (lo, hi) with 1 <= lo <= hi, got {self.user_len}")
        check_int("low", self.low, low=0, high=self.vocab_size - 1)

    def group(self, user: int) -> int:
        """The group whose system prompt user ``user`` shares: ``user % num_groups``."""
        return user % self.num_groups

    def system_prompt(self, group: int = 0) -> np.ndarray:
        """Group ``group``'s system prompt: ``system_len`` new ids. O(system_len)."""
        # [seed, 0, 0] seeds as [seed, 0] did before groups: group 0's prompt is unchanged
        rng = np.random.default_rng([self.seed, 0, group])
        return rng.integers(self.low, self.vocab_size, self.system_len).astype(TOKEN_DTYPE)

    def user_message(self, user: int, turn: int) -> np.ndarray:
        """User ``user``'s message at turn ``turn``: ``user_len`` new ids. O(its length)."""
        rng = np.random.default_rng([self.seed, 1, user, turn])
        n = int(rng.integers(self.user_len[0], self.user_len[1] + 1))
        return rng.integers(self.low, self.vocab_size, n).astype(TOKEN_DTYPE)

    def turn_prompts(self, turn: int, histories: Sequence[np.ndarray] | None) -> list[np.ndarray]:
        """Every user's prompt for ``turn``: history (its system prompt at turn 0) + a new
        message.

        ``histories[u]`` is user ``u``'s previous prompt + reply (None at turn 0).
        ``ValueError`` unless there is one history per user.
        """
        if histories is None:
            systems = [self.system_prompt(g) for g in range(min(self.num_groups, self.num_users))]
            histories = [systems[self.group(u)] for u in range(self.num_users)]
        if len(histories) != self.num_users:
            raise ValueError(f"need {self.num_users} histories, got {len(histories)}")
        return [np.concatenate([h, self.user_message(u, turn)]) for u, h in enumerate(histories)]


class ChatText(Protocol):
    """The text of a chat workload's messages, for a model that reads text."""

    def system_text(self, group: int) -> str:
        """Group ``group``'s system prompt."""
        ...

    def user_text(self, user: int, turn: int) -> str:
        """User ``user``'s message at turn ``turn``."""
        ...


@dataclass(frozen=True)
class WordText:
    """A :class:`ChatWorkload`'s messages as text: id ``i`` is the word ``words[i - low]``,
    the words joined by ``sep``. ``ValueError`` unless there is a word for every id.

    >>> wl = ChatWorkload(system_len=4, vocab_size=3, seed=1)
    >>> WordText(wl, ("a", "b", "c"), sep="").system_text(0)
    'bbcc'
    """

    workload: ChatWorkload
    words: Sequence[str]
    sep: str = " "

    def __post_init__(self) -> None:
        need = self.workload.vocab_size - self.workload.low
        if len(self.words) < need:
            raise ValueError(f"words must hold {need} words (one per id), got {len(self.words)}")

    def _text(self, ids: np.ndarray) -> str:
        low, words = self.workload.low, self.words
        return self.sep.join(words[i - low] for i in ids.tolist())

    def system_text(self, group: int) -> str:
        """Group ``group``'s system prompt as words. O(system_len)."""
        return self._text(self.workload.system_prompt(group))

    def user_text(self, user: int, turn: int) -> str:
        """User ``user``'s message at ``turn`` as words. O(its length)."""
        return self._text(self.workload.user_message(user, turn))


@dataclass(frozen=True)
class TemplateChat:
    """A :class:`ChatWorkload`'s conversations as text, through a tokenizer's chat template.

    ``workload`` gives the shape (users, turns, the system prompt each user shares),
    ``text`` each message's words, ``tokenizer`` the template. Turn 0's prompt is the
    system prompt and the first message as the template renders them
    (:func:`~radixkv.text.tokenizer.render_chat`); turn ``t + 1``'s is turn ``t``'s
    prompt + the reply's ids + the template's ids that close the reply and hold the next
    message (:func:`~radixkv.text.tokenizer.extend_chat`): each prompt extends the last
    in ids, as in :meth:`ChatWorkload.turn_prompts`, and the template's special tokens
    come from the template alone.
    """

    workload: ChatWorkload
    tokenizer: Tokenizer
    text: ChatText

    def messages(self, user: int, turn: int) -> list[dict[str, str]]:
        """User ``user``'s chat through its message at ``turn``: the system prompt, then
        user messages and replies in turn (each reply a stand-in text). O(turn)."""
        system = self.text.system_text(self.workload.group(user))
        chat = [{"role": "system", "content": system}]
        for t in range(turn + 1):
            if t:
                chat.append({"role": "assistant", "content": REPLY_STAND_IN})
            chat.append({"role": "user", "content": self.text.user_text(user, t)})
        return chat

    def turn_prompts(self, turn: int, histories: Sequence[TokenSeq] | None) -> list[np.ndarray]:
        """Every user's prompt for ``turn``, in ids.

        ``histories[u]`` is user ``u``'s previous prompt + reply; None renders each chat
        through ``turn`` whole (turn 0's prompts). ``ValueError`` unless there is one
        history per user, or from the template (see ``extend_chat``). Complexity: a few
        renderings of each chat.
        """
        users = range(self.workload.num_users)
        if histories is None:
            prompts = [render_chat(self.tokenizer, self.messages(u, turn)) for u in users]
        elif len(histories) != len(users):
            raise ValueError(f"need {len(users)} histories, got {len(histories)}")
        else:
            prompts = [
                extend_chat(self.tokenizer, as_token_array(h).tolist(), self.messages(u, turn))
                for u, h in zip(users, histories, strict=True)
            ]
        return [np.asarray(p, dtype=TOKEN_DTYPE) for p in prompts]


class IdealPrefill:
    """An unbounded block-aligned prefix cache, by brute force (the benchmark's yardstick).

    >>> ideal = IdealPrefill(block_size=4)
    >>> ideal.admit([1, 2, 3, 4, 5, 6, 7, 8, 9])        # nothing cached yet: all 9 computed
    9
    >>> ideal.admit([1, 2, 3, 4, 5, 6, 7, 8, 0, 0])     # 8 shared tokens = 2 blocks cached
    2
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = check_int("block_size", block_size, low=1)
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
