"""The ``triton`` backend's kernels against a dense float64 causal reference.

On the CPU they run under Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``
where no GPU is visible), on tiny shapes; on a GPU the same tests run compiled
(``cuda``-marked), in half precision too, and against the ``padded`` backend.

Every pool starts as NaN: a kernel that reads one slot it should not (an unwritten
tail of a last block, a block of another sequence, a freed block reused in a
table) poisons its output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import DEVICES, skip_unless_runs

from radixkv.model.attention import AttentionMetadata, paged_attention
from radixkv.model.forward_batch import triton_backend_runs_on

pytestmark = pytest.mark.skipif(
    not (triton_backend_runs_on("cpu") or triton_backend_runs_on("cuda")),
    reason="needs Triton (and a GPU or TRITON_INTERPRET=1)",
)


def _kernels():
    from radixkv.model import triton_attention

    return triton_attention


class Scenario:
    """Sequences over one layer of a NaN-filled pool, their queries and a float64 reference.

    ``lens``: ``(query_len, context_len)`` per sequence; ``share``: sequence ``i``
    starts on sequence ``share[i]``'s leading blocks (same tokens' K/V, as a
    cache hit gives) for as many whole blocks as both prefixes allow; ``holes``:
    that many blocks are NaN-filled "freed" blocks that tables then reuse.
    """

    def __init__(
        self,
        lens: list[tuple[int, int]],
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        seed: int,
        share: dict[int, int] | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        bs = block_size
        need = sum(-(-c // bs) for _, c in lens)
        num_blocks = need + 7
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_size, self.lens = bs, lens
        slots = num_blocks * bs
        self.k_cache = torch.full((slots, kv_heads, head_dim), math.nan, dtype=dtype)
        self.v_cache = torch.full((slots, kv_heads, head_dim), math.nan, dtype=dtype)
        self.tables: list[list[int]] = []
        self.q, self.k_new, self.v_new, self.slots_new, self.ref = [], [], [], [], []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        share = share or {}
        for i, (ql, c) in enumerate(lens):
            nb = -(-c // bs)
            table: list[int] = []
            k = torch.randn(c, kv_heads, head_dim, generator=gen, dtype=torch.float64)
            v = torch.randn(c, kv_heads, head_dim, generator=gen, dtype=torch.float64)
            if i in share:
                j = share[i]
                # whole blocks of the other's cached prefix, before either's new tokens
                n_shared = min((c - ql) // bs, (lens[j][1] - lens[j][0]) // bs)
                table = self.tables[j][:n_shared]
                k[: n_shared * bs] = keys[j][: n_shared * bs]
                v[: n_shared * bs] = values[j][: n_shared * bs]
            table = table + [free.pop() for _ in range(nb - len(table))]
            self.tables.append(table)
            keys.append(k)
            values.append(v)
            pos = torch.arange(c)
            slot = torch.tensor(table)[pos // bs] * bs + pos % bs
            self.k_cache[slot[: c - ql]] = k[: c - ql].to(dtype)
            self.v_cache[slot[: c - ql]] = v[: c - ql].to(dtype)
            self.slots_new.append(slot[c - ql :])
            self.k_new.append(k[c - ql :].to(dtype))
            self.v_new.append(v[c - ql :].to(dtype))
            q = torch.randn(ql, heads, head_dim, generator=gen, dtype=torch.float64)
            self.q.append(q.to(dtype))
            self.ref.append(self._reference(q, k.to(dtype).double(), v.to(dtype).double(), c))
        self.device = device
        self.k_cache, self.v_cache = self.k_cache.to(device), self.v_cache.to(device)

    @staticmethod
    def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int) -> torch.Tensor:
        ql, heads, d = q.shape
        group = heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        pos = torch.arange(c - ql, c)[:, None]
        scores = scores.masked_fill(torch.arange(c)[None, :] > pos, -math.inf)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out.reshape(ql, heads * d)

    def metadata(self, width_extra: int = 0):
        tk = _kernels()
        qls = np.array([q for q, _ in self.lens])
        cls_ = np.array([c for _, c in self.lens])
        width = max(len(t) for t in self.tables) + width_extra
        tables = np.full((len(self.lens), width), 10**9)  # garbage past each table
        for i, t in enumerate(self.tables):
            tables[i, : len(t)] = t

        def dev(a) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, dtype=np.int64), device=self.device)

        return tk.TritonAttention(
            query_starts=dev(np.cumsum(qls) - qls),
            query_lens=dev(qls),
            context_lens=dev(cls_),
            block_tables=dev(tables),
            block_size=self.block_size,
            max_query_len=int(qls.max()),
            max_splits=tk.decode_splits(int(cls_.max())),
        )

    def run(self, **kw) -> torch.Tensor:
        meta = self.metadata(**kw)
        meta.store(
            self.k_cache,
            self.v_cache,
            torch.cat(self.slots_new).to(self.device),
            torch.cat(self.k_new).to(self.device),
            torch.cat(self.v_new).to(self.device),
        )
        return meta.attend(torch.cat(self.q).to(self.device), self.k_cache, self.v_cache)

    def rel_error(self, out: torch.Tensor) -> float:
        ref = torch.cat(self.ref)
        assert out.shape == ref.shape
        assert torch.isfinite(out).all(), "a NaN slot was read"
        return float((out.double().cpu() - ref).norm() / ref.norm())


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (6, 2), (9, 3), (4, 1)])
def test_mixed_step_equals_the_dense_reference(device, block_size, heads, kv_heads) -> None:
    """Prefill chunks, an extend over a cached prefix and decodes, in one step."""
    skip_unless_runs("triton", device)
    lens = [(7, 7), (1, 40), (12, 37), (1, 1), (3, 19)]
    s = Scenario(lens, heads=heads, kv_heads=kv_heads, head_dim=16, block_size=block_size,
                 dtype=torch.float32, device=device, seed=block_size + heads)  # fmt: skip
    assert s.rel_error(s.run()) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_split_over_long_contexts(device, block_size) -> None:
    """Decode-only steps run in pieces of SPLIT_LEN keys, merged by log-sum-exp."""
    skip_unless_runs("triton", device)
    tk = _kernels()
    lens = [(1, 2 * tk.SPLIT_LEN + 37), (1, 5), (1, tk.SPLIT_LEN), (1, tk.SPLIT_LEN + 1)]
    s = Scenario(lens, heads=6, kv_heads=2, head_dim=16, block_size=block_size,
                 dtype=torch.float32, device=device, seed=3)  # fmt: skip
    meta = s.metadata()
    assert meta.max_query_len == 1 and meta.max_splits == 3
    assert s.rel_error(s.run(width_extra=3)) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_shared_prefix_blocks_and_reused_holes(device) -> None:
    """Sequences that share leading blocks (a cache hit) read them in place, once written."""
    skip_unless_runs("triton", device)
    lens = [(5, 53), (1, 60), (9, 41), (1, 33)]
    s = Scenario(lens, heads=4, kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
                 device=device, seed=11, share={1: 0, 2: 0, 3: 1})  # fmt: skip
    assert s.tables[1][:10] == s.tables[0][:10]
    assert s.rel_error(s.run()) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    "config",
    [
        None,
        {"BLOCK_M": 16, "BLOCK_N": 16},
        {"BLOCK_M": 32, "BLOCK_N": 64},
        {"BLOCK_M": 32, "BLOCK_N": 16, "FOLD_GQA": False},
    ],
    ids=["default", "16x16", "32x64", "unfolded-32x16"],
)
@pytest.mark.slow  # on the CPU: Triton's interpreter over 8 configurations
def test_long_extends_split_the_unmasked_bulk_from_the_diagonal(
    device, block_size, config, monkeypatch
) -> None:
    """Tiles deep into a long extend or cached prefix read most keys unmasked.

    Every tile's keys up to its first query's diagonal take the unmasked pass, the
    rest the masked one; tile sizes that do and do not divide the page, the group
    or the prefix all equal the reference.
    """
    skip_unless_runs("triton", device)
    tk = _kernels()
    if config is not None:
        for size, default in list(tk.PREFILL_CONFIGS.items()):
            monkeypatch.setitem(tk.PREFILL_CONFIGS, size, {**default, **config})
    # (extend, total) per sequence; halved under Triton's interpreter (no GPU), where a
    # program instance is a Python call: still several tiles deep for every tile size,
    # and prefixes (total - extend) that do and do not divide the page and the tiles.
    if device == "cuda":
        lens = [(150, 150), (40, 200), (1, 90), (67, 131)]
    else:
        lens = [(75, 75), (20, 100), (1, 45), (33, 65)]
    s = Scenario(lens, heads=9, kv_heads=3, head_dim=16, block_size=block_size,
                 dtype=torch.float32, device=device, seed=7 + block_size)  # fmt: skip
    assert s.rel_error(s.run()) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [12, 64])
def test_head_dims_that_are_not_a_tile(device, head_dim) -> None:
    skip_unless_runs("triton", device)
    s = Scenario([(6, 30), (1, 17)], heads=3, kv_heads=1, head_dim=head_dim, block_size=4,
                 dtype=torch.float32, device=device, seed=head_dim)  # fmt: skip
    assert s.rel_error(s.run()) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_float16_pool(device) -> None:
    skip_unless_runs("triton", device)
    s = Scenario([(9, 30), (1, 300), (1, 17)], heads=9, kv_heads=3, head_dim=64, block_size=16,
                 dtype=torch.float16, device=device, seed=5)  # fmt: skip
    assert s.rel_error(s.run()) < TOL[torch.float16]


@settings(max_examples=15, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    group=st.sampled_from([1, 2, 3]),
    lens=st.lists(
        st.tuples(st.integers(1, 24), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])),
        min_size=1,
        max_size=5,
    ),
    decode_only=st.booleans(),
    config=st.sampled_from(
        [{}, {"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 16, "FOLD_GQA": False}]
    ),
    seed=st.integers(0, 2**16),
)
def test_random_steps_equal_the_dense_reference(block_size, group, lens, decode_only, config, seed):
    skip_unless_runs("triton", "cpu")
    tk = _kernels()
    if decode_only:
        lens = [(1, c) for _, c in lens]
    s = Scenario(lens, heads=2 * group, kv_heads=2, head_dim=16, block_size=block_size,
                 dtype=torch.float32, device="cpu", seed=seed)  # fmt: skip
    saved = dict(tk.PREFILL_CONFIGS)
    try:
        for size in saved:
            tk.PREFILL_CONFIGS[size] = {**saved[size], **config}
        out = s.run()
    finally:
        tk.PREFILL_CONFIGS.update(saved)
    assert s.rel_error(out) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_store_writes_its_slots_and_skips_negative_ones(device) -> None:
    skip_unless_runs("triton", device)
    tk = _kernels()
    k_cache = torch.full((12, 2, 8), math.nan, device=device)
    v_cache = torch.full((12, 2, 8), math.nan, device=device)
    k, v = torch.randn(3, 2, 8, device=device), torch.randn(3, 2, 8, device=device)
    meta = tk.TritonAttention(*(torch.zeros(1, dtype=torch.int64),) * 3,
                              torch.zeros(1, 1, dtype=torch.int64), 4, 1, 1)  # fmt: skip
    meta.store(k_cache, v_cache, torch.tensor([5, -1, 0], device=device), k, v)
    assert torch.equal(k_cache[5], k[0]) and torch.equal(v_cache[0], v[2])
    written = torch.zeros(12, dtype=torch.bool)
    written[[0, 5]] = True
    assert torch.isnan(k_cache[~written.to(device)]).all()
    assert torch.isnan(v_cache[~written.to(device)]).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    "lens",
    [
        [(1, 1500)] * 8 + [(1, 700)] * 8,  # decode, long contexts
        [(128, 640), (1, 512), (1, 1024)],  # a prefill chunk with decodes
        [(256, 256), (300, 900)],  # prefill and extend
    ],
    ids=["decode", "mixed", "prefill"],
)
def test_cuda_equals_padded_and_the_reference(dtype, block_size, lens) -> None:
    """On the GPU, the ladder of shapes in every dtype: triton == padded == float64 reference."""
    s = Scenario(lens, heads=9, kv_heads=3, head_dim=64, block_size=block_size, dtype=dtype,
                 device="cuda", seed=block_size)  # fmt: skip
    got = s.run()
    assert s.rel_error(got) < TOL[dtype]
    meta = AttentionMetadata.build(
        [q for q, _ in lens], [c for _, c in lens], [np.array(t) for t in s.tables],
        block_size=block_size, group_size=3, backend="padded", device="cuda",
    )  # fmt: skip
    padded = paged_attention(torch.cat(s.q).cuda(), s.k_cache, s.v_cache, meta)
    torch.testing.assert_close(got.float(), padded.float(), atol=TOL[dtype] * 10, rtol=0)
