#!/usr/bin/env python3
"""Soak test for outbox_ext with an independent invariant checker.

N publisher processes (random topics, subjects, dispatch keys, delays, rollbacks)
and M worker processes (random transient failures, permanent failures, slow
handlers that outlive their lease, SIGKILL crashes) run for --duration seconds,
alongside the background worker's maintenance (every 1 s; it also seals and
truncates the event log's ring tables, outbox.retention_delivered being 15s) and
CALL outbox.purge('2 s') every second. Every worker claims from each subscription
in turn (SUBS): the install's `default` (every topic, the topics' policy), and two
made with outbox.create_subscription before the publishers start:
`soak_log` (default's configuration) and `soak_filt` (soak.orders and soak.mail
only, with its own max_attempts, backoff, lease and dead-letter policy). Then the
workers drain every subscription and the checker reads every process's log plus
the public views (outbox.deliveries per subscription) and verifies, per
subscription:

  delivery     every committed event whose topic matches the subscription's filter is
               delivered (ack()=true logged by a worker of that subscription, or
               state delivered), or dead for a justified reason, or still pending
               behind a dead letter that blocks its subject there; no event outside
               the filter is claimed or has a row; one row per event and subscription
  uncommitted  no event of a rolled-back transaction is ever stored or claimed, and
               nothing exists that no publisher published (a log subscription's
               payload is the one its publisher wrote)
  order        per subject, claims ordered by claim time never go back in sequence
               number (seq k may be redelivered only until k+1 was claimed), and
               acked claims rise strictly
  keys         at most one event per dispatch key; a repeated key returns the first id;
               no subscription is handed two events of one key
  leases       no two live leases of one event; after the drain no lease is stuck;
               no lease token is handed out by two claim calls (of any subscription)
  attempts     each event's claims carry attempts 1..k exactly once; k = attempts
               column; an ack or a dead-lettering fail is on the last claim
  dead         dead letters exactly where a failure was permanent, attempts ran out
               (failure or expired lease at the subscription's max_attempts), and
               never elsewhere; the max_attempts shown is the policy's; a dead
               letter blocks its subject exactly under the policy that applies
               (subscription's, else topic's)

By default it starts its own throwaway cluster (scripts/pgcluster.sh, name
outbox-soak, port 5481, preloaded) and stops it at the end:
  python pg_test/suites/soak.py --duration 60      # what CI runs (pg_test/suites/soak.sh)
  python pg_test/suites/soak.py --duration 3600    # the one-hour soak
Last line: `N passed, N failed` (one per invariant plus the run itself); exit 1 on failure.
"""

import argparse
import glob
import json
import os
import random
import shutil
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

# topic -> (max_attempts, backoff_base, backoff_max, default_lease, policy, retention_delivered)
# None = not registered: GUC defaults (set in cluster_settings()).
TOPICS = {
    "soak.orders": (6, "50 ms", "500 ms", None, "block", "2 s"),
    "soak.billing": (5, "100 ms", "1 s", "2 s", "block", None),
    "soak.mail": (3, "50 ms", "300 ms", None, "skip", None),
    "soak.misc.x": None,
}
GUC_MAX_ATTEMPTS = 10
GUC_LEASE = 3.0
CLUSTER_SETTINGS = {
    "outbox.maintenance_interval": "1s",
    "outbox.default_lease": "3s",
    "outbox.backoff_base": "100ms",
    "outbox.backoff_max": "1s",
    "outbox.max_attempts": str(GUC_MAX_ATTEMPTS),
    # The log's ring tables are sealed and truncated during the run (once every
    # subscription has read them), so the soak covers the log's retention too; for an
    # event gone from outbox.deliveries the checker relies on the workers' ack logs.
    "outbox.retention_delivered": "15s",
}
NSUBJECTS = 40
PURGE_AGE = 2.0

# The subscriptions the workers claim from, each worker taking them in turn.
# 'default' is the install's, the others are made by outbox.create_subscription
# before the publishers start. name -> its filter and policy (None = the topic's
# / the GUC).
SUBS = {
    "default": {"topics": None, "max_attempts": None, "backoff_base": None, "backoff_max": None,
                "default_lease": None, "policy": None},
    "soak_log": {"topics": None, "max_attempts": None, "backoff_base": None, "backoff_max": None,
                 "default_lease": None, "policy": None},
    "soak_filt": {"topics": ["soak.orders", "soak.mail"], "max_attempts": 4, "backoff_base": "50 ms",
                  "backoff_max": "400 ms", "default_lease": "2 s", "policy": "skip"},
}
LOG_SUBS = list(SUBS)


def topic_matches(topic, pattern):
    """claim's grammar: an exact topic, a prefix ending in '.*', or '*'."""
    if pattern == "*":
        return True
    if pattern.endswith(".*"):
        return topic.startswith(pattern[:-1])
    return topic == pattern


def sub_matches(sub, topic):
    cfg = SUBS[sub]
    return not cfg or cfg["topics"] is None or any(topic_matches(topic, p) for p in cfg["topics"])


def max_attempts_of(topic, sub="default"):
    cfg = SUBS.get(sub)
    if cfg and cfg["max_attempts"]:
        return cfg["max_attempts"]
    t = TOPICS.get(topic)
    return t[0] if t else GUC_MAX_ATTEMPTS


def lease_of(topic, sub="default"):
    """The lease a claim without one gives an event of `topic`; None when it
    depends on the claim: a subscription of the log without a default_lease
    gives a batch round the longest lease of its events' topics (0.11.0)."""
    cfg = SUBS.get(sub)
    if cfg:
        return float(cfg["default_lease"].split()[0]) if cfg["default_lease"] else None
    t = TOPICS.get(topic)
    return float(t[3].split()[0]) if t and t[3] else GUC_LEASE


def policy_of(topic, sub="default"):
    cfg = SUBS.get(sub)
    if cfg and cfg["policy"]:
        return cfg["policy"]
    t = TOPICS.get(topic)
    return t[4] if t else "block"


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class JLog:
    """Append-only JSON-lines log, flushed per line so a SIGKILL loses nothing written."""

    def __init__(self, path):
        self.f = open(path, "a", buffering=1)

    def __call__(self, **rec):
        rec["t"] = time.time()
        self.f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self.f.flush()


def connect(dsn, retry_for=0.0):
    """retry_for: keep trying that many seconds (a child may start while the server
    restarts; the supervisor decides whether that is a failure)."""
    deadline = time.time() + retry_for
    while True:
        try:
            return psycopg.connect(dsn, autocommit=True, connect_timeout=5)
        except psycopg.OperationalError:
            if time.time() >= deadline:
                raise
            time.sleep(0.5)


# ---------------------------------------------------------------------------
# Publisher process
# ---------------------------------------------------------------------------

def publisher_main(dsn, idx, until, logdir, seed):
    rnd = random.Random(seed)
    out = JLog(os.path.join(logdir, f"pub{idx}.log"))
    conn = connect(dsn, 30)
    topics = list(TOPICS)
    n = 0
    while time.time() < until:
        tx = f"p{idx}-{n}"
        n += 1
        evs = []
        for j in range(rnd.randint(1, 4)):
            topic = rnd.choice(topics)
            subj = f"s{rnd.randrange(NSUBJECTS)}" if rnd.random() < 0.5 else None
            key = None
            r = rnd.random()
            if r < 0.10:
                key = f"k-{tx}-{j}"
            elif r < 0.13:
                # Shared by every publisher for half a second: concurrent duplicates.
                # Retention (2 s after delivery) cannot remove the first one that soon.
                key = f"b-{int(time.time() * 2)}"
            # Failures that dead-letter only where they cannot block a subject forever.
            may_die = subj is None or policy_of(topic) == "skip"
            poison = may_die and rnd.random() < 0.02
            flaky = rnd.randint(1, 4) if may_die and not poison and rnd.random() < 0.04 else 0
            delay = round(rnd.uniform(0.05, 2.0), 3) if rnd.random() < 0.1 else None
            evs.append({"topic": topic, "subj": subj, "key": key, "poison": poison, "flaky": flaky,
                        "delay": delay, "j": j, "dup": key is not None and rnd.random() < 0.2})
        # One lock order for all publishers (subject counter rows, then the extension's
        # subject lock and dispatch-key rows) keeps them from deadlocking each other.
        evs.sort(key=lambda e: (e["subj"] is None, e["subj"] or "", e["key"] or ""))
        done = []
        phase = "tx"
        try:
            conn.execute("BEGIN")
            for e in evs:
                seq = None
                if e["subj"]:
                    # The counter row is locked until commit, so seq order = commit order.
                    seq = conn.execute(
                        "INSERT INTO soak.subject_seq AS s VALUES (%s, 1) ON CONFLICT (subject) "
                        "DO UPDATE SET seq = s.seq + 1 RETURNING seq", (e["subj"],)).fetchone()[0]
                payload = {"tx": tx, "j": e["j"], "subj": e["subj"], "seq": seq, "key": e["key"],
                           "poison": e["poison"], "flaky": e["flaky"], "pad": "x" * rnd.randrange(200)}
                eid = conn.execute(
                    "SELECT outbox.publish(%s, %s::jsonb, %s, %s, NULL, "
                    "CASE WHEN %s::float8 IS NULL THEN NULL ELSE clock_timestamp() + %s::float8 * interval '1 s' END)",
                    (e["topic"], json.dumps(payload), e["subj"], e["key"], e["delay"], e["delay"])).fetchone()[0]
                rec = {"id": eid, "j": e["j"], "topic": e["topic"], "subj": e["subj"], "seq": seq, "key": e["key"],
                       "poison": e["poison"], "flaky": e["flaky"]}
                if e["dup"]:
                    rec["dup"] = conn.execute("SELECT outbox.publish(%s, '\"dup\"', %s, %s)",
                                              (e["topic"], e["subj"], e["key"])).fetchone()[0]
                done.append(rec)
            if rnd.random() < 0.08:
                phase = "rollback"
                conn.execute("ROLLBACK")
                out(k="rollback", tx=tx, ev=done)
            else:
                phase = "commit"
                conn.execute("COMMIT")
                out(k="commit", tx=tx, ev=done)
                # Republish a key of a committed transaction: must return the same id.
                keyed = [d for d in done if d["key"] and d["key"].startswith("k-")]
                if keyed and rnd.random() < 0.3:
                    d = rnd.choice(keyed)
                    got = conn.execute("SELECT outbox.publish(%s, '\"again\"', NULL, %s)",
                                       (d["topic"], d["key"])).fetchone()[0]
                    out(k="repub", key=d["key"], want=d["id"], got=got)
        except psycopg.Error as ex:
            # Never committed unless the error came from COMMIT itself.
            out(k="unknown" if phase == "commit" else "aborted", tx=tx, ev=done,
                sqlstate=ex.sqlstate, err=str(ex)[:300])
            try:
                conn.close()
            except Exception:
                pass
            time.sleep(0.1)
            conn = connect(dsn, 30)
        time.sleep(rnd.uniform(0.01, 0.06))
    conn.close()


# ---------------------------------------------------------------------------
# Worker process
# ---------------------------------------------------------------------------

def worker_main(dsn, name, until, logdir, seed, chaos, drainfile):
    rnd = random.Random(seed)
    out = JLog(os.path.join(logdir, f"work-{name}.log"))
    conn = connect(dsn, 30)
    # Crash after an exponentially distributed lifetime (mean 20 s): a few per minute.
    crash_at = time.time() + rnd.expovariate(1 / 20.0) if chaos else float("inf")
    filters = [None, None, ["*"], ["soak.*"], ["soak.orders", "soak.billing"], ["soak.mail", "soak.misc.*"]]
    # Each worker takes the subscriptions in turn, from a random one; it sleeps
    # only when a whole round of them returned nothing.
    subs = list(SUBS)
    turn = rnd.randrange(len(subs))
    idle = 0
    ncall = 0

    def crash(where):
        out(k="crash", where=where)
        os.kill(os.getpid(), signal.SIGKILL)

    while time.time() < until:
        draining = os.path.exists(drainfile)
        try:
            lease = rnd.choice([None, 1.0, 2.0, 3.0])
            topics = rnd.choice(filters)
            sub = subs[turn % len(subs)]
            turn += 1
            ncall += 1
            rows = conn.execute(
                "SELECT id, topic, subject, dispatch_key, payload, attempt, lease_token::text, "
                "extract(epoch FROM lease_expires_at)::float8, extract(epoch FROM clock_timestamp())::float8 "
                "FROM outbox.claim(%s, %s, %s::float8 * interval '1 s', %s, %s)",
                (name, rnd.randint(1, 8), lease, topics, None if sub == "default" else sub)).fetchall()
            for i, topic, subj, key, p, att, tok, exp, after in rows:
                ls = lease if lease is not None else lease_of(topic, sub)
                # Where the lease's length depends on the round, the server's
                # clock after the claim stands for its start (never earlier).
                at = exp - ls if ls is not None else after
                out(k="claim", sub=sub, id=i, att=att, at=at, exp=exp, topic=topic, subj=subj, key=key,
                    tx=p.get("tx") if isinstance(p, dict) else None,
                    pj=p.get("j") if isinstance(p, dict) else None,
                    seq=p.get("seq") if isinstance(p, dict) else None, tok=tok, cn=ncall)
            if not rows:
                idle += 1
                if idle >= len(subs):
                    idle = 0
                    time.sleep(rnd.uniform(0.02, 0.1))
                continue
            idle = 0
            if chaos and not draining and time.time() > crash_at and rnd.random() < 0.5:
                crash("after claim")
            for n, (i, topic, subj, key, p, att, tok, exp, after) in enumerate(rows):
                ls = lease if lease is not None else lease_of(topic, sub)
                ls = ls if ls is not None else max(exp - after, 0.1)
                p = p if isinstance(p, dict) else {}
                if chaos and not draining and time.time() > crash_at:
                    crash(f"in batch at {n}")
                if chaos and not draining and rnd.random() < 0.006:
                    # Slow handler: sometimes heartbeats, often outlives its lease.
                    nap = rnd.uniform(0.2, 1.6 * ls)
                    if rnd.random() < 0.4:
                        time.sleep(ls * 0.4)
                        r = conn.execute("SELECT extract(epoch FROM outbox.extend_lease(%s, %s::uuid, %s::float8 * interval '1 s'))::float8",
                                         (i, tok, ls)).fetchone()[0]
                        out(k="ext", sub=sub, id=i, att=att, exp=r)
                        nap -= ls * 0.4
                    out(k="slow", sub=sub, id=i, att=att, nap=nap)
                    time.sleep(max(0.0, nap))
                if p.get("poison"):
                    res = conn.execute("SELECT outbox.fail(%s, %s::uuid, 'poison', NULL, true)", (i, tok)).fetchone()[0]
                    out(k="fail", sub=sub, id=i, att=att, perm=True, res=res)
                elif att <= p.get("flaky", 0) or rnd.random() < 0.04:
                    retry = rnd.choice([None, 0.0, 0.05, 0.3])
                    res = conn.execute("SELECT outbox.fail(%s, %s::uuid, 'transient', %s::float8 * interval '1 s')",
                                       (i, tok, retry)).fetchone()[0]
                    out(k="fail", sub=sub, id=i, att=att, perm=False, res=res)
                else:
                    ok = conn.execute("SELECT outbox.ack(%s, %s::uuid)", (i, tok)).fetchone()[0]
                    out(k="ack", sub=sub, id=i, att=att, ok=ok)
        except psycopg.Error as ex:
            out(k="err", sqlstate=ex.sqlstate, err=str(ex)[:300])
            try:
                conn.close()
            except Exception:
                pass
            time.sleep(0.2)
            conn = connect(dsn, 30)
    conn.close()


# ---------------------------------------------------------------------------
# Supervisor
# ---------------------------------------------------------------------------

def setup_db(dsn):
    with connect(dsn) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
        c.execute("DROP SCHEMA IF EXISTS soak CASCADE")
        c.execute("CREATE SCHEMA soak")
        c.execute("CREATE TABLE soak.subject_seq (subject text PRIMARY KEY, seq int NOT NULL)")
        c.execute("TRUNCATE outbox.dispatch_keys, outbox.topics")
        # 'default' as a fresh install makes it. A database that is not fresh
        # (--dsn) gets it made again, so that it has no earlier event.
        exists = c.execute("SELECT EXISTS (SELECT 1 FROM outbox.subscriptions WHERE name = 'default')").fetchone()[0]
        if not exists or c.execute("SELECT EXISTS (SELECT 1 FROM outbox.events)").fetchone()[0]:
            if exists:
                c.execute("SELECT outbox.drop_subscription('default', force => true)")
            c.execute("SELECT outbox.create_subscription('default', start => 'now')")
        for t, cfg in TOPICS.items():
            if cfg:
                ma, bb, bm, dl, pol, rd = cfg
                c.execute("SELECT outbox.create_topic(%s, %s, %s::interval, %s::interval, %s::interval, %s, %s::interval)",
                          (t, ma, bb, bm, dl, pol, rd))
        for k, v in CLUSTER_SETTINGS.items():
            c.execute(f"ALTER SYSTEM SET {k} = '{v}'")
        c.execute("SELECT pg_reload_conf()")
        # The subscriptions of the log, made afresh before any publisher starts: each
        # receives every event committed from now on whose topic matches its filter.
        for name, cfg in SUBS.items():
            if not cfg or name == "default":
                continue
            if c.execute("SELECT 1 FROM outbox.subscription_catalog WHERE name = %s", (name,)).fetchone():
                c.execute("SELECT outbox.drop_subscription(%s, force => true)", (name,))
            c.execute("SELECT outbox.create_subscription(%s, topics => %s, start => 'now', max_attempts => %s, "
                      "backoff_base => %s::interval, backoff_max => %s::interval, default_lease => %s::interval, "
                      "dead_letter_policy => %s)",
                      (name, cfg["topics"], cfg["max_attempts"], cfg["backoff_base"], cfg["backoff_max"],
                       cfg["default_lease"], cfg["policy"]))
        return c.execute("SELECT count(*) FROM outbox.maintenance_log").fetchone()[0]


class Supervisor:
    def __init__(self, args, dsn, logdir):
        self.args, self.dsn, self.logdir = args, dsn, logdir
        self.drainfile = os.path.join(logdir, "DRAIN")
        self.procs = {}  # name -> Popen
        self.crashes = 0
        self.abnormal = []  # exits other than our own SIGKILLs
        self.incarnation = Counter()
        self.purged = 0
        self.purge_errors = []
        self.max_expired_lag = 0.0
        self.log_tables = set()  # (ring table, opened_at) seen: how often the log rotated
        self.stop_bg = threading.Event()
        self.rnd = random.Random(args.seed)

    def spawn(self, role, idx, until):
        name = f"w{idx}.{self.incarnation[idx]}" if role == "worker" else f"p{idx}"
        if role == "worker":
            self.incarnation[idx] += 1
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--dsn", self.dsn, "--name", name,
               "--index", str(idx), "--until", str(until), "--logdir", self.logdir,
               "--seed", str(self.rnd.randrange(1 << 30)), "--chaos", "1"]
        self.procs[(role, idx)] = subprocess.Popen(cmd)

    def background(self):
        """Purges with a short retention and samples default's expired-lease lag
        (outbox.deliveries, every 5 s: a read of the whole retained log)."""
        c = None
        n = 0
        while not self.stop_bg.wait(1.0):
            try:
                if c is None:
                    c = connect(self.dsn)
                r = c.execute("CALL outbox.purge(%s::float8 * interval '1 s')", (PURGE_AGE,)).fetchone()
                self.purged += r[0] or 0
                n += 1
                if n % 5 == 0:
                    lag = c.execute("SELECT COALESCE(extract(epoch FROM clock_timestamp() - min(lease_expires_at)), 0)::float8 "
                                    "FROM outbox.deliveries WHERE subscription = 'default' AND state = 'leased' "
                                    "AND lease_expires_at < clock_timestamp()").fetchone()[0]
                    self.max_expired_lag = max(self.max_expired_lag, lag)
                self.log_tables.update(c.execute("SELECT n, opened_at::text FROM outbox.log_state").fetchall())
            except psycopg.Error as ex:
                self.purge_errors.append(str(ex)[:200])
                c = None
        if c is not None:
            c.close()

    def run(self):
        a = self.args
        until = time.time() + a.duration
        work_until = until + a.drain_timeout + 30
        for i in range(a.publishers):
            self.spawn("publisher", i, until)
        for i in range(a.workers):
            self.spawn("worker", i, work_until)
        bg = threading.Thread(target=self.background, daemon=True)
        bg.start()
        last_report = time.time()
        while time.time() < until:
            time.sleep(0.2)
            self.reap(work_until, respawn=True)
            if time.time() - last_report >= max(10, a.duration / 6):
                last_report = time.time()
                with connect(self.dsn, 30) as c:
                    st = dict(c.execute("SELECT state, count(*) FROM outbox.events GROUP BY 1").fetchall())
                    sst = defaultdict(dict)
                    for sub, state, n in c.execute(
                            "SELECT subscription, state, count(*) FROM outbox.deliveries "
                            "WHERE subscription = ANY (%s) GROUP BY 1, 2", (LOG_SUBS,)).fetchall():
                        sst[sub][state] = n
                log(f"  running: {st}, worker crashes {self.crashes}, purged {self.purged}")
                for sub in LOG_SUBS:
                    log(f"    {sub} (retained in the log): {sst.get(sub, {})}")
        for i in range(a.publishers):
            p = self.procs[("publisher", i)]
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                self.abnormal.append(f"publisher {i} did not stop")
            if p.returncode not in (0, -signal.SIGKILL):
                self.abnormal.append(f"publisher {i} exited with {p.returncode}")
        # Drain: no more crashes or slow handlers; stop when nothing claimable is left.
        open(self.drainfile, "w").close()
        t0 = time.time()
        drained = False
        while time.time() - t0 < a.drain_timeout:
            self.reap(work_until, respawn=True)
            with connect(self.dsn, 30) as c:
                left = drain_left(c)
            if left == 0:
                drained = True
                break
            time.sleep(0.5)
        self.drain_time = time.time() - t0
        self.drained = drained
        self.kill_all()
        self.stop_bg.set()
        bg.join(10)

    def kill_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs.values():
            p.wait()

    def reap(self, work_until, respawn):
        for (role, i), p in list(self.procs.items()):
            rc = p.poll()
            if rc is None or role != "worker":
                continue
            if rc == -signal.SIGKILL:
                self.crashes += 1
            elif time.time() < work_until - 1:
                self.abnormal.append(f"worker {i} exited with {rc}")
                if len(self.abnormal) > 10:
                    raise RuntimeError(f"workers keep failing: {self.abnormal[-3:]}")
            if respawn and time.time() < work_until - 5:
                self.spawn("worker", i, work_until)
            else:
                del self.procs[(role, i)]


def drain_left(c):
    """Events some subscription still has to deliver (outbox.deliveries; on the log an
    event not read yet is pending): pending or leased, and not behind a dead letter of
    its subject whose policy blocks it there (the topics' policies do not change here)."""
    rows = c.execute("SELECT subscription, event_id, topic, subject, state FROM outbox.deliveries "
                     "WHERE subscription = ANY (%s) AND state IN ('pending', 'leased', 'dead')",
                     (list(SUBS),)).fetchall()
    first_block = {}   # (subscription, subject) -> the smallest id of a dead letter that blocks it
    for sub, i, topic, subj, st in rows:
        if st == "dead" and subj is not None and policy_of(topic, sub) == "block":
            k = (sub, subj)
            first_block[k] = min(first_block.get(k, i), i)
    return sum(1 for sub, i, topic, subj, st in rows
               if st != "dead" and not (subj is not None and first_block.get((sub, subj), i) < i))


# ---------------------------------------------------------------------------
# Checker
# ---------------------------------------------------------------------------

class Rec:
    """A log record with slots: an hour of claims as dicts would take gigabytes."""
    __slots__ = ("k", "t", "src", "id", "att", "at", "exp", "topic", "subj", "key", "tx", "pj", "seq",
                 "ok", "perm", "res", "ev", "want", "got", "sqlstate", "err", "where", "nap", "sub", "tok", "cn")

    def __init__(self, d):
        for k, v in d.items():
            if isinstance(v, str) and k in ("k", "topic", "subj", "res", "sub"):
                v = sys.intern(v)
            setattr(self, k, v)

    def __getitem__(self, k):
        return getattr(self, k)

    def get(self, k, default=None):
        return getattr(self, k, default)


def read_logs(logdir, prefix):
    recs = []
    for path in sorted(glob.glob(os.path.join(logdir, prefix + "*.log"))):
        src = sys.intern(os.path.basename(path)[:-4])
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line cannot happen (flushed per line), but be safe
                d["src"] = src
                recs.append(Rec(d))
    return recs


class Checker:
    # A row of the final state, per subscription: (id, topic, subject, dispatch_key, state,
    # attempts, max_attempts, payload tx, payload j, last_error, lease expiry epoch).
    # Read from outbox.deliveries for every subscription.
    def __init__(self, dsn, logdir):
        self.v = defaultdict(list)   # invariant -> violations
        pubs = read_logs(logdir, "pub")
        works = read_logs(logdir, "work-")
        self.pubs, self.works = pubs, works
        self.sdb = {}       # subscription -> {id: row}
        self.sblocks = {}   # subscription -> {id of a dead letter: whether it blocks its subject}
        self.sstuck = {}    # subscription -> leases expired > 5 s ago still leased
        self.dup_rows = []  # (subscription, id, n): outbox.deliveries rows repeated
        self.sown = {}      # subscription -> ids whose row is the event's own (outbox.log_exceptions)
        self.t_read = time.time()
        with connect(dsn) as c:
            self.db = {}
            self.dup_keys_db = c.execute(
                "SELECT dispatch_key, array_agg(id) FROM outbox.events WHERE dispatch_key IS NOT NULL "
                "GROUP BY 1 HAVING count(*) > 1").fetchall()
            # The subscriptions of the log: their state per event from outbox.deliveries
            # (one row per retained event and subscription), the payload from the event's
            # own row (outbox.log_exceptions) or the log, and whether a dead letter blocks.
            for sub in LOG_SUBS:
                self.sdb[sub], self.sblocks[sub], self.sown[sub] = {}, {}, set()
            for r in c.execute(
                    "SELECT d.subscription, d.event_id, d.topic, d.subject, COALESCE(x.dispatch_key, l.dispatch_key), "
                    "d.state, d.attempts, d.max_attempts, COALESCE(x.payload, l.payload)->>'tx', "
                    "(COALESCE(x.payload, l.payload)->>'j')::int, d.last_error, "
                    "extract(epoch FROM d.lease_expires_at)::float8, x.blocks, x.id IS NOT NULL "
                    "FROM outbox.deliveries d "
                    "LEFT JOIN outbox.log_exceptions x ON x.subscription = d.subscription AND x.id = d.event_id "
                    "LEFT JOIN outbox.log l ON x.id IS NULL AND l.id = d.event_id "
                    "WHERE d.subscription = ANY (%s)", (LOG_SUBS,)).fetchall():
                sub, row = r[0], r[1:12]
                if row[0] in self.sdb[sub]:
                    self.dup_rows.append((sub, row[0]))
                self.sdb[sub][row[0]] = row
                if row[4] == "dead":
                    self.sblocks[sub][row[0]] = r[12]
                if r[13]:
                    self.sown[sub].add(row[0])
            for sub, n in c.execute(
                    "SELECT subscription, count(*) FROM outbox.deliveries WHERE subscription = ANY (%s) "
                    "AND state = 'leased' AND lease_expires_at < clock_timestamp() - interval '5 s' GROUP BY 1",
                    (list(SUBS),)).fetchall():
                self.sstuck[sub] = n
            self.db = self.sdb["default"]

    def bad(self, inv, msg):
        self.v[inv].append(msg)

    def run(self):
        recs = defaultdict(list)     # id -> committed publish records that returned it
        never = set()       # (tx, j) of rolled-back / aborted transactions
        unknown = set()
        key_ids = defaultdict(set)   # key -> committed ids
        self.stats = Counter()
        for r in self.pubs:
            k = r["k"]
            if k in ("commit", "rollback", "aborted", "unknown"):
                self.stats["tx_" + k] += 1
            if k == "commit":
                for e in r["ev"]:
                    e = dict(e, tx=r["tx"], t=r["t"])
                    if recs[e["id"]] and recs[e["id"]][0]["key"] != e["key"]:
                        self.bad("keys", f"id {e['id']} returned to two publishes with different keys")
                    recs[e["id"]].append(e)
                    if e["key"]:
                        key_ids[e["key"]].add(e["id"])
                    if "dup" in e and e["dup"] != e["id"]:
                        self.bad("keys", f"repeated key {e['key']} in one transaction returned {e['dup']}, first {e['id']}")
            elif k in ("rollback", "aborted"):
                never.update((r["tx"], e["j"]) for e in r["ev"])
                if k == "aborted" and r.get("sqlstate") not in ("40P01",):
                    self.bad("run", f"publisher {r['src']} error {r.get('sqlstate')}: {r.get('err')}")
            elif k == "unknown":
                unknown.update((r["tx"], e["j"]) for e in r["ev"])
                self.bad("run", f"publisher {r['src']} COMMIT failed: {r.get('err')}")
            elif k == "repub":
                self.stats["republished keys"] += 1
                if r["got"] != r["want"]:
                    self.bad("keys", f"republish of key {r['key']} returned {r['got']}, first id {r['want']}")

        # Per subscription: id -> [claim rec], [ack rec], [fail rec], [extend rec].
        sclaims = {s: defaultdict(list) for s in SUBS}
        sacks = {s: defaultdict(list) for s in SUBS}
        sfails = {s: defaultdict(list) for s in SUBS}
        sexts = {s: defaultdict(list) for s in SUBS}
        tokens = {}   # lease token -> (subscription, worker, claim call) that got it
        for r in self.works:
            k = r["k"]
            self.stats["w_" + k] += 1
            sub = r.get("sub", "default")
            if k in ("claim", "ack", "fail", "ext") and sub not in SUBS:
                self.bad("run", f"worker {r['src']} logged {k} for unknown subscription {sub}")
                continue
            if k == "claim":
                sclaims[sub][r["id"]].append(r)
                # Fencing needs a fresh token per delivery: one claim call may share one
                # among its events, but no other call (of any subscription) may get it.
                tok, who = r.get("tok"), (sub, r["src"], r.get("cn"))
                if tok is not None:
                    if tokens.setdefault(tok, who) != who:
                        self.bad("leases", f"{sub} event {r['id']} attempt {r['att']}: lease token {tok} "
                                           f"already handed out by another claim {tokens[tok]}")
                    del r.tok
            elif k == "ack":
                sacks[sub][r["id"]].append(r)
            elif k == "fail":
                sfails[sub][r["id"]].append(r)
            elif k == "ext":
                sexts[sub][r["id"]].append(r)
            elif k == "err":
                self.bad("run", f"worker {r['src']} error {r.get('sqlstate')}: {r.get('err')}")
        tokens = None
        claims = sclaims["default"]

        # An id returned to several publishes (a dispatch-key hit) belongs to the one
        # whose payload is stored; the others inserted nothing.
        committed = {}
        for i, lst in recs.items():
            row = self.db.get(i)
            tok = (row[7], row[8]) if row else ((claims[i][0]["tx"], claims[i][0]["pj"]) if i in claims else None)
            if tok is None:
                # Gone from 'default' and never claimed there: what another subscription stored.
                for sub in LOG_SUBS:
                    lrow, lcl = self.sdb[sub].get(i), sclaims[sub].get(i)
                    if lrow or lcl:
                        tok = (lrow[7], lrow[8]) if lrow else (lcl[0]["tx"], lcl[0]["pj"])
                        break
            mine = [e for e in lst if (e["tx"], e["j"]) == tok]
            committed[i] = mine[0] if mine else min(lst, key=lambda e: e["t"])
            if tok is not None and not mine:
                self.bad("uncommitted", f"event {i} carries payload {tok}, not that of any committed publish "
                                        f"returning it {[(e['tx'], e['j']) for e in lst]}")

        self.outcome = {}
        nsubj = set()
        for sub in SUBS:
            db, blocks = self.sdb[sub], self.sblocks[sub]
            stuck = self.sstuck.get(sub, 0)
            nsubj |= self.check_subscription(sub, db, blocks, stuck, sclaims[sub], sacks[sub], sfails[sub],
                                             sexts[sub], committed, never, unknown)
        for sub, i in self.dup_rows:
            self.bad("delivery", f"[{sub}] event {i} has more than one row in outbox.deliveries")

        # --- dispatch keys ------------------------------------------------------
        for key, ids in key_ids.items():
            if len(ids) > 1:
                # Allowed only if the earlier event could have been purged before the
                # later publish (2 s after its ack); keys here never live that long.
                # A subscription of the log keeps the key while it retains the event:
                # at least until its own ack (1 s of slack for the logs' timestamps).
                first = min(ids, key=lambda x: committed[x]["t"])
                ack_t = min([a["t"] for a in sacks["default"].get(first, []) if a["ok"]] or [float("inf")])
                log_ack_t = max([min([a["t"] for a in sacks[s].get(first, []) if a["ok"]] or [float("inf")])
                                 for s in LOG_SUBS if sub_matches(s, committed[first]["topic"])] or [0.0])
                later = [x for x in ids if x != first]
                if not all(committed[x]["t"] - ack_t > PURGE_AGE and committed[x]["t"] - log_ack_t > -1.0
                           for x in later):
                    self.bad("keys", f"dispatch key {key} has {len(ids)} committed events {sorted(ids)}")
        for key, ids in self.dup_keys_db:
            self.bad("keys", f"dispatch key {key} stored on {len(ids)} events {ids}")
        for sub in SUBS:
            claimed_keys = defaultdict(set)
            for i, cl in sclaims[sub].items():
                if cl[0]["key"]:
                    claimed_keys[cl[0]["key"]].add(i)
            for key, ids in claimed_keys.items():
                if len(ids) > 1 and not (len(key_ids.get(key, ())) == len(ids)):
                    self.bad("keys", f"{'' if sub == 'default' else f'[{sub}] '}dispatch key {key} delivered as "
                                     f"{len(ids)} events {sorted(ids)}")
        self.stats["committed events"] = len(committed)
        self.stats["claims"] = sum(len(c) for s in SUBS for c in sclaims[s].values())
        self.stats["subjects"] = len(nsubj)
        return self.v

    def check_subscription(self, sub, db, blocks, stuck, claims, acks, fails, exts, committed, never, unknown):
        """Every invariant but keys' publish side, for one subscription: db is its final
        state per event (outbox.deliveries), blocks its dead letters' blocking (its
        rows of their own), claims/acks/fails/exts its workers' records.
        Returns the subjects claimed."""
        pre = "" if sub == "default" else f"[{sub}] "

        # --- uncommitted / strays --------------------------------------------
        for i, row in db.items():
            tok = (row[7], row[8])
            if tok in never:
                self.bad("uncommitted", f"{pre}event {i} of rolled-back transaction {tok} is stored ({row[4]})")
            elif i not in committed and tok not in unknown:
                self.bad("uncommitted", f"{pre}event {i} {tok} was never published by a committed transaction")
            elif i in committed and tok != (committed[i]["tx"], committed[i]["j"]):
                self.bad("uncommitted", f"{pre}event {i} carries payload {tok}, its publisher's "
                                        f"{(committed[i]['tx'], committed[i]['j'])}")
            if not sub_matches(sub, row[1]):
                self.bad("delivery", f"{pre}event {i} of topic {row[1]} outside the subscription's filter has a row ({row[4]})")
        for i, cl in claims.items():
            tok = (cl[0]["tx"], cl[0]["pj"])
            if tok in never:
                self.bad("uncommitted", f"{pre}event {i} of rolled-back transaction {tok} was claimed")
            elif i not in committed and tok not in unknown:
                self.bad("uncommitted", f"{pre}claimed event {i} {tok} was never published by a committed transaction")
            if not sub_matches(sub, cl[0]["topic"]):
                self.bad("delivery", f"{pre}event {i} of topic {cl[0]['topic']} outside the subscription's filter was claimed")

        # --- attempts and leases --------------------------------------------
        for i, cl in claims.items():
            atts = sorted(c["att"] for c in cl)
            if atts != list(range(1, len(atts) + 1)):
                self.bad("attempts", f"{pre}event {i}: claimed attempts {atts}, expected 1..{len(atts)} once each")
            k = atts[-1]
            row = db.get(i)
            oks = [a for a in acks.get(i, []) if a["ok"]]
            if (row is not None and row[5] != k and i not in self.sown[sub]
                    and row[4] == "delivered" and row[5] == 1 and oks
                    and oks[0]["t"] < self.t_read - PURGE_AGE + 1.0):
                # outbox.deliveries shows an event of the log without a row of its own as
                # acked on its first try (attempts 1), also once purge('2 s') removed the
                # row of one delivered after a retry; only the logs tell then.
                self.stats["attempts reported as 1 after purge"] += 1
            elif row is not None and row[5] != k:
                self.bad("attempts", f"{pre}event {i}: attempts column {row[5]}, claims logged {k}")
            if len(oks) > 1:
                self.bad("attempts", f"{pre}event {i}: {len(oks)} successful acks")
            if oks and oks[0]["att"] != k:
                self.bad("attempts", f"{pre}event {i}: acked on attempt {oks[0]['att']} but claimed again up to {k}")
            for f in fails.get(i, []):
                if f["res"] == "dead" and f["att"] != k:
                    self.bad("attempts", f"{pre}event {i}: dead-lettered on attempt {f['att']} but claimed again up to {k}")
            # Lease exclusivity: claim n+1 only after lease n expired or was released.
            by_att = {c["att"]: c for c in cl}
            for n in range(1, k):
                a, b = by_att.get(n), by_att.get(n + 1)
                if not a or not b:
                    continue
                released = any(f["att"] == n and f["res"] != "stale" for f in fails.get(i, []))
                exp = max([a["exp"]] + [e["exp"] for e in exts.get(i, []) if e["att"] == n and e["exp"]])
                if not released and b["at"] < exp - 0.001:
                    self.bad("leases", f"{pre}event {i}: attempt {n + 1} claimed {exp - b['at']:.3f}s before lease {n} expired")
            # A stale ack/fail must mean the lease had really been taken over or expired.
            for r in acks.get(i, []) + fails.get(i, []):
                if (r.get("ok") is False or r.get("res") == "stale"):
                    c0 = by_att.get(r["att"])
                    exp = max([c0["exp"]] + [e["exp"] for e in exts.get(i, []) if e["att"] == r["att"] and e["exp"]]) if c0 else 0
                    if r["t"] < exp - 0.05:
                        self.bad("leases", f"{pre}event {i}: {r['k']} of attempt {r['att']} was stale {exp - r['t']:.2f}s before its lease ended")
        if stuck:
            self.bad("leases", f"{pre}{stuck} leases expired more than 5 s ago are still leased after the drain")

        # --- delivery and dead letters ----------------------------------------
        dead_blocking = defaultdict(list)   # subject -> ids of blocking dead letters
        for i, row in db.items():
            if row[4] == "dead" and blocks.get(i):
                dead_blocking[row[2]].append(i)
            if (row[4] == "dead" and row[2] is not None
                    and bool(blocks.get(i)) != (policy_of(row[1], sub) == "block")):
                self.bad("dead", f"{pre}event {i} ({row[1]}): dead letter blocks={blocks.get(i)}, "
                                 f"but the policy is {policy_of(row[1], sub)}")
        outcome = Counter()
        for i, e in committed.items():
            if not sub_matches(sub, e["topic"]):
                continue
            row = db.get(i)
            ok_ack = any(a["ok"] for a in acks.get(i, []))
            st = row[4] if row else None
            if ok_ack and st not in (None, "delivered"):
                self.bad("delivery", f"{pre}event {i}: ack() returned true but its state is {st}")
            if st == "delivered" and not ok_ack:
                self.bad("delivery", f"{pre}event {i} is delivered but no worker's ack() returned true")
            if ok_ack or st == "delivered":
                outcome["delivered"] += 1
                if e["poison"]:
                    self.bad("dead", f"{pre}poison event {i} was delivered")
            elif st == "dead":
                outcome["dead"] += 1
            elif st == "pending" and any(d < i for d in dead_blocking.get(e["subj"], [])):
                outcome["blocked behind a dead letter"] += 1
            elif st is None:
                self.bad("delivery", f"{pre}committed event {i} ({e['topic']}) is gone without a successful ack")
            else:
                self.bad("delivery", f"{pre}committed event {i} ({e['topic']}, subject {e['subj']}) ended {st}")
        self.outcome[sub] = outcome

        for i, row in db.items():
            if row[4] != "dead":
                continue
            ma = row[6]
            if ma != max_attempts_of(row[1], sub):
                self.bad("dead", f"{pre}event {i} ({row[1]}): max_attempts {ma}, the policy says {max_attempts_of(row[1], sub)}")
            fl = fails.get(i, [])
            dead_fail = [f for f in fl if f["res"] == "dead"]
            if dead_fail:
                f = dead_fail[-1]
                if not f["perm"] and f["att"] < ma:
                    self.bad("dead", f"{pre}event {i}: transient failure on attempt {f['att']}/{ma} dead-lettered it")
            elif row[9] == "lease expired":
                if row[5] != ma:
                    self.bad("dead", f"{pre}event {i}: dead by lease expiry with attempts {row[5]}/{ma}")
                last = [c for c in claims.get(i, []) if c["att"] == ma]
                settled = [r for r in acks.get(i, []) + fl if r["att"] == ma and (r.get("ok") or r.get("res") not in (None, "stale"))]
                if not last or settled:
                    self.bad("dead", f"{pre}event {i}: dead by lease expiry but its last lease was {'settled' if settled else 'never claimed'}")
            else:
                self.bad("dead", f"{pre}event {i} is dead (last_error {row[9]!r}) with no dead-lettering failure logged")
        for i, fl in fails.items():
            row = db.get(i)
            # The subscription's own max_attempts overrides the topic's.
            ma = max_attempts_of(claims[i][0]["topic"] if claims.get(i) else (row[1] if row else ""), sub)
            for f in fl:
                want = "dead" if (f["perm"] or f["att"] >= ma) else "pending"
                if f["res"] not in (want, "stale"):
                    self.bad("dead", f"{pre}event {i}: {'permanent' if f['perm'] else 'transient'} failure on attempt "
                                     f"{f['att']}/{ma} returned {f['res']}, expected {want}")
                if f["res"] == "dead" and (row is None or row[4] != "dead"):
                    self.bad("dead", f"{pre}event {i}: fail() returned dead but the event is {row[4] if row else 'gone'}")

        # --- per-subject order ---------------------------------------------------
        # A claim reads lanes and rows with a fresh snapshot per statement, so it may hand out
        # seq k+1 after seq k was acked during the call: its claims are ordered by the
        # time the call had returned (logged by the worker before it acks or fails).
        by_subj = defaultdict(list)
        for i, cl in claims.items():
            for c in cl:
                if c["subj"]:
                    by_subj[c["subj"]].append((c["t"], c["seq"], i, c["att"]))
        for subj, lst in by_subj.items():
            lst.sort()
            top = (0, None)
            for at, seq, i, att in lst:
                if seq < top[0]:
                    self.bad("order", f"{pre}subject {subj}: seq {seq} (event {i} attempt {att}) claimed after seq "
                                      f"{top[0]} (event {top[1]})")
                    break
                top = (seq, i)
        # Delivered order: the acked claims of a subject have strictly rising seq.
        for subj, lst in by_subj.items():
            acked = [(at, seq, i) for at, seq, i, att in lst
                     if any(a["ok"] and a["att"] == att for a in acks.get(i, []))]
            seqs = [s for _, s, _ in sorted(acked)]
            if any(b <= a for a, b in zip(seqs, seqs[1:])):
                self.bad("order", f"{pre}subject {subj}: delivered sequence not increasing: {seqs[:20]}...")
        return set(by_subj)


INVARIANTS = ["run", "delivery", "uncommitted", "order", "keys", "leases", "attempts", "dead"]


def own_cluster(args):
    r = subprocess.run(["bash", PGCLUSTER, "start", args.cluster, str(args.port), "--preload"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cannot start cluster {args.cluster}: {r.stdout}{r.stderr}")
    return f"host=127.0.0.1 port={args.port} user=postgres dbname=postgres"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60, help="seconds of load (default 60)")
    ap.add_argument("--publishers", type=int, default=4)
    ap.add_argument("--workers", type=int, default=4 * len(SUBS),
                    help="worker processes, each claiming from every subscription in turn (default 4 per subscription)")
    ap.add_argument("--drain-timeout", type=float, default=120)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--dsn", help="use this running preloaded server instead of starting a cluster "
                                  "(its outbox tables are emptied)")
    ap.add_argument("--cluster", default="outbox-soak")
    ap.add_argument("--port", type=int, default=5481)
    ap.add_argument("--keep", action="store_true", help="leave the cluster and logs behind")
    # internal: child processes
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--logdir", help=argparse.SUPPRESS)
    ap.add_argument("--chaos", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.role == "publisher":
        publisher_main(args.dsn, args.index, args.until, args.logdir, args.seed)
        return 0
    if args.role == "worker":
        worker_main(args.dsn, args.name, args.until, args.logdir, args.seed, bool(args.chaos),
                    os.path.join(args.logdir, "DRAIN"))
        return 0

    # A runner's timeout: still kill the children and stop the cluster (finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    owned = args.dsn is None
    logdir = tempfile.mkdtemp(prefix="outbox-soak-")
    try:
        dsn = own_cluster(args) if owned else args.dsn
        log(f"soak: {args.duration:.0f}s, {args.publishers} publishers, {args.workers} workers, "
            f"seed {args.seed}, logs {logdir}")
        m0 = setup_db(dsn)
        sup = Supervisor(args, dsn, logdir)
        t0 = time.time()
        try:
            sup.run()
        finally:
            sup.kill_all()
            sup.stop_bg.set()
        log(f"load done in {time.time() - t0:.0f}s; drain {'finished' if sup.drained else 'TIMED OUT'} "
            f"in {sup.drain_time:.1f}s")
        with connect(dsn) as c:
            maint = c.execute("SELECT count(*), COALESCE(sum(purged_delivered), 0) FROM outbox.maintenance_log").fetchone()
            maint_err = c.execute("SELECT count(*) FROM outbox.maintenance_log WHERE error IS NOT NULL").fetchone()[0]
        chk = Checker(dsn, logdir)
        v = chk.run()
        if not sup.drained:
            v["leases"].append(f"subscriptions not drained within {args.drain_timeout:.0f}s")
        if sup.abnormal:
            v["run"] += sup.abnormal
        if sup.purge_errors:
            v["run"] += [f"purge error: {e}" for e in sup.purge_errors]
        if maint[0] - m0 < 1:
            v["run"].append("the background worker's maintenance never ran")
        if maint_err:
            v["run"].append(f"{maint_err} maintenance runs logged an error")
        if chk.stats["w_claim"] == 0 or chk.stats["committed events"] == 0:
            v["run"].append("no events were published or claimed")
        s = chk.stats
        nviol = sum(len(x) for x in v.values())
        log(f"summary: events {s['committed events']} committed ({s['tx_commit']} transactions, "
            f"{s['tx_rollback']} rolled back, {s['tx_aborted']} aborted), "
            f"claims {s['claims']}, acks {s['w_ack']}, failures {s['w_fail']}, slow handlers {s['w_slow']}, "
            f"crashes {sup.crashes}, violations {nviol}")
        log(f"  outcomes: {dict(chk.outcome['default'])}; subjects {s['subjects']}; republished keys {s['republished keys']}; "
            f"purged by purge() {sup.purged}, by maintenance {maint[1]} in {maint[0] - m0} runs; "
            f"max expired-lease lag during the run {sup.max_expired_lag:.1f}s")
        for sub in LOG_SUBS:
            if sub != "default":
                log(f"  outcomes in {sub}: {dict(chk.outcome[sub])}; rows left in outbox.deliveries {len(chk.sdb[sub])}")
        log(f"  log ring tables opened during the run: {len(sup.log_tables)} (4 at most without truncation); "
            f"events shown with attempts 1 after purge() removed their row {s['attempts reported as 1 after purge']}")
        passed = failed = 0
        for inv in INVARIANTS:
            if v.get(inv):
                failed += 1
                log(f"  {inv}: FAILED ({len(v[inv])} violations)")
                for m in v[inv][:10]:
                    log(f"      {m}")
            else:
                passed += 1
                log(f"  {inv}: ok")
        print(f"{passed} passed, {failed} failed", flush=True)
        return 1 if failed else 0
    except Exception:
        traceback.print_exc()
        print("0 passed, 1 failed", flush=True)
        return 1
    finally:
        if owned and not args.keep:
            subprocess.run(["bash", PGCLUSTER, "stop", args.cluster], capture_output=True)
        if not args.keep:
            shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
