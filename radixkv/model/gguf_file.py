"""Moved to :mod:`radixkv.text.gguf` (issue 23); this old path re-exports it for now."""

from radixkv.text.gguf import GGUFFile, GGUFTensor, read_gguf

__all__ = ["GGUFFile", "GGUFTensor", "read_gguf"]
