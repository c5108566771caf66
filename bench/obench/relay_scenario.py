"""Scenario 11: the relay (`outbox relay`, crates/outbox) into NATS JetStream and webhooks.

bench/relay.py does the work on its own loopback cluster (scripts/pgcluster.sh `relaytest`,
port 5472) and nats-server; this scenario runs it in the same bench/run, reads its JSON and
turns it into rows, targets and a report section. Needs nats-server on PATH and the `outbox`
binary (crates/outbox/target/release or PATH); without them the section says so and the
targets are reported as not measured.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RELAY_PY = os.path.join(os.path.dirname(HERE), "relay.py")


def s11_relay(ctx):
    p = ctx.p
    prm = {"events": p["s11_events"], "subjects": p["s11_subjects"]}
    if shutil.which("nats-server") is None:
        ctx.section("11. Relay into NATS JetStream and webhooks", "Not measured: no `nats-server` on PATH.")
        for tid in ("11a", "11b", "11c", "11d"):
            ctx.target(tid, "relay (not measured: no nats-server)", None, ">=", 0)
        return
    with tempfile.TemporaryDirectory(prefix="outbox-bench-relay-") as tmp:
        out = os.path.join(tmp, "relay.json")
        argv = [sys.executable, RELAY_PY, "--events", str(p["s11_events"]), "--subjects", str(p["s11_subjects"]),
                "--latency-seconds", str(p["s11_latency_seconds"]), "--webhook-events", str(p["s11_webhook_events"]),
                "--json", out]
        ctx.say("  s11: " + " ".join(argv[1:]))
        r = subprocess.run(argv, capture_output=True, text=True, timeout=p["s11_timeout"])
        for line in r.stdout.splitlines():
            ctx.say(f"  s11: {line}")
        if r.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"bench/relay.py exited {r.returncode}: {r.stderr.strip()[-2000:]}")
        res = json.load(open(out))

    ratios = {}
    for b in ("100", "500"):
        d = res["drain"][b]
        q = dict(prm, batch=b)
        ctx.rec("s11_relay", "bare_claim_ack", q, 0, "events_per_s", d["bare"], "ev/s")
        ctx.rec("s11_relay", "relay_jetstream", q, 0, "events_per_s", d["relay"], "ev/s")
        ratios[b] = d["relay"] / d["bare"] if d["bare"] else None
    lat = res["latency"]
    ctx.rec("s11_relay", "relay_jetstream", {"rate": lat["rate"]}, 0, "commit_to_puback_p50", lat["p50_ms"], "ms")
    ctx.rec("s11_relay", "relay_jetstream", {"rate": lat["rate"]}, 0, "commit_to_puback_p99", lat["p99_ms"], "ms")
    wh = res["webhook"]
    ctx.rec("s11_relay", "relay_webhook", {"events": wh["events"]}, 0, "events_per_s", wh["rate"], "ev/s")

    rows = "\n".join(
        f"| {b} | {res['drain'][b]['bare']:,.0f} | {res['drain'][b]['relay']:,.0f} | {ratios[b]:.2f}x |" for b in ("100", "500"))
    md = (f"{res['events']:,} events over {res['subjects']:,} subjects published before each drain, on the relay "
          "bench's own cluster (port 5472, preloaded) and one nats-server with JetStream (file storage), all on "
          "loopback. **Bare**: one psycopg connection claims a batch from its own subscription and acks it with the "
          "array ack, no sink. **Relay**: one `outbox relay --sink nats` claims from another subscription over the "
          "same events and acks each event after its PubAck, keeping per-subject order; the rate runs from the first "
          "stored message to the last (read from the stream's state).\n\n"
          "| batch | bare claim+ack ev/s | relay -> JetStream ev/s | relay / bare |\n|---|---|---|---|\n" + rows + "\n\n"
          f"**Latency** at {lat['rate']:,} events/s (10 events per commit, 1,000 subjects) over {lat['n']:,} events: "
          f"from the publisher's COMMIT returning to the message's JetStream store time: p50 {lat['p50_ms']:.1f} ms, "
          f"p99 {lat['p99_ms']:.1f} ms.\n\n"
          f"**Webhooks**: {wh['events']:,} events into a local receiver that answers 200 at once "
          f"(concurrency 32): {wh['rate']:,.0f} events/s.")
    ctx.section("11. Relay into NATS JetStream and webhooks", md)
    ctx.target("11a", "relay->JetStream / bare claim+ack at batch 100", ratios["100"], ">=", 0.8)
    ctx.target("11b", "relay->JetStream / bare claim+ack at batch 500", ratios["500"], ">=", 0.8)
    ctx.target("11c", "relay commit->PubAck p50 at 1,000 ev/s", lat["p50_ms"], "<=", 5, unit=" ms")
    ctx.target("11d", "relay commit->PubAck p99 at 1,000 ev/s", lat["p99_ms"], "<=", 25, unit=" ms")
