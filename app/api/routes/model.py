"""The serving model: which one, and swapping it for another."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import ModelsDep
from app.engine.predictor import ModelError

router = APIRouter(tags=["model"])


class ModelInfo(BaseModel):
    predictor: str
    version: str | None


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_dir: str = Field(min_length=1, max_length=4096, description="A directory with model.txt and card.json")


@router.get("/model", response_model=ModelInfo)
async def get_model(models: ModelsDep) -> ModelInfo:
    serving = models.serving
    return ModelInfo(predictor=serving.description, version=serving.version)


@router.post("/model/reload", response_model=ModelInfo,
             responses={422: {"description": "The model does not load or does not fit; the old one serves on."}})
async def reload_model(body: ReloadRequest, models: ModelsDep) -> ModelInfo:
    """Load a model, check it on a sample, and swap it in atomically; on failure nothing changes."""
    try:
        serving = models.reload(Path(body.model_dir))
    except ModelError as exc:
        raise HTTPException(422, detail=[{"loc": ["body", "model_dir"], "msg": str(exc), "type": "model_error"}]) from None
    return ModelInfo(predictor=serving.description, version=serving.version)
