"""Early signals in a replay (sim/signals.py): the signal model, its events, the `signal` policy,
the `[signals]` table and `kvprefetch replay --signals`."""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from app.core.errors import ConfigError
from kvprefetch_cli import cli
from kvprefetch_client.events import SessionSignal
from sim.cluster import SimRequest
from sim.replay import EngineFeed, build_requests, replay, sim_engine
from sim.scenario import Scenario, load_scenario
from sim.signals import (
    FALSE_ALARM_QUIET_SECONDS,
    SignalSettings,
    generate_signals,
    parse_signal_overrides,
    with_signals,
)
from sim.traces import TraceRequest
from tests.conftest import TRACES
from tests.sim.test_cluster import TRACE_FILES, trace_prefix

PREFIX = 800  # requests of a trace in the replays here
NOT_COMPARED = {"wall_seconds"}


def signalled(scenario: Scenario, **settings: Any) -> Scenario:
    return scenario.model_copy(update={"signals": with_signals(scenario.signals, settings)})


@functools.cache
def requests_of(trace: str) -> tuple[SimRequest, ...]:
    return tuple(build_requests(trace_prefix(trace, None)))


def returning_turns(requests: tuple[SimRequest, ...]) -> dict[int, SimRequest]:
    """Each returning turn's previous request in its session, by the turn's index."""
    last: dict[str, SimRequest] = {}
    out: dict[int, SimRequest] = {}
    for r in requests:
        if r.session_id in last:
            out[r.index] = last[r.session_id]
        last[r.session_id] = r
    return out


def compared(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in NOT_COMPARED}


# -- the model ------------------------------------------------------------------------------------


def test_the_default_is_off() -> None:
    settings = load_scenario("default").signals
    assert settings == SignalSettings() and not settings.enabled
    assert generate_signals(requests_of(TRACE_FILES[0]), settings) == []


def test_generation_is_deterministic_given_the_seed() -> None:
    requests = requests_of(TRACE_FILES[0])
    settings = SignalSettings(coverage=0.5, false_alarms=1.0, seed=7)
    first = generate_signals(requests, settings)
    assert first and first == generate_signals(requests, settings)
    assert first != generate_signals(requests, settings.model_copy(update={"seed": 8}))
    # The false alarms come from a stream of their own: the true signals stay as they were.
    fewer = generate_signals(requests, settings.model_copy(update={"false_alarms": 0.0}))
    assert fewer == [s for s in first if s.true]


@pytest.mark.parametrize("trace", TRACE_FILES)
@pytest.mark.parametrize(("coverage", "false_alarms"), [(0.5, 1.0), (0.2, 2.5), (1.0, 0.0)])
def test_coverage_and_false_alarm_rates_are_as_set(
    trace: str, coverage: float, false_alarms: float
) -> None:
    requests = requests_of(trace)
    turns = returning_turns(requests)
    assert len(turns) > 1000
    signals = generate_signals(
        requests, SignalSettings(coverage=coverage, false_alarms=false_alarms)
    )
    true = [s for s in signals if s.true]
    false = [s for s in signals if not s.true]
    assert abs(len(true) / len(turns) - coverage) < 0.04
    # Stochastically rounded: within one of the rate times the true signals.
    assert abs(len(false) - false_alarms * len(true)) < 1
    assert [s.ts for s in signals] == sorted(s.ts for s in signals)


def test_a_true_signal_comes_before_its_turn_and_after_the_previous_one() -> None:
    requests = requests_of(TRACE_FILES[0])
    by_index = {r.index: r for r in requests}
    turns = returning_turns(requests)
    following = {prev.index: by_index[turn] for turn, prev in turns.items()}
    signals = [s for s in generate_signals(requests, SignalSettings(coverage=1.0)) if s.true]
    assert len(signals) == len(turns)
    capped = 0
    for s in signals:
        prev, turn = by_index[s.after], following[s.after]
        assert s.session_id == turn.session_id and s.latest == turn.arrival
        assert prev.arrival <= s.ts < turn.arrival or s.ts == turn.arrival == prev.arrival
        assert math.isclose(
            turn.arrival - s.ts, min(s.lead_seconds, turn.arrival - prev.arrival), abs_tol=1e-9
        )
        capped += s.lead_seconds > turn.arrival - prev.arrival
    assert capped > 0  # the cap was exercised
    # The leads as drawn: lognormal with the median set (5 s by default).
    assert 4.5 < statistics.median(s.lead_seconds for s in signals) < 5.5


def test_a_false_alarm_is_not_followed_by_its_session_within_ten_minutes() -> None:
    requests = requests_of(TRACE_FILES[0])
    arrivals: dict[str, list[float]] = {}
    for r in requests:
        arrivals.setdefault(r.session_id, []).append(r.arrival)
    by_index = {r.index: r for r in requests}
    signals = generate_signals(requests, SignalSettings(coverage=0.5, false_alarms=1.0))
    false = [s for s in signals if not s.true]
    assert len(false) > 500
    for s in false:
        assert by_index[s.after].arrival <= s.ts <= s.latest
        assert not any(s.ts < t <= s.ts + FALSE_ALARM_QUIET_SECONDS for t in arrivals[s.session_id])
    kinds = [s.kind for s in false]
    assert kinds.count("opened") > 0.8 * len(kinds)  # mostly `opened`, by default


def test_kinds_are_drawn_by_weight() -> None:
    requests = requests_of(TRACE_FILES[0])
    settings = SignalSettings(coverage=1.0, kinds={"tool_finished": 1.0, "queued": 0.0})
    assert {s.kind for s in generate_signals(requests, settings)} == {"tool_finished"}


# -- in a replay ----------------------------------------------------------------------------------


@functools.cache
def run(
    policy: str, settings: tuple[tuple[str, float], ...] = (), keep_events: bool = False
) -> Any:
    scenario = load_scenario("default")
    if settings:
        scenario = signalled(scenario, **dict(settings))
    return replay(
        trace_prefix(TRACE_FILES[0], PREFIX), scenario, policy=policy, keep_events=keep_events
    )


ON = (("coverage", 1.0), ("false_alarms", 1.0))


def test_signals_are_emitted_only_after_the_previous_turn_finished() -> None:
    result = run("none", ON, keep_events=True)
    s = result.summary
    assert s["signals_emitted"] > 100
    assert s["signals_emitted"] + s["signals_dropped"] <= s["signals_true"] + s["signals_false"]
    routed: dict[str, str] = {}  # session -> its latest request
    finished: set[str] = set()
    seen = 0
    for e in result.events:
        if e.type == "request_routed":
            routed[e.session_id] = e.request_id
        elif e.type == "request_finished":
            finished.add(e.request_id)
        elif e.type == "session_signal":
            seen += 1
            assert routed[e.session_id] in finished, e
            assert e.kind in ("typing", "opened")
    assert seen == s["signals_emitted"]


def test_the_engine_takes_the_signals() -> None:
    scenario = signalled(load_scenario("default"), coverage=1.0)
    feed = EngineFeed(sim_engine(scenario, load_model=False), keep_events=True)
    result = replay(trace_prefix(TRACE_FILES[0], PREFIX), scenario, engine=feed)
    ids = [e.event_id for e in result.events if e.type == "session_signal"]
    assert len(ids) == result.summary["signals_emitted"] > 0
    assert all(feed.store.seen(ids))  # ingested: validated, deduplicated, applied
    # One more, straight through the engine's ingest: accepted.
    now = feed.clock.now()
    event = SessionSignal(event_id="extra", ts=now, session_id="s0", kind="typing")
    assert feed.engine.ingest([event]).accepted == ["extra"]


def test_signals_off_leave_a_replay_unchanged(tmp_path: Path) -> None:
    # An explicit [signals] table of the defaults: the same summary as no table at all.
    text = (Path(__file__).parents[2] / "data/scenarios/default.toml").read_text()
    path = tmp_path / "default-signals.toml"
    path.write_text(
        text + "\n[signals]\ncoverage = 0.0\nlead_median_seconds = 5.0\nfalse_alarms = 0.0\n"
    )
    explicit = load_scenario(path).model_copy(update={"name": "default"})
    assert explicit.signals == SignalSettings()
    trace = trace_prefix(TRACE_FILES[0], 300)
    for policy in ("none", "oracle"):
        plain = replay(trace, load_scenario("default"), policy=policy, keep_events=True)
        table = replay(trace, explicit, policy=policy, keep_events=True)
        assert compared(plain.summary) == compared(table.summary)
        assert [e.type for e in plain.events] == [e.type for e in table.events]
        assert "signals_emitted" not in plain.summary


def test_signals_change_nothing_for_a_policy_that_ignores_them() -> None:
    off, on = run("none").summary, run("none", ON).summary
    assert on["signals_emitted"] > 0
    assert compared(off) == {k: v for k, v in compared(on).items() if not k.startswith("signals")}


def test_the_signal_policy_is_lru_without_signals() -> None:
    none, signal = run("none").summary, run("signal").summary
    assert signal["bytes_prefetched"] == 0
    assert {**compared(signal), "policy": "none"} == compared(none)


def test_the_signal_policy_prefetches_on_signals() -> None:
    s = run("signal", ON).summary
    assert s["bytes_prefetched"] > 0 and s["signals_emitted"] > 0


def test_the_cluster_invariants_hold_with_signals() -> None:
    """Signal prefetches into a full HBM (tight-hbm), with false alarms: the checked cluster's
    pin account and capacity hold after every event."""
    from unittest import mock

    import sim.replay
    from tests.sim.test_cluster import CheckedCluster

    scenario = signalled(load_scenario("tight-hbm"), coverage=1.0, false_alarms=2.0)
    with mock.patch.object(sim.replay, "Cluster", CheckedCluster):
        result = replay(trace_prefix(TRACE_FILES[0], 1000), scenario, policy="signal")
    cluster = CheckedCluster.last  # type: ignore[attr-defined]
    assert cluster.events_checked > 0 and cluster.evicted > 0
    assert result.summary["bytes_prefetched"] > 0 and result.summary["signals_emitted"] > 0


def test_a_signal_brings_an_evicted_context_back_before_its_turn() -> None:
    """One instance with room for six blocks: a session's three blocks are evicted by 40 others'
    requests; a signal 5 s before its return fetches them back, so the return hits."""
    block = 512
    trace = [TraceRequest(0, 0.0, 3 * block, 1, (1, 2, 3))]
    trace += [
        TraceRequest(i, float(i), 3 * block, 1, (1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i))
        for i in range(1, 41)
    ]
    trace.append(TraceRequest(41, 100.0, 4 * block, 1, (1, 2, 3, 4)))
    base = load_scenario("default")
    scenario = base.model_copy(
        update={"instances": 1, "hbm_kv_bytes": 6 * base.block_bytes, "max_running_requests": 1}
    )
    scenario = signalled(scenario, coverage=1.0, lead_sigma=0.0)
    none = replay(trace, scenario, policy="none")
    signal = replay(trace, scenario, policy="signal", keep_events=True)
    assert none.requests[-1].hit_blocks == 0
    assert signal.requests[-1].hit_blocks == 3
    assert signal.summary["bytes_prefetched"] == 3 * base.block_bytes
    assert signal.summary["bytes_prefetched_unused"] == 0
    (event,) = [e for e in signal.events if e.type == "session_signal"]
    assert event.ts == 95.0 and event.session_id == signal.requests[-1].session_id


def test_a_held_signal_past_its_turn_is_dropped() -> None:
    """A signal due before the previous turn finished waits for it; when that is past the next
    turn's arrival, it is dropped, not emitted late."""
    trace = [
        TraceRequest(0, 0.0, 512, 1000, (1,)),  # 30 s of decode
        *[TraceRequest(i, 0.5 * i, 512, 1, (100 + i,)) for i in range(1, 41)],
        TraceRequest(41, 10.0, 1024, 1, (1, 2)),  # arrives while the first still runs
        TraceRequest(42, 100.0, 512, 1, (999,)),  # the replay goes on past the first's finish
    ]
    scenario = signalled(load_scenario("default"), coverage=1.0, lead_sigma=0.0)
    result = replay(trace, scenario, policy="signal", keep_events=True)
    assert result.summary["signals_true"] == 1
    assert (result.summary["signals_emitted"], result.summary["signals_dropped"]) == (0, 1)
    assert not [e for e in result.events if e.type == "session_signal"]


# -- settings -------------------------------------------------------------------------------------


def test_overrides_parse_with_short_and_full_names() -> None:
    assert parse_signal_overrides("coverage=0.5, lead_median=5,false_alarms=1") == {
        "coverage": 0.5,
        "lead_median_seconds": 5.0,
        "false_alarms": 1.0,
    }
    assert parse_signal_overrides("lead_median_seconds=2,lead_sigma=0.5,seed=3") == {
        "lead_median_seconds": 2.0,
        "lead_sigma": 0.5,
        "seed": 3,
    }
    settings = with_signals(SignalSettings(kinds={"opened": 1.0}), {"coverage": 0.25})
    assert (settings.coverage, settings.kinds) == (0.25, {"opened": 1.0})  # the rest kept


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cov=1", "unknown setting 'cov'; known: coverage, lead_median, lead_sigma"),
        ("coverage=x", "coverage: 'x' is not a number"),
        ("seed=1.5", "seed: '1.5' is not an integer"),
        ("coverage", "'coverage': write NAME=VALUE"),
        ("", "no settings given"),
    ],
)
def test_bad_overrides_name_the_setting(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_signal_overrides(text)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"coverage": 2.0}, "coverage: Input should be less than or equal to 1"),
        ({"coverage": math.nan}, "coverage: Input should be a finite number"),
        ({"lead_median_seconds": 0.0}, "lead_median: Input should be greater than 0"),
        ({"false_alarms": -1.0}, "false_alarms: Input should be greater than or equal to 0"),
    ],
)
def test_out_of_range_values_name_the_setting(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        with_signals(SignalSettings(), overrides)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("coverage = 1.5", "signals.coverage: Input should be less than or equal to 1"),
        ("covrage = 0.5", "signals.covrage: Extra inputs are not permitted"),
        ("kinds = {Opened = 1.0}", "signals.kinds: Value error, kind 'Opened'"),
        ("kinds = {opened = 0.0}", "signals.kinds: Value error, the weights sum to 0"),
    ],
)
def test_a_bad_signals_table_fails_naming_the_field(
    tmp_path: Path, table: str, message: str
) -> None:
    text = (Path(__file__).parents[2] / "data/scenarios/default.toml").read_text()
    path = tmp_path / "bad.toml"
    path.write_text(text + f"\n[signals]\n{table}\n")
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert message.replace("Value error, ", "") in str(info.value)


# -- the command line -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("traces") / "small.jsonl"
    with open(TRACES / TRACE_FILES[0]) as f:
        path.write_text("".join(next(f) for _ in range(PREFIX)))
    return path


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["replay", *args])


def flat(text: str) -> str:
    return re.sub(r"[\s│╭╮╰╯─]+", "", text)


def test_the_signals_option_overrides_the_scenario(small_trace: Path) -> None:
    result = invoke(
        "--trace",
        str(small_trace),
        "--compare",
        "none,signal",
        "--signals",
        "coverage=1,lead_median=5,false_alarms=1",
        "--json",
    )
    assert result.exit_code == 0, result.output
    none, signal = json.loads(result.stdout)["compare"]
    assert none["signals"]["coverage"] == 1.0 and none["signals"]["false_alarms"] == 1.0
    # The same signals for both policies, and what they are in process.
    direct = run("signal", ON).summary
    for key in ("signals_true", "signals_false", "bytes_prefetched", "byte_hit_rate"):
        assert signal[key] == direct[key], key
    assert none["signals_true"] == signal["signals_true"] > 0
    assert signal["bytes_prefetched"] > 0 == none["bytes_prefetched"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("cov=1", "Invalid value for '--signals': unknown setting 'cov'"),
        ("coverage=x", "Invalid value for '--signals': coverage: 'x' is not a number"),
        ("coverage=2", "Invalid value for '--signals': coverage: Input should be less than"),
    ],
)
def test_a_bad_signals_option_fails_clearly(small_trace: Path, value: str, message: str) -> None:
    result = invoke("--trace", str(small_trace), "--signals", value, "--json")
    assert result.exit_code == 2 and result.stdout == ""
    assert flat(message) in flat(result.stderr), result.stderr


@pytest.mark.slow
def test_over_http_the_signals_reach_the_service(tmp_path: Path) -> None:
    """`--via`: the signals are posted with the run's other events, and the replay gives what it
    gives in process."""
    from app.api.main import create_app
    from app.core.config import Settings
    from sim.remote import replay_via
    from tests.conftest import live_server

    scenario = signalled(load_scenario("default"), coverage=1.0, false_alarms=1.0)
    trace = trace_prefix(TRACE_FILES[0], 300)
    local = replay(trace, scenario, policy="signal")
    settings = Settings(
        data_dir=tmp_path,
        store="memory",
        log_fsync=False,
        bytes_per_token=scenario.bytes_per_token,
        block_tokens=scenario.block_tokens,
        replica_id="test-signals",
    )
    with live_server(create_app(settings)) as url:
        remote = replay_via(url, trace, scenario, policy="signal", keep_events=True)
    assert remote.summary["signals_emitted"] > 0
    sent = [e for e in remote.events if e.type == "session_signal"]
    assert len(sent) == remote.summary["signals_emitted"]
    assert remote.summary["events_posted"] == len(remote.events)
    ignored = {"wall_seconds", "via", "run_id", "events_posted"}
    assert {k: v for k, v in remote.summary.items() if k not in ignored} == compared(local.summary)


def test_over_http_a_signal_is_namespaced_and_read_back_in_trace_time() -> None:
    """RemoteService posts a signal under the run's ids, and a session view's signals come back
    with them taken off and (paced) in the trace's time."""
    import httpx

    from sim.remote import RemoteService
    from tests.sim.test_remote import FakeService

    service = FakeService()
    engine = RemoteService(
        "http://kvp.test", run_id="sig", speed=10.0, transport=httpx.MockTransport(service)
    )
    engine.emit("session_signal", 50.0, {"session_id": "s", "kind": "typing"})
    engine._sync()
    (posted,) = service.events
    assert (posted["type"], posted["session_id"], posted["kind"]) == (
        "session_signal",
        "sig:s",
        "typing",
    )
    wall0 = posted["ts"]
    service.view = {
        "session_id": "sig:s",
        "state": "idle",
        "turns": 1,
        "first_seen_ts": wall0,
        "last_activity_ts": wall0,
        "closed_ts": None,
        "instance_id": None,
        "context_tokens": 0,
        "context_bytes": 0,
        "block_hashes": [],
        "block_tokens": 512,
        "recent_arrivals_ts": [],
        "inter_turn_gaps_seconds": [],
        "last_request": None,
        "resident_blocks": {},
        "signals": [{"ts": wall0 + 2.0, "kind": "queued", "instance_id": "sig:gpu-1"}],
        "signals_total": 1,
    }
    view = engine.session("s")
    engine.close()
    assert view is not None and view.signals_total == 1
    (signal,) = view.signals
    assert signal.ts == pytest.approx(70.0)
    assert (signal.kind, signal.instance_id) == ("queued", "gpu-1")


def test_the_planners_policies_advise_a_signalled_idle_session_at_once() -> None:
    from sim.planned import PlannedPolicy
    from sim.replay import sim_engine
    from tests.decide.test_advisor import view
    from tests.sim.test_cluster import scenario

    views = {"long": view("long", last=-5000.0), "running": view("running", state="running")}
    engine = sim_engine(scenario(prefill=100.0), load_model=False)
    policy = PlannedPolicy(engine, views.get, "heuristic")
    acted: list[tuple[list[str], float]] = []
    policy._act = lambda ids, now: acted.append((ids, now))  # type: ignore[method-assign]
    policy._idle = {"idle"}
    policy.on_signal("idle", "typing", 5.0)
    policy.on_signal("running", "typing", 6.0)  # not idle: its finish will advise it
    # Idle for longer than the ticks look at (left the idle set): a signal brings it back.
    policy.on_signal("long", "opened", 7.0)
    assert acted == [(["idle"], 5.0), (["long"], 7.0)]
