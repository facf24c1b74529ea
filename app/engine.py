"""The engine: the service's parts, built once, wired in order, and the loops that run them.

Two drivers run the very same Engine: the HTTP service (app/api/main.py, a thin layer of routes
over these parts) and the replay simulator (sim/replay.py, under a simulated clock, calling
`ingest`, `score_tick` and `plan_tick` itself instead of starting the loops). The benches build
one too. What belongs to HTTP callers alone (tokens, rate limits, the batch parser) stays in
the HTTP layer.

`__init__` builds the parts in four steps (`_build_io`, `_build_models`, `_build_planning`,
`_build_ingest`). Ingestion: an accepted event is logged and applied by the Ingestor, told at
once to `immediate_observers` (the deployment's signals, the backlog), and from the backlog to
`observers`, the one ordered list of who hears of it (`_ordered_observers` says why each is where
it is; a sink adds its own through `OrderSink.attach`): by the backlog's loop, or without the
loops before a tick reads what they derive (`drain`, as the routes drain theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from app.core.clock import Clock, ScaledClock, SystemClock
from app.core.cluster import ClusterSpec
from app.core.config import Settings
from app.core.errors import ConfigError, StoreError
from app.core.runtime import young_collector
from app.decide.advisor import Thresholds
from app.decide.dispatcher import Dispatcher, feedback_observer
from app.decide.fleet_feed import FleetFeed
from app.decide.guard import GuardConfig, LruGuard
from app.decide.hints import HintConfig
from app.decide.lease import PlanningLease
from app.decide.popularity import PrefixPopularity
from app.decide.routing import RouteTracker
from app.decide.scheduler import Plan, Scheduler, SchedulerConfig
from app.decide.scorer import Scorer
from app.deliver import Fence, OrderSink, SinkBinding, build_sink
from app.ingest.backlog import Backlog
from app.ingest.base import EventLog
from app.ingest.eventlog import FileEventLog
from app.ingest.ingestor import Ingestor, IngestResult, Observer, Prepared
from app.ingest.vllm.subscriber import VllmSubscriber
from app.ingest.vllm.wire import parse_endpoints
from app.observe.ledger import AdviceLedger
from app.observe.metrics import Metrics, multiprocess_dir
from app.observe.outcomes import RequestOutcome, outcome_observer
from app.observe.timeline import LandedPrefetches, MeasuredStall, Timeline, capacity_for
from app.predict.features import DeploymentSignals
from app.predict.lifecycle import ModelLifecycle, restored_model_dir
from app.predict.retrain import Retrainer
from app.predict.slots import ModelSlots
from app.predict.tool_durations import tool_durations_for
from app.state import MemoryStore, StateStore, build_store
from app.state.base import LogPosition, SessionView
from app.state.storethread import StoreHealth, StoreThread
from kvprefetch_client.events import Event, OrderProgress, VllmKvEvents

log = logging.getLogger("kvprefetch")

# Without the loops, the backlog is handed over once it holds this many events (or before a
# tick): enough to spread each batch's cost (the metrics' sync), few enough that judging a
# batch's outcomes (app/observe/outcomes.py: each request against the blocks landed after it in
# the batch) stays cheap.
DRAIN_EVENTS = 256
# Live sessions a retrained model answers for before it shadows or serves (as the model routes').
MODEL_CHECK_SAMPLE = 256


# The observers another replica's batches reach too, with a planning lease (the fleet feed).
PLANNING_SIDE = frozenset({"scorer", "landed", "feedback"})


@dataclass(frozen=True)
class NamedObserver:
    """An ingest observer and the name it is known by (`Engine.observers`)."""

    name: str
    observe: Observer


class Engine:
    """The parts, as typed attributes. `store`, `clock`, `order_sink` and `event_log`, when
    given, are the caller's: the engine uses them and never closes them; what it built, it
    closes (`close`). `recover`: replay the event log past the store's checkpoint (the service
    does; a replay with a NullEventLog has nothing to replay). `load_model` False: serve the
    heuristic without loading KVP_MODEL_DIR (a replay whose policy never scores through it)."""

    def __init__(
        self,
        settings: Settings,
        *,
        store: StateStore | None = None,
        clock: Clock | None = None,
        order_sink: OrderSink | None = None,
        event_log: EventLog | None = None,
        recover: bool = True,
        load_model: bool = True,
    ) -> None:
        self.settings = settings
        self._build_io(settings, store, clock, order_sink, event_log)
        self._build_models(settings, load_model)
        self._build_planning(settings)
        self._build_ingest(settings)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.probe_task: asyncio.Task[None] | None = None
        self.backlog_task: asyncio.Task[None] | None = None
        self.scoring_task: asyncio.Task[None] | None = None
        self.planning_task: asyncio.Task[None] | None = None
        self.sampling_task: asyncio.Task[None] | None = None
        self.lease_task: asyncio.Task[None] | None = None
        self.feed_task: asyncio.Task[None] | None = None
        self.retrain_task: asyncio.Task[None] | None = None
        self.running = False
        self.closed = False
        self.replayed = self.ingestor.recover() if recover else 0
        self._check_clock()

    def _build_io(
        self,
        settings: Settings,
        store: StateStore | None,
        clock: Clock | None,
        order_sink: OrderSink | None,
        event_log: EventLog | None,
    ) -> None:
        """What the engine talks to: the clock, the order sink, the store, the event log."""
        # First: a bad KVP_VLLM_KV_ENDPOINTS entry stops startup, named.
        self.vllm_endpoints = parse_endpoints(settings.vllm_kv_endpoints)
        self.vllm: VllmSubscriber | None = None
        self.clock: Clock = clock or (
            SystemClock() if settings.clock_speed == 1 else ScaledClock(settings.clock_speed)
        )
        # First: a sink misconfigured (webhook without a URL) stops startup before anything opens.
        self.order_sink: OrderSink = order_sink if order_sink is not None else build_sink(settings)
        self._owns_sink = order_sink is None
        self.store: StateStore = store if store is not None else build_store(settings)
        self._owns_store = store is None
        # A blocking store (Redis) is called off the loop, one job at a time (decisions.md, 16).
        self.offload = not isinstance(self.store, MemoryStore)
        self.store_thread = StoreThread(offload=self.offload)
        self.store_health = StoreHealth(self.store, offload=self.offload)
        # With the memory store: the event log's writes and fsyncs, off the loop (`ingest_async`);
        # the last batch handed to it, settled once applied or refused; the events it holds.
        self._log_thread = ThreadPoolExecutor(1, thread_name_prefix="kvp-log")
        self._settled: asyncio.Future[None] | None = None
        self._logging_events = 0
        # The ids of the batches being logged: a batch holding one of them waits for them to
        # settle, so a client's retry that overlaps its first try is never logged twice.
        self._logging_ids: set[str] = set()
        self.event_log: EventLog = (
            event_log
            if event_log is not None
            else FileEventLog(
                settings.event_log_dir,
                segment_bytes=settings.log_segment_bytes,
                fsync=settings.log_fsync,
            )
        )
        self._owns_log = event_log is None

    def _build_models(self, settings: Settings, load_model: bool) -> None:
        """The cluster's numbers, the advice ledger, the metrics, the tools' run times and the
        models in their slots, with their lifecycle."""
        # Each set once: the cluster's numbers (read by the scheduler, route hints, outcomes and
        # the ledger's cost of advice) and the planner's thresholds (read by the scorer's
        # advisor and the scheduler alike).
        self.cluster = ClusterSpec.from_settings(settings)
        # Both keep per-session maps, forgotten with the store's sessions (by event time).
        self.ledger = AdviceLedger(
            retention_seconds=settings.session_retention_seconds,
            # The judge of a shadow scores P(back within the keep horizon).
            judge_horizon_seconds=settings.keep_horizon_seconds,
            bytes_per_block=self.cluster.bytes_per_block,
        )
        self.hint_config = HintConfig.for_cluster(self.cluster)
        self.thresholds = Thresholds.from_settings(settings)
        self.metrics = Metrics(
            gpu_hour_price_dollars=settings.gpu_hour_price, multiprocess=multiprocess_dir()
        )
        # Each tool's run times and the tool calls in flight, from the agents' signals (the
        # models' tool features, the advice of a session whose call is in flight, its pin's price).
        self.tools = tool_durations_for(settings, on_return=self.metrics.tool_returned)
        # Whether this deployment sends signals (the models' deployment features): told each
        # accepted batch at ingest, in the store's order, as training replays a log.
        self.deployment = DeploymentSignals()
        # A service (it keeps an event log) serves the model chosen at run time before a restart.
        keeps_state = self.event_log.directory is not None
        serve_dir = (
            restored_model_dir(settings.data_dir, settings.models_root_dir, settings.model_dir)
            if keeps_state
            else settings.model_dir
        )
        self.models = ModelSlots(
            serve_dir if load_model else None,
            settings.shadow_model_dir,
            ledger=self.ledger,
            models_root=settings.models_root_dir,
            deployment=self.deployment,
            tools=self.tools,
            # A service starts at once, the Booster serving until lleaves has compiled a model
            # it has not cached; a replay (no event log) compiles first.
            compile_in_background=keeps_state,
        )
        # Every model change goes through it: logged as an event, the serving choice kept.
        self.lifecycle = ModelLifecycle(
            self.models,
            self.clock,
            self._ingest_record,
            data_dir=settings.data_dir if keeps_state else None,
            configured=settings.model_dir,
            replica_id=settings.replica_id,
        )

    def _build_planning(self, settings: Settings) -> None:
        """The scheduler and what it reads (routes, popularity, the LRU guard), the scorer, the
        dispatcher under its lease, the timeline and the retrainer."""
        self.scheduler = Scheduler(
            self.store,
            SchedulerConfig.from_cluster(
                self.cluster,
                self.thresholds,
                overdue_seconds=settings.order_overdue_seconds,
                retry_backoff_seconds=settings.order_retry_backoff_seconds,
                retry_backoff_max_seconds=settings.order_retry_backoff_max_seconds,
                pins_hold_room=settings.pins_hold_room,
            ),
            tools=self.tools,
        )
        self.routes = RouteTracker(retention_seconds=settings.session_retention_seconds)
        self.popularity = PrefixPopularity()
        self.guard: LruGuard | None = (
            LruGuard(
                GuardConfig(
                    bytes_per_block=self.cluster.bytes_per_block,
                    min_arrivals=settings.lru_guard_min_arrivals,
                    retry_seconds=settings.lru_guard_retry_seconds,
                    demote_pricing=settings.lru_guard_demotes,
                )
            )
            if settings.lru_guard
            else None
        )
        self.metrics.bind(
            scheduler=self.scheduler,
            ledger=self.ledger,
            models=self.models,
            guard=self.guard,
            tools=self.tools,
        )
        self.scorer = Scorer(
            self.store,
            self.models,
            self.ledger,
            self.clock,
            sessions_per_tick=settings.score_sessions_per_tick,
            scheduler=self.scheduler,
            routes=self.routes.estimate,
            popularity=self.popularity,
            deployment=self.deployment,
            tools=self.tools,
            observe_seconds=self.metrics.scored,
            thresholds=self.thresholds,
            guard=self.guard,
            every_live=settings.score_all_live,
            chunk_sessions=settings.score_chunk_sessions,
            chunk_target_seconds=settings.score_chunk_target_seconds or None,
            session_retention_seconds=settings.session_retention_seconds,
        )
        self.lease = self._planning_lease(settings)
        self.dispatcher = Dispatcher(
            self.scheduler,
            self.order_sink,
            self.clock,
            observe_seconds=self.metrics.planned,
            offload=self.store_thread.run,
            lease=self.lease,
            skipped=self.metrics.planning_skipped_ticks.inc,
            planned=self.guard.planned if self.guard is not None else None,
        )
        self.landed, self._measured = LandedPrefetches(self.scheduler), MeasuredStall()
        self.timeline = Timeline(
            self.ledger,
            self.scheduler,
            self.models,
            self.clock,
            landed=self.landed,
            stall=self._measured.stall,
            capacity=capacity_for(settings.dashboard_sample_seconds),
        )
        # Retraining on a schedule (off unless KVP_RETRAIN_EVERY_SECONDS): the loop in start().
        self.retrainer = Retrainer(
            settings,
            self.models,
            self.ledger,
            self.clock,
            lifecycle=self.lifecycle,
            log_dir=self.event_log.directory,
            sample=self._model_sample,
            metrics=self.metrics,
        )
        # With a planning lease, the other replicas' accepted events reach the planning side
        # (app/decide/fleet_feed.py); the ledger, outcomes and metrics count this replica's own.
        self.feed = (
            FleetFeed(
                settings.redis_url.get_secret_value(),
                settings.redis_prefix,
                # Per process: the workers of `serve --workers N` share a replica id, and each
                # must read its siblings' events.
                f"{settings.replica_id}:{os.getpid()}",
                timeout_seconds=settings.redis_timeout_seconds,
            )
            if self.lease is not None
            else None
        )

    def _build_ingest(self, settings: Settings) -> None:
        """The ingest path: the ingestor, its observers told at once, the backlog and its
        observers told in order (`observers`, the one list: see its docstring)."""
        self.observers = self._ordered_observers()
        self._fleet_observer = compose_observers(
            [o.observe for o in self.observers if o.name in PLANNING_SIDE]
        )
        self.backlog = Backlog(
            compose_observers([o.observe for o in self.observers]), settings.backlog_max_events
        )
        self.young_gc = young_collector()
        # Told at once, not from the backlog: the next score reads what was just applied.
        self.immediate_observers = [
            NamedObserver("deployment", self.deployment.observe),
            NamedObserver("backlog", self.backlog.put),
            *([NamedObserver("fleet_feed", self.feed.publish)] if self.feed is not None else []),
            # Under `serve`: the young generations collected every so many events
            # (app/core/runtime.py), not once the store forgets as fast as it learns.
            *(
                [NamedObserver("young_gc", self.young_gc.observe)]
                if self.young_gc is not None
                else []
            ),
        ]
        self.ingestor = Ingestor(
            self.store,
            self.event_log,
            replica_id=settings.replica_id,
            clock=self.clock,
            max_clock_skew_seconds=settings.max_clock_skew_seconds,
            observer=compose_observers([o.observe for o in self.immediate_observers]),
            refused=self.metrics.events_refused,
        )

    def _ordered_observers(self) -> list[NamedObserver]:
        """Who hears of each accepted batch, from the backlog, in this order (tests/
        test_engine.py pins it and says why each is where it is):

        the ledger scores the arrivals against the advice in force before anything else moves;
        then the planning side (what another replica's batches also reach: the scorer, the
        landed prefetches before the scheduler's feedback, which forgets a completed order);
        then what the sink needs (the pull queue's order_progress, LMCache's tokens); the LRU
        guard before the outcomes (it looks each arrival up in its LRU); the outcomes; the tools'
        run times; the retrainer when it is on; last the metrics, which sync their counters with
        what the others counted just now."""
        sink = self.order_sink.attach(
            SinkBinding(
                report=self._report_progress,
                metrics=self.metrics,
                now=self.clock.now,
                on_loop=self._on_loop if self.offload else (lambda observer: observer),
            )
        )
        return [
            NamedObserver("ledger", self.ledger.observe),
            NamedObserver("scorer", self.scorer.observe),
            NamedObserver("landed", self.landed.observe),
            NamedObserver(
                "feedback", feedback_observer(self.scheduler, self.routes, self.popularity)
            ),
            *(NamedObserver(f"sink:{type(self.order_sink).__name__}", o) for o in sink),
            *([NamedObserver("guard", self.guard.observe)] if self.guard is not None else []),
            NamedObserver(
                "outcomes", outcome_observer(self.store, self.cluster, self._record_outcomes)
            ),
            NamedObserver("tools", self.tools.observe),
            *(
                [NamedObserver("retrainer", self.retrainer.observe)]
                if self.settings.retrain_every_seconds > 0
                else []
            ),
            NamedObserver("metrics", self.metrics.observe),
        ]

    def _planning_lease(self, settings: Settings) -> PlanningLease | None:
        """With KVP_PLANNING_LEASE_SECONDS, the lease this replica plans under (decisions.md,
        23); None: it plans for itself (and counts as planning in kvprefetch_planning_leader)."""
        if settings.planning_lease_seconds <= 0:
            self.metrics.planning_leader.set(1)
            return None
        if settings.store != "redis":
            raise ConfigError("KVP_PLANNING_LEASE_SECONDS needs KVP_STORE=redis")
        if not self.order_sink.fleet_wide:
            raise ConfigError(
                "KVP_PLANNING_LEASE_SECONDS needs an order sink every replica reaches: "
                "KVP_ORDER_SINK=redis (agents read the streams in Redis), webhook or lmcache; "
                "the pull sink's queues live in one replica"
            )
        lease = PlanningLease.from_url(
            settings.redis_url.get_secret_value(),
            settings.redis_prefix,
            settings.replica_id,
            settings.planning_lease_seconds,
            timeout_seconds=settings.redis_timeout_seconds,
        )
        lease.on_gain = self._take_over
        lease.on_loss = self._lose_lease
        # Every replica reaches its orders: nothing of a lapsed term goes out.
        self.order_sink.fence = Fence(lease.key, lambda: lease.value if lease.held else None)
        self.metrics.planning_leader.set(0)
        return lease

    async def _take_over(self, token: int, state: dict[str, str]) -> None:
        adopted = await self.store_thread.run(
            self.scheduler.take_over, token, state, fail_fast=False
        )
        self.metrics.planning_terms.inc()
        self.metrics.planning_adopted_orders.inc(adopted)
        self.metrics.planning_leader.set(1)
        log.info("planning: term %d, %d open orders taken over", token, adopted)

    async def _follow_feed(self, feed: FleetFeed) -> None:
        """The other replicas' accepted events, to the planning side, on the store thread."""
        failing = False
        while True:
            try:
                batches = feed.read_batches
                events = await feed.read()
                if events:
                    await self.store_thread.run(self._fleet_observer, events, fail_fast=False)
                    self.metrics.fleet_feed_applied_events.inc(len(events))
                    self.metrics.fleet_feed_applied_batches.inc(feed.read_batches - batches)
                failing = False
            except Exception as exc:  # Redis away: read again once it answers
                if not failing:
                    log.warning("the fleet's events not read: %s", exc)
                    failing = True
                await asyncio.sleep(0.5)

    async def _lose_lease(self) -> None:
        # Its open orders are the next planner's now: followed here too, their completions would
        # count on two replicas.
        await self.store_thread.run(self.scheduler.take_over, 0, {}, fail_fast=False)
        self.metrics.planning_leader.set(0)

    def order_owner(self, order_id: str) -> tuple[str | None, str | None]:
        """An order's instance and the agent it is leased to, as far as this replica knows
        (the pull queue knows both; the planner's open orders the instance): (None, None) for
        an order it does not know. What a bound token's order_progress is checked against."""
        owned = self.order_sink.owner(order_id)
        if owned is not None:
            return owned
        order = self.scheduler.open_order(order_id)
        return (order.instance_id if order is not None else None), None

    def _check_clock(self) -> None:
        try:
            ahead = self.ingestor.newest_ahead_of_clock()
        except StoreError:  # a diagnostic: the store's health is reported by its probe
            ahead = None
        if ahead is not None:
            log.error(
                "the store has taken an event stamped %r, more than KVP_MAX_CLOCK_SKEW_SECONDS "
                "ahead of the clock, before such events were refused: its session retention "
                "and reorder windows count from there. Clear the store (its keys under "
                "KVP_REDIS_PREFIX) and restart: the log is replayed without such events.",
                ahead,
            )

    def _record_outcomes(
        self, outcomes: Sequence[RequestOutcome]
    ) -> None:  # /metrics, the dashboard
        self.metrics.record_outcomes(outcomes)
        self._measured.record_outcomes(outcomes)
        if self.guard is not None:
            self.guard.record(outcomes, self.clock.now())

    async def _report_progress(self, events: Sequence[OrderProgress]) -> None:
        """A sink's own order_progress (the lmcache sink's), ingested as posted events are."""
        await self.ingest_async(events)

    async def _model_sample(self) -> list[SessionView]:
        """Live sessions a retrained model must answer for (as POST /v1/model/reload checks)."""
        return list(await self.store_thread.read(self.store.live_sessions, MODEL_CHECK_SAMPLE))

    async def _ingest_record(self, events: Sequence[Event]) -> None:
        """The service's own records (model_changed) into the log, as posted events go."""
        await self.ingest_async(events)

    async def retrain_step(self, *, force: bool = False) -> str | None:
        """One step of the retraining schedule now (a driver without the loops, like a replay's);
        `force`: start a run whatever the schedule. The outcome of a run that ended, else None."""
        if not self.running:
            self.backlog.drain()
        return await self.retrainer.step(force=force)

    def _on_loop(self, observer: Observer) -> Observer:
        """`observer`, told on the engine's loop (in order) once it runs; before, at once."""

        def observe(events: Sequence[Event]) -> None:
            loop = self._loop
            if loop is None:
                observer(events)
            else:
                loop.call_soon_threadsafe(observer, events)

        return observe

    # -- what the drivers call -----------------------------------------------------------------

    def ingest(self, events: Sequence[Event], body: bytes | None = None) -> IngestResult:
        """Validate, dedupe, log and apply `events` (the Ingestor); `body`: the posted batch they
        were parsed from. The observers hear of them from the backlog: its loop's, when the
        loops run; else `drain` (the ticks drain first), or this once the backlog holds a chunk."""
        result = self.ingestor.ingest(events, body)
        self._drain_without_loops()
        return result

    async def ingest_async(
        self, events: Sequence[Event], body: bytes | None = None, *, check_room: bool = False
    ) -> IngestResult | None:
        """`ingest` for the drivers on the event loop; with `check_room`, None when the backlog
        has no room for the batch (counting the batches still being logged).

        With a blocking store the whole ingest runs on the store thread (with the memory store
        and KVP_LOG_THREAD off, inline on the loop). With the memory store it runs on the loop but
        for the log's write and fsync, on the log thread meanwhile: the next batch is checked and
        handed to the log while one is written (docs/decisions.md, 26), and batches are applied in
        the order logged. A caller cancelled midway (a request that timed out) leaves its batch
        to finish: once logged it must be applied."""
        if self.offload or not self.settings.log_thread:

            def admit_and_ingest() -> IngestResult | None:
                if check_room and not self.backlog.has_room(len(events)):
                    return None
                return self.ingest(events, body)

            return await self.store_thread.run(admit_and_ingest)
        if check_room and not self.backlog.has_room(len(events), self._logging_events):
            return None
        while self._logging_ids and self._settled is not None:
            if self._logging_ids.isdisjoint(e.event_id for e in events):
                break
            await asyncio.shield(self._settled)
        prepared = self.ingestor.prepare(events, body)
        if not prepared.fresh:
            return prepared.result
        # Handed to the log thread in this same turn of the loop: the log takes batches in the
        # order they were prepared.
        loop = asyncio.get_running_loop()
        written = loop.run_in_executor(self._log_thread, self.event_log.append, prepared.data)
        before, self._settled = self._settled, loop.create_future()
        self._logging_events += len(prepared.fresh)
        self._logging_ids.update(e.event_id for e in prepared.fresh)
        task = asyncio.ensure_future(self._settle(prepared, written, before, self._settled))
        # A caller cancelled midway never reads its batch's outcome: taken here, so asyncio does
        # not log it as lost (its client retries and finds its events applied or not there).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    async def _settle(
        self,
        prepared: Prepared,
        written: asyncio.Future[LogPosition],
        before: asyncio.Future[None] | None,
        settled: asyncio.Future[None],
    ) -> IngestResult:
        """Commit a batch once the log has it and the batch before it is settled; abandon it when
        the log refused it."""
        try:
            try:
                position = await written
            finally:
                if before is not None:
                    await before
            result = self.ingestor.commit(prepared, position)
            self._drain_without_loops()
            return result
        except BaseException:
            if not written.done() or written.cancelled() or written.exception() is not None:
                self.ingestor.abandon(prepared)
            raise
        finally:
            self._logging_events -= len(prepared.fresh)
            self._logging_ids.difference_update(e.event_id for e in prepared.fresh)
            settled.set_result(None)

    def _drain_without_loops(self) -> None:
        """Without the backlog's loop, hand the observers what a chunk's worth of ingests left."""
        if not self.running and self.backlog.events >= DRAIN_EVENTS:
            self.backlog.drain()

    def drain(self) -> int:
        """Tell the observers what the backlog holds, now (without the loops: a driver reading
        what the planning side derives, as the routes do with theirs); returns how many."""
        return self.backlog.drain()

    def score_tick(
        self,
        session_ids: Sequence[str] | None = None,
        *,
        views: Sequence[SessionView] | None = None,
    ) -> int:
        """One scoring tick now (by the engine's clock): a pass over every live session
        (KVP_SCORE_ALL_LIVE; else a page of them), or exactly `session_ids` in that order (a
        driver that decides which, like the replay's policy), or `views`, those sessions as the
        driver just read them from the store."""
        if not self.running:
            self.backlog.drain()
        return self.scorer.tick(session_ids, views=views)

    async def plan_tick(self) -> Plan:
        """One planning tick now: the scheduler's plan, delivered to the order sink."""
        if not self.running:
            self.backlog.drain()
        return await self.dispatcher.tick()

    async def start(self) -> None:
        """Probe the store once, then run the loops (backlog, store probe, scoring, planning,
        dashboard sampling, retraining when on) on the running event loop until `close`."""
        if self.running or self.closed:
            return
        self._loop = asyncio.get_running_loop()
        settings = self.settings
        # The loops' intervals are in the clock's seconds (KVP_CLOCK_SPEED): each waits as long
        # in wall time divided by its speed.
        per_clock = 1.0 / settings.clock_speed
        await self.store_health.refresh(settings.redis_timeout_seconds)
        self.running = True
        self.probe_task = asyncio.create_task(
            self.store_health.run(settings.store_probe_interval_seconds)
        )
        self.backlog_task = asyncio.create_task(self.backlog.run(self.store_thread.run))
        self.scoring_task = (
            asyncio.create_task(
                self.scorer.run(settings.score_interval_seconds * per_clock, self.store_thread.run)
            )
            if settings.score_interval_seconds > 0
            else None
        )
        if self.lease is not None:
            await self.lease.step()  # a replica alone plans from its first tick
            self.lease_task = asyncio.create_task(self.lease.run())
        if self.feed is not None:
            self.feed_task = asyncio.create_task(self._follow_feed(self.feed))
        self.planning_task = (
            asyncio.create_task(self.dispatcher.run(settings.plan_interval_seconds * per_clock))
            if settings.plan_interval_seconds > 0
            else None
        )
        self.sampling_task = (
            asyncio.create_task(self.timeline.run(settings.dashboard_sample_seconds * per_clock))
            if settings.dashboard_sample_seconds > 0
            else None
        )
        self.retrain_task = (
            asyncio.create_task(self.retrainer.run())
            if settings.retrain_every_seconds > 0
            else None
        )
        if self.vllm_endpoints:
            self.vllm = VllmSubscriber(
                self.vllm_endpoints,
                self._deliver_vllm,
                counters=self.metrics,
                replay_timeout_seconds=settings.vllm_replay_timeout_seconds,
                replay_retry_seconds=settings.vllm_replay_retry_seconds,
                replay_buffer_steps=settings.vllm_replay_buffer_steps,
                max_message_bytes=settings.vllm_max_message_bytes,
                receive_queue=settings.vllm_receive_queue,
            )
            self.vllm.start()
        self._tasks = [
            t
            for t in (
                self.retrain_task,
                self.scoring_task,
                self.planning_task,
                self.sampling_task,
                self.backlog_task,
                self.probe_task,
                self.lease_task,
                self.feed_task,
            )
            if t is not None
        ]

    def _deliver_vllm(self, batches: list[VllmKvEvents]) -> None:
        """A vLLM publisher's thread hands its batches to the loop, as POST /v1/events does
        (the same ingest, on the store thread), and waits until they are durable."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._ingest_vllm(batches), self._loop).result()

    async def _ingest_vllm(self, batches: list[VllmKvEvents]) -> None:
        # A full backlog holds the stream back (the publishers buffer, then replay) rather than
        # dropping it.
        while (result := await self.ingest_async(batches, check_room=True)) is None:
            await asyncio.sleep(0.05)
        if result.rejected:  # counted by kvprefetch_events_refused_total; the first one said
            log.warning("vLLM batches refused: %s", result.rejected[0].message)

    async def close(self) -> None:
        """Stop the loops, hand the backlog to the observers, and close what the engine built.
        A second call does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.vllm is not None:  # first: it waits on the loop for its batch in progress
            await asyncio.to_thread(self.vllm.stop)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.lease is not None:  # a clean stop hands planning over at once
            await self.lease.close()
        if self.feed is not None:
            await self.feed.close()
        if self._settled is not None:  # the batches whose log write is under way, applied
            await self._settled
        await self.store_thread.run(self.backlog.drain, fail_fast=False)
        self.running = False
        self.store_thread.close()
        self._log_thread.shutdown(wait=True)
        self.store_health.close()
        await asyncio.sleep(0)  # what the drain handed to the loop (_on_loop)
        if self._owns_log:
            self.event_log.close()
        self.metrics.close()
        if self._owns_store:
            self.store.close()
        if self._owns_sink:
            await self.order_sink.close()


def compose_observers(observers: Sequence[Observer]) -> Observer:
    """One ingest observer telling each of `observers` in turn; one failing does not keep the
    events from the others."""
    if len(observers) == 1:
        return observers[0]

    def observe(events: Sequence[Event]) -> None:
        for observer in observers:
            try:
                observer(events)
            except Exception:
                log.exception("ingest observer %r failed on %d events", observer, len(events))

    return observe


__all__ = ["PLANNING_SIDE", "Engine", "NamedObserver", "compose_observers"]
