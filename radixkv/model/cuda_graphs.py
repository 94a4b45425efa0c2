"""CUDA graphs for decode steps: capture ``Decoder.forward`` once per batch size, replay it.

A decode step of a small model is a few hundred kernel launches whose arithmetic
takes microseconds; launching them from Python is the step's cost. A CUDA graph
records the launches once and replays them with one call. What a graph replays
is fixed at capture: the kernels, their grid sizes and the addresses they read
and write. So every input lives in a *static* buffer that each step overwrites,
and a step of ``n`` sequences replays the graph of the smallest captured batch
size ``>= n`` (:func:`graph_batch_sizes`, :func:`pick_batch_size`), its extra rows
padded so they compute nothing that matters:

- a padding row's slot is -1: the ``triton`` backend's K/V store skips it;
- its context length is 0: the attention kernels skip it (and write zeros);
- its token and position are 0, and its logits are never read.

Only the ``triton`` attention backend can be captured: its metadata is a few
tensors read at launch, its grids depend only on the batch size and on the
widest block table (``max_context_len``), fixed per graph. The paged backends
build masks whose shapes follow each step's lengths.

The host side of a step is :func:`fill_decode_inputs` (pure numpy, tested on the
CPU): it lays the step out in one page-locked buffer, which goes to the device
in one asynchronous copy, followed by the replay. Nothing in the captured region
allocates outside the graph's pool, synchronizes, or reads Python state that
changes between steps.

:class:`DecodeGraphs` with ``capture=False`` runs the same static-buffer path
eagerly (no graphs), which is how the CPU tests check the padding and the fill
under Triton's interpreter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from radixkv.checks import check_int
from radixkv.model.attention import slot_mapping
from radixkv.model.forward_batch import ForwardBatch
from radixkv.model.kvpool import KVPool

__all__ = [
    "DecodeGraphs",
    "decode_input_layout",
    "fill_decode_inputs",
    "graph_batch_sizes",
    "pick_batch_size",
]

# The static inputs, in the order they sit in the one host buffer (each a region
# of max_batch_size entries, then the block tables, max_batch_size x width).
_FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens")


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to ``max_batch_size``.

    Powers of two to 8, then steps of 8 (as vLLM and SGLang ladder theirs), so
    padding wastes at most 7 rows past 8; ``max_batch_size`` itself is always
    included. ``ValueError`` unless it is a positive int.

    >>> graph_batch_sizes(20)
    (1, 2, 4, 8, 16, 20)
    """
    max_batch_size = check_int("max_batch_size", max_batch_size, low=1)
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += range(8, max_batch_size, 8)
    return (*sizes, max_batch_size)


def pick_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``num_seqs``; None if none does.

    >>> pick_batch_size(5, (1, 2, 4, 8)), pick_batch_size(9, (1, 2, 4, 8))
    (8, None)
    """
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


def decode_input_layout(max_batch_size: int, width: int) -> dict[str, slice]:
    """Where each static input sits in the one int64 host/device buffer.

    ``input_ids``, ``positions``, ``slot_mapping``, ``context_lens``: one entry
    per row (``max_batch_size``); ``block_tables``: ``max_batch_size * width``,
    row-major. Complexity: O(1).
    """
    b = max_batch_size
    layout = {name: slice(i * b, (i + 1) * b) for i, name in enumerate(_FIELDS)}
    start = len(_FIELDS) * b
    layout["block_tables"] = slice(start, start + b * width)
    return layout


def fill_decode_inputs(
    buffer: np.ndarray,
    layout: dict[str, slice],
    width: int,
    batch_size: int,
    input_ids: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int] | np.ndarray],
    block_size: int,
) -> None:
    """Write a decode step of ``n = len(input_ids)`` sequences into ``buffer``, padded.

    Sequence ``i`` decodes one token, ``input_ids[i]``, at position
    ``context_lens[i] - 1``, through ``block_tables[i]`` (at least
    ``ceil(context_lens[i] / block_size)`` blocks; only those are copied). Rows
    ``[n, batch_size)`` are padding: token 0, position 0, slot -1, context 0.
    Mutates ``buffer`` (an int64 array laid out by :func:`decode_input_layout`
    with this ``width``) only. ``ValueError`` if ``n`` is 0 or above
    ``batch_size``, or a context is not in ``[1, width * block_size]``, before
    writing anything. Complexity: O(batch_size + total context / block_size).
    """
    n = len(input_ids)
    if not 1 <= n <= batch_size:
        raise ValueError(f"a decode step of {n} sequences does not fit batch_size {batch_size}")
    ctx = np.asarray(context_lens, dtype=np.int64)
    limit = width * block_size
    bad = np.flatnonzero((ctx < 1) | (ctx > limit))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"context_lens[{i}] = {int(ctx[i])} is outside [1, {limit}] (block table width "
            f"{width} x block_size {block_size})"
        )
    pos = ctx - 1
    flat_tables = buffer[layout["block_tables"]]
    tables = flat_tables.reshape(-1, width)
    for i, (table, c) in enumerate(zip(block_tables, ctx.tolist(), strict=True)):
        nb = -(-c // block_size)
        tables[i, :nb] = table[:nb]
    seqs = np.arange(n, dtype=np.int64)  # one new token per sequence, its row of the tables
    slots = slot_mapping(flat_tables, seqs * width, seqs, pos, block_size)
    rows = slice(0, n)
    pad = slice(n, batch_size)
    for name, real, fill in (
        ("input_ids", np.asarray(input_ids, dtype=np.int64), 0),
        ("positions", pos, 0),
        ("slot_mapping", slots, -1),
        ("context_lens", ctx, 0),
    ):
        region = buffer[layout[name]]
        region[rows] = real
        region[pad] = fill


class DecodeGraphs:
    """Decode steps of ``model`` over ``kv`` replayed from CUDA graphs, one per batch size.

    ``max_batch_size``: the most sequences a decode step may hold (the engine's
    ``max_num_seqs``); ``max_context_len``: the longest context a graphed step
    may read (it fixes the block tables' width, rounded up to whole blocks).
    Steps outside either are the caller's to run eagerly (:meth:`fits`).
    ``capture=True`` (a CUDA pool) records the graphs now, largest first, into
    one memory pool, and ``capture_seconds`` says how long that took;
    ``capture=False`` runs the same static-buffer path without graphs.

    The model must run the ``triton`` backend (``ValueError`` otherwise), and
    the graphs hold ``kv``'s tensors and the model's weights by address: neither
    may be reallocated while this object is used. Not thread-safe.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVPool,
        max_batch_size: int,
        max_context_len: int,
        *,
        capture: bool = True,
    ) -> None:
        from radixkv.model.triton_attention import TritonAttention, decode_splits

        if model.backend_for(kv.device) != "triton":
            raise ValueError(
                "CUDA graphs need the 'triton' attention backend, the model runs "
                f"{model.backend_for(kv.device)!r}"
            )
        max_batch_size = check_int("max_batch_size", max_batch_size, low=1)
        max_context_len = check_int("max_context_len", max_context_len, low=1)
        if capture and kv.device.type != "cuda":
            raise ValueError(f"capture=True needs a CUDA pool, got one on {kv.device}")
        self.model, self.kv = model, kv
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        bs = kv.block_size
        self.width = -(-max_context_len // bs)
        self.max_context_len = self.width * bs
        self.layout = decode_input_layout(max_batch_size, self.width)
        total = self.layout["block_tables"].stop
        pin = kv.device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(total, dtype=torch.int64, device=kv.device)
        self._copied: torch.cuda.Event | None = None
        dev = {name: self._device[sl] for name, sl in self.layout.items()}
        rows = torch.arange(max_batch_size, dtype=torch.int64, device=kv.device)
        ones = torch.ones(max_batch_size, dtype=torch.int64, device=kv.device)
        tables = dev["block_tables"].view(max_batch_size, self.width)
        splits = decode_splits(self.max_context_len)
        self.batches: dict[int, ForwardBatch] = {}
        for b in self.sizes:
            self.batches[b] = ForwardBatch(
                input_ids=dev["input_ids"][:b],
                positions=dev["positions"][:b],
                slot_mapping=dev["slot_mapping"][:b],
                last_token_index=rows[:b],
                query_lens=[1] * b,
                # a template: the real lengths are in kernel.context_lens at replay
                context_lens=[self.max_context_len] * b,
                block_size=bs,
                num_blocks=kv.num_blocks,
                group_size=model.config.group_size,
                attention=None,
                kernel=TritonAttention(
                    query_starts=rows[:b],
                    query_lens=ones[:b],
                    context_lens=dev["context_lens"][:b],
                    block_tables=tables[:b],
                    block_size=bs,
                    max_query_len=1,
                    max_splits=splits,
                ),
            )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        if capture:
            self._capture()

    def fits(self, num_seqs: int, max_context_len: int) -> bool:
        """Whether a decode step of ``num_seqs`` sequences, the longest this long, can run here."""
        return num_seqs <= self.max_batch_size and max_context_len <= self.max_context_len

    def _capture(self) -> None:
        """Record one graph per batch size, largest first, sharing one memory pool."""
        t0 = time.perf_counter()
        self._host_np[:] = 0
        self._host_np[self.layout["slot_mapping"]] = -1  # every row padding: nothing is written
        self._device.copy_(self._host)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self.model.forward(self.batches[b], self.kv)  # compile the kernels first
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        torch.cuda.synchronize(self.kv.device)
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model.forward(self.batches[b], self.kv)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.kv.device)
        self.capture_seconds = time.perf_counter() - t0

    def run(
        self,
        input_ids: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int] | np.ndarray],
    ) -> torch.Tensor:
        """One decode step: float32 logits ``[n, vocab]``, a view valid until the next call.

        Arguments as for :func:`fill_decode_inputs` (``ValueError`` there, before
        anything runs, if the step does not :meth:`fit`). Writes the new K/V into
        the pool like ``Decoder.forward``. One host-to-device copy, one replay
        (or, without capture, one eager forward); no host sync.
        """
        n = len(input_ids)
        b = pick_batch_size(n, self.sizes)
        if b is None:
            raise ValueError(f"a decode step of {n} sequences exceeds {self.max_batch_size}")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the host buffer
        fill_decode_inputs(
            self._host_np, self.layout, self.width, b, input_ids, context_lens, block_tables,
            self.kv.block_size,
        )  # fmt: skip
        if self.kv.device.type == "cuda":
            self._device.copy_(self._host, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._device.copy_(self._host)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self.model.forward(self.batches[b], self.kv)[:n]
