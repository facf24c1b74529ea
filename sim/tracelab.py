"""Import TraceLab's round traces of real coding-agent sessions as agent traces (sim/traces.py).

TraceLab (github.com/uw-syfi/TraceLab, Apache-2.0) publishes Claude Code and Codex sessions as
JSON Lines, one LLM round a line (its README "Data format", example_sessions/): the session
(`session_id`, `round_index`), the prompt split by the provider's prompt cache (`prefix_tokens`
read from it, `newly_append_tokens` new; their sum is the prompt), `output_tokens`, the round's
ordered `timing_events` (`user_message` and `tool_result` are its inputs, then the model's
`reasoning`, `text`, `tool_call` and Codex's `usage_report`, each with an ISO `timestamp`) and its
`tools` (`tool_name`, `tool_call_id`, `emitted_at`, `result_at`, `tool_wall_latency_ms`, ...).
Other fields are ignored.

One request per round (docs/data-science/agent-traces.md says what rests on which assumption):

- Blocks: prefix-chained ids made up per session. A round's first
  min(prefix_tokens, the previous round's prompt) // block_tokens blocks are the previous
  round's; the rest of its prompt gets new ids. So the reuse the replay sees is the prefix the
  provider's cache found; a session's first round shares nothing (its cached system prompt is
  another session's, whose content the trace does not give).
- Times: a round is sent at its latest input event before its first output event (the result or
  message it waited for) and ends at its last event. `after_seconds` is the time from the previous
  round's end to this round's send (at least 0): the tools' measured run, overlap with the
  model's own output taken off, or the human's think time; `tool` is the name of the tool whose
  result came last, absent when the last input was a user message. A round with no input event
  follows its previous one at once, with no tool.
- Sessions keep their recorded timelines. They start at their recorded times, with stretches
  when no session is in progress cut to `max_idle_seconds`, or (`session_rate`) as a seeded
  Poisson process in their recorded order.
- Skipped, and counted: a round without a timestamp, a round without tokens (no usage
  recorded), a second round of the same session and `round_index` (TraceLab keeps duplicates).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sim.traces import TraceError, TraceRequest, json_lines

INPUT_EVENTS = frozenset({"user_message", "tool_result"})


@dataclass(frozen=True, slots=True)
class ImportOptions:
    block_tokens: int = 512  # the replay scenario's (the shipped ones': 512)
    max_idle_seconds: float = 60.0  # an idle stretch between sessions is cut to this
    session_rate: float | None = None  # sessions a second, Poisson; None: their recorded starts
    seed: int = 0


@dataclass(slots=True)
class ImportSummary:
    rounds: int = 0  # lines read
    requests: int = 0
    sessions: int = 0
    skipped_untimed: int = 0
    skipped_no_tokens: int = 0
    skipped_duplicate: int = 0


@dataclass(slots=True)
class _Round:
    line: int
    session_id: str
    round_index: int
    prefix_tokens: int
    input_tokens: int
    output_tokens: int
    sent: float | None  # the latest input event before the first output (POSIX seconds)
    first: float  # its earliest event
    end: float  # its latest event
    # What its send waited for: ("user", None), ("tool", tool_call_id or None, tool_name or
    # None), or None when it has no input event.
    waited_on: tuple[str, str | None, str | None] | None
    tools: dict[str, str] = field(default_factory=dict)  # tool_call_id -> tool_name


def _int(doc: dict[str, Any], key: str, path: Path, line: int) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, f"{key} must be an integer, got {value!r}")
    if value < 0:
        raise TraceError(path, line, f"{key} must be >= 0, got {value}")
    return value


def _time(value: Any, where: str, path: Path, line: int) -> float | None:
    """An ISO 8601 timestamp as POSIX seconds (naive ones are UTC, as TraceLab writes them)."""
    if value is None:
        return None
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        raise TraceError(path, line, f"{where} must be an ISO 8601 time, got {value!r}") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


def _objects(doc: dict[str, Any], key: str, path: Path, line: int) -> list[dict[str, Any]]:
    value = doc.get(key, [])
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise TraceError(path, line, f"{key} must be a list of objects")
    return value


def _name(value: Any, where: str, path: Path, line: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TraceError(path, line, f"{where} must be a string, got {value!r}")
    return value or None


def _round(doc: dict[str, Any], path: Path, line: int) -> _Round | None:
    """The line's round; None when it has no timestamp at all."""
    session_id = doc.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        raise TraceError(path, line, f"session_id must be a non-empty string, got {session_id!r}")
    round_index = _int(doc, "round_index", path, line)
    prefix = _int(doc, "prefix_tokens", path, line)
    appended = _int(doc, "newly_append_tokens", path, line)
    output = _int(doc, "output_tokens", path, line)
    tools: dict[str, str] = {}
    for k, tool in enumerate(_objects(doc, "tools", path, line)):
        call = _name(tool.get("tool_call_id"), f"tools[{k}].tool_call_id", path, line)
        name = _name(tool.get("tool_name"), f"tools[{k}].tool_name", path, line)
        if call is not None and name is not None:
            tools[call] = name
    inputs: list[tuple[float, tuple[str, str | None, str | None]]] = []
    outputs: list[float] = []
    for k, event in enumerate(_objects(doc, "timing_events", path, line)):
        kind = event.get("event_type")
        if not isinstance(kind, str):
            raise TraceError(
                path, line, f"timing_events[{k}].event_type must be a string, got {kind!r}"
            )
        at = _time(event.get("timestamp"), f"timing_events[{k}].timestamp", path, line)
        if at is None:
            continue
        call = _name(event.get("tool_call_id"), f"timing_events[{k}].tool_call_id", path, line)
        name = _name(event.get("tool_name"), f"timing_events[{k}].tool_name", path, line)
        if call is not None and name is not None:
            tools.setdefault(call, name)
        if kind == "user_message":
            inputs.append((at, ("user", None, None)))
        elif kind == "tool_result":
            inputs.append((at, ("tool", call, name)))
        else:
            outputs.append(at)
    times = [at for at, _ in inputs] + outputs
    if not times:
        return None
    # A result landing while the model already answers was not what the request waited for.
    waited = [i for i in inputs if not outputs or i[0] <= min(outputs)] or inputs
    last = max(waited, key=lambda i: i[0]) if waited else None
    return _Round(
        line=line,
        session_id=session_id,
        round_index=round_index,
        prefix_tokens=prefix,
        input_tokens=prefix + appended,
        output_tokens=output,
        sent=last[0] if last is not None else None,
        first=min(times),
        end=max(times),
        waited_on=last[1] if last is not None else None,
        tools=tools,
    )


def _read_rounds(path: Path | str, summary: ImportSummary) -> dict[str, list[_Round]]:
    """Each session's rounds in round order (first seen first); a malformed line is a TraceError
    naming the file, the line and the field."""
    path = Path(path)
    sessions: dict[str, list[_Round]] = {}
    for line_no, doc in json_lines(path):
        summary.rounds += 1
        r = _round(doc, path, line_no)
        if r is None:
            summary.skipped_untimed += 1
        elif r.input_tokens == 0:
            summary.skipped_no_tokens += 1
        else:
            sessions.setdefault(r.session_id, []).append(r)
    for session_id, rounds in sessions.items():
        rounds.sort(key=lambda r: (r.round_index, r.line))
        kept = [
            r for k, r in enumerate(rounds) if k == 0 or r.round_index != rounds[k - 1].round_index
        ]
        summary.skipped_duplicate += len(rounds) - len(kept)
        sessions[session_id] = kept
    return sessions


@dataclass(slots=True)
class _Request:
    at: float  # recorded send time (POSIX seconds), then the trace's
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    session_id: str
    after_seconds: float | None
    tool: str | None


def _session(rounds: Sequence[_Round], block_tokens: int, ids: Iterator[int]) -> list[_Request]:
    """One session's requests on its recorded timeline; new blocks take their ids from `ids`."""
    out: list[_Request] = []
    tools: dict[str, str] = {}
    prev: _Round | None = None
    prev_end = 0.0
    prev_ids: tuple[int, ...] = ()
    for r in rounds:
        tools.update(r.tools)
        shared = min(r.prefix_tokens, prev.input_tokens if prev else 0) // block_tokens
        fresh = math.ceil(r.input_tokens / block_tokens) - shared
        hash_ids = prev_ids[:shared] + tuple(itertools.islice(ids, fresh))
        if prev is None:
            at = r.sent if r.sent is not None else r.first
            after, tool = None, None
        else:
            after = max(0.0, (r.sent if r.sent is not None else prev_end) - prev_end)
            at = prev_end + after
            tool = None
            if r.waited_on is not None and r.waited_on[0] == "tool":
                _, call, name = r.waited_on
                tool = (tools.get(call) if call is not None else None) or name or "unknown"
        out.append(
            _Request(at, r.input_tokens, r.output_tokens, hash_ids, r.session_id, after, tool)
        )
        prev, prev_end, prev_ids = r, max(at, r.end), hash_ids
    return out


def _starts(
    sessions: list[list[_Request]], ends: list[float], options: ImportOptions
) -> list[float]:
    """Each session's start in the trace, in seconds from its beginning."""
    if options.session_rate is not None:
        rng = random.Random(options.seed)
        starts, t = [], 0.0
        for k in range(len(sessions)):
            if k:
                t += rng.expovariate(options.session_rate)
            starts.append(t)
        return starts
    origin = sessions[0][0].at
    starts, cut, frontier = [], 0.0, sessions[0][0].at
    for requests, end in zip(sessions, ends):
        idle = requests[0].at - frontier
        if idle > options.max_idle_seconds:
            cut += idle - options.max_idle_seconds
        starts.append(requests[0].at - origin - cut)
        frontier = max(frontier, end)
    return starts


def import_tracelab(
    path: Path | str, options: ImportOptions | None = None
) -> tuple[list[TraceRequest], ImportSummary]:
    """The TraceLab trace at `path` as an agent trace's requests, in arrival order."""
    options = options or ImportOptions()
    if options.block_tokens <= 0:
        raise ValueError("block_tokens must be > 0")
    if options.max_idle_seconds < 0:
        raise ValueError("max_idle_seconds must be >= 0")
    if options.session_rate is not None and options.session_rate <= 0:
        raise ValueError("session_rate must be > 0")
    summary = ImportSummary()
    ids = itertools.count()
    built = [
        (_session(rounds, options.block_tokens, ids), rounds[-1].end)
        for rounds in _read_rounds(path, summary).values()
    ]
    if not built:
        raise TraceError(path, 0, "no rounds to import")
    built.sort(key=lambda b: b[0][0].at)  # stable: sessions that start together keep file order
    sessions = [requests for requests, _ in built]
    ends = [max(end, requests[-1].at) for requests, end in built]
    flat: list[tuple[float, _Request]] = []
    for requests, start in zip(sessions, _starts(sessions, ends, options)):
        shift = start - requests[0].at
        flat += [(round(r.at + shift, 3), r) for r in requests]
    flat.sort(key=lambda x: x[0])  # stable: a session's requests keep their order
    trace = [
        TraceRequest(
            index=i,
            arrival_seconds=at,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            hash_ids=r.hash_ids,
            session_id=r.session_id,
            after_seconds=None if r.after_seconds is None else round(r.after_seconds, 3),
            tool=r.tool,
        )
        for i, (at, r) in enumerate(flat)
    ]
    summary.requests = len(trace)
    summary.sessions = len(sessions)
    return trace, summary


__all__ = ["ImportOptions", "ImportSummary", "import_tracelab"]
