"""Fixtures for the `outbox` command-line tests (pg_test/cli).

The suite starts its own PostgreSQL cluster, `clitest` on port 5473 with the extension preloaded
(scripts/pgcluster.sh, as pg_test/relay does), and stops it at the end; OUTBOX_CLI_KEEP_CLUSTER=1
keeps it running. The binary under test is $OUTBOX_BIN, else crates/outbox/target/release/outbox.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import clusters  # noqa: E402
import clilib  # noqa: E402


@pytest.fixture(scope="session")
def pg_cluster():
    with clusters.running(clilib.PG_CLUSTER, clilib.PG_PORT, preload=True, keep_env="OUTBOX_CLI_KEEP_CLUSTER") as port:
        yield port


@pytest.fixture(scope="module")
def shared_db(pg_cluster):
    """A database with events in every state, shared by the read-only tests of a module."""
    clilib.fresh_db("cli_shared")
    ids = clilib.populate("cli_shared")
    return "cli_shared", ids


@pytest.fixture
def fresh(pg_cluster, request):
    """A database of the test's own with events in every state (for tests that change things)."""
    name = "cli_" + request.node.name.lower().replace("[", "_").replace("]", "").replace("-", "_")[:40]
    clilib.fresh_db(name)
    ids = clilib.populate(name)
    return name, ids
