"""The OpenAI API's requests as pydantic models (responses: :mod:`~radixkv.serve.openai.responses`).

Requests are checked strictly: every field has its OpenAI (or vLLM) type and JSON types
are not coerced (``"max_tokens": "5"`` and ``"stream": 1`` are errors); an optional
field set to ``null`` takes its default, as OpenAI's nullable fields do. Fields outside
the API are ignored, as vLLM does; fields OpenAI or vLLM define that radixkv does not
implement (``tools``, ``response_format`` other than text, beam search, guided
decoding, ...: :data:`NOT_IMPLEMENTED`) are accepted only at their neutral value and
otherwise refused with a message naming the field, never silently ignored.

Implemented: ``prompt`` as a string, a list of strings, a list of token ids or a list
of token-id lists; ``n`` choices per prompt (``best_of`` 1 or ``n``); sampling
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``), penalties
(``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``), ``logit_bias``,
``min_tokens``, stops (``stop``, vLLM's ``stop_token_ids`` and ``ignore_eos``),
logprobs (completions ``logprobs`` 0-20 and ``echo``; chat ``logprobs`` and
``top_logprobs``; vLLM's ``prompt_logprobs``), vLLM's ``cache_salt``,
``return_token_ids``, ``return_tokens_as_token_ids`` and ``truncate_prompt_tokens``
(-1 or k >= 1: 0 is refused), chat's ``add_generation_prompt`` and
``continue_final_message``, vLLM's ``chat_template_kwargs`` (extra variables of the chat
template, chat and ``/tokenize``) and chat's ``reasoning_effort`` (one more such
variable, as vLLM passes it).

Every string must be valid Unicode, encodable as UTF-8: JSON's ``"\\ud800"`` escape
(a lone surrogate) is legal JSON but no text, so a field holding one is a 400
naming it; ``user`` and ``cache_salt`` become cache namespaces, so nothing
unencodable reaches the cache. ``stop`` holds at most :data:`MAX_STOP` entries, each
string at most :data:`MAX_STOP_LEN` characters (OpenAI allows 4 stop sequences);
``logit_bias`` and ``stop_token_ids`` at most :data:`MAX_TOKEN_IDS` entries each. A
chat holds at most :data:`MAX_MESSAGES` messages, each at most
:data:`MAX_CONTENT_PARTS` text parts, and ``chat_template_kwargs`` at most
:data:`MAX_TEMPLATE_VALUES` values nested at most :data:`MAX_TEMPLATE_DEPTH` deep.
:func:`decode_json` is the body's JSON: UTF-8 only, whatever the ``Content-Type``.
Rules that join two fields (``best_of`` and ``n``, ``min_tokens`` and ``max_tokens``)
are checked by each request's ``check()``, which raises :class:`FieldError`; so are
``chat_template_kwargs``' names and values (:func:`check_chat_template_kwargs`).
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from collections.abc import Hashable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from radixkv.checks import is_int
from radixkv.text.tokenizer import JsonPlace, check_template_variables, walk_json

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "FieldError",
    "MAX_CHOICES",
    "MAX_CONTENT_PARTS",
    "MAX_LOGPROBS",
    "MAX_MESSAGES",
    "MAX_N",
    "MAX_STOP",
    "MAX_STOP_LEN",
    "MAX_TEMPLATE_DEPTH",
    "MAX_TEMPLATE_VALUES",
    "MAX_TOKEN_IDS",
    "NOT_IMPLEMENTED",
    "StreamOptions",
    "TokenizeRequest",
    "check_chat_template_kwargs",
    "decode_json",
    "namespace_of",
    "new_id",
    "utf8_problem",
]

SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_STOP = 16
"""Most entries (strings and token ids) of ``stop``: OpenAI allows 4 stop sequences."""
MAX_STOP_LEN = 256
"""Most characters of one stop string."""
MAX_N = 128
"""Most choices per prompt (OpenAI's limit for ``n``)."""
MAX_CHOICES = 1024
"""Most choices one request may ask for: prompts x ``n``."""
MAX_LOGPROBS = 20
"""Most alternatives per token (completions ``logprobs``, chat ``top_logprobs``): vLLM's."""
MAX_LOGIT_BIAS = 100.0
"""``logit_bias`` values lie in [-100, 100], as OpenAI's."""
MAX_MESSAGES = 4096
"""Most messages of one chat (chat completions and ``/tokenize``)."""
MAX_CONTENT_PARTS = 256
"""Most text parts of one message's ``content``."""
MAX_TEMPLATE_VALUES = 16384
"""Most values in ``chat_template_kwargs`` (list items and object members, at every depth):
room for OpenAI's 128 tools with their parameter schemas."""
MAX_TEMPLATE_DEPTH = 32
"""Deepest value in ``chat_template_kwargs``: the variables are at depth 1, an item of a
list variable at 2, and so on."""
MAX_TOKEN_IDS = 2**18
"""Most entries of ``logit_bias`` and of ``stop_token_ids`` (262,144): one for every token
of the largest vocabularies served (Qwen's 151,936, Gemma 2's 256,000)."""
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""The values of chat's ``reasoning_effort`` (OpenAI's, and vLLM's ``max``)."""


class FieldError(ValueError):
    """A request that breaks a rule joining fields: ``param`` names the field to blame."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


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


def brief(value: object, limit: int = 200) -> str:
    """``value`` as JSON, cut to ``limit`` characters (its type alone if it will not encode)."""
    if isinstance(value, (str, list)) and len(value) > limit:
        value = value[:limit]  # a huge prompt is not dumped whole to show its head
    try:
        text = json.dumps(value, default=repr)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text[:limit]


# Fields OpenAI or vLLM define that radixkv does not implement: the neutral values each
# may take (anything else is a 400 naming the field).
_COMMON_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "response_format": ({"type": "text"},),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "logits_processors": ([],),
    "priority": (0,),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "mm_processor_kwargs": ({},),
}
_COMPLETION_NOT_IMPLEMENTED = {
    **_COMMON_NOT_IMPLEMENTED,
    "suffix": ("",),
    "add_special_tokens": (True,),
    "prompt_embeds": (),
}
_CHAT_NOT_IMPLEMENTED = {
    **_COMMON_NOT_IMPLEMENTED,
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "chat_template": (),
    "documents": ([],),
    "echo": (False,),
    "add_special_tokens": (False,),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
}
NOT_IMPLEMENTED: dict[str, dict[str, tuple[Any, ...]]] = {
    "/v1/completions": _COMPLETION_NOT_IMPLEMENTED,
    "/v1/chat/completions": _CHAT_NOT_IMPLEMENTED,
}
"""Per endpoint, the fields refused unless left out (or null) or sent at a neutral value."""


def _same(value: Any, neutral: Any) -> bool:
    """``value`` equals ``neutral`` with JSON's types (``true`` is not ``1``; ``1`` is ``1.0``)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, float):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


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
    """OpenAI's ``include_usage`` (a last chunk with the request's usage) and vLLM's
    ``continuous_usage_stats`` (with it, every chunk carries the usage so far)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """The fields both generation endpoints share."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}
    ZERO_HINT: ClassVar[str] = ""

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    stop: Text | list[Text | int] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    cache_salt: Text | None = Field(None, min_length=1)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM and OpenAI fields radixkv does not implement: refused unless neutral (NEUTRAL)
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    priority: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    add_special_tokens: Any = None

    @field_validator("*")
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        """A field radixkv does not implement must be at a neutral value."""
        name = info.field_name
        if name is None or name not in cls.NEUTRAL:
            return v
        neutral = cls.NEUTRAL[name]
        if any(_same(v, n) for n in neutral):
            return v
        allowed = " or ".join(f"send {brief(n)}" for n in neutral)
        how = f"leave it out or {allowed}" if allowed else "leave it out"
        raise ValueError(f"not supported by this server ({how}), got {brief(v)}")

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
        if len(v or []) > MAX_TOKEN_IDS:
            raise ValueError(f"at most {MAX_TOKEN_IDS} token ids, got {len(v or [])}")
        for t in v or []:
            if t < 0:
                raise ValueError(f"token ids must be >= 0, got {t}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if len(v or {}) > MAX_TOKEN_IDS:
            raise ValueError(f"at most {MAX_TOKEN_IDS} entries, got {len(v or {})}")
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids written as strings, got {brief(key)}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"biases lie in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias!r} for token {key}"
                )
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:  # vLLM's SamplingParams refuses it too; keeping no token is no prompt
            raise ValueError(
                "must be -1 (as many tokens as the model takes) or at least 1 (keep the "
                "prompt's last k tokens), got 0"
            )
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

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs."""
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's ``continuous_usage_stats``, with ``include_usage``."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """Alternatives per generated token to report, or None for no logprobs."""
        return None

    def check(self) -> None:
        """The rules that join fields; :class:`FieldError` naming the field to blame."""
        max_tokens = self.requested_max_tokens
        if max_tokens == 0 and not self.echoes_prompt:
            raise FieldError("max_tokens", f"max_tokens must be at least 1, got 0{self.ZERO_HINT}")
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise FieldError(
                "min_tokens",
                f"min_tokens must be at most max_tokens ({max_tokens}), got {self.min_tokens}",
            )

    @property
    def echoes_prompt(self) -> bool:
        """Whether the reply starts with the prompt (completions' ``echo``)."""
        return False


def _token_ids(value: list[Any], where: str) -> list[int]:
    """``value`` as a non-empty list of token ids, or ``ValueError`` saying what is wrong."""
    if not value:
        raise ValueError(f"{where} must hold at least one token")
    for k, t in enumerate(value):
        if not is_int(t):
            raise ValueError(f"{where}[{k}] must be a token id (an int), got {brief(t)}")
        if t < 0:
            raise ValueError(f"token ids must be >= 0, got {t} at {where}[{k}]")
    return value


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids or a list of token-id lists; each prompt gets ``n`` choices."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = _COMPLETION_NOT_IMPLEMENTED
    ZERO_HINT: ClassVar[str] = " (0 is allowed only with echo)"

    prompt: Any
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None
    prompt_embeds: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_forms(cls, v: Any) -> Any:
        wrong = (
            "must be a string, a list of strings, a list of token ids or a list of "
            f"token-id lists, got {brief(v, 100)}"
        )
        if isinstance(v, str):
            return _utf8(v)
        if not isinstance(v, list):
            raise ValueError(wrong)
        if not v:
            raise ValueError("must hold at least one prompt, got []")
        if all(isinstance(p, str) for p in v):
            for k, p in enumerate(v):
                if (problem := utf8_problem(p)) is not None:
                    raise ValueError(f"prompt[{k}]: {problem}")
            return v
        if all(isinstance(p, list) for p in v):
            return [_token_ids(p, f"prompt[{k}]") for k, p in enumerate(v)]
        if any(isinstance(p, (str, list)) for p in v):
            raise ValueError(wrong)
        return _token_ids(v, "prompt")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echoes_prompt(self) -> bool:
        return self.echo

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise FieldError(
                "best_of", f"best_of must be 1 or equal to n ({self.n}), got {self.best_of}"
            )
        num = len(self.prompts()) * self.n
        if num > MAX_CHOICES:
            raise FieldError(
                "n" if self.n > 1 else "prompt",
                f"{len(self.prompts())} prompts x n {self.n} is {num} choices; "
                f"a request may ask for at most {MAX_CHOICES}",
            )


def check_chat_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as the chat template's extra variables ({} for None), or
    :class:`FieldError` naming the field: more than :data:`MAX_TEMPLATE_VALUES` values
    or one deeper than :data:`MAX_TEMPLATE_DEPTH` (checked first, as they are read), a
    name the renderer sets itself, a value that is not JSON (a non-finite number:
    ``json`` reads ``NaN``), a string that is not valid UTF-8 text (see
    :func:`~radixkv.text.tokenizer.check_template_variables`). A template that does not
    read a variable renders as without it, as in vLLM. Complexity: O(size of the values)."""
    name = "chat_template_kwargs"
    num_values = -1  # the variables' object itself is not counted
    for item, place in walk_json(value or {}):
        num_values += 1
        if num_values > MAX_TEMPLATE_VALUES:
            raise FieldError(name, f"{name} holds more than {MAX_TEMPLATE_VALUES} values")
        if place.depth > MAX_TEMPLATE_DEPTH:
            deep = f"deeper than {MAX_TEMPLATE_DEPTH} levels (its variables are level 1)"
            raise FieldError(name, f"{name} nests a value {deep}")
        if isinstance(item, str) and (problem := utf8_problem(item)) is not None:
            raise FieldError(name, f"{place.describe(name)}: {problem}")
        if isinstance(item, dict):
            for k in item:
                if isinstance(k, str) and (problem := utf8_problem(k)) is not None:
                    where = JsonPlace(place, k, place.depth + 1).describe(name)
                    raise FieldError(name, f"the key of {where}: {problem}")
    try:
        return check_template_variables(value, name)
    except (TypeError, ValueError) as exc:
        raise FieldError(name, str(exc)) from None


def _check_num_messages(messages: Any) -> Any:
    """At most :data:`MAX_MESSAGES` messages, counted before any is validated."""
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise ValueError(f"a chat holds at most {MAX_MESSAGES} messages, got {len(messages)}")
    return messages


class _TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    """One message; ``content`` is text or a list of ``{"type": "text", "text"}`` parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[_TextPart] | None = None
    name: Text | None = None

    @field_validator("content")
    @classmethod
    def _num_parts(cls, v: str | list[_TextPart] | None) -> str | list[_TextPart] | None:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(
                f"a message's content holds at most {MAX_CONTENT_PARTS} parts, got {len(v)}"
            )
        return v

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
    ``add_generation_prompt`` (default true) ends the prompt with the assistant's header;
    ``continue_final_message`` instead leaves the final message open, so the reply
    continues it (the two exclude each other, as in vLLM). ``chat_template_kwargs`` are
    extra variables of the template (:func:`check_chat_template_kwargs`), and so is
    ``reasoning_effort`` where sent (:meth:`template_variables`). ``prompt_logprobs`` come
    in the response beside ``usage``, as vLLM puts them, and not with ``stream`` (as in
    vLLM: a chat chunk has no place for them).
    """

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = _CHAT_NOT_IMPLEMENTED

    messages: Annotated[list[ChatMessage], BeforeValidator(_check_num_messages)] = Field(
        min_length=1
    )
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Any = None
    echo: Any = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_variables(self) -> dict[str, Any]:
        """The chat template's extra variables: ``chat_template_kwargs``, with
        ``reasoning_effort`` where sent (as vLLM passes it: gpt-oss's template reads it; a
        template that does not renders as without it)."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
        return variables

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise FieldError(
                "top_logprobs", f"top_logprobs needs logprobs: true, got {self.top_logprobs}"
            )
        if self.stream and self.prompt_logprobs is not None:
            raise FieldError(
                "prompt_logprobs",
                "prompt_logprobs are not available with stream: true in chat (as in vLLM: "
                f"send stream: false), got {self.prompt_logprobs}",
            )
        if self.reasoning_effort is not None and "reasoning_effort" in (
            self.chat_template_kwargs or {}
        ):
            raise FieldError(
                "reasoning_effort",
                "reasoning_effort is sent both as a field and in chat_template_kwargs: "
                "send it once",
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt: false "
                "(the reply cannot both continue the final message and open a new one)",
            )
        check_chat_template_kwargs(self.chat_template_kwargs)


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): ``prompt`` text, or chat ``messages`` rendered with the
    chat template (``add_generation_prompt``, ``continue_final_message`` and
    ``chat_template_kwargs`` as in chat)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], BeforeValidator(_check_num_messages)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        """The rules that join fields; :class:`FieldError` naming the field to blame. A text
        prompt gets the tokenizer's special tokens unless ``add_special_tokens`` is false
        (vLLM's default: true); messages get the chat template's own, so for them
        ``add_special_tokens`` may only be false (vLLM's default there)."""
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "send either prompt or messages")
        if self.messages is not None and not self.messages:
            raise FieldError("messages", "messages must hold at least one message")
        if self.messages is not None and self.add_special_tokens:
            raise FieldError(
                "add_special_tokens",
                "add_special_tokens: not supported by this server for messages (the chat "
                "template adds them; leave it out), got true",
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt: false",
            )
        if self.prompt is not None and self.chat_template_kwargs:
            raise FieldError(
                "chat_template_kwargs",
                "chat_template_kwargs are variables of the chat template, which renders "
                "messages, not a prompt",
            )
        check_chat_template_kwargs(self.chat_template_kwargs)


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): ``tokens``, a list of token ids."""

    model: Text | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, v: list[int]) -> list[int]:
        for k, t in enumerate(v):
            if t < 0:
                raise ValueError(f"token ids must be >= 0, got {t} at tokens[{k}]")
        return v


def namespace_of(cache_salt: str | None, user: str | None) -> Hashable:
    """The cache namespace of a request: its ``cache_salt`` if set, else ``("user", user)``
    if ``user`` is set, else None (the shared namespace).

    A salt is the namespace itself, so a radixkv replica's KV event hashes for a
    salted prompt match vLLM's (which puts the salt in the first block's extra keys);
    the ``"user"`` tag keeps a user named like a salt apart from it. Both come from a
    parsed request, so they are text already (``Text``); the engine checks the namespace
    against its cache (``Engine.make_request``).
    """
    if cache_salt is not None:
        return cache_salt
    if user is not None:
        return ("user", user)
    return None


def new_id(prefix: str) -> str:
    """A fresh response id, e.g. ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"
