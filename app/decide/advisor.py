"""From predictions to advice: which contexts to keep, which to let go, which to fetch early.

The advice is in the vocabulary the transfer layers already speak (LMCache, Mooncake Store,
Dynamo's block manager): *keep* a context resident for a time-to-live (a pin with TTL), *demote*
it (evict it first), or *prefetch* it to its instance. What no advice covers is left to the
tier's own LRU. That makes a model an improvement on LRU where it is confident and harmless
where it is not: ranking every context by the model alone lost to plain LRU in replay (see
docs/decisions.md, "Retention as advice on top of LRU").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from app.decide.routing import SameInstanceEstimate
from app.predict.predictors import Predictor
from app.state.base import SessionView
from kvprefetch_client.events import BlockHash

# Sessions idle longer than this are not scored: their contexts go by plain LRU.
MAX_IDLE_SECONDS = 1800.0
# "Does it come back at all?" is asked at this horizon; a later return counts as none.
RETURN_HORIZON_SECONDS = 900.0

Retention = Literal["keep", "demote", "lru"]


@dataclass(frozen=True, slots=True)
class SessionAdvice:
    session_id: str
    instance_id: str | None
    block_hashes: tuple[BlockHash, ...]
    retention: Retention
    # How long to keep the context resident, when retention is "keep".
    keep_seconds: float
    # P(the next request comes within the keep horizon / the lead time / the return horizon,
    # and lands on instance_id, where the context is): what a keep or prefetch there is worth.
    p_keep: float
    p_soon: float
    p_return: float
    prefetch: bool


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The planner's thresholds, set once (Settings: KVP_KEEP_HORIZON_SECONDS and the rest) and
    read by both the Advisor (keep, demote, prefetch) and the scheduler (lead, prefetch, cancel),
    so the two never disagree. The defaults are the settings' defaults."""

    keep_horizon_seconds: float = 300.0
    keep_min_p: float = 0.2
    demote_max_p: float = 0.1
    lead_seconds: float = 30.0
    prefetch_min_p: float = 0.5
    # Hysteresis: an open order survives a small dip in its chance (app/decide/scheduler.py).
    cancel_below_p: float = 0.25

    @classmethod
    def from_settings(cls, settings: object) -> Thresholds:
        """From anything carrying these names (app.core.config.Settings)."""
        return cls(**{name: getattr(settings, name) for name in cls.__slots__})

    def advisor_options(self) -> dict[str, float]:
        """The Advisor's keyword arguments."""
        return {
            "keep_horizon_seconds": self.keep_horizon_seconds,
            "keep_min_p": self.keep_min_p,
            "demote_max_p": self.demote_max_p,
            "lead_seconds": self.lead_seconds,
            "prefetch_min_p": self.prefetch_min_p,
        }


_DEFAULT = Thresholds()


class Advisor:
    def __init__(
        self,
        predictor: Predictor,
        *,
        keep_horizon_seconds: float = _DEFAULT.keep_horizon_seconds,
        keep_min_p: float = _DEFAULT.keep_min_p,
        demote_max_p: float = _DEFAULT.demote_max_p,
        lead_seconds: float = _DEFAULT.lead_seconds,
        prefetch_min_p: float = _DEFAULT.prefetch_min_p,
        return_horizon_seconds: float = RETURN_HORIZON_SECONDS,
        max_idle_seconds: float = MAX_IDLE_SECONDS,
        routes: SameInstanceEstimate | None = None,
    ) -> None:
        self.predictor = predictor
        # None: every return lands where the context is (a sticky router).
        self.routes = routes
        self.keep_horizon_seconds = keep_horizon_seconds
        self.keep_min_p = keep_min_p
        self.demote_max_p = demote_max_p
        self.lead_seconds = lead_seconds
        # Value of a prefetch = P(needed in time) x the stall it avoids; its cost is the bytes,
        # and the stall avoided grows with the bytes, so the test is on the probability alone.
        self.prefetch_min_p = prefetch_min_p
        self.max_idle_seconds = max_idle_seconds
        if not lead_seconds <= keep_horizon_seconds <= return_horizon_seconds:
            raise ValueError(
                "horizons must satisfy lead_seconds <= keep_horizon_seconds "
                "<= return_horizon_seconds"
            )
        # Only the horizons the advice reads: each one is a model row per session per tick.
        self.horizons = (lead_seconds, keep_horizon_seconds, return_horizon_seconds)

    def advise(self, sessions: Sequence[SessionView], now: float) -> list[SessionAdvice]:
        live = [
            s
            for s in sessions
            if s.state == "idle"
            and now - s.last_activity_ts <= self.max_idle_seconds
            and s.block_hashes
        ]
        if not live:
            return []
        p = np.maximum.accumulate(
            np.clip(self.predictor.p_within(live, now, self.horizons), 0.0, 1.0), axis=1
        )
        if self.routes is not None:
            p *= self.routes.p_same
        out = []
        for view, row in zip(live, p):
            p_soon, p_keep, p_return = float(row[0]), float(row[1]), float(row[2])
            retention: Retention = (
                "keep"
                if p_keep >= self.keep_min_p
                else "demote"
                if p_return <= self.demote_max_p
                else "lru"
            )
            out.append(
                SessionAdvice(
                    view.session_id,
                    view.instance_id,
                    tuple(view.block_hashes),
                    retention,
                    self.keep_horizon_seconds if retention == "keep" else 0.0,
                    p_keep,
                    p_soon,
                    p_return,
                    p_soon >= self.prefetch_min_p,
                )
            )
        return out
