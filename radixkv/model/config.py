"""ModelConfig: the shape and options of a Llama-family decoder (plain data, validated)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from radixkv.checks import check_bool, check_int, check_number

__all__ = ["SMALL_CONFIG", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a Llama-family decoder.

    ``qkv_bias``: biases on q/k/v projections (Qwen2); ``o_bias``/``mlp_bias``:
    on the output projection / MLP (Llama's ``attention_bias`` sets both
    ``qkv_bias`` and ``o_bias``); ``qk_norm``: per-head RMSNorm on q and k
    before RoPE (Qwen3).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for f in fields(self)[:7]:  # the shape: stored as plain ints
            object.__setattr__(self, f.name, check_int(f.name, getattr(self, f.name), low=1))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            check_number(name, getattr(self, name), low=0, strict=True)
        for name in ("tie_word_embeddings", "qk_norm", "qkv_bias", "o_bias", "mlp_bias"):
            check_bool(name, getattr(self, name))

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


# A small decoder for the demo and benchmarks when no real model is at hand.
SMALL_CONFIG = ModelConfig(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
)
