"""The claim low-water mark (src/lowwater.rs): claim() starts its index scan at a
key below which no live event is, so dead index entries of consumed events are not
re-read. These tests try to put a live event below the mark, in every way an event
can enter the claim index with an old visible_at, and check it is still claimed.

They need the preloaded cluster: without shared memory there is no mark.
"""

import random
import threading
import time

import pytest

from conftest import connect, put_default_on_queue

# The mark is the queue's (src/lowwater.rs): the log reads in commit order by
# snapshots, with no mark (src/log/mod.rs).
pytestmark = pytest.mark.queue

# -infinity (no mark yet) comes back as NULL: Python's datetime has no infinity.
MARK = ("SELECT NULLIF(low_water_at, '-infinity'), low_water_id, NULLIF(publish_floor, '-infinity'), resets "
        "FROM outbox._claim_low_water()")


def mark(c):
    return c.execute(MARK).fetchone()


def advance_past(c, t, timeout=10.0):
    """Take claim steps (claims of a topic nobody publishes to) until the mark's
    timestamp is above t. Returns the mark."""
    deadline = time.monotonic() + timeout
    while True:
        c.execute("SELECT count(*) FROM outbox.claim('lw-stepper', 1, topics => ARRAY['lw.nothing'])")
        m = mark(c)
        if m[0] is not None and m[0] > t:
            return m
        assert time.monotonic() < deadline, f"the low-water mark did not pass {t} within {timeout}s: {m}"
        time.sleep(0.015)


def claim_ids(c, topic, n=100):
    return [r[0] for r in c.execute(
        "SELECT id FROM outbox.claim('lw-test', %s, topics => ARRAY[%s])", (n, topic)).fetchall()]


def key_of(c, event_id):
    return c.execute("SELECT visible_at, id FROM outbox.event_queue WHERE id = %s", (event_id,)).fetchone()


def test_mark_advances_and_claims_skip_below_it(preload):
    c = preload.conn()
    c.execute("SET outbox.notify = off")
    c.execute("SELECT count(*) FROM outbox.publish_batch('lw.a', (SELECT array_agg('{}'::jsonb) FROM generate_series(1, 300)))")
    ids = claim_ids(c, "lw.a", 200)
    assert len(ids) == 200
    (t0,) = c.execute("SELECT published_at FROM outbox.event_queue WHERE id = %s", (max(ids),)).fetchone()
    c.execute("SELECT outbox.ack(id, lease_token) FROM outbox.event_queue WHERE id = ANY(%s)", (ids,))
    deadline = time.monotonic() + 10
    while True:  # steps until the mark is past every consumed event
        c.execute("SELECT count(*) FROM outbox.claim('lw-stepper', 1, topics => ARRAY['lw.nothing'])")
        m = mark(c)
        if m[0] is not None and (m[0], m[1]) > (t0, max(ids)):
            break
        assert time.monotonic() < deadline, f"the mark did not pass the consumed events: {m}"
        time.sleep(0.015)
    # It never passes a live event of the claim index.
    below = c.execute(
        "SELECT count(*) FROM outbox.event_queue WHERE state <> 'dead' AND is_head AND (visible_at, id) < (%s, %s)",
        (m[0], m[1])).fetchone()[0]
    assert below == 0, f"{below} live events below the mark {m}"
    assert m[2] is not None  # the publish floor moved too
    assert len(claim_ids(c, "lw.a")) == 100


def test_publish_in_old_transaction_is_claimed_after_the_mark_passed_its_start(preload):
    c, old = preload.conn(), preload.conn()
    c.execute("SET outbox.notify = off")
    old.execute("SET outbox.notify = off")
    old.execute("BEGIN")
    (t_old,) = old.execute("SELECT now()").fetchone()  # no xid yet
    time.sleep(0.05)
    c.execute("SELECT outbox.publish('lw.new', '{}')")
    m = advance_past(c, t_old)
    assert m[0] > t_old
    (eid,) = old.execute("SELECT outbox.publish('lw.old', '{}')").fetchone()
    old.execute("COMMIT")
    vis, _ = key_of(c, eid)
    assert (vis, eid) > (m[0], m[1]), "the old transaction's event sorts below the mark"
    assert vis > t_old  # raised to the floor
    assert claim_ids(c, "lw.old") == [eid]


def test_old_transaction_with_an_xid_holds_the_mark_and_its_event_is_claimed(preload):
    c, old = preload.conn(), preload.conn()
    c.execute("SET outbox.notify = off")
    old.execute("SET outbox.notify = off")
    old.execute("BEGIN")
    old.execute("SELECT txid_current()")  # an xid from the start
    time.sleep(0.05)
    c.execute("SELECT outbox.publish('lw.new', '{}')")
    for _ in range(20):  # steps happen; step B must wait for the old transaction
        c.execute("SELECT count(*) FROM outbox.claim('lw-stepper', 1, topics => ARRAY['lw.nothing'])")
        time.sleep(0.015)
    (eid,) = old.execute("SELECT outbox.publish('lw.old', '{}')").fetchone()
    old.execute("COMMIT")
    m = mark(c)
    vis, _ = key_of(c, eid)
    assert m[0] is None or (vis, eid) > (m[0], m[1])
    assert claim_ids(c, "lw.old") == [eid]


def test_event_published_before_the_mark_moved_and_committed_after_is_claimed(preload):
    """The uncommitted row is invisible to the mark's probes; only step B's wait for
    older transaction ids keeps the mark from passing it."""
    c, old = preload.conn(), preload.conn()
    c.execute("SET outbox.notify = off")
    old.execute("SET outbox.notify = off")
    old.execute("BEGIN")
    (eid,) = old.execute("SELECT outbox.publish('lw.old', '{}')").fetchone()
    (t_old,) = old.execute("SELECT now()").fetchone()
    time.sleep(0.05)
    c.execute("SELECT outbox.publish('lw.new', '{}')")
    for _ in range(30):  # plenty of steps while the publisher is open
        c.execute("SELECT count(*) FROM outbox.claim('lw-stepper', 1, topics => ARRAY['lw.nothing'])")
        time.sleep(0.015)
    old.execute("COMMIT")
    m = mark(c)
    vis, _ = key_of(c, eid)
    assert m[0] is None or (vis, eid) >= (m[0], m[1]), f"committed event {(vis, eid)} is below the mark {m}"
    assert claim_ids(c, "lw.old") == [eid]


def test_subject_successor_promoted_after_the_mark_passed_it_is_claimed(preload):
    c = preload.conn()
    c.execute("SET outbox.notify = off")
    c.execute("BEGIN")
    (e1,) = c.execute("SELECT outbox.publish('lw.subj', '{}', subject => 's1')").fetchone()
    (e2,) = c.execute("SELECT outbox.publish('lw.subj', '{}', subject => 's1')").fetchone()
    c.execute("COMMIT")
    (tok,) = c.execute("SELECT lease_token FROM outbox.claim('lw-test', 10, topics => ARRAY['lw.subj'])").fetchone()
    e2_vis, _ = key_of(c, e2)
    time.sleep(0.02)
    c.execute("SELECT outbox.publish('lw.new', '{}')")
    m = advance_past(c, e2_vis)
    assert (m[0], m[1]) > (e2_vis, e2), "test setup: the mark should have passed the queued successor"
    assert c.execute("SELECT outbox.ack(%s, %s)", (e1, tok)).fetchone()[0]
    vis, _ = key_of(c, e2)
    assert (vis, e2) > (m[0], m[1])
    assert claim_ids(c, "lw.subj") == [e2]


def test_retry_and_replay_enter_above_the_mark(preload):
    c = preload.conn()
    c.execute("SET outbox.notify = off")
    (a,) = c.execute("SELECT outbox.publish('lw.retry', '{}')").fetchone()
    (b,) = c.execute("SELECT outbox.publish('lw.dead', '{}')").fetchone()
    rows = dict(c.execute("SELECT id, lease_token FROM outbox.claim('lw-test', 10, topics => ARRAY['lw.retry', 'lw.dead'])").fetchall())
    c.execute("SELECT outbox.fail(%s, %s, 'x', permanent => true)", (b, rows[b]))
    # A worker transaction that began before the mark moved: its retry has no delay.
    w = preload.conn()
    w.execute("BEGIN")
    (t,) = w.execute("SELECT now()").fetchone()
    time.sleep(0.05)
    c.execute("SELECT outbox.publish('lw.new', '{}')")
    m = advance_past(c, t)
    assert w.execute("SELECT outbox.fail(%s, %s, 'x', retry_in => '0 s')", (a, rows[a])).fetchone()[0] == "pending"
    w.execute("COMMIT")
    assert c.execute("SELECT outbox.replay(%s)", (b,)).fetchone()[0]
    for eid in (a, b):
        vis, _ = key_of(c, eid)
        assert (vis, eid) > (m[0], m[1])
    assert sorted(claim_ids(c, "lw.retry") + claim_ids(c, "lw.dead")) == sorted([a, b])


def test_rows_written_around_the_api_are_found_by_the_maintenance_audit(preload):
    c = preload.conn()
    c.execute("SET outbox.notify = off")
    (t,) = c.execute("SELECT clock_timestamp()").fetchone()
    time.sleep(0.01)
    c.execute("SELECT outbox.publish('lw.new', '{}')")
    m = advance_past(c, t)
    # A manual INSERT with an old visible_at lands below the mark.
    (eid,) = c.execute(
        "INSERT INTO outbox.event_queue (topic, payload, max_attempts, visible_at) "
        "VALUES ('lw.manual', '{}', 5, now() - interval '1 hour') RETURNING id").fetchone()
    assert claim_ids(c, "lw.manual") == [], "claim found a row below the low-water mark: it is not using the mark"
    resets = m[3]
    try:
        c.execute("ALTER SYSTEM SET outbox.maintenance_interval = '200ms'")
        c.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 15
        while mark(c)[3] == resets:
            assert time.monotonic() < deadline, "the maintenance audit did not reset the mark within 15 s"
            time.sleep(0.1)
    finally:
        c.execute("ALTER SYSTEM RESET outbox.maintenance_interval")
        c.execute("SELECT pg_reload_conf()")
    assert claim_ids(c, "lw.manual") == [eid]


def test_truncate_resets_the_mark(preload):
    c = preload.conn()
    c.execute("SET outbox.notify = off")
    (t,) = c.execute("SELECT clock_timestamp()").fetchone()
    time.sleep(0.01)
    c.execute("SELECT outbox.publish('lw.new', '{}')")
    advance_past(c, t)
    c.execute("TRUNCATE outbox.event_queue")
    (eid,) = c.execute(
        "INSERT INTO outbox.event_queue (topic, payload, max_attempts, visible_at) "
        "VALUES ('lw.manual', '{}', 5, now() - interval '1 hour') RETURNING id").fetchone()
    assert claim_ids(c, "lw.manual") == [eid]


def test_no_event_is_stranded_under_concurrent_long_publishers(preload):
    """Publishers hold their transactions open for random times (so now() is old
    when they publish and commit), some publish into subjects, some roll back a
    savepoint; two workers claim, fail some and ack the rest. Afterwards every
    committed event is delivered, and claims find them all promptly."""
    dsn = preload.dsn
    stop = threading.Event()
    committed, errors = [], []
    lock = threading.Lock()

    def publisher(seed):
        rnd = random.Random(seed)
        with connect(dsn) as p:
            p.execute("SET outbox.notify = off")
            while not stop.is_set():
                try:
                    p.execute("BEGIN")
                    time.sleep(rnd.random() * 0.08)
                    mine = []
                    # One subject per transaction: subject locks are held to commit,
                    # and two transactions taking two subjects in opposite orders
                    # would deadlock (an application's choice, not under test here).
                    subj = f"s{rnd.randint(1, 5)}" if rnd.random() < 0.4 else None
                    for _ in range(rnd.randint(1, 3)):
                        mine.append(p.execute("SELECT outbox.publish('lw.race', '{}', subject => %s)", (subj,)).fetchone()[0])
                    if rnd.random() < 0.2:
                        p.execute("SAVEPOINT x")
                        p.execute("SELECT outbox.publish('lw.race', '{}')")
                        p.execute("ROLLBACK TO SAVEPOINT x")
                    time.sleep(rnd.random() * 0.08)
                    p.execute("COMMIT")
                    with lock:
                        committed.extend(mine)
                except Exception as e:  # noqa: BLE001
                    errors.append(repr(e))
                    return

    acked = []

    def worker(seed):
        rnd = random.Random(seed)
        with connect(dsn) as w:
            w.execute("SET outbox.notify = off")
            idle_since = None
            while True:
                rows = w.execute("SELECT id, lease_token FROM outbox.claim('lw-race', 20, topics => ARRAY['lw.race'])").fetchall()
                if not rows:
                    if stop.is_set():
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > 2.0:
                            return
                    time.sleep(0.005)
                    continue
                idle_since = None
                for eid, tok in rows:
                    if rnd.random() < 0.1:
                        w.execute("SELECT outbox.fail(%s, %s, 'flaky', retry_in => '0 s')", (eid, tok))
                    else:
                        assert w.execute("SELECT outbox.ack(%s, %s)", (eid, tok)).fetchone()[0]
                        with lock:
                            acked.append(eid)

    pubs = [threading.Thread(target=publisher, args=(i,)) for i in range(4)]
    workers = [threading.Thread(target=worker, args=(100 + i,)) for i in range(2)]
    for t in pubs + workers:
        t.start()
    time.sleep(6)
    stop.set()
    for t in pubs:
        t.join(30)
    for t in workers:
        t.join(60)
    assert not errors, errors[:3]
    with connect(dsn) as c:
        left = c.execute("SELECT id, state, visible_at, is_head FROM outbox.event_queue WHERE topic = 'lw.race'").fetchall()
        m = mark(c)
    assert not left, f"events left undelivered after the workers went idle for 2 s: {left[:5]} (mark {m})"
    assert sorted(acked) == sorted(committed)
    assert len(committed) > 50, len(committed)


def _step_a_while(c, topic, n=12):
    """Publish, claim and ack a few events with pauses, so that claims take steps."""
    for _ in range(n):
        c.execute("SELECT outbox.publish(%s, '{}')", (topic,))
        rows = c.execute("SELECT id, lease_token FROM outbox.claim('lw-step', 10, topics => ARRAY[%s])", (topic,)).fetchall()
        for eid, tok in rows:
            c.execute("SELECT outbox.ack(%s, %s)", (eid, tok))
        time.sleep(0.015)


def test_mark_stays_off_until_the_sql_is_upgraded(preload_dsn):
    """A new library serving 0.2.0's SQL (between installing the package and ALTER
    EXTENSION UPDATE) must not use a mark: 0.2.0's replay writes no floor."""
    from scratch_db import create_db, drop_db
    from test_upgrade import install_fixture

    name = "outbox_lw_upgrade"
    dsn = create_db(preload_dsn, name, extension=False)
    try:
        with connect(dsn) as c:
            install_fixture(c, "0.2.0")
            c.execute("CREATE EXTENSION outbox_ext VERSION '0.2.0'")
            c.execute("SET outbox.notify = off")
            _step_a_while(c, "lw.v2")
            (eid,) = c.execute(
                "INSERT INTO outbox.event_queue (topic, payload, max_attempts, visible_at) "
                "VALUES ('lw.manual', '{}', 5, now() - interval '1 hour') RETURNING id").fetchone()
            got = [r[0] for r in c.execute("SELECT id FROM outbox.claim('lw-test', 10, topics => ARRAY['lw.manual'])")]
            assert got == [eid], "a 0.2.0 schema served by the new library used a low-water mark"
            # The last version whose 'default' reads the queue (0.12.0 moves it to the log).
            c.execute("ALTER EXTENSION outbox_ext UPDATE TO '0.11.0'")
        with connect(dsn) as c:  # a new session, as after the upgrade
            c.execute("SET outbox.notify = off")
            _step_a_while(c, "lw.v3")
            assert mark(c)[0] is not None, "no low-water mark after the upgrade"
            (eid,) = c.execute(
                "INSERT INTO outbox.event_queue (topic, payload, max_attempts, visible_at) "
                "VALUES ('lw.manual', '{}', 5, now() - interval '1 hour') RETURNING id").fetchone()
            got = [r[0] for r in c.execute("SELECT id FROM outbox.claim('lw-test', 10, topics => ARRAY['lw.manual'])")]
            assert got == [], "after the upgrade, claims should start at the mark"
    finally:
        drop_db(preload_dsn, name)


def test_recreated_extension_starts_without_a_mark(preload_dsn):
    from scratch_db import create_db, drop_db

    name = "outbox_lw_recreate"
    dsn = create_db(preload_dsn, name)
    put_default_on_queue(dsn)
    try:
        with connect(dsn) as c:
            c.execute("SET outbox.notify = off")
            _step_a_while(c, "lw.one")
            assert mark(c)[0] is not None
            c.execute("DROP EXTENSION outbox_ext CASCADE")
            c.execute("CREATE EXTENSION outbox_ext")
            put_default_on_queue(dsn)
            m = mark(c)
            assert m[0] is None and m[3] == 0, f"a re-created outbox shows the old table's mark: {m}"
            (eid,) = c.execute(
                "INSERT INTO outbox.event_queue (topic, payload, max_attempts, visible_at) "
                "VALUES ('lw.manual', '{}', 5, now() - interval '1 hour') RETURNING id").fetchone()
            got = [r[0] for r in c.execute("SELECT id FROM outbox.claim('lw-test', 10, topics => ARRAY['lw.manual'])")]
            assert got == [eid]
    finally:
        drop_db(preload_dsn, name)


def test_claim_uses_the_mark_as_an_index_bound(preload):
    """The row comparison must bound the index scan (Index Cond), not filter rows
    after reading them, or the dead entries below the mark would still be read."""
    c = preload.conn()
    c.execute("SET outbox.notify = off")
    c.execute("SELECT count(*) FROM outbox.publish_batch('lw.plan', (SELECT array_agg('{}'::jsonb) FROM generate_series(1, 2000)))")
    c.execute("ANALYZE outbox.event_queue")
    plans = []
    c.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    c.execute("LOAD 'auto_explain'")
    c.execute("SET auto_explain.log_min_duration = 0")
    c.execute("SET auto_explain.log_nested_statements = on")
    c.execute("SET client_min_messages = log")
    c.execute("BEGIN")
    c.execute("SELECT count(*) FROM outbox.claim('lw-plan', 100, topics => ARRAY['lw.plan'])")
    c.execute("ROLLBACK")
    c.execute("SET client_min_messages = notice")
    claim_plans = [p for p in plans if "event_queue_ready_idx" in p]
    assert claim_plans, f"no claim plan logged: {plans[:3]}"
    scan = claim_plans[0].split("event_queue_ready_idx", 1)[1]
    cond = scan.split("Index Cond:", 1)[1].splitlines()[0]
    assert "ROW(visible_at, id) >= ROW(" in cond, claim_plans[0]


def test_audit_function_finds_rows_below_the_mark(preload):
    c = preload.conn()
    c.execute("SET outbox.notify = off")
    (t,) = c.execute("SELECT clock_timestamp()").fetchone()
    time.sleep(0.01)
    c.execute("SELECT outbox.publish('lw.new', '{}')")
    advance_past(c, t)
    assert c.execute("SELECT outbox._audit_low_water()").fetchone()[0] is False
    (eid,) = c.execute(
        "INSERT INTO outbox.event_queue (topic, payload, max_attempts, visible_at) "
        "VALUES ('lw.manual', '{}', 5, now() - interval '1 hour') RETURNING id").fetchone()
    assert claim_ids(c, "lw.manual") == []
    assert c.execute("SELECT outbox._audit_low_water()").fetchone()[0] is True
    assert claim_ids(c, "lw.manual") == [eid]
