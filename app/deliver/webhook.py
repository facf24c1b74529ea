"""WebhookSink: orders and cancels POSTed as JSON batches to one URL.

Body: `{"messages": [...]}`, each message an Order or Cancel in its JSON form (`type` tells them
apart; `kvprefetch_client.orders.message_adapter` reads one). Header `Idempotency-Key`: a digest
of the batch's messages (type and order id), the same on every retry of that batch, so a
receiver that saw the first try can answer the retry without acting twice; per message, the
order id is the key.

Retries: a connection error, a timeout, a 5xx or a 429 is tried again, up to
`max_attempts` tries, after an exponential backoff with jitter (`backoff_seconds` doubling, capped
at `max_backoff_seconds`), or after the receiver's `Retry-After` when it sends one. A Retry-After
longer than `max_backoff_seconds` is honoured by giving up at once (SinkUnavailable naming it)
rather than by holding the caller that long. Other 4xx answers are the receiver refusing the batch:
SinkRejected at once, no retry. The last failure is also kept on `last_error`.

With a planning lease the engine sets `fence` (app/deliver/fence.py): each POST, retries
included, goes out only while this replica holds the lease; else SinkFenced, nothing sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from email.utils import parsedate_to_datetime

import httpx

from app.core.redact import mask_url
from app.deliver._dedupe import RecentIds
from app.deliver.base import OrderSink, SinkClosed, SinkRejected, SinkUnavailable
from app.deliver.fence import Fence
from kvprefetch_client.orders import Cancel, Order

# Messages per POST: about 1 KB each with a few dozen blocks, so a batch stays well under the
# request limits receivers commonly set (1-10 MB).
BATCH_MESSAGES = 500


class WebhookSink(OrderSink):
    def __init__(
        self,
        url: str,
        *,
        timeout_seconds: float = 5.0,
        max_attempts: int = 5,
        backoff_seconds: float = 0.2,
        max_backoff_seconds: float = 5.0,
        dedupe_seconds: float = 3600.0,
        batch_messages: int = BATCH_MESSAGES,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.url = url
        # What errors and logs say: the path of a webhook URL is often its secret.
        self.shown_url = mask_url(url, keep_path=False)
        self.max_attempts = max_attempts
        self.backoff_seconds = backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.batch_messages = batch_messages
        self.last_error: str | None = None
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=timeout_seconds,
            headers={"content-type": "application/json", **(headers or {})},
        )
        # Seams for the tests: retries are timed without waiting.
        self._sleep = sleep
        self._jitter = jitter
        self._orders = RecentIds(dedupe_seconds, clock=clock)
        self._cancels = RecentIds(dedupe_seconds, clock=clock)
        self._closed = False
        self.fence: Fence | None = None  # set by the engine with a planning lease

    async def submit(self, orders: Sequence[Order]) -> list[str]:
        return await self._deliver(orders, self._orders)

    async def cancel(self, cancels: Sequence[Cancel]) -> list[str]:
        return await self._deliver(cancels, self._cancels)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._http.aclose()

    async def _deliver(self, messages: Sequence[Order | Cancel], seen: RecentIds) -> list[str]:
        if self._closed:
            raise SinkClosed("the webhook order sink is closed")
        # Reserved before sending, so a concurrent submit of the same id does not send it too;
        # released when the batch fails, so a resubmission retries it.
        fresh = [m for m in messages if seen.add(m.order_id)]
        sent: list[str] = []
        for start in range(0, len(fresh), self.batch_messages):
            batch = fresh[start : start + self.batch_messages]
            try:
                await self._post(batch)
            except BaseException:
                for m in fresh[start:]:
                    seen.discard(m.order_id)
                raise
            sent.extend(m.order_id for m in batch)
        return sent

    async def _post(self, batch: Sequence[Order | Cancel]) -> None:
        body = b'{"messages":[' + b",".join(m.to_json() for m in batch) + b"]}"
        headers = {"Idempotency-Key": idempotency_key(batch)}
        problem = ""
        for attempt in range(1, self.max_attempts + 1):
            wait = self._backoff(attempt)
            if self.fence is not None:
                self.fence.check()  # a holder that paused past its lease sends nothing
            try:
                response = await self._http.post(self.url, content=body, headers=headers)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                status = response.status_code
                if 200 <= status < 300:
                    self.last_error = None
                    return
                if status != 429 and status < 500:
                    self.last_error = (
                        f"{self.shown_url} refused {len(batch)} messages: "
                        f"HTTP {status}: {response.text[:200]}"
                    )
                    raise SinkRejected(self.last_error, status)
                problem = f"HTTP {status}"
                retry_after = parse_retry_after(response.headers.get("retry-after"))
                if retry_after is not None:
                    if retry_after > self.max_backoff_seconds:
                        self.last_error = (
                            f"{self.shown_url} answered {problem} with Retry-After "
                            f"{retry_after:g} s, longer than "
                            f"KVP_ORDER_WEBHOOK_MAX_BACKOFF_SECONDS "
                            f"({self.max_backoff_seconds:g} s): giving up after {attempt} "
                            f"attempt(s)"
                        )
                        raise SinkUnavailable(self.last_error)
                    wait = retry_after
            if attempt < self.max_attempts:
                await self._sleep(wait)
        self.last_error = (
            f"{self.shown_url}: gave up after {self.max_attempts} attempt(s); last: {problem}"
        )
        raise SinkUnavailable(self.last_error)

    def _backoff(self, attempt: int) -> float:
        """Exponential, capped, and jittered to between half and all of it, so that many senders
        failed together do not retry together."""
        ceiling = min(self.max_backoff_seconds, self.backoff_seconds * 2 ** (attempt - 1))
        return ceiling * (0.5 + 0.5 * self._jitter())


def idempotency_key(batch: Sequence[Order | Cancel]) -> str:
    """The same batch gives the same key (a retry); any other batch a different one."""
    digest = hashlib.blake2b(digest_size=16)
    for m in batch:
        digest.update(f"{m.type}:{m.order_id}\n".encode())
    return digest.hexdigest()


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (seconds, or an HTTP date); None when absent or
    unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
