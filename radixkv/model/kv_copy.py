"""KVCopier: moves whole KV blocks between a device KVPool and a host KVPool (the host tier).

The tensor half of ``radixkv.cache.host``: the tree decides which blocks move
and calls ``backup`` / ``load`` / ``discard`` (the ``BlockCopier`` protocol)
with block ids; this class does the copies, one gather and one scatter per
layer for K and for V, viewing each pool as ``[num_blocks, block_size, heads,
head_dim]`` so a block is one row.

- **Same layout.** Both pools have the same layers, block size, heads, head
  dim and dtype (``ValueError`` naming the field otherwise).
- **CPU device.** Copies are plain synchronous ``index_copy_`` calls.
- **CUDA device.** The host pool must be on the CPU; it is allocated plainly
  (pageable) and pre-touched by its zero fill. Every copy goes through a
  page-locked staging tensor from torch's caching host allocator (a backup
  lands in one, a load gathers host rows into one), so the pool itself is
  never a DMA endpoint and needs no ``cudaHostRegister`` (which, never undone,
  failed with error 712 once a freed pool's address range came back to the
  next pool). Copies run on a stream of their own: it first waits for the compute stream
  (a backup reads blocks the model wrote), and the compute stream waits for
  it after a load (the model reads what was loaded). A backup returns once
  the host copy is complete, so the tree may free the device blocks at once.
- **Poison** (``poison=True``, a debug mode): every device block the tree
  frees is filled with NaN, so any copy made from it after the free, or any
  read of a stale block, shows up as a wrong output instead of passing by luck.

Complexity: O(blocks moved * bytes per block) per call, in ``2 * num_layers``
gathers and scatters.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from radixkv.model.kvpool import KVPool

__all__ = ["KVCopier"]

_LAYOUT = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")


class KVCopier:
    """Copies blocks between ``device`` and ``host`` pools (a ``radixkv.cache.host.BlockCopier``).

    Owns neither pool; writes only the blocks it is named. Counts blocks
    moved (``backed_up_blocks``, ``loaded_blocks``) and the seconds spent
    (``backup_seconds``, ``load_seconds``, wall time including the wait).
    """

    def __init__(self, device: KVPool, host: KVPool, *, poison: bool = False) -> None:
        for name in _LAYOUT:
            a, b = getattr(device, name), getattr(host, name)
            if a != b:
                raise ValueError(f"host.{name} must equal the device pool's {a!r}, got {b!r}")
        if host.device.type != "cpu" and host.device != device.device:
            raise ValueError(f"host pool must be on the CPU, got device {host.device}")
        self.device_pool = device
        self.host_pool = host
        self.poison = bool(poison)
        self.bytes_per_block = device.bytes_per_block
        self.backed_up_blocks = 0
        self.loaded_blocks = 0
        self.backup_seconds = 0.0
        self.load_seconds = 0.0
        self._cuda = device.device.type == "cuda"
        self._stream = torch.cuda.Stream(device.device) if self._cuda else None
        shape = (device.block_size, device.num_kv_heads, device.head_dim)
        self._dev = [t.view(-1, *shape) for t in (*device.k, *device.v)]
        self._host = [t.view(-1, *shape) for t in (*host.k, *host.v)]
        # One reused gather buffer (CPU): a fresh temporary per layer and call moves glibc's
        # malloc thresholds, the heap gets trimmed, and the model's own activations then
        # page-fault back in (measured: ~5% slower forwards with no reuse at all).
        self._scratch = torch.empty((0, *shape), dtype=device.dtype)

    def _rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the reused CPU gather buffer (grown by doubling)."""
        if self._scratch.shape[0] < n:
            rows = max(n, 2 * self._scratch.shape[0])
            self._scratch = torch.empty((rows, *self._scratch.shape[1:]), dtype=self._scratch.dtype)
        return self._scratch[:n]

    def _copy_rows(
        self,
        src: list[torch.Tensor],
        sidx: torch.Tensor,
        dst: list[torch.Tensor],
        didx: torch.Tensor,
    ) -> None:
        """CPU copies: per layer, rows ``sidx`` of ``src`` to rows ``didx`` of ``dst``."""
        buf = self._rows(len(sidx))
        for s, d in zip(src, dst, strict=True):
            d.index_copy_(0, didx, torch.index_select(s, 0, sidx, out=buf))

    def backup(self, device: np.ndarray, host: np.ndarray) -> None:
        """Copy device blocks ``device[i]`` to host blocks ``host[i]``; returns once complete."""
        if not len(device):
            return
        t0 = _now()
        didx = self._index(device, self.device_pool.device)
        hidx = self._index(host, self.host_pool.device)
        if self._stream is None:
            self._copy_rows(self._dev, didx, self._host, hidx)
        else:
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
            with torch.cuda.stream(stream):
                staged = [d.index_select(0, didx).to("cpu", non_blocking=True) for d in self._dev]
            stream.synchronize()  # the host rows are read right below, and the device may reuse
            for h, s in zip(self._host, staged, strict=True):
                h.index_copy_(0, hidx, s)
        self.backed_up_blocks += len(device)
        self.backup_seconds += _now() - t0

    def load(self, host: np.ndarray, device: np.ndarray) -> None:
        """Copy host blocks ``host[i]`` to device blocks ``device[i]``; compute is ordered after."""
        if not len(device):
            return
        t0 = _now()
        didx = self._index(device, self.device_pool.device)
        hidx = self._index(host, self.host_pool.device)
        if self._stream is None:
            self._copy_rows(self._host, hidx, self._dev, didx)
        else:
            stream = self._stream
            compute = torch.cuda.current_stream(self.device_pool.device)
            stream.wait_stream(compute)  # the blocks may have been freed by work in flight
            rows = [h.index_select(0, hidx).pin_memory() for h in self._host]
            with torch.cuda.stream(stream):
                for d, r in zip(self._dev, rows, strict=True):
                    d.index_copy_(0, didx, r.to(d.device, non_blocking=True))
            compute.wait_stream(stream)  # the model reads the loaded blocks after this
            stream.synchronize()  # ``rows`` may be freed once the copies have read them
        self.loaded_blocks += len(device)
        self.load_seconds += _now() - t0

    def discard(self, device: np.ndarray) -> None:
        """The tree freed these device blocks: with ``poison``, fill them with NaN."""
        if not self.poison or not len(device):
            return
        didx = self._index(device, self.device_pool.device)
        for d in self._dev:
            d.index_fill_(0, didx, float("nan"))

    @staticmethod
    def _index(blocks: np.ndarray, where: torch.device) -> torch.Tensor:
        return torch.from_numpy(np.asarray(blocks, dtype=np.int64)).to(where)

    def __repr__(self) -> str:
        return (
            f"KVCopier(device={self.device_pool.device}, host_blocks={self.host_pool.num_blocks}, "
            f"poison={self.poison})"
        )


_now = time.perf_counter
