"""``GET /metrics``: :class:`~radixkv.serve.async_engine.EngineMetrics` as Prometheus text.

The exposition format 0.0.4 (``text/plain; version=0.0.4``), written by hand: one
``# HELP`` and ``# TYPE`` line per metric, one sample labelled ``model_name``. The
names are vLLM's with the ``radixkv:`` prefix, so dashboards built for vLLM read a
radixkv server after a rename of the prefix:

=====================================  =========  ==========================================
name                                   type       meaning
=====================================  =========  ==========================================
``radixkv:num_requests_running``       gauge      requests in the running batch
``radixkv:num_requests_waiting``       gauge      requests queued for admission
``radixkv:kv_cache_usage_perc``        gauge      fraction of KV blocks requests hold (0..1)
``radixkv:prefix_cache_queries_total`` counter    prompt tokens looked up in the prefix cache
``radixkv:prefix_cache_hits_total``    counter    prompt tokens found there
``radixkv:num_preemptions_total``      counter    requests preempted (recomputed later)
``radixkv:request_finished_total``     counter    requests that ended, for any reason
``radixkv:prompt_tokens_total``        counter    prompt tokens of requests that got a token
``radixkv:generation_tokens_total``    counter    tokens generated
``radixkv:failed_steps_total``         counter    engine steps that failed
=====================================  =========  ==========================================
"""

from __future__ import annotations

from collections.abc import Mapping

from radixkv.serve.async_engine import EngineMetrics

__all__ = ["CONTENT_TYPE", "METRICS", "render_fleet_metrics", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, EngineMetrics field, help)
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("radixkv:num_requests_running", "gauge", "running", "Requests in the running batch."),
    ("radixkv:num_requests_waiting", "gauge", "waiting", "Requests waiting to be admitted."),
    (
        "radixkv:kv_cache_usage_perc",
        "gauge",
        "kv_usage",
        "Fraction of KV cache blocks held by requests (1 = full).",
    ),
    (
        "radixkv:prefix_cache_queries_total",
        "counter",
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "radixkv:prefix_cache_hits_total",
        "counter",
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
    ),
    ("radixkv:num_preemptions_total", "counter", "preemptions", "Requests preempted."),
    (
        "radixkv:request_finished_total",
        "counter",
        "requests_finished",
        "Requests that ended (any finish reason).",
    ),
    (
        "radixkv:prompt_tokens_total",
        "counter",
        "prompt_tokens",
        "Prompt tokens of requests that produced a token.",
    ),
    ("radixkv:generation_tokens_total", "counter", "generation_tokens", "Tokens generated."),
    ("radixkv:failed_steps_total", "counter", "failed_steps", "Engine steps that failed."),
)


def _label(value: str) -> str:
    """``value`` escaped for a label (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(metrics: EngineMetrics, model_name: str) -> str:
    """The exposition text of ``metrics``, every sample labelled ``model_name``.

    Complexity: O(number of metrics).
    """
    return _render({None: metrics}, model_name)


def render_fleet_metrics(replicas: Mapping[str, EngineMetrics], model_name: str) -> str:
    """The exposition text of a fleet: one sample per replica of every metric, labelled
    ``model_name`` and ``replica`` (sum over ``replica`` for the fleet's totals).

    Complexity: O(number of metrics x replicas).
    """
    return _render(replicas, model_name)


def _render(samples: Mapping[str | None, EngineMetrics], model_name: str) -> str:
    model = f'model_name="{_label(model_name)}"'
    labels = {
        key: f"{{{model}}}" if key is None else f'{{{model},replica="{_label(key)}"}}'
        for key in samples
    }
    lines: list[str] = []
    for name, kind, field, help_ in METRICS:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for key, metrics in samples.items():
            lines.append(f"{name}{labels[key]} {float(getattr(metrics, field))!r}")
    return "\n".join(lines) + "\n"
