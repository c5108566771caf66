#!/usr/bin/env python3
"""Relay benchmark (issue 18): in one run, on loopback,

1. throughput of `outbox relay` into a local single-node JetStream stream vs a bare claim+ack
   drain with no sink (one psycopg connection: claim, ack the batch), at batch 100 and 500,
   over the same pre-published events (N events over S subjects); reports the ratio;
2. latency from commit to PubAck at 1,000 events/s over 1,000 subjects (commit time taken by the publisher after
   COMMIT returns; PubAck time = the stream's store timestamp of the message), p50/p99;
3. webhook throughput against a local receiver that answers 200 at once.

    .venv/bin/python bench/relay.py [--events N] [--subjects S] [--latency-seconds T] [--webhook-events N]

Uses the relay test cluster (scripts/pgcluster.sh `relaytest`, port 5472; started and stopped
here) and nats-server from PATH. A short smoke run: --events 5000 --latency-seconds 3 --webhook-events 2000.
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pg_test" / "relay"))
import relaylib as rl  # noqa: E402


def publish(db, n, subjects, topic="bench.event"):
    with rl.connect(db) as c:
        done = 0
        while done < n:
            k = min(1000, n - done)
            c.execute(
                "SELECT count(*) FROM outbox.publish_batch(%s, %s::jsonb[], %s::text[])",
                (topic, [json.dumps({"i": done + j}) for j in range(k)], [f"s{(done + j) % subjects}" for j in range(k)]),
            )
            done += k


def make_sub(db, name):
    with rl.connect(db) as c:
        c.execute("SELECT outbox.create_subscription(%s, start => 'now')", (name,))


def bare_drain(db, sub, batch, n):
    t0 = time.monotonic()
    got = 0
    with rl.connect(db) as c:
        while got < n:
            rows = c.execute(
                "SELECT id, lease_token FROM outbox.claim('bare', %s, subscription => %s)", (batch, sub)
            ).fetchall()
            if not rows:
                continue
            c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", ([r[0] for r in rows], [r[1] for r in rows]))
            got += len(rows)
    return n / (time.monotonic() - t0)


def lag(db, sub):
    with rl.connect(db) as c:
        return c.execute("SELECT lag_events, leases_in_flight FROM outbox.subscriptions WHERE name = %s", (sub,)).fetchone()


def relay_drain(workdir, db, ns, sub, stream, batch, n, oargs):
    relay = rl.start_relay(
        workdir,
        f"bench-relay-{batch}",
        db,
        ["--sink", "nats", "--nats-url", ns.url, "--subscription", sub, "--nats-stream", stream,
         "--nats-prefix", stream.lower(), "--batch-size", str(batch), "--max-in-flight", str(max(2000, 4 * batch))],
        oargs,
        extra_env={"OUTBOX_LOG": "warn"},
    )
    try:
        rl.wait_for(lambda: (ns.stream_messages(stream) or 0) > 0, 30, "relay start", interval=0.005)
        t0 = time.monotonic()
        rl.wait_for(lambda: (ns.stream_messages(stream) or 0) >= n, 600, "relay drain", interval=0.01)
        rate = n / (time.monotonic() - t0)
        rl.wait_for(lambda: lag(db, sub) == (0, 0), 60, "acks")
        return rate
    finally:
        relay.term()


async def _store_times(url, stream):
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await nats.connect(url)
    js = nc.jetstream()
    info = await js.stream_info(stream)
    sub = await js.pull_subscribe("", durable="lat", stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE))
    out = []
    while len(out) < info.state.messages:
        for m in await sub.fetch(1000, timeout=5):
            out.append((json.loads(m.data)["k"], m.metadata.timestamp.timestamp()))
    await nc.close()
    return out


def latency(workdir, db, ns, oargs, seconds, rate=1000):
    make_sub(db, "lat")
    relay = rl.start_relay(
        workdir, "bench-latency", db,
        ["--sink", "nats", "--nats-url", ns.url, "--subscription", "lat", "--nats-stream", "LAT", "--nats-prefix", "lat"],
        oargs, extra_env={"OUTBOX_LOG": "warn"},
    )
    try:
        # Ready means connected to both sides with the stream in place (/healthz 200); timing from
        # before that would measure the relay's start, not its latency.
        rl.wait_for(lambda: rl.healthz(relay)[0] == 200, 30, "latency relay ready")
        time.sleep(1)
        per_tick, tick = 10, 10 / rate
        committed = {}
        with rl.connect(db, autocommit=False) as c:
            start = time.monotonic()
            for k in range(int(seconds * rate / per_tick)):
                for j in range(per_tick):
                    c.execute("SELECT outbox.publish('lat.e', %s::jsonb, subject => %s)",
                              (json.dumps({"k": k, "j": j}), f"s{(k * per_tick + j) % 1000}"))
                c.commit()
                committed[k] = time.time()  # COMMIT has returned: the events exist from here on
                sleep = start + (k + 1) * tick - time.monotonic()
                if sleep > 0:
                    time.sleep(sleep)
        n = len(committed) * per_tick
        rl.wait_for(lambda: (ns.stream_messages("LAT") or 0) >= n, 60, "latency drain")
        pairs = asyncio.run(_store_times(ns.url, "LAT"))
        lat = sorted((store - committed[k]) * 1000 for k, store in pairs)
        return lat[len(lat) // 2], lat[max(0, int(len(lat) * 0.99) - 1)], len(lat)
    finally:
        relay.term()



class FastReceiver:
    def __init__(self):
        self.count = 0
        recv = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", "0")))
                recv.count += 1
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def webhook(workdir, db, oargs, n, subjects):
    make_sub(db, "wh")
    publish(db, n, subjects, topic="wh.event")
    recv = FastReceiver()
    relay = rl.start_relay(
        workdir, "bench-webhook", db,
        ["--sink", "webhook", "--subscription", "wh", "--webhook-url", f"http://127.0.0.1:{recv.port}/",
         "--webhook-secret", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "--webhook-concurrency", "32", "--batch-size", "100"],
        oargs, extra_env={"OUTBOX_LOG": "warn"},
    )
    try:
        rl.wait_for(lambda: recv.count > 0, 30, "first webhook", interval=0.005)
        t0 = time.monotonic()
        rl.wait_for(lambda: recv.count >= n, 600, "webhook drain", interval=0.01)
        return n / (time.monotonic() - t0)
    finally:
        relay.term()
        recv.server.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=50000)
    ap.add_argument("--subjects", type=int, default=1000)
    ap.add_argument("--latency-seconds", type=float, default=10)
    ap.add_argument("--webhook-events", type=int, default=10000)
    ap.add_argument("--keep-cluster", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON (bench/run's scenario 11 reads it)")
    a = ap.parse_args()
    workdir = Path("/tmp/outbox-relay-bench")
    subprocess.run(["rm", "-rf", str(workdir)], check=True)
    workdir.mkdir(parents=True)
    subprocess.run(["bash", rl.PGCLUSTER, "start", rl.PG_CLUSTER, str(rl.PG_PORT), "--preload"], check=True,
                   stdout=subprocess.DEVNULL)
    ns = rl.NatsServer(workdir, "bench").start()
    try:
        db = "relay_bench"
        rl.fresh_db(db)
        _oid, oargs = rl.outbox_identity(db)
        results = {}
        for batch in (100, 500):
            bare, relay = f"bare{batch}", f"relay{batch}"
            make_sub(db, bare)
            make_sub(db, relay)
            with rl.connect(db) as c:
                c.execute("CHECKPOINT")
            publish(db, a.events, a.subjects, topic=f"b{batch}.event")
            results[("bare", batch)] = bare_drain(db, bare, batch, a.events)
            stream = f"B{batch}"
            results[("relay", batch)] = relay_drain(workdir, db, ns, relay, stream, batch, a.events, oargs)
            # Keep later subscriptions from seeing these events.
            for s in (bare, relay):
                with rl.connect(db) as c:
                    c.execute("SELECT outbox.drop_subscription(%s, force => true)", (s,))
        print(f"events {a.events} over {a.subjects} subjects, 2 cores, loopback")
        for batch in (100, 500):
            b, r = results[("bare", batch)], results[("relay", batch)]
            print(f"batch {batch:3d}: bare claim+ack {b:8.0f} ev/s   relay->JetStream {r:8.0f} ev/s   ratio {r / b:.2f}x "
                  f"(target >= 0.8x)")
        p50, p99, n = latency(workdir, db, ns, oargs, a.latency_seconds)
        print(f"commit->PubAck at 1000 ev/s over {n} events: p50 {p50:.1f} ms, p99 {p99:.1f} ms (targets 5 / 25 ms)")
        wr = webhook(workdir, db, oargs, a.webhook_events, a.subjects)
        print(f"webhook relay into a local receiver (concurrency 32): {wr:.0f} ev/s over {a.webhook_events} events")
        if a.json:
            Path(a.json).write_text(json.dumps({
                "events": a.events, "subjects": a.subjects,
                "drain": {str(b): {"bare": results[("bare", b)], "relay": results[("relay", b)]} for b in (100, 500)},
                "latency": {"p50_ms": p50, "p99_ms": p99, "n": n, "rate": 1000},
                "webhook": {"events": a.webhook_events, "rate": wr},
            }, indent=1))
    finally:
        ns.stop()
        if not a.keep_cluster:
            subprocess.run(["bash", rl.PGCLUSTER, "stop", rl.PG_CLUSTER], check=False, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
