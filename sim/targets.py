"""`kvprefetch targets`: issue 14's targets, each replayed and checked, as one table.

Every row is a replay judged on the last 30% of its trace by time (`--measure-from` at 70%: the
bundled model was trained on the first 70% of each shared trace), with the model given (default
the bundled one). Gap closed = (policy - none) / (oracle - none) on byte hit rate, with `none`
and `oracle` replayed under the same trace, scenario and router. The signal settings are
assumptions about what a deployment sends (sim/signals.py): the table reports several, and
which target rests on which.

The agent-like trace is generated (`kvprefetch agent-trace` defaults), not measured: its rows
are there because traffic unlike the model's training is where advice can lose to LRU.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.replay import replay
from sim.scenario import load_scenario
from sim.signals import parse_signal_overrides, with_signals
from sim.traces import TraceRequest, judged_from_seconds, load_trace
from sim.workloads import AgentWorkload, agent_trace

CONVERSATION = "mooncake_conversation_first60.jsonl"
SYNTHETIC = "mooncake_synthetic.jsonl"
AGENT = "agent"  # generated: sim/workloads.py with its defaults
HALF = "coverage=0.5,lead_median=5,false_alarms=1"
FULL = "coverage=1,lead_median=5,false_alarms=0"
# Within this much byte hit rate, a policy is not "below" another (the tolerance).
TOLERANCE = 0.005
TRAIN_FRACTION = 0.7


@dataclass(frozen=True, slots=True)
class Case:
    """One trace, scenario, router and signal setting, and the policies replayed under it."""

    trace: str
    router: str
    policies: tuple[str, ...]
    scenario: str = "default"
    signals: str | None = None
    lru_guard: bool = True

    @property
    def label(self) -> str:
        name = {CONVERSATION: "conversation", SYNTHETIC: "synthetic"}.get(self.trace, self.trace)
        parts = [name, self.scenario, self.router, f"signals {self.signals or 'off'}"]
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Target:
    """`policy` under `case` must close at least `min_gap` of the gap, and/or stay within the
    tolerance of (or beat, `strict`) each policy in `not_below`, and/or waste at most
    `max_unused_share` of what it prefetched."""

    case: Case
    policy: str
    text: str
    min_gap: float | None = None
    not_below: tuple[str, ...] = ()
    strict: bool = False
    max_unused_share: float | None = None


@dataclass(slots=True)
class Verdict:
    target: Target
    met: bool
    why: list[str] = field(default_factory=list)


def cases() -> list[Case]:
    out = []
    for trace in (CONVERSATION, SYNTHETIC):
        for router in ("sticky", "least-loaded"):
            out.append(Case(trace, router, ("none", "learned", "clairvoyant", "oracle")))
        out.append(Case(trace, "sticky", ("none", "signal", "learned", "oracle"), signals=HALF))
        out.append(Case(trace, "sticky", ("none", "learned", "oracle"), signals=FULL))
        out.append(Case(trace, "hinted", ("none", "learned", "oracle"), signals=HALF))
        out.append(Case(trace, "sticky", ("none", "lookahead", "learned"), scenario="busy"))
    for router in ("sticky", "least-loaded"):
        out.append(
            Case(AGENT, router, ("none", "learned", "clairvoyant", "oracle"), scenario="tight-hbm")
        )
    return out


def targets(all_cases: Sequence[Case]) -> list[Target]:
    out = []
    for c in all_cases:
        if c.signals is None and c.scenario != "busy":
            for policy in ("learned", "clairvoyant"):
                out.append(Target(c, policy, f"{policy} never below none", not_below=("none",)))
        elif c.signals == HALF and c.router == "sticky":
            out.append(
                Target(
                    c,
                    "learned",
                    "learned closes >= 55%, beats signal, unused < 30%",
                    min_gap=0.55,
                    not_below=("signal",),
                    strict=True,
                    max_unused_share=0.30,
                )
            )
        elif c.signals == FULL:
            out.append(Target(c, "learned", "learned closes >= 85%", min_gap=0.85))
        elif c.router == "hinted":
            out.append(Target(c, "learned", "learned closes >= 40%", min_gap=0.40))
        elif c.scenario == "busy":
            out.append(
                Target(
                    c, "learned", "learned beats lookahead", not_below=("lookahead",), strict=True
                )
            )
    return out


def load(trace: str, traces_dir: Path) -> list[TraceRequest]:
    if trace == AGENT:
        return agent_trace(AgentWorkload())
    return load_trace(traces_dir / trace)


def run_case(case: Case, traces_dir: Path, model_dir: str | None) -> dict[str, dict[str, Any]]:
    requests = load(case.trace, traces_dir)
    scenario = load_scenario(case.scenario)
    if case.signals is not None:
        scenario = scenario.model_copy(
            update={"signals": with_signals(scenario.signals, parse_signal_overrides(case.signals))}
        )
    measure_from = judged_from_seconds(requests, TRAIN_FRACTION)
    return {
        policy: replay(
            requests,
            scenario,
            policy=policy,
            router=case.router,
            model_dir=model_dir,
            measure_from_seconds=measure_from,
            planner_options={"lru_guard": case.lru_guard},
        ).summary
        for policy in case.policies
    }


def gap_closed(results: dict[str, dict[str, Any]], policy: str) -> float | None:
    if "none" not in results or "oracle" not in results:
        return None
    none, oracle = results["none"]["byte_hit_rate"], results["oracle"]["byte_hit_rate"]
    if oracle - none <= 0:
        return None
    return (results[policy]["byte_hit_rate"] - none) / (oracle - none)


def unused_share(summary: dict[str, Any]) -> float | None:
    moved = summary["bytes_prefetched"]
    return summary["bytes_prefetched_unused"] / moved if moved else None


def judge(target: Target, results: dict[str, dict[str, Any]]) -> Verdict:
    v = Verdict(target, True)
    mine = results[target.policy]
    if target.min_gap is not None:
        gap = gap_closed(results, target.policy)
        if gap is None or gap < target.min_gap:
            v.met = False
            v.why.append(f"gap closed {gap if gap is None else round(gap, 3)}")
    for other in target.not_below:
        diff = mine["byte_hit_rate"] - results[other]["byte_hit_rate"]
        beaten = diff > 0 if target.strict else diff >= -TOLERANCE
        if target.strict and other == "signal":
            beaten = beaten and mine["stall_seconds_total"] < results[other]["stall_seconds_total"]
        if not beaten:
            v.met = False
            v.why.append(f"{diff:+.4f} against {other}")
    if target.max_unused_share is not None:
        share = unused_share(mine)
        if share is not None and share >= target.max_unused_share:
            v.met = False
            v.why.append(f"unused {share:.0%}")
    return v


def run(
    traces_dir: Path, model_dir: str | None, jobs: int = 1
) -> tuple[list[tuple[Case, dict[str, dict[str, Any]]]], list[Verdict]]:
    all_cases = cases()
    with ProcessPoolExecutor(max_workers=max(jobs, 1)) as pool:
        done = list(
            pool.map(
                run_case, all_cases, [traces_dir] * len(all_cases), [model_dir] * len(all_cases)
            )
        )
    results = list(zip(all_cases, done))
    by_case = dict(results)
    return results, [judge(t, by_case[t.case]) for t in targets(all_cases)]


def markdown(
    results: Iterable[tuple[Case, dict[str, dict[str, Any]]]], verdicts: Sequence[Verdict]
) -> str:
    lines = [
        "| case | policy | byte hit rate | gap closed | stall s | prefetched GB | unused |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, res in results:
        for policy, s in res.items():
            gap = gap_closed(res, policy)
            share = unused_share(s)
            lines.append(
                f"| {case.label} | {policy} | {s['byte_hit_rate']:.4f} | "
                f"{'' if gap is None else f'{gap:.0%}'} | {s['stall_seconds_total']:,.1f} | "
                f"{s['bytes_prefetched'] / 1e9:,.0f} | {'' if share is None else f'{share:.0%}'} |"
            )
    lines += ["", "| case | target | met | why not |", "|---|---|---|---|"]
    for v in verdicts:
        lines.append(
            f"| {v.target.case.label} | {v.target.text} | {'yes' if v.met else 'no'} | "
            f"{'; '.join(v.why)} |"
        )
    return "\n".join(lines)


def as_json(
    results: Iterable[tuple[Case, dict[str, dict[str, Any]]]], verdicts: Sequence[Verdict]
) -> str:
    return json.dumps(
        {
            "cases": [
                {
                    "case": case.label,
                    "results": res,
                    "gap_closed": {p: gap_closed(res, p) for p in res},
                }
                for case, res in results
            ],
            "targets": [
                {"case": v.target.case.label, "target": v.target.text, "met": v.met, "why": v.why}
                for v in verdicts
            ],
        }
    )
