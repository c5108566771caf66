#!/usr/bin/env bash
# Crash and fault tests: pg_test/suites/crash_test.py on a throwaway
# preloaded cluster of its own (port 5480), because the tests crash and restart the
# server: 1 killed workers (of default and of a named subscription: redelivery after
# the lease, attempts, fencing), 2 server crashes under load (default and two named
# subscriptions: nothing committed lost in any of them, nothing uncommitted, acks
# survive, subject order), 3 background worker crashes, 4 timeouts inside calls.
# The exit code is the verdict; the last line is `N passed, N failed`.
#   CRASH_CASES=1,3 pg_test/suites/crash.sh     # a subset (cases 1..4)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
NAME=outbox-crash
PORT=5480
PY="${OUTBOX_TEST_PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

cleanup() { bash scripts/pgcluster.sh stop "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT

if ! bash scripts/pgcluster.sh start "$NAME" "$PORT" --preload; then
    echo "0 passed, 1 failed"
    exit 1
fi
"$PY" pg_test/suites/crash_test.py --cluster "$NAME" --port "$PORT" --only "${CRASH_CASES:-1,2,3,4}" &
child=$!
# Forward a runner's timeout to python so it can clean up, then stop the cluster.
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM INT
wait "$child"
