"""``GET /metrics``: the engine's gauges and counters and the requests' histograms, in
Prometheus text (exposition format 0.0.4), written by ``prometheus_client``.

Every sample is labelled ``model_name``; in a fleet the engine's gauges and counters are
also labelled ``replica`` (one sample per replica: sum over it for the fleet), while the
requests' histograms and ``request_success`` are the ingress's, which sees every request
whichever replica runs it. Names are vLLM's under a prefix, ``radixkv:`` by default;
``prefix="vllm"`` (``radixkv serve --metrics-prefix vllm``, ``FleetIngress(...,
metrics_prefix="vllm")``) emits vLLM's own names, so dashboards and alerts built for
vLLM read a radixkv server unchanged. ``prefix="sglang"`` emits SGLang's names for the
series SGLang also defines (:data:`ENGINE_NAMES`, the one table of renamings), so
SGLang's dashboard reads it. With prefix ``p`` (vLLM's names):

==========================================  =========  =====================================
name                                        type       meaning
==========================================  =========  =====================================
``p:num_requests_running``                  gauge      requests in the running batch
``p:num_requests_waiting``                  gauge      requests queued for admission
``p:kv_cache_usage_perc``                   gauge      fraction of KV blocks requests hold
``p:cache_hit_rate``                        gauge      prefix cache hits / queries (SGLang's)
``p:gen_throughput``                        gauge      tokens generated a second since the
                                                       previous scrape (SGLang's)
``p:prefix_cache_queries_total``            counter    prompt tokens looked up in the cache
``p:prefix_cache_hits_total``               counter    prompt tokens found there
``p:num_preemptions_total``                 counter    requests preempted
``p:request_finished_total``                counter    requests that ended (radixkv's own)
``p:prompt_tokens_total``                   counter    prompt tokens of requests that ran
``p:generation_tokens_total``               counter    tokens generated
``p:failed_steps_total``                    counter    engine steps that failed (radixkv's)
``p:request_success_total``                 counter    choices ended, by ``finished_reason``
``p:time_to_first_token_seconds``           histogram  request received to first token
``p:inter_token_latency_seconds``           histogram  between a choice's tokens (engine)
``p:time_per_output_token_seconds``         histogram  the same, vLLM's older name
``p:request_time_per_output_token_seconds`` histogram  a choice's decode time per token
``p:e2e_request_latency_seconds``           histogram  request received to choice ended
``p:request_queue_time_seconds``            histogram  queued to first scheduled (engine)
``p:request_inference_time_seconds``        histogram  first scheduled to last token
``p:request_prefill_time_seconds``          histogram  first scheduled to first token
``p:request_decode_time_seconds``           histogram  first token to last token
``p:request_prompt_tokens``                 histogram  prompt tokens per choice
``p:request_generation_tokens``             histogram  tokens generated per choice
``p:request_max_num_generation_tokens``     histogram  a prompt's longest of its ``n`` outputs
``p:request_params_n``                      histogram  ``n`` per request
``p:request_params_max_tokens``             histogram  ``max_tokens`` per request
``p:host_cache_*``                          counters   the host tier, where one exists
``p:kv_store_*``                            counters   the KV store below the host tier,
                                                       where one exists (and two gauges)
==========================================  =========  =====================================

The gauges and counters come from the engine thread's snapshot
(:class:`~radixkv.serve.openai.client.EngineMetrics`; in a fleet, every answering replica's)
and the host tier's and the KV store's :class:`~radixkv.engine.stats.TierStats` at
scrape time (in a fleet, every answering replica's with a host tier, labelled ``replica``:
every replica of a fleet over one store counts its own loads and writes, and the two
gauges are what each replica's store knows of, so their sum over replicas overcounts a
shared store's entries); the
histograms and ``request_success`` are recorded by the request handlers
(:class:`~radixkv.serve.openai.handlers.OpenAIHandlers`, the one code path of the single
server and the fleet's ingress) as each choice ends (:class:`RequestMetrics`), with the
finish reason the client saw (a stop string is ``stop``). Times from the engine (queue,
prefill, decode, between tokens) are differences of its ``time.perf_counter`` stamps (a
replica's own clock in a fleet); time to first token and end to end are measured from
when the server (the ingress) received the request, as vLLM measures them. A fleet with
several ingress replicas has a registry in each, and a scrape through Serve's proxy
reaches one of them: its requests only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixkv.serve.openai.client import EngineMetrics

if TYPE_CHECKING:
    from radixkv.engine.stats import TierStats
    from radixkv.serve.openai.choices import Choice

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_PREFIX",
    "ENGINE_NAMES",
    "METRICS",
    "NO_REQUEST_METRICS",
    "FINISH_REASONS",
    "RequestMetrics",
    "ServerMetrics",
    "check_prefix",
    "metric_name",
    "render_fleet_metrics",
    "render_metrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_PREFIX = "radixkv"
FINISH_REASONS = ("stop", "length", "abort", "error")

# (name, type, EngineMetrics field, help)
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "gauge", "running", "Requests in the running batch."),
    ("num_requests_waiting", "gauge", "waiting", "Requests waiting to be admitted."),
    (
        "kv_cache_usage_perc",
        "gauge",
        "kv_usage",
        "Fraction of KV cache blocks held by requests (1 = full).",
    ),
    (
        "prefix_cache_queries",
        "counter",
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    ("prefix_cache_hits", "counter", "prefix_cache_hits", "Prompt tokens found in the cache."),
    ("num_preemptions", "counter", "preemptions", "Requests preempted."),
    (
        "request_finished",
        "counter",
        "requests_finished",
        "Requests that ended (any finish reason).",
    ),
    ("prompt_tokens", "counter", "prompt_tokens", "Prompt tokens of requests that ran."),
    ("generation_tokens", "counter", "generation_tokens", "Tokens generated."),
    ("failed_steps", "counter", "failed_steps", "Engine steps that failed."),
)

# Another engine's names for the series it also defines, by the prefix that selects them:
# each key is a series' name here (vLLM's, counters without ``_total``), each value that
# engine's. SGLang's are its SchedulerMetricsCollector's and TokenizerMetricsCollector's
# (python/sglang/srt/metrics/collector.py); the rest it names as vLLM does, or not at all.
ENGINE_NAMES: dict[str, dict[str, str]] = {
    "sglang": {
        "num_requests_running": "num_running_reqs",
        "num_requests_waiting": "num_queue_reqs",
        "kv_cache_usage_perc": "token_usage",
        "prefix_cache_hits": "cached_tokens",
        "request_finished": "num_requests",
        "request_queue_time_seconds": "queue_time_seconds",
        "request_prompt_tokens": "prompt_tokens_histogram",
        "request_generation_tokens": "generation_tokens_histogram",
    },
}


def metric_name(prefix: str, series: str) -> str:
    """The full name of ``series`` (its name in :data:`METRICS` or the module table) under
    ``prefix``: the engine's own name where :data:`ENGINE_NAMES` has one for ``prefix``."""
    return f"{prefix}:{ENGINE_NAMES.get(prefix, {}).get(series, series)}"


# (name, TierStats field, help): the host tier's counters
TIER_METRICS: tuple[tuple[str, str, str], ...] = (
    ("host_cache_hit_tokens", "host_hit_tokens", "Prompt tokens found in the host tier."),
    ("host_cache_loaded_tokens", "loaded_tokens", "Tokens loaded from host to device."),
    ("host_cache_loaded_bytes", "loaded_bytes", "Bytes loaded from host to device."),
    ("host_cache_backed_up_blocks", "backed_up_blocks", "Blocks copied device to host."),
    ("host_cache_backed_up_bytes", "backed_up_bytes", "Bytes copied device to host."),
    (
        "host_cache_skipped_backup_blocks",
        "skipped_backup_blocks",
        "Blocks that left the device with no host copy (no host space).",
    ),
)

# (name, TierStats field, help): the KV store's counters, then its gauges
STORE_METRICS: tuple[tuple[str, str, str], ...] = (
    (
        "kv_store_loaded_blocks",
        "store_loaded_blocks",
        "Blocks loaded from the KV store into the host tier (they then reach the device).",
    ),
    ("kv_store_loaded_bytes", "store_loaded_bytes", "Bytes loaded from the KV store."),
    ("kv_store_load_seconds", "store_load_seconds", "Seconds spent loading from the KV store."),
    (
        "kv_store_load_misses",
        "store_load_misses",
        "Loads cut short by a block the KV store no longer gave (recomputed).",
    ),
    ("kv_store_stored_blocks", "store_stored_blocks", "Blocks written to the KV store."),
    ("kv_store_stored_bytes", "store_stored_bytes", "Bytes written to the KV store."),
    ("kv_store_store_seconds", "store_store_seconds", "Seconds spent writing to the KV store."),
    (
        "kv_store_corrupt_blocks",
        "store_corrupt_blocks",
        "KV store entries refused as unsound (checksum or size; recomputed, never served).",
    ),
    (
        "kv_store_errors",
        "store_errors",
        "KV store calls that failed (answered as misses or skipped writes).",
    ),
)
STORE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("kv_store_used_bytes", "store_used_bytes", "Bytes of entries the KV store holds."),
    ("kv_store_entries", "store_entries", "Entries the KV store holds."),
)

# vLLM's buckets
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can start a Prometheus metric name (letters, digits, ``_``; not a
    digit first), else ``ValueError`` naming it."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"metrics prefix must be letters, digits and '_' (not a digit first), got {prefix!r}"
        )
    return prefix


def tokens_buckets(max_len: int) -> list[float]:
    """vLLM's 1-2-5 buckets up to ``max_len``: 1, 2, 5, 10, 20, 50, ..."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return out
            out.append(float(m * scale))
        scale *= 10


class _NoRequestMetrics:
    """Records nothing (handlers built without a ``/metrics`` to report to)."""

    def started(self, n: int, max_tokens: int) -> None:
        pass

    def finished(self, choice: Choice, received: float, now: float) -> None:
        pass

    def prompt_finished(self, max_output_len: int) -> None:
        pass


NO_REQUEST_METRICS: Any = _NoRequestMetrics()


class RequestMetrics:
    """The requests' histograms and ``request_success``, in ``registry``: the handlers call
    :meth:`started` per request and :meth:`finished` per choice (see the module
    docstring). Thread-safe (``prometheus_client``'s metrics are)."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, prefix: str, max_model_len: int
    ) -> None:
        p = check_prefix(prefix)
        label = ["model_name"]

        def hist(name: str, doc: str, buckets: Any) -> Any:
            full = metric_name(p, name)
            return Histogram(full, doc, label, registry=registry, buckets=buckets).labels(
                model_name
            )

        lengths = tokens_buckets(max_model_len)
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.tpot_old = hist(
            "time_per_output_token_seconds", "Inter-token latency (vLLM's older name).", ITL_BUCKETS
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Decode time per output token of a request.",
            ITL_BUCKETS,
        )
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end latency.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time queued.", LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Time running.", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time in prefill.", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time in decode.", LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.output_len = hist(
            "request_generation_tokens", "Generated tokens per request.", lengths
        )
        self.max_output_len = hist(
            "request_max_num_generation_tokens",
            "The most tokens any of a prompt's n choices generated.",
            lengths,
        )
        self.n = hist("request_params_n", "The n request parameter.", (1, 2, 5, 10, 20))
        self.max_tokens = hist(
            "request_params_max_tokens", "The max_tokens request parameter.", lengths
        )
        success = Counter(
            metric_name(p, "request_success"),
            "Requests (choices) that ended, by finish reason.",
            [*label, "finished_reason"],
            registry=registry,
        )
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}

    def started(self, n: int, max_tokens: int) -> None:
        """A request with ``n`` choices per prompt and ``max_tokens`` arrived."""
        self.n.observe(n)
        self.max_tokens.observe(max_tokens)

    def prompt_finished(self, max_output_len: int) -> None:
        """Every choice of one prompt ended; the longest generated ``max_output_len`` tokens
        (vLLM's ``request_max_num_generation_tokens``: a vLLM request is one prompt)."""
        self.max_output_len.observe(max_output_len)

    def finished(self, choice: Choice, received: float, now: float) -> None:
        """``choice`` ended at ``now``; its request arrived at ``received`` (loop clock)."""
        reason = choice.finish or "abort"
        self.success.get(reason, self.success["abort"]).inc()
        self.e2e.observe(now - received)
        self.prompt_len.observe(len(choice.prompt.ids))
        self.output_len.observe(len(choice.token_ids))
        if choice.first_token_at is not None:
            self.ttft.observe(choice.first_token_at - received)
        times = choice.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
            self.tpot_old.observe(b - a)
        out = choice.last
        if out is None or out.scheduled_time is None:
            return
        if out.arrival_time is not None:
            self.queue.observe(out.scheduled_time - out.arrival_time)
        if times:
            self.prefill.observe(times[0] - out.scheduled_time)
            self.decode.observe(times[-1] - times[0])
            self.inference.observe(times[-1] - out.scheduled_time)
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))


class _EngineCollector:
    """The engine snapshot's gauges and counters (and the host tier's and the KV store's,
    per key of ``tiers``: engines with a host tier), per ``key`` (None: one engine; else a
    replica id, as the ``replica`` label), with two gauges derived from them:
    ``cache_hit_rate`` and ``gen_throughput`` (over the time since the previous collection
    of that key; 0 at the first)."""

    def __init__(self, model_name: str, prefix: str) -> None:
        self.model_name = model_name
        self.prefix = check_prefix(prefix)
        self.samples: Mapping[str | None, EngineMetrics] = {}
        self.tiers: Mapping[str | None, TierStats] = {}
        self._generated: dict[str | None, tuple[float, int]] = {}  # key -> (when, tokens)

    def _throughput(self, key: str | None, generated: int) -> float:
        """Tokens a second since ``key``'s previous collection (0 at its first)."""
        now = time.monotonic()
        before = self._generated.get(key)
        self._generated[key] = (now, generated)
        if before is None or now <= before[0]:
            return 0.0
        return max(0, generated - before[1]) / (now - before[0])

    def collect(self) -> Iterator[Metric]:
        p, samples = self.prefix, self.samples
        labels = ["model_name"] if None in samples else ["model_name", "replica"]

        def values(key: str | None) -> list[str]:
            return [self.model_name] if key is None else [self.model_name, key]

        for name, kind, field, help_ in METRICS:
            family: Any
            if kind == "gauge":
                family = GaugeMetricFamily(metric_name(p, name), help_, labels=labels)
            else:
                family = CounterMetricFamily(metric_name(p, name), help_, labels=labels)
            for key, m in samples.items():
                family.add_metric(values(key), float(getattr(m, field)))
            yield family
        hit_rate = GaugeMetricFamily(
            metric_name(p, "cache_hit_rate"),
            "Fraction of prompt tokens looked up in the prefix cache that were found.",
            labels=labels,
        )
        throughput = GaugeMetricFamily(
            metric_name(p, "gen_throughput"),
            "Tokens generated a second since the previous scrape.",
            labels=labels,
        )
        for key, m in samples.items():
            queries = m.prefix_cache_queries
            hit_rate.add_metric(values(key), m.prefix_cache_hits / queries if queries else 0.0)
            throughput.add_metric(values(key), self._throughput(key, m.generation_tokens))
        yield hit_rate
        yield throughput
        tiers = self.tiers
        tier_labels = ["model_name"] if None in tiers else ["model_name", "replica"]
        if tiers:
            for name, field, help_ in TIER_METRICS:
                family = CounterMetricFamily(metric_name(p, name), help_, labels=tier_labels)
                for key, t in tiers.items():
                    family.add_metric(values(key), float(getattr(t, field)))
                yield family
            gauge = GaugeMetricFamily(
                metric_name(p, "host_cache_blocks"),
                "Blocks the host tier holds.",
                labels=tier_labels,
            )
            for key, t in tiers.items():
                gauge.add_metric(values(key), float(t.host_blocks))
            yield gauge
        stores = {key: t for key, t in tiers.items() if t.has_store}
        if stores:
            tables: tuple[tuple[Any, tuple[tuple[str, str, str], ...]], ...] = (
                (CounterMetricFamily, STORE_METRICS),
                (GaugeMetricFamily, STORE_GAUGES),
            )
            for kind, table in tables:
                for name, field, help_ in table:
                    family = kind(metric_name(p, name), help_, labels=tier_labels)
                    for key, t in stores.items():
                        family.add_metric(values(key), float(getattr(t, field)))
                    yield family


class ServerMetrics:
    """A server's ``/metrics``, one engine's or a fleet ingress's: the engine collector and
    :class:`RequestMetrics` (``requests``, for the handlers) in one registry of its own
    (several servers in one process do not share metrics). ``ValueError`` naming a bad
    ``prefix``. Not thread-safe across renders: render from one event loop."""

    def __init__(self, model_name: str, prefix: str = DEFAULT_PREFIX, max_model_len: int = 1):
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = _EngineCollector(model_name, prefix)
        self.registry.register(self._engine)  # type: ignore[arg-type]
        self.requests = RequestMetrics(self.registry, model_name, prefix, max_model_len)

    def render(self, metrics: EngineMetrics, tiers: TierStats | None = None) -> str:
        """The exposition text, with the engine snapshot ``metrics`` (and ``tiers``).

        Complexity: O(number of metrics and histogram buckets)."""
        return self._render({None: metrics}, {} if tiers is None else {None: tiers})

    def render_fleet(
        self,
        replicas: Mapping[str, EngineMetrics],
        tiers: Mapping[str, TierStats] | None = None,
    ) -> str:
        """The exposition text of a fleet's ingress: every engine gauge and counter once per
        replica in ``replicas`` (labelled ``replica``), the host tier's and the KV store's
        once per replica in ``tiers`` (those with a host tier; labelled alike), and the
        requests' histograms.

        Complexity: O(number of metrics x replicas + histogram buckets)."""
        return self._render(replicas, tiers or {})

    def _render(
        self,
        samples: Mapping[str | None, EngineMetrics],
        tiers: Mapping[str | None, TierStats] | Mapping[str, TierStats],
    ) -> str:
        self._engine.samples, self._engine.tiers = samples, tiers
        return generate_latest(self.registry).decode()


def _render(samples: Mapping[str | None, EngineMetrics], model_name: str, prefix: str) -> str:
    collector = _EngineCollector(model_name, prefix)
    collector.samples = samples
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def render_metrics(metrics: EngineMetrics, model_name: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The exposition text of one engine's snapshot, every sample labelled ``model_name``.

    Complexity: O(number of metrics).
    """
    return _render({None: metrics}, model_name, prefix)


def render_fleet_metrics(
    replicas: Mapping[str, EngineMetrics], model_name: str, prefix: str = DEFAULT_PREFIX
) -> str:
    """The exposition text of a fleet: one sample per replica of every metric, labelled
    ``model_name`` and ``replica`` (sum over ``replica`` for the fleet's totals).

    Complexity: O(number of metrics x replicas).
    """
    return _render(replicas, model_name, prefix)
