"""Throwaway PostgreSQL clusters for the pytest suites; scripts/pgcluster.sh does the work.

Each suite that needs a server starts its own here and stops it when its session ends, so
scripts/test.sh only chooses which suites run. Every suite runs under test.sh's machine-wide
lock, which is why fixed names and ports are safe.
"""

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

REPO = Path(os.environ.get("OUTBOX_REPO") or Path(__file__).resolve().parents[1])
PGCLUSTER = str(REPO / "scripts" / "pgcluster.sh")
PG_ROOT = Path(os.environ.get("OUTBOX_PG_ROOT", "/tmp/outbox-pg"))

# The pair the pg_test/py suite runs on: one without preload (no background worker can race a
# test's own maintenance) and one with it (wake-ups, the worker). Prepared transactions are part
# of what the tests exercise (2PC publishers).
PLAIN, PLAIN_PORT = "outbox-test", 5441
PRELOAD, PRELOAD_PORT = "outbox-test-preload", 5442
PAIR_SETTINGS = ("max_prepared_transactions=64",)


def dsn(port, db="postgres", user="postgres"):
    # TCP on loopback, as every client under test connects.
    return f"host=127.0.0.1 port={port} user={user} dbname={db}"


def start(name, port, preload=False, settings=()):
    """Create cluster NAME from scratch on PORT and start it."""
    cmd = ["bash", PGCLUSTER, "start", name, str(port)] + (["--preload"] if preload else [])
    for s in settings:
        cmd += ["-c", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def stop(name):
    subprocess.run(["bash", PGCLUSTER, "stop", name], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextmanager
def running(name, port, preload=False, settings=(), keep_env=None):
    """A fresh cluster for the block; left running when the environment variable keep_env is 1."""
    start(name, port, preload, settings)
    try:
        yield port
    finally:
        if not (keep_env and os.environ.get(keep_env) == "1"):
            stop(name)


def start_pair():
    """Start the pg_test/py pair afresh; returns the environment its tests read."""
    start(PLAIN, PLAIN_PORT, False, PAIR_SETTINGS)
    start(PRELOAD, PRELOAD_PORT, True, PAIR_SETTINGS)
    return {
        "OUTBOX_TEST_DSN": dsn(PLAIN_PORT),
        "OUTBOX_TEST_DSN_PRELOAD": dsn(PRELOAD_PORT),
        "OUTBOX_TEST_CLUSTER_PRELOAD": PRELOAD,
        "OUTBOX_PGCLUSTER": PGCLUSTER,
    }


def stop_pair():
    stop(PLAIN)
    stop(PRELOAD)
