"""Engine: a continuous-batching generation loop over a paged decoder and a prefix cache.

``step()`` is three moves: the scheduler picks this step's tokens (plain ints),
the model runner runs them (block ids become tensors only there, in
:func:`build_forward_batch` or a CUDA graph's static buffers:
:mod:`radixkv.engine.model_runner`), and the scheduler books the sampled tokens.

>>> from radixkv.model import ModelConfig, random_model
>>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
...                   num_heads=2, num_kv_heads=1, head_dim=16)
>>> engine = Engine(random_model(cfg), EngineConfig(num_blocks=32, block_size=4))
>>> [c] = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=3))
>>> len(c.output_ids)
3
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import TokenSeq
from radixkv.cache.eviction import EVICTION_ORDERS
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.host import WRITE_POLICIES, HostTier
from radixkv.cache.manager import CACHE_KINDS, KVCacheManager, make_cache
from radixkv.cache.null import NullCache
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.store.lru import MAX_CAPACITY_BYTES
from radixkv.cache.store.protocol import KVStore
from radixkv.cache.store.tier import STORE_WRITE_POLICIES, StoreTier
from radixkv.checks import check_bool, check_int
from radixkv.engine.kv_store import check_kv_store_spec, open_kv_store, store_tier
from radixkv.engine.model_runner import (
    EagerRunner,
    GraphRunner,
    build_forward_batch,
    make_model_runner,
)
from radixkv.engine.prompt_scores import (
    NO_BLOCK_SCORES,
    BlockScores,
    PromptScorer,
    ScoreStore,
    token_scores,
)
from radixkv.engine.request import (
    EngineLimits,
    FinishReason,
    PromptLogprobs,
    Request,
    RequestStats,
    SamplingParams,
    check_request,
)
from radixkv.engine.sampler import Sampler
from radixkv.engine.scheduler import (
    SCHEDULE_POLICIES,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from radixkv.engine.stats import TierStats
from radixkv.model.kv_copy import KVCopier
from radixkv.model.kvpool import KVPool

__all__ = [
    "DEFAULT_KV_STORE_BYTES",
    "MAX_PROMPT_LOGPROB_ELEMENTS",
    "Completion",
    "Engine",
    "EngineConfig",
    "TokenObserver",
    "build_forward_batch",
]

DEFAULT_KV_STORE_BYTES = 4 << 30
"""``EngineConfig.kv_store_capacity_bytes`` unless told: 4 GiB of entries."""

MAX_PROMPT_LOGPROB_ELEMENTS = 1 << 28
"""Most logits (prompt tokens x vocabulary) :meth:`Engine.score_prompt` computes: the prompt
runs once, whole, so all its logits exist at once (1 GiB in float32)."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Pool size, batching limits and the cache.

    - ``num_blocks``: KV pool blocks; None sizes the pool from ``kv_memory_bytes``.
    - ``max_model_len``: the most tokens a request may have, its prompt plus
      ``max_new_tokens`` (vLLM's ``--max-model-len``); None: all the pool holds
      (``num_blocks * block_size``). More than the pool holds is refused when the
      engine is built.
    - ``cache``: ``"radix"`` (:class:`~radixkv.RadixCache`), ``"hash"``
      (:class:`~radixkv.HashBlockCache`) or None (no caching: a ``NullCache``).
    - ``schedule_policy``: admission order (SGLang's ``--schedule-policy``),
      ``"fcfs"`` or ``"lpm"``; under lpm a request that has waited
      ``lpm_max_wait_steps`` steps goes ahead of the others.
    - ``eviction``: the radix cache's eviction order, a name in
      ``radixkv.cache.eviction.EVICTION_ORDERS`` (``"level"``, ``"lru"``, ``"lfu"``,
      ``"fifo"``, ``"priority"``, ``"lrfu"``, ``"deep"``, ``"ghost"``).
    - ``kv_dtype`` / ``device``: of the pool; None takes the model's.
    - ``seed``: requests sampled without a seed of their own draw theirs from
      this and their arrival order in the engine, so a fresh engine repeats
      its outputs whatever ran before in the process.
    - ``host_kv_blocks``: blocks of a host-memory tier (``radixkv.cache.host``;
      a CPU ``KVPool`` of the same layout); 0 (the default) for none, or with a
      ``kv_store`` as many as the device pool. Needs ``cache="radix"``.
      ``host_write_policy`` is its write policy (``"write_back"`` or
      ``"write_through"``, after ``host_write_through_hits`` hits); None (the
      default) is ``"write_back"`` after 2 hits, or with a ``kv_store``
      ``"write_through"`` after 0: every block the cache keeps is copied to the host
      (and so reaches the store) as it is cached (:meth:`host_write`).
    - ``kv_store``: a KV store below the host tier (docs/store.md), shared with a
      restart and with any other server that opens it: a directory
      (``LocalDiskStore``, made if missing) or ``"mooncake://HOST:PORT"`` (a
      ``MooncakeStore`` over that master); None (the default) for none. It holds at
      most ``kv_store_capacity_bytes`` of entries (a Mooncake client lends the pool
      as much memory). ``kv_store_write_policy``: ``"write_through"`` (the default)
      puts each block in the store when the host gets a copy; ``"write_back"`` only
      when host eviction drops it. A store that is down, slow, full or corrupt never
      fails a request: its blocks are recomputed (``Engine.tier_stats`` counts it).
      The store is opened when the engine is built: ``ValueError`` naming
      ``kv_store`` for a directory this process cannot write or a master that does
      not answer.
    - ``poison_freed_kv``: a debug mode: device blocks the cache frees are
      filled with NaN (``radixkv.model.kv_copy.KVCopier``), so a copy or read
      after a free shows up as a wrong output. Needs a host tier.
    - ``cuda_graphs``: on a CUDA pool with the ``triton`` attention backend,
      capture decode steps as CUDA graphs at start-up (batch sizes 1, 2, 4, 8,
      16, ... up to ``max_num_seqs``; ``radixkv.model.cuda_graphs``) and replay
      them; elsewhere, or False, every step runs eagerly. Decode steps whose
      longest context exceeds ``cuda_graph_max_context`` tokens run eagerly too
      (it fixes the graphs' block-table width).
    - ``prompt_score_cache``: keep, with each full prompt block a ``prompt_logprobs``
      request computes, its positions' scores (``radixkv.engine.prompt_scores``), so a
      later scoring request reads its cached prefix instead of recomputing it. False:
      a scoring request reads no cached prefix (vLLM's behaviour).

    Every field is checked at construction: ``TypeError``/``ValueError`` naming
    the field and the value.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int = 256 << 20
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    schedule_policy: str = "fcfs"
    lpm_max_wait_steps: int = 100
    cache: str | None = "radix"
    eviction: str = "level"
    kv_dtype: torch.dtype | None = None
    device: str | torch.device | None = None
    seed: int = 0
    host_kv_blocks: int = 0
    host_write_policy: str | None = None
    host_write_through_hits: int | None = None
    kv_store: str | None = None
    kv_store_capacity_bytes: int = DEFAULT_KV_STORE_BYTES
    kv_store_write_policy: str = "write_through"
    poison_freed_kv: bool = False
    cuda_graphs: bool = True
    cuda_graph_max_context: int = 4096
    prompt_score_cache: bool = True
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        ints = (
            ("block_size", 1),
            ("kv_memory_bytes", 1),
            ("max_num_batched_tokens", 1),
            ("max_num_seqs", 1),
            ("lpm_max_wait_steps", 1),
            ("cuda_graph_max_context", 1),
            ("seed", 0),
            ("host_kv_blocks", 0),
        )
        for name, low in ints:  # stored as plain ints (a numpy int passes the check)
            object.__setattr__(self, name, check_int(name, getattr(self, name), low=low))
        store_bytes = check_int(
            "kv_store_capacity_bytes", self.kv_store_capacity_bytes, low=1, high=MAX_CAPACITY_BYTES
        )
        object.__setattr__(self, "kv_store_capacity_bytes", store_bytes)
        num_blocks = check_int("num_blocks", self.num_blocks, low=1, optional=True)
        object.__setattr__(self, "num_blocks", num_blocks)
        max_model_len = check_int("max_model_len", self.max_model_len, low=1, optional=True)
        object.__setattr__(self, "max_model_len", max_model_len)
        hits = check_int("host_write_through_hits", self.host_write_through_hits, low=0,
                         optional=True)  # fmt: skip
        object.__setattr__(self, "host_write_through_hits", hits)
        for name in ("poison_freed_kv", "cuda_graphs", "prompt_score_cache"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {CACHE_KINDS}, got {self.cache!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.kv_dtype is not None and not (
            isinstance(self.kv_dtype, torch.dtype) and self.kv_dtype.is_floating_point
        ):
            raise ValueError(f"kv_dtype must be a floating torch.dtype, got {self.kv_dtype!r}")
        if self.eviction not in EVICTION_ORDERS:
            names = ", ".join(repr(n) for n in EVICTION_ORDERS)
            raise ValueError(f"eviction must be one of {names}, got {self.eviction!r}")
        if self.device is not None:
            _check_device(self.device)
        if self.kv_store is not None:
            check_kv_store_spec(self.kv_store)
        for name in ("host_kv_blocks", "kv_store"):
            if getattr(self, name) and self.cache != "radix":
                raise ValueError(
                    f"{name} needs cache='radix', got cache={self.cache!r} "
                    f"with {name}={getattr(self, name)!r}"
                )
        if self.host_write_policy is not None and self.host_write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"host_write_policy must be one of {WRITE_POLICIES} or None, got "
                f"{self.host_write_policy!r}"
            )
        if self.kv_store_write_policy not in STORE_WRITE_POLICIES:
            raise ValueError(
                f"kv_store_write_policy must be one of {STORE_WRITE_POLICIES}, got "
                f"{self.kv_store_write_policy!r}"
            )
        if self.poison_freed_kv and not (self.host_kv_blocks or self.kv_store):
            raise ValueError("poison_freed_kv needs a host tier (host_kv_blocks > 0 or a kv_store)")

    def host_write(self) -> tuple[str, int]:
        """The host tier's write policy and its hits: ``host_write_policy`` and
        ``host_write_through_hits`` where set, else ``("write_through", 0)`` with a
        ``kv_store`` (each cached block reaches the store as it is cached, so a restart or
        another server finds it) and ``("write_back", 2)`` without one."""
        store = self.kv_store is not None
        policy = self.host_write_policy or ("write_through" if store else "write_back")
        hits = self.host_write_through_hits
        return policy, (0 if store else 2) if hits is None else hits

    def host_blocks(self, model: torch.nn.Module) -> int:
        """The blocks of the host tier an engine over ``model`` gets: ``host_kv_blocks``,
        or with a ``kv_store`` and none asked for, the device pool's (:meth:`pool_blocks`);
        0 for none. Allocates nothing."""
        if self.host_kv_blocks or self.kv_store is None:
            return self.host_kv_blocks
        return self.pool_blocks(model)

    def pool_blocks(self, model: torch.nn.Module) -> int:
        """The blocks of the KV pool an engine over ``model`` gets: ``num_blocks``, else as
        many as ``kv_memory_bytes`` holds in ``model``'s layout (``ValueError`` if not one).
        Allocates nothing."""
        if self.num_blocks is not None:
            return self.num_blocks
        mc = model.config
        per_block = KVPool.block_bytes(
            mc.num_layers, self.block_size, mc.num_kv_heads, mc.head_dim,
            self.kv_dtype or model.dtype,
        )  # fmt: skip
        num_blocks = self.kv_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_memory_bytes={self.kv_memory_bytes} is below one block")
        return num_blocks


def _check_device(device: object) -> None:
    """``ValueError`` naming ``device`` unless torch parses it and its backend is present."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a str or torch.device, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"device must name a torch device, got {device!r} ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {device!r} but CUDA is not available here")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device is {device!r} but MPS is not available here")


@dataclass(frozen=True)
class Completion:
    """One finished request: its tokens, the log-probability of each output token, its cost.

    ``finish_reason`` is ``"length"``, ``"stop"``, ``"abort"`` or ``"error"``
    (then ``error`` says what failed).
    """

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stats: RequestStats
    text: str | None = None
    error: str | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None


class TokenObserver(Protocol):
    """Told, on the engine's thread, about the requests that got a token in a step."""

    def on_tokens(self, reqs: Sequence[Request], now: float) -> None:
        """``reqs`` each appended one token (and its logprobs) in the step that ended at
        ``now`` (``time.perf_counter``); finished ones included. Must not mutate them."""


class _NoObserver:
    def on_tokens(self, reqs: Sequence[Request], now: float) -> None:
        pass


class Engine:
    """Generates from token-id prompts (or text, given a tokenizer) with continuous batching.

    ``model`` has the :class:`radixkv.model.Decoder` surface: ``forward(batch,
    kv_pool) -> logits [num_seqs, vocab]`` and ``make_kv_pool(num_blocks,
    block_size, dtype, device)``. The pool's tensors are ``kv_pool`` (a host tier's,
    ``host_kv_pool``); every block a request holds is in ``kv_manager``, over
    ``cache`` and ``allocator``. ``cache_factory`` (``allocator -> cache``)
    overrides ``config.cache`` with any object of the
    :class:`~radixkv.cache.prefix_cache.PrefixCache` surface (``ValueError`` with a
    host tier in ``config``, which only the built-in radix cache has). ``events``
    (a ``ChainHasher``) turns the radix cache's KV events on
    (``engine.cache.take_events()``); ``ValueError`` for another cache.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig | None = None,
        tokenizer: object | None = None,
        cache_factory: Callable[[BlockAllocator], PrefixCache | None] | None = None,
        *,
        events: ChainHasher | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        if cache_factory is not None and (cfg.host_kv_blocks or cfg.kv_store or events is not None):
            raise ValueError(
                "cache_factory builds its own cache: pass host_kv_blocks=0, kv_store=None and "
                "events=None (or build the host tier, store and events into the factory's cache)"
            )
        self.model = model
        self.tokenizer = tokenizer
        num_blocks = cfg.pool_blocks(model)
        pool_tokens = num_blocks * cfg.block_size
        if cfg.max_model_len is not None and cfg.max_model_len > pool_tokens:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} is more than the {pool_tokens} tokens "
                f"the KV pool holds ({num_blocks} blocks of {cfg.block_size})"
            )
        self.max_model_len: int = cfg.max_model_len or pool_tokens
        """The most tokens a request may have, its prompt plus ``max_new_tokens``: at most
        what the pool holds (see :class:`EngineConfig`)."""
        pool = f"the whole pool has {num_blocks} blocks of {cfg.block_size}"
        self.limits = EngineLimits(
            model.config.vocab_size,
            self.max_model_len,
            pool if cfg.max_model_len is None else f"the engine's max_model_len; {pool}",
        )
        """What :meth:`make_request` checks a request against (``check_request``): the
        vocabulary and :attr:`max_model_len`; a front end checks with the same."""
        # Opened before any pool is allocated: a store that cannot open costs nothing else.
        self.kv_store: KVStore | None = None
        """The KV store below the host tier (``config.kv_store``), None without one."""
        if cfg.kv_store is not None:
            self.kv_store = open_kv_store(cfg.kv_store, cfg.kv_store_capacity_bytes)
        self.kv_pool: KVPool = model.make_kv_pool(
            num_blocks, cfg.block_size, dtype=cfg.kv_dtype, device=cfg.device
        )
        allocator = BlockAllocator(num_blocks, cfg.block_size)
        self.host_kv_pool: KVPool | None = None
        self.store_tier: StoreTier | None = None
        """The cache's side of ``kv_store`` (its keys, write policy and stats), None without one."""
        if cache_factory is not None:
            cache = cache_factory(allocator)
            cache = NullCache(allocator) if cache is None else cache
        else:
            cache = make_cache(cfg.cache, allocator, cfg.eviction, self._host_tier(), events)
        if cache.allocator is not allocator:
            raise ValueError("cache_factory must build the cache over the allocator it is given")
        self.kv_manager = KVCacheManager(cache)
        self.scorer = PromptScorer(model, cfg.block_size, self._score_store(num_blocks))
        """Scores prompts for ``prompt_logprobs`` in the prefill (the scheduler's
        ``prefix_reader``: a scoring request reads only the cached blocks it has scores of)."""
        self.scheduler = Scheduler(
            self.kv_manager,
            SchedulerConfig(
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                schedule_policy=cfg.schedule_policy,
                lpm_max_wait_steps=cfg.lpm_max_wait_steps,
                # waiting for a running request's prefill only pays when its blocks get cached
                wait_for_shared_prefill=cfg.cache is not None or cache_factory is not None,
            ),
            prefix_reader=self.scorer,
        )
        self.runner: EagerRunner | GraphRunner = make_model_runner(
            model,
            self.kv_pool,
            cuda_graphs=cfg.cuda_graphs,
            max_num_seqs=cfg.max_num_seqs,
            max_context_len=cfg.cuda_graph_max_context,
        )
        self.num_steps = 0
        self.num_failed_steps = 0
        self.sampler = Sampler()
        self.observer: TokenObserver = _NoObserver()
        """Told about each step's new tokens (a server's output stream); set it before
        serving, never while a step runs."""
        self._num_added = 0  # requests added so far: the default seed's counter
        self._generators: dict[int, torch.Generator] = {}  # sampled requests, until they end

    def _score_store(self, num_blocks: int) -> ScoreStore:
        """Where prompt blocks' scores are kept: one record a pool block, or nowhere."""
        if not self.config.prompt_score_cache or isinstance(self.kv_manager.cache, NullCache):
            return NO_BLOCK_SCORES
        return BlockScores(
            num_blocks,
            self.config.block_size,
            self.model.config.hidden_size,
            self.kv_pool.device,
            self.model.dtype,
        )

    def _host_tier(self) -> HostTier | None:
        """The host tier ``config`` asks for (its pool in ``self.host_kv_pool``) with the store
        below it (``self.store_tier``), or None."""
        cfg = self.config
        num_blocks = cfg.host_blocks(self.model)
        if not num_blocks:
            return None
        self.host_kv_pool = host = self.model.make_kv_pool(
            num_blocks, cfg.block_size, dtype=self.kv_pool.dtype, device="cpu"
        )
        if self.kv_store is not None:  # the model's digest: ~1 s a 135M-parameter model
            self.store_tier = store_tier(self.model, host, self.kv_store, cfg.kv_store_write_policy)
        policy, hits = cfg.host_write()
        return HostTier(
            BlockAllocator(num_blocks, cfg.block_size),
            KVCopier(self.kv_pool, host, poison=cfg.poison_freed_kv),
            policy,
            hits,
            store=self.store_tier,
        )

    def tier_stats(self) -> TierStats:
        """Where the cache's hits came from and what moved between the tiers (the store's
        included), since start."""
        bytes_per_block = self.kv_pool.bytes_per_block
        tier, store = self.store_tier, self.kv_store
        return TierStats.of(
            self.cache.stats,
            self.config.block_size,
            bytes_per_block,
            None if tier is None else tier.stats,
            None if store is None else store.stats,
        )

    @property
    def kv(self) -> KVPool:
        """``kv_pool`` under its name before issue 23 (kept for one release)."""
        return self.kv_pool

    @property
    def host_kv(self) -> KVPool | None:
        """``host_kv_pool`` under its name before issue 23 (kept for one release)."""
        return self.host_kv_pool

    @property
    def allocator(self) -> BlockAllocator:
        """The block pool's bookkeeping (the KV tensors are ``self.kv_pool``)."""
        return self.kv_manager.allocator

    @property
    def cache(self) -> PrefixCache:
        """The prefix cache (a ``NullCache`` when caching is off)."""
        return self.kv_manager.cache

    # ------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: TokenSeq,
        params: SamplingParams | None = None,
        namespace: Hashable = None,
    ) -> int:
        """Queue one token-id prompt; return its request id.

        ``namespace`` (a tenant, a LoRA adapter name, a cache salt; any
        hashable) scopes its prefix cache: requests of different namespaces
        share no blocks. ``TypeError``/``ValueError`` before anything is queued
        if the prompt or the params are malformed, a token or stop id is outside
        the model's vocabulary, or its prompt plus ``max_new_tokens`` is more than
        :attr:`max_model_len` (at most what the pool holds).
        Read the request's progress with :meth:`get`; it comes back from
        :meth:`step` once finished. ``make_request`` then ``enqueue``.
        """
        req = self.make_request(prompt, params, namespace)
        self.enqueue([req])
        return req.request_id

    def get(self, request_id: int) -> Request | None:
        """The waiting or running request with this id; None once it finished (or if unknown)."""
        return self.scheduler.get(request_id)

    def abort_request(self, request_id: int) -> Request | None:
        """Stop a waiting or running request now and return it (None if unknown or finished).

        Its blocks go back to the pool; the full blocks it computed are offered
        to the cache first, so later requests still reuse them. It ends with
        ``finish_reason`` ``"abort"`` and the outputs it had; it is not returned
        by a later :meth:`step`. Complexity: O(queue length) plus the free.
        """
        req = self.scheduler.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, FinishReason.ABORT)
        self._generators.pop(request_id, None)
        return req

    def make_request(
        self, prompt: TokenSeq, params: SamplingParams | None = None, namespace: Hashable = None
    ) -> Request:
        """A new request for ``prompt``, checked against the model, the pool and the cache;
        nothing is queued or allocated. The one check of a request every front end makes
        (:meth:`add_request`, :meth:`generate`, ``AsyncEngine.generate``): its errors name
        the field.

        ``TypeError`` / ``ValueError`` if ``params`` is not ``SamplingParams`` (None: the
        defaults), the prompt is not a non-empty sequence of token ids (``prompt: ...``) or
        the cache refuses ``namespace`` (``PrefixCache.check_namespace``);
        ``RequestError`` from :func:`~radixkv.engine.request.check_request` over
        :attr:`limits` if a token id is outside the vocabulary (``prompt`` /
        ``stop_token_ids`` / ``logit_bias``), and ``ContextLengthError`` if the prompt or
        ``max_new_tokens`` leaves the request over :attr:`max_model_len`.
        Reads only what is fixed once the engine is built (vocabulary, pool, the cache's
        hasher), so any thread may call it while another steps the engine.
        Complexity: O(len(prompt) + len(params.stop_token_ids)).
        """
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams or None, got {params!r}")
        req = Request(prompt, params, namespace=namespace)
        # max_model_len is at most the pool: a request within it fits the scheduler's pool
        check_request(req.prompt, params, self.limits)
        self.cache.check_namespace(req.namespace)
        return req

    def enqueue(self, requests: Sequence[Request]) -> None:
        """Queue requests from :meth:`make_request` (not checked again), arriving now; a
        sampled one gets its own random generator. ``ValueError`` from the scheduler if one
        was queued before. Complexity: O(len(requests))."""
        now = time.perf_counter()
        for req in requests:
            req.arrival_time = now
            if not req.params.greedy:
                seed = req.params.seed
                if seed is None:
                    seed = _derived_seed(self.config.seed, self._num_added)
                gen = torch.Generator(device="cpu")
                gen.manual_seed(seed)
                self._generators[req.request_id] = gen
            self._num_added += 1
            self.scheduler.add_request(req)

    def step(self) -> list[Request]:
        """Schedule, run the model, postprocess; return the requests that finished.

        Each returned request carries its outputs (``output_ids``, ``logprobs``,
        ``finish_reason``; :meth:`completion` packs them) and the engine keeps
        nothing of it. If running the step fails (the model raises, say), the
        step's requests finish with ``finish_reason`` ``"error"`` and
        ``Request.error`` set, their blocks go back, the failure is logged, and
        they are returned: the engine keeps serving the others.
        """
        out = self.scheduler.schedule()
        if not out:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        try:
            self._start_requests(out, time.perf_counter())
            if self.scorer.scores(out):
                logits = self.scorer.score(out, self.runner.hidden(out, self.kv_manager))
            else:
                logits = self.runner.forward(out, self.kv_manager)
            reqs = [s.request if s.samples else None for s in out.seqs]
            next_tokens = self.sampler.sample(logits, reqs, self._generators)
            finished = self.scheduler.postprocess(out, next_tokens)
            now = time.perf_counter()
            self.observer.on_tokens([r for r in reqs if r is not None], now)
        except Exception as exc:  # noqa: BLE001 - one bad step must not wedge the engine
            finished = self._fail(out, exc)
        self.num_steps += 1
        for req in finished:
            self._generators.pop(req.request_id, None)
        return finished

    def _start_requests(self, out: SchedulerOutput, now: float) -> None:
        """For requests scheduled for the first time: note when."""
        for seq in out.seqs:
            req = seq.request
            if req.scheduled_time is None:
                req.scheduled_time = now

    @torch.no_grad()
    def score_prompt(self, prompt: TokenSeq, top: int = 0) -> PromptLogprobs:
        """The model's logprob and rank of each token of ``prompt`` after the first, and the
        ``top`` likeliest tokens at each position: one dense forward of the whole prompt
        (``model.forward_dense``), no cache read or written: the reference that requests'
        ``prompt_logprobs`` (scored in the paged prefill) are tested against.
        ``ValueError`` if its logits would exceed :data:`MAX_PROMPT_LOGPROB_ELEMENTS`.
        Complexity: one forward of ``len(prompt)`` tokens (attention quadratic in it),
        O(len x vocab) after."""
        ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64))
        vocab = self.model.config.vocab_size
        check_prompt_logprobs(len(ids), vocab)
        if len(ids) < 2:
            return PromptLogprobs([], [], [])
        logits = self.model.forward_dense(ids)[:-1]
        lps, ranks, top_ids, top_lps = token_scores(logits, ids[1:].numpy(), top)
        tops = [
            list(zip(i, v, strict=True))
            for i, v in zip(top_ids.tolist(), top_lps.tolist(), strict=True)
        ]
        return PromptLogprobs(lps.tolist(), ranks.tolist(), tops)

    def _fail(self, out: SchedulerOutput, exc: Exception) -> list[Request]:
        """Finish every request of a failed step with an error; return the step's finished."""
        self.num_failed_steps += 1
        reqs = list({id(s.request): s.request for s in out.seqs}.values())
        log.error(
            "step %d failed; finishing its %d requests (%s) with an error",
            self.num_steps,
            len(reqs),
            ", ".join(str(r.request_id) for r in reqs),
            exc_info=exc,
        )
        message = f"{type(exc).__name__}: {exc}"
        for req in reqs:
            if self.scheduler.get(req.request_id) is req:
                self.scheduler.finish(req, FinishReason.ERROR, error=message)
        # Requests that postprocess finished normally before the failure count as finished too.
        return [r for r in reqs if r.finish_reason is not None]

    # ------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[TokenSeq],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool | Any = False,
        namespace: Hashable | list[Hashable] = None,
    ) -> list[Completion]:
        """Generate for every prompt; return completions in prompt order.

        ``params``: one ``SamplingParams`` for all prompts, or a list/tuple of
        one per prompt. ``namespace``: one hashable for all prompts, or a
        ``list`` of one per prompt (see :meth:`add_request`). Every prompt is
        checked (``TypeError``/``ValueError``) before any is queued. Requests
        queued earlier with ``add_request`` run alongside (and are dropped
        from what this returns). ``progress``: True shows a tqdm bar of finished
        requests; an object with ``update(n)`` (a caller's tqdm bar) is
        advanced instead.
        """
        n = len(prompts)
        plist = self._params_list(params, n)
        if isinstance(namespace, list):
            if len(namespace) != n:
                raise ValueError(f"got {len(namespace)} namespaces for {n} prompts")
            nlist = namespace
        else:
            nlist = [namespace] * n
        reqs = [
            self.make_request(p, sp, ns) for p, sp, ns in zip(prompts, plist, nlist, strict=True)
        ]
        self.enqueue(reqs)
        own_bar = progress is True
        bar = _progress(len(reqs)) if own_bar else (progress or None)
        pending = {r.request_id for r in reqs}
        while pending:
            for req in self.step():
                if req.request_id in pending:
                    pending.discard(req.request_id)
                    if bar is not None:
                        bar.update(1)
        if own_bar:
            bar.close()
        return [self.completion(r) for r in reqs]

    def generate_text(
        self,
        prompts: Sequence[str],
        params: SamplingParams | None = None,
        progress: bool | Any = False,
        namespace: Hashable | list[Hashable] = None,
    ) -> list[Completion]:
        """``generate`` for text prompts: encoded and decoded with ``self.tokenizer``."""
        if self.tokenizer is None:
            raise ValueError("generate_text needs an Engine built with a tokenizer")
        ids = [self.tokenizer.encode(p) for p in prompts]
        return self.generate(ids, params, progress=progress, namespace=namespace)

    def completion(self, req: Request) -> Completion:
        """``req``'s outputs, logprobs, finish reason and stats (text too, given a tokenizer)."""
        out = req.output_ids
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return Completion(
            request_id=req.request_id,
            prompt_ids=req.prompt.tolist(),
            output_ids=out,
            logprobs=list(req.logprobs),
            finish_reason=req.finish_reason.value if req.finish_reason else "",
            stats=req.stats(),
            text=text,
            error=req.error,
            top_logprobs=list(req.top_logprobs),
            prompt_logprobs=req.prompt_logprobs,
        )

    @staticmethod
    def _params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        if not isinstance(params, (list, tuple)):
            raise TypeError(
                f"params must be SamplingParams, a list of them or None, got {params!r}"
            )
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        for k, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"params[{k}] must be SamplingParams, got {sp!r}")
        return list(params)

    # ------------------------------------------------------------ housekeeping
    def check(self) -> None:
        """Verify the scheduler's, the manager's (reference conservation), the cache's
        and the allocator's invariants; ``InvariantError`` naming the first broken."""
        self.scheduler.check()

    def reset_cache(self) -> None:
        """Drop everything the cache holds (running requests keep their blocks)."""
        self.kv_manager.reset_cache()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache if no request is running or waiting, as vLLM's and SGLang's
        operator resets do; True once it is empty, False (nothing changed) while any
        request is unfinished: its blocks could not be freed, and it would put its prompt
        back into the cache when it ends. With KV events on, a reset records one
        ``AllBlocksCleared``. Complexity: O(cached blocks)."""
        if self.scheduler.has_unfinished():
            return False
        self.reset_cache()
        return True


def check_prompt_logprobs(prompt_len: int, vocab_size: int) -> None:
    """``ValueError`` if a prompt of ``prompt_len`` tokens has more logits than
    :data:`MAX_PROMPT_LOGPROB_ELEMENTS` (what :meth:`Engine.score_prompt` scores at once)."""
    if prompt_len * vocab_size > MAX_PROMPT_LOGPROB_ELEMENTS:
        most = MAX_PROMPT_LOGPROB_ELEMENTS // vocab_size
        raise ValueError(
            f"score_prompt needs the logits of the whole prompt at once: a prompt of "
            f"{prompt_len} tokens is over the {most} this engine scores (vocab_size "
            f"{vocab_size})"
        )


def _derived_seed(engine_seed: int, ordinal: int) -> int:
    """The seed of the ``ordinal``-th request added to an engine seeded ``engine_seed``."""
    return int(np.random.SeedSequence([engine_seed, ordinal]).generate_state(1, np.uint64)[0])


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", leave=False)
