"""Where an agent's orders come from: the Redis Stream, or the service's pull endpoint.

Both sit behind `OrderSource`: `bind` says which instance the agent serves, `poll` hands over
what arrived (waiting at most the time given), and `ack` says a message is finished with (its
outcome reported and accepted by the service).

The stream format is fixed by the producer (app/deliver/redis_stream.py): one stream per
instance, `<prefix>:orders:<instance_id>`, where `<prefix>` is the service's
KVP_ORDER_STREAM_PREFIX (by default `<KVP_REDIS_PREFIX>:sink`: the Redis state store owns
`<KVP_REDIS_PREFIX>:orders`); one field `msg` holding an Order's or a Cancel's JSON (a Cancel goes
to the stream of its order's instance); consumer group `kvp-agents` on each stream; and
`<prefix>:cancel-ids:<id>` set for every cancelled order, so a Cancel read by one agent also stops
the order another holds (and a cancel the sink could not place in a stream still stops it). An
agent reads its own instance's stream only. An entry stays in the group's pending list until
acked, so an agent that dies holding it loses nothing: after `claim_idle_seconds` without a sign
of life another agent of the same instance takes it over with XAUTOCLAIM. A live agent shows its
life by re-claiming what it holds (XCLAIM to itself resets the idle time) from a heartbeat
thread, so an order waiting for its start time, or a long transfer, is not taken from an agent
that is still doing it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import orjson
from pydantic import ValidationError

if (
    TYPE_CHECKING
):  # the Redis source needs the `redis` extra: pip install 'kvprefetch-client[redis]'
    import redis

from kvprefetch_client.orders import Cancel, Order, from_json

log = logging.getLogger("kvprefetch.agent")

STREAM_SUFFIX = "orders"
GROUP = "kvp-agents"
FIELD = b"msg"


def stream_key(prefix: str, instance_id: str) -> str:
    """The stream of one instance's orders (its id as is: Redis keys take any bytes)."""
    return f"{prefix}:{STREAM_SUFFIX}:{instance_id}"


def cancel_key(prefix: str, order_id: str) -> str:
    return f"{prefix}:cancel-ids:{order_id}"


def default_stream_prefix(redis_prefix: str) -> str:
    """The service's default KVP_ORDER_STREAM_PREFIX for a KVP_REDIS_PREFIX."""
    return f"{redis_prefix}:sink"


def default_consumer_name(instance_id: str) -> str:
    # Unique per process: a restarted agent is a new consumer and takes its predecessor's
    # entries by claim, like any other agent would.
    return f"{instance_id}@{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message as it arrived. `message` is None when it did not parse (`error` says why)."""

    token: str  # the stream entry id; "" where the source has nothing to ack
    message: Order | Cancel | None
    raw: bytes = b""
    error: str | None = None


def parse(token: str, raw: bytes | str | None) -> Delivery:
    """A Delivery from a message's JSON; a malformed one becomes a Delivery without a message."""
    if raw is None:
        return Delivery(token, None, b"", f"entry has no {FIELD.decode()!r} field")
    data = raw.encode() if isinstance(raw, str) else raw
    try:
        return Delivery(token, from_json(data), data)
    except ValidationError as exc:
        errors = exc.errors()
        if not errors:
            return Delivery(token, None, data, f"message: {exc}")
        where = ".".join(str(p) for p in errors[0]["loc"]) or "message"
        return Delivery(token, None, data, f"{where}: {errors[0]['msg']}")


class OrderSource(Protocol):
    """Where an agent's orders come from. An implementation declares it
    (`class MySource(OrderSource)`): tests/client/test_source_contract.py then checks it."""

    def bind(self, instance_id: str) -> None:
        """Serve `instance_id` (the agent's): raises ValueError when the source was made for
        another instance."""
        ...

    def poll(self, max_wait_seconds: float) -> list[Delivery]:
        """What arrived; waits at most `max_wait_seconds` when nothing has."""
        ...

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Finished with: not to be delivered again."""
        ...

    def is_cancelled(self, order_id: str) -> bool:
        """Whether the order was cancelled, whichever agent read the Cancel (asked right before
        an order starts)."""
        ...

    def close(self) -> None: ...


class StreamSource(OrderSource):
    """Reads one instance's orders stream as one consumer of its `kvp-agents` group (Redis 6.2+).

    The instance is `instance_id`, or, when that is None, the one the agent binds it to (the
    agent does, with its own `instance_id`, before the first poll).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str,
        consumer: str,
        instance_id: str | None = None,
        claim_idle_seconds: float = 10.0,
        batch: int = 64,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if claim_idle_seconds <= 0:
            raise ValueError("claim_idle_seconds must be positive")
        self._r = client
        self.prefix = prefix
        self.instance_id: str | None = None
        self.key: str | None = None
        self.consumer = consumer
        self._claim_idle_ms = max(1, int(claim_idle_seconds * 1000))
        self._batch = batch
        self._monotonic = monotonic
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._lock = threading.Lock()
        self._held: set[str] = set()  # delivered to us, not acked
        self._stop = threading.Event()
        if instance_id is not None:
            self.bind(instance_id)
        # Heartbeat well inside the idle limit, so one late beat does not cost an order.
        self._beat_seconds = claim_idle_seconds / 3
        self._heartbeat = threading.Thread(
            target=self._beat, name="kvprefetch-agent-heartbeat", daemon=True
        )
        self._heartbeat.start()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> StreamSource:
        import redis

        # The socket timeout must outlast the longest XREADGROUP BLOCK the runner asks for.
        client = redis.Redis.from_url(url, socket_timeout=30.0, socket_connect_timeout=5.0)
        return cls(client, **kwargs)

    def bind(self, instance_id: str) -> None:
        if self.instance_id is not None:
            if instance_id != self.instance_id:
                raise ValueError(
                    f"this stream source reads instance {self.instance_id!r}'s "
                    f"stream, not {instance_id!r}'s"
                )
            return
        if not instance_id:
            raise ValueError("instance_id must name the instance whose stream to read")
        key = stream_key(self.prefix, instance_id)
        import redis

        try:
            self._r.xgroup_create(key, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.instance_id, self.key = instance_id, key

    def _stream(self) -> str:
        if self.key is None:
            raise RuntimeError(
                "the stream source is not bound to an instance yet (pass instance_id, or bind it)"
            )
        return self.key

    def _deliveries(self, entries: Sequence[Any]) -> list[Delivery]:
        out = []
        for entry_id, fields in entries:
            token = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            out.append(parse(token, (fields or {}).get(FIELD)))
        with self._lock:
            self._held.update(d.token for d in out)
        return out

    def poll(self, max_wait_seconds: float) -> list[Delivery]:
        key = self._stream()
        now = self._monotonic()
        if now >= self._next_claim:
            # Check for abandoned entries twice per idle period: a dead agent's order waits at
            # most 1.5 x claim_idle_seconds.
            self._next_claim = now + self._claim_idle_ms / 2000
            claimed = self._claim()
            if claimed:
                return claimed
        block_ms = int(max_wait_seconds * 1000)
        reply = self._r.xreadgroup(
            GROUP,
            self.consumer,
            {key: ">"},
            count=self._batch,
            block=block_ms if block_ms > 0 else None,
        )
        if not reply:
            return []
        # RESP2 (the client from_url makes): [[stream, [(entry_id, {field: value}), ...]]].
        streams: list[Any] = reply  # type: ignore[assignment]  # redis-py types it as any reply
        return [d for _, entries in streams for d in self._deliveries(entries)]

    def _claim(self) -> list[Delivery]:
        reply = self._r.xautoclaim(
            self._stream(),
            GROUP,
            self.consumer,
            self._claim_idle_ms,
            start_id=self._claim_cursor,
            count=self._batch,
        )
        cursor, entries = reply[0], reply[1]
        self._claim_cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        # Entries deleted from the stream while pending come back without fields: nothing to do.
        live = [(i, f) for i, f in entries if f]
        if live:
            log.info(
                "claimed %d orders stream entries left idle for %.1f s by another agent",
                len(live),
                self._claim_idle_ms / 1000,
            )
        return self._deliveries(live)

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        tokens = [d.token for d in deliveries if d.token]
        if not tokens:
            return
        self._r.xack(self._stream(), GROUP, *tokens)
        with self._lock:
            self._held.difference_update(tokens)

    def is_cancelled(self, order_id: str) -> bool:
        return bool(self._r.exists(cancel_key(self.prefix, order_id)))

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def _beat(self) -> None:
        import redis

        while not self._stop.wait(self._beat_seconds):
            try:
                self.renew()
            except redis.RedisError as exc:
                log.warning("could not renew held orders stream entries: %s", exc)
            except Exception:
                log.exception("orders stream heartbeat failed")

    def renew(self) -> None:
        """Reset the idle time of the entries we still own (not those another agent took)."""
        with self._lock:
            held = set(self._held)
        if not held:
            return
        key = self._stream()
        pending = self._r.xpending_range(
            key, GROUP, min="-", max="+", count=max(len(held) * 2, 100), consumername=self.consumer
        )
        ours: list[Any] = [
            p["message_id"]
            for p in pending
            if (p["message_id"].decode() if isinstance(p["message_id"], bytes) else p["message_id"])
            in held
        ]
        if ours:
            self._r.xclaim(key, GROUP, self.consumer, 0, ours, justid=True)

    def close(self) -> None:
        self._stop.set()
        self._heartbeat.join(timeout=5.0)
        self._r.close()


class PullSource(OrderSource):
    """Asks the service: GET /v1/orders?instance_id=X&limit=N&agent=A -> {"orders": [...],
    "cancelled": [...], "lease_seconds": s}.

    An order comes back on every poll until the service has seen progress on it or it is leased:
    the runner drops repeats by order id. What the agent holds (delivered, not acked) keeps its
    lease: a heartbeat thread renews it (POST /v1/orders/renew) a third of a lease apart, so an
    order waiting for its start, or behind a long transfer, is not handed to a second agent; and
    right before an order starts, `is_cancelled` renews it once more: an order the service says
    is lost (leased to another agent, cancelled, gone) is not started.
    """

    def __init__(
        self,
        service_url: str,
        instance_id: str,
        *,
        limit: int = 100,
        timeout_seconds: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        token: str | None = None,
        agent: str | None = None,
        renew_seconds: float | None = None,
    ) -> None:
        self.instance_id = instance_id
        # The name the leases are under: unique per process, like a stream consumer's.
        self.agent = agent or default_consumer_name(instance_id)
        self._limit = limit
        self._sleep = sleep
        self._http = httpx.Client(
            base_url=service_url.rstrip("/"),
            timeout=timeout_seconds,
            transport=transport,
            headers={"authorization": f"Bearer {token}"} if token else None,
        )
        self._http_lock = threading.Lock()  # the heartbeat and the loop share the client
        self._failing = False
        # None: a third of the lease the service states (10 s until it has).
        self._renew_seconds = renew_seconds
        self._lease_seconds: float | None = None
        self._lock = threading.Lock()
        self._held: set[str] = set()  # order ids delivered, not acked
        self._stop = threading.Event()
        self._wake = threading.Event()  # the lease changed (or stop): wait anew
        self._heartbeat = threading.Thread(
            target=self._beat, name="kvprefetch-agent-lease-renewal", daemon=True
        )
        self._heartbeat.start()

    def bind(self, instance_id: str) -> None:
        if instance_id != self.instance_id:
            raise ValueError(
                f"this pull source asks for instance {self.instance_id!r}'s orders, "
                f"not {instance_id!r}'s"
            )

    def poll(self, max_wait_seconds: float) -> list[Delivery]:
        out = self._fetch()
        if not out and max_wait_seconds > 0:
            self._sleep(max_wait_seconds)
        return out

    def _fetch(self) -> list[Delivery]:
        try:
            with self._http_lock:
                r = self._http.get(
                    "/v1/orders",
                    params={
                        "instance_id": self.instance_id,
                        "limit": self._limit,
                        "agent": self.agent,
                    },
                )
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            doc = orjson.loads(r.content)
            orders, cancelled = doc.get("orders", []), doc.get("cancelled", [])
            if not isinstance(orders, list) or not isinstance(cancelled, list):
                raise RuntimeError('answer is not {"orders": [...], "cancelled": [...]}')
        except (httpx.HTTPError, RuntimeError, orjson.JSONDecodeError, AttributeError) as exc:
            if not self._failing:
                log.warning("cannot pull orders from the service: %s", exc)
            self._failing = True
            return []
        if self._failing:
            log.info("pulling orders from the service again")
            self._failing = False
        lease_seconds = doc.get("lease_seconds")
        if (
            isinstance(lease_seconds, (int, float))
            and lease_seconds > 0
            and lease_seconds != self._lease_seconds
        ):
            self._lease_seconds = float(lease_seconds)
            self._wake.set()
        out = [parse("", orjson.dumps(o)) for o in orders]
        with self._lock:
            self._held.update(d.message.order_id for d in out if isinstance(d.message, Order))
        for order_id in cancelled:
            try:
                out.append(Delivery("", Cancel(order_id=order_id)))
            except ValidationError:
                out.append(Delivery("", None, orjson.dumps(order_id), "cancelled: not an order id"))
        return out

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        done = {d.message.order_id for d in deliveries if isinstance(d.message, Order)}
        with self._lock:
            self._held.difference_update(done)

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def renew(self, order_ids: Sequence[str] | None = None) -> list[str]:
        """Renew the leases of `order_ids` (default: every order held); returns those lost, which
        are held no more. Raises when the service does not answer."""
        if order_ids is None:
            order_ids = self.held()
        lost: list[str] = []
        for start in range(0, len(order_ids), 1000):  # the service's most per call
            with self._http_lock:
                r = self._http.post(
                    "/v1/orders/renew",
                    json={
                        "instance_id": self.instance_id,
                        "agent": self.agent,
                        "order_ids": list(order_ids[start : start + 1000]),
                    },
                )
            if r.status_code != 200:
                raise RuntimeError(f"renewing leases: HTTP {r.status_code}: {r.text[:200]}")
            doc = orjson.loads(r.content)
            if not isinstance(doc, dict) or not isinstance(doc.get("lost"), list):
                raise RuntimeError(
                    'renewing leases: answer is not {"renewed": [...], "lost": [...]}'
                )
            lost += [str(x) for x in doc["lost"]]
        if lost:
            with self._lock:
                self._held.difference_update(lost)
            log.warning(
                "%d pulled orders lost their lease (leased to another agent, or gone): "
                "not starting them: %s",
                len(lost),
                ", ".join(lost[:5]),
            )
        return lost

    def _beat(self) -> None:

        while not self._stop.is_set():
            self._wake.wait(self._beat_seconds())
            self._wake.clear()
            if self._stop.is_set() or not self.held():
                continue
            try:
                self.renew()
            except Exception as exc:
                log.warning("could not renew the leases of pulled orders: %s", exc)

    def _beat_seconds(self) -> float:
        if self._renew_seconds is not None:
            return self._renew_seconds
        return self._lease_seconds / 3 if self._lease_seconds is not None else 10.0

    def is_cancelled(self, order_id: str) -> bool:
        # Cancels come in the next pull's `cancelled`; a lease lost (to another agent, since this
        # one's ran out) is as good as cancelled for this agent. The renewal also gives the order
        # a fresh lease for the time its `accepted` takes to reach the service.
        return bool(self.renew([order_id]))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._heartbeat.join(timeout=5.0)
        self._http.close()
