"""Fixtures for the multi-connection outbox_ext tests.

Two clusters, both reached as superuser, database 'postgres':
  OUTBOX_TEST_DSN          no preload (core and retention tests: no background
                           worker can race a test's own purge)
  OUTBOX_TEST_DSN_PRELOAD  shared_preload_libraries = outbox_ext; its background
                           worker serves database 'postgres' (wake-up tests)
With OUTBOX_TEST_START_CLUSTERS=1 (scripts/test.sh sets it) the session starts both afresh
(pg_test/clusters.py) and stops them at its end. Without any of these variables, the developer
clusters on ports 5445/5446 are used:
  scripts/pgcluster.sh start pyt-plain 5445 -c max_prepared_transactions=10
  scripts/pgcluster.sh start pyt-preload 5446 --preload -c max_prepared_transactions=10

Every `plain`/`preload` fixture empties the outbox tables first, so tests never
see each other's events. Connections are autocommit; tests write BEGIN/COMMIT
themselves so that the transaction boundaries under test are explicit.
"""

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import clusters  # noqa: E402

# Before the DSNs below are read: they name the pair this starts.
_STARTED_PAIR = os.environ.get("OUTBOX_TEST_START_CLUSTERS") == "1" and not os.environ.get("OUTBOX_TEST_DSN")
if _STARTED_PAIR:
    os.environ.update(clusters.start_pair())


def pytest_unconfigure(config):
    if _STARTED_PAIR:
        clusters.stop_pair()


DSN_PLAIN = os.environ.get("OUTBOX_TEST_DSN") or "host=127.0.0.1 port=5445 user=postgres dbname=postgres"
DSN_PRELOAD = (
    os.environ.get("OUTBOX_TEST_DSN_PRELOAD") or "host=127.0.0.1 port=5446 user=postgres dbname=postgres"
)
REPO = Path(os.environ.get("OUTBOX_REPO") or Path(__file__).resolve().parents[2])
PGCLUSTER = os.environ.get("OUTBOX_PGCLUSTER") or str(REPO / "scripts" / "pgcluster.sh")

TABLES = "outbox.dispatch_keys, outbox.topics"


def connect(dsn, autocommit=True, **kw):
    return psycopg.connect(dsn, autocommit=autocommit, connect_timeout=10, **kw)


def dsn_with_db(dsn, dbname):
    return psycopg.conninfo.make_conninfo(dsn, dbname=dbname)


class DB:
    """One cluster/database for one test: opens tracked connections, cleans tables."""

    def __init__(self, dsn, name):
        self.dsn = dsn
        self.name = name
        self._conns = []

    def conn(self, **kw):
        c = connect(self.dsn, **kw)
        self._conns.append(c)
        return c

    def one(self, sql, params=None):
        """Run one statement on a fresh short-lived connection; first row or None."""
        with connect(self.dsn) as c:
            cur = c.execute(sql, params)
            return cur.fetchone() if cur.description else None

    def all(self, sql, params=None):
        with connect(self.dsn) as c:
            return c.execute(sql, params).fetchall()

    def clean(self, extra=()):
        """Empty every table and put 'default' back in its install state, with
        its lanes from the first event."""
        with connect(self.dsn) as c:
            # A leftover lock would make TRUNCATE hang: fail loudly instead.
            c.execute("SET lock_timeout = '10s'")
            c.execute(f"TRUNCATE {', '.join([TABLES, *READER_TABLES, *LOG_TABLES, *extra])}")
            c.execute("DELETE FROM outbox.subscription_catalog WHERE name <> 'default'")
            c.execute("DELETE FROM outbox.subscription_activity a WHERE NOT EXISTS "
                      "(SELECT 1 FROM outbox.subscription_catalog s WHERE s.name = a.name)")
            c.execute("INSERT INTO outbox.subscription_catalog (name) VALUES ('default') ON CONFLICT DO NOTHING")
            c.execute("INSERT INTO outbox.subscription_activity (name) VALUES ('default') ON CONFLICT DO NOTHING")
            # The default subscription back to its install state.
            c.execute("UPDATE outbox.subscription_catalog SET max_attempts = NULL, backoff_base = NULL, "
                      "backoff_max = NULL, default_lease = NULL, paused = false, paused_at = NULL, topics = NULL, "
                      "dead_letter_policy = NULL, max_lag = NULL WHERE name = 'default'")
            c.execute("UPDATE outbox.subscription_activity SET last_claim_at = NULL, lost_events = 0, lost_at = NULL")
            c.execute("SELECT outbox._log_subscribe('default', 'earliest')")

    def close(self):
        for c in self._conns:
            try:
                c.close()
            except Exception:
                pass
        self._conns.clear()


def sqlstate(conn, sql, params=None):
    """The SQLSTATE `sql` raised on `conn`, or None when it succeeded."""
    try:
        conn.execute(sql, params)
    except psycopg.Error as e:
        return e.sqlstate
    return None


# The log's readers (src/log/claim.rs): emptied by every clean().
READER_TABLES = ("outbox.log_lanes", "outbox.log_batches", "outbox.log_exceptions", "outbox.log_delivered")
# The log ring itself (src/log/).
LOG_TABLES = ("outbox.log_0", "outbox.log_1", "outbox.log_2", "outbox.log_3", "outbox.log_state")


def _ensure_extension(dsn):
    try:
        with connect(dsn) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
    except psycopg.Error as e:
        pytest.fail(f"cannot create outbox_ext at {dsn!r}: {e}", pytrace=False)


@pytest.fixture(scope="session")
def plain_dsn():
    _ensure_extension(DSN_PLAIN)
    return DSN_PLAIN


@pytest.fixture(scope="session")
def preload_dsn():
    _ensure_extension(DSN_PRELOAD)
    with connect(DSN_PRELOAD) as c:
        pid, preloaded = c.execute("SELECT worker_pid, preloaded FROM outbox.wakeup_status()").fetchone()
    assert preloaded, f"{DSN_PRELOAD!r} does not have outbox_ext in shared_preload_libraries"
    wait_for_worker(DSN_PRELOAD)
    return DSN_PRELOAD


def wait_for_worker(dsn, not_pid=None, timeout=15.0):
    """The running background worker's pid (waits for one other than not_pid)."""
    deadline = time.monotonic() + timeout
    with connect(dsn) as c:
        while True:
            pid = c.execute("SELECT worker_pid FROM outbox.wakeup_status()").fetchone()[0]
            if pid and pid != not_pid:
                return pid
            if time.monotonic() > deadline:
                pytest.fail(f"no outbox background worker (other than {not_pid}) within {timeout}s")
            time.sleep(0.05)


def restart_preload_cluster(reason):
    """Restart the preload cluster through scripts/pgcluster.sh (keeps the data).
    Only possible when the harness says which cluster it is."""
    name = os.environ.get("OUTBOX_TEST_CLUSTER_PRELOAD")
    if not name or not Path(PGCLUSTER).exists():
        return False
    print(f"restarting cluster {name}: {reason}")
    r = subprocess.run(["bash", PGCLUSTER, "restart", name], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"restarting {name} failed: {r.stderr}"
    wait_for_worker(DSN_PRELOAD)
    return True


@pytest.fixture
def plain(plain_dsn, request):
    db = DB(plain_dsn, "plain")
    db.clean()
    yield db
    db.close()


@pytest.fixture
def logdb(plain_dsn, request):
    """`plain` (every clean() empties the log ring and its readers too), with
    no subscription reading the log: the install's 'default' is dropped."""
    db = DB(plain_dsn, "plain")
    db.clean()
    db.one("SELECT outbox.drop_subscription('default', true)")
    yield db
    db.close()


@pytest.fixture
def preload(preload_dsn, request):
    db = DB(preload_dsn, "preload")
    db.clean()
    yield db
    db.close()


# ---------------------------------------------------------------------------
# LISTEN outbox with receive timestamps.
# ---------------------------------------------------------------------------
class Listener:
    """A connection that LISTENs on 'outbox' and timestamps each notification as
    it arrives (a background thread reads the socket continuously, so timestamps
    are arrival times, not the time a test got round to looking)."""

    def __init__(self, dsn):
        self.conn = connect(dsn)
        self.conn.execute("LISTEN outbox")
        self.q = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                for n in self.conn.notifies(timeout=0.05):
                    self.q.put((n.payload, n.pid, time.monotonic()))
        except psycopg.Error:
            pass  # the server went away (a test restarted it): nothing more to hear

    def collect(self, window):
        """Every notification arriving within `window` seconds from now
        (plus those already received)."""
        out = []
        deadline = time.monotonic() + window
        while True:
            left = deadline - time.monotonic()
            try:
                out.append(self.q.get(timeout=max(left, 0.0)) if left > 0 else self.q.get_nowait())
            except queue.Empty:
                return out

    def first(self, timeout):
        """The next notification, or None after `timeout` seconds."""
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self):
        return self.collect(0)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.conn.close()


@pytest.fixture
def listen():
    made = []

    def make(dsn):
        lst = Listener(dsn)
        made.append(lst)
        return lst

    yield make
    for lst in made:
        lst.close()


class Notices:
    """Collects server notices (WARNING, NOTICE ...) of a connection."""

    def __init__(self, conn):
        self.items = []
        conn.add_notice_handler(lambda d: self.items.append((d.severity_nonlocalized, d.message_primary)))

    def warnings(self, contains=""):
        return [m for s, m in self.items if s == "WARNING" and contains in m]


# ---------------------------------------------------------------------------
# A dedicated pg_cron cluster (no outbox preload), for the "without preload,
# schedule run_maintenance with pg_cron" test. pg_cron's smallest schedule in
# the installed version may be one minute, so the cluster is started and the
# job scheduled as soon as collection finishes, in a background thread; the
# test itself is moved to the end of the run and only waits for what is left.
# ---------------------------------------------------------------------------
CRON_CLUSTER = os.environ.get("OUTBOX_TEST_CRON_CLUSTER", "outbox-py-cron")
# The cluster listens on its unix socket only, so this number never collides
# with a TCP port; it only names the socket file.
CRON_PORT = int(os.environ.get("OUTBOX_TEST_CRON_PORT", "5446"))


class CronCluster:
    def __init__(self):
        self.ready = threading.Event()
        self.error = None  # a skip reason
        self.failure = None  # a setup error that is a real failure
        self.info = {}
        self.started = False
        self.thread = threading.Thread(target=self._setup, daemon=True)

    @property
    def dsn(self):
        return f"host=/tmp/outbox-pg/{CRON_CLUSTER}/sock port={CRON_PORT} user=postgres dbname=postgres"

    def _setup(self):
        try:
            self._setup_inner()
        except Exception as e:  # reported by the test
            self.failure = f"{type(e).__name__}: {e}"
        finally:
            self.ready.set()

    def _setup_inner(self):
        if not Path("/usr/lib/postgresql/15/lib/pg_cron.so").exists():
            self.error = "pg_cron is not installed (Debian package postgresql-15-cron)"
            return
        if not Path(PGCLUSTER).exists() or shutil.which("bash") is None:
            self.error = f"cluster helper {PGCLUSTER} not available"
            return
        sock = f"/tmp/outbox-pg/{CRON_CLUSTER}/sock"
        cmd = [
            "bash", PGCLUSTER, "start", CRON_CLUSTER, str(CRON_PORT),
            "-c", "listen_addresses=",
            "-c", "shared_preload_libraries=pg_cron",
            "-c", "cron.database_name=postgres",
            # pg_cron runs jobs through libpq; point it at the socket (trust auth).
            "-c", f"cron.host={sock}",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            self.error = f"could not start a pg_cron cluster: {r.stderr.strip()[-500:]}"
            return
        self.started = True
        with connect(self.dsn) as c:
            c.execute("CREATE EXTENSION pg_cron")
            c.execute("CREATE EXTENSION outbox_ext")
        with connect(self.dsn) as c:
            self.info["pg_cron_version"] = c.execute(
                "SELECT extversion FROM pg_extension WHERE extname = 'pg_cron'"
            ).fetchone()[0]
            # Material for run_maintenance: 5 rows of their own delivered after a
            # retry and 2 dead ones, aged past the default windows (7 days / 30
            # days), and one pending a retry that must survive; the ring emptied,
            # as the log's retention empties it, so that the rows may go.
            c.execute("SELECT outbox.publish_batch('cron.t', array_fill('{}'::jsonb, ARRAY[8]))")
            ids = c.execute("SELECT id, lease_token FROM outbox.claim('w', 8) ORDER BY id").fetchall()
            assert len(ids) == 8
            for n, (i, tok) in enumerate(ids):
                retry = {5: None, 6: None, 7: "1 hour"}.get(n, "0")
                want = "dead" if retry is None else "pending"
                assert c.execute("SELECT outbox.fail(%s, %s, 'x', retry_in => %s::interval, permanent => %s)",
                                 (i, tok, retry, retry is None)).fetchone()[0] == want
            again = c.execute("SELECT id, lease_token FROM outbox.claim('w', 8)").fetchall()
            assert len(again) == 5
            for i, tok in again:
                assert c.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0]
            c.execute("TRUNCATE outbox.log_0, outbox.log_1, outbox.log_2, outbox.log_3")
            c.execute("UPDATE outbox.log_exceptions SET delivered_at = now() - interval '8 days' WHERE state = 'delivered'")
            c.execute("UPDATE outbox.log_exceptions SET dead_at = now() - interval '31 days' WHERE state = 'dead'")
            # pg_cron >= 1.5 accepts 'N seconds'; older versions only cron syntax.
            try:
                c.execute("SELECT cron.schedule('outbox-retention', '2 seconds', 'CALL outbox.run_maintenance()')")
                self.info["schedule"] = "2 seconds"
            except psycopg.Error:
                c.execute("SELECT cron.schedule('outbox-retention', '* * * * *', 'CALL outbox.run_maintenance()')")
                self.info["schedule"] = "* * * * *"
            self.info["scheduled_at"] = time.monotonic()

    def stop(self):
        if self.thread.is_alive():
            self.thread.join(200)
        if self.started:
            subprocess.run(["bash", PGCLUSTER, "destroy", CRON_CLUSTER], capture_output=True, timeout=120)


_CRON = CronCluster()


def pytest_collection_modifyitems(session, config, items):
    # Tests that disrupt the preload cluster (killing its worker) go after the
    # others; the pg_cron test waits for a cron tick, so it runs last and its
    # wait overlaps with everything else.
    def rank(it):
        if it.get_closest_marker("cron_last"):
            return 2
        return 1 if it.get_closest_marker("disruptive") else 0

    items.sort(key=rank)


def pytest_collection_finish(session):
    if any(it.get_closest_marker("cron_last") for it in session.items):
        _CRON.thread.start()


def pytest_sessionfinish(session, exitstatus):
    _CRON.stop()


def pytest_configure(config):
    config.addinivalue_line("markers", "cron_last: uses the pg_cron cluster; run at the end")
    config.addinivalue_line("markers", "disruptive: may leave the preload cluster without its worker; run late")


@pytest.fixture
def cron_cluster():
    _CRON.ready.wait(240)
    if _CRON.failure:
        pytest.fail(f"pg_cron cluster setup failed: {_CRON.failure}")
    if _CRON.error:
        pytest.skip(_CRON.error)
    return _CRON
