"""The library/SQL handshake (src/handshake.rs): the library serves only the SQL
it was built with, in every direction, and no session keeps a verdict across a
change of the installed SQL.

The installed side is made to differ the ways it can in the field: a fingerprint
another build recorded (same version), SQL newer than the library (a real
ALTER EXTENSION UPDATE to a version whose script records another fingerprint),
and 0.x SQL (a version below 1.0.0 and no recorded fingerprint).
"""

import os
import re
import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from conftest import connect
from scratch_db import create_db, drop_db

MISMATCH = "55000"
OTHER = "0" * 64

RECORD = """DO $$ BEGIN
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION outbox._sql_fingerprint() RETURNS text LANGUAGE sql IMMUTABLE AS %L',
        pg_catalog.format('SELECT %L::text', {value}));
END $$"""


def record(c, value_sql):
    c.execute(RECORD.format(value=value_sql))


def refused(c, sql, params=None):
    """The SQLSTATE and HINT of sql's error (fails when it succeeds)."""
    with pytest.raises(psycopg.Error) as e:
        c.execute(sql, params)
    return e.value.sqlstate, e.value.diag.message_hint or "", e.value.diag.message_primary or ""


@pytest.fixture
def db(plain_dsn):
    name = "outbox_handshake"
    dsn = create_db(plain_dsn, name)
    yield dsn
    drop_db(plain_dsn, name)


def extension_dir(c):
    return Path(c.execute("SELECT setting FROM pg_config WHERE name = 'SHAREDIR'").fetchone()[0]) / "extension"


def test_a_fresh_install_records_the_librarys_fingerprint_and_is_served(db):
    with connect(db) as c:
        lib, sql = c.execute("SELECT outbox._library_fingerprint(), outbox._sql_fingerprint()").fetchone()
        assert re.fullmatch(r"[0-9a-f]{64}", lib) and sql == lib
        assert c.execute("SELECT outbox._handshake()").fetchone()[0] is None
        assert c.execute("SELECT outbox.publish('hs.ok', '{}')").fetchone()[0] > 0


def test_a_fingerprint_another_build_recorded_is_refused_everywhere(db):
    """Same version, other SQL: what a library built from main after an unbumped
    SQL change meets. Publish, claim, ack and the admin functions all refuse."""
    with connect(db) as c:
        record(c, f"'{OTHER}'")
        for sql in ("SELECT outbox.publish('hs.x', '{}')",
                    "SELECT * FROM outbox.claim('w', 1)",
                    "SELECT outbox.ack(1, gen_random_uuid())",
                    "SELECT outbox.create_topic('hs.t')",
                    "SELECT outbox.create_subscription('hs_s')"):
            state, hint, msg = refused(c, sql)
            assert state == MISMATCH, (sql, state, msg)
            assert "another build" in hint, (sql, hint)
            assert "fingerprint 000000000000" in msg, msg
        assert "not the SQL this library serves" in c.execute("SELECT outbox._handshake()").fetchone()[0]
        # Recording the library's own fingerprint again serves the database.
        record(c, "outbox._library_fingerprint()")
        assert c.execute("SELECT outbox.publish('hs.x', '{}')").fetchone()[0] > 0


def test_sql_of_0x_is_refused_with_the_way_to_move(db):
    with connect(db) as c:
        c.execute("ALTER EXTENSION outbox_ext DROP FUNCTION outbox._sql_fingerprint()")
        c.execute("DROP FUNCTION outbox._sql_fingerprint()")
        c.execute("UPDATE pg_extension SET extversion = '0.16.0' WHERE extname = 'outbox_ext'")
        state, hint, msg = refused(c, "SELECT outbox.publish('hs.x', '{}')")
        assert state == MISMATCH
        assert "version 0.16.0, fingerprint none" in msg, msg
        assert "DROP EXTENSION outbox_ext, CREATE EXTENSION outbox_ext" in hint, hint
        # The way out the hint names works (nothing is pending).
        c.execute("DROP EXTENSION outbox_ext")
        c.execute("CREATE EXTENSION outbox_ext")
        assert c.execute("SELECT outbox.publish('hs.x', '{}')").fetchone()[0] > 0


@pytest.fixture
def newer_version(plain_dsn):
    """Update scripts to a version '9.0.0' whose SQL records another fingerprint,
    and back (the way back records this library's again)."""
    with connect(plain_dsn) as c:
        ext = extension_dir(c)
        current = c.execute(
            "SELECT default_version FROM pg_available_extensions WHERE name = 'outbox_ext'").fetchone()[0]
    scripts = {
        ext / f"outbox_ext--{current}--9.0.0.sql": RECORD.format(value=f"'{OTHER}'") + ";\n",
        ext / f"outbox_ext--9.0.0--{current}.sql": RECORD.format(value="outbox._library_fingerprint()") + ";\n",
    }
    for path, text in scripts.items():
        path.write_text(text)
        path.chmod(0o644)
    yield current
    for path in scripts:
        path.unlink(missing_ok=True)


def test_no_session_keeps_a_verdict_across_an_update(db, newer_version):
    """Session A is served; B updates the extension to SQL newer than the
    library; A's next call is refused (told to install the newer library), and
    served again once B goes back: in both directions, no cached verdict
    survives. An update that rolls back leaves everyone served."""
    a, b = connect(db), connect(db)
    try:
        assert a.execute("SELECT outbox.publish('hs.a', '{}')").fetchone()[0] > 0
        b.execute("ALTER EXTENSION outbox_ext UPDATE TO '9.0.0'")
        state, hint, _ = refused(a, "SELECT outbox.publish('hs.a', '{}')")
        assert state == MISMATCH
        assert "library is older" in hint and "version 9.0.0" in hint, hint
        b.execute(f"ALTER EXTENSION outbox_ext UPDATE TO '{newer_version}'")
        assert a.execute("SELECT outbox.publish('hs.a', '{}')").fetchone()[0] > 0

        b.execute("BEGIN")
        b.execute("ALTER EXTENSION outbox_ext UPDATE TO '9.0.0'")
        b.execute("SAVEPOINT s")
        assert refused(b, "SELECT outbox.publish('hs.b', '{}')")[0] == MISMATCH
        b.execute("ROLLBACK TO SAVEPOINT s")
        b.execute("ROLLBACK")
        assert b.execute("SELECT extversion FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] \
            == newer_version
        assert b.execute("SELECT outbox.publish('hs.b', '{}')").fetchone()[0] > 0
        assert a.execute("SELECT outbox.publish('hs.a', '{}')").fetchone()[0] > 0
    finally:
        a.close()
        b.close()


def preload_log():
    name = os.environ.get("OUTBOX_TEST_CLUSTER_PRELOAD")
    if not name:
        return None
    root = os.environ.get("OUTBOX_PG_ROOT", "/tmp/outbox-pg")
    path = Path(root) / name / "server.log"
    return path if path.exists() else None


def passes(dsn):
    with connect(dsn) as c:
        return c.execute("SELECT passes, state FROM outbox.wakeup_status()").fetchone()


def wait_serving(dsn, timeout=15.0):
    deadline = time.monotonic() + timeout
    while True:
        n, state = passes(dsn)
        if state == "serving" and n > 0:
            return n
        assert time.monotonic() < deadline, f"not served within {timeout} s: {state}"
        time.sleep(0.1)


def test_the_background_worker_serves_nothing_in_a_mismatched_database_and_goes_on_elsewhere(preload_dsn):
    """One database's SQL fails the handshake: its worker stops its passes and
    says why once (a line a minute), another database's worker goes on, and the
    first is served again as soon as its SQL matches."""
    bad, good = "outbox_hs_bad", "outbox_hs_good"
    bad_dsn, good_dsn = create_db(preload_dsn, bad), create_db(preload_dsn, good)
    log = preload_log()
    offset = log.stat().st_size if log else 0
    try:
        wait_serving(bad_dsn)
        wait_serving(good_dsn)
        with connect(bad_dsn) as c:
            record(c, f"'{OTHER}'")
        time.sleep(1.5)  # the pass under way ends; every later one stops at the check
        frozen = passes(bad_dsn)[0]
        good_before = passes(good_dsn)[0]
        time.sleep(3)
        assert passes(bad_dsn)[0] == frozen, "the worker went on serving a mismatched database"
        assert passes(good_dsn)[0] >= good_before + 2, "the other database's worker stopped too"
        if log:
            text = log.read_bytes()[offset:].decode(errors="replace")
            lines = [ln for ln in text.splitlines() if "serving nothing in this database" in ln]
            assert len(lines) == 1, lines
            assert "another build" in lines[0]
        with connect(bad_dsn) as c:
            record(c, "outbox._library_fingerprint()")
        deadline = time.monotonic() + 10
        while passes(bad_dsn)[0] <= frozen:
            assert time.monotonic() < deadline, "the worker did not serve the database again"
            time.sleep(0.1)
    finally:
        drop_db(preload_dsn, bad)
        drop_db(preload_dsn, good)


OLD_COMMENT = "Transactional outbox: publish in your transaction, claim with fenced leases, ack/fail with backoff"
PG_BIN = os.environ.get("PG_BINDIR", "/usr/lib/postgresql/15/bin")


def test_a_dump_of_0x_is_refused_before_any_row_loads(plain_dsn, tmp_path):
    """A 0.x dump sets the extension's 0.x comment right after CREATE EXTENSION and
    before any data. The dump here is a 1.x dump with that one line as every 0.x
    dump has it: restored in one transaction it fails there with 0A000 and leaves
    nothing; a 1.x dump as it is restores."""
    src, dst = "outbox_hs_dump_src", "outbox_hs_dump_dst"
    src_dsn = create_db(plain_dsn, src)
    dst_dsn = create_db(plain_dsn, dst, extension=False)
    try:
        with connect(src_dsn) as c:
            c.execute("SELECT outbox.publish('hs.dump', '{}')")
        plain = tmp_path / "dump.sql"
        r = subprocess.run([f"{PG_BIN}/pg_dump", "-Fp", "-d", src_dsn, "-f", str(plain)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        text = plain.read_text()
        line = re.search(r"^COMMENT ON EXTENSION outbox_ext IS '([^']*)';$", text, re.M)
        assert line, "pg_dump wrote no COMMENT ON EXTENSION outbox_ext"
        assert text.index(line.group(0)) < text.index("COPY outbox."), "the comment must come before the data"
        old = tmp_path / "dump-0x.sql"
        old.write_text(text.replace(line.group(0), f"COMMENT ON EXTENSION outbox_ext IS '{OLD_COMMENT}';"))

        r = subprocess.run([f"{PG_BIN}/psql", "-X", "-q", "-1", "-v", "ON_ERROR_STOP=1", "-d", dst_dsn, "-f", str(old)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert "this is a dump of outbox_ext 0.x" in r.stderr, r.stderr
        with connect(dst_dsn) as c:
            assert c.execute("SELECT count(*) FROM pg_extension WHERE extname = 'outbox_ext'").fetchone()[0] == 0
            state, _, _ = refused(c, f"CREATE EXTENSION outbox_ext; COMMENT ON EXTENSION outbox_ext IS '{OLD_COMMENT}'")
            assert state == "0A000"

        r = subprocess.run([f"{PG_BIN}/psql", "-X", "-q", "-1", "-v", "ON_ERROR_STOP=1", "-d", dst_dsn, "-f", str(plain)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        with connect(dst_dsn) as c:
            assert c.execute("SELECT count(*) FROM outbox.events WHERE topic = 'hs.dump'").fetchone()[0] == 1
    finally:
        drop_db(plain_dsn, src)
        drop_db(plain_dsn, dst)


def test_health_reports_a_mismatch_as_critical_first(db):
    """A monitoring check must see what every API call sees: health() names the
    mismatch as a critical check of its own, and runs nothing that would raise."""
    with connect(db) as c:
        assert ("handshake", "ok") in c.execute("SELECT check_name, status FROM outbox.health()").fetchall()
        record(c, f"'{OTHER}'")
        rows = c.execute("SELECT check_name, status, message FROM outbox.health()").fetchall()
        assert rows[0][:2] == ("handshake", "critical"), rows
        assert "not the SQL this library serves" in rows[0][2]
        record(c, "outbox._library_fingerprint()")
