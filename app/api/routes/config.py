"""GET /v1/config: the settings this process runs with, for operators (admin scope)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from app.api.deps import SettingsDep

router = APIRouter(tags=["admin"])


class ConfigView(BaseModel):
    settings: dict[str, Any] = Field(description="Every KVP_ setting, by its field name; tokens shown as "
                                                 "'**********' when set")
    tokens: dict[str, list[str]] = Field(description="Each configured token's name and scopes (never the "
                                                     "token or its digest)")


@router.get("/config", response_model=ConfigView, summary="The running configuration")
async def get_config(request: Request, settings: SettingsDep) -> ConfigView:
    """The effective settings (environment, .env and defaults resolved), secrets masked."""
    return ConfigView(settings=settings.model_dump(mode="json"), tokens=request.app.state.tokens.names())
