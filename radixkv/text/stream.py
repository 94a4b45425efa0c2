"""TextStream: a request's output ids as text, one safe-to-send piece at a time, with stop strings.

Token ids do not map one to one onto characters: a byte-level BPE token may hold
half of a UTF-8 character (decoded, it reads U+FFFD until the rest arrives), and
a stop string may span several tokens. So after each step :meth:`TextStream.push`
decodes the new output ids and sends only the part that can no longer change:

- text that ends in U+FFFD is held back until the next token completes (or
  replaces) the character;
- an end of the text that begins a stop string is held back until the next
  characters show whether the stop string follows;
- the first stop string found ends the text just before it (OpenAI's rule: the
  stop string is not returned) and marks the stream ``stopped``.

When the request finishes everything held back is sent. A stop *token* (EOS, a
``stop_token_ids`` entry) ends the request in the engine; its text is left out, as
vLLM does. The streamed pieces and the non-streamed text are both ``text``: the
same concatenation, so a client sees the same reply either way.

The work per step does not grow with the reply or the stop list. Decoding is
incremental, as vLLM's: each step decodes a window from the last settled token or
two on (tokenizers that drop a leading space, or merge bytes, see the same context
either way), so a token costs O(window), not O(reply) (a 32k-token reply once cost
milliseconds of event loop per token). Stop strings are matched by
:class:`StopMatcher`, an Aho-Corasick automaton fed each new character once, whatever
the number or length of the stop strings (20,000 of them once cost 0.1 s a token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["StopMatcher", "TextStream"]

REPLACEMENT = "\ufffd"


class StopMatcher:
    """Finds stop strings in text fed piece by piece (an Aho-Corasick automaton).

    :meth:`feed` takes the next characters and returns where the earliest-starting
    stop string that ends in them starts; :attr:`partial` is the length of the
    longest end of the text so far that begins some stop string (what a stream must
    hold back). Empty strings are ignored.

    >>> m = StopMatcher(["abcd", "bc", "x"])
    >>> m.feed("zab"), m.partial, m.feed("c"), m.partial
    (None, 2, 2, 3)

    Complexity: O(total length of the stop strings) to build; O(characters fed) to
    feed, amortised, independent of how many stop strings there are.
    """

    __slots__ = ("_depth", "_fail", "_goto", "_longest", "_state", "_fed")

    def __init__(self, stop: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]  # the trie: state -> character -> state
        depth = [0]  # characters from the root: the prefix a state stands for
        longest = [0]  # the longest stop string that ends at a state (0: none)
        for s in stop:
            state = 0
            for ch in s:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    longest.append(0)
                state = nxt
            longest[state] = len(s)
        fail = [0] * len(goto)  # the longest proper suffix of a state that is a state
        queue = list(goto[0].values())
        for state in queue:  # breadth first: a state's fail link is settled before it
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0)
                longest[nxt] = max(longest[nxt], longest[fail[nxt]])
                queue.append(nxt)
        self._goto, self._fail, self._depth, self._longest = goto, fail, depth, longest
        self._state = 0
        self._fed = 0  # characters fed so far

    @property
    def partial(self) -> int:
        """Length of the longest end of the text fed so far that begins some stop string."""
        return self._depth[self._state]

    def feed(self, text: str) -> int | None:
        """Feed ``text``; where (in everything fed) the earliest-starting stop string that
        ends in ``text`` starts, or None."""
        goto, fail, longest = self._goto, self._fail, self._longest
        state, best, end = self._state, None, self._fed
        for ch in text:
            end += 1
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if longest[state]:
                start = end - longest[state]
                if best is None or start < best:
                    best = start
        self._state, self._fed = state, end
        return best


class TextStream:
    """The text of one request's output (see the module docstring).

    ``decode`` maps token ids to text (special tokens left out); ``stop`` are the
    stop strings (empty ones are ignored); ``stop_token_ids`` the ids whose text is
    dropped when one ends the output. A stop string that ends in the text of the first
    ``min_tokens - 1`` tokens does not end it (vLLM's rule: stops are checked once the
    output holds ``min_tokens`` tokens), however many ids each push brings.

    >>> ts = TextStream(lambda ids: bytes(ids).decode(errors="replace"), stop=["!"])
    >>> ts.push(list(b"hi"), finished=False), ts.push(list(b"hi! more"), finished=False)
    ('hi', '')
    >>> ts.text, ts.stopped
    ('hi', True)
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self._decode = decode
        self._min_tokens = min_tokens
        stop = [s for s in stop if s]
        self._matcher = StopMatcher(stop) if stop else None
        self._stop_ids = frozenset(stop_token_ids)
        # incremental decoding: the window is ids[_prefix:], its head ids[_prefix:_read]
        # (text _head, already taken); _taken characters past the head are taken too
        self._prefix = self._read = self._taken = 0
        self._num_ids = 0  # output ids pushed so far
        self._head = ""
        self._decoded = ""  # the text of the settled ids (the matcher has read it all)
        self.text = ""
        """Everything sent so far (the reply, once finished)."""
        self.stopped = False
        """True once a stop string ended the text."""

    def push(self, output_ids: Sequence[int], finished: bool) -> str:
        """The new text to send, given all output ids so far; ``finished`` flushes.

        After ``stopped`` it returns "" (the caller should stop the request).
        Complexity: O(new ids + a window of a few tokens) to decode, O(new text) to match
        stop strings, O(new text) to send (amortised).
        """
        if self.stopped:
            return ""
        early = self._min_tokens - 1  # the ids whose text no stop string may end in
        if self._num_ids < early < len(output_ids):
            # a push of several ids across min_tokens (a slow consumer's) reads the early
            # ones first, as one id a push would: a stop string ending in them stays text
            head = self.push(output_ids[:early], finished=False)
            return head + self.push(output_ids, finished)
        self._num_ids = len(output_ids)
        ids = output_ids
        if finished and ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        new = self._decode_new(ids, finished)
        self._decoded += new
        end = len(self._decoded)
        matcher = self._matcher
        if matcher is not None:
            cut = matcher.feed(new) if new else None
            if cut is not None and len(output_ids) < self._min_tokens:
                cut = None  # too early: the stop string is text like any other
            if cut is not None:
                end = cut
                self.stopped = True
            elif not finished:  # an end that may grow into a stop string waits
                end -= matcher.partial
        if end <= len(self.text):
            return ""
        delta = self._decoded[len(self.text) : end]
        self.text += delta
        return delta

    def _decode_new(self, ids: Sequence[int], finished: bool) -> str:
        """The settled text ``ids`` add: the window ``ids[_prefix:]`` decoded, past its head
        and what earlier calls took of it, and short of a trailing U+FFFD (a character
        still incomplete) unless ``finished``. The window moves on once it ends in a
        whole character."""
        window = self._decode(ids[self._prefix :])
        body = window[len(self._head) :]
        settled = body if finished else body.rstrip(REPLACEMENT)
        new = settled[self._taken :]
        self._taken = max(self._taken, len(settled))
        if len(settled) == len(body) and body:  # a whole character ends the window
            self._prefix, self._read = self._read, len(ids)
            self._head = self._decode(ids[self._prefix : self._read])
            self._taken = 0
        return new
