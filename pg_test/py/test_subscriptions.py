"""Subscriptions (0.7.0: the `default` subscription, its policy and pausing)
across real sessions: pausing takes effect at commit and keeps leases usable,
the subscription's settings override the topic's, which override the GUCs, a
claim's note of its time never makes another transaction wait, and a pause or
policy change never waits for a worker. Runs on the cluster without preload; the
wake-up on resume on the preloaded one."""

import threading
import time

import psycopg
import pytest

from conftest import connect, sqlstate


def claim(conn, worker="w", n=10, lease=None, subscription=None, topics=None):
    return conn.execute(
        "SELECT id, lease_token, attempt, lease_expires_at - clock_timestamp() "
        "FROM outbox.claim(%s, %s, %s::interval, %s, %s)",
        (worker, n, lease, topics, subscription),
    ).fetchall()


def publish(conn, topic="sub.t", n=1, subject=None):
    return [conn.execute("SELECT outbox.publish(%s, '{}', %s)", (topic, subject)).fetchone()[0] for _ in range(n)]


def publish_apart(conn, n):
    """n events, each of its own subject in a lane of its own (hashtext(subject) & 15,
    src/log/mod.rs): on the log, events without a subject share a lane and its
    batch, and a claim in a transaction block waits for that batch's lease."""
    subjects = [r[0] for r in conn.execute(
        "SELECT DISTINCT ON (hashtext(s) & 15) s FROM (SELECT 'apart' || g AS s FROM generate_series(1, 500) g) x "
        "ORDER BY hashtext(s) & 15, s LIMIT %s", (n,))]
    assert len(subjects) == n
    return [publish(conn, subject=s)[0] for s in subjects]


def test_default_subscription_exists_and_the_view_counts_its_events(plain):
    c = plain.conn()
    ids = publish(c, n=3)
    leased = claim(c, n=1)
    assert [r[0] for r in leased] == ids[:1]
    row = c.execute("SELECT name, topics, paused, lag_events, ready, leases_in_flight, dead_letters, "
                    "oldest_undelivered_id, last_claim_at IS NOT NULL FROM outbox.subscriptions").fetchall()
    assert row == [("default", None, False, 3, 2, 1, 0, ids[0], True)]
    # deliveries: one row per event of the subscription, in the event's state.
    got = c.execute("SELECT event_id, subscription, state FROM outbox.deliveries ORDER BY 1").fetchall()
    assert got == [(ids[0], "default", "leased"), (ids[1], "default", "pending"), (ids[2], "default", "pending")]


def test_pause_hands_out_nothing_from_its_commit_and_keeps_leases_usable(plain):
    c, admin = plain.conn(), plain.conn()
    ids = publish(c, n=4)
    (first_id, tok, _, _), = claim(c, n=1)
    admin.execute("BEGIN")
    assert admin.execute("SELECT outbox.pause_subscription('default')").fetchone()[0] is True
    # Not committed yet: claims still serve (and do not wait for the pauser).
    t0 = time.monotonic()
    assert len(claim(c, n=1)) == 1
    assert time.monotonic() - t0 < 2
    admin.execute("COMMIT")
    assert claim(c, n=10) == []
    assert claim(c, n=10, subscription="default") == []
    # The lease taken before the pause still acks; a second pause changes nothing.
    assert c.execute("SELECT outbox.ack(%s, %s)", (first_id, tok)).fetchone()[0] is True
    assert c.execute("SELECT outbox.pause_subscription('default')").fetchone()[0] is False
    assert c.execute("SELECT paused, paused_at IS NOT NULL FROM outbox.subscriptions").fetchone() == (True, True)
    health = c.execute("SELECT status, message FROM outbox.health() WHERE check_name = 'subscription'").fetchall()
    assert len(health) == 1 and health[0][0] == "warn" and "paused" in health[0][1], health
    # Events are kept, and come back on resume.
    assert c.execute("SELECT outbox.resume_subscription('default')").fetchone()[0] is True
    assert c.execute("SELECT outbox.resume_subscription('default')").fetchone()[0] is False
    assert sorted(r[0] for r in claim(c, n=10)) == ids[2:]


def test_resume_wakes_listeners(preload, listen):
    c = preload.conn()
    c.execute("SELECT outbox.pause_subscription('default')")
    publish(c)
    lst = listen(preload.dsn)
    lst.collect(0.5)  # the publish's own wake-up
    c.execute("SELECT outbox.resume_subscription('default')")
    assert lst.first(5) is not None, "no notification after resume_subscription"


def test_health_warns_about_a_subscription_nobody_claims_from(plain):
    c = plain.conn()
    publish(c, n=2)
    time.sleep(0.05)
    (status, msg), = c.execute("SELECT status, message FROM outbox.health(backlog_age => '10 ms') "
                               "WHERE check_name = 'subscription'").fetchall()
    assert status == "warn" and "no claim since" in msg, msg
    claim(plain.conn(), n=1)  # a new session notes its claim at once
    (status, msg), = c.execute("SELECT status, message FROM outbox.health(backlog_age => '10 s') "
                               "WHERE check_name = 'subscription'").fetchall()
    assert status == "ok", msg


def test_subscription_lease_overrides_topic_lease_which_overrides_the_guc(plain):
    c = plain.conn()
    c.execute("SET outbox.default_lease = '10 min'")
    publish(c, topic="sub.plain")
    publish(c, topic="sub.leased")
    c.execute("SELECT outbox.create_topic('sub.leased', default_lease => '5 min')")
    # One topic per claim: on the log, events claimed together in one batch
    # round share its expiry, the longest their topics ask for (README).
    (plain_lease,) = [r[3] for r in claim(c, n=10, topics=["sub.plain"])]
    (topic_lease,) = [r[3] for r in claim(c, n=10, topics=["sub.leased"])]
    assert 240 < topic_lease.total_seconds() <= 300 and 540 < plain_lease.total_seconds() <= 600
    c.execute("SELECT outbox.alter_subscription('default', default_lease => '2 min')")
    publish(c, topic="sub.plain")
    publish(c, topic="sub.leased")
    for r in claim(c, n=10):
        assert 100 < r[3].total_seconds() <= 120, r
    # The call's own lease beats them all.
    publish(c, topic="sub.leased")
    (r,) = claim(c, n=10, lease="7 s")
    assert r[3].total_seconds() <= 7


def test_subscription_max_attempts_and_backoff_override_the_topic(plain):
    c = plain.conn()
    c.execute("SELECT outbox.create_topic('sub.retry', max_attempts => 10, backoff_base => '1 hour', backoff_max => '2 hours')")
    (eid,) = publish(c, topic="sub.retry")
    c.execute("SELECT outbox.alter_subscription('default', max_attempts => 2, backoff_base => '1 second', backoff_max => '1 second')")
    (r,) = claim(c)
    assert c.execute("SELECT outbox.fail(%s, %s, 'boom')", (r[0], r[1])).fetchone()[0] == "pending"
    # The subscription's 1 s backoff, not the topic's hour (equal jitter: 0.5 .. 1 s).
    wait = c.execute("SELECT available_at - clock_timestamp() FROM outbox.deliveries "
                     "WHERE subscription = 'default' AND event_id = %s", (eid,)).fetchone()[0]
    assert wait.total_seconds() <= 1.0, wait
    time.sleep(max(wait.total_seconds(), 0) + 0.05)
    (r,) = claim(c)
    assert r[2] == 2
    # The second attempt is the subscription's last, though the topic allows 10.
    assert c.execute("SELECT outbox.fail(%s, %s, 'boom')", (r[0], r[1])).fetchone()[0] == "dead"


def test_subscription_max_attempts_applies_to_expired_leases(plain):
    c = plain.conn()
    c.execute("SELECT outbox.alter_subscription('default', max_attempts => 1)")
    (eid,) = publish(c)
    (r,) = claim(c, lease="50 ms")
    time.sleep(0.1)
    assert claim(c) == []  # the expired last attempt goes dead, it is not handed out again
    state, err = c.execute("SELECT state, last_error FROM outbox.deliveries "
                           "WHERE subscription = 'default' AND event_id = %s", (eid,)).fetchone()
    assert (state, err) == ("dead", "lease expired")


def test_a_lowered_max_attempts_is_never_exceeded_by_a_claim(plain):
    """An event that has used the subscription's attempts is not leased again:
    the claim turns it dead (a pending event with attempts left by the old limit)."""
    c = plain.conn()
    c.execute("SELECT outbox.create_topic('sub.low', max_attempts => 10)")
    (eid,) = publish(c, topic="sub.low")
    for _ in range(3):
        (r,) = claim(c)
        assert c.execute("SELECT outbox.fail(%s, %s, 'x', retry_in => '0')", (r[0], r[1])).fetchone()[0] == "pending"
    c.execute("SELECT outbox.alter_subscription('default', max_attempts => 2)")
    assert claim(c) == []
    state, attempts = c.execute("SELECT state, attempts FROM outbox.deliveries "
                                "WHERE subscription = 'default' AND event_id = %s", (eid,)).fetchone()
    assert (state, attempts) == ("dead", 3)
    assert c.execute("SELECT max_attempts FROM outbox.deliveries WHERE event_id = %s", (eid,)).fetchone()[0] == 2


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"])
def test_pause_and_alter_never_wait_for_or_fail_a_worker(plain, isolation):
    """fail() reads the subscription's settings without locking them: a pause or
    a policy change committed while a worker's transaction is open neither waits
    for it nor makes its fail() raise a serialization failure; and a pause left
    open does not hold up fail(). (A claim is refused at SERIALIZABLE: there
    the worker claims in autocommit and fails in its transaction.)"""
    w, admin = plain.conn(), plain.conn()
    publish(w, n=2)
    if isolation == "SERIALIZABLE":
        rows = claim(w, n=2)
        w.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    else:
        w.execute(f"BEGIN ISOLATION LEVEL {isolation}")
        rows = claim(w, n=2)
    assert len(rows) == 2
    admin.execute("SET lock_timeout = '2s'")
    admin.execute("SELECT outbox.pause_subscription('default')")
    admin.execute("SELECT outbox.alter_subscription('default', backoff_base => '1 second')")
    assert w.execute("SELECT outbox.fail(%s, %s, 'x')", (rows[0][0], rows[0][1])).fetchone()[0] == "pending"
    admin.execute("BEGIN")
    admin.execute("SELECT outbox.resume_subscription('default')")
    w.execute("SET LOCAL lock_timeout = '2s'")
    assert w.execute("SELECT outbox.fail(%s, %s, 'x')", (rows[1][0], rows[1][1])).fetchone()[0] == "pending"
    w.execute("COMMIT")
    admin.execute("COMMIT")


def test_a_claim_holding_its_activity_note_never_makes_fail_or_other_claims_wait(plain):
    """The claim's note goes to outbox.subscription_activity, not the catalog row
    that fail() locks FOR SHARE: a transactional worker that claims and keeps its
    transaction open must not stall other workers' fail() or claim()."""
    holder, other = plain.conn(), plain.conn()
    ids = publish_apart(holder, 3)
    (r,) = claim(other, worker="other", n=1)
    holder.execute("BEGIN")
    (h,) = claim(holder, worker="holder", n=1)  # notes its time, keeps the row lock open
    other.execute("SET lock_timeout = '2s'")
    t0 = time.monotonic()
    assert other.execute("SELECT outbox.fail(%s, %s, 'x', '1 hour')", (r[0], r[1])).fetchone()[0] == "pending"
    time.sleep(1.1)  # past the once-a-second note interval of `other`'s session
    got = claim(other, worker="other", n=1)
    assert time.monotonic() - t0 < 3
    assert [x[0] for x in got] == sorted(set(ids) - {r[0], h[0]})
    holder.execute("ROLLBACK")


def test_a_claim_under_repeatable_read_skips_a_changed_activity_row(plain):
    """Under REPEATABLE READ the activity row may have been updated since the
    snapshot; the note is skipped (`_lock_row`), never a serialization failure."""
    rr, other = plain.conn(), plain.conn()
    publish(rr, n=2)
    rr.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    rr.execute("SELECT 1 FROM outbox.subscription_catalog")  # take the snapshot
    other.execute("UPDATE outbox.subscription_activity SET last_claim_at = now() WHERE name = 'default'")
    assert len(claim(rr, n=1)) == 1
    rr.execute("COMMIT")


def test_unknown_and_malformed_subscriptions_are_refused_before_any_change(plain):
    c = plain.conn()
    (eid,) = publish(c)
    (r,) = claim(c)
    assert c.execute("SELECT outbox.fail(%s, %s, 'x', permanent => true)", (r[0], r[1])).fetchone()[0] == "dead"
    for sql, state in [
        ("SELECT * FROM outbox.claim('w', 1, subscription => 'nope')", "42704"),
        ("SELECT * FROM outbox.claim('w', 1, subscription => 'Nope')", "22023"),
        ("SELECT outbox.replay(%s, 'nope')" % eid, "42704"),
        ("SELECT outbox.cancel(%s, 'nope')" % eid, "42704"),
        ("SELECT outbox.replay_dead(subscription => 'nope')", "42704"),
        ("SELECT outbox.pause_subscription('nope')", "42704"),
        ("SELECT outbox.alter_subscription('nope', max_attempts => 1)", "42704"),
    ]:
        assert sqlstate(c, sql) == state, sql
    assert c.execute("SELECT state FROM outbox.deliveries WHERE subscription = 'default' AND event_id = %s",
                     (eid,)).fetchone()[0] == "dead"
    assert c.execute("SELECT outbox.replay(%s, 'default')", (eid,)).fetchone()[0] is True


def test_replaced_functions_have_one_signature(plain):
    """claim, replay, replay_dead and cancel were replaced, not overloaded, so a
    call with positional arguments is never ambiguous."""
    c = plain.conn()
    got = dict(c.execute("SELECT proname, count(*) FROM pg_proc WHERE pronamespace = 'outbox'::regnamespace "
                         "AND proname IN ('claim', 'replay', 'replay_dead', 'cancel') GROUP BY 1").fetchall())
    assert got == {"claim": 1, "replay": 1, "replay_dead": 1, "cancel": 1}


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
def test_pause_and_claim_at_every_isolation_level_a_claim_runs_at(plain, isolation):
    c, admin = plain.conn(), plain.conn()
    publish(c, n=2)
    c.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    assert len(claim(c, n=1)) == 1
    admin.execute("SELECT outbox.pause_subscription('default')")
    # A claim that starts after the pause returned finds it, at every isolation
    # level (the settings cache reloads under a fresh snapshot).
    assert claim(c, n=1) == []
    c.execute("COMMIT")
    assert claim(c, n=1) == []


def test_a_rolled_back_change_is_forgotten_by_the_session_that_made_it(plain):
    """The settings cache follows the transaction: a pause or a lease change made
    and rolled back in a session is not applied by that session's next claims."""
    c = plain.conn()
    publish_apart(c, 2)
    c.execute("BEGIN")
    c.execute("SELECT outbox.pause_subscription('default')")
    c.execute("SELECT outbox.alter_subscription('default', default_lease => '3 s')")
    assert claim(c, n=1) == []  # its own uncommitted pause applies to itself
    c.execute("ROLLBACK")
    (r,) = claim(c, n=1)
    assert r[3].total_seconds() > 3, r  # the GUC default lease, not the rolled-back 3 s
    c.execute("BEGIN")
    c.execute("SAVEPOINT s")
    c.execute("SELECT outbox.pause_subscription('default')")
    c.execute("ROLLBACK TO SAVEPOINT s")
    assert len(claim(c, n=1)) == 1
    c.execute("COMMIT")


def _cold_cache_claim_blocked_behind(plain, change_sql):
    """Session A's cache is made stale by an unrelated invalidation; X locks the
    catalog, makes `change_sql` and commits while A's claim (reloading its
    cache) waits for X's lock. Returns A's connection after that claim."""
    a, x = plain.conn(), plain.conn()
    publish(a, n=3)
    assert len(claim(a, n=1)) == 1  # warm cache and saved plans
    x.execute("CREATE TABLE IF NOT EXISTS public.cache_dummy (i int)")
    x.execute("ALTER TABLE public.cache_dummy ALTER COLUMN i SET STATISTICS 10")  # any relcache invalidation
    x.execute("BEGIN")
    x.execute("LOCK outbox.subscription_catalog IN ACCESS EXCLUSIVE MODE")
    x.execute(change_sql)
    done = threading.Event()
    errs = []

    def blocked():
        try:
            claim(a, n=1)
        except psycopg.Error as e:
            errs.append(e.sqlstate)
        done.set()

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.3)
    x.execute("COMMIT")
    t.join(10)
    assert done.is_set()
    return a, errs


def test_a_pause_committed_while_a_session_reloads_its_cache_is_not_lost(plain):
    """The reload's snapshot is taken before its lock, where the pause's
    invalidation is read: the copy is read again, not kept (found by review)."""
    a, errs = _cold_cache_claim_blocked_behind(plain, "SELECT outbox.pause_subscription('default')")
    assert errs == [], f"the claim that waited for the pause raised {errs}"
    for _ in range(3):
        assert claim(a, n=1) == [], "a claim after the pause committed got rows"
        time.sleep(0.1)


def test_a_catalog_truncated_and_refilled_while_a_session_reloads_is_read_again(plain):
    a, errs = _cold_cache_claim_blocked_behind(
        plain, "CREATE TEMP TABLE catalog_copy AS SELECT * FROM outbox.subscription_catalog; "
        "TRUNCATE outbox.subscription_catalog; "
        "INSERT INTO outbox.subscription_catalog SELECT * FROM catalog_copy")
    # The waiting claim itself read the catalog across the TRUNCATE: a stale empty copy raised 42704.
    assert errs == [], f"the claim that waited for the TRUNCATE raised {errs}"
    assert len(claim(a, n=1)) == 1  # 'default' exists: no 42704 from a stale empty copy


def test_a_change_made_with_replica_triggers_reaches_the_cache(plain):
    """The cache trigger is enabled ALWAYS: a change applied as a replica
    (logical replication, session_replication_role = replica) invalidates too."""
    a, x = plain.conn(), plain.conn()
    publish(a, n=2)
    assert len(claim(a, n=1)) == 1
    x.execute("SET session_replication_role = replica")
    x.execute("UPDATE outbox.subscription_catalog SET paused = true WHERE name = 'default'")
    assert claim(a, n=1) == []
