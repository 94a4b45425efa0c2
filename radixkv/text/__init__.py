"""The text tier: tokenizers, the GGUF metadata reader and the stop-string text stream.

Torch-free, so a server front end (the OpenAI layer, a fleet's ingress) tokenizes and
streams text without importing the engine. :mod:`~radixkv.text.tokenizer` is the
:class:`Tokenizer` surface (:class:`ByteTokenizer`, :class:`ChatTokenizer`, chat
rendering) and what a model spec names; :mod:`~radixkv.text.bpe` the byte-level BPE
read from a GGUF file or ``tokenizer.json``; :mod:`~radixkv.text.gguf` the GGUF reader;
:mod:`~radixkv.text.stream` output ids as text, piece by piece, with stop strings.
``tokenizers``, ``jinja2`` and ``gguf`` (the ``engine`` extra) load on first use.
Imports nothing else of radixkv.
"""

from radixkv.text.bpe import GGUFTokenizer, load_gguf_tokenizer
from radixkv.text.gguf import GGUFFile, read_gguf
from radixkv.text.stream import StopMatcher, TextStream
from radixkv.text.tokenizer import (
    ByteTokenizer,
    ChatTokenizer,
    Tokenizer,
    context_length,
    extend_chat,
    load_hf_tokenizer,
    load_tokenizer,
    model_name,
    render_chat,
    smollm2_gguf_path,
    spec_path,
)

__all__ = [
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
]
