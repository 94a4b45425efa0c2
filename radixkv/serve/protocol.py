"""The OpenAI API's requests as pydantic models, and its responses as JSON-ready dicts.

Requests are checked strictly: every field has its OpenAI type and JSON types are
not coerced (``"max_tokens": "5"`` and ``"stream": 1`` are errors); an optional field
set to ``null`` takes its default, as OpenAI's nullable fields do. Fields
OpenAI defines that radixkv does not implement (``logprobs``, ``n`` > 1, penalties,
``logit_bias``, tools) are type-checked too and refused unless left at their
neutral value, never silently ignored. Fields outside the API are ignored, as
vLLM does. vLLM's extensions are accepted: ``stop_token_ids``, ``ignore_eos``,
``cache_salt`` and ``return_token_ids``.

Every string must be valid Unicode, encodable as UTF-8: JSON's ``"\\ud800"`` escape
(a lone surrogate) is legal JSON but no text, so a field holding one is a 400
naming it; ``user`` and ``cache_salt`` become cache namespaces, so nothing
unencodable reaches the cache. ``stop`` holds at most :data:`MAX_STOP` entries, each
string at most :data:`MAX_STOP_LEN` characters (OpenAI allows 4 stop sequences).
:func:`decode_json` is the body's JSON: UTF-8 only, whatever the ``Content-Type``.

Responses follow OpenAI's shapes (``text_completion``, ``chat.completion`` and their
``.chunk`` stream forms); ``usage.prompt_tokens_details.cached_tokens`` is the prompt
prefix the radix cache held.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Hashable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "MAX_STOP",
    "MAX_STOP_LEN",
    "StreamOptions",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "decode_json",
    "error_body",
    "namespace_of",
    "new_id",
    "usage",
    "usage_chunk",
    "utf8_problem",
]

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_STOP = 16
"""Most entries (strings and token ids) of ``stop``: OpenAI allows 4 stop sequences."""
MAX_STOP_LEN = 256
"""Most characters of one stop string."""


def utf8_problem(text: str) -> str | None:
    r"""Why ``text`` cannot be encoded as UTF-8 (a lone surrogate, and where), or None.

    >>> utf8_problem("hé") is None, utf8_problem("a" + chr(0xD800))
    (True, "a lone surrogate '\\ud800' at character 1 is not valid UTF-8 text")

    Complexity: O(len(text)), and O(1) extra for ASCII text.
    """
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        return f"a lone surrogate {char!r} at character {exc.start} is not valid UTF-8 text"
    return None


def _utf8(text: str) -> str:
    problem = utf8_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


Text = Annotated[str, AfterValidator(_utf8)]
"""A string that is valid Unicode text (encodable as UTF-8)."""


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body: UTF-8 (a leading byte-order mark is skipped).

    ``ValueError`` with a message for a client: bytes that are not UTF-8 (and where),
    malformed JSON, an integer of more digits than Python converts (4300), nesting
    deeper than the parser's recursion limit. Complexity: O(len(raw)).
    """
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        byte = raw[exc.start]
        raise ValueError(
            f"the body is not UTF-8: byte 0x{byte:02x} at offset {exc.start}"
        ) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("the body is not valid JSON: it nests too deeply") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the body is not valid JSON: {exc}") from None
    except ValueError:  # json's only other: an integer longer than Python converts
        limit = sys.get_int_max_str_digits()
        raise ValueError(
            f"the body is not valid JSON: an integer has more than {limit} digits"
        ) from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """An optional field set to null takes its default: OpenAI's optional fields are
        nullable (``"temperature": null`` is 1.0), and clients send nulls for "not given"."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].is_required()
        }


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text | int] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    cache_salt: Text | None = Field(None, min_length=1)
    ignore_eos: bool = False
    return_token_ids: bool = False
    # OpenAI fields radixkv does not implement: typed, and refused unless neutral.
    n: int = 1
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_entries(cls, v: str | list[str | int] | None) -> str | list[str | int] | None:
        stop = [v] if isinstance(v, str) else v or []
        if len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stop)}")
        for s in stop:
            if isinstance(s, int) and s < 0:
                raise ValueError(f"token ids must be >= 0, got {s}")
            if isinstance(s, str) and len(s) > MAX_STOP_LEN:
                raise ValueError(
                    f"a stop string holds at most {MAX_STOP_LEN} characters, got {len(s)}"
                )
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        for t in v or []:
            if t < 0:
                raise ValueError(f"token ids must be >= 0, got {t}")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError(f"penalties are not supported; leave it at 0, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_strings(self) -> list[str]:
        """The text stop strings of ``stop``."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if isinstance(s, str) and s]

    def stop_ids(self, only: str | None = None) -> list[int]:
        """The token ids of ``stop`` and ``stop_token_ids`` (in that order, no repeats);
        ``only="stop"`` gives those of ``stop`` alone."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        ids = [s for s in stop if isinstance(s, int)]
        if only != "stop":
            ids += self.stop_token_ids or []
        return list(dict.fromkeys(ids))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text or a list of token ids (one prompt)."""

    prompt: Text | list[int]
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_ids(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list):
            if not v:
                raise ValueError("a token-id prompt must hold at least one token")
            for t in v:
                if t < 0:
                    raise ValueError(f"token ids must be >= 0, got {t}")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, v: object) -> object:
        if v is not None:
            raise ValueError("not supported; leave it out")
        return v


class _TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    """One message; ``content`` is text or a list of ``{"type": "text", "text"}`` parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[_TextPart] | None = None
    name: Text | None = None

    def as_template_input(self) -> dict[str, str]:
        """``{"role", "content"}`` for a chat template (``developer`` reads as ``system``)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template.

    ``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported; leave it out")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tools are not supported")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def namespace_of(cache_salt: str | None, user: str | None) -> Hashable:
    """The cache namespace of a request: its ``cache_salt`` if set, else ``("user", user)``
    if ``user`` is set, else None (the shared namespace).

    A salt is the namespace itself, so a radixkv replica's KV event hashes for a
    salted prompt match vLLM's (which puts the salt in the first block's extra keys);
    the ``"user"`` tag keeps a user named like a salt apart from it. ``ValueError``
    naming the field if either is not valid UTF-8 text (a lone surrogate).
    """
    for field, value in (("cache_salt", cache_salt), ("user", user)):
        problem = None if value is None else utf8_problem(value)
        if problem is not None:
            raise ValueError(f"{field}: {problem}")
    if cache_salt is not None:
        return cache_salt
    if user is not None:
        return ("user", user)
    return None


def new_id(prefix: str) -> str:
    """A fresh response id, e.g. ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _choice(finish_reason: str | None, token_ids: list[int] | None, **fields: Any) -> dict:
    choice: dict[str, Any] = {"index": 0, **fields, "logprobs": None}
    choice["finish_reason"] = finish_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def _envelope(rid: str, obj: str, model: str, choices: list[dict], **extra: Any) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, Any],
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` object with one choice (``token_ids`` when asked for)."""
    choice = _choice(finish_reason, token_ids, text=text)
    return _envelope(rid, "text_completion", model, [choice], usage=usage_)


def completion_chunk(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    return _envelope(rid, "text_completion", model, [_choice(finish_reason, token_ids, text=text)])


def chat_response(
    rid: str,
    model: str,
    content: str,
    finish_reason: str | None,
    usage_: dict[str, Any],
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` object with one assistant message."""
    message = {"role": "assistant", "content": content}
    choice = _choice(finish_reason, token_ids, message=message)
    return _envelope(rid, "chat.completion", model, [choice], usage=usage_)


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, str],
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``."""
    choice = _choice(finish_reason, token_ids, delta=delta)
    return _envelope(rid, "chat.completion.chunk", model, [choice])


def usage_chunk(rid: str, obj: str, model: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return _envelope(rid, obj, model, [], usage=usage_)


def error_body(
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
