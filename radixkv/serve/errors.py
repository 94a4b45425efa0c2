"""The API's errors: OpenAI's error body for a bad request, a malformed one, or a failure.

:class:`ApiError` carries a status and the body; :func:`install_error_handlers`
makes a FastAPI app answer it, and pydantic's validation errors as a 400 naming
the field (``param``).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from radixkv.serve.protocol import error_body

__all__ = ["ApiError", "as_api_error", "error_response", "install_error_handlers"]


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
    """``exc`` as the API reports it: an ``ApiError`` as is, anything else a 500."""
    if isinstance(exc, ApiError):
        return exc
    return ApiError(500, f"{type(exc).__name__}: {exc}", type_="internal_error")


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


def install_error_handlers(app: FastAPI) -> None:
    """Answer ``app``'s ``ApiError``s and malformed requests with OpenAI's error body."""

    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    app.add_exception_handler(ApiError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid_request)  # type: ignore[arg-type]


def _validation_error(exc: RequestValidationError) -> ApiError:
    """The first of pydantic's complaints as a 400 naming the field (``param``)."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request")
    first = max(errors, key=lambda e: len(e.get("loc", ())))  # the most specific complaint
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the body is not valid JSON: {detail}".rstrip(": "))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a union's member type ("str", "list[int]") is not a field name
    path = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    message = str(first.get("msg", "invalid value"))
    where = ".".join(path)
    if "input" in first and path:
        message = f"{message}, got {json.dumps(first['input'], default=repr)[:200]}"
    if not where:
        if first.get("type") == "missing":
            return ApiError(400, "the request body is missing: send a JSON object")
        got = json.dumps(first.get("input"), default=repr)[:100]
        return ApiError(400, f"the request body must be a JSON object, got {got}")
    return ApiError(400, f"{where}: {message}", param=path[0])
