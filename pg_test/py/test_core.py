"""Core delivery guarantees that only show across real sessions:
concurrent claims, fencing tokens after a reclaim, transactional publish, delayed
delivery and clock-based leases. Runs on the cluster without preload."""

import threading
import time
from collections import Counter, defaultdict
from datetime import timedelta

import psycopg
import pytest

from conftest import connect

WORKERS = 8
EVENTS = 2000


def claim_rows(conn, worker, n=100, lease=None, topics=None):
    return conn.execute(
        "SELECT id, lease_token, attempt, lease_expires_at FROM outbox.claim(%s, %s, %s::interval, %s)",
        (worker, n, lease, topics),
    ).fetchall()


def count_in(conn, *states):
    """The default subscription's events in `states` (outbox.deliveries)."""
    return conn.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' "
                        "AND state = ANY (%s)", (list(states),)).fetchone()[0]


def pending_count(conn):
    return count_in(conn, "pending")


def test_concurrent_claims_never_overlap_and_cover_everything(plain):
    c = plain.conn()
    published = {
        r[0]
        for r in c.execute(
            "SELECT outbox.publish_batch('core.load', array_agg(jsonb_build_object('n', g))) "
            "FROM generate_series(1, %s) g",
            (EVENTS,),
        ).fetchall()
    }
    assert len(published) == EVENTS

    claims = defaultdict(list)  # worker -> [(id, token)]
    errors = []
    start = threading.Barrier(WORKERS)

    def work(name):
        try:
            w = connect(plain.dsn)
            try:
                start.wait()
                while True:
                    # Claim inside a transaction that stays open a moment, so the
                    # row locks of concurrent claims really overlap in time.
                    with w.transaction():
                        rows = claim_rows(w, name, 37, "10 min")
                        time.sleep(0.002)
                    if rows:
                        claims[name].extend((i, tok) for i, tok, _, _ in rows)
                        continue
                    # An empty claim may only mean "the rest is locked by others".
                    if pending_count(w) == 0:
                        return
            finally:
                w.close()
        except Exception as e:  # surfaced below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a claimer hung"

    all_ids = [i for rows in claims.values() for i, _ in rows]
    dup = [i for i, k in Counter(all_ids).items() if k > 1]
    assert dup == [], f"{len(dup)} events were claimed by two workers, e.g. {dup[:5]}"
    assert set(all_ids) == published, "claims did not cover every published event"
    assert sum(1 for rows in claims.values() if rows) > 1, "only one worker ever claimed anything"

    # Every lease is the one the database holds: each worker's tokens ack.
    ids = [i for rows in claims.values() for i, _ in rows]
    toks = [t for rows in claims.values() for _, t in rows]
    acked = c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", (ids, toks)).fetchone()[0]
    assert acked == EVENTS
    assert count_in(c, "pending", "leased", "dead") == 0
    assert count_in(c, "delivered") == EVENTS


def test_concurrent_workers_keep_subject_order(plain):
    """Many workers, few subjects: an event is never claimed before the earlier
    event of its subject was acknowledged, so per subject the claims happen in
    publish order."""
    c = plain.conn()
    subjects = [f"s{i}" for i in range(5)]
    n_per = 40
    c.execute(
        "SELECT outbox.publish_batch('core.order', array_agg(jsonb_build_object('n', g) ORDER BY g), "
        "array_agg((%s::text[])[1 + g %% 5] ORDER BY g)) FROM generate_series(0, %s) g",
        (subjects, len(subjects) * n_per - 1),
    )
    order = defaultdict(list)  # subject -> ids in the order claims returned
    lock = threading.Lock()
    errors = []

    def work(name):
        try:
            with connect(plain.dsn) as w:
                while True:
                    rows = w.execute(
                        "SELECT id, subject, lease_token FROM outbox.claim(%s, 3, '10 min')", (name,)
                    ).fetchall()
                    if not rows:
                        if count_in(w, "pending", "leased", "dead") == 0:
                            return
                        time.sleep(0.001)  # others hold the subjects' heads
                        continue
                    # Record before acking: the next event of the subject can only
                    # be claimed after this ack, hence after this record.
                    with lock:
                        for i, s, _ in rows:
                            order[s].append(i)
                    for i, _, tok in rows:
                        assert w.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0]
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    for s in subjects:
        assert len(order[s]) == n_per, f"subject {s}: {len(order[s])} events delivered"
        assert order[s] == sorted(order[s]), f"subject {s} delivered out of order: {order[s]}"


def test_stale_token_cannot_ack_after_reclaim(plain):
    a = plain.conn()
    b = plain.conn()
    (eid,) = a.execute("SELECT outbox.publish('core.lease', '{\"k\": 1}')").fetchone()
    # A lease runs from the claim's start (clock_timestamp()): long enough that a
    # slow first claim of a backend on a busy machine cannot outlast it.
    (_, tok_a, attempt_a, _), = claim_rows(a, "worker-a", 10, "2 s")
    assert attempt_a == 1
    assert claim_rows(b, "worker-b", 10, "10 s") == [], "claimed while the first lease was live"
    time.sleep(2.2)  # let worker-a's lease expire
    (eid_b, tok_b, attempt_b, _), = claim_rows(b, "worker-b", 10, "10 s")
    assert eid_b == eid and attempt_b == 2 and tok_b != tok_a

    # Worker a wakes up late: every fenced call with its token is refused.
    assert a.execute("SELECT outbox.ack(%s, %s)", (eid, tok_a)).fetchone()[0] is False
    assert a.execute("SELECT outbox.ack(ARRAY[%s]::bigint[], ARRAY[%s]::uuid[])", (eid, tok_a)).fetchone()[0] == 0
    assert a.execute("SELECT outbox.fail(%s, %s, 'late')", (eid, tok_a)).fetchone()[0] == "stale"
    assert a.execute("SELECT outbox.extend_lease(%s, %s, '1 min')", (eid, tok_a)).fetchone()[0] is None
    st = a.execute("SELECT state, leased_by, attempts FROM outbox.events WHERE id = %s", (eid,)).fetchone()
    assert st == ("leased", "worker-b", 2)

    # The current holder still acks, exactly once.
    assert b.execute("SELECT outbox.ack(%s, %s)", (eid, tok_b)).fetchone()[0] is True
    assert b.execute("SELECT outbox.ack(%s, %s)", (eid, tok_b)).fetchone()[0] is False
    st = a.execute("SELECT state, attempts FROM outbox.events WHERE id = %s", (eid,)).fetchone()
    assert st == ("delivered", 2)


def test_stale_ack_racing_the_reclaim_transaction(plain):
    """The reclaim is still uncommitted when the old holder acks: the ack waits for
    the row and then sees the new token, so it still loses."""
    a = plain.conn()
    b = plain.conn()
    (eid,) = a.execute("SELECT outbox.publish('core.lease', '{}')").fetchone()
    (_, tok_a, _, _), = claim_rows(a, "worker-a", 1, "100 ms")
    time.sleep(0.25)
    b.execute("BEGIN")
    (_, tok_b, _, _), = claim_rows(b, "worker-b", 1, "10 s")
    result = {}

    def late_ack():
        with connect(plain.dsn) as x:
            result["ack"] = x.execute("SELECT outbox.ack(%s, %s)", (eid, tok_a)).fetchone()[0]

    t = threading.Thread(target=late_ack)
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "the late ack did not wait for the reclaiming transaction"
    b.execute("COMMIT")
    t.join(10)
    assert result == {"ack": False}
    assert b.execute("SELECT outbox.ack(%s, %s)", (eid, tok_b)).fetchone()[0] is True


def test_rolled_back_publish_is_never_claimed(plain):
    p = plain.conn()
    w = plain.conn()
    p.execute("BEGIN")
    (rb_id,) = p.execute("SELECT outbox.publish('core.tx', '{\"rolled\": \"back\"}', dispatch_key => 'k-rb')").fetchone()
    assert claim_rows(w, "w") == [], "an uncommitted event was claimable"
    p.execute("ROLLBACK")

    p.execute("BEGIN")
    (keep1,) = p.execute("SELECT outbox.publish('core.tx', '{\"n\": 1}')").fetchone()
    p.execute("SAVEPOINT s1")
    (sp_id,) = p.execute("SELECT outbox.publish('core.tx', '{\"n\": 2}', dispatch_key => 'k-sp')").fetchone()
    p.execute("SELECT outbox.publish_batch('core.tx', ARRAY['{\"n\": 3}', '{\"n\": 4}']::jsonb[])")
    p.execute("ROLLBACK TO SAVEPOINT s1")
    p.execute("SAVEPOINT s2")
    (keep2,) = p.execute("SELECT outbox.publish('core.tx', '{\"n\": 5}')").fetchone()
    p.execute("RELEASE SAVEPOINT s2")
    assert claim_rows(w, "w") == []
    p.execute("COMMIT")

    got = sorted(r[0] for r in claim_rows(w, "w", 1000))
    assert got == [keep1, keep2]
    assert claim_rows(w, "w", 1000) == []
    # Nothing of the rolled-back work exists anywhere, dispatch keys included:
    # the keys are free again.
    assert p.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == 2
    assert p.execute("SELECT count(*) FROM outbox.dispatch_keys").fetchone()[0] == 0
    (again,) = p.execute("SELECT outbox.publish('core.tx', '{}', dispatch_key => 'k-sp')").fetchone()
    assert again not in (rb_id, sp_id)


def test_concurrent_publish_rolls_back_while_claimers_poll(plain):
    """Claimers polling during a long publishing transaction that rolls back
    never see its rows; a committed one becomes visible all at once."""
    p = plain.conn()
    w = plain.conn()
    p.execute("BEGIN")
    p.execute("SELECT outbox.publish_batch('core.tx', array_fill('{}'::jsonb, ARRAY[50]))")
    for _ in range(5):
        assert claim_rows(w, "w") == []
        time.sleep(0.02)
    p.execute("ROLLBACK")
    assert claim_rows(w, "w") == []
    p.execute("BEGIN")
    p.execute("SELECT outbox.publish_batch('core.tx', array_fill('{}'::jsonb, ARRAY[50]))")
    assert claim_rows(w, "w") == []
    p.execute("COMMIT")
    assert len(claim_rows(w, "w", 1000)) == 50


def test_deliver_at_delays_claimability(plain):
    p = plain.conn()
    w = plain.conn()
    (late,) = p.execute(
        "SELECT outbox.publish('core.delay', '{}', deliver_at => clock_timestamp() + interval '800 ms')"
    ).fetchone()
    (now_id,) = p.execute("SELECT outbox.publish('core.delay', '{}')").fetchone()
    (past,) = p.execute(
        "SELECT outbox.publish('core.delay', '{}', deliver_at => clock_timestamp() - interval '1 hour')"
    ).fetchone()
    got = sorted(r[0] for r in claim_rows(w, "w"))
    assert got == sorted([now_id, past]), "a delayed event was claimable early"
    assert p.execute("SELECT state FROM outbox.events WHERE id = %s", (late,)).fetchone()[0] == "pending"
    time.sleep(1.0)
    assert [r[0] for r in claim_rows(w, "w")] == [late]


def test_lease_uses_clock_time_not_transaction_start(plain):
    p = plain.conn()
    w = plain.conn()
    p.execute("SELECT outbox.publish('core.clock', '{}')")
    w.execute("BEGIN")
    (tx_start,) = w.execute("SELECT now()").fetchone()
    time.sleep(1.5)  # the transaction has been open for a while
    (clock_before,) = w.execute("SELECT clock_timestamp()").fetchone()
    (eid, tok, _, expires), = claim_rows(w, "w", 1, "2 s")
    (clock_after,) = w.execute("SELECT clock_timestamp()").fetchone()
    w.execute("COMMIT")
    lease = expires - clock_before
    # now() + 2 s would be about 0.5 s before clock_before.
    assert expires > clock_before, f"lease ends {expires} before the claim ran ({clock_before})"
    assert 1.9 <= lease.total_seconds() <= 2.0 + (clock_after - clock_before).total_seconds() + 0.1, lease
    assert clock_before > tx_start
    # And extend_lease is clock based too.
    w.execute("BEGIN")
    time.sleep(0.3)
    (c0,) = w.execute("SELECT clock_timestamp()").fetchone()
    (new_exp,) = w.execute("SELECT outbox.extend_lease(%s, %s, '1 s')", (eid, tok)).fetchone()
    w.execute("COMMIT")
    assert new_exp >= c0 + timedelta(seconds=1), (new_exp, c0)


def test_claim_in_long_transaction_not_reclaimable_before_lease_ends(plain):
    """A claim made late in a long transaction must not hand out a lease that is
    already (nearly) expired from another session's point of view."""
    p = plain.conn()
    w = plain.conn()
    o = plain.conn()
    p.execute("SELECT outbox.publish('core.clock', '{}')")
    w.execute("BEGIN")
    w.execute("SELECT now()")
    time.sleep(1.2)
    claim_rows(w, "w", 1, "1 s")
    w.execute("COMMIT")
    # Measured from the claim, the lease still has most of its second left.
    assert claim_rows(o, "other", 1, "1 s") == [], "lease already expired: it was computed from transaction start"


def test_direct_insert_matches_sql_insert_and_yields_to_triggers(plain):
    """publish() appends its row to the log directly (src/pg/heap.rs), not with
    an INSERT statement. The row, its index entries and its visibility must be
    what the INSERT would have produced; and once the ring table has something
    an INSERT must run (here a row trigger), publish() must take the INSERT path
    so that it runs."""
    c = plain.conn()
    c.execute("SET outbox.notify = off")
    with c.transaction():
        direct = c.execute(
            "SELECT outbox.publish('core.direct', '{\"n\": 1}', dispatch_key => 'direct-1', "
            "headers => '{\"h\": \"v\"}', deliver_at => now() + interval '1 hour')"
        ).fetchone()[0]
        # A second call in the same transaction sees the first (same key, same id).
        again = c.execute("SELECT outbox.publish('core.direct', '{\"n\": 2}', dispatch_key => 'direct-1')").fetchone()[0]
        ready = c.execute("SELECT outbox.publish('core.direct', '{\"n\": 3}')").fetchone()[0]
        xid = c.execute("SELECT pg_current_xact_id()::text").fetchone()[0]
    assert again == direct
    row = c.execute(
        "SELECT topic, subject, dispatch_key, payload, headers, max_attempts, "
        "deliver_at > now() + interval '59 minutes', published_at <= now(), txid::text "
        "FROM outbox.log WHERE id = %s",
        (direct,),
    ).fetchone()
    max_attempts = int(c.execute("SHOW outbox.max_attempts").fetchone()[0])
    assert row == ("core.direct", None, "direct-1", {"n": 1}, {"h": "v"}, max_attempts, True, True, xid)
    # Index entries: found through each index, and only through the ones whose
    # predicate the row satisfies.
    c.execute("SET enable_seqscan = off")
    c.execute("SET enable_bitmapscan = off")
    lanes = [r[0] for r in c.execute("SELECT lane FROM outbox.log WHERE id IN (%s, %s)", (direct, ready)).fetchall()]
    assert c.execute("SELECT count(*) FROM outbox.log WHERE lane = ANY(%s::int2[]) AND id IN (%s, %s)",
                     (lanes, direct, ready)).fetchone()[0] == 2
    assert c.execute("SELECT count(*) FROM outbox.log WHERE deliver_at < 'infinity' AND id IN (%s, %s)",
                     (direct, ready)).fetchone()[0] == 1
    c.execute("RESET enable_seqscan")
    c.execute("RESET enable_bitmapscan")
    # amcheck: every heap row that satisfies an index's predicate has its entry.
    c.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
    checked = c.execute("SELECT count(bt_index_check(indexrelid::regclass, true)) FROM pg_index "
                        "WHERE indrelid = ANY (ARRAY['outbox.log_0', 'outbox.log_1', 'outbox.log_2', "
                        "'outbox.log_3']::regclass[])").fetchone()[0]
    assert checked == 12
    got = c.execute("SELECT id FROM outbox.claim('w', 10, topics => ARRAY['core.direct'])").fetchall()
    assert [r[0] for r in got] == [ready]

    # A row trigger on the ring tables: publish() must run it, so it must use the INSERT.
    c.execute("CREATE TABLE public.direct_seen (id bigint)")
    c.execute("CREATE FUNCTION public.direct_seen_f() RETURNS trigger LANGUAGE plpgsql AS "
              "$$BEGIN INSERT INTO public.direct_seen VALUES (NEW.id); RETURN NEW; END$$")
    for n in range(4):
        c.execute(f"CREATE TRIGGER direct_seen AFTER INSERT ON outbox.log_{n} "
                  "FOR EACH ROW EXECUTE FUNCTION public.direct_seen_f()")
    try:
        via_sql = c.execute("SELECT outbox.publish('core.direct', '{\"n\": 4}')").fetchone()[0]
        assert c.execute("SELECT array_agg(id) FROM public.direct_seen").fetchone()[0] == [via_sql]
    finally:
        for n in range(4):
            c.execute(f"DROP TRIGGER direct_seen ON outbox.log_{n}")
        c.execute("DROP FUNCTION public.direct_seen_f()")
        c.execute("DROP TABLE public.direct_seen")
    # Without the trigger the direct path is back, and the table is still sound.
    last = c.execute("SELECT outbox.publish('core.direct', '{\"n\": 5}')").fetchone()[0]
    assert last > via_sql
    assert c.execute("SELECT count(*) FROM outbox.events WHERE topic = 'core.direct'").fetchone()[0] == 4


def test_a_topic_created_during_a_repeatable_read_transaction_reaches_its_session(plain):
    """The topic cache reloads the registry as committed now, not under the
    transaction's older snapshot: otherwise the stale copy outlived the
    transaction, and strict topics refused a registered topic (P0002) in every
    later transaction of the session."""
    c, admin = plain.conn(), plain.conn()
    c.execute("SET outbox.strict_topics = on")
    c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    c.execute("SELECT count(*) FROM outbox.topics")  # the transaction's snapshot is taken
    admin.execute("SELECT outbox.create_topic('rr.late')")
    try:
        c.execute("SELECT outbox.publish('rr.late', '{}')")
        c.execute("COMMIT")
        assert c.execute("SELECT outbox.publish('rr.late', '{}')").fetchone()[0] > 0
    finally:
        c.execute("ROLLBACK")
        admin.execute("SELECT outbox.drop_topic('rr.late', true)")


def test_a_sessions_default_lease_over_max_lease_is_refused(plain):
    """outbox.default_lease is USERSET and outbox.max_lease SUSET: a session must not
    lift its leases past the cap by SETting the default (a crashed worker would
    strand its events for that long)."""
    c = plain.conn()
    c.execute("SELECT outbox.publish('core.cap', '{}')")
    c.execute("SET outbox.default_lease = '24d'")
    with pytest.raises(psycopg.Error) as e:
        c.execute("SELECT * FROM outbox.claim('w', 1)")
    assert e.value.sqlstate == "22023" and "outbox.max_lease" in str(e.value), e.value
    # The call's own lease still serves, and nothing was handed out by the refused claim.
    rows = c.execute("SELECT id, lease_expires_at - clock_timestamp() FROM outbox.claim('w', 1, '1 min')").fetchall()
    assert len(rows) == 1 and rows[0][1] <= timedelta(minutes=1), rows


def test_a_stored_default_lease_above_a_lowered_max_lease_is_cut_to_it(plain):
    """A topic's default_lease written under the default cap (12 h) and a cap lowered
    afterwards: the first delivery (a batch round) and a retry (an exception row)
    are both leased for at most the new cap."""
    c = plain.conn()
    c.execute("SELECT outbox.create_topic('core.longlease', default_lease => '10 hours')")
    c.execute("SET outbox.max_lease = '1h'")
    c.execute("SELECT outbox.publish('core.longlease', '{}')")
    (eid, tok, left), = c.execute(
        "SELECT id, lease_token, lease_expires_at - clock_timestamp() FROM outbox.claim('w', 1)").fetchall()
    assert left <= timedelta(hours=1), left
    assert c.execute("SELECT outbox.fail(%s, %s, 'again', retry_in => '0 s')", (eid, tok)).fetchone()[0] == "pending"
    (eid2, left2), = c.execute("SELECT id, lease_expires_at - clock_timestamp() FROM outbox.claim('w', 1)").fetchall()
    assert eid2 == eid and left2 <= timedelta(hours=1), left2
