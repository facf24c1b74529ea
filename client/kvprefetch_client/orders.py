"""Orders to the tier transfer layer, in the vocabulary the real ones speak.

LMCache, Mooncake Store and Dynamo's block manager all understand three things: move blocks to a
place before they are needed (*prefetch*), keep blocks where they are for a while (*pin* with a
time-to-live), and let blocks go first (*demote*). An order is one of those, for a set of blocks
at one destination, with the times that make it useful: start moving by `start_by_ts` so the last
byte lands by `needed_by_ts`, and (a prefetch) hold the landed blocks for `ttl_seconds`.

An order's id is its identity everywhere (sinks, agents, progress events): delivering or
executing the same id twice is the same as once. A `Cancel` withdraws an order an agent has not
started; a prefetch already moving finishes, and its bytes count as wasted. A pin or demote
already carried out is undone by its Cancel where the tier can: a pin's Cancel means "release it
now" (not at its TTL's end), a demote's "put its blocks back in LRU order". The service sends
those when the LRU guard turns an instance's advice off (app/decide/guard.py): what lost to LRU
there must not outlive the verdict.

The JSON form (`to_json`/`from_json`) is what sinks carry and agents read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from kvprefetch_client.events import MAX_BYTES, BlockHash, Ident, InstanceId, Tier

OrderKind = Literal["prefetch", "pin", "demote"]

MAX_BLOCKS_PER_ORDER = 100_000


class Order(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["order"] = "order"
    order_id: Ident
    kind: OrderKind
    instance_id: InstanceId
    # Where the blocks are to be (prefetch), or are (pin, demote).
    tier: Tier = "hbm"
    # Where a prefetch reads from; None for pin and demote.
    source_tier: Tier | None = None
    block_hashes: Annotated[list[BlockHash], Field(min_length=1, max_length=MAX_BLOCKS_PER_ORDER)]
    # Bytes still to move for a prefetch (blocks already there or on their way are not counted);
    # the bytes pinned or demoted otherwise.
    size_bytes: Annotated[int, Field(ge=0, le=MAX_BYTES)]
    created_ts: float
    start_by_ts: float
    needed_by_ts: float
    # How long a pin holds; for a prefetch, how long the landed blocks are held (pinned) for the
    # return they were fetched for, so another prefetch does not evict them first. None for demote.
    ttl_seconds: Annotated[float, Field(gt=0)] | None = None
    # Expected stall seconds the order saves (its value); higher goes first.
    priority: float = 0.0
    # The sessions it serves: a shared prefix serves many, and is ordered once.
    session_ids: list[Ident] = Field(default_factory=list)

    @model_validator(mode="after")
    def _fields_fit_kind(self) -> Order:
        if self.kind == "prefetch" and self.source_tier is None:
            raise ValueError("a prefetch names its source_tier")
        if self.kind == "pin" and self.ttl_seconds is None:
            raise ValueError("a pin has a ttl_seconds")
        if self.kind == "demote" and self.ttl_seconds is not None:
            raise ValueError("a demote has no ttl_seconds")
        if self.start_by_ts > self.needed_by_ts:
            raise ValueError("start_by_ts is after needed_by_ts")
        return self

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


class Cancel(BaseModel):
    """Withdraw an order not yet started, or undo a pin (released now) or demote (its blocks
    back in LRU order) carried out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["cancel"] = "cancel"
    order_id: Ident
    reason: str = ""

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()


Message = Annotated[Order | Cancel, Field(discriminator="type")]
message_adapter: TypeAdapter[Order | Cancel] = TypeAdapter(Message)


def from_json(data: bytes | str) -> Order | Cancel:
    """An Order or a Cancel from its JSON form; raises pydantic.ValidationError otherwise."""
    return message_adapter.validate_json(data)


def order_id_for(
    kind: OrderKind, instance_id: str, tier: str, block_hashes: Sequence[BlockHash], generation: int
) -> str:
    """A deterministic id: the same plan for the same blocks gets the same id, so a retry (by
    the scheduler or a sink) is recognisably the same order. `generation` tells apart a later
    order for the same blocks after the earlier one ended."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{kind}|{instance_id}|{tier}|".encode())
    for h in block_hashes:
        digest.update(str(h).encode())
        digest.update(b",")
    return f"{kind}-{digest.hexdigest()}-{generation}"
