"""CUDA graphs for decode steps: the ladder, the padding, the static buffers, and the engine.

The pure parts (batch sizes, the host-side fill) are checked here on any machine;
the static-buffer path runs eagerly on the CPU under Triton's interpreter
(``DecodeGraphs(capture=False)``), so padding rows are checked to write nothing
and change no real row's logits. Capture and replay themselves need a GPU
(``cuda``-marked).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_helpers import ENGINE_CONFIG, TOL, skip_unless_runs

from radixkv.engine import Engine, EngineConfig, SamplingParams
from radixkv.engine.model_runner import EagerRunner, GraphRunner
from radixkv.model import ForwardBatch, random_model
from radixkv.model.cuda_graphs import (
    DecodeGraphs,
    decode_input_layout,
    fill_decode_inputs,
    graph_batch_sizes,
    pick_batch_size,
)
from radixkv.workloads import ChatWorkload

needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_batch_size_ladder() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(4) == (1, 2, 4)
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="max_batch_size"):
            graph_batch_sizes(bad)


def test_pick_the_smallest_batch_that_holds_the_step() -> None:
    sizes = graph_batch_sizes(20)
    assert [pick_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == [
        1, 2, 4, 8, 8, 16, 20, 20,
    ]  # fmt: skip
    assert pick_batch_size(21, sizes) is None


def test_fill_pads_rows_to_write_nothing_and_read_nothing() -> None:
    width, bs = 3, 4
    layout = decode_input_layout(8, width)
    buf = np.full(layout["block_tables"].stop, 77, dtype=np.int64)
    fill_decode_inputs(buf, layout, width, 4, [5, 6], [9, 4], [[3, 1, 8, 99], [2]], bs)
    assert buf[layout["input_ids"]][:4].tolist() == [5, 6, 0, 0]
    assert buf[layout["positions"]][:4].tolist() == [8, 3, 0, 0]
    # position 8 of table [3, 1, 8] is block 8, offset 0; position 3 of [2] is slot 11
    assert buf[layout["slot_mapping"]][:4].tolist() == [32, 11, -1, -1]
    assert buf[layout["context_lens"]][:4].tolist() == [9, 4, 0, 0]
    tables = buf[layout["block_tables"]].reshape(8, width)
    assert tables[0].tolist() == [3, 1, 8] and tables[1, 0] == 2
    assert buf[layout["input_ids"]][4:].tolist() == [77] * 4  # rows past the batch untouched


def test_fill_rejects_what_the_graphs_cannot_hold_before_writing() -> None:
    layout = decode_input_layout(4, 2)
    buf = np.zeros(layout["block_tables"].stop, dtype=np.int64)
    with pytest.raises(ValueError, match="does not fit batch_size 2"):
        fill_decode_inputs(buf, layout, 2, 2, [1, 2, 3], [1, 1, 1], [[0]] * 3, 4)
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 9 is outside \[1, 8\]"):
        fill_decode_inputs(buf, layout, 2, 2, [1, 2], [3, 9], [[0], [1, 2, 3]], 4)
    assert not buf.any()


def _prefill(model, kv, prompts: list[list[int]], tables: list[list[int]], bs: int) -> None:
    batch = ForwardBatch.build(
        np.concatenate(prompts), [len(p) for p in prompts], [len(p) for p in prompts], tables,
        block_size=bs, num_blocks=kv.num_blocks, backend="triton", group_size=2, device="cpu",
    )  # fmt: skip
    model(batch, kv)


def test_static_path_equals_eager_and_padding_writes_nothing() -> None:
    skip_unless_runs("triton", "cpu")
    model = random_model(ENGINE_CONFIG, seed=3, attention_backend="triton")
    bs = 4
    kv = model.make_kv_pool(40, bs)
    for t in (*kv.k, *kv.v):
        t.fill_(math.nan)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [4, 4, 4, 4, 4]]
    tables = [[7, 3], [12], [30, 2]]
    _prefill(model, kv, prompts, tables, bs)
    graphs = DecodeGraphs(model, kv, max_batch_size=8, max_context_len=16, capture=False)
    assert graphs.sizes == (1, 2, 4, 8) and graphs.width == 4
    before = [t.clone() for t in (*kv.k, *kv.v)]
    got = graphs.run([11, 12, 13], [8, 4, 6], tables)  # padded to 4 rows
    written = torch.zeros(kv.num_slots, dtype=torch.bool)
    written[[3 * bs + 3, 12 * bs + 3, 2 * bs + 1]] = True
    for old, new in zip(before, (*kv.k, *kv.v), strict=True):
        assert torch.isfinite(new[written]).all()
        assert torch.equal(old[~written].isnan(), new[~written].isnan())  # nothing else written
    # the same step built eagerly (no padding), on a copy of the pool before it
    kv2 = model.make_kv_pool(40, bs)
    for dst, src in zip((*kv2.k, *kv2.v), before, strict=True):
        dst.copy_(src)
    batch = ForwardBatch.build(
        [11, 12, 13], [1, 1, 1], [8, 4, 6], tables, block_size=bs, num_blocks=40,
        backend="triton", group_size=2, device="cpu",
    )  # fmt: skip
    want = model(batch, kv2)
    assert got.shape == want.shape == (3, ENGINE_CONFIG.vocab_size)
    # Attention splits by each decode's own context, but the projections are GEMMs over 4
    # rows here and 3 there, and a BLAS may block (so round) the two shapes differently on
    # a given CPU: equal within the model tolerance (as against the dense reference), not
    # to float32's last bits.
    torch.testing.assert_close(got, want, **TOL)


def test_graphs_need_the_triton_backend_and_capture_needs_cuda() -> None:
    model = random_model(ENGINE_CONFIG, seed=0, attention_backend="loop")
    kv = model.make_kv_pool(8, 4)
    with pytest.raises(ValueError, match="triton"):
        DecodeGraphs(model, kv, 4, 16, capture=False)
    model.attention_backend = "triton"
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, kv, 4, 16, capture=True)
    with pytest.raises(ValueError, match="max_context_len"):
        DecodeGraphs(model, kv, 4, 0, capture=False)


def _chat(
    engine: Engine, seed: int = 0, num_users: int = 5, new_tokens: int = 9
) -> list[list[int]]:
    wl = ChatWorkload(num_users=num_users, num_turns=2, system_len=37, user_len=(3, 9),
                      vocab_size=ENGINE_CONFIG.vocab_size, seed=seed)  # fmt: skip
    histories, outs = None, []
    for turn in range(wl.num_turns):
        prompts = wl.turn_prompts(turn, histories)
        got = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
        engine.check()
        histories = [np.concatenate([p, o.output_ids]) for p, o in zip(prompts, got, strict=True)]
        outs += [o.output_ids for o in got]
    return outs


@pytest.mark.slow  # Triton's interpreter on the CPU
@pytest.mark.parametrize("cache", ["radix", None])
def test_engine_with_the_static_path_equals_eager(cache) -> None:
    """The graph runner's path (eager here) gives the eager engine's greedy tokens."""
    skip_unless_runs("triton", "cpu")
    model = random_model(ENGINE_CONFIG, seed=0, attention_backend="triton")
    cfg = EngineConfig(block_size=4, num_blocks=200, max_num_seqs=6, cache=cache)
    # The eager engine's tokens, from the loop backend: test_engine.py pins the triton
    # backend's tokens to loop's, and triton's interpreter would double this test's time.
    # Three users, five tokens: batches of 1-3 decodes padded to graph sizes, under the
    # interpreter's cost.
    loop = random_model(ENGINE_CONFIG, seed=0, attention_backend="loop")
    want = _chat(Engine(loop, cfg), num_users=3, new_tokens=5)
    engine = Engine(model, cfg)
    assert isinstance(engine.runner, EagerRunner)  # the CPU never captures
    runner = GraphRunner(DecodeGraphs(model, engine.kv_pool, 6, 64, capture=False), engine.runner)
    engine.runner = runner
    assert _chat(engine, num_users=3, new_tokens=5) == want
    assert runner.num_replayed > 0 and runner.num_eager > 0  # decodes replayed, prefills not


@pytest.mark.parametrize("cache", ["radix", "hash", None])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=needs_cuda)])
def test_cuda_graphs_on_equal_off_and_the_cpu(cache, mark) -> None:
    """Greedy tokens: graphs on == graphs off (triton) == padded == the CPU, cache on and off."""
    cpu_model = random_model(ENGINE_CONFIG, seed=0, attention_backend="loop")
    cfg = dict(block_size=4, num_blocks=200, max_num_seqs=6, cache=cache)
    want = _chat(Engine(cpu_model, EngineConfig(**cfg)))
    results = {}
    for backend, graphs in (("triton", True), ("triton", False), ("padded", False)):
        model = random_model(ENGINE_CONFIG, seed=0, attention_backend=backend).cuda()
        engine = Engine(model, EngineConfig(**cfg, cuda_graphs=graphs))
        assert isinstance(engine.runner, GraphRunner) == (backend == "triton" and graphs)
        results[backend, graphs] = _chat(engine)
        if graphs:
            assert engine.runner.num_replayed > 0
    for key, got in results.items():
        assert got == want, key
