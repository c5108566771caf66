#!/usr/bin/env bash
# Randomized concurrency checker (pg_test/suites/checker.py), short CI run: 75 s of
# seeded random load (publishers at every isolation level with savepoints, rollbacks and
# 2PC; workers claiming in autocommit and in explicit transactions; cancel/replay/
# alter_topic; big batches) in two databases with maintenance off, each with `default`
# and two named subscriptions (sub_a: every topic; sub_b: a topic filter, 2 attempts,
# 'skip') that have their own workers (narrowed and bulk claims, array acks, late acks
# with old tokens) and operator (replay, replay_dead, cancel per subscription); then
# quiesce, drain every subscription and check, for each: delivery exactly once,
# uncommitted events, per-subject order (acks and hand-outs), fencing, cancels kept until
# a replay, claim lock waits. In database `other`, `default` reads the log, as a fresh
# 0.12.0 install has it, with cancels of events not read yet or waiting in a batch, and
# its queue must stay empty; in `postgres` it reads the queue (an install before
# 0.12.0), so the queue's code path keeps this coverage. CHECKER_DEFAULT_ON_LOG=all puts
# `default` on the log in both databases (not the CI default yet: with the extra load
# on 2 cores, sub_b's drain has run out of its 40 s budget there), =0 on the queue in both.
# It starts and stops its own preloaded cluster (outbox-checker, port 5482); about
# 2.5 minutes in all. CHECKER_SEED=N reproduces a schedule; the long run:
#   .venv/bin/python pg_test/suites/checker.py --duration 1800 --seed N
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
NAME="${CHECKER_CLUSTER:-outbox-checker}"
PORT="${CHECKER_PORT:-5482}"
PY="${OUTBOX_TEST_PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

# checker.py stops the cluster itself; this covers a kill by the runner's timeout.
cleanup() { bash scripts/pgcluster.sh stop "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT

# The deadline bounds the whole run (load, quiescing, drain, analysis); 170 s was
# hit on a busy machine after a 55 s quiesce and a 38 s drain, before the analysis.
args=(--duration "${CHECKER_DURATION:-75}" --stall 15 --drain-max 40 --deadline 360
      --cluster "$NAME" --port "$PORT")
[ -n "${CHECKER_SEED:-}" ] && args+=(--seed "$CHECKER_SEED")
# Where 'default' reads the log: 1 = other (the default; the queue's 'default' in
# postgres); all = both databases; 0 = none (the queue's in both); =postgres there only.
case "${CHECKER_DEFAULT_ON_LOG:-1}" in
  0|none) args+=(--default-on-log none) ;;
  1) args+=(--default-on-log other) ;;
  *) args+=(--default-on-log "$CHECKER_DEFAULT_ON_LOG") ;;
esac
"$PY" pg_test/suites/checker.py "${args[@]}" &
child=$!
# Forward a runner's timeout to python so it can clean up, then stop the cluster.
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM INT
wait "$child"
