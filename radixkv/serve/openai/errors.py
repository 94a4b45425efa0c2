"""The API's errors: OpenAI's error body for a bad request, a malformed one, or a failure.

:class:`ApiError` carries a status and the body; :func:`parse_body` turns a request
body into a request model or a 400 naming the field (``param``);
:func:`install_error_handlers` makes a FastAPI app answer ``ApiError``s, its own
validation errors, and its routing errors (404 for an unknown path, 405 for a wrong
method) with OpenAI's body too, never FastAPI's ``{"detail": ...}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from radixkv.serve.openai.protocol import FieldError, brief, decode_json
from radixkv.serve.openai.responses import error_body

__all__ = ["ApiError", "as_api_error", "error_response", "install_error_handlers", "parse_body"]

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """An error the API answers with OpenAI's error body and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_=type_, param=param, code=code)


def as_api_error(exc: Exception) -> ApiError:
    """``exc`` as the API reports it: an ``ApiError`` as is, a :class:`FieldError` a 400
    naming its field, anything else a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, FieldError):
        return ApiError(400, str(exc), param=exc.param)
    return ApiError(500, f"{type(exc).__name__}: {exc}", type_="internal_error")


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


def parse_body(model: type[M], raw: bytes) -> M:
    """The request body ``raw`` as ``model``, whatever its ``Content-Type`` (``curl -d``
    sends a form's): ``ApiError`` 400 for bytes that are not UTF-8 JSON
    (:func:`~radixkv.serve.openai.protocol.decode_json`) or a value ``model`` refuses, naming
    the field. Complexity: O(len(raw))."""
    if not raw.strip():
        raise ApiError(400, "the request body is missing: send a JSON object")
    try:
        value = decode_json(raw)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


def install_error_handlers(app: FastAPI) -> None:
    """Answer ``app``'s ``ApiError``s, malformed requests and routing errors (unknown
    path, wrong method) with OpenAI's error body."""

    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc.errors()))

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Invalid URL ({where})"
        elif exc.status_code == 405:
            message = f"Method not allowed ({where})"
        else:  # FastAPI's own, e.g. a body it could not parse: not UTF-8, too deep
            message = str(exc.detail)
        response = error_response(ApiError(exc.status_code, message))
        response.headers.update(exc.headers or {})
        return response

    app.add_exception_handler(ApiError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]


def _validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The most specific of pydantic's complaints as a 400 naming the field (``param``)."""
    if not errors:
        return ApiError(400, "invalid request")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the body is not valid JSON: {detail}".rstrip(": "))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a union's member type ("str", "list[int]", "function-after[...]") is not a field name
    path = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = ".".join(path)
    if "input" in first and path and first.get("type") != "value_error":  # ours say it
        message = f"{message}, got {brief(first['input'])}"
    if not where:
        if first.get("type") == "missing":
            return ApiError(400, "the request body is missing: send a JSON object")
        if isinstance(first.get("input"), (bytes, bytearray)):  # FastAPI read it as no JSON
            header = "Content-Type: application/json"
            return ApiError(400, f"the body was not read as JSON: send it with {header}")
        got = brief(first.get("input"), 100)
        return ApiError(400, f"the request body must be a JSON object, got {got}")
    return ApiError(400, f"{where}: {message}", param=path[0])
