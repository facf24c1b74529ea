"""What a bound token (KVP_TOKENS_FILE `instances`, `agents`: fnmatch patterns) may act for,
checked where agents act; a token without a binding acts for all (app/core/security.py).

- POST /v1/events: block residency (kv_blocks_stored, kv_blocks_removed, kv_blocks_cleared,
  vllm_kv_events) of an instance outside the token's set, or of a shared tier (no instance's),
  is refused 403 naming `events[i].instance_id`; an order_progress for an order of such an
  instance, or leased (pull sink) to an agent name outside the token's, 403 naming
  `events[i].order_id`. Nothing of the batch is accepted.
- GET /v1/orders, POST /v1/orders/renew: an `instance_id` outside the set is refused 403 naming
  it, and so is an `agent` outside the token's names (or none, when the token names agents:
  what it leased must be renewable by its own names only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from app.api.batch import BatchError
from app.core.security import Principal
from kvprefetch_client.events import Event, OrderProgress

# An order id -> (its instance, the agent it is leased to), each None when not known here.
OrderOwner = Callable[[str], tuple[str | None, str | None]]

RESIDENCY_EVENT_TYPES = frozenset(
    {"kv_blocks_stored", "kv_blocks_removed", "kv_blocks_cleared", "vllm_kv_events"}
)


def is_bound(caller: Principal) -> bool:
    return caller.instances is not None or caller.agents is not None


def instance_refusal(caller: Principal, instance_id: str | None) -> str | None:
    """Why `caller` may not act for `instance_id`; None when it may."""
    if caller.acts_for_instance(instance_id):
        return None
    what = f"instance {instance_id!r}" if instance_id is not None else "a shared tier"
    return (
        f"token {caller.name!r} acts for instances {list(caller.instances or ())} only, "
        f"not for {what}"
    )


def agent_refusal(caller: Principal, agent: str | None) -> str | None:
    """Why `caller` may not act as `agent`; None when it may."""
    if caller.acts_as_agent(agent):
        return None
    names = list(caller.agents or ())
    if agent is None:
        return f"token {caller.name!r} acts for agents {names} only: name one (agent)"
    return f"token {caller.name!r} acts for agents {names} only, not {agent!r}"


def check_bound_events(
    caller: Principal,
    events: Sequence[Event],
    indices: Sequence[int] | None,
    owner: OrderOwner,
) -> None:
    """BatchError 403 at the first event `caller` may not post (`indices`: each event's position
    in the posted batch, when some were rejected before)."""
    if not is_bound(caller):
        return
    for n, event in enumerate(events):
        i = indices[n] if indices is not None else n
        kind = event.type
        if kind in RESIDENCY_EVENT_TYPES:
            why = instance_refusal(caller, getattr(event, "instance_id", None))
            if why is not None:
                raise BatchError(403, f"events[{i}].instance_id", f"{why}; nothing accepted")
        elif kind == "order_progress":
            order_id = cast(OrderProgress, event).order_id
            instance, holder = owner(order_id)
            why = instance_refusal(caller, instance) if instance is not None else None
            if why is None and holder is not None:
                why = agent_refusal(caller, holder)
                if why is not None:
                    why = f"order {order_id!r} is leased to agent {holder!r}: {why}"
            elif why is not None:
                why = f"order {order_id!r} is for instance {instance!r}: {why}"
            if why is not None:
                raise BatchError(403, f"events[{i}].order_id", f"{why}; nothing accepted")
