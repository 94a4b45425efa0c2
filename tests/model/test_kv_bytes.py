"""The store tier's engine-side pieces: the "kv-v1" block codec, the model digest, the keyspace."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.kv_store import store_keyspace
from radixkv.model import SMALL_CONFIG, KVPool, ModelConfig, from_pretrained, random_model
from radixkv.model.digest import model_digest
from radixkv.model.kv_bytes import KV_LAYOUT, KVBlockCodec

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 12, 4, 2, 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_BITS = {4: torch.int32, 2: torch.int16}  # a float dtype's bits as an int dtype of its width


def random_pool(dtype: torch.dtype, seed: int) -> KVPool:
    """A CPU pool whose every element has random bits (NaNs, infinities, -0 included)."""
    pool = KVPool(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(seed)
    bits = _BITS[pool.k[0].element_size()]
    info = torch.iinfo(bits)
    for t in (*pool.k, *pool.v):
        t.view(bits).copy_(torch.randint(info.min, info.max, t.shape, generator=g, dtype=bits))
    return pool


def block_bits(pool: KVPool, block: int) -> np.ndarray:
    """Block ``block`` of ``pool`` as [2, layers, block_size, heads, head_dim] raw integers,
    K before V: the layout, built independently of the codec."""
    rows = slice(block * pool.block_size, (block + 1) * pool.block_size)
    bits = _BITS[pool.k[0].element_size()]
    return torch.stack(
        [torch.stack([t[rows].view(bits) for t in side]) for side in (pool.k, pool.v)]
    ).numpy()


def snapshot(pool: KVPool) -> list[torch.Tensor]:
    return [t.view(_BITS[t.element_size()]).clone() for t in (*pool.k, *pool.v)]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------ the codec
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_round_trip_is_bit_identical_and_touches_only_the_named_blocks(
    dtype: torch.dtype, data: st.DataObject
) -> None:
    src = random_pool(dtype, seed=data.draw(st.integers(0, 2**31 - 1), label="seed"))
    ids = data.draw(st.lists(st.integers(0, BLOCKS - 1), max_size=BLOCKS), label="src ids")
    dst_ids = data.draw(st.permutations(range(BLOCKS)), label="dst order")[: len(ids)]
    values = KVBlockCodec(src).host_blocks_to_bytes(np.asarray(ids, dtype=np.int32))
    assert all(type(v) is bytes and len(v) == src.bytes_per_block for v in values)
    for b, v in zip(ids, values, strict=True):  # the documented layout, bit for bit
        want = block_bits(src, b)
        assert np.array_equal(np.frombuffer(v, dtype=want.dtype).reshape(want.shape), want)

    dst = random_pool(dtype, seed=1)
    before = snapshot(dst)
    KVBlockCodec(dst).bytes_to_host_blocks(values, dst_ids)
    for s, d in zip(ids, dst_ids, strict=True):
        assert np.array_equal(block_bits(dst, d), block_bits(src, s))
    untouched = [b for b in range(BLOCKS) if b not in dst_ids]
    for b in untouched:
        blk = slice(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)
        assert all(torch.equal(a[blk], t[blk]) for a, t in zip(before, snapshot(dst), strict=True))


def test_the_layout_is_k_of_every_layer_then_v() -> None:
    """A known answer: element (side, layer, slot, head, dim) holds a number naming it."""

    def label(side: int, layer: int, slot: int, head: int, dim: int) -> float:
        return side * 10000 + layer * 1000 + slot * 10 + head * 2 + dim

    pool = KVPool(2, 3, 2, 2, 2, dtype=torch.float32, device="cpu")
    for side, tensors in enumerate((pool.k, pool.v)):
        for layer, t in enumerate(tensors):
            for slot, head, dim in np.ndindex(*t.shape):
                t[slot, head, dim] = label(side, layer, slot, head, dim)
    (payload,) = KVBlockCodec(pool).host_blocks_to_bytes([1])
    want = [
        label(side, layer, slot, head, dim)
        for side in range(2)
        for layer in range(2)
        for slot in (2, 3)  # block 1 of block_size 2
        for head in range(2)
        for dim in range(2)
    ]
    assert np.frombuffer(payload, dtype="<f4").tolist() == want and KV_LAYOUT == "kv-v1"


# Stand-ins in the cases below: a valid payload, one a byte too long, one not contiguous.
GOOD, LONG, STRIDED = "<good>", "<long>", "<strided>"


@pytest.mark.parametrize(
    "values, ids, match",
    [
        ([GOOD, b"\0" * 7], [0, 1], r"values\[1\] must be \d+ bytes .*got 7"),
        ([GOOD, LONG], [0, 1], r"values\[1\] must be \d+ bytes"),
        ([GOOD, b""], [0, 1], r"values\[1\] must be \d+ bytes .*got 0"),
        ([GOOD, "text"], [0, 1], r"values\[1\] must be bytes-like .*str"),
        ([GOOD, None], [0, 1], r"values\[1\] must be bytes-like"),
        ([GOOD, [1, 2, 3]], [0, 1], r"values\[1\] must be bytes-like .*list"),
        ([GOOD, np.zeros(4)], [0, 1], r"values\[1\] must be bytes-like .*ndarray"),
        ([GOOD, STRIDED], [0, 1], r"values\[1\] must be a contiguous buffer"),
        (GOOD, [0], r"values must be a sequence of payloads, got bytes"),
        ([GOOD, GOOD], [0], r"host_ids must have one block per value: 1 ids for 2 values"),
        ([GOOD, GOOD], [0, BLOCKS], rf"host_ids\[1\] must be an int in \[0, {BLOCKS - 1}\]"),
        ([GOOD, GOOD], [0, -1], r"host_ids\[1\]"),
        ([GOOD, GOOD], [0, 1.0], r"host_ids\[1\] must be an int"),
        ([GOOD, GOOD], [3, 3], r"host_ids\[1\] repeats block 3 \(host_ids\[0\]\)"),
        ([GOOD, GOOD], np.zeros((1, 2), dtype=np.int64), r"host_ids must be 1-D"),
        ([GOOD, GOOD], "01", r"host_ids must be a sequence of block ids"),
    ],
)
def test_bad_values_or_ids_are_refused_naming_them_before_any_write(
    values: object, ids: object, match: str
) -> None:
    pool = random_pool(torch.bfloat16, seed=4)
    codec = KVBlockCodec(pool)
    (good,) = codec.host_blocks_to_bytes([7])
    stand_in = {GOOD: good, LONG: good + b"\0", STRIDED: memoryview(good + good)[::2]}
    if values == GOOD:
        values = good
    else:
        values = [stand_in.get(v, v) if isinstance(v, str) else v for v in values]
    before = snapshot(pool)
    with pytest.raises(ValueError, match=match):
        codec.bytes_to_host_blocks(values, ids)
    assert same_bits(before, snapshot(pool))


def test_reads_name_a_bad_block_id() -> None:
    codec = KVBlockCodec(random_pool(torch.float16, seed=5))
    with pytest.raises(ValueError, match=rf"host_ids\[2\] must be an int in \[0, {BLOCKS - 1}\]"):
        codec.host_blocks_to_bytes([0, 1, BLOCKS])
    with pytest.raises(TypeError, match=r"host_ids\[0\] must be an int"):
        codec.host_blocks_to_bytes([True])
    assert codec.host_blocks_to_bytes([]) == []


def test_the_codec_wants_a_cpu_pool() -> None:
    with pytest.raises(ValueError, match="host pool must be on the CPU, got device meta"):
        KVBlockCodec(KVPool(1, 2, 2, 1, 2, device="meta"))
    with pytest.raises(TypeError, match="host must be a KVPool, got list"):
        KVBlockCodec([])  # type: ignore[arg-type]


# ------------------------------------------------------------------ the model digest
TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=2000.0,
    rms_norm_eps=1e-5,
)


def save_hf(model: torch.nn.Module, config: ModelConfig, path: Path) -> None:
    """``model`` as a Hugging Face llama directory (config.json + one safetensors file)."""
    from safetensors.torch import save_file

    path.mkdir()
    hf = {
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    (path / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "m.safetensors")


def test_the_digest_is_stable_across_loads_in_separate_processes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "tiny"
    save_hf(random_model(TINY, seed=7), TINY, checkpoint)
    script = (
        "import sys; from radixkv.model import from_pretrained; "
        "from radixkv.model.digest import model_digest; "
        "print(model_digest(from_pretrained(sys.argv[1], device='cpu')))"
    )
    other = subprocess.Popen(  # loads while this process loads too
        [sys.executable, "-c", script, str(checkpoint)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    here = model_digest(from_pretrained(checkpoint, device="cpu"))
    out, err = other.communicate(timeout=300)
    assert other.returncode == 0, err
    assert out.strip() == here
    assert len(here) == 64 and int(here, 16) >= 0
    assert here == model_digest(random_model(TINY, seed=7))  # the weights, not the file


def test_one_flipped_weight_bit_changes_the_digest() -> None:
    model = random_model(TINY, seed=7)
    base = model_digest(model)
    state = model.state_dict()
    for name in ("embed_tokens.weight", "layers.1.mlp.down_proj.weight", "norm.weight"):
        bits = state[name].view(torch.int32).view(-1)
        bits[-1] ^= 1  # the lowest mantissa bit of the last element
        assert model_digest(model) != base, name
        bits[-1] ^= 1
        assert model_digest(model) == base


def test_config_dtype_and_seed_enter_the_digest() -> None:
    base = model_digest(random_model(TINY, seed=7))
    other_theta = dataclasses.replace(TINY, rope_theta=10000.0)  # same weights, other config
    assert model_digest(random_model(other_theta, seed=7)) != base
    assert model_digest(random_model(TINY, seed=8)) != base
    assert model_digest(random_model(TINY, seed=7).to(torch.bfloat16)) != base
    with pytest.raises(TypeError, match="model must be a Decoder, got str"):
        model_digest("smollm2")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the keyspace
def test_the_keyspace_names_model_dtype_block_size_and_layout() -> None:
    model = random_model(SMALL_CONFIG, seed=0)
    c = SMALL_CONFIG
    fp32 = store_keyspace(model, model.make_kv_pool(4, 16, device="cpu"))
    assert (fp32.dtype, fp32.block_size, fp32.layout) == ("float32", 16, KV_LAYOUT)
    assert (fp32.num_layers, fp32.num_kv_heads, fp32.head_dim) == (
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
    )
    assert fp32.model_digest == model_digest(model)
    host = store_keyspace(model, model.make_kv_pool(9, 16, device="cpu"))
    assert host == fp32 and host.digest == fp32.digest  # the pool's size is no part of it
    others = [
        store_keyspace(model, model.make_kv_pool(4, 16, dtype=torch.bfloat16, device="cpu")),
        store_keyspace(model, model.make_kv_pool(4, 16, dtype=torch.float16, device="cpu")),
        store_keyspace(model, model.make_kv_pool(4, 8, device="cpu")),
        store_keyspace(random_model(SMALL_CONFIG, seed=1), model.make_kv_pool(4, 16, device="cpu")),
    ]
    digests = {ks.digest for ks in [fp32, *others]}
    assert len(digests) == 5
    tokens = list(range(32))
    assert len({ks.block_keys(tokens)[0] for ks in [fp32, *others]}) == 5


@pytest.mark.parametrize(
    "field, value", [("num_layers", 3), ("num_kv_heads", 1), ("head_dim", 16)]
)
def test_the_keyspace_refuses_a_pool_not_shaped_for_the_model(field: str, value: int) -> None:
    model = random_model(SMALL_CONFIG, seed=0)
    shape = {
        "num_layers": SMALL_CONFIG.num_layers,
        "num_blocks": 2,
        "block_size": 4,
        "num_kv_heads": SMALL_CONFIG.num_kv_heads,
        "head_dim": SMALL_CONFIG.head_dim,
    }
    shape[field] = value
    want = getattr(SMALL_CONFIG, field)
    with pytest.raises(ValueError, match=rf"pool.{field} must equal the model's {want}, got"):
        store_keyspace(model, KVPool(**shape, device="cpu"))
