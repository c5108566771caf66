"""Helpers for the `outbox` command-line tests (pg_test/cli): the cluster, the binary, a database
with events in every state, and a runner that checks the one-line-error contract.

The suite's cluster is `clitest` on 127.0.0.1:5473 with the library preloaded
(scripts/pgcluster.sh, as pg_test/relay does). Every process started here is stopped by the test
that started it, by its pid.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import psycopg

REPO = Path(os.environ.get("OUTBOX_REPO") or Path(__file__).resolve().parents[2])
PGCLUSTER = str(REPO / "scripts" / "pgcluster.sh")
PG_CLUSTER = os.environ.get("OUTBOX_CLI_CLUSTER", "clitest")
PG_PORT = int(os.environ.get("OUTBOX_CLI_PG_PORT", "5473"))

# Topics of the fixture, one per state of the `default` subscription.
T_PENDING, T_LEASED, T_DONE, T_DEAD, T_CANCELLED = (
    "cli.pending",
    "cli.leased",
    "cli.done",
    "cli.dead",
    "cli.cancelled",
)


def outbox_bin():
    """The binary under test: $OUTBOX_BIN, else the crate's release build, else `outbox` on PATH."""
    cands = [os.environ.get("OUTBOX_BIN"), str(REPO / "crates/outbox/target/release/outbox"), shutil.which("outbox")]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    raise RuntimeError("no outbox binary: cargo build --release in crates/outbox, or set OUTBOX_BIN")


def dsn(db, user="postgres"):
    return f"host=127.0.0.1 port={PG_PORT} user={user} dbname={db}"


def connect(db, autocommit=True, user="postgres"):
    return psycopg.connect(dsn(db, user), autocommit=autocommit, connect_timeout=10)


def fresh_db(name, extension=True):
    """Drops and creates database `name`, with the extension unless told otherwise."""
    with connect("postgres") as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}"')
    if extension:
        with connect(name) as c:
            c.execute("CREATE EXTENSION outbox_ext")


def populate(db, per_state=3):
    """Events in every state of `default` (per_state of each, on their own topic), plus the
    subscription of the log `ledger` (created first, so it receives them all) with one dead letter
    and one delivered event of its own. Returns {state: [ids]} for `default`, and 'ledger_dead' /
    'ledger_done' ids."""
    ids = {}
    with connect(db) as c:
        c.execute("SELECT outbox.create_subscription('ledger')")
        c.execute("SELECT outbox.create_topic('cli.dead', max_attempts => 3, dead_letter_policy => 'skip')")

        def publish(topic, n, **kw):
            out = []
            for i in range(n):
                out.append(
                    c.execute(
                        "SELECT outbox.publish(%s, %s::jsonb, subject => %s, headers => %s::jsonb)",
                        (
                            topic,
                            json.dumps({"n": i, "topic": topic}),
                            f"{topic}:{i}",
                            json.dumps({"traceparent": f"00-{i:032x}-{i:016x}-01"}),
                        ),
                    ).fetchone()[0]
                )
            return out

        def claim(topic, n, lease="1 hour", sub=None):
            return c.execute(
                "SELECT id, lease_token FROM outbox.claim('cli-test', %s, %s::interval, ARRAY[%s], %s)",
                (n, lease, topic, sub),
            ).fetchall()

        ids["pending"] = publish(T_PENDING, per_state)
        ids["leased"] = publish(T_LEASED, per_state)
        ids["delivered"] = publish(T_DONE, per_state)
        ids["dead"] = publish(T_DEAD, per_state)
        ids["cancelled"] = publish(T_CANCELLED, per_state)
        got = claim(T_LEASED, per_state)
        assert len(got) == per_state, got
        for i, tok in claim(T_DONE, per_state):
            assert c.execute("SELECT outbox.ack(%s, %s)", (i, tok)).fetchone()[0]
        for i, tok in claim(T_DEAD, per_state):
            # Two failures recorded, then a permanent one: an error history of three entries.
            assert c.execute("SELECT outbox.fail(%s, %s, 'timeout 1', retry_in => '0')", (i, tok)).fetchone()[0] == "pending"
        for i, tok in claim(T_DEAD, per_state):
            assert c.execute("SELECT outbox.fail(%s, %s, 'timeout 2', retry_in => '0')", (i, tok)).fetchone()[0] == "pending"
        for i, tok in claim(T_DEAD, per_state):
            assert c.execute("SELECT outbox.fail(%s, %s, 'HTTP 400 bad request', permanent => true)", (i, tok)).fetchone()[0] == "dead"
        for i in ids["cancelled"]:
            assert c.execute("SELECT outbox.cancel(%s)", (i,)).fetchone()[0]
        # ledger: one dead letter (the first dead-topic event) and one delivered event.
        got = claim(T_DEAD, 1, sub="ledger")
        assert len(got) == 1
        assert c.execute("SELECT outbox.fail(%s, %s, 'ledger said no', permanent => true)", got[0]).fetchone()[0] == "dead"
        ids["ledger_dead"] = [got[0][0]]
        got = claim(T_DONE, 1, sub="ledger")
        assert c.execute("SELECT outbox.ack(%s, %s)", got[0]).fetchone()[0]
        ids["ledger_done"] = [got[0][0]]
    return ids


def sql(db, query, params=None):
    with connect(db) as c:
        return c.execute(query, params).fetchall()


def sql1(db, query, params=None):
    return sql(db, query, params)[0][0]


class Result:
    """One run of the binary."""

    def __init__(self, argv, proc):
        self.argv = argv
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self):
        return json.loads(self.out)

    def __repr__(self):
        return f"<{' '.join(self.argv)} -> {self.code}\nstdout: {self.out}\nstderr: {self.err}>"


def clean_env(extra=None):
    """The environment without any PG* or OUTBOX_* variable of the caller, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("PG") or k.startswith("OUTBOX_"))}
    env["NO_COLOR"] = "1"
    env.update(extra or {})
    return env


def run(args, db=None, env=None, input=None, timeout=60, user="postgres"):
    """Runs `outbox ARGS` with OUTBOX_DSN pointing at `db` (unless env says otherwise)."""
    e = clean_env(env)
    if db is not None and "OUTBOX_DSN" not in e:
        e["OUTBOX_DSN"] = dsn(db, user)
    argv = [outbox_bin(), *[str(a) for a in args]]
    p = subprocess.run(
        argv,
        env=e,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    r = Result(argv, p)
    assert "panicked" not in r.err, r
    return r


def assert_one_line_error(r, *needles):
    """A failed run: non-zero exit, exactly one line on stderr, no panic, mentioning each needle."""
    assert r.code != 0, r
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1, r
    assert "panicked" not in r.err, r
    for n in needles:
        assert n.lower() in lines[0].lower(), (n, r)
    return lines[0]
