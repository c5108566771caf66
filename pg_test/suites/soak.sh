#!/usr/bin/env bash
# Soak test: 60 s of publishers, failing/crashing workers, maintenance and
# purges, then the invariant checker (pg_test/suites/soak.py). It starts and stops
# its own preloaded cluster (outbox-soak, port 5481). The hour-long run:
#   .venv/bin/python pg_test/suites/soak.py --duration 3600
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
NAME=outbox-soak
PORT=5481
PY="${OUTBOX_TEST_PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

# soak.py stops the cluster itself; this covers a kill by the runner's timeout.
cleanup() { bash scripts/pgcluster.sh stop "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT

"$PY" pg_test/suites/soak.py --duration "${SOAK_DURATION:-60}" --cluster "$NAME" --port "$PORT" &
child=$!
# Forward a runner's timeout to python so it can clean up, then stop the cluster.
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM INT
wait "$child"
