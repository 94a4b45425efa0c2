"""The OpenAI Python SDK against a real ``radixkv serve --model random`` (issue 24).

One server process per module (random weights, the byte tokenizer: token ids are the
UTF-8 bytes of the text, 257 is ``<|im_end|>``), driven by ``openai.OpenAI`` with typed
responses: every parameter :mod:`radixkv.serve.openai.protocol` implements, given as the SDK
gives it (named arguments where the SDK has them, ``extra_body`` for vLLM's), and the
SDK's own parsing of each reply (``Completion``, ``ChatCompletion``, chunks, ``Model``,
``BadRequestError``). The random model is near-deterministic (its top token holds
almost all the mass), so the assertions are about shapes, counts, indices and
greedy agreement, not about sampled text.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from serve_helpers import TIMEOUT, spawn_serve  # noqa: E402

MODEL = "random"
BLOCK_SIZE = 16  # radixkv serve's default --block-size
IM_END = 257  # the byte tokenizer's <|im_end|>, a stop token
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    proc, port = spawn_serve("--num-blocks", "256", "--log-level", "warning")
    try:
        sdk = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=TIMEOUT
        )
        end = time.monotonic() + TIMEOUT
        while True:  # the port is bound before uvicorn listens on it
            try:
                sdk.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < end, "the server never answered"
                time.sleep(0.05)
        yield sdk
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


Prompt = str | list[str] | list[int] | list[list[int]]


def greedy(client: openai.OpenAI, prompt: Prompt, max_tokens: int = 6, **kw: object) -> Completion:
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


def text(reply: Completion) -> str:
    [choice] = reply.choices
    return choice.text


def test_models_list_and_retrieve(client) -> None:
    [model] = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize(
    "prompt",
    [["ab", "Hello"], [list(b"ab"), list(b"Hello")], "ab", list(b"ab")],
    ids=["list[str]", "list[list[int]]", "str", "list[int]"],
)
def test_prompt_forms_give_n_choices_indexed_prompt_major(client, prompt) -> None:
    """Choice ``prompt_pos * n + i`` is the ``i``-th sample of prompt ``prompt_pos``:
    greedy, each equals that prompt sent alone (as text; token ids are its bytes)."""
    n = 3
    reply = greedy(client, prompt, n=n, best_of=n)
    assert isinstance(reply, Completion) and reply.object == "text_completion"
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    assert len(reply.choices) == len(prompts) * n
    assert [c.index for c in reply.choices] == list(range(len(prompts) * n))
    for pos, p in enumerate(prompts):
        alone = text(greedy(client, p if isinstance(p, str) else bytes(p).decode()))
        assert [c.text for c in reply.choices[pos * n : pos * n + n]] == [alone] * n
    # each prompt counts once, however many choices it has (as OpenAI counts)
    prompt_tokens = sum(len(p.encode() if isinstance(p, str) else p) for p in prompts)
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == 6 * len(prompts) * n


def test_best_of_other_than_n_is_refused(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="ab", max_tokens=2, n=2, best_of=3)
    assert err.value.body["param"] == "best_of" and "best_of" in err.value.message


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_echo_logprobs_cover_prompt_and_completion(client, k) -> None:
    """lm-eval's loglikelihood request: echo + logprobs, greedy. Tokens are named by id
    (vLLM's ``return_tokens_as_token_ids``): the random model's bytes that are not UTF-8
    all read as U+FFFD, and ``top_logprobs`` dicts keyed by text would merge them."""
    prompt = "radix trees"
    reply = greedy(
        client, prompt, max_tokens=3, echo=True, logprobs=k,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    [choice] = reply.choices
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    num = len(prompt) + reply.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num
    assert lp.tokens[: len(prompt)] == [f"token_id:{b}" for b in prompt.encode()]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for pos in range(1, num):
        top = lp.top_logprobs[pos]
        # the k best, and the chosen token when it is not among them
        assert max(k, 1) <= len(top) <= k + 1
        assert top[lp.tokens[pos]] == pytest.approx(lp.token_logprobs[pos])
        assert all(v <= 0.0 for v in top.values())
    for pos in range(len(prompt), num):  # greedy: each new token is the most likely
        assert lp.token_logprobs[pos] == pytest.approx(max(lp.top_logprobs[pos].values()))


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client) -> None:
    reply = greedy(client, "abc", max_tokens=0, echo=True, logprobs=1)
    [choice] = reply.choices
    assert choice.text == "abc" and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == 3
    assert len(choice.logprobs.token_logprobs) == 3
    with pytest.raises(openai.BadRequestError) as err:
        greedy(client, "abc", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_stop_string_cuts_the_text(client) -> None:
    full = text(greedy(client, "ab", max_tokens=8))
    assert full.startswith("bbbb")  # the random model's greedy continuation of "ab"
    reply = greedy(client, "ab", max_tokens=8, stop=["bbb"])
    [choice] = reply.choices
    assert choice.text == "" and choice.finish_reason == "stop"
    assert text(greedy(client, "ab", max_tokens=8, stop="zzz")) == full


def test_seeded_sampling_repeats(client) -> None:
    kw = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "n": 3, "seed": 1234}
    first = client.completions.create(temperature=2.0, top_p=0.9, **kw)
    again = client.completions.create(temperature=2.0, top_p=0.9, **kw)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]


@pytest.mark.parametrize(
    "truncate",
    [{"top_p": 1e-6}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}],
    ids=["top_p", "top_k", "min_p"],
)
def test_truncating_to_the_top_token_samples_greedily(client, truncate) -> None:
    want = text(greedy(client, "Hello, world", max_tokens=8))
    reply = client.completions.create(
        model=MODEL, prompt="Hello, world", max_tokens=8, temperature=1.5, seed=7, **truncate
    )
    assert text(reply) == want


@pytest.mark.parametrize(
    "penalty",
    [
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 1.5}},
    ],
    ids=["presence", "frequency", "repetition"],
)
def test_penalties_change_a_repetitive_greedy_reply(client, penalty) -> None:
    plain = text(greedy(client, "ab", max_tokens=8))
    assert plain.startswith("bbbbb")
    assert text(greedy(client, "ab", max_tokens=8, **penalty)) != plain


def test_logit_bias_bans_and_forces_tokens(client) -> None:
    assert "b" not in text(greedy(client, "ab", max_tokens=8, logit_bias={"98": -100}))
    assert text(greedy(client, "ab", max_tokens=5, logit_bias={"120": 100})) == "xxxxx"


def test_stop_token_ids_min_tokens_and_ignore_eos(client) -> None:
    stopped = greedy(client, "ab", max_tokens=8, extra_body={"stop_token_ids": [98]})
    assert text(stopped) == "" and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1
    held = greedy(client, "ab", max_tokens=8, extra_body={"stop_token_ids": [98], "min_tokens": 8})
    assert held.choices[0].finish_reason == "length" and "b" not in text(held)
    eos = {str(IM_END): 100}  # <|im_end|> is always the most likely token
    assert greedy(client, "ab", max_tokens=8, logit_bias=eos).usage.completion_tokens == 1
    late = greedy(client, "ab", max_tokens=8, logit_bias=eos, extra_body={"min_tokens": 4})
    assert late.usage.completion_tokens == 5 and late.choices[0].finish_reason == "stop"
    kept = greedy(client, "ab", max_tokens=8, logit_bias=eos, extra_body={"ignore_eos": True})
    assert kept.usage.completion_tokens == 8 and kept.choices[0].finish_reason == "length"


def test_prompt_logprobs_match_echo_logprobs(client) -> None:
    prompt = "prompt logprobs"
    reply = greedy(client, prompt, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scored = reply.choices[0].model_extra["prompt_logprobs"]
    echo = greedy(client, prompt, max_tokens=1, echo=True, logprobs=2).choices[0].logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    for pos, byte in enumerate(prompt.encode()[1:], start=1):
        entry = scored[pos][str(byte)]
        assert entry["logprob"] == pytest.approx(echo.token_logprobs[pos], abs=1e-4)
        assert entry["decoded_token"] == chr(byte) and entry["rank"] >= 1


def test_repeated_prompt_reports_cached_tokens(client) -> None:
    prompt = "a prompt long enough to fill a few cache blocks of sixteen tokens"
    first = greedy(client, prompt, max_tokens=1)
    again = greedy(client, prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < len(prompt) and cached % BLOCK_SIZE == 0


def test_cache_salt_keeps_prompts_apart(client) -> None:
    prompt = "a salted prompt, long enough to fill a few blocks of the cache"
    salted = {"extra_body": {"cache_salt": "tenant-a"}}
    assert greedy(client, prompt, 1, **salted).usage.prompt_tokens_details.cached_tokens == 0
    other = greedy(client, prompt, 1, extra_body={"cache_salt": "tenant-b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    same = greedy(client, prompt, 1, **salted)
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    assert text(same) == text(other)  # the salt names a namespace, it changes no output


def test_chat_logprobs_and_top_logprobs(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    assert isinstance(reply, ChatCompletion) and reply.object == "chat.completion"
    [choice] = reply.choices
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_add_generation_prompt_and_continue_final_message(client) -> None:
    """The byte tokenizer's ChatML: the assistant header is <|im_start|> + "assistant\\n"
    (11 tokens); continuing the final message drops its <|im_end|> + "\\n" (2)."""
    messages = [*CHAT, {"role": "assistant", "content": "Hello"}]

    def prompt_tokens(**extra: bool) -> int:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body=extra
        )
        return reply.usage.prompt_tokens

    closed = prompt_tokens(add_generation_prompt=False)
    assert prompt_tokens() == closed + 11
    assert prompt_tokens(add_generation_prompt=False, continue_final_message=True) == closed - 2
    with pytest.raises(openai.BadRequestError) as err:
        prompt_tokens(continue_final_message=True)
    assert err.value.body["param"] == "continue_final_message"


def test_streams_end_with_usage_and_join_to_the_reply(client) -> None:
    want = text(greedy(client, "Hello, world", max_tokens=8))
    stream = client.completions.create(
        model=MODEL, prompt="Hello, world", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == want
    chat = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 4
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat[:-1])
    assert streamed == whole.choices[0].message.content


def test_unimplemented_parameter_is_a_bad_request_naming_it(client) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[tool])
    assert err.value.status_code == 400
    assert err.value.body["param"] == "tools" and "tools" in err.value.message
    assert "not supported" in err.value.message
