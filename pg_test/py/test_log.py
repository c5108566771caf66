"""The event log ring (src/log/mod.rs): every committed event is appended
exactly once, in its publisher's transaction, with
that transaction's id and its lane; the maintenance step rotates and truncates
the ring without ever queueing for a lock. Real sessions on the cluster without
preload (no background worker rotates behind a test's back)."""

import threading
import time

import psycopg
import pytest

from conftest import connect, sqlstate

RING = ("outbox.log_0", "outbox.log_1", "outbox.log_2", "outbox.log_3")
COLS = "id, txid::text::bigint, lane, topic, subject, dispatch_key, payload::text, max_attempts"


def logging_conn(logdb, **kw):
    return logdb.conn(**kw)


def log_rows(logdb):
    return logdb.all(" UNION ALL ".join(f"SELECT {COLS} FROM {t}" for t in RING) + " ORDER BY 1")


def event_ids(logdb):
    return [r[0] for r in logdb.all("SELECT id FROM outbox.events ORDER BY id")]


def test_committed_events_are_logged_once_with_their_transaction_id(logdb):
    c = logging_conn(logdb)
    c.execute("BEGIN")
    a = c.execute("SELECT outbox.publish('log.a', '{\"n\": 1}')").fetchone()[0]
    b = c.execute("SELECT outbox.publish('log.a', '{\"n\": 2}', 'acct:1', 'key-1')").fetchone()[0]
    # The same key again names the first event and writes nothing.
    assert c.execute("SELECT outbox.publish('log.a', '{\"n\": 3}', NULL, 'key-1')").fetchone()[0] == b
    batch = [r[0] for r in c.execute(
        "SELECT * FROM outbox.publish_batch('log.b', ARRAY['{\"m\": 1}', '{\"m\": 2}']::jsonb[], "
        "ARRAY['acct:2', NULL])").fetchall()]
    xid = c.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
    c.execute("COMMIT")
    rows = log_rows(logdb)
    assert [r[0] for r in rows] == [a, b, *batch] == event_ids(logdb)
    assert {r[1] for r in rows} == {xid}
    assert [(r[3], r[4], r[5], r[6]) for r in rows] == [
        ("log.a", None, None, '{"n": 1}'),
        ("log.a", "acct:1", "key-1", '{"n": 2}'),
        ("log.b", "acct:2", None, '{"m": 1}'),
        ("log.b", None, None, '{"m": 2}'),
    ]
    assert {r[7] for r in rows} == {10}


def test_rollbacks_savepoints_and_prepared_transactions_decide_the_log(logdb):
    c = logging_conn(logdb)
    c.execute("BEGIN")
    c.execute("SELECT outbox.publish('log.r', '{}')")
    c.execute("ROLLBACK")
    c.execute("BEGIN")
    kept = c.execute("SELECT outbox.publish('log.r', '{}', 's1')").fetchone()[0]
    c.execute("SAVEPOINT sp")
    c.execute("SELECT outbox.publish('log.r', '{}', 's2')")
    c.execute("SELECT * FROM outbox.publish_batch('log.r', ARRAY['{}', '{}']::jsonb[])")
    c.execute("ROLLBACK TO SAVEPOINT sp")
    c.execute("SAVEPOINT sp2")
    inner = c.execute("SELECT outbox.publish('log.r', '{}', 's3')").fetchone()[0]
    c.execute("RELEASE SAVEPOINT sp2")
    top = c.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]
    c.execute("COMMIT")
    rows = log_rows(logdb)
    assert [r[0] for r in rows] == [kept, inner] == event_ids(logdb)
    # A subtransaction's event carries the top-level id (what snapshots list).
    assert {r[1] for r in rows} == {top}

    if logdb.one("SHOW max_prepared_transactions")[0] == "0":
        pytest.skip("max_prepared_transactions = 0")
    c.execute("SET outbox.notify = off")  # a NOTIFY cannot be prepared
    for gid, finish in (("log-2pc-a", "COMMIT PREPARED"), ("log-2pc-b", "ROLLBACK PREPARED")):
        before = len(log_rows(logdb))
        c.execute("BEGIN")
        c.execute("SELECT outbox.publish('log.2pc', %s::jsonb)", (f'{{"gid": "{gid}"}}',))
        c.execute(f"PREPARE TRANSACTION '{gid}'")
        try:
            assert len(log_rows(logdb)) == before  # not visible while prepared
        finally:
            c.execute(f"{finish} '{gid}'")
    rows = log_rows(logdb)
    assert [r[6] for r in rows if r[3] == "log.2pc"] == ['{"gid": "log-2pc-a"}']
    assert [r[0] for r in rows] == event_ids(logdb)


def test_every_publish_is_logged_whatever_the_role(logdb):
    """The log is always written, whether or not a subscription exists: one
    created while a publisher's transaction is open must find its events there."""
    c = logdb.conn()
    first = c.execute("SELECT outbox.publish('log.off', '{}')").fetchone()[0]
    c.execute("DROP ROLE IF EXISTS log_test_user")
    c.execute("CREATE ROLE log_test_user")
    c.execute("GRANT outbox_publisher TO log_test_user")
    try:
        c.execute("SET ROLE log_test_user")
        got = c.execute("SELECT outbox.publish('log.role', '{}')").fetchone()[0]
        c.execute("RESET ROLE")
        assert [r[0] for r in log_rows(logdb)] == [first, got]
    finally:
        c.execute("RESET ROLE")
        c.execute("DROP OWNED BY log_test_user")
        c.execute("DROP ROLE log_test_user")


def test_a_subject_keeps_one_lane_and_plain_events_go_in_runs_of_64(logdb):
    c = logging_conn(logdb)
    for i in range(3):
        for s in ("order:1", "order:2", "user:äö", None):
            c.execute("SELECT outbox.publish(%s, '{}', %s)", (f"log.t{i}", s))
    c.execute("SELECT * FROM outbox.publish_batch('log.many', array_fill('{}'::jsonb, ARRAY[200]))")
    rows = logdb.all(" UNION ALL ".join(f"SELECT id, lane, subject, hashtext(subject) & 15 FROM {t}" for t in RING))
    assert len(rows) == 212
    for id_, lane, subject, sql_lane in rows:
        assert 0 <= lane < 16
        if subject is None:
            assert lane == (id_ // 64) % 16
        else:
            assert lane == sql_lane, subject
    by_subject = {}
    for _, lane, subject, _ in rows:
        if subject is not None:
            by_subject.setdefault(subject, set()).add(lane)
    assert all(len(v) == 1 for v in by_subject.values())


def test_a_read_only_transaction_gets_25006_and_writes_nothing(logdb):
    c = logging_conn(logdb)
    c.execute("BEGIN READ ONLY")
    assert sqlstate(c, "SELECT outbox.publish('log.ro', '{}')") == "25006"
    c.execute("ROLLBACK")
    c.execute("BEGIN READ ONLY")
    assert sqlstate(c, "SELECT * FROM outbox.publish_batch('log.ro', ARRAY['{}']::jsonb[])") == "25006"
    c.execute("ROLLBACK")
    assert log_rows(logdb) == []


def test_publish_has_its_transaction_id_before_it_draws_an_event_id(logdb):
    """Invariant 2 of src/log/mod.rs. A session holding the log table's lock
    makes a publisher wait where it opens the table to insert, after it drew its
    event id: it must already have its transaction id (the insert alone would
    assign it only after the wait)."""
    locker, pub, watch = logdb.conn(), logging_conn(logdb), logdb.conn()
    pub.execute("SELECT outbox.publish('log.order', '{}')")  # caches warm: no statement runs below
    pid = pub.execute("SELECT pg_backend_pid()").fetchone()[0]
    before = watch.execute("SELECT last_value FROM outbox.event_id_seq").fetchone()[0]
    locker.execute("BEGIN")
    locker.execute("LOCK TABLE outbox.log_0 IN ACCESS EXCLUSIVE MODE")
    result = []
    t = threading.Thread(target=lambda: result.append(
        pub.execute("SELECT outbox.publish('log.order', '{}')").fetchone()[0]))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            row = watch.execute("SELECT wait_event_type, backend_xid::text FROM pg_stat_activity WHERE pid = %s",
                                (pid,)).fetchone()
            if row[0] == "Lock" or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert row[0] == "Lock", "the publisher never waited for the table lock"
        drawn = watch.execute("SELECT last_value FROM outbox.event_id_seq").fetchone()[0]
        assert drawn == before + 1, "the publisher waited before drawing its id"
        assert row[1] is not None, "waiting with an event id drawn but no transaction id"
    finally:
        locker.execute("COMMIT")
        t.join(10)
    assert result == [before + 1]
    assert [r[0] for r in log_rows(logdb)][-1] == before + 1


def state(logdb):
    return logdb.all("SELECT n, sealed_at IS NOT NULL FROM outbox.log_state ORDER BY n")


def test_rotation_seals_opens_and_truncates_past_retention(logdb):
    c, admin = logging_conn(logdb), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    c.execute("SELECT outbox.publish('log.rot', '{}')")
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 1
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
    assert state(logdb) == [(0, False)]                 # first run records log_0 as open
    admin.execute("SELECT outbox._log_rotate()")
    assert state(logdb) == [(0, True), (1, False)]      # sealed, and log_1 opened
    # The publisher's cached table follows the rotation at its next call.
    second = c.execute("SELECT outbox.publish('log.rot', '{}')").fetchone()[0]
    assert logdb.all("SELECT id FROM outbox.log_1") == [(second,)]
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 1
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 0
    assert state(logdb) == [(1, False)]                 # a truncation ends the call
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
    assert state(logdb) == [(1, True), (2, False)]
    # With the default retention nothing is sealed or truncated early.
    admin.execute("RESET outbox.retention_delivered")
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
    assert state(logdb) == [(1, True), (2, False)]
    assert logdb.one("SELECT count(*) FROM outbox.log_1")[0] == 1


def test_rotation_never_waits_for_a_table_in_use_and_publishers_never_wait_for_it(logdb):
    """A reader idles in a transaction holding a lock on the sealed table: the
    truncation is skipped at once (NOWAIT), no lock request is left queued, so
    a publisher behind it is not blocked; the next run truncates."""
    c, admin, reader = logging_conn(logdb), logdb.conn(), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    admin.execute("SELECT outbox._log_rotate()")     # log_0 open
    c.execute("SELECT outbox.publish('log.busy', '{}')")
    admin.execute("SELECT outbox._log_rotate()")     # log_0 sealed, log_1 open
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM outbox.log_0")
    t0 = time.monotonic()
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
    assert time.monotonic() - t0 < 2
    assert logdb.one("SELECT count(*) FROM pg_locks WHERE NOT granted")[0] == 0
    # Another session still appends (to log_1) and reads log_0 without waiting.
    other = logging_conn(logdb)
    other.execute("SET lock_timeout = '2s'")
    other.execute("SELECT outbox.publish('log.busy', '{}')")
    assert other.execute("SELECT count(*) FROM outbox.log_0").fetchone()[0] == 1
    reader.execute("COMMIT")
    # log_0 now, then log_1 (sealed by the run above): one table per call.
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 1
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 0
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 1
    assert logdb.one("SELECT count(*) FROM outbox.log_1")[0] == 0


def test_two_rotations_at_once_do_not_wait_for_each_other(logdb):
    a, b = logdb.conn(), logdb.conn()
    for x in (a, b):
        x.execute("SET outbox.retention_delivered = 0")
    a.execute("BEGIN")
    a.execute("SELECT outbox._log_rotate()")
    t0 = time.monotonic()
    assert b.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
    assert time.monotonic() - t0 < 2
    a.execute("COMMIT")
    assert state(logdb) == [(0, False)]


def test_the_rotation_that_finds_the_next_table_in_use_keeps_writing_the_open_one(logdb):
    """The ring is full when the next table is still sealed (not past its
    retention): the open table keeps taking events rather than overwrite one."""
    c, admin = logging_conn(logdb), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    for _ in range(4):  # log_0 opened, sealed, truncated; log_1 sealed
        admin.execute("SELECT outbox._log_rotate()")
    assert state(logdb) == [(1, True), (2, False)]
    # log_3 sealed just now, log_2 open for a day, retention 1 h: log_3 is not
    # free, so log_2 stays open and nothing is truncated.
    admin.execute("INSERT INTO outbox.log_state VALUES (3, now(), now(), pg_current_snapshot())")
    admin.execute("UPDATE outbox.log_state SET opened_at = now() - interval '1 day' WHERE n = 2")
    admin.execute("UPDATE outbox.log_state SET opened_at = now(), sealed_at = now() WHERE n = 1")
    admin.execute("SET outbox.retention_delivered = '1h'")
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
    assert state(logdb) == [(1, True), (2, False), (3, True)]
    got = c.execute("SELECT outbox.publish('log.full', '{}')").fetchone()[0]
    assert logdb.all("SELECT id FROM outbox.log_2") == [(got,)]


def test_run_maintenance_runs_the_log_step(logdb):
    c = logging_conn(logdb)
    c.execute("SELECT outbox.publish('log.m', '{}')")
    c.execute("SET outbox.retention_delivered = 0")
    c.execute("CALL outbox.run_maintenance()")
    assert state(logdb) == [(0, False)]
    c.execute("CALL outbox.run_maintenance()")
    assert state(logdb) == [(0, True), (1, False)]


def test_an_altered_ring_table_is_written_through_sql(logdb):
    """A trigger on a ring table rules the direct heap path out: publish then
    uses its INSERT statement, so the trigger fires and the row is the same."""
    c = logging_conn(logdb)
    c.execute("CREATE TABLE public.log_seen (id bigint)")
    c.execute("CREATE FUNCTION public.log_seen_f() RETURNS trigger LANGUAGE plpgsql AS "
              "$$ BEGIN INSERT INTO public.log_seen VALUES (NEW.id); RETURN NEW; END $$")
    c.execute("CREATE TRIGGER seen AFTER INSERT ON outbox.log_0 FOR EACH ROW EXECUTE FUNCTION public.log_seen_f()")
    try:
        a = c.execute("SELECT outbox.publish('log.trg', '{\"a\": 1}', 'x')").fetchone()[0]
        b = [r[0] for r in c.execute(
            "SELECT * FROM outbox.publish_batch('log.trg', ARRAY['{}', '{}']::jsonb[])").fetchall()]
        assert [r[0] for r in c.execute("SELECT id FROM public.log_seen ORDER BY id").fetchall()] == [a, *b]
        rows = log_rows(logdb)
        assert [r[0] for r in rows] == [a, *b]
        assert (rows[0][2], rows[0][4], rows[0][6]) == (logdb.one("SELECT hashtext('x') & 15")[0], "x", '{"a": 1}')
    finally:
        c.execute("DROP TRIGGER seen ON outbox.log_0")
        c.execute("DROP FUNCTION public.log_seen_f()")
        c.execute("DROP TABLE public.log_seen")


def test_concurrent_publishers_log_exactly_the_committed_events(logdb):
    """Eight sessions publish with and without subjects, a third of their
    transactions rolled back and some savepoints undone; the log then holds
    exactly the committed events, each once, with its own transaction's id."""
    errors = []

    def run(k):
        try:
            c = logging_conn(logdb)
            for i in range(40):
                c.execute("BEGIN")
                c.execute("SELECT outbox.publish('log.c', '{}', %s)", (f"s{i % 5}" if k % 2 else None,))
                if i % 4 == 0:
                    c.execute("SAVEPOINT sp")
                    c.execute("SELECT * FROM outbox.publish_batch('log.c', ARRAY['{}', '{}']::jsonb[])")
                    c.execute("ROLLBACK TO SAVEPOINT sp")
                c.execute("ROLLBACK" if i % 3 == 0 else "COMMIT")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    rows = log_rows(logdb)
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids)) == 8 * 26
    assert ids == event_ids(logdb)


def test_retention_keeps_a_table_until_every_reader_has_passed_it(logdb):
    """A reader (log lanes of a subscription) whose cursor has not seen log_0's
    events keeps log_0 from being truncated, however old; once its lanes have
    read past them, the next run truncates it."""
    c, admin = logging_conn(logdb), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    c.execute("SELECT outbox.create_subscription('slow')")
    ids = [r[0] for r in c.execute("SELECT * FROM outbox.publish_batch('log.keep', ARRAY['{}', '{}']::jsonb[])")]
    admin.execute("SELECT outbox._log_rotate()")     # log_0 recorded as open
    admin.execute("SELECT outbox._log_rotate()")     # sealed, log_1 open
    assert admin.execute("SELECT outbox._log_readers_passed(0::smallint)").fetchone()[0] is False
    for _ in range(3):
        admin.execute("SELECT outbox._log_rotate()")  # empty tables come and go
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 2
    # The ring is not overwritten either: log_2, log_3 may open, log_0 may not.
    assert (0, True) in state(logdb)
    # The reader takes and acks them; its lanes then move past log_0.
    claim = "SELECT id, lease_token FROM outbox.claim('w', 10, subscription => 'slow')"
    rows = c.execute(claim).fetchall()
    assert sorted(r[0] for r in rows) == ids
    c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([r[0] for r in rows], [r[1] for r in rows]))
    assert c.execute(claim).fetchall() == []
    assert admin.execute("SELECT outbox._log_readers_passed(0::smallint)").fetchone()[0] is True
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] >= 1
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 0


def test_a_write_after_the_seal_restarts_the_tables_retention(logdb):
    """A transaction open across the seal may still append to the sealed table
    (a publisher's copy of the state can be older than the seal). Once it
    commits, the table's retention starts again instead of truncating its rows.
    The stray row is written by hand here, as such a publisher would."""
    c, admin = logdb.conn(), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    admin.execute("SELECT outbox._log_rotate()")     # log_0 open
    c.execute("BEGIN")
    c.execute("INSERT INTO outbox.log_0 (id, txid, lane, topic, payload, max_attempts, published_at) "
              "VALUES (-1, pg_current_xact_id(), 0, 'log.seal', '{}', 1, now())")
    admin.execute("SELECT outbox._log_rotate()")     # log_0 sealed while c is open
    assert state(logdb) == [(0, True), (1, False)]
    c.execute("COMMIT")
    admin.execute("SELECT outbox._log_rotate()")     # written since the seal: sealed again, kept
    assert logdb.all("SELECT id FROM outbox.log_0") == [(-1,)]
    assert state(logdb)[0] == (0, True)
    admin.execute("SELECT outbox._log_rotate()")     # nothing new since: truncated
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 0


def test_rotation_does_nothing_outside_read_committed(logdb):
    """Its checks must see every committed row; a REPEATABLE READ or
    SERIALIZABLE snapshot may not, so there it leaves the ring alone."""
    admin = logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    admin.execute("SELECT outbox._log_rotate()")     # log_0 open
    for level in ("REPEATABLE READ", "SERIALIZABLE"):
        admin.execute(f"BEGIN ISOLATION LEVEL {level}")
        assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0
        admin.execute("COMMIT")
        assert state(logdb) == [(0, False)]
    admin.execute("SELECT outbox._log_rotate()")
    assert state(logdb) == [(0, True), (1, False)]


def drain(c, sub):
    """Claim and ack everything `sub` is owed now; the ids, in claim order."""
    got = []
    while rows := c.execute("SELECT id, lease_token FROM outbox.claim('w', 100, subscription => %s)",
                            (sub,)).fetchall():
        c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([r[0] for r in rows], [r[1] for r in rows]))
        got += [r[0] for r in rows]
    return got


def publish_two(c, topic):
    return [r[0] for r in c.execute("SELECT * FROM outbox.publish_batch(%s, ARRAY['{}', '{}']::jsonb[])", (topic,))]


@pytest.mark.parametrize("start", ["now", "earliest"])
def test_an_uncommitted_create_subscription_holds_the_ring_tables_it_will_read(logdb, start):
    """Issue 40, item 5. A subscription's start cursor is taken when
    create_subscription runs, but its lanes are seen by retention only once it
    commits. Meanwhile an event committed after the cursor (and, with
    'earliest', every event the log holds) is owed to it: the ring table that
    holds it must not be truncated, however many maintenance runs pass, even
    when every committed reader has read it."""
    c, admin, creator = logging_conn(logdb), logdb.conn(), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    c.execute("SELECT outbox.create_subscription('early')")
    admin.execute("SELECT outbox._log_rotate()")             # log_0 recorded as open
    before = publish_two(c, "log.late")
    creator.execute("BEGIN")
    creator.execute("SELECT outbox.create_subscription('late', start => %s)", (start,))
    after = publish_two(c, "log.late")                      # committed after late's cursor
    assert sorted(drain(c, "early")) == before + after      # no committed reader holds log_0 now
    # Runs until log_0 is sealed and would be truncated, and then some.
    for _ in range(3):
        admin.execute("CALL outbox.run_maintenance()")
    kept = logdb.one("SELECT count(*) FROM outbox.log_0")[0]
    creator.execute("COMMIT")
    owed = after if start == "now" else before + after
    got = drain(c, "late")
    lost = logdb.one("SELECT lost_events FROM outbox.subscriptions WHERE name = 'late'")[0]
    assert sorted(got) == sorted(owed), (
        f"'late' (start {start!r}) claimed {got} of the {owed} owed to it; log_0 kept {kept} of 4 events, "
        f"lost_events {lost}")
    # Once it has read them, the next run lets the table go.
    admin.execute("CALL outbox.run_maintenance()")
    assert logdb.one("SELECT count(*) FROM outbox.log_0")[0] == 0


def due_tables(logdb, c, admin):
    """log_0 and log_1 sealed past retention (0) with one event each, log_2
    open; the caller has SET outbox.retention_delivered = 0 on admin. A reader
    holds log_0 while log_1 is sealed, so that both are due at once."""
    reader = logdb.conn()
    admin.execute("SELECT outbox._log_rotate()")             # log_0 open
    a = c.execute("SELECT outbox.publish('log.due', '{}')").fetchone()[0]
    admin.execute("SELECT outbox._log_rotate()")             # log_0 sealed, log_1 open
    b = c.execute("SELECT outbox.publish('log.due', '{}')").fetchone()[0]
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM outbox.log_0")
    assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] == 0   # log_0 in use; log_1 sealed
    reader.execute("COMMIT")
    assert state(logdb) == [(0, True), (1, True), (2, False)]
    assert logdb.all("SELECT ring, id FROM outbox.log ORDER BY id") == [(0, a), (1, b)]


def ring_locks(watch, pid):
    """The ring tables session `pid` holds ACCESS EXCLUSIVE locks on."""
    return [r[0] for r in watch.execute(
        "SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        " WHERE l.pid = %s AND l.mode = 'AccessExclusiveLock' AND l.granted "
        "   AND c.relnamespace = 'outbox'::regnamespace AND c.relname ~ '^log_[0-3]$' ORDER BY 1", (pid,)).fetchall()]


def test_a_log_step_truncates_one_table_and_its_lock_goes_with_its_commit(logdb):
    """Issue 40, item 6. Claims wait on another session only for retention's
    TRUNCATE lock, at most 20 ms per table and released before the next table:
    one call of the step truncates one table, holds the lock of that one only,
    and says there is more; its caller commits before it calls again."""
    c, admin, watch = logging_conn(logdb), logdb.conn(), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    due_tables(logdb, c, admin)
    pid = admin.execute("SELECT pg_backend_pid()").fetchone()[0]
    step = "SELECT removed, done FROM outbox._maintenance_step('log')"
    admin.execute("BEGIN")
    first = admin.execute(step).fetchone()
    held = ring_locks(watch, pid)
    admin.execute("COMMIT")
    assert (first, held) == ((1, False), ["log_0"]), (
        f"one step call returned (removed, done) = {first} holding ACCESS EXCLUSIVE on {held}")
    assert ring_locks(watch, pid) == []
    rest = []
    while not rest or not rest[-1][1]:
        admin.execute("BEGIN")
        rest.append(admin.execute(step).fetchone())
        assert len(ring_locks(watch, pid)) <= 1
        admin.execute("COMMIT")
        assert len(rest) < 10, rest
    # log_1 next, then the rotation: log_2 sealed, log_3 opened.
    assert rest == [(1, False), (0, True)]
    assert logdb.one("SELECT count(*) FROM outbox.log")[0] == 0
    assert state(logdb) == [(2, True), (3, False)]


def test_run_maintenance_empties_every_due_ring_table(logdb):
    """The procedure calls the step until it is done, committing in between."""
    c, admin = logging_conn(logdb), logdb.conn()
    admin.execute("SET outbox.retention_delivered = 0")
    due_tables(logdb, c, admin)
    admin.execute("CALL outbox.run_maintenance()")
    assert logdb.one("SELECT count(*) FROM outbox.log")[0] == 0
    assert state(logdb) == [(2, True), (3, False)]
