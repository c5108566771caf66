"""The extension's lifecycle: pg_dump / restore round trip, and the
DROP EXTENSION guard. Each test works in databases of its own on the plain cluster.
"""

import json
import os
import subprocess
import threading
import time
from collections import Counter

import psycopg
import pytest

from conftest import connect
from scratch_db import create_db, drop_db

PG_BIN = os.environ.get("PG_BINDIR", "/usr/lib/postgresql/15/bin")
SRC_DB = "outbox_t_dump_src"
LEASE_S = 5  # the 'leased' event's lease, so the restored lease expires during the drain
DELAY_S = 4  # the delayed event's deliver_at
RETRY_S = 3  # the retry-scheduled event's retry_in


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}"
    return r


def one(c, q, p=None):
    return c.execute(q, p).fetchone()[0]


def claim1(c, topic, lease="1 min"):
    rows = c.execute("SELECT id, lease_token FROM outbox.claim('setup', 10, %s::interval, ARRAY[%s])", (lease, topic)).fetchall()
    assert len(rows) == 1, rows
    return rows[0]


def build_source(dsn):
    """Events in every state, topics with policies, dispatch keys, a maintenance
    run. Returns {name: id}."""
    ids = {}
    with connect(dsn) as c:
        # Load the library before create_topic reads outbox.max_lease (BUG-S7).
        c.execute("SELECT outbox.backoff_delay(1)")
        c.execute("SELECT outbox.create_topic('d.orders', max_attempts => 5, backoff_base => '2 s', "
                  "backoff_max => '1 min', retention_delivered => '3 days')")
        c.execute("SELECT outbox.create_topic('d.pay', max_attempts => 2, dead_letter_policy => 'block')")
        c.execute("SELECT outbox.create_topic('d.mail', default_lease => '2 min', dead_letter_policy => 'skip', "
                  "retention_dead => '10 days')")

        casts = {"subject": "text", "dispatch_key": "text", "headers": "jsonb", "deliver_at": "timestamptz"}

        def pub(name, topic, payload, **kw):
            args = "".join(f", {k} => %({k})s::{casts[k]}" for k in kw)
            ids[name] = one(c, f"SELECT outbox.publish(%(t)s, %(p)s::jsonb{args})",
                            {"t": topic, "p": json.dumps(payload), **kw})

        # pending: a subject head, the event queued behind it, headers, a dispatch key
        pub("head", "d.orders", {"n": 1, "s": "ünïcødé \u2603"}, subject="o-1", dispatch_key="dk-head",
            headers=json.dumps({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}))
        pub("next", "d.orders", {"n": 2}, subject="o-1")
        # delayed
        ids["delayed"] = one(c, "SELECT outbox.publish('d.mail', '{\"n\": 3}', "
                                "deliver_at => clock_timestamp() + %s * interval '1 s')", (DELAY_S,))
        # dead after two failed attempts (history kept), blocking its subject
        pub("dead", "d.pay", {"n": 4}, subject="o-2", dispatch_key="dk-dead")
        pub("blocked", "d.pay", {"n": 5}, subject="o-2")
        i, tok = claim1(c, "d.pay")
        assert one(c, "SELECT outbox.fail(%s, %s, 'timeout after 30 s', '0')", (i, tok)) == "pending"
        i, tok = claim1(c, "d.pay")
        assert one(c, "SELECT outbox.fail(%s, %s, 'HTTP 500: {\"x\": \"y\"}')", (i, tok)) == "dead"
        # pending again, waiting for its retry, with one failure in its history
        pub("retry", "d.retry", {"n": 6})
        i, tok = claim1(c, "d.retry")
        assert one(c, "SELECT outbox.fail(%s, %s, 'connection refused', %s * interval '1 s')", (i, tok, RETRY_S)) == "pending"
        # delivered and cancelled, with dispatch keys
        pub("delivered", "d.done", {"n": 7}, dispatch_key="dk-delivered")
        i, tok = claim1(c, "d.done")
        assert one(c, "SELECT outbox.ack(%s, %s)", (i, tok))
        pub("cancelled", "d.done", {"n": 8}, dispatch_key="dk-cancelled")
        assert one(c, "SELECT outbox.cancel(%s)", (ids["cancelled"],))
        # some volume, with subjects and keys
        c.execute("SELECT outbox.publish_batch('d.bulk', array_agg(jsonb_build_object('g', g) ORDER BY g), "
                  "array_agg('b-' || g % 5 ORDER BY g), array_agg('dk-bulk-' || g ORDER BY g)) FROM generate_series(1, 50) g")
        c.execute("CALL outbox.run_maintenance()")
        assert one(c, "SELECT outbox.inbox_receive('dump-consumer', 'm-1')")
        # the default subscription's own policy (the restore's CREATE EXTENSION
        # makes 'default' again: the dumped row must update it, not collide)
        c.execute("SELECT outbox.alter_subscription('default', max_attempts => 7, backoff_base => '2 seconds')")
        # leased, last, so the lease is still running at dump time
        pub("leased", "d.lease", {"n": 9})
        ids["leased_token"] = claim1(c, "d.lease", f"{LEASE_S} seconds")[1]
    return ids


SNAPSHOT = {
    "log_exceptions": "SELECT * FROM outbox.log_exceptions ORDER BY subscription, id",
    "events": "SELECT * FROM outbox.events ORDER BY id",
    "topics": "SELECT * FROM outbox.topics ORDER BY topic",
    "subscriptions": "SELECT * FROM outbox.subscription_catalog ORDER BY name",
    "dispatch_keys": "SELECT * FROM outbox.dispatch_keys ORDER BY dispatch_key",
    "maintenance_runs": "SELECT * FROM outbox.maintenance_runs ORDER BY run_id",
    "sequence": "SELECT last_value, is_called FROM outbox.event_id_seq",
    "log": " UNION ALL ".join(f"SELECT {n} AS t, * FROM outbox.log_{n}" for n in range(4)) + " ORDER BY id",
    "log_state": "SELECT * FROM outbox.log_state ORDER BY n",
    "identity": "SELECT * FROM outbox.identity",
    "inbox": "SELECT * FROM outbox.inbox ORDER BY consumer, message_id",
}




def snapshot(dsn):
    with connect(dsn) as c:
        return {k: c.execute(q).fetchall() for k, q in SNAPSHOT.items()}


@pytest.fixture(scope="module")
def dumped(plain_dsn, tmp_path_factory):
    """The source database, built once, dumped in custom and plain format.
    Named subscriptions through a dump: test_log_subscriptions_survive_dump_and_restore."""
    src = create_db(plain_dsn, SRC_DB)
    ids = build_source(src)
    d = tmp_path_factory.mktemp("dump")
    files = {"custom": d / "src.dump", "plain": d / "src.sql"}
    run([f"{PG_BIN}/pg_dump", "-Fc", "-d", src, "-f", str(files["custom"])])
    run([f"{PG_BIN}/pg_dump", "-Fp", "-d", src, "-f", str(files["plain"])])
    snap = snapshot(src)
    built_at = time.monotonic()
    yield {"ids": ids, "files": files, "snap": snap, "built_at": built_at, "src": src}
    drop_db(plain_dsn, SRC_DB)


def restore(plain_dsn, dumped, fmt, name):
    dsn = create_db(plain_dsn, name, extension=False)
    f = str(dumped["files"][fmt])
    if fmt == "custom":
        run([f"{PG_BIN}/pg_restore", "--exit-on-error", "-d", dsn, f])
    else:
        run([f"{PG_BIN}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", f])
    return dsn


def test_source_has_every_state(dumped):
    states = Counter(r[6] for r in dumped["snap"]["events"])
    assert set(states) == {"pending", "leased", "dead", "delivered", "cancelled"}
    # The source's log ring holds every event once, and maintenance recorded its
    # open table.
    assert sorted(r[1] for r in dumped["snap"]["log"]) == sorted(r[0] for r in dumped["snap"]["events"])
    assert [r[0] for r in dumped["snap"]["log_state"]] == [0]


@pytest.mark.parametrize("fmt", ["custom", "plain"])
def test_dump_restore_round_trip_and_drain(plain_dsn, dumped, fmt):
    name = f"outbox_t_dump_dst_{fmt}"
    ids = dumped["ids"]
    try:
        dst = restore(plain_dsn, dumped, fmt, name)
        got = snapshot(dst)
        for k in SNAPSHOT:
            # The log too (0.11.0), as dumped until its rebase (no subscription
            # of the log claims here; test_log_subscriptions_survive_... below).
            assert got[k] == dumped["snap"][k], f"{k} differs after restore"

        c = connect(dst)
        try:
            by_id = {r[0]: r for r in c.execute("SELECT id, state, attempts, jsonb_array_length(errors), "
                                                "available_at > now(), lease_expires_at FROM outbox.events").fetchall()}
            assert by_id[ids["head"]][1:4] == ("pending", 0, None)
            assert by_id[ids["dead"]][1:4] == ("dead", 2, 2)
            assert by_id[ids["retry"]][1:4] == ("pending", 1, 1)
            assert by_id[ids["delivered"]][1] == "delivered"
            assert by_id[ids["cancelled"]][1] == "cancelled"
            assert by_id[ids["leased"]][1] == "leased"
            errors = one(c, "SELECT errors FROM outbox.events WHERE id = %s", (ids["dead"],))
            assert [e["error"] for e in errors] == ["timeout after 30 s", 'HTTP 500: {"x": "y"}']

            # The sequence continues after the restored ids; dispatch keys still dedupe.
            max_id = one(c, "SELECT max(id) FROM outbox.events")
            new = one(c, "SELECT outbox.publish('d.after', '{}')")
            assert new > max_id
            assert one(c, "SELECT outbox.publish('d.orders', '{}', dispatch_key => 'dk-head')") == ids["head"]
            assert one(c, "SELECT outbox.publish('d.done', '{}', dispatch_key => 'dk-delivered')") == ids["delivered"]
            assert one(c, "SELECT outbox.publish('d.bulk', '{}', dispatch_key => 'dk-bulk-7')") < max_id
            assert one(c, "SELECT count(*) FROM outbox.events") == len(got["events"]) + 1

            # Drain: replay the dead, then claim + ack until nothing is left. The
            # first claim rebases the restored log (sql/restore.sql): what
            # 'default' had not finished becomes rows of their own.
            undelivered = {r[0] for r in c.execute(
                "SELECT event_id FROM outbox.deliveries WHERE subscription = 'default' "
                "AND state IN ('pending', 'leased', 'dead')").fetchall()}
            assert one(c, "SELECT outbox.replay_dead()") == 1
            order = []
            deadline = time.monotonic() + LEASE_S + DELAY_S + 15
            while True:
                rows = c.execute("SELECT id, lease_token FROM outbox.claim('drain', 100, '1 min')").fetchall()
                for i, tok in rows:
                    assert one(c, "SELECT outbox.ack(%s, %s)", (i, tok)), f"ack of {i} refused"
                    order.append(i)
                if rows:
                    continue
                if one(c, "SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' "
                          "AND state IN ('pending', 'leased', 'dead')") == 0:
                    break
                assert time.monotonic() < deadline, (
                    "restored outbox did not drain: "
                    f"{c.execute('SELECT id, state, available_at, lease_expires_at FROM outbox.events WHERE state NOT IN (%s, %s)', ('delivered', 'cancelled')).fetchall()}")
                time.sleep(0.2)
            dup = [i for i, n in Counter(order).items() if n > 1]
            assert not dup, f"delivered twice: {dup}"
            assert set(order) == undelivered
            # Subject order survived the restore.
            assert order.index(ids["head"]) < order.index(ids["next"])
            assert order.index(ids["dead"]) < order.index(ids["blocked"])
            states = dict(c.execute("SELECT state, count(*) FROM outbox.events GROUP BY state").fetchall())
            assert states == {"delivered": len(got["events"]), "cancelled": 1}
            assert c.execute("SELECT * FROM outbox.claim('drain', 100, '1 min')").fetchall() == []
        finally:
            c.close()
    finally:
        drop_db(plain_dsn, name)


def test_restored_maintenance_continues(plain_dsn, dumped):
    """maintenance_runs rows are dumped, so its run_id counter must be too."""
    name = "outbox_t_dump_dst_maint"
    try:
        dst = restore(plain_dsn, dumped, "custom", name)
        with connect(dst) as c:
            c.execute("SELECT outbox.backoff_delay(1)")  # load the library first (BUG-S7)
            before = one(c, "SELECT count(*) FROM outbox.maintenance_log")
            assert before == 1
            c.execute("CALL outbox.run_maintenance()")
            assert one(c, "SELECT count(*) FROM outbox.maintenance_log") == before + 1
    finally:
        drop_db(plain_dsn, name)


# ---------------------------------------------------------------------------
# DROP EXTENSION guard
# ---------------------------------------------------------------------------
GUARD_DB = "outbox_t_guard"


@pytest.fixture
def guard_db(plain_dsn):
    dsn = create_db(plain_dsn, GUARD_DB)
    yield dsn
    drop_db(plain_dsn, GUARD_DB)


def extension_state(dsn):
    with connect(dsn) as c:
        if not c.execute("SELECT 1 FROM pg_extension WHERE extname = 'outbox_ext'").fetchone():
            return None
        return {
            "events": c.execute("SELECT * FROM outbox.events ORDER BY id").fetchall(),
            "topics": c.execute("SELECT * FROM outbox.topics").fetchall(),
            "keys": c.execute("SELECT * FROM outbox.dispatch_keys").fetchall(),
            "guard": c.execute("SELECT evtenabled FROM pg_event_trigger WHERE evtname = 'outbox_drop_guard'").fetchall(),
        }


def make_undelivered(dsn, kind):
    with connect(dsn) as c:
        c.execute("SELECT outbox.create_topic('g.t')")
        c.execute("SELECT outbox.publish('g.done', '{}')")
        i, tok = claim1(c, "g.done")
        c.execute("SELECT outbox.ack(%s, %s)", (i, tok))
        if kind == "pending":
            c.execute("SELECT outbox.publish('g.t', '{}', dispatch_key => 'g-k')")
        elif kind == "delayed":
            c.execute("SELECT outbox.publish('g.t', '{}', deliver_at => now() + interval '1 hour')")
        elif kind == "leased":
            c.execute("SELECT outbox.publish('g.t', '{}')")
            claim1(c, "g.t")
        elif kind == "dead":
            c.execute("SELECT outbox.publish('g.t', '{}')")
            i, tok = claim1(c, "g.t")
            assert one(c, "SELECT outbox.fail(%s, %s, 'x', permanent => true)", (i, tok)) == "dead"
        else:
            raise AssertionError(kind)


def drop_error(dsn, *stmts):
    """Run stmts in one new session; the SQLSTATE of the first error, or None."""
    with connect(dsn) as c:
        try:
            for s in stmts:
                c.execute(s)
        except psycopg.Error as e:
            return e.sqlstate
    return None


@pytest.mark.parametrize("kind", ["pending", "delayed", "leased", "dead"])
def test_drop_refused_while_undelivered(guard_db, kind):
    make_undelivered(guard_db, kind)
    before = extension_state(guard_db)
    assert drop_error(guard_db, "DROP EXTENSION outbox_ext") == "55006"
    assert extension_state(guard_db) == before
    # Still fully working.
    with connect(guard_db) as c:
        c.execute("SELECT outbox.publish('g.after', '{}')")
        i, tok = claim1(c, "g.after")
        assert one(c, "SELECT outbox.ack(%s, %s)", (i, tok))


@pytest.mark.parametrize("stmt", [
    'drop extension "outbox_ext"',
    "DROP EXTENSION IF EXISTS outbox_ext RESTRICT",
    "DROP EXTENSION\n  outbox_ext",
])
def test_drop_refused_whatever_the_spelling(guard_db, stmt):
    make_undelivered(guard_db, "pending")
    before = extension_state(guard_db)
    assert drop_error(guard_db, stmt) == "55006"
    assert extension_state(guard_db) == before


@pytest.mark.parametrize("stmt", [
    # A migration script sent as one query string: the CASCADE belongs to another statement.
    "CREATE TABLE guard_tmp (); DROP TABLE guard_tmp CASCADE; DROP EXTENSION outbox_ext",
    "DROP EXTENSION outbox_ext -- never use cascade here",
    # "cascade" as a name in the list (an extension that does not exist, skipped), not
    # the drop behaviour: found by a break attempt, which lost 3 events this way.
    "DROP EXTENSION IF EXISTS outbox_ext, cascade",
    "DROP EXTENSION IF EXISTS outbox_ext,\n  cascade",
])
def test_drop_guard_not_fooled_by_cascade_elsewhere_in_the_query(guard_db, stmt):
    make_undelivered(guard_db, "pending")
    before = extension_state(guard_db)
    assert drop_error(guard_db, stmt) == "55006"
    assert extension_state(guard_db) == before


def test_drop_cascade_succeeds(guard_db):
    make_undelivered(guard_db, "pending")
    assert drop_error(guard_db, "DROP EXTENSION outbox_ext CASCADE") is None
    assert extension_state(guard_db) is None
    with connect(guard_db) as c:
        # The schema itself comes from the control file and is not an extension
        # member, so PostgreSQL leaves it behind, empty.
        assert c.execute("SELECT count(*) FROM pg_class WHERE relnamespace = 'outbox'::regnamespace").fetchone()[0] == 0
        assert c.execute("SELECT count(*) FROM pg_proc WHERE pronamespace = 'outbox'::regnamespace").fetchone()[0] == 0
        assert not c.execute("SELECT 1 FROM pg_event_trigger WHERE evtname = 'outbox_drop_guard'").fetchone()
        # Roles are cluster-wide and stay.
        assert c.execute("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'outbox\\_%'").fetchone()[0] >= 3


@pytest.mark.parametrize("setting", [
    ["SET outbox.allow_drop = on"],
    ["BEGIN", "SET LOCAL outbox.allow_drop = on"],
    # A boolean GUC: every boolean spelling, also before the library is loaded in the session.
    ["SET outbox.allow_drop = true"],
    ["SET outbox.allow_drop = 1"],
], ids=["set", "set-local", "true", "1"])
def test_drop_with_allow_drop_succeeds(guard_db, setting):
    make_undelivered(guard_db, "leased")
    stmts = [*setting, "DROP EXTENSION outbox_ext"] + (["COMMIT"] if setting[0] == "BEGIN" else [])
    assert drop_error(guard_db, *stmts) is None
    assert extension_state(guard_db) is None


def test_allow_drop_after_a_refusal_in_the_same_session(guard_db):
    make_undelivered(guard_db, "pending")
    with connect(guard_db) as c:
        with pytest.raises(psycopg.errors.ObjectInUse):
            c.execute("DROP EXTENSION outbox_ext")
        c.execute("SET outbox.allow_drop = on")
        c.execute("DROP EXTENSION outbox_ext")
    assert extension_state(guard_db) is None


def test_plain_drop_succeeds_without_undelivered_events(guard_db):
    with connect(guard_db) as c:
        c.execute("SELECT outbox.publish_batch('g.t', ARRAY['1', '2', '3']::jsonb[])")
        rows = c.execute("SELECT id, lease_token FROM outbox.claim('w', 10)").fetchall()
        c.execute("SELECT outbox.ack(%s, %s)", rows[0])
        c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([rows[1][0]], [rows[1][1]]))
        c.execute("SELECT outbox.fail(%s, %s, 'x', '1 hour')", rows[2])
        c.execute("SELECT outbox.cancel(%s)", (rows[2][0],))
        states = Counter(r[0] for r in c.execute("SELECT state FROM outbox.events").fetchall())
        assert states == {"delivered": 2, "cancelled": 1}
    assert drop_error(guard_db, "DROP EXTENSION outbox_ext") is None
    assert extension_state(guard_db) is None


# ---------------------------------------------------------------------------
# The log and its subscriptions through a dump (0.11.0, sql/restore.sql):
# restored into the other cluster, whose transaction ids are far behind the
# source's, so every dumped txid is in the restoring cluster's future.
# ---------------------------------------------------------------------------
LOG_SRC = "outbox_t_dump_log_src"
LOG_DST = "outbox_t_dump_log_dst"


def next_xid(dsn):
    with connect(dsn) as c:
        return int(one(c, "SELECT pg_current_xact_id()::text"))


def burn_xids(dsn, n):
    with connect(dsn) as c:
        c.execute(f"DO $$ BEGIN FOR i IN 1..{int(n)} LOOP PERFORM pg_current_xact_id(); COMMIT; END LOOP; END $$")


def claim_sub(c, sub, n=100, lease="1 min", topics=None):
    return c.execute("SELECT id, lease_token, subject, attempt FROM outbox.claim('w', %s, %s::interval, %s, %s)",
                     (n, lease, topics, sub)).fetchall()


def build_log_source(dsn):
    """Two subscriptions of the log ('a': every topic, 'b': l.x only) with
    events in every state. Returns (ids, expected): expected[sub] = the ids
    each must still receive after a restore."""
    ids = {}
    with connect(dsn) as c:
        c.execute("SELECT outbox.backoff_delay(1)")
        # One event before 'b' exists: not b's.
        ids["before_b"] = one(c, "SELECT outbox.publish('l.x', '{\"n\": 0}', 'early')")
        c.execute("SELECT outbox.create_subscription('a')")
        c.execute("SELECT outbox.create_subscription('b', ARRAY['l.x'], max_attempts => 3)")
        for s in ("s1", "s2", "s3"):
            for k in range(4):
                ids[f"{s}-{k}"] = one(c, "SELECT outbox.publish('l.x', %s::jsonb, %s)", (f'{{"k": {k}}}', s))
        for k in range(6):
            ids[f"y-{k}"] = one(c, "SELECT outbox.publish('l.y', %s::jsonb)", (f'{{"k": {k}}}',))
        ids["delayed"] = one(c, "SELECT outbox.publish('l.x', '{}', deliver_at => clock_timestamp() + interval '3 s')")
        ids["cancel_me"] = one(c, "SELECT outbox.publish('l.y', '{\"c\": 1}')")
        ids["dk"] = one(c, "SELECT outbox.publish('l.y', '{}', dispatch_key => 'dk-log')")
        # a: cancel one unread event; a claim takes one per subject plus the
        # subjectless ones; ack some, fail one (retry), kill one (dead, blocks s3),
        # leave the rest leased.
        assert one(c, "SELECT outbox.cancel(%s, 'a')", (ids["cancel_me"],))
        got = {r[0]: r for r in claim_sub(c, "a", 50)}
        assert ids["s1-0"] in got and ids["s2-0"] in got and ids["s3-0"] in got, got
        assert one(c, "SELECT outbox.ack(%s, %s)", (ids["s1-0"], got[ids["s1-0"]][1]))
        assert one(c, "SELECT outbox.fail(%s, %s, 'flaky', '0')", (ids["s2-0"], got[ids["s2-0"]][1])) == "pending"
        assert one(c, "SELECT outbox.fail(%s, %s, 'broken', permanent => true)", (ids["s3-0"], got[ids["s3-0"]][1])) == "dead"
        acked_a = {ids["s1-0"]}
        for i, (eid, tok, _, _) in enumerate(sorted(v for k, v in got.items() if k not in (ids["s1-0"], ids["s2-0"], ids["s3-0"]))):
            if i % 2 == 0:
                assert one(c, "SELECT outbox.ack(%s, %s)", (eid, tok))
                acked_a.add(eid)
        # b: ack everything of its first claim.
        acked_b = set()
        for eid, tok, _, _ in claim_sub(c, "b", 10):
            assert one(c, "SELECT outbox.ack(%s, %s)", (eid, tok))
            acked_b.add(eid)
        all_x = {v for k, v in ids.items() if k.startswith("s") or k == "delayed"}
        all_y = {v for k, v in ids.items() if k.startswith("y-") or k in ("cancel_me", "dk")}
        expected = {
            # every own event neither acked, cancelled nor dead
            "a": (all_x | all_y) - acked_a - {ids["cancel_me"], ids["s3-0"]},
            "b": all_x - acked_b,
        }
    return ids, expected


@pytest.fixture
def log_restored(plain_dsn, preload_dsn, tmp_path):
    src = create_db(plain_dsn, LOG_SRC)
    dst_admin = preload_dsn
    # The source's ids far ahead of the restoring cluster's.
    gap = next_xid(dst_admin) - next_xid(plain_dsn) + 3000
    if gap > 0:
        burn_xids(src, gap)
    ids, expected = build_log_source(src)
    with connect(src) as c:
        src_view = c.execute("SELECT subscription, event_id, state, attempts FROM outbox.deliveries "
                             "WHERE subscription <> 'default' ORDER BY 1, 2").fetchall()
        src_id = one(c, "SELECT outbox.outbox_id()")
    f = tmp_path / "log.dump"
    run([f"{PG_BIN}/pg_dump", "-Fc", "-d", src, "-f", str(f)])
    dst = create_db(dst_admin, LOG_DST, extension=False)
    run([f"{PG_BIN}/pg_restore", "--exit-on-error", "-d", dst, str(f)])
    yield {"src": src, "dst": dst, "ids": ids, "expected": expected, "src_view": src_view, "src_id": src_id}
    drop_db(plain_dsn, LOG_SRC)
    drop_db(dst_admin, LOG_DST)


def drain_sub(c, sub, seconds=20, blocked=()):
    """Claim and ack until nothing is ready and nothing pending remains but
    the events in `blocked` (behind a dead letter); the order of claims."""
    order = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rows = claim_sub(c, sub)
        for eid, tok, _, _ in rows:
            assert one(c, "SELECT outbox.ack(%s, %s)", (eid, tok)), f"{sub}: ack of {eid} refused"
            order.append(eid)
        if not rows:
            left = one(c, "SELECT count(*) FROM outbox.deliveries WHERE subscription = %s AND state IN ('pending', 'leased') "
                          "AND event_id <> ALL (%s)", (sub, list(blocked)))
            if left == 0:
                return order
            time.sleep(0.2)
    raise AssertionError(f"{sub} did not drain: {order}")


def test_log_subscriptions_survive_dump_and_restore(log_restored):
    r = log_restored
    ids = r["ids"]
    with connect(r["dst"]) as c:
        # Restored as dumped, waiting for its rebase; the identity is the source's.
        assert one(c, "SELECT outbox.outbox_id()") == r["src_id"]
        assert one(c, "SELECT count(*) FROM outbox.log_restore") == 1
        assert c.execute("SELECT subscription, event_id, state, attempts FROM outbox.deliveries "
                         "WHERE subscription <> 'default' ORDER BY 1, 2").fetchall() == r["src_view"]
        health = dict((n, (s, m)) for n, s, _, m in c.execute("SELECT * FROM outbox.health()").fetchall())
        assert health["log_ring"][0] == "warn" and "restored from a dump" in health["log_ring"][1]
        # Published here before any claim: committed, and one still open across the rebase.
        native = one(c, "SELECT outbox.publish('l.x', '{\"native\": 1}', 's1')")
        late = connect(r["dst"], autocommit=False)
        try:
            late_id = one(late, "SELECT outbox.publish('l.y', '{\"native\": 2}')")
            # The first claim rebases.
            first = claim_sub(c, "b", 1)
            assert one(c, "SELECT count(*) FROM outbox.log_restore") == 0
            assert one(c, "SELECT count(*) FROM outbox.log WHERE id <= %s AND txid <> '2'", (ids["dk"],)) == 0
            late.commit()
        finally:
            late.close()
        # Dispatch keys still dedupe against restored log events.
        assert one(c, "SELECT outbox.publish('l.y', '{}', dispatch_key => 'dk-log')") == ids["dk"]
        for eid, tok, _, _ in first:
            assert one(c, "SELECT outbox.ack(%s, %s)", (eid, tok))
        behind_dead = [ids[f"s3-{k}"] for k in (1, 2, 3)]
        order = {"a": drain_sub(c, "a", blocked=behind_dead), "b": [e for e, _, _, _ in first] + drain_sub(c, "b")}
        want = {"a": r["expected"]["a"] - set(behind_dead) | {native, late_id}, "b": r["expected"]["b"] | {native}}
        for sub in ("a", "b"):
            dup = [i for i, n in Counter(order[sub]).items() if n > 1]
            assert not dup, f"{sub} delivered twice: {dup}"
            assert set(order[sub]) == want[sub], (sub, sorted(set(order[sub]) ^ want[sub]))
            # Per-subject order: each subject's events in id (= commit) order.
            subj = dict(c.execute("SELECT id, subject FROM outbox.log WHERE subject IS NOT NULL").fetchall())
            for s in {subj[i] for i in order[sub] if i in subj}:
                seq = [i for i in order[sub] if subj.get(i) == s]
                assert seq == sorted(seq), (sub, s, seq)
        # Not b's: committed before it existed. The dead letter stays dead and
        # holds its subject; the cancelled event stays cancelled.
        assert ids["before_b"] not in order["b"]
        states = dict(c.execute("SELECT event_id, state FROM outbox.deliveries WHERE subscription = 'a'").fetchall())
        assert states[ids["s3-0"]] == "dead" and states[ids["cancel_me"]] == "cancelled"
        assert states[ids["s3-1"]] == "pending" and ids["s3-1"] not in order["a"]
        # The retry kept its history: its second delivery was attempt 2.
        assert one(c, "SELECT attempts FROM outbox.deliveries WHERE subscription = 'a' AND event_id = %s",
                   (ids["s2-0"],)) == 2
        # Nothing waits any more, and the log's maintenance runs again.
        c.execute("CALL outbox.run_maintenance()")
        assert one(c, "SELECT status FROM outbox.health() WHERE check_name = 'log_ring'") == "ok"


def test_maintenance_rebases_a_restore_once_it_is_over(log_restored):
    r = log_restored
    with connect(r["dst"]) as c:
        c.execute("SELECT outbox.backoff_delay(1)")
        # Just restored: the worker's log step leaves it alone.
        assert one(c, "SELECT outbox._log_restore_quiet()") is False
        c.execute("UPDATE outbox.log_restore SET restored_at = now() - interval '2 minutes'")
        # A pg_restore still connected keeps it waiting.
        other = psycopg.connect(r["dst"], autocommit=True, application_name="pg_restore")
        try:
            assert one(c, "SELECT outbox._log_restore_quiet()") is False
        finally:
            other.close()
        time.sleep(0.3)
        assert one(c, "SELECT outbox._log_restore_quiet()") is True
        c.execute("CALL outbox.run_maintenance()")
        assert one(c, "SELECT count(*) FROM outbox.log_restore") == 0
        order = drain_sub(c, "b")
        assert set(order) == r["expected"]["b"]


def test_restore_into_a_log_with_events_is_refused(plain_dsn):
    dsn = create_db(plain_dsn, LOG_DST + "_x")
    try:
        with connect(dsn) as c:
            c.execute("SELECT outbox.publish('t', '{}')")
            before = one(c, "SELECT count(*) FROM outbox.log")
            with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
                c.execute("INSERT INTO outbox.log_1 (id, txid, lane, topic, payload, max_attempts, published_at) "
                          "VALUES (1000, '5', 0, 't', '{}', 5, now())")
            assert one(c, "SELECT count(*) FROM outbox.log") == before
            assert one(c, "SELECT count(*) FROM outbox.log_restore") == 0
            # publish's own rows are not a restore (its heap path fires nothing;
            # the trigger ignores rows of the inserting transaction).
            c.execute("SELECT outbox.publish_batch('t', ARRAY['1', '2']::jsonb[])")
            assert one(c, "SELECT count(*) FROM outbox.log_restore") == 0
    finally:
        drop_db(plain_dsn, LOG_DST + "_x")


def test_a_restore_of_an_empty_log_is_rebased(plain_dsn, preload_dsn, tmp_path):
    """A dump whose log holds no event (nothing published yet, or retention
    emptied it) still restores lanes whose cursors are the source's. They are
    rebased too: events published after the restore reach the subscription,
    even where the source's transaction ids are far ahead of the restoring
    cluster's (its cursors would count them as read)."""
    src = create_db(plain_dsn, LOG_SRC + "_e")
    dst = None
    try:
        gap = next_xid(preload_dsn) - next_xid(plain_dsn) + 3000
        if gap > 0:
            burn_xids(src, gap)
        with connect(src) as c:
            c.execute("SELECT outbox.create_subscription('a')")
            assert one(c, "SELECT count(*) FROM outbox.log") == 0
        f = tmp_path / "empty.dump"
        run([f"{PG_BIN}/pg_dump", "-Fc", "-d", src, "-f", str(f)])
        dst = create_db(preload_dsn, LOG_DST + "_e", extension=False)
        run([f"{PG_BIN}/pg_restore", "--exit-on-error", "-d", dst, str(f)])
        with connect(dst) as c:
            assert one(c, "SELECT upto FROM outbox.log_restore") == 0
            published = {one(c, "SELECT outbox.publish('e.x', '{\"n\": 1}', 's1')"),
                         one(c, "SELECT outbox.publish('e.x', '{\"n\": 2}')")}
            got = claim_sub(c, "a", 10)
            assert {r[0] for r in got} == published
            assert one(c, "SELECT count(*) FROM outbox.log_restore") == 0
            for eid, tok, _, _ in got:
                assert one(c, "SELECT outbox.ack(%s, %s)", (eid, tok))
            # After the rebase the lanes are this cluster's: later events flow.
            later = one(c, "SELECT outbox.publish('e.x', '{\"n\": 3}', 's1')")
            assert [r[0] for r in claim_sub(c, "a", 10)] == [later]
            # create_subscription and claims write lanes without marking a restore.
            c.execute("SELECT outbox.create_subscription('b')")
            assert one(c, "SELECT count(*) FROM outbox.log_restore") == 0
    finally:
        drop_db(plain_dsn, LOG_SRC + "_e")
        if dst is not None:
            drop_db(preload_dsn, LOG_DST + "_e")


def test_ring_tables_restored_at_once_both_arrive(plain_dsn):
    """Two ring tables restored by concurrent sessions (pg_restore --jobs):
    one is the first and the other waits for it, instead of both finding no
    marker and the second failing on the marker's key with its rows lost."""
    dsn = create_db(plain_dsn, LOG_DST + "_j")
    try:
        first = connect(dsn, autocommit=False)
        second = connect(dsn)
        try:
            first.execute("INSERT INTO outbox.log_0 (id, txid, lane, topic, payload, max_attempts, published_at) "
                          "VALUES (1, '5000', 0, 't', '{}', 5, now())")
            done = []

            def restore_other():
                second.execute("INSERT INTO outbox.log_1 (id, txid, lane, topic, payload, max_attempts, published_at) "
                               "VALUES (2, '5001', 1, 't', '{}', 5, now())")
                done.append(True)

            t = threading.Thread(target=restore_other)
            t.start()
            time.sleep(0.5)
            assert not done, "the second ring table did not wait for the first"
            first.commit()
            t.join(10)
            assert done
        finally:
            first.close()
            second.close()
        with connect(dsn) as c:
            assert sorted(r[0] for r in c.execute("SELECT id FROM outbox.log").fetchall()) == [1, 2]
            assert one(c, "SELECT upto FROM outbox.log_restore") == 2
    finally:
        drop_db(plain_dsn, LOG_DST + "_j")
