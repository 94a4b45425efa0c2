"""The paged decoder against its dense no-cache reference, and its input validation."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_helpers import (
    CPU_BACKENDS,
    DEVICES,
    GQA,
    TOL,
    PagedSession,
    check_against_dense,
    paged_greedy,
    skip_unless_runs,
)

from radixkv.model import DECODER_BACKENDS, Decoder, preferred_attention_backend, random_model
from radixkv.model.decoder import apply_rope, rope_cos_sin
from radixkv.model.forward_batch import ForwardBatch
from radixkv.model.gather import GatherWorkspace

torch.set_num_threads(1)

CONFIGS = {
    "gqa": GQA,
    "mha_untied": dataclasses.replace(GQA, num_kv_heads=6, tie_word_embeddings=False),
    "mqa_qwen3": dataclasses.replace(GQA, num_kv_heads=1, head_dim=12, qk_norm=True),
    "qwen2_bias": dataclasses.replace(
        GQA, num_kv_heads=3, qkv_bias=True, o_bias=True, mlp_bias=True
    ),
}


def _seqs(n: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (ln,), generator=g).tolist() for ln in lengths[:n]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", DECODER_BACKENDS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paged_matches_dense_mixed_steps(name: str, backend: str, device: str) -> None:
    skip_unless_runs(backend, device)
    model = random_model(CONFIGS[name], seed=1, attention_backend=backend).to(device)
    s = PagedSession(model, block_size=4, num_blocks=48, seed=2)
    for sid, toks in enumerate(_seqs(3, [23, 9, 14], 97, seed=3)):
        s.add(sid, toks)
    # step 1: three prefill chunks; 2: chunk + chunk + finishing chunk; then mixed decodes
    plans = [{0: 7, 1: 9, 2: 5}, {0: 6, 2: 9}, {0: 10}]
    for plan in plans:
        check_against_dense(model, s, s.step(plan))
    for _ in range(3):
        plan = {}
        for sid in (0, 1, 2):
            s.append(sid, (sid * 31 + len(s.tokens[sid])) % 97)
            plan[sid] = 1
        check_against_dense(model, s, s.step(plan))
    # a new sequence joins on sequence 0's first 3 blocks (a cache hit), mixed with decodes
    s.add(3, s.tokens[0][:12] + [5, 6, 7, 8, 9], share=(0, 3))
    s.append(1, 3)
    check_against_dense(model, s, s.step({1: 1, 3: 5}))


def test_paged_result_independent_of_blocks() -> None:
    """The same steps over other scattered block tables (or block sizes) give the same logits."""
    model = random_model(GQA, seed=4)
    seqs = _seqs(2, [19, 11], 97, seed=5)
    results = []
    for seed, bs in ((0, 4), (1, 4), (2, 4), (3, 1), (4, 16)):
        s = PagedSession(model, block_size=bs, num_blocks=64 // bs + 8, seed=seed)
        for sid, toks in enumerate(seqs):
            s.add(sid, toks)
        out = [s.step({0: 8, 1: 11}), s.step({0: 11})]
        results.append(torch.stack([out[0][0], out[0][1], out[1][0]]))
    for r in results[1:3]:  # same block size: the computation is identical, only addresses move
        assert torch.equal(r, results[0])
    for r in results[3:]:
        torch.testing.assert_close(r, results[0], **TOL)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 3, 8]),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    chunk_seed=st.integers(0, 2**16),
    backend=st.sampled_from(CPU_BACKENDS),
)
def test_paged_matches_dense_property(
    block_size: int, lengths: list[int], chunk_seed: int, backend: str
) -> None:
    cfg = dataclasses.replace(GQA, num_layers=1)
    model = random_model(cfg, seed=7, attention_backend=backend)
    s = PagedSession(model, block_size, num_blocks=sum(lengths) + 12, seed=chunk_seed)
    for sid, toks in enumerate(_seqs(len(lengths), lengths, 97, seed=chunk_seed)):
        s.add(sid, toks + [1, 2])  # two extra tokens to decode one by one
    g = torch.Generator().manual_seed(chunk_seed)
    while any(s.remaining(i) for i in s.tokens):
        plan = {}
        for sid in s.tokens:
            left = s.remaining(sid)
            if left > 2:  # prefill: a random chunk, never eating into the decode tail
                plan[sid] = int(torch.randint(1, left - 1, (1,), generator=g))
            elif left:
                plan[sid] = 1
        check_against_dense(model, s, s.step(plan))


def test_gather_workspace_reuses_grows_and_follows_dtype() -> None:
    ws = GatherWorkspace()
    like = torch.zeros(4, 2, 8)
    k10, v10 = ws.buffers(like, 10)
    assert k10.shape == v10.shape == (10, 2, 8) and k10.data_ptr() != v10.data_ptr()
    k5, _ = ws.buffers(like, 5)
    assert k5.shape[0] == 5 and k5.data_ptr() == k10.data_ptr()  # shrinking reuses
    k20, _ = ws.buffers(like, 20)
    assert k20.shape[0] == 20
    k_half, _ = ws.buffers(like.half(), 3)
    assert k_half.dtype == torch.float16
    k_wide, _ = ws.buffers(torch.zeros(1, 3, 8), 3)
    assert k_wide.shape == (3, 3, 8)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_workspace_gives_the_same_bits_as_fresh_tensors(backend: str) -> None:
    """Steps that grow and shrink the gathered context: reused buffers change nothing."""
    with_ws = random_model(GQA, seed=11, attention_backend=backend)
    without = random_model(GQA, seed=11, attention_backend=backend)
    without.gather_workspace = None
    seqs = _seqs(3, [21, 6, 13], 97, seed=12)
    got = []
    for model in (with_ws, without):
        s = PagedSession(model, block_size=4, num_blocks=40, seed=13)
        for sid, toks in enumerate(seqs):
            s.add(sid, toks)
        got.append([s.step(plan) for plan in ({0: 21, 1: 6, 2: 13},)])
        s.add(3, seqs[0][:8] + [1, 2, 3], share=(0, 2))
        got[-1].append(s.step({3: 3}))  # a much smaller step after a large one
    for a, b in zip(got[0], got[1], strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_greedy_paged_equals_greedy_dense() -> None:
    model = random_model(CONFIGS["mqa_qwen3"], seed=8)
    prompt = _seqs(1, [13], 97, seed=9)[0]
    assert paged_greedy(model, prompt, 8, block_size=3, chunk=4) == model.greedy_dense(
        torch.tensor(prompt), 8
    )


def _one_batch(model: Decoder, bs: int = 4, num_blocks: int = 8, **kwargs: object) -> ForwardBatch:
    """Six tokens of one sequence over blocks 5 and 2, for a pool of ``num_blocks`` blocks."""
    options = {
        "block_size": bs,
        "num_blocks": num_blocks,
        "backend": model.backend_for("cpu"),
        "group_size": model.config.group_size,
        "device": "cpu",
    }
    options.update(kwargs)
    return ForwardBatch.build(range(6), [6], [6], [[5, 2]], **options)


@pytest.mark.parametrize(
    "pool_shape, match",
    [
        ((8, 2), "block_size=4"),  # another block size
        ((9, 4), "num_blocks=8"),  # another pool size
    ],
)
def test_batch_for_another_pool_rejected_before_pool_changes(pool_shape, match) -> None:
    model = random_model(GQA)
    pool = model.make_kv_pool(*pool_shape)
    batch = _one_batch(model)
    with pytest.raises(ValueError, match=match):
        model(batch, pool)
    assert not any(t.any() for t in (*pool.k, *pool.v))


def test_batch_for_another_group_size_rejected() -> None:
    model = random_model(GQA)
    batch = _one_batch(model, group_size=1)
    with pytest.raises(ValueError, match="group_size=1"):
        model(batch, model.make_kv_pool(8, 4))


def test_batch_on_another_device_rejected() -> None:
    model = random_model(GQA)
    batch = _one_batch(model, device="meta")  # no GPU needed to be elsewhere
    with pytest.raises(ValueError, match="one device"):
        model(batch, model.make_kv_pool(8, 4))


def test_pool_of_another_shape_rejected() -> None:
    model = random_model(GQA)
    batch = _one_batch(model)
    other = random_model(dataclasses.replace(GQA, num_kv_heads=3)).make_kv_pool(8, 4)
    with pytest.raises(ValueError, match="does not fit"):
        model(batch, other)


def test_backend_for_names_the_batch_backend() -> None:
    assert Decoder(GQA, attention_backend="varlen").backend_for("cpu") == "varlen"
    auto = Decoder(GQA)
    assert auto.backend_for("cpu") == preferred_attention_backend("cpu")
    assert auto.backend_for(torch.device("cuda")) == preferred_attention_backend("cuda")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_batch_backend_runs_whatever_the_model_default(backend: str) -> None:
    """A batch carries its backend's metadata: any decoder runs it, to the same logits."""
    model = random_model(GQA, seed=2, attention_backend="loop")
    ref = model(_one_batch(model), model.make_kv_pool(8, 4))
    got = model(_one_batch(model, backend=backend), model.make_kv_pool(8, 4))
    torch.testing.assert_close(got, ref, **TOL)


def test_forward_writes_only_its_slots() -> None:
    model = random_model(GQA)
    pool, batch = model.make_kv_pool(8, 4), _one_batch(model)
    for t in (*pool.k, *pool.v):
        t.fill_(math.nan)
    model(batch, pool)
    written = torch.zeros(pool.num_slots, dtype=torch.bool)
    written[batch.slot_mapping] = True
    for t in (*pool.k, *pool.v):
        assert torch.isfinite(t[written]).all()
        assert torch.isnan(t[~written]).all()


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("hidden_size", -1),
        ("num_layers", 1.5),
        ("num_kv_heads", 4),  # 6 heads are not a multiple of 4
        ("head_dim", 7),
        ("rope_theta", 0.0),
        ("rms_norm_eps", math.nan),
        ("qk_norm", 1),
    ],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    name = "num_heads" if field == "num_kv_heads" else field
    with pytest.raises(ValueError, match=name):
        dataclasses.replace(GQA, **{field: value})


def test_unknown_backend_rejected() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        Decoder(GQA, attention_backend="flash")


def test_rope_is_relative() -> None:
    """After RoPE, q.k depends only on the position difference; rotation keeps norms."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)

    def rot(x: torch.Tensor, p: int) -> torch.Tensor:
        cos, sin = rope_cos_sin(torch.tensor([p]), 16, 100.0, torch.float32)
        return apply_rope(x, cos, sin)

    d1 = (rot(q, 7) * rot(k, 3)).sum()
    d2 = (rot(q, 104) * rot(k, 100)).sum()
    d3 = (rot(q, 5) * rot(k, 3)).sum()
    torch.testing.assert_close(d1, d2, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(d1, d3, atol=1e-3)
    torch.testing.assert_close(rot(q, 9).norm(), q.norm())


def test_random_model_is_reproducible_and_attention_is_sharp() -> None:
    a, b = random_model(GQA, seed=3), random_model(GQA, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(
        a.layers[0].self_attn.q_proj.weight,
        random_model(GQA, seed=4).layers[0].self_attn.q_proj.weight,
    )
    # attention scores of the first layer spread well beyond HF's near-uniform init
    x = a.layers[0].input_layernorm(a.embed_tokens(torch.arange(20)))
    cos, sin = rope_cos_sin(torch.arange(20), GQA.head_dim, GQA.rope_theta, torch.float32)
    q, k, _ = a.layers[0].self_attn.qkv(x, cos, sin)
    scores = q[:, 0] @ k[:, 0].T / GQA.head_dim**0.5
    assert scores.std() > 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_paged_close_to_dense(dtype: torch.dtype, device: str) -> None:
    model = random_model(CONFIGS["mqa_qwen3"], seed=12).to(device=device, dtype=dtype)
    s = PagedSession(model, block_size=4, num_blocks=32)
    toks = _seqs(1, [27], 97, seed=13)[0]
    s.add(0, toks)
    s.step({0: 10})
    got = s.step({0: 17})[0]
    assert s.pool.k[0].dtype == dtype and got.dtype == torch.float32
    ref = model.forward_dense(torch.tensor(toks))[-1]
    torch.testing.assert_close(got, ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


def test_preferred_backend_per_device(monkeypatch) -> None:
    assert preferred_attention_backend("cpu") == "cascade"
    assert preferred_attention_backend("mps") == "loop"
    # CUDA (no GPU needed): the triton kernels, or padded where Triton is not installed
    want = "triton" if importlib.util.find_spec("triton") else "padded"
    assert preferred_attention_backend(torch.device("cuda")) == want
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert preferred_attention_backend("cuda") == "padded"


@pytest.mark.parametrize("device", DEVICES)
def test_default_backend_is_the_devices_preferred_one(device: str) -> None:
    """A decoder built without a backend gives the preferred backend's exact bits."""
    auto = random_model(GQA, seed=14).to(device)
    assert auto.attention_backend is None
    chosen = preferred_attention_backend(device)
    explicit = random_model(GQA, seed=14, attention_backend=chosen).to(device)
    seqs = _seqs(3, [22, 22, 9], 97, seed=15)
    seqs[1][:16] = seqs[0][:16]  # 4 shared blocks of 4: cascade has a group to form
    got = []
    for model in (auto, explicit):
        s = PagedSession(model, block_size=4, num_blocks=40, seed=16)
        s.add(0, seqs[0])
        s.step({0: 22})
        s.add(1, seqs[1], share=(0, 4))
        s.add(2, seqs[2])
        s.append(0, 5)
        # 0 (a decode) and 1 (a chunk) share their first 4 blocks in this step
        got.append(s.step({0: 1, 1: 6, 2: 9}))
    assert all(torch.equal(got[0][k], got[1][k]) for k in (0, 1, 2))
