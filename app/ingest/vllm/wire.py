"""vLLM's KV-event stream on the wire: where the publishers are, and one message into one event.

A publisher (vllm/distributed/kv_events.py ZmqEventPublisher) sends three ZMQ frames per batch:
topic, sequence number (8 bytes big-endian, from 0 each time the engine starts), and msgpack
`[ts, events, data_parallel_rank]`. Events are maps with a "type" key (vLLM since PR #42892) or
positional arrays (before); block hashes are 64-bit ints, or raw bytes (written here as hex, a
BlockHash string). A batch becomes one `vllm_kv_events` event, which the ingestor logs and applies
like any posted one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import TypeAdapter, ValidationError

from app.core.errors import KvpError
from kvprefetch_client.events import SessionId, VllmKvEvents

SEQ_BYTES = 8
# The replay socket's end-of-replay marker: -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MAX_INSTANCE_ID_CHARS = 64  # so that an event id (below) stays within its 128 characters

# Why a message was refused (the `reason` label of kvprefetch_vllm_bad_input_total): bounded.
FRAMES = "frames"  # not 3 frames, or a sequence number that is not 8 bytes
MSGPACK = "msgpack"  # the payload is not msgpack
SHAPE = "shape"  # not [ts, events, data_parallel_rank], or an event neither a map nor an array
EVENT_TYPE = "event_type"  # an event type vLLM does not send
HASH = "hash"  # a block hash that is neither an int nor bytes
FIELD = "field"  # any other field out of bounds (ts, block size, session id, ...)
REPLAY = "replay"  # a replay answer of the wrong shape
# A BlockStored's session_id that is no valid session id (SessionId): the batch is taken without
# it, since a request's session identity must not cost the engine's block residency.
SESSION_ID = "session_id"
NESTING = "nesting"  # msgpack nested deeper than the decoder goes (a RecursionError)
ERROR = "error"  # any other exception while decoding: the message is refused, the stream goes on
APPLY = "apply"  # a decoded batch whose delivery (the ingest) raised for it alone
BAD_INPUT_REASONS = (
    FRAMES,
    MSGPACK,
    SHAPE,
    EVENT_TYPE,
    HASH,
    FIELD,
    REPLAY,
    SESSION_ID,
    NESTING,
    ERROR,
    APPLY,
)


class BadInput(KvpError):
    """A message refused, with its reason (one of BAD_INPUT_REASONS)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class VllmEndpoint:
    """One publisher: an engine's data-parallel rank, its PUB endpoint and its replay endpoint."""

    instance_id: str
    rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @property
    def name(self) -> str:
        """How logs name it: `gpu-0` or `gpu-0/dp1`."""
        return self.instance_id if self.rank == 0 else f"{self.instance_id}/dp{self.rank}"


_INSTANCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/\s]+):(?P<port>\d{1,5})$")


def _offset(endpoint: str, rank: int) -> str:
    """vLLM's own rule (ZmqEventPublisher.offset_endpoint_port): rank r publishes on port + r."""
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    m = _TCP.match(endpoint)
    assert m is not None  # checked by parse_endpoints
    return f"tcp://{m['host']}:{int(m['port']) + rank}"


def parse_endpoints(text: str) -> list[VllmEndpoint]:
    """`gpu-0=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,dp=2 gpu-1=tcp://...`.

    Entries are separated by spaces, newlines or `;`; each is `instance_id=endpoint` then options
    after commas: `replay=endpoint` (vLLM's replay_endpoint), `dp=N` (data-parallel ranks: rank r
    publishes on both ports + r), `topic=T` (subscribe to that topic only). Raises ValueError
    naming the entry at fault."""
    out: list[VllmEndpoint] = []
    seen: set[tuple[str, int]] = set()
    for entry in re.split(r"[\s;]+", text.strip()):
        if not entry:
            continue
        head, *options = entry.split(",")
        instance_id, sep, endpoint = head.partition("=")
        if not sep or not _INSTANCE.match(instance_id) or len(instance_id) > MAX_INSTANCE_ID_CHARS:
            raise ValueError(
                f"{entry!r}: expected instance_id=tcp://host:port (an instance id of letters, "
                f"digits and _.:-, at most {MAX_INSTANCE_ID_CHARS} characters)"
            )
        replay: str | None = None
        ranks, topic = 1, ""
        for option in options:
            key, sep, value = option.partition("=")
            if not sep:
                raise ValueError(f"{entry!r}: option {option!r} is not key=value")
            if key == "replay":
                replay = value
            elif key == "dp":
                if not value.isdigit() or not 1 <= int(value) <= 1024:
                    raise ValueError(f"{entry!r}: dp must be a number of ranks, 1 to 1024")
                ranks = int(value)
            elif key == "topic":
                topic = value
            else:
                raise ValueError(f"{entry!r}: unknown option {key!r} (replay, dp, topic)")
        for url in (endpoint, replay):
            if url is not None and not (_TCP.match(url) or url.startswith(("ipc://", "inproc://"))):
                raise ValueError(f"{entry!r}: {url!r} is not tcp://host:port, ipc:// or inproc://")
        for rank in range(ranks):
            if (instance_id, rank) in seen:
                raise ValueError(f"{entry!r}: instance {instance_id!r} is listed twice")
            seen.add((instance_id, rank))
            out.append(
                VllmEndpoint(
                    instance_id,
                    rank,
                    _offset(endpoint, rank),
                    _offset(replay, rank) if replay is not None else None,
                    topic,
                )
            )
    return out


def event_id(instance_id: str, rank: int, seq: int, ts: float) -> str:
    """The batch's event id: the same for the same batch however often it comes (a replay resends
    the very bytes), different for a restarted engine's batch of the same sequence number (its
    sequence starts again from 0, its ts is later)."""
    return f"vllm:{instance_id}:{rank}:{seq}:{ts!r}"


_decode = msgspec.msgpack.Decoder().decode
_session_id: TypeAdapter[str] = TypeAdapter(SessionId)
_ARRAY_HASH_FIELDS = (1, 2)  # block_hashes, parent_block_hash in the positional encoding


def _hash(h: Any) -> Any:
    if type(h) is int:
        return h
    if type(h) is bytes:
        return h.hex()
    raise BadInput(HASH, f"a block hash is {type(h).__name__}, neither an int nor bytes")


def _hashes(hs: Any) -> Any:
    if type(hs) is not list:
        raise BadInput(SHAPE, f"block_hashes is {type(hs).__name__}, not an array")
    if all(type(h) is int for h in hs):
        return hs
    return [_hash(h) for h in hs]


def _session_id_ok(value: Any) -> bool:
    try:
        _session_id.validate_python(value)
    except ValidationError:
        return False
    return True


def _normalise(event: Any, refused: list[str]) -> Any:
    """Bytes hashes to hex, in place, and an invalid session_id dropped (its text appended to
    `refused`); the shape is left to the model's validation."""
    if type(event) is dict:
        if "block_hashes" in event:
            event["block_hashes"] = _hashes(event["block_hashes"])
        parent = event.get("parent_block_hash")
        if parent is not None:
            event["parent_block_hash"] = _hash(parent)
        session_id = event.get("session_id")
        if session_id is not None and not _session_id_ok(session_id):
            refused.append(repr(session_id)[:80])
            event["session_id"] = None
    elif type(event) is list:
        if len(event) > 1:
            event[1] = _hashes(event[1])
        if len(event) > 2 and event[0] == "BlockStored" and event[2] is not None:
            event[2] = _hash(event[2])
    else:
        raise BadInput(SHAPE, f"an event is {type(event).__name__}, neither a map nor an array")
    return event


def _reason_of(exc: ValidationError) -> str:
    for err in exc.errors():
        if err["type"] in ("union_tag_invalid", "union_tag_not_found") or (
            err["type"] == "value_error" and "unknown vLLM KV event" in err["msg"]
        ):
            return EVENT_TYPE
    for err in exc.errors():
        if any(part in ("block_hashes", "parent_block_hash") for part in err["loc"]):
            return HASH
    return FIELD


def decode_batch(
    endpoint: VllmEndpoint, seq: int, payload: bytes, dropped: list[str] | None = None
) -> VllmKvEvents:
    """One publisher's message (its sequence number and payload) as a vllm_kv_events event.
    Session ids that are no valid session id are dropped, and listed in `dropped` when given.

    Raises BadInput."""
    try:
        batch = _decode(payload)
    except msgspec.DecodeError as exc:
        raise BadInput(MSGPACK, f"the payload is not msgpack: {exc}") from None
    if type(batch) is not list or not 2 <= len(batch) <= 3 or type(batch[1]) is not list:
        raise BadInput(SHAPE, "the payload is not [ts, events, data_parallel_rank]")
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    if type(ts) is int:
        ts = float(ts)
    if type(ts) is not float:
        raise BadInput(SHAPE, f"the batch's ts is {type(ts).__name__}, not a number")
    if rank is not None and rank != endpoint.rank:
        raise BadInput(
            FIELD,
            f"the batch says data_parallel_rank {rank!r}; this publisher is rank {endpoint.rank}",
        )
    refused: list[str] = dropped if dropped is not None else []
    for e in events:
        _normalise(e, refused)
    try:
        return VllmKvEvents.model_validate(
            {
                "event_id": event_id(endpoint.instance_id, endpoint.rank, seq, ts),
                "ts": ts,
                "instance_id": endpoint.instance_id,
                "events": events,
                "data_parallel_rank": endpoint.rank,
            }
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadInput(_reason_of(exc), f"{where}: {first['msg']}") from None


def split_live(frames: list[bytes]) -> tuple[int, bytes]:
    """A live message's (sequence number, payload). Raises BadInput."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        raise BadInput(
            FRAMES, f"expected 3 frames (topic, 8-byte sequence, payload), got {len(frames)}"
        )
    return int.from_bytes(frames[1], "big"), frames[2]


def split_replayed(frames: list[bytes]) -> tuple[int, bytes] | None:
    """A replay answer, as a DEALER reads it: `["", topic, seq, payload]` (some builds leave the
    topic out). Its (sequence number, payload); None for the end marker. Raises BadInput."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2 or len(frames[0]) != SEQ_BYTES:
        raise BadInput(REPLAY, f"a replay answer of {len(frames)} frames")
    if frames[0] == END_SEQ:
        return None
    return int.from_bytes(frames[0], "big"), frames[1]
