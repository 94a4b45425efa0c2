"""The OpenAI API's responses as JSON-ready dicts, logprobs included.

Shapes follow OpenAI's (``text_completion``, ``chat.completion`` and their ``.chunk``
stream forms) as vLLM serves them: a choice carries its ``index`` (prompt position x
``n`` + fork), vLLM's ``token_ids`` when asked for, and ``prompt_logprobs`` (vLLM's
shape) when asked for; ``usage.prompt_tokens_details.cached_tokens`` is the prompt
prefix the radix cache held.

Logprobs come in two shapes: completions' (``tokens``, ``token_logprobs``,
``top_logprobs`` as ``{token: logprob}`` holding the top ``logprobs`` and the chosen
token, ``text_offset``) and chat's (``content``: ``token``, ``logprob``, ``bytes``,
``top_logprobs``). A token's text is its id decoded alone (``token_id:N`` with
vLLM's ``return_tokens_as_token_ids``); a logprob of minus infinity is written as
-9999.0, as vLLM writes it (JSON has no infinity).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "LOGPROB_FLOOR",
    "TokenText",
    "chat_choice",
    "chat_logprobs",
    "completion_choice",
    "completion_logprobs",
    "envelope",
    "error_body",
    "prompt_logprobs_entries",
    "usage",
]

LOGPROB_FLOOR = -9999.0
"""What a logprob of minus infinity (a token masked out) is written as."""

TokenText = Callable[[int], str]
"""A token id's text, as logprobs show it."""

TopList = Sequence[tuple[int, float]]


def _lp(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(rid: str, obj: str, model: str, choices: list[dict], **extra: Any) -> dict:
    """A response or chunk: ``id``, ``object``, ``created``, ``model``, ``choices``, ``extra``."""
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def _choice(index: int, finish_reason: str | None, extra: dict[str, Any], **fields: Any) -> dict:
    choice: dict[str, Any] = {"index": index, **fields, "finish_reason": finish_reason}
    choice.update({k: v for k, v in extra.items() if v is not None})
    return choice


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One ``text_completion`` choice; ``extra`` fields (``token_ids``, ``prompt_logprobs``)
    are added where not None."""
    return _choice(index, finish_reason, extra, text=text, logprobs=logprobs)


def chat_choice(
    index: int,
    finish_reason: str | None,
    *,
    message: dict[str, Any] | None = None,
    delta: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One ``chat.completion`` choice (``message``) or chunk choice (``delta``)."""
    body = {"message": message} if message is not None else {"delta": delta or {}}
    return _choice(index, finish_reason, extra, **body, logprobs=logprobs)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float | None],
    tops: Sequence[TopList | None],
    token_text: TokenText,
    offset: int = 0,
) -> dict[str, Any]:
    """Completions' logprobs object for ``token_ids``: each token's logprob (None for a first
    prompt token, which has none), its ``top_logprobs`` (the alternatives in ``tops`` and
    the token itself; None where ``tops`` has None) and its ``text_offset`` (from
    ``offset``, adding each token's text). Complexity: O(tokens x alternatives)."""
    texts = [token_text(t) for t in token_ids]
    top_dicts: list[dict[str, float] | None] = []
    offsets = []
    for text, lp, top in zip(texts, logprobs, tops, strict=True):
        offsets.append(offset)
        offset += len(text)
        if top is None or lp is None:
            top_dicts.append(None)
            continue
        entry = {token_text(t): _lp(v) for t, v in top}
        entry.setdefault(text, _lp(lp))
        top_dicts.append(entry)
    return {
        "tokens": texts,
        "token_logprobs": [None if lp is None else _lp(lp) for lp in logprobs],
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def _chat_entry(text: str, lp: float) -> dict[str, Any]:
    return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopList],
    token_text: TokenText,
) -> dict[str, Any]:
    """Chat's logprobs object: ``{"content": [...]}``, one entry per token with its
    ``top_logprobs`` (the alternatives in ``tops``). Complexity: O(tokens x alternatives)."""
    content = []
    for t, lp, top in zip(token_ids, logprobs, tops, strict=True):
        entry = _chat_entry(token_text(t), lp)
        entry["top_logprobs"] = [_chat_entry(token_text(a), v) for a, v in top]
        content.append(entry)
    return {"content": content}


def prompt_logprobs_entries(
    prompt_ids: Sequence[int],
    logprobs: Sequence[float],
    ranks: Sequence[int],
    tops: Sequence[TopList],
    token_text: TokenText,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token
    ``{token id: {"logprob", "rank", "decoded_token"}}`` for the token itself and the
    alternatives in ``tops`` (rank 1 is the likeliest). ``logprobs``, ``ranks`` and
    ``tops`` cover ``prompt_ids[1:]``."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t, lp, rank, top in zip(prompt_ids[1:], logprobs, ranks, tops, strict=True):
        entry = {
            str(a): {"logprob": _lp(v), "rank": r, "decoded_token": token_text(a)}
            for r, (a, v) in enumerate(top, start=1)
        }
        entry.setdefault(str(t), {"logprob": _lp(lp), "rank": rank, "decoded_token": token_text(t)})
        out.append(entry)
    return out


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
