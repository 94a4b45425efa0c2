"""Fused elementwise kernels for the decoder on CUDA: RMSNorm, rotary embedding, SiLU-and-multiply.

A decode step of a small model is launch-bound: written in plain torch, one
RMSNorm is eight kernels (cast, square, mean, add, rsqrt, multiply, cast,
scale), RoPE five per tensor and SwiGLU's gate two, so these elementwise ops are
most of a layer's ~40 launches while their bytes are tiny. Each function here is
one Triton launch computing the same formula in float32 and rounding once at the
end (the torch versions round after every op in half precision, so results
agree to the output dtype's rounding, not bit for bit).

``Decoder`` calls them for CUDA tensors (:func:`radixkv.model.decoder.fused_for`);
the CPU keeps the torch versions. Under ``TRITON_INTERPRET=1`` they run on CPU
tensors too, which is how the tests compare them with the torch versions without
a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rope_qk", "silu_mul"]


@triton.jit
def _rms_norm_kernel(X, W, Y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + row * n + offs, mask=ok, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    # as the torch version: normalised in fp32, rounded to x's dtype, then scaled
    y = (x * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * n + offs, (w * y).to(Y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dimension, statistics in float32.

    Returns a new tensor of ``x``'s shape in ``torch.result_type(weight, x)``.
    One launch, one program per row.
    """
    n = x.shape[-1]
    rows = x.numel() // n
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](xc, weight, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return y


@triton.jit
def _rope_kernel(
    Q, K, Cos, Sin, QOut, KOut, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < HALF
    d = 2 * HALF
    c1 = tl.load(Cos + t * d + offs, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + t * d + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + t * d + offs, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + t * d + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    if h < num_q_heads:
        src = Q + (t * num_q_heads + h) * d
        dst = QOut + (t * num_q_heads + h) * d
    else:
        src = K + (t * num_k_heads + (h - num_q_heads)) * d
        dst = KOut + (t * num_k_heads + (h - num_q_heads)) * d
    x1 = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    # rotate_half: the first half pairs with the second, (x1, x2) -> (-x2, x1)
    tl.store(dst + offs, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + HALF + offs, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=ok)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate_half`` RoPE of ``q`` ``[T, H, d]`` and ``k`` ``[T, Hkv, d]`` in one launch.

    ``cos``/``sin``: ``[T, 1, d]`` (``rope_cos_sin``). Returns new tensors of
    ``q``'s and ``k``'s dtypes.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    qc, kc = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(qc), torch.empty_like(kc)
    if t:
        half = d // 2
        _rope_kernel[(t, hq + hk)](
            qc, kc, cos.contiguous(), sin.contiguous(), q_out, k_out, hq, hk,
            HALF=half, BLOCK=triton.next_power_of_2(half),
        )  # fmt: skip
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < n
    g = tl.load(G + row * n + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * n + col, mask=ok, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + row * n + col, y.to(Y.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (same shapes and dtype), in one launch."""
    n = gate.shape[-1]
    rows = gate.numel() // n
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](g, u, y, n, BLOCK=block)
    return y
