"""LmcacheSink: orders carried out by LMCache's coordinator, over its HTTP API.

LMCache names content by tokens, so each order's blocks become token sequences first, rebuilt
from the engine's own kv_blocks_stored events by the token index (app/deliver/token_index.py);
then, for the LMCache MP server registered under the order's `instance_id`:

- **prefetch** -> `POST /cache/prefetches` (L2 into the server's L1), polled with
  `GET /cache/prefetches/{instance_id}/{request_id}` until `completed`. Reported `accepted` once
  submitted, then `completed` with the share of `size_bytes` LMCache found (found_keys of
  total_keys) and the seconds from submit to done, or `failed` with the reason.
- **pin** -> `POST /cache/pins` (the keys kept out of L2 eviction, fleet-wide). LMCache pins have
  no time limit: the sink releases each pin itself with `DELETE /cache/pins` once the order's
  `ttl_seconds` ran out (pins are counted per key, so overlapping pins hold until the last), and
  releases every pin it holds on `close()`. A coordinator that restarts forgets every pin
  (`GET /cache/pins` answers none): while it holds pins the sink lists the coordinator's pinned
  keys of its model every `pin_check_seconds`, and when their pin counts add up to fewer than
  the keys its own pins resolved to (the `affected` each pin answered), its pins were lost: each
  pin order is reported `failed` again (a pin that completed before: the scheduler orders it
  anew) and its release dropped. Another pinner's pins of the same model and salt can hide a
  loss from the count until they are released.
- **demote** -> `POST /cache/delete` on `demote_tier` (`l1` by default: the server's DRAM copy goes,
  L2 keeps its own), without force, so LMCache's locks and pins are honoured.

Outcomes go back to the engine as `order_progress` events, through the `report` coroutine bound
with `bind` (the engine ingests them like an agent's). An order that cannot be carried out fails
with its reason and is never retried by the sink: its tokens unknown, the coordinator's 404 (no MP
server under that instance id), the MP server's 503 (no engine has registered its KV layout yet;
the coordinator relays it as a 502 naming the 503), any other 4xx. A connection error, a timeout,
a 429 or another 5xx is tried again, at most `max_attempts` tries per call with a capped,
jittered backoff, and then the order fails with the last problem. Nothing here raises into the
dispatcher but SinkClosed.

`submit` checks each order's tokens at once and starts its calls in the background (at most
`MAX_CONCURRENT_ORDERS` orders talk to the coordinator at a time, and at most
`MAX_PENDING_ORDERS` wait or talk: past that an order fails at once); it returns the ids taken. A
cancel withdraws an order still waiting for its turn; one whose first call was made runs on
(LMCache has no cancel), except that a cancelled pin is released at once (`DELETE /cache/pins`)
instead of at its TTL's end, whether it was held already or is being made. A demote done cannot
be undone (its chunks were deleted from `demote_tier`): its cancel is a no-op. Ids are taken once
per dedupe window, as every sink does.

With a planning lease the engine sets `fence` (app/deliver/fence.py): each call that changes
LMCache (prefetch, pin, delete) is made only while this replica holds the lease; else the order
fails `fenced`, nothing sent. Polls, and the release of the pins this sink made, are not fenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import httpx

from app.core.errors import ConfigError, KvpError
from app.core.redact import mask_url
from app.deliver._dedupe import RecentIds
from app.deliver.base import OrderSink, SinkBinding, SinkClosed, SinkFenced, SinkObserver
from app.deliver.fence import Fence
from app.deliver.token_index import TokenIndex, UnknownTokens
from kvprefetch_client.agent.runner import progress_event_id
from kvprefetch_client.events import OrderProgress
from kvprefetch_client.orders import Cancel, Order

if TYPE_CHECKING:
    from app.core.config import Settings

log = logging.getLogger(__name__)

# Orders talking to the coordinator at once: enough to keep a plan's orders moving, few enough
# that a burst does not open hundreds of connections to it.
MAX_CONCURRENT_ORDERS = 32
# Orders taken and not yet ended, at most: past it a new order fails at once ("backlog"), so a
# coordinator that stopped answering cannot pile up orders (and their tokens) without bound.
MAX_PENDING_ORDERS = 1024
# What an order_progress reason may hold (kvprefetch_client.events.OrderProgress).
MAX_REASON_CHARS = 1024
# Why orders fail, as the metrics label them (a fixed set).
FAILURE_KINDS = (
    "unknown_tokens",  # the token index cannot rebuild the order's tokens
    "too_short",  # fewer tokens than one LMCache chunk: nothing to do
    "backlog",  # MAX_PENDING_ORDERS orders already waiting or running
    "no_layout",  # a prefetch's 503 from the MP server: no engine registered its KV layout
    "server_unavailable",  # another call's 503 from the MP server (no L2 tier, not initialized)
    "unknown_instance",  # the coordinator's 404: no MP server under that instance id
    "refused",  # another 4xx
    "unreachable",  # connection errors, timeouts, 5xx: the tries spent
    "timeout",  # a prefetch still pending at its deadline
    "not_found",  # a prefetch done, none of its chunks in LMCache
    "lmcache_error",  # a prefetch LMCache reported as neither pending nor completed
    "fenced",  # this replica no longer holds the planning lease (app/deliver/fence.py)
    "pin_lost",  # a pin that completed, lost by the coordinator since (its restart)
)
CALLS = ("prefetch", "poll", "pin", "unpin", "delete", "list_pins")
# GET /cache/pins' largest page.
PINS_PAGE = 10_000
# What a replica that lost the planning lease must not do: act on an order of its old term.
FENCED_CALLS = frozenset({"prefetch", "pin", "delete"})

Reporter = Callable[[Sequence[OrderProgress]], Awaitable[None]]
DemoteTier = Literal["l1", "l2", "all"]


class LmcacheMetrics(Protocol):
    """What the sink tells the metrics (app/observe/metrics.py implements it)."""

    def lmcache_order_ended(self, kind: str, failure: str | None) -> None: ...

    def lmcache_call_retried(self, call: str) -> None: ...


class _Failed(KvpError):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass
class _Pinned:
    """One token sequence this sink pinned, until its release."""

    order: Order
    token_ids: list[int]
    keys: int  # the L2 keys the pin resolved to (the coordinator's `affected`)
    task: asyncio.Task[None]


@dataclass
class _Job:
    order: Order
    tokens: list[list[int]]
    task: asyncio.Task[None] | None = None
    started: bool = False
    started_at: float = 0.0


class LmcacheSink(OrderSink):
    name = "lmcache"
    fleet_wide = True

    @classmethod
    def from_settings(
        cls, settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> LmcacheSink:
        url = settings.lmcache_coordinator_url
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"KVP_LMCACHE_COORDINATOR_URL must be an http:// or https:// URL, not "
                f"{mask_url(url, keep_path=False)!r}"
            )
        if not settings.lmcache_model_name:
            raise ConfigError(
                "KVP_ORDER_SINK=lmcache needs KVP_LMCACHE_MODEL_NAME, the model name LMCache's "
                "servers registered their KV layout under (vLLM's --model)"
            )
        # Its report (where order_progress goes) is bound by the engine that builds it (attach).
        return cls(
            url,
            model_name=settings.lmcache_model_name,
            world_size=settings.lmcache_world_size,
            cache_salt=settings.lmcache_cache_salt,
            tokens=TokenIndex(settings.lmcache_token_index_max_tokens),
            demote_tier=settings.lmcache_demote_tier,
            poll_interval_seconds=settings.lmcache_poll_interval_seconds,
            prefetch_timeout_seconds=settings.lmcache_prefetch_timeout_seconds,
            timeout_seconds=settings.lmcache_timeout_seconds,
            max_attempts=settings.lmcache_max_attempts,
            backoff_seconds=settings.lmcache_backoff_seconds,
            max_backoff_seconds=settings.lmcache_max_backoff_seconds,
            pin_check_seconds=settings.lmcache_pin_check_seconds,
            dedupe_seconds=settings.order_dedupe_seconds,
            transport=transport,
        )

    def attach(self, binding: SinkBinding) -> list[SinkObserver]:
        # Its outcomes come back as an agent's would: order_progress events, ingested; the
        # blocks' tokens, which it turns orders into (LMCache is keyed by tokens), from the
        # accepted kv_blocks_stored events.
        self.bind(report=binding.report, metrics=binding.metrics, now=binding.now)
        return [self.tokens.observe]

    def __init__(
        self,
        coordinator_url: str,
        *,
        model_name: str,
        world_size: int = 1,
        cache_salt: str = "",
        tokens: TokenIndex,
        demote_tier: DemoteTier = "l1",
        poll_interval_seconds: float = 0.05,
        prefetch_timeout_seconds: float = 30.0,
        timeout_seconds: float = 5.0,
        max_attempts: int = 3,
        backoff_seconds: float = 0.2,
        max_backoff_seconds: float = 2.0,
        dedupe_seconds: float = 3600.0,
        max_pending_orders: int = MAX_PENDING_ORDERS,
        pin_check_seconds: float = 5.0,
        report: Reporter | None = None,
        metrics: LmcacheMetrics | None = None,
        now: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.coordinator_url = coordinator_url.rstrip("/")
        self.shown_url = mask_url(coordinator_url, keep_path=False)
        self.model_name = model_name
        self.world_size = world_size
        self.cache_salt = cache_salt
        self.tokens = tokens
        self.demote_tier = demote_tier
        self.poll_interval_seconds = poll_interval_seconds
        self.prefetch_timeout_seconds = prefetch_timeout_seconds
        self.timeout_seconds = timeout_seconds
        self.max_attempts = max_attempts
        self.backoff_seconds = backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.max_pending_orders = max_pending_orders
        self.pin_check_seconds = pin_check_seconds
        self._report = report
        self._metrics = metrics
        self._now = now
        self._http = httpx.AsyncClient(
            base_url=self.coordinator_url, transport=transport, timeout=timeout_seconds
        )
        self._sleep = sleep
        self._jitter = jitter
        self._monotonic = monotonic
        self._orders = RecentIds(dedupe_seconds, clock=monotonic)
        self._cancels = RecentIds(dedupe_seconds, clock=monotonic)
        self._jobs: dict[str, _Job] = {}
        self._unpins: set[asyncio.Task[None]] = set()
        self._held_pins: dict[int, _Pinned] = {}  # id(its release task) -> the pin
        # Pin orders cancelled while they were pinning: released once held.
        self._unwanted_pins: set[str] = set()
        self._pin_watch: asyncio.Task[None] | None = None
        self._turns = asyncio.Semaphore(MAX_CONCURRENT_ORDERS)
        self._closed = False
        self.last_error: str | None = None
        self.fence: Fence | None = None  # set by the engine with a planning lease

    def bind(
        self,
        *,
        report: Reporter,
        metrics: LmcacheMetrics | None = None,
        now: Callable[[], float] | None = None,
    ) -> None:
        """What the engine injects once it has built them: where order_progress goes, the
        metrics, and its clock (the events' ts)."""
        self._report = report
        if metrics is not None:
            self._metrics = metrics
        if now is not None:
            self._now = now

    # -- the sink interface -----------------------------------------------------------------

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        if self._closed:
            raise SinkClosed("the lmcache order sink is closed")
        taken: list[str] = []
        failed: list[tuple[Order, _Failed]] = []
        for order in orders:
            if not self._orders.add(order.order_id):
                continue
            taken.append(order.order_id)
            if len(self._jobs) >= self.max_pending_orders:
                failed.append(
                    (
                        order,
                        _Failed(
                            "backlog",
                            f"lmcache: {len(self._jobs)} orders already wait for or talk to the "
                            f"coordinator {self.shown_url}",
                        ),
                    )
                )
                continue
            try:
                tokens = self.tokens.tokens_for(order.block_hashes)
            except UnknownTokens as exc:
                failed.append((order, _Failed("unknown_tokens", f"lmcache: {exc}")))
                continue
            job = _Job(order, tokens)
            self._jobs[order.order_id] = job
            job.task = asyncio.create_task(self._run(job), name=f"lmcache {order.order_id}")
        for order, problem in failed:
            await self._ended(order, problem)
        return taken

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        if self._closed:
            raise SinkClosed("the lmcache order sink is closed")
        withdrawn: list[str] = []
        for c in cancels:
            job = self._jobs.get(c.order_id)
            if job is not None and job.started and job.order.kind == "pin":
                # Pinning now: what it pins is released as soon as it is held.
                if self._cancels.add(c.order_id):
                    self._unwanted_pins.add(c.order_id)
                    withdrawn.append(c.order_id)
                continue
            if job is None and self._release_now(c.order_id):
                withdrawn.append(c.order_id)
                continue
            if job is None or job.started or not self._cancels.add(c.order_id):
                continue  # unknown, already ended, or already talking to LMCache: it runs on
            if job.task is not None:
                job.task.cancel()
            self._jobs.pop(c.order_id, None)
            withdrawn.append(c.order_id)
        return withdrawn

    async def close(self) -> None:
        """Stop the orders in flight (unreported) and release every pin held, then the client."""
        if self._closed:
            return
        self._closed = True
        tasks = [j.task for j in self._jobs.values() if j.task is not None]
        tasks += list(self._unpins)
        if self._pin_watch is not None:
            tasks.append(self._pin_watch)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        held = list(self._held_pins.values())
        self._held_pins.clear()
        for pin in held:  # one try each: a coordinator that is gone keeps them
            with contextlib.suppress(httpx.HTTPError):
                await self._http.request(
                    "DELETE", "/cache/pins", json=self._key_body(pin.token_ids)
                )
        await self._http.aclose()

    async def settle(self) -> None:
        """Wait until every order taken so far has ended (reported); pins keep their timers."""
        while self._jobs:
            tasks = [j.task for j in self._jobs.values() if j.task is not None]
            if not tasks:
                return
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def pins_held(self) -> int:
        """Pins made and not yet released (one per token sequence pinned)."""
        return len(self._held_pins)

    # -- carrying out one order ---------------------------------------------------------------

    async def _run(self, job: _Job) -> None:
        order = job.order
        try:
            async with self._turns:
                job.started = True
                job.started_at = self._monotonic()
                if order.kind == "prefetch":
                    done = await self._prefetch(job)
                elif order.kind == "pin":
                    await self._pin(job)
                    done = order.size_bytes
                else:
                    await self._delete(job)
                    done = order.size_bytes
            seconds = self._monotonic() - job.started_at
            self._jobs.pop(order.order_id, None)
            await self._ended(order, None, nbytes=done, seconds=seconds)
        except _Failed as problem:
            self._jobs.pop(order.order_id, None)
            await self._ended(order, problem)
        except asyncio.CancelledError:
            self._jobs.pop(order.order_id, None)
            raise
        except Exception as exc:  # a bug here must not end the sink's other orders
            self._jobs.pop(order.order_id, None)
            log.exception("lmcache order %s failed unexpectedly", order.order_id)
            await self._ended(
                order, _Failed("lmcache_error", f"lmcache sink error: {type(exc).__name__}: {exc}")
            )
        finally:
            self._unwanted_pins.discard(order.order_id)

    async def _prefetch(self, job: _Job) -> int:
        order = job.order
        deadline = job.started_at + self.prefetch_timeout_seconds
        submitted: list[str] = []
        for token_ids in job.tokens:
            body = {"instance_id": order.instance_id, **self._key_body(token_ids)}
            answer = await self._call("prefetch", "POST", "/cache/prefetches", body, order)
            if answer.get("status") == "noop" or not answer.get("request_id"):
                continue  # shorter than one chunk: nothing of it to warm
            submitted.append(str(answer["request_id"]))
            if len(submitted) == 1:
                await self._progress(order, "accepted")
        if not submitted:
            raise _Failed(
                "too_short",
                f"lmcache: the order's {max(map(len, job.tokens))} tokens are fewer than one "
                f"LMCache chunk: nothing to prefetch",
            )
        found = total = 0
        for request_id in submitted:
            path = f"/cache/prefetches/{order.instance_id}/{request_id}"
            while True:
                answer = await self._call("poll", "GET", path, None, order)
                status = answer.get("status")
                if status == "completed":
                    found += int(answer.get("found_keys", 0))
                    total += int(answer.get("total_keys", 0))
                    break
                if status not in ("pending", "submitted", "running"):
                    raise _Failed(
                        "lmcache_error", f"lmcache: prefetch {request_id} reported {answer!r}"
                    )
                if self._monotonic() >= deadline:
                    raise _Failed(
                        "timeout",
                        f"lmcache: prefetch {request_id} still {status} after "
                        f"{self.prefetch_timeout_seconds:g} s "
                        "(KVP_LMCACHE_PREFETCH_TIMEOUT_SECONDS)",
                    )
                await self._sleep(self.poll_interval_seconds)
        if found == 0:
            raise _Failed(
                "not_found",
                f"lmcache: none of the {total} keys of the order's chunks were in LMCache "
                f"(nothing loaded into {order.instance_id}'s L1)",
            )
        return order.size_bytes * found // total if total else order.size_bytes

    async def _pin(self, job: _Job) -> None:
        order = job.order
        for token_ids in job.tokens:
            answer = await self._call(
                "pin", "POST", "/cache/pins", self._key_body(token_ids), order
            )
            self._hold(order, token_ids, int(answer.get("affected", 0) or 0))

    def _hold(self, order: Order, token_ids: list[int], keys: int) -> None:
        ttl_seconds = 0.0 if order.order_id in self._unwanted_pins else order.ttl_seconds

        async def release() -> None:
            await self._sleep(ttl_seconds or 0.0)
            self._held_pins.pop(id(task), None)
            await self._unpin(token_ids)

        task = asyncio.create_task(release())
        self._held_pins[id(task)] = _Pinned(order, token_ids, keys, task)
        self._unpins.add(task)
        task.add_done_callback(self._unpins.discard)
        if self.pin_check_seconds > 0 and (self._pin_watch is None or self._pin_watch.done()):
            self._pin_watch = asyncio.create_task(self._watch_pins(), name="lmcache pin watch")

    async def _unpin(self, token_ids: list[int]) -> None:
        try:
            await self._call("unpin", "DELETE", "/cache/pins", self._key_body(token_ids), None)
        except _Failed as problem:
            log.warning("lmcache: a pin outlives its TTL or cancel: %s", problem.reason)

    def _release_now(self, order_id: str) -> bool:
        """A Cancel of a pin this sink holds: released now, not at its TTL's end. Whether it
        held one."""
        mine = [k for k, p in self._held_pins.items() if p.order.order_id == order_id]
        if not mine or not self._cancels.add(order_id):
            return False
        for k in mine:
            pin = self._held_pins.pop(k)
            pin.task.cancel()  # still waiting for its TTL: its DELETE is sent here instead
            task = asyncio.create_task(self._unpin(pin.token_ids))
            self._unpins.add(task)
            task.add_done_callback(self._unpins.discard)
        return True

    async def _watch_pins(self) -> None:
        """Checks the pins while it holds any (a new pin starts it again)."""
        while self._held_pins and not self._closed:
            await self._sleep(self.pin_check_seconds)
            try:
                await self.check_pins()
            except _Failed as problem:  # away: checked again next time
                log.info("lmcache: pins not checked: %s", problem.reason)
            except Exception:  # a bug here must not end the checks
                log.exception("lmcache: checking the pins failed")

    async def check_pins(self) -> list[str]:
        """Whether the coordinator still holds this sink's pins (see the module doc); reports
        the orders of the pins it lost and returns their ids."""
        before = dict(self._held_pins)
        if not any(p.keys for p in before.values()):
            return []
        listed = await self._pinned_keys()
        # Only the pins held throughout the listing: one released meanwhile may be gone from it
        # (its release is dropped from the held pins before its DELETE is sent); one made
        # meanwhile only adds to it.
        held = {k: p for k, p in before.items() if self._held_pins.get(k) is p}
        if listed >= sum(p.keys for p in held.values()):
            return []
        lost: dict[str, Order] = {}
        for k, p in held.items():
            del self._held_pins[k]
            p.task.cancel()  # nothing of it left to release
            lost[p.order.order_id] = p.order
        log.warning(
            "lmcache coordinator %s holds %d pinned keys of model %r, fewer than the %d this "
            "sink pinned (restarted?): %d pin orders reported lost",
            self.shown_url,
            listed,
            self.model_name,
            sum(p.keys for p in held.values()),
            len(lost),
        )
        for order in lost.values():
            await self._ended(
                order,
                _Failed(
                    "pin_lost",
                    f"lmcache: pin lost: the coordinator {self.shown_url} no longer holds it "
                    "(restarted?)",
                ),
            )
        return list(lost)

    async def _pinned_keys(self) -> int:
        """The coordinator's pins of this sink's model and salt: their pin counts summed."""
        total, offset = 0, 0
        while True:
            query = httpx.QueryParams(
                model_name=self.model_name,
                cache_salt=self.cache_salt,
                offset=offset,
                limit=PINS_PAGE,
            )
            answer = await self._call("list_pins", "GET", f"/cache/pins?{query}", None, None)
            page = answer.get("pins") or []
            total += sum(int(p.get("pin_count", 0) or 0) for p in page)
            offset += len(page)
            if not page or offset >= int(answer.get("total", 0) or 0):
                return total

    async def _delete(self, job: _Job) -> None:
        order = job.order
        for token_ids in job.tokens:
            body = {
                "instance_id": order.instance_id,
                **self._key_body(token_ids),
                "tier": self.demote_tier,
                "force": False,
            }
            await self._call("delete", "POST", "/cache/delete", body, order)

    def _key_body(self, token_ids: list[int]) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "world_size": self.world_size,
            "token_ids": token_ids,
            "cache_salt": self.cache_salt,
        }

    # -- one call, with bounded retries -------------------------------------------------------

    async def _call(
        self, call: str, method: str, path: str, body: dict[str, Any] | None, order: Order | None
    ) -> dict[str, Any]:
        problem = ""
        where = order.instance_id if order is not None else "the coordinator"
        for attempt in range(1, self.max_attempts + 1):
            if self.fence is not None and call in FENCED_CALLS:
                try:
                    self.fence.check()
                except SinkFenced as exc:
                    raise _Failed("fenced", f"lmcache: {call} not made: {exc}") from None
            try:
                response = await self._http.request(method, path, json=body)
            except httpx.TimeoutException:
                problem = f"no answer within {self.timeout_seconds:g} s"
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                status = response.status_code
                if 200 <= status < 300:
                    try:
                        answer = response.json()
                    except ValueError:
                        answer = None
                    if not isinstance(answer, dict):
                        raise _Failed("refused", f"lmcache: {call} answered {response.text[:200]}")
                    self.last_error = None
                    return answer
                detail = _detail(response)
                # The MP server's 503, as the coordinator relays it (a 502 naming it): not
                # ready for this call, and no retry makes it ready.
                if status == 503 or (status == 502 and "503" in detail):
                    if call == "prefetch":
                        raise _Failed(
                            "no_layout",
                            f"lmcache: {where} cannot prefetch: no engine has registered its KV "
                            f"layout for model {self.model_name!r} (world size "
                            f"{self.world_size}) there yet ({detail})",
                        )
                    raise _Failed(
                        "server_unavailable",
                        f"lmcache: {where} cannot {call}: its MP server answered 503 (not "
                        f"initialized, or no L2 tier for a delete from {self.demote_tier!r}) "
                        f"({detail})",
                    )
                if status == 404 and "no MP server registered" in detail:
                    raise _Failed("unknown_instance", f"lmcache: {detail}")
                if status != 429 and status < 500:
                    raise _Failed("refused", f"lmcache: {call} refused: HTTP {status}: {detail}")
                problem = f"HTTP {status}: {detail}"
            if attempt < self.max_attempts:
                if self._metrics is not None:
                    self._metrics.lmcache_call_retried(call)
                await self._sleep(self._backoff(attempt))
        self.last_error = (
            f"lmcache coordinator {self.shown_url}: {call} gave up after {self.max_attempts} "
            f"attempt(s); last: {problem}"
        )
        raise _Failed("unreachable", self.last_error)

    def _backoff(self, attempt: int) -> float:
        """Exponential, capped, jittered to between half and all of it (as the webhook's)."""
        ceiling = min(self.max_backoff_seconds, self.backoff_seconds * 2 ** (attempt - 1))
        return ceiling * (0.5 + 0.5 * self._jitter())

    # -- reporting ----------------------------------------------------------------------------

    async def _ended(
        self,
        order: Order,
        problem: _Failed | None,
        *,
        nbytes: int = 0,
        seconds: float = 0.0,
    ) -> None:
        if self._metrics is not None:
            self._metrics.lmcache_order_ended(order.kind, problem.kind if problem else None)
        if problem is None:
            await self._progress(order, "completed", nbytes=nbytes, seconds=seconds)
            return
        log.warning("lmcache order %s (%s) failed: %s", order.order_id, order.kind, problem)
        await self._progress(order, "failed", reason=problem.reason)

    async def _progress(
        self,
        order: Order,
        status: Literal["accepted", "completed", "failed"],
        *,
        nbytes: int | None = None,
        seconds: float | None = None,
        reason: str | None = None,
    ) -> None:
        if self._report is None:
            return
        event = OrderProgress(
            event_id=progress_event_id(order.order_id, status),
            ts=self._now(),
            order_id=order.order_id,
            status=status,
            bytes=nbytes if status == "completed" else None,
            seconds=max(0.0, seconds) if status == "completed" and seconds is not None else None,
            reason=reason[:MAX_REASON_CHARS] if reason else None,
        )
        try:
            await self._report([event])
        except Exception:  # the engine refusing a report must not end the order's bookkeeping
            log.exception("lmcache: reporting %s %s failed", order.order_id, status)


def _detail(response: httpx.Response) -> str:
    """FastAPI's {"detail": ...}, else the body's start."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])[:300]
    return str(body)[:300]


__all__ = ["CALLS", "FAILURE_KINDS", "FENCED_CALLS", "LmcacheMetrics", "LmcacheSink", "Reporter"]
