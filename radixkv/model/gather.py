"""What every paged attention backend shares: reading K/V out of the pool, and head folding.

- :func:`gather_kv` copies K/V rows of whole blocks (or single slots) out of one
  layer of the pool, into a reused :class:`GatherWorkspace` when given one.
- :func:`fold_heads` / :func:`unfold_heads`: grouped-query attention folds each KV
  head's ``group = num_heads / num_kv_heads`` query heads into the query-length
  axis, so K/V are never repeated: query head ``h`` uses KV head ``h // group``
  (Hugging Face's ``repeat_kv`` convention).
- :func:`causal_mask`: the boolean mask of one sequence's folded queries.
- :func:`indices_to_device`: several host index arrays to the device in one copy.

Public within the model tier (:mod:`~radixkv.model.attention` and
:mod:`~radixkv.model.cascade` both build on it); not part of ``radixkv.model``'s API.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

__all__ = [
    "GatherWorkspace",
    "causal_mask",
    "fold_heads",
    "gather_kv",
    "indices_to_device",
    "unfold_heads",
]


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
        """Two ``[rows, *like.shape[1:]]`` tensors of ``like``'s dtype and device (stale data).

        Views of the workspace's buffers, valid until the next call.
        Complexity: O(1), or an allocation of ``rows`` rows when the buffers must grow.
        """
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


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: torch.Tensor,
    rows_per_index: int,
    workspace: GatherWorkspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows ``[i * rows_per_index, (i + 1) * rows_per_index)`` for each ``i`` in ``index``.

    ``k_cache``/``v_cache``: one layer of the pool, ``[num_slots, Hkv, d]``;
    ``index``: 1-D int64 on their device; ``rows_per_index`` is ``block_size`` to
    gather whole blocks or 1 for slots. Returns ``[len(index) * rows_per_index,
    Hkv, d]`` tensors, views of the workspace's buffers when one is given (valid
    until its next use), else new tensors. Reads the pool, never writes it.
    Complexity: O(len(index) * rows_per_index * Hkv * d) copied.
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


def fold_heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[L, H, d]`` -> ``[Hkv, group * L, d]`` (a copy).

    Row ``g * L + i`` of KV head ``kv`` is query ``i`` of head ``kv * group + g``.
    ``H`` must be a multiple of ``num_kv_heads``. Complexity: O(L * H * d).
    """
    length, num_heads, d = q.shape
    group = num_heads // num_kv_heads
    return (
        q.view(length, num_kv_heads, group, d)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group * length, d)
    )


def unfold_heads(o: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of :func:`fold_heads`, flattened: ``[Hkv, group * L, d]`` -> ``[L, H * d]``.

    Complexity: O(L * H * d).
    """
    num_kv_heads, rows, d = o.shape
    group = rows // length
    return (
        o.view(num_kv_heads, group, length, d)
        .permute(2, 0, 1, 3)
        .reshape(length, num_kv_heads * group * d)
    )


def causal_mask(
    query_len: int, context_len: int, group: int, device: torch.device, first_key: int = 0
) -> torch.Tensor:
    """``[group * query_len, context_len - first_key]`` bool, for folded queries.

    The sequence's queries sit at positions ``[context_len - query_len,
    context_len)``; row ``r`` (query ``r % query_len``) sees key position ``p``
    iff ``p <= context_len - query_len + r % query_len``. Column ``j`` is key
    position ``first_key + j`` (cascade attention masks a suffix of the keys).
    Built on ``device`` from Python ints: no host-to-device copy.
    Complexity: O(group * query_len * context_len).
    """
    rows = torch.arange(query_len, device=device).repeat(group)
    keys = torch.arange(first_key, context_len, device=device)
    return keys[None, :] <= (context_len - query_len + rows)[:, None]


def indices_to_device(
    arrays: Mapping[str, np.ndarray], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The int64 host ``arrays`` as 1-D tensors on ``device``, in one copy.

    The arrays are concatenated on the host and moved together (one
    host-to-device transfer, however many arrays); the results are views of that
    one tensor, under the same names. On the CPU nothing is copied twice: the
    concatenation is shared with torch. On CUDA the concatenation is written
    into page-locked memory and copied asynchronously, so the host does not wait
    for the device's queue to drain (a copy from pageable memory would); torch's
    caching host allocator keeps that buffer until the copy has run.
    Complexity: O(total entries).
    """
    names = list(arrays)
    parts = [np.asarray(arrays[n], dtype=np.int64).reshape(-1) for n in names]
    sizes = [p.size for p in parts]
    device = torch.device(device)
    if device.type == "cuda":
        staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
        if parts:
            np.concatenate(parts, out=staging.numpy())
        moved = staging.to(device, non_blocking=True)
    else:
        flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        moved = torch.from_numpy(flat).to(device)
    return dict(zip(names, moved.split(sizes), strict=True))
