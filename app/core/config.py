"""The one settings class. Every knob is an environment variable with the KVP_ prefix."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.bundle import DEFAULT_MODEL_DIR
from app.core.cluster import (
    HOST_LINK_BYTES_PER_SECOND,
    LINK_SHARE,
    POOL_LINK_BYTES_PER_SECOND,
    PREFILL_TOKENS_PER_SECOND,
)

# Llama-3.1-70B bf16: 2 x 80 layers x 8 kv heads x 128 x 2 bytes
# (REFERENCE.md, "KV bytes per token").
LLAMA_70B_BF16_BYTES_PER_TOKEN = 327_680
# The Mooncake traces' block unit (shared/traces/README.md).
MOONCAKE_BLOCK_TOKENS = 512


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVP_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    store: Literal["memory", "redis"] = "memory"
    # Secret: it may hold a password; shown masked (app/core/redact.py).
    redis_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    redis_prefix: str = Field("kvp", min_length=1, max_length=64)
    # Redis calls block the event loop, so they must fail fast when Redis is away.
    redis_timeout_seconds: float = Field(2.0, gt=0)
    # /readyz, /metrics and the dashboard never wait on the store (docs/decisions.md, 16): its
    # health and counts are probed this often in the background, so they are this old plus one
    # probe while it answers (kvprefetch_store_stats_age_seconds says how old they are).
    store_probe_interval_seconds: float = Field(1.0, gt=0)
    # How long those routes wait for a fresh probe or for the planning side to catch up with the
    # events acknowledged before they answer with what they have.
    observability_wait_seconds: float = Field(0.5, gt=0)

    data_dir: Path = Path("var")
    # Where the event log lives; defaults to <data_dir>/events.
    log_dir: Path | None = None
    log_segment_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    # fsync each acknowledged batch: survives power loss, not only a process crash.
    log_fsync: bool = True
    # With the memory store, write and fsync the log on a thread of its own, so that a slow disk
    # never holds the event loop (/healthz, route hints) for as long; off: on the loop, one hop
    # per batch cheaper (a disk whose fsync takes microseconds). docs/decisions.md, 26.
    log_thread: bool = True

    max_batch_events: int = Field(10_000, ge=1)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    # One event's JSON, measured before anything is parsed (app/api/batch.py): what one event may
    # cost the parse. 65,536 block hashes (the most an event holds) of 64 hex characters are
    # 4.2 MiB; twice that leaves room for the rest of the event.
    max_event_bytes: int = Field(8 * 1024 * 1024, ge=1024)

    # Bearer tokens (app/core/security.py). Each variable grants one scope; the file names any
    # number of tokens with their scopes. None at all: authentication is off and the service
    # listens on loopback only.
    ingest_token: SecretStr | None = None
    agent_token: SecretStr | None = None
    admin_token: SecretStr | None = None
    tokens_file: Path | None = None
    # /metrics, /dashboard and its data are open like /healthz unless this is set; then they
    # need a token (the read scope, which every token has).
    protect_observability: bool = False
    # Session ids may be user identities: the dashboard's data lists them only to a caller with a
    # valid token, or to anyone when this is set.
    dashboard_show_session_ids: bool = False

    # Per client (token, or address when authentication is off), per worker process: a token
    # bucket holding `burst_seconds` of the rate. 0 turns a limit off.
    rate_limit_requests_per_second: float = Field(10_000.0, ge=0)
    rate_limit_events_per_second: float = Field(500_000.0, ge=0)
    rate_limit_burst_seconds: float = Field(2.0, gt=0)
    # Accepted events waiting for the planning side (app/ingest/backlog.py); a batch that would
    # overflow it is refused with 503 and Retry-After before anything of it is logged.
    backlog_max_events: int = Field(200_000, ge=1)
    # A request whose body has not fully arrived this long after its last chunk is answered 408;
    # one still unanswered after request_timeout_seconds, 503.
    body_timeout_seconds: float = Field(10.0, gt=0)
    # And a body must arrive within body_timeout_seconds of its headers plus one second per
    # min_body_bytes_per_second bytes received (a floor on its rate after a grace); else 408.
    # 0: no floor.
    min_body_bytes_per_second: float = Field(4096.0, ge=0)
    request_timeout_seconds: float = Field(60.0, gt=0)
    # The server's edge, per worker (app/api/edge.py): open connections in all and from one
    # address (past either limit, the longest-idle connection without a request in flight is
    # closed to make room; with none idle, the new one gets 503), and requests in flight (more
    # get 503). A connection must send its headers within header_timeout_seconds of connecting
    # or of its request's first byte; an idle keep-alive connection is closed after
    # keepalive_timeout_seconds. Behind a proxy every client is the proxy's address.
    max_connections: int = Field(1024, ge=1)
    max_connections_per_client: int = Field(256, ge=1)
    # Requests in flight from one address (an IPv6 /64), per worker: more get 503, so a few
    # addresses whose bodies trickle cannot hold every request slot (GET /healthz is exempt).
    max_requests_per_client: int = Field(64, ge=1)
    header_timeout_seconds: float = Field(10.0, gt=0)
    keepalive_timeout_seconds: float = Field(5.0, gt=0)

    bytes_per_token: int = Field(LLAMA_70B_BF16_BYTES_PER_TOKEN, gt=0)
    block_tokens: int = Field(MOONCAKE_BLOCK_TOKENS, gt=0)
    # What moving or recomputing a context costs (REFERENCE.md, "Links and tiers"): a 100 Gb/s
    # NIC from the shared pool, PCIe 5 from host DRAM, 70B prefill on one GPU.
    pool_link_bytes_per_second: float = Field(POOL_LINK_BYTES_PER_SECOND, gt=0)
    host_link_bytes_per_second: float = Field(HOST_LINK_BYTES_PER_SECOND, gt=0)
    prefill_tokens_per_second: float = Field(PREFILL_TOKENS_PER_SECOND, gt=0)
    # Dollars per GPU-hour, for the metrics' cost of the GPU-seconds saved (kvprefetch_gpu_saved_
    # dollars_total): roughly an on-demand H100-class GPU in a public cloud; set your own. For an
    # instance spanning several GPUs, their price together.
    gpu_hour_price: float = Field(2.5, ge=0)

    # How many event ids are remembered for idempotency (memory store) and for how long
    # (Redis store). A retry later than this is applied again.
    dedupe_max_ids: int = Field(2_000_000, ge=1)
    dedupe_ttl_seconds: int = Field(24 * 3600, ge=1)
    # How late (in event time) a block store may arrive and still lose to a newer removal at its
    # location: a removal's tombstone is dropped once that location has seen an event more than
    # this much newer than it. A store or removal whose ts is at least the location's newest
    # event ts minus this is applied as if the location's events had come in order.
    reorder_window_seconds: float = Field(60.0, gt=0)
    # A session with no event for this long, measured against the newest event ts the store has
    # seen, is forgotten (closed or not, with its requests; block residency stays). A later event
    # starts it afresh; a session event older than that newest ts minus this is ignored. Order
    # records, the route tracker and the advice ledger forget by the same rule.
    session_retention_seconds: float = Field(3600.0, gt=0)
    # The most instances the store holds (each with up to three locations: its hbm, host and
    # disk), sized for a large fleet: an event naming one more is rejected (422 on
    # events[i].instance_id) and the rest of its batch taken.
    max_instances: int = Field(10_000, ge=1)
    # An instance nothing has named for this long, measured like the session retention, is
    # forgotten with its locations (the blocks it held); a later event starts it afresh.
    instance_retention_seconds: float = Field(3600.0, gt=0)
    # Both windows count from the newest event ts, so one event stamped in the future would
    # move them for everyone: an event more than this ahead of the service clock is rejected
    # (422 on events[i].ts), and skipped when replayed from the log.
    max_clock_skew_seconds: float = Field(300.0, gt=0)

    # The arrival model served at startup; if it is missing or does not load, the heuristic serves.
    model_dir: Path = DEFAULT_MODEL_DIR
    # The only directory POST /v1/model/reload and PUT /v1/model/shadow load from (names relative
    # to it, or absolute paths inside it); defaults to the one holding model_dir.
    models_root: Path | None = None
    # A second model scored beside the serving one and never advising: its would-be hit rate is
    # reported next to the serving model's. None: no shadow.
    shadow_model_dir: Path | None = None
    # The service's clock runs this many times faster than real time (app/core/clock.py
    # ScaledClock), and its loops tick as often in the clock's time: for a demo that replays a
    # trace at --speed X against it (`make demo`), so that it sees the trace's own durations.
    # 1: real time, as any deployment runs.
    clock_speed: float = Field(1.0, gt=0, le=1000)
    # How often the scoring loop advises on a page of live sessions, for the hit rates; 0 turns
    # the loop off (tests drive it one tick at a time).
    score_interval_seconds: float = Field(1.0, ge=0)
    # Each tick a pass over every live session (app/decide/scorer.py): a feature table kept
    # current from the events, scored in chunks. False: a page of score_sessions_per_tick
    # sessions per tick, read from the store as views (what the service ran before).
    score_all_live: bool = True
    # With score_all_live, sessions per chunk of a pass: what holds the event loop in one piece.
    score_chunk_sessions: int = Field(2048, ge=1)
    # ... at most: a chunk that held the loop longer than this cuts the next one in proportion
    # (app/decide/scorer.py, next_chunk_sessions); 0 keeps every chunk at score_chunk_sessions.
    score_chunk_target_seconds: float = Field(0.05, ge=0)
    # Sessions per tick: the page (without score_all_live), or the sweep page each pass re-reads
    # from the store so that what no observer saw still comes into the table.
    score_sessions_per_tick: int = Field(256, ge=1)
    # How often the scheduler plans orders from the latest advice (app/decide/dispatcher.py); 0
    # turns planning off (tests drive it one tick at a time).
    plan_interval_seconds: float = Field(0.1, ge=0)
    # The share of each link prefetch may book, so demand loads are never starved.
    prefetch_link_share: float = Field(LINK_SHARE, gt=0, le=1)
    # The planner's thresholds (app/decide/advisor.py Thresholds), read by the advisor and the
    # scheduler alike. lead <= keep horizon <= the return horizon (900 s).
    keep_horizon_seconds: float = Field(
        300.0,
        gt=0,
        description=(
            "Keep a context resident for this long when its session is likely back within it."
        ),
    )
    keep_min_p: float = Field(
        0.2,
        ge=0,
        le=1,
        description=(
            "Keep (pin with TTL) a context when P(back within the keep horizon) is at least this."
        ),
    )
    demote_max_p: float = Field(
        0.1,
        ge=0,
        le=1,
        description=("Demote (evict first) a context when P(back within 900 s) is at most this."),
    )
    lead_seconds: float = Field(
        30.0,
        gt=0,
        description=("Prefetch a context when its session is likely back within this long."),
    )
    prefetch_min_p: float = Field(
        0.35,
        ge=0,
        le=1,
        description=(
            "Prefetch into free room when P(back within the lead) is at least this; into a full "
            "HBM only in place of contexts less likely back (docs/decisions.md, 21)."
        ),
    )
    cancel_below_p: float = Field(
        0.25,
        ge=0,
        le=1,
        description=(
            "Cancel an open prefetch not yet started when its chance falls below this (hysteresis "
            "under KVP_PREFETCH_MIN_P)."
        ),
    )
    # Never worse than LRU (app/decide/guard.py): per instance, the advice's resident bytes on
    # each arrival against a shadow LRU's; where the advice loses, it is turned off, and tried
    # again after the retry wait (doubled each time it loses again). On by default since the
    # planner prices what its advice displaces (docs/decisions.md, 19 and 21).
    lru_guard: bool = Field(
        True, description="Turn the advice off on an instance where plain LRU would do better."
    )
    lru_guard_min_arrivals: int = Field(
        50, ge=1, description="Arrivals judged on an instance before a verdict on its advice."
    )
    lru_guard_retry_seconds: float = Field(
        600.0, gt=0, description="How long an instance's advice stays off before it is tried again."
    )
    lru_guard_demotes: bool = Field(
        True,
        description="Price demotes on their own per instance (their cost against the room they "
        "made) and turn them off where they clearly lose.",
    )
    # Tool run times from the agents' tool_started/tool_finished signals
    # (app/predict/tool_durations.py): the most frequent tools each their own distribution.
    tools_tracked: int = Field(
        32,
        ge=0,
        description="Tools whose run times are kept apart (the most frequent); the rest pooled "
        "as 'other'.",
    )
    tool_max_run_seconds: float = Field(
        3600.0,
        gt=0,
        description="A tool call neither finished nor followed by a request this long after its "
        "start expires (counted, not measured).",
    )
    tools_max_in_flight: int = Field(
        100_000, ge=1, description="Tool calls followed in flight at most (the oldest expire)."
    )
    # Retraining from the service's own event log (app/predict/retrain.py, docs/decisions.md, 20):
    # every so often a candidate is trained in a child process on the log (split by time), shadows
    # the serving model, and is promoted only when its Brier score on the same sessions is better.
    retrain_every_seconds: float = Field(
        0.0, ge=0, description="How often to train a candidate from the event log; 0: never."
    )
    retrain_min_arrivals: int = Field(
        1000, ge=0, description="Requests routed since the last run, or the run is skipped."
    )
    retrain_max_log_bytes: int = Field(
        256 * 1024 * 1024,
        ge=4096,
        description="The newest event log segments up to this size are trained on.",
    )
    retrain_valid_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="The newest share of the log's time span that stops training early.",
    )
    retrain_max_rounds: int = Field(300, ge=1, description="Most boosting rounds per candidate.")
    retrain_timeout_seconds: float = Field(
        1800.0, gt=0, description="A training run still going after this long is killed (failed)."
    )
    retrain_min_judged: int = Field(
        500,
        ge=2,
        description="Paired outcomes judged before a candidate is promoted or discarded.",
    )
    retrain_shadow_seconds: float = Field(
        3600.0, gt=0, description="Longest a candidate shadows before it is discarded undecided."
    )
    retrain_promote_margin: float = Field(
        0.02,
        ge=0,
        lt=1,
        description=(
            "Promote when the candidate's Brier score is lower than the serving model's by at "
            "least this share of it (and by two paired standard errors)."
        ),
    )
    # How often the dashboard's timeline samples the counters (app/observe/timeline.py; an hour
    # of samples is kept at 2 s); 0 turns sampling off (tests drive it one sample at a time).
    dashboard_sample_seconds: float = Field(2.0, ge=0)

    # Name of this replica: keys its log checkpoint in a shared store.
    replica_id: str = Field(default_factory=socket.gethostname)

    # Where prefetch orders go (app/deliver): `pull` keeps them for agents to fetch with
    # GET /v1/orders and needs nothing else, so it is the default.
    order_sink: Literal["memory", "webhook", "redis", "pull", "lmcache"] = "pull"
    # A resubmitted order id (or cancel) within this long is dropped by the sink.
    order_dedupe_seconds: int = Field(3600, ge=1)
    # The webhook sink's receiver; required when order_sink is webhook.
    # Secret: its path is often the receiver's secret (shown as https://host/****).
    order_webhook_url: SecretStr | None = None
    order_webhook_timeout_seconds: float = Field(5.0, gt=0)
    # Tries per batch (the first included) on connection errors, 5xx and 429.
    order_webhook_max_attempts: int = Field(5, ge=1)
    # The wait before the first retry, doubling (with jitter) up to the maximum; a Retry-After
    # longer than the maximum gives up at once instead of holding the scheduler.
    order_webhook_backoff_seconds: float = Field(0.2, ge=0)
    order_webhook_max_backoff_seconds: float = Field(5.0, ge=0)
    # The lmcache sink (app/deliver/lmcache.py): LMCache's coordinator, and the model and world
    # size its MP servers registered their KV layout under (LMCache keys content by them).
    lmcache_coordinator_url: str = "http://127.0.0.1:9000"
    lmcache_model_name: str = ""
    lmcache_world_size: int = Field(1, ge=1)
    # LMCache's per-tenant salt, applied to every order's keys ("" for none).
    lmcache_cache_salt: str = Field("", max_length=256)
    # Which tier a demote deletes from: l1 (the MP server's DRAM; L2 keeps its copy), l2, or all.
    lmcache_demote_tier: Literal["l1", "l2", "all"] = "l1"
    # How often a submitted prefetch is polled, and how long it may stay pending before it fails.
    lmcache_poll_interval_seconds: float = Field(0.05, gt=0)
    lmcache_prefetch_timeout_seconds: float = Field(30.0, gt=0)
    # Per call: the wait for an answer, and tries (the first included) on connection errors,
    # timeouts, 429 and 5xx other than the MP server's 503, with a doubling, capped backoff.
    lmcache_timeout_seconds: float = Field(5.0, gt=0)
    lmcache_max_attempts: int = Field(3, ge=1)
    lmcache_backoff_seconds: float = Field(0.2, ge=0)
    lmcache_max_backoff_seconds: float = Field(2.0, ge=0)
    # How often the sink, while it holds pins, checks that the coordinator still holds them (a
    # restart drops them all) and reports those lost, to be pinned again; 0: never.
    lmcache_pin_check_seconds: float = Field(5.0, ge=0)
    # The token index (app/deliver/token_index.py): tokens of stored blocks kept, least recently
    # used out first; about 22 bytes a token with 16-token blocks, so about 90 MiB by default.
    lmcache_token_index_max_tokens: int = Field(4_194_304, ge=1)
    # The Redis stream sink: stream <prefix>:orders, trimmed to about this many entries.
    order_stream_maxlen: int = Field(100_000, ge=1)
    # Defaults to <redis_prefix>:sink, since the state store owns <redis_prefix>:orders.
    order_stream_prefix: str | None = Field(None, min_length=1, max_length=64)
    # How long a stream entry may sit unacked with a consumer before another agent claims it.
    order_claim_idle_seconds: float = Field(30.0, gt=0)
    # The pull queue: how long a pulled order is leased before it is handed out again, unless the
    # agent renews it (POST /v1/orders/renew; the reference agent does, a third of this apart).
    order_lease_seconds: float = Field(30.0, gt=0)
    # The scheduler gives up an open prefetch not done this long past its needed_by (its agent
    # died mid-transfer, or nobody took it up): long enough for a dead agent's order to be
    # claimed and finished, short enough that its room and link time are not held for good.
    order_overdue_seconds: float = Field(60.0, gt=0)
    # A failed order (reported failed, refused by the sink, overdue once started) is planned
    # again for that session and destination only after this long, doubling with each failure in
    # a row up to the max: a failing tier is not asked again every tick.
    order_retry_backoff_seconds: float = Field(1.0, gt=0)
    order_retry_backoff_max_seconds: float = Field(30.0, gt=0)
    # Whether the tier's pins hold room (a pinned block is never evicted for a waiting request,
    # as LMCache's pins or a hard-pinning engine): then a pin is priced against the calls waiting
    # on its instance (app/decide/scheduler.py), Continuum's rule.
    pins_hold_room: bool = Field(
        False,
        description="The tier's pins hold room: price each pin against the calls waiting on its "
        "instance, and release those not worth it.",
    )

    # vLLM's ZMQ KV-event stream (app/ingest/vllm/, docs/integrations/vllm.md): the publishers
    # the service subscribes to, separated by spaces or `;`, each
    # `instance_id=tcp://host:port[,replay=tcp://host:port][,dp=N][,topic=T]` (dp: that many
    # data-parallel ranks, rank r on both ports + r, as vLLM binds them). Empty: no subscription.
    # Parsed when the engine is built (app/ingest/vllm/wire.py parse_endpoints): a bad entry
    # stops startup, named.
    vllm_kv_endpoints: str = ""
    # How long a publisher's replay socket may take to resend a gap before it is reported lost.
    vllm_replay_timeout_seconds: float = Field(2.0, gt=0)
    # A replay that timed out is asked again, with backoff, for up to this long after the gap
    # opened (the publisher's later batches wait meanwhile, so they stay in order); then the gap
    # is lost. 0: never asked again.
    vllm_replay_retry_seconds: float = Field(10.0, ge=0)
    # vLLM's buffer_steps (its replay buffer, 10,000 by default): a gap longer than this is not
    # waited for beyond its last this many batches, which are all a replay socket can hold.
    vllm_replay_buffer_steps: int = Field(10_000, ge=1, le=10_000_000)
    # The largest ZMQ frame taken from a publisher (ZMQ_MAXMSGSIZE): a bigger one drops the
    # connection before it is held in memory (the connection is made again, the batch lost).
    # vLLM's batches are one engine step's events: tens of KB, a few MB at most.
    vllm_max_message_bytes: int = Field(4 * 2**20, ge=4096, le=2**31 - 1)
    # Messages waiting per publisher (ZMQ's receive high-water mark): at most this many times
    # vllm_max_message_bytes held; past it the publisher drops, and a replay recovers.
    vllm_receive_queue: int = Field(1_000, ge=1, le=1_000_000)

    # Several replicas on one Redis (decisions.md, 23). > 0: one replica plans at a time, under a
    # lease in Redis of this many seconds (renewed every third; taken over within about one and
    # a third of it once its holder dies). Needs KVP_STORE=redis and an order sink every replica
    # reaches (redis, webhook, lmcache: not pull). 0: every replica plans for itself, as one.
    planning_lease_seconds: float = Field(0.0, ge=0)
    # Where the per-client rate limits count: in each replica (a client spreading its posts over
    # N replicas gets N times its rate) or fleet-wide, in a Redis token bucket per client.
    rate_limit_scope: Literal["replica", "fleet"] = "replica"

    @model_validator(mode="after")
    def _batch_fits_the_backlog(self) -> Settings:
        if self.max_batch_events > self.backlog_max_events:
            raise ValueError(
                f"max_batch_events ({self.max_batch_events}) must not exceed "
                f"backlog_max_events ({self.backlog_max_events})"
            )
        return self

    @model_validator(mode="after")
    def _horizons_in_order(self) -> Settings:
        # The advisor's return horizon (app/decide/advisor.py RETURN_HORIZON_SECONDS).
        if not self.lead_seconds <= self.keep_horizon_seconds <= 900.0:
            raise ValueError(
                f"lead_seconds ({self.lead_seconds:g}) <= keep_horizon_seconds "
                f"({self.keep_horizon_seconds:g}) <= 900 must hold"
            )
        return self

    @property
    def models_root_dir(self) -> Path:
        return self.models_root if self.models_root is not None else self.model_dir.parent

    @property
    def event_log_dir(self) -> Path:
        return self.log_dir if self.log_dir is not None else self.data_dir / "events"

    @property
    def stream_prefix(self) -> str:
        return (
            self.order_stream_prefix
            if self.order_stream_prefix is not None
            else f"{self.redis_prefix}:sink"
        )
