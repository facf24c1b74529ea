"""The serving model and its shadow: which ones, how often each would have been right, swapping."""

from __future__ import annotations

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
from app.observe.ledger import AdviceLedger, LedgerStats
from app.predict.predictors import ModelError
from app.predict.slots import Serving, resolve_model_dir

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
    prefetch_predictions: int = Field(description="Of the advice records, those that said prefetch")
    keep_advice_bytes: int = Field(
        description="The cost of the advice: the sessions' context bytes summed over the records "
        "that said keep (as predictions are counted: both models advise the same sessions at the "
        "same ticks, so the two sums compare)"
    )
    prefetch_advice_bytes: int = Field(
        description="The same over the records that said prefetch: what its prefetches would move"
    )


class VersionScore(BaseModel):
    predictions: int
    keep_predictions: int
    prefetch_predictions: int
    hits: int
    misses: int
    unscored: int
    hit_rate: float | None
    keep_advice_bytes: int
    prefetch_advice_bytes: int


class ShadowComparison(BaseModel):
    """The shadow judged as a retrained candidate is (app/observe/judge.py), whoever set it."""

    judged: int = Field(description="Paired outcomes judged since the shadow came in")
    live_brier: float | None = Field(
        description="The serving model's mean Brier score of P(back within the keep horizon)"
    )
    shadow_brier: float | None = Field(description="The shadow's, on the same outcomes")
    mean_gain: float | None = Field(
        description="Mean of (serving Brier - shadow Brier) per pair: positive when the shadow "
        "is better"
    )
    gain_se: float | None = Field(description="The standard error of mean_gain")
    paired: int = Field(
        description="Advice records of the two models on the same session at the same tick"
    )
    disagreed: int = Field(
        description="Of those, how many differ (keep or not, prefetch or not); the dashboard "
        "lists the latest sessions"
    )


class ModelStatus(ModelInfo):
    """`predictor` and `version` name the serving model, as they did before the shadow existed."""

    live: ModelScore
    shadow: ModelScore | None
    comparison: ShadowComparison | None = Field(
        description="The shadow against the serving model since the shadow came in; null "
        "without a shadow"
    )
    by_version: dict[str, VersionScore] = Field(
        description="Each model version's counts while it sat in a slot since the service "
        "started (a swap keeps them; 'heuristic' for no model)"
    )


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
    return ModelScore(
        predictor=serving.description, version=serving.version, **counts(ledger.stats(slot))
    )


def counts(s: LedgerStats) -> dict[str, Any]:
    """A ledger's counts as the API names them."""
    return {
        "predictions": s.predictions,
        "keep_predictions": s.keep_predictions,
        "hits": s.hits,
        "misses": s.misses,
        "unscored": s.unscored,
        "hit_rate": s.hit_rate,
        "prefetch_predictions": s.prefetch_predictions,
        "keep_advice_bytes": s.keep_advice_bytes,
        "prefetch_advice_bytes": s.prefetch_advice_bytes,
    }


def comparison(ledger: AdviceLedger) -> dict[str, Any] | None:
    """The shadow against the serving model (the judge's scores, the pairs that disagree);
    None without a shadow."""
    compared = ledger.comparison()
    if compared is None:
        return None
    judge = ledger.judge.stats()
    return {
        "judged": judge.judged,
        "live_brier": judge.live_brier,
        "shadow_brier": judge.shadow_brier,
        "mean_gain": judge.mean_gain,
        "gain_se": judge.gain_se,
        "paired": compared.paired,
        "disagreed": compared.disagreed,
    }


@router.get("/model", dependencies=[ReadScope], response_model=ModelStatus)
async def get_model(models: ModelsDep, ledger: LedgerDep) -> ModelStatus:
    """The serving model and the shadow, each with its hit rate and the cost of its advice since
    it was put in place (a promoted model's since it began to shadow); the shadow judged against
    the serving model by the Brier score, as a retrained candidate is; each version's counts."""
    serving, shadow = models.serving, models.shadow
    compared = comparison(ledger)
    return ModelStatus(
        predictor=serving.description,
        version=serving.version,
        live=_score(serving, ledger, "live"),
        shadow=_score(shadow, ledger, "shadow") if shadow is not None else None,
        comparison=ShadowComparison(**compared) if compared is not None else None,
        by_version={
            version: VersionScore(**counts(s)) for version, s in ledger.by_version().items()
        },
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
    engine: EngineDep,
    store: StoreDep,
    clock: ClockDep,
    settings: SettingsDep,
    store_thread: StoreThreadDep,
) -> ModelInfo | Response:
    """Load a model from the models directory (KVP_MODELS_ROOT), check it on live sessions, and
    swap it in atomically; on failure nothing changes. The change is written to the event log
    (`model_changed`) and the model serves again after a restart."""
    try:
        model_dir = resolve_model_dir(settings.models_root_dir, body.model_dir)
        sample = await store_thread.read(store.live_sessions, CHECK_SAMPLE)
        serving = await engine.lifecycle.reload(model_dir, sample, clock.now())
    except ModelError as exc:
        return error_response(422, "model_dir", str(exc))
    return ModelInfo(predictor=serving.description, version=serving.version)


@router.put(
    "/model/shadow", dependencies=[AdminScope], response_model=ModelInfo, responses=_REFUSED
)
async def set_shadow(
    body: ModelDirRequest,
    engine: EngineDep,
    store: StoreDep,
    clock: ClockDep,
    settings: SettingsDep,
    store_thread: StoreThreadDep,
) -> ModelInfo | Response:
    """Put a model from the models directory beside the serving one, checked as a reload is; it
    is scored and never advises, and judged against the serving model (GET /v1/model's
    `comparison`). Written to the event log (`model_changed`)."""
    try:
        model_dir = resolve_model_dir(settings.models_root_dir, body.model_dir)
        sample = await store_thread.read(store.live_sessions, CHECK_SAMPLE)
        shadow = await engine.lifecycle.set_shadow(model_dir, sample, clock.now())
    except ModelError as exc:
        return error_response(422, "model_dir", str(exc))
    return ModelInfo(predictor=shadow.description, version=shadow.version)


@router.delete("/model/shadow", dependencies=[AdminScope], status_code=204, response_class=Response)
async def clear_shadow(engine: EngineDep) -> Response:
    """Remove the shadow model (its version keeps its counts in `by_version`); no shadow is not
    an error."""
    await engine.lifecycle.clear_shadow()
    return Response(status_code=204)


_NOTHING_TO_SWAP: dict[int | str, dict[str, Any]] = {
    409: {"model": Error, "description": "No model to move there; nothing changed."}
}


@router.post(
    "/model/promote",
    dependencies=[AdminScope],
    response_model=ModelInfo,
    responses=_NOTHING_TO_SWAP,
)
async def promote_model(engine: EngineDep) -> ModelInfo | Response:
    """The shadow serves, with the counts it made while it shadowed, and the shadow slot is
    empty; the model serving before can be served again with POST /v1/model/rollback. Written
    to the event log (`model_changed`), and kept across a restart."""
    try:
        serving = await engine.lifecycle.promote()
    except ModelError as exc:
        return error_response(409, "shadow", str(exc))
    return ModelInfo(predictor=serving.description, version=serving.version)


@router.post(
    "/model/rollback",
    dependencies=[AdminScope],
    response_model=ModelInfo,
    responses=_NOTHING_TO_SWAP,
)
async def rollback_model(engine: EngineDep) -> ModelInfo | Response:
    """The model that served before the last promote or reload serves again (once); written to
    the event log (`model_changed`), and kept across a restart."""
    try:
        serving = await engine.lifecycle.rollback()
    except ModelError as exc:
        return error_response(409, "serving", str(exc))
    return ModelInfo(predictor=serving.description, version=serving.version)
