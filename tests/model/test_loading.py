"""Loading checkpoints: Hugging Face directories against `transformers`, and GGUF files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from model_helpers import DEVICES, PagedSession, on_device, paged_greedy

from radixkv.model import Decoder, ModelConfig, from_pretrained, random_model
from radixkv.model.loading import (
    config_from_hf,
    permute_qk_for_gguf,
    unpermute_qk_from_gguf,
)
from radixkv.text.tokenizer import context_length

torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")


def _scale_init(model: torch.nn.Module, seed: int) -> None:
    """Weights far from HF's std 0.02 so attention is sharp and RoPE/GQA bugs show."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / hidden**0.5)


def _hf_model(kind: str, seed: int = 0):
    common = dict(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":  # q/k norm, head_dim != hidden / heads, tied head
        cfg = transformers.Qwen3Config(**common, head_dim=12, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    else:  # qwen2: q/k/v bias, tied head
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    model = cls(cfg).eval()
    _scale_init(model, seed)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2"])
def hf_pair(request, tmp_path_factory):
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = from_pretrained(path, device="cpu")
    return request.param, hf, ours, path


PROMPT = [3, 17, 99, 42, 42, 8, 64, 23, 1, 77, 5, 30, 12, 90]


def test_hf_config_translated(hf_pair) -> None:
    kind, hf, ours, _ = hf_pair
    c = ours.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.rope_theta) == (2, 6, 2, 500.0)
    assert c.head_dim == (12 if kind == "qwen3" else 8)
    assert c.qk_norm == (kind == "qwen3") and c.qkv_bias == (kind == "qwen2")
    assert c.tie_word_embeddings == (kind != "llama")


@pytest.mark.parametrize("device", DEVICES)
def test_logits_match_transformers(hf_pair, device) -> None:
    _, hf, ours, _ = hf_pair
    ours = on_device(ours, device)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():  # transformers on the CPU is the reference for both devices
        ref = hf(ids[None]).logits[0].float().to(device)
    assert ref.std() > 1.0  # the scaled init gives decisive logits
    torch.testing.assert_close(ours.forward_dense(ids), ref, rtol=1e-4, atol=1e-4)
    # paged, with the prompt's first 2 blocks coming from another sequence (a cache hit)
    s = PagedSession(ours, block_size=4, num_blocks=16)
    s.add(0, PROMPT[:9] + [7, 7])
    s.step({0: 11})
    s.add(1, PROMPT, share=(0, 2))
    got = s.step({1: 6})[1]
    torch.testing.assert_close(got, ref[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_continuation_matches_transformers(hf_pair, device) -> None:
    _, hf, ours, _ = hf_pair
    ours = on_device(ours, device)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = hf.generate(
            ids,
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=10,
        )
    expected = out[0, len(PROMPT) :].tolist()
    assert paged_greedy(ours, PROMPT, 10, block_size=4, chunk=6) == expected


def test_tied_head_absent_from_file_and_theta_at_top_level(hf_pair, tmp_path) -> None:
    kind, _, ours, path = hf_pair
    from safetensors.torch import load_file

    names = set(load_file(str(path / "model.safetensors")))
    assert ("lm_head.weight" in names) == (kind == "llama")
    cfg = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in cfg or "rope_theta" in cfg
    # the older layout: rope_theta at the top level
    params = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = params.get("rope_theta", cfg.get("rope_theta"))
    assert config_from_hf(cfg) == ours.config


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding"),
    ],
)
def test_unsupported_hf_configs_rejected(change: dict, match: str) -> None:
    cfg = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    cfg.update(change)
    with pytest.raises(ValueError, match=match):
        config_from_hf(cfg)


def test_missing_weight_rejected(hf_pair, tmp_path) -> None:
    _, _, ours, path = hf_pair
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="missing weights"):
        from_pretrained(tmp_path, device="cpu")


# ---------------------------------------------------------------- GGUF


def test_gguf_permutation_is_llama_cpps() -> None:
    w = np.arange(16, dtype=np.float32).reshape(8, 2)  # 2 heads of head_dim 4, 2 columns
    p = permute_qk_for_gguf(w, 2)
    # per head, rows [0, 1 | 2, 3] (two halves) become [0, 2, 1, 3] (interleaved pairs)
    assert p[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]
    assert np.array_equal(unpermute_qk_from_gguf(p, 2), w)


TINY = ModelConfig(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=2000.0,
    rms_norm_eps=1e-5,
)


def _write_gguf(model: Decoder, path: Path, qtype: str) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp's converter does; return what each weight should load as."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(256)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    names = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    expected = {}
    for name, t in model.state_dict().items():
        a = t.numpy().astype(np.float32)
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            part = rest.rsplit(".", 1)[0]
            gname = f"blk.{i}.{parts[part]}.weight"
            if part == "self_attn.q_proj":
                a = permute_qk_for_gguf(a, c.num_heads)
            elif part == "self_attn.k_proj":
                a = permute_qk_for_gguf(a, c.num_kv_heads)
        else:
            gname = names[name]
        if a.ndim == 2 and qtype != "F32":
            q = gguf.GGMLQuantizationType[qtype]
            data = gguf.quants.quantize(a, q)
            w.add_tensor(gname, data, raw_dtype=q)
            a = gguf.quants.dequantize(data, q)
        else:
            w.add_tensor(gname, a)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_heads if "q_proj" in name else c.num_kv_heads
            a = unpermute_qk_from_gguf(a, heads)
        expected[name] = a
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("qtype, tied", [("F32", True), ("F32", False), ("Q8_0", True)])
def test_gguf_round_trip(tmp_path: Path, qtype: str, tied: bool) -> None:
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    model = random_model(cfg, seed=11)
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected = _write_gguf(model, path, qtype)
    loaded = from_pretrained(path, device="cpu")
    assert loaded.config == cfg
    state = loaded.state_dict()
    assert set(state) == set(expected)
    for name, a in expected.items():
        assert np.array_equal(state[name].numpy(), a), name
    ids = torch.tensor(PROMPT) % cfg.vocab_size
    if qtype == "F32":
        assert torch.equal(loaded.forward_dense(ids), model.forward_dense(ids))
        assert paged_greedy(loaded, ids.tolist(), 6) == model.greedy_dense(ids, 6)
    else:  # quantized: close to the float model, not equal
        diff = (loaded.forward_dense(ids) - model.forward_dense(ids)).abs().max()
        assert 0 < diff < 0.1 * model.forward_dense(ids).abs().max()


def test_not_a_model_rejected(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"PK\x03\x04junk")
    with pytest.raises(ValueError, match="not GGUF"):
        from_pretrained(f)
    with pytest.raises(FileNotFoundError):
        from_pretrained(tmp_path / "absent")


def test_a_deeply_nested_config_is_a_value_error(tmp_path: Path) -> None:
    """A ``config.json`` nested past the parser's recursion limit: a ValueError naming the
    file, from the model loader and from the context-length probe alike."""
    config = tmp_path / "config.json"
    config.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match=f"{config}: invalid JSON: it nests too deeply"):
        from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{config}: invalid JSON: it nests too deeply"):
        context_length(str(tmp_path))


def test_load_model_random_is_seeded_and_speaks_bytes() -> None:
    """The one loader of a model spec: ``"random"`` is RANDOM_CONFIG over ByteTokenizer."""
    from radixkv.model.loading import RANDOM_CONFIG, load_model
    from radixkv.text.tokenizer import ByteTokenizer

    a, tok = load_model("random", seed=3)
    b, _ = load_model("random", seed=3)
    assert isinstance(tok, ByteTokenizer) and a.config == RANDOM_CONFIG
    assert RANDOM_CONFIG.vocab_size == ByteTokenizer.vocab_size
    assert not a.training
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_load_model_casts_to_its_dtype_and_sets_the_backend() -> None:
    """The same weights in bfloat16 are the float32 ones rounded; the backend is set."""
    from radixkv.model.loading import MODEL_DTYPES, load_model

    full, _ = load_model("random", seed=2)
    half, _ = load_model("random", seed=2, dtype="bfloat16", attention_backend="loop")
    assert full.attention_backend is None and half.attention_backend == "loop"
    assert MODEL_DTYPES["auto"] == torch.float32 == full.dtype and half.dtype == torch.bfloat16
    for (name, x), y in zip(full.state_dict().items(), half.state_dict().values(), strict=True):
        assert torch.equal(x.to(torch.bfloat16), y), name


def test_load_model_refuses_a_bad_dtype_or_backend_before_loading(monkeypatch) -> None:
    from radixkv.model.loading import load_model

    with pytest.raises(ValueError, match=r"dtype must be one of \['auto', .*got 'int8'"):
        load_model("no-such-model", dtype="int8")  # the spec is never read
    with pytest.raises(ValueError, match="attention_backend must be one of .*got 'flash'"):
        load_model("no-such-model", attention_backend="flash")
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="attention_backend 'triton' cannot run on cpu"):
            load_model("random", attention_backend="triton")


def test_load_model_names_the_spec_of_a_gguf_without_a_tokenizer(tmp_path: Path) -> None:
    from radixkv.model.loading import load_model

    path = tmp_path / "weights-only.gguf"
    _write_gguf(random_model(TINY, seed=1), path, "F32")
    with pytest.raises(ValueError, match=r"spec '.*weights-only.gguf': only byte-level BPE"):
        load_model(str(path))
