"""Background wake-ups and maintenance in every database that has the extension
(0.6.0: a static "outbox_ext launcher" runs one dynamic "outbox_ext worker" per
database). Runs on the preload cluster (OUTBOX_TEST_DSN_PRELOAD); the module makes
its own databases (three with the extension, one without) and drops them at the end.
The health test with max_worker_processes exhausted starts a cluster of its own
(OUTBOX_TEST_DBS_PORT, default 5494) and destroys it afterwards.

"Served" below means all of: outbox.wakeup_status() in that database names a
worker_pid for that database's oid, and pg_stat_activity shows exactly that pid as
the one 'outbox_ext worker' connected to it. A wake-up counts as background only
if the notification comes from that worker's pid (a publisher that falls back to
'transaction' mode notifies from its own pid).

Run with -s to see the measured times."""

import os
import secrets
import socket
import statistics
import subprocess
import threading
import time
from types import SimpleNamespace

import psycopg
import pytest
from psycopg import sql

from conftest import PGCLUSTER, Listener, connect, dsn_with_db, restart_preload_cluster
from scratch_db import create_db

QUIET = 1.3  # the worker sleeps at most 1 s between passes
WORKER = "outbox_ext worker"
LAUNCHER = "outbox_ext launcher"
BASE = f"obxdbs_{os.getpid() % 100000}_{secrets.token_hex(2)}"
EXT = ("a", "b", "c")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def run(dsn, stmt, params=None):
    """One statement on a fresh autocommit connection; all rows (or None)."""
    with connect(dsn) as c:
        cur = c.execute(stmt, params)
        return cur.fetchall() if cur.description else None


def q(stmt, *names):
    return sql.SQL(stmt).format(*[sql.Identifier(n) for n in names])


def outbox_backends(admin):
    return run(
        admin,
        "SELECT pid, backend_type, datname FROM pg_stat_activity WHERE backend_type LIKE 'outbox_ext%' ORDER BY pid",
    )


def workers_of(admin, dbname):
    return [pid for pid, bt, dn in outbox_backends(admin) if bt == WORKER and dn == dbname]


def bgworkers(admin):
    return run(
        admin,
        "SELECT backend_type, count(*) FROM pg_stat_activity WHERE backend_type NOT IN "
        "('client backend', 'autovacuum launcher', 'autovacuum worker', 'background writer', "
        "'checkpointer', 'walwriter', 'archiver', 'startup', 'walsender', 'walreceiver') "
        "GROUP BY 1 ORDER BY 1",
    )


def launchers(admin):
    return [(pid, dn) for pid, bt, dn in outbox_backends(admin) if bt == LAUNCHER]


def wakeup_status(dsn):
    """outbox.wakeup_status() as a dict (whatever columns this version has), plus
    '_oid', the oid of the database connected to."""
    with connect(dsn) as c:
        (row,) = c.execute("SELECT to_jsonb(w) FROM outbox.wakeup_status() w").fetchone()
        (oid,) = c.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()
    row["_oid"] = oid
    return row


def served_pid(admin, dbname):
    """(pid of the worker serving dbname or None, a description for messages)."""
    st = wakeup_status(dsn_with_db(admin, dbname))
    pids = workers_of(admin, dbname)
    ok = bool(st.get("worker_pid")) and st.get("database") == st["_oid"] and pids == [st["worker_pid"]]
    desc = (
        f"wakeup_status in {dbname} = {st}; '{WORKER}' backends connected to it: {pids}; "
        f"all outbox backends: {outbox_backends(admin)}"
    )
    if st.get("state") == "waiting":
        (mwp,) = run(admin, "SHOW max_worker_processes")[0]
        desc += f" (state 'waiting': max_worker_processes = {mwp}, background workers: {bgworkers(admin)})"
    return (st["worker_pid"] if ok else None), desc


def wait_served(admin, dbname, timeout=5.0, not_pid=None, what=""):
    """Wait until dbname is served (by a pid other than not_pid); (pid, seconds waited)."""
    t0 = time.monotonic()
    while True:
        pid, desc = served_pid(admin, dbname)
        waited = time.monotonic() - t0
        if pid and pid != not_pid:
            return pid, waited
        if waited > timeout:
            other = f" other than {not_pid}" if not_pid else ""
            what = f" {what}" if what else ""
            pytest.fail(f"database {dbname} not served by an '{WORKER}'{other}{what} within {timeout} s: {desc}")
        time.sleep(0.05)


def wait_no_worker(admin, dbname, timeout, what=""):
    """Wait until no outbox_ext backend is connected to dbname (pg_stat_activity
    only: works for databases one cannot or should not connect to)."""
    t0 = time.monotonic()
    while True:
        conns = [(pid, bt) for pid, bt, dn in outbox_backends(admin) if dn == dbname]
        waited = time.monotonic() - t0
        if not conns:
            return waited
        if waited > timeout:
            pytest.fail(f"outbox backends still connected to {dbname} {what} after {timeout} s: {conns}")
        time.sleep(0.05)


class ActivitySampler:
    """Samples pg_stat_activity every 20 ms from database postgres and records
    every outbox_ext backend connected to one of `dbnames`."""

    def __init__(self, admin, dbnames):
        self.admin = admin
        self.dbnames = list(dbnames)
        self.seen = set()
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with connect(self.admin) as c:
            while not self._stop.is_set():
                for pid, bt, dn in c.execute(
                    "SELECT pid, backend_type, datname FROM pg_stat_activity "
                    "WHERE backend_type LIKE 'outbox_ext%%' AND datname = ANY(%s)",
                    (self.dbnames,),
                ).fetchall():
                    self.seen.add((pid, bt, dn))
                self.samples += 1
                self._stop.wait(0.02)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)


def publish_commit(dsn, topic, notify=None):
    """Publish one event in its own transaction; (time just before COMMIT,
    publisher pid, event id)."""
    with connect(dsn) as p:
        if notify:
            p.execute(f"SET outbox.notify = '{notify}'")
        p.execute("BEGIN")
        (eid,) = p.execute("SELECT outbox.publish(%s, '{}')", (topic,)).fetchone()
        t0 = time.monotonic()
        p.execute("COMMIT")
        return t0, p.info.backend_pid, eid


def next_for(lst, topic, timeout):
    """The first notification for `topic` within timeout (others are skipped), or None."""
    deadline = time.monotonic() + timeout
    while True:
        n = lst.first(max(0.0, deadline - time.monotonic()))
        if n is None or n[0] == topic:
            return n


def assert_background_wakeup(dsn, lst, worker_pid, topic, timeout=1.0, what=""):
    """Publish `topic`; the listener must hear it from worker_pid within timeout.
    Returns the latency in seconds."""
    t0, ppid, _ = publish_commit(dsn, topic)
    n = next_for(lst, topic, timeout)
    assert n is not None, f"no wake-up for {topic} within {timeout} s {what} (worker {worker_pid}, publisher {ppid})"
    assert n[1] == worker_pid, (
        f"{topic} was notified by pid {n[1]}, not by the database's worker {worker_pid} "
        f"(publisher pid {ppid}{': the publisher notified itself' if n[1] == ppid else ''}) {what}"
    )
    return n[2] - t0


def set_system(admin, name, value):
    with connect(admin) as c:
        if value is None:
            c.execute(f"ALTER SYSTEM RESET {name}")
        else:
            c.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.SQL(name), sql.Literal(value)))
        c.execute("SELECT pg_reload_conf()")


def drop_all_test_dbs(admin, prefix, keep=()):
    with connect(admin) as c:
        c.execute("SET client_min_messages = warning")
        # Prepared transactions left by a failed test would block DROP DATABASE.
        for gid, db in c.execute(
            "SELECT gid, database FROM pg_prepared_xacts WHERE gid LIKE %s OR database LIKE %s",
            (prefix + "%", prefix + "%"),
        ).fetchall():
            try:
                with connect(dsn_with_db(admin, db)) as d:
                    d.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
            except psycopg.Error as e:
                print(f"cleanup: ROLLBACK PREPARED {gid} in {db}: {e}")
        for name, is_tpl in c.execute(
            "SELECT datname, datistemplate FROM pg_database WHERE datname LIKE %s", (prefix + "%",)
        ).fetchall():
            if name in keep:
                continue
            try:
                if is_tpl:
                    c.execute(q("ALTER DATABASE {} IS_TEMPLATE false", name))
                c.execute(q("ALTER DATABASE {} ALLOW_CONNECTIONS true", name))
                c.execute(q("DROP DATABASE IF EXISTS {} WITH (FORCE)", name))
            except psycopg.Error as e:
                print(f"cleanup: dropping {name}: {e}")


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dbs(preload_dsn):
    """Three databases with the extension (dbs.ext['a'|'b'|'c']) and one without
    (dbs.none), on the preload cluster; dropped (FORCE) at the end."""
    admin = preload_dsn
    ext = {k: f"{BASE}_{k}" for k in EXT}
    none = f"{BASE}_none"
    try:
        for name in ext.values():
            create_db(admin, name, extension=True)
        create_db(admin, none, extension=False)
        yield SimpleNamespace(admin=admin, ext=ext, none=none, dsn=lambda n: dsn_with_db(admin, n))
    finally:
        drop_all_test_dbs(admin, BASE)


@pytest.fixture
def extra_dbs(dbs):
    """For tests that make databases of their own (named BASE_*): drop them when
    the test ends. Each served database takes a worker process, and the test
    clusters have max_worker_processes = 8 (6 dynamic workers), of which
    postgres and the module's three databases use 4."""
    yield
    drop_all_test_dbs(dbs.admin, BASE, keep=(*dbs.ext.values(), dbs.none))


@pytest.fixture
def listeners(listen):
    """conftest's listen fixture, under the name these tests use."""
    return listen


@pytest.fixture
def served_again(dbs):
    """After a disruptive test: reset what it set and make sure every database is
    served again (restarting the cluster if that is possible and needed)."""
    yield
    with connect(dbs.admin) as c:
        try:
            c.execute("ALTER SYSTEM RESET outbox.databases")
        except psycopg.Error:
            pass  # 0.5.0: no such setting
        c.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + 10
    names = ["postgres", *dbs.ext.values()]
    while time.monotonic() < deadline:
        if all(served_pid(dbs.admin, n)[0] for n in names):
            return
        time.sleep(0.2)
    restart_preload_cluster("some database is not served after a disruptive test")


# ---------------------------------------------------------------------------
# the launcher and its workers
# ---------------------------------------------------------------------------
def test_launcher_and_one_worker_per_database(dbs):
    """One launcher (no database), one worker per database with the extension,
    and wakeup_status agrees: launcher_pid, state 'serving'."""
    pids = {}
    for k, name in dbs.ext.items():
        pids[name], waited = wait_served(dbs.admin, name, timeout=5.0, what="(created with the extension)")
        print(f"[{name}] served by {pids[name]} ({waited:.2f} s after the check began)")
    pids["postgres"], _ = wait_served(dbs.admin, "postgres", timeout=5.0)
    ls = launchers(dbs.admin)
    assert len(ls) == 1, f"expected exactly one '{LAUNCHER}' backend: {outbox_backends(dbs.admin)}"
    lpid, ldb = ls[0]
    assert ldb is None, f"the launcher is connected to database {ldb}"
    assert len(set(pids.values())) == len(pids), f"one worker must serve one database: {pids}"
    for name, pid in pids.items():
        st = wakeup_status(dbs.dsn(name))
        assert st.get("launcher_pid") == lpid, f"{name}: wakeup_status launcher_pid {st.get('launcher_pid')} != {lpid}: {st}"
        assert st.get("state") == "serving", f"{name}: state {st.get('state')!r}, expected 'serving': {st}"
        assert st.get("preloaded") is True, st
        assert st.get("worker_pid") == pid, st


def test_outbox_database_setting_is_gone(dbs):
    with connect(dbs.dsn(dbs.ext["a"])) as c:
        c.execute("SELECT outbox.wakeup_status()")  # library loaded in this session
        (v,) = c.execute("SELECT current_setting('outbox.database', true)").fetchone()
        assert v is None, f"outbox.database still exists (= {v!r})"
        # The new setting exists; its default serves every database.
        (d,) = c.execute("SELECT current_setting('outbox.databases', true)").fetchone()
        assert d == "", f"outbox.databases = {d!r}, expected '' (every database)"


# ---------------------------------------------------------------------------
# 1. two-phase commit in background mode, in every database
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", EXT)
def test_prepare_transaction_and_commit_prepared_wakes(dbs, listeners, k):
    name = dbs.ext[k]
    dsn = dbs.dsn(name)
    with connect(dbs.admin) as c:
        assert int(c.execute("SHOW max_prepared_transactions").fetchone()[0]) > 0, "needs max_prepared_transactions > 0"
    # Not asserted yet: PREPARE is tried either way, so that a failure shows both facts.
    try:
        pid, _ = wait_served(dbs.admin, name, timeout=5.0)
        served_err = None
    except pytest.fail.Exception as e:
        pid, served_err = None, str(e)
    lst = listeners(dsn)
    gid = f"{BASE}_2pc_{k}"
    topic = f"dbs.2pc.{k}"
    with connect(dsn) as p, connect(dsn) as o:
        (mode,) = p.execute("SHOW outbox.notify").fetchone()
        assert mode == "background", f"outbox.notify defaults to {mode!r} in {name}"
        p.execute("BEGIN")
        (eid,) = p.execute("SELECT outbox.publish(%s, '{}')", (topic,)).fetchone()
        try:
            p.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        except psycopg.Error as e:
            pytest.fail(
                f"PREPARE TRANSACTION after publish failed in {name}: SQLSTATE {e.sqlstate}: {e} "
                f"(served: {served_err or f'yes, worker {pid}'})"
            )
        assert served_err is None, served_err
        early = lst.collect(0.5)
        assert early == [], f"notified for a transaction that is only prepared: {early}"
        t0 = time.monotonic()
        o.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
        n = next_for(lst, topic, 3.0)
        assert n is not None, f"COMMIT PREPARED in {name} did not wake the listener within 3 s"
        assert n[1] == pid, f"notified by pid {n[1]}, not by {name}'s worker {pid}"
        print(f"[{name}] COMMIT PREPARED -> notification {1000 * (n[2] - t0):.1f} ms")
        got = [r[0] for r in o.execute("SELECT id FROM outbox.claim('w', 10, topics => ARRAY[%s])", (topic,)).fetchall()]
        assert got == [eid]
        more = [x for x in lst.collect(QUIET) if x[0] == topic]
        assert more == [], f"more than one notification for one commit: {more}"


# ---------------------------------------------------------------------------
# 2. latency per database, and no cross-database wake-ups
# ---------------------------------------------------------------------------
PROBES = 7


@pytest.mark.parametrize("k", EXT)
def test_wakeup_latency_and_no_cross_database_wakeups(dbs, listeners, record_property, k):
    name = dbs.ext[k]
    dsn = dbs.dsn(name)
    pid, _ = wait_served(dbs.admin, name, timeout=5.0)
    lst = listeners(dsn)
    others = {n: listeners(dbs.dsn(n)) for n in [*dbs.ext.values(), dbs.none, "postgres"] if n != name}
    time.sleep(0.1)  # let every LISTEN settle before the first probe
    topics = []
    rounds = []
    for r in range(2):  # one retry of the whole round on a noisy machine
        lat = []
        for i in range(PROBES):
            topic = f"dbs.lat.{k}.r{r}.p{i}"
            topics.append(topic)
            lat.append(assert_background_wakeup(dsn, lst, pid, topic, timeout=2.0, what=f"in {name}"))
            time.sleep(0.03)
        rounds.append(lat)
        if statistics.median(lat) < 0.1:
            break
    med = statistics.median(rounds[-1])
    desc = "; ".join(f"round {i + 1}: " + ", ".join(f"{x * 1000:.1f}" for x in lat) + " ms" for i, lat in enumerate(rounds))
    print(f"[{name}] wake-up latencies {desc}")
    record_property(f"wakeup_latency_median_ms_{k}", round(med * 1000, 2))
    assert med < 0.1, f"median wake-up latency {med * 1000:.1f} ms in {name} (>= 100 ms): {desc}"

    time.sleep(QUIET)  # anything a worker might still send for these commits
    leaked = {n: [x[:2] for x in o.drain() if x[0] in topics] for n, o in others.items()}
    leaked = {n: v for n, v in leaked.items() if v}
    assert leaked == {}, f"listeners in other databases heard {name}'s commits: {leaked}"


def test_a_burst_in_one_database_does_not_starve_another(dbs, listeners):
    """Each database has its own slot: a flood of distinct topics in A (more than a
    slot holds, so A's worker falls back to sweeping) leaves B's wake-ups prompt
    and exact, and A still announces every one of its topics."""
    a, b = dbs.ext["a"], dbs.ext["c"]
    pid_b, _ = wait_served(dbs.admin, b)
    wait_served(dbs.admin, a)
    lst_a, lst_b = listeners(dbs.dsn(a)), listeners(dbs.dsn(b))
    stop = threading.Event()
    flood = []

    def burst():
        with connect(dbs.dsn(a)) as p:
            i = 0
            while not stop.is_set():
                p.execute("BEGIN")
                for _ in range(10):
                    t = f"dbs.flood.t{i}"
                    p.execute("SELECT outbox.publish(%s, '{}')", (t,))
                    flood.append(t)
                    i += 1
                p.execute("COMMIT")

    th = threading.Thread(target=burst, daemon=True)
    th.start()
    try:
        time.sleep(0.3)
        lat = [assert_background_wakeup(dbs.dsn(b), lst_b, pid_b, f"dbs.calm.p{i}", timeout=1.0,
                                        what=f"in {b} while {a} publishes a flood of topics")
               for i in range(7)]
    finally:
        stop.set()
        th.join(10)
    med = statistics.median(lat)
    print(f"[{b}] wake-ups during {len(flood)} topics in {a}: " + ", ".join(f"{x * 1000:.1f}" for x in lat) + " ms")
    assert len(flood) > 64, f"the flood in {a} published only {len(flood)} topics"
    assert med < 0.1, f"median wake-up latency in {b} {med * 1000:.1f} ms during the flood in {a}"
    heard, deadline = set(), time.monotonic() + 5
    want = set(flood)
    while want - heard and time.monotonic() < deadline:
        n = lst_a.first(max(0.01, deadline - time.monotonic()))
        if n:
            heard.add(n[0])
    missing = want - heard
    assert not missing, f"{len(missing)} of {len(want)} flood topics in {a} never announced, e.g. {sorted(missing)[:5]}"


# ---------------------------------------------------------------------------
# 3. no worker where the extension is not
# ---------------------------------------------------------------------------
def test_database_without_extension_has_no_worker(dbs):
    for name in dbs.ext.values():
        wait_served(dbs.admin, name, timeout=5.0, what="(discovery must have run)")
    # A brief look by the launcher would be tolerable; a worker that stays is not:
    # require 1.5 s without any outbox backend connected, within 10 s.
    seen, free_since, t0 = set(), time.monotonic(), time.monotonic()
    while time.monotonic() - free_since < 1.5:
        now = [(p, bt) for p, bt, dn in outbox_backends(dbs.admin) if dn == dbs.none]
        if now:
            seen.update(now)
            free_since = time.monotonic()
        assert time.monotonic() - t0 < 10, f"outbox backends stay connected to {dbs.none} (no extension): {sorted(seen)}"
        time.sleep(0.05)
    if seen:
        print(f"[{dbs.none}] transient outbox backends seen: {sorted(seen)}")


# ---------------------------------------------------------------------------
# 4. maintenance in every database, recorded in its own maintenance_runs
# ---------------------------------------------------------------------------
def test_maintenance_runs_in_every_database(dbs):
    """Each database's own maintenance purges its own old delivered rows (rows
    of their own of events delivered after a retry, whose events the log no
    longer holds), which give a count per database (the log's retention
    truncates whole ring tables: test_log.py)."""
    counts = {name: n for name, n in zip(dbs.ext.values(), (2, 3, 4))}
    t0 = {}
    for name, n in counts.items():
        with connect(dbs.dsn(name)) as c:
            (t0[name],) = c.execute("SELECT clock_timestamp()").fetchone()
            c.execute("SET outbox.notify = off")
            # 'default' afresh, from now: the earlier tests' events stay unread
            # ahead of this test's in its lanes otherwise.
            c.execute("SELECT outbox.drop_subscription('default', force => true)")
            c.execute("SELECT outbox.create_subscription('default')")
            topic = "dbs.ret.old"
            c.execute("SELECT outbox.publish_batch(%s, array_fill('{}'::jsonb, ARRAY[%s]))", (topic, n))
            rows = c.execute("SELECT id, lease_token FROM outbox.claim('r', %s, topics => ARRAY[%s])", (n, topic)).fetchall()
            assert len(rows) == n
            assert c.execute(
                "SELECT count(outbox.fail(i, t, 'once', retry_in => '0')) FROM unnest(%s::bigint[], %s::uuid[]) AS u(i, t)",
                ([i for i, _ in rows], [t for _, t in rows])).fetchone()[0] == n
            rows = c.execute("SELECT id, lease_token FROM outbox.claim('r', %s, topics => ARRAY[%s])", (n, topic)).fetchall()
            assert c.execute(
                "SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([i for i, _ in rows], [t for _, t in rows])
            ).fetchone()[0] == n
            c.execute("TRUNCATE outbox.log_0, outbox.log_1, outbox.log_2, outbox.log_3")
            c.execute(
                "UPDATE outbox.log_exceptions SET delivered_at = now() - interval '8 days', "
                "published_at = now() - interval '8 days' WHERE topic = %s",
                (topic,),
            )
    got = {}
    try:
        set_system(dbs.admin, "outbox.maintenance_interval", "1s")
        deadline = time.monotonic() + 20
        pending = set(counts)
        while pending:
            for name in sorted(pending):
                with connect(dbs.dsn(name)) as c:
                    got[name] = c.execute(
                        "SELECT count(*), coalesce(sum(purged_delivered), 0), "
                        "       count(*) FILTER (WHERE error IS NOT NULL), "
                        "       (SELECT count(*) FROM outbox.log_exceptions WHERE topic = 'dbs.ret.old') "
                        "  FROM outbox.maintenance_runs WHERE started_at >= %s AND finished_at IS NOT NULL",
                        (t0[name],),
                    ).fetchone()
                if got[name][0] >= 2 and got[name][3] == 0:
                    pending.discard(name)
            if pending:
                assert time.monotonic() < deadline, (
                    "no (or only one) maintenance run recorded within 20 s of maintenance_interval = 1s in "
                    f"{sorted(pending)}: (runs, purged_delivered, errors, old rows left) = {got}"
                )
                time.sleep(0.2)
    finally:
        set_system(dbs.admin, "outbox.maintenance_interval", None)
    for name, n in counts.items():
        runs, purged, errors, left = got[name]
        print(f"[{name}] {runs} maintenance runs, purged_delivered {purged}")
        assert errors == 0, f"{name}: maintenance runs with an error: {got[name]}"
        assert purged == n, f"{name}: its runs purged {purged} delivered events, it had {n} old ones: {got[name]}"


# ---------------------------------------------------------------------------
# 5. CREATE EXTENSION / DROP EXTENSION at run time
# ---------------------------------------------------------------------------
def test_create_extension_at_run_time_is_served_within_2s(dbs, extra_dbs, listeners):
    name = f"{BASE}_late"
    dsn = create_db(dbs.admin, name, extension=False)
    # The launcher's next poll (1 s) probes the new database with a worker, which
    # finds no extension and leaves; only then is the database known unserved.
    time.sleep(1.5)
    wait_no_worker(dbs.admin, name, 2.0, what="before CREATE EXTENSION (a probe finds no extension and leaves)")
    lst = listeners(dsn)
    with connect(dsn) as c:
        c.execute("CREATE EXTENSION outbox_ext")
        t0 = time.monotonic()
    pid, _ = wait_served(dbs.admin, name, timeout=2.0, what="after CREATE EXTENSION")
    print(f"[{name}] served {(time.monotonic() - t0):.2f} s after CREATE EXTENSION committed")
    lat = assert_background_wakeup(dsn, lst, pid, "dbs.late", timeout=1.0, what=f"in {name} after CREATE EXTENSION")
    print(f"[{name}] first wake-up {lat * 1000:.1f} ms")


def test_drop_extension_stops_the_worker(dbs, extra_dbs, listeners):
    name = f"{BASE}_dropext"
    dsn = create_db(dbs.admin, name, extension=True)
    pid, _ = wait_served(dbs.admin, name, timeout=5.0)
    with connect(dsn) as c:
        c.execute("SET outbox.allow_drop = on")
        c.execute("DROP EXTENSION outbox_ext")
    waited = wait_no_worker(dbs.admin, name, 2.0, what="after DROP EXTENSION")
    print(f"[{name}] worker {pid} gone {waited:.2f} s after DROP EXTENSION")
    gone = run(dbs.admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))[0][0]
    assert gone == 0, f"worker {pid} still runs after DROP EXTENSION: {outbox_backends(dbs.admin)}"
    # ... and stays away.
    with ActivitySampler(dbs.admin, [name]) as s:
        time.sleep(2.5)
    assert s.seen == set(), f"outbox backends connected to {name} after DROP EXTENSION: {s.seen}"


def test_create_extension_in_a_prepared_transaction_is_served_at_commit_prepared(dbs, extra_dbs, listeners):
    """COMMIT PREPARED runs none of the prepared transaction's callbacks: the
    announcement must still reach the launcher (it watches the prepared xid)."""
    name = f"{BASE}_prep"
    dsn = create_db(dbs.admin, name, extension=False)
    time.sleep(1.5)  # the launcher's look at the new database finds no extension
    gid = f"{BASE}_prep_gid"
    with connect(dsn) as c:
        c.execute("BEGIN")
        c.execute("CREATE EXTENSION outbox_ext")
        c.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    time.sleep(1.2)
    assert workers_of(dbs.admin, name) == [], "a worker serves the database before COMMIT PREPARED"
    with connect(dsn) as c:
        c.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
    pid, waited = wait_served(dbs.admin, name, timeout=2.0, what="after COMMIT PREPARED of CREATE EXTENSION")
    print(f"[{name}] served {waited:.2f} s after COMMIT PREPARED")
    lst = listeners(dsn)
    assert_background_wakeup(dsn, lst, pid, "dbs.prep", timeout=1.0, what=f"in {name}")


def test_alter_database_options_in_an_open_transaction_keep_wakeups(dbs, listeners):
    """Only SET TABLESPACE needs the database to itself: a CONNECTION LIMIT change
    left in an open transaction (a migration tool) must not stop its wake-ups."""
    name = dbs.ext["b"]
    dsn = dbs.dsn(name)
    pid, _ = wait_served(dbs.admin, name)
    lst = listeners(dsn)
    with connect(dbs.admin) as a:
        a.execute("BEGIN")
        a.execute(q("ALTER DATABASE {} CONNECTION LIMIT 500", name))
        try:
            time.sleep(0.3)
            assert served_pid(dbs.admin, name)[0] == pid, served_pid(dbs.admin, name)[1]
            assert_background_wakeup(dsn, lst, pid, "dbs.altdb", timeout=1.0,
                                     what="while ALTER DATABASE ... CONNECTION LIMIT is uncommitted")
        finally:
            a.execute("ROLLBACK")


# ---------------------------------------------------------------------------
# 6. templates, databases without connections, CREATE DATABASE ... TEMPLATE
# ---------------------------------------------------------------------------
def test_template_database_has_no_worker_and_copies_are_served(dbs, extra_dbs, listeners):
    tpl = f"{BASE}_tpl"
    create_db(dbs.admin, tpl, extension=True)
    run(dbs.admin, q("ALTER DATABASE {} IS_TEMPLATE true", tpl))
    waited = wait_no_worker(dbs.admin, tpl, 3.0, what="after ALTER DATABASE ... IS_TEMPLATE true")
    print(f"[{tpl}] no worker {waited:.2f} s after IS_TEMPLATE true")
    copies = [f"{BASE}_copy{i}" for i in range(3)]
    with ActivitySampler(dbs.admin, [tpl]) as s:
        time.sleep(1.5)  # at least one poll of pg_database while it is a template
        for i, copy in enumerate(copies):
            try:
                run(dbs.admin, q("CREATE DATABASE {} TEMPLATE {}", copy, tpl))
            except psycopg.Error as e:
                pytest.fail(
                    f"CREATE DATABASE {copy} TEMPLATE {tpl} (copy {i + 1} of 3) failed: SQLSTATE {e.sqlstate}: {e}; "
                    f"outbox backends: {outbox_backends(dbs.admin)}"
                )
        # One copy at a time: the test cluster may have only two worker processes
        # to spare, so each copy is dropped (no FORCE) once it has been served.
        for copy in copies:
            pid, waited = wait_served(dbs.admin, copy, timeout=3.0, what="(copy of a template with the extension)")
            print(f"[{copy}] served by {pid} {waited:.2f} s after the previous step")
            lst = Listener(dbs.dsn(copy))
            try:
                assert_background_wakeup(dbs.dsn(copy), lst, pid, "dbs.copy", what=f"in {copy}")
            finally:
                lst.close()
            try:
                run(dbs.admin, q("DROP DATABASE {}", copy))
            except psycopg.Error as e:
                pytest.fail(f"DROP DATABASE {copy} (no FORCE) failed while served: SQLSTATE {e.sqlstate}: {e}")
    assert s.seen == set(), f"outbox backends connected to template {tpl}: {sorted(s.seen)} ({s.samples} samples)"


def test_create_database_from_a_served_database(dbs, extra_dbs, listeners):
    src = f"{BASE}_src"
    create_db(dbs.admin, src, extension=True)
    old, _ = wait_served(dbs.admin, src, timeout=5.0)
    dst = f"{BASE}_fromsrc"
    try:
        run(dbs.admin, q("CREATE DATABASE {} TEMPLATE {}", dst, src))
    except psycopg.Error as e:
        pytest.fail(f"CREATE DATABASE {dst} TEMPLATE {src} failed while {src} is served: SQLSTATE {e.sqlstate}: {e}")
    t0 = time.monotonic()
    pid_src, _ = wait_served(dbs.admin, src, timeout=3.0, what="again after it was copied")
    pid_dst, _ = wait_served(dbs.admin, dst, timeout=3.0, what="(the copy)")
    print(f"[{src}] worker {old} -> {pid_src}; copy {dst} served by {pid_dst} ({time.monotonic() - t0:.2f} s)")
    for name, pid in ((src, pid_src), (dst, pid_dst)):
        lst = listeners(dbs.dsn(name))
        assert_background_wakeup(dbs.dsn(name), lst, pid, "dbs.fromsrc", what=f"in {name}")


def test_database_without_connections_is_not_connected_to(dbs, extra_dbs):
    name = f"{BASE}_noconn"
    create_db(dbs.admin, name, extension=True)
    wait_served(dbs.admin, name, timeout=5.0)
    run(dbs.admin, q("ALTER DATABASE {} ALLOW_CONNECTIONS false", name))
    try:
        waited = wait_no_worker(dbs.admin, name, 3.0, what="after ALLOW_CONNECTIONS false")
        print(f"[{name}] no worker {waited:.2f} s after ALLOW_CONNECTIONS false")
        with ActivitySampler(dbs.admin, [name]) as s:
            time.sleep(2.5)
        assert s.seen == set(), f"outbox backends connected to {name} (datallowconn = false): {sorted(s.seen)}"
    finally:
        run(dbs.admin, q("ALTER DATABASE {} ALLOW_CONNECTIONS true", name))
    _, waited = wait_served(dbs.admin, name, timeout=5.0, what="after ALLOW_CONNECTIONS true again")
    print(f"[{name}] served again {waited:.2f} s after ALLOW_CONNECTIONS true")


# ---------------------------------------------------------------------------
# 7. DROP DATABASE and RENAME while the worker runs
# ---------------------------------------------------------------------------
def test_drop_database_while_its_worker_runs(dbs, extra_dbs):
    name = f"{BASE}_drop"
    create_db(dbs.admin, name, extension=True)
    pid, _ = wait_served(dbs.admin, name, timeout=5.0)
    t0 = time.monotonic()
    try:
        run(dbs.admin, q("DROP DATABASE {}", name))
    except psycopg.Error as e:
        pytest.fail(f"DROP DATABASE {name} (no FORCE) failed while worker {pid} served it: SQLSTATE {e.sqlstate}: {e}")
    took = time.monotonic() - t0
    print(f"[{name}] DROP DATABASE took {took:.2f} s (worker {pid})")
    assert run(dbs.admin, "SELECT count(*) FROM pg_database WHERE datname = %s", (name,))[0][0] == 0
    deadline = time.monotonic() + 2
    while run(dbs.admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))[0][0]:
        assert time.monotonic() < deadline, f"worker {pid} of the dropped database still runs"
        time.sleep(0.05)


def test_rename_database_while_its_worker_runs(dbs, extra_dbs, listeners):
    name, new = f"{BASE}_ren", f"{BASE}_renamed"
    create_db(dbs.admin, name, extension=True)
    pid, _ = wait_served(dbs.admin, name, timeout=5.0)
    try:
        run(dbs.admin, q("ALTER DATABASE {} RENAME TO {}", name, new))
    except psycopg.Error as e:
        pytest.fail(f"ALTER DATABASE {name} RENAME failed while worker {pid} served it: SQLSTATE {e.sqlstate}: {e}")
    new_pid, waited = wait_served(dbs.admin, new, timeout=3.0, what="after RENAME")
    print(f"[{new}] served again by {new_pid} {waited:.2f} s after the rename (was {pid})")
    lst = listeners(dbs.dsn(new))
    assert_background_wakeup(dbs.dsn(new), lst, new_pid, "dbs.renamed", what=f"in {new} after the rename")


def test_failed_drop_database_leaves_it_served(dbs, extra_dbs, listeners):
    name = f"{BASE}_busy"
    dsn = create_db(dbs.admin, name, extension=True)
    pid, _ = wait_served(dbs.admin, name, timeout=5.0)
    lst = listeners(dsn)  # the other client session that makes DROP fail
    t0 = time.monotonic()
    with pytest.raises(psycopg.errors.ObjectInUse) as ei:
        run(dbs.admin, q("DROP DATABASE {}", name))
    print(f"[{name}] DROP DATABASE failed after {time.monotonic() - t0:.2f} s: {ei.value}")
    assert "other users" in str(ei.value) or "other session" in str(ei.value), ei.value
    new_pid, waited = wait_served(dbs.admin, name, timeout=3.0, what="after the failed DROP DATABASE")
    print(f"[{name}] served by {new_pid} {waited:.2f} s after the failed DROP (was {pid})")
    lst.drain()
    assert_background_wakeup(dsn, lst, new_pid, "dbs.busy", what=f"in {name} after the failed DROP")


# ---------------------------------------------------------------------------
# 8. outbox.databases
# ---------------------------------------------------------------------------
@pytest.mark.disruptive
def test_databases_filter(dbs, listeners, served_again):
    a, b, c = dbs.ext.values()
    for name in (a, b, c):
        wait_served(dbs.admin, name, timeout=5.0)
    try:
        set_system(dbs.admin, "outbox.databases", a)
    except psycopg.Error as e:
        pytest.fail(f"cannot set outbox.databases: SQLSTATE {e.sqlstate}: {e}")
    t0 = time.monotonic()
    for name in (b, c, "postgres"):
        wait_no_worker(dbs.admin, name, 5.0, what=f"after outbox.databases = '{a}'")
        st = wakeup_status(dbs.dsn(name))
        assert st.get("worker_pid") == 0 and st.get("state") == "not served", f"{name}: {st}"
    print(f"filter applied within {time.monotonic() - t0:.2f} s")
    pid_a, _ = wait_served(dbs.admin, a, timeout=3.0, what=f"with outbox.databases = '{a}'")
    lst = listeners(dbs.dsn(a))
    assert_background_wakeup(dbs.dsn(a), lst, pid_a, "dbs.filter", what=f"in {a} with the filter set")
    with connect(dbs.dsn(b)) as x:
        h = x.execute("SELECT status, message FROM outbox.health() WHERE check_name = 'background_worker'").fetchone()
        print(f"[{b}] health background_worker while filtered out: {h}")

    set_system(dbs.admin, "outbox.databases", None)
    t0 = time.monotonic()
    for name in (a, b, c, "postgres"):
        wait_served(dbs.admin, name, timeout=5.0, what="after RESET outbox.databases")
    print(f"all served again {time.monotonic() - t0:.2f} s after the reset")


# ---------------------------------------------------------------------------
# 9. killing the worker and the launcher
# ---------------------------------------------------------------------------
@pytest.mark.disruptive
def test_terminated_worker_is_replaced(dbs, listeners, served_again):
    name = dbs.ext["a"]
    dsn = dbs.dsn(name)
    old, _ = wait_served(dbs.admin, name, timeout=5.0)
    lst = listeners(dsn)
    assert run(dbs.admin, "SELECT pg_terminate_backend(%s)", (old,))[0][0]
    new, waited = wait_served(dbs.admin, name, timeout=5.0, not_pid=old, what="after pg_terminate_backend(worker)")
    print(f"[{name}] worker {old} terminated, {new} serving after {waited:.2f} s")
    assert_background_wakeup(dsn, lst, new, "dbs.after-kill", what=f"in {name} after the worker was replaced")


@pytest.mark.disruptive
def test_terminated_launcher_is_restarted_and_databases_stay_served(dbs, listeners, served_again):
    names = [*dbs.ext.values(), "postgres"]
    for name in names:
        wait_served(dbs.admin, name, timeout=5.0)
    ls = launchers(dbs.admin)
    assert len(ls) == 1, f"expected one '{LAUNCHER}' backend: {outbox_backends(dbs.admin)}"
    old = ls[0][0]
    lsts = {name: listeners(dbs.dsn(name)) for name in names}
    assert run(dbs.admin, "SELECT pg_terminate_backend(%s)", (old,))[0][0]
    t0 = time.monotonic()
    while True:
        ls = [p for p, _ in launchers(dbs.admin) if p != old]
        if ls:
            break
        assert time.monotonic() - t0 < 4, f"no new launcher within 4 s of terminating {old}: {outbox_backends(dbs.admin)}"
        time.sleep(0.05)
    print(f"launcher {old} terminated, {ls[0]} running after {time.monotonic() - t0:.2f} s")
    for name in names:
        pid, _ = wait_served(dbs.admin, name, timeout=5.0, what="after the launcher was terminated")
        st = wakeup_status(dbs.dsn(name))
        assert st.get("launcher_pid") == ls[0], f"{name}: launcher_pid {st.get('launcher_pid')} != {ls[0]}: {st}"
        assert_background_wakeup(dbs.dsn(name), lsts[name], pid, "dbs.after-launcher-kill", what=f"in {name}")


# ---------------------------------------------------------------------------
# 10. health: critical when no worker process is free (a cluster of its own)
# ---------------------------------------------------------------------------
HEALTH_CLUSTER = os.environ.get("OUTBOX_TEST_DBS_CLUSTER", "outbox-py-dbs-mwp")
# Not 5496: test_liveness.py's faketime cluster uses that one.
HEALTH_PORT = int(os.environ.get("OUTBOX_TEST_DBS_PORT", "5494"))


@pytest.fixture
def small_cluster():
    """A preloaded cluster with room for the launcher and one dynamic worker only:
    max_worker_processes = 2, no logical replication launcher, no parallel workers."""
    if not os.path.exists(PGCLUSTER):
        pytest.skip(f"{PGCLUSTER} not available")
    with socket.socket() as sock:
        sock.settimeout(1)
        if sock.connect_ex(("127.0.0.1", HEALTH_PORT)) == 0:
            pytest.fail(f"port {HEALTH_PORT} is in use: set OUTBOX_TEST_DBS_PORT to a free port")
    cmd = [
        "bash", PGCLUSTER, "start", HEALTH_CLUSTER, str(HEALTH_PORT), "--preload",
        "-c", "max_worker_processes=2",
        "-c", "max_logical_replication_workers=0",
        "-c", "max_parallel_workers=0",
        "-c", "max_parallel_workers_per_gather=0",
        "-c", "max_parallel_maintenance_workers=0",
    ]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, f"could not start {HEALTH_CLUSTER} on port {HEALTH_PORT}: {r.stderr[-1500:]}"
        yield f"host=127.0.0.1 port={HEALTH_PORT} user=postgres dbname=postgres"
    finally:
        subprocess.run(["bash", PGCLUSTER, "destroy", HEALTH_CLUSTER], capture_output=True, timeout=120)


def test_health_critical_when_worker_processes_are_exhausted(small_cluster):
    admin = small_cluster
    names = [f"{BASE}_h{i}" for i in range(3)]
    for name in names:
        create_db(admin, name, extension=True)

    def snapshot():
        out = {}
        for name in names:
            with connect(dsn_with_db(admin, name)) as c:
                (st,) = c.execute("SELECT to_jsonb(w) FROM outbox.wakeup_status() w").fetchone()
                (oid,) = c.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()
                h = c.execute(
                    "SELECT status, value, message FROM outbox.health() WHERE check_name = 'background_worker'"
                ).fetchone()
            served = bool(st.get("worker_pid")) and st.get("database") == oid
            out[name] = SimpleNamespace(st=st, health=h, served=served)
        return out

    def settle(expect_served, what):
        """Wait until exactly expect_served databases are served and every other
        one says state 'waiting'; then hold for one more launcher poll."""
        deadline = time.monotonic() + 10
        while True:
            snap = snapshot()
            served = [n for n, s in snap.items() if s.served]
            waiting = [n for n, s in snap.items() if not s.served and s.st.get("state") == "waiting"]
            if len(served) == expect_served and len(served) + len(waiting) == len(names):
                time.sleep(1.2)
                snap2 = snapshot()
                if [n for n, s in snap2.items() if s.served] == served:
                    return snap2
            if time.monotonic() > deadline:
                detail = {n: (s.st, s.health) for n, s in snap.items()}
                pytest.fail(
                    f"{what}: expected {expect_served} served and the rest 'waiting' within 10 s "
                    f"(max_worker_processes = 2: the launcher and one worker); got {detail}; "
                    f"outbox backends: {outbox_backends(admin)}"
                )
            time.sleep(0.1)

    snap = settle(1, "3 databases, 1 free worker process")
    for name, s in snap.items():
        want = "ok" if s.served else "critical"
        assert s.health[0] == want, f"{name}: health background_worker {s.health}, expected {want}; wakeup_status {s.st}"
        if not s.served:
            assert s.st.get("worker_pid") == 0, s.st
    print({n: (s.st.get("state"), s.health[0]) for n, s in snap.items()})

    # Freeing the one worker process lets a waiting database be served.
    (first,) = [n for n, s in snap.items() if s.served]
    with connect(dsn_with_db(admin, first)) as c:
        c.execute("SET outbox.allow_drop = on")
        c.execute("DROP EXTENSION outbox_ext")
    names.remove(first)
    snap = settle(1, f"after DROP EXTENSION in {first}")
    for name, s in snap.items():
        want = "ok" if s.served else "critical"
        assert s.health[0] == want, f"{name}: health background_worker {s.health}, expected {want}; wakeup_status {s.st}"
