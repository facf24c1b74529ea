"""Traces of our own making, in the Mooncake format: an agent-like workload.

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
  decoded (`decode_seconds_per_token` a token) and the tool has run (lognormal, median
  `tool_median_seconds` for the tool the call named, of `tools` tools with their own medians);
  the tool's result adds `result_blocks` blocks.
- After its last call a task gets a human turn with probability `human_turn_share`, after a
  lognormal think time (median `think_median_seconds`), and loops again.
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
    tools: int = 8
    tool_median_seconds: tuple[float, float] = (0.5, 10.0)  # the tools' medians, spread between
    tool_sigma: float = 0.6
    result_blocks: tuple[int, int] = (1, 3)
    human_turn_share: float = 0.3
    think_median_seconds: float = 60.0
    think_sigma: float = 1.0
    block_tokens: int = 512
    seed: int = 0


def agent_trace(w: AgentWorkload) -> list[TraceRequest]:
    """The workload's requests in arrival order (deterministic for its seed)."""
    rng = random.Random(w.seed)
    ids = itertools.count()
    prefixes = [
        [next(ids) for _ in range(w.system_blocks + w.tool_blocks)] for _ in range(w.agent_kinds)
    ]
    low, high = w.tool_median_seconds
    tool_medians = [low * (high / low) ** (k / max(w.tools - 1, 1)) for k in range(w.tools)]
    calls: list[tuple[float, int, int, tuple[int, ...]]] = []
    start = 0.0
    for _ in range(w.tasks):
        start += rng.expovariate(w.tasks / w.seconds)
        context = [*rng.choice(prefixes)]
        context += [next(ids) for _ in range(rng.randint(*w.user_blocks))]
        at = start
        while True:
            n_calls = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / w.calls_mean))
            for _ in range(n_calls):
                output = rng.randint(*w.output_tokens)
                prompt_tokens = len(context) * w.block_tokens - rng.randrange(w.block_tokens)
                calls.append((at, max(prompt_tokens, 1), output, tuple(context)))
                tool = rng.randrange(w.tools)
                run = rng.lognormvariate(math.log(tool_medians[tool]), w.tool_sigma)
                at += output * w.decode_seconds_per_token + run
                context += [next(ids) for _ in range(rng.randint(*w.result_blocks))]
            if rng.random() >= w.human_turn_share:
                break
            at += rng.lognormvariate(math.log(w.think_median_seconds), w.think_sigma)
            context += [next(ids) for _ in range(rng.randint(*w.user_blocks))]
    calls.sort(key=lambda c: c[0])
    return [
        TraceRequest(i, round(at, 3), prompt, output, hashes)
        for i, (at, prompt, output, hashes) in enumerate(calls)
    ]


def trace_lines(requests: list[TraceRequest]) -> Iterator[bytes]:
    """The Mooncake JSON Lines (timestamps in milliseconds)."""
    for r in requests:
        yield (
            orjson.dumps(
                {
                    "timestamp": round(r.arrival_seconds * 1000),
                    "input_length": r.input_tokens,
                    "output_length": r.output_tokens,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + b"\n"
        )


def write_trace(requests: list[TraceRequest], path: Path) -> int:
    """Write the trace; returns how many requests."""
    with open(path, "wb") as f:
        f.writelines(trace_lines(requests))
    return len(requests)


__all__ = ["AgentWorkload", "agent_trace", "trace_lines", "write_trace"]
