"""The API's OpenAPI document names each POST route's JSON body.

The routes read their bodies themselves (:func:`~radixkv.serve.openai.bodies.read_body` bounds the
size before anything is parsed, :func:`~radixkv.serve.openai.errors.parse_body` maps errors to
OpenAI's shape), so FastAPI cannot infer the bodies from the handlers' signatures. Without
them ``/openapi.json`` would describe four POST routes that take nothing, and a client
generator or a schema-driven fuzzer (the suite runs schemathesis over it) would never send a
real request. :func:`document_bodies` adds each request model's JSON schema as the route's
``requestBody``, with the models under ``components/schemas``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from radixkv.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

__all__ = ["REQUEST_BODIES", "document_bodies"]

# Each POST route's body, for the one-engine app and the fleet's ingress alike.
REQUEST_BODIES: Mapping[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

_REF = "#/components/schemas/{model}"


def document_bodies(app: FastAPI, bodies: Mapping[str, type[BaseModel]] = REQUEST_BODIES) -> None:
    """Make ``app.openapi()`` give each POST path in ``bodies`` its model as a required JSON
    ``requestBody``. Mutates ``app.openapi`` (computed once, on first call, as FastAPI's
    own); raises ``ValueError`` naming a path the app has no POST route for (then, lazily,
    on the first ``app.openapi()`` call)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        refs, defs = models_json_schema(
            [(model, "validation") for model in bodies.values()], ref_template=_REF
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs.get("$defs", {}))
        for path, model in bodies.items():
            post = schema.get("paths", {}).get(path, {}).get("post")
            if post is None:
                raise ValueError(f"bodies: no POST route for path {path!r}")
            post["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(model, "validation")]}},
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
