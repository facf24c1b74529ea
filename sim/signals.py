"""Early signals for a replay: `session_signal` events drawn from a trace by a signal model.

Traces carry no signals (a user reopening a chat, typing, a tool finishing), so a replay makes
them up from what the trace says about which turn returns when. This is an assumption, a model
of signals, not data: its settings (the scenario's `[signals]` table, `--signals` on
`kvprefetch replay`) say how many returning turns a signal precedes, how early, and how many
signals are false alarms.

- **True signals.** Each returning turn (a request whose session had an earlier one) is preceded
  by one signal with probability `coverage`. Its lead before the request is lognormal, median
  `lead_median_seconds`, shape `lead_sigma`; it is capped so that the signal comes no earlier than
  the session's previous request's arrival here, and no earlier than that request's finish in
  the replay (the cluster holds it until then: sim/cluster.py). A signal that would come only
  after its request arrived is dropped.
- **False alarms.** `false_alarms` per true signal (stochastically rounded), each on an idle
  spell that is not followed by a request of its session within `FALSE_ALARM_QUIET_SECONDS`:
  a spell is picked uniformly among those, and a time uniformly within it (from the spell's
  request's arrival to 10 minutes before the session's next request, or the trace's last
  arrival when it has none). Like true signals, one is held until its spell's request finished,
  and dropped if that leaves it less than 10 minutes before the next request.
- **Kinds.** True signals draw their kind from `kinds` and false alarms from `false_alarm_kinds`
  (weights): by default a chat's `typing` and `opened`, false alarms mostly `opened` (a user who
  opens the chat and leaves).

- **Tool signals** (`tools`, an agent trace's calls that carry the `tool` whose result they
  bring): for that share of sessions, as an instrumented agent framework would post them,
  `tool_started` with the tool's name when the call before finishes (the tool starts; held until
  that call finished here) and `tool_finished` when the tool returns,
  `TOOL_FINISHED_LEAD_SECONDS` before the call it brings (the framework appending the result and
  posting the call). Exact, not drawn: no lead model; which sessions are instrumented is drawn
  (`seed`). They count as true signals, not in the false alarms' base.

Generation is deterministic given the settings (`seed` included) and the trace; true signals and
false alarms come from separate random streams, so a change of `false_alarms` leaves the true
signals as they were. The default is off (`coverage` 0, `false_alarms` 0): no signals, and every
replay is what it was before signals existed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from kvprefetch_client.events import SignalKind

if TYPE_CHECKING:
    from sim.cluster import SimRequest

# A false alarm is a signal not followed by a request of its session within this long.
FALSE_ALARM_QUIET_SECONDS = 600.0

# An agent framework posts tool_finished as it appends the tool's result: the call follows
# this soon (an assumption; milliseconds in practice).
TOOL_FINISHED_LEAD_SECONDS = 0.01

# `--signals` short names for the settings; the full field names are accepted too.
SHORT_NAMES: dict[str, str] = {
    "coverage": "coverage",
    "lead_median": "lead_median_seconds",
    "lead_sigma": "lead_sigma",
    "false_alarms": "false_alarms",
    "tools": "tools",
    "seed": "seed",
}


class SignalSettings(BaseModel):
    """The scenario's `[signals]` table. Defaults: off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    coverage: float = Field(
        0.0, ge=0, le=1, allow_inf_nan=False, description="share of returning turns signalled"
    )
    lead_median_seconds: float = Field(5.0, gt=0, allow_inf_nan=False)
    lead_sigma: float = Field(1.0, ge=0, le=5, allow_inf_nan=False)
    false_alarms: float = Field(
        0.0, ge=0, le=100, allow_inf_nan=False, description="false alarms per true signal"
    )
    kinds: dict[str, float] = Field(default_factory=lambda: {"typing": 0.7, "opened": 0.3})
    false_alarm_kinds: dict[str, float] = Field(
        default_factory=lambda: {"opened": 0.9, "typing": 0.1}
    )
    tools: float = Field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="share of sessions whose tool calls post tool_started and tool_finished",
    )
    seed: int = 0

    @field_validator("kinds", "false_alarm_kinds")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("name at least one kind")
        kind_adapter: TypeAdapter[str] = TypeAdapter(SignalKind)
        for kind, weight in v.items():
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"kind {kind!r}: weight {weight!r} is not a number >= 0")
            try:  # a kind a session_signal event may carry
                kind_adapter.validate_python(kind)
            except ValidationError:
                raise ValueError(
                    f"kind {kind!r}: 1 to 64 of a-z, 0-9 and _.:-, starting with a letter or digit"
                ) from None
        if sum(v.values()) <= 0:
            raise ValueError("the weights sum to 0")
        return v

    @property
    def enabled(self) -> bool:
        return self.coverage > 0 or self.tools > 0


@dataclass(frozen=True, slots=True)
class SimSignal:
    """A signal to emit at `ts`, held until request `after` finished, dropped past `latest`."""

    ts: float
    session_id: str
    kind: str
    after: int  # the index of the session's request it follows
    latest: float
    true: bool  # precedes a request (False: a false alarm)
    lead_seconds: float  # as drawn (before the cap); 0 for a false alarm
    tool: str | None = None  # a tool signal's tool


def generate_signals(requests: Sequence[SimRequest], settings: SignalSettings) -> list[SimSignal]:
    """The signals of a trace's requests (their sessions derived), in time order."""
    if not settings.enabled:
        return []
    true_rng = random.Random(f"true:{settings.seed}")
    false_rng = random.Random(f"false:{settings.seed}")
    previous: dict[str, SimRequest] = {}
    spells: list[tuple[SimRequest, float]] = []  # (the spell's request, its latest false alarm)
    signals: list[SimSignal] = []
    mu = math.log(settings.lead_median_seconds)
    kinds, weights = list(settings.kinds), list(settings.kinds.values())
    last_arrival = max((r.arrival for r in requests), default=0.0)
    for r in requests:
        prev = previous.get(r.session_id)
        previous[r.session_id] = r
        if prev is None:
            continue
        if r.arrival - prev.arrival > FALSE_ALARM_QUIET_SECONDS:
            spells.append((prev, r.arrival - FALSE_ALARM_QUIET_SECONDS))
        # Both draws for every returning turn, so each turn's lead does not depend on others.
        covered = true_rng.random() < settings.coverage
        lead = true_rng.lognormvariate(mu, settings.lead_sigma)
        kind = true_rng.choices(kinds, weights)[0]
        if covered:
            signals.append(_before(r, prev, kind, lead))
    if settings.tools > 0:
        signals += _tool_signals(requests, settings)
    # The spells with no later request: quiet up to the trace's end.
    spells += [(r, last_arrival) for r in previous.values() if r.arrival < last_arrival]
    n_true = sum(s.tool is None for s in signals)
    wanted = settings.false_alarms * n_true
    n_false = int(wanted) + (false_rng.random() < wanted - int(wanted))
    if spells and n_false:
        kinds, weights = list(settings.false_alarm_kinds), list(settings.false_alarm_kinds.values())
        for _ in range(n_false):
            spell, latest = spells[false_rng.randrange(len(spells))]
            signals.append(
                SimSignal(
                    ts=false_rng.uniform(spell.arrival, latest),
                    session_id=spell.session_id,
                    kind=false_rng.choices(kinds, weights)[0],
                    after=spell.index,
                    latest=latest,
                    true=False,
                    lead_seconds=0.0,
                )
            )
    signals.sort(key=lambda s: (s.ts, s.session_id, s.after))
    return signals


def _tool_signals(requests: Sequence[SimRequest], settings: SignalSettings) -> list[SimSignal]:
    """tool_started and tool_finished around each tool run of an instrumented session."""
    rng = random.Random(f"tools:{settings.seed}")
    instrumented: dict[str, bool] = {}
    previous: dict[str, SimRequest] = {}
    out: list[SimSignal] = []
    for r in requests:
        prev = previous.get(r.session_id)
        previous[r.session_id] = r
        if r.session_id not in instrumented:
            instrumented[r.session_id] = rng.random() < settings.tools
        if prev is None or r.tool is None or not instrumented[r.session_id]:
            continue
        # The tool ran from the call before's finish to this call: its whole gap when open loop.
        ran = r.after_seconds if r.after_seconds is not None else r.arrival - prev.arrival
        finished_lead = min(TOOL_FINISHED_LEAD_SECONDS, ran)
        for kind, lead in (("tool_started", ran), ("tool_finished", finished_lead)):
            out.append(_before(r, prev, kind, lead, r.tool))
    return out


def _before(
    r: SimRequest, prev: SimRequest, kind: str, lead: float, tool: str | None = None
) -> SimSignal:
    """A true signal `lead` seconds before request `r`, not before its session's `prev`."""
    return SimSignal(
        ts=max(r.arrival - lead, prev.arrival),
        session_id=r.session_id,
        kind=kind,
        after=prev.index,
        latest=r.arrival,
        true=True,
        lead_seconds=lead,
        tool=tool,
    )


def parse_signal_overrides(text: str) -> dict[str, Any]:
    """`coverage=0.5,lead_median=5,false_alarms=1` as settings (their field names); ValueError
    naming the setting when a key is unknown or a value is not a number."""
    out: dict[str, Any] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"{item!r}: write NAME=VALUE (for example coverage=0.5)")
        name = SHORT_NAMES.get(key, key if key in SHORT_NAMES.values() else None)
        if name is None:
            raise ValueError(f"unknown setting {key!r}; known: {', '.join(SHORT_NAMES)}")
        try:
            number: float = int(value) if name == "seed" else float(value)
        except ValueError:
            what = "an integer" if name == "seed" else "a number"
            raise ValueError(f"{key}: {value!r} is not {what}") from None
        out[name] = number
    if not out:
        raise ValueError("no settings given (for example coverage=0.5,lead_median=5)")
    return out


def with_signals(settings: SignalSettings, overrides: Mapping[str, Any]) -> SignalSettings:
    """`settings` with `overrides` (field names), validated; ValueError naming the setting."""
    try:
        return SignalSettings.model_validate({**settings.model_dump(), **overrides})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"])
        short = next((k for k, v in SHORT_NAMES.items() if v == field), field)
        raise ValueError(f"{short}: {first['msg'].removeprefix('Value error, ')}") from None
