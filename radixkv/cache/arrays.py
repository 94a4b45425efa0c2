"""Token sequences and block ids as the caches see them: 1-D int32 numpy arrays.

Every cache entry point converts its ``tokens`` argument with ``as_token_array``
and its ``blocks`` argument with ``as_block_array`` first, so bad input raises
before any state changes. Both take ordered sequences only (a ``set`` or a
``dict`` has no position order to give a block table) and accept torch tensors
without importing torch: a tensor can only exist once torch is imported, so
``sys.modules`` tells. ``common_prefix_len`` is the one longest-common-prefix
function of the package.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from radixkv.cache import kernels

__all__ = [
    "BLOCK_DTYPE",
    "TOKEN_DTYPE",
    "BlockSeq",
    "TokenSeq",
    "as_block_array",
    "as_token_array",
    "common_prefix_len",
]

TOKEN_DTYPE = np.int32
BLOCK_DTYPE = np.int32
_INFO = np.iinfo(np.int32)  # both dtypes are int32: one range check serves both
_INT32 = np.dtype(np.int32)
_INT64 = np.dtype(np.int64)
# array.array's C int code; 4 bytes on every platform numpy ships for, checked all the same.
_ARRAY_CODE = "i" if array.array("i").itemsize == 4 else None

# A list/tuple of ints, a 1-D integer numpy array, or a 1-D integer torch tensor.
TokenSeq = Sequence[int] | np.ndarray | Any
# The same for block ids (a block table: entry i holds positions [i * bs, (i + 1) * bs)).
BlockSeq = Sequence[int] | np.ndarray | Any


def as_token_array(tokens: TokenSeq) -> np.ndarray:
    """Return ``tokens`` as a C-contiguous 1-D int32 array (no copy when it already is one).

    Accepts a list or tuple of ints, a 1-D integer numpy array, or a 1-D
    integer torch tensor on any device. Raises ``TypeError`` for any other
    type, a non-integer dtype or entry, and ``ValueError`` for a wrong shape or
    ids outside int32; both name ``tokens`` and the first bad entry's index and
    value. The result may be ``tokens`` itself: do not write to it.

    Complexity: O(1) for an int32 C-contiguous array, else O(len(tokens)).

    >>> as_token_array([1, 2, 3])
    array([1, 2, 3], dtype=int32)
    """
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == TOKEN_DTYPE and tokens.ndim == 1 and tokens.flags.c_contiguous:
            return tokens  # the fast path: already what the caches use
        arr = tokens
    elif isinstance(tokens, (list, tuple)):
        if len(tokens) == 0:
            return np.empty(0, dtype=TOKEN_DTYPE)
        arr = _list_to_numpy(tokens, "tokens")
    elif _is_tensor(tokens):
        arr = _tensor_to_numpy(tokens, "tokens")
    else:
        raise TypeError(
            "tokens must be a list/tuple of ints, a 1-D integer numpy array or a 1-D integer "
            f"torch tensor, got {type(tokens).__name__}"
        )
    return _as_int32(arr, "tokens", "token ids")


def as_block_array(blocks: BlockSeq) -> np.ndarray:
    """Return block ids as a C-contiguous 1-D int32 array (no copy when it already is one).

    Accepts an ordered sequence: a list, tuple or other ``Sequence`` of ints
    (``range`` included; ``str``/``bytes`` not), a 1-D integer numpy array,
    or a 1-D integer torch tensor on any device. Raises ``TypeError`` naming
    ``blocks`` for anything else (a ``set``, a ``dict``, an iterator, an
    int, None: nothing that fixes which block holds which positions), a
    non-integer dtype or entry, and ``ValueError`` for a wrong shape or ids
    outside int32. Range against a pool is the allocator's check, not this
    one's. The result may be ``blocks`` itself: do not write to it.

    Complexity: O(1) for an int32 C-contiguous array, else O(len(blocks)).

    >>> as_block_array(range(3))
    array([0, 1, 2], dtype=int32)
    """
    if isinstance(blocks, np.ndarray):
        if blocks.dtype == BLOCK_DTYPE and blocks.ndim == 1 and blocks.flags.c_contiguous:
            return blocks  # the fast path: already what the caches use
        arr = blocks
    elif isinstance(blocks, (list, tuple)):
        if len(blocks) == 0:
            return np.empty(0, dtype=BLOCK_DTYPE)
        arr = _list_to_numpy(blocks, "blocks")
    elif _is_tensor(blocks):
        arr = _tensor_to_numpy(blocks, "blocks")
    elif isinstance(blocks, Sequence) and not isinstance(blocks, (str, bytes)):
        if len(blocks) == 0:
            return np.empty(0, dtype=BLOCK_DTYPE)
        arr = _list_to_numpy(list(blocks), "blocks")
    else:
        raise TypeError(
            "blocks must be an ordered sequence of block ids (a list/tuple of ints, a 1-D "
            f"integer numpy array or a 1-D integer torch tensor), got {type(blocks).__name__}"
        )
    return _as_int32(arr, "blocks", "block ids")


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int32 arrays (e.g. from ``as_token_array``).

    Raises ``TypeError`` if either is not a 1-D int32 numpy array.
    Complexity: O(length of the common prefix), one compiled loop.

    >>> common_prefix_len(as_token_array([1, 2, 3]), as_token_array([1, 2, 4, 5]))
    2
    """
    if type(a) is np.ndarray and type(b) is np.ndarray:  # the fast path (the tree's walk)
        if a.dtype is _INT32 and b.dtype is _INT32 and a.ndim == 1 and b.ndim == 1:
            return kernels.common_prefix_len(a, b)
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, np.ndarray) or x.dtype != np.int32 or x.ndim != 1:
            got = f"{x.dtype} array of shape {x.shape}" if isinstance(x, np.ndarray) else type(x)
            raise TypeError(f"{name} must be a 1-D int32 numpy array, got {got}")
    return int(kernels.common_prefix_len(a, b))


def _is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor; never imports torch (no torch loaded, no tensor)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _tensor_to_numpy(x: Any, what: str) -> np.ndarray:
    """A CPU numpy copy of an integer tensor; ``TypeError`` naming ``what`` for any other dtype."""
    dtype = x.dtype
    if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        raise TypeError(f"{what} must be an integer tensor, got dtype {dtype}")
    return x.detach().cpu().numpy()


def _list_to_numpy(seq: Sequence, what: str) -> np.ndarray:
    """``seq`` as an integer array, or the error naming ``what``'s first entry that is no
    int32 int.

    The fast path is ``array.array("i", seq)``: one C loop that takes each
    entry's ``__index__`` and checks the int32 range (about half the time of
    ``np.asarray``, which infers a dtype first and leaves int64 to narrow),
    viewed by numpy without a copy. A list of bools, which numpy would call a
    bool array, and anything the fast path refuses take the general path, so
    every error is the same as before. numpy turns ``[2**63, 1]`` into
    float64 and ``[2**64]`` into object, which would report a dtype the caller
    never wrote: an int entry is what is wrong.
    """
    if _ARRAY_CODE is not None and type(seq[0]) is not bool:
        try:
            return np.frombuffer(array.array(_ARRAY_CODE, seq), dtype=np.int32)
        except (TypeError, OverflowError, ValueError):
            pass  # the general path below names the entry
    try:
        arr = np.asarray(seq)
    except (ValueError, TypeError, OverflowError):  # ragged or nested: name the entry
        arr = None
    if arr is not None and arr.dtype.kind in "iu" and arr.ndim == 1:
        return arr  # the common case; _as_int32 checks the range
    for i, x in enumerate(seq):
        if not isinstance(x, (int, np.integer)):
            raise TypeError(f"{what}[{i}] must be an int, got {x!r} ({type(x).__name__})")
        if not _INFO.min <= x <= _INFO.max:
            raise ValueError(
                f"{what}[{i}] is {x}, outside the int32 range [{_INFO.min}, {_INFO.max}]"
            )
    if arr is None:
        raise TypeError(f"{what} must be a flat sequence of ints, got {type(seq).__name__}")
    return arr  # entries numpy does not store as ints (bools): _as_int32 names the dtype


def _as_int32(arr: np.ndarray, what: str, ids: str) -> np.ndarray:
    """``arr`` checked (1-D, integer, within int32) and converted to C-contiguous int32."""
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.empty(0, dtype=np.int32)
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype is _INT64 or arr.dtype == _INT64:  # torch's default, and numpy's
        out = np.empty(arr.size, dtype=np.int32)
        bad = kernels.narrow_int32(arr, out)
        if bad >= 0:
            raise ValueError(
                f"{what}[{bad}] is {arr[bad]}: {ids} must fit in int32 [{_INFO.min}, {_INFO.max}]"
            )
        return out
    if arr.dtype != np.int32:
        if arr.size and (arr.min() < _INFO.min or arr.max() > _INFO.max):
            i = int(np.flatnonzero((arr < _INFO.min) | (arr > _INFO.max))[0])
            raise ValueError(
                f"{what}[{i}] is {arr[i]}: {ids} must fit in int32 [{_INFO.min}, {_INFO.max}]"
            )
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)
