"""Subject locks past outbox.max_subject_locks (src/subject.rs): any number of
distinct subjects in one transaction, at default settings, with a bounded
number of locks; the coarse lock's waits; escalation inside a savepoint.

Runs on the cluster without preload, at the server's default settings (the
default max_locks_per_transaction, whose shared lock table 10,000 fine locks
would overflow)."""

import threading
import time

import psycopg
import pytest

from conftest import connect

N = 10_000
# pg_locks shows the library's locks as advisory locks with objsubid 28514
# (src/pg/mod.rs, LOCK_SPACE); the coarse lock's first key is "obsg".
OURS = "locktype = 'advisory' AND objsubid = 28514"
COARSE_KEY = 0x6F627367


def max_subject_locks(c):
    return int(c.execute("SHOW outbox.max_subject_locks").fetchone()[0])


def locks_held(c):
    """(all pg_locks rows granted to this backend, the library's among them)."""
    return c.execute(f"SELECT count(*), count(*) FILTER (WHERE {OURS}) FROM pg_locks "
                     "WHERE pid = pg_backend_pid() AND granted").fetchone()


def coarse_mode(c, pid):
    """The mode in which backend `pid` holds the coarse lock, or None."""
    row = c.execute(f"SELECT mode FROM pg_locks WHERE {OURS} AND classid = %s::oid AND objid = 0 "
                    "AND pid = %s AND granted", (COARSE_KEY, pid)).fetchone()
    return row[0] if row else None


def assert_bounded(c, what, fine=None):
    """At most K fine locks and the coarse lock; the rest of the backend's
    locks are the relations the calls touched and the transaction's own ids,
    a few dozen whatever N is. With `fine`, exactly that many fine locks and
    the coarse lock held exclusively (the transaction escalated)."""
    k = max_subject_locks(c)
    total, ours = locks_held(c)
    assert ours <= k + 1, f"{what}: {ours} of the library's locks held, more than K + 1 = {k + 1}"
    assert total <= k + 100, f"{what}: {total} locks held by the backend"
    if fine is not None:
        fine = k if fine == "K" else fine
        assert coarse_mode(c, c.info.backend_pid) == "ExclusiveLock", f"{what}: not escalated"
        assert ours == fine + 1, f"{what}: {ours} of the library's locks held, expected {fine} fine + the coarse one"


def drain(c, topic=None):
    """Claim and ack until nothing is left; the ids in the order handed out."""
    out = []
    while True:
        rows = c.execute("SELECT id, lease_token FROM outbox.claim('w', 10000, topics => %s)",
                         ([topic] if topic else None,)).fetchall()
        if not rows:
            return out
        assert c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                         ([r[0] for r in rows], [r[1] for r in rows])).fetchone()[0] == len(rows)
        out += [r[0] for r in rows]


def wait_until_blocked(c, pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if c.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", (pid,)).fetchone()[0]:
            return True
        time.sleep(0.02)
    return False


def test_ten_thousand_subjects_in_one_transaction_of_publish_calls(plain):
    c = plain.conn()
    c.execute("BEGIN")
    c.execute("SELECT count(outbox.publish('sl.one', jsonb_build_object('n', g), subject => 's' || g)) "
              "FROM generate_series(1, %s) g", (N,))
    # And one call at a time, as an application publishes.
    for g in range(N + 1, N + 201):
        c.execute("SELECT outbox.publish('sl.one', '{}', subject => %s)", (f"s{g}",))
    # K fine locks, then the coarse lock for the rest.
    assert_bounded(c, "a transaction of publish calls over 10,200 subjects", fine="K")
    c.execute("COMMIT")
    assert len(drain(c)) == N + 200


def test_ten_thousand_subjects_in_one_publish_batch(plain):
    c = plain.conn()
    c.execute("BEGIN")
    ids = c.execute("SELECT outbox.publish_batch('sl.batch', array_agg(jsonb_build_object('n', g) ORDER BY g), "
                    "array_agg('s' || g ORDER BY g)) FROM generate_series(1, %s) g", (N,)).fetchall()
    assert len(ids) == N
    # The call escalated before it took any fine lock.
    assert_bounded(c, "publish_batch of 10,000 subjects", fine=0)
    c.execute("COMMIT")
    assert sorted(drain(c)) == sorted(r[0] for r in ids)


def _publish_apart(c, topic, prefix, n):
    """n events of distinct subjects, 1,000 per transaction (the replay_dead and
    cancel tests are about those calls, not about publishing); their ids."""
    ids = []
    for lo in range(1, n + 1, 1000):
        ids += [r[0] for r in c.execute(
            "SELECT outbox.publish_batch(%s, array_agg('{}'::jsonb), array_agg(%s || g)) "
            "FROM generate_series(%s::int, %s::int) g", (topic, prefix, lo, min(n, lo + 999))).fetchall()]
    return ids


def _dead_letters(c, n):
    """n events of distinct subjects, each dead for 'default'."""
    _publish_apart(c, "sl.dead", "d", n)
    dead = 0
    while dead < n:
        got = c.execute("SELECT count(*) FILTER (WHERE outbox.fail(id, lease_token, 'x', permanent => true) = 'dead') "
                        "FROM outbox.claim('w', 10000)").fetchone()[0]
        assert got > 0, f"only {dead} of {n} events went dead"
        dead += got


def test_replay_dead_over_ten_thousand_subjects(plain):
    c = plain.conn()
    _dead_letters(c, N)
    c.execute("BEGIN")
    assert c.execute("SELECT outbox.replay_dead()").fetchone()[0] == N
    assert_bounded(c, "replay_dead over 10,000 subjects")
    c.execute("COMMIT")
    assert len(drain(c)) == N


def test_cancel_over_ten_thousand_subjects(plain):
    c = plain.conn()
    ids = _publish_apart(c, "sl.cancel", "c", N)
    # Some out under a lease (not cancellable), the lanes' batches read.
    out = {r[0] for r in c.execute("SELECT id FROM outbox.claim('w', 100)").fetchall()}
    assert len(out) == 100
    c.execute("BEGIN")
    cancelled = c.execute("SELECT count(*) FILTER (WHERE outbox.cancel(i)) FROM unnest(%s::bigint[]) i",
                          (ids,)).fetchone()[0]
    assert cancelled == N - len(out)
    assert_bounded(c, "cancel over 10,000 subjects")
    c.execute("COMMIT")
    assert c.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' "
                     "AND state = 'cancelled'").fetchone()[0] == N - len(out)


def test_an_escalated_transaction_holds_publishers_of_every_subject_until_it_ends(plain):
    """Past K subjects a transaction holds the coarse lock: a publisher of any
    subject waits for it, one without a subject does not, and once it commits
    the waiter goes on (its event after the escalated one's, per subject)."""
    a, b, n, mon = plain.conn(), plain.conn(), plain.conn(), plain.conn()
    a.execute("SET outbox.max_subject_locks = 2")
    a.execute("BEGIN")
    a_ids = {s: a.execute("SELECT outbox.publish('sl.esc', '\"A\"', subject => %s)", (s,)).fetchone()[0]
             for s in ("p1", "p2", "p3")}
    assert coarse_mode(mon, a.info.backend_pid) == "ExclusiveLock"
    n.execute("SET lock_timeout = '2s'")
    n.execute("SELECT outbox.publish('sl.esc', '\"no subject\"')")  # never waits
    got = {}

    def publish_b():
        got["id"] = b.execute("SELECT outbox.publish('sl.esc', '\"B\"', subject => 'p1')").fetchone()[0]

    t = threading.Thread(target=publish_b)
    t.start()
    assert wait_until_blocked(mon, b.info.backend_pid), "a publisher of p1 did not wait for the escalated transaction"
    assert mon.execute("SELECT %s = ANY (pg_blocking_pids(%s))",
                       (a.info.backend_pid, b.info.backend_pid)).fetchone()[0]
    a.execute("COMMIT")
    t.join(10)
    assert got["id"] > a_ids["p1"]
    assert coarse_mode(mon, a.info.backend_pid) is None


def test_escalation_inside_a_savepoint_that_rolls_back(plain):
    """The coarse lock taken in a savepoint goes with it: the transaction is not
    escalated any more, takes fine locks again (and escalates again when it
    passes K), and the subjects it published before keep their fine locks."""
    a, b, mon = plain.conn(), plain.conn(), plain.conn()
    a.execute("SET outbox.max_subject_locks = 3")
    b.execute("SET lock_timeout = '2s'")
    a.execute("BEGIN")
    a.execute("SELECT outbox.publish('sl.sp', '\"before\"', subject => 'keep')")
    a.execute("SAVEPOINT sp")
    a.execute("SELECT count(outbox.publish('sl.sp', '\"in savepoint\"', subject => 'x' || g)) "
              "FROM generate_series(1, 5) g")
    assert coarse_mode(mon, a.info.backend_pid) == "ExclusiveLock"
    a.execute("ROLLBACK TO SAVEPOINT sp")
    assert coarse_mode(mon, a.info.backend_pid) is None
    assert locks_held(a)[1] == 1  # keep's fine lock
    # Not escalated: a publisher of another subject does not wait ...
    b.execute("SELECT outbox.publish('sl.sp', '\"other\"', subject => 'other')")
    # ... and one of 'keep' does (its fine lock outlived the savepoint).
    assert b.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND granted AND " + OURS,
                     (a.info.backend_pid,)).fetchone()[0] == 1
    with pytest.raises(psycopg.errors.LockNotAvailable):
        b.execute("SELECT outbox.publish('sl.sp', '\"other keep\"', subject => 'keep')")
    # Fine locks again up to K, then the coarse lock again.
    a.execute("SELECT outbox.publish('sl.sp', '\"after\"', subject => 'y1')")
    a.execute("SELECT outbox.publish('sl.sp', '\"after\"', subject => 'y2')")
    assert locks_held(a)[1] == 3 and coarse_mode(mon, a.info.backend_pid) is None
    a.execute("SAVEPOINT sp2")
    a.execute("SELECT outbox.publish('sl.sp', '\"after\"', subject => 'y3')")
    a.execute("RELEASE SAVEPOINT sp2")  # a committed subtransaction passes G to its parent
    assert coarse_mode(mon, a.info.backend_pid) == "ExclusiveLock"
    with pytest.raises(psycopg.errors.LockNotAvailable):
        b.execute("SELECT outbox.publish('sl.sp', '\"waits\"', subject => 'z')")
    a.execute("COMMIT")
    assert coarse_mode(mon, a.info.backend_pid) is None
    got = [r[0] for r in a.execute("SELECT payload #>> '{}' FROM outbox.events WHERE topic = 'sl.sp' "
                                   "ORDER BY id").fetchall()]
    assert got == ["before", "other", "after", "after", "after"]
