"""Upgrades: ALTER EXTENSION outbox_ext UPDATE from every released version.

1.0.0 is the first release anything upgrades from; until it is tagged and its
install script frozen here, the parametrised test has no case. For each released
version V (pg_test/upgrade/outbox_ext--V.sql is V's install
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
import time
from pathlib import Path

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
        c.execute("SELECT outbox.publish('upg.delayed', '{}', deliver_at => now() + interval '3 seconds')")
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


def version_key(v):
    return tuple(int(x) for x in v.split("."))


def test_frozen_releases_are_1_x_and_each_has_one_upgrade_script():
    """1.0.0 is the first release anything upgrades from: no 0.x install or upgrade
    script is carried (a 0.x install moves by DROP and CREATE EXTENSION, and the
    handshake refuses its SQL). Each frozen release has exactly one upgrade script
    out of it, into the next release, and each script starts with the psql guard."""
    scripts = sorted(p.name for p in (REPO / "sql").glob("outbox_ext--*--*.sql"))
    for v in OLD_VERSIONS:
        assert version_key(v) >= (1, 0, 0), f"0.x install script frozen: {v}"
        assert sum(s.startswith(f"outbox_ext--{v}--") for s in scripts) == 1, f"upgrade scripts from {v}: {scripts}"
    for s in scripts:
        old, new = s[len("outbox_ext--"):-len(".sql")].split("--")
        assert version_key(old) >= (1, 0, 0), f"0.x upgrade script carried: {s}"
        assert old in OLD_VERSIONS, f"{s} upgrades from {old}, which is not frozen in {FIXTURES}"
        first = (REPO / "sql" / s).read_text().splitlines()
        guard = [line for line in first[:5] if line.startswith("\\echo")]
        assert guard and guard[0].rstrip().endswith("\\quit"), f"{s} must start with the \\echo ... \\quit guard"


def test_the_server_offers_no_version_this_library_does_not_serve(plain_dsn):
    """The installed package offers its own version and frozen 1.x releases only:
    no 0.x script (scripts/install-ext.sh removes those other builds left behind)."""
    with connect(plain_dsn) as c:
        offered = sorted(r[0] for r in c.execute(
            "SELECT version FROM pg_available_extension_versions WHERE name = 'outbox_ext'").fetchall())
        current = c.execute("SELECT default_version FROM pg_available_extensions WHERE name = 'outbox_ext'").fetchone()[0]
    assert current in offered, offered
    assert all(v == current or v in OLD_VERSIONS for v in offered), f"versions no release ships: {offered}"
    assert all(version_key(v) >= (1, 0, 0) for v in offered if v.replace(".", "").isdigit()), offered


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
    started = time.monotonic()
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
    time.sleep(max(0.0, 3.5 - (time.monotonic() - started)))  # the delayed event is due
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


def test_latest_upgrade_script_is_assembled_from_the_sources(plain_dsn):
    """sql/outbox_ext--OLD--NEW.sql for the newest frozen release is what
    scripts/upgrade-sql.py makes from the two install scripts (the installed one
    is this build's) and sql/upgrade/OLD--NEW.sql: no hand edit, no stale copy."""
    import subprocess
    import sys
    if not OLD_VERSIONS:
        pytest.skip("no release is frozen in pg_test/upgrade/ yet (1.0.0 is the first)")
    with connect(plain_dsn) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
        new = c.execute("SELECT default_version FROM pg_available_extensions WHERE name = 'outbox_ext'").fetchone()[0]
        install = extension_dir(c) / f"outbox_ext--{new}.sql"
    old = max(OLD_VERSIONS, key=version_key)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "upgrade-sql.py"), old, new, "--check",
                        "--new-install", str(install)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
