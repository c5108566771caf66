"""The worker contract of 1.0 (README, "Workers"; docs/design/claims-1.0.md),
one test per rule, each through the public API with real connections.

Issue 40 measured each of these failing on 0.16.0; every test here failed on
the build before its fix."""

import psycopg
import pytest

from conftest import connect

CLAIM = "SELECT id, subject, lease_token, lease_expires_at FROM outbox.claim('w', %s, %s::interval)"


def publish(c, n, subject=None, topic="t"):
    return [
        c.execute("SELECT outbox.publish(%s, '{}'::jsonb, subject => %s)", (topic, subject)).fetchone()[0]
        for _ in range(n)
    ]


def lease_expiry(c, event_id):
    return c.execute(
        "SELECT lease_expires_at FROM outbox.deliveries WHERE event_id = %s AND subscription = 'default'",
        (event_id,),
    ).fetchone()[0]


# Rule 2: every event handed out has its own lease token.


def test_each_event_of_a_claim_has_its_own_token(plain):
    c = plain.conn()
    publish(c, 10)
    rows = c.execute(CLAIM, (10, "1 min")).fetchall()
    assert len(rows) == 10
    assert len({r[2] for r in rows}) == 10, "events of one claim share a lease token"


def test_each_row_of_its_own_claimed_together_has_its_own_token(plain):
    c = plain.conn()
    publish(c, 4)
    first = c.execute(CLAIM, (4, "1 min")).fetchall()
    for i, _, tok, _ in first:  # each gets a row of its own, due at once
        assert c.execute("SELECT outbox.fail(%s, %s, 'x', '0 s')", (i, tok)).fetchone()[0] == "pending"
    again = c.execute(CLAIM, (4, "1 min")).fetchall()
    assert sorted(r[0] for r in again) == sorted(r[0] for r in first)
    assert len({r[2] for r in again}) == 4, "rows of their own claimed together share a lease token"


def test_extend_lease_extends_that_event_alone(plain):
    c = plain.conn()
    publish(c, 10)
    rows = c.execute(CLAIM, (10, "1 min")).fetchall()
    (i, _, tok, _), neighbour = rows[0], rows[1]
    before = lease_expiry(c, neighbour[0])
    until = c.execute("SELECT outbox.extend_lease(%s, %s, '1 hour')", (i, tok)).fetchone()[0]
    assert until is not None and lease_expiry(c, i) == until
    assert lease_expiry(c, neighbour[0]) == before, "extend_lease of one event extended its neighbour"
    # Still each event's own: the neighbour acks with its token, the extended one with its.
    assert c.execute("SELECT outbox.ack(%s, %s)", (neighbour[0], neighbour[2])).fetchone()[0] is True
    assert c.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0] is True


def test_a_token_acks_only_its_own_event(plain):
    c = plain.conn()
    publish(c, 3)
    rows = c.execute(CLAIM, (3, "1 min")).fetchall()
    a, b = rows[0], rows[1]
    assert c.execute("SELECT outbox.ack(%s, %s)", (b[0], a[2])).fetchone()[0] is False
    assert c.execute("SELECT outbox.fail(%s, %s, 'x')", (b[0], a[2])).fetchone()[0] == "stale"
    assert c.execute("SELECT outbox.extend_lease(%s, %s, '1 min')", (b[0], a[2])).fetchone()[0] is None
    assert c.execute("SELECT outbox.ack(%s, %s)", (b[0], b[2])).fetchone()[0] is True
