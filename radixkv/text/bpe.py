"""Byte-level BPE tokenizers with their chat template, read from a GGUF file.

:func:`load_gguf_tokenizer` builds a byte-level BPE (the ``tokenizers`` package) from
``tokenizer.ggml.tokens`` / ``merges`` / ``token_type``, with the pre-tokenizer
llama.cpp uses for the file's ``tokenizer.ggml.pre``, and :class:`GGUFTokenizer`
renders ``tokenizer.chat_template`` with a sandboxed jinja2 environment (as
``transformers`` does). A Hugging Face ``tokenizer.json`` is wrapped in the same class
(:func:`radixkv.text.tokenizer.load_hf_tokenizer`).

Special tokens in a tokenized chat come from the template alone: a special token's
text inside a message (a user writing ``<|im_end|>\n<|im_start|>system``) is
encoded as plain text, as ``transformers`` does with ``split_special_tokens=True``
but for the messages only, so a message cannot close its own turn or open another.
vLLM and SGLang encode the rendered prompt whole, specials and all;
``special_tokens_in_content=True`` does that too.

How: the template is rendered with the chat's real strings, so every filter
(``|tojson``, ``|upper``, ``|trim``, slicing, ``|length``, ...) sees and writes the
client's text, and the prompt is that rendering, as ``transformers`` renders it. Where a
string of the chat (a message's, or a template variable's, keys included) holds a
special token's text, in any letter case, the template is rendered a second time with
each character of that text replaced by one mark character (a private-use character in
no special token). A filter that keeps characters in place (a case change, trimming,
slicing, JSON quoting) keeps the marks where the text was, so the two renderings have
the same length and differ only at the marks; that is checked. The special tokens of
the prompt are the special-token texts found in the marked rendering: the template's
own, and those a template builds around a string (Phi-3's ``'<|' + role + '|>'``),
never one holding a marked character. A template that treats the hidden text otherwise
than as many other characters (searches for it, replaces or HTML-escapes it) renders
differently the second time and is refused with a ``ValueError``. Not covered: a
special token's text split between a string and what follows or precedes it (a string
ending in ``<|im_`` written just before ``end|>``, by the template or by another
string), or made by deleting characters inside a string; no chat template we know
writes either.

Torch-free: ``tokenizers`` and ``jinja2`` are imported on first use.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from radixkv.text.gguf import GGUFFile, open_gguf

__all__ = ["GGUFTokenizer", "load_gguf_tokenizer"]

# llama.cpp pre-tokenizer types that split every digit on its own before the GPT-2 regex
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
# GGUF token types: 3 = control, 4 = user-defined; both match atomically in text
_SPECIAL_TYPES = (3, 4)
# Where to look for the mark: a character no special token holds (private use: no letter
# case, not whitespace, not escaped by tojson)
_MARK_CANDIDATES = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE))


@dataclass
class GGUFTokenizer:
    """Encode/decode text and render the chat template of a GGUF model.

    ``tokenizer`` is the underlying ``tokenizers.Tokenizer``; ``stop_token_ids``
    holds the EOS id (and ``<|im_end|>``/``<|endoftext|>`` where the vocab has them).
    """

    tokenizer: Any
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    tokens: list[str] = field(repr=False)
    stop_token_ids: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text map to their ids.

        ``add_special_tokens`` prepends BOS when the file asks for it (SmolLM2 does not).
        """
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        special_tokens_in_content: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str | list[int]:
        """Render ``messages`` (``{"role", "content"}`` dicts) with the file's template,
        ``variables`` (names to JSON values) as extra variables beside the template's own
        (``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, which win
        over a variable of the same name).

        Returns the prompt text, or its ids when ``tokenize`` (BOS only if the
        template does not already emit it). Filters see the strings as given, and the
        text is what ``transformers`` renders (``|tojson`` as its: no HTML escapes, no
        sorted keys, ``ensure_ascii`` off). In the ids, special tokens come from the
        template only: a special token's text in a message's strings, or in a
        variable's, is encoded as plain text whatever filter the template applies (the
        module docstring says how, and what it leaves out);
        ``special_tokens_in_content=True`` encodes the rendered text whole instead, so
        that text becomes the special token (vLLM's and SGLang's behaviour). Without
        special text in the messages and variables both give the same ids. Raises
        ``ValueError`` if the file has no template, or if the template treats a
        string's special-token text otherwise than as many other characters.

        Complexity: one rendering, two when a string holds a special token's text, plus
        O(rendered length + size of the messages and variables), whatever the number of
        special tokens.
        """
        if self.chat_template is None:
            raise ValueError("this GGUF file has no tokenizer.chat_template")
        variables = variables or {}
        if tokenize and not special_tokens_in_content and self._specials:
            return self._encode_chat(self.chat_template, messages, add_generation_prompt, variables)
        text = _render(
            self.chat_template, messages, add_generation_prompt, self.token_text, variables
        )
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=not text.startswith(self.token_text("bos")))

    def _encode_chat(
        self,
        template: str,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
    ) -> list[int]:
        """The prompt's ids with special tokens where the marked rendering has them (the
        module docstring), the text between them encoded with every special token's text
        split (``encode_special_tokens``), as plain text."""
        text = _render(template, messages, add_generation_prompt, self.token_text, variables)
        mark, num_hidden = self._mark, 0

        def hide(value: str) -> str:
            nonlocal num_hidden
            hidden, n = self._special_pattern_any_case.subn(
                lambda m: mark * len(m.group()), value
            )
            num_hidden += n
            return hidden

        masked_messages = _map_strings(list(messages), hide)
        masked_variables = _map_strings(variables, hide)
        marked = text
        if num_hidden:
            marked = _render(
                template, masked_messages, add_generation_prompt, self.token_text, masked_variables
            )
            _check_same_but_marks(text, marked, mark)
        specials = self._specials
        found = list(self._special_pattern.finditer(marked))
        ids: list[int] = []
        for i in range(len(found) + 1):
            start = found[i - 1].end() if i > 0 else 0
            end = found[i].start() if i < len(found) else len(text)
            piece = text[start:end]
            # an added token's lstrip/rstrip eat the whitespace beside it, as in the tokenizer
            if i > 0 and specials[found[i - 1].group()].rstrip:
                piece = piece.lstrip()
            if i < len(found) and specials[found[i].group()].lstrip:
                piece = piece.rstrip()
            if piece:
                ids += self._split_tokenizer.encode(piece, add_special_tokens=False).ids
            if i < len(found):
                ids.append(specials[found[i].group()].id)
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    @cached_property
    def _specials(self) -> dict[str, _Special]:
        """The tokenizer's special added tokens, by their text."""
        return {
            added.content: _Special(i, added.lstrip, added.rstrip)
            for i, added in self.tokenizer.get_added_tokens_decoder().items()
            if added.special
        }

    @cached_property
    def _special_pattern(self) -> re.Pattern[str]:
        """Any special token's text, the longest where several start at one place (the
        tokenizer matches leftmost-longest)."""
        return re.compile(_trie_regex(self._specials))

    @cached_property
    def _special_pattern_any_case(self) -> re.Pattern[str]:
        """Any special token's text in any letter case (a template may change it)."""
        return re.compile(_trie_regex(self._specials), re.IGNORECASE)

    @cached_property
    def _mark(self) -> str:
        """A private-use character that no special token's text holds."""
        held = set("".join(self._specials))
        for candidates in _MARK_CANDIDATES:
            for code in candidates:
                if chr(code) not in held:
                    return chr(code)
        raise ValueError("every private-use character occurs in a special token")

    @cached_property
    def _split_tokenizer(self) -> Any:
        """A copy of ``tokenizer`` that encodes special tokens' text as plain text."""
        split = type(self.tokenizer).from_str(self.tokenizer.to_str())
        split.encode_special_tokens = True
        return split

    def token_text(self, which: str) -> str:
        """The text of the ``"bos"`` or ``"eos"`` token ("" where the file names none)."""
        i = self.bos_token_id if which == "bos" else self.eos_token_id
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else ""


class _Special(NamedTuple):
    """A special token's id, and whether it eats the whitespace on its left / right."""

    id: int
    lstrip: bool
    rstrip: bool


def _trie_regex(texts: Iterable[str]) -> str:
    """A regex matching any of ``texts`` (not empty), the longest where several match at
    one place, as a trie: each character of the subject is tried against one branch per
    level, so matching is linear in the subject whatever the number of texts."""
    root: dict[str, dict] = {}
    for text in texts:
        node = root
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}  # a text ends here

    def branch(node: dict[str, dict]) -> str:
        alternatives = [re.escape(c) + branch(child) for c, child in node.items() if c]
        if "" in node:
            alternatives.append("")  # last: a longer text is tried first
        if len(alternatives) == 1:
            return alternatives[0]
        return "(?:" + "|".join(alternatives) + ")"

    return branch(root)


def _check_same_but_marks(text: str, marked: str, mark: str) -> None:
    """``ValueError`` unless ``marked`` is ``text`` with some characters swapped for
    ``mark``: the second rendering went where the first did. O(len(text))."""
    start = 0
    if len(text) == len(marked):
        for run in re.finditer(f"{re.escape(mark)}+", marked):
            if text[start : run.start()] != marked[start : run.start()]:
                break
            start = run.end()
        else:
            if text[start:] == marked[start:]:
                return
    raise ValueError(
        "the chat template treats a special token's text in the chat's strings otherwise "
        "than other text (it searches, replaces or escapes it), so the template's own "
        "special tokens cannot be told from it; render it with special_tokens_in_content=True"
    )


def _map_strings(value: Any, f: Callable[[str], str]) -> Any:
    """A JSON value with ``f`` applied to every string in it, keys of objects included."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, f): _map_strings(v, f) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, f) for v in value]
    return value


def _render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    token_text: Any,
    variables: Mapping[str, Any],
) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson
    own = {
        "messages": list(messages),
        "add_generation_prompt": add_generation_prompt,
        "bos_token": token_text("bos"),
        "eos_token": token_text("eos"),
    }
    return env.from_string(template).render({**variables, **own})


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """The ``tojson`` filter of ``transformers``' chat templates: ``json.dumps`` as it is,
    not jinja's (which escapes ``<``, ``>``, ``&`` and ``'`` for HTML, writes non-ASCII
    text as ``\\u`` escapes and sorts keys)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def load_gguf_tokenizer(path: str | Path | GGUFFile) -> GGUFTokenizer:
    """Build the byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) of a GGUF file.

    ``path`` may also be a parsed :class:`~radixkv.text.gguf.GGUFFile` (share
    one with :func:`radixkv.model.loading.load_gguf`). Raises ``ValueError`` for
    another tokenizer model or missing vocab/merges.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    get = open_gguf(path).get

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers work, got {kind!r}")
    tokens: list[str] = get("tokenizer.ggml.tokens")
    merges: list[str] = get("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise ValueError(f"{path}: tokenizer.ggml.tokens/merges missing")
    types: list[int] = get("tokenizer.ggml.token_type", [1] * len(tokens))
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
    )
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if get("tokenizer.ggml.pre", "default") in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty in _SPECIAL_TYPES
        ]
    )
    eos = get("tokenizer.ggml.eos_token_id")
    stops = [] if eos is None else [int(eos)]
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        i = tok.token_to_id(name)
        if i is not None and i not in stops:
            stops.append(i)
    bos = get("tokenizer.ggml.bos_token_id")
    return GGUFTokenizer(
        tokenizer=tok,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos_token=bool(get("tokenizer.ggml.add_bos_token", False)),
        chat_template=get("tokenizer.chat_template"),
        tokens=tokens,
        stop_token_ids=tuple(stops),
    )
