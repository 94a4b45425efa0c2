"""What ``radixkv serve --model SPEC`` builds: the engine over the model ``SPEC`` names.

The one construction path of a served engine (one server, a fleet's replicas, the
``radixkv serve`` command): :func:`engine_config` (the pool and batching settings),
:func:`build_engine` (the model, its tokenizer, the radix cache and its KV events) and
:func:`event_hasher` (how the cache names blocks). The spec, the tokenizers and the
loader live below: :mod:`radixkv.text.tokenizer` and :func:`radixkv.model.loading.load_model`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

from radixkv.cache.hashing import ChainHasher, vllm_hash_seed
from radixkv.checks import check_bool
from radixkv.engine.engine import Engine, EngineConfig
from radixkv.model.loading import check_model_options, load_model
from radixkv.text.tokenizer import context_length

if TYPE_CHECKING:
    import torch

    from radixkv.text.tokenizer import Tokenizer

__all__ = [
    "build_engine",
    "check_engine_options",
    "default_max_model_len",
    "engine_config",
    "event_hasher",
]


def event_hasher(seed: int | str | None = None) -> ChainHasher:
    """The chain hash a serving cache names its blocks with: vLLM's ``sha256_cbor`` when
    ``cbor2`` is installed, else ``xxhash``, seeded with ``seed``; None takes vLLM's seed
    rule in this process (:func:`~radixkv.cache.hashing.vllm_hash_seed`: ``PYTHONHASHSEED``,
    else ``"vllm-none-hash"``), so the blocks are named as a vLLM server here names them."""
    name = "sha256_cbor" if importlib.util.find_spec("cbor2") is not None else "xxhash"
    return ChainHasher(name, seed=vllm_hash_seed() if seed is None else seed)


def check_engine_options(dtype: str, attention_backend: str | None, cuda_graphs: bool) -> None:
    """Check what :func:`build_engine` passes to the loader and the engine config, before
    anything loads: ``ValueError`` naming ``dtype`` or ``attention_backend``
    (:func:`~radixkv.model.loading.check_model_options`), ``TypeError`` naming
    ``cuda_graphs`` unless it is a bool. A fleet checks its replicas' options here."""
    check_model_options(dtype, attention_backend)
    check_bool("cuda_graphs", cuda_graphs)


def engine_config(
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    seed: int = 0,
    max_num_seqs: int = 64,
    host_kv_blocks: int = 0,
    prefix_caching: bool = True,
    cuda_graphs: bool = True,
    max_model_len: int | None = None,
    kv_store: str | None = None,
    kv_store_capacity_bytes: int | None = None,
    kv_store_write_policy: str | None = None,
) -> EngineConfig:
    """The :class:`~radixkv.engine.EngineConfig` a served engine runs with (a radix cache,
    or none when not ``prefix_caching``: every prompt computed in full, vLLM's
    ``--no-enable-prefix-caching``; ``num_blocks`` None sizes the pool from the default KV
    memory; ``cuda_graphs`` False runs every decode step eagerly, vLLM's
    ``--enforce-eager``; ``max_model_len`` None: all the pool holds; ``kv_store`` a KV store
    below the host tier, a directory or ``mooncake://HOST:PORT``, with its capacity and write
    policy, None each: :class:`~radixkv.engine.EngineConfig`'s defaults). What
    :func:`build_engine` builds over, so a caller can check the pool before building
    (``radixkv serve`` checks it fits in memory). ``ValueError`` naming a bad setting."""
    store: dict[str, object] = {"kv_store": kv_store}
    if kv_store_capacity_bytes is not None:
        store["kv_store_capacity_bytes"] = kv_store_capacity_bytes
    if kv_store_write_policy is not None:
        store["kv_store_write_policy"] = kv_store_write_policy
    return EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        seed=seed,
        host_kv_blocks=host_kv_blocks,
        cache="radix" if check_bool("prefix_caching", prefix_caching) else None,
        cuda_graphs=cuda_graphs,
        max_model_len=max_model_len,
        **store,  # type: ignore[arg-type]
    )


def default_max_model_len(
    config: EngineConfig, model: torch.nn.Module, context_len: int | None
) -> int | None:
    """The ``max_model_len`` a served engine over ``model`` runs with unless told: the
    model's context length ``context_len`` or the tokens ``config``'s pool holds, whichever
    is smaller (None, all the pool holds, where the context is unknown). A request can get
    what ``/v1/models`` advertises (vLLM refuses to start otherwise)."""
    if context_len is None:
        return None
    return min(context_len, config.pool_blocks(model) * config.block_size)


def build_engine(
    spec: str | tuple[torch.nn.Module, Tokenizer],
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    events: bool = False,
    hash_seed: int | str | None = None,
    seed: int = 0,
    max_num_seqs: int = 64,
    host_kv_blocks: int = 0,
    special_tokens_in_content: bool = False,
    prefix_caching: bool = True,
    cuda_graphs: bool = True,
    dtype: str = "auto",
    attention_backend: str | None = None,
    max_model_len: int | None = None,
    kv_store: str | None = None,
    kv_store_capacity_bytes: int | None = None,
    kv_store_write_policy: str | None = None,
) -> Engine:
    """An :class:`~radixkv.engine.Engine` over the model ``spec`` names, with its tokenizer
    set (``engine.tokenizer``) and a radix cache, configured by :func:`engine_config`.

    ``spec`` is loaded here (``load_model(spec, seed=seed,
    special_tokens_in_content=..., dtype=..., attention_backend=...)``:
    ``special_tokens_in_content`` True lets special-token text in chat messages become
    special tokens, see :class:`~radixkv.text.tokenizer.ChatTokenizer`), or a
    ``(decoder, tokenizer)`` pair ``load_model`` returned (those three were the loader's
    to apply: ``ValueError`` if given here). ``events=True`` builds the cache with KV events on
    (``event_hasher(hash_seed)``: None is vLLM's seed rule in this process; a fleet passes
    every replica one seed, so they name a block alike);
    ``engine.cache.take_events()`` returns them. ``host_kv_blocks`` > 0 adds a
    host-memory tier of that many blocks; ``prefix_caching=False`` caches nothing;
    ``kv_store`` (with ``kv_store_capacity_bytes`` and ``kv_store_write_policy``) puts a KV
    store below the host tier (opened here: ``ValueError`` naming ``kv_store`` if it
    cannot be).
    ``max_model_len`` (the most tokens a request may have) None: for a ``spec`` string,
    :func:`default_max_model_len` of its context length; for a pair, all the pool holds;
    more than the pool holds is a ``ValueError``, before the pool is allocated. The
    settings are checked before the model loads: ``ValueError`` naming the bad setting,
    or ``spec`` (see :func:`load_model`); ``TypeError`` for a ``spec`` that is neither a
    str nor a pair.
    """
    config = engine_config(
        block_size=block_size,
        num_blocks=num_blocks,
        seed=seed,
        max_num_seqs=max_num_seqs,
        host_kv_blocks=host_kv_blocks,
        prefix_caching=prefix_caching,
        cuda_graphs=cuda_graphs,
        max_model_len=max_model_len,
        kv_store=kv_store,
        kv_store_capacity_bytes=kv_store_capacity_bytes,
        kv_store_write_policy=kv_store_write_policy,
    )
    if isinstance(spec, str):
        decoder, tokenizer = load_model(
            spec,
            seed=seed,
            special_tokens_in_content=special_tokens_in_content,
            dtype=dtype,
            attention_backend=attention_backend,
        )
        if max_model_len is None:
            limit = default_max_model_len(config, decoder, context_length(spec))
            config = dataclasses.replace(config, max_model_len=limit)
    elif isinstance(spec, tuple) and len(spec) == 2:
        given = {
            "special_tokens_in_content": special_tokens_in_content,
            "dtype": dtype != "auto",
            "attention_backend": attention_backend is not None,
        }
        if any(given.values()):
            name = next(k for k, v in given.items() if v)
            raise ValueError(
                f"{name} is the loader's: pass it to load_model, not with a model it already loaded"
            )
        decoder, tokenizer = spec
    else:
        raise TypeError(
            f"spec must be a str or a (decoder, tokenizer) pair, got {type(spec).__name__}"
        )
    hasher = event_hasher(hash_seed) if events else None
    return Engine(decoder, config, tokenizer=tokenizer, events=hasher)
