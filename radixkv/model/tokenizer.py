"""Moved to :mod:`radixkv.text.tokenizer` (issue 23); this old path re-exports it for now."""

from radixkv.text.tokenizer import GGUFTokenizer, load_gguf_tokenizer, smollm2_gguf_path

__all__ = ["GGUFTokenizer", "load_gguf_tokenizer", "smollm2_gguf_path"]
