"""Engine: a continuous-batching generation loop over a paged decoder and a prefix cache.

``step()`` is three moves: the scheduler picks this step's tokens (plain ints),
the model runs them (block ids become tensors only here, in
:func:`build_forward_batch`), and the scheduler books the sampled tokens.

>>> from radixkv.model import ModelConfig, random_model
>>> cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
...                   num_heads=2, num_kv_heads=1, head_dim=16)
>>> engine = Engine(random_model(cfg), EngineConfig(num_blocks=32, block_size=4))
>>> [c] = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=3))
>>> len(c.output_ids)
3
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import TokenSeq
from radixkv.cache.null import NullCache
from radixkv.cache.protocol import PrefixCache
from radixkv.engine.kv_manager import CACHE_KINDS, KVCacheManager, make_cache
from radixkv.engine.request import Request, RequestStats, SamplingParams
from radixkv.engine.scheduler import (
    ADMISSION_POLICIES,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from radixkv.model.forward_batch import ForwardBatch
from radixkv.model.kvpool import KVPool

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "build_forward_batch",
]


@dataclass(frozen=True)
class EngineConfig:
    """Pool size, batching limits and the cache.

    - ``num_blocks``: KV pool blocks; None sizes the pool from ``kv_memory_bytes``.
    - ``cache``: ``"radix"`` (:class:`~radixkv.RadixCache`), ``"hash"``
      (:class:`~radixkv.HashBlockCache`) or None (no caching: a ``NullCache``).
    - ``eviction``: the radix cache's eviction order (``"level"`` or ``"lru"``).
    - ``kv_dtype`` / ``device``: of the pool; None takes the model's.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int = 256 << 20
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    policy: str = "fcfs"
    cache: str | None = "radix"
    eviction: str = "level"
    kv_dtype: torch.dtype | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_memory_bytes", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool)
            or not isinstance(self.num_blocks, int)
            or self.num_blocks < 1
        ):
            raise ValueError(f"num_blocks must be a positive int or None, got {self.num_blocks!r}")
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {CACHE_KINDS}, got {self.cache!r}")
        if self.policy not in ADMISSION_POLICIES:
            raise ValueError(f"policy must be one of {ADMISSION_POLICIES}, got {self.policy!r}")
        if self.kv_dtype is not None and not (
            isinstance(self.kv_dtype, torch.dtype) and self.kv_dtype.is_floating_point
        ):
            raise ValueError(f"kv_dtype must be a floating torch.dtype, got {self.kv_dtype!r}")


@dataclass(frozen=True)
class Completion:
    """One finished request: its tokens, the log-probability of each output token, its cost."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stats: RequestStats
    text: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """Aggregate over a set of finished requests (times in seconds).

    ``hit_rate`` is ``cached_tokens / prompt_tokens`` (tokens matched at first
    admission); ``throughput`` is output tokens per second of ``wall_time``.
    """

    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    decode_tokens: int
    output_tokens: int
    preemptions: int
    wall_time: float
    ttft_median: float
    ttft_p90: float
    decode_tps_median: float
    throughput: float
    hit_rate: float

    @classmethod
    def of(cls, stats: Sequence[RequestStats], wall_time: float) -> EngineStats:
        nan = float("nan")
        ttft = np.array([s.ttft for s in stats], dtype=np.float64)
        tps = np.array([s.decode_tps for s in stats if s.decode_tps == s.decode_tps])
        prompt = sum(s.prompt_tokens for s in stats)
        cached = sum(s.cached_tokens for s in stats)
        output = sum(s.output_tokens for s in stats)
        return cls(
            num_requests=len(stats),
            prompt_tokens=prompt,
            cached_tokens=cached,
            prefill_tokens=sum(s.prefill_tokens for s in stats),
            decode_tokens=sum(s.decode_tokens for s in stats),
            output_tokens=output,
            preemptions=sum(s.preemptions for s in stats),
            wall_time=wall_time,
            ttft_median=float(np.median(ttft)) if ttft.size else nan,
            ttft_p90=float(np.percentile(ttft, 90)) if ttft.size else nan,
            decode_tps_median=float(np.median(tps)) if tps.size else nan,
            throughput=output / wall_time if wall_time > 0 else nan,
            hit_rate=cached / prompt if prompt else 0.0,
        )


def build_forward_batch(
    out: SchedulerOutput,
    kv: KVCacheManager,
    device: torch.device,
    *,
    backend: str,
    group_size: int,
) -> ForwardBatch:
    """The batch the model runs for ``out``, on ``device`` (see :meth:`ForwardBatch.build`).

    Each sequence's block table is its request's in ``kv``, so cached positions
    (the matched blocks at the head of the table) are read from the cache's
    blocks; ``block_size``/``num_blocks`` are ``kv``'s (the pool's). ``backend``
    and ``group_size`` are the model's (``Decoder.backend_for``,
    ``ModelConfig.group_size``). Raises ``ValueError`` if ``out`` is inconsistent
    (a table too short, a block outside the pool). Reads ``kv``, never mutates it.
    Complexity: O(num_tokens + total context / block_size).
    """
    seqs = out.seqs
    return ForwardBatch.build(
        np.concatenate([s.request.tokens[s.start : s.stop] for s in seqs]),
        [s.num_new_tokens for s in seqs],
        [s.stop for s in seqs],
        [kv.block_table(s.request.request_id) for s in seqs],
        block_size=kv.block_size,
        num_blocks=kv.allocator.num_blocks,
        backend=backend,
        group_size=group_size,
        device=device,
    )


class Engine:
    """Generates from token-id prompts (or text, given a tokenizer) with continuous batching.

    ``model`` has the :class:`radixkv.model.Decoder` surface: ``forward(batch,
    kv) -> logits [num_seqs, vocab]`` and ``make_kv_pool(num_blocks,
    block_size, dtype, device)``. ``cache_factory`` (``allocator -> cache``)
    overrides ``config.cache`` with any object of the
    :class:`~radixkv.cache.protocol.PrefixCache` surface.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig | None = None,
        tokenizer: object | None = None,
        cache_factory: Callable[[BlockAllocator], PrefixCache | None] | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            mc = model.config
            kv_dtype = cfg.kv_dtype or model.dtype
            per_block = KVPool.block_bytes(
                mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, kv_dtype
            )
            num_blocks = cfg.kv_memory_bytes // per_block
            if num_blocks < 1:
                raise ValueError(f"kv_memory_bytes={cfg.kv_memory_bytes} is below one block")
        self.kv = model.make_kv_pool(
            num_blocks, cfg.block_size, dtype=cfg.kv_dtype, device=cfg.device
        )
        allocator = BlockAllocator(num_blocks, cfg.block_size)
        if cache_factory is not None:
            cache = cache_factory(allocator)
            cache = NullCache(allocator) if cache is None else cache
        else:
            cache = make_cache(cfg.cache, allocator, cfg.eviction)
        if cache.allocator is not allocator:
            raise ValueError("cache_factory must build the cache over the allocator it is given")
        self.kv_manager = KVCacheManager(cache)
        self.scheduler = Scheduler(
            self.kv_manager,
            SchedulerConfig(
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                policy=cfg.policy,
                # waiting for a running request's prefill only pays when its blocks get cached
                wait_for_shared_prefill=cfg.cache is not None or cache_factory is not None,
            ),
        )
        self.num_steps = 0
        self._generators: dict[int, torch.Generator] = {}
        self._logprobs: dict[int, list[float]] = {}

    @property
    def allocator(self) -> BlockAllocator:
        """The block pool's bookkeeping (the KV tensors are ``self.kv``)."""
        return self.kv_manager.allocator

    @property
    def cache(self) -> PrefixCache:
        """The prefix cache (a ``NullCache`` when caching is off)."""
        return self.kv_manager.cache

    # ------------------------------------------------------------- requests
    def add_request(self, prompt: TokenSeq, params: SamplingParams | None = None) -> Request:
        """Queue one token-id prompt; ``ValueError`` if it could never fit the pool."""
        req = Request(prompt, params or SamplingParams(), arrival_time=time.perf_counter())
        self.scheduler.add_request(req)
        self._logprobs[req.request_id] = []
        return req

    def step(self) -> list[Request]:
        """Schedule, run the model, postprocess; return the requests that finished."""
        out = self.scheduler.schedule()
        if not out:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests pending")
            return []
        batch = build_forward_batch(
            out,
            self.kv_manager,
            self.kv.device,
            backend=self.model.backend_for(self.kv.device),
            group_size=self.model.config.group_size,
        )
        logits = self.model.forward(batch, self.kv)
        next_tokens = self._sample(out, logits)
        self.num_steps += 1
        finished = self.scheduler.postprocess(out, next_tokens)
        for req in finished:
            self._generators.pop(req.request_id, None)
        return finished

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[int | None]:
        """One token per sequence that reached its last token (None for mid-prefill chunks)."""
        rows = [k for k, seq in enumerate(out.seqs) if seq.samples]
        tokens: list[int | None] = [None] * len(out.seqs)
        if not rows:
            return tokens
        sel = logits[rows].float()
        logp = torch.log_softmax(sel, dim=-1)
        picks = sel.argmax(dim=-1)  # ties go to the lowest id
        for j, k in enumerate(rows):
            req = out.seqs[k].request
            if not req.params.greedy:
                picks[j] = self._sample_one(req, sel[j])
        picked = picks.tolist()
        chosen = logp.gather(1, picks[:, None])[:, 0].tolist()
        for j, k in enumerate(rows):
            tokens[k] = picked[j]
            self._logprobs[out.seqs[k].request.request_id].append(chosen[j])
        return tokens

    def _sample_one(self, req: Request, row: torch.Tensor) -> int:
        """Temperature / top-p sampling from ``req``'s own generator (batch-independent)."""
        gen = self._generators.get(req.request_id)
        if gen is None:
            seed = req.params.seed if req.params.seed is not None else req.request_id
            gen = torch.Generator(device="cpu").manual_seed(seed)
            self._generators[req.request_id] = gen
        probs = torch.softmax(row.double().cpu() / req.params.temperature, dim=-1)
        if req.params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < req.params.top_p  # always keeps the top one
            probs = torch.zeros_like(probs).index_copy_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))

    # ------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[TokenSeq],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool | Any = False,
    ) -> list[Completion]:
        """Generate for every prompt; return completions in prompt order.

        Every prompt is checked (and ``ValueError`` raised) before any is
        queued. Requests queued earlier with ``add_request`` run alongside.
        ``progress``: True shows a tqdm bar of finished requests; an object
        with ``update(n)`` (a caller's tqdm bar) is advanced instead.
        """
        plist = self._params_list(params, len(prompts))
        reqs = [Request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        for req in reqs:
            self.scheduler.validate(req)
        now = time.perf_counter()
        for req in reqs:
            req.arrival_time = now
            self.scheduler.add_request(req)
            self._logprobs[req.request_id] = []
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
        return [self._completion(r) for r in reqs]

    def generate_text(
        self,
        prompts: Sequence[str],
        params: SamplingParams | None = None,
        progress: bool | Any = False,
    ) -> list[Completion]:
        """``generate`` for text prompts: encoded and decoded with ``self.tokenizer``."""
        if self.tokenizer is None:
            raise ValueError("generate_text needs an Engine built with a tokenizer")
        ids = [self.tokenizer.encode(p) for p in prompts]
        return self.generate(ids, params, progress=progress)

    def _completion(self, req: Request) -> Completion:
        out = req.output_ids
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return Completion(
            request_id=req.request_id,
            prompt_ids=req.prompt.tolist(),
            output_ids=out,
            logprobs=self._logprobs.pop(req.request_id, []),
            finish_reason=req.finish_reason.value if req.finish_reason else "",
            stats=req.stats(),
            text=text,
        )

    @staticmethod
    def _params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        plist = list(params)
        if len(plist) != n:
            raise ValueError(f"got {len(plist)} SamplingParams for {n} prompts")
        return plist

    # ------------------------------------------------------------ housekeeping
    def check(self) -> None:
        """Verify the scheduler's, the manager's (reference conservation), the cache's
        and the allocator's invariants; ``AssertionError`` naming the first broken."""
        self.scheduler.check()

    def reset_cache(self) -> None:
        """Drop everything the cache holds (running requests keep their blocks)."""
        self.kv_manager.reset_cache()


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", leave=False)
