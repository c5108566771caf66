"""Upgrades: ALTER EXTENSION outbox_ext UPDATE from every released version.

For each released version V (pg_test/upgrade/outbox_ext--V.sql is V's install
script exactly as it was packaged), in a fresh database:
  1. CREATE EXTENSION outbox_ext VERSION 'V' and give the outbox events in every
     state: pending, delayed, leased (with live lease tokens), dead, delivered,
     cancelled, with subjects, dispatch keys and a registered topic;
  2. ALTER EXTENSION outbox_ext UPDATE;
  3. check every event, state, attempt history and key survived, that the leases
     taken before the upgrade can still be acked with their tokens, and that the
     outbox drains;
  4. compare the upgraded schema with a fresh CREATE EXTENSION: functions (body,
     SECURITY DEFINER, SET clauses, grants, comments), tables and columns, indexes,
     constraints, storage options, views, triggers, event triggers, sequences,
     configuration-table registration and extension membership must all match.
"""

import difflib
import shutil
import threading
import time
from pathlib import Path

import psycopg
import pytest

from conftest import REPO, connect, dsn_with_db

FIXTURES = REPO / "pg_test" / "upgrade"
OLD_VERSIONS = sorted(p.name[len("outbox_ext--"):-len(".sql")] for p in FIXTURES.glob("outbox_ext--*.sql")
                      if p.name.count("--") == 1)

# One line per object property; ORDER BY makes the two sides comparable.
FINGERPRINT = r"""
WITH ext AS (SELECT oid FROM pg_extension WHERE extname = 'outbox_ext'),
nsp AS (SELECT 'outbox'::regnamespace::oid AS oid)
SELECT line FROM (
  SELECT 'member ' || pg_describe_object(d.classid, d.objid, d.objsubid) AS line
    FROM pg_depend d, ext
   WHERE d.refclassid = 'pg_extension'::regclass AND d.refobjid = ext.oid AND d.deptype = 'e'
  UNION ALL
  SELECT 'function ' || pg_get_functiondef(p.oid) || ' acl=' || coalesce(p.proacl::text, '-')
         || ' comment=' || coalesce(obj_description(p.oid, 'pg_proc'), '-')
    FROM pg_proc p, nsp WHERE p.pronamespace = nsp.oid AND p.prokind IN ('f', 'p')
  UNION ALL
  SELECT 'relation ' || c.relname || ' kind=' || c.relkind::text || ' persistence=' || c.relpersistence::text
         || ' options=' || coalesce(c.reloptions::text, '-') || ' acl=' || coalesce(c.relacl::text, '-')
         || ' owner=' || pg_get_userbyid(c.relowner)
         || ' comment=' || coalesce(obj_description(c.oid, 'pg_class'), '-')
    FROM pg_class c, nsp WHERE c.relnamespace = nsp.oid
  UNION ALL
  SELECT 'column ' || c.relname || '.' || a.attname || ' #' || a.attnum || ' ' || format_type(a.atttypid, a.atttypmod)
         || ' notnull=' || a.attnotnull || ' default=' || coalesce(pg_get_expr(ad.adbin, ad.adrelid), '-')
         || ' identity=' || a.attidentity::text || ' acl=' || coalesce(a.attacl::text, '-')
         || ' comment=' || coalesce(col_description(c.oid, a.attnum), '-')
    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
    LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum, nsp
   WHERE c.relnamespace = nsp.oid AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT 'index ' || pg_get_indexdef(i.indexrelid)
    FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid, nsp WHERE c.relnamespace = nsp.oid
  UNION ALL
  SELECT 'constraint ' || conrelid::regclass || ' ' || conname || ' ' || pg_get_constraintdef(k.oid)
    FROM pg_constraint k, nsp WHERE k.connamespace = nsp.oid
  UNION ALL
  SELECT 'view ' || c.oid::regclass || ' ' || pg_get_viewdef(c.oid)
    FROM pg_class c, nsp WHERE c.relnamespace = nsp.oid AND c.relkind IN ('v', 'm')
  UNION ALL
  SELECT 'trigger ' || pg_get_triggerdef(t.oid) || ' enabled=' || t.tgenabled::text
    FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid, nsp
   WHERE c.relnamespace = nsp.oid AND NOT t.tgisinternal
  UNION ALL
  SELECT 'event trigger ' || evtname || ' on ' || evtevent || ' ' || evtfoid::regproc::text
         || ' enabled=' || evtenabled::text || ' tags=' || coalesce(evttags::text, '-')
    FROM pg_event_trigger
  UNION ALL
  SELECT 'sequence ' || s.seqrelid::regclass || ' ' || format_type(s.seqtypid, NULL) || ' start=' || s.seqstart
         || ' inc=' || s.seqincrement || ' min=' || s.seqmin || ' max=' || s.seqmax || ' cache=' || s.seqcache
         || ' cycle=' || s.seqcycle
    FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid, nsp WHERE c.relnamespace = nsp.oid
  UNION ALL
  SELECT 'config ' || u.c::regclass || ' where=' || coalesce(nullif(u.cond, ''), '-')
    FROM pg_extension e, unnest(e.extconfig, e.extcondition) AS u(c, cond) WHERE e.extname = 'outbox_ext'
  UNION ALL
  SELECT 'schema outbox owner=' || pg_get_userbyid(n.nspowner) || ' acl=' || coalesce(n.nspacl::text, '-')
         || ' comment=' || coalesce(obj_description(n.oid, 'pg_namespace'), '-')
    FROM pg_namespace n, nsp WHERE n.oid = nsp.oid
  UNION ALL
  SELECT 'extension ' || extname || ' ' || extversion || ' relocatable=' || extrelocatable
    FROM pg_extension WHERE extname = 'outbox_ext'
  UNION ALL
  SELECT 'role ' || rolname || ' login=' || rolcanlogin || ' inherit=' || rolinherit
    FROM pg_roles WHERE rolname IN ('outbox_publisher', 'outbox_worker', 'outbox_admin')
) AS all_lines
ORDER BY line
"""

# Everything an operator can see about the events, in a stable order.
EVENTS = """
SELECT id, topic, subject, dispatch_key, payload, headers, state, attempts, max_attempts,
       last_error, errors, published_at
  FROM outbox.events ORDER BY id
"""


def extension_dir(c):
    return Path(c.execute("SELECT setting FROM pg_config WHERE name = 'SHAREDIR'").fetchone()[0]) / "extension"


def install_fixture(c, version):
    """Put version's install script next to the installed extension (if needed)."""
    src = FIXTURES / f"outbox_ext--{version}.sql"
    dst = extension_dir(c) / src.name
    if dst.exists() and dst.read_bytes() == src.read_bytes():
        return
    try:
        tmp = dst.with_suffix(".sql.tmp")
        shutil.copyfile(src, tmp)
        tmp.chmod(0o644)
        tmp.replace(dst)
    except OSError as e:
        pytest.fail(f"cannot install {src} into {dst.parent} ({e}); run the tests as a user who can", pytrace=False)


@pytest.fixture
def scratch_db(plain_dsn):
    """A factory of empty databases on the plain cluster, dropped afterwards."""
    made = []
    admin = connect(plain_dsn)

    def make(name):
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {name}")
        made.append(name)
        return dsn_with_db(plain_dsn, name)

    yield make
    for name in made:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    admin.close()


def fingerprint(c):
    return [r[0] for r in c.execute(FINGERPRINT).fetchall()]


def populate(c):
    """Events in every state; returns the leases still held (id, token)."""
    c.execute("SET outbox.notify = off")
    c.execute("SELECT outbox.create_topic('upg.registered', max_attempts => 2)")
    with c.transaction():
        for i in range(60):
            c.execute(
                "SELECT outbox.publish(%s, jsonb_build_object('n', %s::int), subject => %s, dispatch_key => %s, "
                "headers => '{\"traceparent\": \"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\"}')",
                ("upg.registered" if i % 3 == 0 else "upg.plain", i, f"s{i % 7}" if i % 2 else None, f"k{i}"),
            )
        c.execute("SELECT count(*) FROM outbox.publish_batch('upg.batch', "
                  "ARRAY(SELECT jsonb_build_object('b', g) FROM generate_series(1, 40) g))")
        c.execute("SELECT outbox.publish('upg.delayed', '{}', deliver_at => now() + interval '1 hour')")
    claimed = c.execute("SELECT id, lease_token FROM outbox.claim('before', 30)").fetchall()
    assert len(claimed) == 30
    acked, failed, held = claimed[:10], claimed[10:20], claimed[20:]
    assert c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                     ([i for i, _ in acked], [t for _, t in acked])).fetchone()[0] == 10
    for i, t in failed[:5]:
        c.execute("SELECT outbox.fail(%s, %s, 'permanent', permanent => true)", (i, t))
    for i, t in failed[5:]:
        c.execute("SELECT outbox.fail(%s, %s, 'transient', retry_in => interval '0')", (i, t))
    cancel = c.execute("SELECT id FROM outbox.events WHERE state = 'pending' AND subject IS NULL "
                       "ORDER BY id DESC LIMIT 1").fetchone()[0]
    c.execute("SELECT outbox.cancel(%s)", (cancel,))
    states = dict(c.execute("SELECT state, count(*) FROM outbox.events GROUP BY state").fetchall())
    assert {"pending", "leased", "dead", "delivered", "cancelled"} <= set(states), states
    return held


def drain(c):
    """Claim and ack until nothing is claimable; returns how many were acked."""
    total = 0
    for _ in range(1000):
        rows = c.execute("SELECT id, lease_token FROM outbox.claim('after', 50)").fetchall()
        if not rows:
            return total
        total += c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                           ([r[0] for r in rows], [r[1] for r in rows])).fetchone()[0]
    pytest.fail("the outbox did not drain")


def test_old_versions_are_packaged_fixtures():
    """There is something to upgrade from, and each fixture has an upgrade path."""
    assert OLD_VERSIONS, f"no released install scripts in {FIXTURES}"
    scripts = sorted(p.name for p in (REPO / "sql").glob("outbox_ext--*--*.sql"))
    for v in OLD_VERSIONS:
        assert any(s.startswith(f"outbox_ext--{v}--") for s in scripts), f"no upgrade script from {v}: {scripts}"
    for s in scripts:
        first = (REPO / "sql" / s).read_text().splitlines()
        guard = [line for line in first[:5] if line.startswith("\\echo")]
        assert guard and guard[0].rstrip().endswith("\\quit"), f"{s} must start with the \\echo ... \\quit guard"


@pytest.mark.parametrize("old", OLD_VERSIONS)
def test_upgrade_keeps_events_and_matches_fresh_install(scratch_db, old):
    fresh = connect(scratch_db("outbox_upg_fresh"))
    fresh.execute("CREATE EXTENSION outbox_ext")
    current = fresh.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0]
    assert current != old
    install_fixture(fresh, old)

    old_dsn = scratch_db("outbox_upg_old")
    c = connect(old_dsn)
    c.execute("CREATE EXTENSION outbox_ext VERSION %s" % psycopg_literal(old))
    assert c.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] == old
    held = populate(c)
    before = c.execute(EVENTS).fetchall()
    keys_before = c.execute("SELECT dispatch_key, event_id FROM outbox.dispatch_keys ORDER BY 1").fetchall()
    topics_before = c.execute("SELECT topic, max_attempts FROM outbox.topics ORDER BY 1").fetchall()

    c.execute("ALTER EXTENSION outbox_ext UPDATE")
    c.close()
    c = connect(old_dsn)  # a new session, as an application would have after the upgrade
    assert c.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] == current

    # Nothing lost or changed.
    assert c.execute(EVENTS).fetchall() == before
    assert c.execute("SELECT dispatch_key, event_id FROM outbox.dispatch_keys ORDER BY 1").fetchall() == keys_before
    assert c.execute("SELECT topic, max_attempts FROM outbox.topics ORDER BY 1").fetchall() == topics_before

    # The schema is exactly a fresh install's.
    got, want = fingerprint(c), fingerprint(fresh)
    diff = "\n".join(difflib.unified_diff(want, got, "fresh install", f"upgraded from {old}", lineterm="", n=0))
    assert got == want, "upgraded schema differs from a fresh install:\n" + diff

    # Leases taken before the upgrade are still honoured (tokens fence), then
    # everything drains: the dead letters after a replay, the delayed event once due.
    c.execute("SET outbox.notify = off")
    assert c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                     ([i for i, _ in held], [t for _, t in held])).fetchone()[0] == len(held)
    # A key published before the upgrade still deduplicates.
    first = c.execute("SELECT event_id FROM outbox.dispatch_keys WHERE dispatch_key = 'k1'").fetchone()[0]
    assert c.execute("SELECT outbox.publish('upg.plain', '{}', dispatch_key => 'k1')").fetchone()[0] == first
    drain(c)
    c.execute("SELECT outbox.replay_dead()")
    c.execute("UPDATE outbox.event_queue SET visible_at = now() WHERE topic = 'upg.delayed'")
    drain(c)
    left = c.execute("SELECT state, count(*) FROM outbox.events WHERE state NOT IN ('delivered', 'cancelled') "
                     "GROUP BY state").fetchall()
    assert left == []
    assert c.execute("SELECT count(*) FROM outbox.events").fetchone()[0] == len(before)
    c.close()
    fresh.close()


def psycopg_literal(s):
    assert all(ch.isalnum() or ch in "._-" for ch in s), s
    return "'" + s + "'"


def test_claims_follow_the_installed_sql_within_one_session(scratch_db):
    """A 0.5.0 library claims with 0.4.0's statements until outbox._lock_row
    exists, and switches back when an ALTER EXTENSION UPDATE rolls back or the
    extension is recreated at 0.4.0, all in one session (the library must not
    remember a function the catalog no longer has)."""
    c = connect(scratch_db("outbox_upg_switch"))
    install_fixture(c, "0.4.0")
    c.execute("CREATE EXTENSION outbox_ext VERSION '0.4.0'")
    c.execute("SET outbox.notify = off")

    def claim_one(topic):
        eid = c.execute("SELECT outbox.publish(%s, '{}', subject => 's')", (topic,)).fetchone()[0]
        rows = c.execute("SELECT id, lease_token FROM outbox.claim('w', 10, NULL, ARRAY[%s])", (topic,)).fetchall()
        assert [r[0] for r in rows] == [eid]
        assert c.execute("SELECT outbox.ack(%s::bigint, %s::uuid)", rows[0]).fetchone()[0]

    claim_one("sw.a")                     # 0.4.0 SQL
    c.execute("BEGIN")
    c.execute("ALTER EXTENSION outbox_ext UPDATE TO '0.5.0'")
    claim_one("sw.b")                     # 0.5.0 SQL, inside the update's transaction
    c.execute("ROLLBACK")
    claim_one("sw.c")                     # 0.4.0 again
    c.execute("DROP EXTENSION outbox_ext")
    c.execute("CREATE EXTENSION outbox_ext VERSION '0.4.0'")
    claim_one("sw.d")
    c.execute("ALTER EXTENSION outbox_ext UPDATE")
    claim_one("sw.e")
    c.close()


def test_latest_upgrade_script_is_assembled_from_the_sources(plain_dsn):
    """sql/outbox_ext--OLD--NEW.sql for the newest frozen release is what
    scripts/upgrade-sql.py makes from the two install scripts (the installed one
    is this build's) and sql/upgrade/OLD--NEW.sql: no hand edit, no stale copy."""
    import subprocess
    import sys
    with connect(plain_dsn) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
        new = c.execute("SELECT default_version FROM pg_available_extensions WHERE name = 'outbox_ext'").fetchone()[0]
        install = extension_dir(c) / f"outbox_ext--{new}.sql"
    old = max(OLD_VERSIONS, key=lambda v: tuple(int(x) for x in v.split(".")))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "upgrade-sql.py"), old, new, "--check",
                        "--new-install", str(install)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_update_to_subscriptions_keeps_the_grants_of_replaced_functions(scratch_db):
    """0.7.0 replaces claim, replay, replay_dead and cancel (a trailing
    subscription argument, not an overload); grants a user made on the old
    signatures carry over to the new ones, grant option included."""
    c = connect(scratch_db("outbox_upg_grants"))
    install_fixture(c, "0.6.0")
    c.execute("CREATE EXTENSION outbox_ext VERSION '0.6.0'")
    c.execute("DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'upg_custom') THEN "
              "CREATE ROLE upg_custom NOLOGIN; END IF; END $$")
    c.execute("GRANT EXECUTE ON FUNCTION outbox.claim(text, integer, interval, text[]) TO upg_custom")
    c.execute("GRANT EXECUTE ON FUNCTION outbox.replay(bigint) TO upg_custom WITH GRANT OPTION")
    c.execute("GRANT EXECUTE ON FUNCTION outbox.cancel(bigint) TO PUBLIC")
    # Under the 0.6.0 SQL the new library claims and fails as 0.6.0 did.
    c.execute("SET outbox.notify = off")
    ids = [c.execute("SELECT outbox.publish('upg.g', '{}')").fetchone()[0] for _ in range(2)]
    (i, tok), = c.execute("SELECT id, lease_token FROM outbox.claim('w', 1)").fetchall()
    assert c.execute("SELECT outbox.fail(%s, %s, 'x', permanent => true)", (i, tok)).fetchone()[0] == "dead"
    c.execute("ALTER EXTENSION outbox_ext UPDATE TO '0.7.0'")

    def can(role, fn, grant_option=False):
        priv = "EXECUTE WITH GRANT OPTION" if grant_option else "EXECUTE"
        return c.execute("SELECT has_function_privilege(%s, %s, %s)", (role, fn, priv)).fetchone()[0]

    assert can("upg_custom", "outbox.claim(text, integer, interval, text[], text)")
    assert can("upg_custom", "outbox.replay(bigint, text)", grant_option=True)
    assert not can("upg_custom", "outbox.cancel(bigint, text)", grant_option=True)
    assert can("public", "outbox.cancel(bigint, text)")
    assert not can("public", "outbox.claim(text, integer, interval, text[], text)")
    assert can("outbox_worker", "outbox.claim(text, integer, interval, text[], text)")
    # Every event is the default subscription's, in its state.
    assert c.execute("SELECT name, lag_events, dead_letters FROM outbox.subscriptions").fetchall() == [("default", 1, 1)]
    assert [r[0] for r in c.execute("SELECT id FROM outbox.claim('w', 5, subscription => 'default')").fetchall()] \
        == [ids[1]]
    assert c.execute("SELECT outbox.replay(%s, 'default')", (i,)).fetchone()[0] is True
    c.close()


def test_update_to_0_10_keeps_the_grants_of_create_and_alter_subscription(scratch_db):
    """0.10.0 replaces create_subscription and alter_subscription (a trailing
    max_lag argument); grants made on the old signatures carry over, and the
    existing 'default' reads the queue while named subscriptions read the log."""
    c = connect(scratch_db("outbox_upg_grants_010"))
    install_fixture(c, "0.9.0")
    c.execute("CREATE EXTENSION outbox_ext VERSION '0.9.0'")
    c.execute("DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'upg_custom') THEN "
              "CREATE ROLE upg_custom NOLOGIN; END IF; END $$")
    c.execute("GRANT EXECUTE ON FUNCTION outbox.create_subscription(text, text[], text, integer, interval, interval, "
              "interval, text) TO upg_custom WITH GRANT OPTION")
    c.execute("GRANT EXECUTE ON FUNCTION outbox.alter_subscription(text, integer, interval, interval, interval) "
              "TO upg_custom")
    c.execute("SELECT outbox.create_subscription('named')")
    c.execute("ALTER EXTENSION outbox_ext UPDATE TO '0.10.0'")

    def can(role, fn, grant_option=False):
        priv = "EXECUTE WITH GRANT OPTION" if grant_option else "EXECUTE"
        return c.execute("SELECT has_function_privilege(%s, %s, %s)", (role, fn, priv)).fetchone()[0]

    assert can("upg_custom", "outbox.create_subscription(text, text[], text, integer, interval, interval, interval, "
               "text, interval)", grant_option=True)
    assert can("upg_custom", "outbox.alter_subscription(text, integer, interval, interval, interval, interval)")
    assert not can("upg_custom", "outbox.alter_subscription(text, integer, interval, interval, interval, interval)",
                   grant_option=True)
    assert c.execute("SELECT name, storage FROM outbox.subscriptions ORDER BY name").fetchall() == \
        [("default", "queue"), ("named", "log")]
    c.close()


def test_update_to_0_12_moves_default_to_the_log_with_every_event_in_its_state(scratch_db):
    """0.12.0 moves the 'default' that read the queue onto the log
    (outbox._default_to_log): each event keeps its state, attempts and error
    history, a lease taken before the update still acks with its token, a dead
    letter still holds its subject, cancelled events can be replayed, and the
    outbox drains every event exactly once, in subject order."""
    dsn = scratch_db("outbox_upg_to_log")
    c = connect(dsn)
    install_fixture(c, "0.11.0")
    c.execute("CREATE EXTENSION outbox_ext VERSION '0.11.0'")
    c.execute("SET outbox.notify = off")
    c.execute("SELECT outbox.create_topic('u.skip', dead_letter_policy => 'skip')")
    c.execute("SELECT outbox.create_subscription('named')")

    def pub(topic, subject=None, **kw):
        args = "".join(f", {k} => %({k})s" for k in kw)
        return c.execute(f"SELECT outbox.publish(%(t)s, '{{}}', subject => %(s)s{args})",
                         {"t": topic, "s": subject, **kw}).fetchone()[0]

    def claim(topic, lease="10 min"):
        (row,) = c.execute("SELECT id, lease_token FROM outbox.claim('w', 1, %s::interval, ARRAY[%s])",
                           (lease, topic)).fetchall()
        return row

    head, nxt = pub("u.order", "s1"), pub("u.order", "s1")
    delayed = pub("u.later", deliver_at="2999-01-01")
    dead, held = pub("u.dead", "s2"), pub("u.dead", "s2")
    skipped, free = pub("u.skip", "s3"), pub("u.skip", "s3")
    retry, leased, done, cancelled = pub("u.retry"), pub("u.leased"), pub("u.done"), pub("u.cancel")
    assert c.execute("SELECT outbox.fail(%s, %s, 'gone', permanent => true)", claim("u.dead")).fetchone()[0] == "dead"
    assert c.execute("SELECT outbox.fail(%s, %s, 'gone', permanent => true)", claim("u.skip")).fetchone()[0] == "dead"
    assert c.execute("SELECT outbox.fail(%s, %s, 'later', '1 hour')", claim("u.retry")).fetchone()[0] == "pending"
    assert c.execute("SELECT outbox.ack(%s, %s)", claim("u.done")).fetchone()[0]
    assert c.execute("SELECT outbox.cancel(%s)", (cancelled,)).fetchone()[0]
    lease_id, token = claim("u.leased")
    assert lease_id == leased
    before = c.execute("SELECT id, state, attempts, last_error, errors FROM outbox.events ORDER BY id").fetchall()

    c.execute("ALTER EXTENSION outbox_ext UPDATE TO '0.12.0'")
    c.close()
    c = connect(dsn)  # a new session, as after the update
    c.execute("SET outbox.notify = off")
    assert c.execute("SELECT name, storage FROM outbox.subscriptions ORDER BY name").fetchall() == \
        [("default", "log"), ("named", "log")]
    assert c.execute("SELECT count(*) FROM outbox.event_queue").fetchone()[0] == 0
    assert c.execute("SELECT id, state, attempts, last_error, errors FROM outbox.events ORDER BY id").fetchall() == before
    # The lease taken before the update is still its worker's.
    assert c.execute("SELECT outbox.extend_lease(%s, %s, '1 min') IS NOT NULL", (leased, token)).fetchone()[0]
    assert c.execute("SELECT outbox.ack(%s, %s)", (leased, token)).fetchone()[0] is True
    assert c.execute("SELECT outbox.ack(%s, %s)", (leased, token)).fetchone()[0] is False
    # Due now: the subject heads and the event a skipped dead letter released;
    # not the one behind the blocking dead letter, the delayed one, the retry.
    got = {r[0]: r[1] for r in c.execute("SELECT id, lease_token FROM outbox.claim('w', 100, '10 min')")}
    assert set(got) == {head, free}, (got, {"head": head, "free": free})
    assert c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", (list(got), list(got.values()))).fetchone()[0] == 2
    # Publish writes the log alone now.
    after = pub("u.new")
    assert c.execute("SELECT count(*) FROM outbox.event_queue").fetchone()[0] == 0
    # Replay the cancelled and the dead events, make the retry and the delay due, and drain.
    assert c.execute("SELECT outbox.replay(%s)", (cancelled,)).fetchone()[0] is True
    assert c.execute("SELECT outbox.replay_dead()").fetchone()[0] == 2
    c.execute("UPDATE outbox.log_exceptions SET visible_at = now() WHERE subscription = 'default' AND state = 'pending'")
    order, deadline = [], time.monotonic() + 30
    while True:
        rows = c.execute("SELECT id, lease_token FROM outbox.claim('drain', 100, '1 min')").fetchall()
        for i, tok in rows:
            assert c.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0], f"ack of {i} refused"
            order.append(i)
        if not rows:
            break
        assert time.monotonic() < deadline
    # head and free were delivered above: the rest once each.
    assert sorted(order) == sorted({nxt, delayed, dead, held, skipped, retry, cancelled, after}), order
    assert order.index(dead) < order.index(held)
    c.close()


def _upgrade_db(scratch_db, name):
    dsn = scratch_db(name)
    with connect(dsn) as c:
        install_fixture(c, "0.11.0")
        c.execute("CREATE EXTENSION outbox_ext VERSION '0.11.0'")
    return dsn


def test_update_to_0_12_never_deadlocks_with_a_publisher(scratch_db):
    """A publisher of 0.11.0 locks the queue, then the ring table it appends to.
    The update takes the queue first, before its index builds lock the ring
    tables (found by review: a publish that came between them deadlocked with
    it). A reader holding a view the update replaces keeps it waiting there."""
    dsn = _upgrade_db(scratch_db, "outbox_upg_no_deadlock")
    with connect(dsn) as c:
        c.execute("SELECT outbox.publish('t', '{}')")
    reader = connect(dsn, autocommit=False)
    reader.execute("SELECT count(*) FROM outbox.events")  # holds a lock on a view the update replaces
    res = {}

    def run(key, sql):
        try:
            with connect(dsn) as c:
                c.execute("SET lock_timeout = '20s'")
                cur = c.execute(sql)
                res[key] = cur.fetchone() if cur.description else "done"
        except psycopg.Error as e:
            res[key] = ("error", e.sqlstate)

    alter = threading.Thread(target=run, args=("alter", "ALTER EXTENSION outbox_ext UPDATE TO '0.12.0'"))
    alter.start()
    time.sleep(0.5)
    pub = threading.Thread(target=run, args=("publish", "SELECT outbox.publish('t', '{\"x\": 1}')"))
    pub.start()
    time.sleep(0.5)
    reader.commit()
    alter.join(30)
    pub.join(30)
    reader.close()
    assert res.get("alter") == "done", res
    assert isinstance(res.get("publish"), tuple) and res["publish"][0] != "error", res
    with connect(dsn) as c:
        assert c.execute("SELECT storage FROM outbox.subscription_catalog WHERE name = 'default'").fetchone()[0] == "log"
        got = [r[0] for r in c.execute("SELECT id FROM outbox.claim('w', 10)")]
        assert sorted(got) == [1, res["publish"][0]]


def test_tokens_used_while_the_update_runs_still_lease_their_events(scratch_db):
    """An ack, fail or extend_lease with a token of the queue that waited for
    the update's lock finds its row gone from the queue: it goes on in the log,
    where the move put the row with its token (found by review: false, 'stale'
    and NULL before)."""
    dsn = _upgrade_db(scratch_db, "outbox_upg_tokens_during")
    with connect(dsn) as c:
        ids = [c.execute("SELECT outbox.publish('t', '{}')").fetchone()[0] for _ in range(3)]
        tok = dict(c.execute("SELECT id, lease_token FROM outbox.claim('w', 3, '10 min')").fetchall())
    up = connect(dsn, autocommit=False)
    up.execute("ALTER EXTENSION outbox_ext UPDATE TO '0.12.0'")  # holds the queue until it commits
    res = {}

    def call(key, sql, i):
        with connect(dsn) as c:
            res[key] = c.execute(sql, (i, tok[i])).fetchone()[0]

    ths = [threading.Thread(target=call, args=a) for a in (
        ("ack", "SELECT outbox.ack(%s, %s)", ids[0]),
        ("fail", "SELECT outbox.fail(%s, %s, 'x', '1 hour')", ids[1]),
        ("extend", "SELECT outbox.extend_lease(%s, %s, '1 hour') IS NOT NULL", ids[2]))]
    for t in ths:
        t.start()
    time.sleep(0.5)
    assert res == {}, f"calls did not wait for the update: {res}"
    up.commit()
    for t in ths:
        t.join(30)
    up.close()
    assert res == {"ack": True, "fail": "pending", "extend": True}, res
    with connect(dsn) as c:
        assert c.execute("SELECT id, state FROM outbox.events ORDER BY id").fetchall() == \
            [(ids[0], "delivered"), (ids[1], "pending"), (ids[2], "leased")]
