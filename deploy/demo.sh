#!/usr/bin/env bash
# `make demo`: start the service (in-memory store, the bundled model) and replay a shared trace
# against it over HTTP in accelerated time, so /dashboard (and /metrics) fill while you watch.
# The replay's cluster runs on the service's own orders (`--policy service`, sim/served.py): it
# reports its instances' free KV bytes, pulls the service's prefetch, pin and demote orders
# (GET /v1/orders), carries them out over its simulated links and reports their progress, with
# early signals (session_signal events) before returning turns. The service's clock runs at the
# replay's speed (KVP_CLOCK_SPEED), so it sees the trace's own durations.
# Ctrl-C stops both. Settings (environment):
#   DEMO_TRACE     the trace (default ../shared/traces/mooncake_conversation_first60.jsonl)
#   DEMO_SPEED     times real time (default 20: the conversation trace's 35 minutes in under 2)
#   DEMO_POLICY    the simulated cluster's policy (default service: the service's own orders drive
#                  it; none, learned, ...: the simulator decides, and nobody carries the service's
#                  orders out)
#   DEMO_SIGNALS   the replay's --signals (default coverage=0.5,lead_median=5,false_alarms=1: half
#                  the returning turns signalled 5 s ahead, as many false alarms); off: no signals
#   DEMO_REQUESTS  replay only the trace's first N requests (default: all)
#   DEMO_AGENTS    1: an agent trace instead (`kvprefetch agent-trace`, DEMO_AGENT_TASKS tasks,
#                  default 600), replayed closed-loop on the agents scenario with exact tool
#                  signals (DEMO_SIGNALS default tools=1): the dashboard's Tools table fills
#   DEMO_SCENARIO  the replay's scenario (default: default; agents with DEMO_AGENTS=1)
#   DEMO_LINGER    1 (default): keep serving after the replay until Ctrl-C; 0: stop when it ends
#   DEMO_DATA_DIR  where each demo's directory goes (default var/demo): a new one a run, named for
#                  its start (UTC), holding the service's event log (events/) and log; kept, so a
#                  demo's events can be trained on later (`kvprefetch train --events DIR/events`)
#   KVP_PORT       the service's port (default 8000); other KVP_ settings pass through (KVP_MODEL_DIR:
#                  another model; KVP_CLOCK_SPEED: another clock than DEMO_SPEED's)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
KVP="$VENV/bin/kvprefetch"
AGENTS="${DEMO_AGENTS:-0}"
TRACE="${DEMO_TRACE:-../shared/traces/mooncake_conversation_first60.jsonl}"
SPEED="${DEMO_SPEED:-20}"
POLICY="${DEMO_POLICY:-service}"
if [ "$AGENTS" = "1" ]; then
  SIGNALS="${DEMO_SIGNALS:-tools=1}"
  SCENARIO="${DEMO_SCENARIO:-agents}"
else
  SIGNALS="${DEMO_SIGNALS:-coverage=0.5,lead_median=5,false_alarms=1}"
  SCENARIO="${DEMO_SCENARIO:-default}"
fi
LINGER="${DEMO_LINGER:-1}"
PORT="${KVP_PORT:-8000}"
DATA_ROOT="${DEMO_DATA_DIR:-var/demo}"
URL="http://127.0.0.1:$PORT"

say() { echo "demo: $*" >&2; }

[ -x "$KVP" ] || { say "no $KVP: run 'make install' first (make demo does)"; exit 1; }
# A fresh in-memory service each time, in a directory of its own (the store would otherwise be
# rebuilt from an old demo's log); earlier demos' directories and logs are kept.
mkdir -p "$DATA_ROOT"
DATA=$(mktemp -d "$DATA_ROOT/$(date -u +%Y%m%dT%H%M%SZ)-XXXX")
EVENTS="${KVP_LOG_DIR:-$DATA/events}"
say "this demo's directory: $DATA (event log: $EVENTS; kept after the demo)"
if [ "$AGENTS" = "1" ]; then
  TRACE="$DATA/agent.jsonl"
  "$KVP" agent-trace --out "$TRACE" --tasks "${DEMO_AGENT_TASKS:-600}" >&2
fi
[ -f "$TRACE" ] || { say "no trace at $TRACE: set DEMO_TRACE to a Mooncake-format trace"; exit 1; }
if [ -n "${DEMO_REQUESTS:-}" ]; then
  head -n "$DEMO_REQUESTS" "$TRACE" >"$DATA/trace.jsonl"
  TRACE="$DATA/trace.jsonl"
fi

svc=""
stop() {
  trap - EXIT INT TERM
  if [ -n "$svc" ] && kill -0 "$svc" 2>/dev/null; then
    say "stopping the service"
    kill -TERM "$svc" 2>/dev/null || true
    wait "$svc" 2>/dev/null || true
    say "this demo's event log is kept at $EVENTS"
  fi
}
trap stop EXIT
trap 'exit 130' INT TERM

# In a session of its own: Ctrl-C reaches this script alone, whose EXIT trap stops the service.
# In the terminal's group the service would take the SIGINT too and could exit 0 before the trap
# ran, so the script's status would depend on which of the two went first.
SETSID=$(command -v setsid || true)
# Its clock at the replay's pace: a trace second is a second of the service's, so its model,
# thresholds and loops see the durations they were made for.
KVP_STORE=memory KVP_HOST=127.0.0.1 KVP_PORT="$PORT" KVP_DATA_DIR="$DATA" KVP_LOG_FSYNC=false \
  KVP_CLOCK_SPEED="${KVP_CLOCK_SPEED:-$SPEED}" $SETSID "$KVP" serve >"$DATA/service.log" 2>&1 &
svc=$!

say "starting the service on $URL (log: $DATA/service.log)"
for _ in $(seq 1 300); do
  if ! kill -0 "$svc" 2>/dev/null; then
    cat "$DATA/service.log" >&2
    say "the service exited during startup (is port $PORT taken? set KVP_PORT)"
    exit 1
  fi
  if "$VENV/bin/python" - "$URL/readyz" <<'PY' 2>/dev/null; then break; fi
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=1)
PY
  sleep 0.2
done

echo
echo "  kvprefetch demo: open the dashboard at  $URL/dashboard"
echo "  (Prometheus metrics: $URL/metrics; API: $URL/docs). Ctrl-C stops the demo."
echo
SIGNAL_ARGS=()
if [ "$SIGNALS" != "off" ]; then SIGNAL_ARGS=(--signals "$SIGNALS"); fi
say "replaying $TRACE at ${SPEED}x (policy $POLICY, signals $SIGNALS, scenario $SCENARIO)"
"$KVP" replay --via "$URL" --trace "$TRACE" --policy "$POLICY" --speed "$SPEED" \
  --scenario "$SCENARIO" ${SIGNAL_ARGS[@]+"${SIGNAL_ARGS[@]}"}
if [ "$POLICY" = "service" ]; then
  # The service's own books: its orders issued, completed and used (GET /v1/scheduler).
  "$VENV/bin/python" - "$URL/v1/scheduler" <<'PY' || true
import json, sys, urllib.request
t = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))
o = t["orders"]
print(
    f"demo: the service's orders: {o['prefetch']} prefetches ({t['bytes_ordered'] / 1e9:,.1f} GB), "
    f"{o['pin']} pins, {o['demote']} demotes; {t['completed']} prefetches landed, "
    f"{t['cancelled']} cancelled, {t['failed']} failed; {t['bytes_used'] / 1e9:,.1f} GB used, "
    f"{t['bytes_unused'] / 1e9:,.1f} GB unused, {t['bytes_wasted'] / 1e9:,.1f} GB wasted",
    file=sys.stderr,
)
PY
fi

if [ "$AGENTS" = "1" ]; then
  # What the service learned of the agents' tools from their signals (GET /v1/tools).
  "$VENV/bin/python" - "$URL/v1/tools" <<'PY' || true
import json, sys, urllib.request
tools = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))["tools"]
for t in tools:
    p50 = "-" if t["p50_seconds"] is None else f"{t['p50_seconds']:.1f} s"
    print(f"demo: tool {t['tool']}: {t['calls']} calls, p50 {p50}", file=sys.stderr)
PY
fi

say "the event log is at $EVENTS (kept: train on it with kvprefetch train --events $EVENTS)"
if [ "$LINGER" = "1" ]; then
  say "replay done; the service keeps serving $URL/dashboard until Ctrl-C"
  wait "$svc"
fi
