"""`outbox relay --sink webhook` against a local receiver that verifies every request with the
`standardwebhooks` package (PyPI), not with code of ours.

The receiver answers by the event's payload: `ok` events get a random 500 (20 %), `r429` events a
429 with Retry-After: 2 on their first attempt, `slow` events a response slower than the 2 s
timeout on their first attempt, `bad` events 422; the `gone` endpoint answers 410 until the test
flips it. Asserted: every body is byte-identical to `payload::text`, every request carries a valid
signature for each of the two configured secrets, webhook-id is `<outbox id>:<event id>`, retries
and dead letters are as specified, and a 410 disables its endpoint (subscription paused) until
`outbox.resume_subscription`.
"""

import collections
import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
from standardwebhooks.webhooks import Webhook

import relaylib as rl

SECRETS = ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_c2Vjb25kLXNlY3JldC1mb3Itcm90YXRpb24="]


class Receiver:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = []  # (time, path, status, webhook-id, body bytes, verified)
        self.seen = collections.Counter()
        self.gone_enabled = False
        self.rng = random.Random(18)
        self.verifiers = [Webhook(s) for s in SECRETS]
        recv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                hdrs = {k.lower(): v for k, v in self.headers.items()}
                verified = True
                for v in recv.verifiers:
                    try:
                        v.verify(body, hdrs)
                    except Exception:
                        verified = False
                mid = hdrs.get("webhook-id", "")
                with recv.lock:
                    recv.seen[mid] += 1
                    first = recv.seen[mid] == 1
                    r = recv.rng.random()
                mode = json.loads(body).get("mode")
                status, extra, delay, text = 200, {}, 0, b"ok"
                if self.path == "/gone":
                    status = 200 if recv.gone_enabled else 410
                elif mode == "ok" and r < 0.2:
                    status, text = 500, b"oops"
                elif mode == "r429" and first:
                    status, extra = 429, {"Retry-After": "2"}
                elif mode == "slow" and first:
                    delay = 5
                elif mode == "bad":
                    status, text = 422, b"unprocessable: field x is invalid"
                with recv.lock:
                    recv.requests.append((time.monotonic(), self.path, status, mid, body, verified))
                if delay:
                    time.sleep(delay)
                try:
                    self.send_response(status)
                    for k, v in extra.items():
                        self.send_header(k, v)
                    self.send_header("content-length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def relay_outcomes(relay, event_id):
    """The failures the relay logged for one event, oldest first ("failed: …", "dead letter: …")."""
    pat = re.compile(r"(failed: .*|dead letter: .*?)\s+event=(\d+)")
    out = []
    for line in relay.log_path.read_text(errors="replace").splitlines():
        m = pat.search(line)
        if m and int(m.group(2)) == event_id:
            out.append(m.group(1))
    return out


def test_webhooks(pg_cluster, workdir, procs):
    db = "relay_w"
    rl.fresh_db(db)
    oid, oargs = rl.outbox_identity(db)
    with rl.connect(db) as c:
        for sub, topics in (("relay-webhook.main", ["orders.*"]), ("relay-webhook.gone", ["legacy.*"])):
            c.execute(
                "SELECT outbox.create_subscription(%s, %s, start => 'earliest', backoff_base => '200 milliseconds', "
                "backoff_max => '1 second', max_attempts => 50)",
                (sub, topics),
            )
        ids = {}

        def pub(topic, mode, n, subject_prefix):
            for i in range(n):
                payload = json.dumps({"mode": mode, "n": i, "text": "Grüße ✓ \"quoted\"", "nested": {"b": [1, 2.50]}})
                eid = c.execute(
                    "SELECT outbox.publish(%s, %s::jsonb, subject => %s, headers => %s::jsonb)",
                    (topic, payload, f"{subject_prefix}-{i % 30}", json.dumps({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})),
                ).fetchone()[0]
                ids[eid] = mode

        pub("orders.created", "ok", 300, "ok")
        pub("orders.created", "r429", 5, "r429")
        pub("orders.updated", "slow", 5, "slow")
        pub("orders.created", "bad", 3, "bad")
        pub("legacy.thing", "legacy", 20, "legacy")
        payloads = dict(c.execute("SELECT id, payload::text FROM outbox.events WHERE id = ANY(%s)", (list(ids),)).fetchall())
    assert len(payloads) == len(ids)

    recv = Receiver()
    try:
        cfg = workdir / "relay.toml"
        cfg.write_text(
            f"""
sink = "webhook"
subscription = "relay-webhook"
lease = "10s"
poll_interval = "200ms"
[webhook]
secrets = {json.dumps(SECRETS)}
timeout = "2s"
concurrency = 8
[[webhook.endpoints]]
name = "main"
url = "http://127.0.0.1:{recv.port}/main"
topics = ["orders.*"]
[[webhook.endpoints]]
name = "gone"
url = "http://127.0.0.1:{recv.port}/gone"
topics = ["legacy.*"]
concurrency = 2
"""
        )
        # Debug level: the relay logs every failure with its event id, which the 422 check reads.
        relay = rl.start_relay(
            workdir, "relay", db, ["--config", str(cfg)], oargs, extra_env={"OUTBOX_LOG": "info,outbox::relay=debug"}
        )
        procs.append(relay)

        def status(sub):
            with rl.connect(db) as c:
                return c.execute(
                    "SELECT lag_events, leases_in_flight, dead_letters, paused FROM outbox.subscriptions WHERE name = %s",
                    (sub,),
                ).fetchone()

        rl.wait_for(lambda: status("relay-webhook.main")[:2] == (0, 0), 120, "main endpoint drained")
        rl.wait_for(lambda: status("relay-webhook.gone")[3], 30, "gone endpoint disabled")
        with rl.connect(db) as c:
            rows = c.execute(
                "SELECT event_id, subscription, state, attempts, last_error FROM outbox.deliveries "
                "WHERE subscription LIKE 'relay-webhook.%%'"
            ).fetchall()
        by_id = {(r[0], r[1]): r for r in rows}
        main = {i: by_id[(i, "relay-webhook.main")] for i, m in ids.items() if m != "legacy"}
        for i, r in main.items():
            mode = ids[i]
            if mode == "bad":
                # A 422 is final: the event is dead after the attempt that got it. An attempt before
                # it may have failed otherwise (a request timing out on a loaded machine), so the
                # relay's log, not the attempt count alone, shows that no 422 was retried.
                assert r[2] == "dead" and "HTTP 422" in r[4] and "field x is invalid" in r[4], r
                outcomes = relay_outcomes(relay, i)
                assert outcomes[-1].startswith("dead letter: webhook main: HTTP 422"), outcomes
                assert not any("HTTP 422" in o for o in outcomes[:-1]), outcomes
                assert r[3] == len(outcomes), (r, outcomes)
            else:
                assert r[2] == "delivered", r
        with recv.lock:
            reqs = list(recv.requests)
        assert all(q[5] for q in reqs), "a request failed signature verification"
        for _t, _path, _status, mid, body, _v in reqs:
            o, _, eid = mid.partition(":")
            assert o == oid
            assert body == payloads[int(eid)].encode(), f"body of {eid} differs from payload::text"
        per_id = collections.defaultdict(list)
        for t, path, st, mid, _b, _v in reqs:
            per_id[int(mid.partition(":")[2])].append((t, st))
        n500 = sum(1 for q in reqs if q[2] == 500)
        assert n500 > 20, f"only {n500} random 500s"
        for i, m in ids.items():
            if m == "ok" and per_id[i][0][1] == 500:
                assert main[i][3] >= 2 and main[i][2] == "delivered"
            if m == "r429":
                (t1, s1), (t2, s2) = per_id[i][:2]
                assert s1 == 429 and s2 == 200
                assert t2 - t1 >= 1.9, f"Retry-After not honoured: {t2 - t1:.2f}s"
            if m == "slow":
                assert len(per_id[i]) >= 2 and main[i][3] >= 2
        # 410: the event whose 410 disabled the endpoint is dead, the endpoint's subscription is
        # paused and the others wait, not dead-lettered (also one whose request was in flight).
        legacy = [by_id[(i, "relay-webhook.gone")] for i, m in ids.items() if m == "legacy"]
        dead = [r for r in legacy if r[2] == "dead"]
        assert len(dead) == 1, legacy
        assert all("HTTP 410" in r[4] for r in dead)
        assert sum(1 for r in legacy if r[2] == "delivered") == 0
        rl.wait_for(
            lambda: rl.metrics(relay).get('outbox_relay_endpoint_disabled{sink="webhook",subscription="relay-webhook.gone"}') == 1,
            15,
            "endpoint_disabled metric",
        )
        gone_before = sum(1 for q in reqs if q[1] == "/gone")
        time.sleep(2)
        with recv.lock:
            assert sum(1 for q in recv.requests if q[1] == "/gone") == gone_before, "disabled endpoint was called"
            recv.gone_enabled = True
        with rl.connect(db) as c:
            c.execute("SELECT outbox.resume_subscription('relay-webhook.gone')")
        rl.wait_for(lambda: status("relay-webhook.gone")[:2] == (0, 0), 60, "gone endpoint drained after resume")
        with rl.connect(db) as c:
            states = collections.Counter(
                r[0]
                for r in c.execute(
                    "SELECT state FROM outbox.deliveries WHERE subscription = 'relay-webhook.gone'"
                ).fetchall()
            )
        assert states["delivered"] == 20 - len(dead) and states["dead"] == len(dead), states
        assert relay.term() == 0
        print(
            f"\nwebhooks: {len(ids)} events, {len(reqs)} requests, {n500} random 500s, 429/slow retried, "
            f"3 dead (422), {len(dead)} dead (410), endpoint re-enabled and drained"
        )
    finally:
        recv.close()


class GoneReceiver:
    """Answers 410 (after `delay` s, so concurrent requests are all in flight when the first 410
    comes back) until `enabled`, then 200; `/down` is never listened on."""

    def __init__(self, delay=0.5):
        self.enabled = False
        self.delay = delay
        self.lock = threading.Lock()
        self.calls = collections.Counter()
        recv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", "0")))
                with recv.lock:
                    recv.calls[recv.enabled] += 1
                    enabled = recv.enabled
                if not enabled:
                    time.sleep(recv.delay)
                self.send_response(200 if enabled else 410)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_410_race_and_healthz(pg_cluster, workdir, procs):
    """Four requests in flight all answered 410: one dead letter (the one that disabled the
    endpoint), the other three wait with the rest. /healthz is 503 while the only endpoint is
    disabled, 200 again after the resume; 503 while an endpoint is unreachable."""
    db = "relay_w"
    rl.fresh_db(db)
    _oid, oargs = rl.outbox_identity(db)
    with rl.connect(db) as c:
        c.execute(
            "SELECT outbox.create_subscription('relay-webhook', start => 'earliest', backoff_base => '200 milliseconds', "
            "backoff_max => '1 second', max_attempts => 50)"
        )
        for i in range(12):
            c.execute("SELECT outbox.publish('legacy.thing', %s::jsonb)", (json.dumps({"n": i}),))
    recv = GoneReceiver()
    try:
        args = ["--sink", "webhook", "--webhook-url", f"http://127.0.0.1:{recv.port}/gone", "--webhook-secret",
                SECRETS[0], "--webhook-concurrency", "4", "--poll-interval", "200ms", "--lease", "10s"]
        relay = rl.start_relay(workdir, "relay", db, args, oargs)
        procs.append(relay)

        def states():
            with rl.connect(db) as c:
                return collections.Counter(
                    r[0] for r in c.execute(
                        "SELECT state FROM outbox.deliveries WHERE subscription = 'relay-webhook'"
                    ).fetchall()
                )

        def paused():
            with rl.connect(db) as c:
                return c.execute("SELECT paused FROM outbox.subscriptions WHERE name = 'relay-webhook'").fetchone()[0]

        rl.wait_for(paused, 20, "endpoint disabled")
        rl.wait_for(lambda: states().get("leased", 0) == 0, 20, "in-flight requests finished")
        with recv.lock:
            assert recv.calls[False] >= 2, recv.calls
        assert states()["dead"] == 1, states()
        status, body = rl.wait_for(lambda: (lambda h: h if h[0] == 503 else None)(rl.healthz(relay)), 10, "healthz 503")
        assert "disabled" in json.loads(body)["reason"], body
        with recv.lock:
            recv.enabled = True
        with rl.connect(db) as c:
            c.execute("SELECT outbox.resume_subscription('relay-webhook')")
        rl.wait_for(lambda: states().get("delivered", 0) == 11, 30, "the other 11 delivered after the resume")
        assert states()["dead"] == 1
        assert rl.healthz(relay)[0] == 200
        assert relay.term() == 0
    finally:
        recv.close()

    # Unreachable: nothing listens on the endpoint's port.
    with rl.connect(db) as c:
        c.execute("SELECT outbox.publish('legacy.thing', '{}'::jsonb)")
    args = ["--sink", "webhook", "--webhook-url", f"http://127.0.0.1:{rl.free_port()}/down", "--webhook-secret",
            SECRETS[0], "--poll-interval", "200ms", "--webhook-timeout", "1s"]
    relay = rl.start_relay(workdir, "relay2", db, args, oargs)
    procs.append(relay)
    status, body = rl.wait_for(lambda: (lambda h: h if h[0] == 503 else None)(rl.healthz(relay)), 15, "healthz 503")
    assert "unreachable" in json.loads(body)["reason"], body
    assert relay.term() == 0


def test_relay_claims_in_a_database_whose_default_isolation_is_serializable(pg_cluster, workdir, procs):
    """outbox.claim refuses SERIALIZABLE (0A000). The relay's sessions run at READ COMMITTED
    whatever the database's default_transaction_isolation, so it delivers there (before it set
    its sessions' level, every claim failed with 0A000 and nothing was delivered)."""
    db = "relay_ser"
    rl.fresh_db(db)
    _oid, oargs = rl.outbox_identity(db)
    with rl.connect("postgres") as c:
        c.execute(f'ALTER DATABASE "{db}" SET default_transaction_isolation = serializable')
    with rl.connect(db) as c:
        assert c.execute("SHOW default_transaction_isolation").fetchone()[0] == "serializable"
        try:
            c.execute("SELECT * FROM outbox.claim('probe', 1)")
            refused = None
        except psycopg.Error as e:
            refused = e.sqlstate
        assert refused == "0A000", f"a claim at the database's SERIALIZABLE default gave {refused!r}"
        c.execute("SELECT outbox.create_subscription('relay-webhook', start => 'earliest')")
        for i in range(20):
            c.execute("SELECT outbox.publish('ser.thing', %s::jsonb, subject => %s)", (json.dumps({"n": i}), f"s{i % 3}"))
    recv = GoneReceiver()
    with recv.lock:
        recv.enabled = True
    try:
        args = ["--sink", "webhook", "--webhook-url", f"http://127.0.0.1:{recv.port}/ok", "--webhook-secret",
                SECRETS[0], "--poll-interval", "200ms"]
        relay = rl.start_relay(workdir, "relay", db, args, oargs)
        procs.append(relay)

        def delivered():
            with rl.connect(db) as c:
                return c.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'relay-webhook' "
                                 "AND state = 'delivered'").fetchone()[0]

        rl.wait_for(lambda: delivered() == 20, 30, f"20 events delivered (relay log: {relay.log_path})")
        assert "0A000" not in relay.log() and "SERIALIZABLE" not in relay.log(), relay.log()[-2000:]
        assert relay.term() == 0
    finally:
        recv.close()
