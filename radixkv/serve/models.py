"""What ``radixkv serve --model SPEC`` builds: the engine over the model ``SPEC`` names.

The spec, the tokenizers and the loader moved (issue 23): the torch-free half to
:mod:`radixkv.text.tokenizer` (:class:`Tokenizer`, :class:`ByteTokenizer`,
:class:`ChatTokenizer`, :func:`render_chat`, :func:`load_hf_tokenizer`,
:func:`context_length`, :func:`model_name`), the loader to
:func:`radixkv.model.loading.load_model` (with :data:`RANDOM_CONFIG`). This module
re-exports them under their old path for now, and keeps what builds an engine:
:func:`event_hasher` and :func:`build_engine`.
"""

from __future__ import annotations

import importlib.util

from radixkv.cache.events import ChainHasher
from radixkv.engine.engine import Engine, EngineConfig
from radixkv.model.loading import RANDOM_CONFIG, load_model
from radixkv.text.tokenizer import (
    ByteTokenizer,
    ChatTokenizer,
    Tokenizer,
    context_length,
    load_hf_tokenizer,
    model_name,
    render_chat,
)

__all__ = [
    "RANDOM_CONFIG",
    "ByteTokenizer",
    "ChatTokenizer",
    "Tokenizer",
    "build_engine",
    "context_length",
    "event_hasher",
    "load_hf_tokenizer",
    "load_model",
    "model_name",
    "render_chat",
]


def event_hasher(seed: int | str = 0) -> ChainHasher:
    """The chain hash a serving cache names its blocks with: vLLM's ``sha256_cbor`` when
    ``cbor2`` is installed, else ``xxhash``."""
    name = "sha256_cbor" if importlib.util.find_spec("cbor2") is not None else "xxhash"
    return ChainHasher(name, seed=seed)


def build_engine(
    spec: str,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    events: bool = False,
    seed: int = 0,
    max_num_seqs: int = 64,
    host_kv_blocks: int = 0,
    special_tokens_in_content: bool = False,
) -> Engine:
    """An :class:`~radixkv.engine.Engine` over ``load_model(spec, seed=seed)``, with its
    tokenizer set (``engine.tokenizer``) and a radix cache.

    ``num_blocks`` None sizes the pool from the engine's default KV memory.
    ``events=True`` builds the cache with KV events on (:func:`event_hasher`, seed
    0, so every replica names a block alike); ``engine.cache.take_events()``
    returns them. ``host_kv_blocks`` > 0 adds a host-memory tier of that many
    blocks (``EngineConfig.host_kv_blocks``). ``special_tokens_in_content`` True lets
    special-token text in chat messages become special tokens (see
    :class:`ChatTokenizer`; off by default). ``ValueError`` naming ``spec``
    (see :func:`load_model`) or the bad setting.
    """
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        seed=seed,
        host_kv_blocks=host_kv_blocks,
    )
    model, tokenizer = load_model(
        spec, seed=seed, special_tokens_in_content=special_tokens_in_content
    )
    hasher = event_hasher() if events else None
    return Engine(model, config, tokenizer=tokenizer, events=hasher)
