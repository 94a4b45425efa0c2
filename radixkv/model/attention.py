"""Paged attention: each sequence's queries against its context K/V read through its block table.

Three interchangeable backends compute the same thing (tests check each against
a dense causal reference):

- ``"loop"``: one ``scaled_dot_product_attention`` call per sequence over exactly
  its context; decode tokens need no mask.
- ``"padded"``: one call over all sequences padded to the longest query and
  context, with a boolean mask.
- ``"varlen"``: one call over all tokens against all gathered context, with a
  block-diagonal causal mask (cost grows with ``num_tokens * total_context``).

Grouped-query attention folds each KV head's ``group = num_heads / num_kv_heads``
query heads into the query-length axis, so K/V are never repeated: query head
``h`` uses KV head ``h // group`` (Hugging Face's ``repeat_kv`` convention).

Queries of a sequence with ``query_len`` new tokens and ``context_len`` tokens in
total sit at positions ``[context_len - query_len, context_len)``; query ``i``
sees keys ``[0, context_len - query_len + i]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.model.forward_batch import ForwardBatch
from radixkv.model.kvpool import slots_for_positions

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "GatherWorkspace",
    "dense_causal_attention",
    "paged_attention",
    "validate_batch",
]

ATTENTION_BACKENDS = ("loop", "padded", "varlen")


def validate_batch(batch: ForwardBatch) -> None:
    """Raise ``ValueError`` if the batch's per-sequence lengths are inconsistent.

    Checks the Python-side fields only (no device sync): counts agree, every
    ``1 <= query_len <= context_len``, tensors are 1-D of ``num_tokens``.
    """
    n = batch.num_seqs
    if n == 0:
        raise ValueError("ForwardBatch has no sequences")
    if len(batch.context_lens) != n or len(batch.block_tables) != n:
        raise ValueError(
            f"query_lens ({n}), context_lens ({len(batch.context_lens)}) and block_tables "
            f"({len(batch.block_tables)}) must have one entry per sequence"
        )
    for i, (q, c) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        if not 1 <= q <= c:
            raise ValueError(f"sequence {i}: need 1 <= query_len <= context_len, got {q}, {c}")
    t = batch.num_tokens
    if sum(batch.query_lens) != t:
        raise ValueError(f"sum(query_lens)={sum(batch.query_lens)} != num_tokens={t}")
    for name in ("input_ids", "positions", "slot_mapping"):
        x = getattr(batch, name)
        if x.dim() != 1 or x.numel() != t:
            raise ValueError(f"{name} must be 1-D with {t} entries, got {tuple(x.shape)}")


@dataclass
class AttentionMetadata:
    """Per-step index tensors shared by every layer (built once per forward).

    Contexts are gathered a whole block at a time: ``ctx_blocks`` concatenates
    each sequence's first ``ceil(context_len / block_size)`` block ids, so
    sequence ``i``'s keys are rows ``[key_starts[i], key_starts[i] +
    context_len)`` of the gathered ``[len(ctx_blocks) * block_size, ...]`` K/V
    (the rest of its last block is never read). A block is one contiguous run of
    slots, so this gather copies ``block_size`` rows per index where a per-slot
    gather would index every row (3x faster on CPU, ``bench_attention.py``).
    ``new_slots``/``new_positions`` are what the batch's
    ``slot_mapping``/``positions`` must equal. The remaining fields serve one backend.
    """

    backend: str
    group: int
    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    ctx_blocks: torch.Tensor
    key_starts: list[int]
    new_slots: torch.Tensor
    new_positions: torch.Tensor
    loop_masks: list[torch.Tensor | None] | None = None
    pad_q_index: torch.Tensor | None = None
    pad_slots: torch.Tensor | None = None
    pad_mask: torch.Tensor | None = None
    ctx_slots: torch.Tensor | None = None
    varlen_mask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        block_size: int,
        group: int,
        backend: str,
        device: torch.device | None = None,
    ) -> AttentionMetadata:
        """Index tensors for ``batch`` on ``device`` (default: the batch's).

        Raises ``ValueError`` if a block table is shorter than its context.
        Complexity: O(total context / block_size + num_tokens).
        """
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        device = batch.input_ids.device if device is None else device
        qls, cls_ = list(batch.query_lens), list(batch.context_lens)
        nbs = [-(-c // block_size) for c in cls_]
        for i, (bt, nb) in enumerate(zip(batch.block_tables, nbs, strict=True)):
            if bt.dim() != 1 or bt.numel() < nb:
                raise ValueError(
                    f"sequence {i}: block_table needs >= {nb} blocks for {cls_[i]} tokens, "
                    f"got shape {tuple(bt.shape)}"
                )
        ctx_blocks = torch.cat([bt[:nb] for bt, nb in zip(batch.block_tables, nbs, strict=True)])
        ctx_blocks = ctx_blocks.to(device=device, dtype=torch.int64)
        first_block = [0]
        for nb in nbs[:-1]:
            first_block.append(first_block[-1] + nb)
        key_starts = [b * block_size for b in first_block]
        new_positions = torch.cat(
            [torch.arange(c - q, c, device=device) for q, c in zip(qls, cls_, strict=True)]
        )
        # each new token's block: its sequence's first block in ctx_blocks + position // bs
        token_first_block = torch.repeat_interleave(
            torch.tensor(first_block, device=device), torch.tensor(qls, device=device)
        )
        block_of_token = ctx_blocks[token_first_block + new_positions // block_size]
        new_slots = block_of_token * block_size + new_positions % block_size
        meta = cls(
            backend, group, block_size, qls, cls_, ctx_blocks, key_starts, new_slots, new_positions
        )
        if backend == "loop":
            meta.loop_masks = [
                None if q == 1 else _causal_mask(q, c, group, device)
                for q, c in zip(qls, cls_, strict=True)
            ]
        elif backend == "padded":
            per_seq = _context_slots(ctx_blocks, first_block, cls_, block_size)
            b, max_q, max_c = len(qls), max(qls), max(cls_)
            meta.pad_q_index = torch.cat(
                [torch.arange(q, device=device) + i * max_q for i, q in enumerate(qls)]
            )
            slots = torch.empty((b, max_c), dtype=torch.int64, device=device)
            mask = torch.zeros((b, 1, group * max_q, max_c), dtype=torch.bool, device=device)
            rows = torch.arange(max_q, device=device).repeat(group)
            cols = torch.arange(max_c, device=device)
            for i, (s, q, c) in enumerate(zip(per_seq, qls, cls_, strict=True)):
                slots[i, :c] = s
                slots[i, c:] = s[0]  # any written slot: masked out, but finite
                # padded query rows (>= q) see key 0 only, so no row is fully masked
                limit = torch.where(rows < q, c - q + rows, 0)
                mask[i, 0] = cols[None, :] <= limit[:, None]
            meta.pad_slots, meta.pad_mask = slots.view(-1), mask
        else:
            meta.ctx_slots = torch.cat(_context_slots(ctx_blocks, first_block, cls_, block_size))
            seq_of_key = torch.repeat_interleave(
                torch.arange(len(qls), device=device), torch.tensor(cls_, device=device)
            )
            key_pos = torch.cat([torch.arange(c, device=device) for c in cls_])
            seq_of_q = torch.repeat_interleave(
                torch.arange(len(qls), device=device), torch.tensor(qls, device=device)
            )
            mask = (seq_of_q[:, None] == seq_of_key[None, :]) & (
                key_pos[None, :] <= new_positions[:, None]
            )
            meta.varlen_mask = mask.repeat(group, 1)
        return meta


def _context_slots(
    ctx_blocks: torch.Tensor, first_block: list[int], context_lens: list[int], block_size: int
) -> list[torch.Tensor]:
    """Per sequence, the exact slots of positions ``[0, context_len)``.

    The padded and varlen backends mask keys rather than slicing them, so they must
    never read the unwritten tail of a last block (it may hold anything, NaN included).
    """
    return [
        slots_for_positions(ctx_blocks[f:], c, block_size)
        for f, c in zip(first_block, context_lens, strict=True)
    ]


def _causal_mask(q: int, c: int, group: int, device: torch.device) -> torch.Tensor:
    """``[group * q, c]`` bool: row ``r`` (query ``r % q``) sees keys ``<= c - q + r % q``."""
    rows = torch.arange(q, device=device).repeat(group)
    return torch.arange(c, device=device)[None, :] <= (c - q + rows)[:, None]


def _fold(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[L, H, d]`` -> ``[Hkv, group * L, d]``.

    Row ``g * L + i`` of KV head ``kv`` is query ``i`` of head ``kv * group + g``.
    """
    length, num_heads, d = q.shape
    group = num_heads // num_kv_heads
    return (
        q.view(length, num_kv_heads, group, d)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group * length, d)
    )


def _unfold(o: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of :func:`_fold` flattened: ``[Hkv, group * L, d]`` -> ``[L, H * d]``."""
    num_kv_heads, rows, d = o.shape
    group = rows // length
    return (
        o.view(num_kv_heads, group, length, d)
        .permute(2, 0, 1, 3)
        .reshape(length, num_kv_heads * group * d)
    )


class GatherWorkspace:
    """Reusable buffers that contexts are gathered into, one for K and one for V.

    A step gathers megabytes of K/V per layer. Allocating that afresh each layer
    costs page faults on CPU (glibc hands large blocks back to the OS on free),
    which measured 4x the copy itself in ``bench_engine.py``; reusing one buffer
    pair per model removes them. The buffers grow to the largest step seen and
    are never shrunk. Not reentrant: one forward at a time per workspace.
    """

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def buffers(self, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``[rows, *like.shape[1:]]`` tensors of ``like``'s dtype and device (stale data)."""
        k = self._k
        if (
            k is None
            or k.shape[0] < rows
            or k.shape[1:] != like.shape[1:]
            or k.dtype != like.dtype
            or k.device != like.device
        ):
            shape = (rows, *like.shape[1:])
            self._k = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._v = torch.empty(shape, dtype=like.dtype, device=like.device)
        assert self._k is not None and self._v is not None
        return self._k[:rows], self._v[:rows]


def _gather(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: torch.Tensor,
    rows_per_index: int,
    workspace: GatherWorkspace | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows ``[i * rows_per_index, (i + 1) * rows_per_index)`` for each ``i`` in ``index``.

    ``rows_per_index`` is ``block_size`` to gather whole blocks or 1 for slots.
    Returns ``[len(index) * rows_per_index, Hkv, d]`` tensors, views of the
    workspace's buffers when one is given (valid until its next use).
    """
    num_kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    rows = index.numel() * rows_per_index
    out: list[torch.Tensor] = []
    bufs = (None, None) if workspace is None else workspace.buffers(k_cache, rows)
    for cache, buf in zip((k_cache, v_cache), bufs, strict=True):
        src = cache.view(-1, rows_per_index, num_kv_heads, d)
        if buf is None:
            got = src.index_select(0, index)
        else:
            dst = buf.view(-1, rows_per_index, num_kv_heads, d)
            got = torch.index_select(src, 0, index, out=dst)
        out.append(got.view(rows, num_kv_heads, d))
    return out[0], out[1]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    workspace: GatherWorkspace | None = None,
) -> torch.Tensor:
    """Attention of the batch's queries over their paged contexts.

    ``q``: ``[num_tokens, num_heads, head_dim]``; ``k_cache``/``v_cache``: one
    layer of the pool, already holding this step's new K/V. Returns
    ``[num_tokens, num_heads * head_dim]``. Reads the pool, never writes it;
    overwrites ``workspace``'s buffers when one is given (else allocates).
    """
    num_kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    if meta.backend == "loop":
        keys, values = _gather(k_cache, v_cache, meta.ctx_blocks, meta.block_size, workspace)
        outs = []
        q_start = 0
        masks = meta.loop_masks or [None] * len(meta.query_lens)
        for ql, cl, k_start, mask in zip(
            meta.query_lens, meta.context_lens, meta.key_starts, masks, strict=True
        ):
            qi = _fold(q[q_start : q_start + ql], num_kv_heads)
            ki = keys[k_start : k_start + cl].transpose(0, 1)
            vi = values[k_start : k_start + cl].transpose(0, 1)
            o = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask)
            outs.append(_unfold(o[0], ql))
            q_start += ql
        return torch.cat(outs) if len(outs) > 1 else outs[0]
    if meta.backend == "padded":
        assert meta.pad_mask is not None and meta.pad_slots is not None
        assert meta.pad_q_index is not None
        b, _, rows, max_c = meta.pad_mask.shape
        max_q = rows // meta.group
        num_heads = q.shape[1]
        qp = q.new_zeros((b * max_q, num_heads, d)).index_copy_(0, meta.pad_q_index, q)
        qp = qp.view(b, max_q, num_kv_heads, meta.group, d).permute(0, 2, 3, 1, 4)
        qp = qp.reshape(b, num_kv_heads, rows, d)
        kp, vp = _gather(k_cache, v_cache, meta.pad_slots, 1, workspace)
        kp, vp = kp.view(b, max_c, num_kv_heads, d), vp.view(b, max_c, num_kv_heads, d)
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=meta.pad_mask
        )
        o = o.view(b, num_kv_heads, meta.group, max_q, d).permute(0, 3, 1, 2, 4)
        return o.reshape(b * max_q, num_heads * d).index_select(0, meta.pad_q_index)
    assert meta.ctx_slots is not None
    keys, values = _gather(k_cache, v_cache, meta.ctx_slots, 1, workspace)
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)
    qf = _fold(q, num_kv_heads)
    o = F.scaled_dot_product_attention(
        qf[None], keys[None], values[None], attn_mask=meta.varlen_mask
    )
    return _unfold(o[0], q.shape[0])


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
