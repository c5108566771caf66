"""Named subscriptions (0.9.0): create_subscription, drop_subscription, and
the claim contract per subscription over the log (src/log/claim.rs,
src/log/exceptions.rs): fan-out, retries with backoff, dead letters and their
policy, per-subject order across failures, topic filters, delays, pausing,
replay and cancel, and the views."""

import threading
import time

import psycopg
import pytest

from conftest import connect

CLAIM = ("SELECT id, subject, lease_token, attempt, topic FROM outbox.claim("
         "%s, %s, %s::interval, %s::text[], subscription => %s)")


def claim(c, sub, n=10, lease="30 s", topics=None, worker="w"):
    return c.execute(CLAIM, (worker, n, lease, topics, sub)).fetchall()


def ack(c, row):
    return c.execute("SELECT outbox.ack(%s::bigint, %s::uuid)", (row[0], row[2])).fetchone()[0]


def fail(c, row, error="boom", retry_in="0 s", permanent=False):
    return c.execute("SELECT outbox.fail(%s, %s, %s, %s::interval, %s)",
                     (row[0], row[2], error, retry_in, permanent)).fetchone()[0]


def publish(c, topic="t.a", subject=None, deliver_at=None):
    return c.execute("SELECT outbox.publish(%s, '{}', %s, deliver_at => %s)",
                     (topic, subject, deliver_at)).fetchone()[0]


def drain(c, sub, **kw):
    """Claim and ack until nothing is left; the ids in the order handed out."""
    got = []
    for _ in range(100):
        rows = claim(c, sub, **kw)
        if not rows:
            return got
        for r in rows:
            assert ack(c, r)
            got.append(r[0])
    raise AssertionError("did not drain")


def test_every_subscription_receives_every_event_and_default_still_does(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('ledger')")
    c.execute("SELECT outbox.create_subscription('mail')")
    ids = [publish(c, subject=f"s{i % 3}") for i in range(30)]
    assert sorted(drain(c, "ledger")) == ids
    assert sorted(drain(c, "mail")) == ids
    # 'default' reads the queue as before.
    assert sorted(drain(c, None)) == ids
    # Nothing is left anywhere: no batch, no exception row.
    assert plain.one("SELECT count(*) FROM outbox.log_batches")[0] == 0
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions")[0] == 0


def test_a_transaction_that_publishes_before_create_and_commits_after_is_delivered(plain):
    c, pub = plain.conn(), plain.conn()
    before = publish(c)                       # committed before: not delivered
    pub.execute("BEGIN")
    late = publish(pub)                       # published before the subscription exists
    c.execute("SELECT outbox.create_subscription('late')")
    pub.execute("COMMIT")                     # ...and commits after
    after = publish(c)
    assert sorted(drain(c, "late")) == [late, after]
    assert before < late
    # start => 'earliest' also takes what the log still holds.
    c.execute("SELECT outbox.create_subscription('all', start => 'earliest')")
    assert {before, late, after} <= set(drain(c, "all"))


def test_fail_retries_with_attempts_then_dead_letters_and_holds_its_subject(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('s', max_attempts => 2)")
    a1, a2 = publish(c, subject="a"), publish(c, subject="a")
    b1 = publish(c, subject="b")
    rows = {r[0]: r for r in claim(c, "s")}
    assert set(rows) == {a1, b1} and rows[a1][3] == 1
    assert fail(c, rows[a1], "first", "0 s") == "pending"
    # A stale token after the failure: nothing.
    assert fail(c, rows[a1]) == "stale" and ack(c, rows[a1]) is False
    assert ack(c, rows[b1])
    # a1 again (attempt 2); a2 waits behind it.
    (r,) = claim(c, "s")
    assert (r[0], r[3]) == (a1, 2)
    assert fail(c, r, "second") == "dead"
    assert claim(c, "s") == []                # 'block': a2 is held by the dead letter
    d = plain.one("SELECT state, attempts, last_error, jsonb_array_length(errors) FROM outbox.deliveries "
                  "WHERE subscription = 's' AND event_id = %s", (a1,))
    assert d == ("dead", 2, "second", 2)
    assert plain.one("SELECT dead_letters FROM outbox.subscriptions WHERE name = 's'")[0] == 1
    # Replay: a1 comes back with fresh attempts, then a2 after it.
    assert c.execute("SELECT outbox.replay(%s, 's')", (a1,)).fetchone()[0] is True
    assert drain(c, "s") == [a1, a2]


def test_skip_policy_lets_the_subject_go_on_and_cancel_unblocks_block(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('skip', dead_letter_policy => 'skip')")
    c.execute("SELECT outbox.create_subscription('blk')")
    x1, x2 = publish(c, subject="x"), publish(c, subject="x")
    for sub in ("skip", "blk"):
        (r,) = claim(c, sub)
        assert fail(c, r, permanent=True) == "dead"
    assert drain(c, "skip") == [x2]
    assert drain(c, "blk") == []
    assert c.execute("SELECT outbox.cancel(%s, 'blk')", (x1,)).fetchone()[0] is True
    assert drain(c, "blk") == [x2]
    assert plain.one("SELECT state FROM outbox.deliveries WHERE subscription = 'blk' AND event_id = %s",
                     (x1,))[0] == "cancelled"
    # Nothing to cancel: an event the subscription delivered has no row.
    assert c.execute("SELECT outbox.cancel(%s, 'blk')", (x2,)).fetchone()[0] is False


def test_a_failure_in_one_subscription_never_delays_another(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('bad')")
    c.execute("SELECT outbox.create_subscription('good')")
    ids = [publish(c, subject="k") for _ in range(3)]
    (r,) = claim(c, "bad")
    assert fail(c, r, retry_in="1 hour") == "pending"
    assert drain(c, "good") == ids
    assert claim(c, "bad") == []


def test_order_holds_across_a_retry_and_later_batches(plain):
    """A failed event's later events of the same subject, in its batch and in
    batches read after it, wait for it; other subjects of the lane go on."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    first = [publish(c, subject="o") for _ in range(3)]
    (r,) = [x for x in claim(c, "s") if x[0] == first[0]]
    assert fail(c, r, retry_in="1 s") == "pending"
    later = [publish(c, subject="o") for _ in range(2)]
    others = [publish(c, subject=f"p{i}") for i in range(5)]
    got = drain(c, "s")
    assert set(others) <= set(got) and not set(first + later) & set(got)
    time.sleep(1.1)
    assert drain(c, "s") == first + later


def test_topic_filters_of_the_subscription_and_of_the_claim(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('orders', topics => ARRAY['orders.*'])")
    o1 = publish(c, "orders.created", subject="o")
    publish(c, "billing.paid", subject="o")
    o2 = publish(c, "orders.paid", subject="o")
    o3 = publish(c, "orders.paid")
    assert plain.one("SELECT topics FROM outbox.subscriptions WHERE name = 'orders'")[0] == ["orders.*"]
    # A claim narrowed to orders.paid takes o3 now; o1 (created) goes to the
    # exception table, and o2 waits behind it (same subject).
    got = claim(c, "orders", topics=["orders.paid"])
    assert [r[0] for r in got] == [o3]
    ack(c, got[0])
    assert claim(c, "orders", topics=["orders.paid"]) == []
    assert drain(c, "orders") == [o1, o2]


def test_deliver_at_delays_an_event_and_its_subject_only(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('s')")
    soon = c.execute("SELECT now() + interval '1 second'").fetchone()[0]
    d = publish(c, subject="d", deliver_at=soon)
    d2 = publish(c, subject="d")
    e = publish(c, subject="e")
    assert drain(c, "s") == [e]
    time.sleep(1.1)
    assert drain(c, "s") == [d, d2]


def test_pause_hands_out_nothing_and_resume_goes_on(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('p')")
    i = publish(c)
    assert c.execute("SELECT outbox.pause_subscription('p')").fetchone()[0] is True
    assert claim(c, "p") == []
    c.execute("SELECT outbox.resume_subscription('p')")
    assert drain(c, "p") == [i]


def test_drop_refuses_leases_in_flight_unless_forced_and_their_tokens_go_stale(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('d')")
    publish(c)
    (r,) = claim(c, "d")
    with pytest.raises(psycopg.Error) as e:
        c.execute("SELECT outbox.drop_subscription('d')")
    assert e.value.sqlstate == "55006"
    assert plain.one("SELECT count(*) FROM outbox.subscriptions WHERE name = 'd'")[0] == 1
    c.execute("SELECT outbox.drop_subscription('d', force => true)")
    assert ack(c, r) is False
    assert fail(c, r) == "stale"
    for t in ("log_lanes", "log_batches", "log_exceptions"):
        assert plain.one(f"SELECT count(*) FROM outbox.{t} WHERE subscription = 'd'")[0] == 0
    with pytest.raises(psycopg.Error) as e:
        claim(c, "d")
    assert e.value.sqlstate == "42704"
    # Created again, it starts afresh.
    c.execute("SELECT outbox.create_subscription('d')")
    j = publish(c)
    assert drain(c, "d") == [j]


def test_the_subscriptions_view_counts_lag_leases_and_dead_letters(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('v')")
    ids = [publish(c, subject=f"v{i}") for i in range(6)]
    row = plain.one("SELECT lag_events, oldest_undelivered_id, leases_in_flight, dead_letters "
                    "FROM outbox.subscriptions WHERE name = 'v'")
    assert row == (6, ids[0], 0, 0)
    got = claim(c, "v", n=2)
    assert plain.one("SELECT lag_events, leases_in_flight FROM outbox.subscriptions WHERE name = 'v'") == (6, 2)
    fail(c, got[0], permanent=True)
    ack(c, got[1])
    assert plain.one("SELECT lag_events, leases_in_flight, dead_letters FROM outbox.subscriptions "
                     "WHERE name = 'v'") == (4, 0, 1)


def test_dead_letters_of_named_subscriptions_age_out_with_retention_dead(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('r')")
    publish(c)
    (r,) = claim(c, "r")
    fail(c, r, permanent=True)
    c.execute("CALL outbox.purge_dead(interval '1 hour')")
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions")[0] == 1
    c.execute("CALL outbox.purge_dead(interval '0')")
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions")[0] == 0


def test_workers_of_one_subscription_share_the_work_and_each_event_goes_out_once(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('share')")
    ids = set(r[0] for r in c.execute(
        "SELECT * FROM outbox.publish_batch('t.s', array_fill('{}'::jsonb, ARRAY[400]), "
        "(SELECT array_agg('k' || (g % 37)) FROM generate_series(1, 400) g))"))
    seen, errors = [], []

    def work(k):
        try:
            with connect(plain.dsn) as w:
                idle = 0
                while idle < 20:
                    rows = claim(w, "share", n=7, worker=f"w{k}")
                    if not rows:
                        idle += 1
                        time.sleep(0.01)
                        continue
                    idle = 0
                    subjects = [r[1] for r in rows]
                    assert len(subjects) == len(set(subjects))
                    for r in rows:
                        assert ack(w, r)
                        seen.append(r[0])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(seen) == sorted(ids)


def test_health_warns_about_a_named_subscription_that_lags_without_claims(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('idle')")
    publish(c)
    time.sleep(0.05)
    rows = dict(c.execute("SELECT substring(message from '''([a-z]+)'''), status FROM outbox.health(backlog_age => '10 ms') "
                          "WHERE check_name = 'subscription'").fetchall())
    assert rows["idle"] == "warn"
    msg = c.execute("SELECT message FROM outbox.health(backlog_age => '10 ms') WHERE check_name = 'subscription' "
                    "AND message LIKE '%''idle''%'").fetchone()[0]
    assert "holds the log's retention" in msg, msg
    drain(plain.conn(), "idle")
    status = c.execute("SELECT status FROM outbox.health(backlog_age => '10 ms') WHERE check_name = 'subscription' "
                       "AND message LIKE '%''idle''%'").fetchone()[0]
    assert status == "ok"
