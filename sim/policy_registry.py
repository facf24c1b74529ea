"""Every replay policy by name: `make_policy`, for the replay and the bench.

Its own module because it builds the planner's policies (sim/planned.py, sim/scheduled.py), which
build on sim/policies.py: in policies.py it made that module and planned.py import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.core.bundle import DEFAULT_MODEL_DIR
from app.decide.advisor import Advisor
from app.decide.guard import GUARD_SETTINGS
from app.decide.routing import SameInstanceEstimate
from app.predict.predictors import HeuristicPredictor, LearnedPredictor
from sim.planned import Clairvoyant, ClairvoyantPolicy, PlannedPolicy
from sim.policies import POLICIES, Belady, Lookahead, NoPrefetch, Oracle, Policy, SignalPrefetch
from sim.scheduled import ScheduledPolicy
from sim.served import ServicePolicy

if TYPE_CHECKING:
    from app.engine import Engine
    from app.state.base import StateStore
    from sim.remote import RemoteEngine
    from sim.scenario import Scenario

# Over HTTP only (not in POLICIES, the in-process ones): the service's own orders drive the cluster.
SERVICE_POLICY = "service"


def make_policy(
    name: str,
    *,
    session_view: Callable[[str], object] | None = None,
    model_dir: str | None = None,
    planner_options: dict[str, float] | None = None,
    store: StateStore | None = None,
    scenario: Scenario | None = None,
    engine: Engine | None = None,
    remote: RemoteEngine | None = None,
) -> Policy:
    """`planner_options`: keyword arguments for app.decide.advisor.Advisor (heuristic, learned;
    the scheduled policy's engine was built with them). `engine`: the replay's in-process Engine
    (sim/replay.py sim_engine), whose loops the `scheduled` policy runs and whose LRU guard
    (app/decide/guard.py) the planner's policies obey. `remote`: the replay's engine when it is a
    running service (sim/remote.py), whose orders the `service` policy carries out."""
    # The guard's settings are the engine's (sim_engine), not the Advisor's.
    planner_options = {k: v for k, v in (planner_options or {}).items() if k not in GUARD_SETTINGS}
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
    if name == "scheduled":
        if session_view is None or engine is None:
            raise ValueError(
                "the scheduled policy runs the engine's own loops: it needs the in-process engine"
            )
        return ScheduledPolicy(engine, session_view)  # type: ignore[arg-type]
    if name == "clairvoyant":
        if session_view is None:
            raise ValueError("the clairvoyant policy reads the engine's state: pass session_view")
        advisor = Advisor(
            Clairvoyant(),
            popularity=engine.popularity if engine is not None else None,
            **(planner_options or {}),  # type: ignore[arg-type]
        )
        return ClairvoyantPolicy(
            advisor,
            session_view,  # type: ignore[arg-type]
            "clairvoyant",
            guard=engine.guard if engine is not None else None,
        )
    if name in ("heuristic", "learned"):
        if session_view is None:
            raise ValueError(f"the {name} policy reads the engine's state: pass session_view")
        predictor = (
            HeuristicPredictor()
            if name == "heuristic"
            else LearnedPredictor(
                model_dir or DEFAULT_MODEL_DIR,
                deployment=engine.deployment if engine is not None else None,
            )
        )
        planner = Advisor(
            predictor,
            routes=SameInstanceEstimate(),
            popularity=engine.popularity if engine is not None else None,
            deployment=engine.deployment if engine is not None else None,
            **(planner_options or {}),
        )
        return PlannedPolicy(
            planner,
            session_view,  # type: ignore[arg-type]
            name,
            guard=engine.guard if engine is not None else None,
        )
    raise ValueError(
        f"unknown policy {name!r}; choose from {', '.join(POLICIES)} "
        f"(or {SERVICE_POLICY}, with --via)"
    )
