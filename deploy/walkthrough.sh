#!/usr/bin/env bash
# `make walkthrough`: a data scientist's round trip, with the documented commands only. From an
# event log to two trained models, tracked in MLflow, compared on the held-out end of the trace,
# registered, one shadowing the other in a running service under live traffic, then promoted.
# Every result names the logs and the model it came from (the cards' lineage, evaluate's JSON).
# Settings (environment):
#   WALK_TRACE  the trace (default ../shared/traces/mooncake_conversation_first60.jsonl)
#   WALK_DIR    where everything goes (default var/walkthrough/<start, UTC>): the event log,
#               the models, the MLflow store, the plots, the service's data and log; kept
#   WALK_SPEED  the live traffic's pace, times the trace's (default 60)
#   KVP_PORT    the service's port (default 8000); other KVP_ settings pass through to it
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="${VENV:-.venv}/bin:$PATH"

TRACE="${WALK_TRACE:-../shared/traces/mooncake_conversation_first60.jsonl}"
DIR="${WALK_DIR:-var/walkthrough/$(date -u +%Y%m%dT%H%M%SZ)}"
SPEED="${WALK_SPEED:-60}"
URL="http://127.0.0.1:${KVP_PORT:-8000}"
export MLFLOW_TRACKING_URI="sqlite:///$DIR/mlflow.db"
mkdir -p "$DIR/models"
step() { echo "walkthrough: [${SECONDS} s] $*" >&2; }

step "1. the event log of the trace's first 70% by time (the rest is judged, never trained on)"
kvprefetch events-from-trace --trace "$TRACE" --fraction 0.7 --out "$DIR/events.jsonl"

step "2. two models from it, each a run in MLflow (the second validated on a longer tail)"
kvprefetch train --events "$DIR/events.jsonl" --out "$DIR/models/a" --quiet --mlflow
kvprefetch train --events "$DIR/events.jsonl" --out "$DIR/models/b" --quiet --mlflow \
  --valid-fraction 0.3 --seed 1

step "3. both against the bundled model on the trace's last 30%, logged to MLflow too"
kvprefetch evaluate --models "models/default,$DIR/models/a,$DIR/models/b" --trace "$TRACE" \
  --holdout 0.3 --plots "$DIR/plots" --out "$DIR/evaluate.json" --mlflow

step "4. registered: a to serve, b to shadow (MLflow aliases named for the service's slots)"
kvprefetch registry register "$DIR/models/a" --slot serving
kvprefetch registry register "$DIR/models/b" --slot shadow

step "5. a service serving a, with b as its shadow, under the trace's traffic at ${SPEED}x"
KVP_MODEL_DIR="$DIR/models/a" KVP_DATA_DIR="$DIR/service" KVP_PORT="${URL##*:}" \
  KVP_CLOCK_SPEED="$SPEED" kvprefetch serve >"$DIR/service.log" 2>&1 &
service=$!
trap 'kill -TERM $service 2>/dev/null; wait $service 2>/dev/null || true' EXIT
until curl -fsS "$URL/readyz" >/dev/null 2>&1; do
  kill -0 $service 2>/dev/null || { cat "$DIR/service.log" >&2; exit 1; }
  sleep 0.2
done
curl -fsS -X PUT "$URL/v1/model/shadow" -H 'content-type: application/json' \
  -d '{"model_dir": "b"}'
echo
kvprefetch replay --via "$URL" --trace "$TRACE" --policy service --speed "$SPEED" \
  --signals coverage=0.5,lead_median=5,false_alarms=1 >"$DIR/replay.txt"

step "6. the shadow judged beside the serving model: hit rate, Brier, bytes, disagreements"
curl -fsS "$URL/v1/model" >"$DIR/model-before-promote.json"
jq '{live: .live.hit_rate, shadow: .shadow.hit_rate, comparison}' "$DIR/model-before-promote.json"

step "7. b promoted, in the service and in the registry; the change is in the event log"
curl -fsS -X POST "$URL/v1/model/promote"
echo
kvprefetch registry promote
kvprefetch registry list
grep -h '"model_changed"' "$DIR"/service/events/*
step "done in ${SECONDS} s; everything is in $DIR"
