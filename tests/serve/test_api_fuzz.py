"""The HTTP API fuzzed from its own OpenAPI document (schemathesis, a bounded number of
examples per route): no request gets a 5xx, every error has OpenAI's shape, and the engine is
idle and consistent afterwards.

The server is the one-engine app over a tiny random model with a KV pool of 64 tokens, so any
request it accepts is short whatever its ``max_tokens`` or ``n``. ``/openapi.json`` declares
each POST route's body (:mod:`radixkv.serve.openai.openapi`): without that the fuzzer would send
empty bodies only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from serve_helpers import TINY_CONFIG, check_engine, served_engine, tiny_engine  # noqa: E402

from radixkv.model import random_model  # noqa: E402
from radixkv.serve.openai.openapi import REQUEST_BODIES  # noqa: E402

EXAMPLES = 20  # per route and phase: the suite's time budget, not a search for the last bug


@pytest.fixture(scope="module")
def served() -> Iterator:
    engine = tiny_engine(random_model(TINY_CONFIG, seed=0), num_blocks=16, block_size=4)
    with served_engine(engine, "random") as pair:
        yield pair
        check_engine(pair[1])  # idle, with every invariant of cache and scheduler holding


def openai_error_shape(ctx, response, case) -> None:
    """A 4xx or 5xx answers OpenAI's error body: ``{"error": {"message": str, "type": str,
    "param", "code"}}`` (FastAPI's ``{"detail": ...}`` would break OpenAI's clients)."""
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str), body


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_gets_a_server_error(served, mode) -> None:
    """Every route of ``/openapi.json``, with bodies, paths and queries drawn from its schema
    (``POSITIVE``: valid by the schema; ``NEGATIVE``: violating it)."""
    server, _ = served
    base_url = f"http://127.0.0.1:{server.port}"
    api = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    posts = {op.path for op in operations if op.method.upper() == "POST"}
    assert posts >= set(REQUEST_BODIES), posts  # the bodies are documented, so fuzzed
    for op in operations:
        if mode == GenerationMode.NEGATIVE and not op.body:
            continue  # a path of strings and no body: nothing the schema forbids

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,  # the same examples on every run: a CI failure reproduces here
            database=None,
        )
        def fuzz(case) -> None:
            response = case.call(base_url=base_url, timeout=60)
            case.validate_response(response, checks=[not_a_server_error, openai_error_shape])

        fuzz()
