"""Fixtures for the `outbox relay` tests (pg_test/relay).

The suite starts its own PostgreSQL cluster, `relaytest` on port 5472 with the extension
preloaded (scripts/pgcluster.sh), and stops it at the end; OUTBOX_RELAY_KEEP_CLUSTER=1 keeps it
running for the next run. nats-server processes are started per test on free loopback ports.
The relay binary is $OUTBOX_BIN, crates/outbox/target/release/outbox, or `outbox` on PATH.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import relaylib  # noqa: E402


@pytest.fixture(scope="session")
def pg_cluster():
    subprocess.run(
        ["bash", relaylib.PGCLUSTER, "start", relaylib.PG_CLUSTER, str(relaylib.PG_PORT), "--preload"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    yield relaylib.PG_PORT
    if os.environ.get("OUTBOX_RELAY_KEEP_CLUSTER") != "1":
        subprocess.run(["bash", relaylib.PGCLUSTER, "stop", relaylib.PG_CLUSTER], check=False, stdout=subprocess.DEVNULL)


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
