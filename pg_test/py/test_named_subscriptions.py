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
    # 'default' reads the log beside it.
    assert sorted(drain(c, None)) == ids
    # Nothing is left anywhere: no batch, no exception row.
    assert plain.one("SELECT count(*) FROM outbox.log_batches")[0] == 0
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions")[0] == 0


def test_a_transaction_that_publishes_before_create_and_commits_after_is_delivered(logdb):
    # logdb: 'earliest' takes the whole log, which other tests leave behind.
    c, pub = logdb.conn(), logdb.conn()
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


@pytest.mark.parametrize("end", ["commit", "rollback"])
@pytest.mark.parametrize("op", ["pause", "resume"])
def test_a_pause_or_resume_that_waited_for_a_drop_raises_42704(plain, op, end):
    """pause_subscription and resume_subscription wait for the catalog row a
    drop_subscription holds. Once the drop commits they raise 42704, as
    alter_subscription does, instead of returning false as if nothing had to
    change; once it rolls back they change the subscription as usual."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('pr')")
    if op == "resume":
        assert c.execute("SELECT outbox.pause_subscription('pr')").fetchone()[0] is True
    d = connect(plain.dsn, autocommit=False)
    try:
        d.execute("SELECT outbox.drop_subscription('pr')")   # holds the row until it ends
        out = {}

        def run():
            try:
                out["value"] = plain.conn().execute(f"SELECT outbox.{op}_subscription('pr')").fetchone()[0]
            except psycopg.Error as e:
                out["error"] = e.sqlstate

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.5)
        assert t.is_alive(), f"{op}_subscription did not wait for the drop"
        if end == "commit":
            d.commit()
        else:
            d.rollback()
        t.join(10)
        assert not t.is_alive()
    finally:
        d.close()
    if end == "commit":
        assert out == {"error": "42704"}, out
        assert plain.one("SELECT count(*) FROM outbox.subscription_catalog WHERE name = 'pr'")[0] == 0
    else:
        assert out == {"value": True}, out
        assert plain.one("SELECT paused FROM outbox.subscriptions WHERE name = 'pr'")[0] is (op == "pause")


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
    """A dead letter goes after retention_dead, once the log no longer holds its
    event (0.12.0): with the event still there, outbox.deliveries would show it
    as acked from its batch (the lane's cursor has passed it)."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('r')")
    eid = publish(c)
    (r,) = claim(c, "r")
    fail(c, r, permanent=True)
    view = "SELECT state FROM outbox.deliveries WHERE subscription = 'r' AND event_id = %s"
    c.execute("CALL outbox.purge_dead(interval '1 hour')")
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'r'")[0] == 1
    c.execute("CALL outbox.purge_dead(interval '0')")
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'r'")[0] == 1
    assert plain.one(view, (eid,)) == ("dead",)
    for n in range(4):
        c.execute(f"TRUNCATE outbox.log_{n}")
    c.execute("CALL outbox.purge_dead(interval '0')")
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'r'")[0] == 0


def test_a_retried_delivery_keeps_its_history_while_the_log_holds_the_event(plain):
    """purge() leaves a delivered row of its own while the log still holds the
    event: outbox.deliveries would otherwise show it as acked on the first try
    (found by the soak, 0.11.0)."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('h')")
    eid = publish(c)
    (r,) = claim(c, "h")
    assert fail(c, r) == "pending"
    (r,) = claim(c, "h")
    assert ack(c, r)
    view = "SELECT state, attempts, last_error FROM outbox.deliveries WHERE subscription = 'h' AND event_id = %s"
    assert plain.one(view, (eid,)) == ("delivered", 2, "boom")
    time.sleep(0.05)
    c.execute("CALL outbox.purge(interval '0')")
    assert plain.one(view, (eid,)) == ("delivered", 2, "boom")
    # Once the log no longer holds it, the row goes too.
    for n in range(4):
        c.execute(f"TRUNCATE outbox.log_{n}")
    c.execute("CALL outbox.purge(interval '0')")
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'h'")[0] == 0


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


def test_a_narrowed_claim_never_takes_another_topic_from_a_batch_in_flight(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('n')")
    a = publish(c, "a.x", subject="s")
    b = publish(c, "b.x", subject="s")
    (r,) = claim(c, "n")
    assert r[0] == a and ack(c, r)
    # b.x is next in the batch, but this claim wants a.* only: b moves to the
    # exception table instead of being handed out here.
    assert claim(c, "n", topics=["a.*"]) == []
    assert drain(c, "n") == [b]


def test_a_narrowed_claim_goes_past_a_batch_it_takes_nothing_from(plain):
    """A batch in flight whose handable events are all outside a narrowed
    claim's topics, with an event out under another worker's lease, must not
    send that claim back empty while the lane has a newer event of its topics:
    the other topics' events move to the exception table, the event out moves
    aside still leased to its holder (it has no subject), and the lane's newer
    event goes out (src/log/claim.rs, serve(): narrow before move_out)."""
    c = plain.conn()
    # x1, x2 (subject s) and e3, y (no subject) must share a lane: e3 and y by
    # their run of ids (src/log/mod.rs, lane()), s by its hash.
    probe = publish(c, "probe")
    while (probe + 3) % 64 > 60:
        probe = publish(c, "probe")
    lane = ((probe + 3) // 64) % 16
    (s,) = plain.one("SELECT s FROM (SELECT 'subj-' || g AS s FROM generate_series(1, 1000) g) x "
                     "WHERE hashtext(s) & 15 = %s LIMIT 1", (lane,))
    c.execute("SELECT outbox.create_subscription('nb')")
    x1, x2 = publish(c, "b.x", subject=s), publish(c, "b.x", subject=s)
    e3 = publish(c, "b.x")
    assert [x1, x2, e3] == [probe + 1, probe + 2, probe + 3]
    # One batch of the three: x1 and e3 go out, x2 waits behind x1.
    first = claim(c, "nb", n=3, worker="other")
    assert [r[0] for r in first] == [x1, e3]
    assert ack(c, first[0])
    y = publish(c, "a.x")
    assert y == probe + 4
    got = claim(c, "nb", n=10, topics=["a.*"])
    assert [r[0] for r in got] == [y]
    # e3's holder keeps its lease and token; x2 waits in the exception table.
    assert plain.one("SELECT state, leased_by FROM outbox.deliveries WHERE subscription = 'nb' AND event_id = %s",
                     (e3,)) == ("leased", "other")
    assert ack(c, first[1]) and ack(c, got[0])
    assert drain(c, "nb") == [x2]


def test_a_filtered_subscription_claims_its_event_behind_other_topics(plain):
    """A claim of a filtered subscription reads past events of other topics
    in growing pieces (src/log/claim.rs, PIECE_GROWTH): its one event behind
    5,000 of other topics comes out of the first claim of batch size 1, not
    after dozens of empty ones (0.15.0 read `batch_size` events a piece,
    eight pieces a lane: about 40 claims)."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('rare', topics => ARRAY['rare.*'])")
    c.execute("SELECT count(*) FROM outbox.publish_batch('noise.x', array_fill('{}'::jsonb, ARRAY[5000]))")
    r = publish(c, "rare.x")
    assert [x[0] for x in claim(c, "rare", n=1)] == [r]
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'rare'")[0] == 0


def claims_until(c, sub, want, n, limit=40, **kw):
    """How many claims of `n` it takes until event `want` comes out (each
    claim's events acked); fails after `limit`."""
    for calls in range(1, limit + 1):
        rows = claim(c, sub, n=n, **kw)
        for r in rows:
            assert ack(c, r)
        if want in [r[0] for r in rows]:
            return calls
    raise AssertionError(f"{want} not claimed in {limit} claims")


def test_a_narrowed_claim_passes_other_topics_within_a_few_claims(plain):
    """A narrowed claim of an unfiltered subscription sends the events of
    other topics it reads to the exception table (the subscription still owes
    them), at most DIVERT_BUDGET (1,024) per claim, in growing pieces: 5,000
    of them take at most 5 claims of 1 before the narrowed event, where 0.15.0
    took about 40 (16 lanes x 8 pieces of 1 event a claim)."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('nar')")
    c.execute("SELECT count(*) FROM outbox.publish_batch('noise.x', array_fill('{}'::jsonb, ARRAY[5000]))")
    r = publish(c, "rare.x")
    assert claims_until(c, "nar", r, n=1, topics=["rare.*"]) <= 5
    # Nothing is lost: the rest of the subscription drains without narrowing.
    assert len(drain(c, "nar", n=1000)) == 5000


def test_a_blocked_subject_does_not_hide_its_lane_for_dozens_of_claims(plain):
    """A dead letter that blocks its subject (max_attempts 1, the default
    policy) with 3,000 later events of that subject: each claim sends at most
    DIVERT_BUDGET of them to the exception table, in growing pieces, so a ready
    event of another subject of the same lane comes out within 4 claims of 10
    (0.15.0: 8 pieces of 10 a claim, about 38 claims)."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('poi', max_attempts => 1)")
    publish(c, "poi.x", subject="P")
    (row,) = claim(c, "poi", n=1)
    assert fail(c, row, "poison", permanent=True) == "dead"
    c.execute("SELECT count(*) FROM outbox.publish_batch('poi.x', array_fill('{}'::jsonb, ARRAY[3000]), "
              "array_fill('P'::text, ARRAY[3000]))")
    (t,) = plain.one("SELECT s FROM (SELECT 'T' || g AS s FROM generate_series(1, 1000) g) x "
                     "WHERE hashtext(s) & 15 = hashtext('P') & 15 LIMIT 1")
    other = publish(c, "poi.x", subject=t)
    assert claims_until(c, "poi", other, n=10) <= 4
    # P stays blocked behind its dead letter: none of its events went out.
    assert plain.one("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'poi' AND state = 'pending'")[0] \
        == 3000


def test_a_slow_handler_holds_its_lane_only_for_a_moment(plain):
    """One event kept out (1 h lease) must not hold the other subjects of its
    lane: after src/log/claim.rs's LANE_HOLD_US it moves to the exception table,
    still leased to its holder, and the lane goes on."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('hol')")
    publish(c, subject="slow")
    (slow,) = claim(c, "hol", lease="1 hour")
    others = [publish(c, subject=f"other-{i}") for i in range(64)]
    first = [r[0] for r in claim(c, "hol", n=1000)]
    time.sleep(1.1)
    got = sorted(first + drain(c, "hol"))
    assert got == others
    # The slow holder's lease is intact: it extends and acks with its token.
    assert c.execute("SELECT outbox.extend_lease(%s, %s, '1 hour') IS NOT NULL",
                     (slow[0], slow[2])).fetchone()[0]
    assert claim(c, "hol") == []
    assert ack(c, slow)
    assert plain.one("SELECT state FROM outbox.deliveries WHERE subscription = 'hol' AND event_id = %s",
                     (slow[0],))[0] == "delivered"


def test_a_claimable_event_never_waits_for_another_events_lease(plain):
    """Events without a subject share lanes in runs of 64 ids, so consecutive
    events meet in one lane's batch. The batch slides: a claim appends the
    lane's newer events and hands them out while another worker's events are
    still out under their lease, in a transaction block too. A subject's own
    later event still waits for its earlier one."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('nw')")
    e1 = publish(c)
    (r1,) = claim(c, "nw", n=1, lease="1 hour", worker="slow")
    assert r1[0] == e1
    e2, e3 = publish(c), publish(c)
    assert [r[0] for r in claim(c, "nw", n=10, worker="quick")] == [e2, e3]
    # The first holder keeps its lease and token, in the batch.
    assert plain.one("SELECT state, leased_by FROM outbox.deliveries WHERE subscription = 'nw' AND event_id = %s",
                     (e1,)) == ("leased", "slow")
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'nw'")[0] == 0
    assert ack(c, r1)
    e4 = publish(c)
    (r4,) = claim(c, "nw", n=1, lease="1 hour", worker="slow")
    assert r4[0] == e4
    e5 = publish(c)
    t = plain.conn()
    t.execute("BEGIN")
    assert [r[0] for r in claim(t, "nw")] == [e5]
    t.execute("ROLLBACK")
    assert ack(c, r4)
    assert drain(c, "nw") == [e5]
    # With a subject: the later event waits for the earlier one's lease.
    s1 = publish(c, subject="acct")
    (r,) = claim(c, "nw", n=1, lease="1 hour")
    assert r[0] == s1
    s2 = publish(c, subject="acct")
    assert claim(c, "nw") == []
    assert ack(c, r)
    assert drain(c, "nw") == [s2]


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("op", ["ack", "extend", "fail"])
def test_a_stale_token_waiting_for_a_reclaim_is_refused_not_a_serialization_failure(plain, op, isolation):
    """An event with a row of its own (after a retry), its lease expired and
    claimed again by a transaction still open: an ack, extend_lease or fail
    with the old token waits for that claim, and once it commits is refused
    as stale at every isolation level (found by a helper's stress run: 40001
    at REPEATABLE READ before 0.12.0, src/log/exceptions.rs `by_token`)."""
    c, holder = plain.conn(), plain.conn()
    c.execute("SELECT outbox.create_subscription('rr')")
    e = publish(c)
    (r,) = claim(c, "rr", n=1)
    assert fail(c, r) == "pending"
    (old,) = claim(c, "rr", n=1, lease="200 ms")
    assert old[0] == e
    time.sleep(0.4)
    holder.execute("BEGIN")
    (new,) = claim(holder, "rr", n=1)
    assert new[0] == e and new[2] != old[2]
    w = connect(plain.dsn)
    w.execute(f"SET default_transaction_isolation = '{isolation.lower()}'")
    sql = {"ack": "SELECT outbox.ack(%s::bigint, %s::uuid)",
           "extend": "SELECT outbox.extend_lease(%s, %s, '1 min')",
           "fail": "SELECT outbox.fail(%s, %s, 'late')"}[op]
    got = {}

    def stale():
        try:
            got["value"] = w.execute(sql, (old[0], old[2])).fetchone()[0]
        except psycopg.Error as ex:
            got["error"] = ex.sqlstate

    t = threading.Thread(target=stale)
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "the stale call did not wait for the open claim"
    holder.execute("COMMIT")
    t.join(10)
    w.close()
    assert got == {"value": {"ack": False, "extend": None, "fail": "stale"}[op]}
    # The new holder's lease is untouched.
    assert ack(c, new)


def test_a_claim_racing_a_drop_never_brings_the_subscription_back(plain):
    """A claim that passed the catalog check before drop_subscription committed
    must not recreate the dropped subscription's lanes (they would hold the
    log's retention for ever)."""
    a = plain.conn()
    a.execute("SELECT outbox.create_subscription('orph')")
    d = connect(plain.dsn, autocommit=False)
    x = connect(plain.dsn, autocommit=False)
    try:
        d.execute("SELECT outbox.drop_subscription('orph', force => true)")
        # x queues an exclusive lock behind d's; the claim then waits behind x
        # after its catalog check, at its first read of the exception table.
        tx = threading.Thread(target=lambda: x.execute("LOCK TABLE outbox.log_exceptions IN ACCESS EXCLUSIVE MODE"))
        tx.start()
        time.sleep(0.3)
        out = {}

        def run_claim():
            try:
                out["rows"] = claim(plain.conn(), "orph")
            except psycopg.Error as e:
                out["err"] = e.sqlstate

        tc = threading.Thread(target=run_claim)
        tc.start()
        time.sleep(0.3)
        d.commit()
        tx.join(10)
        x.commit()
        tc.join(10)
        assert out.get("rows", []) == [] or out.get("err") == "42704", out
    finally:
        d.close()
        x.close()
    assert plain.one("SELECT count(*) FROM outbox.log_lanes WHERE subscription = 'orph'")[0] == 0
    # A subscription restored without its lanes (they are not dumped) gets them.
    a.execute("SELECT outbox.create_subscription('rest')")
    a.execute("DELETE FROM outbox.log_lanes WHERE subscription = 'rest'")
    e = publish(a)
    assert drain(a, "rest") == []          # starts at the restore: e came before
    f = publish(a)
    assert drain(a, "rest") == [f]
    assert e < f


def test_events_outside_the_filter_never_link_a_subjects_order(plain):
    """An event the subscription does not take must not let a later event of
    its subject go out while an earlier one is still out, nor be delivered."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('f', topics => ARRAY['t.a.*'])")
    n1 = publish(c, "t.a.x", subject="S")
    publish(c, "t.b.x", subject="S")
    n3 = publish(c, "t.a.x", subject="S")
    (r,) = claim(c, "f")
    assert r[0] == n1
    assert fail(c, r, retry_in="0 s") == "pending"
    assert drain(c, "f") == [n1, n3]


def test_a_replayed_event_never_goes_out_beside_a_later_one_of_its_subject(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('rs', dead_letter_policy => 'skip', max_attempts => 1)")
    n1 = publish(c, subject="R")
    (r,) = claim(c, "rs")
    assert fail(c, r) == "dead"
    n2, n3 = publish(c, subject="R"), publish(c, subject="R")
    (r2,) = claim(c, "rs")
    assert r2[0] == n2 and ack(c, r2)
    assert c.execute("SELECT outbox.replay(%s, 'rs')", (n1,)).fetchone()[0] is True
    # n1 first, then n3 (which was waiting in the batch), one at a time.
    assert drain(c, "rs") == [n1, n3]
    # Replayed while a later event of its subject is out: it waits for that one.
    n4 = publish(c, subject="R")
    (r4,) = claim(c, "rs")
    assert r4[0] == n4
    c.execute("UPDATE outbox.log_exceptions SET state = 'dead' WHERE subscription = 'rs' AND id = %s", (n1,))
    assert c.execute("SELECT outbox.replay(%s, 'rs')", (n1,)).fetchone()[0] is True
    assert claim(c, "rs") == []
    assert ack(c, r4)
    assert drain(c, "rs") == [n1]


def test_switching_a_topics_dead_letter_policy_releases_named_subscriptions_too(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_topic('dl.t')")
    c.execute("SELECT outbox.create_subscription('dl')")
    c.execute("SELECT outbox.create_subscription('dlown', dead_letter_policy => 'block')")
    e1, e2 = publish(c, "dl.t", subject="x"), publish(c, "dl.t", subject="x")
    for sub in ("dl", "dlown"):
        (r,) = claim(c, sub)
        assert fail(c, r, permanent=True) == "dead"
        assert drain(c, sub) == []
    c.execute("SELECT outbox.alter_topic('dl.t', dead_letter_policy => 'skip')")
    assert drain(c, "dl") == [e2]
    assert drain(c, "dlown") == []       # its own policy stays
    assert e1 < e2


def test_one_array_ack_may_carry_one_event_for_several_subscriptions(plain):
    c = plain.conn()
    for s in ("mx", "mx2"):
        c.execute(f"SELECT outbox.create_subscription('{s}', max_attempts => 5)")
    e = publish(c)
    toks = []
    for s in ("mx", "mx2"):
        (r,) = claim(c, s)
        fail(c, r)                       # now an exception row of each subscription
        (r,) = claim(c, s)
        toks.append(r[2])
    (d,) = claim(c, None)
    toks.append(d[2])
    assert c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([e, e, e], toks)).fetchone()[0] == 3


def test_a_claim_left_open_in_a_transaction_does_not_stall_other_workers(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('open')")
    w1 = connect(plain.dsn, autocommit=False)
    try:
        assert claim(w1, "open") == []        # nothing yet; the transaction stays open
        ids = [publish(c, subject=f"o{i}") for i in range(40)]
        assert sorted(drain(plain.conn(), "open")) == ids
    finally:
        w1.rollback()
        w1.close()


def test_a_claim_larger_than_a_batch_holds_is_served_in_batches(plain):
    c = plain.conn()
    c.execute("SET outbox.max_batch_size = 100000")
    c.execute("SELECT outbox.create_subscription('big')")
    c.execute("SELECT count(*) FROM outbox.publish_batch('big.t', array_fill('{}'::jsonb, ARRAY[10000]))")
    c.execute("SELECT count(*) FROM outbox.publish_batch('big.t', array_fill('{}'::jsonb, ARRAY[10000]))")
    n = c.execute("SELECT count(*) FROM outbox.claim('w', 70000, subscription => 'big')").fetchone()[0]
    assert n == 20000


@pytest.mark.parametrize("path", ["batch", "retry"])
def test_drop_counts_the_leases_of_a_claim_still_open_in_a_transaction(plain, path):
    """A claim serves a batch in flight (or exception rows) without locking a
    lane: drop_subscription must still wait for it and refuse (55006)."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('dd')")
    publish(c, subject="S")
    publish(c, subject="S")
    (r,) = claim(c, "dd")
    if path == "batch":
        assert ack(c, r)                     # the second event waits in the batch
    else:
        assert fail(c, r, retry_in="0 s") == "pending"   # both now exception rows
    x = connect(plain.dsn, autocommit=False)
    try:
        (got,) = claim(x, "dd", lease="10 minutes")
        out = {}

        def drop():
            try:
                plain.conn().execute("SELECT outbox.drop_subscription('dd')")
                out["drop"] = "ok"
            except psycopg.Error as e:
                out["drop"] = e.sqlstate

        t = threading.Thread(target=drop)
        t.start()
        time.sleep(0.5)
        assert t.is_alive(), "the drop did not wait for the open claim"
        x.commit()
        t.join(10)
        assert out == {"drop": "55006"}
        assert ack(c, got)
    finally:
        x.close()


def test_replay_and_drop_take_their_locks_in_one_order(plain):
    """replay (named) locks the lane and batch before the exception row, as
    drop_subscription does: the two serialise, never deadlock."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('rd', dead_letter_policy => 'skip', max_attempts => 1)")
    n1 = publish(c, subject="R")
    (r,) = claim(c, "rd")
    assert fail(c, r) == "dead"
    publish(c, subject="R")
    publish(c, subject="R")
    x = connect(plain.dsn, autocommit=False)
    try:
        claim(x, "rd")                       # an open claim holds the lane's batch
        out = {}

        def run(name, sql):
            try:
                plain.conn().execute(sql)
                out[name] = "ok"
            except psycopg.Error as e:
                out[name] = e.sqlstate

        ts = [threading.Thread(target=run, args=("drop", "SELECT outbox.drop_subscription('rd', true)")),
              threading.Thread(target=run, args=("replay", f"SELECT outbox.replay({n1}, 'rd')"))]
        for t in ts:
            t.start()
            time.sleep(0.3)
        x.commit()
        for t in ts:
            t.join(10)
        assert out["drop"] == "ok" and out["replay"] in ("ok", "42704"), out
    finally:
        x.close()


def test_every_event_names_the_worker_that_holds_it_wherever_it_is(plain):
    """leased_by per subscription (0.11.0): a batch keeps the worker of each of
    its rounds, so an event out in a batch names its holder, and an event that
    leaves the batch keeps that name in its row and attempt history: after an
    expired lease, a failure, or a slow handler's move out of its lane."""
    c = plain.conn()
    c.execute("SELECT outbox.create_subscription('who', max_attempts => 5)")
    one, two = publish(c, subject="s"), publish(c, subject="s")

    def row(i):
        return c.execute("SELECT state, leased_by, errors FROM outbox.deliveries "
                         "WHERE subscription = 'who' AND event_id = %s", (i,)).fetchone()

    # Round 1 of the batch: worker-a; round 2 (the subject's next event): worker-b.
    (r1,) = claim(c, "who", worker="worker-a")
    assert row(one)[:2] == ("leased", "worker-a") and row(two)[:2] == ("pending", None)
    assert ack(c, r1)
    (r2,) = claim(c, "who", lease="1 s", worker="worker-b")
    assert r2[0] == two and row(two)[:2] == ("leased", "worker-b")
    # Its lease expires: the next claim's history names the holder it lost.
    time.sleep(1.2)
    (r3,) = claim(c, "who", worker="worker-c")
    state, by, errors = row(two)
    assert (state, by) == ("leased", "worker-c")
    assert [(e["worker"], e["error"]) for e in errors] == [("worker-b", "lease expired")]
    assert fail(c, r3, error="bad", permanent=True) == "dead"
    state, by, errors = row(two)
    assert (state, by) == ("dead", "worker-c")
    assert [(e["worker"], e["error"]) for e in errors] == [("worker-b", "lease expired"), ("worker-c", "bad")]
    # A failure straight out of a batch names the batch's worker.
    three = publish(c, subject="t")
    (r4,) = claim(c, "who", worker="worker-d")
    assert fail(c, r4, error="nope", retry_in="1 hour") == "pending"
    state, by, errors = row(three)
    assert (state, by) == ("pending", "worker-d") and [e["worker"] for e in errors] == ["worker-d"]
    # A slow handler stays in its batch while the lane goes on (the batch
    # slides), and keeps its name there.
    slow = publish(c, subject="slow")
    (r5,) = claim(c, "who", lease="1 hour", worker="worker-e")
    others = [publish(c, subject=f"other-{i}") for i in range(64)]
    assert sorted(r[0] for r in claim(c, "who", n=1000)) == sorted(others)
    assert plain.one("SELECT count(*) FROM outbox.log_exceptions WHERE subscription = 'who' AND id = %s",
                     (slow,))[0] == 0, "the slow event left its batch"
    assert row(slow)[:2] == ("leased", "worker-e")
    assert ack(c, r5)


def test_a_topics_default_lease_applies_between_the_claims_and_the_subscriptions(plain):
    """Policy order for a subscription of the log (0.11.0): the call's lease,
    else the subscription's default_lease, else the topic's, else the GUC. A
    round of a batch has one expiry: the longest its events' topics ask for;
    a row of its own (after a failure) takes its own topic's."""
    c = plain.conn()
    # The two events below must share a lane: without a subject, an event's
    # lane is its run of 64 ids (src/log/mod.rs, lane()); two ids astride a
    # run's end go to two lanes, two batches, two leases. The probes are
    # published before the subscriptions exist, so neither receives them.
    probe = publish(c, "tl.probe")
    while (probe + 2) % 64 == 0:
        probe = publish(c, "tl.probe")
    c.execute("SELECT outbox.create_topic('tl.long', default_lease => '1 hour')")
    c.execute("SELECT outbox.create_subscription('tl')")
    c.execute("SELECT outbox.create_subscription('tl_sub', default_lease => '2 minutes')")

    def leases(sub, lease=None):
        """(id, topic, seconds left, token) of a claim of up to 10 events."""
        return c.execute("SELECT id, topic, extract(epoch FROM lease_expires_at - clock_timestamp())::float8, "
                         "lease_token FROM outbox.claim('w', 10, %s::interval, NULL, %s) ORDER BY id",
                         (lease, sub)).fetchall()

    def near(secs, want):
        return want - 5 < secs <= want

    long_id, plain_id = publish(c, topic="tl.long"), publish(c, topic="tl.plain")
    assert [long_id, plain_id] == [probe + 1, probe + 2]
    # One round with both events: the longest, the topic's hour.
    got = leases("tl")
    assert [r[:2] for r in got] == [(long_id, "tl.long"), (plain_id, "tl.plain")], got
    assert all(near(r[2], 3600) for r in got), got
    # The subscription's default beats the topic's; the call's beats both.
    got_sub = leases("tl_sub")
    assert len(got_sub) == 2 and all(near(r[2], 120) for r in got_sub), got_sub
    for i, r in enumerate(got_sub):
        assert fail(c, (r[0], None, r[3]), retry_in="0 s") == "pending"
    again = leases("tl_sub", lease="7 seconds")
    assert len(again) == 2 and all(near(r[2], 7) for r in again), again
    # Rows of their own in 'tl' (no lease of its own): each its topic's, or the GUC's.
    for r in got:
        assert fail(c, (r[0], None, r[3]), retry_in="0 s") == "pending"
    rows = {r[1]: r[2] for r in leases("tl")}
    assert near(rows["tl.long"], 3600) and near(rows["tl.plain"], 30), rows
    # A round of plain events alone: the GUC's 30 s.
    later = publish(c, topic="tl.plain")
    got = leases("tl")
    assert [r[0] for r in got] == [later] and near(got[0][2], 30), got
