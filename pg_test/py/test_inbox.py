"""The inbox (outbox.inbox_receive) and the outbox's identity (outbox.outbox_id),
0.11.0. Real connections: commits, rollbacks, savepoints and concurrent
duplicates are what the inbox is for."""

import threading
import time

import psycopg
import pytest

from conftest import connect
from scratch_db import create_db, drop_db

DB = "outbox_t_inbox"


@pytest.fixture
def db(plain_dsn):
    dsn = create_db(plain_dsn, DB)
    yield dsn
    drop_db(plain_dsn, DB)


def receive(c, consumer, mid):
    return c.execute("SELECT outbox.inbox_receive(%s, %s)", (consumer, mid)).fetchone()[0]


def test_first_time_true_then_false_per_consumer(db):
    with connect(db) as c:
        assert receive(c, "billing", "m-1") is True
        assert receive(c, "billing", "m-1") is False
        # Another consumer has its own set of ids.
        assert receive(c, "mailer", "m-1") is True
        assert receive(c, "billing", "m-2") is True
        assert c.execute("SELECT count(*) FROM outbox.inbox").fetchone()[0] == 3


def test_rollback_forgets_the_message(db):
    with connect(db, autocommit=False) as c:
        assert receive(c, "k", "m") is True
        c.rollback()
        assert receive(c, "k", "m") is True
        c.commit()
        assert receive(c, "k", "m") is False
        c.rollback()


def test_rollback_to_savepoint_forgets_the_message(db):
    with connect(db, autocommit=False) as c:
        c.execute("SAVEPOINT s")
        assert receive(c, "k", "m") is True
        c.execute("ROLLBACK TO SAVEPOINT s")
        assert receive(c, "k", "m") is True
        c.commit()
    with connect(db) as c:
        assert receive(c, "k", "m") is False


@pytest.mark.parametrize("first_commits", [True, False])
def test_concurrent_duplicate_waits_for_the_first(db, first_commits):
    first = connect(db, autocommit=False)
    try:
        assert receive(first, "k", "dup") is True
        got = {}

        def second():
            with connect(db, autocommit=False) as c:
                t0 = time.monotonic()
                got["value"] = receive(c, "k", "dup")
                got["waited"] = time.monotonic() - t0
                c.commit()

        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.5)
        assert t.is_alive(), "the duplicate did not wait for the first transaction"
        if first_commits:
            first.commit()
        else:
            first.rollback()
        t.join(10)
        assert not t.is_alive()
        assert got["waited"] >= 0.4
        # A duplicate of a committed receipt is refused; after a rollback the
        # waiting transaction is the first.
        assert got["value"] is (not first_commits)
    finally:
        first.close()
    with connect(db) as c:
        assert c.execute("SELECT count(*) FROM outbox.inbox WHERE message_id = 'dup'").fetchone()[0] == 1


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_concurrent_duplicate_at_snapshot_isolation_raises_40001(db, level):
    first = connect(db, autocommit=False)
    second = connect(db, autocommit=False)
    try:
        second.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        second.execute("SELECT 1")  # take the snapshot before the first commits
        assert receive(first, "k", "rr") is True
        first.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            receive(second, "k", "rr")
        second.rollback()
        # Retried, it sees the first one's receipt.
        second.execute(f"SET TRANSACTION ISOLATION LEVEL {level}")
        assert receive(second, "k", "rr") is False
        second.commit()
    finally:
        first.close()
        second.close()


def test_exactly_once_effects_under_redelivery(db):
    """The pattern the inbox exists for: effects applied once, whatever the
    number of deliveries and whichever attempts roll back."""
    with connect(db) as c:
        c.execute("CREATE TABLE effects (message_id text PRIMARY KEY, n int)")
    deliveries = [f"m-{i % 50}" for i in range(400)]  # each message 8 times
    with connect(db, autocommit=False) as c:
        for k, mid in enumerate(deliveries):
            if receive(c, "fx", mid):
                c.execute("INSERT INTO effects VALUES (%s, 1)", (mid,))
            if k % 7 == 3:
                c.rollback()  # a crashed consumer: neither the receipt nor the effect
            else:
                c.commit()
    with connect(db) as c:
        rows = c.execute("SELECT count(*), sum(n) FROM effects").fetchone()
        assert rows == (50, 50)
        assert c.execute("SELECT count(*) FROM outbox.inbox WHERE consumer = 'fx'").fetchone()[0] == 50


def test_retention_purges_old_receipts(db):
    with connect(db) as c:
        c.execute("SELECT outbox.backoff_delay(1)")  # load the library (settings)
        for i in range(5):
            receive(c, "r", f"old-{i}")
        receive(c, "r", "new")
        c.execute("UPDATE outbox.inbox SET received_at = now() - interval '8 days' WHERE message_id LIKE 'old-%'")
        assert c.execute("SELECT outbox._purge_step('inbox', NULL, 2)").fetchone()[0] == 2
        c.execute("CALL outbox.run_maintenance()")
        assert [r[0] for r in c.execute("SELECT message_id FROM outbox.inbox").fetchall()] == ["new"]
        # A purged message is received again (the documented window).
        assert receive(c, "r", "old-1") is True
        c.execute("SET outbox.retention_inbox = '1h'")
        c.execute("UPDATE outbox.inbox SET received_at = now() - interval '2 hours' WHERE message_id = 'new'")
        c.execute("CALL outbox.run_maintenance()")
        assert [r[0] for r in c.execute("SELECT message_id FROM outbox.inbox").fetchall()] == ["old-1"]


def test_worker_role_may_receive_and_read_the_id(db):
    with connect(db) as c:
        c.execute("DROP ROLE IF EXISTS outbox_t_inbox_w")
        c.execute("CREATE ROLE outbox_t_inbox_w LOGIN IN ROLE outbox_worker")
        try:
            c.execute("SET ROLE outbox_t_inbox_w")
            assert receive(c, "w", "m") is True
            assert c.execute("SELECT outbox.outbox_id()").fetchone()[0] is not None
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute("SELECT * FROM outbox.inbox")
            c.execute("RESET ROLE")
        finally:
            c.execute("RESET ROLE")
            c.execute("DROP OWNED BY outbox_t_inbox_w")
            c.execute("DROP ROLE outbox_t_inbox_w")


def test_outbox_id_is_stable_and_distinct_per_database(db, plain_dsn):
    with connect(db) as c:
        a = c.execute("SELECT outbox.outbox_id()").fetchone()[0]
        assert c.execute("SELECT outbox.outbox_id()").fetchone()[0] == a
        assert c.execute("SELECT count(*) FROM outbox.identity").fetchone()[0] == 1
    other = create_db(plain_dsn, DB + "_b")
    try:
        with connect(other) as c:
            assert c.execute("SELECT outbox.outbox_id()").fetchone()[0] != a
    finally:
        drop_db(plain_dsn, DB + "_b")
