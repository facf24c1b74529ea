"""GET /v1/orders: transfer agents pull their instance's orders from the pull sink, and
POST /v1/orders/renew: they keep the leases of what they hold."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from app.api.auth import AgentCaller
from app.api.bindings import agent_refusal, instance_refusal
from app.api.deps import ClockDep, OrderSinkDep, SettingsDep
from app.api.errors import Error, body_error, error_response
from app.core.security import Principal
from app.deliver import PullQueue
from kvprefetch_client.events import INSTANCE_ID_PATTERN, Ident, InstanceId
from kvprefetch_client.orders import Order

MAX_LIMIT = 1000


def validation_error(request: Request, error: dict[str, Any]) -> Response:
    """A bad query parameter, or body field, named (app/api/errors.py answers with it)."""
    if error["loc"] and error["loc"][0] == "body":
        return body_error(request, error)
    name = str(error["loc"][-1])
    message = (
        f"the query parameter {name} is required"
        if error["type"] == "missing"
        else f"{name}: {error['msg']}"
    )
    return error_response(422, name, message)


router = APIRouter(tags=["orders"])


class OrdersResponse(BaseModel):
    orders: list[Order]
    cancelled: list[str]
    lease_seconds: float = Field(
        description="How long the orders are leased: renew well within it "
        "(POST /v1/orders/renew) while holding them"
    )


class RenewRequest(BaseModel):
    model_config = {"extra": "forbid"}

    instance_id: InstanceId
    agent: Ident = Field(description="The name the agent leased them under (GET /v1/orders?agent=)")
    order_ids: list[Ident] = Field(
        max_length=MAX_LIMIT, description="Orders the agent holds, not finished"
    )


class RenewResponse(BaseModel):
    renewed: list[str] = Field(description="Still this agent's: leased for lease_seconds more")
    lost: list[str] = Field(description="Gone, or leased to another agent since: do not start them")
    lease_seconds: float


def _not_pull(settings: SettingsDep, route: str) -> Response:
    return error_response(
        409,
        "order_sink",
        f"orders go to the {settings.order_sink} sink (KVP_ORDER_SINK); "
        f"{route} serves only the pull sink (KVP_ORDER_SINK=pull)",
    )


def _refusal(caller: Principal, instance_id: str, agent: str | None) -> Response | None:
    """403 naming the field a bound token may not act for (app/api/bindings.py)."""
    why = instance_refusal(caller, instance_id)
    if why is not None:
        return error_response(403, "instance_id", why)
    why = agent_refusal(caller, agent)
    if why is not None:
        return error_response(403, "agent", why)
    return None


_BOUND: dict[int | str, dict[str, Any]] = {
    403: {
        "model": Error,
        "description": "A bound token names an instance or agent it does not act for "
        "(KVP_TOKENS_FILE instances, agents).",
    }
}


@router.get(
    "/orders",
    response_model=OrdersResponse,
    responses={
        409: {"model": Error, "description": "The configured order sink is not the pull queue."},
        422: {"model": Error, "description": "A query parameter is missing or out of range."},
        **_BOUND,
    },
    summary="Lease an instance's pending orders",
)
async def get_orders(
    caller: AgentCaller,
    sink: OrderSinkDep,
    settings: SettingsDep,
    clock: ClockDep,
    instance_id: Annotated[
        str,
        Query(
            min_length=1,
            max_length=256,
            pattern=INSTANCE_ID_PATTERN,
            description="The instance whose orders to lease",
        ),
    ],
    limit: Annotated[
        int, Query(ge=1, le=MAX_LIMIT, description="The most orders to hand out")
    ] = 100,
    agent: Annotated[
        str | None,
        Query(
            min_length=1, max_length=256, description="The agent's name, to renew the leases under"
        ),
    ] = None,
) -> Response:
    """Orders for the instance not leased yet or whose lease ran out (leased now for
    KVP_ORDER_LEASE_SECONDS, to `agent`: renew them while holding them, and report
    `order_progress` `accepted` when one starts), and the ids of its orders cancelled since its
    last pull. Served only when KVP_ORDER_SINK is `pull`."""
    refused = _refusal(caller, instance_id, agent)
    if refused is not None:
        return refused
    if not isinstance(sink, PullQueue):
        return _not_pull(settings, "GET /v1/orders")
    lease = sink.lease(instance_id, limit, clock.now(), agent)
    return Response(lease.to_json(), media_type="application/json")


@router.post(
    "/orders/renew",
    response_model=RenewResponse,
    responses={
        400: {"model": Error, "description": "The body is not JSON."},
        409: {"model": Error, "description": "The configured order sink is not the pull queue."},
        422: {"model": Error, "description": "A body field is missing or out of range."},
        **_BOUND,
    },
    summary="Keep the leases of orders an agent holds",
)
async def renew_orders(
    caller: AgentCaller,
    body: RenewRequest,
    sink: OrderSinkDep,
    settings: SettingsDep,
    clock: ClockDep,
) -> Response:
    """For each order: leased to `agent` for KVP_ORDER_LEASE_SECONDS more (`renewed`; a started
    order needs no lease and is renewed as it is), or `lost` (done, cancelled, expired, unknown,
    or leased to another agent after this one's lease ran out): the agent must not start a lost
    order. An agent renews what it holds a third of a lease apart, so a long transfer, or orders
    waiting behind one, are not handed to a second agent."""
    refused = _refusal(caller, body.instance_id, body.agent)
    if refused is not None:
        return refused
    if not isinstance(sink, PullQueue):
        return _not_pull(settings, "POST /v1/orders/renew")
    renewed, lost = sink.renew(body.instance_id, body.agent, body.order_ids, clock.now())
    return Response(
        RenewResponse(
            renewed=renewed, lost=lost, lease_seconds=sink.lease_seconds
        ).model_dump_json(),
        media_type="application/json",
    )
