"""From predictions to advice: which contexts to keep, which to let go, which to fetch early.

The advice is in the vocabulary the transfer layers already speak (LMCache, Mooncake Store,
Dynamo's block manager): *keep* a context resident for a time-to-live (a pin with TTL), *demote*
it (evict it first), or *prefetch* it to its instance. What no advice covers is left to the
tier's own LRU. That makes a model an improvement on LRU where it is confident and harmless
where it is not: ranking every context by the model alone lost to plain LRU in replay (see
docs/decisions.md, "Retention as advice on top of LRU").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from app.decide.popularity import PrefixPopularity
from app.decide.routing import SameInstanceEstimate
from app.predict.features import DeploymentSignals
from app.predict.predictors import Predictor
from app.predict.tool_durations import ToolDurations
from app.state.base import SessionView
from kvprefetch_client.events import BlockHash

# Sessions idle longer than this are not scored (unless a signal came): their contexts go by LRU.
MAX_IDLE_SECONDS = 1800.0
# "Does it come back at all?" is asked at this horizon; a later return counts as none.
RETURN_HORIZON_SECONDS = 900.0
# Where P(back within t) is also asked, to read it off at any t below the lead (linearly between
# these points): when a prefetch is needed by.
GRID_SECONDS = (2.0, 5.0, 15.0)
# A prefetch must land before this share of the returns it expects within the lead have come.
NEEDED_SHARE = 0.1

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
    # Leading blocks other sessions are using too (app/decide/popularity.py): a demotion leaves
    # them alone, as LRU would keep them.
    shared_blocks: int = 0
    # When a prefetch must have landed, in seconds from the advice (the lead's when unknown).
    needed_in_seconds: float | None = None
    # For a request already routed and waiting for a slot: no prediction (the ledger, which
    # judges predictions, leaves it out).
    queued: bool = False
    # P(a return lands on instance_id): the router's part of the chances above (routing.py).
    p_routed: float = 1.0

    @property
    def demotable_blocks(self) -> tuple[BlockHash, ...]:
        return self.block_hashes[self.shared_blocks :]

    @property
    def p_back_soon(self) -> float:
        """P(the next request comes within the lead, wherever it lands): what the prefetch bar
        and its cancelling judge. Where it lands prices the prefetch (`p_soon`), as it prices
        every other, so a router that spreads returns makes a prefetch worth less, not void."""
        return self.p_soon / self.p_routed if self.p_routed > 0.0 else 0.0


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The planner's thresholds, set once (Settings: KVP_KEEP_HORIZON_SECONDS and the rest) and
    read by both the Advisor (keep, demote, prefetch) and the scheduler (lead, prefetch, cancel),
    so the two never disagree. The defaults are the settings' defaults."""

    keep_horizon_seconds: float = 300.0
    keep_min_p: float = 0.2
    demote_max_p: float = 0.1
    lead_seconds: float = 30.0
    prefetch_min_p: float = 0.35
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
        popularity: PrefixPopularity | None = None,
        deployment: DeploymentSignals | None = None,
        tools: ToolDurations | None = None,
    ) -> None:
        self.predictor = predictor
        # The deployment's tool run times: a session whose tool call is in flight is back when
        # the call returns, which they say better than a model trained on other agents.
        self.tools = tools
        self.popularity = popularity
        # What this deployment's signals have been worth: a fresh signal's chance is at least
        # its kind's (decisions 22).
        self.deployment = deployment
        # None: every return lands where the context is (a sticky router).
        self.routes = routes
        self.keep_horizon_seconds = keep_horizon_seconds
        self.keep_min_p = keep_min_p
        self.demote_max_p = demote_max_p
        self.lead_seconds = lead_seconds
        # The bar for a prefetch into free room (its cost is link time alone). Into a full HBM
        # it is a swap, priced by whoever carries it out against the contexts it would displace
        # (app/decide/scheduler.py; sim/planned.py): docs/decisions.md, 21.
        self.prefetch_min_p = prefetch_min_p
        self.max_idle_seconds = max_idle_seconds
        if not lead_seconds <= keep_horizon_seconds <= return_horizon_seconds:
            raise ValueError(
                "horizons must satisfy lead_seconds <= keep_horizon_seconds "
                "<= return_horizon_seconds"
            )
        # Only the horizons the advice reads: each one is a model row per session per tick.
        self.horizons = (lead_seconds, keep_horizon_seconds, return_horizon_seconds)
        # ... and a few more, for the shape of the curve below the lead: when a prefetch is
        # needed by.
        self._grid = tuple(sorted({*(h for h in GRID_SECONDS if h < lead_seconds), *self.horizons}))
        self._times = (0.0, *self._grid)
        self._at = [self._grid.index(h) for h in self.horizons]
        self._lead_at = self._grid.index(lead_seconds)

    def advise(self, sessions: Sequence[SessionView], now: float) -> list[SessionAdvice]:
        """Advice for the idle sessions among `sessions` (from the model), and for the queued
        ones: a request routed and waiting for a slot is the surest signal there is."""
        live = [
            s
            for s in sessions
            if s.state == "idle"
            and s.block_hashes
            and (now - s.last_activity_ts <= self.max_idle_seconds or self._signalled(s, now))
        ]
        queued = [self._queued(s, now) for s in sessions if s.state == "queued" and s.block_hashes]
        if not live:
            return queued
        horizons = self._grid
        p = self.predictor.p_within(live, now, horizons)
        tooled = self.tool_outlooks([s.session_id for s in live], now)
        if tooled:
            p = np.array(p, dtype=np.float64)  # a copy: the predictor's own is left as it was
            for i, view in enumerate(live):
                if view.session_id in tooled:
                    p[i] = tooled[view.session_id]
        grid = np.maximum.accumulate(np.clip(p, 0.0, 1.0), axis=1)
        p_same = self.routes.p_same if self.routes is not None else 1.0
        # The bar a prefetch must clear, on the chance it is back wherever it lands; none when
        # the last instance is not where returns land most.
        bar = self.prefetch_bar(p_same)
        grid *= p_same
        out = []
        for view, curve in zip(live, grid):
            p_soon, p_keep, p_return = (float(curve[j]) for j in self._at)
            needed_in = self._needed_in(curve, p_soon)
            # A call in flight: its tool's curve already says what its signal does.
            floor = 0.0 if view.session_id in tooled else self._signal_floor(view, now) * p_same
            if floor > p_soon:  # the signal says more than the model read in it: fetch at once
                p_soon, needed_in = floor, 0.0
                # Back within the lead is back within the longer horizons too: a context already
                # resident is then kept (pinned), so it survives until the turn the signal
                # announces, as a landed prefetch is held.
                p_keep, p_return = max(p_keep, floor), max(p_return, floor)
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
                    p_soon >= bar,
                    self.shared_blocks(view.block_hashes, now),
                    needed_in,
                    p_routed=p_same,
                )
            )
        return out + queued

    def tool_outlooks(self, session_ids: Sequence[str], now: float) -> dict[str, list[float]]:
        """P(back within each of the grid's times) of the sessions among these whose tool calls
        are in flight, from the tools' run times (ToolDurations.outlooks); none without them."""
        if self.tools is None or not self.tools.sessions_in_flight:
            return {}
        return self.tools.outlooks(self._grid, now, session_ids)

    def prefetch_bar(self, p_same: float) -> float:
        """What `p_soon` (routed) must reach for a prefetch to the last instance:
        `prefetch_min_p` of the chance the session is back at all within the lead, so a router
        that spreads returns prices a prefetch lower (its value, `p_soon`) but does not rule it
        out; infinite when another instance is likelier to take the return."""
        if self.routes is not None and not self.routes.last_is_likeliest:
            return math.inf
        return self.prefetch_min_p * p_same

    def _queued(self, view: SessionView, now: float) -> SessionAdvice:
        return self.queued_advice(view.session_id, view.instance_id, tuple(view.block_hashes), now)

    def queued_advice(
        self,
        session_id: str,
        instance_id: str | None,
        block_hashes: tuple[BlockHash, ...],
        now: float,
    ) -> SessionAdvice:
        """A queued request's context, fetched to where it waits as soon as can be (what
        `lookahead` does in replay, CachedAttention's prefetch during the queueing): it is
        certain, so it outranks every idle context."""
        return SessionAdvice(
            session_id,
            instance_id,
            block_hashes,
            "lru",
            0.0,
            1.0,
            1.0,
            1.0,
            True,
            self.shared_blocks(block_hashes, now),
            0.0,
            queued=True,
        )

    def shared_blocks(self, block_hashes: Sequence[BlockHash], now: float) -> int:
        """How many leading blocks of a context other sessions share now (never demoted)."""
        if self.popularity is None:
            return 0
        return self.popularity.shared_prefix(block_hashes, now)

    def _signalled(self, view: SessionView, now: float) -> bool:
        """A signal this idle spell, within the lead: the session is scored however long it has
        been idle (a user reopening yesterday's chat)."""
        return any(
            s.ts >= view.last_activity_ts and now - s.ts <= self.lead_seconds for s in view.signals
        )

    def _signal_floor(self, view: SessionView, now: float) -> float:
        """P(back within the lead) at least as sure as this deployment's record for the kind of
        the session's latest signal this idle spell, when it is within the lead: the model was
        trained on a few signal settings and under-reads a kind far more reliable here than in
        them (with a signal before every turn, `opened` got a median chance of 0.5)."""
        if self.deployment is None or not view.signals:
            return 0.0
        latest = view.signals[-1]
        if latest.ts < view.last_activity_ts or now - latest.ts > self.lead_seconds:
            return 0.0
        return self.deployment.followed_lower_bound(latest.kind)

    def _needed_in(self, curve: np.ndarray, p_soon: float) -> float:
        """When a prefetch for the lead must have landed: by the time NEEDED_SHARE of the returns
        expected within the lead have come (read off the model's curve), so a signal that says
        "within seconds" starts one at once and a vague chance leaves time to spare."""
        if p_soon <= 0.0:
            return self.lead_seconds
        times = self._times[: self._lead_at + 2]
        return float(np.interp(NEEDED_SHARE * p_soon, (0.0, *curve[: self._lead_at + 1]), times))
