"""Request: one generation request's tokens, progress and timing, as the scheduler sees them.

Plain ints and numpy only: no tensor lives here. A request's token buffer is
``prompt + output``; ``num_computed_tokens`` of them have K/V in the pool (in the
blocks the :class:`~radixkv.engine.kv_manager.KVCacheManager` holds for it), and the
scheduler's job is to bring ``num_computed_tokens`` up to ``num_tokens`` (prefill
chunks, then one decode token per step).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from radixkv.cache.arrays import TOKEN_DTYPE, TokenSeq, as_token_array
from radixkv.cache.protocol import check_namespace

__all__ = ["FinishReason", "Request", "RequestStats", "RequestStatus", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    - ``max_new_tokens``: generation stops after this many tokens (>= 1).
    - ``temperature``: 0.0 is greedy (argmax; ties go to the lowest id), else
      softmax sampling at that temperature.
    - ``top_p``: nucleus sampling mass in ``(0, 1]``; ignored when greedy.
    - ``seed``: seeds the request's own generator, so sampled outputs do not
      depend on batching; an int in ``[-2**63, 2**64)`` (what
      ``torch.Generator.manual_seed`` takes). None: the engine derives one from
      its own seed and the request's arrival order in that engine.
    - ``stop_token_ids``: generation stops after emitting any of these (the
      stop token is kept in the output).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_real("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=SEED_MIN, high=SEED_MAX)
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {stops!r}")
        stops = tuple(stops)
        for t in stops:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        # looked up once per generated token: a set, whatever the list's length
        object.__setattr__(self, "_stop_set", frozenset(self.stop_token_ids))

    def is_stop(self, token: int) -> bool:
        """Whether ``token`` is one of ``stop_token_ids``. Complexity: O(1)."""
        return token in self._stop_set

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    """``ValueError`` naming ``name`` unless ``low <= value <= high``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def _check_real(name: str, value: object) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a finite real."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


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

    Its blocks live in the scheduler's :class:`~radixkv.engine.kv_manager.KVCacheManager`
    under ``request_id``. ``namespace`` (a tenant, a LoRA adapter, a cache salt; any
    hashable) scopes its cache lookups: requests of different namespaces share nothing.
    """

    __slots__ = (
        "request_id", "params", "namespace", "prompt_len", "status", "finish_reason",
        "num_computed_tokens", "prefill_end", "cached_tokens", "num_prefill_tokens",
        "num_decode_tokens", "num_preemptions", "arrival_time", "first_token_time",
        "finish_time", "admitted", "logprobs", "error", "_buf", "_len",
    )  # fmt: skip

    def __init__(
        self,
        prompt: TokenSeq,
        params: SamplingParams,
        arrival_time: float = 0.0,
        namespace: Hashable = None,
    ) -> None:
        tokens = as_token_array(prompt)
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
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.admitted = False
        self.logprobs: list[float] = []
        """Log-probability of each output token under the distribution it was picked from."""
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
