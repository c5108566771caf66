#!/usr/bin/env python3
"""Outbox worker for the demo: a separate process that speaks only SQL.

Loop: claim a batch with a lease, run the handler on each event, then in one
transaction report failures with outbox.fail() and acknowledge the rest with
outbox.ack(), logging each ack that returned true in demo.deliveries. When nothing
is claimable it waits for a NOTIFY on channel 'outbox' (or a short timeout: retries
coming due are not always announced at once).

The handler fails a few percent of events transiently (only on attempts 1 and 2,
so an ordinary event never exhausts the topic's 5 attempts) and always fails the
poison event, which therefore goes dead after its last attempt.

Once scripts/demo.sh has recorded that pgbench finished, the worker exits as soon
as no event of the topic is pending or leased (exit 0), or after --drain-timeout
seconds (exit 3).
"""

import argparse
import random
import sys
import time

import psycopg

CLAIM = """
SELECT id, payload, attempt, lease_token
  FROM outbox.claim(%(worker)s, %(batch)s, make_interval(secs => %(lease)s), ARRAY[%(topic)s],
                    subscription => %(subscription)s)
"""

# ack() and the delivery record commit together: a record exists iff that ack
# returned true and committed.
ACK_AND_RECORD = """
WITH acked AS (
    SELECT e.id, e.attempt
      FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(attempts)s::int[]) AS e(id, token, attempt)
     WHERE outbox.ack(e.id, e.token)
)
INSERT INTO demo.deliveries (subscription, event_id, worker, attempt)
SELECT %(subscription)s, id, %(worker)s, attempt FROM acked ORDER BY id
RETURNING event_id
"""

FAIL = "SELECT outbox.fail(%s, %s, %s, make_interval(secs => %s))"

RECORD_FAILURE = """
INSERT INTO demo.failures (subscription, event_id, worker, attempt, result, error)
VALUES (%s, %s, %s, %s, %s, %s)
"""

# What is left for this worker's subscription: pending or leased events of the
# topic ('default': as outbox.events shows them), or a named subscription's lag (events it has not
# finished, read from the log or not).
UNFINISHED = """
SELECT (SELECT pgbench_finished IS NOT NULL FROM demo.run),
       CASE WHEN %(subscription)s = 'default'
            THEN (SELECT count(*) FROM outbox.events
                   WHERE topic = %(topic)s AND state IN ('pending', 'leased'))
            ELSE (SELECT lag_events FROM outbox.subscriptions WHERE name = %(subscription)s) END
"""


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", required=True, help="libpq connection string")
    p.add_argument("--name", required=True, help="worker name (recorded as leased_by)")
    p.add_argument("--topic", default="bank.account.updated")
    p.add_argument("--subscription", default="default", help="the subscription to claim from")
    p.add_argument("--batch", type=int, default=100, help="events per claim")
    p.add_argument("--lease", type=float, default=10.0, help="lease in seconds")
    p.add_argument("--fail-pct", type=float, default=3.0,
                   help="percent of handler calls on attempts 1 and 2 that fail transiently")
    p.add_argument("--retry-min", type=float, default=0.05, help="seconds")
    p.add_argument("--retry-max", type=float, default=0.2, help="seconds")
    p.add_argument("--idle-wait", type=float, default=0.5,
                   help="longest wait for a NOTIFY before claiming again (seconds)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds to wait for the outbox to drain after pgbench finished")
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args()


class Worker:
    def __init__(self, args):
        self.a = args
        self.rng = random.Random(args.seed)
        self.stats = dict(batches=0, claimed=0, acked=0, ack_stale=0,
                          fail_pending=0, fail_dead=0, fail_stale=0, wakeups=0)
        # autocommit: claim() commits on its own (the lease must be visible to
        # others at once); ack/fail batches use explicit transactions.
        self.conn = psycopg.connect(args.dsn, autocommit=True,
                                    application_name=args.name)
        # outbox.claim refuses SERIALIZABLE (0A000): claim at READ COMMITTED
        # whatever the database's default_transaction_isolation.
        self.conn.execute("SET default_transaction_isolation = 'read committed'")
        self.conn.execute("LISTEN outbox")

    def handle(self, payload, attempt):
        """The 'downstream' handler: None on success, else an error message."""
        if payload.get("poison"):
            return "poison event: handler rejects it on every attempt"
        if attempt <= 2 and self.rng.random() * 100 < self.a.fail_pct:
            return "transient: simulated downstream timeout"
        return None

    def process(self, rows):
        ok, failed = [], []
        for event_id, payload, attempt, token in rows:
            err = self.handle(payload, attempt)
            if err is None:
                ok.append((event_id, token, attempt))
            else:
                failed.append((event_id, token, attempt, err))
        # Counters change only after the commit, so they match what the
        # database recorded.
        counts = dict(fail_pending=0, fail_dead=0, fail_stale=0, acked=0, ack_stale=0)
        with self.conn.transaction():
            for event_id, token, attempt, err in failed:
                retry_in = self.rng.uniform(self.a.retry_min, self.a.retry_max)
                result = self.conn.execute(FAIL, (event_id, token, err, retry_in)).fetchone()[0]
                counts["fail_" + result] += 1
                self.conn.execute(RECORD_FAILURE,
                                  (self.a.subscription, event_id, self.a.name, attempt, result, err))
            if ok:
                acked = self.conn.execute(ACK_AND_RECORD, dict(
                    ids=[r[0] for r in ok], tokens=[r[1] for r in ok],
                    attempts=[r[2] for r in ok], worker=self.a.name,
                    subscription=self.a.subscription)).fetchall()
                counts["acked"] += len(acked)
                counts["ack_stale"] += len(ok) - len(acked)
        for k, v in counts.items():
            self.stats[k] += v

    def wait_for_notify(self):
        try:
            gen = self.conn.notifies(timeout=self.a.idle_wait, stop_after=1)
        except TypeError:  # psycopg < 3.2 has no timeout: poll instead
            time.sleep(self.a.idle_wait)
            return
        for _ in gen:
            self.stats["wakeups"] += 1

    def run(self):
        drain_deadline = None
        while True:
            rows = self.conn.execute(CLAIM, dict(
                worker=self.a.name, batch=self.a.batch, lease=self.a.lease,
                topic=self.a.topic, subscription=self.a.subscription)).fetchall()
            if rows:
                self.stats["batches"] += 1
                self.stats["claimed"] += len(rows)
                self.process(rows)
                continue
            finished, unfinished = self.conn.execute(UNFINISHED, dict(
                topic=self.a.topic, subscription=self.a.subscription)).fetchone()
            if finished:
                if unfinished == 0:
                    return True
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + self.a.drain_timeout
                elif time.monotonic() > drain_deadline:
                    print(f"{self.a.name}: {unfinished} event(s) still pending or leased "
                          f"after {self.a.drain_timeout:.0f} s; giving up", file=sys.stderr)
                    return False
            self.wait_for_notify()

    def save_stats(self, drained):
        s = self.stats
        self.conn.execute(
            "INSERT INTO demo.worker_stats (worker, subscription, batches, claimed, acked, ack_stale,"
            " fail_pending, fail_dead, fail_stale, wakeups, drained)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (self.a.name, self.a.subscription, s["batches"], s["claimed"], s["acked"], s["ack_stale"],
             s["fail_pending"], s["fail_dead"], s["fail_stale"], s["wakeups"], drained))
        print(f"{self.a.name}: " + " ".join(f"{k}={v}" for k, v in s.items())
              + f" drained={drained}")


def main():
    args = parse_args()
    w = Worker(args)
    drained = w.run()
    w.save_stats(drained)
    w.conn.close()
    return 0 if drained else 3


if __name__ == "__main__":
    sys.exit(main())
