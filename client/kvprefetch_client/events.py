"""The events kvprefetch accepts: one pydantic model per `type`, joined in a discriminated union.

Routers report requests, engines report where KV blocks live, transfer agents report how orders
went. Every event carries a client-chosen `event_id` (a resend with the same id is acknowledged
and ignored) and `ts`, the time the thing happened, in seconds. State follows `ts`, not arrival
order (see app/state/).
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    TypeAdapter,
    field_validator,
    model_validator,
)

# Bounds that reject absurd input with a clear message instead of corrupting state.
MAX_TS_SECONDS = 1e11  # year 5138: anything later is a unit mistake (ms sent as s)
MAX_TOKENS = 10_000_000
MAX_BLOCKS_PER_EVENT = 65_536
MAX_BYTES = 2**53  # exact in a JSON double
MAX_SECONDS = 1e7

# Numbers are strict on the wire: a JSON int for an int (no "10", no true, no 10.0), a JSON
# number for a float. So a batch logged as posted holds exactly the values validated. The log's
# reader validates with strict=False, to read what older, lenient versions logged.
StrictInt = Annotated[int, Strict()]
StrictFloat = Annotated[float, Strict()]

EventId = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Ident = Annotated[str, StringConstraints(min_length=1, max_length=256)]


# GET /v1/sessions/{session_id} must reach every session accepted: a path segment holds no "/",
# clients resolve "." and ".." away before sending, and control characters do not travel. A
# pattern (Rust regex, inside pydantic-core) costs nothing measurable; a Python validator cost
# a third of the parse of 1000 ids.
SESSION_ID_PATTERN = r"^(?:[^/.\p{Cc}]|\.[^/.\p{Cc}]|\.\.[^/\p{Cc}])[^/\p{Cc}]*$"
SessionId = Annotated[
    str, StringConstraints(min_length=1, max_length=256, pattern=SESSION_ID_PATTERN)
]
# An instance id is shown verbatim (GET /v1/instances, the dashboard, logs, order routes): no
# control characters, so no id can forge a line or a terminal escape there. The control
# characters (\p{Cc}) spelled as ranges: the OpenAPI's pattern is read by generators too.
INSTANCE_ID_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]+$"
InstanceId = Annotated[
    str, StringConstraints(min_length=1, max_length=256, pattern=INSTANCE_ID_PATTERN)
]
Timestamp = Annotated[StrictFloat, Field(ge=0, le=MAX_TS_SECONDS, allow_inf_nan=False)]
Tokens = Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS)]
BlockTokens = Annotated[StrictInt, Field(ge=1, le=1_048_576)]
# vLLM's ExternalBlockHash is bytes or int; over JSON that is an int or a (hex) string.
BlockHash = (
    Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]
    | Annotated[str, StringConstraints(min_length=1, max_length=128)]
)
BlockHashes = Annotated[list[BlockHash], Field(max_length=MAX_BLOCKS_PER_EVENT)]

# Where KV can live: a GPU's HBM, its host's DRAM, its local disk, or the shared pool
# (a memory pool or object store every instance can read).
Tier = Literal["hbm", "host", "disk", "pool"]
SHARED_TIERS: frozenset[str] = frozenset({"pool"})


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: EventId
    ts: Timestamp


class RequestRouted(_Event):
    """A router sent a request of a session to an instance."""

    type: Literal["request_routed"] = "request_routed"
    session_id: SessionId
    request_id: Ident
    instance_id: InstanceId
    prompt_tokens: Tokens
    # The prompt's prefix-chained block hashes, oldest first, if the router knows them.
    block_hashes: BlockHashes | None = None
    block_tokens: BlockTokens | None = None


class RequestStarted(_Event):
    """The instance's GPU began the request (prefill started)."""

    type: Literal["request_started"] = "request_started"
    session_id: SessionId
    request_id: Ident
    instance_id: InstanceId


class RequestFinished(_Event):
    """The request finished; `context_tokens` is what the session now holds (prompt + output)."""

    type: Literal["request_finished"] = "request_finished"
    session_id: SessionId
    request_id: Ident
    instance_id: InstanceId
    output_tokens: Tokens
    context_tokens: Tokens | None = None
    block_hashes: BlockHashes | None = None
    block_tokens: BlockTokens | None = None


class SessionClosed(_Event):
    """The conversation ended (the user closed it, or the router gave up on it)."""

    type: Literal["session_closed"] = "session_closed"
    session_id: SessionId


class _Located(_Event):
    tier: Tier = "hbm"
    # Which instance's tier; omitted for the shared pool.
    instance_id: InstanceId | None = None

    @model_validator(mode="after")
    def _location_is_complete(self) -> _Located:
        if self.tier in SHARED_TIERS:
            if self.instance_id is not None:
                raise ValueError(f"tier {self.tier!r} is shared: leave instance_id out")
        elif self.instance_id is None:
            raise ValueError(f"instance_id is required for tier {self.tier!r}")
        return self


class KvBlocksStored(_Located):
    type: Literal["kv_blocks_stored"] = "kv_blocks_stored"
    block_hashes: Annotated[BlockHashes, Field(min_length=1)]
    parent_block_hash: BlockHash | None = None
    block_tokens: BlockTokens | None = None
    # The blocks' tokens, in order, when the engine reports them (vLLM's BlockStored does): a tier
    # keyed by tokens rather than block hashes (LMCache) needs them to fetch a context.
    token_ids: Annotated[list[StrictInt], Field(max_length=MAX_TOKENS)] | None = None
    # The session whose context these blocks extend (vLLM's BlockStored `session_id`): in HBM,
    # they join that session's context after their parent (a session the router started only).
    session_id: SessionId | None = None


class KvBlocksRemoved(_Located):
    type: Literal["kv_blocks_removed"] = "kv_blocks_removed"
    block_hashes: Annotated[BlockHashes, Field(min_length=1)]


class KvBlocksCleared(_Located):
    """Every block at the location is gone (an engine restart, vLLM's AllBlocksCleared)."""

    type: Literal["kv_blocks_cleared"] = "kv_blocks_cleared"


# vLLM's own KV event structs (vllm/distributed/kv_events.py), field names kept as they are.
# msgspec encodes them tagged by class name; older releases encoded them as arrays.
_VLLM_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
# vLLM's medium names for where a block lives, mapped to our tiers.
VLLM_MEDIUM_TIERS: dict[str, Tier] = {
    "GPU": "hbm",
    "CPU": "host",
    "STORAGE": "disk",
    "DISK": "disk",
}


class _VllmEvent(BaseModel):
    # vLLM adds fields over time (group_idx, extra_keys, ...): tolerate the ones we don't use.
    # They are dropped, never logged: a batch holding vLLM events is logged re-encoded
    # (app/ingest/ingestor.py).
    model_config = ConfigDict(extra="ignore", frozen=True)


def _vllm_from_array(data: Any) -> Any:
    """["BlockStored", hashes, parent, ...] (msgspec array_like) -> the tagged object form."""
    if isinstance(data, list) and data and isinstance(data[0], str):
        names = _VLLM_FIELDS.get(data[0])
        if names is None:
            raise ValueError(f"unknown vLLM KV event {data[0]!r}")
        if len(data) - 1 > len(names):
            raise ValueError(f"{data[0]} has at most {len(names)} fields")
        return {"type": data[0], **dict(zip(names, data[1:]))}
    return data


def _tier_of_medium(medium: str | None) -> Tier:
    if medium is None:
        return "hbm"
    return VLLM_MEDIUM_TIERS.get(medium.upper(), "host")


class VllmBlockStored(_VllmEvent):
    type: Literal["BlockStored"]
    block_hashes: Annotated[BlockHashes, Field(min_length=1)]
    parent_block_hash: BlockHash | None = None
    token_ids: list[StrictInt] = Field(default_factory=list, max_length=MAX_TOKENS)
    block_size: BlockTokens
    lora_id: StrictInt | None = None
    medium: Annotated[str, StringConstraints(max_length=32)] | None = None
    # The OpenAI request's stable session identity, when the request carried one: the session of
    # the router's events (session_id) whose context these blocks hold.
    session_id: SessionId | None = None


class VllmBlockRemoved(_VllmEvent):
    type: Literal["BlockRemoved"]
    block_hashes: Annotated[BlockHashes, Field(min_length=1)]
    medium: Annotated[str, StringConstraints(max_length=32)] | None = None


class VllmAllBlocksCleared(_VllmEvent):
    type: Literal["AllBlocksCleared"]


VllmKvEvent = Annotated[
    Annotated[
        VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared, Field(discriminator="type")
    ],
    BeforeValidator(_vllm_from_array),
]


class VllmKvEvents(_Event):
    """One vLLM KVEventBatch from one instance, as its ZMQ publisher emits it.

    `ts` is the batch's own ts. The batch is translated into kv_blocks_* changes by `expand()`.
    """

    type: Literal["vllm_kv_events"] = "vllm_kv_events"
    instance_id: InstanceId
    events: Annotated[list[VllmKvEvent], Field(max_length=MAX_BLOCKS_PER_EVENT)]
    data_parallel_rank: StrictInt | None = None

    def expand(self) -> tuple[KvBlocksStored | KvBlocksRemoved | KvBlocksCleared, ...]:
        """The batch as kv_blocks_* events, built once: the store, the outcomes and the
        scheduler's feedback each read it, per batch of vLLM's intake (a tuple: shared)."""
        return self.kv_block_events

    # Outside the fields (pydantic ignores a cached_property; equality compares fields only).
    @cached_property
    def kv_block_events(self) -> tuple[KvBlocksStored | KvBlocksRemoved | KvBlocksCleared, ...]:
        out: list[KvBlocksStored | KvBlocksRemoved | KvBlocksCleared] = []
        for i, e in enumerate(self.events):
            sub_id = f"{self.event_id}#{i}"
            if isinstance(e, VllmBlockStored):
                out.append(
                    KvBlocksStored(
                        event_id=sub_id,
                        ts=self.ts,
                        tier=_tier_of_medium(e.medium),
                        instance_id=self.instance_id,
                        block_hashes=e.block_hashes,
                        parent_block_hash=e.parent_block_hash,
                        block_tokens=e.block_size,
                        token_ids=e.token_ids or None,
                        session_id=e.session_id,
                    )
                )
            elif isinstance(e, VllmBlockRemoved):
                out.append(
                    KvBlocksRemoved(
                        event_id=sub_id,
                        ts=self.ts,
                        tier=_tier_of_medium(e.medium),
                        instance_id=self.instance_id,
                        block_hashes=e.block_hashes,
                    )
                )
            else:
                # vLLM clears its GPU prefix cache; other tiers are reported by their owners.
                out.append(
                    KvBlocksCleared(
                        event_id=sub_id, ts=self.ts, tier="hbm", instance_id=self.instance_id
                    )
                )
        return tuple(out)


class InstanceStatus(_Event):
    """An instance's load, as its engine or the router sees it."""

    type: Literal["instance_status"] = "instance_status"
    instance_id: InstanceId
    free_kv_bytes: Annotated[StrictInt, Field(ge=0, le=MAX_BYTES)]
    total_kv_bytes: Annotated[StrictInt, Field(ge=0, le=MAX_BYTES)] | None = None
    queue_depth: Annotated[StrictInt, Field(ge=0, le=1_000_000)] = 0
    running_requests: Annotated[StrictInt, Field(ge=0, le=1_000_000)] = 0

    @model_validator(mode="after")
    def _free_within_total(self) -> InstanceStatus:
        if self.total_kv_bytes is not None and self.free_kv_bytes > self.total_kv_bytes:
            raise ValueError("free_kv_bytes exceeds total_kv_bytes")
        return self


# The kinds a deployment most often has; any other short name is accepted too (a deployment's own
# kinds), and the model learns each kind's reliability and lead from the logs.
SIGNAL_KINDS: tuple[str, ...] = ("opened", "typing", "tool_started", "tool_finished", "queued")
SignalKind = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_.:-]*$")
]


class SessionSignal(_Event):
    """Something that usually comes before a session's next request, seconds before it exists.

    A chat front end sends `opened` when the user reopens the conversation and `typing` when they
    type; an agent framework sends `tool_started` (with the `tool`) and `tool_finished`; a router
    or gateway sends `queued` when it admits a request before an instance is free (with the
    `instance_id` it will go to). A signal is a hint, never a promise: the model learns from the
    logs how often each kind is followed by a request, and how soon.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "type": "session_signal",
                    "event_id": "sig-7f3a",
                    "ts": 1767000000.25,
                    "session_id": "agent-run-42",
                    "kind": "tool_started",
                    "tool": "web.search",
                    "expected_in_seconds": 4.0,
                }
            ]
        }
    )

    type: Literal["session_signal"] = "session_signal"
    session_id: SessionId
    kind: SignalKind
    tool: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None
    # Where the next request will go, when the sender knows (a router's `queued`).
    instance_id: InstanceId | None = None
    # The sender's own estimate, when it has one: the request in this many seconds, this big.
    expected_in_seconds: (
        Annotated[StrictFloat, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)] | None
    ) = None
    expected_prompt_tokens: Tokens | None = None


OrderStatus = Literal["accepted", "completed", "failed"]


class OrderProgress(_Event):
    """A transfer agent's report on a prefetch order."""

    type: Literal["order_progress"] = "order_progress"
    order_id: Ident
    status: OrderStatus
    bytes: Annotated[StrictInt, Field(ge=0, le=MAX_BYTES)] | None = None
    seconds: Annotated[StrictFloat, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)] | None = None
    reason: Annotated[str, StringConstraints(max_length=1024)] | None = None

    @field_validator("reason")
    @classmethod
    def _strip(cls, v: str | None) -> str | None:
        return v.strip() if v is not None else None

    @model_validator(mode="after")
    def _fields_fit_status(self) -> OrderProgress:
        if self.status == "completed" and (self.bytes is None or self.seconds is None):
            raise ValueError("a completed order reports bytes and seconds")
        if self.status == "failed" and not self.reason:
            raise ValueError("a failed order reports a reason")
        return self


ModelSlot = Literal["serving", "shadow"]
# loaded: a model put in the slot (at startup, a reload, a shadow set); promoted: the shadow moved
# to serving; rolled_back: the model serving before the last promote or reload serves again;
# cleared: the shadow removed.
ModelAction = Literal["loaded", "promoted", "rolled_back", "cleared"]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class ModelChanged(_Event):
    """The service changed the model in a slot: written to the event log by the service itself
    (app/predict/lifecycle.py), so every outcome after `ts` can be joined to the model that
    served it. It changes no session's state. `model_dir` is the model's directory relative to
    the models root; the hashes are app.core.bundle.model_identity's (None: the heuristic)."""

    type: Literal["model_changed"] = "model_changed"
    slot: ModelSlot
    action: ModelAction
    version: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    model_dir: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = None
    card_sha256: Sha256 | None = None
    model_sha256: Sha256 | None = None

    @model_validator(mode="after")
    def _action_fits_slot(self) -> ModelChanged:
        if self.action == "cleared":
            if self.slot != "shadow":
                raise ValueError("only the shadow slot is cleared")
            if self.version is not None or self.model_dir is not None:
                raise ValueError("a cleared slot holds no model: leave version and model_dir out")
        elif self.action in ("promoted", "rolled_back") and self.slot != "serving":
            raise ValueError(f"{self.action} names the serving slot")
        return self


Event = Annotated[
    RequestRouted
    | RequestStarted
    | RequestFinished
    | SessionClosed
    | SessionSignal
    | KvBlocksStored
    | KvBlocksRemoved
    | KvBlocksCleared
    | VllmKvEvents
    | InstanceStatus
    | OrderProgress
    | ModelChanged,
    Field(discriminator="type"),
]

# What the service writes about itself into its log, for the log's readers: deduplicated and
# logged like any event, but it is no traffic: it changes no state, moves no window (the store's
# newest ts), and the ingest observers never hear of it.
RECORD_EVENT_TYPES: frozenset[str] = frozenset({"model_changed"})

EVENT_TYPES: tuple[str, ...] = (
    "request_routed",
    "request_started",
    "request_finished",
    "session_closed",
    "session_signal",
    "kv_blocks_stored",
    "kv_blocks_removed",
    "kv_blocks_cleared",
    "vllm_kv_events",
    "instance_status",
    "order_progress",
    "model_changed",
)


class EventBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    events: list[Event]


event_adapter: TypeAdapter[Event] = TypeAdapter(Event)
batch_adapter: TypeAdapter[EventBatch] = TypeAdapter(EventBatch)
