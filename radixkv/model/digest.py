"""model_digest: a model's identity from its config and weights, never from its name.

A KV store shared by processes (and servers) must not serve one checkpoint's K/V to
another that goes by the same name: its keys carry this digest
(``StoreKeyspace.model_digest``). The digest is SHA-256, so two models share it only
by a 2^-128 collision, chosen inputs included, over

    b"radixkv/model-digest/v1\\n" || JSON({"config": the ModelConfig's fields,
        "tensors": [[name, dtype, shape, sha256(the tensor's bytes)], ...] sorted by name})

where each tensor is as the loaded model holds it (after any dequantization,
un-permutation and cast: what actually computes the K/V), and its bytes are its
C-order bytes in its own dtype. Nothing in it depends on the process (no ``hash()``,
no dict order, no addresses), so the same checkpoint loaded the same way gives the
same digest in every process; the device does not enter it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from radixkv.errors import ArgumentTypeError
from radixkv.model.decoder import Decoder

__all__ = ["dtype_name", "model_digest"]

_DOMAIN = b"radixkv/model-digest/v1\n"
_MAX_THREADS = 8


def model_digest(model: Decoder) -> str:
    """The SHA-256 hex digest (64 digits) of ``model``'s config and every tensor of its
    ``state_dict()``: each one's name, dtype, shape and bytes (see the module docstring).

    Reads the weights only. A tensor on an accelerator is copied to the host one at a
    time per thread, so the extra host memory is at most a few of the largest tensors.

    Complexity: O(total weight bytes); the tensors are hashed on up to
    ``min(8, os.cpu_count())`` threads (``hashlib`` releases the GIL while it hashes).
    """
    if not isinstance(model, Decoder):
        raise ArgumentTypeError(f"model must be a Decoder, got {type(model).__name__}")
    state = model.state_dict()
    names = sorted(state)
    workers = max(1, min(_MAX_THREADS, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(workers, thread_name_prefix="model-digest") as pool:
        digests = list(pool.map(_tensor_digest, (state[n] for n in names)))
    record = {
        "config": dataclasses.asdict(model.config),
        "tensors": [
            [n, dtype_name(state[n].dtype), list(state[n].shape), d]
            for n, d in zip(names, digests, strict=True)
        ],
    }
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(_DOMAIN + text.encode()).hexdigest()


def _tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 hex of ``tensor``'s C-order bytes in its own dtype."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as a digest or a store keyspace spells it: ``torch.bfloat16`` ->
    ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
