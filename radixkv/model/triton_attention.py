"""The ``triton`` backend: paged attention kernels that read K/V in place through the block table.

The other backends gather each context out of the pool into a dense buffer and
call ``scaled_dot_product_attention``; on a GPU that is a dozen launches per
layer and a copy of every context. Here one kernel reads K/V straight from the
pool: key position ``p`` of sequence ``s`` lives at slot ``block_table[s, p //
block_size] * block_size + p % block_size``, exactly the pages the radix tree
hands out. Three kernels:

- ``_store_kv_kernel`` writes a step's new K/V at ``slot_mapping``, skipping
  negative slots (the padding rows of a CUDA-graph batch write nowhere).
- ``_attention_kernel`` is flash attention over a page table (online softmax,
  fp32 accumulators). A program owns one sequence, one KV head and a tile of
  ``BLOCK_M`` *folded* query rows (row ``r`` is query ``r // group`` of query
  head ``kv_head * group + r % group``), so grouped-query heads share every K/V
  load, and a decode token's ``group`` heads fill one tile. A prefill config may
  turn folding off (``FOLD_GQA``): then a program owns one query head's tile of
  ``BLOCK_M`` queries. It serves
  prefill/extend (causal: query ``i`` of a sequence with ``query_len`` new
  tokens and ``context_len`` in total sees keys ``[0, context_len - query_len +
  i]``) and, in *split* mode, decode: each sequence's context is cut into
  ``SPLIT_LEN``-token pieces attended in parallel (flash-decoding). A program
  reads its keys in two passes (``_attend_keys``): those every row of its tile
  sees, whole ``BLOCK_N`` tiles up to its first query's diagonal, unmasked; then
  the diagonal and the tail, masked.
- ``_merge_splits_kernel`` merges a decode's pieces through their log-sum-exps.

How many pieces a decode is cut into depends on its own context length only,
so a sequence's decode attention rounds the same whatever else shares the step
(a padded CUDA-graph batch included).

The metadata (:class:`TritonAttention`) is four small int64 tensors and two
launch sizes; it holds no Python per-sequence state that a kernel reads, which
is what lets :mod:`radixkv.model.cuda_graphs` capture a decode step once and
replay it on new contents of the same tensors.

Triton compiles these for CUDA. On the CPU they run only under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported), which is
slow and is how the test suite checks them against the dense reference without a
GPU; bfloat16 is not supported there. fp32 inputs take three TF32 tensor-core
products per dot on CUDA (``tf32x3``: about fp32's accuracy, not TF32's), so the
backend agrees with the others to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["SPLIT_LEN", "TritonAttention", "decode_splits"]

# Tokens of context per decode piece. 256 keys x 64 dims x 2 (K and V) is a few
# hundred KB per program: enough work to amortise a program, few enough that a
# 32-sequence batch of 1-2k contexts fills an H100's 132 SMs several times over.
SPLIT_LEN = 256
# Launch configurations: folded query rows per program (BLOCK_M; a decode's tile is
# its group padded to 16), keys per inner iteration (BLOCK_N), warps, pipeline
# stages, and for prefill FOLD_GQA (default True: a tile folds a KV head's query
# heads, `group` rows per query; False: a tile is BLOCK_M queries of one head, as
# FlashAttention's are). By pool dtype size: fp32 tiles take twice the shared memory.
# Chosen on an H200 by bench_decode.py --sweep (docs/engine.md); module-level so it
# can sweep them.
PREFILL_CONFIGS = {
    4: {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    2: {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
}
DECODE_CONFIGS = {
    4: {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    2: {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
}
_LOG2E = 1.4426950408889634


def decode_splits(context_len: int) -> int:
    """Pieces a decode with ``context_len`` keys is cut into: ``ceil(context_len / SPLIT_LEN)``."""
    return -(-context_len // SPLIT_LEN)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _store_kv_kernel(
    K_new, V_new, K_cache, V_cache, Slots,
    stride_new_t, stride_cache_t,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """K/V row ``t`` (``ROW = Hkv * head_dim`` values) to slot ``Slots[t]``; nothing if < 0."""
    t = tl.program_id(0)
    slot = tl.load(Slots + t)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        ok = offs < ROW
        k = tl.load(K_new + t * stride_new_t + offs, mask=ok)
        v = tl.load(V_new + t * stride_new_t + offs, mask=ok)
        dst = slot.to(tl.int64) * stride_cache_t + offs
        tl.store(K_cache + dst, k.to(K_cache.dtype.element_ty), mask=ok)
        tl.store(V_cache + dst, v.to(V_cache.dtype.element_ty), mask=ok)


@triton.jit
def _load_tile(ptrs, key_ok, d_ok, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_D]`` tile of K or V at ``ptrs``: masked by key and dim, by dim
    alone (a head dim below the tile's), or not at all."""
    if MASKED:
        return tl.load(ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=d_ok[None, :], other=0.0)


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """``a @ b`` in fp32 accumulators; fp32 inputs at ``FP32_DOT`` precision (e.g. tf32x3)."""
    if FP32_DOT == "":
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision=FP32_DOT)


@triton.jit
def _attend_keys(
    acc, l_i, m_i, q, K, V, table, kv_head, offs_d, d_ok, limit,
    start, end, hi, qk_scale, stride_kt, stride_kh,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys ``[start, end)``; returns the updated ``(acc, l_i, m_i)``.

    Unmasked (``MASKED`` false), every key of every iteration is below ``hi`` and
    visible to every row of the tile, so neither the loads nor the scores are masked
    and the running maximum stays finite: this is the bulk of a long context. The
    masked pass takes the keys near the causal diagonal and past ``hi``.
    """
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi  # all true in the unmasked pass, which never reads it
        if MASKED:
            block = tl.load(table + pos // PAGE, mask=key_ok, other=0)
        else:
            block = tl.load(table + pos // PAGE)
        slot = block.to(tl.int64) * PAGE + pos % PAGE
        kv_off = slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = _load_tile(K + kv_off, key_ok, d_ok, MASKED, EVEN_D)
        s = _dot(q, tl.trans(k), FP32_DOT)
        if MASKED:
            s = s * qk_scale
            visible = (pos[None, :] <= limit[:, None]) & key_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps -inf; exp2 of (-inf) - (-inf) is NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
        else:
            # the scale rides on the subtraction: one fused multiply-add per score
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_safe = m_new
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V + kv_off, key_ok, d_ok, MASKED, EVEN_D)
        pv = _dot(p.to(v.dtype), v, FP32_DOT)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_kernel(
    Q, K, V, Out, PartOut, PartLse,
    QStart, QLen, CtxLen, BlockTable,
    qk_scale, max_splits,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, FOLD: tl.constexpr, NUM_HEADS: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_LEN: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    # FOLD of a KV head's GROUP query heads share a tile (GROUP or 1); a program has one
    # such set of heads: the KV head's GROUP // FOLD programs read its K/V alike
    heads = tl.program_id(1)
    kv_head = heads // (GROUP // FOLD)
    first_head = kv_head * GROUP + heads % (GROUP // FOLD) * FOLD
    tile = tl.program_id(2)
    q_len = tl.load(QLen + seq)
    ctx = tl.load(CtxLen + seq)
    q_start = tl.load(QStart + seq)
    if SPLIT:
        split = tile
        tile = 0
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // FOLD
    head = first_head + rows % FOLD
    row_ok = qi < q_len
    prefix = ctx - q_len
    limit = prefix + qi  # the last key position each row sees
    if SPLIT:
        lo = split.to(tl.int64) * SPLIT_LEN
        hi = tl.minimum(ctx, lo + SPLIT_LEN)
        # a decode's one query sees every key of its piece
        full = lo + (hi - lo) // BLOCK_N * BLOCK_N
    else:
        lo = 0
        last_q = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // FOLD)
        hi = prefix + last_q + 1
        # keys every row of the tile sees: up to its first query's diagonal
        full = (prefix + tile * BLOCK_M // FOLD + 1) // BLOCK_N * BLOCK_N
    # tiles past a sequence's rows (or pieces past its context) have nothing to do;
    # the padding sequences of a graph batch (q_len 0, context 0) stop here
    if (tile * BLOCK_M < q_len * FOLD) & (lo < hi):
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_rows = (q_start + qi).to(tl.int64)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = BlockTable + seq.to(tl.int64) * stride_bt
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, K, V, table, kv_head, offs_d, d_ok, limit,
            lo, full, hi, qk_scale, stride_kt, stride_kh,
            PAGE=PAGE, BLOCK_N=BLOCK_N, EVEN_D=HEAD_DIM == BLOCK_D, MASKED=False,
            FP32_DOT=FP32_DOT,
        )  # fmt: skip
        acc, l_i, m_i = _attend_keys(
            acc, l_i, m_i, q, K, V, table, kv_head, offs_d, d_ok, limit,
            full, hi, hi, qk_scale, stride_kt, stride_kh,
            PAGE=PAGE, BLOCK_N=BLOCK_N, EVEN_D=HEAD_DIM == BLOCK_D, MASKED=True,
            FP32_DOT=FP32_DOT,
        )  # fmt: skip
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if SPLIT:
            # rows of a decode are its GROUP heads (qi == 0; FOLD is GROUP)
            part = (seq * NUM_HEADS + head).to(tl.int64) * max_splits + split
            tl.store(
                PartOut + part[:, None] * BLOCK_D + offs_d[None, :],
                out,
                mask=row_ok[:, None] & d_ok[None, :],
            )
            tl.store(PartLse + part, m_i + tl.log2(l_safe), mask=row_ok)  # base 2
        else:
            tl.store(
                Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                out.to(Out.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )


@triton.jit
def _merge_splits_kernel(
    Out, PartOut, PartLse, QStart, CtxLen,
    max_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
):  # fmt: skip
    """One decode token's head: the weighted sum of its pieces (zeros for a padding row).

    The pieces' log-sum-exps are in base 2, as the attention kernel's scores are.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(CtxLen + seq)
    q_start = tl.load(QStart + seq)
    n = (ctx + SPLIT_LEN - 1) // SPLIT_LEN
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    base = (seq * NUM_HEADS + head).to(tl.int64) * max_splits
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(0, n):
        lse = tl.load(PartLse + base + j)
        o = tl.load(PartOut + (base + j) * BLOCK_D + offs_d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m, lse)
        scale = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * scale + w * o
        total = total * scale + w
        m = m_new
    total = tl.where(total == 0.0, 1.0, total)
    dst = Out + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(dst, (acc / total).to(Out.dtype.element_ty), mask=d_ok)


@dataclass
class TritonAttention:
    """A step's metadata for the triton kernels, and the two calls a layer makes.

    Tensors (int64, on the pool's device, one entry per sequence):
    ``query_starts`` (first row of the sequence's new tokens in ``q``),
    ``query_lens``, ``context_lens`` (0 for a padding sequence: it is skipped),
    and ``block_tables`` ``[num_seqs, width]`` (row ``s`` holds at least
    ``ceil(context_len / block_size)`` block ids; the rest is never read).
    Launch sizes (Python ints, fixed for a captured graph): ``max_query_len``
    (1 = a decode-only step, run in split mode) and ``max_splits`` (pieces a
    decode grid holds per sequence: at least ``decode_splits`` of its longest
    context). ``num_tokens`` is the rows of ``q``.

    The tensors are read at launch, never written, so a CUDA graph replays with
    whatever they hold then.
    """

    query_starts: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int
    max_splits: int

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

    def store(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write new ``k``/``v`` (``[n, Hkv, d]``) into one layer at ``slot_mapping`` (``[n]``).

        A negative slot is skipped. Casts to the pool's dtype. One launch.
        """
        n = slot_mapping.shape[0]
        if n == 0:
            return
        k = k.contiguous()
        v = v.contiguous()
        row = k_cache.shape[1] * k_cache.shape[2]
        _store_kv_kernel[(n,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k_cache.stride(0),
            ROW=row, BLOCK=_next_pow2(row),
        )  # fmt: skip

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` (``[num_tokens, H, d]``) over the paged contexts: ``[T, H*d]``.

        ``k_cache``/``v_cache``: one layer of the pool (``[num_slots, Hkv, d]``,
        contiguous), already holding this step's new K/V. Allocates the output
        (and, for a decode step, the pieces' scratch). Two launches for a decode
        step (pieces, merge), one otherwise.
        """
        num_tokens, num_heads, d = q.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        q = q.contiguous()
        out = torch.empty_like(q)
        block_d = max(16, _next_pow2(d))
        # fp32: three TF32 products on CUDA (about fp32's accuracy on tensor cores);
        # the interpreter computes in fp32 whatever it is told
        fp32_dot = ""
        if q.dtype == torch.float32:
            fp32_dot = "tf32x3" if q.is_cuda else "ieee"
        n = self.num_seqs
        size = k_cache.element_size()
        common = dict(
            GROUP=group, NUM_HEADS=num_heads, PAGE=self.block_size,
            HEAD_DIM=d, BLOCK_D=block_d, SPLIT_LEN=SPLIT_LEN, FP32_DOT=fp32_dot,
        )  # fmt: skip
        strides = (
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            out.stride(0), out.stride(1), self.block_tables.stride(0),
        )  # fmt: skip
        scale = _LOG2E / d**0.5  # scores in base 2: exp2 is the cheaper instruction
        if self.max_query_len == 1:
            splits = max(1, self.max_splits)
            part_out = torch.empty(
                (n * num_heads * splits, block_d), dtype=torch.float32, device=q.device
            )
            part_lse = torch.empty(n * num_heads * splits, dtype=torch.float32, device=q.device)
            _attention_kernel[(n, num_kv_heads, splits)](
                q, k_cache, v_cache, out, part_out, part_lse,
                self.query_starts, self.query_lens, self.context_lens, self.block_tables,
                scale, splits, *strides,
                BLOCK_M=max(16, _next_pow2(group)), SPLIT=True, FOLD=group,
                **DECODE_CONFIGS[min(size, 4)], **common,
            )  # fmt: skip
            _merge_splits_kernel[(n, num_heads)](
                out, part_out, part_lse, self.query_starts, self.context_lens,
                splits, out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, HEAD_DIM=d, BLOCK_D=block_d,
                SPLIT_LEN=SPLIT_LEN,
            )  # fmt: skip
        else:
            config = dict(PREFILL_CONFIGS[min(size, 4)])
            fold = group if config.pop("FOLD_GQA", True) else 1
            tiles = -(-self.max_query_len * fold // config["BLOCK_M"])
            _attention_kernel[(n, num_heads // fold, tiles)](
                q, k_cache, v_cache, out, out, out,
                self.query_starts, self.query_lens, self.context_lens, self.block_tables,
                scale, 1, *strides, SPLIT=False, FOLD=fold, **config, **common,
            )  # fmt: skip
        return out.view(num_tokens, num_heads * d)
