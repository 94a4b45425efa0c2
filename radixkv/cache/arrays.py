"""Token sequences and block ids as the caches see them: 1-D int32 numpy arrays.

Every cache entry point converts its ``tokens`` argument with ``as_token_array``
and its ``blocks`` argument with ``as_block_array`` first, so bad input raises
before any state changes. Both accept torch tensors without importing torch:
a tensor can only exist once torch is imported, so ``sys.modules`` tells.
``common_prefix_len`` is the one longest-common-prefix function of the package.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from radixkv.cache import kernels

__all__ = [
    "BLOCK_DTYPE",
    "TOKEN_DTYPE",
    "TokenSeq",
    "as_block_array",
    "as_token_array",
    "common_prefix_len",
]

TOKEN_DTYPE = np.int32
BLOCK_DTYPE = np.int32
_INFO = np.iinfo(np.int32)  # both dtypes are int32: one range check serves both
_INT32 = np.dtype(np.int32)

# A list/tuple of ints, a 1-D integer numpy array, or a 1-D integer torch tensor.
TokenSeq = Sequence[int] | np.ndarray | Any


def as_token_array(tokens: TokenSeq) -> np.ndarray:
    """Return ``tokens`` as a C-contiguous 1-D int32 array (no copy when it already is one).

    Accepts a list or tuple of ints, a 1-D integer numpy array, or a 1-D
    integer torch tensor on any device. Raises ``TypeError`` for any other
    type or a non-integer dtype, and ``ValueError`` for a wrong shape or ids
    outside int32. The result may be ``tokens`` itself: do not write to it.

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
        arr = np.asarray(tokens)
    elif _is_tensor(tokens):
        arr = _tensor_to_numpy(tokens, "tokens")
    else:
        raise TypeError(
            "tokens must be a list/tuple of ints, a 1-D integer numpy array or a 1-D integer "
            f"torch tensor, got {type(tokens).__name__}"
        )
    return _as_int32(arr, "tokens", "token ids")


def as_block_array(blocks: Iterable[int]) -> np.ndarray:
    """Return block ids as a C-contiguous 1-D int32 array (no copy when it already is one).

    Accepts any iterable of ints except ``str``/``bytes``, a 1-D integer numpy
    array, or a 1-D integer torch tensor on any device. Raises ``TypeError``
    for a non-integer dtype or a string, ``ValueError`` for a wrong shape or
    ids outside int32. Range against a pool is the allocator's check, not
    this one's. The result may be ``blocks`` itself: do not write to it.

    Complexity: O(1) for an int32 C-contiguous array, else O(len(blocks)).

    >>> as_block_array(range(3))
    array([0, 1, 2], dtype=int32)
    """
    if isinstance(blocks, np.ndarray):
        if blocks.dtype == BLOCK_DTYPE and blocks.ndim == 1 and blocks.flags.c_contiguous:
            return blocks  # the fast path: already what the caches use
        arr = blocks
    elif _is_tensor(blocks):
        arr = _tensor_to_numpy(blocks, "blocks")
    else:
        if isinstance(blocks, (str, bytes)):
            raise TypeError(f"blocks must be a sequence of ints, got {type(blocks).__name__}")
        arr = np.asarray(list(blocks))
        if arr.size == 0:
            return np.empty(0, dtype=BLOCK_DTYPE)
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


def _as_int32(arr: np.ndarray, what: str, ids: str) -> np.ndarray:
    """``arr`` checked (1-D, integer, within int32) and converted to C-contiguous int32."""
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.empty(0, dtype=np.int32)
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        if arr.size and (arr.min() < _INFO.min or arr.max() > _INFO.max):
            raise ValueError(f"{ids} must fit in int32 [{_INFO.min}, {_INFO.max}]")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)
