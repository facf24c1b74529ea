#!/usr/bin/env bash
# `make demo`: start the service (in-memory store, the bundled model) and replay a shared trace
# against it over HTTP in accelerated time, so /dashboard (and /metrics) fill while you watch.
# Ctrl-C stops both. Settings (environment):
#   DEMO_TRACE     the trace (default ../shared/traces/mooncake_conversation_first60.jsonl)
#   DEMO_SPEED     times real time (default 20: the conversation trace's 35 minutes in under 2)
#   DEMO_POLICY    the simulated cluster's policy (default none: LRU; the service predicts on its own)
#   DEMO_REQUESTS  replay only the trace's first N requests (default: all)
#   DEMO_LINGER    1 (default): keep serving after the replay until Ctrl-C; 0: stop when it ends
#   KVP_PORT       the service's port (default 8000); other KVP_ settings pass through
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
KVP="$VENV/bin/kvprefetch"
TRACE="${DEMO_TRACE:-../shared/traces/mooncake_conversation_first60.jsonl}"
SPEED="${DEMO_SPEED:-20}"
POLICY="${DEMO_POLICY:-none}"
LINGER="${DEMO_LINGER:-1}"
PORT="${KVP_PORT:-8000}"
DATA="${DEMO_DATA_DIR:-var/demo}"
URL="http://127.0.0.1:$PORT"

say() { echo "demo: $*" >&2; }

[ -x "$KVP" ] || { say "no $KVP: run 'make install' first (make demo does)"; exit 1; }
[ -f "$TRACE" ] || { say "no trace at $TRACE: set DEMO_TRACE to a Mooncake-format trace"; exit 1; }

# A fresh in-memory service each time: the store would otherwise be rebuilt from an old demo's log.
rm -rf "$DATA"
mkdir -p "$DATA"
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
  fi
}
trap stop EXIT
trap 'exit 130' INT TERM

# In a session of its own: Ctrl-C reaches this script alone, whose EXIT trap stops the service.
# In the terminal's group the service would take the SIGINT too and could exit 0 before the trap
# ran, so the script's status would depend on which of the two went first.
SETSID=$(command -v setsid || true)
KVP_STORE=memory KVP_HOST=127.0.0.1 KVP_PORT="$PORT" KVP_DATA_DIR="$DATA" KVP_LOG_FSYNC=false \
  $SETSID "$KVP" serve >"$DATA/service.log" 2>&1 &
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
say "replaying $TRACE at ${SPEED}x (policy $POLICY)"
"$KVP" replay --via "$URL" --trace "$TRACE" --policy "$POLICY" --speed "$SPEED"

if [ "$LINGER" = "1" ]; then
  say "replay done; the service keeps serving $URL/dashboard until Ctrl-C"
  wait "$svc"
fi
