"""A small Llama-family decoder that reads and writes a paged KV pool.

Token embedding, RMSNorm (computed in float32), rotary embeddings (Hugging Face
Llama's ``rotate_half`` layout), grouped-query attention, SwiGLU MLP; optional
per-head q/k RMSNorm (Qwen3) and q/k/v bias (Qwen2); tied or untied LM head.
Parameter names mirror Hugging Face's (without the ``model.`` prefix) so
checkpoints load by name (:mod:`radixkv.model.loading`).

``Decoder.forward`` runs one scheduler step (a :class:`ForwardBatch`, built for
``Decoder.backend_for`` of the pool's device): it writes every new token's K/V
into the pool at ``slot_mapping`` and attends over each sequence's context
through the batch's attention metadata. ``Decoder.forward_dense`` is the
no-cache reference for one sequence.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from types import ModuleType

import torch
from torch import nn

from radixkv.checks import check_number
from radixkv.model.attention import dense_causal_attention, paged_attention
from radixkv.model.cascade import cascade_attention
from radixkv.model.config import ModelConfig
from radixkv.model.forward_batch import DECODER_BACKENDS, ForwardBatch, triton_backend_runs_on
from radixkv.model.gather import GatherWorkspace
from radixkv.model.kvpool import KVPool

__all__ = [
    "DECODER_BACKENDS",
    "Decoder",
    "preferred_attention_backend",
    "random_model",
]


def preferred_attention_backend(device: torch.device | str) -> str:
    """The measured-fastest backend for ``device``: ``cascade`` on the CPU, ``triton`` on CUDA.

    What a ``Decoder`` built without a backend runs. CPU: ``bench_attention.py``
    ranks ``loop`` first among the paged backends (``padded``/``varlen`` are 2-12x
    slower once a prefill chunk shares the batch), and cascade (``loop`` plus one
    read of shared prefix blocks; exactly ``loop`` when nothing is shared) lifts
    ``bench_engine.py``'s later-wave TTFT speedup on SmolLM2 from 6.5-6.9x to
    7.0-7.7x and cuts the random model's cached wall time by ~10%. CUDA: the
    ``triton`` kernels read K/V in place with one launch per layer, and are the
    only backend whose decode steps CUDA graphs can capture (``bench_decode.py``,
    docs/engine.md); where Triton is missing, ``padded`` (one SDPA call per layer;
    0.33x the loop's time on a 32-decode step on an H100). Other devices were
    never measured: they get ``loop``, the simplest.
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return "triton" if triton_backend_runs_on(device) else "padded"
    return {"cpu": "cascade"}.get(kind, "loop")


@functools.cache
def _fused_kernels() -> ModuleType | None:
    """:mod:`radixkv.model.fused_kernels`, or None where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("radixkv.model.fused_kernels")


def fused_for(x: torch.Tensor) -> ModuleType | None:
    """The fused elementwise kernels for ``x``'s device: on CUDA (with Triton), else None.

    The CPU runs the torch formulas below, as it always has; CUDA runs one
    Triton launch per op (:mod:`~radixkv.model.fused_kernels`), which a
    launch-bound decode step needs. Complexity: O(1).
    """
    return _fused_kernels() if x.is_cuda else None


class Linear(nn.Linear):
    """``nn.Linear`` created zero-filled: the random init is wasted work before loading."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` created zero-filled (see :class:`Linear`)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, the normalisation in float32 (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_for(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[T, 1, head_dim]`` for ``rotate_half`` RoPE, angles computed in float32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponent / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, d]``): first half pairs with second half (``rotate_half``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        h = cfg.hidden_size
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(h, q_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(h, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(h, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_dim, h, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, normed and rotated ``q`` ``[T, H, d]``, ``k`` and ``v`` ``[T, Hkv, d]``."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        fused = fused_for(q)
        if fused is not None:
            q, k = fused.rope_qk(q, k, cos, sin)
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_for(x)
        if fused is not None:
            return self.down_proj(fused.silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Decoder(nn.Module):
    """Llama-family decoder over a paged KV pool; inference only (no autograd).

    A new ``Decoder`` has zero weights (norm weights one): fill it with
    :func:`random_model` or :func:`from_pretrained`. It lives on CPU in float32
    until moved (``.to(device, dtype)``).
    ``attention_backend`` picks the paged attention implementation
    (:data:`DECODER_BACKENDS`) that :meth:`backend_for` names, so the batches
    built for this model use it; all give the same result up to float rounding.
    None (the default) names :func:`preferred_attention_backend` of the pool's device.
    """

    def __init__(self, config: ModelConfig, attention_backend: str | None = None):
        super().__init__()
        if attention_backend is not None and attention_backend not in DECODER_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {DECODER_BACKENDS}, got {attention_backend!r}"
            )
        self.config = config
        self.attention_backend = attention_backend
        # None makes every layer allocate its gather tensors (benchmarks compare the two)
        self.gather_workspace: GatherWorkspace | None = GatherWorkspace()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def make_kv_pool(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVPool:
        """A zeroed pool shaped for this model, by default in its dtype and on its device."""
        c = self.config
        return KVPool(
            c.num_layers,
            num_blocks,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=dtype or self.dtype,
            device=device if device is not None else self.device,
        )

    def _block(self, layer: DecoderLayer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = x + layer.self_attn.o_proj(attn_out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def backend_for(self, device: torch.device | str) -> str:
        """The backend a :class:`ForwardBatch` for this model on ``device`` should be built with.

        ``attention_backend`` if one was given, else
        :func:`preferred_attention_backend` of ``device``. Complexity: O(1).
        """
        return self.attention_backend or preferred_attention_backend(device)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """One step; float32 logits ``[num_seqs, vocab]`` of each sequence's last new token:
        :meth:`logits` of :meth:`hidden`'s rows ``batch.last_token_index``."""
        return self.logits(self.hidden(batch, kv).index_select(0, batch.last_token_index))

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[..., vocab]`` of hidden states ``h`` (the final norm, then the
        head). Complexity: one ``hidden_size x vocab`` product per row."""
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(h, weight).float()

    @torch.no_grad()
    def hidden(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """One step's hidden states ``[num_tokens, hidden_size]`` (every new token's, before
        the final norm; :meth:`logits` turns rows into logits).

        ``batch`` comes from :meth:`ForwardBatch.build` (which validated it) for
        this pool and model; the backend it was built with is the one that runs.
        Writes each new token's K/V at ``batch.slot_mapping`` in every layer of
        ``kv`` (the only mutation). Raises ``ValueError``, before touching the
        pool, if ``kv`` is shaped for another model, the batch was built for a
        pool of another ``block_size``/``num_blocks`` or another ``group_size``,
        or the batch, the pool and the model are not on one device. Only these
        Python-side facts are checked: no device sync.
        Complexity: ``num_layers`` times (projections + the backend's attention).
        """
        c = self.config
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
        ):
            raise ValueError(f"{kv!r} does not fit {c}")
        if (batch.block_size, batch.num_blocks) != (kv.block_size, kv.num_blocks):
            raise ValueError(
                f"batch was built for a pool of num_blocks={batch.num_blocks}, "
                f"block_size={batch.block_size}; got {kv!r}"
            )
        if batch.group_size != c.group_size:
            raise ValueError(
                f"batch was built for group_size={batch.group_size}, the model has {c.group_size}"
            )
        if not batch.device == kv.device == self.device:
            raise ValueError(
                f"batch on {batch.device}, pool on {kv.device}, model on {self.device}: "
                "need one device"
            )
        x = self.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(batch.positions, c.head_dim, c.rope_theta, x.dtype)
        meta, plan, kernel = batch.attention, batch.cascade, batch.kernel
        ws = self.gather_workspace
        for i, layer in enumerate(self.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            qi = q.to(kv.dtype)
            if kernel is not None:
                kernel.store(kv.k[i], kv.v[i], batch.slot_mapping, k, v)
                attn = kernel.attend(qi, kv.k[i], kv.v[i])
            else:
                kv.write(i, batch.slot_mapping, k, v)
                assert meta is not None
                if plan is None:
                    attn = paged_attention(qi, kv.k[i], kv.v[i], meta, ws)
                else:
                    attn = cascade_attention(qi, kv.k[i], kv.v[i], plan, ws)
            x = self._block(layer, x, attn.to(x.dtype))
        return x

    @torch.no_grad()
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Reference forward of one sequence, no cache: float32 logits ``[T, vocab]``."""
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D tensor, got {input_ids.shape}")
        c = self.config
        x = self.embed_tokens(input_ids.to(self.device))
        positions = torch.arange(x.shape[0], device=x.device)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
        for layer in self.layers:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            x = self._block(layer, x, dense_causal_attention(q, k, v))
        return self.logits(x)

    @torch.no_grad()
    def greedy_dense(self, input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
        """Greedy continuation by recomputing the dense forward each step (a slow reference)."""
        ids = input_ids.to(self.device).long()
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(self.forward_dense(ids)[-1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, ids.new_tensor([nxt])])
        return out


def random_model(
    config: ModelConfig,
    seed: int = 0,
    std: float | None = None,
    attention_backend: str | None = None,
) -> Decoder:
    """A decoder with reproducible random weights, float32 on CPU.

    Weights and biases are ``N(0, std)`` with ``std = 1.5 / sqrt(hidden_size)``
    by default (so attention scores have spread ~1-4: far from uniform, unlike
    Hugging Face's 0.02, which hides RoPE and GQA bugs); embeddings ``N(0, 1)``;
    norm weights ``U(0.5, 1.5)``.
    """
    check_number("std", std, low=0, strict=True, optional=True)
    std = 1.5 / math.sqrt(config.hidden_size) if std is None else std
    model = Decoder(config, attention_backend)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.eval()
