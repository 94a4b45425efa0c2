"""The model tier: everything that holds tensors (torch).

A Llama-family decoder over a paged KV pool (:mod:`~radixkv.model.decoder`), its
attention backends (:mod:`~radixkv.model.attention`, :mod:`~radixkv.model.cascade`,
sharing :mod:`~radixkv.model.gather`; the Triton kernels of
:mod:`~radixkv.model.triton_attention`, with :mod:`~radixkv.model.fused_kernels` and the
decode graphs of :mod:`~radixkv.model.cuda_graphs` for CUDA), the pool
(:mod:`~radixkv.model.kvpool`), the
record an eager step hands the model (:mod:`~radixkv.model.forward_batch`, where a
step's block ids become tensors), and loading from Hugging Face safetensors or GGUF
(:mod:`~radixkv.model.loading`, with the tokenizers and the GGUF reader of the
torch-free :mod:`radixkv.text`). Nothing here imports the cache tier: block ids arrive
as plain integers.
"""

from radixkv.model.config import SMALL_CONFIG, ModelConfig
from radixkv.model.decoder import (
    DECODER_BACKENDS,
    Decoder,
    preferred_attention_backend,
    random_model,
)
from radixkv.model.forward_batch import ForwardBatch
from radixkv.model.kvpool import KVPool
from radixkv.model.loading import from_pretrained
from radixkv.text.tokenizer import GGUFTokenizer, load_gguf_tokenizer, smollm2_gguf_path

__all__ = [
    "DECODER_BACKENDS",
    "SMALL_CONFIG",
    "Decoder",
    "ForwardBatch",
    "GGUFTokenizer",
    "KVPool",
    "ModelConfig",
    "from_pretrained",
    "load_gguf_tokenizer",
    "preferred_attention_backend",
    "random_model",
    "smollm2_gguf_path",
]
