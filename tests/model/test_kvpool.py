"""KVPool: shapes, sizing from a memory budget, write/gather by slot."""

from __future__ import annotations

import pytest
import torch
from model_helpers import DEVICES

from radixkv.model.kvpool import KVPool, default_device

torch.set_num_threads(1)


def test_shapes_and_attributes() -> None:
    pool = KVPool(3, 10, 4, 2, 8, dtype=torch.float16, device="cpu")
    pool.check()
    assert (pool.num_layers, pool.num_blocks, pool.block_size) == (3, 10, 4)
    assert (pool.num_kv_heads, pool.head_dim, pool.dtype) == (2, 8, torch.float16)
    assert pool.device == torch.device("cpu")
    assert len(pool.k) == len(pool.v) == 3
    assert tuple(pool.k[0].shape) == (40, 2, 8) and pool.num_slots == 40
    assert pool.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2
    assert pool.total_bytes == sum(t.numel() * t.element_size() for t in (*pool.k, *pool.v))
    assert pool.k[0].data_ptr() != pool.v[0].data_ptr()


def test_default_device() -> None:
    assert KVPool(1, 1, 1, 1, 2).device.type == default_device().type


@pytest.mark.parametrize("budget", [1000, 4096, 4097, 10**6])
def test_from_memory_budget_is_the_largest_pool_that_fits(budget: int) -> None:
    per_block = KVPool.block_bytes(2, 4, 2, 8, torch.float32)
    if budget < per_block:
        with pytest.raises(ValueError, match="budget_bytes"):
            KVPool.from_memory_budget(budget, 2, 4, 2, 8, device="cpu")
        return
    pool = KVPool.from_memory_budget(budget, 2, 4, 2, 8, device="cpu")
    assert pool.total_bytes <= budget < pool.total_bytes + pool.bytes_per_block
    assert pool.num_blocks == budget // per_block


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"block_size": 2.0}, "block_size"),
        ({"num_kv_heads": True}, "num_kv_heads"),
        ({"dtype": torch.int32}, "dtype"),
    ],
)
def test_invalid_arguments(kwargs: dict, name: str) -> None:
    args = {"num_layers": 1, "num_blocks": 2, "block_size": 4, "num_kv_heads": 1, "head_dim": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        KVPool(**args, device="cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_write_then_gather_round_trips_and_touches_only_those_slots(device: str) -> None:
    pool = KVPool(2, 6, 4, 2, 3, device=device)
    assert pool.device.type == device
    slots = torch.tensor([16, 17, 18, 19, 4, 5], device=device)  # block 4, then block 1
    k, v = torch.randn(6, 2, 3, device=device), torch.randn(6, 2, 3, device=device)
    pool.write(1, slots, k, v)
    gk, gv = pool.gather(1, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    mask = torch.ones(pool.num_slots, dtype=torch.bool, device=device)
    mask[slots] = False
    assert not pool.k[1][mask].any() and not pool.k[0].any()
