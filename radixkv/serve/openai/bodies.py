"""Request bodies and the server's identity, as both HTTP front ends read them.

The one-engine app (:mod:`radixkv.serve.app`) and the Ray fleet's ingress
(:mod:`radixkv.serve.ray.ingress`) take the same bodies the same way: read in chunks up to
a byte limit (413 as soon as it is known to be over, before it is read whole), then
parsed as JSON whatever the ``Content-Type`` (:func:`~radixkv.serve.openai.errors.parse_body`).
Part of the OpenAI layer: no torch.
"""

from __future__ import annotations

import importlib.metadata

from fastapi import Request

from radixkv.serve.openai.errors import ApiError

__all__ = [
    "BODY_BYTES_PER_TOKEN",
    "MIN_BODY_BYTES",
    "default_max_body_bytes",
    "read_body",
    "server_version",
]

MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32


def default_max_body_bytes(max_model_len: int) -> int:
    """The largest request body a pool of ``max_model_len`` tokens takes by default:
    :data:`BODY_BYTES_PER_TOKEN` per token (a token id in JSON takes at most 8 bytes, a
    token of text a few characters), and at least :data:`MIN_BODY_BYTES`."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


async def read_body(request: Request, limit: int) -> bytes:
    """The body of ``request``; ``ApiError`` 413 as soon as it is known to exceed ``limit``
    bytes (from ``Content-Length``, or while reading), before it is read whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes, the most this server takes")


def server_version() -> str:
    """The installed radixkv's version (the serve tier may not import the package root)."""
    try:
        return importlib.metadata.version("radixkv")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
