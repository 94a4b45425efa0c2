"""A cost model for a two-tier replay: recompute a missed token, or reload a host-held block.

Per request ``i`` (``ReplayResult`` figures, tokens unless noted)::

    cost_i = recompute_i * c_prefill + reloaded_blocks_i * block_size * c_reload
    recompute_i = prompt_tokens_i - hit_tokens_i - host_hit_tokens_i

(``c_prefill = prefill_s_per_token``, ``c_reload = reload_s_per_token``).

Device hits cost nothing (the KV is where attention reads it); a host hit
costs a copy of whole blocks (``host_hit_blocks * block_size`` tokens, even
where the last block is partial); everything else is prefilled. With no cache
at all the cost is ``prompt_tokens * prefill_s_per_token``, so the
**effective prefill tokens saved** are::

    saved = (no_cache_cost - cost) / c_prefill
          = hit_tokens + host_hit_tokens - reloaded_tokens * c_reload / c_prefill

The default constants are SmolLM2-135M in float32 on this repository's CPU
(docs/replay.md, "Two tiers"):

- ``prefill_s_per_token = 3.40e-3``: the linear layers of one prompt token,
  1 thread (``radixkv.fleet.sim.ServiceModel.prefill_per_token``, calibrated on
  ``benchmarks/results/bench_engine_smollm2.csv``). Attention over the context
  is left out, so this is a low estimate of what a miss costs on long prompts,
  which understates the host tier's gain.
- ``reload_s_per_token = KV_BYTES_PER_TOKEN / 6.4e9``: SmolLM2-135M's KV is
  ``2 (K, V) * 30 layers * 3 KV heads * 64 head dim * 4 bytes = 46,080 bytes``
  per token, and ``radixkv.model.kv_copy.KVCopier.load`` moved 6.4 GB/s on
  the CPU (2,048 tokens in 16-token blocks per call, pre-touched pools;
  ``benchmarks/replay_host_tier.py --measure-reload``): 7.2 us per token.

Backups (device to host at eviction, write-back) are not in the per-request
cost: ``CacheStats.backed_up_blocks`` counts them for a separate total. A store
tier's reads have no price here: a three-tier result is a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixkv.checks import check_int, check_number
from radixkv.replay.replay import ReplayResult

__all__ = [
    "DEFAULT_PREFILL_S_PER_TOKEN",
    "DEFAULT_RELOAD_GBPS",
    "DEFAULT_RELOAD_S_PER_TOKEN",
    "KV_BYTES_PER_TOKEN",
    "TierCostModel",
]

# SmolLM2-135M: 30 layers, 3 KV heads of 64, float32; K and V.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
DEFAULT_PREFILL_S_PER_TOKEN = 3.40e-3
DEFAULT_RELOAD_GBPS = 6.4
DEFAULT_RELOAD_S_PER_TOKEN = KV_BYTES_PER_TOKEN / (DEFAULT_RELOAD_GBPS * 1e9)


@dataclass(frozen=True)
class TierCostModel:
    """Seconds per recomputed (prefilled) token and per reloaded token (see the module doc).

    Both must be finite numbers >= 0 and ``prefill_s_per_token > 0`` (it is the
    unit of ``tokens_saved``); ``ValueError`` naming the field and value.
    """

    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    reload_s_per_token: float = DEFAULT_RELOAD_S_PER_TOKEN

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "reload_s_per_token"):
            strict = name == "prefill_s_per_token"  # it is the unit of tokens_saved
            value = check_number(name, getattr(self, name), low=0, strict=strict)
            object.__setattr__(self, name, value)

    @classmethod
    def from_bandwidth(
        cls,
        prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN,
        gbps: float = DEFAULT_RELOAD_GBPS,
        kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
    ) -> TierCostModel:
        """The model with ``reload_s_per_token = kv_bytes_per_token / (gbps * 1e9)``.

        ``ValueError`` naming the argument for ``gbps <= 0`` or ``kv_bytes_per_token < 1``.
        """
        check_number("gbps", gbps, low=0, strict=True, finite=False)
        check_int("kv_bytes_per_token", kv_bytes_per_token, low=1)
        return cls(prefill_s_per_token, kv_bytes_per_token / (gbps * 1e9))

    @property
    def ratio(self) -> float:
        """``reload_s_per_token / prefill_s_per_token``: below 1, a reload beats a recompute."""
        return self.reload_s_per_token / self.prefill_s_per_token

    def request_seconds(self, result: ReplayResult) -> np.ndarray:
        """Per request: ``recompute * prefill_s_per_token + reloaded_tokens * reload_s_per_token``.

        ``reloaded_tokens = host_hit_blocks * block_size``. A float64 array, one per request.
        ``ValueError`` for a result with a store tier (``config.store_capacity > 0``): this
        model has no price for a store read.
        """
        if result.config.store_capacity:
            raise ValueError(
                "TierCostModel prices a device and a host tier only, got a result with "
                f"store_capacity={result.config.store_capacity}"
            )
        reloaded = result.host_hit_blocks * result.config.block_size
        return (
            result.recompute_tokens * self.prefill_s_per_token + reloaded * self.reload_s_per_token
        )

    def seconds(self, result: ReplayResult) -> float:
        """The trace's total: the sum of ``request_seconds``."""
        return float(self.request_seconds(result).sum())

    def no_cache_seconds(self, result: ReplayResult) -> float:
        """Every prompt token prefilled: ``total_prompt_tokens * prefill_s_per_token``."""
        return result.total_prompt_tokens * self.prefill_s_per_token

    def tokens_saved(self, result: ReplayResult) -> float:
        """Effective prefill tokens saved: ``(no_cache_seconds - seconds) / prefill_s_per_token``.

        Equals ``total_hit_tokens + total_host_hit_tokens - ratio * reloaded tokens``.
        """
        return (self.no_cache_seconds(result) - self.seconds(result)) / self.prefill_s_per_token
