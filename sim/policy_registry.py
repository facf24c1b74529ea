"""Every replay policy by name: `make_policy`, for the replay and the bench.

Its own module because it builds the planner's policies (sim/planned.py), which build on
sim/policies.py: in policies.py it made that module and planned.py import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.predict.predictors import HeuristicPredictor
from sim.agent_policies import AGENT_POLICIES, make_agent_policy
from sim.clairvoyant import Clairvoyant
from sim.planned import ClairvoyantPolicy, PlannedPolicy
from sim.policies import (
    PLANNER_POLICIES,
    POLICIES,
    SCHEDULED_ALIAS,
    Belady,
    Lookahead,
    NoPrefetch,
    Oracle,
    Policy,
    SignalPrefetch,
)
from sim.served import ServicePolicy

if TYPE_CHECKING:
    from app.engine import Engine
    from sim.remote import RemoteService

# Over HTTP only (not in POLICIES, the in-process ones): the service's own orders drive the cluster.
SERVICE_POLICY = "service"


def make_policy(
    name: str,
    *,
    session_view: Callable[[str], object] | None = None,
    engine: Engine | None = None,
    remote: RemoteService | None = None,
) -> Policy:
    """`engine`: the replay's in-process Engine (sim/replay.py sim_engine), whose scoring and
    planning the planner's policies (heuristic, learned, clairvoyant) run: its model, thresholds
    and LRU guard are theirs. `scheduled` is another name for `learned` (the service's scheduler
    once had a policy of its own; now every planner's policy is it). `remote`: the replay's
    engine when it is a running service (sim/remote.py), whose orders the `service` policy
    carries out."""
    if name == "none":
        return NoPrefetch()
    if name == "lookahead":
        return Lookahead()
    if name == "belady":
        return Belady()
    if name == "oracle":
        return Oracle()
    if name == "signal":
        return SignalPrefetch()
    if name == SERVICE_POLICY:
        if remote is None:
            raise ValueError(
                "the service policy carries out a running service's orders: replay with "
                "--via URL --speed X"
            )
        return ServicePolicy(remote)
    if name in PLANNER_POLICIES or name == SCHEDULED_ALIAS:
        if session_view is None or engine is None:
            raise ValueError(
                f"the {name} policy runs the engine's own scoring and planning: it needs the "
                "in-process engine (sim.replay.sim_engine) and its session_view; over HTTP, "
                "--policy service replays the service's own planner"
            )
        view = session_view
        if name == "clairvoyant":
            return ClairvoyantPolicy(engine, view, name, predictor=Clairvoyant())  # type: ignore[arg-type]
        if name == "heuristic":
            return PlannedPolicy(engine, view, name, predictor=HeuristicPredictor())  # type: ignore[arg-type]
        # learned: the model the engine loaded (sim_engine's model_dir, default the bundled one).
        return PlannedPolicy(engine, view, "learned")  # type: ignore[arg-type]
    agent = make_agent_policy(name)
    if agent is not None:
        return agent
    raise ValueError(
        f"unknown policy {name!r}; choose from {', '.join((*POLICIES, *AGENT_POLICIES))} "
        f"(ttl-N for a TTL of N seconds; or {SERVICE_POLICY}, with --via)"
    )
