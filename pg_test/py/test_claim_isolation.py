"""Isolation levels of the worker calls (src/claim.rs): claim refuses
SERIALIZABLE with 0A000 before it reads or writes anything, and works at READ
COMMITTED and REPEATABLE READ; ack, fail and extend_lease stay allowed at
SERIALIZABLE."""

import psycopg
import pytest

from conftest import connect


def claim(c, n=10):
    return c.execute("SELECT id, lease_token FROM outbox.claim('w', %s)", (n,)).fetchall()


def refusal(c, sql):
    with pytest.raises(psycopg.Error) as ei:
        c.execute(sql)
    return ei.value


def untouched(c):
    """What a claim changes: the lanes, batches, rows of their own and the
    subscription's activity note."""
    return c.execute(
        "SELECT (SELECT coalesce(string_agg(l::text, ',' ORDER BY l.lane), '') FROM outbox.log_lanes l), "
        "(SELECT count(*) FROM outbox.log_batches), (SELECT count(*) FROM outbox.log_exceptions), "
        "(SELECT last_claim_at FROM outbox.subscription_activity WHERE name = 'default')").fetchone()


def check_refused(err):
    assert err.sqlstate == "0A000", f"{err.sqlstate}: {err.diag.message_primary}"
    assert "SERIALIZABLE" in err.diag.message_primary and "READ COMMITTED" in err.diag.message_primary
    assert "SET TRANSACTION ISOLATION LEVEL READ COMMITTED" in (err.diag.message_hint or "")


def test_a_claim_in_a_serializable_transaction_is_refused_before_anything(plain):
    c, other = plain.conn(), plain.conn()
    c.execute("SELECT outbox.publish('iso.t', '{}', subject => 's')")
    before = untouched(other)
    c.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
    check_refused(refusal(c, "SELECT * FROM outbox.claim('w', 10)"))
    c.execute("ROLLBACK")
    # Before the other arguments are checked, too.
    c.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
    check_refused(refusal(c, "SELECT * FROM outbox.claim('', 0, topics => ARRAY['BAD'])"))
    c.execute("ROLLBACK")
    assert untouched(other) == before
    # The hint's remedy works.
    c.execute("BEGIN")
    c.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
    assert len(claim(c)) == 1
    c.execute("COMMIT")


def test_a_claim_under_a_serializable_default_is_refused(plain):
    c = plain.conn()
    c.execute("SELECT outbox.publish('iso.t', '{}')")
    c.execute("SET default_transaction_isolation = 'serializable'")
    check_refused(refusal(c, "SELECT * FROM outbox.claim('w', 10)"))  # autocommit
    # A database's default, as an application's database may have it.
    opts = psycopg.conninfo.make_conninfo(plain.dsn, options="-c default_transaction_isolation=serializable")
    with connect(opts) as s:
        check_refused(refusal(s, "SELECT * FROM outbox.claim('w', 10)"))
    c.execute("RESET default_transaction_isolation")
    assert len(claim(c)) == 1


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
def test_claim_ack_fail_extend_work_at_read_committed_and_repeatable_read(plain, isolation):
    c = plain.conn()
    for s in ("a", "b", "c"):
        c.execute("SELECT outbox.publish('iso.t', '{}', subject => %s)", (s,))
    c.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    (a, ta), (b, tb), (x, tx) = claim(c)
    assert c.execute("SELECT outbox.extend_lease(%s, %s, '1 min')", (a, ta)).fetchone()[0] is not None
    assert c.execute("SELECT outbox.ack(%s, %s)", (a, ta)).fetchone()[0] is True
    assert c.execute("SELECT outbox.fail(%s, %s, 'x')", (b, tb)).fetchone()[0] == "pending"
    c.execute("COMMIT")
    c.execute(f"SET default_transaction_isolation = '{isolation.lower()}'")
    assert c.execute("SELECT outbox.ack(%s, %s)", (x, tx)).fetchone()[0] is True


def test_ack_fail_extend_stay_allowed_at_serializable(plain):
    """Only claim is refused: a worker whose acks run at SERIALIZABLE retries on
    40001 like any serializable transaction, and is never refused."""
    c, s = plain.conn(), plain.conn()
    for subj in ("a", "b"):
        c.execute("SELECT outbox.publish('iso.t', '{}', subject => %s)", (subj,))
    (a, ta), (b, tb) = claim(c)
    s.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
    assert s.execute("SELECT outbox.extend_lease(%s, %s, '1 min')", (a, ta)).fetchone()[0] is not None
    assert s.execute("SELECT outbox.ack(%s, %s)", (a, ta)).fetchone()[0] is True
    assert s.execute("SELECT outbox.fail(%s, %s, 'x', permanent => true)", (b, tb)).fetchone()[0] == "dead"
    s.execute("COMMIT")
    assert c.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' "
                     "AND state IN ('delivered', 'dead')").fetchone()[0] == 2
