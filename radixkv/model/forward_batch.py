"""ForwardBatch: the record an eager step hands the model.

The scheduler works on plain ints (block ids, lengths); :meth:`ForwardBatch.build`
turns a step's into tensors (a captured decode step's go through
:func:`~radixkv.model.cuda_graphs.fill_decode_inputs` instead). It validates the host data, computes
every new token's position and slot and the attention backend's index tensors
once, and moves them to the device together; the model then only computes
(``Decoder.forward`` reads the batch and mutates only the pool, writing each new
token's K/V at its slot).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixkv.checks import check_int, check_ints, is_int
from radixkv.model.attention import (
    ATTENTION_BACKENDS,
    AttentionMetadata,
    context_blocks,
    query_positions,
    slot_mapping,
)
from radixkv.model.cascade import CascadePlan, plan_cascade
from radixkv.model.gather import indices_to_device

if TYPE_CHECKING:
    from radixkv.model.triton_attention import TritonAttention

__all__ = ["DECODER_BACKENDS", "ForwardBatch", "triton_backend_runs_on"]

# The paged backends, cascade attention (radixkv.model.cascade), which reads the
# prefix blocks that a step's sequences share once for all of them, and the Triton
# kernels that read K/V in place through the block table (radixkv.model.triton_attention;
# CUDA, or the CPU under TRITON_INTERPRET=1).
DECODER_BACKENDS = (*ATTENTION_BACKENDS, "cascade", "triton")


def triton_backend_runs_on(device: torch.device | str) -> bool:
    """Whether the ``triton`` backend can run on ``device`` here.

    Triton must be importable, and the device a CUDA GPU, or any device when
    Triton's interpreter is on (``TRITON_INTERPRET=1``, read when the kernels are
    first imported: set it before). Imports nothing. Complexity: O(1).
    """
    if importlib.util.find_spec("triton") is None:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.device(device).type == "cuda"


def _int_list(name: str, values: Sequence[int]) -> list[int]:
    """``values`` as plain ints; ``check_ints``' error naming the first non-int."""
    # one pass of is_int on the step's path; check_ints (a name per element) only to raise
    if all(map(is_int, values)):
        return [int(v) for v in values]
    return check_ints(name, values)


def _int_array(name: str, values: object) -> np.ndarray:
    """``values`` as a 1-D integer array (no copy if it already is one)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    return a


@dataclass(frozen=True)
class ForwardBatch:
    """One model step over a mix of prefill chunks and decode tokens, ready on a device.

    Make it with :meth:`build`. Sequences appear in a fixed order;
    ``input_ids``, ``positions`` and ``slot_mapping`` hold every sequence's new
    tokens back to back in that order (int64 tensors on the step's device).

    - ``input_ids``: ``[num_tokens]``, the new tokens.
    - ``positions``: ``[num_tokens]``, each new token's absolute position in its
      sequence: sequence ``i``'s are ``[context_len - query_len, context_len)``.
    - ``slot_mapping``: ``[num_tokens]``, the KV pool slot
      (``block * block_size + offset``) where each new token's K/V is written.
    - ``last_token_index``: ``[num_seqs]``, each sequence's last new token's row
      (whose logits the model returns).
    - ``query_lens``: new tokens per sequence (a prefill chunk, or 1 for a decode).
    - ``context_lens``: per sequence, context length after this step
      (cached + earlier chunks + new tokens); attention reads positions
      ``[0, context_len)`` through the block table.
    - ``block_size``/``num_blocks``: of the pool the batch was built for;
      ``group_size``: of the model (query heads per KV head).
    - ``attention``: the paged backend's index tensors (None for ``triton``);
      ``cascade``: the shared-prefix plan when built for ``cascade`` and a group
      formed, else None; ``kernel``: the ``triton`` backend's metadata, which also
      writes the new K/V (else None: the pool's ``write`` does).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    last_token_index: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    num_blocks: int
    group_size: int
    attention: AttentionMetadata | None
    cascade: CascadePlan | None = None
    kernel: TritonAttention | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @classmethod
    def build(
        cls,
        input_ids: np.ndarray | Sequence[int],
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[np.ndarray | Sequence[int]],
        *,
        block_size: int,
        num_blocks: int,
        backend: str,
        group_size: int,
        device: torch.device | str,
    ) -> ForwardBatch:
        """The batch for one step, every tensor on ``device``.

        ``input_ids``: 1-D ints, all sequences' new tokens back to back;
        ``query_lens``/``context_lens``: per sequence; ``block_tables``: per
        sequence, 1-D ints with at least ``ceil(context_len / block_size)``
        entries (entry ``j`` holds positions ``[j * bs, (j + 1) * bs)``; more are
        ignored). ``num_blocks``/``block_size``: of the pool the batch will run
        on; ``backend``: one of :data:`DECODER_BACKENDS`; ``group_size``: the
        model's query heads per KV head (``Decoder.backend_for`` and
        ``ModelConfig.group_size`` give the last two). Nothing is kept from the
        inputs: they are copied.

        Raises ``ValueError`` naming the field, the sequence and the value, before
        any tensor exists, if: there are no sequences; the per-sequence counts
        disagree; a ``query_len`` is not in ``[1, context_len]``;
        ``sum(query_lens) != len(input_ids)``; a block table is too short or not
        1-D ints; a block id it uses is outside ``[0, num_blocks)``; a token id is
        negative; or an option is invalid. Token ids are not checked against a
        vocabulary. One host-to-device copy (two when a cascade group forms).
        Complexity: O(num_seqs + num_tokens + total context / block_size) on the
        host (times ``block_size`` for ``padded``/``varlen``), plus the backend's
        masks on the device.

        >>> b = ForwardBatch.build([7, 8, 9], [2, 1], [6, 3], [[1, 6], [5]], block_size=4,
        ...                        num_blocks=8, backend="loop", group_size=1, device="cpu")
        >>> b.positions.tolist(), b.slot_mapping.tolist()
        ([4, 5, 2], [24, 25, 22])
        """
        bs = check_int("block_size", block_size, low=1)
        num_blocks = check_int("num_blocks", num_blocks, low=1)
        group_size = check_int("group_size", group_size, low=1)
        if backend not in DECODER_BACKENDS:
            raise ValueError(f"backend must be one of {DECODER_BACKENDS}, got {backend!r}")
        ids = _int_array("input_ids", input_ids)
        qls = _int_list("query_lens", query_lens)
        cls_ = _int_list("context_lens", context_lens)
        n = len(qls)
        if n == 0:
            raise ValueError("query_lens is empty: a batch needs at least one sequence")
        if len(cls_) != n or len(block_tables) != n:
            raise ValueError(
                f"query_lens has {n} entries, context_lens {len(cls_)} and block_tables "
                f"{len(block_tables)}: need one per sequence"
            )
        for i, (q, c) in enumerate(zip(qls, cls_, strict=True)):
            if not 1 <= q <= c:
                raise ValueError(
                    f"query_lens[{i}] = {q} with context_lens[{i}] = {c}: "
                    "need 1 <= query_len <= context_len"
                )
        if sum(qls) != ids.size:
            raise ValueError(f"input_ids has {ids.size} tokens, sum(query_lens) = {sum(qls)}")
        tables = [_int_array(f"block_tables[{i}]", t) for i, t in enumerate(block_tables)]
        ctx_blocks, first_blocks = context_blocks(cls_, tables, bs)
        bad = np.flatnonzero((ctx_blocks < 0) | (ctx_blocks >= num_blocks))
        if bad.size:
            k = int(bad[0])
            i = int(np.searchsorted(first_blocks, k, side="right")) - 1
            raise ValueError(
                f"block_tables[{i}][{k - int(first_blocks[i])}] = {int(ctx_blocks[k])} "
                f"is outside the pool's blocks [0, {num_blocks})"
            )
        seq_of_token, positions = query_positions(qls, cls_)
        neg = np.flatnonzero(ids < 0)
        if neg.size:
            t = int(neg[0])
            raise ValueError(
                f"input_ids[{t}] = {int(ids[t])} (sequence {int(seq_of_token[t])}) is negative"
            )

        host = {
            "input_ids": ids,
            "positions": positions,
            "slot_mapping": slot_mapping(ctx_blocks, first_blocks, seq_of_token, positions, bs),
            "last_token_index": np.cumsum(np.asarray(qls, dtype=np.int64)) - 1,
        }
        meta, plan, kernel = None, None, None
        if backend == "triton":
            moved, kernel = cls._kernel_metadata(host, qls, cls_, tables, bs, device)
        else:
            paged = "loop" if backend == "cascade" else backend
            meta_host = AttentionMetadata.host_indices(
                qls, cls_, ctx_blocks, block_size=bs, backend=paged
            )
            moved = indices_to_device({**host, **meta_host}, device)
            meta = AttentionMetadata.from_indices(
                {name: moved[name] for name in meta_host},
                qls,
                cls_,
                block_size=bs,
                group_size=group_size,
                backend=paged,
            )
            if backend == "cascade":
                plan = plan_cascade(
                    qls, cls_, tables, block_size=bs, group_size=group_size, device=device
                )
        return cls(
            input_ids=moved["input_ids"],
            positions=moved["positions"],
            slot_mapping=moved["slot_mapping"],
            last_token_index=moved["last_token_index"],
            query_lens=qls,
            context_lens=cls_,
            block_size=bs,
            num_blocks=num_blocks,
            group_size=group_size,
            attention=meta,
            cascade=plan,
            kernel=kernel,
        )

    @staticmethod
    def _kernel_metadata(
        host: dict[str, np.ndarray],
        qls: list[int],
        cls_: list[int],
        tables: list[np.ndarray],
        bs: int,
        device: torch.device | str,
    ) -> tuple[dict[str, torch.Tensor], TritonAttention]:
        """:meth:`build`'s ``triton`` half: ``host`` and the kernels' metadata moved in one copy.

        Block tables are padded to the widest one. ``ValueError`` where the
        backend cannot run on ``device``, before any tensor exists.
        """
        if not triton_backend_runs_on(device):
            raise ValueError(
                "backend 'triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1), "
                f"got device {str(device)!r}"
            )
        from radixkv.model.triton_attention import TritonAttention, decode_splits

        n = len(qls)
        nbs = [-(-c // bs) for c in cls_]
        width = max(nbs)
        padded = np.zeros((n, width), dtype=np.int64)
        for i, (table, nb) in enumerate(zip(tables, nbs, strict=True)):
            padded[i, :nb] = table[:nb]
        q_lens = np.asarray(qls, dtype=np.int64)
        moved = indices_to_device(
            {
                **host,
                "query_starts": np.cumsum(q_lens) - q_lens,
                "query_lens": q_lens,
                "context_lens": np.asarray(cls_, dtype=np.int64),
                "block_tables": padded,
            },
            device,
        )
        kernel = TritonAttention(
            query_starts=moved["query_starts"],
            query_lens=moved["query_lens"],
            context_lens=moved["context_lens"],
            block_tables=moved["block_tables"].view(n, width),
            block_size=bs,
            max_query_len=max(qls),
            max_splits=decode_splits(max(cls_)),
        )
        return moved, kernel
