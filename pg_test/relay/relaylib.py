"""Helpers for the `outbox relay` tests: a PostgreSQL cluster of our own, nats-server processes,
relay processes, and readers of a JetStream stream.

Everything listens on 127.0.0.1 only. Every process started here is stopped by the fixture or
test that started it (by its pid, never by name).
"""

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import psycopg

REPO = Path(os.environ.get("OUTBOX_REPO") or Path(__file__).resolve().parents[2])
PGCLUSTER = str(REPO / "scripts" / "pgcluster.sh")
PG_CLUSTER = os.environ.get("OUTBOX_RELAY_CLUSTER", "relaytest")
PG_PORT = int(os.environ.get("OUTBOX_RELAY_PG_PORT", "5472"))


def outbox_bin():
    """The relay binary: $OUTBOX_BIN, the crate's release build, or `outbox` on PATH."""
    cands = [os.environ.get("OUTBOX_BIN"), str(REPO / "crates/outbox/target/release/outbox"), shutil.which("outbox")]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    raise RuntimeError("no outbox binary: cargo build --release in crates/outbox, or set OUTBOX_BIN")


def nats_server_bin():
    return shutil.which("nats-server") or "/usr/sbin/nats-server"


def dsn(db):
    return f"host=127.0.0.1 port={PG_PORT} user=postgres dbname={db}"


def connect(db, autocommit=True):
    return psycopg.connect(dsn(db), autocommit=autocommit, connect_timeout=10)


def fresh_db(name):
    """Drops and creates database `name` with the extension installed."""
    with connect("postgres") as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}"')
    with connect(name) as c:
        c.execute("CREATE EXTENSION outbox_ext")


def has_function(db, name):
    with connect(db) as c:
        return c.execute(
            "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'outbox' AND p.proname = %s",
            (name,),
        ).fetchone()[0] > 0


def outbox_identity(db):
    """(outbox id, extra relay args): outbox.outbox_id() when the extension has it, else a random
    id passed with the hidden --outbox-id flag."""
    if has_function(db, "outbox_id"):
        with connect(db) as c:
            return str(c.execute("SELECT outbox.outbox_id()").fetchone()[0]), []
    oid = str(uuid.uuid4())
    return oid, ["--outbox-id", oid]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout, what, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Proc:
    """A child process with its output in a log file."""

    def __init__(self, argv, log_path, env=None):
        self.argv = argv
        self.log_path = Path(log_path)
        self.env = env
        self.p = None
        self.starts = 0

    def start(self):
        self.starts += 1
        log = open(self.log_path, "ab")
        log.write(f"\n=== start #{self.starts}: {' '.join(self.argv)}\n".encode())
        log.flush()
        env = dict(os.environ)
        env.update(self.env or {})
        self.p = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        log.close()
        return self

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def kill(self):
        if self.alive():
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(timeout=30)

    def term(self, timeout=30):
        """SIGTERM and wait; returns the exit status."""
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                return self.p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=30)
                raise AssertionError(f"{self.argv[0]} did not stop within {timeout}s after SIGTERM")
        return self.p.returncode if self.p else None

    def log(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class NatsServer:
    """One nats-server with JetStream, optionally a member of a cluster."""

    def __init__(self, workdir, name="n1", port=None, cluster_port=None, routes=(), cluster_name=None, js_limits=None):
        self.name = name
        self.port = port or free_port()
        self.mon_port = free_port()
        self.cluster_port = cluster_port
        self.dir = Path(workdir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = [
            f"server_name: {name}",
            f"listen: 127.0.0.1:{self.port}",
            f"http: 127.0.0.1:{self.mon_port}",
            "jetstream {",
            f'  store_dir: "{self.dir / "js"}"',
            "  max_memory_store: 64MB",
            "  max_file_store: 2GB",
            *([f"  limits {{ {js_limits} }}"] if js_limits else []),
            "}",
        ]
        if cluster_port:
            conf += [
                "cluster {",
                f"  name: {cluster_name or 'relaytest'}",
                f"  listen: 127.0.0.1:{cluster_port}",
                "  routes: [" + ", ".join(f"nats-route://127.0.0.1:{r}" for r in routes) + "]",
                "}",
            ]
        self.conf = self.dir / "nats.conf"
        self.conf.write_text("\n".join(conf) + "\n")
        self.proc = Proc([nats_server_bin(), "-c", str(self.conf)], self.dir / "server.log")

    @property
    def url(self):
        return f"nats://127.0.0.1:{self.port}"

    def start(self, wait=True):
        self.proc.start()
        if wait:
            wait_for(self._up, 20, f"nats-server {self.name}")
        return self

    def _up(self):
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self):
        self.proc.term(timeout=30)

    def kill(self):
        self.proc.kill()

    def jsz(self):
        """/jsz with stream details, or None while the server is down."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.mon_port}/jsz?streams=true", timeout=2) as r:
                return json.loads(r.read())
        except Exception:
            return None

    def stream_messages(self, stream):
        j = self.jsz()
        if not j:
            return None
        for acc in j.get("account_details") or []:
            for s in acc.get("stream_detail") or []:
                if s.get("name") == stream:
                    return s.get("state", {}).get("messages", 0)
        return 0


def start_relay(workdir, name, db, args, outbox_args, metrics_port=None, extra_env=None):
    """Starts `outbox relay` (text logs, info level) and returns its Proc."""
    metrics_port = metrics_port or free_port()
    argv = [outbox_bin(), "relay", "--dsn", dsn(db), "--metrics-listen", f"127.0.0.1:{metrics_port}"]
    argv += list(args) + list(outbox_args)
    env = {"OUTBOX_LOG": "info", "NO_COLOR": "1"}
    env.update(extra_env or {})
    p = Proc(argv, Path(workdir) / f"{name}.log", env=env)
    p.metrics_port = metrics_port
    return p.start()


def metrics(proc):
    """The relay's /metrics as {name{labels}: value}."""
    out = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, _, v = line.rpartition(" ")
                    out[k] = float(v)
    except Exception:
        pass
    return out


async def _read_stream(urls, stream, subject="outbox.>"):
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await nats.connect(servers=urls, connect_timeout=5)
    try:
        js = nc.jetstream(timeout=10)
        info = await js.stream_info(stream)
        total = info.state.messages
        name = "check-" + uuid.uuid4().hex[:8]
        sub = await js.pull_subscribe(
            subject,
            durable=name,
            stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, max_waiting=1),
        )
        msgs = []
        while len(msgs) < total:
            try:
                batch = await sub.fetch(1000, timeout=5)
            except Exception:
                break
            for m in batch:
                msgs.append((m.metadata.sequence.stream, dict(m.headers or {}), m.data, m.subject))
        await js.delete_consumer(stream, name)
        return total, msgs
    finally:
        await nc.close()


def read_stream(urls, stream, subject="outbox.>"):
    """(message count in the stream info, [(stream seq, headers, data, subject)] in stream order)."""
    if isinstance(urls, str):
        urls = [urls]
    return asyncio.run(_read_stream(urls, stream, subject))


def healthz(proc):
    """(HTTP status, body) of the relay's /healthz, or (None, "") when it does not answer."""
    import urllib.error

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/healthz", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception:
        return None, ""


def js_call(url, fn):
    """Runs `await fn(jetstream context)` against the server at `url` and returns its result."""
    import nats

    async def go():
        nc = await nats.connect(url, connect_timeout=5)
        try:
            return await fn(nc.jetstream(timeout=10))
        finally:
            await nc.close()

    return asyncio.run(go())
