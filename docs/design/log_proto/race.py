#!/usr/bin/env python3
"""Adversarial check of the storage prototype (proto.sql): publishers commit in
random orders while workers of two subscriptions claim, ack, and sometimes let
a lease expire; every committed event must be acked exactly once in each
subscription, in per-subject order, and no stale token may ack anything.

    .venv/bin/python docs/design/log_proto/race.py --port 5477 [--seconds 30]

Uses the cluster bench.py made (it must have loaded proto.sql; the cluster needs
max_prepared_transactions > 0 for the 2PC arm, else 2PC is skipped).
Publishers: transactions of 1-4 events over 8 subjects (and events without a
subject), serialised per subject by an advisory lock, with savepoint rollbacks,
aborts, long transactions and PREPARE TRANSACTION committed or rolled back
later. Workers (READ COMMITTED or REPEATABLE READ per claim): batch sizes 1-20;
one claim in eight is abandoned (never acked, lease 1 s), and its tokens are
tried again after the events were handed out anew, which must ack nothing.
Exits 1 on a violation.
"""

import argparse
import random
import sys
import threading
import time
from collections import defaultdict

import psycopg

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, default=5477)
ap.add_argument("--seconds", type=float, default=30)
ap.add_argument("--seed", type=int, default=None)
ap.add_argument("--break", dest="brk", default="", help="negative control: 'xip' drops the late committers' arm")
a = ap.parse_args()
DSN = f"host=127.0.0.1 port={a.port} user=postgres dbname=postgres"
SEED = a.seed if a.seed is not None else random.randrange(1 << 30)
SUBS = ("ledger", "mailer")

adm = psycopg.connect(DSN, autocommit=True)
for (g,) in adm.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'lp-%'").fetchall():
    adm.execute(f"ROLLBACK PREPARED '{g}'")
adm.execute("TRUNCATE proto.log, proto.lanes, proto.batches, proto.delivered")
for s in SUBS:
    adm.execute("SELECT proto.create_subscription(%s)", (s,))
two_pc = adm.execute("SELECT current_setting('max_prepared_transactions')::int > 0").fetchone()[0]

committed = {}          # id -> subject
lock = threading.Lock()
acks = defaultdict(list)       # sub -> [(t_ack, id, subject)]
claims = defaultdict(list)     # sub -> [(t_claim, id, subject)]
violations = []
stop_pub = time.monotonic() + a.seconds
pending_2pc = []


def publisher(n):
    c = psycopg.connect(DSN, autocommit=True)
    r = random.Random(SEED * 100 + n)
    k = 0
    while time.monotonic() < stop_pub:
        k += 1
        mine = []
        try:
            c.execute("BEGIN")
            if r.random() < 0.2:
                time.sleep(r.random() * 0.3)  # a long transaction
            for _ in range(r.randint(1, 4)):
                sp = r.random() < 0.2
                if sp:
                    c.execute("SAVEPOINT s")
                subj = None if r.random() < 0.25 else f"k{r.randint(0, 7)}"
                if subj:
                    c.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (subj,))
                (i,) = c.execute("SELECT proto.publish_batch('t', ARRAY['{}'::jsonb], ARRAY[%s::text])",
                                 (subj,)).fetchone()
                if sp and r.random() < 0.5:
                    c.execute("ROLLBACK TO SAVEPOINT s")
                else:
                    mine.append((i, subj))
                time.sleep(r.random() * 0.01)
            x = r.random()
            if x < 0.15:
                c.execute("ROLLBACK")
            elif x < 0.25 and two_pc:
                gid = f"lp-{n}-{k}"
                c.execute(f"PREPARE TRANSACTION '{gid}'")
                time.sleep(r.random() * 0.3)
                if r.random() < 0.7:
                    c.execute(f"COMMIT PREPARED '{gid}'")
                    with lock:
                        committed.update(mine)
                else:
                    c.execute(f"ROLLBACK PREPARED '{gid}'")
            else:
                c.execute("COMMIT")
                with lock:
                    committed.update(mine)
        except psycopg.errors.DeadlockDetected:
            c.execute("ROLLBACK")


def worker(sub, n, done):
    c = psycopg.connect(DSN, autocommit=True, options=f"-c proto.break={a.brk}" if a.brk else None)
    r = random.Random(SEED * 1000 + n)
    stale = []   # (ids, tokens) of abandoned claims
    while not done.is_set():
        iso = r.choice(["READ COMMITTED", "REPEATABLE READ"])
        c.execute(f"BEGIN ISOLATION LEVEL {iso}")
        try:
            rows = c.execute("SELECT id, lease_token::text, subject FROM proto.claim(%s, %s, %s, '1 second')",
                             (sub, f"w{n}", r.randint(1, 20))).fetchall()
            c.execute("COMMIT")
        except psycopg.errors.SerializationFailure:
            c.execute("ROLLBACK")
            continue
        t = time.monotonic()
        with lock:
            claims[sub].extend((t, i, s) for i, _, s in rows)
        subj = [s for _, _, s in rows if s is not None]
        if len(subj) != len(set(subj)):
            violations.append(f"{sub}: a claim returned two events of one subject: {rows}")
        if rows and r.random() < 0.125:
            stale.append(([i for i, _, _ in rows], [tk for _, tk, _ in rows], time.monotonic()))
            continue
        if rows:
            time.sleep(r.random() * 0.005)
            (k,) = c.execute("SELECT proto.ack(%s::bigint[], %s::uuid[])",
                             ([i for i, _, _ in rows], [tk for _, tk, _ in rows])).fetchone()
            ta = time.monotonic()
            if k != len(rows):
                violations.append(f"{sub}: acked {k} of {len(rows)} live events")
            with lock:
                acks[sub].extend((ta, i, s) for i, _, s in rows)
        # Tokens abandoned more than 1.5 s ago: their events were handed out
        # again (or will be), so the old token must ack nothing.
        keep = []
        for ids, toks, t0 in stale:
            if time.monotonic() - t0 > 1.5:
                (k,) = c.execute("SELECT proto.ack(%s::bigint[], %s::uuid[])", (ids, toks)).fetchone()
                if k:
                    # Legal only if nobody was handed them since; then the ack
                    # is the delivery.
                    with lock:
                        again = any(i in ids and tc > t0 for tc, i, _ in claims[sub])
                        if again:
                            violations.append(f"{sub}: a stale token acked {k} events after they were re-claimed")
                        else:
                            acks[sub].extend((time.monotonic(), i, None) for i in ids[:k])
            else:
                keep.append((ids, toks, t0))
        stale = keep
        if not rows:
            time.sleep(0.005)


pubs = [threading.Thread(target=publisher, args=(n,)) for n in range(6)]
done = threading.Event()
workers = [threading.Thread(target=worker, args=(s, n, done)) for s in SUBS for n in range(3)]
for t in pubs + workers:
    t.start()
for t in pubs:
    t.join()
# Drain: until every subscription has acked every committed event (or 60 s).
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    with lock:
        if all({i for _, i, _ in acks[s]} >= set(committed) for s in SUBS):
            break
    time.sleep(0.2)
time.sleep(0.5)
done.set()
for t in workers:
    t.join()

for s in SUBS:
    got = [i for _, i, _ in acks[s]]
    dup = len(got) - len(set(got))
    if dup:
        violations.append(f"{s}: {dup} events acked twice")
    missing = set(committed) - set(got)
    extra = set(got) - set(committed)
    if missing:
        violations.append(f"{s}: {len(missing)} committed events never acked, e.g. {sorted(missing)[:5]}")
    if extra:
        violations.append(f"{s}: {len(extra)} acked events never committed, e.g. {sorted(extra)[:5]}")
    # Per subject: ids acked in increasing order, and each claimed only after
    # the previous one of its subject was acked.
    acked_at = {i: t for t, i, _ in acks[s]}
    by_subject = defaultdict(list)
    for i, subj in committed.items():
        if subj is not None:
            by_subject[subj].append(i)
    first_claim = {}
    for t, i, _ in claims[s]:
        first_claim.setdefault(i, t)
    for subj, ids in by_subject.items():
        ids.sort()
        for p, q in zip(ids, ids[1:]):
            if p in acked_at and q in acked_at and acked_at[q] < acked_at[p]:
                violations.append(f"{s}/{subj}: {q} acked before {p}")
            if p in acked_at and q in first_claim and first_claim[q] < acked_at[p]:
                violations.append(f"{s}/{subj}: {q} claimed before {p} was acked")

print(f"seed {SEED}: {len(committed)} committed events, "
      + ", ".join(f"{s}: {len(acks[s])} acks, {len(claims[s])} handed out" for s in SUBS)
      + f", 2PC {'on' if two_pc else 'off'}")
if violations:
    print("VIOLATIONS:\n  " + "\n  ".join(violations[:20]))
    sys.exit(1)
print("ok: every committed event acked once per subscription, in subject order; stale tokens acked nothing")
