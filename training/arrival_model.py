"""A saved arrival model for data scientists: `load_model(dir)` and `predict(frame)`.

    from training import build_dataset, load_model

    model = load_model()                      # the bundled model (models/default)
    df = build_dataset(["var/synthetic.events.jsonl"])
    df["p"] = model.predict(df)               # P(next request within the row's horizon)

The model is loaded and scored by the service's own LearnedPredictor, so a frame's probabilities
are the ones the service would compute from the same features.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from app.core.bundle import DEFAULT_MODEL_DIR
from app.predict.features import FEATURES
from app.predict.predictors import LearnedPredictor

__all__ = ["ArrivalModel", "load_model"]


class ArrivalModel:
    """A model directory (model.txt, card.json) loaded for scoring frames. Attributes: `dir`,
    `card` (card.json as a dict; empty without one), `feature_names` (the columns it reads)."""

    def __init__(self, model_dir: Path) -> None:
        # The Booster, not a compiled copy: a notebook scores a frame once, compiling costs more.
        self._predictor = LearnedPredictor(model_dir, backend="booster")
        self.dir = Path(model_dir)
        self.card: dict[str, Any] = self._predictor.card
        self.feature_names: tuple[str, ...] = self._predictor.feature_names

    def predict(self, frame: pd.DataFrame) -> np.ndarray:
        """P(the session's next request comes within `horizon_seconds`) for each row of `frame`,
        as a float64 array in the frame's row order.

        `frame` holds the columns app.predict.features.FEATURES (as training.build_dataset's
        frames do), in any order; other columns are ignored. NaN is a missing feature, as in
        the service. Raises ValueError naming the columns the frame lacks."""
        missing = [name for name in FEATURES if name not in frame.columns]
        if missing:
            raise ValueError(
                f"the frame lacks {len(missing)} feature column(s) the model needs: "
                f"{', '.join(missing)} (app.predict.features.FEATURES lists them all)"
            )
        x = frame[list(FEATURES)].to_numpy(dtype=np.float64)
        return self._predictor.p_from_matrix(x)

    def __repr__(self) -> str:
        return f"ArrivalModel({str(self.dir)!r})"


def load_model(model_dir: Path | str | None = None) -> ArrivalModel:
    """The model saved in `model_dir` (by training.save_model or `kvprefetch train`), or the
    bundled model when None. Raises app.predict.predictors.ModelError when the directory holds
    no model, or one trained on features this code does not compute."""
    return ArrivalModel(Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR)
