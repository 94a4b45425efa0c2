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

Torch-free: ``tokenizers`` and ``jinja2`` are imported on first use.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
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
# Where to look for a character no message, template or special token holds (private use)
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
        template does not already emit it). In the ids, special tokens come from the
        template only: a special token's text in a message's strings, or in a
        variable's, is encoded as plain text (the module docstring says why);
        ``special_tokens_in_content=True`` encodes the rendered text whole instead, so
        that text becomes the special token (vLLM's and SGLang's behaviour). Without
        special text in the messages and variables both give the same ids. Raises
        ``ValueError`` if the file has no template, or if the template cut a message's
        special-token text apart.

        Complexity: O(rendered length + number of special tokens + size of variables).
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
        """The prompt's ids with special tokens matched outside the messages' and the
        variables' strings only.

        Every special token's text in a message string or a variable's string (keys of
        nested objects included) is swapped for a placeholder
        (``mark`` + index + ``mark``, ``mark`` a character found nowhere else) before
        rendering, so the specials left in the rendered text are the template's. The
        text is split at those, as the tokenizer itself splits at added tokens; each
        piece between them gets its placeholders back and is encoded with every
        special token split (``encode_special_tokens``).
        """
        specials, pattern = self._specials, self._special_pattern
        mark = _unused_char(template, messages, specials, variables)
        hidden: list[str] = []

        def hide(match: re.Match[str]) -> str:
            hidden.append(match.group())
            return f"{mark}{len(hidden) - 1}{mark}"

        def mask(text: str) -> str:
            return pattern.sub(hide, text)

        masked = [{k: mask(v) if isinstance(v, str) else v for k, v in m.items()} for m in messages]
        masked_vars = {k: _map_strings(v, mask) for k, v in variables.items()}
        text = _render(template, masked, add_generation_prompt, self.token_text, masked_vars)
        unmask = re.compile(f"{re.escape(mark)}([0-9]+){re.escape(mark)}")
        pieces = pattern.split(text)  # one group: odd items are the template's specials
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(specials[piece].id)
                continue
            # an added token's lstrip/rstrip eat the whitespace beside it, as in the tokenizer
            if i > 0 and specials[pieces[i - 1]].rstrip:
                piece = piece.lstrip()
            if i + 1 < len(pieces) and specials[pieces[i + 1]].lstrip:
                piece = piece.rstrip()
            plain = unmask.sub(lambda m: hidden[int(m.group(1))], piece)
            if mark in plain:
                raise ValueError(
                    "the chat template cut a message's special-token text apart; "
                    "render it with special_tokens_in_content=True"
                )
            if plain:
                ids += self._split_tokenizer.encode(plain, add_special_tokens=False).ids
        bos = self.token_text("bos")
        if self.add_bos_token and self.bos_token_id is not None and not text.startswith(bos):
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
        """Any special token's text, longest first (the tokenizer matches leftmost-longest)."""
        texts = sorted(self._specials, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, texts)) + ")")

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


def _unused_char(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    specials: Mapping[str, _Special],
    variables: Mapping[str, Any],
) -> str:
    """A private-use character found in none of the template, message strings, specials and
    the variables' strings."""
    texts = [template, *specials, *(v for m in messages for v in m.values() if isinstance(v, str))]
    texts += _strings(variables)
    for candidates in _MARK_CANDIDATES:
        for code in candidates:
            c = chr(code)
            if not any(c in t for t in texts):
                return c
    raise ValueError("every private-use character occurs in the messages")


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys of objects included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


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
    own = {
        "messages": list(messages),
        "add_generation_prompt": add_generation_prompt,
        "bos_token": token_text("bos"),
        "eos_token": token_text("eos"),
    }
    return env.from_string(template).render({**variables, **own})


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
