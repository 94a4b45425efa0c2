"""Paged attention: each sequence's queries against its context K/V read through its block table.

Three interchangeable backends compute the same thing (tests check each against
a dense causal reference):

- ``"loop"``: one ``scaled_dot_product_attention`` call per sequence over exactly
  its context; decode tokens need no mask.
- ``"padded"``: one call over all sequences padded to the longest query and
  context, with a boolean mask.
- ``"varlen"``: one call over all tokens against all gathered context, with a
  block-diagonal causal mask (cost grows with ``num_tokens * total_context``).

Queries of a sequence with ``query_len`` new tokens and ``context_len`` tokens in
total sit at positions ``[context_len - query_len, context_len)``; query ``i``
sees keys ``[0, context_len - query_len + i]``. Heads are folded as
:func:`~radixkv.model.gather.fold_heads` describes.

:class:`AttentionMetadata` holds a step's index tensors; it is built from host
data (lists and numpy arrays) in two halves, so that
:meth:`~radixkv.model.forward_batch.ForwardBatch.build` can move its own arrays
and these to the device in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixkv.model.gather import (
    GatherWorkspace,
    causal_mask,
    fold_heads,
    gather_kv,
    indices_to_device,
    unfold_heads,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "context_blocks",
    "dense_causal_attention",
    "paged_attention",
    "query_positions",
    "slot_mapping",
]

ATTENTION_BACKENDS = ("loop", "padded", "varlen")


def _num_blocks(context_lens: Sequence[int], block_size: int) -> np.ndarray:
    """Blocks each context spans: ``ceil(context_len / block_size)``, int64."""
    return -(-np.asarray(context_lens, dtype=np.int64) // block_size)


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of ``lengths`` starts when laid back to back (exclusive cumsum)."""
    return np.cumsum(lengths) - lengths


def context_blocks(
    context_lens: Sequence[int], block_tables: Sequence[np.ndarray], block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's first ``ceil(context_len / block_size)`` block ids, back to back.

    ``block_tables[i]`` is a 1-D integer array with at least that many entries.
    Returns ``(ctx_blocks, first_blocks)``: the int64 concatenation, and where
    each sequence's blocks start in it. Block ids are not range-checked here.
    Raises ``ValueError`` naming ``block_tables[i]`` if a table is too short.
    Complexity: O(total context / block_size).
    """
    nbs = _num_blocks(context_lens, block_size)
    parts = []
    for i, (table, nb) in enumerate(zip(block_tables, nbs.tolist(), strict=True)):
        if len(table) < nb:
            raise ValueError(
                f"block_tables[{i}] has {len(table)} blocks, needs >= {nb} for "
                f"context_lens[{i}] = {context_lens[i]} at block_size {block_size}"
            )
        parts.append(table[:nb])
    ctx_blocks = np.concatenate(parts).astype(np.int64, copy=False)
    return ctx_blocks, _starts(nbs)


def query_positions(
    query_lens: Sequence[int], context_lens: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Per new token (sequences back to back): its sequence and its position, both int64.

    Sequence ``i``'s new tokens sit at positions ``[context_len - query_len,
    context_len)``. Complexity: O(num_tokens).
    """
    qls = np.asarray(query_lens, dtype=np.int64)
    cls_ = np.asarray(context_lens, dtype=np.int64)
    seq = np.repeat(np.arange(qls.size, dtype=np.int64), qls)
    offset = np.arange(seq.size, dtype=np.int64) - _starts(qls)[seq]
    return seq, (cls_ - qls)[seq] + offset


def slot_mapping(
    blocks: np.ndarray,
    first_blocks: np.ndarray,
    seq_of_token: np.ndarray,
    positions: np.ndarray,
    block_size: int,
) -> np.ndarray:
    """Each new token's KV pool slot: ``block_table[pos // block_size] * block_size + pos %
    block_size`` of its sequence. The one computation of slots, eager and CUDA-graph alike.

    ``blocks`` holds the sequences' block tables back to back, sequence ``i``'s from
    ``first_blocks[i]`` (:func:`context_blocks`, or the rows of a padded table); per new
    token, ``seq_of_token`` and ``positions`` (:func:`query_positions`). Int64 arrays; not
    range-checked. Complexity: O(num_tokens).

    >>> slot_mapping(np.array([1, 6, 5]), np.array([0, 2]), np.array([0, 0, 1]),
    ...              np.array([4, 5, 2]), 4).tolist()
    [24, 25, 22]
    """
    return blocks[first_blocks[seq_of_token] + positions // block_size] * block_size + (
        positions % block_size
    )


@dataclass
class AttentionMetadata:
    """Per-step index tensors shared by every layer (built once per step, on the host).

    Contexts are gathered a whole block at a time: ``ctx_blocks`` concatenates
    each sequence's first ``ceil(context_len / block_size)`` block ids, so
    sequence ``i``'s keys are rows ``[key_starts[i], key_starts[i] +
    context_len)`` of the gathered ``[len(ctx_blocks) * block_size, ...]`` K/V
    (the rest of its last block is never read). A block is one contiguous run of
    slots, so this gather copies ``block_size`` rows per index where a per-slot
    gather would index every row (3x faster on CPU, ``bench_attention.py``).
    ``ctx_blocks`` and ``loop_masks`` serve ``loop``; the ``pad_*`` fields
    ``padded``; ``ctx_slots``/``varlen_mask`` ``varlen``. ``group_size`` is the
    model's query heads per KV head: the masks are shaped for it.
    """

    backend: str
    group_size: int
    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    key_starts: list[int]
    ctx_blocks: torch.Tensor | None = None
    loop_masks: list[torch.Tensor | None] | None = None
    pad_q_index: torch.Tensor | None = None
    pad_slots: torch.Tensor | None = None
    pad_mask: torch.Tensor | None = None
    ctx_slots: torch.Tensor | None = None
    varlen_mask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[np.ndarray | Sequence[int]],
        *,
        block_size: int,
        group_size: int,
        backend: str,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Index tensors on ``device`` for sequences ``(query_len, context_len)`` over their tables.

        Host inputs as for :meth:`~radixkv.model.forward_batch.ForwardBatch.build`,
        which validates them; here only ``backend`` and the tables' lengths are
        checked (``ValueError``). One host-to-device copy.
        Complexity: O(total context / block_size + num_tokens) on the host, plus
        the backend's masks on the device.
        """
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        tables = [np.asarray(t) for t in block_tables]
        ctx_blocks, _ = context_blocks(context_lens, tables, block_size)
        host = cls.host_indices(
            query_lens, context_lens, ctx_blocks, block_size=block_size, backend=backend
        )
        return cls.from_indices(
            indices_to_device(host, device),
            query_lens,
            context_lens,
            block_size=block_size,
            group_size=group_size,
            backend=backend,
        )

    @staticmethod
    def host_indices(
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        ctx_blocks: np.ndarray,
        *,
        block_size: int,
        backend: str,
    ) -> dict[str, np.ndarray]:
        """The first half of :meth:`build`: the int64 index arrays ``backend`` needs, on the host.

        ``ctx_blocks`` is :func:`context_blocks`'s first result. Returns arrays
        by name, for :func:`~radixkv.model.gather.indices_to_device` and then
        :meth:`from_indices`. Complexity: O(total context / block_size +
        num_tokens), times ``block_size`` for ``padded``/``varlen`` (per-slot).
        """
        bs = block_size
        if backend == "loop":
            return {"ctx_blocks": ctx_blocks}
        qls = np.asarray(query_lens, dtype=np.int64)
        cls_ = np.asarray(context_lens, dtype=np.int64)
        first = _starts(_num_blocks(context_lens, bs))
        seq_of_token, positions = query_positions(query_lens, context_lens)
        if backend == "padded":
            max_q, max_c = int(qls.max()), int(cls_.max())
            q_off = np.arange(seq_of_token.size, dtype=np.int64) - _starts(qls)[seq_of_token]
            cols = np.arange(max_c, dtype=np.int64)
            # past its context a row reads position 0's slot: masked out, but finite
            pos = np.where(cols[None, :] < cls_[:, None], cols[None, :], 0)
            pad_slots = ctx_blocks[first[:, None] + pos // bs] * bs + pos % bs
            rows = np.arange(max_q, dtype=np.int64)
            # padded query rows (>= query_len) see key 0 only, so no row is fully masked
            limit = np.where(rows[None, :] < qls[:, None], (cls_ - qls)[:, None] + rows, 0)
            return {
                "pad_q_index": seq_of_token * max_q + q_off,
                "pad_slots": pad_slots,
                "pad_limit": limit,
            }
        if backend == "varlen":
            # the padded and varlen backends mask keys rather than slicing them, so they
            # gather exact slots: the unwritten tail of a last block may hold NaN
            seq_of_key = np.repeat(np.arange(cls_.size, dtype=np.int64), cls_)
            key_start = _starts(cls_)
            kp = np.arange(seq_of_key.size, dtype=np.int64) - key_start[seq_of_key]
            lo = key_start[seq_of_token]
            return {
                "ctx_slots": ctx_blocks[first[seq_of_key] + kp // bs] * bs + kp % bs,
                "key_lo": lo,
                "key_hi": lo + positions,
            }
        raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")

    @classmethod
    def from_indices(
        cls,
        indices: dict[str, torch.Tensor],
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        *,
        block_size: int,
        group_size: int,
        backend: str,
    ) -> AttentionMetadata:
        """The second half of :meth:`build`: masks made on the device from moved indices.

        ``indices``: :meth:`host_indices`' arrays as 1-D tensors on one device
        (the metadata's). Keeps references to them. No host-to-device copy.
        Complexity: the backend's masks, O(group_size * num_tokens * context).
        """
        qls, cls_ = [int(q) for q in query_lens], [int(c) for c in context_lens]
        nbs = _num_blocks(cls_, block_size)
        key_starts = (_starts(nbs) * block_size).tolist()
        meta = cls(backend, group_size, block_size, qls, cls_, key_starts)
        device = next(iter(indices.values())).device
        if backend == "loop":
            meta.ctx_blocks = indices["ctx_blocks"]
            meta.loop_masks = [
                None if q == 1 else causal_mask(q, c, group_size, device)
                for q, c in zip(qls, cls_, strict=True)
            ]
        elif backend == "padded":
            b, max_q, max_c = len(qls), max(qls), max(cls_)
            limit = indices["pad_limit"].view(b, max_q).repeat(1, group_size)
            cols = torch.arange(max_c, device=device)
            meta.pad_q_index = indices["pad_q_index"]
            meta.pad_slots = indices["pad_slots"]
            meta.pad_mask = (cols[None, None, :] <= limit[:, :, None])[:, None]
        elif backend == "varlen":
            lo, hi = indices["key_lo"], indices["key_hi"]
            cols = torch.arange(indices["ctx_slots"].numel(), device=device)
            mask = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
            meta.ctx_slots = indices["ctx_slots"]
            meta.varlen_mask = mask.repeat(group_size, 1)
        else:
            raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        return meta


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    workspace: GatherWorkspace | None = None,
) -> torch.Tensor:
    """Attention of the batch's queries over their paged contexts.

    ``q``: ``[num_tokens, num_heads, head_dim]``; ``k_cache``/``v_cache``: one
    layer of the pool, already holding this step's new K/V; all on ``meta``'s
    device. Returns ``[num_tokens, num_heads * head_dim]``. Reads the pool, never
    writes it; overwrites ``workspace``'s buffers when one is given (else
    allocates). Complexity: the backend's gather plus its attention calls.
    """
    num_kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    if meta.backend == "loop":
        assert meta.ctx_blocks is not None
        keys, values = gather_kv(k_cache, v_cache, meta.ctx_blocks, meta.block_size, workspace)
        outs = []
        q_start = 0
        masks = meta.loop_masks or [None] * len(meta.query_lens)
        for ql, cl, k_start, mask in zip(
            meta.query_lens, meta.context_lens, meta.key_starts, masks, strict=True
        ):
            qi = fold_heads(q[q_start : q_start + ql], num_kv_heads)
            ki = keys[k_start : k_start + cl].transpose(0, 1)
            vi = values[k_start : k_start + cl].transpose(0, 1)
            o = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask)
            outs.append(unfold_heads(o[0], ql))
            q_start += ql
        return torch.cat(outs) if len(outs) > 1 else outs[0]
    if meta.backend == "padded":
        assert meta.pad_mask is not None and meta.pad_slots is not None
        assert meta.pad_q_index is not None
        b, _, rows, max_c = meta.pad_mask.shape
        group = meta.group_size
        max_q = rows // group
        num_heads = q.shape[1]
        qp = q.new_zeros((b * max_q, num_heads, d)).index_copy_(0, meta.pad_q_index, q)
        qp = qp.view(b, max_q, num_kv_heads, group, d).permute(0, 2, 3, 1, 4)
        qp = qp.reshape(b, num_kv_heads, rows, d)
        kp, vp = gather_kv(k_cache, v_cache, meta.pad_slots, 1, workspace)
        kp, vp = kp.view(b, max_c, num_kv_heads, d), vp.view(b, max_c, num_kv_heads, d)
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=meta.pad_mask
        )
        o = o.view(b, num_kv_heads, group, max_q, d).permute(0, 3, 1, 2, 4)
        return o.reshape(b * max_q, num_heads * d).index_select(0, meta.pad_q_index)
    assert meta.ctx_slots is not None
    keys, values = gather_kv(k_cache, v_cache, meta.ctx_slots, 1, workspace)
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)
    qf = fold_heads(q, num_kv_heads)
    o = F.scaled_dot_product_attention(
        qf[None], keys[None], values[None], attn_mask=meta.varlen_mask
    )
    return unfold_heads(o[0], q.shape[0])


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference causal attention over one whole sequence, K/V heads repeated.

    ``q``: ``[L, H, d]``, ``k``/``v``: ``[L, Hkv, d]``; returns ``[L, H * d]``.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
    )
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)
