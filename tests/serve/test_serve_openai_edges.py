"""The OpenAI surface at its edges: each test pins a behaviour that a one-line bug could break
while every other server test passed (issue 33's mutation audit).

Most servers here use a trained byte-level BPE (test_tokenizer's, multi-character tokens),
since the byte tokenizer's one character per token hides every offset and boundary bug:
``text_offset``, streamed detokenization and stop strings across token boundaries.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("gguf")

from prometheus_client import CollectorRegistry  # noqa: E402
from serve_helpers import (  # noqa: E402
    TIMEOUT,
    TINY_CONFIG,
    Server,
    served_engine,
    tiny_engine,
    wait_idle,
)

from radixkv.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from radixkv.model import random_model  # noqa: E402
from radixkv.serve.app import build_app  # noqa: E402
from radixkv.serve.async_engine import AsyncEngine  # noqa: E402
from radixkv.serve.openai.choices import Choice, Prompt, usage_of  # noqa: E402
from radixkv.serve.openai.metrics import RequestMetrics, tokens_buckets  # noqa: E402
from radixkv.text.tokenizer import load_tokenizer  # noqa: E402

MODEL = "edges"


def ok(server: Server, path: str, body: dict) -> dict:
    status, reply = server.post(path, body)
    assert status == 200, reply
    return reply


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Iterator[tuple[Server, object]]:
    """A server over a random model whose vocabulary is a trained byte-level BPE."""
    from test_tokenizer import train_reference, write_tokenizer_gguf

    path = tmp_path_factory.mktemp("bpe") / "tok.gguf"
    write_tokenizer_gguf(train_reference(), path)
    tok = load_tokenizer(str(path))
    config = dataclasses.replace(TINY_CONFIG, vocab_size=tok.vocab_size)
    engine = Engine(
        random_model(config, seed=1), EngineConfig(num_blocks=256, block_size=4), tokenizer=tok
    )
    with served_engine(engine, MODEL) as (server, ae):
        yield server, tok
        wait_idle(ae)


@pytest.fixture(scope="module")
def byte_server() -> Iterator[Server]:
    engine = tiny_engine(random_model(TINY_CONFIG, seed=0), num_blocks=256, block_size=4)
    with served_engine(engine, MODEL) as (server, _):
        yield server


GREEDY = {"prompt": "the radix tree keeps", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


# ---------------------------------------------------------------- BPE text over HTTP
def test_streamed_text_offsets_add_each_tokens_text_with_multi_character_tokens(bpe) -> None:
    server, _ = bpe
    whole = ok(server, "/v1/completions", {**GREEDY, "logprobs": 0})["choices"][0]
    lp = whole["logprobs"]
    assert max(len(t) for t in lp["tokens"]) > 1  # else this test could not tell
    for i in range(1, len(lp["tokens"])):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
    streamed = {"tokens": [], "text_offset": []}
    text = ""
    for event in server.stream("/v1/completions", {**GREEDY, "logprobs": 0}):
        for c in event["choices"]:
            text += c["text"]
            if c.get("logprobs"):
                streamed["tokens"] += c["logprobs"]["tokens"]
                streamed["text_offset"] += c["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert streamed == {"tokens": lp["tokens"], "text_offset": lp["text_offset"]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_across_a_token_boundary_cuts_the_text_before_it(bpe, stream) -> None:
    server, _ = bpe
    whole = ok(server, "/v1/completions", {**GREEDY, "logprobs": 0})["choices"][0]
    tokens = whole["logprobs"]["tokens"]
    # a stop string of one token's last character and the next token's first
    i = next(i for i in range(1, len(tokens)) if tokens[i - 1] and tokens[i] and i > 2)
    stop = tokens[i - 1][-1] + tokens[i][0]
    want = whole["text"][: whole["text"].index(stop)]
    body = {**GREEDY, "stop": [stop]}
    if stream:
        events = server.stream("/v1/completions", body)
        text = "".join(c["text"] for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    else:
        choice = ok(server, "/v1/completions", body)["choices"][0]
        text, finish = choice["text"], [choice["finish_reason"]]
    assert (text, finish) == (want, ["stop"])


def test_streamed_bpe_text_equals_the_whole_replys_for_every_prompt_form(bpe) -> None:
    server, tok = bpe
    for prompt in ("é and ü are two bytes", "emoji 🙂 are four", tok.encode("ids too")):
        body = {**GREEDY, "prompt": prompt, "max_tokens": 16}
        whole = ok(server, "/v1/completions", body)["choices"][0]["text"]
        events = server.stream("/v1/completions", body)
        assert "".join(c["text"] for e in events for c in e["choices"]) == whole


# ---------------------------------------------------------------- fields joined
def test_truncate_prompt_tokens_keeps_the_last_k_tokens(byte_server) -> None:
    prompt = "abcdefghij"
    reply = ok(byte_server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True,
                                                 "truncate_prompt_tokens": 3})  # fmt: skip
    assert reply["usage"]["prompt_tokens"] == 3
    assert reply["choices"][0]["text"].startswith("hij")


def test_echo_logprobs_and_prompt_logprobs_each_get_their_own_count(byte_server) -> None:
    body = {"prompt": "scored prompt", "max_tokens": 1, "echo": True, "logprobs": 1,
            "prompt_logprobs": 4, "temperature": 0}  # fmt: skip
    choice = ok(byte_server, "/v1/completions", body)["choices"][0]
    prompt_lp = choice["prompt_logprobs"]
    assert prompt_lp[0] is None
    # vLLM's shape: the k likeliest and the prompt's own token (k or k + 1 entries)
    assert all(len(entry) >= 4 for entry in prompt_lp[1:]), prompt_lp
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(1 <= len(t) <= 2 for t in tops[1:]), tops


def test_chat_logprobs_without_top_logprobs_is_a_logprobs_object(byte_server) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "logprobs": True, "ignore_eos": True}  # fmt: skip
    choice = ok(byte_server, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    assert all(entry["top_logprobs"] == [] and entry["logprob"] <= 0 for entry in content)


@pytest.mark.parametrize(("max_tokens", "max_completion_tokens"), [(5, 2), (2, 5)])
def test_chat_max_completion_tokens_wins_over_max_tokens(
    byte_server, max_tokens, max_completion_tokens
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True,
            "max_tokens": max_tokens, "max_completion_tokens": max_completion_tokens}  # fmt: skip
    reply = ok(byte_server, "/v1/chat/completions", body)
    assert reply["usage"]["completion_tokens"] == max_completion_tokens


def test_top_logprobs_up_to_the_vocabulary_size_is_accepted() -> None:
    """A vocabulary smaller than the API's cap: k equal to it is every token, one more is
    refused, with a message that says so."""
    SamplingParams(3, top_logprobs=16, prompt_logprobs=16).check_vocab(16)
    for field in ("top_logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} is 17, more than the vocabulary's 16"):
            SamplingParams(3, **{field: 17}).check_vocab(16)


def _choice(index: int, prompt_index: int, cached: int) -> Choice:
    out = SimpleNamespace(cached_tokens=cached)
    return Choice(index, prompt_index, Prompt([1, 2, 3]), None, None, None, last=out)  # type: ignore[arg-type]


def test_usage_counts_per_prompt_what_every_fork_got() -> None:
    """``cached_tokens`` with ``n`` > 1: per prompt, the fewest cached tokens any fork found
    (what every fork got), summed over prompts; prompt tokens once per prompt."""
    choices = [_choice(0, 0, 8), _choice(1, 0, 4), _choice(2, 0, 12), _choice(3, 1, 0),
               _choice(4, 1, 16)]  # fmt: skip
    got = usage_of(choices, [Prompt([1, 2, 3]), Prompt([4, 5])])
    assert got["prompt_tokens"] == 5
    assert got["prompt_tokens_details"]["cached_tokens"] == 4 + 0


# ---------------------------------------------------------------- the body limit
def test_a_body_of_exactly_the_limit_is_read_and_chunks_count_in_total() -> None:
    ae = AsyncEngine(tiny_engine(random_model(TINY_CONFIG, seed=0), num_blocks=64, block_size=4))
    limit = 2000
    with Server(build_app(ae, model_name=MODEL, max_body_bytes=limit)) as server:
        small = b'{"max_tokens": 1, "prompt": "x"}'
        exact = small + b" " * (limit - len(small))  # JSON's whitespace: a cheap request
        status, data, _ = server.request("POST", "/v1/completions", raw=exact)
        assert status == 200, data
        assert server.request("POST", "/v1/completions", raw=exact + b" ")[0] == 413
        # four chunks of 1.5 KB, each under the limit, 6 KB in all, sent apart so the
        # server reads them one by one (no Content-Length: chunked transfer encoding)
        body = small + b" " * (6000 - len(small))
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
            for i in range(0, len(body), 1500):
                piece = body[i : i + 1500]
                try:
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                except OSError:  # the server answered 413 and closed before the rest
                    break
                time.sleep(0.05)
            else:
                sock.sendall(b"0\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")


# ---------------------------------------------------------------- /metrics values
def test_token_buckets_end_at_the_max_model_len() -> None:
    assert tokens_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert tokens_buckets(99) == [1, 2, 5, 10, 20, 50]
    assert tokens_buckets(1) == [1]


def test_time_per_output_token_divides_by_the_gaps_between_tokens() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, MODEL, "radixkv", 100)
    out = SimpleNamespace(scheduled_time=1.0, arrival_time=0.5)
    choice = SimpleNamespace(
        finish="length", prompt=Prompt([1, 2]), token_ids=[7, 8, 9, 10], first_token_at=2.0,
        token_times=[2.0, 3.0, 5.0, 8.0], last=out,
    )  # fmt: skip
    metrics.finished(choice, received=0.0, now=9.0)

    def value(name: str) -> float | None:
        return registry.get_sample_value(f"radixkv:{name}", {"model_name": MODEL})

    assert value("request_time_per_output_token_seconds_sum") == pytest.approx(2.0)  # 6 s / 3
    assert value("request_decode_time_seconds_sum") == pytest.approx(6.0)
    assert value("inter_token_latency_seconds_sum") == pytest.approx(6.0)
    assert value("inter_token_latency_seconds_count") == 3
    assert value("request_prefill_time_seconds_sum") == pytest.approx(1.0)
    assert value("request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value("time_to_first_token_seconds_sum") == pytest.approx(2.0)
    assert value("e2e_request_latency_seconds_sum") == pytest.approx(9.0)
    lengths = {"model_name": MODEL, "le": "100.0"}
    assert registry.get_sample_value("radixkv:request_prompt_tokens_bucket", lengths) == 1
