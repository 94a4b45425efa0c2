"""Model runners: how a scheduled step becomes logits (eagerly, or by CUDA-graph replay).

The engine hands its runner each step (:class:`~radixkv.engine.scheduler.SchedulerOutput`)
and gets back the logits of every sequence's last new token. Two runners, one
surface:

- :class:`EagerRunner` builds the step's :class:`~radixkv.model.ForwardBatch`
  and calls the model: every backend, every step shape.
- :class:`GraphRunner` replays a captured CUDA graph for decode-only steps that
  fit its graphs (:class:`~radixkv.model.cuda_graphs.DecodeGraphs`) and hands
  every other step (prefill chunks, oversize batches, contexts past the graphs'
  width) to an :class:`EagerRunner`.

:func:`make_model_runner` picks one from the engine's configuration.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from radixkv.cache.manager import KVCacheManager
from radixkv.engine.scheduler import SchedulerOutput
from radixkv.model.forward_batch import ForwardBatch
from radixkv.model.kvpool import KVPool

__all__ = ["EagerRunner", "GraphRunner", "ModelRunner", "build_forward_batch", "make_model_runner"]

log = logging.getLogger(__name__)


def build_forward_batch(
    out: SchedulerOutput,
    kv_manager: KVCacheManager,
    device: torch.device,
    *,
    backend: str,
    group_size: int,
) -> ForwardBatch:
    """The batch the model runs for ``out``, on ``device`` (see :meth:`ForwardBatch.build`).

    Each sequence's block table is its request's in ``kv_manager``, so cached positions
    (the matched blocks at the head of the table) are read from the cache's
    blocks; ``block_size``/``num_blocks`` are ``kv_manager``'s (the pool's). ``backend``
    and ``group_size`` are the model's (``Decoder.backend_for``,
    ``ModelConfig.group_size``). Raises ``ValueError`` if ``out`` is inconsistent
    (a table too short, a block outside the pool). Reads ``kv_manager``, never mutates it.
    Complexity: O(num_tokens + total context / block_size).
    """
    seqs = out.seqs
    return ForwardBatch.build(
        np.concatenate([s.request.tokens[s.start : s.stop] for s in seqs]),
        [s.num_new_tokens for s in seqs],
        [s.stop for s in seqs],
        [kv_manager.block_table(s.request.request_id) for s in seqs],
        block_size=kv_manager.block_size,
        num_blocks=kv_manager.allocator.num_blocks,
        backend=backend,
        group_size=group_size,
        device=device,
    )


class ModelRunner(Protocol):
    """Runs one scheduled step of the model over the pool."""

    def forward(self, out: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        """Float32 logits ``[len(out.seqs), vocab]``, row ``i`` for ``out.seqs[i]``'s last token.

        Writes the step's new K/V into the pool. ``ValueError`` for an
        inconsistent step, before the model runs.
        """
        ...

    def hidden(self, out: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        """The step's hidden states ``[out.num_tokens, hidden_size]`` (``model.hidden``: every
        new token's, in batch order, before the final norm), for a step that needs more than
        the last tokens' logits (prompt logprobs). Writes the new K/V as :meth:`forward` does.
        """
        ...


class EagerRunner:
    """Builds each step's batch for the model's backend and calls ``model.forward`` over
    ``kv_pool``."""

    def __init__(self, model: torch.nn.Module, kv_pool: KVPool) -> None:
        self.model, self.kv_pool = model, kv_pool

    def forward(self, out: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        return self.model.forward(self._batch(out, kv_manager), self.kv_pool)

    def hidden(self, out: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        return self.model.hidden(self._batch(out, kv_manager), self.kv_pool)

    def _batch(self, out: SchedulerOutput, kv_manager: KVCacheManager) -> ForwardBatch:
        device = self.kv_pool.device
        return build_forward_batch(
            out,
            kv_manager,
            device,
            backend=self.model.backend_for(device),
            group_size=self.model.config.group_size,
        )


class GraphRunner:
    """Replays CUDA graphs for the decode steps that fit them; runs the rest eagerly.

    ``graphs``: captured (or, for tests, eager static-buffer)
    :class:`~radixkv.model.cuda_graphs.DecodeGraphs` over the same model and
    pool as ``eager``. ``num_replayed`` / ``num_eager`` count the steps each way.
    """

    def __init__(self, graphs: object, eager: EagerRunner) -> None:
        from radixkv.model.cuda_graphs import DecodeGraphs

        if not isinstance(graphs, DecodeGraphs):
            raise TypeError(f"graphs must be DecodeGraphs, got {graphs!r}")
        self.graphs = graphs
        self.eager = eager
        self.num_replayed = 0
        self.num_eager = 0

    def forward(self, out: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        seqs = out.seqs
        decode_only = all(s.num_new_tokens == 1 for s in seqs)
        if not decode_only or not self.graphs.fits(len(seqs), max(s.stop for s in seqs)):
            self.num_eager += 1
            return self.eager.forward(out, kv_manager)
        self.num_replayed += 1
        return self.graphs.run(
            [int(s.request.tokens[s.start]) for s in seqs],
            [s.stop for s in seqs],
            [kv_manager.block_table(s.request.request_id) for s in seqs],
        )

    def hidden(self, out: SchedulerOutput, kv_manager: KVCacheManager) -> torch.Tensor:
        """Eager: the graphs return only the last tokens' logits."""
        self.num_eager += 1
        return self.eager.hidden(out, kv_manager)


def make_model_runner(
    model: torch.nn.Module,
    kv_pool: KVPool,
    *,
    cuda_graphs: bool,
    max_num_seqs: int,
    max_context_len: int,
) -> EagerRunner | GraphRunner:
    """A :class:`GraphRunner` where graphs are asked for and can be captured, else eager.

    Graphs are captured when ``cuda_graphs`` is true, the pool is on CUDA and the
    model runs the ``triton`` backend there (the only one whose step can be
    captured); otherwise the eager runner serves every step, and a request for
    graphs that cannot be met is logged. Capture happens here, once, for batch
    sizes up to ``max_num_seqs`` and contexts up to ``max_context_len``
    (capped at the pool's size); its time is logged and kept in
    ``runner.graphs.capture_seconds``.
    """
    eager = EagerRunner(model, kv_pool)
    if not cuda_graphs or kv_pool.device.type != "cuda":
        return eager
    backend = model.backend_for(kv_pool.device)
    if backend != "triton":
        log.info(
            "CUDA graphs need the 'triton' attention backend (got %r): running eagerly", backend
        )
        return eager
    from radixkv.model.cuda_graphs import DecodeGraphs

    max_context_len = min(max_context_len, kv_pool.num_slots)
    graphs = DecodeGraphs(model, kv_pool, max_num_seqs, max_context_len, capture=True)
    log.info(
        "captured CUDA graphs for decode batch sizes %s (contexts up to %d) in %.2f s",
        graphs.sizes,
        graphs.max_context_len,
        graphs.capture_seconds,
    )
    return GraphRunner(graphs, eager)
