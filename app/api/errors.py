"""One error shape for every 4xx/5xx the service writes itself: {"detail", "field"}; one handler.

`install_error_handlers(app)` registers `answer_error` for what a route may raise past itself:

- `RequestValidationError` (and FastAPI's 400 for a body it cannot decode): worded by the
  route's module when it defines `validation_error(request, error)` (its parameters' names and
  rules), else by `body_error`;
- `HttpError` (app.api.auth.Refused, app.api.batch.BatchError): its own status, field, headers;
- the engine's errors a route lets through: the store's and the event log's (503, retry later).

Any other exception is the server's fault and reaches Starlette's 500, as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from app.core.errors import EventLogError, KvpError, StoreError, StoreUnavailable


def error_response(
    status_code: int, field: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps({"detail": message, "field": field}),
        status_code=status_code,
        media_type="application/json",
        headers=headers,
    )


class Error(BaseModel):
    """The error shape, for OpenAPI's `responses=`."""

    detail: str
    field: str


class HttpError(KvpError):
    """An error the API answers as it is: `status_code`, `field`, `message` and `headers`."""

    def __init__(
        self, status_code: int, field: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.field = field
        self.message = message
        self.headers = headers or {}


# What a route answers for a request FastAPI failed to validate: its first error, and the request.
ValidationRenderer = Callable[[Request, dict[str, Any]], Response]

# The engine's errors a route may let through: (status, field, message prefix, headers).
_ENGINE_ERRORS: tuple[tuple[type[KvpError], int, str, str, dict[str, str]], ...] = (
    (StoreUnavailable, 503, "store", "the state store is unavailable: ", {"Retry-After": "1"}),
    (StoreError, 503, "store", "the state store failed: ", {"Retry-After": "1"}),
    (EventLogError, 503, "event_log", "", {"Retry-After": "5"}),
)


def body_error(request: Request, error: dict[str, Any]) -> Response:
    """A bad JSON body, naming its top-level field; one that is not JSON as POST /v1/events
    answers it."""
    if error["type"] == "json_invalid":
        return error_response(400, "body", f"the body is not JSON: {error['ctx']['error']}")
    loc = [str(p) for p in error["loc"]]
    field = loc[1] if len(loc) > 1 else "body"
    if error["type"] == "missing":
        message = f"{field} is required"
    else:
        where = ".".join(loc[1:]) or "body"
        message = f"{where}: {str(error['msg']).removeprefix('Value error, ')}"
    return error_response(422, field, message)


def _renderer(request: Request) -> ValidationRenderer:
    """The `validation_error` of the module that defines the route's endpoint, else body_error."""
    endpoint = request.scope.get("endpoint")
    module = sys.modules.get(getattr(endpoint, "__module__", ""), None)
    render = getattr(module, "validation_error", None)
    return render if callable(render) else body_error


async def answer_error(request: Request, exc: Exception) -> Response:
    """The one exception handler: the {"detail", "field"} answer for each error it is installed
    for."""
    if isinstance(exc, RequestValidationError):
        return _renderer(request)(request, exc.errors()[0])
    if isinstance(exc, HTTPException):
        # FastAPI's own 400 for a body it cannot decode (not UTF-8) is a JSON error too, as it
        # words one itself for a body that decodes but does not parse.
        if exc.status_code == 400 and isinstance(exc.__cause__, ValueError):
            return _renderer(request)(
                request,
                {
                    "type": "json_invalid",
                    "loc": ("body", 0),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": str(exc.__cause__)},
                },
            )
        return await http_exception_handler(request, exc)
    if isinstance(exc, HttpError):
        return error_response(exc.status_code, exc.field, exc.message, exc.headers)
    for kind, status_code, field, prefix, headers in _ENGINE_ERRORS:
        if isinstance(exc, kind):
            return error_response(status_code, field, f"{prefix}{exc}", headers)
    raise exc  # not installed for it


async def _client_gone(_: Request, exc: Exception) -> Response:
    # The client left, or a limit answered for it (app/api/bodylimit.py, timeouts.py): this
    # answer goes nowhere, and nothing of the request was accepted.
    return Response(status_code=400)


def install_error_handlers(app: FastAPI) -> None:
    for kind in (
        RequestValidationError,
        HTTPException,
        HttpError,
        *(kind for kind, *_ in _ENGINE_ERRORS),
    ):
        app.add_exception_handler(kind, answer_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
