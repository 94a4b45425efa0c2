"""Cascade attention: queries of sequences that share cached prefix blocks attend to them once.

With a prefix cache, sequences that start with the same prompt hold the *same*
blocks for it (same block ids). Per-sequence attention (the ``loop`` backend)
gathers and reads those blocks once per sequence and runs one small attention
call each. Cascade attention (as in FlashInfer's cascade / Hydragen) splits
each member's keys at the shared prefix:

1. all members' queries attend to the shared prefix in one call, with no mask
   (every query of a member comes after the prefix);
2. each member's queries attend to its own suffix (causal mask inside it);
3. the two partial results merge exactly through their log-sum-exps:
   ``lse = logaddexp(lse1, lse2)``, ``o = o1 * e^(lse1 - lse) + o2 * e^(lse2 - lse)``.

The shared blocks are gathered once per group, and step 1 is one larger
attention call instead of one per member. The arithmetic is the same softmax
attention, regrouped, so results equal the ``loop`` backend's up to float
rounding (tests check both against the dense reference).

Groups: sequences whose block tables start with the same block; a group's
prefix is its members' longest common run of leading block ids, cut to end
before any member's first new token (at least ``MIN_PREFIX_BLOCKS`` blocks,
else the members run as in ``loop``). The plan is made from the host-side block
tables: planning reads nothing back from the device.
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
    unfold_heads,
)

__all__ = ["MIN_PREFIX_BLOCKS", "CascadePlan", "cascade_attention", "plan_cascade"]

MIN_PREFIX_BLOCKS = 2

# CPU flash attention that also returns the log-sum-exp of each query row (aten's
# private op behind scaled_dot_product_attention on CPU). Elsewhere: plain math.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class CascadePlan:
    """How one step's sequences split into shared-prefix groups, and its index tensors.

    ``query_lens``/``context_lens``/``block_size`` describe the step as for
    :class:`~radixkv.model.attention.AttentionMetadata`. ``gather_blocks``
    (int64, on the step's device) lists, in order, each group's prefix blocks and
    then every sequence's own blocks (for a member, only those after its group's
    prefix); ``prefix_starts[g]`` / ``seq_starts[i]`` are their first rows in the
    gathered K/V. ``group_of[i]`` is sequence ``i``'s group or -1; ``masks[i]``
    masks the keys sequence ``i`` reads from its own rows: for a member the
    causal mask's suffix columns, additive (float32, the flash op wants that);
    otherwise the ``loop`` backend's boolean mask (None for one query).
    """

    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    groups: list[list[int]]
    prefix_lens: list[int]
    prefix_starts: list[int]
    group_of: list[int]
    gather_blocks: torch.Tensor
    seq_starts: list[int]
    masks: list[torch.Tensor | None]


def plan_cascade(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[np.ndarray | Sequence[int]],
    *,
    block_size: int,
    group_size: int,
    device: torch.device | str,
) -> CascadePlan | None:
    """Group the step's sequences by shared leading blocks; None if no group qualifies.

    Host inputs as for :meth:`~radixkv.model.forward_batch.ForwardBatch.build`
    (which validates them): ``block_tables[i]`` holds at least
    ``ceil(context_lens[i] / block_size)`` block ids. Grouping reads only those
    host tables; a plan costs one host-to-device copy (``gather_blocks``) and its
    masks are made on ``device``, shaped for ``group_size`` query heads per KV head.
    Complexity: O(total context blocks) plus the masks.
    """
    bs = block_size
    qls, cls_ = [int(q) for q in query_lens], [int(c) for c in context_lens]
    tables = [
        np.asarray(t)[: -(-c // bs)].tolist() for t, c in zip(block_tables, cls_, strict=True)
    ]
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        by_first.setdefault(table[0], []).append(i)
    groups, prefix_blocks = [], []
    for members in by_first.values():
        if len(members) < 2:
            continue
        # a prefix block must hold no member's new tokens: end before the earliest one
        limit = min((cls_[i] - qls[i]) // bs for i in members)
        first = tables[members[0]]
        n = 0
        while n < limit and all(tables[i][n] == first[n] for i in members[1:]):
            n += 1
        if n >= MIN_PREFIX_BLOCKS:
            groups.append(members)
            prefix_blocks.append(first[:n])
    if not groups:
        return None
    device = torch.device(device)
    group_of = [-1] * len(tables)
    for g, members in enumerate(groups):
        for i in members:
            group_of[i] = g
    order: list[int] = []
    prefix_starts = []
    for blocks in prefix_blocks:
        prefix_starts.append(len(order) * bs)
        order.extend(blocks)
    seq_starts: list[int] = []
    masks: list[torch.Tensor | None] = []
    for i, (table, q, c) in enumerate(zip(tables, qls, cls_, strict=True)):
        skip = len(prefix_blocks[group_of[i]]) if group_of[i] >= 0 else 0
        seq_starts.append(len(order) * bs)
        order.extend(table[skip:])
        if q == 1:
            masks.append(None)
        elif skip:
            seen = causal_mask(q, c, group_size, device, first_key=skip * bs)
            masks.append(torch.zeros(seen.shape, device=device).masked_fill_(~seen, -torch.inf))
        else:
            masks.append(causal_mask(q, c, group_size, device))
    return CascadePlan(
        query_lens=qls,
        context_lens=cls_,
        block_size=bs,
        groups=groups,
        prefix_lens=[len(b) * bs for b in prefix_blocks],
        prefix_starts=prefix_starts,
        group_of=group_of,
        gather_blocks=torch.tensor(order, dtype=torch.int64).to(device),
        seq_starts=seq_starts,
        masks=masks,
    )


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[1, Hkv, R, d]`` over ``k``/``v`` ``[1, Hkv, L, d]``.

    Returns the output ``[1, Hkv, R, d]`` and each row's log-sum-exp of its scaled
    scores ``[1, Hkv, R]`` (float32).
    """
    if mask is not None:
        mask = mask.to(q.dtype)
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(q, k, v, attn_mask=mask)[:2]
        return out, lse.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v)
    return out, lse


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CascadePlan,
    workspace: GatherWorkspace | None = None,
) -> torch.Tensor:
    """Attention of the batch's queries over their paged contexts, shared prefixes once.

    Same contract as :func:`radixkv.model.attention.paged_attention`: ``q`` is
    ``[num_tokens, num_heads, head_dim]``, ``k_cache``/``v_cache`` one layer of
    the pool holding this step's K/V, all on ``plan``'s device; returns
    ``[num_tokens, num_heads * head_dim]``. Reads the pool, never writes it.
    Complexity: one gather of ``plan.gather_blocks`` plus one attention call per
    group and one per sequence.
    """
    num_kv_heads = k_cache.shape[1]
    qls = plan.query_lens
    keys, values = gather_kv(k_cache, v_cache, plan.gather_blocks, plan.block_size, workspace)
    q_starts = [0]
    for ql in qls[:-1]:
        q_starts.append(q_starts[-1] + ql)
    folded = [fold_heads(q[s : s + ql], num_kv_heads) for s, ql in zip(q_starts, qls, strict=True)]
    # 1. each group's queries, all together, over its shared prefix
    prefix_part: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for members, start, length in zip(
        plan.groups, plan.prefix_starts, plan.prefix_lens, strict=True
    ):
        kp = keys[start : start + length].transpose(0, 1)[None]
        vp = values[start : start + length].transpose(0, 1)[None]
        rows = [folded[i].shape[1] for i in members]
        out, lse = _attend(torch.cat([folded[i] for i in members], dim=1)[None], kp, vp, None)
        for i, o, m in zip(members, out.split(rows, dim=2), lse.split(rows, dim=2), strict=True):
            prefix_part[i] = (o, m)
    outs = []
    for i, (ql, cl) in enumerate(zip(qls, plan.context_lens, strict=True)):
        g = plan.group_of[i]
        length = cl - (plan.prefix_lens[g] if g >= 0 else 0)
        s = plan.seq_starts[i]
        ki = keys[s : s + length].transpose(0, 1)[None]
        vi = values[s : s + length].transpose(0, 1)[None]
        qi = folded[i][None]
        if g < 0:
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=plan.masks[i])
        else:
            # 2. the member's own suffix, then 3. merge the two softmax parts exactly
            o2, lse2 = _attend(qi, ki, vi, plan.masks[i])
            o1, lse1 = prefix_part[i]
            lse = torch.logaddexp(lse1, lse2)
            w1 = torch.exp(lse1 - lse)[..., None].to(o1.dtype)
            w2 = torch.exp(lse2 - lse)[..., None].to(o2.dtype)
            o = o1 * w1 + o2 * w2
        outs.append(unfold_heads(o[0], ql))
    return torch.cat(outs) if len(outs) > 1 else outs[0]
