"""Bad configuration: one error line on stderr, a non-zero exit, no panic, nothing claimed."""

import subprocess

import pytest

import relaylib as rl


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
