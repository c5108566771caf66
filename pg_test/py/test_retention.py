"""Retention across sessions: purge never removes undelivered events,
commits batch by batch, counts each row once under concurrency, never waits on
in-flight work, and runs on its own (background worker with preload, pg_cron
without). Explicit purges run on the cluster without preload, where no
background worker can purge behind a test's back."""

import threading
import time

import psycopg
import pytest

from conftest import connect

OLD = "1 year"


def publish_n(c, n, topic, keys=None, subjects=None):
    return [
        r[0]
        for r in c.execute(
            "SELECT * FROM outbox.publish_batch(%s, array_fill('{}'::jsonb, ARRAY[%s]), %s, %s)",
            (topic, n, subjects, keys),
        ).fetchall()
    ]


def claim_all(c, n, lease="10 min", topics=None):
    return c.execute(
        "SELECT id, lease_token FROM outbox.claim('w', %s, %s::interval, %s)", (n, lease, topics)
    ).fetchall()


def forget_log(c):
    """Empty the log's ring, as its retention does once every reader has read
    past a table: the events leave the log, and what the subscriptions keep of
    their own (rows in outbox.log_exceptions, delivery records) becomes
    purgeable (outbox._log_floor). Every batch must be finished first."""
    c.execute("TRUNCATE outbox.log_0, outbox.log_1, outbox.log_2, outbox.log_3")


def retry_rows(c, n, topic, keys=None, subjects=None, retry_in="0"):
    """n events of `topic`, each failed once: rows of their own of 'default',
    pending a retry in `retry_in`."""
    ids = publish_n(c, n, topic, keys, subjects)
    rows = claim_all(c, n, topics=[topic])
    assert sorted(i for i, _ in rows) == sorted(ids)
    states = c.execute(
        "SELECT outbox.fail(i, t, 'once', retry_in => %s::interval) FROM unnest(%s::bigint[], %s::uuid[]) AS u(i, t)",
        (retry_in, [i for i, _ in rows], [t for _, t in rows]),
    ).fetchall()
    assert {s for (s,) in states} == {"pending"} and len(states) == n
    return ids


def make_delivered(c, n, topic, age=OLD, keyed=True):
    """n rows of their own of 'default' delivered after a retry (their attempt
    history), finished `age` ago."""
    keys = [f"{topic}-k{i}" for i in range(n)] if keyed else None
    ids = retry_rows(c, n, topic, keys)
    rows = claim_all(c, n, topics=[topic])
    assert sorted(i for i, _ in rows) == sorted(ids)
    acked = c.execute(
        "SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([i for i, _ in rows], [t for _, t in rows])
    ).fetchone()[0]
    assert acked == n
    if age:
        c.execute(
            f"UPDATE outbox.log_exceptions SET delivered_at = now() - interval '{age}', "
            f"published_at = now() - interval '{age}' WHERE id = ANY(%s)",
            (ids,),
        )
    return ids


def make_dead(c, n, topic, age=OLD, subjects=None):
    ids = publish_n(c, n, topic, subjects=subjects)
    rows = claim_all(c, n, topics=[topic])
    states = c.execute(
        "SELECT outbox.fail(i, t, 'boom', permanent => true) FROM unnest(%s::bigint[], %s::uuid[]) AS u(i, t)",
        ([i for i, _ in rows], [t for _, t in rows]),
    ).fetchall()
    assert {s for (s,) in states} == {"dead"} and len(states) == n
    if age:
        c.execute(
            f"UPDATE outbox.log_exceptions SET dead_at = now() - interval '{age}', "
            f"published_at = now() - interval '{age}' WHERE id = ANY(%s)",
            (ids,),
        )
    return ids


def rows_in(c, states):
    """Ids of the rows of their own of 'default' in `states`."""
    return sorted(r[0] for r in c.execute(
        "SELECT id FROM outbox.log_exceptions WHERE subscription = 'default' AND state = ANY(%s)", (list(states),)
    ).fetchall())


def loaded(c):
    """Load the library in this session first (see BUG-P4 in
    test_purge_as_first_call_of_a_session): tests that are about something else
    must not trip over it."""
    c.execute("SELECT outbox.wakeup_status()")
    return c


def call_purge(c, proc, older_than, batch_size):
    return c.execute(f"CALL outbox.{proc}(%s::interval, %s)", (older_than, batch_size)).fetchone()[0]


def ids_in(c, sql, params=None):
    return sorted(r[0] for r in c.execute(sql, params).fetchall())


def test_purge_never_removes_undelivered_events(plain):
    c = plain.conn()
    # Undelivered rows of their own of every kind, all a year old.
    pending = retry_rows(c, 3, "ret.pending", keys=["kp0", "kp1", "kp2"], retry_in="1 hour")
    leased = retry_rows(c, 2, "ret.leased")
    assert len(claim_all(c, 2, topics=["ret.leased"])) == 2
    expired = retry_rows(c, 1, "ret.expired")
    claim_all(c, 1, lease="1 ms", topics=["ret.expired"])  # lease long gone
    dead_recent = make_dead(c, 2, "ret.dead-recent", age=None)
    dead_old = make_dead(c, 3, "ret.dead-old")
    # A blocking dead letter with a successor of the same subject parked behind it.
    head = make_dead(c, 1, "ret.subj", subjects=["s1"])
    behind = publish_n(c, 1, "ret.subj", subjects=["s1"])
    assert claim_all(c, 10, topics=["ret.subj"]) == []
    undelivered = pending + leased + expired + behind
    # Finished rows: old and recent, delivered and cancelled.
    delivered_old = make_delivered(c, 4, "ret.done")
    delivered_new = make_delivered(c, 2, "ret.done-new", age=None)
    cancelled = retry_rows(c, 1, "ret.cancelled", retry_in="1 hour")
    assert c.execute("SELECT outbox.cancel(%s)", (cancelled[0],)).fetchone()[0]
    c.execute(f"UPDATE outbox.log_exceptions SET published_at = now() - interval '{OLD}', "
              f"cancelled_at = now() - interval '{OLD}' WHERE id = %s", (cancelled[0],))
    c.execute(f"UPDATE outbox.log_exceptions SET published_at = now() - interval '{OLD}' WHERE id = ANY(%s)",
              (undelivered,))
    assert sorted(undelivered) == rows_in(c, ["pending", "leased"])
    forget_log(c)

    # Rows are compared, not the reported counts (those are
    # test_purge_commits_each_batch's business).
    hot = sorted(undelivered + dead_recent + dead_old + head + cancelled)
    assert rows_in(c, ["delivered"]) == sorted(delivered_old + delivered_new)
    call_purge(c, "purge", "1 day", 2)
    assert rows_in(c, ["delivered"]) == sorted(delivered_new)
    call_purge(c, "purge", "0", 2)
    call_purge(c, "purge", None, 1000)
    assert rows_in(c, ["delivered"]) == []
    # purge() never touches another state.
    assert rows_in(c, ["pending", "leased", "dead", "cancelled"]) == hot

    call_purge(c, "purge_dead", "1 day", 2)
    call_purge(c, "purge_dead", None, 1000)
    assert rows_in(c, ["pending", "leased", "dead", "cancelled"]) == sorted(undelivered + dead_recent)
    states = dict(c.execute("SELECT id, state FROM outbox.events").fetchall())
    assert all(states[i] in ("pending", "leased") for i in undelivered), states
    # Their dispatch keys survive too: republishing a key still deduplicates.
    assert c.execute("SELECT outbox.publish('ret.pending', '{}', dispatch_key => 'kp1')").fetchone()[0] == pending[1]
    # Purging the blocking dead letter released its subject.
    assert behind[0] in ids_in(c, "SELECT id FROM outbox.claim('w2', 100, topics => ARRAY['ret.subj'])")


@pytest.mark.parametrize("call", ["purge('1 day')", "purge_dead('1 day')", "run_maintenance()"])
def test_purge_as_first_call_of_a_session(plain, call):
    """pg_cron and cron-like schedulers open a fresh session per run: the first
    thing they do is CALL the procedure, before any other outbox function has
    loaded the library."""
    c = plain.conn()
    make_delivered(c, 3, "ret.fresh", age="8 days")
    make_dead(c, 2, "ret.fresh-dead", age="31 days")
    forget_log(c)
    with connect(plain.dsn) as fresh:
        fresh.execute(f"CALL outbox.{call}")
    left = c.execute("SELECT count(*) FROM outbox.events").fetchone()[0]
    assert left == {"purge": 2, "purge_dead": 3, "run_maintenance": 0}[call.split("(")[0]]


@pytest.fixture
def purge_probe(plain):
    """An AFTER DELETE trigger on the rows of their own that records, per purge
    statement, the transaction id and rows deleted, and that makes the purge
    wait on advisory lock 7770001 once the rows (as the purge sees them) are
    down to 50. Test-only instrumentation, dropped afterwards."""
    c = plain.conn()
    c.execute("DROP TABLE IF EXISTS public.purge_probe")
    c.execute("CREATE TABLE public.purge_probe (xid xid8, n bigint, at timestamptz DEFAULT clock_timestamp())")
    c.execute(
        """
        CREATE OR REPLACE FUNCTION public.purge_probe_fn() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO public.purge_probe (xid, n) SELECT pg_catalog.pg_current_xact_id(), pg_catalog.count(*) FROM gone;
            IF (SELECT pg_catalog.count(*) FROM outbox.log_exceptions) OPERATOR(pg_catalog.<=) 50 THEN
                PERFORM pg_catalog.pg_advisory_xact_lock(7770001);
            END IF;
            RETURN NULL;
        END $$"""
    )
    c.execute(
        "CREATE TRIGGER purge_probe AFTER DELETE ON outbox.log_exceptions "
        "REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION public.purge_probe_fn()"
    )
    yield c
    c.execute("DROP TRIGGER IF EXISTS purge_probe ON outbox.log_exceptions")
    c.execute("DROP FUNCTION IF EXISTS public.purge_probe_fn()")
    c.execute("DROP TABLE IF EXISTS public.purge_probe")


def wait_until_waiting(c, pid, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = c.execute("SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        if ev == ("Lock", "advisory"):
            return True
        time.sleep(0.01)
    return False


def test_purge_commits_each_batch(plain, purge_probe):
    """While a purge with batch_size 10 is held in its 5th batch, another session
    already sees the first 4 batches gone; each transaction deleted at most 10."""
    c = plain.conn()
    make_delivered(c, 100, "ret.batch")
    forget_log(c)
    blocker = plain.conn()
    blocker.execute("SELECT pg_advisory_lock(7770001)")
    purger = loaded(plain.conn())
    result = {}

    def run():
        try:
            result["removed"] = call_purge(purger, "purge", "1 day", 10)
        except Exception as e:
            result["error"] = repr(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert wait_until_waiting(c, purger.info.backend_pid), "purge never reached the probe's lock"
        seen = c.execute("SELECT count(*) FROM outbox.log_exceptions").fetchone()[0]
        committed = c.execute("SELECT count(DISTINCT xid), coalesce(sum(n), 0) FROM public.purge_probe").fetchone()
    finally:
        blocker.execute("SELECT pg_advisory_unlock(7770001)")
        t.join(30)
    assert "error" not in result, result
    per_xact = c.execute("SELECT xid::text, sum(n) FROM public.purge_probe GROUP BY xid ORDER BY min(at)").fetchall()
    assert all(n <= 10 for _, n in per_xact), f"a transaction deleted more than batch_size rows: {per_xact}"
    assert sum(n for _, n in per_xact) == 100
    # 100 rows, 4 committed batches of 10 visible from outside, the 5th not yet.
    assert seen == 60, f"another session saw {seen} rows while the purge was in its 5th batch"
    assert committed == (4, 40)
    assert result["removed"] == 100, f"purge reported {result['removed']} of 100 rows removed"
    assert c.execute("SELECT count(*) FROM outbox.log_exceptions").fetchone()[0] == 0


@pytest.mark.parametrize("proc", ["purge", "purge_dead"])
def test_concurrent_purges_count_each_row_once(plain, proc):
    c = plain.conn()
    n = 1500
    if proc == "purge":
        make_delivered(c, n, "ret.conc")
    else:
        make_dead(c, n, "ret.conc")
    forget_log(c)
    rounds = []
    errors = []
    start = threading.Barrier(2)

    def run(name):
        try:
            with connect(plain.dsn) as x:
                # A wait (let alone a deadlock) shows up as an error, not a hang.
                x.execute("SET lock_timeout = '5s'")
                loaded(x)
                start.wait()
                rounds.append((name, call_purge(x, proc, "1 day", 25)))
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(f"p{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    left = c.execute("SELECT count(*) FROM outbox.log_exceptions").fetchone()[0]
    assert left == 0
    assert c.execute("SELECT count(*) FROM outbox.dispatch_keys").fetchone()[0] == 0
    print(f"[{proc}] concurrent counts: {rounds}")
    assert sum(r for _, r in rounds) == n, f"reported {rounds}, removed {n}"


def test_purge_never_waits_on_inflight_work(plain):
    """Claims, acks, replays, cancels and readers holding row locks are in flight:
    purge and purge_dead skip what is locked instead of waiting (lock_timeout
    would turn any wait into an error)."""
    c = plain.conn()
    old_done = make_delivered(c, 20, "ret.done")
    old_dead = make_dead(c, 10, "ret.dead")
    forget_log(c)
    pending = publish_n(c, 5, "ret.work")

    worker = plain.conn()
    worker.execute("BEGIN")
    leased = claim_all(worker, 5, topics=["ret.work"])
    for i, t in leased[:2]:
        assert worker.execute("SELECT outbox.ack(%s, %s)", (i, t)).fetchone()[0]
    replayer = plain.conn()
    replayer.execute("BEGIN")
    assert replayer.execute("SELECT outbox.replay(%s)", (old_dead[0],)).fetchone()[0]
    canceller = plain.conn()
    canceller.execute("BEGIN")
    assert canceller.execute("SELECT outbox.cancel(%s)", (old_dead[1],)).fetchone()[0]
    reader = plain.conn()
    reader.execute("BEGIN")
    reader.execute("SELECT 1 FROM outbox.log_exceptions WHERE id = %s FOR UPDATE", (old_done[0],))

    p = loaded(plain.conn())
    p.execute("SET lock_timeout = '500ms'")
    t0 = time.monotonic()
    call_purge(p, "purge", "1 day", 5)
    call_purge(p, "purge", "0", 5)
    call_purge(p, "purge_dead", "1 day", 3)
    elapsed = time.monotonic() - t0
    # All but the row the reader locked; the uncommitted acks are not finished yet.
    assert rows_in(c, ["delivered"]) == [old_done[0]]
    # All dead rows but the replaying and the cancelling one.
    assert rows_in(c, ["dead"]) == sorted(old_dead[:2])
    assert elapsed < 2, f"purges took {elapsed:.2f}s: they waited"

    worker.execute("COMMIT")
    replayer.execute("COMMIT")
    canceller.execute("COMMIT")
    reader.execute("ROLLBACK")
    states = dict(c.execute("SELECT id, state FROM outbox.events").fetchall())
    assert states[old_dead[0]] == "pending" and states[old_dead[1]] == "cancelled"
    assert [states[i] for i, _ in leased[:2]] == ["delivered", "delivered"]
    assert [states[i] for i, _ in leased[2:]] == ["leased"] * 3
    # What was skipped is purged by the next run, once finished and old enough:
    # the 2 acks, the cancel, the reader's row.
    call_purge(p, "purge", "0", 5)
    call_purge(p, "purge_dead", "0", 5)
    assert rows_in(c, ["delivered"]) == []
    assert sorted(i for i, s in states.items() if s in ("pending", "leased")) == sorted(pending[2:] + [old_dead[0]])


def test_purge_dead_of_blocking_letter_does_not_wait_for_publisher(plain):
    """Purging a dead letter that blocks its subject releases the subject; an
    open publisher transaction of that subject (which holds the subject lock)
    must not stall retention."""
    c = plain.conn()
    make_dead(c, 1, "ret.subj", subjects=["s-busy"])
    forget_log(c)
    publisher = plain.conn()
    publisher.execute("BEGIN")
    publisher.execute("SELECT outbox.publish('ret.subj', '{}', subject => 's-busy')")
    p = loaded(plain.conn())
    p.execute("SET lock_timeout = '500ms'")
    try:
        removed = call_purge(p, "purge_dead", "1 day", 10)
    except psycopg.errors.LockNotAvailable as e:
        pytest.fail(f"purge_dead waited for an open publisher of the subject: {e}")
    finally:
        publisher.execute("COMMIT")
    assert removed == 1
    # The publisher's event leads its subject now, and is claimable.
    assert len(claim_all(c, 10, topics=["ret.subj"])) == 1


# ---------------------------------------------------------------------------
# Scheduled retention
# ---------------------------------------------------------------------------

def with_worker_every_second(c, done, what, timeout=15):
    """Run the background worker's maintenance every second until `done()`
    returns a true value (returned), failing with `what` after `timeout` s."""
    try:
        c.execute("ALTER SYSTEM SET outbox.maintenance_interval = '1s'")
        c.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + timeout
        while not (result := done()):
            assert time.monotonic() < deadline, f"{what} within {timeout} s"
            time.sleep(0.2)
        return result
    finally:
        c.execute("ALTER SYSTEM RESET outbox.maintenance_interval")
        c.execute("SELECT pg_reload_conf()")


def test_background_worker_runs_maintenance(preload):
    c = preload.conn()
    c.execute("TRUNCATE outbox.maintenance_runs")
    kept_new = make_delivered(c, 2, "ret.bg-new", age=None)
    kept_pending = retry_rows(c, 2, "ret.bg-pending", retry_in="1 hour")
    c.execute(
        f"UPDATE outbox.log_exceptions SET published_at = now() - interval '{OLD}' WHERE id = ANY(%s)",
        (kept_pending,),
    )
    dead_recent = make_dead(c, 1, "ret.bg-dead-new", age=None)
    (t0,) = c.execute("SELECT clock_timestamp()").fetchone()
    old_done = make_delivered(c, 7, "ret.bg", age="8 days")  # past the 7 day default
    old_dead = make_dead(c, 3, "ret.bg-dead", age="31 days")  # past the 30 day default
    forget_log(c)

    def purged():
        runs = c.execute(
            "SELECT count(*), coalesce(sum(purged_delivered), 0), coalesce(sum(purged_dead), 0), "
            "       count(*) FILTER (WHERE error IS NOT NULL) "
            "  FROM outbox.maintenance_log WHERE finished_at >= %s",
            (t0,),
        ).fetchone()
        # Two runs at least: the worker keeps running at the configured pace.
        return runs if runs[0] >= 2 and runs[1] >= len(old_done) and runs[2] >= len(old_dead) else None

    runs = with_worker_every_second(c, purged, "no maintenance run purged the old rows")
    assert runs[1:] == (len(old_done), len(old_dead), 0), runs
    print(f"[preload] maintenance runs since setup: {runs[0]}")
    assert rows_in(c, ["delivered"]) == sorted(kept_new)
    assert rows_in(c, ["pending", "leased", "dead"]) == sorted(kept_pending + dead_recent)


def test_background_worker_empties_every_due_ring_table(preload):
    """The log step truncates one ring table per call (issue 40, item 6): the
    worker calls it again, one transaction each, until every due table is
    empty. Two tables sealed 8 days ago (past the 7-day default), one event
    each, no subscription to hold them."""
    c = preload.conn()
    (t0,) = c.execute("SELECT clock_timestamp()").fetchone()
    c.execute("SELECT outbox.drop_subscription('default', true)")
    row = ("(%s, pg_current_xact_id(), 0, 'ret.ring', '{}', 1, now())")
    c.execute("INSERT INTO outbox.log_0 (id, txid, lane, topic, payload, max_attempts, published_at) VALUES " + row, (-1,))
    c.execute("INSERT INTO outbox.log_1 (id, txid, lane, topic, payload, max_attempts, published_at) VALUES " + row, (-2,))
    with c.transaction():
        c.execute("DELETE FROM outbox.log_state")  # waits for a step of the worker in progress
        c.execute("INSERT INTO outbox.log_state VALUES "
                  "(0, now() - interval '9 days', now() - interval '8 days', pg_current_snapshot()), "
                  "(1, now() - interval '8 days', now() - interval '8 days', pg_current_snapshot()), "
                  "(2, now(), NULL, NULL)")
    def emptied():
        return c.execute("SELECT count(*) = 0 FROM outbox.log_state WHERE n IN (0, 1)").fetchone()[0]

    with_worker_every_second(c, emptied, "ring tables 0 and 1 still due")
    assert c.execute("SELECT count(*) FROM outbox.log").fetchone()[0] == 0
    assert c.execute("SELECT array_agg(error) FROM outbox.maintenance_log WHERE finished_at >= %s AND error IS NOT NULL",
                     (t0,)).fetchone()[0] is None


@pytest.mark.cron_last
def test_pg_cron_schedules_maintenance_without_preload(cron_cluster):
    """Without preload, retention is scheduled with pg_cron (the documented
    cron.schedule('outbox-retention', ..., 'CALL outbox.run_maintenance()')).
    pg_cron before 1.5 only knows minute schedules: then this waits for the next
    minute boundary (the cluster was set up when the session started)."""
    info = cron_cluster.info
    deadline = info["scheduled_at"] + (10 if info["schedule"] == "2 seconds" else 75)
    with connect(cron_cluster.dsn) as c:
        while True:
            row = c.execute(
                "SELECT purged_delivered, purged_dead, error FROM outbox.maintenance_log ORDER BY run_id LIMIT 1"
            ).fetchone()
            if row:
                break
            if time.monotonic() > deadline:
                jobs = c.execute(
                    "SELECT status, return_message FROM cron.job_run_details ORDER BY runid"
                ).fetchall()
                pytest.fail(f"pg_cron ({info}) did not run outbox.run_maintenance(): job runs {jobs}")
            time.sleep(0.5)
        print(f"[pg_cron {info['pg_cron_version']}, schedule {info['schedule']!r}] maintenance_log row: {row}")
        assert row == (5, 2, None), f"run_maintenance via pg_cron recorded {row}"
        status = c.execute(
            "SELECT status FROM cron.job_run_details ORDER BY runid LIMIT 1"
        ).fetchone()
        assert status == ("succeeded",), status
        assert c.execute("SELECT state FROM outbox.log_exceptions").fetchall() == [("pending",)]


def test_purge_pauses_between_batches(plain):
    """outbox.purge_delay: a pause after every committed batch except the last."""
    c = loaded(plain.conn())
    make_delivered(c, 30, "ret.pace", keyed=False)
    forget_log(c)
    c.execute("SET outbox.purge_delay = '150ms'")
    t = time.monotonic()
    assert call_purge(c, "purge", "1 day", 10) == 30  # batches of 10, 10, 10, 0: three pauses
    paced = time.monotonic() - t
    make_delivered(c, 30, "ret.pace", keyed=False)
    forget_log(c)
    c.execute("SET outbox.purge_delay = 0")
    t = time.monotonic()
    assert call_purge(c, "purge", "1 day", 10) == 30
    flat = time.monotonic() - t
    assert paced >= 0.45, f"three 150 ms pauses expected, the purge took {paced:.3f}s"
    assert flat < paced - 0.3, f"purge_delay = 0 still paused: {flat:.3f}s vs {paced:.3f}s"
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        c.execute("SET outbox.purge_delay = -1")


def test_wakeups_flow_during_a_paced_maintenance_run(preload, listen):
    """The worker runs retention one batch per loop iteration, so a long purge does
    not hold back NOTIFYs: a publish in the middle of it wakes a listener at once."""
    c = preload.conn()
    c.execute("TRUNCATE outbox.maintenance_runs")
    c.execute("SET outbox.notify = off")
    # 40 batches of 1,000 old delivered rows of their own, of events the log
    # no longer holds; at 100 ms per pause the run lasts 4 s+.
    c.execute(
        "INSERT INTO outbox.log_exceptions (subscription, id, lane, topic, payload, max_attempts, published_at, "
        "                                   state, attempts, visible_at, delivered_at) "
        "SELECT 'default', nextval('outbox.event_id_seq'), 0, 'ret.bulk', '{}', 10, now() - interval '30 days', "
        "       'delivered', 2, now() - interval '30 days', now() - interval '30 days' FROM generate_series(1, 40000)"
    )
    lst = listen(preload.dsn)
    try:
        c.execute("ALTER SYSTEM SET outbox.purge_delay = '100ms'")
        c.execute("ALTER SYSTEM SET outbox.maintenance_interval = '200ms'")
        c.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 15
        while c.execute("SELECT count(*) FROM outbox.log_exceptions WHERE topic = 'ret.bulk'").fetchone()[0] > 35000:
            assert time.monotonic() < deadline, "the maintenance run did not start"
            time.sleep(0.05)
        lst.drain()
        p = preload.conn()
        p.execute("SET outbox.notify = background")
        t = time.monotonic()
        p.execute("SELECT outbox.publish('ret.during-purge', '{}')")
        got = None
        while got is None or got[0] != "ret.during-purge":
            got = lst.first(timeout=max(0.0, 2.0 - (time.monotonic() - t)))
            assert got is not None, "no wake-up within 2 s while maintenance ran"
        latency = got[2] - t
        left = c.execute("SELECT count(*) FROM outbox.log_exceptions WHERE topic = 'ret.bulk'").fetchone()[0]
        assert left > 0, "the purge was already over: the test did not overlap it"
        assert latency < 0.5, f"wake-up took {latency:.3f}s during maintenance"
        # And the run completes and is recorded as one run.
        deadline = time.monotonic() + 30
        while not c.execute("SELECT count(*) FROM outbox.maintenance_log WHERE purged_delivered >= 40000").fetchone()[0]:
            assert time.monotonic() < deadline, "the paced maintenance run did not finish"
            time.sleep(0.2)
    finally:
        c.execute("ALTER SYSTEM RESET outbox.purge_delay")
        c.execute("ALTER SYSTEM RESET outbox.maintenance_interval")
        c.execute("SELECT pg_reload_conf()")
