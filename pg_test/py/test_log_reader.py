"""Reading the log in commit order (src/log.rs, "Reading in commit order"):
per-lane cursors and windows (outbox._log_cursor, outbox._log_window) against
real commit orders. Publishers commit in random orders, with savepoint
rollbacks, aborts, long transactions and two-phase commits resolved later;
readers under READ COMMITTED and REPEATABLE READ advance each lane's cursor,
reading windows whole or in pieces. Every committed event must be read exactly
once by each reader, and each subject in commit (id) order."""

import random
import threading
import time

import psycopg
import pytest

from conftest import connect

SUBJECTS = [f"acct:{i}" for i in range(8)]


def cursor(conn):
    return conn.execute("SELECT snap::text, m, xn::text FROM outbox._log_cursor()").fetchone()


def window(conn, lane, lo, hi_snap, after=0, limit=None):
    return [r[0] for r in conn.execute(
        "SELECT * FROM outbox._log_window(%s::smallint, %s::pg_snapshot, %s, %s::xid8, %s::pg_snapshot, %s, %s)",
        (lane, lo[0], lo[1], lo[2], hi_snap, after, limit)).fetchall()]


def publisher(dsn, seed, stop, prepared, errors, two_pc):
    rnd = random.Random(seed)
    try:
        with connect(dsn) as c:
            c.execute("SET outbox.notify = off")  # a NOTIFY cannot be prepared
            k = 0
            while not stop.is_set():
                k += 1
                try:
                    transaction(c, rnd, seed, k, prepared, two_pc)
                except psycopg.errors.DeadlockDetected:
                    # Two transactions took the same subjects in other orders: the
                    # application's deadlock, resolved by PostgreSQL as usual.
                    c.execute("ROLLBACK")
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def transaction(c, rnd, seed, k, prepared, two_pc):
    """One random transaction: 1-4 events, savepoints, batches, sometimes long."""
    c.execute("BEGIN")
    for i in range(rnd.randint(1, 4)):
        subject = rnd.choice(SUBJECTS + [None, None])
        if rnd.random() < 0.2:
            c.execute("SAVEPOINT sp")
            c.execute("SELECT outbox.publish('rd.t', '{}', %s)", (subject,))
            c.execute("ROLLBACK TO SAVEPOINT sp")
        elif rnd.random() < 0.15:
            c.execute("SELECT outbox.publish_batch('rd.b', ARRAY['{}', '{}', '{}']::jsonb[], "
                      "ARRAY[%s, NULL, %s])", (subject, subject))
        else:
            c.execute("SELECT outbox.publish('rd.t', '{}', %s)", (subject,))
        time.sleep(rnd.random() * 0.01)
    if rnd.random() < 0.05:
        time.sleep(0.3 + rnd.random())  # a long transaction, a late committer
    r = rnd.random()
    if r < 0.15:
        c.execute("ROLLBACK")
    elif r < 0.25 and two_pc:
        gid = f"rd-{seed}-{k}"
        c.execute(f"PREPARE TRANSACTION '{gid}'")
        prepared.append((time.monotonic() + 0.1 + rnd.random() * 0.8, gid, rnd.random() < 0.7))
    else:
        c.execute("COMMIT")


def resolver(dsn, done, prepared, errors):
    """Commit or roll back each prepared transaction when its time comes; once
    `done` is set (every publisher has stopped), resolve the rest and return."""
    try:
        with connect(dsn) as c:
            while not (done.is_set() and not prepared):
                now = time.monotonic()
                for item in [p for p in list(prepared) if p[0] <= now or done.is_set()]:
                    _, gid, commit = item
                    c.execute(f"{'COMMIT' if commit else 'ROLLBACK'} PREPARED '{gid}'")
                    prepared.remove(item)
                time.sleep(0.02)
    except Exception as e:  # noqa: BLE001
        errors.append(e)


class Traffic:
    """`n` publishers (and the resolver of their prepared transactions) for as
    long as the caller runs; `finish()` stops them, resolves every prepared
    transaction and returns once nothing is left in flight."""

    def __init__(self, logdb, n, seed, errors):
        two_pc = int(logdb.one("SHOW max_prepared_transactions")[0]) > 0
        self.stop, self.done, self.prepared, self.errors = threading.Event(), threading.Event(), [], errors
        self.pubs = [threading.Thread(target=publisher, args=(logdb.dsn, seed + k, self.stop, self.prepared, errors,
                                                                two_pc)) for k in range(n)]
        self.res = threading.Thread(target=resolver, args=(logdb.dsn, self.done, self.prepared, errors))
        for t in self.pubs + [self.res]:
            t.start()

    def finish(self):
        self.stop.set()
        for t in self.pubs:
            t.join(30)
        self.done.set()
        self.res.join(30)
        assert not self.prepared


class Reader:
    """One subscription's worth of lane cursors, read by one session."""

    def __init__(self, dsn, isolation, seed):
        self.conn = connect(dsn)
        self.isolation = isolation
        self.rnd = random.Random(seed)
        start = cursor(self.conn)
        self.lanes = {lane: start for lane in range(16)}
        self.read = []  # ids in the order this reader read them

    def step(self, lane):
        hi = cursor(self.conn)
        lo = self.lanes[lane]
        if self.rnd.random() < 0.3:
            # In pieces: what a claim does when the window is larger than its batch.
            after, ids = 0, []
            while True:
                piece = window(self.conn, lane, lo, hi[0], after, self.rnd.randint(1, 3))
                ids += piece
                if len(piece) == 0:
                    break
                after = piece[-1]
        else:
            ids = window(self.conn, lane, lo, hi[0])
        self.read += ids
        self.lanes[lane] = hi

    def run(self, stop, errors):
        try:
            while not stop.is_set():
                self.conn.execute(f"BEGIN ISOLATION LEVEL {self.isolation}")
                for _ in range(self.rnd.randint(1, 20)):
                    self.step(self.rnd.randrange(16))
                self.conn.execute("COMMIT")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def finish(self):
        for lane in range(16):
            self.step(lane)


def test_windows_read_every_committed_event_once_in_subject_order(logdb):
    errors, stop_readers = [], threading.Event()
    readers = [Reader(logdb.dsn, "READ COMMITTED", 1), Reader(logdb.dsn, "REPEATABLE READ", 2)]
    rthreads = [threading.Thread(target=r.run, args=(stop_readers, errors)) for r in readers]
    traffic = Traffic(logdb, 5, 100, errors)
    for t in rthreads:
        t.start()
    # At least 12 s of races, and on a loaded machine until the traffic means something (bounded).
    started = time.monotonic()
    time.sleep(12)
    while time.monotonic() - started < 90 and logdb.all("SELECT count(*) FROM outbox.log")[0][0] <= 300:
        time.sleep(1)
    traffic.finish()
    stop_readers.set()
    for t in rthreads:
        t.join(30)
    assert not errors, errors
    for r in readers:
        r.finish()
        r.conn.close()

    committed = logdb.all("SELECT id, subject FROM outbox.log ORDER BY id")
    assert len(committed) > 200, "too little traffic to mean anything"
    assert [r[0] for r in committed] == [r[0] for r in logdb.all("SELECT id FROM outbox.events ORDER BY id")]
    subject_of = dict(committed)
    for r in readers:
        assert len(r.read) == len(set(r.read)), f"{r.isolation}: an event read twice"
        missing = set(subject_of) - set(r.read)
        assert not missing, f"{r.isolation}: {len(missing)} committed events never read, e.g. {sorted(missing)[:5]}"
        assert set(r.read) <= set(subject_of)
        last = {}
        for i in r.read:
            s = subject_of[i]
            if s is not None:
                assert last.get(s, 0) < i, f"{r.isolation}: subject {s} read {i} after {last[s]}"
                last[s] = i


def test_a_transaction_running_at_the_cursor_is_read_by_the_next_window(logdb):
    """The late committer: T1 drew its id first but commits after T2 and after
    the cursor was taken (m already covers its id); the next window must have it
    (only the cursor's in-progress list finds it), and the one after must not."""
    t1, t2, r = logdb.conn(), logdb.conn(), logdb.conn()
    lo = cursor(r)
    t1.execute("BEGIN")
    a = t1.execute("SELECT outbox.publish('rd.late', '{}')").fetchone()[0]
    b = t2.execute("SELECT outbox.publish('rd.late', '{}')").fetchone()[0]
    mid = cursor(r)
    assert mid[1] >= b > a
    t1.execute("COMMIT")
    hi = cursor(r)
    lane_of = dict(logdb.all("SELECT id, lane FROM outbox.log"))
    got_first = {i for lane in set(lane_of.values()) for i in window(r, lane, lo, mid[0])}
    got_second = {i for lane in set(lane_of.values()) for i in window(r, lane, mid, hi[0])}
    got_third = {i for lane in set(lane_of.values()) for i in window(r, lane, hi, cursor(r)[0])}
    assert (got_first, got_second, got_third) == ({b}, {a}, set())


def test_a_repeatable_read_reader_sees_commits_after_its_snapshot(logdb):
    """The cursor and the window take fresh snapshots, not the transaction's."""
    p, r = logdb.conn(), logdb.conn()
    r.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    lo = cursor(r)
    a = p.execute("SELECT outbox.publish('rd.rr', '{}')").fetchone()[0]
    hi = cursor(r)
    lane = logdb.one("SELECT lane FROM outbox.log WHERE id = %s", (a,))[0]
    assert window(r, lane, lo, hi[0]) == [a]
    r.execute("COMMIT")


def test_bad_window_arguments_get_documented_errors(logdb):
    c = logdb.conn()
    lo = cursor(c)
    for lane, limit, state in ((16, None, "22023"), (-1, None, "22023"), (0, -1, "22023")):
        with pytest.raises(psycopg.Error) as e:
            window(c, lane, lo, lo[0], 0, limit)
        assert e.value.sqlstate == state
    with pytest.raises(psycopg.Error) as e:
        c.execute("SELECT * FROM outbox._log_window(0::smallint, NULL, 0, '1', '1:1:')")
    assert e.value.sqlstate == "22004"
    with pytest.raises(psycopg.Error) as e:
        c.execute("SELECT * FROM outbox._log_window_ids(0::smallint, 'nonsense', 0, '1', '1:1:', 0, NULL)")
    assert e.value.sqlstate == "22P02"


def test_a_cursor_taken_in_a_writing_transaction_leaves_its_events_to_a_later_window(logdb):
    """A snapshot does not list its own transaction as running; the cursor does,
    so the transaction's events (published before or after the cursor) are read
    by the first window that ends after its commit, once."""
    r, other = logdb.conn(), logdb.conn()
    c0 = cursor(r)
    r.execute("BEGIN")
    before = r.execute("SELECT outbox.publish('rd.own', '{}')").fetchone()[0]
    # A later transaction completes, so the own id sits below the snapshot's xmax.
    theirs = other.execute("SELECT outbox.publish('rd.own', '{}')").fetchone()[0]
    c1 = cursor(r)
    after = r.execute("SELECT outbox.publish('rd.own', '{}')").fetchone()[0]
    lanes = range(16)
    first = [i for lane in lanes for i in window(r, lane, c0, c1[0])]
    r.execute("COMMIT")
    c2 = cursor(r)
    second = [i for lane in lanes for i in window(r, lane, c1, c2[0])]
    assert sorted(first) == [theirs]
    assert sorted(second) == [before, after]
