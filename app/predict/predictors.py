"""Predictors of each live session's next request: how likely within a horizon, and when.

`p_within` is the matrix the planner uses: for each session and each horizon h, P(the next
request arrives within h seconds).
The heuristic needs no model: it reads the session's own history. The learned predictor is a
LightGBM model over app.predict.features, trained from event logs (training/), evaluated by the
Booster or, when lleaves is installed, by the same model compiled to machine code
(app/predict/compiled.py). A caller that keeps a FeatureTable current scores straight from it
(`p_within_table`), skipping the conversion of views to features.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from app.core.errors import KvpError
from app.predict import compiled
from app.predict.feature_table import FeatureTable, feature_matrix
from app.predict.features import (
    FEATURES,
    HORIZON_FEATURE,
    DeploymentSignals,
    deployment_features,
)
from app.predict.tool_durations import ToolDurations
from app.state.base import SessionView

log = logging.getLogger(__name__)

# REFERENCE.md ("What real traffic looks like"): the gap to a conversation's next turn has a
# median of ~78-126 s; this is the prior for a session with no gap of its own yet.
PRIOR_GAP_SECONDS = 100.0
# The horizons a prediction is read at; beyond the last, a session counts as not returning.
HORIZON_GRID: tuple[float, ...] = (5.0, 15.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0, 900.0)
# What evaluates the trees: "auto" is the compiled model when lleaves is installed and compiles
# this model, else the Booster.
Backend = Literal["auto", "compiled", "booster"]


class ModelError(KvpError):
    """A model that cannot serve: missing files, or features that differ from the service's."""


class Predictor(Protocol):
    """What every predictor promises (tests/predict/test_predictor_contract.py checks each one):
    probabilities in [0, 1], non-decreasing in the horizon, 0 for a closed session."""

    name: str

    def p_within(
        self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]
    ) -> np.ndarray:
        """Shape (len(sessions), len(horizons))."""
        ...


@runtime_checkable
class TablePredictor(Predictor, Protocol):
    """A predictor that also scores straight from a FeatureTable: `p_within_table` answers what
    `p_within` answers for the table's sessions (app/decide/table_advice.py takes this path)."""

    def p_within_table(
        self,
        table: FeatureTable,
        now: float,
        horizons: Sequence[float],
        rows: np.ndarray | None = None,
        *,
        matrices: dict[bytes, np.ndarray] | None = None,
    ) -> np.ndarray:
        """`p_within` for the table's sessions (all rows, or `rows`), shape (sessions,
        horizons); `matrices`: feature matrices to share with other models asked the same."""
        ...


class HeuristicPredictor(Predictor):
    """The session's median recent gap between turns, else a prior; a fixed chance of return,
    until the session is `give_up_gaps` gaps late, when it counts as gone."""

    name = "heuristic"

    def __init__(
        self, prior_gap_seconds: float = PRIOR_GAP_SECONDS, give_up_gaps: float = 3.0
    ) -> None:
        self.prior_gap_seconds = prior_gap_seconds
        self.give_up_gaps = give_up_gaps

    def p_within(
        self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]
    ) -> np.ndarray:
        out = np.zeros((len(sessions), len(horizons)))
        for i, s in enumerate(sessions):
            if s.state == "closed":
                continue
            gaps = s.inter_turn_gaps_seconds
            gap = statistics.median(gaps) if gaps else self.prior_gap_seconds
            last = s.recent_arrivals_ts[-1] if s.recent_arrivals_ts else s.last_activity_ts
            if now - last > self.give_up_gaps * gap:
                continue
            due_in = max(last + gap - now, 0.0)
            p = 0.6 if gaps else 0.4
            out[i] = [p if h >= due_in else 0.0 for h in horizons]
        return out


class LearnedPredictor(TablePredictor):
    """A LightGBM model of P(next request within horizon), from models/<version>/.

    `deployment`: the DeploymentSignals the service's ingest keeps current (app/engine.py), read
    at each call for the DEPLOYMENT_FEATURES; `tools`: the ToolDurations it keeps, read for the
    TOOL_FEATURES; without them those are NaN."""

    name = "learned"

    def __init__(
        self,
        model_dir: Path | str,
        *,
        backend: Backend = "auto",
        cache_dir: Path | None = None,
        deployment: DeploymentSignals | None = None,
        tools: ToolDurations | None = None,
        compile_in_background: bool = False,
    ) -> None:
        import lightgbm as lgb

        self.deployment = deployment
        self.tools = tools

        self.model_dir = Path(model_dir)
        model_file = self.model_dir / "model.txt"
        try:
            found = model_file.is_file()
        except OSError as exc:  # a name too long for the file system, a directory we may not search
            raise ModelError(f"no model at {model_file}: {exc.strerror}") from None
        if not found:
            raise ModelError(f"no model at {model_file}")
        try:
            self.booster = lgb.Booster(model_file=str(model_file))
        except lgb.basic.LightGBMError as exc:
            raise ModelError(f"{model_file} does not load: {exc}") from None
        names = tuple(self.booster.feature_name())
        unknown = [n for n in names if n not in FEATURES]
        if unknown or HORIZON_FEATURE not in names:
            raise ModelError(
                f"{model_file} was trained on features {list(names)}; this service computes "
                f"{list(FEATURES)}"
            )
        # A model trained before later features existed (the signal, deployment and tool
        # features) still serves: it reads its own columns of the service's feature matrix, by
        # name.
        self.feature_names = names
        self._columns: np.ndarray | None = (
            None if names == FEATURES else np.array([FEATURES.index(n) for n in names])
        )
        card_file = self.model_dir / "card.json"
        try:
            self.card = json.loads(card_file.read_text()) if card_file.is_file() else {}
        except (OSError, ValueError) as exc:
            raise ModelError(f"{card_file} does not load: {exc}") from None
        self.version = self.model_dir.name
        self.compiled: compiled.CompiledModel | None = None
        self._compiling: threading.Thread | None = None
        if backend == "compiled" or (backend == "auto" and compiled.available()):
            probe = probe_rows()
            if self._columns is not None:
                probe = probe[:, self._columns]
            expected = self._booster_predict(probe)
            if (
                backend == "auto"
                and compile_in_background
                and not compiled.is_cached(model_file, cache_dir)
            ):
                # A first compile takes a minute or more for a model of a thousand trees: the
                # Booster serves meanwhile (the same answers, slower), so a start never waits.
                self._compiling = threading.Thread(
                    target=self._compile,
                    args=(model_file, probe, expected, cache_dir, False),
                    name="kvp-lleaves",
                    daemon=True,
                )
                self._compiling.start()
            else:
                self._compile(model_file, probe, expected, cache_dir, backend == "compiled")

    def _compile(
        self,
        model_file: Path,
        probe: np.ndarray,
        expected: np.ndarray,
        cache_dir: Path | None,
        required: bool,
    ) -> None:
        try:
            done = compiled.compile_model(model_file, probe, expected, cache_dir)
        except Exception as exc:  # lleaves is optional: any failure leaves the Booster serving
            if required:
                raise ModelError(f"{model_file} does not compile: {exc}") from None
            log.warning(
                "scoring with the LightGBM Booster: %s does not compile: %s", model_file, exc
            )
            return
        if self._compiling is not None:
            log.info("%s compiled in %.1f s: scoring with lleaves", model_file, done.load_seconds)
        self.compiled = done  # one assignment: a scoring thread sees the old or the new

    def wait_compiled(self, timeout_seconds: float | None = None) -> bool:
        """Wait for a compile in the background (`compile_in_background`); whether the compiled
        model serves now."""
        if self._compiling is not None:
            self._compiling.join(timeout_seconds)
        return self.compiled is not None

    @property
    def backend(self) -> str:
        """What evaluates the trees: "lleaves" or "booster"."""
        return "lleaves" if self.compiled is not None else "booster"

    def model_input(self, x: np.ndarray) -> np.ndarray:
        """The columns of a FEATURES matrix this model reads, in its order."""
        return x if self._columns is None else x[:, self._columns]

    def p_from_matrix(self, x: np.ndarray) -> np.ndarray:
        """P(within the row's horizon) for each row of a FEATURES matrix (feature_matrix's
        layout)."""
        if len(x) == 0:
            return np.zeros(0)
        x = self.model_input(x)
        model = self.compiled  # read once: a background compile may land meanwhile
        if model is not None:
            return model.predict(x)
        return self._booster_predict(x)

    def p_within(
        self, sessions: Sequence[SessionView], now: float, horizons: Sequence[float]
    ) -> np.ndarray:
        if not sessions:
            return np.zeros((0, len(horizons)))
        x = feature_matrix(
            sessions, now, horizons, deployment_features(self.deployment), self.tools
        )
        out = self.p_from_matrix(x).reshape(len(sessions), len(horizons))
        closed = np.array([s.state == "closed" for s in sessions])
        out[closed] = 0.0
        return out

    def p_within_table(
        self,
        table: FeatureTable,
        now: float,
        horizons: Sequence[float],
        rows: np.ndarray | None = None,
        *,
        matrices: dict[bytes, np.ndarray] | None = None,
    ) -> np.ndarray:
        """`p_within` for the table's sessions (all rows, or `rows`), shape (sessions, horizons).
        `matrices`: feature matrices of these rows at this time and horizons, by deployment
        features and tool run times, shared with other models asked the same (the serving model
        and the shadow read one matrix); a new one is added."""
        n = len(table) if rows is None else len(rows)
        deployment = deployment_features(self.deployment)
        key = np.asarray(deployment, dtype=np.float64).tobytes() + str(id(self.tools)).encode()
        x = matrices.get(key) if matrices is not None else None
        if x is None:
            x = table.matrix(now, horizons, rows, deployment, self.tools)
            if matrices is not None:
                matrices[key] = x
        out = self.p_from_matrix(x).reshape(n, len(horizons))
        out[table.closed(rows)] = 0.0
        return out

    def _booster_predict(self, x: np.ndarray) -> np.ndarray:
        # One thread: the service shares its two cores with ingestion (bench predict has both).
        return np.asarray(self.booster.predict(x, num_threads=1))


def probe_rows(n: int = 512, seed: int = 0) -> np.ndarray:
    """Rows spread over many orders of magnitude, some NaN, every grid horizon: a compiled model
    (or a cached one) that answers all of them as the Booster does is taken for the same model."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(mean=2.0, sigma=3.0, size=(n, len(FEATURES)))
    x[rng.random(x.shape) < 0.15] = np.nan
    x[:, FEATURES.index("running")] = rng.integers(0, 2, n)
    x[:, FEATURES.index(HORIZON_FEATURE)] = rng.choice(HORIZON_GRID, n)
    return x
