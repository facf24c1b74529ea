"""Read the live state: sessions, instances, block residency.

The handlers are async so they run on the event loop, the thread that applies events: a read
never sees a half-applied batch of the in-memory store. With the Redis store (whose batches are
atomic in Redis) they read on a worker thread instead (app/state/storethread.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel, Field

from app.api.deps import StoreDep, StoreThreadDep
from app.api.errors import Error, error_response
from app.state.base import InstanceView, LocationView, SessionView


def validation_error(request: Request, error: dict[str, Any]) -> Response:
    """A bad path or query parameter, named (app/api/errors.py answers with it)."""
    name = str(error["loc"][-1])
    return error_response(422, name, f"the {error['loc'][0]} parameter {name}: {error['msg']}")


router = APIRouter(tags=["state"])

# The most instances (locations) one page of GET /v1/instances (/v1/locations) answers: a page
# costs its own instances (locations) only.
MAX_INSTANCES_PAGE = 1000
MAX_LOCATIONS_PAGE = 1000


class InstancesResponse(BaseModel):
    instances: list[InstanceView] = Field(description="Up to `limit` instances, by id")
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null: this was the last"
    )


class LocationsResponse(BaseModel):
    locations: list[LocationView] = Field(description="Up to `limit` locations, by name")
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null: this was the last"
    )


@router.get(
    "/sessions/{session_id}",
    response_model=SessionView,
    responses={
        404: {"model": Error, "description": "No event has named this session."},
        422: {"model": Error, "description": "The session id is longer than 256 characters."},
    },
)
async def get_session(
    session_id: Annotated[str, Path(min_length=1, max_length=256)],
    store: StoreDep,
    store_thread: StoreThreadDep,
) -> SessionView | Response:
    view = await store_thread.read(store.session, session_id)
    if view is None:
        return error_response(404, "session_id", f"session {session_id!r} is not known")
    return view


@router.get(
    "/instances",
    response_model=InstancesResponse,
    responses={422: {"model": Error, "description": "`limit` or `cursor` is out of range."}},
)
async def get_instances(
    store: StoreDep,
    store_thread: StoreThreadDep,
    limit: Annotated[
        int, Query(ge=1, le=MAX_INSTANCES_PAGE, description="The most instances to answer")
    ] = 100,
    cursor: Annotated[
        str | None,
        Query(min_length=1, max_length=256, description="The previous page's `next_cursor`"),
    ] = None,
) -> InstancesResponse:
    """Instances by id, a page at a time: each one's last status and the blocks and bytes it holds
    per tier. Follow `next_cursor` until it is null."""
    # One more than asked: is there a next page?
    page = await store_thread.read(lambda: store.instances(after=cursor, limit=limit + 1))
    more = len(page) > limit
    page = page[:limit]
    return InstancesResponse(instances=page, next_cursor=page[-1].instance_id if more else None)


@router.get(
    "/locations",
    response_model=LocationsResponse,
    responses={422: {"model": Error, "description": "`limit` or `cursor` is out of range."}},
)
async def get_locations(
    store: StoreDep,
    store_thread: StoreThreadDep,
    limit: Annotated[
        int, Query(ge=1, le=MAX_LOCATIONS_PAGE, description="The most locations to answer")
    ] = 100,
    cursor: Annotated[
        str | None,
        Query(min_length=1, max_length=512, description="The previous page's `next_cursor`"),
    ] = None,
) -> LocationsResponse:
    """Locations by name (`hbm@gpu-0`, `host@gpu-0`, `pool`), a page at a time: the blocks and
    bytes each holds, each block counted once however many sessions use it. Follow
    `next_cursor` until it is null."""
    page = await store_thread.read(lambda: store.locations(after=cursor, limit=limit + 1))
    more = len(page) > limit
    page = page[:limit]
    return LocationsResponse(locations=page, next_cursor=page[-1].location if more else None)
