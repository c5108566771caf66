"""Monitoring: outbox.health() checks and outbox.stats counts."""

import time

import pytest

from conftest import connect
from scratch_db import ensure_login_role, role_dsn

CHECKS = {"handshake", "backlog_age", "dead_letters", "expired_leases", "xmin_horizon", "dead_tuples", "id_sequence", "background_worker",
          "subscription", "default_subscription", "log_ring"}
STATUSES = {"ok", "warn", "critical"}


def health(conn, **kw):
    args = ", ".join(f"{k} => %({k})s" for k in kw)
    rows = conn.execute(f"SELECT check_name, status, value, message FROM outbox.health({args})", kw).fetchall()
    for name, status, _value, message in rows:
        assert name in CHECKS and status in STATUSES and message, (name, status, message)
    return {r[0]: r[1:] for r in rows}


def make_states(c, topic, sub=None):
    """ready x2, scheduled, leased, expired lease, dead, delivered, cancelled,
    for subscription `sub` (None: the default)."""
    c.execute("SELECT outbox.publish_batch(%s, array_fill('{}'::jsonb, ARRAY[7]))", (topic,))
    c.execute("SELECT outbox.publish(%s, '{}', deliver_at => now() + interval '1 hour')", (topic,))
    rows = c.execute("SELECT id, lease_token FROM outbox.claim('h', 4, '10 min', ARRAY[%s], %s)", (topic, sub)).fetchall()
    assert len(rows) == 4
    c.execute("SELECT outbox.ack(%s, %s)", rows[0])
    c.execute("SELECT outbox.fail(%s, %s, 'x', permanent => true)", rows[1])
    c.execute("SELECT outbox.fail(%s, %s, 'x', '1 hour')", rows[2])
    c.execute("SELECT outbox.cancel(%s, %s)", (rows[2][0], sub))
    # rows[3] stays leased; one more with a lease that runs out at once
    (i, _tok) = c.execute("SELECT id, lease_token FROM outbox.claim('h', 1, '1 ms', ARRAY[%s], %s)",
                          (topic, sub)).fetchone()
    return i


def test_health_on_an_empty_outbox(plain):
    c = plain.conn()
    h = health(c)
    assert set(h) == CHECKS
    for name in ("backlog_age", "dead_letters", "expired_leases", "dead_tuples"):
        assert h[name][0] == "ok", (name, h[name])
    assert h["backlog_age"][1] == 0 and h["dead_letters"][1] == 0 and h["expired_leases"][1] == 0
    # Without preload: a warning that says what to do instead.
    assert h["background_worker"][0] == "warn"
    assert "shared_preload_libraries" in h["background_worker"][2]


def test_health_background_worker_ok_when_preloaded(preload):
    c = preload.conn()
    pid = c.execute("SELECT worker_pid FROM outbox.wakeup_status()").fetchone()[0]
    h = health(c)
    assert set(h) == CHECKS
    assert h["background_worker"][0] == "ok" and h["background_worker"][1] == pid


@pytest.mark.parametrize("sub", [None, "hl_log"])
def test_health_reports_backlog_dead_letters_and_expired_leases(plain, sub):
    """The same counts for 'default' and for a named subscription, with no
    other subscription to count."""
    c = plain.conn()
    if sub:
        c.execute("SELECT outbox.create_subscription(%s)", (sub,))
        c.execute("SELECT outbox.drop_subscription('default', true)")
    make_states(c, "hl.t", sub)
    time.sleep(0.05)
    h = health(c, backlog_age="0 s", backlog_critical=3)
    assert h["backlog_age"][:2] == ("warn", 2), h["backlog_age"]
    assert health(c, backlog_age="0 s", backlog_critical=2)["backlog_age"][:2] == ("critical", 2)
    assert health(c)["backlog_age"][:2] == ("ok", 0)  # nothing is 60 s old
    assert h["dead_letters"][:2] == ("warn", 1)
    assert h["expired_leases"][:2] == ("warn", 1)


def xmin_row(c, **kw):
    return health(c, **kw)["xmin_horizon"]


def test_health_names_the_session_holding_the_xmin_horizon(plain):
    c = plain.conn()
    holder = plain.conn()
    pid = holder.execute("SELECT pg_backend_pid()").fetchone()[0]
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM outbox.events")
    time.sleep(0.05)
    # An autovacuum worker could briefly hold an older snapshot: retry a little.
    for _ in range(20):
        status, value, msg = xmin_row(c)
        if f"pid {pid} " in msg:
            break
        time.sleep(0.1)
    assert f"pid {pid} " in msg, msg
    assert status == "ok" and value > 0
    assert "user postgres" in msg
    status, value, msg = xmin_row(c, xmin_warn="1 ms", xmin_critical="1 hour")
    assert status == "warn" and f"pid {pid} " in msg
    status, value, msg = xmin_row(c, xmin_warn="1 ms", xmin_critical="2 ms")
    assert status == "critical" and f"pid {pid} " in msg
    holder.execute("COMMIT")
    for _ in range(20):
        status, value, msg = xmin_row(c)
        if f"pid {pid} " not in msg:
            break
        time.sleep(0.1)
    assert f"pid {pid} " not in msg


def test_health_as_admin_role(plain):
    ensure_login_role(plain.dsn, "admin_u", ("outbox_admin",))
    with connect(role_dsn(plain.dsn, "admin_u")) as c:
        assert set(health(c)) == CHECKS


@pytest.mark.parametrize("topics", [1, 2])
def test_stats_match_events(plain, topics):
    c = plain.conn()
    for t in range(topics):
        make_states(c, f"st.t{t}")
    c.execute("SELECT outbox.publish('st.only_pending', '{}')")
    time.sleep(0.05)
    with c.transaction():  # one snapshot and one now() for both sides
        c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        expect = {
            r[0]: r[1:]
            for r in c.execute("""
                SELECT topic,
                       count(*) FILTER (WHERE state = 'pending' AND available_at <= now()),
                       count(*) FILTER (WHERE state = 'pending' AND available_at > now()),
                       count(*) FILTER (WHERE state = 'leased'),
                       count(*) FILTER (WHERE state = 'leased' AND lease_expires_at <= now()),
                       count(*) FILTER (WHERE state = 'dead'),
                       count(*) FILTER (WHERE state = 'delivered'),
                       count(*) FILTER (WHERE state = 'cancelled')
                  FROM outbox.events GROUP BY topic""").fetchall()
        }
        got = {
            r[0]: r[1:]
            for r in c.execute(
                "SELECT topic, ready, scheduled, leased, expired_leases, dead, delivered, cancelled FROM outbox.stats"
            ).fetchall()
        }
    assert got == expect
    for t in range(topics):
        assert got[f"st.t{t}"] == (2, 1, 2, 1, 1, 1, 1)
    assert got["st.only_pending"] == (1, 0, 0, 0, 0, 0, 0)


def test_health_names_an_overdue_log_table_and_the_reader_that_holds_it(plain):
    c = plain.conn()
    plain.clean(extra=("outbox.log_0", "outbox.log_1", "outbox.log_2", "outbox.log_3", "outbox.log_state",
                       "outbox.log_lanes", "outbox.log_batches"))
    assert health(c)["log_ring"][:2] == ("ok", 0)
    c.execute("SELECT outbox._log_subscribe('slow')")
    c.execute("SELECT outbox.publish('hl.log', '{}')")
    c.execute("INSERT INTO outbox.log_state VALUES (0, now() - interval '30 days', now() - interval '20 days', "
              "pg_current_snapshot()), (1, now() - interval '20 days', NULL, NULL)")
    status, value, message = health(c)["log_ring"]
    assert (status, value) == ("warn", 2), message
    assert "outbox.log_0" in message and "a log reader has not read past" in message
    assert "outbox.log_1" in message and "not sealed" in message
    c.execute("TRUNCATE outbox.log_state, outbox.log_lanes")
    assert health(c)["log_ring"][:2] == ("ok", 0)


def test_health_warns_while_default_is_never_claimed_and_another_subscription_is(plain):
    """Issue 40, item 7. The install's 'default' receives every event, so an
    application that claims only from named subscriptions leaves it holding
    the whole ring for ever. Kept (nothing committed is lost), but said as
    soon as another subscription has been claimed from and 'default' never."""
    c = plain.conn()
    assert health(c)["default_subscription"][:2] == ("ok", 0)
    c.execute("SELECT outbox.create_subscription('named')")
    c.execute("SELECT outbox.publish_batch('hd.t', array_fill('{}'::jsonb, ARRAY[3]))")
    assert health(c)["default_subscription"][0] == "ok"      # nobody has claimed yet
    rows = c.execute("SELECT id, lease_token FROM outbox.claim('w', 10, subscription => 'named')").fetchall()
    assert len(rows) == 3
    c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([r[0] for r in rows], [r[1] for r in rows]))
    status, value, message = health(c)["default_subscription"]
    assert (status, value) == ("warn", 3), (status, value, message)
    assert "never been claimed" in message and "'named'" in message, message
    assert "outbox.drop_subscription('default')" in message, message
    # Claimed once, holding no ring table: nothing to say.
    c.execute("SELECT * FROM outbox.claim('w', 1)")
    assert health(c)["default_subscription"][0] == "ok"
    c.execute("SELECT outbox.drop_subscription('default', true)")
    assert health(c)["default_subscription"][:2] == ("ok", 0)


def test_health_warns_while_default_holds_a_ring_table_past_retention(plain):
    """Issue 40, item 7: 'default' has been claimed from, then no more, and a
    ring table sealed longer ago than outbox.retention_delivered (7 days) is
    kept for it alone."""
    c = plain.conn()
    assert c.execute("SELECT count(*) FROM outbox.claim('w', 1)").fetchone()[0] == 0
    c.execute("SELECT outbox.create_subscription('named')")
    c.execute("SELECT outbox.publish_batch('hd.t', array_fill('{}'::jsonb, ARRAY[2]))")
    c.execute("INSERT INTO outbox.log_state VALUES (0, now() - interval '30 days', now() - interval '20 days', "
              "pg_current_snapshot()), (1, now() - interval '20 days', NULL, NULL)")
    named = c.execute("SELECT id, lease_token FROM outbox.claim('w', 10, subscription => 'named')").fetchall()
    c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([r[0] for r in named], [r[1] for r in named]))
    assert c.execute("SELECT count(*) FROM outbox.claim('w', 10, subscription => 'named')").fetchone()[0] == 0
    status, value, message = health(c)["default_subscription"]
    assert (status, value) == ("warn", 2), (status, value, message)
    assert "outbox.log_0" in message and "outbox.drop_subscription('default')" in message, message
    # Once 'default' has read past it, it holds nothing.
    while rows := c.execute("SELECT id, lease_token FROM outbox.claim('w', 10)").fetchall():
        c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([r[0] for r in rows], [r[1] for r in rows]))
    assert health(c)["default_subscription"][:2] == ("ok", 0)
