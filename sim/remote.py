"""Replay against a running kvprefetch service (`kvprefetch replay --via URL`).

The same replay as sim.replay.replay(), but the engine is a service reached over HTTP: every
event the cluster emits is posted with kvprefetch_client.client.KvpClient, and the policies read
their sessions from GET /v1/sessions/{id}. Before each read the client is flushed, so the service
has applied every event emitted so far and a policy decides on the same state as in process; an
over-HTTP replay therefore gives the same summary as an in-process one.

One service can take many replays (`--compare` runs one per policy): each run namespaces what it
posts with its run id, so runs neither collide nor mix their state. Event ids are
`<run_id>:<n>`; session, request and instance ids are `<run_id>:<id>`; block hashes (the
traces' ints, below 2**32) are `salt << 32 | hash`, the salt a 31-bit digest of the run id, so
the shared pool and every location hold each run's blocks apart and stay 64-bit ints. The views
the policies see are translated back: they are the ones an in-process replay would give.

Pacing (`--speed X`): by default events are posted as fast as the simulator emits them, stamped
with the trace's own times (seconds from its start). With a speed, the run plays as live traffic
X times faster than the trace: the event at trace time ts is posted at the wall-clock time
start + (ts - ts0) / X, where ts0 is the first event's time and start the moment it was
emitted, and stamped with the service's clock at that moment (GET /readyz says what it reads and
how fast it runs): the wall clock, or, for a service started with KVP_CLOCK_SPEED=S, a clock S
times faster. The service (its scoring loop, scheduler and dashboards) then sees a cluster
running now, each trace second lasting S / X of its seconds: with S = X it sees the trace's own
durations, as on live traffic. The session views read back are translated to trace time again
(up to float rounding), so the simulator's policies decide as in an unpaced run.

Whose decisions: with the simulator's policies (`none`, `learned`, ...) an over-HTTP replay takes
their inputs, the session views, from the service, and their decisions are carried out by the
simulator as in-process; the service's own scheduler plans too, but nobody carries its orders out.
With `--policy service` (sim/served.py) the simulated cluster is the service's transfer layer
instead: it pulls the service's orders (GET /v1/orders, `pull_orders` here), carries them out and
reports their progress (`post_progress`); orders and progress are translated between the run's
namespace and times and the service's as the events are.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import quote

import httpx
import orjson

from app.core.errors import KvpError
from app.state.base import SessionView
from kvprefetch_client.client import KvpClient
from kvprefetch_client.events import Event, event_adapter
from kvprefetch_client.orders import Order
from sim.replay import ReplayResult, replay

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from sim.scenario import Scenario
    from sim.traces import TraceRequest

__all__ = [
    "EventsRejected",
    "RemoteService",
    "RemoteServiceError",
    "RemoteStats",
    "ServiceUnreachable",
    "replay_via",
]

log = logging.getLogger("kvprefetch.sim.remote")

# The fields of an event that name something a run owns; each is namespaced with the run id.
_ID_FIELDS = ("session_id", "request_id", "instance_id", "order_id")
_SEPARATOR = ":"
_HASH_BITS = 32
_HASH_MASK = (1 << _HASH_BITS) - 1


class RemoteServiceError(KvpError):
    """A replay over HTTP cannot go on: the service is away, not ready, or refused events."""


class ServiceUnreachable(RemoteServiceError):
    """No kvprefetch service answers (or is ready) at the URL."""


class EventsRejected(RemoteServiceError):
    """The service refused events the simulator emitted; the message names the field and why."""


@dataclass(frozen=True, slots=True)
class RemoteStats:
    url: str
    run_id: str
    events_emitted: int
    events_posted: int  # acknowledged by the service (accepted, or a resend it already had)
    session_reads: int


def new_run_id() -> str:
    return f"sim-{uuid.uuid4().hex[:10]}"


def _block_salt(run_id: str) -> int:
    """A nonzero 31-bit digest of the run id: a salted hash stays below 2**63."""
    return (int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:4], "big") >> 1) | 1


class RemoteService:
    """sim.replay.ReplayBackend over HTTP: posts events to a service and reads its sessions back.

    Use it as a context manager (leaving flushes everything and checks it was taken), or call
    close(). The constructor checks GET /readyz and raises ServiceUnreachable when the service
    is not there or not ready.

    speed: post the events at this many times the trace's pace, stamped with the wall-clock time
    they are due (see the module's docstring); None: as fast as possible, with the trace's times.
    bytes_per_token: the scenario's; when given, the first session view is checked against it,
    since a service configured otherwise reports other context_bytes than an in-process replay.
    flush_every: emitted events between flushes when no policy reads sessions, so the client's
    queue stays bounded (it would drop events past max_queue_events) and errors surface early.
    transport: for tests, an httpx transport both the event client and the reads go through.
    """

    def __init__(
        self,
        url: str,
        *,
        run_id: str | None = None,
        bytes_per_token: int | None = None,
        keep_events: bool = False,
        timeout_seconds: float = 60.0,
        http_timeout_seconds: float = 10.0,
        flush_every: int = 5_000,
        speed: float | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if speed is not None and not 0 < speed < float("inf"):
            raise ValueError(f"speed {speed!r}: a positive number of times the trace's pace")
        self.url = url.rstrip("/")
        self.run_id = run_id or new_run_id()
        if _SEPARATOR in self.run_id or "/" in self.run_id or not 1 <= len(self.run_id) <= 64:
            raise ValueError(
                f"run_id {self.run_id!r}: 1 to 64 characters, no {_SEPARATOR!r} or '/'"
            )
        self.keep_events = keep_events
        self.events: list[Event] = []
        self._prefix = self.run_id + _SEPARATOR
        self._salt = _block_salt(self.run_id)
        self._bytes_per_token = bytes_per_token
        self._timeout = timeout_seconds
        self._flush_every = flush_every
        self._emitted = 0
        self._unchecked = 0  # emitted since the last flush
        self._reads = 0
        self._closed = False
        self._speed = speed
        self._clock_start: tuple[float, float, float] | None = (
            None  # first ts, the service's time then, its monotonic
        )
        # The service's clock, from GET /readyz: how fast it runs, and (when not the wall clock)
        # what it read at a wall-clock time.
        self._service_speed = 1.0
        self._service_ref: tuple[float, float] | None = None
        # Told of every event emitted, with the run's own ids (sim/served.py hears its landings).
        self.listeners: list[Callable[[str, float, dict[str, Any]], None]] = []
        self._http = httpx.Client(
            base_url=self.url, timeout=http_timeout_seconds, transport=transport
        )
        try:
            self._check_ready()
        except BaseException:
            self._http.close()
            raise
        self._client = KvpClient(
            self.url, timeout_seconds=http_timeout_seconds, transport=transport
        )
        log.info("replay run %s posts its events to %s", self.run_id, self.url)

    # -- sim.replay.ReplayBackend -----------------------------------------------------------------

    def emit(self, kind: str, ts: float, fields: dict[str, Any]) -> None:
        self._post(kind, ts, fields, _ID_FIELDS)
        for listener in self.listeners:
            listener(kind, ts, fields)

    def _post(self, kind: str, ts: float, fields: dict[str, Any], id_fields: Sequence[str]) -> None:
        """Post one event, `id_fields` namespaced with the run id, paced when the run is."""
        remote_ts = ts if self._speed is None else self._pace(ts)
        doc = {
            "type": kind,
            "event_id": self._remote(str(self._emitted)),
            "ts": remote_ts,
            **fields,
        }
        for key in id_fields:
            value = doc.get(key)
            if value is not None:
                doc[key] = self._remote(value)
        if doc.get("block_hashes") is not None:
            doc["block_hashes"] = [self._remote_block(h) for h in doc["block_hashes"]]
        if self.keep_events:  # as an in-process replay keeps them: the run's own ids
            self.events.append(
                event_adapter.validate_python(
                    {"type": kind, "event_id": f"sim-{self._emitted}", "ts": ts, **fields}
                )
            )
        self._client.send(doc)
        self._emitted += 1
        self._unchecked += 1
        if self._unchecked >= self._flush_every:
            self._sync()

    # -- the service's orders (sim/served.py) ------------------------------------------------

    @property
    def speed(self) -> float | None:
        return self._speed

    @property
    def trace_seconds_per_service_second(self) -> float:
        """How long one of the service's seconds is in the trace (paced runs: X / the service's
        clock speed; 1 unpaced)."""
        return 1.0 if self._speed is None else self._speed / self._service_speed

    def pull_orders(self, instance_id: str, limit: int = 100) -> tuple[list[Order], list[str]]:
        """Lease the service's pending orders for one of the run's instances, as an agent does
        (GET /v1/orders, the pull sink): the orders in the run's own ids, blocks and times (a
        paced run's durations too: `ttl_seconds` x speed), and the ids of orders cancelled since
        the last pull. Order ids are the service's, unchanged: progress is reported with them."""
        params: dict[str, str | int] = {
            "instance_id": self._remote(instance_id),
            "limit": limit,
            "agent": self.run_id,
        }
        try:
            response = self._http.get("/v1/orders", params=params)
        except httpx.HTTPError as exc:
            raise ServiceUnreachable(
                f"GET {self.url}/v1/orders failed: {_describe_exception(exc)}"
            ) from exc
        if response.status_code == 409:
            raise RemoteServiceError(
                f"the service at {self.url} does not hand out orders to pull "
                f"({_describe_response(response)}): the service policy needs it started with "
                "KVP_ORDER_SINK=pull (the default)"
            )
        doc = _json(response.content)
        if response.status_code != 200 or not isinstance(doc, dict):
            raise RemoteServiceError(
                f"GET {self.url}/v1/orders answered {_describe_response(response)}"
            )
        orders = [self._local_order(Order.model_validate(o)) for o in doc.get("orders", [])]
        return orders, [str(c) for c in doc.get("cancelled", [])]

    def post_progress(self, ts: float, order_id: str, status: str, **fields: Any) -> None:
        """An order_progress event for one of the service's orders, its id as the service named
        it (the run's other ids are namespaced: `emit`)."""
        fields = {"order_id": order_id, "status": status, **fields}
        self._post("order_progress", ts, fields, ())
        for listener in self.listeners:
            listener("order_progress", ts, fields)

    def _local_order(self, order: Order) -> Order:
        """An order as the run's cluster names things: its instance, blocks and times."""
        scale = self.trace_seconds_per_service_second
        return order.model_copy(
            update={
                "instance_id": self._local(order.instance_id),
                "block_hashes": [self._local_block(h) for h in order.block_hashes],
                "created_ts": self._local_ts(order.created_ts),
                "start_by_ts": self._local_ts(order.start_by_ts),
                "needed_by_ts": self._local_ts(order.needed_by_ts),
                "ttl_seconds": None if order.ttl_seconds is None else order.ttl_seconds * scale,
                "session_ids": [self._local(s) for s in order.session_ids],
            }
        )

    def session(self, session_id: str) -> SessionView | None:
        """The service's view of a session, once it has every event emitted so far; None:
        unknown."""
        self._sync()
        path = "/v1/sessions/" + quote(self._remote(session_id), safe="")
        try:
            response = self._http.get(path)
        except httpx.HTTPError as exc:
            raise ServiceUnreachable(
                f"GET {self.url}{path} failed: {_describe_exception(exc)}"
            ) from exc
        self._reads += 1
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise RemoteServiceError(
                f"GET {self.url}{path} answered {_describe_response(response)}"
            )
        view = self._local_view(response.json())
        self._check_bytes_per_token(view)
        return view

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def stats(self) -> RemoteStats:
        s = self._client.stats
        return RemoteStats(
            url=self.url,
            run_id=self.run_id,
            events_emitted=self._emitted,
            events_posted=s.sent + s.duplicates,
            session_reads=self._reads,
        )

    def close(self) -> RemoteStats:
        """Deliver every event still queued, check the service took them all, and stop."""
        if not self._closed:
            self._closed = True
            try:
                delivered = self._client.close(self._timeout)
                self._check_delivered(delivered)
            finally:
                self._http.close()
            stats = self.stats
            log.info(
                "replay run %s: %d events posted to %s, %d session reads",
                self.run_id,
                stats.events_posted,
                self.url,
                stats.session_reads,
            )
        return self.stats

    def abort(self) -> None:
        """Stop without waiting long for the service (the replay failed anyway)."""
        if not self._closed:
            self._closed = True
            self._client.close(timeout=1.0)
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.abort()

    # -- inside ----------------------------------------------------------------------------

    def _check_ready(self) -> None:
        try:
            response = self._http.get("/readyz")
        except httpx.HTTPError as exc:
            raise ServiceUnreachable(
                f"no kvprefetch service answers at {self.url} ({_describe_exception(exc)}); "
                "start one with `kvprefetch serve`, or check the URL"
            ) from exc
        doc = _json(response.content)
        if response.status_code == 503 and isinstance(doc, dict):
            raise ServiceUnreachable(
                f"the kvprefetch service at {self.url} is not ready "
                f"(status {doc.get('status')!r}, store {doc.get('store')!r})"
            )
        if response.status_code != 200 or not isinstance(doc, dict) or "store_ok" not in doc:
            raise ServiceUnreachable(
                f"{self.url}/readyz answered {_describe_response(response)}: "
                "is this a kvprefetch service?"
            )
        speed, now = doc.get("clock_speed"), doc.get("clock_ts")
        if isinstance(speed, (int, float)) and speed > 0 and speed != 1:
            if not isinstance(now, (int, float)):
                raise ServiceUnreachable(f"{self.url}/readyz names a clock_speed but no clock_ts")
            self._service_speed = float(speed)
            self._service_ref = (float(now), time.time())

    def _service_now(self, wall: float) -> float:
        """The service's clock at a wall-clock time (within the latency of one GET /readyz)."""
        if self._service_ref is None:
            return wall
        ref_ts, ref_wall = self._service_ref
        return ref_ts + (wall - ref_wall) * self._service_speed

    def _sync(self) -> None:
        """Wait until the service has answered for every event emitted so far; raise if any
        failed."""
        if self._unchecked:
            delivered = self._client.flush(self._timeout)
            self._check_delivered(delivered)
            self._unchecked = 0

    def _check_delivered(self, delivered: bool) -> None:
        s = self._client.stats
        if s.rejected:
            raise EventsRejected(
                f"the service at {self.url} refused {s.rejected} events of replay run "
                f"{self.run_id}: {s.last_error}"
            )
        if not delivered or s.queued:
            why = f" (last error: {s.last_error})" if s.last_error else ""
            raise ServiceUnreachable(
                f"the service at {self.url} did not take {s.queued} events of replay "
                f"run {self.run_id} within {self._timeout:g}s{why}"
            )
        if s.dropped:
            why = f" (last error: {s.last_error})" if s.last_error else ""
            raise RemoteServiceError(
                f"{s.dropped} events of replay run {self.run_id} were dropped "
                f"before reaching {self.url}{why}"
            )

    def _pace(self, ts: float) -> float:
        """Wait until the event at trace time `ts` is due; its wall-clock time."""
        assert self._speed is not None
        if self._clock_start is None:
            self._clock_start = (ts, self._service_now(time.time()), time.monotonic())
        ts0, service0, mono0 = self._clock_start
        offset = (ts - ts0) / self._speed
        delay = mono0 + offset - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return service0 + offset * self._service_speed

    def _local_ts(self, t: float | None) -> float | None:
        """A time the service reports, in the trace's time again (paced runs only)."""
        if t is None or self._speed is None or self._clock_start is None:
            return t
        ts0, service0, _ = self._clock_start
        return ts0 + (t - service0) * self.trace_seconds_per_service_second

    def _remote(self, ident: str) -> str:
        return self._prefix + ident

    def _local(self, ident: str) -> str:
        if not ident.startswith(self._prefix):
            raise RemoteServiceError(
                f"the service at {self.url} named {ident!r}, which is not of replay run "
                f"{self.run_id}"
            )
        return ident[len(self._prefix) :]

    def _remote_block(self, h: Any) -> int:
        if type(h) is not int or not 0 <= h <= _HASH_MASK:
            raise RemoteServiceError(
                f"block hash {h!r}: a replay over HTTP namespaces int block hashes "
                f"from 0 to 2**{_HASH_BITS} - 1 (the traces' hash_ids), not this"
            )
        return self._salt << _HASH_BITS | h

    def _local_block(self, h: Any) -> int:
        if type(h) is not int or h >> _HASH_BITS != self._salt:
            raise RemoteServiceError(
                f"the service at {self.url} named block {h!r}, which is not of replay "
                f"run {self.run_id}"
            )
        return h & _HASH_MASK

    def _local_location(self, name: str) -> str:
        tier, at, instance = name.partition("@")
        return f"{tier}@{self._local(instance)}" if at else name

    def _local_view(self, doc: dict[str, Any]) -> SessionView:
        """The service's view with this run's namespace taken off every id, as a policy expects."""
        doc["session_id"] = self._local(doc["session_id"])
        if doc.get("instance_id") is not None:
            doc["instance_id"] = self._local(doc["instance_id"])
        last = doc.get("last_request")
        if last is not None:
            last["request_id"] = self._local(last["request_id"])
            if last.get("instance_id") is not None:
                last["instance_id"] = self._local(last["instance_id"])
        doc["block_hashes"] = [self._local_block(h) for h in doc["block_hashes"]]
        for signal in doc.get("signals", []):
            if signal.get("instance_id") is not None:
                signal["instance_id"] = self._local(signal["instance_id"])
            if self._speed is not None:
                signal["ts"] = self._local_ts(signal["ts"])
        if self._speed is not None:
            for key in ("first_seen_ts", "last_activity_ts", "closed_ts"):
                doc[key] = self._local_ts(doc.get(key))
            doc["recent_arrivals_ts"] = [
                self._local_ts(t) for t in doc.get("recent_arrivals_ts", [])
            ]
            doc["inter_turn_gaps_seconds"] = [
                g * self.trace_seconds_per_service_second
                for g in doc.get("inter_turn_gaps_seconds", [])
            ]
            if last is not None:
                for key in ("routed_ts", "started_ts", "finished_ts"):
                    last[key] = self._local_ts(last.get(key))
        resident = doc.get("resident_blocks", {})
        doc["resident_blocks"] = {self._local_location(k): v for k, v in resident.items()}
        prefix = self._prefix.encode()
        untranslated = [k for k, v in doc.items() if prefix in orjson.dumps(v)]
        if untranslated:
            # SessionView grew a field naming an id, and this method does not translate it yet.
            raise RemoteServiceError(
                f"session views from {self.url} name replay run {self.run_id}'s ids "
                f"in {untranslated}, which sim/remote.py's _local_view leaves as they are"
            )
        return SessionView.model_validate(doc)

    def _check_bytes_per_token(self, view: SessionView) -> None:
        bpt = self._bytes_per_token
        if bpt is None or not view.context_tokens:
            return
        if view.context_bytes != view.context_tokens * bpt:
            raise RemoteServiceError(
                f"the service at {self.url} counts "
                f"{view.context_bytes / view.context_tokens:g} bytes per "
                f"token, the scenario {bpt}: its session views would differ "
                f"from an in-process replay's. "
                f"Start it with KVP_BYTES_PER_TOKEN={bpt}"
            )
        self._bytes_per_token = None  # checked once


def replay_via(
    url: str,
    trace: Sequence[TraceRequest],
    scenario: Scenario,
    *,
    policy: str = "none",
    router: str = "sticky",
    model_dir: str | None = None,
    measure_from_seconds: float = 0.0,
    keep_events: bool = False,
    progress: Callable[[int], None] | None = None,
    run_id: str | None = None,
    speed: float | None = None,
) -> ReplayResult:
    """sim.replay.replay() with a running service at `url` as the engine.

    speed: post events at this many times the trace's pace, stamped with wall-clock times (see
    the module's docstring); None: as fast as possible.

    The summary has the in-process keys, plus `via` (the URL), `run_id` and `events_posted`.
    Raises ServiceUnreachable (the service is not there or not ready, or stopped taking events),
    EventsRejected, or another RemoteServiceError; all are KvpErrors.
    """
    with RemoteService(
        url,
        run_id=run_id,
        bytes_per_token=scenario.bytes_per_token,
        keep_events=keep_events,
        speed=speed,
    ) as engine:
        result = replay(
            trace,
            scenario,
            policy=policy,
            router=router,
            model_dir=model_dir,
            measure_from_seconds=measure_from_seconds,
            progress=progress,
            engine=engine,
        )
    stats = engine.stats
    result.summary.update(
        {"via": stats.url, "run_id": stats.run_id, "events_posted": stats.events_posted}
    )
    return result


def _json(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return None


def _describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _describe_response(response: httpx.Response) -> str:
    doc = _json(response.content)
    if isinstance(doc, dict) and "detail" in doc:
        field = f" (field {doc['field']})" if doc.get("field") else ""
        return f"HTTP {response.status_code}: {doc['detail']}{field}"
    text = response.content[:200].decode("utf-8", "replace").strip()
    return f"HTTP {response.status_code}: {text}" if text else f"HTTP {response.status_code}"
