"""Test helpers: a minimal paged driver for the decoder (no scheduler, no cache structure).

``PagedSession`` hands each sequence blocks from a shuffled free list (so block
tables are scattered across the pool), builds one :class:`ForwardBatch` per step
from a plan ``{seq: new tokens this step}``, and can start a sequence on another
sequence's leading blocks, as a cache hit would.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from radixkv.model import DECODER_BACKENDS, Decoder, ModelConfig
from radixkv.model.forward_batch import ForwardBatch, triton_backend_runs_on

# Tests that take a ``device`` run on the CPU always and on CUDA when a GPU is visible;
# ``pytest -m cuda`` selects the GPU half.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


# The engine suites' tiny decoder: 2 layers, hidden 64, vocabulary 256 (GQA: 4 heads, 2 KV).
ENGINE_CONFIG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
)


# The decoder backends that can run on the CPU here: ``triton`` needs Triton's
# interpreter there (conftest turns it on where no GPU is visible).
CPU_BACKENDS = [b for b in DECODER_BACKENDS if b != "triton" or triton_backend_runs_on("cpu")]
# The backends that run at compiled speed on the CPU: without a GPU, ``triton`` runs in
# Triton's interpreter (one Python call per program instance, ~100x slower), so the
# property tests that draw many workloads use these, and triton is checked on fixed
# scenarios (test_engine.py's test_every_backend_with_cache_equals_loop_without).
FAST_CPU_BACKENDS = [b for b in CPU_BACKENDS if b != "triton"]


def skip_unless_runs(backend: str, device: str) -> None:
    """Skip the calling test when ``backend`` cannot run on ``device`` here."""
    if backend == "triton" and not triton_backend_runs_on(device):
        pytest.skip(f"the triton backend does not run on {device} here")


def on_device(model: Decoder, device: str) -> Decoder:
    """``model`` itself on the CPU, else a copy moved to ``device`` (the original stays put)."""
    return model if device == "cpu" else copy.deepcopy(model).to(device)


class PagedSession:
    def __init__(
        self,
        model: Decoder,
        block_size: int,
        num_blocks: int,
        seed: int = 0,
        fill: float = math.nan,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.pool = model.make_kv_pool(num_blocks, block_size)
        for t in (*self.pool.k, *self.pool.v):
            t.fill_(fill)  # NaN: any read of a slot never written poisons the logits
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}

    def add(self, sid: int, tokens: list[int], share: tuple[int, int] | None = None) -> None:
        """Register a sequence; ``share=(other, n)`` starts it on ``other``'s first ``n`` blocks."""
        self.tokens[sid] = list(tokens)
        self.tables[sid] = []
        self.done[sid] = 0
        if share is not None:
            other, n = share
            assert tokens[: n * self.block_size] == self.tokens[other][: n * self.block_size]
            self.tables[sid] = self.tables[other][:n]
            self.done[sid] = n * self.block_size

    def remaining(self, sid: int) -> int:
        return len(self.tokens[sid]) - self.done[sid]

    def step(self, plan: dict[int, int]) -> dict[int, torch.Tensor]:
        """Run ``plan[sid]`` new tokens of each sequence; return each one's last-token logits."""
        batch = self.batch(plan)
        logits = self.model(batch, self.pool)
        return {sid: logits[i] for i, sid in enumerate(plan)}

    def batch(self, plan: dict[int, int]) -> ForwardBatch:
        """The batch of ``plan`` (blocks allocated, sequences advanced), for the model's backend."""
        bs = self.block_size
        ids, qls, cls, tables = [], [], [], []
        for sid, n in plan.items():
            start = self.done[sid]
            assert 1 <= n <= self.remaining(sid)
            while len(self.tables[sid]) * bs < start + n:
                self.tables[sid].append(self.free.pop())
            ids.extend(self.tokens[sid][start : start + n])
            qls.append(n)
            cls.append(start + n)
            tables.append(list(self.tables[sid]))
            self.done[sid] = start + n
        return ForwardBatch.build(
            ids,
            qls,
            cls,
            tables,
            block_size=bs,
            num_blocks=self.pool.num_blocks,
            backend=self.model.backend_for(self.pool.device),
            group_size=self.model.config.group_size,
            device=self.pool.device,
        )

    def append(self, sid: int, token: int) -> None:
        self.tokens[sid].append(token)


def paged_greedy(
    model: Decoder,
    prompt: list[int],
    max_new_tokens: int,
    block_size: int = 4,
    chunk: int = 5,
    num_blocks: int = 64,
    seed: int = 0,
) -> list[int]:
    """Greedy continuation on the paged path: the prompt in ``chunk``-token pieces, then decodes."""
    s = PagedSession(model, block_size, num_blocks, seed)
    s.add(0, prompt)
    while True:
        out = s.step({0: min(chunk, s.remaining(0))})[0]
        if s.remaining(0) == 0:
            break
    generated = []
    for i in range(max_new_tokens):
        nxt = int(out.argmax())
        generated.append(nxt)
        if i + 1 == max_new_tokens:
            break
        s.append(0, nxt)
        out = s.step({0: 1})[0]
    return generated


# Small GQA decoder shared by the model tests, and their tolerance against the dense reference.
GQA = ModelConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
)
TOL = {"rtol": 1e-4, "atol": 1e-4}


def check_against_dense(model: Decoder, s: PagedSession, got: dict[int, torch.Tensor]) -> None:
    """Each sequence's last-token logits equal the dense no-cache forward of its tokens so far."""
    for sid, logits in got.items():
        ref = model.forward_dense(torch.tensor(s.tokens[sid][: s.done[sid]]))[-1]
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(logits, ref, **TOL)
