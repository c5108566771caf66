"""Liveness: no committed event may become unclaimable without maintenance.

Each test reproduces one way 0.3.0 strands events (or blocks workers, or leaks
resources) and asserts the fixed behaviour. Every scenario runs in a scratch
database of its own (`liveness_<test>`), where the maintenance repair
(none of its steps is needed for delivery) never runs: whatever makes an event
claimable must be the API itself. On the preload cluster a background worker
serves the scratch database too (since 0.6.0 every database has one), but its
first maintenance run comes one `outbox.maintenance_interval` (1 min) after it
starts, later than any of these tests ends; `Scratch.close` fails the test if a
maintenance run was recorded anyway. Only the run_maintenance test calls
maintenance, and the prepared-transaction wake-up test uses database `postgres` of
the preload cluster on purpose (it needs the background worker).

Every connection has a lock_timeout and a statement_timeout, so a statement that
would wait for ever fails instead, and every wait loop has a deadline.

The tests of the contract itself (a snapshot or an open transaction strands
nothing, the attempt history stays bounded, every committed event is delivered
without maintenance, a dead letter follows the policy committed last) read the
public views only. The log's own schedules are in test_log_claim.py,
test_log_reader.py and the isolation specs.
"""

import hashlib
import os
import re
import subprocess
import time
import threading
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from conftest import PGCLUSTER, connect
from scratch_db import create_db, drop_db

CLUSTERS = ["plain", "preload"]

# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------


def _db_name(node_name):
    base = re.sub(r"[^a-z0-9_]+", "_", node_name.lower().replace("test_", "", 1)).strip("_")
    name = f"liveness_{base}"
    if len(name) > 63:
        digest = hashlib.sha1(name.encode()).hexdigest()[:8]
        name = f"{name[:54]}_{digest}"
    return name


class Scratch:
    """A scratch database with the extension, its tracked connections, and cleanup."""

    def __init__(self, admin_dsn, name, maintenance_allowed=False):
        self.admin_dsn = admin_dsn
        self.name = name
        self.dsn = create_db(admin_dsn, name)
        self._conns = []
        self.maintenance_allowed = maintenance_allowed

    def conn(self, lock_timeout="5s", statement_timeout="30s", notify="off", autocommit=True):
        opts = f"-c lock_timeout={lock_timeout} -c statement_timeout={statement_timeout}"
        if notify:
            opts += f" -c outbox.notify={notify}"
        c = connect(self.dsn, autocommit=autocommit, options=opts)
        self._conns.append(c)
        return c

    def close(self):
        for c in self._conns:
            try:
                c.close()
            except Exception:
                pass
        self._conns.clear()
        runs = 0
        # A prepared transaction keeps the database from being dropped.
        try:
            with connect(self.dsn) as c:
                runs = c.execute("SELECT count(*) FROM outbox.maintenance_runs").fetchone()[0]
                for (gid,) in c.execute(
                    "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall():
                    c.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        except psycopg.Error:
            pass
        drop_db(self.admin_dsn, self.name)
        assert self.maintenance_allowed or runs == 0, (
            f"{runs} maintenance run(s) were recorded in {self.name}: the test may pass only because "
            "maintenance repaired what the API left")


@pytest.fixture
def scratch(request):
    """scratch("plain" | "preload") -> Scratch: a fresh database on that cluster,
    dropped at the end of the test."""
    made = []

    def make(cluster):
        admin = request.getfixturevalue(f"{cluster}_dsn")
        db = Scratch(admin, _db_name(request.node.name), "run_maintenance" in request.node.name)
        made.append(db)
        return db

    yield make
    for db in made:
        db.close()


def publish(c, topic, subject=None, payload="{}"):
    return c.execute("SELECT outbox.publish(%s, %s::jsonb, subject => %s)", (topic, payload, subject)).fetchone()[0]


def publish_batch(c, topic, n, subjects=None):
    return [r[0] for r in c.execute(
        "SELECT outbox.publish_batch(%s, array_fill('{}'::jsonb, ARRAY[%s]), %s::text[])",
        (topic, n, subjects)).fetchall()]


def claim(c, topics, n=100, lease=None, worker="lv-worker"):
    """[(id, lease_token)] claimed from `topics` (a name, a list, or None = all)."""
    if isinstance(topics, str):
        topics = [topics]
    return [(r[0], r[1]) for r in c.execute(
        "SELECT id, lease_token FROM outbox.claim(%s, %s, %s::interval, %s::text[])",
        (worker, n, lease, topics)).fetchall()]


def ack(c, eid, tok):
    return c.execute("SELECT outbox.ack(%s::bigint, %s::uuid)", (eid, tok)).fetchone()[0]


def ack_many(c, rows):
    if not rows:
        return 0
    return c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                     ([r[0] for r in rows], [r[1] for r in rows])).fetchone()[0]


def describe(c, eid):
    """One line on where an event is, for failure messages."""
    # Where the public view has it.
    r = c.execute("SELECT state, attempts, subject, available_at FROM outbox.deliveries "
                  "WHERE event_id = %s AND subscription = 'default'", (eid,)).fetchone()
    if r:
        return f"event {eid} (log): {r[0]}, attempts={r[1]}, subject={r[2]!r}, available_at={r[3]}"
    return f"event {eid}: does not exist"


def expect_claim(c, topics, eid, timeout=3.0, lease=None, why=""):
    """Claim (retrying until `timeout`) until a claim returns event `eid`; the claim
    must return nothing else. Returns the lease token. Fails with where the event is
    stuck when no claim returns it."""
    deadline = time.monotonic() + timeout
    while True:
        rows = claim(c, topics, 10, lease)
        if rows:
            ids = [r[0] for r in rows]
            assert ids == [eid], f"expected a claim to return only event {eid}, got {ids} ({describe(c, eid)})"
            return rows[0][1]
        if time.monotonic() > deadline:
            pytest.fail(f"{describe(c, eid)} -- stranded: no claim returned it within {timeout}s{why}",
                        pytrace=False)
        time.sleep(0.05)


def drain(c, topics, expect, timeout=10.0, fail_once=(), record=None, batch=1000):
    """Claim and ack until every id in `expect` was acked (fail each id in
    `fail_once` once with retry_in '0' first). Returns ack order. Fails with the
    ids left over, and where they are."""
    want = set(expect)
    done, failed, order = set(), set(), []
    deadline = time.monotonic() + timeout
    while want - done:
        rows = claim(c, topics, batch)
        if not rows:
            if time.monotonic() > deadline:
                left = sorted(want - done)
                info = "; ".join(describe(c, i) for i in left[:5])
                pytest.fail(f"{len(left)} committed events never became claimable (no maintenance ran): {info}",
                            pytrace=False)
            time.sleep(0.02)
            continue
        oks = []
        for eid, tok in rows:
            if eid in fail_once and eid not in failed:
                st = c.execute("SELECT outbox.fail(%s, %s, 'flaky', retry_in => '0')", (eid, tok)).fetchone()[0]
                assert st == "pending", f"fail of event {eid} returned {st}"
                failed.add(eid)
            else:
                oks.append((eid, tok))
        n = ack_many(c, oks)
        assert n == len(oks), f"acked {n} of {len(oks)} claimed events"
        for eid, _ in oks:
            done.add(eid)
            order.append(eid)
            if record is not None:
                record.append(eid)
    return order


def prompt(c, what, stmt, args=None, limit=1.0):
    """Run `stmt`, which must neither fail nor take `limit` seconds (the
    connection's lock_timeout is about that long, so a statement that waits for
    another session's lock fails instead of hanging)."""
    t0 = time.monotonic()
    err = None
    try:
        rows = c.execute(stmt, args).fetchall()
    except psycopg.Error as e:
        err = e
    elapsed = time.monotonic() - t0
    if err is not None:
        pytest.fail(f"{what} failed after {elapsed:.2f}s: SQLSTATE {err.sqlstate}: "
                    f"{err.diag.message_primary}", pytrace=False)
    assert elapsed < limit, f"{what} took {elapsed:.2f}s"
    return rows


def advisory_locks(c, pid):
    return c.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (pid,)).fetchone()[0]


# ---------------------------------------------------------------------------
# 1. REPEATABLE READ / SERIALIZABLE transactions must not strand a subject.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("iso", ["REPEATABLE READ", "SERIALIZABLE"])
def test_snapshot_publisher_does_not_strand_its_subject(cluster, iso, scratch):
    """The publisher's snapshot predates the ack of the subject's head: its event
    must still become the head."""
    db = scratch(cluster)
    w, p = db.conn(), db.conn()
    e1 = publish(w, "t.a", "s")
    [(got, tok1)] = claim(w, "t.a")
    assert got == e1
    p.execute(f"BEGIN ISOLATION LEVEL {iso}")
    p.execute("SELECT 1")  # the snapshot is taken here
    assert ack(w, e1, tok1)
    e2 = publish(p, "t.a", "s")
    p.execute("COMMIT")
    e3 = publish(w, "t.a", "s")
    tok2 = expect_claim(w, "t.a", e2, why=f" (published under {iso} after its subject's head was acked)")
    assert ack(w, e2, tok2)
    tok3 = expect_claim(w, "t.a", e3, why=" (published after the stranded event)")
    assert ack(w, e3, tok3)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_repeatable_read_publish_batch_does_not_strand_its_subject(cluster, scratch):
    db = scratch(cluster)
    w, p = db.conn(), db.conn()
    e1 = publish(w, "t.a", "s")
    [(_, tok1)] = claim(w, "t.a")
    p.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    p.execute("SELECT 1")
    assert ack(w, e1, tok1)
    e2, e2b = publish_batch(p, "t.a", 2, ["s", "s"])
    p.execute("COMMIT")
    e3 = publish(w, "t.a", "s")
    for eid in (e2, e2b, e3):
        tok = expect_claim(w, "t.a", eid, why=" (publish_batch under REPEATABLE READ)")
        assert ack(w, eid, tok)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_repeatable_read_replay_of_cancelled_event_becomes_claimable(cluster, scratch):
    db = scratch(cluster)
    w, r = db.conn(), db.conn()
    e1 = publish(w, "t.a", "s")
    [(_, tok1)] = claim(w, "t.a")
    e2 = publish(w, "t.a", "s")
    assert w.execute("SELECT outbox.cancel(%s)", (e2,)).fetchone()[0]
    r.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    r.execute("SELECT 1")
    assert ack(w, e1, tok1)  # the subject's live head goes while R's snapshot still has it
    assert r.execute("SELECT outbox.replay(%s)", (e2,)).fetchone()[0]
    r.execute("COMMIT")
    tok = expect_claim(w, "t.a", e2, why=" (cancelled, then replayed under REPEATABLE READ)")
    assert ack(w, e2, tok)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_repeatable_read_ack_promotes_successor_committed_after_its_snapshot(cluster, scratch):
    db = scratch(cluster)
    c, wk, p = db.conn(), db.conn(), db.conn()
    e1 = publish(c, "t.a", "s")
    [(_, tok1)] = claim(c, "t.a")
    wk.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    wk.execute("SELECT 1")
    e2 = publish(p, "t.a", "s")  # autocommit: committed after the worker's snapshot
    assert ack(wk, e1, tok1)
    wk.execute("COMMIT")
    tok = expect_claim(c, "t.a", e2, why=" (its head was acked by a REPEATABLE READ worker)")
    assert ack(c, e2, tok)


# ---------------------------------------------------------------------------
# 3. A claim (or claim + ack) in an open transaction must not block other workers.
# ---------------------------------------------------------------------------


def _deferred_promotion(c, p, topic, subject):
    """A head acked while a publisher of its subject holds the subject lock
    (the ack must not wait for it). Returns the successor's id."""
    e1 = publish(c, topic, subject)
    [(got, tok1)] = claim(c, topic)
    assert got == e1
    p.execute("BEGIN")
    e2 = publish(p, topic, subject)
    t0 = time.monotonic()
    assert ack(c, e1, tok1)
    assert time.monotonic() - t0 < 1.0, "ack waited for the publisher's subject lock"
    p.execute("COMMIT")
    return e2


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_open_claim_transaction_does_not_block_other_claims(cluster, scratch):
    db = scratch(cluster)
    c, p = db.conn(), db.conn()
    c1, c2 = db.conn(), db.conn(lock_timeout="1s")
    e2 = _deferred_promotion(c, p, "t.c", "s")
    c1.execute("BEGIN")
    rows1 = claim(c1, "t.c", 10, worker="c1")
    rows2 = [(r[0], r[1]) for r in prompt(
        c2, "a claim while another session's claim transaction was open",
        "SELECT id, lease_token FROM outbox.claim('c2', 10, NULL, ARRAY['t.c'])")]
    both = {r[0] for r in rows1} & {r[0] for r in rows2}
    assert not both, f"events {both} were claimed by both sessions"
    c1.execute("COMMIT")
    for eid, tok in rows1 + rows2:
        assert ack(c, eid, tok)
    done = {r[0] for r in rows1 + rows2}
    if e2 not in done:
        drain(c, "t.c", [e2], timeout=3.0)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_claim_and_ack_in_one_open_transaction_do_not_block_others(cluster, scratch):
    db = scratch(cluster)
    c, p, wk = db.conn(), db.conn(), db.conn()
    o = db.conn(lock_timeout="1s")
    # Another worker holds a lease on the head of an unrelated subject with a successor.
    b1 = publish(c, "t.d", "sb")
    b2 = publish(c, "t.d", "sb")
    [(got, tokb1)] = claim(o, "t.d", worker="o")
    assert got == b1
    # Then a promotion is deferred, so the worker's claim below has one to retry.
    a2 = _deferred_promotion(c, p, "t.c", "sa")
    wk.execute("BEGIN")
    mine = claim(wk, "t.c", 10, worker="wk")
    for eid, tok in mine:
        assert ack(wk, eid, tok)
    # wk stays open. Other sessions' claims and acks must not wait for it.
    for what, stmt, args in [
        ("claim", "SELECT count(*) FROM outbox.claim('o', 10, '100 ms', ARRAY['t.c', 't.d'])", None),
        ("ack", "SELECT outbox.ack(%s::bigint, %s::uuid)", (b1, tokb1)),
        ("claim of everything", "SELECT count(*) FROM outbox.claim('o', 10, '100 ms')", None),
    ]:
        prompt(o, f"{what} while a worker's claim+ack transaction was open", stmt, args)
    wk.execute("COMMIT")
    # o's claims above may have leased b2 or a2 for 100 ms without acking them:
    # both must still be delivered.
    expect = [e for e in (a2, b2) if e not in {r[0] for r in mine}]
    drain(c, ["t.c", "t.d"], expect, timeout=3.0)


def test_lock_row_refuses_read_only_transactions(scratch):
    db = scratch("plain")
    c = db.conn()
    c.execute("BEGIN READ ONLY")
    with pytest.raises(psycopg.Error) as e:
        c.execute("SELECT outbox._lock_row('outbox.subscription_catalog'::regclass::oid, ctid) "
                  "FROM outbox.subscription_catalog")
    assert e.value.sqlstate == "25006"
    c.execute("ROLLBACK")


def test_lock_row_on_a_table_dropped_meanwhile(scratch):
    """The lock waits for the dropping transaction, then finds no table: 42P01,
    not an internal error."""
    db = scratch("plain")
    a, b = db.conn(), db.conn(lock_timeout="10s")
    a.execute("CREATE TABLE doomed (x int)")
    a.execute("INSERT INTO doomed VALUES (1)")
    oid, tid = a.execute("SELECT 'doomed'::regclass::oid, ctid FROM doomed").fetchone()
    a.execute("BEGIN")
    a.execute("DROP TABLE doomed")
    got = {}

    def lock():
        try:
            got["r"] = b.execute("SELECT outbox._lock_row(%s::oid, %s::tid)", (oid, tid)).fetchone()
        except psycopg.Error as e:
            got["r"] = e.sqlstate

    t = threading.Thread(target=lock)
    t.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not a.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock')",
            (b.info.backend_pid,)).fetchone()[0]:
        time.sleep(0.02)
    a.execute("COMMIT")
    t.join(10)
    assert got.get("r") == "42P01", got


# ---------------------------------------------------------------------------
# 4. Subject advisory locks are bounded.
# ---------------------------------------------------------------------------

def test_publishing_more_subjects_than_the_lock_table_holds_in_one_statement(scratch):
    """40,000 distinct subjects in one statement, five times what the shared lock
    table holds at default settings: the statement holds at most
    outbox.max_subject_locks fine locks and the coarse lock (src/subject.rs), so
    it succeeds (before the coarse lock it was refused with 54000)."""
    db = scratch("plain")
    c, other = db.conn(statement_timeout="120s"), db.conn()
    n = c.execute("SELECT count(outbox.publish('t.l', '{}', subject => 's' || g)) "
                  "FROM generate_series(1, 40000) g").fetchone()[0]
    assert n == 40000
    # Nothing is left holding locks: others (and this session) publish with subjects.
    assert publish(other, "t.l", "after-1")
    assert len(publish_batch(other, "t.l", 500, [f"after-b{i}" for i in range(500)])) == 500
    assert publish(c, "t.l", "after-2")
    assert c.execute("SELECT count(*) FROM outbox.events WHERE topic = 't.l'").fetchone()[0] == 40502


# ---------------------------------------------------------------------------
# 5. replay of a cancelled event must take the subject lock.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_replay_of_cancelled_event_racing_the_head_ack(cluster, scratch):
    db = scratch(cluster)
    w, r = db.conn(lock_timeout="2s"), db.conn()
    e1 = publish(w, "t.a", "s")
    [(_, tok1)] = claim(w, "t.a")
    e2 = publish(w, "t.a", "s")
    assert w.execute("SELECT outbox.cancel(%s)", (e2,)).fetchone()[0]
    r.execute("BEGIN")
    assert r.execute("SELECT outbox.replay(%s)", (e2,)).fetchone()[0]
    t0 = time.monotonic()
    assert ack(w, e1, tok1)  # must neither wait for R nor miss R's event
    assert time.monotonic() - t0 < 1.0, "ack waited for the replaying transaction"
    r.execute("COMMIT")
    tok = expect_claim(w, "t.a", e2, why=" (replayed in a transaction that committed after the head's ack)")
    assert ack(w, e2, tok)


# ---------------------------------------------------------------------------
# 6. A clock set back while step B is stalled (libfaketime).
# ---------------------------------------------------------------------------

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
FT_CLUSTER, FT_PORT = "lv-faketime", 5496


@pytest.fixture(scope="module")
def faketime_cluster():
    if not Path(FAKETIME_LIB).exists():
        pytest.skip(f"libfaketime is not installed ({FAKETIME_LIB}; Debian package faketime)")
    ts_file = Path(f"/tmp/outbox-pg-{FT_CLUSTER}.faketime")
    ts_file.write_text("+0\n")
    ts_file.chmod(0o644)
    env = dict(os.environ, LD_PRELOAD=FAKETIME_LIB, FAKETIME_TIMESTAMP_FILE=str(ts_file),
               FAKETIME_NO_CACHE="1", FAKETIME_DONT_FAKE_MONOTONIC="1")
    r = subprocess.run(["bash", PGCLUSTER, "start", FT_CLUSTER, str(FT_PORT), "--preload",
                        "-c", "max_prepared_transactions=8"],
                       env=env, capture_output=True, text=True, timeout=180)
    if r.returncode != 0:
        subprocess.run(["bash", PGCLUSTER, "destroy", FT_CLUSTER], capture_output=True, timeout=120)
        pytest.fail(f"could not start the faketime cluster: {r.stderr[-800:]}")
    try:
        yield f"host=127.0.0.1 port={FT_PORT} user=postgres dbname=postgres", ts_file
    finally:
        ts_file.write_text("+0\n")
        subprocess.run(["bash", PGCLUSTER, "destroy", FT_CLUSTER], capture_output=True, timeout=120)
        ts_file.unlink(missing_ok=True)


# ---------------------------------------------------------------------------
# 7. Smaller ones.
# ---------------------------------------------------------------------------


def test_event_id_sequence_cache_is_guarded(scratch):
    db = scratch("plain")
    c = db.conn()
    seqcache = "SELECT seqcache FROM pg_sequence WHERE seqrelid = 'outbox.event_id_seq'::regclass"
    try:
        c.execute("ALTER SEQUENCE outbox.event_id_seq CACHE 10")
    except psycopg.Error as err:
        assert err.sqlstate == "0A000", (
            f"ALTER SEQUENCE ... CACHE 10 failed with {err.sqlstate} ({err.diag.message_primary}), expected 0A000")
    else:
        pytest.fail(f"ALTER SEQUENCE outbox.event_id_seq CACHE 10 was accepted (seqcache now "
                    f"{c.execute(seqcache).fetchone()[0]}): a cached sequence breaks per-subject id order",
                    pytrace=False)
    assert c.execute(seqcache).fetchone()[0] == 1
    # Forced with event triggers off: health() must say so.
    c.execute("SET session_replication_role = replica")
    c.execute("ALTER SEQUENCE outbox.event_id_seq CACHE 10")
    c.execute("RESET session_replication_role")
    assert c.execute(seqcache).fetchone()[0] == 10
    rows = c.execute("SELECT status, message FROM outbox.health() WHERE check_name = 'id_sequence'").fetchall()
    assert rows, "outbox.health() has no 'id_sequence' check"
    assert [r[0] for r in rows] == ["critical"], f"id_sequence check with CACHE 10: {rows}"


def _errors_of(c, eid):
    return c.execute("SELECT errors, last_error FROM outbox.events WHERE id = %s", (eid,)).fetchone()


def _check_bounded_history(errors, n, text_of):
    assert isinstance(errors, list), errors
    assert len(errors) == 20, f"after {n} failed attempts the history has {len(errors)} entries, expected 20"
    assert errors[0].get("attempt") == 1 and errors[0].get("error") == text_of(1), errors[0]
    assert errors[1] == {"omitted": n - 19}, f"element 1 should be {{'omitted': {n - 19}}}, got {errors[1]}"
    tail = [(x.get("attempt"), x.get("error")) for x in errors[2:]]
    assert tail == [(a, text_of(a)) for a in range(n - 17, n + 1)], tail


def test_attempt_history_is_bounded(scratch):
    db = scratch("plain")
    c = db.conn()
    c.execute("SELECT outbox.create_topic('t.e', max_attempts => 1000)")
    e = publish(c, "t.e")
    for i in range(1, 51):
        rows = claim(c, "t.e")
        assert [r[0] for r in rows] == [e], f"round {i}: claim returned {rows}"
        st = c.execute("SELECT outbox.fail(%s, %s, %s, retry_in => '0')", (e, rows[0][1], f"error {i}")).fetchone()[0]
        assert st == "pending"
    errors, last = _errors_of(c, e)
    _check_bounded_history(errors, 50, lambda a: f"error {a}")
    assert last == "error 50"


def test_attempt_history_is_bounded_for_expired_leases(scratch):
    db = scratch("plain")
    c = db.conn()
    c.execute("SELECT outbox.create_topic('t.e', max_attempts => 1000)")
    e = publish(c, "t.e")
    for i in range(31):  # 31 claims: the first 30 leases expire
        deadline = time.monotonic() + 2
        while True:
            rows = claim(c, "t.e", lease="50 ms")
            if rows:
                break
            assert time.monotonic() < deadline, f"round {i}: the expired lease was not reclaimed"
            time.sleep(0.01)
        assert [r[0] for r in rows] == [e]
        time.sleep(0.06)
    errors, last = _errors_of(c, e)
    _check_bounded_history(errors, 30, lambda a: "lease expired")
    assert last == "lease expired"


def test_prepared_transactions_beyond_the_shared_list_are_announced(preload, listen):
    """Database postgres of the preload cluster: its worker sends the wake-ups."""
    dsn = preload.dsn
    n = 40
    gids = [f"lv_prep_{i}" for i in range(1, n + 1)]
    with connect(dsn) as o:
        if int(o.execute("SHOW max_prepared_transactions").fetchone()[0]) < n:
            pytest.skip("max_prepared_transactions < 40 on the preload cluster")
    lst = listen(dsn)
    p = connect(dsn, options="-c lock_timeout=5s -c statement_timeout=30s")
    try:
        p.execute("SET outbox.notify = 'background'")
        for i, gid in enumerate(gids, 1):
            p.execute("BEGIN")
            publish(p, f"t.p{i}")
            p.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        time.sleep(0.2)
        lst.drain()
        # First the ones the shared list (32 entries) can track; once the worker has
        # resolved them, the rest.
        for gid in gids[:32]:
            p.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            if p.execute("SELECT prepared_waiting FROM outbox.wakeup_status()").fetchone()[0] == 0:
                break
            time.sleep(0.02)
        time.sleep(0.1)
        for gid in gids[32:]:
            p.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
        want = {f"t.p{i}" for i in range(1, n + 1)}
        seen = set()
        deadline = time.monotonic() + 3.0
        while want - seen and time.monotonic() < deadline:
            got = lst.first(max(deadline - time.monotonic(), 0.01))
            if got:
                seen.add(got[0])
        missing = sorted(want - seen, key=lambda t: int(t[3:]))
        assert not missing, f"no notification within 3 s after COMMIT PREPARED for {len(missing)} topics: {missing}"
    finally:
        for (gid,) in p.execute("SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)", (gids,)).fetchall():
            p.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        p.execute("SET lock_timeout = '10s'")
        p.execute("TRUNCATE outbox.log_0, outbox.log_1, outbox.log_2, outbox.log_3, outbox.log_batches, "
                  "outbox.log_exceptions, outbox.log_delivered")
        p.close()


def test_untracked_prepared_transactions_resolved_at_once_are_announced(preload, listen):
    """With the shared list full (32 prepared publishers held), a transaction that
    is prepared and committed at once may never be listed by the worker's poll of
    pg_prepared_xacts: it must be announced all the same."""
    dsn = preload.dsn
    held = [f"lv_hold_{i}" for i in range(32)]
    with connect(dsn) as o:
        if int(o.execute("SHOW max_prepared_transactions").fetchone()[0]) < 34:
            pytest.skip("max_prepared_transactions < 34 on the preload cluster")
    lst = listen(dsn)
    p = connect(dsn, options="-c lock_timeout=5s -c statement_timeout=30s")
    try:
        p.execute("SET outbox.notify = 'background'")
        for gid in held:
            p.execute("BEGIN")
            publish(p, "t.held")
            p.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        time.sleep(0.2)
        lst.drain()
        missing = []
        for i in range(20):
            gid = f"lv_quick_{i}"
            p.execute("BEGIN")
            publish(p, f"t.q{i}")
            p.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
            p.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
            deadline = time.monotonic() + 3.0
            while True:
                got = lst.first(max(deadline - time.monotonic(), 0.01))
                if got is None:
                    missing.append(f"t.q{i}")
                    break
                if got[0] == f"t.q{i}":
                    break
        assert not missing, f"no notification within 3 s after PREPARE + COMMIT PREPARED for {missing}"
    finally:
        for (gid,) in p.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'lv_%'").fetchall():
            p.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        p.execute("SET lock_timeout = '10s'")
        p.execute("TRUNCATE outbox.log_0, outbox.log_1, outbox.log_2, outbox.log_3, outbox.log_batches, "
                  "outbox.log_exceptions, outbox.log_delivered")
        p.close()


def test_publish_honours_rules_on_the_log(scratch):
    db = scratch("plain")
    c = db.conn()
    c.execute("CREATE TABLE public.audit (id bigint)")
    for n in range(4):
        c.execute(f"CREATE RULE r AS ON INSERT TO outbox.log_{n} DO ALSO INSERT INTO public.audit VALUES (NEW.id)")
    e = c.execute("SELECT outbox.publish('t.r', '{}')").fetchone()[0]
    rows = [r[0] for r in c.execute("SELECT id FROM public.audit").fetchall()]
    assert rows == [e], f"the rule on the log's ring table recorded {rows} for published event {e}"


# -- Rust backtraces must not reach error DETAIL lines -----------------------

BT_CLUSTER, BT_PORT = "lv-bt", 5495
BACKTRACE = re.compile(r"std::|pgrx::|outbox_ext::|^\s*\d+: ", re.M)


@pytest.fixture(scope="module")
def bt_dsn():
    env = dict(os.environ, RUST_BACKTRACE="1")
    r = subprocess.run(["bash", PGCLUSTER, "start", BT_CLUSTER, str(BT_PORT), "--preload"],
                       env=env, capture_output=True, text=True, timeout=180)
    if r.returncode != 0:
        subprocess.run(["bash", PGCLUSTER, "destroy", BT_CLUSTER], capture_output=True, timeout=120)
        pytest.fail(f"could not start cluster {BT_CLUSTER}: {r.stderr[-800:]}")
    try:
        dsn = f"host=127.0.0.1 port={BT_PORT} user=postgres dbname=postgres"
        pidfile = Path(f"/tmp/outbox-pg/{BT_CLUSTER}/data/postmaster.pid")
        try:
            pid = pidfile.read_text().split()[0]
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"RUST_BACKTRACE=1" in environ, "setup: RUST_BACKTRACE=1 did not reach the postmaster"
        except OSError:
            pass  # cannot inspect the server's environment: trust pgcluster.sh
        with connect(dsn) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
        yield dsn
    finally:
        subprocess.run(["bash", PGCLUSTER, "destroy", BT_CLUSTER], capture_output=True, timeout=120)


def _bt_bad_input(c, o):
    c.execute("SELECT * FROM outbox.claim('', 1)")


def _bt_read_only(c, o):
    c.execute("BEGIN READ ONLY")
    c.execute("SELECT outbox.publish('t.x', '{}', subject => 's')")


def _bt_lock_timeout_claim(c, o):
    o.execute("BEGIN")
    o.execute("LOCK TABLE outbox.log_exceptions IN ACCESS EXCLUSIVE MODE")
    c.execute("SET lock_timeout = '200ms'")
    c.execute("SELECT * FROM outbox.claim('w', 1)")


def _bt_lock_timeout_ack(c, o):
    o.execute("BEGIN")
    o.execute("LOCK TABLE outbox.log_exceptions IN ACCESS EXCLUSIVE MODE")
    c.execute("SET lock_timeout = '200ms'")
    c.execute("SELECT outbox.ack(1, gen_random_uuid())")


def _bt_payload_too_large(c, o):
    c.execute("SELECT outbox.publish('t.l', to_jsonb(repeat('x', 1048576)))")


BT_CASES = [
    ("bad input: claim('', 1)", "22023", _bt_bad_input),
    ("PostgreSQL error inside SPI: publish in a read-only transaction", "25006", _bt_read_only),
    ("lock_timeout inside claim", "55P03", _bt_lock_timeout_claim),
    ("lock_timeout inside ack", "55P03", _bt_lock_timeout_ack),
    ("payload over outbox.max_payload_bytes", "54000", _bt_payload_too_large),
]


def test_errors_carry_no_rust_backtrace(bt_dsn):
    """The server runs with RUST_BACKTRACE=1; no error raised in the extension's
    Rust code may carry a backtrace."""
    problems = []
    for case, sqlstate, run in BT_CASES:
        c = connect(bt_dsn, options="-c statement_timeout=30s -c outbox.notify=off")
        o = connect(bt_dsn)
        try:
            err = None
            try:
                run(c, o)
            except psycopg.Error as e:
                err = e
            if err is None:
                problems.append(f"{case}: no error (expected SQLSTATE {sqlstate})")
                continue
            if err.sqlstate != sqlstate:
                problems.append(f"{case}: SQLSTATE {err.sqlstate} ({err.diag.message_primary}), expected {sqlstate}")
            for field in ("message_primary", "message_detail", "message_hint"):
                text = getattr(err.diag, field)
                if text is not None and BACKTRACE.search(text):
                    first = [ln for ln in text.splitlines() if ln.strip()][:3]
                    problems.append(f"{case}: a Rust backtrace in the error's {field}: {' | '.join(first)} ...")
        finally:
            c.close()
            o.close()
    assert not problems, "\n".join(problems)


def test_run_maintenance_records_purged_keys(scratch):
    db = scratch("plain")
    c = db.conn()
    e1 = publish(c, "t.m", "s")
    c.execute("INSERT INTO outbox.dispatch_keys (dispatch_key, event_id, created_at) "
              "VALUES ('lv-orphan', 0, now() - interval '1 day')")
    c.execute("CALL outbox.run_maintenance()")
    tok = expect_claim(c, "t.m", e1, timeout=1.0)
    assert ack(c, e1, tok)
    row = c.execute("SELECT purged_keys, error FROM outbox.maintenance_log ORDER BY run_id DESC LIMIT 1").fetchone()
    assert row is not None, "run_maintenance recorded no maintenance_log row"
    assert row[0] >= 1, f"run_maintenance purged the orphaned dispatch key but recorded purged_keys = {row[0]}"
    assert c.execute("SELECT count(*) FROM outbox.dispatch_keys WHERE dispatch_key = 'lv-orphan'").fetchone()[0] == 0


# ---------------------------------------------------------------------------
# 8. The contract end to end: every committed event is claimable without maintenance.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_committed_event_is_delivered_without_maintenance(cluster, scratch):
    db = scratch(cluster)
    c, p, r, wk = db.conn(), db.conn(), db.conn(), db.conn()
    committed, acks = [], []
    topics = ["e2e.a", "e2e.b", "e2e.c"]
    c.execute("SELECT outbox.create_topic('e2e.b', max_attempts => 100)")

    def pub(conn, topic, subject=None):
        eid = publish(conn, topic, subject)
        return eid

    def ack_rec(conn, eid, tok):
        assert ack(conn, eid, tok), f"ack of event {eid} failed"
        acks.append(eid)

    # Heads of several subjects and some unordered events.
    x1, z1, w1, u1 = (pub(c, "e2e.a", s) for s in ("x", "z", "w", "u"))
    y1 = pub(c, "e2e.c", "y")
    v1 = pub(c, "e2e.b", "v")
    free = [pub(c, "e2e.b") for _ in range(3)]
    committed += [x1, y1, z1, w1, u1, v1, *free]
    leased = dict(claim(c, "e2e.a", 10))
    leased.update(claim(c, "e2e.b", 10))
    # y1's lease is left to expire (a crashed worker).
    leased.update(claim(c, "e2e.c", 10, lease="50 ms"))
    assert {x1, y1, z1, w1, u1, v1} <= set(leased), leased
    for f in free:
        ack_rec(c, f, leased[f])

    # A REPEATABLE READ publisher whose snapshot predates the acks of x1 and v1.
    p.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    p.execute("SELECT 1")
    ack_rec(c, x1, leased[x1])
    ack_rec(c, v1, leased[v1])
    x2 = pub(p, "e2e.a", "x")
    vb = publish_batch(p, "e2e.b", 3, ["v", "v", "v"])
    p.execute("COMMIT")
    committed += [x2, *vb]

    # y2 waits behind y1, whose lease expires.
    y2 = pub(c, "e2e.c", "y")
    committed.append(y2)

    # z1 fails and is retried at once; z2 waits behind it.
    assert c.execute("SELECT outbox.fail(%s, %s, 'boom', retry_in => '0')", (z1, leased[z1])).fetchone()[0] == "pending"
    z2 = pub(c, "e2e.a", "z")
    committed.append(z2)

    # w2 is cancelled and replayed in a transaction that commits after w1's ack.
    w2 = pub(c, "e2e.a", "w")
    assert c.execute("SELECT outbox.cancel(%s)", (w2,)).fetchone()[0]
    r.execute("BEGIN")
    assert r.execute("SELECT outbox.replay(%s)", (w2,)).fetchone()[0]
    ack_rec(c, w1, leased[w1])
    r.execute("COMMIT")
    committed.append(w2)

    # A REPEATABLE READ worker acks u1 after u2 was committed behind it.
    wk.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    wk.execute("SELECT 1")
    u2 = pub(c, "e2e.a", "u")
    committed.append(u2)
    assert ack(wk, u1, leased[u1])
    wk.execute("COMMIT")
    acks.append(u1)

    time.sleep(0.06)  # y1's lease has expired
    rest = set(committed) - set(acks)
    fail_once = {e for e in rest if e % 3 == 0}
    drain(c, topics, rest, timeout=5.0, fail_once=fail_once, record=acks)

    # outbox.events describes 'default'.
    left = c.execute("SELECT id, state FROM outbox.events WHERE topic = ANY(%s) AND state <> 'delivered'",
                     (topics,)).fetchall()
    assert not left, f"events not delivered after the drain: {left}"
    delivered = {row[0] for row in c.execute(
        "SELECT id FROM outbox.events WHERE state = 'delivered' AND topic = ANY(%s)", (topics,))}
    assert delivered == set(committed), (sorted(set(committed) - delivered), sorted(delivered - set(committed)))
    # Per subject, acks came in id (= commit) order.
    subj = dict(c.execute("SELECT id, subject FROM outbox.events WHERE subject IS NOT NULL AND topic = ANY(%s)",
                          (topics,)).fetchall())
    by = {}
    for eid in acks:
        if eid in subj:
            by.setdefault(subj[eid], []).append(eid)
    for s, ids in by.items():
        assert ids == sorted(ids), f"subject {s!r} delivered out of order: {ids}"


@pytest.mark.parametrize("first,second", [("block", "skip"), ("skip", "block")])
@pytest.mark.parametrize("via", ["first", "retry", "claim", "moveclaim"])
@pytest.mark.parametrize("iso", ["read committed", "repeatable read", "serializable"])
def test_policy_switch_racing_a_dead_transition(first, second, via, iso, scratch):
    """alter_topic(dead_letter_policy) while the subject's head is turning dead in
    an open transaction: the dead letter must follow the new policy (0.4.0 review:
    alter_topic's UPDATE of dead rows could not see the uncommitted transition).
    The head turns dead in fail(), on its first delivery ("first": on the log, out
    of a batch, so the dead letter is a new row of its own) or on a retry
    ("retry": it has a row already), or in a claim that finds its last lease
    expired ("claim"; on the log "moveclaim" too: the racing claim is the first
    after the expiry, so it moves the event out of its batch and turns it dead
    in one transaction, inserting a row alter_topic cannot see before it
    commits). alter_topic runs at each isolation level, its snapshot taken
    before the dead transition commits. On the log, "first" and "retry" failed
    before fail() took the topic row FOR SHARE (0.12.0); "claim", and
    alter_topic at REPEATABLE READ or SERIALIZABLE, failed before it read the
    log's dead letters under a snapshot taken after the topic row's lock
    (0.13.0); "moveclaim" failed (both switches, every level) before every dead
    transition of the log held the topic's policy lock (0.14.0)."""
    db = scratch("plain")
    a, b = db.conn(), db.conn()
    f = db.conn(autocommit=False)
    a.execute("SELECT outbox.create_topic('t.pr', max_attempts => %s, dead_letter_policy => %s)",
              (2 if via == "retry" else 1, first))
    e1 = publish(a, "t.pr", "s")
    e2 = publish(a, "t.pr", "s")
    expiring = via in ("claim", "moveclaim")
    [(i, tok)] = claim(a, "t.pr", lease="100 milliseconds" if expiring else None)
    assert i == e1
    if via == "retry":
        assert a.execute("SELECT outbox.fail(%s, %s, 'once', retry_in => '0')", (e1, tok)).fetchone()[0] == "pending"
        tok = expect_claim(a, "t.pr", e1, why=" (retried at once)")
    if expiring:
        time.sleep(0.3)  # e1's last lease has expired
        if via == "claim":
            # The first claim after the expiry moves e1 out of its batch (still
            # leased, expired); the next one finds it exhausted.
            assert claim(a, "t.pr") == []
        got = claim(f, "t.pr")
        # Under 'skip' the claim that turns e1 dead may hand out e2 at once.
        allowed = [[], [e2]] if first == "skip" else [[]]
        assert [r[0] for r in got] in allowed, f"the claim that found e1's last lease expired returned {got}"
        out = dict(got)
    else:
        out = {}
        assert f.execute("SELECT outbox.fail(%s, %s, 'boom')", (e1, tok)).fetchone()[0] == "dead"
    state = f.execute("SELECT state FROM outbox.deliveries WHERE event_id = %s AND subscription = 'default'",
                      (e1,)).fetchone()[0]
    # A fail() of an event out of its batch, in a transaction block, is applied
    # as the transaction commits (src/log/deferred.rs): the dead letter is
    # written then, under the policy lock, and must follow the new policy too.
    want = "leased" if via == "first" else "dead"
    assert state == want, f"{e1} is {state!r} in the transaction that should have turned it dead"
    done, errors = threading.Event(), []

    def switch():
        for _ in range(3):
            try:
                b.execute(f"BEGIN ISOLATION LEVEL {iso}")
                b.execute("SELECT outbox.alter_topic('t.pr', dead_letter_policy => %s)", (second,))
                b.execute("COMMIT")
                done.set()
                return
            except psycopg.errors.SerializationFailure as e:
                b.execute("ROLLBACK")
                errors.append(e)
                return

    t = threading.Thread(target=switch, daemon=True)
    t.start()
    time.sleep(0.3)
    f.commit()
    t.join(10)
    assert not errors, f"alter_topic at {iso} failed: {errors}"
    assert done.is_set(), f"alter_topic did not finish ({errors})"
    # What the policy means: e2 goes, or nothing does.
    if e2 in out:
        # e2 went under 'skip' before 'block' committed; the subject's next one
        # must wait behind the dead letter now.
        assert ack(a, e2, out[e2])
        e2 = publish(a, "t.pr", "s")
    if second == "skip":
        expect_claim(a, "t.pr", e2, why=" (its subject's dead letter is under 'skip')")
    else:
        assert claim(a, "t.pr") == [], "an event was claimed past a blocking dead letter"


@pytest.mark.parametrize("via", ["first", "retry"])
def test_policy_switch_does_not_wait_for_a_fail_that_schedules_a_retry(via, scratch):
    """alter_topic(dead_letter_policy) waits only for transactions that turned one
    of the topic's events dead: a fail() in an open transaction that schedules a
    retry holds no dead-letter policy lock, so the policy change commits at once,
    and another worker's fail() is not queued behind it (an adversarial run of
    0.14.0's first cut: both waited until the retrying transaction ended). "first"
    fails an event out of its batch, "retry" one that has a row of its own."""
    db = scratch("plain")
    a, b = db.conn(), db.conn()
    w = db.conn(autocommit=False)
    a.execute("SELECT outbox.create_topic('t.rt', max_attempts => 5, dead_letter_policy => 'block')")
    e1 = publish(a, "t.rt", "s1")
    [(i, tok)] = claim(a, "t.rt", n=1)
    assert i == e1
    if via == "retry":
        assert a.execute("SELECT outbox.fail(%s, %s, 'once', retry_in => '0')", (e1, tok)).fetchone()[0] == "pending"
        tok = expect_claim(a, "t.rt", e1, why=" (retried at once)")
    assert w.execute("SELECT outbox.fail(%s, %s, 'transient')", (e1, tok)).fetchone()[0] == "pending"
    try:
        b.execute("SET statement_timeout = '5s'")
        t0 = time.monotonic()
        b.execute("SELECT outbox.alter_topic('t.rt', dead_letter_policy => 'skip')")
        took = time.monotonic() - t0
        assert took < 2.0, f"alter_topic waited {took:.1f}s for a fail() that scheduled a retry"
    finally:
        w.rollback()
