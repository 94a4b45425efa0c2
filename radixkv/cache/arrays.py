"""Token sequences as the caches see them: 1-D int32 numpy arrays.

Every cache entry point converts its ``tokens`` argument here first, so bad
input raises before any state changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["TOKEN_DTYPE", "TokenSeq", "as_token_array"]

TOKEN_DTYPE = np.int32
_INFO = np.iinfo(TOKEN_DTYPE)

# A list/tuple of ints, a 1-D integer numpy array, or a 1-D integer torch tensor.
TokenSeq = Sequence[int] | np.ndarray | Any


def as_token_array(tokens: TokenSeq) -> np.ndarray:
    """Return ``tokens`` as a C-contiguous 1-D int32 array (no copy when it already is one).

    Accepts a list or tuple of ints, a 1-D integer numpy array, or a 1-D
    integer torch tensor on any device. Raises ``TypeError`` for any other
    type or a non-integer dtype, and ``ValueError`` for a wrong shape or ids
    outside int32.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.dtype == TOKEN_DTYPE and tokens.ndim == 1 and tokens.flags.c_contiguous:
            return tokens  # the fast path: already what the caches use
        arr = tokens
    elif isinstance(tokens, (list, tuple)):
        if len(tokens) == 0:
            return np.empty(0, dtype=TOKEN_DTYPE)
        arr = np.asarray(tokens)
    elif type(tokens).__module__.split(".")[0] == "torch" and hasattr(tokens, "numpy"):
        if tokens.is_floating_point() or tokens.is_complex() or str(tokens.dtype) == "torch.bool":
            raise TypeError(f"tokens must be an integer tensor, got dtype {tokens.dtype}")
        arr = tokens.detach().cpu().numpy()
    else:
        raise TypeError(
            "tokens must be a list/tuple of ints, a 1-D integer numpy array or a 1-D integer "
            f"torch tensor, got {type(tokens).__name__}"
        )
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.empty(0, dtype=TOKEN_DTYPE)
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype != TOKEN_DTYPE:
        if arr.size and (arr.min() < _INFO.min or arr.max() > _INFO.max):
            raise ValueError(f"token ids must fit in int32 [{_INFO.min}, {_INFO.max}]")
        arr = arr.astype(TOKEN_DTYPE)
    return np.ascontiguousarray(arr)
