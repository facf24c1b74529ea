"""Read the live state: sessions, instances, block residency.

The handlers are async so they run on the event loop, the thread that applies events: a read
never sees a half-applied batch of the in-memory store.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel

from app.api.deps import StoreDep
from app.engine.state.base import InstanceView, LocationView, SessionView

router = APIRouter(tags=["state"])


class InstancesResponse(BaseModel):
    instances: list[InstanceView]


class LocationsResponse(BaseModel):
    locations: list[LocationView]


@router.get("/sessions/{session_id}", response_model=SessionView,
            responses={404: {"description": "No event has named this session."}})
async def get_session(session_id: Annotated[str, Path(min_length=1, max_length=256)], store: StoreDep) -> SessionView:
    view = store.session(session_id)
    if view is None:
        raise HTTPException(404, detail=f"session {session_id!r} is not known")
    return view


@router.get("/instances", response_model=InstancesResponse)
async def get_instances(store: StoreDep) -> InstancesResponse:
    return InstancesResponse(instances=store.instances())


@router.get("/locations", response_model=LocationsResponse)
async def get_locations(store: StoreDep) -> LocationsResponse:
    """Every location that holds KV blocks, each block counted once however many sessions use it."""
    return LocationsResponse(locations=store.locations())
