"""One error shape for every 4xx/5xx the service writes itself: {"detail", "field"}."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException


def error_response(status_code: int, field: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"detail": message, "field": field}), status_code=status_code,
                    media_type="application/json", headers=headers)


class Error(BaseModel):
    """The error shape, for OpenAPI's `responses=`."""

    detail: str
    field: str


# What a route answers for a request FastAPI failed to validate: its first error, and the request.
ValidationRenderer = Callable[[Request, dict[str, Any]], Response]


def field_error_route(render: ValidationRenderer) -> type[APIRoute]:
    """An APIRoute class that answers a request failing validation with `render` (the service's
    one error shape, worded per route module) instead of FastAPI's list of errors."""

    class FieldErrorRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                try:
                    return await handler(request)
                except RequestValidationError as exc:
                    return render(request, exc.errors()[0])
                except HTTPException as exc:
                    # FastAPI's own 400 for a body it cannot decode (not UTF-8) is a JSON error too,
                    # as it words one itself for a body that decodes but does not parse.
                    if exc.status_code != 400 or not isinstance(exc.__cause__, ValueError):
                        raise
                    return render(request, {"type": "json_invalid", "loc": ("body", 0),
                                            "msg": "JSON decode error", "input": {},
                                            "ctx": {"error": str(exc.__cause__)}})

            return route

    return FieldErrorRoute


def body_error(request: Request, error: dict[str, Any]) -> Response:
    """A bad JSON body, naming its top-level field; one that is not JSON as POST /v1/events answers it."""
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
