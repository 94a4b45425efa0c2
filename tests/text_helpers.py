"""A small BPE tokenizer trained in code and written as GGUF, and chat templates: shared by
the text room's tests and the serve room's (no model hub needed)."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TEXT = (  # CHATML's rendering of one user message, with the generation prompt
    "<|im_start|>system\nYou are helpful<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Prefix caching saves prefill work: 12345 tokens, 678 blocks!",
    "def radix_tree(blocks):\n    return [b * 16 for b in blocks]\n",
    "Héllo wörld — naïve café, ünïcödé ✓ 日本語",
    "  leading spaces\tand tabs\n\nand newlines",
]
def train_reference():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def write_tokenizer_gguf(
    tok,
    path: Path,
    pre: str = "smollm",
    template: str | None = CHATML,
    extra_merges=(),
    bos: str = "<|im_start|>",
    add_bos: bool = False,
):
    import json

    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    for a, b in extra_merges:  # highest priority, new tokens at the end of the vocab
        merges.insert(0, f"{a} {b}")
        tokens.append(a + b)
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[bos])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


VARIABLES_TEMPLATE = (
    "{% if greeting is defined %}{{ '<|im_start|>system\n' + greeting + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% if reasoning_effort is defined %}"
    "{{ '<|im_start|>system\nReasoning: ' + reasoning_effort + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
