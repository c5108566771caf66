"""Wake-ups: what a `LISTEN outbox` connection receives, per
outbox.notify mode, across commit, rollback, savepoints, two-phase commit, worker
restarts and delayed events. 'background' needs the preloaded cluster, where the
launcher runs a worker in every database that has the extension.

Each notification is timestamped on arrival by a reader thread (conftest.Listener),
so the latencies printed here are commit -> arrival. Run with `-s` to see them; they
are also recorded as junit properties."""

import os
import statistics
import time
from collections import Counter

import psycopg
import pytest

from conftest import PGCLUSTER, Notices, connect, dsn_with_db, restart_preload_cluster, wait_for_worker

# The worker sleeps at most 1 s between passes; a window a bit longer than that
# catches anything it might still send.
QUIET = 1.3

MODE_CASES = [
    ("plain", "off"),
    ("plain", "transaction"),
    ("preload", "off"),
    ("preload", "transaction"),
    ("preload", "background"),
]


def payloads(got):
    return Counter(p for p, _, _ in got)


def set_mode(conn, mode):
    conn.execute(f"SET outbox.notify = '{mode}'")
    assert conn.execute("SHOW outbox.notify").fetchone()[0] == mode


# What a claim reads: the install's 'default' (NULL), and a named subscription,
# which reads the log (its due times come from src/log/due.rs, 0.12.0).
SUBSCRIPTIONS = [None, "wk_log"]


def subscribe(db, sub):
    """Create `sub` (a subscription of the log) unless it is the default; then
    without 'default' (clean() brings it back), so that only the log holds
    the events and only its due times can announce them."""
    if sub is not None:
        db.one("SELECT outbox.create_subscription(%s)", (sub,))
        db.one("SELECT outbox.drop_subscription('default', true)")


@pytest.mark.parametrize("where,mode", MODE_CASES, ids=[f"{w}-{m}" for w, m in MODE_CASES])
def test_notifications_follow_commit_not_rollback(request, listen, where, mode):
    db = request.getfixturevalue(where)
    lst = listen(db.dsn)
    p = db.conn()
    set_mode(p, mode)

    p.execute("BEGIN")
    p.execute("SELECT outbox.publish('wk.a', '{}')")
    p.execute("SELECT outbox.publish('wk.a', '{}', subject => 's1')")
    p.execute("SELECT outbox.publish_batch('wk.a', ARRAY['1', '2']::jsonb[])")
    p.execute("SELECT outbox.publish('wk.b', '{}')")
    p.execute("SAVEPOINT s1")
    p.execute("SELECT outbox.publish('wk.rolled-back-savepoint', '{}')")
    p.execute("SELECT outbox.publish_batch('wk.rolled-back-savepoint', ARRAY['1']::jsonb[])")
    p.execute("ROLLBACK TO SAVEPOINT s1")
    p.execute("SAVEPOINT s2")
    p.execute("SELECT outbox.publish('wk.released-savepoint', '{}')")
    p.execute("RELEASE SAVEPOINT s2")
    before = lst.collect(0.3)
    p.execute("COMMIT")
    t_commit = time.monotonic()

    p.execute("BEGIN")
    p.execute("SELECT outbox.publish('wk.rolled-back', '{}')")
    p.execute("ROLLBACK")
    # A short transaction too: no worker pass can fall between its start and its
    # commit, which is when a sweep of "newly visible" rows would pick it up.
    p.execute("SELECT outbox.publish('wk.quick', '{}')")

    got = lst.collect(QUIET)
    assert before == [], f"notified before commit: {before}"
    expected = (
        Counter()
        if mode == "off"
        else Counter({"wk.a": 1, "wk.b": 1, "wk.released-savepoint": 1, "wk.quick": 1})
    )
    assert payloads(got) == expected, (
        f"mode {mode} on {where}: got {[(t, pid, round(at - t_commit, 3)) for t, pid, at in got]} "
        f"(publisher pid {p.info.backend_pid})"
    )
    if expected:
        lat = max(at for _, _, at in got) - t_commit
        print(f"[{where}/{mode}] last notification {lat * 1000:.1f} ms after COMMIT returned")

    # The notified topics really hold the committed events, and only those.
    w = db.conn()
    claimed = Counter(r[0] for r in w.execute("SELECT topic FROM outbox.claim('w', 100)").fetchall())
    assert claimed == Counter({"wk.a": 4, "wk.b": 1, "wk.released-savepoint": 1, "wk.quick": 1})


@pytest.mark.parametrize("where,mode", [("plain", "transaction"), ("preload", "background")])
def test_woken_worker_finds_events_and_latency(request, listen, record_property, where, mode):
    """A worker that claims the moment its notification arrives always finds the
    event: the notification never overtakes the commit's visibility."""
    db = request.getfixturevalue(where)
    lst = listen(db.dsn)
    p = db.conn()
    w = db.conn()
    set_mode(p, mode)
    lat = []
    for i in range(20):
        topic = f"wk.lat{i % 3}"
        p.execute("BEGIN")
        (eid,) = p.execute("SELECT outbox.publish(%s, '{}')", (topic,)).fetchone()
        t0 = time.monotonic()
        p.execute("COMMIT")
        n = lst.first(5)
        assert n is not None, f"no notification for commit {i}"
        assert n[0] == topic
        lat.append(n[2] - t0)
        rows = w.execute("SELECT id FROM outbox.claim('w', 10, topics => ARRAY[%s])", (topic,)).fetchall()
        assert [r[0] for r in rows] == [eid], f"woken worker found {rows} instead of event {eid}"
        time.sleep(0.02)
    p50, worst = statistics.median(lat) * 1000, max(lat) * 1000
    print(f"[{where}/{mode}] wake-up latency COMMIT -> LISTEN: median {p50:.1f} ms, max {worst:.1f} ms")
    record_property(f"wakeup_latency_{mode}_median_ms", round(p50, 2))
    record_property(f"wakeup_latency_{mode}_max_ms", round(worst, 2))
    assert worst < 500, f"wake-up took {worst:.0f} ms"


def test_background_falls_back_without_preload_and_warns_once(plain, listen):
    lst = listen(plain.dsn)
    p = plain.conn()
    notes = Notices(p)
    # Without preload the GUC exists once the library is loaded in the session.
    d = plain.conn()
    d.execute("SELECT outbox.wakeup_status()")
    assert d.execute("SHOW outbox.notify").fetchone()[0] == "transaction"  # default without preload
    # SET before the library is loaded (a placeholder), as an application would.
    set_mode(p, "background")
    for topic in ("wk.fb1", "wk.fb2", "wk.fb1"):
        p.execute("BEGIN")
        p.execute("SELECT outbox.publish(%s, '{}')", (topic,))
        p.execute("COMMIT")
    got = lst.collect(0.5)
    # Behaves as 'transaction': the publishing backend itself notifies at commit.
    assert payloads(got) == Counter({"wk.fb1": 2, "wk.fb2": 1})
    assert {pid for _, pid, _ in got} == {p.info.backend_pid}
    warns = notes.warnings("background")
    assert len(warns) == 1, f"expected one WARNING per session, got {notes.items}"
    assert "shared_preload_libraries" in warns[0]

    # A new session warns again, once.
    q = plain.conn()
    notes2 = Notices(q)
    set_mode(q, "background")
    q.execute("SELECT outbox.publish('wk.fb3', '{}')")
    q.execute("SELECT outbox.publish('wk.fb3', '{}')")
    assert len(notes2.warnings("background")) == 1, notes2.items
    assert payloads(lst.collect(0.5)) == Counter({"wk.fb3": 2})  # autocommit: two transactions


def test_background_in_another_database_is_served_by_its_own_worker(preload_dsn, listen):
    """Every database with the extension gets its own background worker (0.5.0
    served one database, and elsewhere 'background' fell back to 'transaction'):
    the wake-up comes from that worker, not from the publisher, and PREPARE
    TRANSACTION after a publish works there."""
    dbname = "outbox_py_other"
    with connect(preload_dsn) as c:
        c.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {dbname}")
    dsn = dsn_with_db(preload_dsn, dbname)
    try:
        with connect(dsn) as p:
            p.execute("CREATE EXTENSION outbox_ext")
            deadline = time.monotonic() + 5
            while p.execute("SELECT state FROM outbox.wakeup_status()").fetchone()[0] != "serving":
                assert time.monotonic() < deadline, "no worker serves the new database within 5 s"
                time.sleep(0.05)
            worker = p.execute("SELECT worker_pid FROM outbox.wakeup_status()").fetchone()[0]
            lst = listen(dsn)
            set_mode(p, "background")
            p.execute("SELECT outbox.publish('wk.elsewhere', '{}')")
            got = lst.collect(QUIET)
            assert payloads(got) == Counter({"wk.elsewhere": 1}), got
            assert {pid for _, pid, _ in got} == {worker}, (got, worker)
            p.execute("BEGIN")
            p.execute("SELECT outbox.publish('wk.elsewhere.2pc', '{}')")
            p.execute("PREPARE TRANSACTION 'outbox_py_other_2pc'")
            assert lst.collect(0.3) == []
            p.execute("COMMIT PREPARED 'outbox_py_other_2pc'")
            # A resolved prepared transaction makes the worker announce every topic
            # with ready events (wk.elsewhere is still unclaimed).
            assert payloads(lst.collect(QUIET))["wk.elsewhere.2pc"] == 1
            lst.close()
    finally:
        with connect(preload_dsn) as c:
            c.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")


# ---------------------------------------------------------------------------
# Two-phase commit
# ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def prepared_ok(preload_dsn):
    """max_prepared_transactions > 0 on the preload cluster. The harness's clusters
    may not have it: then set it and restart the cluster (only when the harness
    told us which cluster that is)."""
    with connect(preload_dsn) as c:
        n = int(c.execute("SHOW max_prepared_transactions").fetchone()[0])
    if n > 0:
        return True
    if not os.environ.get("OUTBOX_TEST_CLUSTER_PRELOAD") or not os.path.exists(PGCLUSTER):
        pytest.skip("max_prepared_transactions = 0 on the preload cluster and no way to restart it")
    with connect(preload_dsn) as c:
        c.execute("ALTER SYSTEM SET max_prepared_transactions = 10")
    assert restart_preload_cluster("max_prepared_transactions = 0")
    with connect(preload_dsn) as c:
        assert int(c.execute("SHOW max_prepared_transactions").fetchone()[0]) > 0
    return True


@pytest.fixture
def gids(preload_dsn):
    made = []
    yield made
    with connect(preload_dsn) as c:
        for (g,) in c.execute("SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)", (made,)).fetchall():
            c.execute(f"ROLLBACK PREPARED '{g}'")


@pytest.mark.parametrize("sub", SUBSCRIPTIONS)
def test_prepared_transaction_background_wakes_on_commit_prepared(prepared_ok, preload, listen, gids, sub):
    subscribe(preload, sub)
    lst = listen(preload.dsn)
    p = preload.conn()
    o = preload.conn()
    set_mode(p, "background")

    gids.append("outbox_py_2pc_commit")
    p.execute("BEGIN")
    (eid,) = p.execute("SELECT outbox.publish('wk.2pc', '{}')").fetchone()
    p.execute("PREPARE TRANSACTION 'outbox_py_2pc_commit'")
    assert lst.collect(0.5) == [], "notified for a transaction that is only prepared"
    assert o.execute("SELECT count(*) FROM outbox.claim('w', subscription => %s)", (sub,)).fetchone()[0] == 0
    t0 = time.monotonic()
    o.execute("COMMIT PREPARED 'outbox_py_2pc_commit'")  # from another session
    n = lst.first(3)
    assert n is not None, "COMMIT PREPARED did not wake the listener"
    assert n[0] == "wk.2pc"
    print(f"[preload/background] COMMIT PREPARED -> notification {1000 * (n[2] - t0):.1f} ms")
    assert [r[0] for r in o.execute("SELECT id FROM outbox.claim('w', subscription => %s)", (sub,)).fetchall()] == [eid]
    assert payloads(lst.collect(QUIET)) == Counter(), "more than one notification"

    gids.append("outbox_py_2pc_abort")
    p.execute("BEGIN")
    p.execute("SELECT outbox.publish('wk.2pc-aborted', '{}')")
    p.execute("PREPARE TRANSACTION 'outbox_py_2pc_abort'")
    o.execute("ROLLBACK PREPARED 'outbox_py_2pc_abort'")
    assert lst.collect(QUIET) == [], "a rolled-back prepared transaction notified"
    assert o.execute("SELECT prepared_waiting FROM outbox.wakeup_status()").fetchone()[0] == 0


def test_prepared_transaction_in_transaction_mode_fails(prepared_ok, preload, listen):
    """Documented limitation: 'transaction' mode queues a NOTIFY in the publishing
    transaction, and PostgreSQL cannot PREPARE a transaction that has executed
    NOTIFY (SQLSTATE 0A000). Use 'background' (or 'off') with two-phase commit."""
    lst = listen(preload.dsn)
    p = preload.conn()
    set_mode(p, "transaction")
    p.execute("BEGIN")
    p.execute("SELECT outbox.publish('wk.2pc-tx', '{}')")
    with pytest.raises(psycopg.errors.FeatureNotSupported) as ei:
        p.execute("PREPARE TRANSACTION 'outbox_py_2pc_tx'")
    assert "NOTIFY" in str(ei.value)
    p.execute("ROLLBACK")  # no-op if already aborted
    assert p.execute("SELECT count(*) FROM pg_prepared_xacts WHERE gid = 'outbox_py_2pc_tx'").fetchone()[0] == 0
    assert p.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 0
    assert lst.collect(0.3) == []


# ---------------------------------------------------------------------------
# The background worker
# ---------------------------------------------------------------------------
@pytest.fixture
def worker_back(preload_dsn):
    """After a test that kills the worker: make sure one runs again, restarting
    the cluster if the postmaster did not, so later tests are unaffected."""
    yield
    with connect(preload_dsn) as c:
        deadline = time.monotonic() + 5
        while c.execute("SELECT worker_pid FROM outbox.wakeup_status()").fetchone()[0] == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        else:
            return
    restart_preload_cluster("the outbox worker did not come back")


@pytest.mark.disruptive
def test_worker_restarts_after_terminate_and_wakeups_resume(preload, listen, worker_back):
    lst = listen(preload.dsn)
    p = preload.conn()
    set_mode(p, "background")
    old = wait_for_worker(preload.dsn)
    assert p.execute("SELECT pg_terminate_backend(worker_pid) FROM outbox.wakeup_status()").fetchone()[0]
    t_kill = time.monotonic()

    # Publish while no worker runs (if we catch that window): it must be announced
    # by the restarted worker.
    down = False
    while time.monotonic() - t_kill < 3:
        pid = p.execute("SELECT worker_pid FROM outbox.wakeup_status()").fetchone()[0]
        if pid == 0:
            down = True
            break
        if pid != old:
            break
        time.sleep(0.01)
    if down:
        p.execute("SELECT outbox.publish('wk.while-down', '{}')")

    new = wait_for_worker(preload.dsn, not_pid=old, timeout=10)
    restart = time.monotonic() - t_kill
    print(f"[preload] worker {old} terminated, {new} running after {restart:.2f} s (window seen: {down})")
    assert restart < 5
    if down:
        n = lst.first(3)
        # The old worker may still have sent a pass of the previous test's commits
        # before it died; only the new worker's notifications count here.
        while n is not None and n[1] == old:
            n = lst.first(3)
        assert n is not None and n[0] == "wk.while-down", f"event committed while the worker was down: {n}"
        assert n[1] == new

    t0 = time.monotonic()
    p.execute("SELECT outbox.publish('wk.after-restart', '{}')")
    n = lst.first(2)
    assert n is not None, "no wake-up after the worker restarted"
    assert (n[0], n[1]) == ("wk.after-restart", new)
    assert n[2] - t0 < 0.5
    assert payloads(lst.collect(QUIET)) == Counter()


@pytest.mark.parametrize("sub", SUBSCRIPTIONS)
@pytest.mark.parametrize("mode", ["background", "transaction"])
def test_delayed_event_wakes_listener_when_due(preload, listen, mode, sub):
    """deliver_at = +300 ms: no notification at commit, one when it comes due. In
    'transaction' mode only the worker's due sweep (at most 1 s apart) sees it."""
    subscribe(preload, sub)
    lst = listen(preload.dsn)
    p = preload.conn()
    set_mode(p, mode)
    p.execute("BEGIN")
    p.execute("SELECT outbox.publish('wk.delayed', '{}', deliver_at => clock_timestamp() + interval '300 ms')")
    p.execute("COMMIT")
    t0 = time.monotonic()
    got = lst.collect(1.6)
    times = [(t, round(at - t0, 3)) for t, _, at in got]
    assert payloads(got) == Counter({"wk.delayed": 1}), times
    dt = got[0][2] - t0
    print(f"[preload/{mode}] delayed event (300 ms) notified {dt * 1000:.0f} ms after COMMIT")
    assert 0.25 <= dt <= 1.3, times
    w = preload.conn()
    assert w.execute("SELECT count(*) FROM outbox.claim('w', subscription => %s)", (sub,)).fetchone()[0] == 1


@pytest.mark.parametrize("sub", SUBSCRIPTIONS)
def test_a_delayed_event_committed_after_its_time_is_announced_by_its_commit(preload, listen, sub):
    """deliver_at passes while the publishing transaction is still open: the
    worker's due-time pass has looked past that moment already, so the commit
    announces the event, as an immediate publish (found by a helper)."""
    subscribe(preload, sub)
    lst = listen(preload.dsn)
    p = preload.conn()
    set_mode(p, "background")
    p.execute("BEGIN")
    p.execute("SELECT outbox.publish('wk.late', '{}', deliver_at => clock_timestamp() + interval '200 ms')")
    time.sleep(1.2)  # past its time, and past a due-time sweep of the worker
    t0 = time.monotonic()
    p.execute("COMMIT")
    # Counted from the moment COMMIT returned: a commit's WAL flush on a busy
    # disk is not the worker's latency (CI once took 0.8 s from before COMMIT).
    t1 = time.monotonic()
    got = lst.collect(1.0)
    # A due-time sweep never finds this event (its time lies before the sweep's
    # window), so without the commit's announcement nothing arrives at all.
    assert payloads(got) == Counter({"wk.late": 1}), got
    assert got[0][2] - t1 < 0.5, f"announced {got[0][2] - t1:.3f}s after COMMIT returned ({t1 - t0:.3f}s in COMMIT)"
    w = preload.conn()
    assert w.execute("SELECT count(*) FROM outbox.claim('w', subscription => %s)", (sub,)).fetchone()[0] == 1


@pytest.mark.parametrize("sub", SUBSCRIPTIONS)
@pytest.mark.parametrize("mode", ["background", "transaction"])
def test_retry_wakes_listener_when_due(preload, listen, mode, sub):
    subscribe(preload, sub)
    lst = listen(preload.dsn)
    p = preload.conn()
    set_mode(p, mode)
    (eid,) = p.execute("SELECT outbox.publish('wk.retry', '{}')").fetchone()
    lst.collect(QUIET)  # the publish's own wake-up(s)
    (tok,) = p.execute("SELECT lease_token FROM outbox.claim('w', 1, '1 min', subscription => %s)", (sub,)).fetchone()
    assert p.execute("SELECT outbox.fail(%s, %s, 'boom', retry_in => '300 ms')", (eid, tok)).fetchone()[0] == "pending"
    t0 = time.monotonic()
    got = lst.collect(1.6)
    times = [(t, round(at - t0, 3)) for t, _, at in got]
    assert payloads(got) == Counter({"wk.retry": 1}), times
    dt = got[0][2] - t0
    print(f"[preload/{mode}] retry (300 ms) notified {dt * 1000:.0f} ms after fail()")
    assert 0.25 <= dt <= 1.3, times
    (attempt,) = p.execute("SELECT attempt FROM outbox.claim('w', 1, subscription => %s)", (sub,)).fetchone()
    assert attempt == 2


@pytest.mark.parametrize("sub", SUBSCRIPTIONS)
def test_expired_lease_wakes_listener_when_due(preload, listen, sub):
    """A lease that runs out makes its event claimable with no commit to
    announce it: the worker's due pass does, within its 1 s sweep. Twice: the
    first lease is (for the log) a batch round, the second a lease of the
    event's row of its own."""
    subscribe(preload, sub)
    lst = listen(preload.dsn)
    p = preload.conn()
    set_mode(p, "background")
    (eid,) = p.execute("SELECT outbox.publish('wk.expired', '{}')").fetchone()
    lst.collect(QUIET)
    for attempt in (1, 2):
        (got, n) = p.execute("SELECT id, attempt FROM outbox.claim('w', 1, '400 ms', subscription => %s)",
                             (sub,)).fetchone()
        assert (got, n) == (eid, attempt)
        t0 = time.monotonic()
        heard = lst.collect(1.8)
        times = [(t, round(at - t0, 3)) for t, _, at in heard]
        assert payloads(heard) == Counter({"wk.expired": 1}), times
        dt = heard[0][2] - t0
        print(f"[preload/{sub}] lease {attempt} (400 ms) expiry notified {dt * 1000:.0f} ms after the claim")
        assert 0.35 <= dt <= 1.6, times
    (n,) = p.execute("SELECT attempt FROM outbox.claim('w', 1, subscription => %s)", (sub,)).fetchone()
    assert n == 3


def test_wakeup_coalesce_batches_a_stream_but_not_the_first_commit(preload, listen):
    """outbox.wakeup_coalesce: under a stream of commits the worker runs at most one
    pass per interval (each topic announced once per pass), while the first commit
    after a quiet spell is announced at once."""
    admin = preload.conn()
    lst = listen(preload.dsn)
    pub = preload.conn()
    pub.execute("SET outbox.notify = background")
    try:
        admin.execute("ALTER SYSTEM SET outbox.wakeup_coalesce = '250ms'")
        admin.execute("SELECT pg_reload_conf()")
        time.sleep(1.0)  # the worker reloads on its next wake-up; leave a quiet spell
        pub.execute("SELECT outbox.publish('wk.coalesce.first', '{}')")  # applies the reload
        time.sleep(1.0)
        lst.drain()
        # Quiet for a second: the next commit must not wait for the interval.
        t = time.monotonic()
        pub.execute("SELECT outbox.publish('wk.coalesce.first', '{}')")
        got = lst.first(timeout=2.0)
        assert got is not None and got[0] == "wk.coalesce.first"
        assert got[2] - t < 0.15, f"first commit after a quiet spell waited {got[2] - t:.3f}s"
        time.sleep(0.5)
        lst.drain()
        # A stream: 100 commits over ~1 s.
        passes0 = admin.execute("SELECT passes FROM outbox.wakeup_status()").fetchone()[0]
        t0 = time.monotonic()
        for _ in range(100):
            pub.execute("SELECT outbox.publish('wk.coalesce.stream', '{}')")
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        heard = [n for n in lst.collect(1.0) if n[0] == "wk.coalesce.stream"]
        passes = admin.execute("SELECT passes FROM outbox.wakeup_status()").fetchone()[0] - passes0
        bound = elapsed / 0.25 + 3
        assert 1 <= len(heard) <= bound, f"{len(heard)} notifications for 100 commits in {elapsed:.2f}s"
        assert passes <= bound + 2, f"{passes} passes in {elapsed:.2f}s with a 250 ms interval"
    finally:
        admin.execute("ALTER SYSTEM RESET outbox.wakeup_coalesce")
        admin.execute("SELECT pg_reload_conf()")
        pub.execute("SELECT outbox.publish('wk.coalesce.reset', '{}')")  # wakes the worker to reload
