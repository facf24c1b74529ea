"""GET /v1/orders: transfer agents pull their instance's orders from the pull sink."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel

from app.api.deps import ClockDep, OrderSinkDep, SettingsDep
from app.api.errors import Error, error_response, field_error_route
from app.engine.orders import Order
from app.engine.sinks import PullQueue

MAX_LIMIT = 1000


def _query_error(request: Request, error: dict[str, Any]) -> Response:
    """A bad query parameter, named."""
    name = str(error["loc"][-1])
    message = (f"the query parameter {name} is required" if error["type"] == "missing"
               else f"{name}: {error['msg']}")
    return error_response(422, name, message)


router = APIRouter(tags=["orders"], route_class=field_error_route(_query_error))


class OrdersResponse(BaseModel):
    orders: list[Order]
    cancelled: list[str]


@router.get(
    "/orders",
    response_model=OrdersResponse,
    responses={409: {"model": Error, "description": "The configured order sink is not the pull queue."},
               422: {"model": Error, "description": "A query parameter is missing or out of range."}},
    summary="Lease an instance's pending orders",
)
async def get_orders(
    sink: OrderSinkDep,
    settings: SettingsDep,
    clock: ClockDep,
    instance_id: Annotated[str, Query(min_length=1, max_length=256,
                                      description="The instance whose orders to lease")],
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="The most orders to hand out")] = 100,
) -> Response:
    """Orders for the instance not leased yet or whose lease ran out (leased now for
    KVP_ORDER_LEASE_SECONDS; report `order_progress` `accepted` to keep them), and the ids of its
    orders cancelled since its last pull. Served only when KVP_ORDER_SINK is `pull`."""
    if not isinstance(sink, PullQueue):
        return error_response(409, "order_sink",
                              f"orders go to the {settings.order_sink} sink (KVP_ORDER_SINK); "
                              "GET /v1/orders serves only the pull sink (KVP_ORDER_SINK=pull)")
    lease = sink.lease(instance_id, limit, clock.now())
    return Response(lease.to_json(), media_type="application/json")
