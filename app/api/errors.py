"""One error shape for every 4xx/5xx the service writes itself: {"detail", "field"}."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel


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

            return route

    return FieldErrorRoute
