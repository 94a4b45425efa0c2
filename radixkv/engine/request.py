"""Request: one generation request's tokens, progress and timing, as the scheduler sees them.

Plain ints and numpy only: this module makes no tensor (the scorer's and the sampler's
per-request state, which may hold some, is opaque here). A request's token buffer is
``prompt + output``; ``num_computed_tokens`` of them have K/V in the pool (in the
blocks the :class:`~radixkv.cache.manager.KVCacheManager` holds for it), and the
scheduler's job is to bring ``num_computed_tokens`` up to ``num_tokens`` (prefill
chunks, then one decode token per step).

The one check of a request against the engine it goes to lives here too:
:func:`check_request` (the prompt's ids, ``SamplingParams``' ids and the room left in
``max_model_len``) over the engine's fixed :class:`EngineLimits`. ``Engine.make_request``
calls it, and so do the OpenAI handlers, before they start any choice, with their
client's limits (the fleet's ingress has no engine, only its replicas' limits); its
errors (:class:`RequestError`, :class:`ContextLengthError`) name the field, which a
front end maps to its own name.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from radixkv.cache.arrays import TOKEN_DTYPE, TokenSeq, as_token_array
from radixkv.cache.prefix_cache import check_namespace
from radixkv.checks import check_int, check_ints, check_number, check_str

__all__ = [
    "ContextLengthError",
    "EngineLimits",
    "FinishReason",
    "PromptLogprobs",
    "Request",
    "RequestError",
    "RequestStats",
    "RequestStatus",
    "SamplingParams",
    "check_params",
    "check_prompt",
    "check_request",
    "check_token_ids",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    - ``max_new_tokens``: generation stops after this many tokens (>= 1).
    - ``temperature``: 0.0 is greedy (argmax; ties go to the lowest id), else
      softmax sampling at that temperature.
    - ``top_p``: nucleus sampling mass in ``(0, 1]``; ``top_k``: keep the ``k``
      likeliest tokens (0: all); ``min_p``: drop tokens less likely than ``min_p``
      times the likeliest one (0: none). Applied in that order after the temperature
      (min_p, then top-k, then top-p over what top-k kept, as vLLM does); ignored when
      greedy.
    - ``repetition_penalty`` (> 0; 1 is none): a token already in the prompt or the
      output has its logit divided by it (multiplied, if negative);
      ``presence_penalty`` / ``frequency_penalty``: subtracted from an output token's
      logit once / once per occurrence. ``logit_bias``: ``(token, bias)`` pairs added
      to the logits. ``min_tokens``: the stop tokens cannot be picked before this many
      tokens exist. These apply to greedy requests too, in vLLM's order (bias and
      min_tokens, then the penalties).
    - ``seed``: seeds the request's own generator, so sampled outputs do not
      depend on batching; an int in ``[-2**63, 2**64)`` (what
      ``torch.Generator.manual_seed`` takes). None: the engine derives one from
      its own seed and the request's arrival order in that engine.
    - ``stop_token_ids``: generation stops after emitting any of these (the
      stop token is kept in the output).
    - ``top_logprobs``: record the ``k`` likeliest tokens and their logprobs at each
      output position (``Request.top_logprobs``); 0: none. ``prompt_logprobs``: None,
      or record each prompt token's logprob, rank and the ``k`` likeliest at its
      position (``Request.prompt_logprobs``), scored in the prefill itself, reading the
      scores the cache keeps for its blocks (``radixkv.engine.prompt_scores``). Logprobs are those
      of the model's own distribution, before any of the adjustments above.

    The penalties and the ``logit_bias`` values adjust the float32 logits: each must be one
    float32 holds as it is, 0 or a magnitude in [1.18e-38, 3.40e38]
    (``radixkv.checks.FLOAT32_TINY`` / ``FLOAT32_MAX``); a smaller magnitude is subnormal or
    0 there (a repetition penalty of 1e-300 divided by 0) and a larger one infinity. The
    temperature, ``top_p`` and ``min_p`` act in float64, which holds any finite value (a
    temperature of 5e-324 is greedy). ``logit_bias`` and ``stop_token_ids`` are checked
    once: a copy made with ``dataclasses.replace`` (a fork's seed) keeps them, in O(1).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    top_logprobs: int = 0
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # The checks only refuse: a field keeps the value given (token ids excepted).
        check_int("max_new_tokens", self.max_new_tokens, low=1)
        check_number("temperature", self.temperature, low=0)
        check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        check_int("seed", self.seed, low=SEED_MIN, high=SEED_MAX, optional=True)
        object.__setattr__(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        # looked up once per generated token: a set, whatever the list's length
        object.__setattr__(self, "_stop_set", frozenset(self.stop_token_ids))
        check_int("top_k", self.top_k, low=0)
        check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        rep = self.repetition_penalty
        check_number("repetition_penalty", rep, low=0, strict=True, float32=True)
        check_number("presence_penalty", self.presence_penalty, float32=True)
        check_number("frequency_penalty", self.frequency_penalty, float32=True)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        check_int("min_tokens", self.min_tokens, low=0, high=self.max_new_tokens)
        check_int("top_logprobs", self.top_logprobs, low=0)
        check_int("prompt_logprobs", self.prompt_logprobs, low=0, optional=True)

    def is_stop(self, token: int) -> bool:
        """Whether ``token`` is one of ``stop_token_ids``. Complexity: O(1)."""
        return token in self._stop_set

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalises(self) -> bool:
        """Whether a repetition, presence or frequency penalty applies."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before a pick (penalties, bias, min_tokens), greedy or not."""
        return self.penalises or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``logit_bias`` as two read-only arrays, built once: the token ids (int64,
        ascending) and their biases (float32). Complexity: O(1)."""
        bias = self.logit_bias
        assert isinstance(bias, _BiasPairs)  # __post_init__ made it one
        return bias.ids, bias.values

    @property
    def truncates(self) -> bool:
        """Whether sampling keeps only the likeliest tokens (top-k or top-p)."""
        return self.top_k > 0 or self.top_p < 1.0

    def check_vocab(self, vocab_size: int) -> None:
        """:class:`RequestError` naming the field if a token id here is outside
        ``[0, vocab_size)``, or ``top_logprobs`` / ``prompt_logprobs`` ask for more tokens
        than there are. Complexity: O(len(stop_token_ids)) and O(1) for ``logit_bias`` (its
        ids are sorted), in C."""
        if max(self.stop_token_ids, default=-1) >= vocab_size:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            raise RequestError(
                "stop_token_ids",
                f"{bad} are outside the model's vocabulary (vocab_size {vocab_size})",
            )
        ids, _ = self.logit_bias_arrays
        if len(ids) and ids[-1] >= vocab_size:
            bad = ids[ids >= vocab_size].tolist()
            raise RequestError(
                "logit_bias",
                f"token ids {bad} are outside the model's vocabulary (vocab_size {vocab_size})",
            )
        for name in ("top_logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > vocab_size:
                raise RequestError(name, f"is {k}, more than the vocabulary's {vocab_size} tokens")


class _Checked(tuple):
    """A tuple field's value as ``SamplingParams.__post_init__`` checked it: given again (a
    ``dataclasses.replace``), it is kept as it is, without a second O(length) check."""


class _StopIds(_Checked):
    """Checked ``stop_token_ids``."""


class _BiasPairs(_Checked):
    """Checked ``logit_bias`` pairs, with their token ids and biases as arrays (built once,
    for the sampler's tensors)."""

    ids: np.ndarray
    values: np.ndarray


def _stop_ids(stops: object) -> tuple[int, ...]:
    """``stop_token_ids`` checked, as a tuple of ints (kept as it is if already checked)."""
    if type(stops) is _StopIds:
        return stops
    if isinstance(stops, (str, bytes)) or not isinstance(stops, Iterable):
        raise ValueError(f"stop_token_ids must be a sequence of ints, got {stops!r}")
    return _StopIds(check_ints("stop_token_ids", stops, low=0))


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping or ``(token, bias)`` pairs) as checked pairs sorted by token
    (kept as it is if already checked)."""
    if type(bias) is _BiasPairs:
        return bias
    items = bias.items() if isinstance(bias, Mapping) else bias
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise ValueError(f"logit_bias must hold (token, bias) pairs, got {bias!r}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"logit_bias must hold (token, bias) pairs, got {item!r}")
        token, value = item
        token = check_int("logit_bias token id", token, low=0)
        pairs[token] = check_number(f"logit_bias[{token}]", value, float32=True)
    checked = _BiasPairs(sorted(pairs.items()))
    checked.ids = np.fromiter((t for t, _ in checked), dtype=np.int64, count=len(checked))
    checked.values = np.fromiter((b for _, b in checked), dtype=np.float32, count=len(checked))
    checked.ids.flags.writeable = checked.values.flags.writeable = False
    return checked


@dataclass(frozen=True)
class PromptLogprobs:
    """The model's view of a prompt, for ``prompt_ids[1:]`` (the first token has none):
    each token's ``logprobs`` and ``ranks`` (1: the likeliest) and the ``top`` likeliest
    ``(token, logprob)`` pairs at its position."""

    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


class RequestError(ValueError):
    """A request the engine refuses: ``param`` names the field to blame, by the engine's name
    (``"prompt"``, or a ``SamplingParams`` field), and the message starts with it."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param} {detail}")
        self.param = param
        self.detail = detail

    def message_for(self, name: str) -> str:
        """The message with the field called ``name``, a front end's name for ``param``
        (OpenAI's ``max_tokens`` for ``max_new_tokens``, ``messages`` for a chat's prompt)."""
        return f"{name} {self.detail}"


class ContextLengthError(RequestError):
    """The request does not fit ``max_model_len``: ``param`` is ``"prompt"`` when the prompt
    leaves room for no new token, ``"max_new_tokens"`` when it asks for more than the room."""


@dataclass(frozen=True)
class EngineLimits:
    """What an engine accepts, fixed once it is built: token ids below ``vocab_size``, and
    at most ``max_model_len`` tokens of prompt plus ``max_new_tokens``. ``source`` says what
    set ``max_model_len`` (the pool, a setting, the model's context), for the errors. Plain
    values: a front end without the engine (the fleet's ingress) checks requests with its
    replicas' limits. ``ValueError`` naming a field that is not a positive int (a str for
    ``source``)."""

    vocab_size: int
    max_model_len: int
    source: str = "the engine's setting"

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocab_size", check_int("vocab_size", self.vocab_size, low=1))
        max_model_len = check_int("max_model_len", self.max_model_len, low=1)
        object.__setattr__(self, "max_model_len", max_model_len)
        check_str("source", self.source)

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens leaves room for (0: none).
        Complexity: O(1)."""
        return max(0, self.max_model_len - prompt_len)

    def within(self, context_len: int | None) -> EngineLimits:
        """These limits with ``max_model_len`` lowered to the model's context length
        ``context_len`` where that is shorter (None: unknown, no change): the smaller limit
        wins, and the errors say which."""
        if context_len is None or context_len >= self.max_model_len:
            return self
        return replace(self, max_model_len=context_len, source="the model's context length")


def check_token_ids(field: str, ids: Sequence[int] | np.ndarray, vocab_size: int) -> None:
    """:class:`RequestError` naming ``field`` if an id of ``ids`` (ints >= 0) is not below
    ``vocab_size``: the one vocabulary rule for token ids. Complexity: O(len(ids)), in C."""
    if len(ids) == 0:
        return
    top = int(np.max(ids))
    if top >= vocab_size:
        raise RequestError(
            field, f"holds token id {top}, outside the model's vocabulary (vocab_size {vocab_size})"
        )


def check_prompt(prompt: Sequence[int] | np.ndarray, limits: EngineLimits) -> None:
    """The prompt's rules, once its ids are ints >= 0 (``Request`` checks that): each id
    inside the vocabulary (:class:`RequestError`) and room for one new token within
    ``max_model_len`` (:class:`ContextLengthError`), both naming ``prompt``.
    Complexity: O(len(prompt))."""
    check_token_ids("prompt", prompt, limits.vocab_size)
    n = len(prompt)
    if n >= limits.max_model_len:
        raise ContextLengthError(
            "prompt",
            f"holds {n} tokens, which leaves room for 0 new tokens within max_model_len "
            f"{limits.max_model_len} ({limits.source})",
        )


def check_params(params: SamplingParams, prompt_len: int, limits: EngineLimits) -> None:
    """``params``' rules for a prompt of ``prompt_len`` tokens that :func:`check_prompt`
    passed: :meth:`SamplingParams.check_vocab`, then ``max_new_tokens`` within the room
    the prompt leaves (:class:`ContextLengthError` naming ``max_new_tokens``).
    Complexity: O(len(params.stop_token_ids))."""
    params.check_vocab(limits.vocab_size)
    room = limits.max_new_tokens(prompt_len)
    if params.max_new_tokens > room:
        raise ContextLengthError(
            "max_new_tokens",
            f"is {params.max_new_tokens} but a prompt of {prompt_len} tokens leaves room for "
            f"{room} within max_model_len {limits.max_model_len} ({limits.source})",
        )


def check_request(
    prompt: Sequence[int] | np.ndarray, params: SamplingParams, limits: EngineLimits
) -> None:
    """The one check of a request against an engine's ``limits``: :func:`check_prompt`,
    then :func:`check_params`. ``Engine.make_request`` calls it; a front end that builds
    its request in parts (the OpenAI handlers) calls the two halves, in this order.
    Complexity: O(len(prompt) + len(params.stop_token_ids))."""
    check_prompt(prompt, limits)
    check_params(params, len(prompt), limits)


SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop token was sampled
    ABORT = "abort"  # Engine.abort_request
    ERROR = "error"  # the step that ran it failed (Request.error says how)


@dataclass(frozen=True)
class RequestStats:
    """What one request cost. Times in seconds (``time.perf_counter`` clock).

    - ``cached_tokens``: prompt tokens matched in the cache at the first admission.
    - ``prefill_tokens``: tokens run as prefill, recomputation after preemption included.
    - ``decode_tokens``: tokens run as single-token decode steps.
    - ``ttft``: arrival to first sampled token; ``decode_tps``: later tokens per second.
    """

    request_id: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    ttft: float
    decode_tps: float
    latency: float
    finish_reason: str


_ids = itertools.count()


class Request:
    """A prompt being served: its tokens, progress and timing.

    Its blocks live in the scheduler's :class:`~radixkv.cache.manager.KVCacheManager`
    under ``request_id``. ``namespace`` (a tenant, a LoRA adapter, a cache salt; any
    hashable) scopes its cache lookups: requests of different namespaces share nothing.
    """

    __slots__ = (
        "request_id", "params", "namespace", "prompt_len", "status", "finish_reason",
        "num_computed_tokens", "prefill_end", "cached_tokens", "num_prefill_tokens",
        "num_decode_tokens", "num_preemptions", "arrival_time", "first_token_time",
        "finish_time", "logprobs", "error", "_buf", "_len", "scheduled_time",
        "top_logprobs", "prompt_logprobs", "prompt_scoring", "sampler_state",
    )  # fmt: skip

    def __init__(
        self,
        prompt: TokenSeq,
        params: SamplingParams,
        arrival_time: float = 0.0,
        namespace: Hashable = None,
    ) -> None:
        try:
            tokens = as_token_array(prompt)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"prompt: {exc}") from None
        if tokens.size == 0:
            raise ValueError("prompt must hold at least one token")
        if (tokens < 0).any():
            raise ValueError(f"prompt token ids must be >= 0, got {int(tokens.min())}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        self.request_id = next(_ids)
        self.params = params
        self.namespace = check_namespace(namespace)
        self.prompt_len = int(tokens.size)
        # Room for a few outputs; append_token doubles it as needed, so a huge
        # max_new_tokens costs nothing until the tokens exist (and validation comes first).
        self._buf = np.empty(self.prompt_len + min(params.max_new_tokens, 16), dtype=TOKEN_DTYPE)
        self._buf[: self.prompt_len] = tokens
        self._len = self.prompt_len
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        # Tokens below prefill_end (set at each admission) run as prefill.
        self.prefill_end = 0
        self.cached_tokens = -1  # set at the first admission
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_preemptions = 0
        self.arrival_time = arrival_time
        self.scheduled_time: float | None = None
        """When the engine first scheduled it (``time.perf_counter``): its queue time ends."""
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.logprobs: list[float] = []
        """Log-probability of each output token under the model's distribution."""
        self.top_logprobs: list[list[tuple[int, float]]] = []
        """The likeliest ``(token, logprob)`` pairs at each output position, when
        ``params.top_logprobs`` asks for them (empty otherwise)."""
        self.prompt_logprobs: PromptLogprobs | None = None
        """The prompt's logprobs, once computed, when ``params.prompt_logprobs`` asks."""
        self.prompt_scoring: object | None = None
        """The engine's ``PromptScorer`` state for this request while its prompt is scored
        (``radixkv.engine.prompt_scores.PromptScoring``; opaque here)."""
        self.sampler_state: object | None = None
        """The sampler's tensors for this request (its logit bias, stop ids, prompt mask),
        built the first time it samples (``radixkv.engine.sampler``; opaque here)."""
        self.error: str | None = None
        """Why the request ended with ``FinishReason.ERROR``."""

    # ----------------------------------------------------------- tokens
    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """Prompt plus output so far, a read-only view (int32)."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[: self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        return self._buf[self.prompt_len : self._len].tolist()

    @property
    def num_output_tokens(self) -> int:
        return self._len - self.prompt_len

    @property
    def max_kv_tokens(self) -> int:
        """Tokens whose K/V the request may ever hold: all but its last output token."""
        return self.prompt_len + self.params.max_new_tokens - 1

    def append_token(self, token: int) -> None:
        """Add a sampled token; sets ``finish_reason`` when it ends the request."""
        if self.num_output_tokens >= self.params.max_new_tokens:
            raise RuntimeError(f"request {self.request_id} is already at max_new_tokens")
        if self._len == self._buf.size:
            cap = min(2 * self._buf.size, self.prompt_len + self.params.max_new_tokens)
            buf = np.empty(cap, dtype=TOKEN_DTYPE)
            buf[: self._len] = self._buf[: self._len]
            self._buf = buf
        self._buf[self._len] = token
        self._len += 1
        if self.params.is_stop(token):
            self.finish_reason = FinishReason.STOP
        elif self.num_output_tokens >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    # ----------------------------------------------------------- stats
    def stats(self) -> RequestStats:
        """Per-request statistics; valid once finished (earlier, unknown times are NaN)."""
        nan = float("nan")
        first = self.first_token_time
        end = self.finish_time
        ttft = first - self.arrival_time if first is not None else nan
        later = self.num_output_tokens - 1
        if first is not None and end is not None and later > 0 and end > first:
            tps = later / (end - first)
        else:
            tps = nan
        return RequestStats(
            request_id=self.request_id,
            prompt_tokens=self.prompt_len,
            output_tokens=self.num_output_tokens,
            cached_tokens=max(self.cached_tokens, 0),
            prefill_tokens=self.num_prefill_tokens,
            decode_tokens=self.num_decode_tokens,
            preemptions=self.num_preemptions,
            ttft=ttft,
            decode_tps=tps,
            latency=end - self.arrival_time if end is not None else nan,
            finish_reason=self.finish_reason.value if self.finish_reason else "",
        )

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"namespace={self.namespace!r})"
        )
