#!/usr/bin/env python3
"""Seeded randomized concurrency checker for outbox_ext: liveness and safety.

Sessions (threads, one psycopg 3 connection per thread and database) drive a random,
seeded mix of operations against a preloaded cluster with maintenance OFF
(outbox.maintenance_interval = 0), in two databases, `postgres` and `other`, each
served by its own background worker. Each database has three subscriptions: `default`
(as the install made it) and two named ones, created before any load starts, so
every committed event of the run is theirs: sub_a (every topic; the topics' and the
GUCs' policy) and sub_b (a topic filter; max_attempts 2, its own backoff and lease,
dead letters under 'skip'):

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
              transactions (READ COMMITTED or REPEATABLE READ: a claim refuses
              SERIALIZABLE with 0A000) that claim again, ack, fail,
              cancel, hold the transaction and then commit or roll back
  sworkers    workers of the named subscriptions: autocommit claims with
              subscription => (small ones, ones narrowed with topics, bulk ones
              acked with one ack(ids[], tokens[])) + ack / array ack / fail (retry,
              permanent) / extend_lease / leases left to expire / slow acks; claims
              inside explicit transactions (READ COMMITTED or REPEATABLE READ) that claim again,
              ack, fail, cancel and commit or roll back; late acks with old tokens
              (of leases left to expire, and of claims that rolled back)
  operator    cancel, cancel + replay of a queued event (the replay held open a
              moment), replay of dead events, replay_dead(), alter_topic switching
              dead_letter_policy block/skip and max_attempts
  soperator   the named subscriptions' operator: replay(id, sub) of dead letters,
              replay_dead(pattern, since, until, dry_run, sub), cancel(id, sub) of
              events held per event (and of others: false), replay of cancelled
              events, alter_subscription(sub_a, max_attempts)
  idler       sessions idle in a REPEATABLE READ transaction
  bigops      publish_batch with 200-2000 distinct subjects (past
              outbox.max_subject_locks the call takes the coarse subject lock) and claim + one batch ack of
              thousands of events with distinct subjects
  scenarios   a targeted race in the mix: replay of a cancelled event (waiting in
              its head's batch) while its subject's head is acked
  sampler     pg_stat_activity every 50 ms: any backend running outbox.claim that
              waits on a Lock (with its blockers and the lock it waits for)

`default` is served like the named subscriptions: the workers' claims, acks (a
batch ack is one ack(ids[], tokens[])), fails and cancels in transactions use it;
the operator runs the named operator's actions for it (with NULL as subscription;
its alter_topic sets its policy); the named workers claim it too; bigops and the
scenario run against it. Every subscription's operator also cancels events not
read yet (the newest published) or waiting in a batch (a later event of a subject
just handed out), sometimes replayed (in autocommit, or in a transaction held
open, sometimes rolled back).

Every CYCLE (12 s) the load calms down for CALM (3.5 s): no long transaction holds an
xid then, so the lanes' windows close.

Claims run with lock_timeout = 2 s (55P03 in claim is a violation) and
statement_timeout = 10 s. Then the checker quiesces: load stops, every prepared
transaction is resolved, every open transaction ends; without any maintenance
(never run_maintenance, purge, _purge_step) every dead and
cancelled event is replayed (for a named subscription: replay(id, sub) of its rows of
outbox.deliveries in state dead or cancelled) and plain autocommit claim + ack workers,
one per database and subscription, drain until every committed event is acked in
every subscription or nothing moved for --stall seconds. The journal records every
claim (events, tokens, attempts, when it returned), ack (token, outcome) and
transaction; transaction outcomes come from pg_xact_status of each transaction's xid,
commit order from pg_xact_commit_timestamp (track_commit_timestamp = on). Invariants,
checked for `default`, sub_a and sub_b alike:

  server_errors     no unexpected server error (XX000, 53200, a timeout in claim, a
                    lost connection, a Rust backtrace in a DETAIL, ...)
  delivery          every committed event of the subscription's topics is acked
                    exactly once (ack() = true in a committed transaction; an array
                    ack of a named subscription that acked only some of its events
                    counts as unknown); a committed event never acked is "stranded"
                    and printed with its row of outbox.deliveries, whether the log
                    holds it, and the subscription's counters; an acked event is 'delivered' there; no claim returns
                    an event outside the subscription's topics or the claim's own
                    topics; outbox.log holds every committed event
  uncommitted       claim never returned, and no table holds (outbox.events,
                    outbox.log, the named subscriptions' per-event rows), an event
                    of a rolled-back transaction, savepoint or prepared transaction
  subject_order     per subject, committed acks follow the publishers' commit order;
                    an event is handed out (by a claim whose transaction committed)
                    only after the subject's previous event's ack committed, unless
                    its own transaction acked that event first; one claim never
                    returns two events of one subject (events that were ever
                    cancelled, or went dead where the 'skip' policy applied at some
                    point, are left out: for a named subscription, events fail()
                    reported dead and events replay()/replay_dead() brought back)
  fencing           an ack that returned true (in a committed transaction) used a
                    token handed out for that event by a claim that did not roll
                    back, and no committed claim handed the event out again between
                    that claim and the ack
  cancel            a cancel() that returned true holds from its commit until a
                    replay: no claim that started after the commit (whatever its
                    transaction did) returns the event, and no ack started then
                    returns true in a committed transaction, unless a replay() of
                    it that returned true overlapped (conservative: one rolled back
                    counts); the drain's replays then deliver it exactly once
  claim_no_wait     no claim waited on a lock (sampled) or hit lock_timeout
  dispatch_keys     re-publishing a committed dispatch key returns its event id

Opt-in modes (issue 40; none is on by default, and checker.sh runs none), each adding
load that the invariants above then cover, and any of them combinable:

  --txn-holders     two more workers, on `default` and on sub_a: BEGIN, claim 1-5 events
                    (leases of 1-10 s), hold the transaction open and idle 2-8 s, ack
                    in it (a tenth: fail) and COMMIT, or ROLLBACK (a fifth); journaled
                    as worker_tx is. Prints how many of the other workers' claims came
                    back empty during a hold, and of those how many left a ready event
                    (no subject, no delay, committed before the claim began, first
                    handed out after it ended: approximate, by wall clock)
  --bulk-publisher  a publisher whose transaction publishes 5,000-20,000 events
                    (publish_batch calls of 2,500; topics chk.fast, chk.slow, chk.unreg,
                    chk.big; a tenth with subjects of a pool of 40 of its own), stays
                    open 5-15 s and commits (4 in 5) or rolls back. Its drain is long:
                    give it --drain-max 300
  --max-lag         one more named subscription, sub_l (every topic, max_lag 2 s), whose
                    only worker is slow (0.5-3 s per claim, some tokens reported 3-8 s
                    later), while a thread per database runs the log's retention step
                    (outbox._log_rotate() until it returns 0, retention_delivered 1 s)
                    every 0.5 s, and another keeps the other subscriptions up with the
                    load (claims of 500, one array ack), so that ring tables get
                    truncated behind sub_l. Invariant max_lag: per database, sub_l's committed
                    events never acked are no more than its lost_events (delivered +
                    lost >= committed); a fail() of an event it never got returned
                    'stale'; the subscriptions without max_lag lost nothing (and keep
                    every invariant above; the log check then accepts committed events
                    retention removed, whose rows come from the journal). A claim
                    waiting for the truncation's lock is counted, not a violation
  --serializable    two workers whose sessions default to SERIALIZABLE: a claim in
                    autocommit or after BEGIN ISOLATION LEVEL SERIALIZABLE must be
                    refused at once with 0A000 (contract item 3); they then claim at
                    READ COMMITTED and ack / fail / extend_lease + ack in SERIALIZABLE
                    transactions, run again whole on 40001 (at a call or at COMMIT);
                    publishers pick SERIALIZABLE half the time. Invariant serializable:
                    a claim at SERIALIZABLE that returns rows or fails otherwise.
                    Prints 40001/40P01 by call (claim, ack, fail, extend_lease,
                    publisher transaction (publish / commit), commit) and the 0A000s

Usage:
  .venv/bin/python pg_test/suites/checker.py --duration 60 --seed 1     # own cluster
  .venv/bin/python pg_test/suites/checker.py --duration 1800 --seed 7   # long run
  .venv/bin/python pg_test/suites/checker.py --port 5491 --no-cluster   # running server
  .venv/bin/python pg_test/suites/checker.py --duration 90 --seed 1 --txn-holders --serializable
The last line is `N passed, N failed`; exit 1 on any violation, 2 if the checker
itself broke. The full operation log is written to <logdir>/ops.jsonl.
"""

import argparse
import bisect
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
# Where a transaction claims: a claim at SERIALIZABLE is refused (0A000).
CLAIM_ISOS = ["READ COMMITTED", "REPEATABLE READ"]
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
    "chk.rp": dict(max_attempts=10, backoff_base="10 ms", backoff_max="200 ms", default_lease="2 s",
                   dead_letter_policy="block"),
}
PUB_TOPICS = ["chk.fast", "chk.skip", "chk.slow", "chk.unreg"]
WORK_TOPICS = PUB_TOPICS
NSUBJECTS = 10
EPOCH = 15.0
# Named subscriptions (0.9.0), created in every database before any load starts, so
# every committed event of the run is theirs (when its topic matches). sub_a takes
# every topic (the big and replay scenarios' too) with the topics' and the
# GUCs' policy; sub_b has a topic filter and a policy of its own: two attempts,
# short backoff and lease, dead letters that let their subject go on ('skip').
NAMED = {
    "sub_a": dict(topics=None, max_attempts=None, backoff_base=None, backoff_max=None, default_lease=None,
                  dead_letter_policy=None),
    "sub_b": dict(topics=["chk.fast", "chk.skip", "chk.slow", "chk.unreg"], max_attempts=2,
                  backoff_base="10 ms", backoff_max="100 ms", default_lease="400 ms", dead_letter_policy="skip"),
}
SUBS = ["default"] + list(NAMED)
# The named subscriptions the load threads (sworker, soperator, serializable workers) serve.
LOADED = list(NAMED)
# --max-lag: one more subscription, with an age cap, served only by a slow worker
# (lagger) while a thread runs the log's retention step (rotator); added to NAMED and
# SUBS by main(), so the drain and the analysis cover it.
LAG_SUB = "sub_l"
LAG_SPEC = dict(topics=None, max_attempts=None, backoff_base=None, backoff_max=None, default_lease="2 s",
                dead_letter_policy=None, max_lag="2 s")


def subarg(sub):
    """The subscription argument of claim/cancel/replay: NULL for 'default'."""
    return None if sub in (None, "default") else sub


def topic_matches(topic, patterns):
    """claim()'s topic patterns: exact names, prefixes ending in '.*', '*'; None = all."""
    if patterns is None:
        return True
    return any(p == "*" or p == topic or (p.endswith(".*") and topic.startswith(p[:-1])) for p in patterns)


CYCLE = 12.0      # every CYCLE seconds the load calms down for the last CALM seconds:
CALM = 3.5        # no long transaction holds an xid then, so the log's windows close
QUIET_BEFORE = 3.0  # (long holders stop QUIET_BEFORE seconds earlier)


def phase():
    return time.time() % CYCLE


def calm():
    return phase() >= CYCLE - CALM


def quiet():
    """No new long-held transaction now (it could still run into the calm window)."""
    return phase() >= CYCLE - CALM - QUIET_BEFORE


def pick_db(rnd):
    return rnd.choice(DBS)


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
INVARIANTS = ["server_errors", "delivery", "uncommitted", "subject_order", "fencing", "cancel", "claim_no_wait",
              "dispatch_keys"]
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
        self.drain_stop = threading.Event()  # the drain ran out of its budget: its sessions end
        self.lock = threading.Lock()
        self.seq = 0
        self.ops = []
        self.f = open(os.path.join(logdir, "ops.jsonl"), "w", buffering=1 << 16)
        self.count = Counter()
        self.errors = Counter()
        self.violations = defaultdict(list)
        self.pubtx = {}           # tag -> tx record
        self.pubops = {}          # pk "tag.k.j" -> (tag, k, j)
        self.clock = 0            # journal clock: tick() orders claims, acks and commits
        self.wtx = {}             # worker tx tag -> {db, xid, client[, tx, cseq]}
        # (db, id, wtxtag, ok, sub, token, ack start tick); ok None: an array ack of a
        # named subscription that acked some of its events, not known which
        self.acks = []
        # (db, id, pk, wtxtag, sub, token, attempt, subject, claim end time, claim end tick)
        self.claimed = []
        # per subscription ('default', 'sub_a', ...): sets of (db, id)
        self.cancelled = defaultdict(set)      # cancel() returned true (any outcome)
        self.replayed = defaultdict(set)       # replay() returned true, or replay_dead() replayed it
        self.dead_reported = defaultdict(set)  # fail() returned 'dead'
        # cancel() = true: (db, sub, id, wtx of its transaction or None (autocommit),
        # tick before the call, tick after it returned); replay() = true, whatever its
        # transaction did: (db, sub, id, tick before, tick after its transaction ended)
        self.cancel_log = []
        self.replay_log = []
        self.recent_pub = {db: [] for db in DBS}   # (id, topic, subject) as publish returned them
        self.pub_by_subject = {db: defaultdict(list) for db in DBS}   # subject -> ids, publish order
        self.big_out = Counter()   # big events committed, not yet acked (bigops)
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
        self.holds = []           # --txn-holders: (db, sub, claim end, transaction end) of each hold
        self.claim_wall = []      # --txn-holders: (db, sub, worker, start, end, ids, topics) of every claim

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

    def tick(self):
        with self.lock:
            self.clock += 1
            return self.clock

    def note_cancel(self, db, sub, eid, t0, wtx=None):
        """cancel() returned true (in wtx's transaction, or in autocommit when None)."""
        t1 = self.tick()
        with self.lock:
            self.cancelled[sub].add((db, eid))   # conservative: the transaction may roll back
            self.cancel_log.append((db, sub, eid, wtx, t0, t1))

    def note_replay_try(self, db, sub, eid, t0):
        """replay() returned true; called once its transaction ended (either way)."""
        t1 = self.tick()
        with self.lock:
            self.replay_log.append((db, sub, eid, t0, t1))

    def note_pub(self, db, ids, topic, subjects):
        with self.lock:
            for i, eid in enumerate(ids):
                subj = subjects[i] if subjects else None
                self.recent_pub[db].append((eid, topic, subj))
                if subj is not None:
                    self.pub_by_subject[db][subj].append(eid)
            if len(self.recent_pub[db]) > 2000:
                del self.recent_pub[db][:1000]

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
        if st in RETRY:   # counted by call (and the stage of a transaction: publish, commit)
            with self.lock:
                self.count[f"{st} at {where}" + (f" ({ctx['stage']})" if ctx.get("stage") else "")] += 1
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

    def recover(self, db, c, ex):
        """After an error on connection c of db: drop a lost connection, else
        roll back what it left open."""
        if c is None or is_conn_error(ex):
            self.drop(db)
        else:
            safe_rollback(c)

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
    iso = rnd.choices(ISOS, weights=[3, 2, 5] if ctx.args.serializable else [5, 3, 2])[0]
    mode = rnd.choices(["commit", "rollback", "2pc", "hold"], weights=[60, 10, 18, 12])[0]
    if quiet() and mode in ("2pc", "hold"):
        mode = "commit"
    tx = {"tag": tag, "db": db, "iso": iso, "mode": mode, "ops": [], "xid": None, "client": None}
    with ctx.lock:
        ctx.pubtx[tag] = tx
    first_subject = None
    stage = "publish"
    try:
        c.execute(f"BEGIN ISOLATION LEVEL {iso}")
        if iso != "READ COMMITTED" and rnd.random() < 0.7 and not quiet():
            # Read first (the snapshot), publish later: the subject's head, leased now,
            # may be acked in between.
            pool = subjects_now()
            # a subject a claim handed out lately
            with ctx.lock:
                hot = sorted(set(r[7] for r in ctx.claimed[-300:] if r[0] == db and r[7] in pool))
            row = (rnd.choice(hot),) if hot else None
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
        stage = "commit"
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
        st = ctx.server_error(ex, "publisher transaction", tag=tag, db=db, stage=stage)
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
    ctx.note_pub(db, [eid], topic, [subject])
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
    ctx.note_pub(db, ids, topic, subjects)
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
             "FROM outbox.claim(%s, %s, %s::interval, %s::text[], %s)")
WORKER_SETTINGS = ["SET lock_timeout = '2s'", "SET statement_timeout = '10s'"]
# The drain also reads outbox.deliveries and outbox.subscriptions, monitoring views whose
# cost grows with the log: after a long run (600 s of load, 300,000 events) a drain's
# first read of them took over 10 s, and with the workers' timeout the drain gave up.
DRAIN_SETTINGS = ["SET lock_timeout = '2s'", "SET statement_timeout = '120s'"]


def claim(ctx, c, db, wname, wtx, batch, lease, topics, sub=None, accepted=()):
    """One claim call (sub None: 'default'). Journals every event handed out with its
    token, attempt, and when the call returned (wall clock and journal tick).
    accepted: SQLSTATEs expected here (0A000 at SERIALIZABLE)."""
    sname = sub or "default"
    ctx.inc("claims" if sub is None else "named claims")
    t_start = ctx.tick()
    w_start = time.time()
    try:
        rows = c.execute(CLAIM_SQL, (wname, batch, lease, topics, sub)).fetchall()
    except psycopg.Error as ex:
        st = getattr(ex, "sqlstate", None)
        if st == "55P03":
            ex._chk_seen = True
            ctx.violation("claim_no_wait", f"claim ({sname}) hit lock_timeout (55P03) in {db}: "
                          f"{str(ex).strip()[:200]}", db=db, wtx=wtx, sub=sname)
            ctx.inc("claim lock_timeout")
            ctx.op(k="error", where="claim", st=st, db=db, wtx=wtx, sub=sname)
            with ctx.lock:
                ctx.errors[st] += 1
        else:
            ctx.server_error(ex, "claim", db=db, wtx=wtx, sub=sname, accepted=accepted)
        raise
    t_end = time.time()
    seq = ctx.tick()
    ids = [r[0] for r in rows]
    if ctx.args.txn_holders:
        with ctx.lock:
            ctx.claim_wall.append((db, sname, wname, w_start, t_end, ids, topics))
    with ctx.lock:
        for r in rows:
            ctx.claimed.append((db, r[0], r[3], wtx, sname, str(r[5]), r[4], r[2], t_end, seq, t_start))
    ctx.inc("claimed events" if sub is None else "named claimed events", len(rows))
    if rows:
        ctx.op(k="claim", db=db, wtx=wtx, sub=sname, ids=ids, subjs=[r[2] for r in rows], att=[r[4] for r in rows],
               tok=sorted(set(str(r[5]) for r in rows)) if sub else None)
        subjs = [r[2] for r in rows if r[2] is not None]
        if len(subjs) != len(set(subjs)):
            dup = [s for s, k in Counter(subjs).items() if k > 1]
            ctx.violation("subject_order", f"[{sname}] one claim in {db} returned two events of subject {dup[0]}: "
                          f"{[(r[0], r[2]) for r in rows if r[2] in dup][:10]}", db=db, subj=dup[0], wtx=wtx, sub=sname)
        want = NAMED[sub]["topics"] if sub else None
        bad = [(r[0], r[1]) for r in rows if not topic_matches(r[1], want) or not topic_matches(r[1], topics)]
        if bad:
            ctx.violation("delivery", f"[{sname}] claim in {db} with topics {topics} returned events of other topics: "
                          f"{bad[:10]}", db=db, id=bad[0][0], wtx=wtx, sub=sname)
    return rows


def ack_auto(ctx, c, db, wname, row, sub=None):
    sname = sub or "default"
    eid, tok = row[0], row[5]
    wtx = f"{wname}-a{eid}-{time.monotonic_ns()}"
    seq = ctx.tick()
    try:
        ok, xid = c.execute("SELECT s.a, pg_current_xact_id_if_assigned()::text "
                            "FROM (SELECT outbox.ack(%s, %s) AS a OFFSET 0) s", (eid, tok)).fetchone()
    except psycopg.Error as ex:
        ctx.server_error(ex, "ack", db=db, id=eid, sub=sname, accepted=("55P03",))
        if is_conn_error(ex):
            with ctx.lock:  # the outcome is unknown
                ctx.wtx[wtx] = {"db": db, "xid": None, "client": "unknown"}
                ctx.acks.append((db, eid, wtx, True, sname, str(tok), seq))
        raise
    end = ctx.tick()
    with ctx.lock:
        ctx.wtx[wtx] = {"db": db, "xid": xid, "client": "commit", "end": end}
        ctx.acks.append((db, eid, wtx, bool(ok), sname, str(tok), seq))
    if sub is None:
        ctx.inc("acks true" if ok else "acks false")
    else:
        ctx.inc("named acks true" if ok else "named acks false")
    ctx.op(k="ack", db=db, id=eid, ok=ok, wtx=wtx, xid=xid, subj=row[2], sub=sname, tok=str(tok) if sub else None)
    return ok


def fail_call(ctx, c, db, row, permanent, wtx, sub=None):
    sname = sub or "default"
    eid, tok = row[0], row[5]
    err = "checker: permanent" if permanent else "checker: transient"
    try:
        res = c.execute("SELECT outbox.fail(%s, %s, %s, NULL, %s)", (eid, tok, err, permanent)).fetchone()[0]
    except psycopg.Error as ex:
        ctx.server_error(ex, "fail", db=db, id=eid, sub=sname, accepted=("55P03",))
        raise
    if res == "dead":
        with ctx.lock:
            ctx.dead_reported[sname].add((db, eid))
    ctx.inc(f"fails {res}" if sub is None else f"named fails {res}")
    ctx.op(k="fail", db=db, id=eid, perm=permanent, res=res, wtx=wtx, subj=row[2], sub=sname)
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
            s.recover(db, c, ex)
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
    """Batch ack in its own transaction: one ack(ids[], tokens[]), as for a named
    subscription."""
    return ack_array_named(ctx, c, db, rows, wtx, "default")


def worker_tx(ctx, rnd, c, db, wname, n):
    """Claims inside an explicit transaction that may roll back."""
    wtx = f"{wname}-t{n}"
    iso = rnd.choices(CLAIM_ISOS, weights=[6, 4])[0]
    rec = {"db": db, "xid": None, "client": None, "iso": iso, "tx": True}
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
                # a recent event, often not read yet or waiting in a batch
                eid = pick_fresh(ctx, rnd, db, "default")
                eid = (eid,) if eid else None
                if eid:
                    t0 = ctx.tick()
                    ok = c.execute("SELECT outbox.cancel(%s)", (eid[0],)).fetchone()[0]
                    if ok:
                        ctx.note_cancel(db, "default", eid[0], t0, wtx)
                    ctx.inc("cancels in worker tx")
                    ctx.op(k="cancel", db=db, id=eid[0], ok=ok, wtx=wtx)
            for row in rows:
                a = rnd.random()
                stage = "ack/fail"
                if a < 0.6:
                    seq = ctx.tick()
                    ok = c.execute("SELECT outbox.ack(%s, %s)", (row[0], row[5])).fetchone()[0]
                    acks.append((row[0], bool(ok), str(row[5]), seq))
                    ctx.op(k="ack", db=db, id=row[0], ok=ok, wtx=wtx, subj=row[2], intx=True)
                elif a < 0.72:
                    fail_call(ctx, c, db, row, rnd.random() < 0.15, wtx)
            if r + 1 < rounds:
                time.sleep(rnd.uniform(0.012, 0.04))
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
            rec["cseq"] = ctx.tick()
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
            for eid, ok, tok, seq in acks:
                ctx.acks.append((db, eid, wtx, ok, "default", tok, seq))
        ctx.inc("acks true (in tx)", sum(1 for _, ok, _, _ in acks if ok))


# ---------------------------------------------------------------------------
# Named subscriptions: workers and operator
# ---------------------------------------------------------------------------

def lease_s(sub, lease):
    if lease is not None:
        return float(lease.split()[0]) / (1000.0 if lease.endswith("ms") else 1.0)
    dl = NAMED[sub]["default_lease"] if sub in NAMED else None
    return lease_s(sub, dl) if dl else 1.0   # else outbox.default_lease (SERVER_SETTINGS)


def narrowed(rnd):
    """claim()'s topics for a named subscription: mostly none (the subscription's own
    filter), sometimes narrowed (what it leaves goes to the exception table)."""
    r = rnd.random()
    if r < 0.85:
        return None
    if r < 0.88:
        return ["chk.*"]
    return rnd.sample(WORK_TOPICS, rnd.randint(1, 3))


def ack_array_named(ctx, c, db, rows, wtx, sub):
    """ack(ids[], tokens[]) for a named subscription, autocommit. The count says which
    events it acked only when it is 0 or all of them; otherwise the acks are recorded
    as ambiguous (neither counted as deliveries nor as missing)."""
    ids = [r[0] for r in rows]
    toks = [r[5] for r in rows]
    seq = ctx.tick()
    try:
        cnt, xid = c.execute("SELECT s.n, pg_current_xact_id_if_assigned()::text FROM "
                             "(SELECT outbox.ack(%s::bigint[], %s::uuid[]) AS n OFFSET 0) s", (ids, toks)).fetchone()
    except psycopg.Error as ex:
        ctx.server_error(ex, "array ack", db=db, n=len(ids), wtx=wtx, sub=sub, accepted=("55P03",))
        if is_conn_error(ex):
            with ctx.lock:
                ctx.wtx[wtx] = {"db": db, "xid": None, "client": "unknown"}
                for i, tok in zip(ids, toks):
                    ctx.acks.append((db, i, wtx, True, sub, str(tok), seq))
        raise
    if cnt < 0 or cnt > len(ids):
        ctx.violation("delivery", f"[{sub}] array ack of {len(ids)} events returned {cnt}", db=db, ids=ids[:50], sub=sub)
    ok = True if cnt == len(ids) else False if cnt == 0 else None
    end = ctx.tick()
    with ctx.lock:
        ctx.wtx[wtx] = {"db": db, "xid": xid, "client": "commit", "end": end}
        for i, tok in zip(ids, toks):
            ctx.acks.append((db, i, wtx, ok, sub, str(tok), seq))
    ctx.inc("named array acks")
    ctx.inc("named acks true", cnt)
    if ok is None:
        ctx.inc("named array acks partial (ambiguous)")
    ctx.op(k="ack_array", db=db, sub=sub, ids=ids if len(ids) <= 50 else f"{len(ids)} ids", acked=cnt, wtx=wtx, xid=xid)
    return cnt


def sworker(ctx, idx):
    """A worker of the named subscriptions: autocommit claims (small, narrowed, or bulk
    with one array ack) and claims in explicit transactions at every isolation level.
    Tokens of leases left to expire and of claims rolled back are kept and acked again
    later: a late ack is accepted only while nobody has been handed the event since."""
    rnd = random.Random(ctx.args.seed * 8009 + idx)
    wname = f"sw{idx}"
    s = Session(ctx, f"sworker{idx}", WORKER_SETTINGS)
    held = []   # (due, db, sub, row)
    n = 0
    while not ctx.stop.is_set():
        db = pick_db(rnd)
        # 'default' gets these workers' claims too (late acks, bulk)
        sub = rnd.choices(LOADED + ["default"], weights=[3, 2, 2])[0]
        n += 1
        c = None
        try:
            c = s.get(db)
            now = time.time()
            due = [h for h in held if h[0] <= now and h[1] == db]
            held = [h for h in held if not (h[0] <= now and h[1] == db) and h[0] > now - 10]
            for _, _, hsub, row in due[:8]:
                ok = ack_auto(ctx, c, db, wname, row, hsub)
                ctx.inc("named late acks " + ("true" if ok else "false"))
            if rnd.random() < 0.6:
                sworker_auto(ctx, rnd, c, db, sub, wname, n, held)
            else:
                sworker_tx(ctx, rnd, c, db, sub, wname, n, held)
        except psycopg.Error as ex:
            ctx.server_error(ex, "named worker", db=db, sub=sub)
            s.recover(db, c, ex)
            time.sleep(0.05)
        time.sleep(rnd.uniform(0, 0.03))
    s.close()


def sworker_auto(ctx, rnd, c, db, sub, wname, n, held):
    wtx = f"{wname}-c{n}"
    bulk = rnd.random() < 0.25
    with ctx.lock:
        ctx.wtx[wtx] = {"db": db, "xid": None, "client": "commit"}
    if bulk:
        # Big claims keep sub_a up with the big batches; one array ack for all of them.
        rows = claim(ctx, c, db, wname, wtx, rnd.randint(50, 400), "2 s", None, subarg(sub))
        if rows:
            ack_array_named(ctx, c, db, rows, f"{wname}-b{n}", sub)
        return
    lease = rnd.choice([None, None, "300 ms", "500 ms", "1 s"])
    rows = claim(ctx, c, db, wname, wtx, rnd.randint(1, 8), lease, narrowed(rnd), subarg(sub))
    if not rows:
        time.sleep(rnd.uniform(0.01, 0.05))
        return
    rest = []
    for row in rows:
        a = rnd.random()
        if a < 0.50:
            ack_auto(ctx, c, db, wname, row, sub)
        elif a < 0.62:
            fail_call(ctx, c, db, row, False, wtx, sub)
        elif a < 0.66:
            fail_call(ctx, c, db, row, True, wtx, sub)
        elif a < 0.71:
            try:
                until = c.execute("SELECT outbox.extend_lease(%s, %s, '1 s')", (row[0], row[5])).fetchone()[0]
            except psycopg.Error as ex:
                ctx.server_error(ex, "extend_lease", db=db, id=row[0], sub=sub, accepted=("55P03",))
                raise
            ctx.inc("named extend_lease")
            ctx.op(k="extend", db=db, id=row[0], ok=until is not None, sub=sub)
            ack_auto(ctx, c, db, wname, row, sub)
        elif a < 0.78:
            # Left to expire; its token is tried again after the lease (true only if no
            # claim has handed the event out again by then).
            ctx.inc("named leases left to expire")
            ctx.op(k="expire", db=db, id=row[0], sub=sub)
            held.append((time.time() + lease_s(sub, lease) + rnd.uniform(0.0, 1.5), db, sub, row))
        elif a < 0.81:
            time.sleep(rnd.uniform(0.2, 1.0))  # slow handler: the ack may be stale
            ack_auto(ctx, c, db, wname, row, sub)
        else:
            rest.append(row)
    if rest:
        ack_array_named(ctx, c, db, rest, f"{wname}-b{n}", sub)


def sworker_tx(ctx, rnd, c, db, sub, wname, n, held):
    """Claims of a named subscription inside an explicit transaction (READ COMMITTED
    or REPEATABLE READ) that acks, fails, cancels, claims again and commits or rolls back."""
    wtx = f"{wname}-t{n}"
    iso = rnd.choices(CLAIM_ISOS, weights=[5, 5])[0]
    rec = {"db": db, "xid": None, "client": None, "iso": iso, "tx": True}
    with ctx.lock:
        ctx.wtx[wtx] = rec
    acks = []
    handed = []
    stage = "begin"
    try:
        c.execute(f"BEGIN ISOLATION LEVEL {iso}")
        ctx.op(k="wbegin", db=db, wtx=wtx, iso=iso, sub=sub)
        rounds = rnd.choices([1, 2], weights=[6, 4])[0] if not quiet() else 1
        for r in range(rounds):
            stage = "claim"
            rows = claim(ctx, c, db, wname, wtx, rnd.randint(1, 6), rnd.choice([None, "500 ms", "1 s"]),
                         narrowed(rnd), subarg(sub))
            handed += rows
            if rnd.random() < 0.1:
                stage = "cancel: pick"
                # Not outbox.deliveries: it reads the whole log, which can outlast the
                # worker's statement_timeout (57014) while this transaction holds its
                # batches. One of the subscription's own rows (a retry, a delay, a parked
                # or dead event), or a recent event: often not read yet, or in a batch.
                if rnd.random() < 0.5:
                    row = c.execute("SELECT id FROM outbox.log_exceptions WHERE subscription = %s "
                                    "AND state IN ('pending', 'dead') ORDER BY random() LIMIT 1", (sub,)).fetchone()
                else:
                    eid = pick_fresh(ctx, rnd, db, sub)
                    row = (eid,) if eid else None
                if row:
                    stage = "cancel"
                    t0 = ctx.tick()
                    ok = c.execute("SELECT outbox.cancel(%s, %s)", (row[0], subarg(sub))).fetchone()[0]
                    if ok:
                        ctx.note_cancel(db, sub, row[0], t0, wtx)   # conservative: the tx may roll back
                    ctx.inc("named cancels in worker tx")
                    ctx.op(k="cancel", db=db, id=row[0], ok=ok, wtx=wtx, sub=sub)
            for row in rows:
                a = rnd.random()
                stage = "ack/fail"
                if a < 0.6:
                    seq = ctx.tick()
                    ok = c.execute("SELECT outbox.ack(%s, %s)", (row[0], row[5])).fetchone()[0]
                    acks.append((row[0], bool(ok), str(row[5]), seq))
                    ctx.op(k="ack", db=db, id=row[0], ok=ok, wtx=wtx, subj=row[2], intx=True, sub=sub)
                elif a < 0.72:
                    fail_call(ctx, c, db, row, rnd.random() < 0.15, wtx, sub)
            if r + 1 < rounds:
                time.sleep(rnd.uniform(0.012, 0.04))
        if not quiet():
            time.sleep(rnd.choice([0, 0, rnd.uniform(0.05, 0.4)]))
        stage = "end"
        rec["xid"] = c.execute("SELECT pg_current_xact_id_if_assigned()::text").fetchone()[0]
        if rnd.random() < 0.35:
            c.execute("ROLLBACK")
            rec["client"] = "rollback"
            ctx.inc("named worker rollbacks")
            ctx.op(k="wrollback", db=db, wtx=wtx, xid=rec["xid"], sub=sub)
            # Every token of a rolled-back claim must be refused (the claim never happened).
            for row in handed:
                held.append((time.time() + rnd.uniform(0.05, 1.0), db, sub, row))
        else:
            c.execute("COMMIT")
            rec["cseq"] = ctx.tick()
            rec["client"] = "commit"
            ctx.inc("named worker commits")
            ctx.op(k="wcommit", db=db, wtx=wtx, xid=rec["xid"], sub=sub)
    except psycopg.Error as ex:
        rec["client"] = "unknown" if is_conn_error(ex) and rec["xid"] else "error"
        ctx.server_error(ex, f"named worker transaction ({stage})", db=db, wtx=wtx, sub=sub,
                         accepted=("55P03",) if stage in ("cancel", "ack/fail") else ())
        safe_rollback(c)
        ctx.op(k="wabort", db=db, wtx=wtx, st=getattr(ex, "sqlstate", None), sub=sub)
        raise
    finally:
        with ctx.lock:
            for eid, ok, tok, seq in acks:
                ctx.acks.append((db, eid, wtx, ok, sub, tok, seq))
        ctx.inc("named acks true (in tx)", sum(1 for _, ok, _, _ in acks if ok))


def soperator(ctx):
    """The operator of the named subscriptions: replay(id, sub) of dead letters,
    replay_dead(pattern, since, until, dry_run, sub), cancel(id, sub) of events held
    per event (and of ones it does not hold: false), replay of cancelled events,
    alter_subscription of sub_a's max_attempts; with --default-on-log also cancels of
    events not read yet or waiting in a batch (cancel_fresh). Which events replay_dead
    replayed is read back from the exception rows its transaction wrote (xmin)."""
    rnd = random.Random(ctx.args.seed * 9001)
    s = Session(ctx, "soperator", ["SET statement_timeout = '30s'"])
    while not ctx.stop.is_set():
        db = pick_db(rnd)
        sub = rnd.choice(LOADED)
        c = None
        try:
            c = s.get(db)
            soperator_step(ctx, rnd, c, db, sub)
        except psycopg.Error as ex:
            ctx.server_error(ex, "named operator", db=db, sub=sub)
            s.recover(db, c, ex)
        ctx.stop.wait(rnd.uniform(0.05, 0.25))
    s.close()


def soperator_step(ctx, rnd, c, db, sub):
    """One action of the operator of a subscription (a named one, or 'default':
    then every call passes NULL as subscription)."""
    sa = subarg(sub)
    if rnd.random() < 0.3:
        cancel_fresh(ctx, rnd, c, db, sub)
        return
    a = rnd.random()
    if a < 0.25:
        for (eid,) in c.execute("SELECT event_id FROM outbox.deliveries WHERE subscription = %s "
                                "AND state = 'dead' ORDER BY random() LIMIT 3", (sub,)).fetchall():
            t0 = ctx.tick()
            ok = c.execute("SELECT outbox.replay(%s, %s)", (eid, sa)).fetchone()[0]
            if ok:
                ctx.note_replay_try(db, sub, eid, t0)
                with ctx.lock:
                    ctx.replayed[sub].add((db, eid))
            ctx.inc("named replays")
            ctx.op(k="replay", db=db, id=eid, ok=ok, dead=True, sub=sub)
    elif a < 0.40:
        pat = rnd.choice([None, "chk.*", "chk.fast", "chk.skip", "chk.slow"])
        since = rnd.choice([None, None, 5.0, 1.0])
        until = rnd.choice([None, None, 0.3])
        dry = rnd.random() < 0.25
        c.execute("BEGIN")
        nd = c.execute("SELECT outbox.replay_dead(%s, now() - %s * interval '1 s', now() - %s * interval '1 s', "
                       "%s, %s)", (pat, since, until, dry, sa)).fetchone()[0]
        mine = [r[0] for r in c.execute(
            "SELECT id FROM outbox.log_exceptions WHERE subscription = %s AND xmin::text = "
            "(pg_current_xact_id()::text::bigint %% 4294967296)::text", (sub,)).fetchall()]
        c.execute("COMMIT")
        if dry and mine:
            ctx.violation("delivery", f"[{sub}] replay_dead(dry_run => true) changed {len(mine)} rows",
                          db=db, ids=mine[:20], sub=sub)
        elif not dry and len(mine) < nd:
            ctx.violation("delivery", f"[{sub}] replay_dead returned {nd} but changed {len(mine)} rows",
                          db=db, ids=mine[:20], sub=sub)
        with ctx.lock:
            ctx.replayed[sub].update((db, i) for i in mine)
        ctx.inc("named replay_dead calls")
        ctx.op(k="replay_dead", db=db, pattern=pat, since=since, until=until, dry=dry, n=nd, ids=mine[:50],
               sub=sub)
    elif a < 0.65:
        row = c.execute("SELECT event_id FROM outbox.deliveries WHERE subscription = %s "
                        "AND state IN ('pending', 'dead') ORDER BY random() LIMIT 1", (sub,)).fetchone()
        if row:
            eid = row[0]
            t0 = ctx.tick()
            ok = c.execute("SELECT outbox.cancel(%s, %s)", (eid, sa)).fetchone()[0]
            ctx.inc("named cancels")
            ctx.op(k="cancel", db=db, id=eid, ok=ok, sub=sub)
            if ok:
                ctx.note_cancel(db, sub, eid, t0)
                if rnd.random() < 0.5:
                    time.sleep(rnd.uniform(0, 0.2))
                    t0 = ctx.tick()
                    ok2 = c.execute("SELECT outbox.replay(%s, %s)", (eid, sa)).fetchone()[0]
                    if ok2:
                        ctx.note_replay_try(db, sub, eid, t0)
                        with ctx.lock:
                            ctx.replayed[sub].add((db, eid))
                    ctx.inc("named replays")
                    ctx.op(k="replay", db=db, id=eid, ok=ok2, cancelled=True, sub=sub)
    elif a < 0.75:
        # cancel of an event the subscription may not hold per event (leased in a
        # batch, delivered, not read yet, waiting in a batch): false for the first two
        with ctx.lock:
            recent = [r[1] for r in ctx.claimed[-200:] if r[0] == db and r[4] == sub]
        if recent:
            eid = rnd.choice(recent)
            t0 = ctx.tick()
            ok = c.execute("SELECT outbox.cancel(%s, %s)", (eid, sa)).fetchone()[0]
            if ok:
                ctx.note_cancel(db, sub, eid, t0)
            ctx.inc("named cancels")
            ctx.op(k="cancel", db=db, id=eid, ok=ok, sub=sub, any=True)
    elif a < 0.80 and sub == "sub_a":
        ma = rnd.choice([3, 4, 6])
        c.execute("SELECT outbox.alter_subscription('sub_a', max_attempts => %s)", (ma,))
        ctx.inc("alter_subscription")
        ctx.op(k="alter_subscription", db=db, sub=sub, max_attempts=ma)
    else:
        for (eid,) in c.execute("SELECT event_id FROM outbox.deliveries WHERE subscription = %s "
                                "AND state = 'cancelled' ORDER BY random() LIMIT 2", (sub,)).fetchall():
            t0 = ctx.tick()
            ok = c.execute("SELECT outbox.replay(%s, %s)", (eid, sa)).fetchone()[0]
            if ok:
                ctx.note_replay_try(db, sub, eid, t0)
                with ctx.lock:
                    ctx.replayed[sub].add((db, eid))
            ctx.inc("named replays")
            ctx.op(k="replay", db=db, id=eid, ok=ok, cancelled=True, sub=sub)


def pick_fresh(ctx, rnd, db, sub, batch=None):
    """An event for a cancel of 0.10.0 (--default-on-log), from what publishers and
    claims returned lately (no query: outbox.deliveries reads the whole log). batch
    False: one of the newest events of the subscription's topics, often not read yet
    by it; True: a later event of the subject of an event a claim of the subscription
    handed out lately, often waiting in that claim's batch; None: either."""
    if batch is None:
        batch = rnd.random() < 0.5
    pats = NAMED[sub]["topics"] if sub in NAMED else None
    with ctx.lock:
        if not batch:
            cand = [e for e, t, _ in ctx.recent_pub[db][-60:] if topic_matches(t, pats)]
            return rnd.choice(cand) if cand else None
        recent = [(r[1], r[7]) for r in ctx.claimed[-300:] if r[0] == db and r[4] == sub and r[7] is not None]
        if not recent:
            return None
        eid, subj = rnd.choice(recent)
        later = [i for i in ctx.pub_by_subject[db].get(subj, []) if i > eid][:3]
    if not later:
        return None
    return later[0] if rnd.random() < 0.6 else rnd.choice(later)


def cancel_fresh(ctx, rnd, c, db, sub):
    """cancel(id, sub) of an event the subscription has not read yet, or that waits in
    its lane's batch (0.10.0), and sometimes a replay of it: after a moment, in
    autocommit or in a transaction held open a moment (and then rolled back at times).
    The cancel must hold from its commit until a replay commits (check_cancels)."""
    batch = rnd.random() < 0.5
    eid = pick_fresh(ctx, rnd, db, sub, batch)
    if eid is None:
        return
    sa = subarg(sub)
    kind = "batch" if batch else "unread"
    t0 = ctx.tick()
    ok = c.execute("SELECT outbox.cancel(%s, %s)", (eid, sa)).fetchone()[0]
    ctx.inc(f"fresh cancels ({kind}) {'true' if ok else 'false'}")
    ctx.op(k="cancel", db=db, id=eid, ok=ok, sub=sub, fresh=kind)
    if not ok:
        return
    ctx.note_cancel(db, sub, eid, t0)
    # Where it stood: not read yet (its id is in its lane's skips), or it had a row
    # (a batch's waiting event, detached; or a row of its own)
    unread = c.execute("SELECT EXISTS (SELECT 1 FROM outbox.log_lanes WHERE subscription = %s AND %s = ANY (skips))",
                       (sub, eid)).fetchone()[0]
    ctx.inc(f"fresh cancels ({kind}) true: {'not read yet' if unread else 'read (a batch or a row)'}")
    if rnd.random() >= 0.4:
        return
    time.sleep(rnd.uniform(0, 0.15))
    held = rnd.random() < 0.5 and not quiet()
    t0 = ctx.tick()
    if held:
        c.execute("BEGIN")
    try:
        ok2 = c.execute("SELECT outbox.replay(%s, %s)", (eid, sa)).fetchone()[0]
        rolled = False
        if held:
            time.sleep(rnd.uniform(0.05, 0.4))
            rolled = rnd.random() < 0.15
            c.execute("ROLLBACK" if rolled else "COMMIT")
    finally:
        if held and c.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            safe_rollback(c)
    if ok2:
        ctx.note_replay_try(db, sub, eid, t0)
        if not rolled:
            with ctx.lock:
                ctx.replayed[sub].add((db, eid))
    ctx.inc("fresh cancel replays" + (" (rolled back)" if rolled else ""))
    ctx.op(k="replay", db=db, id=eid, ok=ok2, cancelled=True, sub=sub, fresh=kind, held=held, rolledback=rolled)


# ---------------------------------------------------------------------------
# Operator, idler, big operations, sampler
# ---------------------------------------------------------------------------

def operator(ctx):
    rnd = random.Random(ctx.args.seed * 3001)
    s = Session(ctx, "operator", ["SET statement_timeout = '30s'"])
    while not ctx.stop.is_set():
        db = pick_db(rnd)
        c = None
        try:
            c = s.get(db)
            a = rnd.random()
            if not 0.55 <= a < 0.70:
                # the named operator's actions, for 'default' (alter_topic below
                # sets its dead-letter policy and max_attempts)
                soperator_step(ctx, rnd, c, db, "default")
            else:
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
        except psycopg.Error as ex:
            ctx.server_error(ex, "operator", db=db)
            s.recover(db, c, ex)
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
            # the snapshot, held
            c.execute("SELECT pg_current_snapshot()")
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
    700-2000 distinct subjects (past outbox.max_subject_locks, the coarse subject lock)
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
            out = ctx.big_out[db]   # what this thread committed
            if out < ctx.args.big_ack:
                m = rnd.randint(1001, 2000) if rnd.random() < 0.12 else rnd.randint(700, 1000)
                big_publish(ctx, rnd, c, db, f"b-{n}", m)
                continue
            big_ack(ctx, rnd, c, db, n)
            # clean up (expired leases of a failed batch become claimable after 5 s)
            t_end = time.time() + 12
            while time.time() < t_end and not ctx.stop.is_set() and not quiet():
                cw = f"big-cl{n}-{time.monotonic_ns()}"
                with ctx.lock:
                    ctx.wtx[cw] = {"db": db, "xid": None, "client": "commit"}
                rows = claim(ctx, c, db, "bigw", cw, 500, "5 s", ["chk.big"])
                if rows:
                    ack_batch(ctx, c, db, "bigw", rows, f"big-clb{n}-{time.monotonic_ns()}")
                else:
                    break   # the rest (leases of a failed batch) goes to the drain
            ctx.big_out[db] = 0
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
        ctx.big_out[db] += len(ids)
        ctx.inc("big publish_batch")
        ctx.inc("publisher commits")
        ctx.op(k="pub_commit", db=db, tag=tag, n=len(ids), big=True)
    except psycopg.Error as ex:
        ctx.server_error(ex, "big publish_batch", db=db, tag=tag, subjects=m)
        tx["client"] = "error"
        safe_rollback(c)
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
            # (where 'default' reads the log, E2 waits in E1's batch: a cancel of 0.10.0)
            t0 = ctx.tick()
            ok = cb.execute("SELECT outbox.cancel(%s)", (e2,)).fetchone()[0]
            ctx.op(k="cancel", db=db, id=e2, ok=ok, scenario="rp")
            if ok:
                ctx.note_cancel(db, "default", e2, t0)
            t0 = ctx.tick()
            cb.execute("BEGIN")
            ok2 = cb.execute("SELECT outbox.replay(%s)", (e2,)).fetchone()[0]
            ctx.op(k="replay", db=db, id=e2, ok=ok2, scenario="rp", open=True)
            if rows:
                ack_auto(ctx, ca, db, "rp", rows[0])
            time.sleep(rnd.uniform(0.0, 0.05))
            cb.execute("COMMIT")
            if ok2:
                ctx.note_replay_try(db, "default", e2, t0)
                with ctx.lock:
                    ctx.replayed["default"].add((db, e2))
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
    k = 0
    while not done.is_set():
        try:
            c = s.get(db)
            k += 1
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
# Opt-in modes (issue 40): --txn-holders, --bulk-publisher, --max-lag, --serializable
# ---------------------------------------------------------------------------

def ack_in_tx(ctx, c, db, row, wtx, acks, sub):
    """ack() inside the caller's transaction; the outcome joins ctx.acks in flush_acks."""
    seq = ctx.tick()
    ok = c.execute("SELECT outbox.ack(%s, %s)", (row[0], row[5])).fetchone()[0]
    acks.append((row[0], bool(ok), str(row[5]), seq))
    ctx.op(k="ack", db=db, id=row[0], ok=ok, wtx=wtx, subj=row[2], intx=True, sub=sub)
    return ok


def flush_acks(ctx, db, wtx, acks, sub):
    with ctx.lock:
        for eid, ok, tok, seq in acks:
            ctx.acks.append((db, eid, wtx, ok, sub, tok, seq))
    ctx.inc("acks true (in tx)" if sub == "default" else "named acks true (in tx)", sum(1 for a in acks if a[1]))


def end_tx(ctx, c, db, wtx, rec, rollback, sub):
    """Ends a worker transaction as worker_tx does: its xid first, then COMMIT (with the
    journal tick it committed at) or ROLLBACK."""
    rec["xid"] = c.execute("SELECT pg_current_xact_id_if_assigned()::text").fetchone()[0]
    if rollback:
        c.execute("ROLLBACK")
        rec["client"] = "rollback"
        ctx.op(k="wrollback", db=db, wtx=wtx, xid=rec["xid"], sub=sub)
    else:
        c.execute("COMMIT")
        rec["cseq"] = ctx.tick()
        rec["client"] = "commit"
        ctx.op(k="wcommit", db=db, wtx=wtx, xid=rec["xid"], sub=sub)


def tx_failed(ctx, c, db, wtx, rec, ex, where, sub, accepted=()):
    """A worker transaction failed: classify the error, roll back, journal it."""
    rec["client"] = "unknown" if is_conn_error(ex) and rec["xid"] else "error"
    st = ctx.server_error(ex, where, db=db, wtx=wtx, sub=sub, accepted=accepted)
    safe_rollback(c)
    ctx.op(k="wabort", db=db, wtx=wtx, st=getattr(ex, "sqlstate", None), sub=sub)
    return st


def new_wtx(ctx, wtx, db, iso):
    rec = {"db": db, "xid": None, "client": None, "iso": iso, "tx": True}
    with ctx.lock:
        ctx.wtx[wtx] = rec
    return rec


def holder(ctx, idx, sub):
    """--txn-holders: BEGIN, claim 1-5 events (leases of 1-10 s), keep the transaction
    open and idle for 2-8 s, then ack them in it (a tenth: fail) and COMMIT, or ROLLBACK
    (a fifth). A hold ends before the calm window (cut short to fit, not below 2 s)."""
    rnd = random.Random(ctx.args.seed * 10007 + idx)
    wname = f"hold{idx}"
    s = Session(ctx, f"holder{idx}", WORKER_SETTINGS)
    n = 0
    while not ctx.stop.is_set():
        hold = min(rnd.uniform(2.0, 8.0), CYCLE - CALM - phase() - 0.3)
        if hold < 2.0:
            ctx.stop.wait(CYCLE - phase() + 0.05)
            continue
        db = pick_db(rnd)
        n += 1
        wtx = f"{wname}-t{n}"
        iso = rnd.choice(CLAIM_ISOS)
        rec = new_wtx(ctx, wtx, db, iso)
        acks, stage, c = [], "begin", None
        try:
            c = s.get(db)
            c.execute(f"BEGIN ISOLATION LEVEL {iso}")
            ctx.op(k="wbegin", db=db, wtx=wtx, iso=iso, sub=sub, hold=round(hold, 2))
            stage = "claim"
            rows = claim(ctx, c, db, wname, wtx, rnd.randint(1, 5), rnd.choice(["1 s", "3 s", "5 s", "10 s"]),
                         WORK_TOPICS if sub == "default" else None, subarg(sub))
            t_hold = time.time()
            if rows:
                ctx.stop.wait(hold)
            stage = "ack/fail"
            for row in rows:
                if rnd.random() < 0.9:
                    ack_in_tx(ctx, c, db, row, wtx, acks, sub)
                else:
                    fail_call(ctx, c, db, row, False, wtx, subarg(sub))
            stage = "end"
            rb = rnd.random() < 0.2
            end_tx(ctx, c, db, wtx, rec, rb, sub)
            if rows:
                with ctx.lock:
                    ctx.holds.append((db, sub, t_hold, time.time()))
                ctx.inc("holds " + ("rolled back" if rb else "committed"))
        except psycopg.Error as ex:
            tx_failed(ctx, c, db, wtx, rec, ex, f"holder transaction ({stage})", sub,
                      accepted=("55P03",) if stage == "ack/fail" else ())
            if c is None or is_conn_error(ex):
                s.drop(db)
        finally:
            flush_acks(ctx, db, wtx, acks, sub)
        ctx.stop.wait(rnd.uniform(0.1, 0.5))
    s.close()


def bulk_publisher(ctx):
    """--bulk-publisher: each round one transaction publishes 5,000-20,000 events
    (publish_batch calls of up to 2,500: one topic each; a tenth with subjects of a
    pool of 40 of its own), stays open 5-15 s, then commits (4 in 5) or rolls back."""
    rnd = random.Random(ctx.args.seed * 11003)
    s = Session(ctx, "bulkpub", ["SET statement_timeout = '60s'"])
    n = 0
    while not ctx.stop.is_set():
        n += 1
        db, tag, m = pick_db(rnd), f"bk-{n}", rnd.randint(5000, 20000)
        tx = {"tag": tag, "db": db, "iso": "READ COMMITTED", "mode": "bulk", "ops": [], "xid": None, "client": None}
        with ctx.lock:
            ctx.pubtx[tag] = tx
        stage, c = "publish", None
        try:
            c = s.get(db)
            c.execute("BEGIN")
            for k in range((m + 2499) // 2500):
                if ctx.stop.is_set():
                    break
                cnt = min(2500, m - 2500 * k)
                topic = rnd.choice(["chk.fast", "chk.slow", "chk.unreg", "chk.big"])
                # mostly without subject: a subject's events are handed out one at a time
                subjs = [None if rnd.random() < 0.9 else f"{tag}-{rnd.randrange(40)}" for _ in range(cnt)]
                op = {"k": k, "ids": [], "sp": None, "sp_rb": False, "topic": topic, "subjs": subjs}
                tx["ops"].append(op)
                pks = [f"{tag}.{k}.{j}" for j in range(cnt)]
                for j, pk in enumerate(pks):
                    ctx.pubops[pk] = (tag, k, j)
                ctx.op(k="publish_batch", db=db, tag=tag, n=cnt, topic=topic, bulk=True)
                ids = [r[0] for r in c.execute(
                    "SELECT * FROM outbox.publish_batch(%s, %s::text[]::jsonb[], %s::text[])",
                    (topic, [json.dumps({"pk": pk}) for pk in pks], subjs)).fetchall()]
                op["ids"].extend(ids)
                ctx.note_pub(db, ids, topic, subjs)
                ctx.op(k="published_batch", db=db, tag=tag, ids=ids, topic=topic, bulk=True)
                if tx["xid"] is None:
                    tx["xid"] = c.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
                    ctx.op(k="pub_xid", db=db, tag=tag, xid=tx["xid"], iso="READ COMMITTED", mode="bulk")
            hold = rnd.uniform(5.0, 15.0)
            ctx.op(k="bulk_hold", db=db, tag=tag, n=sum(len(o["ids"]) for o in tx["ops"]), secs=round(hold, 2))
            ctx.stop.wait(hold)
            stage = "commit"
            commit = rnd.random() < 0.8
            c.execute("COMMIT" if commit else "ROLLBACK")
            tx["client"] = "commit" if commit else "rollback"
            ctx.inc("bulk transactions " + ("committed" if commit else "rolled back"))
            ctx.inc("bulk events " + ("committed" if commit else "rolled back"), sum(len(o["ids"]) for o in tx["ops"]))
            ctx.op(k="pub_commit" if commit else "pub_rollback", db=db, tag=tag, bulk=True)
        except psycopg.Error as ex:
            ctx.server_error(ex, "bulk publisher", db=db, tag=tag, stage=stage)
            tx["client"] = "error"
            s.recover(db, c, ex)
        ctx.stop.wait(rnd.uniform(0.5, 2.0))
    s.close()


def lagger(ctx):
    """--max-lag: the only worker of sub_l, a slow one: claims of 1-10 events, 0.5-3 s
    of work, then ack (7 in 10) or fail (retry); the other tokens are reported 3-8 s
    later (fail mostly, else ack), when the event may be lost to max_lag."""
    rnd = random.Random(ctx.args.seed * 12007)
    s = Session(ctx, "lagger", WORKER_SETTINGS)
    held, n = [], 0
    while not ctx.stop.is_set():
        db = pick_db(rnd)
        n += 1
        c = None
        try:
            c = s.get(db)
            now = time.time()
            for h in [h for h in held if h[0] <= now and h[1] == db]:
                held.remove(h)
                if rnd.random() < 0.7:
                    fail_call(ctx, c, db, h[2], False, f"lag-late{n}", LAG_SUB)
                else:
                    ack_auto(ctx, c, db, "lag", h[2], LAG_SUB)
            wtx = f"lag-c{n}"
            with ctx.lock:
                ctx.wtx[wtx] = {"db": db, "xid": None, "client": "commit"}
            rows = claim(ctx, c, db, "lag", wtx, rnd.randint(1, 10), rnd.choice([None, "1 s", "3 s"]), None, LAG_SUB)
            ctx.stop.wait(rnd.uniform(0.5, 3.0) if rows else 0.2)
            for row in rows:
                a = rnd.random()
                if a < 0.7:
                    ack_auto(ctx, c, db, "lag", row, LAG_SUB)
                elif a < 0.8:
                    fail_call(ctx, c, db, row, False, wtx, LAG_SUB)
                else:
                    held.append((time.time() + rnd.uniform(3.0, 8.0), db, row))
        except psycopg.Error as ex:
            ctx.server_error(ex, "lagger", db=db, sub=LAG_SUB, accepted=("55P03",))
            s.recover(db, c, ex)
    s.close()


def keeper(ctx, db):
    """--max-lag: keeps the subscriptions without max_lag up with the load (claims of 500,
    one array ack), so that retention has ring tables only sub_l still holds."""
    s = Session(ctx, "keeper", WORKER_SETTINGS)
    n = 0
    while not ctx.stop.is_set():
        got = 0
        for sub in ["default"] + LOADED:
            n += 1
            try:
                c = s.get(db)
                wtx = f"keep-{db}-{n}"
                with ctx.lock:
                    ctx.wtx[wtx] = {"db": db, "xid": None, "client": "commit"}
                rows = claim(ctx, c, db, "keep", wtx, 500, "5 s", None, subarg(sub))
                if rows:
                    ack_array_named(ctx, c, db, rows, f"keep-b-{db}-{n}", sub)
                got += len(rows)
            except psycopg.Error as ex:
                ctx.server_error(ex, "keeper", db=db, sub=sub, accepted=("55P03",))
                s.drop(db)
        if not got:
            ctx.stop.wait(0.1)
    s.close()


def rotator(ctx, db):
    """--max-lag: the log's retention step every 0.5 s with outbox.retention_delivered
    = 1 s: outbox._log_rotate() until a call returns 0, as run_maintenance does."""
    s = Session(ctx, "rotator", ["SET statement_timeout = '30s'", "SET outbox.retention_delivered = 1"])
    while not ctx.stop.wait(0.5):
        try:
            c = s.get(db)
            for _ in range(8):
                r = c.execute("SELECT outbox._log_rotate()").fetchone()[0]
                ctx.inc("log rotate calls")
                if not r:
                    break
                ctx.inc("ring tables truncated", r)
                ctx.op(k="truncated", db=db, n=r)
        except psycopg.Error as ex:
            ctx.server_error(ex, "log rotate", db=db)
            s.drop(db)
    s.close()


def ser_worker(ctx, idx):
    """--serializable: a worker whose session defaults to SERIALIZABLE. Its claim (in
    autocommit, or after BEGIN ISOLATION LEVEL SERIALIZABLE) must be refused at once with
    0A000; then it claims at READ COMMITTED and reports the events in SERIALIZABLE
    transactions, retried whole on 40001 (at a call or at COMMIT)."""
    rnd = random.Random(ctx.args.seed * 13001 + idx)
    wname = f"sz{idx}"
    s = Session(ctx, f"serworker{idx}", WORKER_SETTINGS + ["SET default_transaction_isolation = 'serializable'"])
    n = 0
    while not ctx.stop.is_set():
        db, sub = pick_db(rnd), rnd.choice(LOADED + ["default"])
        n += 1
        c = None
        try:
            c = s.get(db)
            ser_refused_claim(ctx, rnd, c, db, sub, wname, n)
            wtx = f"{wname}-t{n}"
            rec = new_wtx(ctx, wtx, db, "READ COMMITTED")
            try:
                c.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
                rows = claim(ctx, c, db, wname, wtx, rnd.randint(1, 8), rnd.choice([None, "1 s", "2 s"]), None,
                             subarg(sub))
                end_tx(ctx, c, db, wtx, rec, False, sub)
            except psycopg.Error as ex:
                tx_failed(ctx, c, db, wtx, rec, ex, "claim", sub)
                raise
            k = 0
            while rows:
                m = rnd.randint(1, 4)
                ser_report(ctx, rnd, c, db, sub, rows[:m], f"{wname}-s{n}.{k}")
                rows, k = rows[m:], k + 1
        except psycopg.Error as ex:
            ctx.server_error(ex, "serializable worker", db=db, sub=sub)
            s.recover(db, c, ex)
            time.sleep(0.05)
        time.sleep(rnd.uniform(0, 0.03))
    s.close()


def ser_refused_claim(ctx, rnd, c, db, sub, wname, n):
    """A claim at SERIALIZABLE: 0A000 at once, or a violation (rows, another error)."""
    explicit = rnd.random() < 0.5
    wtx = f"{wname}-z{n}"
    if explicit:
        rec = new_wtx(ctx, wtx, db, "SERIALIZABLE")
        c.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
    else:
        with ctx.lock:
            ctx.wtx[wtx] = {"db": db, "xid": None, "client": "commit"}
    how = "in BEGIN ISOLATION LEVEL SERIALIZABLE" if explicit else "in autocommit (session default SERIALIZABLE)"
    try:
        rows = claim(ctx, c, db, wname, wtx, rnd.randint(1, 8), None, None, subarg(sub), accepted=("0A000",))
    except psycopg.Error as ex:
        st = getattr(ex, "sqlstate", None)
        if explicit:
            safe_rollback(c)
            rec["client"] = "rollback"
        if st == "0A000":
            ctx.inc("serializable claims refused (0A000)")
        elif not is_conn_error(ex):
            ctx.violation("serializable", f"[{sub}] claim at SERIALIZABLE {how} in {db} failed with {st}, not 0A000",
                          db=db, wtx=wtx, sub=sub)
        else:
            raise
        return
    ctx.violation("serializable", f"[{sub}] claim at SERIALIZABLE {how} in {db} returned {len(rows)} rows, "
                  f"not 0A000", db=db, wtx=wtx, sub=sub, ids=[r[0] for r in rows])
    if explicit:
        end_tx(ctx, c, db, wtx, rec, True, sub)


def ser_report(ctx, rnd, c, db, sub, rows, tag):
    """ack / fail / extend_lease + ack of rows in one SERIALIZABLE transaction, run
    again whole (same plan, same tokens) on 40001 or 40P01, at a call or at COMMIT."""
    plan = rnd.choices(["ack", "fail", "extend"], weights=[7, 1.5, 1.5], k=len(rows))
    for attempt in range(6):
        wtx = f"{tag}a{attempt}"
        rec = new_wtx(ctx, wtx, db, "SERIALIZABLE")
        acks, stage = [], "begin"
        try:
            c.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
            ctx.op(k="wbegin", db=db, wtx=wtx, iso="SERIALIZABLE", sub=sub)
            for row, act in zip(rows, plan):
                if act == "fail":
                    stage = "fail"
                    fail_call(ctx, c, db, row, False, wtx, subarg(sub))
                    continue
                if act == "extend":
                    stage = "extend_lease"
                    until = c.execute("SELECT outbox.extend_lease(%s, %s, '1 s')", (row[0], row[5])).fetchone()[0]
                    ctx.op(k="extend", db=db, id=row[0], ok=until is not None, sub=sub, wtx=wtx)
                stage = "ack"
                ack_in_tx(ctx, c, db, row, wtx, acks, sub)
            stage = "commit"
            end_tx(ctx, c, db, wtx, rec, False, sub)
            ctx.inc("serializable report transactions committed")
            return
        except psycopg.Error as ex:
            st = tx_failed(ctx, c, db, wtx, rec, ex, stage, sub, accepted=("55P03",))
            if st not in RETRY:
                raise
            ctx.inc("serializable report transactions retried")
        finally:
            flush_acks(ctx, db, wtx, acks, sub)
    ctx.inc("serializable report transactions given up (6 attempts)")


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
    committed event is delivered or nothing moved for --stall seconds; one session per
    database and subscription, side by side. For 'default': replay() of the cancelled
    events, replay_dead(), claims of 500 acked one by one or in one batch. For a named
    subscription: replay(id, sub) of its dead and cancelled events (outbox.deliveries),
    claims of 500 with one array ack, until its lag, leases, dead letters and
    undelivered rows in outbox.deliveries are all zero."""
    t0 = time.time()
    res = {}
    ts = [threading.Thread(target=drain_one, args=(ctx, db, sub, t0, res), name=f"drain-{db}-{sub}", daemon=True)
          for db in DBS for sub in SUBS]
    for t in ts:
        t.start()
    for t in ts:
        t.join(max(1.0, t0 + ctx.args.drain_max + 15 - time.time()))
    stuck = [t.name for t in ts if t.is_alive()]
    if stuck:
        # The analysis reads what the drain sessions write; they must have ended first.
        ctx.drain_stop.set()
        for t in ts:
            t.join(60)
    # None: the last statement failed, so how much is left is unknown (not "empty").
    left = {k: ("unknown" if v is None else v) for k, v in res.items() if v != 0}
    if not left and not stuck:
        log(f"drain: queues empty after {time.time() - t0:.1f}s")
    else:
        log(f"drain: gave up after {time.time() - t0:.1f}s: events still queued {left}"
            + (f"; still running: {stuck}" if stuck else ""))
    return time.time() - t0


def drain_left(c, sub, db):
    """How much is left to deliver (0 = all of it): the subscription's counters and its
    undelivered rows of outbox.deliveries."""
    return c.execute("SELECT coalesce(lag_events, 0) + coalesce(leases_in_flight, 0) + coalesce(dead_letters, 0) + "
                     "(SELECT count(*) FROM outbox.deliveries d WHERE d.subscription = s.name "
                     "AND d.state <> 'delivered') FROM outbox.subscriptions s WHERE s.name = %s", (sub,)).fetchone()[0]


def drain_replay(ctx, c, db, sub):
    for (eid, st) in c.execute("SELECT event_id, state FROM outbox.deliveries WHERE subscription = %s "
                               "AND state IN ('dead', 'cancelled')", (sub,)).fetchall():
        t0 = ctx.tick()
        ok = c.execute("SELECT outbox.replay(%s, %s)", (eid, subarg(sub))).fetchone()[0]
        if ok:
            ctx.note_replay_try(db, sub, eid, t0)
            with ctx.lock:
                ctx.replayed[sub].add((db, eid))
        ctx.inc("drain named replays")
        ctx.op(k="replay", db=db, id=eid, ok=ok, drain=True, sub=sub, was=st)


def drain_one(ctx, db, sub, t0, res):
    hard = t0 + ctx.args.drain_max
    stall = ctx.args.stall
    s = Session(ctx, "drain", DRAIN_SETTINGS)
    last_progress = time.time()
    last_left = None
    last_replay = 0.0
    rounds = 0
    left = None
    c = None
    while True:
        if ctx.drain_stop.is_set():
            left = left or "stopped at the drain budget"
            break
        rounds += 1
        now = time.time()
        got = 0
        try:
            c = s.get(db)
            if now - last_replay > 1.0:
                last_replay = now
                drain_replay(ctx, c, db, sub)
            wtx = f"drain-{db}-{rounds}" if sub == "default" else f"drain-{sub}-{db}-{rounds}"
            with ctx.lock:
                ctx.wtx[wtx] = {"db": db, "xid": None, "client": "commit"}
            rows = claim(ctx, c, db, "drain", wtx, 500, "10 s", None, subarg(sub))
            if rows:
                ack_array_named(ctx, c, db, rows, f"drain-b-{sub}-{db}-{rounds}", sub)
            got = len(rows)
            if not got:
                # Polled only when a claim found nothing: outbox.subscriptions is not cheap.
                left = drain_left(c, sub, db)
        except psycopg.Error as ex:
            ctx.server_error(ex, "drain", db=db, sub=sub)
            s.recover(db, c, ex)
            left = None
        if got:
            last_progress = time.time()
            continue
        if left == 0:
            break
        if left is not None and (last_left is None or left < last_left):
            last_progress = time.time()
            last_left = left
            continue   # a named subscription's claim may read past other topics' events only
        if time.time() - last_progress > stall or time.time() > hard:
            break
        time.sleep(0.1)
    res[(db, sub)] = left
    ctx.op(k="drained", db=db, sub=sub, left=left, secs=round(time.time() - t0, 1), rounds=rounds)
    s.close()


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
        self.load_times = Counter()   # (db, relation) -> seconds
        for db in DBS:
            c = self.c[db]
            t0 = time.time()
            # outbox.events is the log joined with outbox.deliveries (seconds over
            # the whole log): the log itself, and the state of 'default' from its
            # rows in outbox.log_exceptions (check_delivery).
            q = "SELECT id, topic, subject, NULL::text, payload->>'pk', NULL::jsonb, max_attempts FROM outbox.log"
            for eid, topic, subj, state, pk, errors, maxa in c.execute(q).fetchall():
                rows[(db, eid)] = (topic, subj, state, pk, errors, maxa)
            self.load_times[f"{db}/events"] += time.time() - t0
        self.final = rows
        # Subscriptions of the log: their per-event rows (outbox.deliveries' source) and the log.
        self.named_rows = {sub: {} for sub in SUBS}
        self.log_rows = {}
        self.named_stats = {}
        for db in DBS:
            c = self.c[db]
            for sub, eid, state, att, topic, subj, pk, err in c.execute(
                    "SELECT subscription, id, state, attempts, topic, subject, payload->>'pk', last_error "
                    "FROM outbox.log_exceptions").fetchall():
                if sub in self.named_rows:
                    self.named_rows[sub][(db, eid)] = (state, att, topic, subj, pk, err)
            t0 = time.time()
            for eid, pk, txid in c.execute("SELECT id, payload->>'pk', txid::text FROM outbox.log").fetchall():
                self.log_rows[(db, eid)] = (pk, txid)
            t1 = time.time()
            for name, lag, leases, dead in c.execute(
                    "SELECT name, lag_events, leases_in_flight, dead_letters FROM outbox.subscriptions").fetchall():
                self.named_stats[(db, name)] = (lag, leases, dead)
            self.load_times[f"{db}/log"] += t1 - t0
            self.load_times[f"{db}/subscriptions"] += time.time() - t1
        if self.ctx.args.max_lag:
            self.journal_rows(rows)
        return rows

    def journal_rows(self, rows):
        """--max-lag: retention truncated ring tables, so the log no longer holds every
        committed event; their topic, subject and pk come from the journal: from the
        first publish that returned the id (a later one re-published its dispatch key)."""
        ctx = self.ctx
        first = {}   # (db, id) -> (topic, subject, tag)
        for r in ctx.ops:
            if r.get("k") == "published":
                first.setdefault((r["db"], r["id"]), (r["topic"], r["subj"], r["tag"]))
            elif r.get("k") == "published_batch" and isinstance(r.get("ids"), list):
                for i, eid in enumerate(r["ids"]):
                    first.setdefault((r["db"], eid), (r["topic"], r["subjs"][i] if r.get("subjs") else None, r["tag"]))
        self.retained_out = 0
        for tag, t in ctx.pubtx.items():
            for op in t["ops"]:
                for j, eid in enumerate(op["ids"]):
                    key = (t["db"], eid)
                    if key in rows or key not in self.committed:
                        continue
                    if t.get("big"):
                        topic, subj = "chk.big", f"{tag}-{j}"
                    elif "topic" in op:   # bulk
                        topic, subj = op["topic"], op["subjs"][j]
                    else:
                        topic, subj, otag = first[key]
                        if otag != tag:
                            continue   # a re-publish: its row comes with the original's ops
                    rows[key] = (topic, subj, None, f"{tag}.{op['k']}.{j}", None, None)
                    self.retained_out += 1

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

    def expected(self, sub):
        """The committed events the subscription must deliver: all of them for 'default'
        and sub_a, the ones of its topics for a named subscription with a filter (both
        named subscriptions exist since before the first publish)."""
        if sub == "default" or NAMED[sub]["topics"] is None:
            return self.committed
        pats = NAMED[sub]["topics"]
        return {k: t for k, t in self.committed.items()
                if self.final.get(k) is None or topic_matches(self.final[k][0], pats)}

    def run(self):
        ctx = self.ctx
        self.outcomes()
        t0 = time.time()
        final = self.load_final()
        self.load_secs = time.time() - t0
        self.claims_by = defaultdict(list)
        self.acks_by = defaultdict(list)
        for r in ctx.claimed:
            self.claims_by[r[4]].append(r)
        for a in ctx.acks:
            self.acks_by[a[4]].append(a)
        self.good_acks, self.unknown_acks, self.stranded, self.order_stats = {}, {}, {}, {}
        self.check_log(final)
        for sub in SUBS:
            self.check_uncommitted(final, sub)
            self.check_delivery(final, sub)
            self.check_order(final, sub)
            self.check_handouts(final, sub)
            self.check_fencing(sub)
            self.check_cancels(sub)
        self.check_keys()
        self.check_lockwaits()
        if ctx.args.max_lag:
            self.check_lag()
        if ctx.args.txn_holders:
            self.hold_figures = self.holds_figure()

    def check_lag(self):
        """--max-lag: per database, sub_l's committed events never acked are no more than
        its lost_events; a fail() of an event lost to it returned 'stale' (any other
        answer kept a row of its own, which the drain delivers); the subscriptions
        without max_lag lost nothing."""
        ctx = self.ctx
        self.lag_stats = {}
        for db in DBS:
            lost = dict(self.c[db].execute("SELECT name, lost_events FROM outbox.subscriptions").fetchall())
            for sub in SUBS:
                if sub != LAG_SUB and lost.get(sub):
                    ctx.violation("max_lag", f"[{sub}] (no max_lag) lost {lost[sub]} events in {db}", db=db, sub=sub)
            stranded = [eid for d, eid in self.stranded[LAG_SUB] if d == db]
            exp = sum(1 for k in self.expected(LAG_SUB) if k[0] == db)
            self.lag_stats[db] = dict(committed=exp, delivered=exp - len(stranded), lost_events=lost.get(LAG_SUB))
            if len(stranded) > (lost.get(LAG_SUB) or 0):
                ctx.violation("max_lag", f"[{LAG_SUB}] {db}: {exp - len(stranded)} delivered + {lost.get(LAG_SUB)} "
                              f"lost_events < {exp} committed events ({len(stranded)} never acked, first "
                              f"{sorted(stranded)[:10]})", db=db, id=min(stranded), sub=LAG_SUB)
        never = set(self.stranded[LAG_SUB])
        fails = [r for r in ctx.ops if r.get("k") == "fail" and r.get("sub") == LAG_SUB]
        self.lag_stats["fails"] = dict(Counter(r["res"] for r in fails))
        self.lag_stats["fails of events never delivered"] = dict(Counter(r["res"] for r in fails
                                                                         if (r["db"], r["id"]) in never))
        bad = [r for r in fails if (r["db"], r["id"]) in never and r["res"] != "stale"]
        for r in bad[:20]:
            ctx.violation("max_lag", f"[{LAG_SUB}] fail() of {r['db']}/{r['id']} returned {r['res']!r}, yet the "
                          f"event was never delivered", db=r["db"], id=r["id"], sub=LAG_SUB)

    def holds_figure(self):
        """--txn-holders: the other workers' claims that came back empty while a holder
        kept a claim of the same database and subscription open, and how many of those
        left a ready event: one without a subject or delay, committed before the claim
        began and first handed out only after it ended (approximate: wall clocks)."""
        ctx = self.ctx
        holds = defaultdict(list)
        for db, sub, h0, h1 in ctx.holds:
            holds[(db, sub)].append((h0, h1))
        first = {}
        for db, sub, w, t0, t1, ids, tps in ctx.claim_wall:
            for i in ids:
                first[(db, sub, i)] = min(t0, first.get((db, sub, i), t0))
        delayed = {r["pk"] for r in ctx.ops if r.get("k") == "publish" and r.get("delay")}
        tag_ts = {tag: self.xinfo.get(t["xid"], (None, None))[1] for tag, t in ctx.pubtx.items() if t["xid"]}
        ready = defaultdict(list)   # (db, sub, topic) -> [(commit time, first hand-out start)]
        for sub in set(s for _, s in holds):
            for key, tag in self.expected(sub).items():
                row, ts, fs = self.final.get(key), tag_ts.get(tag), first.get((key[0], sub, key[1]))
                if row and row[1] is None and row[3] not in delayed and ts and fs and key not in ctx.cancelled[sub]:
                    ready[(key[0], sub, row[0])].append((ts.timestamp(), fs))
        pref = {}
        for k, v in ready.items():
            v.sort()
            mx, m = [], 0.0
            for _, fs in v:
                m = max(m, fs)
                mx.append(m)
            pref[k] = ([a for a, _ in v], mx)
        empty = with_ready = 0
        for db, sub, w, t0, t1, ids, tps in ctx.claim_wall:
            if ids or w.startswith("hold") or w == "drain" or not any(h0 < t1 and t0 < h1 for h0, h1 in holds[(db, sub)]):
                continue
            empty += 1
            for (d, s, topic), (cts, mx) in pref.items():
                i = bisect.bisect_left(cts, t0) if d == db and s == sub and topic_matches(topic, tps) else 0
                if i and mx[i - 1] > t1:
                    with_ready += 1
                    break
        return empty, with_ready

    def check_log(self, final):
        """The log (what named subscriptions read) holds exactly the committed events."""
        ctx = self.ctx
        bad = 0
        for (db, eid), (pk, txid) in self.log_rows.items():
            st = self.pk_status(pk)
            if st in ("aborted", "foreign"):
                bad += 1
                if bad <= 20:
                    ctx.violation("uncommitted", f"outbox.log holds {db}/{eid} ({pk}, txid {txid}) of a {st} publish",
                                  db=db, id=eid, pk=pk)
        # (--max-lag: retention removes what every subscription without max_lag has read)
        missing = [k for k in self.committed if k not in self.log_rows and not ctx.args.max_lag]
        for db, eid in missing[:20]:
            ctx.violation("delivery", f"committed event {db}/{eid} ({self.committed[(db, eid)]}) is missing from "
                          f"outbox.log: no named subscription can receive it", db=db, id=eid)
        if len(missing) > 20:
            ctx.violation("delivery", f"... {len(missing) - 20} more committed events missing from outbox.log")

    def check_uncommitted(self, final, sub):
        ctx = self.ctx
        bad = 0
        for db, eid, pk, wtx, _s, tok, att, subj, t_end, seq, _t0 in self.claims_by[sub]:
            st = self.pk_status(pk)
            if st in ("aborted", "foreign"):
                bad += 1
                if bad <= 20:
                    ctx.violation("uncommitted", f"[{sub}] claim returned event {db}/{eid} ({pk}) of a {st} publish",
                                  db=db, id=eid, pk=pk, wtx=wtx, sub=sub)
        if sub == "default":
            for (db, eid), (topic, subj, state, pk, errors, maxa) in final.items():
                st = self.pk_status(pk)
                if st in ("aborted", "foreign"):
                    bad += 1
                    if bad <= 40:
                        ctx.violation("uncommitted", f"outbox.events holds {db}/{eid} ({pk}, {state}) of a {st} publish",
                                      db=db, id=eid, pk=pk)
        for (db, eid), (state, att, topic, subj, pk, err) in self.named_rows[sub].items():
            st = self.pk_status(pk)
            if st in ("aborted", "foreign"):
                bad += 1
                if bad <= 40:
                    ctx.violation("uncommitted", f"[{sub}] outbox.deliveries holds {db}/{eid} ({pk}, {state}) of a "
                                  f"{st} publish", db=db, id=eid, pk=pk, sub=sub)

    def check_delivery(self, final, sub):
        ctx = self.ctx
        good = defaultdict(list)
        unknown = set()
        for db, eid, wtx, ok, _s, tok, seq in self.acks_by[sub]:
            if ok is False:
                continue
            st = self.worker_committed(wtx) if ok else "unknown"
            if st == "committed":
                good[(db, eid)].append(wtx)
            elif st == "unknown":
                unknown.add((db, eid))
        self.good_acks[sub] = good
        self.unknown_acks[sub] = unknown
        expected = self.expected(sub)
        stranded = []
        for key, tag in sorted(expected.items()):
            n = len(good.get(key, []))
            row = final.get(key)
            if n > 1:
                ctx.violation("delivery", f"[{sub}] event {key[0]}/{key[1]} acked {n} times in committed transactions",
                              db=key[0], id=key[1], wtx=good[key], sub=sub)
            if n == 0 and key not in unknown:
                stranded.append(key)
            if n:
                nrow = self.named_rows[sub].get(key)
                if nrow is not None and nrow[0] != "delivered":
                    ctx.violation("delivery", f"[{sub}] event {key[0]}/{key[1]} acked but outbox.deliveries says "
                                  f"{nrow[0]} (attempts {nrow[1]})", db=key[0], id=key[1], sub=sub)
            if row is None and sub == "default":
                ctx.violation("delivery", f"committed event {key[0]}/{key[1]} ({tag}) is missing from outbox.log",
                              db=key[0], id=key[1])
        if sub != "default":
            for key in good:
                if key in self.committed and key not in expected:
                    ctx.violation("delivery", f"[{sub}] acked event {key[0]}/{key[1]} of topic {final[key][0]}, "
                                  f"outside its topics", db=key[0], id=key[1], sub=sub)
        self.stranded[sub] = stranded
        if sub != LAG_SUB:   # sub_l's loss is judged by check_lag
            self.describe_stranded_named(stranded, sub)

    def describe_stranded_named(self, stranded, sub):
        """One violation per stranded subject (its first stranded event, in full)
        and per stranded event without a subject: its row in outbox.deliveries (if
        any), whether the log holds the event, the subscription's counters."""
        ctx = self.ctx
        groups = defaultdict(list)
        for db, eid in stranded:
            row = self.final.get((db, eid))
            subj = row[1] if row else None
            groups[(db, subj if subj is not None else f"#{eid}")].append(eid)
        for (db, gkey), eids in sorted(groups.items(), key=lambda kv: (kv[0][0], min(kv[1])))[:40]:
            eid = min(eids)
            c = self.c[db]
            d = c.execute("SELECT event_id, state, attempts, max_attempts, leased_by, lease_expires_at, available_at, "
                          "last_error, dead_at, cancelled_at FROM outbox.deliveries WHERE subscription = %s "
                          "AND event_id = %s", (sub, eid)).fetchone()
            ev = c.execute("SELECT id, topic, subject, state, published_at FROM outbox.events WHERE id = %s",
                           (eid,)).fetchone()
            hint = [f"deliveries: {d[1]}, attempts {d[2]}" if d else "no row in outbox.deliveries"]
            if (db, eid) not in self.log_rows:
                hint.append("not in outbox.log")
            if (db, eid) in ctx.cancelled[sub]:
                hint.append("it was cancelled")
            if (db, eid) in ctx.replayed[sub]:
                hint.append("it was replayed")
            handed = [r for r in self.claims_by[sub] if r[0] == db and r[1] == eid]
            hint.append(f"handed out {len(handed)} times")
            tag = self.committed.get((db, eid))
            t = ctx.pubtx.get(tag, {})
            hint.append(f"publisher {tag} iso={t.get('iso')} mode={t.get('mode')}")
            more = f"; {len(eids) - 1} later events of this subject stranded too" if len(eids) > 1 else ""
            ctx.violation("delivery", f"[{sub}] stranded: committed event {db}/{eid} never acked "
                          f"({'; '.join(hint)}){more}", db=db, id=eid, subj=(ev[2] if ev else None), sub=sub,
                          events_row=fmt_row(ev), deliveries_row=fmt_row(d),
                          counters=f"{sub} lag_events, leases_in_flight, dead_letters: "
                                   f"{self.named_stats.get((db, sub))}")
        if len(groups) > 40:
            ctx.violation("delivery", f"[{sub}] ... {len(groups) - 40} more stranded subjects")

    def excluded_from_order(self, key, row, sub):
        """Why an event is left out of its subject's order: it was cancelled (then
        replayed out of order), or it went dead where the policy lets its subject go on."""
        ctx = self.ctx
        topic, subj, state, pk, errors, maxa = row
        db = key[0]
        if key in ctx.cancelled[sub]:
            return "cancelled"
        # A dead letter is delivered only after a replay (the operator's, or the
        # drain's), so every event that ever went dead and was acked is in replayed.
        went_dead = key in ctx.dead_reported[sub] or key in ctx.replayed[sub]
        pol = NAMED[sub]["dead_letter_policy"] if sub in NAMED else None
        skip = pol == "skip" or (pol is None and (db, topic) in ctx.ever_skip)
        if went_dead and skip:
            return "dead under skip"
        return None

    def chains(self, final, sub):
        """(db, subject) -> the subject's events the subscription must deliver in commit
        order: [(commit ts, publisher tag, k, j, id)], sorted (publish order within a
        transaction); excluded events left out."""
        ctx = self.ctx
        tag_ts = {tag: self.xinfo.get(t["xid"], (None, None))[1] for tag, t in ctx.pubtx.items() if t["xid"]}
        by_subject = defaultdict(list)
        excluded = Counter()
        for key, tag in self.expected(sub).items():
            row = final.get(key)
            if row is None or row[1] is None:
                continue
            why = self.excluded_from_order(key, row, sub)
            if why:
                excluded[why] += 1
                continue
            pk = row[3]
            if pk not in ctx.pubops or tag_ts.get(ctx.pubops[pk][0]) is None:
                excluded["no timestamp"] += 1
                continue
            ptag, k, j = ctx.pubops[pk]
            by_subject[(key[0], row[1])].append((tag_ts[ptag], ptag, k, j, key[1]))
        for evs in by_subject.values():
            evs.sort()
        return by_subject, excluded

    def check_order(self, final, sub):
        """Per subject, committed acks follow the publishers' commit order."""
        ctx = self.ctx
        good = self.good_acks[sub]
        chains, excluded = self.chains(final, sub)
        by_subject = {}
        for (db, subj), evs in chains.items():
            lst = []
            for ts, ptag, k, j, eid in evs:
                acks = good.get((db, eid))
                if not acks or len(acks) != 1:
                    continue
                ats = self.ack_ts(acks[0])
                if ats is None:
                    excluded["no timestamp"] += 1
                    continue
                lst.append((ts, ptag, k, j, ats, eid))
            if lst:
                by_subject[(db, subj)] = lst
        self.order_stats[sub] = {"subjects": len(by_subject), "events": sum(len(v) for v in by_subject.values()),
                                 "excluded": dict(excluded)}
        nviol = 0
        for (db, subj), evs in by_subject.items():
            # (commit ts, publisher tag, k, j, ack ts, id), in publish order. Events of
            # transactions with the same commit timestamp are not ordered against each
            # other; within one transaction publish order counts.
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
                                    f"[{sub}] subject {db}/{subj}: event {e[5]} (publisher {e[1]} committed {e[0]}) "
                                    f"acked at {e[4]}, before event {ref[5]} (publisher {ref[1]} committed "
                                    f"{ref[0]}, acked {ref[4]})", db=db, subj=subj, id=e[5], other=ref[5], sub=sub)
                            break
                    if run_max is None or e[4] > run_max[4]:
                        run_max = e
                if prev_max is None or run_max[4] > prev_max[4]:
                    prev_max = run_max
        if nviol > 20:
            ctx.violation("subject_order", f"[{sub}] ... {nviol - 20} more order violations")

    def check_handouts(self, final, sub):
        """Per subject, an event is handed out only after the subject's previous event
        (in commit order) was finished in this subscription: every committed claim that
        returned it ended after the commit of the previous event's ack, unless its own
        transaction had acked that event first. (A claim in a transaction that rolled
        back is not judged: what justified it, such as its own claim moving an expired
        last attempt to dead under 'skip', was rolled back with it.)"""
        ctx = self.ctx
        good, unknown = self.good_acks[sub], self.unknown_acks[sub]
        chains, _ = self.chains(final, sub)
        hand = defaultdict(list)
        for r in self.claims_by[sub]:
            if self.worker_committed(r[3]) == "committed":
                hand[(r[0], r[1])].append(r)
        acked_in = defaultdict(list)   # (db, id) -> [(wtx, tick)] of ack() = true, whatever the outcome
        for db, eid, wtx, ok, _s, tok, seq in self.acks_by[sub]:
            if ok:
                acked_in[(db, eid)].append((wtx, seq))
        nviol = checked = 0
        for (db, subj), evs in chains.items():
            for p, n in zip(evs, evs[1:]):
                if p[0] == n[0] and p[1] != n[1]:
                    continue   # one commit timestamp, two transactions: not ordered
                pkey = (db, p[4])
                if pkey in unknown or len(good.get(pkey, [])) != 1:
                    continue
                ts = self.ack_ts(good[pkey][0])
                if ts is None:
                    continue
                done = ts.timestamp()
                for h in hand.get((db, n[4]), []):
                    checked += 1
                    if h[8] >= done or any(w == h[3] and s < h[9] for w, s in acked_in.get(pkey, [])):
                        continue
                    nviol += 1
                    if nviol <= 20:
                        ctx.violation(
                            "subject_order",
                            f"[{sub}] subject {db}/{subj}: event {n[4]} handed out (claim {h[3]}, attempt {h[6]}, "
                            f"returned at {time.strftime('%H:%M:%S', time.localtime(h[8]))}"
                            f"{('%.6f' % (h[8] % 1))[1:]}) before the previous event {p[4]} was finished: its ack "
                            f"({good[pkey][0]}) committed at {ts}", db=db, subj=subj, id=n[4], other=p[4], sub=sub)
        self.order_stats[sub]["hand-outs checked"] = checked
        if nviol > 20:
            ctx.violation("subject_order", f"[{sub}] ... {nviol - 20} more hand-outs before the previous event "
                          f"was finished")

    def check_fencing(self, sub):
        """An ack that returned true (in a committed transaction) used a token handed out
        for that event by a claim that did not roll back, and no other token was handed
        out for the event (by a committed claim) between that claim and the ack."""
        ctx = self.ctx
        hand = defaultdict(list)   # (db, id) -> [(claim end tick, effective tick or None, outcome, token, wtx)]
        for r in self.claims_by[sub]:
            st = self.worker_committed(r[3])
            w = ctx.wtx.get(r[3]) or {}
            eff = (w.get("cseq") if w.get("tx") else r[9]) if st == "committed" else None
            hand[(r[0], r[1])].append((r[9], eff, st, r[5], r[3]))
        nviol = checked = 0
        for db, eid, wtx, ok, _s, tok, seq in self.acks_by[sub]:
            if ok is not True or self.worker_committed(wtx) != "committed":
                continue
            checked += 1
            hs = hand.get((db, eid), [])
            mine = [h for h in hs if h[3] == tok and h[0] < seq]
            msg = None
            if not mine:
                msg = f"ack of {db}/{eid} returned true with token {tok}, never handed out for it"
            elif all(h[2] == "aborted" for h in mine):
                msg = (f"ack of {db}/{eid} returned true with token {tok} of a claim that rolled back "
                       f"({mine[-1][4]})")
            else:
                m = max(h[0] for h in mine)
                again = [h for h in hs if h[3] != tok and h[1] is not None and m < h[0] and h[1] < seq]
                if again:
                    msg = (f"stale ack of {db}/{eid} returned true ({wtx}, token {tok}): the event was handed out "
                           f"again with token {again[0][3]} ({again[0][4]}) before the ack started")
            if msg:
                nviol += 1
                if nviol <= 20:
                    ctx.violation("fencing", f"[{sub}] {msg}", db=db, id=eid, wtx=wtx, sub=sub)
        self.order_stats[sub]["acks fenced"] = checked
        if nviol > 20:
            ctx.violation("fencing", f"[{sub}] ... {nviol - 20} more fencing violations")

    def check_cancels(self, sub):
        """A cancel that returned true is kept from its commit until a replay: no claim
        that started after the cancel committed returns the event, and no ack that
        started then returns true (in a committed transaction), unless a replay of it
        that returned true (committed or not: conservative) ran after the cancel began
        and began before that claim or ack ended. Claims are judged whatever their
        transaction did: a hand-out is one. A cancel in a transaction counts from that
        transaction's commit."""
        ctx = self.ctx
        cancels = defaultdict(list)   # (db, id) -> [(cancel start tick, commit tick)]
        for db, s, eid, wtx, t0, t1 in ctx.cancel_log:
            if s != sub:
                continue
            if wtx is not None:
                w = ctx.wtx.get(wtx) or {}
                if self.worker_committed(wtx) != "committed" or w.get("cseq") is None:
                    continue
                t1 = w["cseq"]
            cancels[(db, eid)].append((t0, t1))
        replays = defaultdict(list)   # (db, id) -> [(start tick, end tick)]
        for db, s, eid, r0, r1 in ctx.replay_log:
            if s == sub:
                replays[(db, eid)].append((r0, r1))

        def kept(key, start, end):
            """The cancel in force over [start, end], if any."""
            for c0, c1 in cancels.get(key, []):
                if c1 < start and not any(r1 > c0 and r0 < end for r0, r1 in replays.get(key, [])):
                    return c0, c1
            return None

        nviol = handouts = acks = 0
        for r in self.claims_by[sub]:
            key = (r[0], r[1])
            if key not in cancels:
                continue
            handouts += 1
            k = kept(key, r[10], r[9])
            if k:
                nviol += 1
                if nviol <= 20:
                    ctx.violation("cancel", f"[{sub}] cancelled event {key[0]}/{key[1]} handed out (claim {r[3]}, "
                                  f"{self.worker_committed(r[3])}, attempt {r[6]}, ticks {r[10]}-{r[9]}) after the "
                                  f"cancel committed (tick {k[1]}) with no replay since", db=key[0], id=key[1],
                                  wtx=r[3], subj=r[7], sub=sub)
        for db, eid, wtx, ok, _s, tok, seq in self.acks_by[sub]:
            key = (db, eid)
            if ok is not True or key not in cancels or self.worker_committed(wtx) != "committed":
                continue
            acks += 1
            w = ctx.wtx.get(wtx) or {}
            end = w.get("cseq") if w.get("tx") else w.get("end")
            k = kept(key, seq, end if end is not None else float("inf"))
            if k:
                nviol += 1
                if nviol <= 20:
                    ctx.violation("cancel", f"[{sub}] ack of cancelled event {db}/{eid} returned true ({wtx}, token "
                                  f"{tok}, tick {seq}) after the cancel committed (tick {k[1]}) with no replay since",
                                  db=db, id=eid, wtx=wtx, sub=sub)
        self.order_stats[sub]["cancelled: hand-outs checked"] = handouts
        self.order_stats[sub]["cancelled: acks checked"] = acks
        if nviol > 20:
            ctx.violation("cancel", f"[{sub}] ... {nviol - 20} more hand-outs or acks of cancelled events")

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
        waits = ctx.lockwaits
        if ctx.args.max_lag:
            # a claim waits for a truncation's lock (20 ms lock_timeout + the truncation): documented;
            # also a wait on a relation whose lock and blocker were gone when the sample read them, and
            # a wait for ACCESS SHARE on a ring table whose blocker was gone: only ACCESS EXCLUSIVE
            # conflicts with it, and only the log step's TRUNCATE takes that on a ring table
            rot = [r for r in waits if any((b or {}).get("app") == "chk-rotator" for b in (r["blockers"] or []))
                   or (r["wait"] == "Lock:relation" and not r["blockers"]
                       and (not r["lock"] or all(lk.get("mode") == "AccessShareLock"
                                                 and re.fullmatch(r"outbox\.log_[0-3]", lk.get("rel") or "")
                                                 for lk in r["lock"])))]
            self.rotator_waits = len(rot)
            waits = [r for r in waits if r not in rot]
        for rec in waits[:30]:
            ctx.violation("claim_no_wait", f"claim ({rec['app']}) waited on a lock in {rec['db']} ({rec['wait']} "
                          f"{json.dumps(rec['lock'])}); blockers: {json.dumps(rec['blockers'])[:700]}",
                          **{k: v for k, v in rec.items() if k not in ('blockers', 'db')})
        if len(waits) > 30:
            ctx.violation("claim_no_wait", f"... {len(waits) - 30} more distinct lock waits of claims")


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
            if isinstance(r.get("wtx"), str):
                wtxs.add(r["wtx"])
    # plus how the transactions that touched them ended
    seen = set(id(r) for r in out)
    for r in ctx.ops:
        if (id(r) not in seen and r.get("k") in ("wbegin", "wcommit", "wrollback", "wabort")
                and r.get("wtx") in wtxs):
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
        # Before any load: every event committed from now on belongs to them.
        for name, a in NAMED.items():
            c.execute("SELECT outbox.create_subscription(%s, topics => %s, max_attempts => %s, "
                      "backoff_base => %s::interval, backoff_max => %s::interval, default_lease => %s::interval, "
                      "dead_letter_policy => %s, max_lag => %s::interval)",
                      (name, a["topics"], a["max_attempts"], a["backoff_base"], a["backoff_max"], a["default_lease"],
                       a["dead_letter_policy"], a.get("max_lag")))
        c.close()
    log(f"extension outbox_ext {v} in databases {', '.join(DBS)}; named subscriptions {', '.join(NAMED)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60, help="seconds of load (default 60)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--publishers", type=int, default=5)
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--sworkers", type=int, default=3, help="workers of the named subscriptions")
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
    ap.add_argument("--txn-holders", action="store_true",
                    help="two more workers (default, sub_a) that claim in a transaction and hold it open 2-8 s")
    ap.add_argument("--bulk-publisher", action="store_true",
                    help="a publisher of 5,000-20,000 events per transaction, held open 5-15 s")
    ap.add_argument("--max-lag", action="store_true",
                    help=f"subscription {LAG_SUB} with max_lag {LAG_SPEC['max_lag']} and one slow worker, while the "
                         f"log's retention step (retention_delivered 1 s) runs every 0.5 s")
    ap.add_argument("--serializable", action="store_true",
                    help="two workers at SERIALIZABLE (claims refused with 0A000), more SERIALIZABLE publishers")
    args = ap.parse_args()
    if args.max_lag:
        NAMED[LAG_SUB] = LAG_SPEC
        SUBS.append(LAG_SUB)
        INVARIANTS.append("max_lag")
    if args.serializable:
        INVARIANTS.append("serializable")
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
            f"{args.sworkers} named-subscription workers, operator, named operator, resolver, idler, bigops, "
            f"sampler; databases {DBS}; log {logdir}/ops.jsonl")
        threads = []
        for i in range(args.publishers):
            threads.append(threading.Thread(target=publisher, args=(ctx, i), name=f"pub{i}", daemon=True))
        for i in range(args.workers):
            threads.append(threading.Thread(target=worker, args=(ctx, i), name=f"worker{i}", daemon=True))
        for i in range(args.sworkers):
            threads.append(threading.Thread(target=sworker, args=(ctx, i), name=f"sworker{i}", daemon=True))
        threads.append(threading.Thread(target=operator, args=(ctx,), name="operator", daemon=True))
        threads.append(threading.Thread(target=soperator, args=(ctx,), name="soperator", daemon=True))
        threads.append(threading.Thread(target=idler, args=(ctx,), name="idler", daemon=True))
        threads.append(threading.Thread(target=bigops, args=(ctx,), name="bigops", daemon=True))
        threads.append(threading.Thread(target=scenario_replay, args=(ctx,), name="scen-replay", daemon=True))
        modes = [m for m in ("txn_holders", "bulk_publisher", "max_lag", "serializable") if getattr(args, m)]
        if modes:
            log(f"modes: {', '.join('--' + m.replace('_', '-') for m in modes)}")
        if args.txn_holders:
            threads += [threading.Thread(target=holder, args=(ctx, i, sub), name=f"holder{i}", daemon=True)
                        for i, sub in enumerate(["default", "sub_a"])]
        if args.bulk_publisher:
            threads.append(threading.Thread(target=bulk_publisher, args=(ctx,), name="bulkpub", daemon=True))
        if args.max_lag:
            threads.append(threading.Thread(target=lagger, args=(ctx,), name="lagger", daemon=True))
            threads += [threading.Thread(target=f, args=(ctx, db), name=f"{f.__name__}-{db}", daemon=True)
                        for db in DBS for f in (rotator, keeper)]
        if args.serializable:
            threads += [threading.Thread(target=ser_worker, args=(ctx, i), name=f"serworker{i}", daemon=True)
                        for i in range(2)]
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
                    f"{ctx.count['claimed events']} claimed, {ctx.count['acks true']} acks; named "
                    f"{ctx.count['named claimed events']} claimed, {ctx.count['named acks true']} acks; "
                    f"errors {dict(ctx.errors)}, violations {sum(len(v) for v in ctx.violations.values())}")
        log("load stopped; quiescing")
        quiesce(ctx, threads, res_t)
        an = Analysis(ctx)
        an.outcomes()
        backlog = {}
        for db in DBS:
            for sub in SUBS:
                try:
                    backlog[f"{db}/{sub}"] = drain_left(an.c[db], sub, db)
                except psycopg.Error as ex:
                    ctx.server_error(ex, "backlog", db=db, sub=sub)
        log(f"backlog to drain: {backlog}")

        dt = drain(ctx)
        time.sleep(0.3)
        samp_done.set()
        for t in samp_ts:
            t.join(5)
        ta = time.time()
        an.run()
        log(f"analysis: {time.time() - ta:.1f}s (final state read in {an.load_secs:.1f}s: "
            f"{ {k: round(v, 1) for k, v in an.load_times.items() if v >= 0.5} })")
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
    log(f"named subscriptions: claims {cnt['named claims']} ({cnt['named claimed events']} events), acks true "
        f"{cnt['named acks true']} (+{cnt['named acks true (in tx)']} in explicit tx), acks false {cnt['named acks false']}, "
        f"array acks {cnt['named array acks']} (partial: {cnt['named array acks partial (ambiguous)']}), fails pending "
        f"{cnt['named fails pending']} dead {cnt['named fails dead']} stale {cnt['named fails stale']}, extend_lease "
        f"{cnt['named extend_lease']}, left to expire {cnt['named leases left to expire']}, late acks true "
        f"{cnt['named late acks true']} false {cnt['named late acks false']}, worker tx commits "
        f"{cnt['named worker commits']} rollbacks {cnt['named worker rollbacks']}; operator: replays "
        f"{cnt['named replays']}, replay_dead {cnt['named replay_dead calls']}, cancels {cnt['named cancels']} "
        f"(+{cnt['named cancels in worker tx']} in worker tx), alter_subscription {cnt['alter_subscription']}; "
        f"drain replays {cnt['drain named replays']}")
    fresh = {k[len("fresh "):]: v for k, v in sorted(cnt.items()) if k.startswith("fresh cancel")}
    log(f"cancels of events not read yet / waiting in a batch and their replays: {fresh}")
    for sub in SUBS:
        exp = len(an.expected(sub))
        log(f"  {sub}: {exp} committed events to deliver, {sum(1 for k in an.expected(sub) if len(an.good_acks[sub].get(k, [])) == 1)} "
            f"acked once, {len(an.stranded[sub])} stranded; "
            f"{sum(len(v) for k, v in an.good_acks[sub].items())} committed acks")
    log(f"errors by SQLSTATE: {dict(sorted(ctx.errors.items()))}; lock-wait samples {cnt['lock-wait samples']}")
    report_modes(ctx, an)
    for sub in SUBS:
        log(f"order check {sub}: {an.order_stats.get(sub)}")
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
                for k in ("events_row", "deliveries_row", "counters", "detail"):
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


def report_modes(ctx, an):
    """The figures of the opt-in modes."""
    a, cnt = ctx.args, ctx.count
    if a.txn_holders:
        empty, ready = getattr(an, "hold_figures", (None, None))
        log(f"txn-holders: holds committed {cnt['holds committed']}, rolled back {cnt['holds rolled back']}; "
            f"other workers' claims during holds that came back empty: {empty}, of them with a ready event "
            f"(no subject, committed before, first handed out after; approximate): {ready}")
    if a.bulk_publisher:
        log(f"bulk-publisher: transactions committed {cnt['bulk transactions committed']} "
            f"({cnt['bulk events committed']} events), rolled back {cnt['bulk transactions rolled back']} "
            f"({cnt['bulk events rolled back']} events)")
    if a.max_lag:
        log(f"max-lag: {LAG_SUB} {getattr(an, 'lag_stats', None)}; log rotate calls {cnt['log rotate calls']}, "
            f"ring tables truncated {cnt['ring tables truncated']}, committed events no longer in the log "
            f"{getattr(an, 'retained_out', None)}; claims that waited for a truncation "
            f"{getattr(an, 'rotator_waits', None)}")
    if a.serializable:
        log(f"serializable: claims refused with 0A000 {cnt['serializable claims refused (0A000)']}; report "
            f"transactions committed {cnt['serializable report transactions committed']}, retried "
            f"{cnt['serializable report transactions retried']}, given up "
            f"{cnt['serializable report transactions given up (6 attempts)']}")
        log(f"serializable: 40001/40P01 by call: "
            f"{dict(sorted((k, v) for k, v in cnt.items() if k.startswith(('40001 at', '40P01 at'))))}")


if __name__ == "__main__":
    sys.exit(main())
