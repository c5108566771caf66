"""Fixtures for the dashboard tests (pg_test/dashboard).

The suite starts its own PostgreSQL cluster, `dashtest` on port 5476 with the extension preloaded
(scripts/pgcluster.sh, as pg_test/cli does), and stops it at the end; OUTBOX_DASH_KEEP_CLUSTER=1
keeps it running. The binary under test is $OUTBOX_BIN, else crates/outbox/target/release/outbox.
Screenshots and server logs go to target/test-results/dashboard/.
"""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import clusters  # noqa: E402
import dashlib  # noqa: E402


@pytest.fixture(scope="session")
def pg_cluster():
    with clusters.running(dashlib.clilib.PG_CLUSTER, dashlib.clilib.PG_PORT, preload=True, keep_env="OUTBOX_DASH_KEEP_CLUSTER") as port:
        yield port


@pytest.fixture(scope="session")
def shared_db(pg_cluster):
    """A database with events in every state and blocked subjects, for tests that only read."""
    dashlib.fresh_db("dash_shared")
    return "dash_shared", dashlib.populate("dash_shared")


@pytest.fixture
def fresh(pg_cluster, request):
    """A database of the test's own (for tests that change events)."""
    name = "dash_" + request.node.name.lower().replace("[", "_").replace("]", "").replace("-", "_")[:40]
    dashlib.fresh_db(name)
    return name, dashlib.populate(name)


@pytest.fixture(scope="session")
def driver():
    for path in (dashlib.CHROMIUM, dashlib.CHROMEDRIVER):
        if not shutil.which(path):
            pytest.fail(f"{path} is missing: apt-get install -y chromium chromium-driver (scripts/setup.sh does)")
    d = dashlib.browser()
    yield d
    d.quit()


@pytest.fixture
def servers():
    """`outbox serve` processes a test starts; all are stopped (by pid) at its end."""
    started = []

    def start(*args, **kw):
        s = dashlib.Server(*args, **kw)
        started.append(s)
        return s

    yield start
    for s in reversed(started):
        s.stop()
