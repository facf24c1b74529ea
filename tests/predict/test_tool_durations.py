"""Per-tool run times (ToolDurations): quantiles, P(back within t | running for s), the tracked
tools bounded, runs matched and expired, and the same state online (the engine's ingest) and
offline (the event log replayed in time order)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from app.core.clock import ManualClock
from app.core.config import Settings
from app.deliver import InProcessSink
from app.engine import Engine
from app.predict.tool_durations import (
    BUCKET_BOUNDS_SECONDS,
    CANDIDATES_PER_TRACKED,
    MAX_RUNS_PER_SESSION,
    OTHER_TOOL,
    OUTLOOK_MIN_RUNS,
    RunTimes,
    ToolDurations,
)
from app.state import MemoryStore
from kvprefetch_client.events import Event, RequestRouted, SessionClosed, SessionSignal
from training.dataset import load_events

_n = iter(range(10**9))


def started(session: str, ts: float, tool: str | None = "bash") -> SessionSignal:
    return SessionSignal(
        event_id=f"g{next(_n)}", ts=ts, session_id=session, kind="tool_started", tool=tool
    )


def finished(session: str, ts: float, tool: str | None = "bash") -> SessionSignal:
    return SessionSignal(
        event_id=f"g{next(_n)}", ts=ts, session_id=session, kind="tool_finished", tool=tool
    )


def routed(session: str, ts: float) -> RequestRouted:
    n = next(_n)
    return RequestRouted(
        event_id=f"r{n}",
        ts=ts,
        session_id=session,
        request_id=f"q{n}",
        instance_id="gpu-0",
        prompt_tokens=10,
    )


def runs(tool: str, seconds: list[float], t0: float = 0.0) -> list[Event]:
    """One call of `tool` per entry, each in its own session, 1 s apart."""
    out: list[Event] = []
    for i, s in enumerate(seconds):
        session = f"{tool}-{next(_n)}"
        out += [started(session, t0 + i, tool), finished(session, t0 + i + s, tool)]
    return sorted(out, key=lambda e: e.ts)


# -- the distribution ---------------------------------------------------------------------------


def test_quantiles_are_the_runs_seen_within_a_bucket() -> None:
    same = RunTimes()
    for _ in range(20):
        same.add(5.0)
    assert (same.quantile(0.5), same.quantile(0.9), same.n) == (5.0, 5.0, 20)
    spread = RunTimes()
    for s in range(1, 101):
        spread.add(float(s))
    p50, p90 = spread.quantile(0.5), spread.quantile(0.9)
    assert p50 is not None and p90 is not None
    assert abs(p50 - 50) < 2.5 and abs(p90 - 90) < 4.5, (p50, p90)
    assert (spread.quantile(0.0), spread.quantile(1.0)) == (1.0, 100.0)
    assert RunTimes().quantile(0.5) is None and RunTimes().cdf(1.0) is None
    # Above the last bound: one bucket, up to the longest run.
    long = RunTimes()
    long.add(BUCKET_BOUNDS_SECONDS[-1] * 3)
    assert long.quantile(0.5) == BUCKET_BOUNDS_SECONDS[-1] * 3


def test_the_chance_of_a_return_is_conditioned_on_the_time_already_run() -> None:
    """Half the runs take 2 s, half 20 s: a call still running at 3 s is a 20 s one."""
    r = RunTimes()
    for _ in range(10):
        r.add(2.0)
        r.add(20.0)
    assert r.cdf(1.0) == 0.0 and r.cdf(3.0) == 0.5 and r.cdf(17.0) == 0.5 and r.cdf(20.0) == 1.0
    assert r.p_within(5.0, 0.0) == 0.5  # unconditioned: the 2 s half
    assert r.p_within(5.0, 3.0) == 0.0  # past 3 s, nothing returns before 17.8 s
    assert r.p_within(20.0, 3.0) == 1.0
    median = r.conditional_quantile(0.5, 3.0)
    assert median is not None and 17.0 < median <= 20.0
    # Past every run seen: nothing to say.
    assert r.p_within(1.0, 25.0) is None and r.conditional_quantile(0.5, 25.0) is None


def test_a_call_in_flight_is_predicted_back_at_its_start_plus_the_conditional_median() -> None:
    t = ToolDurations()
    t.observe(runs("bash", [2.0] * 10 + [20.0] * 10))
    t.observe([started("agent", 100.0)])
    (early,) = t.running(101.0, "agent")
    (late,) = t.running(104.0, "agent")
    assert (early.tool, early.label, early.started_at, early.running_seconds) == (
        "bash",
        "bash",
        100.0,
        1.0,
    )
    assert early.predicted_return_at is not None and late.predicted_return_at is not None
    assert early.predicted_return_at < 103.0 < 117.0 < late.predicted_return_at <= 120.0
    assert t.p_back_within("agent", 5.0, 104.0) == 0.0
    assert t.p_back_within("agent", 20.0, 104.0) == 1.0
    assert t.p_back_within("nobody", 5.0, 104.0) is None
    assert t.running(130.0, "agent")[0].predicted_return_at is None  # past every run


# -- matching and expiry ------------------------------------------------------------------------


def test_a_run_ends_at_its_finish_or_else_at_the_sessions_next_request() -> None:
    t = ToolDurations()
    t.observe(
        [
            started("a", 0.0, "search"),
            started("a", 1.0, "bash"),  # in parallel
            finished("a", 4.0, "bash"),  # names its tool: ends bash, not the older search
            started("b", 0.0, "search"),
            finished("b", 7.0, None),  # names none: the session's oldest
            started("c", 10.0, "bash"),
            routed("c", 9.0),  # before the start: not its end
            routed("a", 12.0),  # the next call: ends search
            routed("c", 16.0),
            finished("c", 17.0),  # nothing left to finish
        ]
    )
    assert t.in_flight == 0
    assert t.distribution("bash").state()[1:4] == (2, 3.0, 6.0)
    assert t.distribution("search").state()[1:4] == (2, 7.0, 12.0)
    assert t.expired == 0


def test_unmatched_starts_expire_and_are_counted_never_measured() -> None:
    t = ToolDurations(max_run_seconds=100.0, max_in_flight=3)
    t.observe([started("old", 0.0), started("closed", 1.0), started("s1", 50.0)])
    t.observe([SessionClosed(event_id="x", ts=60.0, session_id="closed")])
    assert (t.in_flight, t.expired) == (2, 1)
    t.observe([started("s2", 90.0), started("s3", 95.0)])  # a fourth: over max_in_flight
    assert [r.session_id for r in t.running(95.0)] == ["s1", "s2", "s3"]
    assert t.expired == 2
    t.observe([routed("x", 160.0)])  # 160 - 100 = 60: s1 (started at 50) expires
    assert [r.session_id for r in t.running(160.0)] == ["s2", "s3"]
    assert t.expired == 3
    t.observe([routed("x", 195.5)])  # 95.5: s2 (90) and s3 (95) too
    assert (t.in_flight, t.expired) == (0, 5)
    t.observe([started("late", 10.0)])  # older than the newest event time less the limit
    assert (t.in_flight, t.expired) == (0, 6)
    assert t.distribution("bash").n == 0  # nothing expired was measured


def test_a_session_keeps_a_bounded_number_of_calls_in_flight() -> None:
    t = ToolDurations()
    t.observe([started("a", float(i)) for i in range(MAX_RUNS_PER_SESSION + 3)])
    assert (t.in_flight, t.expired) == (MAX_RUNS_PER_SESSION, 3)
    assert t.running(100.0, "a")[0].started_at == 3.0


# -- the tracked tools --------------------------------------------------------------------------


def test_the_most_frequent_tools_are_tracked_and_the_rest_pooled() -> None:
    t = ToolDurations(tracked=2, recent_returns=4)
    t.observe(runs("a", [1.0] * 6) + runs("b", [2.0] * 2, t0=10.0))
    t.observe(runs("c", [3.0] * 2, t0=20.0))  # not 1.5 times b's calls: pooled
    assert t.labels() == ["a", "b", OTHER_TOOL]
    assert t.label("c") == OTHER_TOOL and t.distribution("c").n == 2
    t.observe(runs("c", [3.0], t0=30.0))  # 3 calls, 1.5 times b's 2: c takes b's place
    assert t.labels() == ["a", "c", OTHER_TOOL]
    # b's runs went to other; c starts afresh from the call that promoted it.
    assert (t.distribution("b").n, t.distribution("c").n) == (4 + 0, 1)
    summary = {s.tool: s for s in t.summaries()}
    assert set(summary) == {"a", "c", OTHER_TOOL}
    assert (summary["a"].calls, summary["a"].p50_seconds) == (6, 1.0)
    assert len(summary["a"].returns) == 4  # the last recent_returns
    assert summary[OTHER_TOOL].calls == 4
    # Never tracked: a tool named like the pool, and a start naming no tool.
    t.observe(runs(OTHER_TOOL, [1.0] * 10, t0=40.0))
    t.observe([started("anon", 60.0, None), finished("anon", 61.0, None)])
    assert t.labels() == ["a", "c", OTHER_TOOL] and t.distribution(None).n == 15


def test_a_flood_of_tool_names_stays_bounded() -> None:
    t = ToolDurations(tracked=3)
    t.observe(runs("steady", [1.0] * 50))
    for i in range(2000):
        t.observe(
            [started(f"s{i}", 100.0 + i, f"tool-{i}"), finished(f"s{i}", 100.5 + i, f"tool-{i}")]
        )
    assert len(t.labels()) == 4 and "steady" in t.labels()
    state = t.state()
    assert len(state["candidates"]) <= CANDIDATES_PER_TRACKED * 3
    assert len(state["times"]) == 4 and len(state["returns"]) == 4
    assert sum(s.calls for s in t.summaries()) == 2050


def test_nothing_is_tracked_with_tracked_zero() -> None:
    t = ToolDurations(tracked=0)
    t.observe(runs("a", [1.0] * 3))
    assert t.labels() == [OTHER_TOOL] and t.distribution("a").n == 3


@pytest.mark.parametrize(
    "kw", [{"tracked": -1}, {"max_run_seconds": 0.0}, {"max_in_flight": 0}, {"recent_returns": 0}]
)
def test_bad_bounds_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        ToolDurations(**kw)  # type: ignore[arg-type]


def test_the_return_hook_hears_each_run_with_its_label() -> None:
    heard: list[tuple[str, float]] = []
    t = ToolDurations(tracked=1, on_return=lambda label, s: heard.append((label, s)))
    t.observe(runs("a", [2.0, 3.0]) + runs("b", [4.0], t0=10.0))
    assert heard == [("a", 2.0), ("a", 3.0), (OTHER_TOOL, 4.0)]


# -- online and offline -------------------------------------------------------------------------


def agent_traffic(seed: int) -> list[Event]:
    """Agent sessions calling four tools of distinct run times, some in parallel, some never
    finished (the next request ends them), some abandoned (they expire), one session closed."""
    rng = random.Random(seed)
    mean = {"grep": 0.3, "bash": 4.0, "tests": 40.0, "browse": 8.0}
    weights = [8, 5, 2, 1]
    events: list[Event] = []
    for s in range(30):
        session, t = f"agent-{s}", 1000.0 + rng.uniform(0, 60)
        for _ in range(rng.randint(3, 8)):
            events.append(routed(session, t))
            t += rng.uniform(0.5, 3.0)
            tool = rng.choices(list(mean), weights)[0]
            run = rng.expovariate(1 / mean[tool])
            events.append(started(session, t, tool))
            if rng.random() < 0.2:
                events.append(started(session, t + 0.1, "grep"))  # a parallel call
            end = rng.random()
            if end < 0.7:
                events.append(finished(session, t + run, tool))
            elif end < 0.95:
                pass  # the framework posts no finish: the next request ends it
            else:
                break  # abandoned: it expires
            t += run + rng.uniform(0.1, 1.0)
        if s == 7:
            events.append(SessionClosed(event_id=f"close-{s}", ts=t + 1, session_id=session))
    events.append(routed("late-comer", 2500.0))  # moves event time past the abandoned ones
    events.append(started("late-comer", 2501.0, "tests"))  # still out at the end
    return sorted(events, key=lambda e: e.ts)


def test_the_engine_online_and_the_log_replayed_offline_keep_the_same_state(
    tmp_path: Path,
) -> None:
    events = agent_traffic(seed=3)
    settings = Settings(
        data_dir=tmp_path, log_fsync=False, tools_tracked=3, tool_max_run_seconds=600.0
    )
    engine = Engine(
        settings,
        store=MemoryStore(bytes_per_token=1024, block_tokens=512),
        clock=ManualClock(events[-1].ts),
        order_sink=InProcessSink(),
        recover=False,
        load_model=False,
    )
    try:
        for k in range(0, len(events), 7):
            assert not engine.ingest(events[k : k + 7]).rejected
        engine.drain()
        online = engine.tools.state()
        displaced = engine.tools.labels_version > 3  # three tracked, then one took a place
    finally:
        asyncio.run(engine.close())

    offline = ToolDurations(tracked=3, max_run_seconds=600.0)
    replayed = load_events(settings.event_log_dir)
    assert len(replayed) == len(events)
    offline.observe(replayed)
    assert offline.state() == online
    # Something of each was exercised: measured runs, a pool, calls still out and expired ones.
    assert len(online["frequency"]) == 3 and online["times"][OTHER_TOOL][1] > 0 and displaced
    assert online["expired"] > 0 and sum(v[1] for v in online["times"].values()) > 50
    assert [r[:3] for r in online["runs"]] == [("late-comer", "tests", 2501.0)]
    # Batching does not matter: one event at a time gives the same.
    single = ToolDurations(tracked=3, max_run_seconds=600.0)
    for e in events:
        single.observe([e])
    assert single.state() == online


# -- outlooks: when a session with calls in flight is back ---------------------------------------


def test_a_sessions_outlook_is_its_tools_conditional_chances_multiplied() -> None:
    """An agent calls the model once every parallel call returned: the chances multiply; the
    distributions are conditioned on the time each call has run; and the share of runs that
    never returned scales the curve."""
    tools = ToolDurations()
    tools.observe(runs("bash", [float(s) for s in range(1, 21)], t0=0.0))  # 1..20 s
    tools.observe(runs("grep", [float(s) for s in range(3, 15)], t0=0.0))  # 3..14 s
    tools.observe([started("a", 100.0), started("b", 100.0), started("b", 100.0, "grep")])
    times = (1.0, 5.0, 30.0)
    out = tools.outlooks(times, 104.0, ["a", "b", "idle"])
    assert out.keys() == {"a", "b"}  # no call in flight: no outlook
    bash = tools.distribution("bash")
    expected = [bash.p_within(t, 4.0) for t in times]
    assert out["a"] == pytest.approx(expected)
    grep = tools.distribution("grep")
    assert out["b"] == pytest.approx([e * grep.p_within(t, 4.0) for e, t in zip(expected, times)])
    assert out["a"][-1] == pytest.approx(1.0)  # every bash run seen ended within 24 s
    # One run in four never returned (the agent stopped): every chance scales by 3/4.
    tools.observe([started(f"gone{k}", 101.0, "ls") for k in range(11)])
    tools.observe(
        [SessionClosed(event_id=f"c{k}", ts=102.0, session_id=f"gone{k}") for k in range(11)]
    )
    assert tools.outlooks(times, 104.0, ["a"])["a"] == pytest.approx(
        [p * 32 / 43 for p in expected]
    )


def test_a_tool_with_few_runs_or_a_call_past_every_run_has_no_outlook() -> None:
    tools = ToolDurations()
    tools.observe(runs("bash", [2.0] * (OUTLOOK_MIN_RUNS - 1)))
    tools.observe([started("a", 100.0)])
    assert tools.outlooks((1.0,), 101.0, ["a"]) == {}  # too few runs to go by
    tools.observe(runs("bash", [2.0], t0=50.0))
    assert tools.outlooks((1.0,), 101.0, ["a"])["a"] == [pytest.approx(1.0)]
    assert tools.outlooks((1.0,), 103.0, ["a"]) == {}  # outlasted every run seen
