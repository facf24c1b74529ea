"""The service's Prometheus metrics: built once per app (app.state.metrics), served at GET /metrics.

Every metric is named `kvprefetch_*`, in base units (seconds, bytes; dollars for the cost), with
`_total` only on counters; ratios (hit rates) are left to PromQL over the counters, and no label
takes an unbounded value (no session, request or order ids; a rejected event's field is one of the
event schemas' field names or `other`). README.md ("Metrics") lists every metric.

Where the numbers come from:

- **At the source**, through seams that exist anyway: the ingest observer (events by type, what
  each arriving request found: app/observe/outcomes.py), POST /v1/events (duplicates,
  rejections), timing hooks on the scoring and planning loops (latency histograms).
- **From the totals their owners keep**: the scheduler's `SchedulerTotals` and the advice
  ledger's counts per model are the one bookkeeping of orders and would-be hits; `sync()` adds
  what they grew by since it last looked to the counters here. It runs after each ingest batch,
  each scoring and planning tick, and each scrape, so in multiprocess mode every worker's files
  are at most a tick behind its totals. A ledger slot counts afresh when a model is swapped in:
  `sync()` sees the new model and counts from zero again, so the exported counter never goes back.
  A custom collector reading the totals at scrape time would be simpler, but with several
  workers only the worker answering the scrape would be read.

Registries. One `CollectorRegistry` per app, not prometheus-client's global REGISTRY, so tests
building many apps in one process never collide. The exception is multiprocess mode
(PROMETHEUS_MULTIPROC_DIR set, as `kvprefetch serve --workers N` does): prometheus-client then
keeps every value in per-process files in that directory, keyed by metric name and labels, and a
scrape reads all workers' files with MultiProcessCollector; so one app per process, and the
directory must be emptied before the workers start (app/core/multiprocess.py, run by `serve`).
Gauges need a `multiprocess_mode` there: the model info gauge uses `livemax` (a version is
reported while any live worker serves it; a worker's values go when it shuts down).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import threading
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from app.core.multiprocess import multiprocess_dir, prepare_multiprocess_dir
from app.deliver.lmcache import CALLS as LMCACHE_CALLS
from app.deliver.lmcache import FAILURE_KINDS as LMCACHE_FAILURES
from app.ingest.ingestor import REFUSAL_REASONS
from app.ingest.vllm.wire import BAD_INPUT_REASONS
from app.observe.judge import JudgeStats
from app.observe.ledger import SLOTS, LedgerStats
from app.observe.outcomes import OUTCOMES, RequestOutcome
from app.observe.signals import FOLLOW_WINDOW_SECONDS, OTHER_KIND, SignalFollowups
from app.predict.tool_durations import OTHER_TOOL
from kvprefetch_client.events import (
    EVENT_TYPES,
    SIGNAL_KINDS,
    Event,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
)

__all__ = [
    "CONTENT_TYPE",
    "Metrics",
    "multiprocess_dir",
    "prepare_multiprocess_dir",
    "rejection_field",
]

from app.decide.guard import GUARD_STATES

if TYPE_CHECKING:
    from app.decide.guard import LruGuard
    from app.decide.scheduler import Scheduler
    from app.observe.ledger import AdviceLedger
    from app.predict.slots import ModelSlots, Serving
    from app.predict.tool_durations import ToolDurations
    from app.state.storethread import StoreSnapshot

# Text format 0.0.4: every name here is a classic one, so every Prometheus (2.x, 3.x) and
# promtool read it; prometheus-client's default (1.0.0) is for UTF-8 names.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# A planning tick takes ~1-50 ms and a scoring page of 256 sessions 10-30 ms per model (README,
# KVP_SCORE_SESSIONS_PER_TICK): buckets from 0.5 ms to 1 s, finer where the ticks fall, and
# room above for a tick that holds the event loop too long.
PLAN_BUCKETS_SECONDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
# A pass over every live session (KVP_SCORE_ALL_LIVE) takes ~0.45 s a model at 100,000 sessions
# on the 2-core development machine: room above a second too.
INFERENCE_BUCKETS_SECONDS = (*PLAN_BUCKETS_SECONDS, 2.5, 5.0)
# An agent's tool calls: a fraction of a second (a lookup) to many minutes (a build, a test suite).
TOOL_BUCKETS_SECONDS = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)

ORDER_KINDS = ("prefetch", "pin", "demote")
# What POST /v1/events answers a body it refuses whole (app/api/routes/events.py).
REFUSED_CODES = (400, 413, 415, 422)
ADVICE_OUTCOMES = ("hit", "miss", "unscored")
# The store's counts (StateStore.stats()) exported as kvprefetch_store_objects{kind}.
STORE_KINDS = (
    "sessions",
    "instances",
    "locations",
    "resident_blocks",
    "orders",
    "remembered_event_ids",
)
# A rejected event whose error is about the event as a whole (not an object, no or an unknown
# type, fields that do not fit together), or about a field no event schema has (a typo: its
# name is the client's, so it is not a label value).
WHOLE_EVENT, OTHER_FIELD = "event", "other"
_INDEX = re.compile(r"\[\d+\]")
_EVENT_PREFIX = re.compile(r"^events\[\d+\]\.?")


def _schema_fields() -> frozenset[str]:
    """Every field name an event may be rejected for, as `rejection_field` spells it."""
    names: set[str] = set()
    for model in typing.get_args(typing.get_args(Event)[0]):  # Event: Annotated[Union[...], ...]
        names.update(model.model_fields)
    # vllm_kv_events' inner events: events[i].events[j].block_hashes -> events.block_hashes
    for model in (VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared):
        names.update(f"events.{n}" for n in model.model_fields)
    return frozenset(names)


SCHEMA_FIELDS = _schema_fields()


def rejection_field(path: str) -> str:
    """A rejection's field path as a bounded label value: 'events[3].prompt_tokens' ->
    'prompt_tokens', 'events[4].events[0].block_hashes[2]' -> 'events.block_hashes',
    'events[2]' -> 'event', an unknown field -> 'other'."""
    name = _INDEX.sub("", _EVENT_PREFIX.sub("", path, count=1))
    if not name:
        return WHOLE_EVENT
    return name if name in SCHEMA_FIELDS else OTHER_FIELD


class Metrics:
    """Every metric of one app, on its own registry; the ingest observer, the events route and the
    loops' timing hooks feed it, and `exposition()` is what GET /metrics answers."""

    def __init__(self, *, gpu_hour_price_dollars: float, multiprocess: Path | None = None) -> None:
        # The `_created` series double the exposition and multiprocess mode has none: off, so both
        # modes expose the same families. (A process-wide switch in prometheus-client.)
        prometheus_client.disable_created_metrics()
        self.gpu_hour_price_dollars = gpu_hour_price_dollars
        self.multiprocess = multiprocess
        self.registry = r = CollectorRegistry(auto_describe=True)
        if multiprocess is None:
            # The process's CPU, memory and GC, as the default registry would have them; they
            # mean nothing summed over workers, so multiprocess mode has none.
            prometheus_client.ProcessCollector(registry=r)
            prometheus_client.PlatformCollector(registry=r)
            prometheus_client.GCCollector(registry=r)
        # Grouped by area, each family defined once in its group's builder below.
        self._ingest_metrics(r)
        self._advice_metrics(r)
        self._order_metrics(r)
        self._store_metrics(r)
        self._guard_metrics(r)
        self._retrain_metrics(r)
        self._lmcache_metrics(r)
        self._vllm_metrics(r)
        self._tool_metrics(r)
        self._lease_metrics(r)
        self._label_children()
        self._scheduler: Scheduler | None = None
        self._ledger: AdviceLedger | None = None
        self._models: ModelSlots | None = None
        self._guard: LruGuard | None = None
        self._tools: ToolDurations | None = None
        self._tool_labels_version = -1
        self._tools_in_flight: dict[str, int] = {}
        # tool label -> its histogram child: 'other' from the start, the tracked tools as they come
        self._tool_children: dict[str, Histogram] = {
            OTHER_TOOL: self.tool_seconds.labels(OTHER_TOOL)
        }
        self.tools_in_flight.labels(OTHER_TOOL)
        # sync() runs on the store thread (ingest, ticks) and on the loop (a scrape).
        self._sync_lock = threading.RLock()
        self._seen: dict[object, int] = {}  # a source total -> its value at the last sync
        self._children: dict[object, Counter] = {}  # a source total -> its series
        self._scheduler_seen: tuple[object, ...] | None = None
        self._ledger_seen: dict[str, tuple[Serving, LedgerStats]] = {}
        self._versions: dict[str, str | None] = {}

    def _ingest_metrics(self, r: CollectorRegistry) -> None:
        """Events, signals and batches at the ingest path."""
        self.events_ingested = Counter(
            "kvprefetch_events_ingested",
            "Events accepted (durable and applied), by event type.",
            ["type"],
            registry=r,
        )
        self.events_duplicate = Counter(
            "kvprefetch_events_duplicate",
            "Events acknowledged as duplicates of an event id already accepted.",
            registry=r,
        )
        self.events_rejected = Counter(
            "kvprefetch_events_rejected",
            "Events rejected by validation, by the first field named (schema field names; "
            "'event': the event as a whole; 'other': a field no event has).",
            ["field"],
            registry=r,
        )
        self.events_refused_by_time = Counter(
            "kvprefetch_events_refused",
            "Events not taken, by reason: 'clock_skew', more than "
            "KVP_MAX_CLOCK_SKEW_SECONDS ahead of the service clock (rejected when posted, skipped "
            "when replayed from the log); 'past_retention', a session or order event older than "
            "the session retention (rejected); 'instance_cap', naming an instance past the "
            "KVP_MAX_INSTANCES the store holds (rejected).",
            ["reason"],
            registry=r,
        )
        self.signals_received = Counter(
            "kvprefetch_signals",
            "session_signal events accepted, by kind: the common kinds, a deployment's first few "
            "own kinds, the rest as 'other' (app/observe/signals.py).",
            ["kind"],
            registry=r,
        )
        self.signals_followed = Counter(
            "kvprefetch_signals_followed",
            "Signals followed by a request_routed of the same session at most "
            f"{FOLLOW_WINDOW_SECONDS:g} s later (event time), by the signal's kind.",
            ["kind"],
            registry=r,
        )
        self.batches_refused = Counter(
            "kvprefetch_event_batches_refused",
            "POST /v1/events bodies refused whole (nothing accepted), by HTTP status code.",
            ["code"],
            registry=r,
        )

    def _advice_metrics(self, r: CollectorRegistry) -> None:
        """Each model's predictions, its advice judged, and what the models are."""
        self.predictions = Counter(
            "kvprefetch_predictions",
            "Sessions scored (advice records made) by the model in each slot.",
            ["slot"],
            registry=r,
        )
        self.advice_outcomes = Counter(
            "kvprefetch_advice_outcomes",
            "Arriving requests judged against each model's advice in force: hit (keep or "
            "prefetch), miss (demote or lru), unscored (no advice).",
            ["slot", "outcome"],
            registry=r,
        )
        self.advice_bytes = Counter(
            "kvprefetch_advice_bytes",
            "The cost of each model's advice: the sessions' context bytes summed over its advice "
            "records that said keep (advice=keep) or prefetch (advice=prefetch), as predictions "
            "are counted; the two slots advise the same sessions at the same ticks.",
            ["slot", "advice"],
            registry=r,
        )
        self.model_info = Gauge(
            "kvprefetch_model_info",
            "The model serving in each slot (1); version 'heuristic' when no model loads.",
            ["slot", "version"],
            registry=r,
            multiprocess_mode="livemax",
        )

    def _order_metrics(self, r: CollectorRegistry) -> None:
        """The scheduler's orders, the prefetched bytes, the reuse of contexts and the loops'
        timings."""
        self.orders_issued = Counter(
            "kvprefetch_orders_issued",
            "Orders the scheduler issued, by kind.",
            ["kind"],
            registry=r,
        )
        self.orders_completed = Counter(
            "kvprefetch_orders_completed",
            "Orders completed (reported, or their blocks seen at the destination).",
            ["kind"],
            registry=r,
        )
        self.orders_failed = Counter(
            "kvprefetch_orders_failed",
            "Orders failed (reported by the agent, or not taken by the sink).",
            ["kind"],
            registry=r,
        )
        self.orders_cancelled = Counter(
            "kvprefetch_orders_cancelled",
            "Orders cancelled before they started.",
            ["kind"],
            registry=r,
        )
        self.prefetch_ordered_bytes = Counter(
            "kvprefetch_prefetch_ordered_bytes", "Bytes in the prefetch orders issued.", registry=r
        )
        # Landed prefetch bytes end used or wasted, or still wait: used + wasted + waiting =
        # landed (app/decide/order_book.py).
        self.prefetch_landed_bytes = Counter(
            "kvprefetch_prefetch_landed_bytes",
            "Bytes of prefetches that landed (completed), as ordered.",
            registry=r,
        )
        self.prefetch_wasted_bytes = Counter(
            "kvprefetch_prefetch_wasted_bytes",
            "Bytes of landed prefetches evicted, demoted or past their hold (the order's ttl) "
            "before a request used them.",
            registry=r,
        )
        self.prefetch_used_bytes = Counter(
            "kvprefetch_prefetch_used_bytes",
            "Bytes of landed prefetches a request routed to their instance used.",
            registry=r,
        )
        self.prefetch_unused_bytes = Counter(
            "kvprefetch_prefetch_unused_bytes",
            "Bytes of landed prefetches that ended unused: the same as "
            "kvprefetch_prefetch_wasted_bytes_total (the replay's name).",
            registry=r,
        )
        self.prefetch_waiting_bytes = Gauge(
            "kvprefetch_prefetch_waiting_bytes",
            "Bytes of landed prefetches neither used nor wasted yet.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.reuse_requests = Counter(
            "kvprefetch_reuse_requests",
            "Arriving requests with a reused context, by what they found in their instance's HBM: "
            "hit (all of it), partial, miss (none).",
            ["outcome"],
            registry=r,
        )
        self.reused_bytes = Counter(
            "kvprefetch_reused_bytes",
            "Bytes of arriving requests' reused contexts, resident in the instance's HBM or not.",
            ["resident"],
            registry=r,
        )
        self.stall_seconds = Counter(
            "kvprefetch_stall_seconds",
            "Estimated GPU stall incurred by arriving requests: their non-resident reused blocks "
            "loaded or recomputed, whichever is sooner.",
            registry=r,
        )
        self.stall_avoided_seconds = Counter(
            "kvprefetch_stall_avoided_seconds",
            "Estimated GPU stall avoided (GPU-seconds saved): the resident reused blocks' load "
            "from the pool, or their recompute if sooner.",
            registry=r,
        )
        self.gpu_saved_dollars = Counter(
            "kvprefetch_gpu_saved_dollars",
            "The GPU-seconds saved at KVP_GPU_HOUR_PRICE dollars per GPU-hour.",
            registry=r,
        )
        self.plan_duration = Histogram(
            "kvprefetch_plan_duration_seconds",
            "Time of one planning tick (the scheduler's plan).",
            registry=r,
            buckets=PLAN_BUCKETS_SECONDS,
        )

    def _store_metrics(self, r: CollectorRegistry) -> None:
        """The state store's health, from its background probe."""
        # From the store's last background probe (app/state/storethread.py): /metrics never
        # waits on the store. In multiprocess mode the worst worker's view wins.
        self.store_up = Gauge(
            "kvprefetch_store_up",
            "1 when the state store answered its last probe, else 0.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.store_stats_age = Gauge(
            "kvprefetch_store_stats_age_seconds",
            "Seconds since kvprefetch_store_objects was read from the store (probed every "
            "KVP_STORE_PROBE_INTERVAL_SECONDS; grows while the store does not answer).",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.store_objects = Gauge(
            "kvprefetch_store_objects",
            "The state store's counts at its last answered probe, by kind.",
            ["kind"],
            registry=r,
            multiprocess_mode="livemax",
        )

    def _guard_metrics(self, r: CollectorRegistry) -> None:
        """The LRU guard: the advice against plain LRU on the same arrivals."""
        # app/decide/guard.py: the advice against plain LRU on the same arrivals.
        self.guard_instances = Gauge(
            "kvprefetch_lru_guard_instances",
            "Instances by what decides their HBM: advice (the model's advice acts), lru (it lost "
            "to plain LRU and is off), trial (on again, being judged).",
            ["state"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.guard_resident_bytes = Counter(
            "kvprefetch_lru_guard_resident_bytes_total",
            "Reused bytes resident at arrival, as served (side=served) and as a shadow LRU fed the "
            "same requests would have had them (side=lru), on the instances judged.",
            ["side"],
            registry=r,
        )
        self.guard_fallbacks = Counter(
            "kvprefetch_lru_guard_fallbacks_total",
            "Times an instance's advice was turned off for losing to plain LRU.",
            registry=r,
        )
        self.guard_demote_blocks = Counter(
            "kvprefetch_lru_guard_demote_blocks_total",
            "Reused blocks the demotes cost (side=cost: demoted, missed, LRU would have held "
            "them) and the room they made kept (side=gain: found, LRU would have evicted them, "
            "no pin or prefetch put them there), on the instances judged.",
            ["side"],
            registry=r,
        )
        self.guard_demote_suspensions = Counter(
            "kvprefetch_lru_guard_demote_suspensions_total",
            "Times an instance's demotes were turned off for costing more than they gained.",
            registry=r,
        )

    def _retrain_metrics(self, r: CollectorRegistry) -> None:
        """Retraining on a schedule."""
        # app/predict/retrain.py: retraining on a schedule, its candidate judged in shadow.
        self.retrain_runs = Counter(
            "kvprefetch_retrain_runs",
            "Scheduled retraining runs by how they ended: promoted (the candidate serves), "
            "discarded (it did not beat the serving model), failed (training or loading failed), "
            "skipped (too little new traffic, an operator's shadow set, or no event log).",
            ["outcome"],
            registry=r,
        )
        self.retrain_last_run = Gauge(
            "kvprefetch_retrain_last_run_timestamp_seconds",
            "When the last retraining run ended (the service clock; 0 before the first); "
            "kvprefetch_retrain_runs_total says how.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.retrain_brier = Gauge(
            "kvprefetch_retrain_brier_score",
            "Mean Brier score of P(back within the keep horizon) on the paired outcomes judged "
            "while a shadow is set (an operator's or a retrained candidate): slot=live "
            "(serving) and slot=shadow; lower is better. NaN before the first outcome; the last "
            "shadow's scores once it is promoted or removed.",
            ["slot"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.retrain_judged_outcomes = Gauge(
            "kvprefetch_retrain_judged_outcomes",
            "Paired outcomes judged for the shadow (an operator's or a retrained candidate) so "
            "far.",
            registry=r,
            multiprocess_mode="livemax",
        )

    def _lmcache_metrics(self, r: CollectorRegistry) -> None:
        """The lmcache sink."""
        # app/deliver/lmcache.py: the lmcache sink's orders and its calls to the coordinator.
        self.lmcache_orders = Counter(
            "kvprefetch_lmcache_orders",
            "Orders the lmcache sink carried to their end, by kind and outcome (completed, "
            "failed).",
            ["kind", "outcome"],
            registry=r,
        )
        self.lmcache_order_failures = Counter(
            "kvprefetch_lmcache_order_failures",
            "Orders the lmcache sink failed, by why: unknown_tokens, too_short, backlog, "
            "no_layout (a prefetch's 503 from the MP server), server_unavailable (another "
            "call's), unknown_instance, refused, unreachable (tries spent), timeout, not_found, "
            "lmcache_error, fenced, pin_lost (a pin that completed, lost by the coordinator "
            "since).",
            ["reason"],
            registry=r,
        )
        self.lmcache_retries = Counter(
            "kvprefetch_lmcache_call_retries",
            "Calls to LMCache's coordinator tried again (connection errors, timeouts, 429, 5xx), "
            "by call: prefetch, poll, pin, unpin, delete, list_pins.",
            ["call"],
            registry=r,
        )
        self.inference_duration = Histogram(
            "kvprefetch_inference_duration_seconds",
            "Time a model took to score one pass over every live session (or one page, with "
            "KVP_SCORE_ALL_LIVE=false): features, model, planner rules.",
            ["slot"],
            registry=r,
            buckets=INFERENCE_BUCKETS_SECONDS,
        )

    def _vllm_metrics(self, r: CollectorRegistry) -> None:
        """vLLM's KV-event stream."""
        # vLLM's ZMQ KV-event stream (app/ingest/vllm/), when KVP_VLLM_KV_ENDPOINTS is set.
        self.vllm_batches = Counter(
            "kvprefetch_vllm_batches",
            "vLLM KV-event batches taken from the publishers and handed to the ingestor "
            "(replayed ones included; duplicates among them are counted by "
            "kvprefetch_events_duplicate_total).",
            registry=r,
        )
        self.vllm_events = Counter(
            "kvprefetch_vllm_events",
            "vLLM KV events (BlockStored, BlockRemoved, AllBlocksCleared) in those batches.",
            registry=r,
        )
        self.vllm_bad_input = Counter(
            "kvprefetch_vllm_bad_input",
            "vLLM messages refused, by reason: frames, msgpack, shape, event_type, hash, field, "
            "replay, nesting (msgpack too deep to decode), error (any other exception while "
            "decoding), apply (a batch whose ingest raised for it alone); session_id: a session "
            "id dropped from a batch otherwise taken (logged with its publisher and sequence "
            "number, at most once a minute per publisher and reason).",
            ["reason"],
            registry=r,
        )
        self.vllm_recovered = Counter(
            "kvprefetch_vllm_batches_recovered",
            "vLLM batches fetched from a publisher's replay socket after a gap, a restart or a "
            "reconnect.",
            registry=r,
        )
        self.vllm_lost = Counter(
            "kvprefetch_vllm_batches_lost",
            "vLLM batches of a sequence gap that the publisher's replay buffer no longer held "
            "(or that no replay socket could give): lost, and logged.",
            registry=r,
        )
        self.vllm_restarts = Counter(
            "kvprefetch_vllm_publisher_restarts",
            "vLLM publishers seen restarting (a sequence number going back: a new engine).",
            registry=r,
        )
        self.vllm_intake_deaths = Counter(
            "kvprefetch_vllm_intake_deaths",
            "Times the vLLM intake's thread died (logged; started again after a pause, /readyz "
            "answering 503 until it runs).",
            registry=r,
        )

    def _tool_metrics(self, r: CollectorRegistry) -> None:
        """The agents' tools."""
        # app/predict/tool_durations.py: labelled by the tracked tools (KVP_TOOLS_TRACKED) and
        # 'other'; a tool that leaves the tracked set loses its series (multiprocess mode keeps it).
        self.tool_seconds = Histogram(
            "kvprefetch_tool_seconds",
            "Tool call run times (tool_started to tool_finished, or to the session's next "
            "request_routed), by tool: the most frequent tools, the rest as 'other'.",
            ["tool"],
            registry=r,
            buckets=TOOL_BUCKETS_SECONDS,
        )
        self.tools_in_flight = Gauge(
            "kvprefetch_tools_in_flight",
            "Tool calls started and not returned yet, by tool (as kvprefetch_tool_seconds).",
            ["tool"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.tool_runs_expired = Counter(
            "kvprefetch_tool_runs_expired",
            "Tool calls never seen returning: no finish and no request within "
            "KVP_TOOL_MAX_RUN_SECONDS, their session closed, or past KVP_TOOLS_MAX_IN_FLIGHT.",
            registry=r,
        )

    def _lease_metrics(self, r: CollectorRegistry) -> None:
        """The planning lease."""
        # The planning lease (app/decide/lease.py, KVP_PLANNING_LEASE_SECONDS): per replica, so a
        # fleet's sum of the gauge is how many plan (1 when healthy).
        self.planning_leader = Gauge(
            "kvprefetch_planning_leader",
            "1 while this replica holds the planning lease (or plans without one), else 0.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.planning_terms = Counter(
            "kvprefetch_planning_terms",
            "Planning terms this replica began: each time it took the planning lease.",
            registry=r,
        )
        self.planning_adopted_orders = Counter(
            "kvprefetch_planning_adopted_orders",
            "Open orders taken over from the previous planning replica's hand-over state.",
            registry=r,
        )
        self.planning_skipped_ticks = Counter(
            "kvprefetch_planning_skipped_ticks",
            "Planning ticks skipped because this replica does not hold the planning lease.",
            registry=r,
        )
        # What the fleet feed's reader applied (app/decide/fleet_feed.py): on the planner, its
        # rate against the other replicas' kvprefetch_events_ingested_total says if it keeps up.
        self.fleet_feed_applied_events = Counter(
            "kvprefetch_fleet_feed_applied_events",
            "Other replicas' accepted events read from the fleet feed and applied to this "
            "replica's planning side.",
            registry=r,
        )
        self.fleet_feed_applied_batches = Counter(
            "kvprefetch_fleet_feed_applied_batches",
            "Other replicas' accepted batches (fleet feed entries) applied to this replica's "
            "planning side.",
            registry=r,
        )

    def _label_children(self) -> None:
        """The children made once: a labelled counter's lookup costs more than its increment,
        and the bounded label sets show as 0 from the first scrape rather than appearing later."""
        self._ingested = {t: self.events_ingested.labels(t) for t in EVENT_TYPES}
        self._reuse = {o: self.reuse_requests.labels(o) for o in OUTCOMES}
        for state in GUARD_STATES:
            self.guard_instances.labels(state)
        for side in ("served", "lru"):
            self.guard_resident_bytes.labels(side)
        for side in ("cost", "gain"):
            self.guard_demote_blocks.labels(side)
        self._resident_bytes = self.reused_bytes.labels("true")
        self._missing_bytes = self.reused_bytes.labels("false")
        for code in REFUSED_CODES:
            self.batches_refused.labels(str(code))
        for reason in REFUSAL_REASONS:
            self.events_refused_by_time.labels(reason)
        for kind in ORDER_KINDS:
            self.orders_issued.labels(kind)
        for family in (self.orders_completed, self.orders_failed, self.orders_cancelled):
            family.labels(
                "prefetch"
            )  # the scheduler follows prefetches to their end; pins and demotes not
        for kind in ORDER_KINDS:
            for outcome in ("completed", "failed"):
                self.lmcache_orders.labels(kind, outcome)
        for reason in LMCACHE_FAILURES:
            self.lmcache_order_failures.labels(reason)
        for call in LMCACHE_CALLS:
            self.lmcache_retries.labels(call)
        self._slot_started("live")
        for reason in BAD_INPUT_REASONS:
            self.vllm_bad_input.labels(reason)
        for outcome in ("promoted", "discarded", "failed", "skipped"):
            self.retrain_runs.labels(outcome)
        for slot in SLOTS:
            self.retrain_brier.labels(slot).set(float("nan"))
        for kind in (*SIGNAL_KINDS, OTHER_KIND):
            self.signals_received.labels(kind)
            self.signals_followed.labels(kind)
        # Told every batch that holds a signal, or any batch while signals wait to be followed.
        self.signals = SignalFollowups(
            on_signal=self._signal_counted,
            on_followed=lambda kind: self.signals_followed.labels(kind).inc(),
        )

    def bind(
        self,
        *,
        scheduler: Scheduler,
        ledger: AdviceLedger,
        models: ModelSlots,
        guard: LruGuard | None = None,
        tools: ToolDurations | None = None,
    ) -> None:
        """The owners of the totals `sync()` reads."""
        self._scheduler, self._ledger, self._models = scheduler, ledger, models
        self._guard = guard
        self._tools = tools
        self.sync()

    # -- at the source ----------------------------------------------------------------------

    def observe(self, events: Sequence[Event]) -> None:
        """The ingest observer, after the ledger's and the scheduler's (it syncs what they
        counted)."""
        if len(events) == 1:  # one at a time (a replay's engine): no tally to build
            event_type = events[0].type
            self._ingested[event_type].inc()
            if event_type == "session_signal" or self.signals.pending:
                self.signals.observe(events)
        else:
            counts = collections.Counter(e.type for e in events)
            for event_type, n in counts.items():
                self._ingested[event_type].inc(n)
            if "session_signal" in counts or self.signals.pending:
                self.signals.observe(events)
        self.sync()

    def _signal_counted(self, kind: str) -> None:
        self.signals_received.labels(kind).inc()
        self.signals_followed.labels(kind)  # a deployment's kind: 0 until one is followed

    def tool_returned(self, label: str, seconds: float) -> None:
        """The tool distributions' hook (app/predict/tool_durations.py): a run measured."""
        child = self._tool_children.get(label)
        if child is None:
            child = self._tool_children[label] = self.tool_seconds.labels(label)
        child.observe(seconds)

    def record_outcomes(self, outcomes: Iterable[RequestOutcome]) -> None:
        """What arriving requests found (app/observe/outcomes.py), summed per batch: one increment
        per counter, not per request, on the ingest path."""
        counts = dict.fromkeys(OUTCOMES, 0)
        resident = missing = 0
        stall = avoided = 0.0
        for o in outcomes:
            counts[o.outcome] += 1
            resident += o.resident_bytes
            missing += o.missing_bytes
            stall += o.stall_seconds
            avoided += o.stall_avoided_seconds
        for outcome, n in counts.items():
            if n:
                self._reuse[outcome].inc(n)
        if resident:
            self._resident_bytes.inc(resident)
        if missing:
            self._missing_bytes.inc(missing)
        if stall:
            self.stall_seconds.inc(stall)
        if avoided:
            self.stall_avoided_seconds.inc(avoided)
            self.gpu_saved_dollars.inc(avoided / 3600.0 * self.gpu_hour_price_dollars)

    def batch_answered(
        self, *, duplicates: int, rejected_fields: Sequence[tuple[int, str]]
    ) -> None:
        """A POST /v1/events answered with its lists: `rejected_fields` are (index, field path) of
        each rejection, several per event possible; an event counts once, under its first field."""
        if duplicates:
            self.events_duplicate.inc(duplicates)
        first: dict[int, str] = {}
        for index, path in rejected_fields:
            first.setdefault(index, path)
        for field, n in collections.Counter(rejection_field(p) for p in first.values()).items():
            self.events_rejected.labels(field).inc(n)

    def events_refused(self, reason: str, n: int) -> None:
        """The ingestor's hook (app/ingest/ingestor.py): `n` events refused for `reason`."""
        self.events_refused_by_time.labels(reason).inc(n)

    def lmcache_order_ended(self, kind: str, failure: str | None) -> None:
        """The lmcache sink's hook: an order ended, completed (`failure` None) or failed."""
        self.lmcache_orders.labels(kind, "completed" if failure is None else "failed").inc()
        if failure is not None:
            self.lmcache_order_failures.labels(failure).inc()

    def lmcache_call_retried(self, call: str) -> None:
        self.lmcache_retries.labels(call).inc()

    # The vLLM subscriber's counters (app/ingest/vllm/subscriber.py IntakeCounters).
    def vllm_batches_taken(self, batches: int, events: int) -> None:
        self.vllm_batches.inc(batches)
        self.vllm_events.inc(events)

    def vllm_input_refused(self, reason: str) -> None:
        self.vllm_bad_input.labels(reason).inc()

    def vllm_batches_recovered(self, batches: int) -> None:
        self.vllm_recovered.inc(batches)

    def vllm_batches_lost(self, batches: int) -> None:
        self.vllm_lost.inc(batches)

    def vllm_publisher_restarted(self) -> None:
        self.vllm_restarts.inc()

    def vllm_intake_died(self) -> None:
        self.vllm_intake_deaths.inc()

    def batch_refused(self, status_code: int) -> None:
        self.batches_refused.labels(str(status_code)).inc()

    def planned(self, seconds: float) -> None:
        """The planning loop's timing hook (app/decide/dispatcher.py), right after a plan."""
        self.plan_duration.observe(seconds)
        with self._sync_lock:
            self._sync_scheduler()

    def scored(self, slot: str, seconds: float) -> None:
        """The scoring loop's timing hook (app/decide/scorer.py), after a model's page is
        recorded."""
        self.inference_duration.labels(slot).observe(seconds)
        with self._sync_lock:
            self._sync_models()

    def retrain_finished(self, outcome: str, ts: float) -> None:
        """A retraining run ended (app/predict/retrain.py) at `ts`, the service clock."""
        self.retrain_runs.labels(outcome).inc()
        self.retrain_last_run.set(ts)

    def retrain_judged(self, stats: JudgeStats) -> None:
        """The judge's scores for the shadow, an operator's or a retrained candidate."""
        self.retrain_judged_outcomes.set(stats.judged)
        for slot, score in (("live", stats.live_brier), ("shadow", stats.shadow_brier)):
            self.retrain_brier.labels(slot).set(float("nan") if score is None else score)

    def store_probed(self, snapshot: StoreSnapshot, now: float) -> None:
        """The store's last probe (`now` on the same time.monotonic() scale)."""
        self.store_up.set(1 if snapshot.ok else 0)
        age = snapshot.stats_age_seconds(now)
        self.store_stats_age.set(age if age is not None else float("nan"))
        for kind in STORE_KINDS:
            if kind in snapshot.stats:
                self.store_objects.labels(kind).set(snapshot.stats[kind])

    # -- from the owners' totals --------------------------------------------------------------

    def sync(self) -> None:
        with self._sync_lock:
            self._sync_scheduler()
            self._sync_models()
            self._sync_guard()
            self._sync_tools()

    def _sync_tools(self) -> None:
        tools = self._tools
        if tools is None:
            return
        if tools.labels_version != self._tool_labels_version:
            self._tool_labels_version = tools.labels_version
            labels = tools.labels()
            for gone in [label for label in self._tool_children if label not in labels]:
                del self._tool_children[gone]
                self._tools_in_flight.pop(gone, None)
                if self.multiprocess is None:  # a removed series stays in a worker's file
                    for family in (self.tool_seconds, self.tools_in_flight):
                        with contextlib.suppress(KeyError):
                            family.remove(gone)
            for label in labels:
                if label not in self._tool_children:
                    self._tool_children[label] = self.tool_seconds.labels(label)
        for label, n in tools.in_flight_by_label().items():
            if self._tools_in_flight.get(label) != n:
                self._tools_in_flight[label] = n
                self.tools_in_flight.labels(label).set(n)
        self._advance("tools_expired", self.tool_runs_expired, tools.expired)

    def _sync_guard(self) -> None:
        guard = self._guard
        if guard is None:
            return
        for state, n in guard.states().items():
            self.guard_instances.labels(state).set(n)
        self._advance("guard_served", self.guard_resident_bytes, guard.served_bytes_total, "served")
        self._advance("guard_lru", self.guard_resident_bytes, guard.lru_bytes_total, "lru")
        self._advance("guard_fallbacks", self.guard_fallbacks, guard.fallbacks_total)
        demote_blocks = self.guard_demote_blocks
        self._advance("demote_cost", demote_blocks, guard.demote_cost_blocks_total, "cost")
        self._advance("demote_gain", demote_blocks, guard.demote_gain_blocks_total, "gain")
        self._advance(
            "demote_suspensions", self.guard_demote_suspensions, guard.demote_suspensions_total
        )

    def _advance(self, key: object, counter: Counter, current: int, *labels: str) -> None:
        # Each series labelled once (at the first sync, so it shows from the start), then kept:
        # this runs for every batch ingested.
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = counter.labels(*labels) if labels else counter
        last = self._seen.get(key, 0)
        delta = (
            current - last if current >= last else current
        )  # gone down: its owner started afresh
        if delta:
            child.inc(delta)
        self._seen[key] = current

    def _sync_scheduler(self) -> None:
        if self._scheduler is None:
            return
        t = self._scheduler.totals
        totals = (
            tuple(t.orders.items()),
            t.completed,
            t.failed,
            t.cancelled,
            t.bytes_ordered,
            t.bytes_landed,
            t.bytes_wasted,
            t.bytes_used,
            t.bytes_waiting,
        )
        if totals == self._scheduler_seen:
            return  # nothing moved (the common case: this runs for every batch ingested)
        self._scheduler_seen = totals
        for kind, n in list(t.orders.items()):
            self._advance(("issued", kind), self.orders_issued, n, kind)
        self._advance("completed", self.orders_completed, t.completed, "prefetch")
        self._advance("failed", self.orders_failed, t.failed, "prefetch")
        self._advance("cancelled", self.orders_cancelled, t.cancelled, "prefetch")
        self._advance("ordered_bytes", self.prefetch_ordered_bytes, t.bytes_ordered)
        self._advance("landed_bytes", self.prefetch_landed_bytes, t.bytes_landed)
        self._advance("wasted_bytes", self.prefetch_wasted_bytes, t.bytes_wasted)
        self._advance("used_bytes", self.prefetch_used_bytes, t.bytes_used)
        self._advance("unused_bytes", self.prefetch_unused_bytes, t.bytes_unused)
        self.prefetch_waiting_bytes.set(t.bytes_waiting)

    def _sync_models(self) -> None:
        if self._models is None or self._ledger is None:
            return
        for slot in SLOTS:
            serving = self._models.serving if slot == "live" else self._models.shadow
            self._set_version(slot, None if serving is None else serving.version or "heuristic")
            if serving is None:
                self._ledger_seen.pop(slot, None)
                continue
            seen = self._ledger_seen.get(slot)
            if seen is None or seen[0] is not serving:
                # A model just swapped into the slot: the ledger counts it from zero, or, for a
                # promoted shadow, from what it counted as the shadow (exported there already).
                seen = (serving, self._ledger.base(slot))
                self._slot_started(slot)
            elif self._ledger.stats(slot) == seen[1]:
                continue  # nothing new to count (the common case: this runs for every batch)
            last, now = seen[1], self._ledger.stats(slot)
            for counter, was, is_ in (
                (self.predictions.labels(slot), last.predictions, now.predictions),
                (self.advice_outcomes.labels(slot, "hit"), last.hits, now.hits),
                (self.advice_outcomes.labels(slot, "miss"), last.misses, now.misses),
                (self.advice_outcomes.labels(slot, "unscored"), last.unscored, now.unscored),
                (
                    self.advice_bytes.labels(slot, "keep"),
                    last.keep_advice_bytes,
                    now.keep_advice_bytes,
                ),
                (
                    self.advice_bytes.labels(slot, "prefetch"),
                    last.prefetch_advice_bytes,
                    now.prefetch_advice_bytes,
                ),
            ):
                delta = is_ - was if is_ >= was else is_
                if delta:
                    counter.inc(delta)
            self._ledger_seen[slot] = (serving, now)
        # Any shadow is judged against the serving model, an operator's as a retrained one.
        # Once the shadow leaves (promoted, cleared), its last scores stay: how it was judged.
        if self._models.shadow is not None:
            self.retrain_judged(self._ledger.judge.stats())

    def _slot_started(self, slot: str) -> None:
        self.predictions.labels(slot)
        for advice in ("keep", "prefetch"):
            self.advice_bytes.labels(slot, advice)
        for outcome in ADVICE_OUTCOMES:
            self.advice_outcomes.labels(slot, outcome)

    def _set_version(self, slot: str, version: str | None) -> None:
        old = self._versions.get(slot)
        if old == version:
            return
        if old is not None:
            self.model_info.labels(slot, old).set(0)
            if self.multiprocess is None:
                # Gone from the exposition; in multiprocess mode a removed series stays in this
                # worker's file, so it stays at 0 there instead.
                self.model_info.remove(slot, old)
        if version is not None:
            self.model_info.labels(slot, version).set(1)
        self._versions[slot] = version

    # -- exposition ---------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The text exposition: this app's registry, or every worker's files in multiprocess
        mode."""
        self.sync()
        if self.multiprocess is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(self.multiprocess))
        return generate_latest(registry)

    def close(self) -> None:
        """At shutdown: a worker's `live*` gauges leave the exposition with it."""
        if self.multiprocess is not None:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid(), str(self.multiprocess))
