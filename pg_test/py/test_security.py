"""Privileges and search_path safety.

- The three NOLOGIN roles, and CREATE EXTENSION when they already exist.
- Every allowed call works and every denied call fails with 42501, each tried
  as a real LOGIN role (pub_u, work_u, admin_u, and nobody_u with no outbox role).
- A caller whose search_path puts shadowing operators and functions (= on text,
  now(), ...) ahead of pg_catalog changes nothing in what the API does.
Runs on the plain cluster.
"""

import uuid
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg import sql

from conftest import connect
from scratch_db import create_db, drop_db, ensure_login_role, role_dsn

OUTBOX_ROLES = ("outbox_publisher", "outbox_worker", "outbox_admin", "outbox_monitor")
LOGIN_ROLES = {
    "pub_u": ("outbox_publisher",),
    "work_u": ("outbox_worker",),
    "admin_u": ("outbox_admin",),
    "nobody_u": (),
}
CLAIM_SIG = "outbox.claim(text, integer, interval, text[], text)"


@pytest.fixture(scope="module")
def roles(plain_dsn):
    for role, groups in LOGIN_ROLES.items():
        ensure_login_role(plain_dsn, role, groups)
    return {role: role_dsn(plain_dsn, role) for role in LOGIN_ROLES}


def sqlstate_of(conn, stmt, params=None):
    """Run stmt in a transaction that is always rolled back; the SQLSTATE it
    raised, or None when it succeeded."""
    try:
        conn.execute(stmt, params)
        return None
    except psycopg.Error as e:
        return e.sqlstate
    finally:
        conn.rollback()


# ---------------------------------------------------------------------------
# 1. The roles
# ---------------------------------------------------------------------------
def role_rows(conn):
    return {
        r[0]: r[1:]
        for r in conn.execute(
            "SELECT rolname, oid, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls "
            "FROM pg_roles WHERE rolname = ANY(%s)",
            (list(OUTBOX_ROLES),),
        ).fetchall()
    }


def assert_nologin_roles(conn):
    rows = role_rows(conn)
    assert set(rows) == set(OUTBOX_ROLES)
    for name, (_oid, *attrs) in rows.items():
        assert attrs == [False] * 6, f"{name}: login/super/createrole/createdb/replication/bypassrls = {attrs}"
    return {name: r[0] for name, r in rows.items()}


def assert_grants(conn):
    def can(role, fn):
        return conn.execute("SELECT has_function_privilege(%s, %s, 'EXECUTE')", (role, fn)).fetchone()[0]

    assert can("outbox_publisher", "outbox.publish(text, jsonb, text, text, jsonb, timestamptz)")
    assert can("outbox_worker", CLAIM_SIG)
    assert can("outbox_admin", "outbox.replay(bigint, text)")
    assert not can("outbox_publisher", CLAIM_SIG)
    assert not can("outbox_worker", "outbox.replay(bigint, text)")
    assert can("outbox_monitor", "outbox.blocked_subjects(text, integer)")
    assert not can("outbox_monitor", "outbox.replay(bigint, text)")


def test_roles_exist_and_are_nologin(plain_dsn):
    with connect(plain_dsn) as c:
        assert_nologin_roles(c)
        assert_grants(c)


def test_create_extension_reuses_existing_roles(plain_dsn):
    name = "outbox_t_roles_reuse"
    with connect(plain_dsn) as c:
        before = assert_nologin_roles(c)
    try:
        dsn = create_db(plain_dsn, name)  # the roles exist already (database postgres has the extension)
        with connect(dsn) as c:
            assert assert_nologin_roles(c) == before
            assert_grants(c)
            c.execute("DROP EXTENSION outbox_ext")
            # Roles are cluster objects: dropping the extension keeps them.
            assert assert_nologin_roles(c) == before
            c.execute("CREATE EXTENSION outbox_ext")
            assert assert_nologin_roles(c) == before
            assert_grants(c)
            c.execute("SELECT outbox.publish('roles.t', '{}')")
    finally:
        drop_db(plain_dsn, name)


def test_create_extension_creates_missing_roles(plain_dsn):
    """The roles are renamed aside (grants follow the OID, so the rest of the
    cluster keeps working), then CREATE EXTENSION in a new database must create
    fresh NOLOGIN roles."""
    name = "outbox_t_roles_new"
    aside = {r: f"{r}_aside_t" for r in OUTBOX_ROLES}

    def rename(c, frm, to):
        c.execute(sql.SQL("ALTER ROLE {} RENAME TO {}").format(sql.Identifier(frm), sql.Identifier(to)))

    with connect(plain_dsn) as c:
        # Repair an interrupted earlier run.
        for r, a in aside.items():
            if c.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (a,)).fetchone():
                c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(r)))
                rename(c, a, r)
        old = assert_nologin_roles(c)
        for r, a in aside.items():
            rename(c, r, a)
    try:
        dsn = create_db(plain_dsn, name)
        with connect(dsn) as c:
            new = assert_nologin_roles(c)
            assert not set(new.values()) & set(old.values()), "CREATE EXTENSION did not create new roles"
            assert_grants(c)
    finally:
        drop_db(plain_dsn, name)
        with connect(plain_dsn) as c:
            for r, a in aside.items():
                c.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(r)))
                rename(c, a, r)
            assert assert_nologin_roles(c) == old


# ---------------------------------------------------------------------------
# 2. Denials: each one as a real login role, SQLSTATE 42501
# ---------------------------------------------------------------------------
TOKEN = "'00000000-0000-0000-0000-000000000001'::uuid"
CALLS = {
    "publish": "SELECT outbox.publish('sec.t', '{}')",
    "publish_batch": "SELECT outbox.publish_batch('sec.t', ARRAY['{}']::jsonb[])",
    "claim": "SELECT * FROM outbox.claim('w', 1)",
    "ack": f"SELECT outbox.ack(1, {TOKEN})",
    "ack_batch": f"SELECT outbox.ack(ARRAY[1]::bigint[], ARRAY[{TOKEN}])",
    "fail": f"SELECT outbox.fail(1, {TOKEN}, 'x')",
    "extend_lease": f"SELECT outbox.extend_lease(1, {TOKEN}, '1 min')",
    "replay": "SELECT outbox.replay(1)",
    "replay_dead": "SELECT outbox.replay_dead()",
    "cancel": "SELECT outbox.cancel(1)",
    "create_topic": "SELECT outbox.create_topic('sec.new')",
    "alter_topic": "SELECT outbox.alter_topic('sec.t', max_attempts => 3)",
    "drop_topic": "SELECT outbox.drop_topic('sec.t')",
    "purge": "CALL outbox.purge()",
    "purge_dead": "CALL outbox.purge_dead()",
    "run_maintenance": "CALL outbox.run_maintenance()",
    "health": "SELECT * FROM outbox.health()",
    "wakeup_status": "SELECT * FROM outbox.wakeup_status()",
    "_purge_step": "SELECT outbox._purge_step('dead', '0', 10)",
    "_log_maintenance": "SELECT outbox._log_maintenance(now(), '{}')",
    "_maintenance_steps": "SELECT * FROM outbox._maintenance_steps()",
    "_maintenance_step": "SELECT * FROM outbox._maintenance_step('keys')",
    "_wake": "SELECT outbox._wake(NULL)",
    "nextval": "SELECT nextval('outbox.event_id_seq')",
    "setval": "SELECT setval('outbox.event_id_seq', 1)",
}
VIEWS = ("events", "stats", "maintenance_log", "subscriptions", "deliveries")
TABLE_WRITES = {
    "log_exceptions": (
        "INSERT INTO outbox.log_exceptions (subscription, id, lane, topic, payload, max_attempts, published_at, "
        "state, attempts, visible_at) VALUES ('default', -1, 0, 'sec.t', '{}', 1, now(), 'pending', 0, now())",
        "state = state",
    ),
    "dispatch_keys": ("INSERT INTO outbox.dispatch_keys (dispatch_key, event_id) VALUES ('sec-k', 1)", "event_id = event_id"),
    "topics": ("INSERT INTO outbox.topics (topic) VALUES ('sec.x')", "max_attempts = max_attempts"),
    "maintenance_runs": ("INSERT INTO outbox.maintenance_runs (started_at) VALUES (now())", "error = error"),
}
for _t, (_ins, _set) in TABLE_WRITES.items():
    CALLS[f"insert_{_t}"] = _ins
    CALLS[f"update_{_t}"] = f"UPDATE outbox.{_t} SET {_set}"
    CALLS[f"delete_{_t}"] = f"DELETE FROM outbox.{_t}"
    CALLS[f"truncate_{_t}"] = f"TRUNCATE outbox.{_t}"
    CALLS[f"select_{_t}"] = f"SELECT * FROM outbox.{_t} LIMIT 1"
for _v in VIEWS:
    CALLS[f"select_{_v}"] = f"SELECT * FROM outbox.{_v} LIMIT 1"

WRITES = {k for k in CALLS if k.split("_")[0] in ("insert", "update", "delete", "truncate")} | {"nextval", "setval"}
READS = {k for k in CALLS if k.startswith("select_")}
WORKER_CALLS = {"claim", "ack", "ack_batch", "fail", "extend_lease"}
ADMIN_CALLS = {"replay", "replay_dead", "cancel", "create_topic", "alter_topic", "drop_topic",
               "purge", "purge_dead", "run_maintenance", "health", "wakeup_status"}
INTERNAL = {"_purge_step", "_log_maintenance", "_maintenance_steps", "_maintenance_step", "_wake"}

DENIED = {
    # "outbox_publisher may publish (single and batch) and nothing else"
    "pub_u": sorted(set(CALLS) - {"publish", "publish_batch"}),
    # "A worker cannot publish, replay or purge"; it reads events only through claim.
    "work_u": sorted(set(CALLS) - WORKER_CALLS),
    # The admin reads everything but writes only through the API, and does not deliver.
    "admin_u": sorted(WRITES | WORKER_CALLS | {"_wake"}),
    "nobody_u": sorted(CALLS),
}
CASES = [(role, call) for role, calls in DENIED.items() for call in calls]


@pytest.fixture(scope="module")
def role_conns(roles):
    conns = {}

    def get(role):
        if role not in conns:
            conns[role] = connect(roles[role], autocommit=False)
        return conns[role]

    yield get
    for c in conns.values():
        c.close()


@pytest.mark.parametrize("role,call", CASES, ids=[f"{r}-{c}" for r, c in CASES])
def test_denied(role_conns, role, call):
    state = sqlstate_of(role_conns(role), CALLS[call])
    assert state == "42501", f"{role}: {CALLS[call]!r} gave SQLSTATE {state}, expected 42501"


def test_publisher_may_publish(plain, roles):
    pub = connect(roles["pub_u"])
    try:
        one = pub.execute("SELECT outbox.publish('sec.pub', '{\"n\": 1}', 's1', 'sec-key-1')").fetchone()[0]
        batch = [r[0] for r in pub.execute(
            "SELECT outbox.publish_batch('sec.pub', ARRAY['{\"n\": 2}', '{\"n\": 3}']::jsonb[], ARRAY['s1', NULL], NULL)"
        ).fetchall()]
        # Idempotency works for the publisher too (it reads dispatch_keys through the API).
        assert pub.execute("SELECT outbox.publish('sec.pub', '{}', NULL, 'sec-key-1')").fetchone()[0] == one
        # In the caller's transaction: a rollback leaves nothing.
        with pub.transaction(force_rollback=True):
            gone = pub.execute("SELECT outbox.publish('sec.pub', '{\"n\": 4}')").fetchone()[0]
    finally:
        pub.close()
    rows = plain.all("SELECT id, payload->>'n', subject, state FROM outbox.events ORDER BY id")
    assert rows == [(one, "1", "s1", "pending"), (batch[0], "2", "s1", "pending"), (batch[1], "3", None, "pending")]
    assert gone not in [r[0] for r in rows]


def test_worker_may_claim_ack_fail_extend(plain, roles):
    ids = [r[0] for r in plain.all(
        "SELECT outbox.publish_batch('sec.work', array_agg(jsonb_build_object('n', g) ORDER BY g)) FROM generate_series(1, 5) g"
    )]
    w = connect(roles["work_u"])
    try:
        got = w.execute("SELECT id, payload, lease_token FROM outbox.claim('work_u', 10, '1 min')").fetchall()
        # The worker reads the events it claims, payload included.
        assert [(i, p["n"]) for i, p, _ in got] == [(i, n) for n, i in enumerate(ids, 1)]
        tok = {i: t for i, _, t in got}
        a, b, c, d, e = ids
        assert w.execute("SELECT outbox.ack(%s, %s)", (a, tok[a])).fetchone()[0] is True
        assert w.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([b], [tok[b]])).fetchone()[0] == 1
        assert w.execute("SELECT outbox.extend_lease(%s, %s, '5 min')", (c, tok[c])).fetchone()[0] is not None
        assert w.execute("SELECT outbox.fail(%s, %s, 'later', '1 hour')", (d, tok[d])).fetchone()[0] == "pending"
        assert w.execute("SELECT outbox.fail(%s, %s, 'poison', permanent => true)", (e, tok[e])).fetchone()[0] == "dead"
        # A forged token changes nothing (and is not an error).
        assert w.execute("SELECT outbox.ack(%s, %s)", (c, uuid.uuid4())).fetchone()[0] is False
        # Backoff arithmetic is public to the roles.
        assert w.execute("SELECT outbox.backoff_delay(1, '1 s', '1 min', false)").fetchone()[0] == timedelta(seconds=1)
    finally:
        w.close()
    states = dict(plain.all("SELECT id, state FROM outbox.events"))
    assert [states[i] for i in ids] == ["delivered", "delivered", "leased", "pending", "dead"]


def _dead_event(db, topic):
    i = db.one("SELECT outbox.publish(%s, '{}')", (topic,))[0]
    (tok,) = db.one("SELECT lease_token FROM outbox.claim('setup', 1, NULL, ARRAY[%s])", (topic,))
    assert db.one("SELECT outbox.fail(%s, %s, 'boom', permanent => true)", (i, tok))[0] == "dead"
    return i


def test_admin_may_replay_cancel_manage_topics_and_read(plain, roles):
    dead1 = _dead_event(plain, "sec.adm")
    dead2 = _dead_event(plain, "sec.adm2")
    pending = plain.one("SELECT outbox.publish('sec.adm', '{}')")[0]
    adm = connect(roles["admin_u"])
    try:
        assert adm.execute("SELECT outbox.replay(%s)", (dead1,)).fetchone()[0] is True
        assert adm.execute("SELECT outbox.replay_dead('sec.adm2')").fetchone()[0] == 1
        assert adm.execute("SELECT outbox.cancel(%s)", (pending,)).fetchone()[0] is True
        adm.execute("SELECT outbox.create_topic('sec.topic', max_attempts => 3, default_lease => '1 min')")
        adm.execute("SELECT outbox.alter_topic('sec.topic', max_attempts => 4, dead_letter_policy => 'skip')")
        assert adm.execute("SELECT max_attempts, dead_letter_policy FROM outbox.topics WHERE topic = 'sec.topic'").fetchone() == (4, "skip")
        assert adm.execute("SELECT outbox.drop_topic('sec.topic')").fetchone()[0] is True
        # Reads everything.
        states = dict(adm.execute("SELECT id, state FROM outbox.events").fetchall())
        assert states == {dead1: "pending", dead2: "pending", pending: "cancelled"}
        for rel in ("log_exceptions", "dispatch_keys", "topics", "maintenance_runs", *VIEWS):
            adm.execute(f"SELECT count(*) FROM outbox.{rel}")
        checks = [r[0] for r in adm.execute("SELECT check_name FROM outbox.health()").fetchall()]
        assert len(set(checks)) == 11  # handshake, backlog, dead letters, leases, xmin, dead tuples, id sequence, worker, subscription, default subscription, log ring
        adm.execute("SELECT * FROM outbox.wakeup_status()")
    finally:
        adm.close()


@pytest.mark.parametrize("stmt", ["CALL outbox.purge('0')", "CALL outbox.purge_dead('0')", "CALL outbox.run_maintenance()"])
def test_admin_may_run_retention(plain, roles, stmt):
    """Each in a new session, as pg_cron runs it (see also BUG-S7). Retention
    removes rows of their own (a dead letter; an event delivered after a retry)
    once the log no longer holds their events: the ring is emptied first, as
    the log's retention empties it."""
    _dead_event(plain, "sec.ret")
    i = plain.one("SELECT outbox.publish('sec.ret', '{}')")[0]
    (tok,) = plain.one("SELECT lease_token FROM outbox.claim('setup', 1, NULL, ARRAY['sec.ret'])")
    assert plain.one("SELECT outbox.fail(%s, %s, 'once', retry_in => '0')", (i, tok))[0] == "pending"
    (tok,) = plain.one("SELECT lease_token FROM outbox.claim('setup', 1, NULL, ARRAY['sec.ret'])")
    assert plain.one("SELECT outbox.ack(%s, %s)", (i, tok))[0]
    plain.one("TRUNCATE outbox.log_0, outbox.log_1, outbox.log_2, outbox.log_3")
    with connect(roles["admin_u"]) as adm:
        adm.execute(stmt)
    left = dict(plain.all("SELECT state, count(*) FROM outbox.events GROUP BY state"))
    if "purge(" in stmt:
        assert left == {"dead": 1}
    elif "purge_dead" in stmt:
        assert left == {"delivered": 1}
    else:  # default windows (7 / 30 days) keep both
        assert left == {"dead": 1, "delivered": 1}


# ---------------------------------------------------------------------------
# 3. A hostile search_path
# ---------------------------------------------------------------------------
FAR_FUTURE = datetime(2999, 1, 1, tzinfo=timezone.utc)
FIXED_UUID = "00000000-0000-0000-0000-00000000beef"
HOSTILE_DDL = f"""
CREATE FUNCTION hostile.yes(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION hostile.no(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR hostile.= (LEFTARG = text, RIGHTARG = text, FUNCTION = hostile.yes);
CREATE OPERATOR hostile.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = hostile.no);
CREATE FUNCTION hostile.yes(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR hostile.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = hostile.yes);
CREATE FUNCTION hostile.yes(uuid, uuid) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE OPERATOR hostile.= (LEFTARG = uuid, RIGHTARG = uuid, FUNCTION = hostile.yes);
CREATE FUNCTION hostile.yes(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql AS 'SELECT true';
CREATE FUNCTION hostile.no(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql AS 'SELECT false';
CREATE OPERATOR hostile.<= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = hostile.yes);
CREATE OPERATOR hostile.< (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = hostile.yes);
CREATE OPERATOR hostile.>= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = hostile.no);
CREATE OPERATOR hostile.> (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = hostile.no);
CREATE FUNCTION hostile.now() RETURNS timestamptz LANGUAGE sql AS $$SELECT '{FAR_FUTURE.isoformat()}'::timestamptz$$;
CREATE FUNCTION hostile.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT '{FAR_FUTURE.isoformat()}'::timestamptz$$;
CREATE FUNCTION hostile.statement_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT '{FAR_FUTURE.isoformat()}'::timestamptz$$;
CREATE FUNCTION hostile.transaction_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT '{FAR_FUTURE.isoformat()}'::timestamptz$$;
CREATE FUNCTION hostile.gen_random_uuid() RETURNS uuid LANGUAGE sql AS $$SELECT '{FIXED_UUID}'::uuid$$;
"""


@pytest.fixture
def hostile(plain):
    """A session of evil_u (all three outbox roles, no superuser) whose own
    schema shadows pg_catalog's =, <>, <, <=, >, >=, now(), clock_timestamp() and
    gen_random_uuid()."""
    ensure_login_role(plain.dsn, "evil_u", OUTBOX_ROLES)
    with connect(plain.dsn) as c:
        c.execute("DROP SCHEMA IF EXISTS hostile CASCADE")
        c.execute("CREATE SCHEMA hostile AUTHORIZATION evil_u")
    evil = connect(role_dsn(plain.dsn, "evil_u"))
    try:
        evil.execute(HOSTILE_DDL)
        evil.execute("SET search_path = hostile, pg_catalog, public")
        # The shadows are live in the caller's own statements.
        assert evil.execute("SELECT now(), clock_timestamp()").fetchone() == (FAR_FUTURE, FAR_FUTURE)
        assert evil.execute("SELECT 'a'::text = 'b'::text, 1::bigint = 2::bigint, 'a'::text <> 'a'::text").fetchone() == (
            True, True, False)
        assert evil.execute("SELECT gen_random_uuid()").fetchone()[0] == uuid.UUID(FIXED_UUID)
        # ... and in any function that does not pin its search_path.
        evil.execute("CREATE FUNCTION hostile.probe() RETURNS timestamptz LANGUAGE sql AS 'SELECT now()'")
        assert evil.execute("SELECT hostile.probe()").fetchone()[0] == FAR_FUTURE
        yield evil
    finally:
        evil.close()
        with connect(plain.dsn) as c:
            c.execute("DROP SCHEMA IF EXISTS hostile CASCADE")


def near_now(ts, plain, slack=timedelta(minutes=1)):
    now = plain.one("SELECT clock_timestamp()")[0]
    return abs(ts - now) < slack


def test_hostile_search_path_changes_nothing(plain, hostile):
    evil = hostile
    c = plain.conn()
    future = c.execute("SELECT outbox.publish('h.t', '{\"k\": \"future\"}', deliver_at => now() + interval '1 hour')").fetchone()[0]
    c.execute("SELECT outbox.create_topic('h.keep')")

    # publish: real timestamps, and a different dispatch key is a different event.
    e1 = evil.execute("SELECT outbox.publish('h.t', '{\"k\": 1}', 'subj', 'hk-1')").fetchone()[0]
    assert evil.execute("SELECT outbox.publish('h.t', '{}', NULL, 'hk-1')").fetchone()[0] == e1
    e2 = evil.execute("SELECT outbox.publish('h.t', '{\"k\": 2}', NULL, 'hk-2')").fetchone()[0]
    assert e2 != e1
    e3, e4, e5 = [r[0] for r in evil.execute(
        "SELECT outbox.publish_batch('h.t', ARRAY['{\"k\": 3}', '{\"k\": 4}', '{\"k\": 5}']::jsonb[], NULL, ARRAY['hk-3', 'hk-4', 'hk-5'])"
    ).fetchall()]
    assert len({e1, e2, e3, e4, e5}) == 5
    for pub_at, avail in c.execute("SELECT published_at, available_at FROM outbox.events WHERE id <> %s", (future,)).fetchall():
        assert near_now(pub_at, plain) and near_now(avail, plain)
    assert c.execute("SELECT count(*) FROM outbox.dispatch_keys").fetchone()[0] == 5

    # claim: the future event stays unclaimable; leases use the real clock; tokens are random.
    got = evil.execute("SELECT id, lease_token, lease_expires_at FROM outbox.claim('evil', 100, '1 min')").fetchall()
    assert sorted(i for i, _, _ in got) == sorted([e1, e2, e3, e4, e5])
    toks = {t for _, t, _ in got}
    assert uuid.UUID(FIXED_UUID) not in toks
    # A batch round's events share one token (README, claim).
    for _, _, exp in got:
        assert near_now(exp, plain, timedelta(minutes=2))
    tok = {i: t for i, t, _ in got}

    # ack / fail / extend_lease with a wrong token are still refused.
    assert evil.execute("SELECT outbox.ack(%s, %s)", (e1, uuid.uuid4())).fetchone()[0] is False
    assert evil.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([e1, e2], [uuid.uuid4(), uuid.uuid4()])).fetchone()[0] == 0
    assert evil.execute("SELECT outbox.fail(%s, %s, 'x')", (e2, uuid.uuid4())).fetchone()[0] == "stale"
    assert evil.execute("SELECT outbox.extend_lease(%s, %s, '1 min')", (e2, uuid.uuid4())).fetchone()[0] is None
    assert c.execute("SELECT count(*) FROM outbox.events WHERE state = 'leased'").fetchone()[0] == 5

    # The right tokens work, on exactly the event named.
    assert evil.execute("SELECT outbox.ack(%s, %s)", (e1, tok[e1])).fetchone()[0] is True
    assert evil.execute("SELECT outbox.fail(%s, %s, 'later', '1 hour')", (e2, tok[e2])).fetchone()[0] == "pending"
    assert evil.execute("SELECT outbox.fail(%s, %s, 'poison', permanent => true)", (e3, tok[e3])).fetchone()[0] == "dead"
    assert evil.execute("SELECT outbox.fail(%s, %s, 'poison', permanent => true)", (e4, tok[e4])).fetchone()[0] == "dead"
    states = dict(c.execute("SELECT id, state FROM outbox.events").fetchall())
    assert states == {future: "pending", e1: "delivered", e2: "pending", e3: "dead", e4: "dead", e5: "leased"}
    (retry_at,) = c.execute("SELECT available_at FROM outbox.events WHERE id = %s", (e2,)).fetchone()
    assert near_now(retry_at - timedelta(hours=1), plain)

    # Nothing is claimable: the delayed event and the retry are in the future.
    assert evil.execute("SELECT count(*) FROM outbox.claim('evil', 100)").fetchone()[0] == 0

    # replay / cancel touch only the event named.
    assert evil.execute("SELECT outbox.replay(%s)", (e3,)).fetchone()[0] is True
    (avail,) = c.execute("SELECT available_at FROM outbox.events WHERE id = %s", (e3,)).fetchone()
    assert near_now(avail, plain)
    assert evil.execute("SELECT outbox.cancel(%s)", (e2,)).fetchone()[0] is True
    assert evil.execute("SELECT outbox.cancel(%s)", (e5,)).fetchone()[0] is False  # leased: never cancelled
    states = dict(c.execute("SELECT id, state FROM outbox.events").fetchall())
    assert states == {future: "pending", e1: "delivered", e2: "cancelled", e3: "pending", e4: "dead", e5: "leased"}

    # Topics: dropping one drops one.
    evil.execute("SELECT outbox.create_topic('h.x', max_attempts => 2)")
    evil.execute("SELECT outbox.alter_topic('h.x', max_attempts => 3)")
    assert dict(c.execute("SELECT topic, max_attempts FROM outbox.topics").fetchall()) == {"h.keep": None, "h.x": 3}
    assert evil.execute("SELECT outbox.drop_topic('h.x')").fetchone()[0] is True
    assert [r[0] for r in c.execute("SELECT topic FROM outbox.topics").fetchall()] == ["h.keep"]

    # Retention keeps what is within its windows (7 / 30 days by the real clock).
    evil.execute("CALL outbox.purge()")
    evil.execute("CALL outbox.purge_dead()")
    evil.execute("CALL outbox.run_maintenance()")
    states_after = dict(c.execute("SELECT id, state FROM outbox.events").fetchall())
    assert states_after == states
    assert c.execute("SELECT count(*) FROM outbox.dispatch_keys").fetchone()[0] == 5

    # Monitoring reads the real clock too.
    health = {r[0]: r for r in evil.execute("SELECT check_name, status, value FROM outbox.health()").fetchall()}
    assert health["backlog_age"][2] == 0  # e3 became ready just now, not 975 years ago
    assert health["dead_letters"][2] == 1
    assert health["expired_leases"][2] == 0
    (scheduled, ready, leased) = evil.execute(
        "SELECT scheduled, ready, leased FROM outbox.stats WHERE topic = 'h.t'").fetchone()
    assert (scheduled, ready, leased) == (1, 1, 1)

    # The shadows were in force all along.
    assert evil.execute("SELECT now()").fetchone()[0] == FAR_FUTURE


# The first keys of the library's locks (src/pg/locks.rs), which it once took with
# PostgreSQL's advisory-lock functions: batches, dead-letter policies, subjects.
# (Lanes are only ever tried, never waited for.)
OUR_OLD_KEYS = {"batch": 0x6F62746C, "policy": 0x6F627470, "subject": 1869903970}


def test_a_role_without_outbox_privileges_cannot_hold_the_librarys_locks(plain, roles):
    """Any login role may call pg_advisory_lock. If the library's own locks were
    advisory locks that SQL can name, nobody_u could make publish, claim and ack
    wait for as long as it likes (found by a break attempt: each hung until
    statement_timeout). They live in a lock space SQL cannot reach."""
    c = plain.conn()
    c.execute("SELECT outbox.create_topic('sec.locks', default_lease => '1 min')")
    c.execute("SELECT outbox.publish('sec.locks', '{}', subject => 'account:42')")
    (eid, tok), = c.execute("SELECT id, lease_token FROM outbox.claim('w', 1)").fetchall()
    nxt = c.execute("SELECT last_value FROM outbox.log_batch_seq").fetchone()[0]
    with connect(roles["nobody_u"]) as evil:
        evil.execute("SELECT pg_advisory_lock(%s, hashtext('account:42'))", (OUR_OLD_KEYS["subject"],))
        evil.execute("SELECT pg_advisory_lock(%s, hashtext('sec.locks'))", (OUR_OLD_KEYS["policy"],))
        # The batch of the claim above and the next 300 batches.
        evil.execute("SELECT pg_advisory_lock(%s, k::int) FROM generate_series(%s::bigint - 1, %s::bigint + 300) k",
                     (OUR_OLD_KEYS["batch"], nxt, nxt))
        w = plain.conn()
        w.execute("SET statement_timeout = '5s'")
        assert w.execute("SELECT outbox.ack(%s, %s)", (eid, tok)).fetchone()[0] is True
        w.execute("SELECT outbox.publish('sec.locks', '{}', subject => 'account:42')")
        w.execute("SELECT outbox.create_subscription('sec_locks_sub', start => 'earliest')")
        got = w.execute("SELECT id, lease_token FROM outbox.claim('w', 10, subscription => 'sec_locks_sub')").fetchall()
        assert len(got) == 1
        assert w.execute("SELECT outbox.fail(%s, %s, 'x', permanent => true)", got[0]).fetchone()[0] == "dead"
