"""The decoder's fused CUDA kernels (RMSNorm, RoPE, SiLU-and-multiply) against its torch formulas.

On the CPU they run under Triton's interpreter (conftest); on a GPU compiled, in
half precision too. The decoder calls them only for CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import DEVICES, skip_unless_runs

from radixkv.model.decoder import RMSNorm, apply_rope, fused_for, rope_cos_sin

pytestmark = pytest.mark.parametrize(
    "device, dtype",
    [("cpu", torch.float32), ("cpu", torch.float16)]
    + [
        pytest.param("cuda", dt, marks=DEVICES[1].marks)
        for dt in (torch.float32, torch.float16, torch.bfloat16)
    ],
)

TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _kernels():
    from radixkv.model import fused_kernels

    return fused_kernels


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).norm() / want.norm())
    assert err < TOL[dtype], err


def test_rms_norm(device, dtype) -> None:
    skip_unless_runs("triton", device)
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    x = (torch.randn(7, 576, generator=gen) * 3).to(dtype)
    want = norm(x)  # the CPU: torch's formula
    norm, x = norm.to(device), x.to(device)
    _close(_kernels().rms_norm(x, norm.weight, norm.eps).cpu(), want, dtype)
    # per-head rows (qk_norm): [T, H, d], head_dim not a power of two
    small = RMSNorm(12, 1e-6).to(dtype)
    xh = torch.randn(5, 3, 12, generator=gen).to(dtype)
    _close(
        _kernels().rms_norm(xh.to(device), small.weight.to(device), 1e-6).cpu(), small(xh), dtype
    )


def test_rope_of_q_and_k_in_one_launch(device, dtype) -> None:
    skip_unless_runs("triton", device)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(6, 9, 64, generator=gen).to(dtype)
    k = torch.randn(6, 3, 64, generator=gen).to(dtype)
    cos, sin = rope_cos_sin(torch.tensor([0, 1, 5, 100, 2047, 9000]), 64, 1e5, dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    got_q, got_k = _kernels().rope_qk(*(t.to(device) for t in (q, k, cos, sin)))
    _close(got_q.cpu(), want_q, dtype)
    _close(got_k.cpu(), want_k, dtype)


def test_silu_mul(device, dtype) -> None:
    skip_unless_runs("triton", device)
    gen = torch.Generator().manual_seed(2)
    g = (torch.randn(4, 1536 + 7, generator=gen) * 4).to(dtype)
    u = torch.randn(4, 1536 + 7, generator=gen).to(dtype)
    want = torch.nn.functional.silu(g) * u
    _close(_kernels().silu_mul(g.to(device), u.to(device)).cpu(), want, dtype)


def test_only_cuda_tensors_take_the_fused_path(device, dtype) -> None:
    x = torch.zeros(2, 4, dtype=dtype)
    assert fused_for(x) is None  # the CPU keeps torch's formulas
    if device == "cuda":
        assert fused_for(x.to(device)) is not None
