"""GET /v1/config: the settings this process runs with, for operators (admin scope)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from app.api.deps import SettingsDep, TokensDep
from app.core.redact import mask_url

router = APIRouter(tags=["admin"])


class ConfigView(BaseModel):
    settings: dict[str, Any] = Field(
        description="Every KVP_ setting, by its field name; tokens shown as '**********' when set, "
        "URLs without their password, query or (the webhook's) path"
    )
    tokens: dict[str, list[str]] = Field(
        description="Each configured token's name and scopes (never the token or its digest)"
    )
    bindings: dict[str, dict[str, list[str]]] = Field(
        default_factory=dict,
        description="Each bound token's name and the instance and agent patterns it acts for "
        "(KVP_TOKENS_FILE instances, agents); a token not listed acts for all",
    )


@router.get("/config", response_model=ConfigView, summary="The running configuration")
async def get_config(settings: SettingsDep, tokens: TokensDep) -> ConfigView:
    """The effective settings (environment, .env and defaults resolved), secrets masked."""
    shown = settings.model_dump(mode="json")
    shown["redis_url"] = mask_url(settings.redis_url.get_secret_value())
    if settings.order_webhook_url is not None:
        webhook = settings.order_webhook_url.get_secret_value()
        shown["order_webhook_url"] = mask_url(webhook, keep_path=False)
    return ConfigView(settings=shown, tokens=tokens.names(), bindings=tokens.bindings())
