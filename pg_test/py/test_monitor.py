"""The operators' read side (0.11.0): outbox.blocked_subjects(), outbox.delivered_per_minute()
and the read-only role outbox_monitor, on 'default' and on a named subscription."""

import psycopg
import pytest

from conftest import connect
from scratch_db import ensure_login_role, role_dsn


def claim(c, topic, sub=None, n=10, lease="10 min"):
    return c.execute(
        "SELECT id, lease_token, subject FROM outbox.claim('t', %s, %s::interval, ARRAY[%s], %s)", (n, lease, topic, sub)
    ).fetchall()


def make_blocked(c, topic, sub=None):
    """Subjects: 'lease' (held by a live lease), 'retry' (failed, backoff 1 h), 'dead' (dead letter,
    'block' policy), 'delay' (deliver_at in an hour), each with events waiting behind; 'alone' (a lease,
    nothing behind), 'ready' (head claimable now). Returns {subject: holding event id}."""
    ids = {}
    for s in ("lease", "retry", "dead", "alone"):
        ids[s] = c.execute("SELECT outbox.publish(%s, '{}', subject => %s)", (topic, s)).fetchone()[0]
    ids["delay"] = c.execute(
        "SELECT outbox.publish(%s, '{}', subject => 'delay', deliver_at => now() + interval '1 hour')", (topic,)
    ).fetchone()[0]
    for s, n in (("lease", 2), ("retry", 3), ("dead", 1), ("delay", 2)):
        for _ in range(n):
            c.execute("SELECT outbox.publish(%s, '{}', subject => %s)", (topic, s))
    got = {r[2]: r for r in claim(c, topic, sub)}
    assert set(got) == {"lease", "retry", "dead", "alone"}, got
    c.execute("SELECT outbox.fail(%s, %s, 'boom', '1 hour')", got["retry"][:2])
    c.execute("SELECT outbox.fail(%s, %s, 'gone for good', permanent => true)", got["dead"][:2])
    c.execute("SELECT outbox.publish(%s, '{}', subject => 'ready')", (topic,))
    c.execute("SELECT outbox.publish(%s, '{}', subject => 'ready')", (topic,))
    return ids


def blocked(c, sub=None):
    rows = c.execute(
        "SELECT subscription, subject, event_id, state, reason, attempts, last_error, until IS NULL, until > now(), waiting "
        "FROM outbox.blocked_subjects(%s)", (sub,)
    ).fetchall()
    return {(r[0], r[1]): r[2:] for r in rows}


@pytest.mark.parametrize("which", ["default", "named"])
def test_blocked_subjects_names_the_holding_event_and_why(plain, which):
    c = plain.conn()
    sub = None
    if which == "named":
        c.execute("SELECT outbox.create_subscription('mon', start => 'now')")
        sub = "mon"
    ids = make_blocked(c, "mon.t", sub)
    name = sub or "default"
    got = blocked(c, sub)
    assert got == {
        (name, "lease"): (ids["lease"], "leased", "leased", 1, None, False, True, 2),
        (name, "retry"): (ids["retry"], "pending", "retrying", 1, "boom", False, True, 3),
        (name, "dead"): (ids["dead"], "dead", "dead", 1, "gone for good", True, None, 1),
        (name, "delay"): (ids["delay"], "pending", "delayed", 0, None, False, True, 2),
    }
    # Most waiting first, and max_rows bounds the answer.
    first = c.execute("SELECT subject FROM outbox.blocked_subjects(%s, max_rows => 1)", (sub,)).fetchall()
    assert first == [("retry",)]
    # NULL = every subscription: the named one and 'default' side by side.
    every = blocked(c)
    assert (name, "retry") in every


def test_blocked_subjects_skip_policy_releases_dead_letters(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_topic('mon.skip', dead_letter_policy => 'skip')")
    c.execute("SELECT outbox.publish('mon.skip', '{}', subject => 's')")
    c.execute("SELECT outbox.publish('mon.skip', '{}', subject => 's')")
    (i, tok, _s) = claim(c, "mon.skip")[0]
    c.execute("SELECT outbox.fail(%s, %s, 'x', permanent => true)", (i, tok))
    assert blocked(c) == {}


def test_blocked_subjects_bad_input(logdb):
    c = logdb.conn()
    for stmt, state in (
        ("SELECT * FROM outbox.blocked_subjects(NULL, 0)", "22023"),
        ("SELECT * FROM outbox.blocked_subjects(NULL, NULL)", "22023"),
        ("SELECT * FROM outbox.blocked_subjects('Bad Name')", "22023"),
        ("SELECT * FROM outbox.blocked_subjects('nope')", "42704"),
        ("SELECT * FROM outbox.delivered_per_minute(0)", "22023"),
        ("SELECT * FROM outbox.delivered_per_minute(1441)", "22023"),
        ("SELECT * FROM outbox.delivered_per_minute(NULL)", "22023"),
        ("SELECT * FROM outbox.delivered_per_minute(60, 'nope')", "42704"),
    ):
        with pytest.raises(psycopg.Error) as e:
            c.execute(stmt)
        assert e.value.sqlstate == state, stmt


@pytest.mark.parametrize("which", ["default", "named"])
def test_delivered_per_minute_counts_this_minute_and_fills_the_rest(plain, which):
    c = plain.conn()
    sub = None
    if which == "named":
        c.execute("SELECT outbox.create_subscription('mon', start => 'now')")
        sub = "mon"
    c.execute("SELECT outbox.publish_batch('mon.a', array_fill('{}'::jsonb, ARRAY[5]))")
    c.execute("SELECT outbox.publish_batch('mon.b', array_fill('{}'::jsonb, ARRAY[2]))")
    c.execute("SELECT outbox.publish('mon.c', '{}')")  # never delivered: no rows
    rows = c.execute("SELECT id, lease_token, topic FROM outbox.claim('t', 100, '1 min', ARRAY['mon.a', 'mon.b'], %s)",
                     (sub,)).fetchall()
    assert len(rows) == 7
    # One of mon.a fails first and is delivered on its second try: a row of its own on the log.
    first = next(r for r in rows if r[2] == "mon.a")
    c.execute("SELECT outbox.fail(%s, %s, 'once', '0 s')", first[:2])
    rest = [r for r in rows if r is not first]
    c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([r[0] for r in rest], [r[1] for r in rest]))
    (i, tok) = c.execute("SELECT id, lease_token FROM outbox.claim('t', 1, '1 min', ARRAY['mon.a'], %s)", (sub,)).fetchone()
    assert i == first[0]
    c.execute("SELECT outbox.ack(%s, %s)", (i, tok))
    name = sub or "default"
    with c.transaction():
        out = c.execute("SELECT subscription, topic, minute, delivered FROM outbox.delivered_per_minute(10, %s)",
                        (sub,)).fetchall()
        now_minute = c.execute("SELECT date_trunc('minute', now())").fetchone()[0]
    by = {}
    for s, t, m, n in out:
        assert s == name
        by.setdefault(t, []).append((m, n))
    assert set(by) == {"mon.a", "mon.b"}
    for t, want in (("mon.a", 5), ("mon.b", 2)):
        series = by[t]
        assert len(series) == 10 and [m for m, _ in series] == sorted(m for m, _ in series)
        assert series[-1] == (now_minute, want)
        assert all(n == 0 for _, n in series[:-1])


def test_monitor_role_reads_counts_states_and_errors_but_no_payloads(plain):
    c = plain.conn()
    ids = make_blocked(c, "mon.r")
    ensure_login_role(plain.dsn, "monitor_u", ("outbox_monitor",))
    with connect(role_dsn(plain.dsn, "monitor_u")) as m:
        assert m.execute("SELECT count(*) FROM outbox.stats").fetchone()[0] >= 1
        assert m.execute("SELECT count(*) FROM outbox.subscriptions").fetchone()[0] >= 1
        assert m.execute("SELECT count(*) FROM outbox.deliveries").fetchone()[0] > 0
        assert m.execute("SELECT count(*) FROM outbox.health()").fetchone()[0] > 0
        assert m.execute("SELECT count(*) FROM outbox.wakeup_status()").fetchone()[0] == 1
        assert m.execute("SELECT count(*) FROM outbox.delivered_per_minute()").fetchone()[0] == 0
        assert {r[0] for r in m.execute("SELECT subject FROM outbox.blocked_subjects()")} == {"lease", "retry", "dead", "delay"}
        row = m.execute("SELECT state, last_error, errors IS NOT NULL FROM outbox.events WHERE id = %s", (ids["dead"],)).fetchone()
        assert row == ("dead", "gone for good", True)
        for stmt in (
            "SELECT payload FROM outbox.events LIMIT 1",
            "SELECT headers FROM outbox.events LIMIT 1",
            "SELECT * FROM outbox.events LIMIT 1",
            "SELECT count(*) FROM outbox.log",
            "SELECT count(*) FROM outbox.log_lanes",
            "SELECT count(*) FROM outbox.log_exceptions",
            f"SELECT outbox.replay({ids['dead']})",
            f"SELECT outbox.cancel({ids['retry']})",
            "SELECT outbox.publish('mon.r', '{}')",
            "SELECT * FROM outbox.claim('m', 1)",
        ):
            with pytest.raises(psycopg.Error) as e:
                m.execute(stmt)
            assert e.value.sqlstate == "42501", stmt


def test_monitor_reads_views_over_a_filtered_subscription(logdb):
    """The views call the topic matcher for a subscription with a topic filter: the monitor
    must be able to run everything it calls (found by review: 42501 for _pattern_kind)."""
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('filtered', topics => ARRAY['mon.*'])")
    c.execute("SELECT outbox.publish('mon.f', '{}', subject => 's')")
    c.execute("SELECT outbox.publish('other.f', '{}', subject => 's')")
    ensure_login_role(logdb.dsn, "monitor_u", ("outbox_monitor",))
    with connect(role_dsn(logdb.dsn, "monitor_u")) as m:
        assert m.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'filtered'").fetchone()[0] == 1
        assert m.execute("SELECT count(*) FROM outbox.stats WHERE subscription = 'filtered'").fetchone()[0] == 1
        assert m.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 2
        m.execute("SELECT * FROM outbox.blocked_subjects('filtered')")


def test_blocked_subjects_a_later_event_out_holds_a_replayed_one(logdb):
    """Under the 'skip' policy a dead head lets the next event go out; replaying the dead one
    while the next is leased: the subject is held by the lease (a claim hands out nothing of it)."""
    c = logdb.conn()
    c.execute("SELECT outbox.create_topic('mon.skip', dead_letter_policy => 'skip')")
    c.execute("SELECT outbox.create_subscription('s1', topics => ARRAY['mon.*'])")
    e1 = c.execute("SELECT outbox.publish('mon.skip', '{}', subject => 'subj')").fetchone()[0]
    e2 = c.execute("SELECT outbox.publish('mon.skip', '{}', subject => 'subj')").fetchone()[0]
    (i, tok, _s) = claim(c, "mon.skip", "s1")[0]
    assert i == e1
    c.execute("SELECT outbox.fail(%s, %s, 'x', permanent => true)", (i, tok))
    (i, _tok, _s) = claim(c, "mon.skip", "s1", lease="1 hour")[0]
    assert i == e2
    assert c.execute("SELECT outbox.replay(%s, 's1')", (e1,)).fetchone()[0] is True
    c.execute("SELECT outbox.publish('mon.skip', '{}', subject => 'subj')")
    assert claim(c, "mon.skip", "s1") == []
    got = blocked(c, "s1")
    assert got == {("s1", "subj"): (e2, "leased", "leased", 1, None, False, True, 2)}, got


def test_lag_of_a_filtered_subscription_counts_only_its_topics(logdb):
    """outbox.subscriptions.lag_events (and so health()) of a subscription with a topic filter:
    unread events of other topics are not owed to it (review: it counted the whole log)."""
    c = logdb.conn()
    c.execute("SELECT outbox.create_subscription('filt', topics => ARRAY['mon.*', 'exact.t'])")
    c.execute("SELECT outbox.publish_batch('mon.x', array_fill('{}'::jsonb, ARRAY[3]))")
    c.execute("SELECT outbox.publish_batch('other.y', array_fill('{}'::jsonb, ARRAY[5]))")
    c.execute("SELECT outbox.publish('exact.t', '{}')")
    c.execute("SELECT outbox.publish('exact.tt', '{}')")

    def lag():
        return c.execute("SELECT lag_events FROM outbox.subscriptions WHERE name = 'filt'").fetchone()[0]

    assert lag() == 4
    assert lag() == c.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'filt' AND state <> 'delivered'").fetchone()[0]
    rows = c.execute("SELECT id, lease_token FROM outbox.claim('t', 2, subscription => 'filt')").fetchall()
    assert len(rows) == 2 and lag() == 4  # read into a batch, not yet acked
    c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([r[0] for r in rows], [r[1] for r in rows]))
    assert lag() == 2
