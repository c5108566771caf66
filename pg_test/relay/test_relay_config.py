"""Bad configuration: one error line on stderr, a non-zero exit, no panic, nothing claimed."""

import os
import subprocess
import time

import pytest

import relaylib as rl


SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def run(args, env=None, timeout=30):
    import os

    e = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    e.update(env or {})
    return subprocess.run([rl.outbox_bin(), "relay", *args], capture_output=True, text=True, timeout=timeout, env=e)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no sink"),
        (["--sink", "nats"], "no PostgreSQL DSN"),
        (["--sink", "nats", "--dsn", "host=x", "--subscription", "Bad Name"], "bad subscription name"),
        (["--sink", "nats", "--dsn", "host=x", "--nats-retry-horizon", "2m"], "must be shorter than the duplicate window"),
        (["--sink", "nats", "--dsn", "host=x", "--topics", "a..b"], "bad topic pattern"),
        (["--sink", "webhook", "--dsn", "host=x"], "no webhook endpoint"),
        (["--sink", "webhook", "--dsn", "host=x", "--webhook-url", "http://h/x"], "no signing secret"),
        (["--sink", "webhook", "--dsn", "host=x", "--webhook-url", "http://h/x", "--webhook-secret", "nope"], "whsec_"),
        (["--sink", "nats", "--dsn", "host=x", "--lease", "soon"], "bad duration"),
        (["--sink", "nats", "--dsn", "host='x", "--metrics-listen", "off"], "unterminated quote"),
        (["--config", "/nonexistent.toml"], "cannot read"),
        (["--sink", "nats", "--dsn", "host=x", "--webhook-url", "http://h/x"], "--webhook-url does not apply to --sink nats"),
        (["--sink", "webhook", "--dsn", "host=x", "--webhook-url", "http://h/x", "--webhook-secret", SECRET,
          "--nats-stream", "S"], "--nats-stream does not apply to --sink webhook"),
        (["--sink", "webhook", "--dsn", "host=x", "--webhook-url", "http://h/x", "--webhook-secret", SECRET,
          "--max-in-flight", "9"], "--max-in-flight"),
    ],
)
def test_bad_config_is_one_line(args, message):
    r = run(args)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert any(message in line for line in lines), r.stderr
    assert "panicked" not in r.stderr
    if r.returncode == 1:
        assert len(lines) == 1, r.stderr


def test_stream_with_short_duplicate_window_is_refused(pg_cluster, workdir, procs):
    import asyncio

    import nats
    from nats.js.api import StreamConfig

    rl.fresh_db("relay_c")
    ns = rl.NatsServer(workdir, "n1").start()
    procs.append(ns)

    async def make():
        nc = await nats.connect(ns.url)
        await nc.jetstream().add_stream(StreamConfig(name="OUTBOX", subjects=["outbox.>"], duplicate_window=20))
        await nc.close()

    asyncio.run(make())
    _oid, oargs = rl.outbox_identity("relay_c")
    r = run(
        ["--sink", "nats", "--dsn", rl.dsn("relay_c"), "--nats-url", ns.url, "--metrics-listen", "off", *oargs],
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    assert "duplicate window" in r.stderr.splitlines()[-1]


def test_unreachable_database_is_retried_then_sigterm_exits_0(workdir):
    p = rl.Proc(
        [rl.outbox_bin(), "relay", "--sink", "nats", "--dsn", f"host=127.0.0.1 port={rl.free_port()} user=x dbname=x",
         "--metrics-listen", "off"],
        workdir / "r.log",
        env={"NO_COLOR": "1"},
    ).start()
    import time

    time.sleep(1.5)
    assert p.alive()
    assert p.term() == 0
    assert "retrying" in p.log()


def test_config_file_sections_of_the_other_sink_and_syntax_errors(workdir):
    f = workdir / "relay.toml"
    f.write_text('sink = "webhook"\ndsn = "host=x"\n[nats]\nstream = "S"\n[[webhook.endpoints]]\nname = "a"\nurl = "http://h/"\n')
    r = run(["--config", str(f), "--webhook-secret", SECRET])
    assert r.returncode == 1 and "[nats] in the config file does not apply to --sink webhook" in r.stderr, r.stderr
    f.write_text('sink = "nats"\ndsn = "host=x"\nbatch_size = "many"\n')
    r = run(["--config", str(f)])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"{f}:3:14: " in lines[0], r.stderr


def fails_fast(args, message, env=None, limit=20):
    """The relay exits 1 within `limit` seconds, its last line the one-line error with `message`."""
    t0 = time.monotonic()
    r = run(["--metrics-listen", "off", *args], env=env, timeout=limit)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert "panicked" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("outbox: error: ") and message in last, r.stderr
    return elapsed, r.stderr


def webhook_args(db):
    return ["--sink", "webhook", "--webhook-url", f"http://127.0.0.1:{rl.free_port()}/x", "--webhook-secret", SECRET,
            "--dsn", rl.dsn(db)]


def test_permanent_errors_stop_the_relay(pg_cluster, workdir, procs):
    db = "relay_c"
    rl.fresh_db(db)
    _oid, oargs = rl.outbox_identity(db)
    # (b) sslmode=require against a server without SSL.
    fails_fast([*webhook_args(db)[:-1], rl.dsn(db) + " sslmode=require", *oargs], "server does not support TLS")
    # Authentication / unknown database (SQLSTATE 3D000).
    fails_fast([*webhook_args(db)[:-1], rl.dsn("no_such_db"), *oargs], "3D000")
    # (c) 42501 from claim: a role with outbox_admin (subscriptions) but not outbox_worker.
    with rl.connect(db) as c:
        c.execute("DROP ROLE IF EXISTS relay_noworker")
        c.execute("CREATE ROLE relay_noworker LOGIN IN ROLE outbox_admin")
    dsn = f"host=127.0.0.1 port={rl.PG_PORT} user=relay_noworker dbname={db}"
    _, err = fails_fast([*webhook_args(db)[:-1], dsn, *oargs], "42501")
    assert "retrying" not in err, err
    # (d) stream configurations JetStream refuses: replicas without a cluster, a duplicate window
    # above the server's limit.
    plain = rl.NatsServer(workdir, "n1").start()
    limited = rl.NatsServer(workdir, "n2", js_limits="duplicate_window: 30s").start()
    procs.extend([plain, limited])
    nats = ["--sink", "nats", "--dsn", rl.dsn(db), *oargs]
    fails_fast([*nats, "--nats-url", plain.url, "--nats-replicas", "3"], "replicas > 1 not supported")
    _, err = fails_fast([*nats, "--nats-url", limited.url], "duplicates window can not be larger")
    assert "error code 10052" in err


def test_dsn_without_host_uses_pghost_and_unix_sockets(pg_cluster, workdir, procs):
    """A DSN without a host takes PGHOST, else /var/run/postgresql, like libpq and the operator
    commands, and a Unix socket directory works (the TLS connector needs no host name there)."""
    db = "relay_c"
    rl.fresh_db(db)
    _oid, oargs = rl.outbox_identity(db)
    sock = "/tmp/outbox-pg/" + rl.PG_CLUSTER + "/sock"
    args = ["--sink", "webhook", "--webhook-url", "http://127.0.0.1:9/x", "--webhook-secret", SECRET,
            "--dsn", f"port={rl.PG_PORT} user=postgres dbname={db}", "--metrics-listen", "off", *oargs]
    for n, host in enumerate((sock, "127.0.0.1")):
        p = rl.Proc([rl.outbox_bin(), "relay", *args], workdir / f"r{n}.log", env={"NO_COLOR": "1", "PGHOST": host}).start()
        try:
            rl.wait_for(lambda: "outbox relay starting" in p.log(), 20, f"the relay to connect through PGHOST={host}")
        finally:
            assert p.term() == 0, p.log()
    # sslmode=require over a socket is refused, as libpq refuses it: one line, at once.
    fails_fast(["--sink", "webhook", "--webhook-url", "http://127.0.0.1:9/x", "--webhook-secret", SECRET,
                "--dsn", f"host={sock} port={rl.PG_PORT} user=postgres dbname={db} sslmode=require", *oargs],
               "does not support TLS")


def test_existing_subscription_with_other_topics_is_refused(pg_cluster, workdir):
    db = "relay_c"
    rl.fresh_db(db)
    _oid, oargs = rl.outbox_identity(db)
    with rl.connect(db) as c:
        c.execute("SELECT outbox.create_subscription('relay-nats', ARRAY['orders.*'])")
    base = ["--sink", "nats", "--dsn", rl.dsn(db), "--nats-url", f"nats://127.0.0.1:{rl.free_port()}", *oargs]
    _, err = fails_fast([*base, "--topics", "billing.*"], "already exists with topics [orders.*]")
    assert "[billing.*]" in err and "drop_subscription('relay-nats')" in err
    # The same filter (in any order, duplicates ignored) is accepted: the relay then waits for NATS.
    p = rl.Proc([rl.outbox_bin(), "relay", *base, "--topics", "orders.*,orders.*", "--metrics-listen", "off"],
                workdir / "ok.log", env={"NO_COLOR": "1"}).start()
    try:
        rl.wait_for(lambda: "cannot connect" in p.log(), 20, "the relay to get past the subscription check")
        assert p.alive(), p.log()
    finally:
        assert p.term() == 0
