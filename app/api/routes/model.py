"""The serving model and its shadow: which ones, how often each would have been right, swapping."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.auth import AdminScope, ReadScope
from app.api.deps import (
    ClockDep,
    EngineDep,
    LedgerDep,
    ModelsDep,
    SettingsDep,
    StoreDep,
    StoreThreadDep,
)
from app.api.errors import Error, error_response
from app.observe.ledger import AdviceLedger
from app.predict.predictors import ModelError
from app.predict.registry import Serving, resolve_model_dir

router = APIRouter(tags=["model"])

# Live sessions a new model must answer for before it serves (or shadows): the most recently
# active ones, the traffic it would see first.
CHECK_SAMPLE = 256

_REFUSED: dict[int | str, dict[str, Any]] = {
    400: {"model": Error, "description": "The body is not JSON."},
    422: {
        "model": Error,
        "description": (
            "The model does not load or does not fit, or the body is bad; nothing changed."
        ),
    },
}


class ModelInfo(BaseModel):
    predictor: str
    version: str | None


class ModelScore(ModelInfo):
    predictions: int = Field(
        description="Advice records made (each live idle session, at every pass "
        "of the scoring loop)"
    )
    keep_predictions: int = Field(description="Of those, how many said keep or prefetch")
    hits: int = Field(description="Requests whose latest advice before them said keep or prefetch")
    misses: int = Field(description="Requests whose latest advice before them said demote or lru")
    unscored: int = Field(description="Requests of sessions with no advice before them")
    hit_rate: float | None = Field(
        description="hits / (hits + misses); null before the first scored request"
    )


class ModelStatus(ModelInfo):
    """`predictor` and `version` name the serving model, as they did before the shadow existed."""

    live: ModelScore
    shadow: ModelScore | None


class ModelDirRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_dir: str = Field(
        min_length=1,
        max_length=4096,
        description="A directory with model.txt and card.json inside the "
        "models directory (KVP_MODELS_ROOT): its name relative to "
        "it, or its absolute path",
    )


class RetrainJudge(BaseModel):
    judged: int = Field(description="Paired outcomes judged since the candidate began to shadow")
    live_brier: float | None = Field(
        description="The serving model's mean Brier score of P(back within the keep horizon)"
    )
    shadow_brier: float | None = Field(description="The candidate's, on the same outcomes")
    mean_gain: float | None = Field(
        description="Mean of (serving Brier - candidate Brier) per pair: positive when the "
        "candidate is better"
    )
    gain_se: float | None = Field(description="The standard error of mean_gain")
    dropped: int = Field(description="Pairs dropped unjudged (memory bound)")
    pending: int = Field(description="Pairs waiting for their outcome")


class RetrainCandidate(BaseModel):
    version: str
    shadow_since_ts: float
    judge: RetrainJudge | None
    min_judged: int


class RetrainRun(BaseModel):
    outcome: Literal["promoted", "discarded", "failed", "skipped"]
    reason: str
    ts: float = Field(description="When the run ended, by the service clock")
    version: str | None = Field(description="The candidate's version, when one was trained")
    judged: int
    live_brier: float | None
    shadow_brier: float | None


class RetrainStatus(BaseModel):
    enabled: bool = Field(description="KVP_RETRAIN_EVERY_SECONDS > 0")
    state: Literal["off", "waiting", "training", "shadowing"]
    every_seconds: float
    next_run_ts: float | None = Field(
        description="When the next run is due (service clock); null before the schedule's "
        "first step"
    )
    arrivals_since_last_run: int
    min_arrivals: int
    runs: dict[str, int] = Field(description="Runs by outcome since the service started")
    candidate: RetrainCandidate | None = Field(description="The candidate shadowing now")
    last: RetrainRun | None = Field(description="The last run that ended")


def _score(serving: Serving, ledger: AdviceLedger, slot: str) -> ModelScore:
    s = ledger.stats(slot)
    return ModelScore(
        predictor=serving.description,
        version=serving.version,
        predictions=s.predictions,
        keep_predictions=s.keep_predictions,
        hits=s.hits,
        misses=s.misses,
        unscored=s.unscored,
        hit_rate=s.hit_rate,
    )


@router.get("/model", dependencies=[ReadScope], response_model=ModelStatus)
async def get_model(models: ModelsDep, ledger: LedgerDep) -> ModelStatus:
    """The serving model and the shadow, each with its hit rate since it was put in place."""
    serving, shadow = models.serving, models.shadow
    return ModelStatus(
        predictor=serving.description,
        version=serving.version,
        live=_score(serving, ledger, "live"),
        shadow=_score(shadow, ledger, "shadow") if shadow is not None else None,
    )


@router.get("/model/retrain", dependencies=[ReadScope], response_model=RetrainStatus)
async def get_retrain(engine: EngineDep) -> RetrainStatus:
    """The retraining schedule (KVP_RETRAIN_*): its state, the candidate shadowing now with the
    paired Brier scores that will decide it, and the last run's outcome and why."""
    return RetrainStatus.model_validate(engine.retrainer.status())


@router.post(
    "/model/reload", dependencies=[AdminScope], response_model=ModelInfo, responses=_REFUSED
)
async def reload_model(
    body: ModelDirRequest,
    models: ModelsDep,
    store: StoreDep,
    clock: ClockDep,
    settings: SettingsDep,
    store_thread: StoreThreadDep,
) -> ModelInfo | Response:
    """Load a model from the models directory (KVP_MODELS_ROOT), check it on live sessions, and
    swap it in atomically; on failure nothing changes."""
    try:
        model_dir = resolve_model_dir(settings.models_root_dir, body.model_dir)
        sample = await store_thread.read(store.live_sessions, CHECK_SAMPLE)
        # Off the loop: a model new to this machine compiles for seconds (app/predict/compiled.py).
        serving = await asyncio.to_thread(models.reload, model_dir, sample, clock.now())
    except ModelError as exc:
        return error_response(422, "model_dir", str(exc))
    return ModelInfo(predictor=serving.description, version=serving.version)


@router.put(
    "/model/shadow", dependencies=[AdminScope], response_model=ModelInfo, responses=_REFUSED
)
async def set_shadow(
    body: ModelDirRequest,
    models: ModelsDep,
    store: StoreDep,
    clock: ClockDep,
    settings: SettingsDep,
    store_thread: StoreThreadDep,
) -> ModelInfo | Response:
    """Put a model from the models directory beside the serving one, checked as a reload is; it
    is scored and never advises."""
    try:
        model_dir = resolve_model_dir(settings.models_root_dir, body.model_dir)
        sample = await store_thread.read(store.live_sessions, CHECK_SAMPLE)
        shadow = await asyncio.to_thread(models.set_shadow, model_dir, sample, clock.now())
    except ModelError as exc:
        return error_response(422, "model_dir", str(exc))
    return ModelInfo(predictor=shadow.description, version=shadow.version)


@router.delete("/model/shadow", dependencies=[AdminScope], status_code=204, response_class=Response)
async def clear_shadow(models: ModelsDep) -> Response:
    """Remove the shadow model (and its counts); no shadow is not an error."""
    models.clear_shadow()
    return Response(status_code=204)
