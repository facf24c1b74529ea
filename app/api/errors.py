"""One error shape for every 4xx/5xx the service writes itself: {"detail", "field"}."""

from __future__ import annotations

import orjson
from fastapi import Response


def error_response(status_code: int, field: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"detail": message, "field": field}), status_code=status_code,
                    media_type="application/json", headers=headers)
