"""Fixtures for the `outbox relay` tests (pg_test/relay).

The suite starts its own PostgreSQL cluster, `relaytest` on port 5472 with the extension
preloaded (scripts/pgcluster.sh), and stops it at the end; OUTBOX_RELAY_KEEP_CLUSTER=1 keeps it
running for the next run. nats-server processes are started per test on free loopback ports.
The relay binary is $OUTBOX_BIN, crates/outbox/target/release/outbox, or `outbox` on PATH.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import clusters  # noqa: E402
import relaylib  # noqa: E402


@pytest.fixture(scope="session")
def pg_cluster():
    with clusters.running(relaylib.PG_CLUSTER, relaylib.PG_PORT, preload=True, keep_env="OUTBOX_RELAY_KEEP_CLUSTER") as port:
        yield port


@pytest.fixture
def workdir(tmp_path):
    return tmp_path


@pytest.fixture
def procs():
    """Processes a test starts; every one still running is killed at the end of the test."""
    started = []
    yield started
    for p in reversed(started):
        try:
            if hasattr(p, "proc"):
                p.proc.kill()
            else:
                p.kill()
        except Exception:
            pass
