"""`kvprefetch bench planner`: what one planning replica follows (docs/decisions.md, 30).

With a planning lease every replica adds its accepted batches to the fleet feed in Redis and
reads the others' into its planning side (app/decide/fleet_feed.py), so the fleet's event rate is
bounded by what one process applies from the feed. Each round, against real `serve` processes on
one Redis (the Redis store, KVP_PLANNING_LEASE_SECONDS, KVP_ORDER_SINK=redis, a prefix of their
own, removed afterwards):

1. **One replica** under the bench-load client's closed-loop routers (bench/load/client.py, all
   `connections` on it): accepted events/s and batch latency, its own ingest.
2. **The feed, pre-filled.** The same replica, now idle, is stopped (SIGSTOP); this process adds
   `feed_events` events to the feed in the entries `FleetFeed.publish` writes, as another
   replica; the replica is continued (SIGCONT) and its applied-events counter
   (`kvprefetch_fleet_feed_applied_events_total`) polled until it has them all: events/s applied
   from the feed, beside its own ingest's from step 1.
3. **`replicas` replicas**, the same routers spread over them: the fleet's accepted events/s and
   batch latency, each replica's, and the planner's lag: the other replicas' accepted events
   (`kvprefetch_events_ingested_total`) less what it applied from the feed, sampled during the
   load, at its stop, and how long it took to reach zero after.

Everything shares this machine's cores: the replicas, Redis and this client. On a machine with
fewer cores than replicas the three-replica figures say what the cores give, not what three
hosts would; the JSON has the core count and load averages beside them.

- `options`: `PlannerOptions`, a run's settings and their defaults;
- `driver`: `run(options)`, the rounds and their JSON.
"""
