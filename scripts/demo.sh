#!/usr/bin/env bash
# The outbox_ext demo: pgbench's TPC-B-like workload publishing one outbox event per
# transaction, drained meanwhile through two subscriptions, 'ledger' and
# 'notifications', each by its own worker processes; then, per subscription, a
# summary and the invariant check (delivered events = committed transactions, each
# acked once, in per-account order).
#
#   scripts/demo.sh [--duration SECS] [--clients N] [--workers N] [--scale N]
#                   [--port PORT] [--cluster NAME] [--skip-setup] [--keep]
#
# Defaults: 20 s, 8 clients, 2 workers per subscription, scale 8, cluster 'demo' on port 5450.
# --skip-setup  do not run scripts/setup.sh (also: OUTBOX_SKIP_SETUP=1)
# --keep        leave the cluster running afterwards (scripts/pgcluster.sh stop NAME)
# Exit status: 0 when the invariant holds, 1 when it does not, 2 on a usage or
# setup error. Logs of the last run: /tmp/outbox-demo/NAME/.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
DEMO_DIR="$REPO/examples/demo"

DURATION=20 CLIENTS=8 WORKERS=2 SCALE=8 PORT=5450 CLUSTER=demo KEEP=0
SKIP_SETUP="${OUTBOX_SKIP_SETUP:-0}"
# Percent of pgbench transactions that roll back, and of handler calls (on
# attempts 1-2) that fail transiently.
ABORT_PCT=2 FAIL_PCT=3
TOPIC=bank.account.updated
SUBSCRIPTIONS=(ledger notifications)

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
num() { case "${2:-}" in '' | *[!0-9]*) echo "demo: $1 needs a number" >&2; exit 2 ;; esac; }
while [ "$#" -gt 0 ]; do
    case "$1" in
        --duration) num "$1" "${2:-}"; DURATION="$2"; shift ;;
        --clients) num "$1" "${2:-}"; CLIENTS="$2"; shift ;;
        --workers) num "$1" "${2:-}"; WORKERS="$2"; shift ;;
        --scale) num "$1" "${2:-}"; SCALE="$2"; shift ;;
        --port) num "$1" "${2:-}"; PORT="$2"; shift ;;
        --cluster) CLUSTER="${2:?--cluster needs a name}"; shift ;;
        --skip-setup) SKIP_SETUP=1 ;;
        --keep) KEEP=1 ;;
        -h | --help) usage ;;
        *) echo "demo: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
[ "$DURATION" -ge 2 ] && [ "$CLIENTS" -ge 1 ] && [ "$WORKERS" -ge 1 ] && [ "$SCALE" -ge 1 ] ||
    { echo "demo: duration >= 2 and clients, workers, scale >= 1 please" >&2; exit 2; }

say() { echo "demo: $*"; }

if [ "$SKIP_SETUP" != "1" ]; then
    say "setup (scripts/setup.sh: packages, extension, .venv)"
    bash "$SCRIPT_DIR/setup.sh" || { echo "demo: setup failed" >&2; exit 2; }
fi

# shellcheck source=scripts/pgenv.sh
. "$SCRIPT_DIR/pgenv.sh" --
PY="$REPO/.venv/bin/python"
[ -x "$PY" ] || { echo "demo: $PY missing; run scripts/setup.sh" >&2; exit 2; }
PGCLUSTER=(bash "$SCRIPT_DIR/pgcluster.sh")
RUN_DIR="/tmp/outbox-demo/$CLUSTER"
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"

WORKER_PIDS=()
PGBENCH_PID=""
DEMO_OK=0
cleanup() {
    local p
    for p in "${WORKER_PIDS[@]}" $PGBENCH_PID; do
        kill "$p" 2>/dev/null || true
    done
    wait 2>/dev/null || true
    if [ "$KEEP" -eq 1 ]; then
        say "cluster '$CLUSTER' left running (stop: scripts/pgcluster.sh stop $CLUSTER)"
    elif [ "$DEMO_OK" -eq 1 ]; then
        # ~300 MB of pgbench data and WAL: not worth keeping after a good run.
        "${PGCLUSTER[@]}" destroy "$CLUSTER" >/dev/null 2>&1 || true
    else
        # Stopped but kept for a post-mortem (server.log, data).
        "${PGCLUSTER[@]}" stop "$CLUSTER" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A fresh cluster with the library preloaded, so the background worker sends the
# wake-ups (outbox.notify = background) for database 'postgres', which we use.
say "starting cluster '$CLUSTER' on port $PORT (shared_preload_libraries = outbox_ext)"
"${PGCLUSTER[@]}" start "$CLUSTER" "$PORT" --preload >"$RUN_DIR/pgcluster.log" 2>&1 ||
    { cat "$RUN_DIR/pgcluster.log" >&2; exit 2; }
DSN="$(outbox_pg_dsn "$CLUSTER" "$PORT" postgres)"
psql() { "$PG_BINDIR/psql" "$DSN" -X -q -v ON_ERROR_STOP=1 "$@"; }

say "pgbench -i -s $SCALE, then examples/demo/prepare.sql"
"$PG_BINDIR/pgbench" "$DSN" -i -s "$SCALE" -q >"$RUN_DIR/pgbench-init.log" 2>&1 ||
    { cat "$RUN_DIR/pgbench-init.log" >&2; exit 2; }
psql -f "$DEMO_DIR/prepare.sql" >/dev/null

# Workers get the whole run plus their drain allowance, and a margin, before
# timeout stops them: the demo must never hang.
DRAIN_TIMEOUT=60
for sub in "${SUBSCRIPTIONS[@]}"; do
    for i in $(seq 1 "$WORKERS"); do
        timeout -k 5 $((DURATION + DRAIN_TIMEOUT + 30)) "$PY" "$DEMO_DIR/worker.py" \
            --dsn "$DSN" --name "$sub-$i" --topic "$TOPIC" --subscription "$sub" \
            --fail-pct "$FAIL_PCT" --drain-timeout "$DRAIN_TIMEOUT" \
            >"$RUN_DIR/worker-$sub-$i.log" 2>&1 &
        WORKER_PIDS+=("$!")
    done
done
say "$WORKERS workers for each of ${SUBSCRIPTIONS[*]} started; pgbench: $CLIENTS clients for $DURATION s ($ABORT_PCT% of transactions roll back)"

psql -c "UPDATE demo.run SET pgbench_started = clock_timestamp()"
"$PG_BINDIR/pgbench" "$DSN" -n -f "$DEMO_DIR/tpcb_outbox.sql" -s "$SCALE" \
    -D abort_pct="$ABORT_PCT" -c "$CLIENTS" -j 2 -T "$DURATION" -P 5 \
    >"$RUN_DIR/pgbench.log" 2>&1 &
PGBENCH_PID=$!

# Halfway through, the poison event: its own subject, so it blocks no account.
sleep $((DURATION / 2))
psql -c "SELECT outbox.publish('$TOPIC',
            jsonb_build_object('poison', true, 'note', 'the handler always rejects this one'),
            subject => 'poison')" >/dev/null
say "poison event published"

pgbench_rc=0
wait "$PGBENCH_PID" || pgbench_rc=$?
PGBENCH_PID=""
psql -c "UPDATE demo.run SET pgbench_finished = clock_timestamp()"
grep -E '^progress:' "$RUN_DIR/pgbench.log" | sed 's/^/  /' || true
if [ "$pgbench_rc" -ne 0 ]; then
    echo "demo: pgbench exited with $pgbench_rc; end of its log:" >&2
    tail -n 20 "$RUN_DIR/pgbench.log" >&2
fi
say "pgbench done; waiting for the workers to drain the outbox (at most ${DRAIN_TIMEOUT} s)"

workers_rc=0
for p in "${WORKER_PIDS[@]}"; do
    wait "$p" || workers_rc=$?
done
WORKER_PIDS=()
if [ "$workers_rc" -ne 0 ]; then
    echo "demo: a worker exited with $workers_rc; its log:" >&2
    cat "$RUN_DIR"/worker-*.log >&2
fi

check_rc=0
for sub in "${SUBSCRIPTIONS[@]}"; do
    "$PY" "$DEMO_DIR/check.py" --dsn "$DSN" --topic "$TOPIC" --pgbench-log "$RUN_DIR/pgbench.log" \
        --clients "$CLIENTS" --workers "$WORKERS" --duration "$DURATION" --subscription "$sub" || check_rc=$?
done

if [ "$check_rc" -ne 0 ] || [ "$pgbench_rc" -ne 0 ] || [ "$workers_rc" -ne 0 ]; then
    say "FAILED (check $check_rc, pgbench $pgbench_rc, workers $workers_rc); logs in $RUN_DIR," \
        "server log in $(outbox_pg_logfile "$CLUSTER")"
    exit 1
fi
DEMO_OK=1
say "OK; logs in $RUN_DIR"
