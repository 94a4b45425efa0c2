"""KVPool: the paged K/V tensors that the allocator's block ids index.

Per layer, one K and one V tensor of shape ``[num_blocks * block_size,
num_kv_heads, head_dim]``. Token ``offset`` of block ``b`` lives at slot
``b * block_size + offset``, so a block id from :class:`~radixkv.BlockAllocator`
(same ``num_blocks`` and ``block_size``) addresses the pool directly. The pool
owns memory only; which blocks are live is the allocator's business, and slots
are computed by :meth:`~radixkv.model.forward_batch.ForwardBatch.build` (and, for a
captured decode step, :func:`~radixkv.model.cuda_graphs.fill_decode_inputs`).
"""

from __future__ import annotations

import torch

from radixkv.checks import check_int
from radixkv.errors import invariant

__all__ = ["KVPool", "default_device"]


def default_device() -> torch.device:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class KVPool:
    """Per-layer K and V tensors addressed by slot (``block * block_size + offset``).

    ``k[layer]`` and ``v[layer]`` have shape ``[num_blocks * block_size,
    num_kv_heads, head_dim]``, are zero-initialised, and are written in place by
    the model (``Decoder.forward``). The pool never frees or tracks blocks.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim = (
            check_int(name, value, low=1)
            for name, value in (
                ("num_layers", num_layers),
                ("num_blocks", num_blocks),
                ("block_size", block_size),
                ("num_kv_heads", num_kv_heads),
                ("head_dim", head_dim),
            )
        )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        where = torch.device(device) if device is not None else default_device()
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=where) for _ in range(num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=where) for _ in range(num_layers)
        ]
        self.device = self.k[0].device  # "cuda" resolved to "cuda:0"

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers, K and V together."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @classmethod
    def from_memory_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVPool:
        """The largest pool whose K/V tensors fit in ``budget_bytes``.

        Raises ``ValueError`` if not even one block fits.
        """
        budget_bytes = check_int("budget_bytes", budget_bytes, low=1)
        per_block = cls.block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"budget_bytes={budget_bytes} is below one block ({per_block} bytes)")
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, K and V together."""
        return self.block_bytes(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store ``k``/``v`` (``[n, num_kv_heads, head_dim]``) at ``slot_mapping`` (``[n]``)."""
        self.k[layer].index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].index_copy_(0, slot_mapping, v.to(self.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (``[n]`` int64): two new ``[n, num_kv_heads, head_dim]`` tensors."""
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)

    def check(self) -> None:
        """Verify the tensors' count, shape, dtype and device match the pool's attributes;
        ``InvariantError`` naming the first that does not. O(num_layers)."""
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        n = self.num_layers
        invariant(len(self.k) == len(self.v) == n, f"{len(self.k)} K, {len(self.v)} V for {n}")
        for t in (*self.k, *self.v):
            invariant(tuple(t.shape) == shape, f"a tensor of shape {tuple(t.shape)}, not {shape}")
            invariant(t.dtype == self.dtype, f"a tensor of dtype {t.dtype}, not {self.dtype}")
            invariant(t.device == self.device, f"a tensor on {t.device}, not {self.device}")

    def __repr__(self) -> str:
        return (
            f"KVPool(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )
