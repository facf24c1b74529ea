"""The model lifecycle as data: every swap written to the event log, the serving choice kept.

The routes (app/api/routes/model.py) and the retraining schedule (app/predict/retrain.py) change
models through here, not on the registry directly, so that:

- each change (a model loaded in a slot, a promote, a rollback, the shadow cleared) is ingested
  as a `model_changed` event, stamped by the service clock: a reader of the log joins every
  outcome to the latest `model_changed` of the serving slot before it (docs/operators/
  model-lifecycle.md shows the join). None is written at startup: a restart would add records
  to a log that must hold what was posted, and the model a service starts with is the one the
  last record named (SERVING_CHOICE_FILE) or KVP_MODEL_DIR;
- the serving model chosen at run time (promoted, reloaded, rolled back to) is written to
  SERVING_CHOICE_FILE in the data directory and served again after a restart, as long as
  KVP_MODEL_DIR is still what it was when the choice was made (an operator who changes it
  means the new one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from app.core.bundle import model_identity
from app.core.clock import Clock
from app.predict.predictors import ModelError
from app.predict.slots import ModelSlots, Serving, public_name, resolve_model_dir
from app.state.base import SessionView
from kvprefetch_client.events import Event, ModelAction, ModelChanged, ModelSlot

log = logging.getLogger(__name__)

# Under the data directory: the serving model chosen at run time.
SERVING_CHOICE_FILE = "serving-model.json"

Ingest = Callable[[Sequence[Event]], Awaitable[object]]


def restored_model_dir(data_dir: Path, models_root: Path, configured: Path) -> Path:
    """The model to serve at startup: the one chosen at run time (SERVING_CHOICE_FILE) while
    `configured` (KVP_MODEL_DIR) is what it was then and the choice still has its model.txt;
    else `configured`."""
    path = data_dir / SERVING_CHOICE_FILE
    try:
        choice = json.loads(path.read_text())
    except FileNotFoundError:
        return configured
    except (OSError, ValueError) as exc:
        log.warning("serving the configured model: %s is unreadable (%s)", path, exc)
        return configured
    if not isinstance(choice, dict) or choice.get("configured_model_dir") != str(configured):
        log.info("serving KVP_MODEL_DIR: it changed since %s was written", path)
        return configured
    try:
        chosen = resolve_model_dir(models_root, str(choice.get("model_dir", "")))
    except ModelError:
        log.warning("serving the configured model: %s names no model under the root", path)
        return configured
    if not (chosen / "model.txt").is_file():
        log.warning("serving the configured model: the chosen %s is gone", choice["model_dir"])
        return configured
    return chosen


class ModelLifecycle:
    """`ingest`: how an event enters the log (the engine's ingest); `data_dir`: where the serving
    choice is kept (None: not kept, a replay); `configured`: KVP_MODEL_DIR."""

    def __init__(
        self,
        models: ModelSlots,
        clock: Clock,
        ingest: Ingest,
        *,
        data_dir: Path | None,
        configured: Path,
        replica_id: str,
    ) -> None:
        self.models = models
        self.clock = clock
        self.ingest = ingest
        self.data_dir = data_dir
        self.configured = configured
        self.replica_id = replica_id

    async def reload(
        self, model_dir: Path, sample: Sequence[SessionView], now: float | None
    ) -> Serving:
        # Off the loop: a model new to this machine compiles for seconds (app/predict/compiled.py).
        serving = await asyncio.to_thread(self.models.reload, model_dir, sample, now)
        self._keep_choice()
        await self._changed("serving", "loaded", serving)
        return serving

    async def set_shadow(
        self, model_dir: Path, sample: Sequence[SessionView], now: float | None
    ) -> Serving:
        shadow = await asyncio.to_thread(self.models.set_shadow, model_dir, sample, now)
        await self._changed("shadow", "loaded", shadow)
        return shadow

    async def clear_shadow(self) -> None:
        had = self.models.shadow is not None
        self.models.clear_shadow()
        if had:
            await self._changed("shadow", "cleared", None)

    async def promote(self) -> Serving:
        """ModelError when there is no shadow."""
        serving = self.models.promote()
        self._keep_choice()
        await self._changed("serving", "promoted", serving)
        await self._changed("shadow", "cleared", None)
        return serving

    async def rollback(self) -> Serving:
        """ModelError when nothing served before."""
        serving = self.models.rollback()
        self._keep_choice()
        await self._changed("serving", "rolled_back", serving)
        return serving

    def event(self, slot: ModelSlot, action: ModelAction, model: Serving | None) -> ModelChanged:
        """The model_changed event for `model` (None: the slot emptied) now."""
        fields: dict[str, str | None] = {}
        if model is not None:
            fields["version"] = model.version
            if model.model_dir is not None:
                identity = model_identity(model.model_dir)
                fields["model_dir"] = public_name(model.model_dir, self.models.models_root)
                fields["card_sha256"] = identity["card_sha256"]
                fields["model_sha256"] = identity["model_sha256"]
        return ModelChanged(
            event_id=f"model-{self.replica_id}-{uuid.uuid4().hex}"[:128],
            ts=self.clock.now(),
            slot=slot,
            action=action,
            **fields,
        )

    async def _changed(self, slot: ModelSlot, action: ModelAction, model: Serving | None) -> None:
        try:
            await self.ingest([self.event(slot, action, model)])
        except Exception:  # the swap is done: a log that refuses its record must not undo it
            log.exception("the %s model change (%s) was not logged", slot, action)

    def _keep_choice(self) -> None:
        """Write what serves now to SERVING_CHOICE_FILE (whole or not at all); the heuristic
        serving leaves the choice to the configuration again."""
        if self.data_dir is None:
            return
        path = self.data_dir / SERVING_CHOICE_FILE
        model_dir = self.models.serving.model_dir
        try:
            if model_dir is None:
                path.unlink(missing_ok=True)
                return
            self.data_dir.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_text(
                json.dumps(
                    {
                        "model_dir": public_name(model_dir, self.models.models_root),
                        "version": self.models.serving.version,
                        "configured_model_dir": str(self.configured),
                    }
                )
            )
            os.replace(partial, path)
        except OSError as exc:  # serving goes on; only the restart would not remember
            log.warning("the serving model chosen is not kept across a restart: %s", exc)


__all__ = ["SERVING_CHOICE_FILE", "ModelLifecycle", "restored_model_dir"]
