#!/usr/bin/env python3
"""Seeded randomized concurrency checker for outbox_ext: liveness and safety.

Sessions (threads, one psycopg 3 connection per thread and database) drive a random,
seeded mix of operations against a preloaded cluster with maintenance OFF
(outbox.maintenance_interval = 0), in two databases, `postgres` and `other`, each
served by its own background worker:

  publishers  publish / publish_batch, with and without subjects (a small colliding
              pool) and dispatch keys (unique, re-used committed keys, a colliding
              pool), delayed events, every isolation level (REPEATABLE READ and
              SERIALIZABLE ones often take their snapshot first and publish later),
              savepoints rolled back or released, whole-transaction rollbacks,
              PREPARE TRANSACTION resolved by COMMIT/ROLLBACK PREPARED in the same
              session or in another one after a delay, long-held transactions
              (1-2 s holding the subject lock); 40001/40P01 are retried
  workers     autocommit claim + ack / fail (retry, permanent) / extend_lease /
              leases left to expire / slow acks; and claims inside explicit
              transactions (any isolation level) that claim again, ack, fail,
              cancel, hold the transaction and then commit or roll back
  operator    cancel, cancel + replay of a queued event (the replay held open a
              moment), replay of dead events, replay_dead(), alter_topic switching
              dead_letter_policy block/skip and max_attempts
  idler       sessions idle in a REPEATABLE READ transaction
  bigops      publish_batch with 200-2000 distinct subjects (54000 above the
              documented 1000 is an accepted refusal) and claim + one batch ack of
              thousands of events with distinct subjects
  scenarios   two targeted races in the mix: replay of a cancelled event while its
              subject's head is acked; a claim in an explicit READ COMMITTED transaction
              that claims again right after a low-water step and rolls back
  sampler     pg_stat_activity every 50 ms: any backend running outbox.claim that
              waits on a Lock (with its blockers and the lock it waits for)

Every CYCLE (12 s) the load calms down for CALM (3.5 s): no long transaction holds an
xid (so the claim low-water mark can step), and one database is left to the low-water
race.

Claims run with lock_timeout = 2 s (55P03 in claim is a violation) and
statement_timeout = 10 s. Then the checker quiesces: load stops, every prepared
transaction is resolved, every open transaction ends; without any maintenance
(never run_maintenance, purge, _purge_step, _audit_low_water) every dead and
cancelled event is replayed and plain autocommit claim + ack workers drain until
every committed event is acked or nothing moved for --stall seconds. Invariants
(transaction outcomes come from pg_xact_status of each transaction's xid, commit
order from pg_xact_commit_timestamp; track_commit_timestamp = on):

  server_errors     no unexpected server error (XX000, 53200, a timeout in claim, a
                    lost connection, a Rust backtrace in a DETAIL, ...)
  delivery          every committed event is acked exactly once (ack() = true in a
                    committed transaction); a committed event never acked is
                    "stranded" and printed with its queue row and _claim_low_water()
  uncommitted       claim never returned, and no table holds, an event of a
                    rolled-back transaction, savepoint or prepared transaction
  subject_order     per subject, committed acks follow the publishers' commit order
                    (events that were ever cancelled, or went dead in a topic that
                    had the 'skip' policy at some point, are left out)
  claim_no_wait     no claim waited on a lock (sampled) or hit lock_timeout
  dispatch_keys     re-publishing a committed dispatch key returns its event id

Usage:
  .venv/bin/python pg_test/suites/checker.py --duration 60 --seed 1     # own cluster
  .venv/bin/python pg_test/suites/checker.py --duration 1800 --seed 7   # long run
  .venv/bin/python pg_test/suites/checker.py --port 5491 --no-cluster   # running server
The last line is `N passed, N failed`; exit 1 on any violation, 2 if the checker
itself broke. The full operation log is written to <logdir>/ops.jsonl.
"""

import argparse
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict

import psycopg

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("OUTBOX_REPO") or os.path.dirname(os.path.dirname(HERE))
PGCLUSTER = os.environ.get("OUTBOX_PGCLUSTER") or os.path.join(REPO, "scripts", "pgcluster.sh")

DBS = ["postgres", "other"]
ISOS = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"]
# topic -> create_topic arguments (None: not registered, GUC defaults below)
TOPICS = {
    "chk.fast": dict(max_attempts=4, backoff_base="10 ms", backoff_max="200 ms", default_lease="500 ms",
                     dead_letter_policy="block"),
    "chk.skip": dict(max_attempts=3, backoff_base="10 ms", backoff_max="200 ms", default_lease="300 ms",
                     dead_letter_policy="skip"),
    "chk.slow": dict(max_attempts=5, backoff_base="20 ms", backoff_max="200 ms", default_lease="1 s",
                     dead_letter_policy="block"),
    "chk.big": dict(max_attempts=10, backoff_base="10 ms", backoff_max="200 ms", default_lease="5 s",
                    dead_letter_policy="block"),
    "chk.unreg": None,
    # claimed only by the scenario threads (and by the rare worker claiming every topic)
    "chk.lw": dict(max_attempts=10, backoff_base="10 ms", backoff_max="200 ms", default_lease="2 s",
                   dead_letter_policy="block"),
    "chk.rp": dict(max_attempts=10, backoff_base="10 ms", backoff_max="200 ms", default_lease="2 s",
                   dead_letter_policy="block"),
}
PUB_TOPICS = ["chk.fast", "chk.skip", "chk.slow", "chk.unreg"]
WORK_TOPICS = PUB_TOPICS
NSUBJECTS = 10
EPOCH = 15.0


CYCLE = 12.0      # every CYCLE seconds the load calms down for the last CALM seconds:
CALM = 3.5        # no long transaction holds an xid then, so the claim low-water mark
QUIET_BEFORE = 3.0  # can step (long holders stop QUIET_BEFORE seconds earlier)


def phase():
    return time.time() % CYCLE


def calm():
    return phase() >= CYCLE - CALM


def quiet():
    """No new long-held transaction now (it could still run into the calm window)."""
    return phase() >= CYCLE - CALM - QUIET_BEFORE


def lw_db():
    """The database reserved for the low-water scenario during the current calm window
    (alternates); all other load uses the other database then."""
    return DBS[int(time.time() // CYCLE) % 2]


def pick_db(rnd):
    db = rnd.choice(DBS)
    if calm() and db == lw_db():
        db = [d for d in DBS if d != db][0]
    return db


def subjects_now():
    """The small pool of subjects publishers use now. The pool changes every EPOCH
    seconds, so that a subject stuck by a defect does not take all the load with it."""
    e = int(time.time() // EPOCH)
    return [f"e{e}s{i}" for i in range(NSUBJECTS)]
SERVER_SETTINGS = {
    "outbox.maintenance_interval": "0",
    "max_prepared_transactions": "64",
    "track_commit_timestamp": "on",
    "max_connections": "100",
    # The lock table holds max_locks_per_transaction * (backends + prepared) entries
    # (about 4,000 here): a claim/ack batch of thousands of distinct subjects must
    # not need one lock per subject. Documented batches (publish_batch: at most
    # 1,000 distinct subjects) fit; the checker runs one big operation at a time.
    "max_locks_per_transaction": "10",
    "deadlock_timeout": "100ms",
    "outbox.default_lease": "1s",
    "outbox.backoff_base": "10ms",
    "outbox.backoff_max": "200ms",
    "outbox.max_attempts": "4",
}
INVARIANTS = ["server_errors", "delivery", "uncommitted", "subject_order", "claim_no_wait", "dispatch_keys"]
RETRY = {"40001", "40P01"}
APP = "chk"


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def xid32(x):
    return int(x) % (1 << 32)


class Stop(Exception):
    pass


class Ctx:
    def __init__(self, args, logdir):
        self.args = args
        self.logdir = logdir
        self.stop = threading.Event()       # load phase over
        self.pubs_done = threading.Event()  # every load thread has finished
        self.quiescing = threading.Event()  # backends may be terminated on purpose
        self.lock = threading.Lock()
        self.seq = 0
        self.ops = []
        self.f = open(os.path.join(logdir, "ops.jsonl"), "w", buffering=1 << 16)
        self.count = Counter()
        self.errors = Counter()
        self.violations = defaultdict(list)
        self.pubtx = {}           # tag -> tx record
        self.pubops = {}          # pk "tag.k.j" -> (tag, k, j)
        self.wtx = {}             # worker tx tag -> {db, xid, client}
        self.acks = []            # (db, id, wtxtag, ok)
        self.claimed = []         # (db, id, pk, wtxtag)
        self.cancelled = set()    # (db, id) cancel() returned true (any outcome)
        self.replayed = set()     # (db, id) replay() returned true
        self.dead_reported = set()  # (db, id) fail() returned 'dead'
        self.ever_skip = set((db, t) for db in DBS for t, a in TOPICS.items()
                             if a and a["dead_letter_policy"] == "skip")
        self.committed_keys = {db: [] for db in DBS}   # (key, id) of committed events
        self.key_checks = []      # (db, key, expected id, got id, tag)
        self.prepared = queue.Queue()   # (due, db, gid, commit, tag)
        self.prepared_plan = {}   # gid -> (db, commit, tag)
        self.lockwaits = []
        self.big = threading.Semaphore(1)
        self.big_db = None        # the database bigops is filling now
        self.conns = []           # every connection (for the final close)

    # -- bookkeeping ------------------------------------------------------------
    def op(self, **rec):
        with self.lock:
            self.seq += 1
            rec["n"] = self.seq
            rec["t"] = round(time.time(), 4)
            rec.setdefault("th", threading.current_thread().name)
            self.ops.append(rec)
            self.f.write(json.dumps(rec, separators=(",", ":"), default=str) + "\n")

    def inc(self, key, n=1):
        with self.lock:
            self.count[key] += n

    def violation(self, inv, msg, **ctx):
        with self.lock:
            self.violations[inv].append((msg, ctx))
        self.op(k="VIOLATION", inv=inv, msg=msg, **ctx)

    # -- connections ------------------------------------------------------------
    def dsn(self, db):
        return f"host=127.0.0.1 port={self.args.port} user=postgres dbname={db}"

    def connect(self, db, role, settings=()):
        deadline = time.time() + 20
        while True:
            try:
                c = psycopg.connect(self.dsn(db), autocommit=True, connect_timeout=5,
                                    application_name=f"{APP}-{role}")
                break
            except psycopg.OperationalError:
                if time.time() > deadline or self.quiescing.is_set():
                    raise
                time.sleep(0.3)
        for s in settings:
            c.execute(s)
        with self.lock:
            self.conns.append(c)
        return c

    # -- errors -----------------------------------------------------------------
    def server_error(self, ex, where, accepted=(), **ctx):
        """Classify a server error. Returns the SQLSTATE; records a violation when the
        error is not one an application must expect at this call."""
        st = getattr(ex, "sqlstate", None) or "conn"
        if getattr(ex, "_chk_seen", False):
            return st
        try:
            ex._chk_seen = True
        except Exception:
            pass
        diag = getattr(ex, "diag", None)
        detail = getattr(diag, "message_detail", None) if diag else None
        msg = (getattr(diag, "message_primary", None) if diag else None) or str(ex).strip()
        with self.lock:
            self.errors[st] += 1
        self.op(k="error", where=where, st=st, msg=msg[:300], detail=(detail or "")[:500], **ctx)
        if detail and ("backtrace" in detail.lower() or ".rs:" in detail or "rust_begin_unwind" in detail):
            self.violation("server_errors", f"backtrace in DETAIL ({where}: {st} {msg[:120]})",
                           detail=detail[:2000], **ctx)
        if st in RETRY or st in accepted:
            return st
        if st == "0A000" and "PREPARE" in msg:
            self.violation("server_errors", f"PREPARE TRANSACTION refused after publish in database "
                           f"{ctx.get('db')}: {st} {msg[:150]}", **ctx)
            return st
        if self.quiescing.is_set() and st in ("conn", "57P01", "08006", "08003", "25P02"):
            return st
        self.violation("server_errors", f"{where}: SQLSTATE {st}: {msg[:300]}", detail=(detail or "")[:1000], **ctx)
        return st


def is_conn_error(ex):
    return isinstance(ex, psycopg.OperationalError) and getattr(ex, "sqlstate", None) in (None, "57P01", "08006", "08003")


def safe_rollback(c):
    try:
        c.execute("ROLLBACK")
    except Exception:
        pass


class Session:
    """One role's connections, one per database, re-opened after connection errors."""

    def __init__(self, ctx, role, settings=()):
        self.ctx, self.role, self.settings = ctx, role, settings
        self.c = {}

    def get(self, db):
        c = self.c.get(db)
        if c is None or c.closed or c.broken:
            c = self.ctx.connect(db, self.role, self.settings)
            self.c[db] = c
        return c

    def drop(self, db):
        c = self.c.pop(db, None)
        if c is not None:
            try:
                c.close()
            except Exception:
                pass

    def close(self):
        for db in list(self.c):
            self.drop(db)


# ---------------------------------------------------------------------------
# Publishers
# ---------------------------------------------------------------------------

def publisher(ctx, idx):
    rnd = random.Random(ctx.args.seed * 1009 + idx)
    s = Session(ctx, f"pub{idx}", ["SET statement_timeout = '30s'"])
    n = 0
    while not ctx.stop.is_set():
        db = pick_db(rnd)
        base = f"p{idx}-{n}"
        n += 1
        txseed = rnd.getrandbits(32)
        tag = base
        try:
            # 40001/40P01: the application runs the same transaction again (same plan)
            for attempt in range(4):
                tag = base if attempt == 0 else f"{base}r{attempt}"
                st = pub_tx(ctx, random.Random(txseed), s.get(db), db, tag)
                if st not in RETRY or ctx.stop.is_set():
                    break
                ctx.inc("publisher retries")
                time.sleep(0.005 * (attempt + 1))
        except psycopg.Error as ex:
            if is_conn_error(ex):
                ctx.server_error(ex, "publisher connection", tag=tag)
                s.drop(db)
                time.sleep(0.2)
        except Stop:
            break
    s.close()


def pick_key(ctx, rnd, db, tag, k, j):
    r = rnd.random()
    if r < 0.25:
        return f"u-{tag}.{k}.{j}", None
    if r < 0.30 and ctx.committed_keys[db]:
        with ctx.lock:
            key, eid = rnd.choice(ctx.committed_keys[db][-500:])
        return key, eid
    if r < 0.33:
        return f"pool-{rnd.randrange(4)}-{int(time.time())}", None
    return None, None


def pub_tx(ctx, rnd, c, db, tag):
    iso = rnd.choices(ISOS, weights=[5, 3, 2])[0]
    mode = rnd.choices(["commit", "rollback", "2pc", "hold"], weights=[60, 10, 18, 12])[0]
    if quiet() and mode in ("2pc", "hold"):
        mode = "commit"
    tx = {"tag": tag, "db": db, "iso": iso, "mode": mode, "ops": [], "xid": None, "client": None}
    with ctx.lock:
        ctx.pubtx[tag] = tx
    first_subject = None
    try:
        c.execute(f"BEGIN ISOLATION LEVEL {iso}")
        if iso != "READ COMMITTED" and rnd.random() < 0.7 and not quiet():
            # Read first (the snapshot), publish later: the subject's head, leased now,
            # may be acked in between.
            pool = subjects_now()
            row = c.execute("SELECT q.subject FROM outbox.event_queue q WHERE q.is_head AND q.state = 'leased' "
                            "AND q.subject = ANY(%s) AND NOT EXISTS (SELECT 1 FROM outbox.event_queue p "
                            "WHERE p.subject = q.subject AND p.id > q.id) ORDER BY random() LIMIT 1",
                            (pool,)).fetchone()
            first_subject = row[0] if row else rnd.choice(pool)
            ctx.op(k="pub_snapshot", db=db, tag=tag, subj=first_subject, iso=iso)
            time.sleep(rnd.uniform(0.05, 0.6))
        for k in range(rnd.randint(1, 3)):
            sp = f"sp{k}" if rnd.random() < 0.2 else None
            if sp:
                c.execute(f"SAVEPOINT {sp}")
            op = {"k": k, "ids": [], "sp": sp, "sp_rb": False}
            tx["ops"].append(op)
            try:
                if rnd.random() < 0.75:
                    publish_one(ctx, rnd, c, db, tag, k, op, first_subject if k == 0 else None)
                else:
                    publish_many(ctx, rnd, c, db, tag, k, op)
            except psycopg.Error as ex:
                if sp is None or is_conn_error(ex):
                    raise
                ctx.server_error(ex, "publish", tag=tag, db=db)
                c.execute(f"ROLLBACK TO SAVEPOINT {sp}")
                op["sp_rb"] = True
                ctx.op(k="rollback_to", db=db, tag=tag, sp=sp, ids=op["ids"])
                continue
            if sp and rnd.random() < 0.5:
                c.execute(f"ROLLBACK TO SAVEPOINT {sp}")
                op["sp_rb"] = True
                ctx.inc("savepoint rollbacks")
                ctx.op(k="rollback_to", db=db, tag=tag, sp=sp, ids=op["ids"])
            elif sp:
                c.execute(f"RELEASE SAVEPOINT {sp}")
        tx["xid"] = c.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
        ctx.op(k="pub_xid", db=db, tag=tag, xid=tx["xid"], iso=iso, mode=mode)
        if mode == "rollback":
            c.execute("ROLLBACK")
            tx["client"] = "rollback"
            ctx.inc("publisher rollbacks")
            ctx.op(k="pub_rollback", db=db, tag=tag)
            return
        if mode == "hold":
            # Keeps the subject locks: acks must defer promotions, claims must not wait.
            time.sleep(rnd.uniform(1.0, 2.0))
        if mode == "2pc":
            gid = f"chk-{tag}"
            tx["gid"] = gid
            c.execute(f"PREPARE TRANSACTION '{gid}'")
            ctx.inc("2pc prepared")
            commit = rnd.random() < 0.75
            with ctx.lock:
                ctx.prepared_plan[gid] = (db, commit, tag)
            ctx.op(k="prepare", db=db, tag=tag, gid=gid, commit=commit)
            r = rnd.random()
            if r < 0.5:
                if r < 0.2:
                    time.sleep(rnd.uniform(0.05, 1.0))
                resolve_prepared(ctx, c, db, gid, commit, tag)
            else:
                ctx.prepared.put((time.time() + rnd.uniform(0.1, 2.5), db, gid, commit, tag))
            return
        c.execute("COMMIT")
        tx["client"] = "commit"
        ctx.inc("publisher commits")
        ctx.op(k="pub_commit", db=db, tag=tag)
        note_committed_keys(ctx, tx)
    except psycopg.Error as ex:
        st = ctx.server_error(ex, "publisher transaction", tag=tag, db=db,
                              accepted=("54000",) if tx.get("big") else ())
        tx["client"] = "error"
        tx["error"] = st
        safe_rollback(c)
        if is_conn_error(ex):
            raise
        return st


def note_committed_keys(ctx, tx):
    with ctx.lock:
        for op in tx["ops"]:
            if op["sp_rb"]:
                continue
            for key, eid in op.get("keys", []):
                if key and key.startswith("u-"):
                    ctx.committed_keys[tx["db"]].append((key, eid))


def resolve_prepared(ctx, c, db, gid, commit, tag):
    verb = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
    c.execute(f"{verb} '{gid}'")
    with ctx.lock:
        ctx.prepared_plan.pop(gid, None)
        tx = ctx.pubtx.get(tag)
    ctx.inc("2pc committed" if commit else "2pc rolled back")
    ctx.op(k="resolve", db=db, gid=gid, commit=commit, tag=tag, th=threading.current_thread().name)
    if tx is not None:
        tx["client"] = "commit" if commit else "rollback"
        if commit:
            note_committed_keys(ctx, tx)


def payload(pk, rnd):
    return json.dumps({"pk": pk, "pad": "x" * rnd.randrange(40)})


def publish_one(ctx, rnd, c, db, tag, k, op, subject=None):
    topic = rnd.choice(PUB_TOPICS)
    if subject is None and rnd.random() < 0.75:
        subject = rnd.choice(subjects_now())
    key, want = pick_key(ctx, rnd, db, tag, k, 0)
    delay = round(rnd.uniform(0.02, 0.4), 3) if rnd.random() < 0.08 else None
    pk = f"{tag}.{k}.0"
    ctx.pubops[pk] = (tag, k, 0)
    ctx.op(k="publish", db=db, tag=tag, pk=pk, topic=topic, subj=subject, key=key, delay=delay)
    eid = c.execute(
        "SELECT outbox.publish(%s, %s::jsonb, %s, %s, NULL, "
        "CASE WHEN %s::float8 IS NULL THEN NULL ELSE clock_timestamp() + %s::float8 * interval '1 s' END)",
        (topic, payload(pk, rnd), subject, key, delay, delay)).fetchone()[0]
    op["ids"].append(eid)
    op.setdefault("keys", []).append((key, eid))
    ctx.inc("publish calls")
    ctx.op(k="published", db=db, tag=tag, pk=pk, id=eid, subj=subject, topic=topic)
    if want is not None:
        ctx.key_checks.append((db, key, want, eid, tag))


def publish_many(ctx, rnd, c, db, tag, k, op):
    topic = rnd.choice(PUB_TOPICS)
    m = rnd.randint(2, 6)
    pool = subjects_now()
    subjects = [rnd.choice(pool) if rnd.random() < 0.7 else None for _ in range(m)] if rnd.random() < 0.75 else None
    keys = None
    if rnd.random() < 0.3:
        keys = [f"u-{tag}.{k}.{j}" if rnd.random() < 0.6 else None for j in range(m)]
    pks = [f"{tag}.{k}.{j}" for j in range(m)]
    for j, pk in enumerate(pks):
        ctx.pubops[pk] = (tag, k, j)
    ctx.op(k="publish_batch", db=db, tag=tag, pks=pks, topic=topic, subjs=subjects, keys=keys)
    ids = [r[0] for r in c.execute(
        "SELECT * FROM outbox.publish_batch(%s, %s::text[]::jsonb[], %s::text[], %s::text[])",
        (topic, [payload(pk, rnd) for pk in pks], subjects, keys)).fetchall()]
    op["ids"].extend(ids)
    op.setdefault("keys", []).extend(zip(keys or [None] * m, ids))
    ctx.inc("publish_batch calls")
    ctx.op(k="published_batch", db=db, tag=tag, ids=ids, subjs=subjects, topic=topic)


def resolver(ctx):
    """Resolves prepared transactions from another session, after their delay."""
    s = Session(ctx, "resolver", ["SET statement_timeout = '30s'"])
    pending = []
    while True:
        try:
            while True:
                pending.append(ctx.prepared.get_nowait())
        except queue.Empty:
            pass
        if ctx.pubs_done.is_set() and not pending and ctx.prepared.empty():
            break
        now = time.time()
        pending.sort()
        while pending and (pending[0][0] <= now or ctx.pubs_done.is_set()):
            due, db, gid, commit, tag = pending.pop(0)
            try:
                resolve_prepared(ctx, s.get(db), db, gid, commit, tag)
            except psycopg.Error as ex:
                ctx.server_error(ex, "resolve prepared", gid=gid, db=db)
                if is_conn_error(ex):
                    s.drop(db)
                # left in pg_prepared_xacts: the quiesce step resolves it
        time.sleep(0.02)
    s.close()


# ---------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------

CLAIM_SQL = ("SELECT id, topic, subject, payload->>'pk', attempt, lease_token "
             "FROM outbox.claim(%s, %s, %s::interval, %s::text[])")
WORKER_SETTINGS = ["SET lock_timeout = '2s'", "SET statement_timeout = '10s'"]


def claim(ctx, c, db, wname, wtx, batch, lease, topics):
    ctx.inc("claims")
    try:
        rows = c.execute(CLAIM_SQL, (wname, batch, lease, topics)).fetchall()
    except psycopg.Error as ex:
        st = getattr(ex, "sqlstate", None)
        if st == "55P03":
            ex._chk_seen = True
            ctx.violation("claim_no_wait", f"claim hit lock_timeout (55P03) in {db}: {str(ex).strip()[:200]}",
                          db=db, wtx=wtx)
            ctx.inc("claim lock_timeout")
            ctx.op(k="error", where="claim", st=st, db=db, wtx=wtx)
            with ctx.lock:
                ctx.errors[st] += 1
        else:
            ctx.server_error(ex, "claim", db=db, wtx=wtx)
        raise
    ids = [r[0] for r in rows]
    with ctx.lock:
        for r in rows:
            ctx.claimed.append((db, r[0], r[3], wtx))
    ctx.inc("claimed events", len(rows))
    if rows:
        ctx.op(k="claim", db=db, wtx=wtx, ids=ids, subjs=[r[2] for r in rows], att=[r[4] for r in rows])
    return rows


def ack_auto(ctx, c, db, wname, row):
    eid, tok = row[0], row[5]
    wtx = f"{wname}-a{eid}-{time.monotonic_ns()}"
    try:
        ok, xid = c.execute("SELECT s.a, pg_current_xact_id_if_assigned()::text "
                            "FROM (SELECT outbox.ack(%s, %s) AS a OFFSET 0) s", (eid, tok)).fetchone()
    except psycopg.Error as ex:
        ctx.server_error(ex, "ack", db=db, id=eid, accepted=("55P03",))
        if is_conn_error(ex):
            with ctx.lock:  # the outcome is unknown
                ctx.wtx[wtx] = {"db": db, "xid": None, "client": "unknown"}
                ctx.acks.append((db, eid, wtx, True))
        raise
    with ctx.lock:
        ctx.wtx[wtx] = {"db": db, "xid": xid, "client": "commit"}
        ctx.acks.append((db, eid, wtx, bool(ok)))
    ctx.inc("acks true" if ok else "acks false")
    ctx.op(k="ack", db=db, id=eid, ok=ok, wtx=wtx, xid=xid, subj=row[2])
    return ok


def fail_call(ctx, c, db, row, permanent, wtx):
    eid, tok = row[0], row[5]
    err = "checker: permanent" if permanent else "checker: transient"
    try:
        res = c.execute("SELECT outbox.fail(%s, %s, %s, NULL, %s)", (eid, tok, err, permanent)).fetchone()[0]
    except psycopg.Error as ex:
        ctx.server_error(ex, "fail", db=db, id=eid, accepted=("55P03",))
        raise
    if res == "dead":
        with ctx.lock:
            ctx.dead_reported.add((db, eid))
    ctx.inc(f"fails {res}")
    ctx.op(k="fail", db=db, id=eid, perm=permanent, res=res, wtx=wtx, subj=row[2])
    return res


def worker(ctx, idx):
    rnd = random.Random(ctx.args.seed * 2003 + idx)
    wname = f"w{idx}"
    s = Session(ctx, f"worker{idx}", WORKER_SETTINGS)
    n = 0
    while not ctx.stop.is_set():
        db = pick_db(rnd)
        n += 1
        c = None
        try:
            c = s.get(db)
            if rnd.random() < 0.55:
                worker_auto(ctx, rnd, c, db, wname, n)
            else:
                worker_tx(ctx, rnd, c, db, wname, n)
        except psycopg.Error as ex:
            ctx.server_error(ex, "worker", db=db)
            if is_conn_error(ex) or c is None:
                s.drop(db)
            else:
                safe_rollback(c)
            time.sleep(0.05)
        time.sleep(rnd.uniform(0, 0.03))
    s.close()


def topics_arg(rnd):
    r = rnd.random()
    if r < 0.05:
        return None
    if r < 0.1:
        return ["chk.*"]
    if r < 0.6:
        return WORK_TOPICS
    return rnd.sample(WORK_TOPICS, rnd.randint(1, 3))


def worker_auto(ctx, rnd, c, db, wname, n):
    wtx = f"{wname}-c{n}"
    lease = rnd.choice([None, None, "300 ms", "500 ms", "1 s"])
    rows = claim(ctx, c, db, wname, wtx, rnd.randint(1, 8), lease, topics_arg(rnd))
    with ctx.lock:
        ctx.wtx[wtx] = {"db": db, "xid": None, "client": "commit"}
    if not rows:
        time.sleep(rnd.uniform(0.01, 0.05))
        return
    rest = []
    for row in rows:
        a = rnd.random()
        if a < 0.55:
            ack_auto(ctx, c, db, wname, row)
        elif a < 0.67:
            fail_call(ctx, c, db, row, False, wtx)
        elif a < 0.71:
            fail_call(ctx, c, db, row, True, wtx)
        elif a < 0.76:
            try:
                until = c.execute("SELECT outbox.extend_lease(%s, %s, '1 s')", (row[0], row[5])).fetchone()[0]
            except psycopg.Error as ex:
                ctx.server_error(ex, "extend_lease", db=db, id=row[0], accepted=("55P03",))
                raise
            ctx.inc("extend_lease")
            ctx.op(k="extend", db=db, id=row[0], ok=until is not None)
            ack_auto(ctx, c, db, wname, row)
        elif a < 0.83:
            ctx.inc("leases left to expire")
            ctx.op(k="expire", db=db, id=row[0])
        elif a < 0.87:
            time.sleep(rnd.uniform(0.2, 1.2))  # slow handler: the ack may be stale
            ack_auto(ctx, c, db, wname, row)
        else:
            rest.append(row)
    if rest:
        ack_batch(ctx, c, db, wname, rest, f"{wname}-b{n}")


def ack_batch(ctx, c, db, wname, rows, wtx):
    """Batch ack in its own transaction; which ids this transaction acked comes from
    the archive rows it inserted (xmin)."""
    ids = [r[0] for r in rows]
    toks = [r[5] for r in rows]
    try:
        c.execute("BEGIN")
        cnt = c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", (ids, toks)).fetchone()[0]
        mine = c.execute("SELECT coalesce(array_agg(id), '{}') FROM outbox.event_archive WHERE id = ANY(%s) "
                         "AND xmin::text = (pg_current_xact_id()::text::bigint %% 4294967296)::text", (ids,)).fetchone()[0]
        xid = c.execute("SELECT pg_current_xact_id_if_assigned()::text").fetchone()[0]
        c.execute("COMMIT")
    except psycopg.Error as ex:
        ctx.server_error(ex, "batch ack", db=db, n=len(ids), wtx=wtx, accepted=("55P03",))
        safe_rollback(c)
        raise
    mine = set(mine)
    if cnt != len(mine):
        ctx.violation("delivery", f"batch ack returned {cnt} but archived {len(mine)} rows", db=db, ids=ids[:50])
    with ctx.lock:
        ctx.wtx[wtx] = {"db": db, "xid": xid, "client": "commit"}
        for i in ids:
            ctx.acks.append((db, i, wtx, i in mine))
    ctx.inc("batch acks")
    ctx.inc("acks true", len(mine))
    ctx.op(k="ack_batch", db=db, ids=ids if len(ids) <= 50 else f"{len(ids)} ids", acked=len(mine), wtx=wtx, xid=xid)


def worker_tx(ctx, rnd, c, db, wname, n):
    """Claims inside an explicit transaction that may roll back."""
    wtx = f"{wname}-t{n}"
    iso = rnd.choices(ISOS, weights=[6, 2, 2])[0]
    rec = {"db": db, "xid": None, "client": None, "iso": iso}
    with ctx.lock:
        ctx.wtx[wtx] = rec
    acks = []
    stage = "begin"
    try:
        c.execute(f"BEGIN ISOLATION LEVEL {iso}")
        ctx.op(k="wbegin", db=db, wtx=wtx, iso=iso)
        rounds = rnd.choices([1, 2, 3], weights=[4, 4, 2])[0] if not quiet() else 1
        for r in range(rounds):
            stage = "claim"
            rows = claim(ctx, c, db, wname, wtx, rnd.randint(1, 6), rnd.choice([None, "500 ms", "1 s"]),
                         topics_arg(rnd))
            if rnd.random() < 0.12:
                # An operator-style change in the same transaction: cancel a queued event
                # (often the newest claimable one).
                stage = "cancel"
                order = "id DESC" if rnd.random() < 0.6 else "random()"
                eid = c.execute("SELECT id FROM outbox.event_queue WHERE state = 'pending' AND is_head "
                                f"AND topic NOT IN ('chk.big', 'chk.lw', 'chk.rp') ORDER BY {order} LIMIT 1").fetchone()
                if eid:
                    ok = c.execute("SELECT outbox.cancel(%s)", (eid[0],)).fetchone()[0]
                    if ok:
                        with ctx.lock:
                            ctx.cancelled.add((db, eid[0]))
                    ctx.inc("cancels in worker tx")
                    ctx.op(k="cancel", db=db, id=eid[0], ok=ok, wtx=wtx)
            for row in rows:
                a = rnd.random()
                stage = "ack/fail"
                if a < 0.6:
                    ok = c.execute("SELECT outbox.ack(%s, %s)", (row[0], row[5])).fetchone()[0]
                    acks.append((row[0], bool(ok)))
                    ctx.op(k="ack", db=db, id=row[0], ok=ok, wtx=wtx, subj=row[2], intx=True)
                elif a < 0.72:
                    fail_call(ctx, c, db, row, rnd.random() < 0.15, wtx)
            if r + 1 < rounds:
                time.sleep(rnd.uniform(0.012, 0.04))  # let the low-water mark step inside the tx
        if not quiet():
            time.sleep(rnd.choice([0, 0, rnd.uniform(0.05, 0.4)]))
        stage = "end"
        rec["xid"] = c.execute("SELECT pg_current_xact_id_if_assigned()::text").fetchone()[0]
        if rnd.random() < 0.35:
            c.execute("ROLLBACK")
            rec["client"] = "rollback"
            ctx.inc("worker rollbacks")
            ctx.op(k="wrollback", db=db, wtx=wtx, xid=rec["xid"])
        else:
            c.execute("COMMIT")
            rec["client"] = "commit"
            ctx.inc("worker commits")
            ctx.op(k="wcommit", db=db, wtx=wtx, xid=rec["xid"])
    except psycopg.Error as ex:
        rec["client"] = "unknown" if is_conn_error(ex) and rec["xid"] else "error"
        if True:  # claim(), fail_call() already recorded theirs (_chk_seen)
            # cancel waits for the subject lock (an operator action): lock_timeout there is fine
            ctx.server_error(ex, f"worker transaction ({stage})", db=db, wtx=wtx,
                             accepted=("55P03",) if stage in ("cancel", "ack/fail") else ())
        safe_rollback(c)
        ctx.op(k="wabort", db=db, wtx=wtx, st=getattr(ex, "sqlstate", None))
        raise
    finally:
        with ctx.lock:
            for eid, ok in acks:
                ctx.acks.append((db, eid, wtx, ok))
        ctx.inc("acks true (in tx)", sum(1 for _, ok in acks if ok))


# ---------------------------------------------------------------------------
# Operator, idler, big operations, sampler
# ---------------------------------------------------------------------------

def operator(ctx):
    rnd = random.Random(ctx.args.seed * 3001)
    s = Session(ctx, "operator", ["SET statement_timeout = '30s'"])
    while not ctx.stop.is_set():
        db = pick_db(rnd)
        try:
            c = s.get(db)
            a = rnd.random()
            if a < 0.30:
                # Cancel a queued event behind a leased head, then replay it in a
                # transaction held open while the head may be acked (defect 5).
                row = c.execute(
                    "SELECT q.id FROM outbox.event_queue q WHERE q.state = 'pending' AND NOT q.is_head "
                    "AND q.topic NOT IN ('chk.big', 'chk.lw', 'chk.rp') AND EXISTS (SELECT 1 FROM outbox.event_queue h "
                    "WHERE h.subject = q.subject AND h.is_head AND h.state = 'leased') "
                    "ORDER BY random() LIMIT 1").fetchone()
                if row is None:
                    row = c.execute("SELECT id FROM outbox.event_queue WHERE state = 'pending' AND subject IS NOT NULL "
                                    "AND topic NOT IN ('chk.big', 'chk.lw', 'chk.rp') ORDER BY random() LIMIT 1").fetchone()
                if row:
                    eid = row[0]
                    ok = c.execute("SELECT outbox.cancel(%s)", (eid,)).fetchone()[0]
                    ctx.inc("cancels")
                    ctx.op(k="cancel", db=db, id=eid, ok=ok)
                    if ok:
                        with ctx.lock:
                            ctx.cancelled.add((db, eid))
                        if rnd.random() < 0.7:
                            time.sleep(rnd.uniform(0, 0.1))
                            c.execute("BEGIN")
                            ok2 = c.execute("SELECT outbox.replay(%s)", (eid,)).fetchone()[0]
                            if not quiet():
                                time.sleep(rnd.uniform(0.05, 0.4))
                            if rnd.random() < 0.1:
                                c.execute("ROLLBACK")
                                ctx.op(k="replay", db=db, id=eid, ok=ok2, rolledback=True)
                            else:
                                c.execute("COMMIT")
                                if ok2:
                                    with ctx.lock:
                                        ctx.replayed.add((db, eid))
                                ctx.inc("replays")
                                ctx.op(k="replay", db=db, id=eid, ok=ok2)
            elif a < 0.45:
                for (eid,) in c.execute("SELECT id FROM outbox.event_queue WHERE state = 'dead' "
                                        "ORDER BY random() LIMIT 3").fetchall():
                    ok = c.execute("SELECT outbox.replay(%s)", (eid,)).fetchone()[0]
                    if ok:
                        with ctx.lock:
                            ctx.replayed.add((db, eid))
                    ctx.inc("replays")
                    ctx.op(k="replay", db=db, id=eid, ok=ok, dead=True)
            elif a < 0.55:
                pat = rnd.choice([None, "chk.*", "chk.fast", "chk.skip"])
                n = c.execute("SELECT outbox.replay_dead(%s)", (pat,)).fetchone()[0]
                ctx.inc("replay_dead calls")
                ctx.op(k="replay_dead", db=db, pattern=pat, n=n)
            elif a < 0.70:
                topic = rnd.choice(["chk.fast", "chk.skip", "chk.slow"])
                pol = rnd.choice(["block", "skip"])
                ma = rnd.choice([None, 2, 3, 4, 5])
                if pol == "skip":
                    with ctx.lock:
                        ctx.ever_skip.add((db, topic))  # before the call: conservative
                c.execute("SELECT outbox.alter_topic(%s, max_attempts => %s, dead_letter_policy => %s)",
                          (topic, ma, pol))
                ctx.inc("alter_topic")
                ctx.op(k="alter_topic", db=db, topic=topic, policy=pol, max_attempts=ma)
            elif a < 0.75:
                # cancel of any live event (pending, dead, or a leased one: false)
                row = c.execute("SELECT id FROM outbox.event_queue WHERE topic NOT IN ('chk.big', 'chk.lw', 'chk.rp') "
                                "ORDER BY random() LIMIT 1").fetchone()
                if row:
                    ok = c.execute("SELECT outbox.cancel(%s)", (row[0],)).fetchone()[0]
                    if ok:
                        with ctx.lock:
                            ctx.cancelled.add((db, row[0]))
                    ctx.inc("cancels")
                    ctx.op(k="cancel", db=db, id=row[0], ok=ok)
            else:
                for (eid,) in c.execute("SELECT id FROM outbox.event_archive WHERE state = 'cancelled' "
                                        "AND topic NOT IN ('chk.lw', 'chk.rp') ORDER BY random() LIMIT 2").fetchall():
                    ok = c.execute("SELECT outbox.replay(%s)", (eid,)).fetchone()[0]
                    if ok:
                        with ctx.lock:
                            ctx.replayed.add((db, eid))
                    ctx.inc("replays")
                    ctx.op(k="replay", db=db, id=eid, ok=ok, cancelled=True)
        except psycopg.Error as ex:
            ctx.server_error(ex, "operator", db=db)
            if is_conn_error(ex):
                s.drop(db)
            else:
                safe_rollback(c)
        ctx.stop.wait(rnd.uniform(0.05, 0.25))
    s.close()


def idler(ctx):
    rnd = random.Random(ctx.args.seed * 4001)
    s = Session(ctx, "idler", ["SET statement_timeout = '30s'"])
    while not ctx.stop.is_set():
        db = rnd.choice(DBS)
        try:
            c = s.get(db)
            c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            c.execute("SELECT count(*) FROM outbox.event_queue")
            ctx.op(k="idle_rr", db=db)
            ctx.inc("idle RR transactions")
            ctx.stop.wait(rnd.uniform(0.5, 3.0))
            c.execute("COMMIT")
        except psycopg.Error as ex:
            ctx.server_error(ex, "idler", db=db)
            s.drop(db)
        ctx.stop.wait(rnd.uniform(0.5, 2.0))
    s.close()


def bigops(ctx):
    """One big operation at a time, one database at a time: publish_batch calls of
    700-2000 distinct subjects (54000 above the documented 1000 is an accepted refusal)
    until the database holds --big-ack big events, then one claim of all of them and one
    batch ack (thousands of distinct subjects); whatever that leaves is acked in
    batches of 500, and the next phase fills the other database."""
    rnd = random.Random(ctx.args.seed * 5003)
    s = Session(ctx, "bigops", ["SET statement_timeout = '60s'"])
    n = 0
    bphase = 0
    while not ctx.stop.wait(rnd.uniform(0.3, 1.0)):
        if quiet():
            continue
        n += 1
        db = DBS[bphase % 2]
        ctx.big_db = db
        try:
            c = s.get(db)
            out = c.execute("SELECT count(*) FROM outbox.event_queue WHERE topic = 'chk.big'").fetchone()[0]
            if out < ctx.args.big_ack:
                m = rnd.randint(1001, 2000) if rnd.random() < 0.12 else rnd.randint(700, 1000)
                big_publish(ctx, rnd, c, db, f"b-{n}", m)
                continue
            big_ack(ctx, rnd, c, db, n)
            # clean up (expired leases of a failed batch become claimable after 5 s)
            t_end = time.time() + 12
            while time.time() < t_end and not ctx.stop.is_set() and not quiet():
                left = c.execute("SELECT count(*) FROM outbox.event_queue WHERE topic = 'chk.big'").fetchone()[0]
                if not left:
                    break
                cw = f"big-cl{n}-{time.monotonic_ns()}"
                with ctx.lock:
                    ctx.wtx[cw] = {"db": db, "xid": None, "client": "commit"}
                rows = claim(ctx, c, db, "bigw", cw, 500, "5 s", ["chk.big"])
                if rows:
                    ack_batch(ctx, c, db, "bigw", rows, f"big-clb{n}-{time.monotonic_ns()}")
                else:
                    time.sleep(0.5)
            bphase += 1
        except psycopg.Error as ex:
            if is_conn_error(ex):
                s.drop(db)
            else:
                ctx.server_error(ex, "bigops", db=db)
                safe_rollback(c)
    ctx.big_db = None
    s.close()


def big_publish(ctx, rnd, c, db, tag, m):
    tx = {"tag": tag, "db": db, "iso": "READ COMMITTED", "mode": "big", "ops": [], "xid": None,
          "client": None, "big": True}
    with ctx.lock:
        ctx.pubtx[tag] = tx
    pks = [f"{tag}.0.{j}" for j in range(m)]
    for j, pk in enumerate(pks):
        ctx.pubops[pk] = (tag, 0, j)
    op = {"k": 0, "ids": [], "sp": None, "sp_rb": False}
    tx["ops"].append(op)
    subjects = [f"{tag}-{j}" for j in range(m)]
    ctx.op(k="publish_batch", db=db, tag=tag, n=m, topic="chk.big", big=True)
    try:
        c.execute("BEGIN")
        ids = [r[0] for r in c.execute(
            "SELECT * FROM outbox.publish_batch('chk.big', %s::text[]::jsonb[], %s::text[])",
            ([json.dumps({"pk": pk}) for pk in pks], subjects)).fetchall()]
        op["ids"].extend(ids)
        tx["xid"] = c.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
        c.execute("COMMIT")
        tx["client"] = "commit"
        ctx.inc("big publish_batch")
        ctx.inc("publisher commits")
        ctx.op(k="pub_commit", db=db, tag=tag, n=len(ids), big=True)
    except psycopg.Error as ex:
        st = ctx.server_error(ex, "big publish_batch", db=db, tag=tag, subjects=m,
                              accepted=("54000",) if m > 1000 else ())
        tx["client"] = "error"
        safe_rollback(c)
        if st == "54000":
            ctx.inc("big publish_batch refused (54000)")
        if is_conn_error(ex):
            raise


def big_ack(ctx, rnd, c, db, n):
    wtx = f"big-c{n}"
    with ctx.lock:
        ctx.wtx[wtx] = {"db": db, "xid": None, "client": "commit"}
    c.execute("SET lock_timeout = '2s'")
    try:
        rows = claim(ctx, c, db, "bigw", wtx, 10000, "5 s", ["chk.big"])
    except psycopg.Error:
        c.execute("RESET lock_timeout")
        return
    c.execute("RESET lock_timeout")
    if rows:
        try:
            ack_batch(ctx, c, db, "bigw", rows, f"big-b{n}")
            ctx.inc("big batch acks")
            ctx.op(k="big_ack", db=db, n=len(rows))
        except psycopg.Error:
            pass


def scenario_publish(ctx, rnd, c, db, tag, items, hold=0.0):
    """One publisher transaction of (topic, subject) items; returns the ids (None on error).
    hold: seconds between BEGIN (the transaction's now()) and the first publish."""
    tx = {"tag": tag, "db": db, "iso": "READ COMMITTED", "mode": "scenario", "ops": [], "xid": None, "client": None}
    with ctx.lock:
        ctx.pubtx[tag] = tx
    ids = []
    try:
        c.execute("BEGIN")
        if hold:
            c.execute("SELECT pg_current_xact_id_if_assigned()")
            time.sleep(hold)
        for k, (topic, subj) in enumerate(items):
            pk = f"{tag}.{k}.0"
            ctx.pubops[pk] = (tag, k, 0)
            op = {"k": k, "ids": [], "sp": None, "sp_rb": False}
            tx["ops"].append(op)
            eid = c.execute("SELECT outbox.publish(%s, %s::jsonb, %s)", (topic, payload(pk, rnd), subj)).fetchone()[0]
            op["ids"].append(eid)
            ids.append(eid)
            ctx.op(k="published", db=db, tag=tag, pk=pk, id=eid, subj=subj, topic=topic)
        tx["xid"] = c.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
        c.execute("COMMIT")
        tx["client"] = "commit"
        ctx.inc("publisher commits")
        ctx.op(k="pub_commit", db=db, tag=tag)
        return ids
    except psycopg.Error as ex:
        ctx.server_error(ex, "scenario publish", db=db, tag=tag)
        tx["client"] = "error"
        safe_rollback(c)
        if is_conn_error(ex):
            raise
        return None


def scenario_replay(ctx):
    """Replay of a cancelled event racing the ack of its subject's head: publish E1, E2
    of a fresh subject, claim E1, cancel E2, then replay E2 in a transaction that stays
    open while another session acks E1 (on 0.3.0 nothing promotes E2: defect 5)."""
    rnd = random.Random(ctx.args.seed * 6007)
    a = Session(ctx, "scen-rp-a", WORKER_SETTINGS)
    b = Session(ctx, "scen-rp-b", ["SET statement_timeout = '30s'"])
    n = 0
    while not ctx.stop.wait(rnd.uniform(1.0, 4.0)):
        n += 1
        db = pick_db(rnd)
        subj = f"rp{n}"
        try:
            ca, cb = a.get(db), b.get(db)
            ids = scenario_publish(ctx, rnd, ca, db, f"rp-{n}", [("chk.rp", subj), ("chk.rp", subj)])
            if not ids:
                continue
            e1, e2 = ids
            wtx = f"rp-c{n}"
            with ctx.lock:
                ctx.wtx[wtx] = {"db": db, "xid": None, "client": "commit"}
            rows = [r for r in claim(ctx, ca, db, "rp", wtx, 5, "2 s", ["chk.rp"]) if r[0] == e1]
            ok = cb.execute("SELECT outbox.cancel(%s)", (e2,)).fetchone()[0]
            ctx.op(k="cancel", db=db, id=e2, ok=ok, scenario="rp")
            if ok:
                with ctx.lock:
                    ctx.cancelled.add((db, e2))
            cb.execute("BEGIN")
            ok2 = cb.execute("SELECT outbox.replay(%s)", (e2,)).fetchone()[0]
            ctx.op(k="replay", db=db, id=e2, ok=ok2, scenario="rp", open=True)
            if rows:
                ack_auto(ctx, ca, db, "rp", rows[0])
            time.sleep(rnd.uniform(0.0, 0.05))
            cb.execute("COMMIT")
            if ok2:
                with ctx.lock:
                    ctx.replayed.add((db, e2))
            ctx.inc("scenario replay races")
            ctx.op(k="replay_commit", db=db, id=e2, scenario="rp")
        except psycopg.Error as ex:
            ctx.server_error(ex, "scenario replay", db=db)
            for sess in (a, b):
                c = sess.c.get(db)
                if c is not None and not is_conn_error(ex):
                    safe_rollback(c)
                else:
                    sess.drop(db)
    a.close()
    b.close()


def scenario_lowwater(ctx):
    """During calm windows, in the database the rest of the load leaves alone then: a
    publisher P publishes E0 and, once a claim of another session (S) has stepped the
    claim low-water mark, commits; an explicit READ COMMITTED transaction T claims E0,
    claims again ~10 ms later (taking the next step of the mark inside T) and rolls
    back. On 0.3.0 the mark then passes E0 for good (defect 2)."""
    rnd = random.Random(ctx.args.seed * 7001)
    p = Session(ctx, "scen-lw-p", ["SET statement_timeout = '30s'"])
    st = Session(ctx, "scen-lw-s", WORKER_SETTINGS)
    t = Session(ctx, "scen-lw-t", WORKER_SETTINGS)
    n = 0
    while not ctx.stop.wait(rnd.uniform(0.02, 0.1)):
        if not calm() or phase() > CYCLE - 0.3:
            continue
        n += 1
        db = lw_db()
        try:
            cp, cs, ct = p.get(db), st.get(db), t.get(db)
            # S first delivers what the rest of the load and the earlier rounds left in this
            # database (it would hold the mark back)
            with ctx.lock:
                ctx.wtx[f"lw-d{n}"] = {"db": db, "xid": None, "client": "commit"}
            t_end = time.time() + 0.8
            while time.time() < t_end:
                got = claim(ctx, cs, db, "lw-s", f"lw-d{n}", 200, "2 s", WORK_TOPICS + ["chk.lw", "chk.big", "chk.rp"])
                if not got:
                    break
                for r in got:
                    ack_auto(ctx, cs, db, "lw-s", r)
            tag = f"lw-{n}"
            tx = {"tag": tag, "db": db, "iso": "READ COMMITTED", "mode": "scenario", "ops": [], "xid": None,
                  "client": None}
            with ctx.lock:
                ctx.pubtx[tag] = tx
            subj = f"lw{n}" if rnd.random() < 0.5 else None
            pk = f"{tag}.0.0"
            ctx.pubops[pk] = (tag, 0, 0)
            op = {"k": 0, "ids": [], "sp": None, "sp_rb": False}
            tx["ops"].append(op)
            cp.execute("BEGIN")
            eid = cp.execute("SELECT outbox.publish('chk.lw', %s::jsonb, %s)", (payload(pk, rnd), subj)).fetchone()[0]
            op["ids"].append(eid)
            tx["xid"] = cp.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
            key0 = cp.execute("SELECT visible_at, id FROM outbox.event_queue WHERE id = %s", (eid,)).fetchone()
            ctx.op(k="published", db=db, tag=tag, pk=pk, id=eid, subj=subj, topic="chk.lw")
            # S steps the mark while P is open (claims of a topic nobody publishes); P commits
            # right after S's last claim, and T claims right after that.
            with ctx.lock:
                ctx.wtx[f"lw-s{n}"] = {"db": db, "xid": None, "client": "commit"}
            for _ in range(rnd.randint(2, 8)):
                time.sleep(0.0105)
                claim(ctx, cs, db, "lw-s", f"lw-s{n}", 1, "2 s", ["chk.none"])
            cp.execute("COMMIT")
            tx["client"] = "commit"
            wtx = f"lw-t{n}"
            rec = {"db": db, "xid": None, "client": None}
            with ctx.lock:
                ctx.wtx[wtx] = rec
            ct.execute("BEGIN")
            rows = claim(ctx, ct, db, "lw", wtx, 5, "2 s", ["chk.lw"])
            # Claim again until a step of the mark has happened inside T (at most ~0.4 s;
            # only S and T claim in this database during the calm window).
            moved = False
            for _ in range(60):
                time.sleep(0.0105)
                claim(ctx, ct, db, "lw", wtx, 1, "2 s", ["chk.lw"])
                # -infinity (no mark) has no Python datetime: NULL instead.
                lwm = ct.execute("SELECT NULLIF(low_water_at, '-infinity'), low_water_id "
                                 "FROM outbox._claim_low_water()").fetchone()
                if key0 and lwm and lwm[0] is not None and (lwm[0], lwm[1]) > tuple(key0):
                    moved = True
                    break
            ctx.op(k="lw_mark", db=db, id=eid, key0=str(key0), mark=str(lwm), passed=moved, claimed=[r[0] for r in rows])
            rec["xid"] = ct.execute("SELECT pg_current_xact_id_if_assigned()::text").fetchone()[0]
            ct.execute("ROLLBACK")
            rec["client"] = "rollback"
            ctx.inc("scenario low-water rollbacks")
            ctx.op(k="wrollback", db=db, wtx=wtx, scenario="lw", ids=[r[0] for r in rows])
        except psycopg.Error as ex:
            ctx.server_error(ex, "scenario low-water", db=db)
            for sess in (p, st, t):
                c = sess.c.get(db)
                if c is not None and not is_conn_error(ex):
                    safe_rollback(c)
                else:
                    sess.drop(db)
    for sess in (p, st, t):
        sess.close()


def sampler(ctx, done, db):
    s = Session(ctx, "sampler", ["SET statement_timeout = '5s'"])
    seen = set()
    q = ("SELECT a.pid, a.datname, a.wait_event_type, a.wait_event, left(a.query, 300), "
         "pg_blocking_pids(a.pid), a.application_name, "
         "(SELECT json_agg(json_build_object('pid', b.pid, 'app', b.application_name, 'state', b.state, "
         "'wait', b.wait_event_type || ':' || b.wait_event, 'query', left(b.query, 200))) "
         "FROM pg_stat_activity b WHERE b.pid = ANY (pg_blocking_pids(a.pid))), "
         "(SELECT json_agg(json_build_object('locktype', l.locktype, 'rel', l.relation::regclass::text, "
         "'mode', l.mode)) FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted) "
         "FROM pg_stat_activity a WHERE a.state = 'active' AND a.wait_event_type = 'Lock' "
         # Relation-extension and page locks are held for the moment a buffer is
         # added or split, never until a transaction ends: not a wait on a claim
         # or an application transaction.
         "AND a.wait_event NOT IN ('extend', 'page') "
         "AND a.datname = current_database() "
         "AND a.query LIKE '%outbox.claim(%' AND a.pid <> pg_backend_pid()")
    while not done.is_set():
        try:
            c = s.get(db)
            for pid, dat, wt, we, query, blockers, app, binfo, waiting in c.execute(q).fetchall():
                ctx.inc("lock-wait samples")
                key = (pid, tuple(blockers or []))
                rec = dict(pid=pid, db=dat, wait=f"{wt}:{we}", lock=waiting, query=query, app=app, blockers=binfo)
                ctx.op(k="lockwait", **rec)
                if key not in seen:
                    seen.add(key)
                    ctx.lockwaits.append(rec)
        except psycopg.Error:
            s.drop(db)
            time.sleep(0.2)
        time.sleep(0.05)
    s.close()


# ---------------------------------------------------------------------------
# Quiesce and drain
# ---------------------------------------------------------------------------

def terminate_load_backends(ctx, c):
    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE 'chk-%%' "
              "AND application_name NOT IN ('chk-sampler', 'chk-quiesce', 'chk-drain') AND pid <> pg_backend_pid()")


def quiesce(ctx, threads, resolver_t):
    ctx.stop.set()
    deadline = time.time() + 20
    for t in threads:
        t.join(max(0.1, deadline - time.time()))
    ctx.pubs_done.set()
    resolver_t.join(max(5.0, deadline - time.time()))
    threads = threads + [resolver_t]
    ctx.quiescing.set()
    alive = [t.name for t in threads if t.is_alive()]
    c = ctx.connect("postgres", "quiesce")
    if alive:
        log(f"quiesce: threads still running after 20 s: {alive}; terminating their backends")
        ctx.violation("server_errors", f"sessions did not finish within 20 s after the load stopped: {alive}")
        terminate_load_backends(ctx, c)
        for t in threads:
            t.join(10)
    # Resolve every prepared transaction left (a failed or pending resolution).
    n = 0
    for db in DBS:
        cd = ctx.connect(db, "quiesce")
        for (gid,) in cd.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall():
            with ctx.lock:
                plan = ctx.prepared_plan.get(gid)
            commit = plan[1] if plan else True
            try:
                resolve_prepared(ctx, cd, db, gid, commit, plan[2] if plan else None)
                n += 1
            except psycopg.Error as ex:
                ctx.server_error(ex, "quiesce: resolve prepared", gid=gid)
        cd.close()
    if n:
        log(f"quiesce: resolved {n} prepared transactions")
    # No transaction of ours may stay open.
    open_tx = c.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'chk-%%' "
                        "AND xact_start IS NOT NULL AND pid <> pg_backend_pid() "
                        "AND application_name <> 'chk-sampler'").fetchone()[0]
    if open_tx:
        terminate_load_backends(ctx, c)
    left = c.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone()[0]
    if left:
        ctx.violation("server_errors", f"{left} prepared transactions could not be resolved")
    c.close()


def drain(ctx):
    """Replay every dead and cancelled event, drain with autocommit claim + ack, until every
    committed event is delivered or nothing moved for --stall seconds."""
    t0 = time.time()
    hard = t0 + ctx.args.drain_max
    stall = ctx.args.stall
    sess = {db: Session(ctx, "drain", WORKER_SETTINGS) for db in DBS}
    last_progress = time.time()
    last_delivered = -1
    last_replay = 0.0
    rounds = 0
    while True:
        rounds += 1
        now = time.time()
        if now - last_replay > 1.0:
            last_replay = now
            for db in DBS:
                try:
                    c = sess[db].get(db)
                    for (eid,) in c.execute("SELECT id FROM outbox.event_archive WHERE state = 'cancelled'").fetchall():
                        ok = c.execute("SELECT outbox.replay(%s)", (eid,)).fetchone()[0]
                        if ok:
                            with ctx.lock:
                                ctx.replayed.add((db, eid))
                        ctx.inc("drain replays")
                        ctx.op(k="replay", db=db, id=eid, ok=ok, drain=True)
                    nd = c.execute("SELECT outbox.replay_dead()").fetchone()[0]
                    if nd:
                        ctx.inc("drain replay_dead", nd)
                        ctx.op(k="replay_dead", db=db, n=nd, drain=True)
                except psycopg.Error as ex:
                    ctx.server_error(ex, "drain replay", db=db)
                    sess[db].drop(db)
        got = 0
        for db in DBS:
            try:
                c = sess[db].get(db)
                rows = claim(ctx, c, db, "drain", f"drain-{db}-{rounds}", 500, "10 s", None)
                with ctx.lock:
                    ctx.wtx[f"drain-{db}-{rounds}"] = {"db": db, "xid": None, "client": "commit"}
                if len(rows) > 20:
                    ack_batch(ctx, c, db, "drain", rows, f"drain-b-{db}-{rounds}")
                else:
                    for row in rows:
                        ack_auto(ctx, c, db, "drain", row)
                got += len(rows)
            except psycopg.Error as ex:
                ctx.server_error(ex, "drain", db=db)
                if is_conn_error(ex):
                    sess[db].drop(db)
                else:
                    safe_rollback(c)
        # Everything committed is delivered when no live or cancelled event is left.
        remaining = 0
        for db in DBS:
            try:
                remaining += sess[db].get(db).execute(
                    "SELECT (SELECT count(*) FROM outbox.event_queue) + "
                    "(SELECT count(*) FROM outbox.event_archive WHERE state = 'cancelled')").fetchone()[0]
            except psycopg.Error as ex:
                ctx.server_error(ex, "drain count", db=db)
                sess[db].drop(db)
                remaining += 1
        if last_delivered < 0 or remaining < last_delivered:
            last_progress = time.time()
            last_delivered = remaining
        if remaining == 0:
            log(f"drain: queues empty after {time.time() - t0:.1f}s")
            break
        if time.time() - last_progress > stall or time.time() > hard:
            log(f"drain: gave up after {time.time() - t0:.1f}s: {remaining} events still queued "
                f"(nothing delivered for {time.time() - last_progress:.0f}s)")
            break
        if not got:
            time.sleep(0.1)
    for s in sess.values():
        s.close()
    return time.time() - t0


# ---------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------

def xact_info(c, xids):
    """xid8 text -> (status, commit timestamp)."""
    out = {}
    xs = sorted(set(x for x in xids if x))
    for i in range(0, len(xs), 5000):
        part = xs[i:i + 5000]
        for x, st, ts in c.execute(
                "SELECT x, pg_xact_status(x::xid8), pg_xact_commit_timestamp((x::bigint %% 4294967296)::text::xid) "
                "FROM unnest(%s::text[]) x", (part,)).fetchall():
            out[x] = (st, ts)
    return out


class Analysis:
    def __init__(self, ctx):
        self.ctx = ctx
        self.c = {db: ctx.connect(db, "analysis") for db in DBS}

    def outcomes(self):
        ctx = self.ctx
        xids = [t["xid"] for t in ctx.pubtx.values()] + [w["xid"] for w in ctx.wtx.values()]
        self.xinfo = xact_info(self.c["postgres"], xids)
        # publisher transactions
        self.pub_status = {}
        for tag, t in ctx.pubtx.items():
            st = self.xinfo.get(t["xid"], (None, None))[0] if t["xid"] else None
            if st is None:
                # no xid: the transaction failed before it published anything durable
                st = "aborted" if t["client"] in ("rollback", "error", None) else "unknown"
            elif st == "in progress":
                st = "unknown"
            if st == "committed" and t["client"] in ("rollback",):
                ctx.violation("uncommitted", f"publisher {tag} rolled back but pg_xact_status says committed")
            self.pub_status[tag] = st
        # committed events: (db, id) -> (tag, k, j)
        self.committed = {}
        self.rolled_back_ids = set()
        for tag, t in ctx.pubtx.items():
            st = self.pub_status[tag]
            for op in t["ops"]:
                for eid in op["ids"]:
                    if st == "committed" and not op["sp_rb"]:
                        self.committed[(t["db"], eid)] = tag

    def load_final(self, sess=None):
        rows = {}
        for db in DBS:
            c = self.c[db]
            for eid, topic, subj, state, pk, errors, maxa in c.execute(
                    "SELECT id, topic, subject, state, payload->>'pk', errors, max_attempts FROM outbox.events").fetchall():
                rows[(db, eid)] = (topic, subj, state, pk, errors, maxa)
        self.final = rows
        return rows

    def pk_status(self, pk):
        """'committed', 'aborted' or 'unknown' for the publish op named by a payload pk."""
        if pk is None or pk not in self.ctx.pubops:
            return "foreign"
        tag, k, j = self.ctx.pubops[pk]
        t = self.ctx.pubtx.get(tag)
        st = self.pub_status.get(tag, "unknown")
        if st != "committed":
            return st
        for op in t["ops"]:
            if op["k"] == k:
                return "aborted" if op["sp_rb"] else "committed"
        return "aborted"  # the op never returned (failed inside a released savepoint? counted aborted)

    def worker_committed(self, wtx):
        w = self.ctx.wtx.get(wtx)
        if w is None:
            return "unknown"
        if w["client"] == "unknown":
            return "unknown"
        if w["xid"]:
            return {"committed": "committed", "aborted": "aborted"}.get(self.xinfo.get(w["xid"], (None,))[0], "unknown")
        return "aborted" if w["client"] in ("rollback", "error", None) else "committed"

    def ack_ts(self, wtx):
        w = self.ctx.wtx.get(wtx)
        if w and w["xid"]:
            return self.xinfo.get(w["xid"], (None, None))[1]
        return None

    def run(self):
        ctx = self.ctx
        self.outcomes()
        final = self.load_final()
        self.check_uncommitted(final)
        self.check_delivery(final)
        self.check_order(final)
        self.check_keys()
        self.check_lockwaits()

    def check_uncommitted(self, final):
        ctx = self.ctx
        bad = 0
        for db, eid, pk, wtx in ctx.claimed:
            st = self.pk_status(pk)
            if st in ("aborted", "foreign"):
                bad += 1
                if bad <= 20:
                    ctx.violation("uncommitted", f"claim returned event {db}/{eid} ({pk}) of a {st} publish",
                                  db=db, id=eid, pk=pk, wtx=wtx)
        for (db, eid), (topic, subj, state, pk, errors, maxa) in final.items():
            st = self.pk_status(pk)
            if st in ("aborted", "foreign"):
                bad += 1
                if bad <= 40:
                    ctx.violation("uncommitted", f"outbox.events holds {db}/{eid} ({pk}, {state}) of a {st} publish",
                                  db=db, id=eid, pk=pk)

    def check_delivery(self, final):
        ctx = self.ctx
        good = defaultdict(list)
        unknown = set()
        for db, eid, wtx, ok in ctx.acks:
            if not ok:
                continue
            st = self.worker_committed(wtx)
            if st == "committed":
                good[(db, eid)].append(wtx)
            elif st == "unknown":
                unknown.add((db, eid))
        self.good_acks = good
        self.stranded = []
        for key, tag in sorted(self.committed.items()):
            n = len(good.get(key, []))
            row = final.get(key)
            if n > 1:
                ctx.violation("delivery", f"event {key[0]}/{key[1]} acked {n} times in committed transactions",
                              db=key[0], id=key[1], wtx=good[key])
            if n == 0 and key not in unknown:
                self.stranded.append(key)
            elif row is not None and row[2] != "delivered":
                ctx.violation("delivery", f"event {key[0]}/{key[1]} acked but its state is {row[2]}",
                              db=key[0], id=key[1])
            if row is None:
                ctx.violation("delivery", f"committed event {key[0]}/{key[1]} ({tag}) is missing from outbox.events",
                              db=key[0], id=key[1])
        for (db, eid), r in final.items():
            if r[2] == "delivered" and (db, eid) not in good and (db, eid) not in unknown and (db, eid) in self.committed:
                pass  # counted as stranded above only if no ack: delivered without ack is impossible here
        self.describe_stranded()

    def describe_stranded(self):
        """One violation per stranded subject (its first stranded event, in full) and per
        stranded event without a subject."""
        ctx = self.ctx
        if not self.stranded:
            return
        lw = {db: self.c[db].execute("SELECT publish_floor::text, low_water_at::text, low_water_id, step_pending, "
                                      "resets FROM outbox._claim_low_water()").fetchone() for db in DBS}
        groups = defaultdict(list)
        for db, eid in self.stranded:
            row = self.final.get((db, eid))
            subj = row[1] if row else None
            groups[(db, subj if subj is not None else f"#{eid}")].append(eid)
        self.stranded_groups = groups
        for (db, gkey), eids in sorted(groups.items(), key=lambda kv: (kv[0][0], min(kv[1]))):
            eid = min(eids)
            c = self.c[db]
            ev = c.execute("SELECT id, topic, subject, state, attempts, max_attempts, available_at, lease_expires_at, "
                           "published_at, last_error FROM outbox.events WHERE id = %s", (eid,)).fetchone()
            q = c.execute("SELECT id, state, is_head, visible_at, blocks_subject, subject, attempts, leased_by "
                          "FROM outbox.event_queue WHERE id = %s", (eid,)).fetchone()
            hint = []
            if q is not None:
                subj = q[5]
                earlier = c.execute("SELECT count(*) FROM outbox.event_queue WHERE subject = %s AND id < %s "
                                    "AND (state <> 'dead' OR blocks_subject)", (subj, eid)).fetchone()[0] if subj else 0
                if not q[2] and earlier == 0:
                    hint.append("is_head = false and no earlier live event of its subject: never promoted")
                elif earlier:
                    hint.append(f"behind {earlier} earlier live events of its subject")
                if q[2] and lw[db] and (q[3], q[0]) < (lw[db][1], lw[db][2]):
                    hint.append("a head below the claim low-water mark")
                if q[1] == "dead":
                    hint.append("dead after the drain")
            else:
                hint.append("not in event_queue")
            tag = self.committed.get((db, eid))
            t = ctx.pubtx.get(tag, {})
            if (db, eid) in ctx.cancelled:
                hint.append("it was cancelled and replayed")
            hint.append(f"publisher {tag} iso={t.get('iso')} mode={t.get('mode')}")
            more = f"; {len(eids) - 1} later events of this subject stranded too" if len(eids) > 1 else ""
            ctx.violation("delivery", f"stranded: committed event {db}/{eid} never acked ({'; '.join(hint)}){more}",
                          db=db, id=eid, subj=(q[5] if q else (ev[2] if ev else None)),
                          events_row=fmt_row(ev), queue_row=fmt_row(q), low_water=fmt_row(lw[db]))

    def check_order(self, final):
        ctx = self.ctx
        tag_ts = {tag: self.xinfo.get(t["xid"], (None, None))[1] for tag, t in ctx.pubtx.items() if t["xid"]}
        by_subject = defaultdict(list)
        excluded = Counter()
        for key, tag in self.committed.items():
            row = final.get(key)
            if row is None:
                continue
            topic, subj, state, pk, errors, maxa = row
            if subj is None:
                continue
            db = key[0]
            if key in ctx.cancelled:
                excluded["cancelled"] += 1
                continue
            went_dead = key in ctx.dead_reported or any(
                (e.get("error") == "checker: permanent") or (e.get("attempt") or 0) >= maxa for e in (errors or []))
            if went_dead and (db, topic) in ctx.ever_skip:
                excluded["dead under skip"] += 1
                continue
            acks = self.good_acks.get(key)
            if not acks or len(acks) != 1:
                continue
            ats = self.ack_ts(acks[0])
            if pk not in ctx.pubops or tag_ts.get(self.ctx.pubops[pk][0]) is None or ats is None:
                excluded["no timestamp"] += 1
                continue
            ptag, k, j = ctx.pubops[pk]
            by_subject[(db, subj)].append((tag_ts[ptag], ptag, k, j, ats, key[1]))
        self.order_stats = {"subjects": len(by_subject), "events": sum(len(v) for v in by_subject.values()),
                            "excluded": dict(excluded)}
        nviol = 0
        for (db, subj), evs in by_subject.items():
            # (commit ts, publisher tag, k, j, ack ts, id), in publish order. Events of
            # transactions with the same commit timestamp are not ordered against each
            # other; within one transaction publish order counts.
            evs.sort()
            prev_max = None   # the latest-acked event of all earlier timestamp groups
            i = 0
            while i < len(evs):
                g = [evs[i]]
                while i + len(g) < len(evs) and evs[i + len(g)][0] == evs[i][0]:
                    g.append(evs[i + len(g)])
                i += len(g)
                single_tx = len(set(e[1] for e in g)) == 1
                run_max = None  # within one transaction
                for e in g:
                    for ref in (prev_max, run_max if single_tx else None):
                        if ref is not None and e[4] < ref[4]:
                            nviol += 1
                            if nviol <= 20:
                                ctx.violation(
                                    "subject_order",
                                    f"subject {db}/{subj}: event {e[5]} (publisher {e[1]} committed {e[0]}) "
                                    f"acked at {e[4]}, before event {ref[5]} (publisher {ref[1]} committed "
                                    f"{ref[0]}, acked {ref[4]})", db=db, subj=subj, id=e[5], other=ref[5])
                            break
                    if run_max is None or e[4] > run_max[4]:
                        run_max = e
                if prev_max is None or run_max[4] > prev_max[4]:
                    prev_max = run_max
        if nviol > 20:
            ctx.violation("subject_order", f"... {nviol - 20} more order violations")

    def check_keys(self):
        ctx = self.ctx
        for db, key, want, got, tag in ctx.key_checks:
            if want != got:
                # only a violation when the original event's transaction committed
                otag = self.committed.get((db, want))
                if otag is not None:
                    ctx.violation("dispatch_keys", f"{db}: re-publish of committed key {key} returned {got}, "
                                  f"not {want}", db=db, id=want, other=got, tag=tag)

    def check_lockwaits(self):
        ctx = self.ctx
        for rec in ctx.lockwaits[:30]:
            ctx.violation("claim_no_wait", f"claim ({rec['app']}) waited on a lock in {rec['db']} ({rec['wait']} "
                          f"{json.dumps(rec['lock'])}); blockers: {json.dumps(rec['blockers'])[:700]}",
                          **{k: v for k, v in rec.items() if k not in ('blockers', 'db')})
        if len(ctx.lockwaits) > 30:
            ctx.violation("claim_no_wait", f"... {len(ctx.lockwaits) - 30} more distinct lock waits of claims")


def fmt_row(r):
    if r is None:
        return "None"
    return "(" + ", ".join(v.isoformat(sep=" ", timespec="microseconds") if hasattr(v, "isoformat") else repr(v)
                           for v in r) + ")"


def relevant_ops(ctx, limit=200):
    ids, subjs = set(), set()
    for inv, vs in ctx.violations.items():
        for msg, c in vs:
            if "id" in c and c.get("db"):
                ids.add((c["db"], c["id"]))
            if "other" in c and c.get("db") and isinstance(c["other"], int):
                ids.add((c["db"], c["other"]))
            if c.get("subj") and c.get("db"):
                subjs.add((c["db"], c["subj"]))
    out = []
    wtxs = set()
    for r in ctx.ops:
        db = r.get("db")
        if r.get("k") == "VIOLATION":
            continue
        hit = False
        if db is not None:
            if (db, r.get("id")) in ids:
                hit = True
            elif isinstance(r.get("ids"), list) and any((db, i) in ids for i in r["ids"]):
                hit = True
            elif (db, r.get("subj")) in subjs:
                hit = True
            elif isinstance(r.get("subjs"), list) and any((db, s) in subjs for s in r["subjs"] if s):
                hit = True
        if hit:
            out.append(r)
            if r.get("wtx"):
                wtxs.add(r["wtx"])
    # plus how the transactions that touched them ended
    seen = set(id(r) for r in out)
    for r in ctx.ops:
        if id(r) not in seen and r.get("wtx") in wtxs and r.get("k") in ("wbegin", "wcommit", "wrollback", "wabort"):
            out.append(r)
    out.sort(key=lambda r: r["n"])
    return out[-limit:]


# ---------------------------------------------------------------------------
# Cluster and main
# ---------------------------------------------------------------------------

def start_cluster(args):
    cmd = ["bash", PGCLUSTER, "start", args.cluster, str(args.port), "--preload"]
    for k, v in SERVER_SETTINGS.items():
        cmd += ["-c", f"{k}={v}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cannot start cluster {args.cluster}: {r.stdout}{r.stderr}")


def stop_cluster(args):
    subprocess.run(["bash", PGCLUSTER, "stop", args.cluster], capture_output=True)


def setup(ctx):
    c = ctx.connect("postgres", "setup")
    c.execute("SET client_min_messages = warning")
    for db in DBS:
        if db != "postgres":
            c.execute(f"DROP DATABASE IF EXISTS {db}")
            c.execute(f"CREATE DATABASE {db}")
    s = c.execute("SELECT current_setting('outbox.maintenance_interval'), current_setting('track_commit_timestamp'), "
                  "current_setting('max_prepared_transactions'), current_setting('outbox.databases')").fetchone()
    log(f"server: maintenance_interval={s[0]} track_commit_timestamp={s[1]} "
        f"max_prepared_transactions={s[2]} outbox.databases={s[3]!r}")
    if s[1] != "on" or int(s[2]) < 16:
        raise RuntimeError("the server needs track_commit_timestamp=on and max_prepared_transactions >= 16")
    c.close()
    for db in DBS:
        c = ctx.connect(db, "setup")
        c.execute("SET client_min_messages = warning")
        c.execute("DROP EXTENSION IF EXISTS outbox_ext CASCADE")
        c.execute("DROP SCHEMA IF EXISTS outbox CASCADE")
        c.execute("CREATE EXTENSION outbox_ext")
        v = c.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0]
        for t, a in TOPICS.items():
            if a:
                c.execute("SELECT outbox.create_topic(%s, max_attempts => %s, backoff_base => %s::interval, "
                          "backoff_max => %s::interval, default_lease => %s::interval, dead_letter_policy => %s)",
                          (t, a["max_attempts"], a["backoff_base"], a["backoff_max"], a["default_lease"],
                           a["dead_letter_policy"]))
        c.close()
    log(f"extension outbox_ext {v} in databases {', '.join(DBS)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60, help="seconds of load (default 60)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--publishers", type=int, default=5)
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--stall", type=float, default=25, help="drain gives up after this many seconds without progress")
    ap.add_argument("--drain-max", type=float, default=120, help="longest drain, seconds")
    ap.add_argument("--cluster", default="outbox-checker")
    ap.add_argument("--port", type=int, default=5482)
    ap.add_argument("--no-cluster", action="store_true",
                    help="use the server already running on 127.0.0.1:--port (its outbox schema is re-created)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running")
    ap.add_argument("--logdir", default=None)
    ap.add_argument("--deadline", type=float, default=None,
                    help="hard limit for the whole run in seconds (default: duration + drain-max + 180)")
    ap.add_argument("--big-ack", type=int, default=5000,
                    help="bigops acks one database's big events in one batch once it has this many")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    print(f"seed {args.seed}", flush=True)
    logdir = args.logdir or tempfile.mkdtemp(prefix="outbox-checker-")
    os.makedirs(logdir, exist_ok=True)

    def on_term(*_):
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, on_term)
    owned = not args.no_cluster
    hard_deadline = time.time() + (args.deadline or args.duration + args.drain_max + 180)
    watchdog = threading.Timer(max(10.0, hard_deadline - time.time()), lambda: os.kill(os.getpid(), signal.SIGTERM))
    watchdog.daemon = True
    watchdog.start()
    ctx = None
    try:
        if owned:
            start_cluster(args)
        ctx = Ctx(args, logdir)
        setup(ctx)
        log(f"checker: {args.duration:.0f}s of load, {args.publishers} publishers, {args.workers} workers, "
            f"operator, resolver, idler, bigops, sampler; databases {DBS}; log {logdir}/ops.jsonl")
        threads = []
        for i in range(args.publishers):
            threads.append(threading.Thread(target=publisher, args=(ctx, i), name=f"pub{i}", daemon=True))
        for i in range(args.workers):
            threads.append(threading.Thread(target=worker, args=(ctx, i), name=f"worker{i}", daemon=True))
        threads.append(threading.Thread(target=operator, args=(ctx,), name="operator", daemon=True))
        threads.append(threading.Thread(target=idler, args=(ctx,), name="idler", daemon=True))
        threads.append(threading.Thread(target=bigops, args=(ctx,), name="bigops", daemon=True))
        threads.append(threading.Thread(target=scenario_replay, args=(ctx,), name="scen-replay", daemon=True))
        threads.append(threading.Thread(target=scenario_lowwater, args=(ctx,), name="scen-lowwater", daemon=True))
        res_t = threading.Thread(target=resolver, args=(ctx,), name="resolver", daemon=True)
        samp_done = threading.Event()
        samp_ts = [threading.Thread(target=sampler, args=(ctx, samp_done, db), name=f"sampler-{db}", daemon=True)
                   for db in DBS]
        for t in threads + [res_t] + samp_ts:
            t.start()
        t0 = time.time()
        while time.time() - t0 < args.duration:
            time.sleep(min(5, args.duration - (time.time() - t0)) if args.duration > time.time() - t0 else 0)
            el = time.time() - t0
            if int(el) % 15 < 5:
                log(f"  {el:.0f}s: {ctx.count['publish calls'] + ctx.count['publish_batch calls']} publish calls, "
                    f"{ctx.count['claimed events']} claimed, {ctx.count['acks true']} acks, "
                    f"errors {dict(ctx.errors)}, violations {sum(len(v) for v in ctx.violations.values())}")
        log("load stopped; quiescing")
        quiesce(ctx, threads, res_t)
        an = Analysis(ctx)
        an.outcomes()

        dt = drain(ctx)
        time.sleep(0.3)
        samp_done.set()
        for t in samp_ts:
            t.join(5)
        an.run()
        report(ctx, an, dt)
        failed = sum(1 for inv in INVARIANTS if ctx.violations.get(inv))
        print(f"{len(INVARIANTS) - failed} passed, {failed} failed", flush=True)
        return 1 if failed else 0
    except SystemExit as e:
        print(f"checker: interrupted ({e.code})", flush=True)
        print("0 passed, 1 failed", flush=True)
        return 2
    except Exception:
        traceback.print_exc()
        print("0 passed, 1 failed", flush=True)
        return 2
    finally:
        if ctx is not None:
            ctx.stop.set()
            ctx.quiescing.set()
            try:
                ctx.f.flush()
            except Exception:
                pass
            for c in list(ctx.conns):
                try:
                    c.close()
                except Exception:
                    pass
        if owned and not args.keep:
            stop_cluster(args)
        watchdog.cancel()


def report(ctx, an, drain_time):
    cnt = ctx.count
    pubs = Counter(an.pub_status.values())
    log(f"seed {ctx.args.seed}")
    log(f"events: {len(an.committed)} committed events; publisher transactions {dict(pubs)} "
        f"(client view: commits {cnt['publisher commits']}, rollbacks {cnt['publisher rollbacks']}, "
        f"savepoint rollbacks {cnt['savepoint rollbacks']}, retries {cnt['publisher retries']}); "
        f"2PC prepared {cnt['2pc prepared']}, committed {cnt['2pc committed']}, rolled back {cnt['2pc rolled back']}")
    log(f"workers: claims {cnt['claims']} ({cnt['claimed events']} events), acks true {cnt['acks true']} "
        f"(+{cnt['acks true (in tx)']} in explicit tx), acks false {cnt['acks false']}, batch acks {cnt['batch acks']}, "
        f"fails pending {cnt['fails pending']} dead {cnt['fails dead']} stale {cnt['fails stale']}, "
        f"extend_lease {cnt['extend_lease']}, left to expire {cnt['leases left to expire']}, "
        f"worker tx commits {cnt['worker commits']} rollbacks {cnt['worker rollbacks']}")
    log(f"operator: cancels {cnt['cancels']} (+{cnt['cancels in worker tx']} in worker tx), replays {cnt['replays']}, "
        f"replay_dead {cnt['replay_dead calls']}, alter_topic {cnt['alter_topic']}, idle RR {cnt['idle RR transactions']}, "
        f"big publish_batch {cnt['big publish_batch']} (refused {cnt['big publish_batch refused (54000)']}), "
        f"big batch acks {cnt['big batch acks']}; drain {drain_time:.1f}s, replays {cnt['drain replays']}, "
        f"replay_dead {cnt['drain replay_dead']}")
    log(f"errors by SQLSTATE: {dict(sorted(ctx.errors.items()))}; lock-wait samples {cnt['lock-wait samples']}")
    log(f"order check: {an.order_stats}")
    for inv in INVARIANTS:
        vs = ctx.violations.get(inv, [])
        if not vs:
            log(f"  {inv}: ok")
            continue
        log(f"  {inv}: FAILED ({len(vs)} violations)")
        # group repeats (same message apart from numbers); show each kind once
        groups = {}
        for msg, c in vs:
            key = re.sub(r"\d+", "N", msg)[:160]
            groups.setdefault(key, []).append((msg, c))
        shown = 0
        # backtrace reports last: they repeat other errors
        for key, items in sorted(groups.items(), key=lambda kv: kv[0].startswith("backtrace")):
            for msg, c in items[:(25 if inv in ("delivery", "subject_order") else 1 if "backtrace" in key else 2)]:
                shown += 1
                if shown > 60:
                    break
                log(f"      {msg}")
                for k in ("events_row", "queue_row", "low_water", "detail"):
                    if c.get(k):
                        text = [t.strip() for t in str(c[k]).strip().splitlines() if t.strip()]
                        bt = [i for i, t in enumerate(text) if re.match(r"^\d+: ", t)]
                        if bt:  # a Rust backtrace: show its start only
                            text = text[:bt[0]] + text[bt[0]:bt[0] + 8] + [f"... ({len(bt)} frames)"]
                        log(f"          {k}: " + " | ".join(text[:16]))
            if len(items) > 2 and inv not in ("delivery", "subject_order"):
                log(f"      ... {len(items)} times in all (like the above)")
    if any(ctx.violations.get(inv) for inv in INVARIANTS):
        rel = relevant_ops(ctx)
        log(f"full operation log: {os.path.join(ctx.logdir, 'ops.jsonl')}; last {len(rel)} operations "
            f"on the violating events/subjects:")
        for r in rel:
            print("    " + json.dumps(r, separators=(",", ":"), default=str), flush=True)


if __name__ == "__main__":
    sys.exit(main())
