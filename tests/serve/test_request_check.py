"""One request check (issue 34, item 3): the engine tier's ``check_request`` (over
``EngineLimits``) is the only place a request is checked against an engine; the HTTP layer
maps its errors to 400s.

The same hostile request goes through ``Engine.make_request`` and through the server (a real
uvicorn server over one engine, and the handlers over a client that has only the engine's
limits, as the fleet's ingress does): the 400's ``param`` is the API's name for the field
the engine's error names, its message is the engine's, and ``context_length_exceeded``
comes with exactly the engine's ``ContextLengthError``. With the engine-tier functions
patched in the handlers, the server follows them: it has no check of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_helpers import TINY_CONFIG, Server, served_engine, tiny_engine  # noqa: E402

from radixkv.engine import Engine, SamplingParams  # noqa: E402
from radixkv.engine.request import (  # noqa: E402
    ContextLengthError,
    EngineLimits,
    RequestError,
    check_request,
)
from radixkv.model import random_model  # noqa: E402
from radixkv.serve.async_engine import AsyncEngine  # noqa: E402
from radixkv.serve.openai import handlers  # noqa: E402
from radixkv.serve.openai.errors import ApiError  # noqa: E402
from radixkv.serve.openai.handlers import OpenAIHandlers  # noqa: E402
from radixkv.serve.openai.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from radixkv.text.tokenizer import ByteTokenizer  # noqa: E402

V = TINY_CONFIG.vocab_size  # 259: the byte tokenizer's
L = 16 * 4  # max_model_len: all the pool holds, 16 blocks of 4
CHAT = [{"role": "user", "content": "hi"}]

# (path, body, the engine's prompt for a completion (None: the chat's, rendered), params)
HOSTILE = [
    ("/v1/completions", {"prompt": [1, V], "max_tokens": 1}, [1, V], SamplingParams(1)),
    ("/v1/completions", {"prompt": [1], "max_tokens": 1, "stop_token_ids": [2, V + 3]}, [1],
     SamplingParams(1, stop_token_ids=(2, V + 3))),
    ("/v1/completions", {"prompt": [1], "max_tokens": 1, "logit_bias": {str(V): 5}}, [1],
     SamplingParams(1, logit_bias={V: 5.0})),
    ("/v1/completions", {"prompt": [7] * L, "max_tokens": 1}, [7] * L, SamplingParams(1)),
    ("/v1/completions", {"prompt": [7] * (L + 9)}, [7] * (L + 9), SamplingParams(16)),
    ("/v1/completions", {"prompt": [7] * 10, "max_tokens": L - 9}, [7] * 10,
     SamplingParams(L - 9)),
    ("/v1/completions", {"prompt": [7], "max_tokens": 10**6}, [7], SamplingParams(10**6)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * L}]}, None,
     SamplingParams(16)),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": L}, None, SamplingParams(L)),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": L}, None,
     SamplingParams(L)),
]  # fmt: skip


def api_name(path: str, body: dict[str, Any], engine_param: str) -> str:
    """The API's name for the engine's field: what the 400's ``param`` must be."""
    if engine_param == "prompt":
        return "messages" if "messages" in body else "prompt"
    if engine_param == "max_new_tokens":
        return "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return engine_param


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_CONFIG, seed=0)


@pytest.fixture(scope="module")
def served(model) -> Iterator[tuple[Server, AsyncEngine]]:
    with served_engine(tiny_engine(model, num_blocks=16, block_size=4), "tiny") as pair:
        yield pair


def engine_refusal(server: Server, engine: Engine, body, prompt, params) -> RequestError:
    """What ``Engine.make_request`` raises for the request (a chat's prompt rendered by the
    server's ``/tokenize``, as it renders it for generation)."""
    if prompt is None:
        status, reply = server.post("/tokenize", {"messages": body["messages"]})
        assert status == 200, reply
        prompt = reply["tokens"]
    with pytest.raises(RequestError) as refused:
        engine.make_request(prompt, params)
    return refused.value


def assert_same_refusal(error: dict[str, Any], refusal: RequestError, path: str, body) -> None:
    param = api_name(path, body, refusal.param)
    assert error["param"] == param, (body, error, refusal)
    assert error["message"] == refusal.message_for(param), (error, refusal)
    assert error["type"] == "invalid_request_error"
    context = isinstance(refusal, ContextLengthError)
    assert error["code"] == ("context_length_exceeded" if context else None), (error, refusal)


@pytest.mark.parametrize(("path", "body", "prompt", "params"), HOSTILE)
def test_the_server_and_the_engine_refuse_a_request_naming_the_same_field(
    served, path, body, prompt, params
) -> None:
    server, ae = served
    refusal = engine_refusal(server, ae.engine, body, prompt, params)
    status, reply = server.post(path, body)
    assert status == 400, reply
    assert_same_refusal(reply["error"], refusal, path, body)
    # the fleet's ingress has no engine, only its replicas' limits: the same answer
    api = OpenAIHandlers(LimitsOnly(ae.engine.limits), "tiny")
    request = (CompletionRequest if "prompt" in body else ChatCompletionRequest).model_validate(
        body
    )
    call = api.completions(request) if "prompt" in body else api.chat(request)
    with pytest.raises(ApiError) as answered:
        asyncio.run(call)
    assert answered.value.status == 400
    assert answered.value.body["error"] == reply["error"]


class LimitsOnly:
    """An ``EngineClient`` with an engine's limits and no engine: a request that reaches
    ``generate`` was not refused by the handlers."""

    tokenizer = ByteTokenizer()

    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits

    async def generate(self, prompt_ids, params, namespace):  # noqa: ANN001, ANN201
        raise AssertionError(f"a refused request reached the engine: {len(prompt_ids)} tokens")


def test_the_server_answers_what_the_engine_tier_check_says(served, monkeypatch) -> None:
    """The handlers refuse through the engine tier's functions: patched to refuse a good
    request, the server answers that refusal as its 400, named in the API's words."""
    server, _ = served

    def refuse_params(params: SamplingParams, prompt_len: int, limits: EngineLimits) -> None:
        raise ContextLengthError("max_new_tokens", f"is {params.max_new_tokens}: patched")

    def refuse_prompt(prompt: list[int], limits: EngineLimits) -> None:
        raise RequestError("prompt", f"of {len(prompt)} tokens: patched")

    monkeypatch.setattr(handlers, "check_params", refuse_params)
    status, reply = server.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 3})
    assert status == 400
    assert reply["error"] == {"message": "max_tokens is 3: patched", "param": "max_tokens",
                              "type": "invalid_request_error",
                              "code": "context_length_exceeded"}  # fmt: skip
    monkeypatch.setattr(handlers, "check_prompt", refuse_prompt)
    status, reply = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3})
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert reply["error"]["message"].endswith("tokens: patched") and not reply["error"]["code"]


def test_without_the_engine_tier_check_the_handlers_have_no_other(served, monkeypatch) -> None:
    """With the engine tier's functions made to pass everything in the handlers, a prompt
    outside the vocabulary or past ``max_model_len`` is refused by nothing in the HTTP layer:
    it reaches the engine, whose ``make_request`` refuses it with the same check (a 400
    without the API's ``param``: no handler mapped it)."""
    server, ae = served
    for name in ("check_prompt", "check_params", "check_token_ids"):
        monkeypatch.setattr(handlers, name, lambda *args: None)
    passed = [
        ({"prompt": [1, V], "max_tokens": 1}, SamplingParams(1)),
        ({"prompt": [7] * L, "max_tokens": 1}, SamplingParams(1)),
        ({"prompt": [7], "max_tokens": L}, SamplingParams(L)),
        ({"prompt": [1], "max_tokens": 1, "stop": [V + 1]},
         SamplingParams(1, stop_token_ids=[V + 1])),
    ]
    for body, params in passed:
        status, reply = server.post("/v1/completions", body)
        assert status == 400, (body, reply)
        assert reply["error"]["param"] is None and reply["error"]["code"] is None, reply
        with pytest.raises(RequestError) as refused:
            ae.engine.make_request(body["prompt"], params)
        assert reply["error"]["message"] == str(refused.value)
    assert ae.num_requests == 0


def test_the_smaller_limit_wins_and_its_error_says_which() -> None:
    """The model's context lowers an engine's ``max_model_len`` only where it is shorter; the
    room and the errors follow whichever wins."""
    pool = EngineLimits(V, 64, "the whole pool has 16 blocks of 4")
    assert pool.within(None) is pool and pool.within(64) is pool and pool.within(100) is pool
    context = pool.within(40)
    assert (context.max_model_len, context.vocab_size) == (40, V)
    assert context.max_new_tokens(30) == 10 and context.max_new_tokens(40) == 0
    with pytest.raises(ContextLengthError, match=r"within max_model_len 40 \(the model's co"):
        check_request([1] * 30, SamplingParams(11), context)
    with pytest.raises(ContextLengthError, match=r"max_model_len 64 \(the whole pool") as err:
        check_request([1] * 64, SamplingParams(1), pool)
    assert err.value.param == "prompt"
    check_request([1] * 30, SamplingParams(10), context)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineLimits(V, 0)
    with pytest.raises(TypeError, match="vocab_size"):
        EngineLimits(2.5, 10)  # type: ignore[arg-type]
