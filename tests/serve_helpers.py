"""Test helpers for the serving tier: one tiny random decoder over the byte tokenizer's
vocabulary, shared by the async-engine and server tests."""

from __future__ import annotations

from radixkv.model import ModelConfig
from radixkv.serve.models import ByteTokenizer

TINY_CONFIG = ModelConfig(
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
