"""Traces of our own making, in the agent trace format: an agent-like workload.

The shared traces are chat (a human's think time between turns). Agents call the model in loops:
a task starts with a user message, then each call's output names a tool, the tool runs for
seconds, and its result comes back as the next call's new prompt; now and then a human turn
follows the task, minutes later. Every call of an agent of one kind starts with the same system
prompt and tool schemas. `agent_trace` writes such traffic. **It is an assumption, not data**:
the shape comes from how agent frameworks call models (tool loops, shared schemas), the numbers
from the defaults below, not from a measured trace.

- Tasks arrive as a Poisson process (`tasks` over `seconds`), each of one of `agent_kinds` kinds;
  a kind's shared prefix is `system_blocks` + `tool_blocks` blocks, the same ids for every task of
  the kind (prefix-chained like the Mooncake traces' ids: the same first blocks, the same ids).
- A task makes a geometric number of calls (mean `calls_mean`); each call's prompt is the task's
  whole context so far, its output `output_tokens` tokens; the next call comes when the output is
  decoded (`decode_seconds_per_token` a token) and the tool the call named has run: one of
  `tools`, equally likely, each with its own lognormal run time (`AgentTool`: median and sigma);
  the tool's result adds `result_blocks` blocks.
- After its last call a task gets a human turn with probability `human_turn_share`, after a
  lognormal think time (median `think_median_seconds`), and loops again.

Each request carries its task as `session_id`; each but a task's first carries `after_seconds`,
the time from the previous call's finish (arrival plus decode, as the generator assumes it) to
this call, and `tool`, the tool whose result it carries. A human turn comes after its previous
call's tool has run and the human has thought, so its `after_seconds` is that run plus the think
time, and it has no `tool` (it waited on the human). `timestamp` is the arrival this gives in an
open loop: the previous call's arrival, its decode and `after_seconds`.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from sim.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class AgentTool:
    """A tool an agent calls and its run time: lognormal, `median_seconds` and `sigma` (of the
    log)."""

    name: str
    median_seconds: float
    sigma: float = 0.6


# Eight tools, fast to slow: medians log-spaced from 0.5 s to 10 s (0.5, 0.77, 1.18, 1.81, 2.77,
# 4.25, 6.52, 10.0), one sigma. Assumed, not measured; named for what such a run time suggests.
DEFAULT_TOOLS = tuple(
    AgentTool(name, 0.5 * 20.0 ** (k / 7), 0.6)
    for k, name in enumerate(
        ("read_file", "grep", "list_dir", "edit_file", "bash", "run_tests", "web_search", "build")
    )
)


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    tasks: int = 600
    seconds: float = 1200.0
    agent_kinds: int = 3
    system_blocks: int = 4
    tool_blocks: int = 6
    user_blocks: tuple[int, int] = (1, 4)
    calls_mean: float = 6.0
    output_tokens: tuple[int, int] = (30, 400)
    decode_seconds_per_token: float = 0.03
    tools: tuple[AgentTool, ...] = DEFAULT_TOOLS
    result_blocks: tuple[int, int] = (1, 3)
    human_turn_share: float = 0.3
    think_median_seconds: float = 60.0
    think_sigma: float = 1.0
    block_tokens: int = 512
    seed: int = 0


def agent_trace(w: AgentWorkload) -> list[TraceRequest]:
    """The workload's requests in arrival order (deterministic for its seed)."""
    if not w.tools:
        raise ValueError("an agent workload needs at least one tool")
    rng = random.Random(w.seed)
    ids = itertools.count()
    prefixes = [
        [next(ids) for _ in range(w.system_blocks + w.tool_blocks)] for _ in range(w.agent_kinds)
    ]
    calls: list[tuple[float, int, int, tuple[int, ...], str, float | None, str | None]] = []
    start = 0.0
    for task in range(w.tasks):
        session_id = f"task-{task}"  # renamed below
        start += rng.expovariate(w.tasks / w.seconds)
        context = [*rng.choice(prefixes)]
        context += [next(ids) for _ in range(rng.randint(*w.user_blocks))]
        at = start
        # What the next call waited on since the previous one finished: nothing for a task's
        # first call, then the tool the previous call named (and a human, on a human turn).
        after: float | None = None
        waited_on: str | None = None
        while True:
            n_calls = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / w.calls_mean))
            for _ in range(n_calls):
                output = rng.randint(*w.output_tokens)
                prompt_tokens = len(context) * w.block_tokens - rng.randrange(w.block_tokens)
                waited = None if after is None else round(after, 3)
                calls.append(
                    (
                        at,
                        max(prompt_tokens, 1),
                        output,
                        tuple(context),
                        session_id,
                        waited,
                        waited_on,
                    )
                )
                tool = w.tools[rng.randrange(len(w.tools))]
                run = rng.lognormvariate(math.log(tool.median_seconds), tool.sigma)
                at += output * w.decode_seconds_per_token + run
                after, waited_on = run, tool.name
                context += [next(ids) for _ in range(rng.randint(*w.result_blocks))]
            if rng.random() >= w.human_turn_share:
                break
            think = rng.lognormvariate(math.log(w.think_median_seconds), w.think_sigma)
            at += think
            assert after is not None  # a loop makes at least one call
            after, waited_on = after + think, None
            context += [next(ids) for _ in range(rng.randint(*w.user_blocks))]
    calls.sort(key=lambda c: c[0])
    # A task's session is named by its first request's index, as sim/sessions.py names the
    # sessions it derives: the same ids for the same tasks, so replays of the trace give what they
    # gave before it carried them (the planner breaks ties by session id).
    names: dict[str, str] = {}
    for i, c in enumerate(calls):
        names.setdefault(c[4], f"s{i}")
    return [
        TraceRequest(i, round(at, 3), prompt, output, hashes, names[task], after, tool)
        for i, (at, prompt, output, hashes, task, after, tool) in enumerate(calls)
    ]


def trace_lines(requests: list[TraceRequest]) -> Iterator[bytes]:
    """The Mooncake JSON Lines (timestamps in milliseconds), with the agent fields a request
    carries (sim/traces.py)."""
    for r in requests:
        doc: dict[str, object] = {
            "timestamp": round(r.arrival_seconds * 1000),
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(r.hash_ids),
        }
        if r.session_id is not None:
            doc["session_id"] = r.session_id
        if r.after_seconds is not None:
            doc["after_seconds"] = r.after_seconds
        if r.tool is not None:
            doc["tool"] = r.tool
        yield orjson.dumps(doc) + b"\n"


def write_trace(requests: list[TraceRequest], path: Path) -> int:
    """Write the trace; returns how many requests."""
    with open(path, "wb") as f:
        f.writelines(trace_lines(requests))
    return len(requests)


__all__ = [
    "DEFAULT_TOOLS",
    "AgentTool",
    "AgentWorkload",
    "agent_trace",
    "trace_lines",
    "write_trace",
]
