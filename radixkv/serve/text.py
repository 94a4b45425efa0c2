"""TextStream: a request's output ids as text, one safe-to-send piece at a time, with stop strings.

Token ids do not map one to one onto characters: a byte-level BPE token may hold
half of a UTF-8 character (decoded, it reads U+FFFD until the rest arrives), and
a stop string may span several tokens. So after each step :meth:`TextStream.push`
decodes all output ids so far and sends only the part that can no longer change:

- trailing U+FFFD is held back until the next token completes (or replaces) it;
- an end of the text that begins a stop string is held back until the next
  characters show whether the stop string follows;
- the first stop string found ends the text just before it (OpenAI's rule: the
  stop string is not returned) and marks the stream ``stopped``.

When the request finishes everything held back is sent. A stop *token* (EOS, a
``stop_token_ids`` entry) ends the request in the engine; its text is left out, as
vLLM does. The streamed pieces and the non-streamed text are both ``text``: the
same concatenation, so a client sees the same reply either way.

Decoding everything at each step costs O(output length) per step; that is small
next to a model step for the replies a chat server writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]

REPLACEMENT = "\ufffd"


class TextStream:
    """The text of one request's output (see the module docstring).

    ``decode`` maps token ids to text (special tokens left out); ``stop`` are the
    stop strings (empty ones are ignored); ``stop_token_ids`` the ids whose text is
    dropped when one ends the output.

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
    ) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._stop_ids = frozenset(stop_token_ids)
        self._searched = 0  # characters of the decoded text already searched for stops
        self.text = ""
        """Everything sent so far (the reply, once finished)."""
        self.stopped = False
        """True once a stop string ended the text."""

    def push(self, output_ids: Sequence[int], finished: bool) -> str:
        """The new text to send, given all output ids so far; ``finished`` flushes.

        After ``stopped`` it returns "" (the caller should stop the request).
        Complexity: O(len(output_ids)) to decode, O(new text x stop strings) to search.
        """
        if self.stopped:
            return ""
        ids = output_ids
        if finished and ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        full = self._decode(ids)
        cut = self._find_stop(full)
        if cut is not None:
            ready = full[:cut]
            self.stopped = True
        elif finished:
            ready = full
        else:
            ready = full.rstrip(REPLACEMENT)
            ready = ready[: len(ready) - self._partial_stop(ready)]
        if len(ready) <= len(self.text):
            return ""
        delta = ready[len(self.text) :]
        self.text += delta
        return delta

    def _partial_stop(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string (0 if none)."""
        for k in range(min(self._hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _find_stop(self, full: str) -> int | None:
        """Where the first stop string starts in ``full`` (searching only new text)."""
        if not self._stop:
            return None
        start = max(0, self._searched - self._hold)
        self._searched = len(full.rstrip(REPLACEMENT))  # a trailing U+FFFD may still change
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
