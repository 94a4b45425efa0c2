"""The public names of radixkv and its engine, model, serve and text packages, imported from
their package.

Issue 23 re-cut the modules under these packages (tokenizers and the GGUF reader to
``radixkv.text``, ``KVCacheManager`` to ``radixkv.cache``, the stats records to
``radixkv.engine.stats``, ...) and deleted the old module paths. What a user imports from
a package must not move with them: each name below is imported from its package, and
each package's ``__all__`` is exactly the list here, so dropping a name (or a module move
that breaks a lazy re-export) fails this test instead of a user's import. The KV manager
and ``make_cache`` are ``radixkv``'s (``radixkv.engine``'s old re-export of them warns).
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "radixkv": [
        "BlockAllocator",
        "CacheStats",
        "HashBlockCache",
        "InvariantError",
        "KVCacheManager",
        "MatchResult",
        "NullCache",
        "OutOfBlocks",
        "PrefixCache",
        "RadixCache",
        "make_cache",
    ],
    "radixkv.engine": [
        "SCHEDULE_POLICIES",
        "Completion",
        "Engine",
        "EngineConfig",
        "EngineStats",
        "Request",
        "RequestStats",
        "SamplingParams",
        "Scheduler",
        "SchedulerConfig",
        "build_forward_batch",
    ],
    "radixkv.model": [
        "DECODER_BACKENDS",
        "Decoder",
        "ForwardBatch",
        "GGUFTokenizer",
        "KVPool",
        "ModelConfig",
        "SMALL_CONFIG",
        "from_pretrained",
        "load_gguf_tokenizer",
        "preferred_attention_backend",
        "random_model",
        "smollm2_gguf_path",
    ],
    "radixkv.serve": [
        "AsyncEngine",
        "EngineMetrics",
        "RequestOutput",
        "build_app",
        "build_engine",
        "load_model",
    ],
    "radixkv.text": [
        "ByteTokenizer",
        "ChatTokenizer",
        "GGUFFile",
        "GGUFTokenizer",
        "StopMatcher",
        "TextStream",
        "Tokenizer",
        "context_length",
        "extend_chat",
        "load_gguf_tokenizer",
        "load_hf_tokenizer",
        "load_tokenizer",
        "model_name",
        "read_gguf",
        "render_chat",
        "smollm2_gguf_path",
        "spec_path",
    ],
}
# Packages whose names need torch (the engine's torch names load lazily, on first use).
NEEDS_TORCH = {"radixkv.engine", "radixkv.model", "radixkv.serve"}
NEEDS_FASTAPI = {"radixkv.serve"}


def _package(name: str):
    if name in NEEDS_TORCH:
        pytest.importorskip("torch")
    if name in NEEDS_FASTAPI:
        pytest.importorskip("fastapi")
    return importlib.import_module(name)


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_the_package_exports_exactly_its_public_names(package: str) -> None:
    assert sorted(_package(package).__all__) == sorted(PUBLIC[package])


@pytest.mark.parametrize(
    ("package", "name"), [(p, n) for p, names in sorted(PUBLIC.items()) for n in names]
)
def test_each_public_name_imports_from_its_package(package: str, name: str) -> None:
    module = _package(package)
    namespace: dict[str, object] = {}
    exec(f"from {package} import {name}", namespace)  # as a user writes it
    assert namespace[name] is getattr(module, name)
    assert namespace[name] is not None
