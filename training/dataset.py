"""Training rows from event logs, computed by the service's own state and feature code.

Each log is replayed, in event-time order, through a fresh MemoryStore (the service's embedded
store). At every *decision point* the features are read with app.predict.features from the
store's SessionView, as the service reads them from live state. Decision points: when a request
finishes, and again while the session stays idle (CHECKPOINTS after the finish), because the
chance of a return changes as the silence grows; and when a session_signal comes, and a few
seconds after it (SIGNAL_CHECKPOINTS), because a signal's worth is in its first seconds.

The deployment's signals (DeploymentSignals) and its tool run times (ToolDurations, built from the
same KVP_TOOLS_* settings as the service's) are told each accepted event in the same order as the
service's ingest tells them, so the deployment and tool features are the service's too.

The label of a row is whether the session's next request arrives within the row's horizon. A row
whose horizon reaches past the end of its log is dropped (its answer is unknown: censored).
"""

from __future__ import annotations

import bisect
import gc
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from app.core.config import Settings
from app.core.errors import EventLogError
from app.ingest.eventlog import read_events
from app.predict.features import (
    FEATURES,
    HORIZON_FEATURE,
    NAN,
    SIGNAL_FOLLOW_SECONDS,
    DeploymentSignals,
    session_features,
    tool_features,
)
from app.predict.tool_durations import TOOL_FEATURES, ToolDurations, tool_durations_for
from app.state import MemoryStore, SessionView
from kvprefetch_client.events import (
    RECORD_EVENT_TYPES,
    Event,
    RequestFinished,
    RequestRouted,
    SessionSignal,
)
from training.lineage import log_record

# Seconds after a finish at which the question is asked again while the session is idle. They
# span the whole range over which the service scores idle sessions (up to MAX_IDLE_SECONDS), or a
# model would be asked about silences it never saw.
CHECKPOINTS: tuple[float, ...] = (0.0, 20.0, 60.0, 150.0, 300.0, 600.0, 1200.0)
# Seconds after a signal at which it is asked again (the service scores every second or so).
SIGNAL_CHECKPOINTS: tuple[float, ...] = (0.0, 2.0, 5.0, 15.0)
# The horizons a row asks about. The model takes the horizon as a feature, so the service can
# ask about any horizon in between.
# Training also at the planner's own 30/300/900 s calibrates those answers better (training/
# DESIGN.md, `classifier+`) but did not keep more bytes in replay on a window inside the training
# part (docs/decisions.md, 10), so the bundled model keeps these.
HORIZONS: tuple[float, ...] = (15.0, 60.0, 180.0, 600.0)

# A replay reports its progress at most this many times per log: a bar needs no finer steps.
REPORTS_PER_LOG = 200
# progress(task, done, total): total is None while unknown (training/progress.py draws it).
Progress = Callable[[str, int, "int | None"], None]
# tools_at(session_id, ts, horizons): a session's TOOL_FEATURES after the log's events up to ts.
ToolsAt = Callable[[str, float, Sequence[float]], list[list[float]]]

META_COLUMNS = (
    "log",
    "session_id",
    "decision_ts",
    "time_fraction",
    "checkpoint_seconds",
    # What the decision point follows: "finish", or "signal:<kind>".
    "anchor",
    "time_to_next_seconds",
    "instance_id",
    "next_instance_id",
    "label",
)


def load_events(path: Path) -> list[Event]:
    """A log's events, each event id once, in event-time order (file order breaks ties). The
    service's records of itself (RECORD_EVENT_TYPES: a model change) are no traffic: left out,
    so their service-clock stamps never widen the span a time split cuts."""
    seen: set[str] = set()
    events = []
    for e in read_events([path]):
        if e.type in RECORD_EVENT_TYPES:
            continue
        if e.event_id not in seen:
            seen.add(e.event_id)
            events.append(e)
    if not events:
        raise EventLogError(f"{path}: the log holds no events")
    events.sort(key=lambda e: e.ts)
    return events


def rows_from_events(
    events: Sequence[Event],
    *,
    log_name: str,
    bytes_per_token: int = 327_680,
    block_tokens: int = 512,
    checkpoints: Sequence[float] = CHECKPOINTS,
    signal_checkpoints: Sequence[float] = SIGNAL_CHECKPOINTS,
    horizons: Sequence[float] = HORIZONS,
    applied: Callable[[int], None] | None = None,
    span: tuple[float, float] | None = None,
    deployment_at: Callable[[float], list[float]] | None = None,
    tools: ToolDurations | None = None,
    tools_at: ToolsAt | None = None,
) -> pd.DataFrame:
    """`applied(n)`, when given, hears now and then how many events the replay has applied.
    `tools`: a fresh ToolDurations to feed (default: of the KVP_TOOLS_* settings, as the
    service's).

    A shard of a log (training/fleet.py: some sessions' events only) gives the whole log's
    `span` (first, last event ts: the time fractions and the censoring), `deployment_at(ts)`,
    the whole log's DEPLOYMENT_FEATURES after its events up to ts, and `tools_at`, its
    TOOL_FEATURES (a shard's are not the deployment's: its tools' runs are everyone's)."""
    arrivals: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for e in events:
        if isinstance(e, RequestRouted):
            arrivals[e.session_id].append((e.ts, e.instance_id))
    for a in arrivals.values():
        a.sort()
    arrival_times = {session_id: [t for t, _ in a] for session_id, a in arrivals.items()}
    start, end = span if span is not None else (events[0].ts, events[-1].ts)

    # (decision ts, anchor ts, session, checkpoint, anchor): the anchor is a finish or a signal.
    decisions: list[tuple[float, float, str, float, str]] = []
    for e in events:
        if isinstance(e, RequestFinished):
            for c in checkpoints:
                decisions.append((e.ts + c, e.ts, e.session_id, c, "finish"))
        elif isinstance(e, SessionSignal):
            for c in signal_checkpoints:
                decisions.append((e.ts + c, e.ts, e.session_id, c, f"signal:{e.kind}"))
    decisions.sort()

    store = MemoryStore(
        bytes_per_token=bytes_per_token, block_tokens=block_tokens, dedupe_max_ids=len(events) + 1
    )
    deployment = DeploymentSignals()
    if tools is None and tools_at is None:
        tools = tool_durations_for(Settings())
    report_every = max(len(events) // REPORTS_PER_LOG, 1)
    # The features as doubles, row after row (no list a row: a shard has a million rows), and
    # each meta column's values.
    feats = array("d")
    meta: list[list[Any]] = [[] for _ in META_COLUMNS]
    (
        col_log,
        col_session,
        col_decision,
        col_fraction,
        col_checkpoint,
        col_anchor,
        col_next,
        col_instance,
        col_next_instance,
        col_label,
    ) = meta
    # Each session's view as of its last event: the store keeps every session (no retention),
    # and a session's record changes only with events of its own (_VIEW_ONLY_OWN_TYPES), so
    # the view of its finish serves its later checkpoints until its next event. A view
    # without the resident blocks (a walk over every location): no feature reads them.
    views: dict[str, SessionView | None] = {}
    no_tools = [[NAN] * len(TOOL_FEATURES) for _ in horizons]
    i = 0
    with gc_paused():
        for decision_ts, anchor_ts, session_id, checkpoint, anchor in decisions:
            if decision_ts > end:
                break
            while i < len(events) and events[i].ts <= decision_ts:
                e = events[i]
                accepted = store.apply([e])[0]
                if accepted:  # the ingest tells them accepted events only
                    if deployment_at is None:
                        deployment.observe([e])
                    if tools is not None and tools_at is None:
                        tools.observe([e])
                    if e.type in _VIEW_ONLY_OWN_TYPES:
                        views.pop(getattr(e, "session_id", None) or "", None)
                    else:
                        views.clear()
                i += 1
                if applied is not None and i % report_every == 0:
                    applied(i)
            times = arrival_times.get(session_id, [])
            # Asked only while idle since that finish (or signal): a request after it starts a
            # new story.
            if (
                times
                and times[-1] > anchor_ts
                and bisect.bisect_right(times, anchor_ts) < bisect.bisect_right(times, decision_ts)
            ):
                continue
            if session_id in views:
                view = views[session_id]
            else:
                view = views[session_id] = store.sessions([session_id], resident=False)[0]
            if view is None or view.state == "closed":
                continue
            k = bisect.bisect_right(times, decision_ts)
            time_to_next = times[k] - decision_ts if k < len(times) else float("inf")
            next_instance = arrivals[session_id][k][1] if k < len(times) else None
            deployment_now = (
                deployment.features() if deployment_at is None else deployment_at(decision_ts)
            )
            base = [*session_features(view, decision_ts), *deployment_now]
            if tools_at is not None:
                by_horizon = tools_at(session_id, decision_ts, horizons)
            elif tools is None or tools.sessions_in_flight:
                by_horizon = tool_features(tools, session_id, decision_ts, horizons)
            else:
                by_horizon = no_tools  # what tool_features says without a call in flight
            # Censored: a horizon past the log's end (its answer is unknown).
            kept = [(h, tool) for h, tool in zip(horizons, by_horizon) if decision_ts + h <= end]
            for h, tool in kept:
                feats.extend(base)
                feats.extend(tool)
                feats.append(float(h))
            n = len(kept)
            col_log.extend([log_name] * n)
            col_session.extend([session_id] * n)
            col_decision.extend([decision_ts] * n)
            col_fraction.extend(horizon_fraction(decision_ts, start, end, h) for h, _ in kept)
            col_checkpoint.extend([checkpoint] * n)
            col_anchor.extend([anchor] * n)
            col_next.extend([time_to_next] * n)
            col_instance.extend([view.instance_id] * n)
            col_next_instance.extend([next_instance] * n)
            col_label.extend(int(time_to_next <= h) for h, _ in kept)
    values = np.frombuffer(feats, dtype=np.float64) if len(feats) else np.zeros(0)
    frame = pd.DataFrame(values.reshape(len(col_log), len(FEATURES)), columns=list(FEATURES))
    for name, column in zip(META_COLUMNS, meta):
        frame[name] = column
    return frame


# Events that change no session's record but their own session's (app/state/memory.py: the
# request events, a close, a signal, blocks stored with a session; events without a session
# change none). Any other (a vLLM batch carries several sessions) drops every view held.
_VIEW_ONLY_OWN_TYPES = frozenset(
    {
        "request_routed",
        "request_started",
        "request_finished",
        "session_closed",
        "session_signal",
        "kv_blocks_stored",
        "kv_blocks_removed",
        "kv_blocks_cleared",
        "instance_status",
        "order_progress",
    }
)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off for a replay: it makes millions of objects that live to its
    end and no cycles, and the collector rescanned them over and over (a quarter of a shard's
    CPU seconds, bench/README.md)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def horizon_fraction(decision_ts: float, start: float, end: float, horizon_seconds: float) -> float:
    """Where a row lies in the part of its log's time span its horizon can be asked in (up to the
    log's end less the horizon: later rows are censored). Against the whole span, the last 20%
    of a 40-minute log would hold no 600 s row, and the model would be stopped, calibrated and
    judged without its longest horizon; this way each horizon's last share validates."""
    return (decision_ts - start) / max(end - horizon_seconds - start, 1e-9)


def signal_follow_through(events: Sequence[Event]) -> dict[str, dict[str, int]]:
    """Per signal kind: how many signals the events hold, and how many were followed by a request
    of their session within SIGNAL_FOLLOW_SECONDS (what the model card reports)."""
    arrivals: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if isinstance(e, RequestRouted):
            arrivals[e.session_id].append(e.ts)
    for times in arrivals.values():
        times.sort()
    out: dict[str, dict[str, int]] = {}
    for e in events:
        if isinstance(e, SessionSignal):
            times = arrivals.get(e.session_id, [])
            k = bisect.bisect_right(times, e.ts)
            followed = k < len(times) and times[k] - e.ts <= SIGNAL_FOLLOW_SECONDS
            kind = out.setdefault(e.kind, {"signals": 0, "followed": 0})
            kind["signals"] += 1
            kind["followed"] += int(followed)
    return out


def build_dataset(
    logs: Iterable[Path | str], progress: Progress | None = None, **kwargs: object
) -> pd.DataFrame:
    """Training rows from one or more event logs (files or log directories), each replayed alone.

    Columns: app.predict.features.FEATURES, then META_COLUMNS (`label` is the target,
    `time_fraction` the row's position in its log's time span, less its horizon at the end
    (`horizon_fraction`), for splitting by time).
    `progress(task, done, total)`, when given, hears how far each log's replay has got.
    """
    frames = []
    signals: dict[str, dict[str, int]] = {}
    records = []
    for log in logs:
        path = Path(log)
        task = f"replaying {path.name}"
        if progress is not None:
            progress(task, 0, None)  # reading: the event count is not known yet
        events = load_events(path)
        report = (
            (lambda done, task=task, total=len(events): progress(task, done, total))
            if progress
            else None
        )
        frames.append(
            rows_from_events(
                events,
                log_name=path.name,
                applied=report,
                **kwargs,  # type: ignore[arg-type]
            )
        )
        records.append(log_record(path, len(events), events[0].ts, events[-1].ts))
        for kind, counts in signal_follow_through(events).items():
            total = signals.setdefault(kind, {"signals": 0, "followed": 0})
            total["signals"] += counts["signals"]
            total["followed"] += counts["followed"]
        if progress is not None:
            progress(task, len(events), len(events))
    if not frames:
        raise ValueError("no event logs given")
    data = pd.concat(frames, ignore_index=True)
    if data.empty:
        raise EventLogError("the logs hold no finished request to learn from")
    # Carried to the model card by training.train (DataFrame.attrs: metadata, not a column).
    data.attrs["signals"] = signals
    # Each log's path, hash and span, for the card's lineage (training/lineage.py).
    data.attrs["logs"] = records
    return data


__all__ = [
    "CHECKPOINTS",
    "HORIZONS",
    "HORIZON_FEATURE",
    "META_COLUMNS",
    "SIGNAL_CHECKPOINTS",
    "build_dataset",
    "gc_paused",
    "horizon_fraction",
    "load_events",
    "rows_from_events",
    "signal_follow_through",
]
