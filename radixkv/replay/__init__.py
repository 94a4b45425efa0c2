"""Trace replay: Mooncake ``hash_ids`` traces through LRU, LFU, S3FIFO and the radix tree.

>>> from radixkv.replay import replay
>>> reqs = [{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [1, 2]},
...         {"timestamp": 1, "input_length": 900, "output_length": 1, "hash_ids": [1, 2]}]
>>> r = replay(reqs, "lru", capacity=4)
>>> r.hit_tokens.tolist(), r.total_hit_tokens, r.final_cache_blocks
([0, 900], 900, 2)

``replay(..., host_capacity=N)`` gives a radix policy a host-memory tier of N
blocks (``ReplayResult.host_hit_tokens``); ``TierCostModel`` prices the
recomputed and reloaded tokens.

No torch import: replay runs on numpy arrays and numba kernels.
"""

from radixkv.replay.config import FLAT_POLICIES, RADIX_POLICIES, REPLAY_POLICIES, ReplayConfig
from radixkv.replay.cost import TierCostModel
from radixkv.replay.replay import ReplayResult, replay
from radixkv.replay.trace import Trace, TraceError, TraceLengthError, TraceRequest, load_trace

__all__ = [
    "FLAT_POLICIES",
    "RADIX_POLICIES",
    "REPLAY_POLICIES",
    "ReplayConfig",
    "ReplayResult",
    "Trace",
    "TraceError",
    "TraceLengthError",
    "TierCostModel",
    "TraceRequest",
    "load_trace",
    "replay",
]
