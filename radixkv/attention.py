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

from radixkv.forward_batch import ForwardBatch
from radixkv.kvpool import slots_for_positions

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
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

    ``ctx_slots`` concatenates each sequence's context slots (positions ``[0,
    context_len)``); ``new_slots``/``new_positions`` are what the batch's
    ``slot_mapping``/``positions`` must equal. The remaining fields serve one backend.
    """

    backend: str
    group: int
    query_lens: list[int]
    context_lens: list[int]
    ctx_slots: torch.Tensor
    new_slots: torch.Tensor
    new_positions: torch.Tensor
    loop_masks: list[torch.Tensor | None] | None = None
    pad_q_index: torch.Tensor | None = None
    pad_slots: torch.Tensor | None = None
    pad_mask: torch.Tensor | None = None
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

        Complexity: O(total context).
        """
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        device = batch.input_ids.device if device is None else device
        qls, cls_ = list(batch.query_lens), list(batch.context_lens)
        per_seq = [
            slots_for_positions(
                torch.as_tensor(bt, dtype=torch.int64, device=device), c, block_size
            )
            for bt, c in zip(batch.block_tables, cls_, strict=True)
        ]
        ctx_slots = torch.cat(per_seq)
        new_slots = torch.cat([s[c - q :] for s, q, c in zip(per_seq, qls, cls_, strict=True)])
        new_positions = torch.cat(
            [torch.arange(c - q, c, device=device) for q, c in zip(qls, cls_, strict=True)]
        )
        meta = cls(backend, group, qls, cls_, ctx_slots, new_slots, new_positions)
        if backend == "loop":
            meta.loop_masks = [
                None if q == 1 else _causal_mask(q, c, group, device)
                for q, c in zip(qls, cls_, strict=True)
            ]
        elif backend == "padded":
            b, max_q, max_c = len(qls), max(qls), max(cls_)
            meta.pad_q_index = torch.cat(
                [torch.arange(q, device=device) + i * max_q for i, q in enumerate(qls)]
            )
            slots = torch.empty((b, max_c), dtype=torch.int64, device=device)
            mask = torch.zeros((b, 1, group * max_q, max_c), dtype=torch.bool, device=device)
            for i, (s, q, c) in enumerate(zip(per_seq, qls, cls_, strict=True)):
                slots[i, :c] = s
                slots[i, c:] = s[0]  # any written slot: masked out, but finite
                rows = torch.arange(max_q, device=device).repeat(group)
                cols = torch.arange(max_c, device=device)
                # padded query rows (>= q) see key 0 only, so no row is fully masked
                limit = torch.where(rows < q, c - q + rows, 0)
                mask[i, 0] = cols[None, :] <= limit[:, None]
            meta.pad_slots, meta.pad_mask = slots.view(-1), mask
        else:
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


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Attention of the batch's queries over their paged contexts.

    ``q``: ``[num_tokens, num_heads, head_dim]``; ``k_cache``/``v_cache``: one
    layer of the pool, already holding this step's new K/V. Returns
    ``[num_tokens, num_heads * head_dim]``. Reads the pool, never writes it.
    """
    num_kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    if meta.backend == "loop":
        keys = k_cache.index_select(0, meta.ctx_slots)
        values = v_cache.index_select(0, meta.ctx_slots)
        outs = []
        q_start = k_start = 0
        masks = meta.loop_masks or [None] * len(meta.query_lens)
        for ql, cl, mask in zip(meta.query_lens, meta.context_lens, masks, strict=True):
            qi = _fold(q[q_start : q_start + ql], num_kv_heads)
            ki = keys[k_start : k_start + cl].transpose(0, 1)
            vi = values[k_start : k_start + cl].transpose(0, 1)
            o = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask)
            outs.append(_unfold(o[0], ql))
            q_start += ql
            k_start += cl
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
        kp = k_cache.index_select(0, meta.pad_slots).view(b, max_c, num_kv_heads, d)
        vp = v_cache.index_select(0, meta.pad_slots).view(b, max_c, num_kv_heads, d)
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=meta.pad_mask
        )
        o = o.view(b, num_kv_heads, meta.group, max_q, d).permute(0, 3, 1, 2, 4)
        return o.reshape(b * max_q, num_heads * d).index_select(0, meta.pad_q_index)
    keys = k_cache.index_select(0, meta.ctx_slots).transpose(0, 1)
    values = v_cache.index_select(0, meta.ctx_slots).transpose(0, 1)
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
