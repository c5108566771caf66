#!/usr/bin/env python3
"""Crash and fault tests for outbox_ext, against a real cluster.

  1. worker crash     SIGKILL of a client worker holding leases (and one holding an
                      open claim transaction): redelivery after the lease, attempts
                      counted, fencing of the dead worker's tokens, nothing lost. The
                      same for a worker of a named subscription (c1_sub): its 40
                      leases come back once each, only after the lease, with attempt
                      2; its tokens then ack (single and array), fail and extend
                      nothing; a claim transaction killed open leaves its events
                      claimable with attempt 1.
  2. server crash     8 publishers + 3 workers of default + 2 workers each of two
                      named subscriptions (c2_a: every topic, single acks; c2_b: a
                      topic filter, array acks); `pg_ctl stop -m immediate` at random
                      moments, 5 times; then drain and check every acknowledged
                      commit is delivered, nothing uncommitted ever appears, every
                      ack survives, subjects keep their order; and for each named
                      subscription that it received every acknowledged commit
                      (nothing lost), never an uncommitted event, never an event
                      again after a successful ack, each (event, attempt) once, and
                      subjects in order. Hand-out order is judged by intervals: a
                      claim hands out between its start (lease_expires_at - lease)
                      and its return.
  3. bgworker crash   pg_terminate_backend and kill -9 of the outbox background
                      worker: it comes back, wake-ups and maintenance resume,
                      publishers are unaffected (terminate) or recover without
                      losing a committed event (kill -9 = cluster crash-restart).
  4. faults in calls  lock_timeout / statement_timeout inside claim, ack, fail and
                      extend_lease: the error reaches the caller and the lease state
                      stays consistent.
                      Disk full is not simulated: filling the shared /tmp of a machine
                      other people use is not safe, and a loop-mounted small file
                      system needs mount privileges the test must not assume.

Every check reads the public views (outbox.events, outbox.deliveries,
outbox.subscriptions). The faults of case 4 lock the tables the calls of `default`
write (the log's lanes, batches and rows of their own); case 3c loads maintenance
with old rows of their own of `default` (delivered after a retry, of events the
log no longer holds).

The cluster is owned by the caller (crash.sh starts it with --preload); this script
crashes and restarts it. Usage:
  crash_test.py --cluster NAME --port PORT [--only 1,2,3,4] [--seed N]
Last line: `N passed, N failed`; exit status 1 on any failure.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import defaultdict

import psycopg
from psycopg import errors as pgerr

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("OUTBOX_REPO") or os.path.dirname(os.path.dirname(HERE))
PGCLUSTER = os.environ.get("OUTBOX_PGCLUSTER") or os.path.join(REPO, "scripts", "pgcluster.sh")
PG_BINDIR = os.environ.get("PG_BINDIR", "/usr/lib/postgresql/15/bin")
PG_ROOT = os.environ.get("OUTBOX_PG_ROOT", "/tmp/outbox-pg")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Cluster:
    def __init__(self, name, port):
        self.name = name
        self.port = port
        self.pgdata = os.path.join(PG_ROOT, name, "data")
        self.dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"

    def connect(self, **kw):
        kw.setdefault("autocommit", True)
        return psycopg.connect(self.dsn, connect_timeout=3, **kw)

    def postmaster_pid(self):
        try:
            with open(os.path.join(self.pgdata, "postmaster.pid")) as f:
                return int(f.readline())
        except (OSError, ValueError):
            return None

    def _as_pg(self, *cmd):
        if os.geteuid() == 0:
            cmd = ("runuser", "-u", "postgres", "--") + cmd
        return subprocess.run(cmd, cwd="/", capture_output=True, text=True)

    def stop_immediate(self):
        r = self._as_pg(f"{PG_BINDIR}/pg_ctl", "stop", "-D", self.pgdata, "-m", "immediate", "-w", "-t", "30")
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl stop -m immediate failed: {r.stdout}{r.stderr}")

    def restart(self):
        r = subprocess.run(["bash", PGCLUSTER, "restart", self.name], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"pgcluster restart failed: {r.stdout}{r.stderr}")

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while True:
            try:
                with self.connect() as c:
                    c.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)

    def one(self, sql, params=None):
        with self.connect() as c:
            return c.execute(sql, params).fetchone()

    def all(self, sql, params=None):
        with self.connect() as c:
            return c.execute(sql, params).fetchall()


def wait_until(fn, timeout, step=0.1):
    """Poll fn until it returns a truthy value; returns it, or None on timeout."""
    deadline = time.time() + timeout
    while True:
        try:
            v = fn()
        except psycopg.OperationalError:
            v = None
        if v:
            return v
        if time.time() > deadline:
            return None
        time.sleep(step)


# Lease consistency, what a half-applied claim/ack/fail would break, through the view
# (one read of it): every leased delivery names its holder, its expiry and an attempt;
# one row per event and subscription.
CONSISTENCY_SQL = """
SELECT count(*) FILTER (WHERE n = 0), count(*) FILTER (WHERE rows > 1)
  FROM (SELECT count(*) AS rows, count(*) FILTER (WHERE state = 'leased' AND leased_by IS NOT NULL
                                                  AND lease_expires_at IS NOT NULL AND attempts >= 1
                                                  OR state <> 'leased') AS n
          FROM outbox.deliveries GROUP BY event_id, subscription) d
"""
CONSISTENCY_NAMES = ["leased deliveries without leased_by/lease_expires_at/attempt",
                     "events with two rows of one subscription in outbox.deliveries"]
def consistency_problems(conn, where=""):
    r = conn.execute(CONSISTENCY_SQL).fetchone()
    return [f"{where}{n}: {v}" for n, v in zip(CONSISTENCY_NAMES, r) if v]


def default_left(conn, topic):
    """Events of topic 'default' has not delivered yet (outbox.deliveries: on the log an
    event not read yet is pending)."""
    return conn.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' AND topic = %s "
                        "AND state <> 'delivered'", (topic,)).fetchone()[0]


def no_open_claim_tx(cl):
    """No other backend sits in a transaction that ran outbox.claim (a killed client's
    is rolled back once the server notices the closed socket)."""
    return cl.one("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                  "AND state LIKE 'idle in transaction%' AND query LIKE '%outbox.claim%'")[0]


# ---------------------------------------------------------------------------
# 1. Worker crash
# ---------------------------------------------------------------------------

def child_worker(dsn, topic, lease, out, in_tx, sub=None):
    """Claims a batch (of the named subscription sub, else of default), reports it in the
    file out, then hangs until killed."""
    c = psycopg.connect(dsn, autocommit=True)
    if in_tx:
        c.execute("BEGIN")
    rows = c.execute(
        "SELECT id, attempt, lease_token::text, extract(epoch FROM lease_expires_at)::float8 "
        "FROM outbox.claim(%s, 40, %s::interval, %s::text[], %s)",
        ("doomed" if sub is None else f"doomed-{sub}", f"{lease} s", [topic] if sub is None else None, sub)).fetchall()
    with open(out, "w") as f:
        json.dump(rows, f)
        f.flush()
        os.fsync(f.fileno())
    # Hang until killed; bounded so a child orphaned by an aborted run goes away.
    time.sleep(120)


def spawn_doomed(cl, topic, lease, in_tx, sub=None):
    out = f"/tmp/outbox-crash-child-{os.getpid()}-{topic}-{sub or 'default'}.json"
    if os.path.exists(out):
        os.unlink(out)
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child-worker", cl.dsn, topic,
                          str(lease), out, "1" if in_tx else "0", sub or "-"])
    got = wait_until(lambda: os.path.exists(out) and os.path.getsize(out) > 0 and open(out).read(), 20)
    if not got:
        p.kill()
        raise RuntimeError("child worker did not claim")
    rows = json.loads(got)
    os.unlink(out)
    return p, rows


def case_worker_sigkill(cl):
    probs = []
    lease = 3
    c = cl.connect()
    c.execute("SELECT outbox.create_topic('c1.jobs', max_attempts => 5)")
    # A named subscription receives the same events (created before they are published).
    c.execute("SELECT outbox.create_subscription('c1_sub', topics => ARRAY['c1.jobs'])")
    c.execute("SELECT outbox.publish_batch('c1.jobs', array(SELECT jsonb_build_object('n', g) FROM generate_series(1, 100) g))")

    # a) a worker with committed leases dies: its events stay leased until the lease ends.
    p, rows = spawn_doomed(cl, "c1.jobs", lease, in_tx=False)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    killed_at = time.time()
    doomed = {r[0]: r for r in rows}
    if len(doomed) != 40 or any(r[1] != 1 for r in rows):
        probs.append(f"doomed worker claimed {len(doomed)} rows, attempts {sorted({r[1] for r in rows})}")
    st = dict(c.execute("SELECT state, count(*) FROM outbox.deliveries WHERE subscription = 'default' "
                        "AND leased_by = 'doomed' GROUP BY 1").fetchall())
    if st != {"leased": 40}:
        probs.append(f"after SIGKILL expected 40 leased rows of the dead worker, got {st}")

    # The survivor drains; nothing of the dead worker's may come back before its lease ends.
    seen = defaultdict(list)  # id -> [(attempt, claimed_at_epoch)]
    acked = set()
    deadline = time.time() + 30
    while len(acked) < 100 and time.time() < deadline:
        got = c.execute(
            "SELECT id, attempt, lease_token, extract(epoch FROM lease_expires_at)::float8 - 10 "
            "FROM outbox.claim('survivor', 30, '10 s', ARRAY['c1.jobs'])").fetchall()
        for i, att, tok, at in got:
            seen[i].append((att, at))
            if c.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0]:
                acked.add(i)
            else:
                probs.append(f"ack of event {i} by the survivor returned false")
        if not got:
            time.sleep(0.1)
    for i, (_, att, _, exp) in doomed.items():
        claims = seen.get(i, [])
        if [a for a, _ in claims] != [2]:
            probs.append(f"event {i} of the dead worker: survivor claims attempts {claims}, expected [2]")
        elif claims[0][1] < exp - 0.05:
            probs.append(f"event {i} redelivered {exp - claims[0][1]:.2f}s before its lease ended")
    others = [i for i in seen if i not in doomed]
    if any([a for a, _ in seen[i]] != [1] for i in others):
        probs.append("events the dead worker never held were not claimed exactly once with attempt 1")
    # Fencing: the dead worker's tokens are stale now.
    stale = sum(c.execute("SELECT outbox.ack(%s, %s::uuid)", (r[0], r[2])).fetchone()[0] for r in rows)
    if stale:
        probs.append(f"{stale} acks with the dead worker's tokens succeeded after redelivery")
    res = dict(c.execute("SELECT attempts, count(*) FROM outbox.events WHERE topic = 'c1.jobs' AND state = 'delivered' "
                         "GROUP BY 1").fetchall())
    if res != {1: 60, 2: 40}:
        probs.append(f"delivered attempts histogram {res}, expected {{1: 60, 2: 40}}")
    log(f"  1a: 40 leases of a SIGKILLed worker redelivered after "
        f"{min(a for i in doomed for _, a in seen.get(i, [(0, killed_at)])) - killed_at:+.2f}s, 100/100 delivered")

    # a') the same for a worker of the named subscription c1_sub.
    probs += named_worker_sigkill(cl, c, lease)

    # b) a worker killed inside its claim transaction: the claim never happened.
    c.execute("SELECT outbox.publish_batch('c1.jobs', array(SELECT jsonb_build_object('m', g) FROM generate_series(1, 20) g))")
    p, rows = spawn_doomed(cl, "c1.jobs", 30, in_tx=True)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    # The server notices the closed socket at once; the claim rolls back.
    ok = wait_until(lambda: no_open_claim_tx(cl) and cl.one(
        "SELECT count(*) = 0 FROM outbox.deliveries WHERE subscription = 'default' AND state = 'leased'")[0], 10)
    if not ok:
        probs.append("events of a worker killed inside its claim transaction are still leased")
    got = c.execute("SELECT id, attempt, lease_token FROM outbox.claim('survivor', 100, '10 s', ARRAY['c1.jobs'])").fetchall()
    if len(got) != 20 or any(a != 1 for _, a, _ in got):
        probs.append(f"after an uncommitted claim died: {len(got)} claimable, attempts {sorted({a for _, a, _ in got})}")
    c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([g[0] for g in got], [g[2] for g in got]))
    with cl.connect() as c2:
        n = default_left(c2, "c1.jobs")
    if n:
        probs.append(f"{n} c1.jobs events left undelivered in default")

    # b') a worker of c1_sub killed inside its claim transaction (c1_sub has these 20 too).
    p, rows = spawn_doomed(cl, "c1.jobs", 30, in_tx=True, sub="c1_sub")
    if len(rows) != 20:
        probs.append(f"c1_sub: the doomed claim transaction got {len(rows)} of the 20 new events")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    # The server notices the closed socket at once; the claim rolls back.
    ok = wait_until(lambda: cl.one("SELECT count(*) = 0 FROM pg_stat_activity WHERE query LIKE '%doomed-c1_sub%' "
                                   "AND pid <> pg_backend_pid()")[0], 10)
    if not ok:
        probs.append("c1_sub: the backend of a worker killed inside its claim transaction is still there")
    got = c.execute("SELECT id, attempt, lease_token FROM outbox.claim('survivor', 100, '10 s', NULL, "
                    "'c1_sub')").fetchall()
    if sorted(g[0] for g in got) != sorted(r[0] for r in rows) or any(a != 1 for _, a, _ in got):
        probs.append(f"c1_sub: after an uncommitted claim died: {len(got)} claimable (the dead claim had "
                     f"{len(rows)}), attempts {sorted({a for _, a, _ in got})}")
    n = c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([g[0] for g in got], [g[2] for g in got])).fetchone()[0]
    if n != len(got):
        probs.append(f"c1_sub: {n} of {len(got)} acked")
    left = named_left(cl, "c1_sub")
    if left:
        probs.append(f"c1_sub: {left} events left (lag, leases, dead letters, undelivered rows)")
    log(f"  1b': a c1_sub worker killed inside its claim transaction: its {len(rows)} events claimable again "
        f"with attempt 1")
    probs += consistency_problems(c, "1: ")
    c.execute("SELECT outbox.drop_subscription('c1_sub')")
    c.close()
    return probs, {"worker_kills": 4}


def named_worker_sigkill(cl, c, lease):
    """A worker of the named subscription c1_sub is SIGKILLed holding 40 leases: nothing
    of its comes back before its lease ends, each comes back once with attempt 2, the
    rest go out once with attempt 1, and its tokens ack, fail and extend nothing
    after the redelivery."""
    probs = []
    p, rows = spawn_doomed(cl, "c1.jobs", lease, in_tx=False, sub="c1_sub")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    killed_at = time.time()
    doomed = {r[0]: r for r in rows}
    if len(doomed) != 40 or any(r[1] != 1 for r in rows):
        probs.append(f"c1_sub: doomed worker claimed {len(doomed)} rows, attempts {sorted({r[1] for r in rows})}")
    inflight = cl.one("SELECT leases_in_flight FROM outbox.subscriptions WHERE name = 'c1_sub'")[0]
    if inflight != len(doomed):
        probs.append(f"c1_sub: after SIGKILL expected {len(doomed)} leases in flight, got {inflight}")
    seen = defaultdict(list)  # id -> [(attempt, claimed_at_epoch)]
    acked = set()
    deadline = time.time() + 30
    while len(acked) < 100 and time.time() < deadline:
        got = c.execute(
            "SELECT id, attempt, lease_token, extract(epoch FROM lease_expires_at)::float8 - 10 "
            "FROM outbox.claim('survivor', 30, '10 s', NULL, 'c1_sub')").fetchall()
        for i, att, tok, at in got:
            seen[i].append((att, at))
            if c.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0]:
                acked.add(i)
            else:
                probs.append(f"c1_sub: ack of event {i} by the survivor returned false")
        if not got:
            time.sleep(0.1)
    for i, (_, att, _, exp) in doomed.items():
        claims = seen.get(i, [])
        if [a for a, _ in claims] != [2]:
            probs.append(f"c1_sub: event {i} of the dead worker: survivor claims attempts {claims}, expected [2]")
        elif claims[0][1] < exp - 0.05:
            probs.append(f"c1_sub: event {i} redelivered {exp - claims[0][1]:.2f}s before its lease ended")
    others = [i for i in seen if i not in doomed]
    if len(others) != 60 or any([a for a, _ in seen[i]] != [1] for i in others):
        probs.append(f"c1_sub: the {len(others)} events the dead worker never held (60 expected) were not "
                     f"claimed exactly once with attempt 1")
    # Fencing: the dead worker's tokens hold nothing now.
    stale_acks = sum(c.execute("SELECT outbox.ack(%s, %s::uuid)", (r[0], r[2])).fetchone()[0] for r in rows)
    stale_arr = c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                          ([r[0] for r in rows], [r[2] for r in rows])).fetchone()[0]
    fails = {c.execute("SELECT outbox.fail(%s, %s::uuid, 'late')", (r[0], r[2])).fetchone()[0] for r in rows[:5]}
    ext = [c.execute("SELECT outbox.extend_lease(%s, %s::uuid, '1 min')", (r[0], r[2])).fetchone()[0] for r in rows[:5]]
    if stale_acks or stale_arr:
        probs.append(f"c1_sub: {stale_acks} single and {stale_arr} array acks with the dead worker's tokens "
                     f"succeeded after redelivery")
    if fails != {"stale"} or any(e is not None for e in ext):
        probs.append(f"c1_sub: fail/extend_lease with the dead worker's tokens returned {fails} / {ext}")
    left = named_left(cl, "c1_sub")
    if len(acked) != 100 or left:
        probs.append(f"c1_sub: {len(acked)}/100 acked, {left} left (lag, leases, dead letters, undelivered rows)")
    first = min((a for i in doomed for _, a in seen.get(i, [])), default=killed_at)
    log(f"  1a': c1_sub: 40 leases of a SIGKILLed worker redelivered after {first - killed_at:+.2f}s with attempt 2, "
        f"its tokens stale; {len(acked)}/100 delivered")
    return probs


# ---------------------------------------------------------------------------
# 2. Server crash during load
# ---------------------------------------------------------------------------

class CrashLoad:
    """Publishers and workers that survive connection loss and record outcomes; workers
    of the default subscription and of each named subscription in SUBS."""

    TOPIC = "c2.load"
    # Named subscriptions: c2_a takes every topic and acks one by one; c2_b filters on
    # the topic and acks with ack(ids[], tokens[]). max_attempts is high enough that no
    # event goes dead over the crashes.
    SUBS = {"c2_a": dict(topics=None, array=False), "c2_b": dict(topics=["c2.load"], array=True)}

    def __init__(self, cl, seed, npub=8, nwork=3, lease=2, nsub_work=2):
        self.cl = cl
        self.seed = seed
        self.npub, self.nwork, self.lease, self.nsub_work = npub, nwork, lease, nsub_work
        self.lock = threading.Lock()
        self.must = {}      # (tx, j) -> id      COMMIT returned
        self.never = {}     # (tx, j) -> id      rolled back, or the tx died before COMMIT
        self.unknown = {}   # (tx, j) -> id      COMMIT raised: outcome unknown
        self.acked = {}     # id -> (attempt, (tx, j))
        # (id, attempt, claim start (lease_expires_at - lease), (tx, j), subject, seq, claim end (client clock))
        self.claims = []
        self.conn_errors = 0
        # per named subscription
        self.sclaims = {s: [] for s in self.SUBS}        # as claims, and the token
        self.sacked = {s: {} for s in self.SUBS}         # id -> (attempt, (tx, j)): ack returned true
        self.sack_unknown = {s: set() for s in self.SUBS}  # ids whose ack raised (outcome unknown)
        self.stop_pub = threading.Event()
        self.stop_work = threading.Event()
        self.threads = []

    def _connect(self):
        return self.cl.connect()

    def publisher(self, i):
        rnd = random.Random(self.seed * 1000 + i)
        conn = None
        seqs = defaultdict(int)
        n = 0
        while not self.stop_pub.is_set():
            ids = []
            phase = "connect"
            try:
                if conn is None:
                    conn = self._connect()
                tx = f"p{i}-{n}"
                n += 1
                phase = "tx"
                conn.execute("BEGIN")
                for j in range(rnd.randint(1, 3)):
                    subj = f"s{i}-{rnd.randrange(3)}" if rnd.random() < 0.5 else None
                    seq = None
                    if subj:
                        seqs[subj] += 1
                        seq = seqs[subj]
                    payload = json.dumps({"tx": tx, "j": j, "subj": subj, "seq": seq})
                    eid = conn.execute("SELECT outbox.publish(%s, %s::jsonb, %s)", (self.TOPIC, payload, subj)).fetchone()[0]
                    ids.append(((tx, j), eid))
                if rnd.random() < 0.1:
                    phase = "rollback"
                    conn.execute("ROLLBACK")
                    with self.lock:
                        self.never.update(ids)
                else:
                    phase = "commit"
                    conn.execute("COMMIT")
                    with self.lock:
                        self.must.update(ids)
            except psycopg.Error:
                with self.lock:
                    self.conn_errors += 1
                    # Before COMMIT was sent the transaction cannot have committed.
                    (self.unknown if phase == "commit" else self.never).update(ids)
                try:
                    if conn is not None:
                        conn.close()
                except Exception:
                    pass
                conn = None
                time.sleep(rnd.uniform(0.05, 0.3))
                continue
            time.sleep(rnd.uniform(0.005, 0.04))
        if conn is not None:
            conn.close()

    def worker(self, w):
        rnd = random.Random(self.seed * 1000 + 100 + w)
        conn = None
        while not self.stop_work.is_set():
            try:
                if conn is None:
                    conn = self._connect()
                rows = conn.execute(
                    "SELECT id, attempt, lease_token, extract(epoch FROM lease_expires_at)::float8 - %s, payload "
                    "FROM outbox.claim(%s, %s, %s::interval, ARRAY[%s])",
                    (self.lease, f"w{w}", rnd.randint(1, 10), f"{self.lease} s", self.TOPIC)).fetchall()
                end = time.time()
                with self.lock:
                    for i, att, _, at, p in rows:
                        self.claims.append((i, att, at, (p["tx"], p["j"]), p["subj"], p["seq"], end))
                if not rows:
                    time.sleep(0.05)
                    continue
                for i, att, tok, _, p in rows:
                    if conn.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0]:
                        with self.lock:
                            self.acked[i] = (att, (p["tx"], p["j"]))
            except psycopg.Error:
                with self.lock:
                    self.conn_errors += 1
                try:
                    if conn is not None:
                        conn.close()
                except Exception:
                    pass
                conn = None
                time.sleep(rnd.uniform(0.05, 0.3))
        if conn is not None:
            conn.close()

    def sub_worker(self, sub, w):
        """A worker of a named subscription: claim, then ack (one by one, or one array
        ack); an ack that raises leaves its events' outcome unknown."""
        rnd = random.Random(self.seed * 1000 + 200 + 10 * list(self.SUBS).index(sub) + w)
        conn = None
        array = self.SUBS[sub]["array"]
        while not self.stop_work.is_set():
            pending = []
            try:
                if conn is None:
                    conn = self._connect()
                rows = conn.execute(
                    "SELECT id, attempt, lease_token, extract(epoch FROM lease_expires_at)::float8 - %s, payload "
                    "FROM outbox.claim(%s, %s, %s::interval, NULL, %s)",
                    (self.lease, f"{sub}-w{w}", rnd.randint(1, 10), f"{self.lease} s", sub)).fetchall()
                end = time.time()
                with self.lock:
                    for i, att, tok, at, p in rows:
                        self.sclaims[sub].append((i, att, at, (p["tx"], p["j"]), p["subj"], p["seq"], end, str(tok)))
                if not rows:
                    time.sleep(0.05)
                    continue
                if array:
                    pending = [r[0] for r in rows]
                    n = conn.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                                     ([r[0] for r in rows], [r[2] for r in rows])).fetchone()[0]
                    with self.lock:
                        if n == len(rows):
                            for i, att, _, _, p in rows:
                                self.sacked[sub][i] = (att, (p["tx"], p["j"]))
                        elif n:
                            # some of them: which ones is not known
                            self.sack_unknown[sub].update(r[0] for r in rows)
                    pending = []
                else:
                    for i, att, tok, _, p in rows:
                        pending = [i]
                        if conn.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0]:
                            with self.lock:
                                self.sacked[sub][i] = (att, (p["tx"], p["j"]))
                        pending = []
            except psycopg.Error:
                with self.lock:
                    self.conn_errors += 1
                    self.sack_unknown[sub].update(pending)
                try:
                    if conn is not None:
                        conn.close()
                except Exception:
                    pass
                conn = None
                time.sleep(rnd.uniform(0.05, 0.3))
        if conn is not None:
            conn.close()

    def start(self):
        for i in range(self.npub):
            self.threads.append(threading.Thread(target=self.publisher, args=(i,), daemon=True))
        for w in range(self.nwork):
            self.threads.append(threading.Thread(target=self.worker, args=(w,), daemon=True))
        for sub in self.SUBS:
            for w in range(self.nsub_work):
                self.threads.append(threading.Thread(target=self.sub_worker, args=(sub, w), daemon=True))
        for t in self.threads:
            t.start()

    def join(self):
        for t in self.threads:
            t.join(30)


def check_subject_order(claims):
    """claims: (id, attempt, claim start, (tx, j), subject, seq, claim end). Per subject,
    every hand-out of seq k comes before every hand-out of seq k+1 (k is redelivered
    only until it is acked, and k+1 goes out only after that ack). A claim hands an
    event out somewhere between its start (lease_expires_at - lease: the clock when
    the call began) and its end (when it returned, same host clock), so the order is
    broken for certain when a claim returning seq k started after a claim returning a
    later seq had already returned."""
    bad = []
    by = defaultdict(list)
    for i, att, start, _, subj, seq, end in claims:
        if subj:
            by[subj].append((seq, start, end, i, att))
    for subj, lst in by.items():
        lst.sort()
        # the earliest-returning hand-out of any later seq, scanning seqs downwards
        first_end = None
        k = len(lst) - 1
        found = None
        while k >= 0 and found is None:
            seq = lst[k][0]
            group = []
            while k >= 0 and lst[k][0] == seq:
                group.append(lst[k])
                k -= 1
            if first_end is not None:
                late = max(group, key=lambda h: h[1])
                if late[1] > first_end[2]:
                    found = (late, first_end)
            e = min(group, key=lambda h: h[2])
            if first_end is None or e[2] < first_end[2]:
                first_end = e
        if found:
            (seq, start, _, i, att), (seq2, start2, end2, i2, att2) = found
            bad.append(f"subject {subj}: seq {seq} (event {i} attempt {att}) was handed out by a claim that began at "
                       f"{start:.6f}, after a claim that handed out seq {seq2} (event {i2} attempt {att2}, began "
                       f"{start2:.6f}) had returned at {end2:.6f}")
    return bad


NAMED_LEFT_SQL = ("SELECT coalesce(lag_events, 0) + coalesce(leases_in_flight, 0) + coalesce(dead_letters, 0) + "
                  "(SELECT count(*) FROM outbox.deliveries d WHERE d.subscription = s.name "
                  "AND d.state <> 'delivered') FROM outbox.subscriptions s WHERE s.name = %s")


def named_left(cl, sub):
    """What a named subscription still has to deliver: lag, leases, dead letters and
    undelivered per-event rows (0 = everything delivered)."""
    return cl.one(NAMED_LEFT_SQL, (sub,))[0]


def case_server_crash(cl, seed, cycles=5):
    probs = []
    rnd = random.Random(seed)
    with cl.connect() as c:
        c.execute("SELECT outbox.create_topic('c2.load', max_attempts => 100)")
        # Before any publisher starts: every c2.load event is theirs.
        for sub, a in CrashLoad.SUBS.items():
            c.execute("SELECT outbox.create_subscription(%s, topics => %s, max_attempts => 100)", (sub, a["topics"]))
    load = CrashLoad(cl, seed)
    load.start()
    crashes = 0
    for cyc in range(cycles):
        time.sleep(rnd.uniform(2.0, 4.5))
        with load.lock:
            before = (len(load.must), len(load.acked))
        cl.stop_immediate()
        crashes += 1
        t0 = time.time()
        time.sleep(rnd.uniform(0.2, 0.8))
        cl.restart()
        cl.wait_ready()
        # Everything acked so far must already be delivered after recovery.
        with load.lock:
            acked_now = dict(load.acked)
        rows = dict(cl.all("SELECT id, state FROM outbox.events WHERE id = ANY(%s)", (list(acked_now),)))
        lost = [i for i in acked_now if rows.get(i) != "delivered"]
        if lost:
            probs.append(f"cycle {cyc + 1}: {len(lost)} acked events not delivered after recovery, e.g. {lost[:5]}")
        log(f"  2: crash {cyc + 1}: {before[0]} committed / {before[1]} acked so far, "
            f"down and recovered in {time.time() - t0:.1f}s")
    time.sleep(1.5)
    load.stop_pub.set()
    drained = wait_until(lambda: cl.one(
        "SELECT count(*) = 0 FROM outbox.deliveries WHERE subscription = 'default' AND topic = 'c2.load' "
        "AND state <> 'delivered'")[0], 60, step=0.3)
    t_named = time.time()
    named_drained = wait_until(lambda: all(named_left(cl, sub) == 0 for sub in load.SUBS), 60, step=0.5)
    load.stop_work.set()
    load.join()
    if not drained:
        left = cl.all("SELECT state, count(*) FROM outbox.deliveries WHERE subscription = 'default' "
                      "AND topic = 'c2.load' AND state <> 'delivered' GROUP BY 1")
        probs.append(f"default did not drain within 60 s: {left}")
    if not named_drained:
        left = {sub: cl.one("SELECT lag_events, leases_in_flight, dead_letters FROM outbox.subscriptions "
                            "WHERE name = %s", (sub,)) for sub in load.SUBS}
        probs.append(f"named subscriptions did not drain within 60 s: (lag, leases, dead letters) {left}")

    rows = cl.all("SELECT id, state, attempts, payload->>'tx', (payload->>'j')::int FROM outbox.events "
                  "WHERE topic = 'c2.load'")
    by_tok = {(tx, j): (i, st, att) for i, st, att, tx, j in rows}
    by_id = {i: (st, (tx, j)) for i, st, att, tx, j in rows}
    missing = [t for t in load.must if t not in by_tok or by_tok[t][1] != "delivered"]
    if missing:
        probs.append(f"{len(missing)} acknowledged commits not delivered, e.g. {missing[:5]}")
    ghosts = [t for t in load.never if t in by_tok]
    if ghosts:
        probs.append(f"{len(ghosts)} events of uncommitted transactions exist, e.g. {ghosts[:5]}")
    reused = [i for t, i in load.never.items() if i in by_id and by_id[i][1] != t]
    strays = [t for t in by_tok if t not in load.must and t not in load.unknown and t not in load.never]
    if strays:
        probs.append(f"{len(strays)} events nobody published, e.g. {strays[:5]}")
    claimed_ghosts = {c[3] for c in load.claims if c[3] in load.never}
    if claimed_ghosts:
        probs.append(f"{len(claimed_ghosts)} uncommitted events were claimed, e.g. {list(claimed_ghosts)[:5]}")
    unacked = [i for i, (att, t) in load.acked.items() if by_id.get(i, (None, None)) != ("delivered", t)]
    if unacked:
        probs.append(f"{len(unacked)} events a worker saw ack()=true for are not delivered, e.g. {unacked[:5]}")
    late = [(i, att) for i, att, *_ in load.claims if i in load.acked and att > load.acked[i][0]]
    if late:
        probs.append(f"{len(late)} claims after a successful ack, e.g. {late[:5]}")
    seen = defaultdict(set)
    dup = []
    for i, att, *_ in load.claims:
        if att in seen[i]:
            dup.append((i, att))
        seen[i].add(att)
    if dup:
        probs.append(f"{len(dup)} (id, attempt) pairs claimed twice, e.g. {dup[:5]}")
    short = [i for i, s in seen.items() if i in by_id and max(s) > by_tok[by_id[i][1]][2]]
    if short:
        probs.append(f"{len(short)} events whose attempts column is below a claimed attempt")
    probs += check_subject_order(load.claims)
    with cl.connect() as c:
        probs += consistency_problems(c, "2: ")
    named_figs = []
    for sub in load.SUBS:
        p, fig = check_named_after_crashes(load, sub, by_tok, by_id)
        probs += p
        named_figs.append(fig)
    unknown_in = sum(1 for t in load.unknown if t in by_tok)
    log(f"  2: {crashes} crashes; {len(load.must)} committed (all checked), {len(load.never)} rolled back/aborted, "
        f"{len(load.unknown)} unknown ({unknown_in} of them committed), {len(load.acked)} acks, "
        f"{len(load.claims)} claims, {load.conn_errors} connection errors survived"
        + (f"; {len(reused)} ids of aborted transactions reused after a crash (sequence not flushed: allowed)"
           if reused else ""))
    log(f"  2: named subscriptions (drained {time.time() - t_named:.1f}s after default): "
        + "; ".join(named_figs))
    return probs, {"server_crashes": crashes, "events_checked": len(load.must) + len(load.never) + len(load.unknown)}


def check_named_after_crashes(load, sub, by_tok, by_id):
    """After the crashes and the final drain, the named subscription `sub` received every
    committed event (each acked by one of its workers, or in an ack whose outcome the
    crash hid), never an uncommitted or unknown one, never an event again after its ack
    succeeded, each (event, attempt) once, subjects in publish order."""
    probs = []
    claims = load.sclaims[sub]
    acked, unk = load.sacked[sub], load.sack_unknown[sub]
    lost = [t for t, i in load.must.items() if i not in acked and i not in unk]
    if lost:
        probs.append(f"{sub}: {len(lost)} acknowledged commits never acked by its workers (lost), e.g. {lost[:5]}")
    ghosts = {c[3] for c in claims if c[3] in load.never}
    if ghosts:
        probs.append(f"{sub}: {len(ghosts)} uncommitted events were claimed, e.g. {list(ghosts)[:5]}")
    strays = {c[3] for c in claims if c[3] not in load.must and c[3] not in load.unknown and c[3] not in load.never}
    if strays:
        probs.append(f"{sub}: {len(strays)} events nobody published were claimed, e.g. {list(strays)[:5]}")
    wrong = [(i, att, t) for i, (att, t) in acked.items() if by_id.get(i, (None, None))[1] != t]
    if wrong:
        probs.append(f"{sub}: {len(wrong)} acks of ids that are other events, e.g. {wrong[:5]}")
    late = [(c[0], c[1]) for c in claims if c[0] in acked and c[1] > acked[c[0]][0]]
    if late:
        probs.append(f"{sub}: {len(late)} claims after a successful ack (an ack lost in a crash?), e.g. {late[:5]}")
    seen = defaultdict(set)
    dup = []
    for c in claims:
        if c[1] in seen[c[0]]:
            dup.append((c[0], c[1]))
        seen[c[0]].add(c[1])
    if dup:
        probs.append(f"{sub}: {len(dup)} (id, attempt) pairs claimed twice, e.g. {dup[:5]}")
    probs += [f"{sub}: {p}" for p in check_subject_order([c[:7] for c in claims])]
    redelivered = sum(1 for s in seen.values() if len(s) > 1)
    fig = (f"{sub}: {len(load.must) - len(lost)}/{len(load.must)} committed received ({len(acked)} acks, "
           f"{len(unk)} of unknown outcome), {len(claims)} claims, {redelivered} events redelivered")
    return probs, fig


# ---------------------------------------------------------------------------
# 3. Background worker crash
# ---------------------------------------------------------------------------

class SteadyPublisher:
    """Publishes one event every ~20 ms in autocommit; records commits and errors."""

    def __init__(self, cl, topic):
        self.cl, self.topic = cl, topic
        self.committed = []
        self.errors = []   # timestamps
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        conn = None
        n = 0
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = self.cl.connect()
                n += 1
                i = conn.execute("SELECT outbox.publish(%s, %s::jsonb)", (self.topic, json.dumps({"n": n}))).fetchone()[0]
                self.committed.append((i, time.time()))
            except psycopg.Error:
                self.errors.append(time.time())
                try:
                    if conn is not None:
                        conn.close()
                except Exception:
                    pass
                conn = None
                time.sleep(0.1)
                continue
            time.sleep(0.02)
        if conn is not None:
            conn.close()


def listen_conn(cl):
    c = cl.connect()
    c.execute("LISTEN outbox")
    c.seen = set()   # every payload received so far: waiting for one must not lose another
    return c


def got_notify(conn, topic, timeout):
    deadline = time.time() + timeout
    while topic not in conn.seen and time.time() < deadline:
        for n in conn.notifies(timeout=max(0.05, deadline - time.time())):
            conn.seen.add(n.payload)
            if n.payload == topic:
                break
    return topic in conn.seen


def worker_pid(cl):
    r = cl.one("SELECT worker_pid FROM outbox.wakeup_status()")
    return r[0] if r else 0


def maint_runs(cl, since=None):
    if since is None:
        return cl.one("SELECT count(*) FROM outbox.maintenance_log")[0]
    return cl.one("SELECT count(*) FROM outbox.maintenance_log WHERE started_at > to_timestamp(%s)", (since,))[0]


def check_worker_back(cl, old_pid, since, ping_topic, listener, what):
    probs = []
    new = wait_until(lambda: (lambda p: p if p not in (0, old_pid) else None)(worker_pid(cl)), 15)
    if not new:
        return [f"{what}: no new background worker within 15 s (old pid {old_pid})"], None
    bt = cl.one("SELECT backend_type FROM pg_stat_activity WHERE pid = %s", (new,))
    if not bt or bt[0] != "outbox_ext worker":
        probs.append(f"{what}: pid {new} from wakeup_status is not an outbox_ext process ({bt})")
    if not wait_until(lambda: maint_runs(cl, since) >= 2, 15, step=0.25):
        probs.append(f"{what}: maintenance did not run twice within 15 s after the restart")
    with cl.connect() as c:
        c.execute("SELECT outbox.publish(%s, '{}')", (ping_topic,))
    if not got_notify(listener, ping_topic, 10):
        probs.append(f"{what}: LISTEN connection got no wake-up for {ping_topic} within 10 s")
    return probs, new


def bg_setup(cl, probs):
    with cl.connect() as c:
        c.execute("ALTER SYSTEM SET outbox.maintenance_interval = '1s'")
        c.execute("SELECT pg_reload_conf()")
    t = time.time()
    if not wait_until(lambda: maint_runs(cl, t) >= 1, 15, step=0.25):
        probs.append("maintenance did not run within 15 s of outbox.maintenance_interval = 1s")


def bg_finish(cl, pub, probs, what):
    """Stop the publisher; every event it saw commit must exist and be deliverable."""
    pub.stop.set()
    pub.t.join(10)
    ids = [i for i, _ in pub.committed]
    with cl.connect() as c:
        present = c.execute("SELECT count(*) FROM outbox.events WHERE id = ANY(%s) AND topic = %s",
                            (ids, pub.topic)).fetchone()[0]
        if present != len(ids):
            probs.append(f"{what}: {len(ids) - present} of {len(ids)} committed events lost")
        while True:
            got = c.execute("SELECT id, lease_token FROM outbox.claim('c3', 1000, '30 s', ARRAY['c3.*'])").fetchall()
            if not got:
                break
            c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([g[0] for g in got], [g[1] for g in got]))
        delivered = c.execute("SELECT count(*) FROM outbox.events WHERE id = ANY(%s) AND state = 'delivered'",
                              (ids,)).fetchone()[0]
        if delivered != len(ids):
            probs.append(f"{what}: only {delivered} of {len(ids)} committed events delivered")
        probs += consistency_problems(c, f"{what}: ")
        c.execute("ALTER SYSTEM RESET outbox.maintenance_interval")
        c.execute("SELECT pg_reload_conf()")
    return len(ids)


def case_bgworker_terminate(cl):
    probs = []
    bg_setup(cl, probs)
    pid0 = worker_pid(cl)
    if not pid0:
        return probs + ["no background worker running (is the cluster preloaded?)"], {}
    pub = SteadyPublisher(cl, "c3.steady")
    lst = listen_conn(cl)
    time.sleep(0.5)
    t = time.time()
    if not cl.one("SELECT pg_terminate_backend(worker_pid) FROM outbox.wakeup_status()")[0]:
        probs.append("pg_terminate_backend(worker_pid) returned false")
    # Published while no worker runs: the new worker's first sweep must still wake us.
    with cl.connect() as c:
        c.execute("SELECT outbox.publish('c3.gap', '{}')")
    p, pid1 = check_worker_back(cl, pid0, t, "c3.ping1", lst, "terminate")
    probs += p
    if not got_notify(lst, "c3.gap", 5):
        probs.append("terminate: event published while the worker was down never produced a wake-up")
    lst.close()
    if pub.errors:
        probs.append(f"terminate: the publisher saw {len(pub.errors)} errors")
    n = bg_finish(cl, pub, probs, "terminate")
    log(f"  3a: worker {pid0} terminated, new worker {pid1}; publisher: {n} events committed and delivered, "
        f"{len(pub.errors)} errors")
    return probs, {"bgworker_kills": 1, "events_checked": n}


def case_bgworker_kill9(cl):
    probs = []
    if not worker_pid(cl):
        # Left without a worker (e.g. case 3a failed): a clean restart brings it back.
        log("  3b: no background worker running; restarting the cluster first")
        cl.restart()
        cl.wait_ready()
        wait_until(lambda: worker_pid(cl), 15)
    bg_setup(cl, probs)
    victim = worker_pid(cl)
    bt = cl.one("SELECT backend_type FROM pg_stat_activity WHERE pid = %s", (victim,)) if victim > 0 else None
    if not bt or bt[0] != "outbox_ext worker":
        # Never signal a pid we are not sure is the worker (0 would be our own group).
        return probs + [f"kill -9: no background worker to kill (pid {victim})"], {}
    pub = SteadyPublisher(cl, "c3.steady9")
    time.sleep(1.0)
    pm = cl.postmaster_pid()
    before = len(pub.committed)
    t = time.time()
    # PostgreSQL treats a SIGKILLed child as a crash and reinitialises the whole cluster.
    os.kill(victim, signal.SIGKILL)
    time.sleep(1.0)
    cl.wait_ready()
    lst = listen_conn(cl)
    p, pid2 = check_worker_back(cl, victim, t, "c3.ping2", lst, "kill -9")
    probs += p
    lst.close()
    if cl.postmaster_pid() != pm:
        probs.append("kill -9: postmaster pid changed (expected an in-place crash restart)")
    n_after = len(pub.committed)
    if not wait_until(lambda: len(pub.committed) > n_after + 20, 15):
        probs.append("kill -9: the publisher did not resume publishing")
    n = bg_finish(cl, pub, probs, "kill -9")
    log(f"  3b: worker {victim} killed -9, cluster crash-restarted, new worker {pid2}; "
        f"{n} committed events ({before} before the kill) all present and delivered; "
        f"publisher reconnected after {len(pub.errors)} errors")
    return probs, {"bgworker_kills": 1, "events_checked": n}


def case_bgworker_sigterm_in_maintenance(cl):
    """A SIGTERM (pg_terminate_backend, or any shutdown) that lands while the worker
    runs a long retention pass must still stop it."""
    probs = []
    with cl.connect() as c:
        # Old delivered rows of their own, of events the log no longer holds (ids
        # below every id it holds): one maintenance pass then takes several seconds.
        c.execute("INSERT INTO outbox.log_exceptions (subscription, id, lane, topic, payload, max_attempts, "
                  "published_at, state, attempts, visible_at, delivered_at) SELECT 'default', -g, 0, 'c3.old', '{}', 10, "
                  "now() - interval '9 days', 'delivered', 2, now() - interval '9 days', now() - interval '8 days' "
                  "FROM generate_series(1, 150000) g")
    if not wait_until(lambda: worker_pid(cl), 15):
        return probs + ["no background worker running"], {}
    bg_setup_only = cl.connect()
    bg_setup_only.execute("ALTER SYSTEM SET outbox.maintenance_interval = '1s'")
    bg_setup_only.execute("SELECT pg_reload_conf()")
    bg_setup_only.close()
    running = wait_until(lambda: cl.one("SELECT count(*) < 149000 FROM outbox.log_exceptions WHERE topic = 'c3.old'")[0],
                         20, step=0.05)
    pid = worker_pid(cl)
    left = cl.one("SELECT count(*) FROM outbox.log_exceptions WHERE topic = 'c3.old'")[0]
    if not running or left == 0:
        probs.append(f"could not catch the worker inside a maintenance pass ({left} rows left)")
    cl.one("SELECT pg_terminate_backend(%s)", (pid,))
    gone = wait_until(lambda: not cl.one("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))[0], 10)
    if not gone:
        probs.append(f"worker {pid} still running 10 s after pg_terminate_backend during maintenance "
                     f"(SIGTERM swallowed: a fast shutdown would hang the same way)")
        # It would block a fast shutdown forever: get rid of it.
        cl.stop_immediate()
        cl.restart()
        cl.wait_ready()
    with cl.connect() as c:
        c.execute("ALTER SYSTEM RESET outbox.maintenance_interval")
        c.execute("SELECT pg_reload_conf()")
        c.execute("DELETE FROM outbox.log_exceptions WHERE topic = 'c3.old'")
    log(f"  3c: worker {pid} terminated during maintenance ({left} of 150000 old rows left): "
        f"{'exited' if gone else 'ignored it'}")
    return probs, {"bgworker_kills": 1}


# ---------------------------------------------------------------------------
# 4. Timeouts inside claim/ack
# ---------------------------------------------------------------------------

def expect_sqlstate(conn, sql, params, want, what, probs):
    try:
        conn.execute(sql, params)
    except psycopg.Error as e:
        if e.sqlstate != want:
            probs.append(f"{what}: expected SQLSTATE {want}, got {e.sqlstate} ({e})")
        return True
    probs.append(f"{what}: expected SQLSTATE {want}, the call succeeded")
    return False


def lease_snapshot(conn, ids):
    """Each event's lease in 'default' (outbox.deliveries)."""
    snap = dict((i, (st, att, by, str(exp))) for i, st, att, by, exp in conn.execute(
        "SELECT event_id, state, attempts, leased_by, lease_expires_at FROM outbox.deliveries "
        "WHERE subscription = 'default' AND event_id = ANY(%s)", (ids,)).fetchall())
    return snap


# The tables the calls of 'default' write, for the faults of case 4: the log's lanes
# (claims), batches (claims, acks, fails, extends of batch events) and rows of their
# own (fails).
def written_tables():
    return "outbox.log_lanes, outbox.log_batches, outbox.log_exceptions"


def lock_held_rows(conn, hid):
    """Row locks under which ack/fail/extend of hid[0] must wait."""
    # the batches of 'default' (the held events are out in them)
    conn.execute("SELECT 1 FROM outbox.log_batches WHERE subscription = 'default' FOR UPDATE")


def case_timeouts(cl):
    probs = []
    a = cl.connect()
    b = cl.connect()
    a.execute("SELECT outbox.create_topic('c4.t', max_attempts => 10)")
    a.execute("SELECT outbox.publish_batch('c4.t', array(SELECT jsonb_build_object('n', g) FROM generate_series(1, 5000) g))")
    held = a.execute("SELECT id, lease_token FROM outbox.claim('holder', 50, '5 min', ARRAY['c4.t'])").fetchall()
    hid = [h[0] for h in held]
    htok = [h[1] for h in held]
    snap0 = lease_snapshot(a, hid)

    # a) lock_timeout: another session holds ACCESS EXCLUSIVE on the hot relations.
    b.execute("BEGIN")
    b.execute(f"LOCK TABLE {written_tables()} IN ACCESS EXCLUSIVE MODE")
    a.execute("SET lock_timeout = '200ms'")
    calls = [
        ("claim", "SELECT * FROM outbox.claim('w4', 100, '30 s', ARRAY['c4.t'])", None),
        ("ack", "SELECT outbox.ack(%s, %s)", (hid[0], htok[0])),
        ("ack batch", "SELECT outbox.ack(%s::bigint[], %s::uuid[])", (hid[:10], htok[:10])),
        ("fail", "SELECT outbox.fail(%s, %s, 'x')", (hid[1], htok[1])),
        ("extend_lease", "SELECT outbox.extend_lease(%s, %s, '1 min')", (hid[2], htok[2])),
    ]
    for what, sql, params in calls:
        expect_sqlstate(a, sql, params, "55P03", f"lock_timeout in {what}", probs)
    b.execute("ROLLBACK")
    a.execute("RESET lock_timeout")
    if lease_snapshot(a, hid) != snap0:
        probs.append("lock_timeout: the held leases changed")
    probs += consistency_problems(a, "4a: ")

    # b) statement_timeout while a row lock blocks ack/fail: nothing of a batch is applied.
    b.execute("BEGIN")
    lock_held_rows(b, hid)
    a.execute("SET statement_timeout = '300ms'")
    for what, sql, params in calls[1:]:
        # The row lock is on hid[0]: make every call touch it.
        params = (hid[0], htok[0]) if what != "ack batch" else (hid[:10], htok[:10])
        expect_sqlstate(a, sql, params, "57014", f"statement_timeout in {what}", probs)
    b.execute("ROLLBACK")
    # A SHARE lock blocks claim's UPDATE (of a lane and its new batch):
    # statement_timeout inside claim.
    b.execute("BEGIN")
    b.execute(f"LOCK TABLE {written_tables()} IN SHARE MODE")
    expect_sqlstate(a, calls[0][1], None, "57014", "statement_timeout in claim (SHARE lock)", probs)
    b.execute("ROLLBACK")
    a.execute("RESET statement_timeout")
    if lease_snapshot(a, hid) != snap0:
        probs.append("statement_timeout: the held leases changed")
    probs += consistency_problems(a, "4b: ")

    # c) statement_timeout = 1ms on a claim of thousands: cancelled mid-way, nothing leased.
    timeouts = 0
    for k in range(10):
        # A connection of its own carries the 1 ms timeout: a RESET on the same
        # connection would run under it too, and a slow machine cancels the RESET.
        c = cl.connect(options="-c statement_timeout=1ms")
        try:
            got = c.execute("SELECT id, lease_token FROM outbox.claim(%s, 4000, '30 s', ARRAY['c4.t'])",
                            (f"big{k}",)).fetchall()
        except pgerr.QueryCanceled:
            got = None
            timeouts += 1
        finally:
            c.close()
        n = a.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' AND leased_by = %s",
                      (f"big{k}",)).fetchone()[0]
        if got is None and n:
            probs.append(f"cancelled claim big{k} left {n} rows leased")
        if got:
            # It beat the timeout: hand the rows back so the next try has work.
            for i, tok in got:
                a.execute("SELECT outbox.fail(%s, %s, 'give back', '0 s')", (i, tok))
    if timeouts == 0:
        probs.append("statement_timeout = 1ms never cancelled a 4000-row claim")
    # attempts only grew for rows that were really claimed
    bad = a.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' AND topic = 'c4.t' "
                    "AND state = 'pending' AND attempts > 0 AND errors IS NULL").fetchone()[0]
    if bad:
        probs.append(f"{bad} pending rows have attempts counted by a cancelled claim")
    probs += consistency_problems(a, "4c: ")

    # Everything still works: ack the held leases, drain the rest.
    n = a.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", (hid, htok)).fetchone()[0]
    if n != len(hid):
        probs.append(f"after the faults only {n} of {len(hid)} held leases could be acked")
    while True:
        got = a.execute("SELECT id, lease_token FROM outbox.claim('drain4', 2000, '30 s', ARRAY['c4.t'])").fetchall()
        if not got:
            break
        a.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([g[0] for g in got], [g[1] for g in got]))
    left = default_left(a, "c4.t")
    delivered = a.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' AND topic = 'c4.t' "
                          "AND state = 'delivered'").fetchone()[0]
    if left or delivered != 5000:
        probs.append(f"after the faults: {left} left undelivered, {delivered}/5000 delivered")
    log(f"  4: 5 calls x lock_timeout (55P03), 5 x statement_timeout (57014), "
        f"{timeouts}/10 big claims cancelled at 1ms; leases consistent")
    a.close()
    b.close()
    return probs, {}


CASES = [
    ("1", "worker SIGKILL (default and a named subscription): leases redelivered after expiry, attempts counted",
     case_worker_sigkill),
    ("2", "server crash (pg_ctl stop -m immediate) during load, 5 cycles, default and two named subscriptions",
     case_server_crash),
    ("3a", "background worker pg_terminate_backend", case_bgworker_terminate),
    ("3b", "background worker kill -9 (cluster crash-restart)", case_bgworker_kill9),
    ("3c", "background worker SIGTERM during a maintenance pass", case_bgworker_sigterm_in_maintenance),
    ("4", "lock_timeout / statement_timeout inside claim, ack, fail, extend_lease", case_timeouts),
]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child-worker":
        dsn, topic, lease, out, in_tx, sub = sys.argv[2:8]
        child_worker(dsn, topic, int(lease), out, in_tx == "1", None if sub == "-" else sub)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--only", default="1,2,3,4")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    cl = Cluster(args.cluster, args.port)
    cl.wait_ready()
    with cl.connect() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
        if not c.execute("SELECT EXISTS (SELECT 1 FROM outbox.subscriptions WHERE name = 'default')").fetchone()[0]:
            c.execute("SELECT outbox.create_subscription('default', start => 'now')")
    log(f"crash tests on {cl.name} (port {cl.port}), seed {seed}")
    passed = failed = 0
    totals = defaultdict(int)
    for key, title, fn in CASES:
        if key not in args.only.split(",") and key.rstrip("abc") not in args.only.split(","):
            continue
        log(f"case {key}: {title}")
        t0 = time.time()
        try:
            probs, figs = fn(cl, seed) if fn is case_server_crash else fn(cl)
        except Exception:
            probs, figs = [f"exception:\n{traceback.format_exc()}"], {}
            try:
                cl.wait_ready(30)
            except Exception:
                pass
        for k, v in figs.items():
            totals[k] += v
        if probs:
            failed += 1
            log(f"case {key}: FAILED ({time.time() - t0:.1f}s)")
            for p in probs:
                log(f"    violation: {p}")
        else:
            passed += 1
            log(f"case {key}: ok ({time.time() - t0:.1f}s)")
    log("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())) + f", seed {seed}")
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
