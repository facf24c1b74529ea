"""The predictor the service serves, and swapping it for another model without a gap."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.observe.ledger import AdviceLedger
from app.predict.features import DeploymentSignals
from app.predict.predictors import HeuristicPredictor, LearnedPredictor, ModelError, Predictor
from app.predict.tool_durations import ToolDurations
from app.state.base import SessionView

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Serving:
    predictor: Predictor
    # What /readyz says: "learned (default)" or why the heuristic serves.
    description: str
    version: str | None
    # Where the model was loaded from; None for the heuristic.
    model_dir: Path | None = None


def _probe_session() -> SessionView:
    return SessionView(
        session_id="probe",
        state="idle",
        turns=2,
        first_seen_ts=0.0,
        last_activity_ts=60.0,
        closed_ts=None,
        instance_id="probe",
        context_tokens=8000,
        context_bytes=0,
        block_hashes=[1],
        block_tokens=512,
        recent_arrivals_ts=[0.0, 50.0],
        inter_turn_gaps_seconds=[50.0],
        last_request=None,
        resident_blocks={},
    )


def load_checked(
    model_dir: Path,
    sample: Sequence[SessionView] = (),
    now: float | None = None,
    *,
    deployment: DeploymentSignals | None = None,
    tools: ToolDurations | None = None,
    compile_in_background: bool = False,
) -> LearnedPredictor:
    """Load a model and make it answer for a sample of sessions before it may serve.

    `sample` is live sessions from the store (the probe session when there are none), scored at
    `now`: a model that loads but breaks on the traffic it would serve is caught here, not after
    the swap. Raises ModelError when the files are missing, do not load, compute other features,
    or do not give probabilities in [0, 1] for every session of the sample. `deployment`,
    `tools`: what the model reads the deployment's and the tool features from (LearnedPredictor).
    """
    model = LearnedPredictor(
        model_dir, deployment=deployment, tools=tools, compile_in_background=compile_in_background
    )
    if sample:
        sessions, what = (
            list(sample),
            f"{len(sample)} live session{'s' if len(sample) != 1 else ''}",
        )
    else:
        sessions, what = [_probe_session()], "the probe session"
    if now is None:
        now = max(s.last_activity_ts for s in sessions) + 30.0
    try:
        p = model.p_within(sessions, now, (15.0, 60.0, 600.0))
    except Exception as exc:  # a model that breaks on real sessions is refused, not served
        raise ModelError(f"{model_dir}: the model fails on {what}: {exc!r}") from None
    if p.shape != (len(sessions), 3) or not ((p >= 0) & (p <= 1)).all():
        raise ModelError(f"{model_dir}: the model's answers on {what} are not probabilities")
    return model


# Whatever a refused name was, outside the models root: one answer, so that it tells nothing of
# what exists there.
OUTSIDE_ROOT = (
    "model_dir must name a directory inside the models directory (KVP_MODELS_ROOT): "
    "a name relative to it, or an absolute path under it, with no '..'"
)


class ModelDirRefused(ModelError):
    pass


def resolve_model_dir(root: Path, requested: str) -> Path:
    """The directory `requested` names inside `root` (relative names are under it), symlinks
    resolved; ModelDirRefused for `..`, or anything that is or leads outside it."""
    path = Path(requested)
    if "\x00" in requested or ".." in path.parts:
        raise ModelDirRefused(OUTSIDE_ROOT)
    root_real = root.resolve()
    if path.is_absolute():
        # Lexically first, so nothing outside the root is ever looked at.
        if not (_within(path, root.absolute()) or _within(path, root_real)):
            raise ModelDirRefused(OUTSIDE_ROOT)
    else:
        path = root_real / path
    try:
        real = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise ModelDirRefused(OUTSIDE_ROOT) from None
    if not _within(real, root_real):  # a symlink leading out
        raise ModelDirRefused(OUTSIDE_ROOT)
    return real


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def public_name(model_dir: Path, root: Path) -> str:
    """How messages that anyone may read name a model directory: relative to the models root,
    else by its last part (never a path of this machine)."""
    for base in (root, root.resolve()):
        try:
            return model_dir.relative_to(base).as_posix() or "."
        except ValueError:
            continue
    try:
        return model_dir.resolve().relative_to(root.resolve()).as_posix() or "."
    except (OSError, ValueError):
        return model_dir.name or "."


def public_error(exc: ModelError, model_dir: Path, root: Path) -> ModelError:
    """`exc` with this machine's paths replaced by the names of public_name."""
    message = str(exc)
    name = public_name(model_dir, root)
    forms = {str(model_dir), str(model_dir.absolute()), str(model_dir.resolve())}
    for path in sorted(forms, key=len, reverse=True):
        message = message.replace(path, name)
    for path in sorted({str(root.absolute()), str(root.resolve())}, key=len, reverse=True):
        message = message.replace(path, "<models>")
    return type(exc)(message)


class ModelSlots:
    """Holds the serving predictor and the shadow beside it; a swap replaces one in a single
    assignment, or nothing at all, and starts that slot's advice ledger afresh (the ledger keeps
    each version's counts); a promote moves the shadow, with its counts, to serving and empties
    the shadow slot; a rollback serves again what served before the last promote or reload,
    once. app/predict/lifecycle.py logs each change and keeps the serving choice. What it says
    (descriptions, errors) names model directories relative to `models_root` (default: the one
    holding `model_dir`), never by their path."""

    def __init__(
        self,
        model_dir: Path | None,
        shadow_dir: Path | None = None,
        *,
        ledger: AdviceLedger | None = None,
        models_root: Path | None = None,
        deployment: DeploymentSignals | None = None,
        tools: ToolDurations | None = None,
        compile_in_background: bool = False,
    ) -> None:
        """`model_dir` None: serve the heuristic, loading nothing (a replay whose policy never
        scores through the engine). `deployment`, `tools`: handed to every model loaded
        (LearnedPredictor); `compile_in_background`: a model whose machine code is not cached
        serves with the Booster until lleaves has compiled it (the service's start never waits
        on it; a replay compiles first, so its answers never change midway)."""
        self.deployment = deployment
        self.tools = tools
        self.compile_in_background = compile_in_background
        self.ledger = ledger if ledger is not None else AdviceLedger()
        if models_root is None:
            models_root = model_dir.parent if model_dir is not None else Path(".")
        self.models_root = models_root
        if model_dir is None:
            self.serving = Serving(HeuristicPredictor(), "heuristic (no model loaded)", None)
        else:
            try:
                model = self._load(model_dir)
                self.serving = _learned(model, model_dir)
            except ModelError as exc:
                log.warning("serving the heuristic: %s (%s)", exc, model_dir)
                self.serving = Serving(HeuristicPredictor(), f"heuristic ({exc})", None)
        self.ledger.start("live", self.serving.version)
        # What served before the last promote or reload: what a rollback serves again.
        self.previous: Serving | None = None
        # The shadow is scored beside the serving model and never advises anyone.
        self.shadow: Serving | None = None
        # Why the configured shadow is not there; a shadow that fails never stops the service.
        self.shadow_problem: str | None = None
        if shadow_dir is not None:
            try:
                self.set_shadow(shadow_dir)
            except ModelError as exc:
                log.warning("no shadow model: %s (%s)", exc, shadow_dir)
                self.shadow_problem = str(exc)

    def _load(
        self, model_dir: Path, sample: Sequence[SessionView] = (), now: float | None = None
    ) -> LearnedPredictor:
        try:
            return load_checked(
                model_dir,
                sample,
                now,
                deployment=self.deployment,
                tools=self.tools,
                compile_in_background=self.compile_in_background,
            )
        except ModelError as exc:
            raise public_error(exc, model_dir, self.models_root) from None

    def reload(
        self, model_dir: Path, sample: Sequence[SessionView] = (), now: float | None = None
    ) -> Serving:
        model = self._load(model_dir, sample, now)  # raises before anything changes
        self.previous, self.serving = self.serving, _learned(model, model_dir)
        self.ledger.start("live", model.version)
        log.info("now serving model %s from %s", model.version, model_dir)
        return self.serving

    def set_shadow(
        self, model_dir: Path, sample: Sequence[SessionView] = (), now: float | None = None
    ) -> Serving:
        model = self._load(model_dir, sample, now)
        self.shadow = _learned(model, model_dir)
        self.shadow_problem = None
        self.ledger.start("shadow", model.version)
        log.info("shadowing model %s from %s", model.version, model_dir)
        return self.shadow

    def clear_shadow(self) -> None:
        self.shadow, self.shadow_problem = None, None
        self.ledger.stop("shadow")

    def promote(self) -> Serving:
        """The shadow serves, with what it counted while it shadowed; the shadow slot is empty.
        ModelError when there is no shadow."""
        shadow = self.shadow
        if shadow is None:
            raise ModelError("no shadow model to promote: set one first (PUT /v1/model/shadow)")
        self.previous, self.serving, self.shadow = self.serving, shadow, None
        self.shadow_problem = None
        self.ledger.promote()
        log.info("promoted model %s from the shadow to serving", shadow.version)
        return shadow

    def rollback(self) -> Serving:
        """What served before the last promote or reload serves again (its counts start
        afresh); once: a second rollback has nothing to go back to. ModelError when nothing
        did."""
        previous = self.previous
        if previous is None:
            raise ModelError("nothing to roll back to: no promote or reload since the start")
        self.previous, self.serving = None, previous
        self.ledger.start("live", previous.version)
        log.info("rolled back to model %s", previous.version or "heuristic")
        return previous


def _learned(model: LearnedPredictor, model_dir: Path) -> Serving:
    return Serving(model, f"learned ({model.version})", model.version, model_dir)
