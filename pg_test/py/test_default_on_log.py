"""The default subscription on the log: it can be dropped and created again,
and every call that names no subscription (claim, replay, replay_dead,
cancel) goes to it, with the claim contract of any subscription; outbox.events
reads the log, with the default subscription's state. Delivery records,
max_lag, cancels of unread events, and the views' plans."""

import threading
import time
from datetime import timedelta

import psycopg
import pytest

from conftest import connect, sqlstate



@pytest.fixture
def logdb(plain):
    """'default' as a fresh install makes it: these tests drop it, or read
    beside it."""
    return plain

CLAIM = "SELECT id, subject, lease_token, attempt, topic FROM outbox.claim('w', %s, '30 s')"


def publish(c, topic="t.a", subject=None, deliver_at=None):
    return c.execute("SELECT outbox.publish(%s, '{}', %s, deliver_at => %s)",
                     (topic, subject, deliver_at)).fetchone()[0]


def claim(c, n=10):
    return c.execute(CLAIM, (n,)).fetchall()


def ack(c, row):
    return c.execute("SELECT outbox.ack(%s::bigint, %s::uuid)", (row[0], row[2])).fetchone()[0]


def fail(c, row, permanent=False):
    return c.execute("SELECT outbox.fail(%s, %s, 'boom', '0 s'::interval, %s)",
                     (row[0], row[2], permanent)).fetchone()[0]


def start_waiting(fn, what):
    """Run fn in a thread and check that it is still waiting half a second
    later; returns the thread and the event it sets when fn returns."""
    done = threading.Event()

    def run():
        fn()
        done.set()
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    assert not done.is_set(), f"the {what} did not wait"
    return t, done


def states(db, ids):
    rows = db.all("SELECT id, state FROM outbox.events WHERE id = ANY(%s) ORDER BY id", (ids,))
    return [r[1] for r in rows]


def test_drop_default_with_leases_in_flight_needs_force(plain):
    c = plain.conn()
    publish(c)
    row = claim(c, 1)[0]
    assert sqlstate(c, "SELECT outbox.drop_subscription('default')") == "55006"
    assert plain.one("SELECT count(*) FROM outbox.subscriptions WHERE name = 'default'")[0] == 1  # nothing half-applied
    c.execute("SELECT outbox.drop_subscription('default', force => true)")
    assert ack(c, row) is False
    assert fail(c, row) == "stale"


def test_default_created_again_reads_the_log_with_the_whole_contract(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.drop_subscription('default')")
    old = publish(c)                              # committed before: not its own
    c.execute("SELECT outbox.create_subscription('default')")
    ids = [publish(c, subject="k") for _ in range(3)] + [publish(c)]
    assert states(logdb, [old]) == [None]
    assert states(logdb, ids) == ["pending"] * 4
    rows = claim(c)
    # One event per subject per claim: k's first, and the one without subject.
    assert sorted(r[0] for r in rows) == [ids[0], ids[3]]
    assert all(r[2].version == 8 for r in rows)   # log tokens
    assert states(logdb, ids) == ["leased", "pending", "pending", "leased"]
    assert ack(c, rows[0]) and ack(c, rows[1])
    assert states(logdb, [ids[0], ids[3]]) == ["delivered", "delivered"]
    # A failure: retried, then dead, then replayed and cancelled by id alone.
    c.execute("SELECT outbox.alter_subscription('default', max_attempts => 2)")
    r = claim(c)[0]
    assert r[0] == ids[1]
    assert fail(c, r) == "pending"
    r = claim(c)[0]
    assert (r[0], r[3]) == (ids[1], 2)
    assert fail(c, r) == "dead"
    assert logdb.one("SELECT state, attempts, last_error FROM outbox.events WHERE id = %s", (ids[1],)) == ("dead", 2, "boom")
    assert claim(c) == []                         # the dead letter holds its subject
    assert c.execute("SELECT outbox.replay(%s)", (ids[1],)).fetchone()[0] is True
    r = claim(c)[0]
    assert r[0] == ids[1]
    assert ack(c, r)
    r = claim(c)[0]
    assert r[0] == ids[2]
    assert fail(c, r, permanent=True) == "dead"
    assert c.execute("SELECT outbox.replay_dead('t.*')").fetchone()[0] == 1
    assert c.execute("SELECT outbox.cancel(%s)", (ids[2],)).fetchone()[0] is True
    assert states(logdb, ids) == ["delivered", "delivered", "cancelled", "delivered"]
    d = logdb.all("SELECT event_id, state FROM outbox.deliveries WHERE subscription = 'default' ORDER BY event_id")
    assert d == list(zip(ids, ["delivered", "delivered", "cancelled", "delivered"]))
    # It can be dropped like any subscription of the log.
    c.execute("SELECT outbox.drop_subscription('default')")
    assert logdb.one("SELECT count(*) FROM outbox.log_lanes")[0] == 0
    assert states(logdb, ids) == [None] * 4


def test_health_watches_a_default_of_the_log(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.drop_subscription('default')")
    c.execute("SELECT outbox.create_subscription('default')")
    publish(c)
    c.execute("SELECT outbox.pause_subscription('default')")
    rows = logdb.all("SELECT status, message FROM outbox.health() WHERE check_name = 'subscription'")
    assert len(rows) == 1 and rows[0][0] == "warn" and "paused" in rows[0][1]


def test_delivery_time_at_batch_precision_and_stats_per_subscription(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('audit')")
    ids = [publish(c, topic="t.a") for _ in range(4)] + [publish(c, topic="t.b")]
    rows = c.execute("SELECT id, subject, lease_token FROM outbox.claim('w', 10, subscription => 'audit')").fetchall()
    assert sorted(r[0] for r in rows) == ids
    # In flight: acked events are delivered with no time yet; the others leased.
    # The first ack is of an event whose lane's batch holds another one (ids
    # may straddle two lanes, and an ack that finishes its batch records it).
    lanes = dict(logdb.all("SELECT id, lane FROM outbox.log WHERE id = ANY (%s)", (ids,)))
    rows.sort(key=lambda r: -list(lanes.values()).count(lanes[r[0]]))
    assert ack(c, rows[0])
    d = dict(logdb.all("SELECT event_id, state FROM outbox.deliveries WHERE subscription = 'audit'"))
    assert d[rows[0][0]] == "delivered" and sorted(d.values()).count("leased") == 4
    assert logdb.one("SELECT count(*) FROM outbox.log_delivered")[0] == 0
    t0 = logdb.one("SELECT clock_timestamp()")[0]
    for r in rows[1:]:
        assert ack(c, r)
    t1 = logdb.one("SELECT clock_timestamp()")[0]
    # The batches finished (one per lane: events without a subject share a
    # lane in runs of 64 ids, which these may straddle): one record row each,
    # every event delivered at its time.
    (batches,) = logdb.one("SELECT count(DISTINCT lane) FROM outbox.log WHERE id = ANY (%s)", (ids,))
    assert logdb.one("SELECT count(*) FROM outbox.log_delivered WHERE subscription = 'audit'")[0] == batches
    got = logdb.all("SELECT event_id, state, attempts, delivered_at FROM outbox.deliveries "
                    "WHERE subscription = 'audit' ORDER BY event_id")
    assert [g[0] for g in got] == ids
    assert all(g[1] == "delivered" and g[2] == 1 for g in got)
    assert all(t0 <= g[3] <= t1 for g in got)
    s = dict((r[0], r[1:]) for r in logdb.all(
        "SELECT topic, delivered, delivered_last_minute, delivered_last_hour, ready, leased "
        "FROM outbox.stats WHERE subscription = 'audit'"))
    assert s == {"t.a": (4, 4, 4, 0, 0), "t.b": (1, 1, 1, 0, 0)}
    # 'default' has its own rows, unchanged by the subscription's acks.
    q = dict((r[0], r[1:]) for r in logdb.all("SELECT topic, ready, delivered FROM outbox.stats WHERE subscription = 'default'"))
    assert q == {"t.a": (4, 0), "t.b": (1, 0)}
    # Retention removes the record (each batch row counts as one row).
    removed = c.execute("CALL outbox.purge(older_than => '0 s')").fetchone()[0]
    assert removed == batches
    assert logdb.one("SELECT count(*) FROM outbox.log_delivered")[0] == 0
    assert logdb.one("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'audit' "
                     "AND state = 'delivered' AND delivered_at IS NULL")[0] == 5


def test_drop_subscription_removes_its_delivery_record(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('audit')")
    c.execute("SELECT outbox.create_subscription('keep')")
    publish(c)
    for sub in ("audit", "keep"):
        for r in c.execute("SELECT id, subject, lease_token FROM outbox.claim('w', 10, subscription => %s)", (sub,)).fetchall():
            assert ack(c, r)
    assert logdb.one("SELECT count(*) FROM outbox.log_delivered")[0] == 2
    c.execute("SELECT outbox.drop_subscription('audit')")
    assert logdb.all("SELECT subscription FROM outbox.log_delivered") == [("keep",)]


def test_events_of_a_failed_batch_keep_their_own_times(logdb):
    """An event that left its batch (a failure) is not in the record: its row
    has its own history; the batch's record holds only what it acked."""
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('audit')")
    a, b = publish(c), publish(c)
    rows = {r[0]: r for r in c.execute(
        "SELECT id, subject, lease_token FROM outbox.claim('w', 10, subscription => 'audit')").fetchall()}
    assert fail(c, rows[a]) == "pending"
    assert ack(c, rows[b])
    d = dict((r[0], r[1:]) for r in logdb.all(
        "SELECT event_id, state, attempts, delivered_at IS NOT NULL FROM outbox.deliveries WHERE subscription = 'audit'"))
    assert d == {a: ("pending", 1, False), b: ("delivered", 1, True)}
    r = c.execute("SELECT id, subject, lease_token, attempt FROM outbox.claim('w', 10, subscription => 'audit')").fetchall()
    assert [(x[0], x[3]) for x in r] == [(a, 2)]
    assert ack(c, r[0])
    d = dict((r[0], r[1:]) for r in logdb.all(
        "SELECT event_id, state, attempts, delivered_at IS NOT NULL FROM outbox.deliveries WHERE subscription = 'audit'"))
    assert d == {a: ("delivered", 2, True), b: ("delivered", 1, True)}


def _drain(c, sub):
    got = []
    while rows := c.execute("SELECT id, subject, lease_token FROM outbox.claim('w', 50, subscription => %s)",
                            (sub,)).fetchall():
        for r in rows:
            assert ack(c, r)
            got.append(r[0])
    return got


def test_max_lag_lets_retention_pass_a_lagging_subscription_and_counts_its_loss(logdb):
    c, admin = logdb.conn(), logdb.conn()
    c.execute("SELECT outbox.drop_subscription('default', true)")  # it would hold the log too
    admin.execute("SET outbox.retention_delivered = 0")
    c.execute("SELECT outbox.create_subscription('capped', topics => ARRAY['t.*'], max_lag => '1 s')")
    c.execute("SELECT outbox.create_subscription('full')")
    admin.execute("SELECT outbox._log_rotate()")                 # log_0 open
    ids = [publish(c) for _ in range(5)] + [publish(c, topic="u.x")]
    admin.execute("SELECT outbox._log_rotate()")                 # log_0 sealed, log_1 open
    assert _drain(c, "full") == ids
    # The seal is younger than the cap: the capped subscription still holds it.
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 6
    time.sleep(1.2)
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] >= 1   # log_0, and the empty log_1 sealed since
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 0
    # Its five events of t.* are lost to it (u.x was never its own), and said so.
    lost, at, max_lag = logdb.one("SELECT lost_events, lost_at IS NOT NULL, max_lag FROM outbox.subscriptions WHERE name = 'capped'")
    assert (lost, at) == (5, True) and max_lag.total_seconds() == 1
    assert logdb.one("SELECT lost_events FROM outbox.subscriptions WHERE name = 'full'")[0] == 0
    h = logdb.all("SELECT status, message FROM outbox.health() WHERE check_name = 'subscription' AND message LIKE '%capped%'")
    assert h[0][0] == "warn" and "max_lag" in h[0][1] and " 5 events" in h[0][1]
    # It goes on with what comes next.
    later = publish(c)
    assert _drain(c, "capped") == [later]


def test_without_max_lag_a_lagging_subscription_holds_the_log(logdb):
    c, admin = logdb.conn(), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    c.execute("SELECT outbox.create_subscription('slow')")
    c.execute("SELECT outbox.create_subscription('capped', max_lag => '1 s')")
    admin.execute("SELECT outbox._log_rotate()")
    ids = [publish(c) for _ in range(3)]
    admin.execute("SELECT outbox._log_rotate()")
    time.sleep(1.2)
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 3
    assert _drain(c, "slow") == ids
    # Nothing is counted lost while another subscription holds the table.
    assert logdb.one("SELECT lost_events FROM outbox.subscriptions WHERE name = 'capped'")[0] == 0


def test_max_lag_input(plain):
    c = plain.conn()
    for bad in ("0 s", "-1 s", "101 years"):
        assert sqlstate(c, "SELECT outbox.create_subscription('x', max_lag => %s::interval)", (bad,)) == "22023"
    assert plain.one("SELECT count(*) FROM outbox.subscription_catalog WHERE name = 'x'")[0] == 0
    # 'default' is a subscription like any other: it takes a max_lag too.
    assert sqlstate(c, "SELECT outbox.alter_subscription('default', max_lag => '1 h')") is None
    assert plain.one("SELECT max_lag FROM outbox.subscriptions WHERE name = 'default'")[0] == timedelta(hours=1)
    c.execute("SELECT outbox.create_subscription('x')")
    c.execute("SELECT outbox.alter_subscription('x', max_lag => '2 h')")
    assert plain.one("SELECT max_lag FROM outbox.subscriptions WHERE name = 'x'")[0].total_seconds() == 7200
    assert sqlstate(c, "SELECT outbox.alter_subscription('x', max_lag => '0 s')") == "22023"


def _claim_sub(c, sub, n=10):
    return c.execute("SELECT id, subject, lease_token FROM outbox.claim('w', %s, subscription => %s)",
                     (n, sub)).fetchall()


def _cancel(c, id_, sub):
    return c.execute("SELECT outbox.cancel(%s, %s)", (id_, sub)).fetchone()[0]


def test_cancel_an_event_the_subscription_has_not_read(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('c')")
    a, b, x = publish(c, subject="s"), publish(c, subject="s"), publish(c)
    assert _cancel(c, a, "c") is True
    assert logdb.one("SELECT skips FROM outbox.log_lanes WHERE subscription = 'c' AND skips IS NOT NULL")[0] == [a]
    assert _cancel(c, a, "c") is False            # already cancelled
    rows = _claim_sub(c, "c")
    # a is finished for its subject: b goes out at once, with x.
    assert sorted(r[0] for r in rows) == [b, x]
    assert logdb.one("SELECT count(*) FROM outbox.log_lanes WHERE subscription = 'c' AND skips IS NOT NULL")[0] == 0
    for r in rows:
        assert ack(c, r)
    assert _claim_sub(c, "c") == []
    d = dict(logdb.all("SELECT event_id, state FROM outbox.deliveries WHERE subscription = 'c'"))
    assert d == {a: "cancelled", b: "delivered", x: "delivered"}
    # Another subscription is not affected.
    assert c.execute("SELECT outbox.cancel(%s)", (a,)).fetchone()[0] is True     # 'default': its own cancel


def test_replay_of_an_event_cancelled_before_it_was_read_puts_it_back_in_order(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('c')")
    a, b = publish(c, subject="s"), publish(c, subject="s")
    assert _cancel(c, a, "c") is True
    assert c.execute("SELECT outbox.replay(%s, 'c')", (a,)).fetchone()[0] is True
    assert logdb.one("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'c'")[0] == 0
    got = []
    while rows := _claim_sub(c, "c"):
        assert len(rows) == 1                     # one subject: one at a time, in order
        assert ack(c, rows[0])
        got.append(rows[0][0])
    assert got == [a, b]


def test_cancel_an_event_waiting_in_its_batch(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('c')")
    a, b, z = publish(c, subject="s"), publish(c, subject="s"), publish(c, subject="s")
    rows = _claim_sub(c, "c")
    assert [r[0] for r in rows] == [a]            # b and z wait behind a in the batch
    assert _cancel(c, a, "c") is False            # out under a lease
    assert _cancel(c, b, "c") is True
    # a's holder still acks it; then z, not b.
    assert ack(c, rows[0])
    rows = _claim_sub(c, "c")
    assert [r[0] for r in rows] == [z]
    assert ack(c, rows[0])
    assert _claim_sub(c, "c") == []
    d = dict(logdb.all("SELECT event_id, state FROM outbox.deliveries WHERE subscription = 'c'"))
    assert d == {a: "delivered", b: "cancelled", z: "delivered"}
    assert _cancel(c, z, "c") is False            # delivered


def test_cancel_refuses_what_is_not_the_subscriptions_own(logdb):
    c = logdb.conn()
    before = publish(c, topic="t.a")
    c.execute("SELECT outbox.create_subscription('c', topics => ARRAY['t.a'])")
    other = publish(c, topic="u.b")
    assert _cancel(c, before, "c") is False       # committed before it was created
    assert _cancel(c, other, "c") is False        # outside its topics
    assert _cancel(c, 10 ** 15, "c") is False     # no such event
    assert logdb.one("SELECT count(*) FROM outbox.log_exceptions")[0] == 0


def test_cancel_waits_for_a_claim_moving_the_lane(logdb):
    claimer, canceller, pub = logdb.conn(), logdb.conn(), logdb.conn()
    claimer.execute("SELECT outbox.create_subscription('c')")
    first = publish(pub, subject="s")
    claimer.execute("BEGIN")
    got = [r[0] for r in _claim_sub(claimer, "c")]
    assert got == [first]                         # the lane row is held until commit
    later = publish(pub, subject="s")
    result = {}
    t, _ = start_waiting(lambda: result.update(ok=_cancel(canceller, later, "c")),
                         "cancel, behind the claim holding the lane,")
    claimer.execute("COMMIT")
    t.join(10)
    assert result == {"ok": True}
    rows = claimer.execute("SELECT id, subject, lease_token FROM outbox.claim('w', 10, subscription => 'c')").fetchall()
    # first is still leased to its holder; later is cancelled: nothing to hand out.
    assert rows == []


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_drop_of_a_log_subscription_whose_snapshot_predates_its_claims_leaves_nothing(logdb, isolation):
    dropper, w = logdb.conn(), logdb.conn()
    w.execute("SELECT outbox.create_subscription('s')")
    dropper.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    dropper.execute("SELECT 1")
    publish(w, subject="k")
    publish(w, subject="k")
    row = _claim_sub(w, "s")[0]                       # a lane moved, a batch, after the snapshot
    assert fail(w, row) == "pending"                  # an exception row too
    dropper.execute("SELECT outbox.drop_subscription('s', force => true)")
    dropper.execute("COMMIT")
    for t in ("log_lanes", "log_batches", "log_exceptions", "log_delivered"):
        assert logdb.one(f"SELECT count(*) FROM outbox.{t} WHERE subscription = 's'")[0] == 0, t


def test_a_cancelled_dead_letter_of_the_log_has_no_dead_at(logdb):
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('c')")
    e = publish(c)
    row = _claim_sub(c, "c")[0]
    assert fail(c, row, permanent=True) == "dead"
    assert _cancel(c, e, "c") is True
    assert logdb.one("SELECT state, dead_at, cancelled_at IS NOT NULL FROM outbox.deliveries "
                     "WHERE subscription = 'c' AND event_id = %s", (e,)) == ("cancelled", None, True)


def test_max_lag_counts_only_what_is_lost(logdb):
    """Acked events, events out under a lease and events with rows of their own
    are not lost when retention passes a capped subscription; unread ones are."""
    c, admin = logdb.conn(), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    c.execute("SELECT outbox.drop_subscription('default')")
    c.execute("SELECT outbox.create_subscription('cap', max_lag => '1 s')")
    admin.execute("SELECT outbox._log_rotate()")
    acked = [publish(c, subject=f"a{i}") for i in range(3)]
    failed = publish(c, subject="f")
    out = publish(c, subject="o")
    rows = {r[0]: r for r in _claim_sub(c, "cap")}
    for i in acked:
        assert ack(c, rows[i])
    assert fail(c, rows[failed], permanent=True) == "dead"
    unread = [publish(c, subject="u") for _ in range(2)]   # after the claim's cursor
    admin.execute("SELECT outbox._log_rotate()")            # all of them in the sealed log_0
    time.sleep(1.2)
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] >= 1
    assert logdb.one("SELECT lost_events FROM outbox.subscriptions WHERE name = 'cap'")[0] == len(unread)
    # The one out under a lease is still acked by its holder; the dead letter is kept.
    assert ack(c, rows[out])
    assert logdb.one("SELECT state FROM outbox.deliveries WHERE subscription = 'cap' AND event_id = %s",
                     (failed,))[0] == "dead"


def test_the_views_of_the_log_never_run_in_a_parallel_plan(logdb):
    """_log_batch_states and _log_delivered read through SPI, which gives the
    transaction an id: a parallel plan would fail (XX000). They are declared
    PARALLEL UNSAFE, so the planner never makes one for these views."""
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('p')")
    for _ in range(3):
        c.execute("SELECT count(*) FROM outbox.publish_batch('t.a', (SELECT array_agg('{}'::jsonb) FROM generate_series(1, 500)))")
    rows = _claim_sub(c, "p", 100)
    for r in rows[:50]:
        assert ack(c, r)
    c.execute("BEGIN")
    for setting in ("parallel_setup_cost = 0", "parallel_tuple_cost = 0", "min_parallel_table_scan_size = 0",
                    "max_parallel_workers_per_gather = 2"):
        c.execute(f"SET LOCAL {setting}")
    assert c.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'p'").fetchone()[0] == 1500
    assert c.execute("SELECT sum(leased) FROM outbox.stats WHERE subscription = 'p'").fetchone()[0] == 50
    plan = "\n".join(r[0] for r in c.execute("EXPLAIN SELECT * FROM outbox.deliveries WHERE subscription = 'p'"))
    assert "Gather" not in plan
    c.execute("COMMIT")


def test_max_lag_under_a_batch_in_flight_wedges_nothing_and_counts_the_loss(logdb):
    """Retention passes a capped subscription while events of its lane's batch
    are out: the holder's fail() answers 'stale' (0.16.0: XX000, and every
    later claim of the lane too), a lease that runs out meanwhile wedges no
    claim, and each lost event is counted once."""
    c, admin = logdb.conn(), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    c.execute("SELECT outbox.drop_subscription('default')")
    c.execute("SELECT outbox.create_subscription('cap', max_lag => '1 s')")
    admin.execute("SELECT outbox._log_rotate()")
    first, behind = publish(c, subject="s"), publish(c, subject="s")
    short = publish(c, subject="x")
    rows = {r[0]: r for r in _claim_sub(c, "cap")}
    assert set(rows) == {first, short}
    assert c.execute("SELECT outbox.extend_lease(%s, %s, '1 s')", (short, rows[short][2])).fetchone()[0]
    admin.execute("SELECT outbox._log_rotate()")
    time.sleep(1.2)
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] >= 1
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 0
    # The waiting one was counted by the log step; the two out were not (yet).
    assert logdb.one("SELECT lost_events FROM outbox.subscriptions WHERE name = 'cap'")[0] == 1
    assert fail(c, rows[first]) == "stale"
    later = publish(c)
    assert _drain(c, "cap") == [later]
    assert logdb.one("SELECT lost_events FROM outbox.subscriptions WHERE name = 'cap'")[0] == 3
