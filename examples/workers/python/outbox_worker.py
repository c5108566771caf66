#!/usr/bin/env python3
"""Reference outbox_ext worker in Python (psycopg 3.2+).

Settings come from the environment (see examples/workers/README.md):
OUTBOX_DSN, OUTBOX_WORKER_NAME, OUTBOX_SUBSCRIPTION, OUTBOX_TOPICS, OUTBOX_BATCH_SIZE,
OUTBOX_LEASE, OUTBOX_CONCURRENCY, OUTBOX_POLL_INTERVAL, OUTBOX_RETRY_IN, OUTBOX_RECONNECT_MAX,
OUTBOX_HANDLER (stdout | webhook | test | module:function), OUTBOX_WEBHOOK_URL,
OUTBOX_WEBHOOK_TIMEOUT, OUTBOX_DELIVERY_LOG, OUTBOX_INBOX_DSN, OUTBOX_INBOX_CONSUMER,
OUTBOX_INBOX_TABLE.

A handler is a callable taking one Event. Returning means delivered; raising
PermanentError dead-letters the event at once; any other exception is a
transient failure that the extension retries with backoff.

A handler whose effect is a write to PostgreSQL applies it exactly once with
process_once(conn, consumer, event.message_id, fn): see its docstring and the
`inbox` handler.
"""

import importlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psycopg
from psycopg import sql


class PermanentError(Exception):
    """Raised by a handler when retrying cannot help (bad payload, HTTP 4xx...)."""


class Event:
    __slots__ = ("id", "topic", "subject", "dispatch_key", "payload_text", "headers",
                 "attempt", "lease_token", "message_id", "_payload")

    def __init__(self, row, outbox_id=None):
        (self.id, self.topic, self.subject, self.dispatch_key, self.payload_text,
         headers, self.attempt, self.lease_token) = row
        self.headers = json.loads(headers) if headers else {}
        # The event's identity as a message, the same on every delivery and
        # across databases: what the relay sends as Nats-Msg-Id and webhook-id.
        self.message_id = message_id(outbox_id, self.id) if outbox_id else None
        self._payload = None

    @property
    def payload(self):
        # Parsed lazily: the webhook forwards payload_text untouched, so numbers
        # keep the exact text the publisher stored.
        if self._payload is None:
            self._payload = json.loads(self.payload_text)
        return self._payload


def log(msg):
    ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    print(f"{ts} {msg}", file=sys.stderr, flush=True)


def env_float(name, default):
    v = os.environ.get(name, "").strip()
    return float(v) if v else default


class Config:
    def __init__(self):
        self.dsn = os.environ.get("OUTBOX_DSN") or sys.exit("OUTBOX_DSN is required")
        self.name = os.environ.get("OUTBOX_WORKER_NAME") or f"py-{socket.gethostname()}-{os.getpid()}"
        # Unset or empty: NULL, the 'default' subscription.
        self.subscription = os.environ.get("OUTBOX_SUBSCRIPTION", "").strip() or None
        topics = [t.strip() for t in os.environ.get("OUTBOX_TOPICS", "").split(",") if t.strip()]
        self.topics = topics or None
        self.batch_size = int(env_float("OUTBOX_BATCH_SIZE", 10))
        self.lease = env_float("OUTBOX_LEASE", 30.0)
        self.concurrency = max(1, int(env_float("OUTBOX_CONCURRENCY", 1)))
        self.poll = env_float("OUTBOX_POLL_INTERVAL", 5.0)
        retry = os.environ.get("OUTBOX_RETRY_IN", "").strip()
        self.retry_in = float(retry) if retry else None
        self.reconnect_max = env_float("OUTBOX_RECONNECT_MAX", 30.0)
        self.handler = os.environ.get("OUTBOX_HANDLER", "stdout")
        self.webhook_url = os.environ.get("OUTBOX_WEBHOOK_URL", "")
        self.webhook_timeout = env_float("OUTBOX_WEBHOOK_TIMEOUT", 10.0)
        self.delivery_log = os.environ.get("OUTBOX_DELIVERY_LOG") or None
        self.inbox_dsn = os.environ.get("OUTBOX_INBOX_DSN") or self.dsn
        self.inbox_consumer = os.environ.get("OUTBOX_INBOX_CONSUMER") or "outbox-worker"
        self.inbox_table = os.environ.get("OUTBOX_INBOX_TABLE") or "outbox_effects"


# ---------------------------------------------------------------- exactly-once effects (the inbox)

def message_id(outbox_id, event_id):
    """An outbox event's message id: `<outbox_id>:<event id>`, where outbox_id is
    `SELECT outbox.outbox_id()` in the outbox's database (read it once)."""
    return f"{outbox_id}:{event_id}"


def process_once(conn, consumer, message_id, fn, retries=5):
    """Apply a message's effect on PostgreSQL exactly once; True if it was
    applied now, False if the message was a duplicate (fn did not run).

    In one transaction on `conn` (the consumer's own database, where the effect
    goes, which may not be the outbox's): `outbox.inbox_receive(consumer,
    message_id)`, then `fn(cursor)` only when that says it is the first time,
    then COMMIT. The receipt commits iff the effect does, so the effect lives in
    the same database as the inbox: that database needs outbox_ext installed
    (CREATE EXTENSION outbox_ext) and the role EXECUTE on inbox_receive
    (outbox_worker has it).

    `conn` must not be in a transaction (process_once commits); autocommit or
    not, it is left idle. Use one connection per thread. The transaction has the
    connection's isolation level. A concurrent duplicate waits for the first and
    returns False; at REPEATABLE READ or SERIALIZABLE it gets 40001 instead,
    and serialization failures (40001) and deadlocks (40P01), from
    inbox_receive, fn or COMMIT, retry the whole transaction up to `retries`
    times, so fn may run more than once but only one run commits: its writes go
    through the cursor, nothing else. Any other exception from fn rolls back
    (the message can be received again) and propagates.
    """
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise psycopg.ProgrammingError("process_once: the connection is in a transaction; it must be idle")
    for attempt in range(retries + 1):
        try:
            with conn.transaction(), conn.cursor() as cur:
                cur.execute("SELECT outbox.inbox_receive(%s, %s)", (consumer, message_id))
                if not cur.fetchone()[0]:
                    return False
                fn(cur)
                if conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                    # fn swallowed an SQL error: COMMIT would silently roll back.
                    raise psycopg.errors.InFailedSqlTransaction(
                        "process_once: fn left the transaction aborted; rolled back")
            return True
        except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
            if attempt >= retries:
                raise
            time.sleep(random.uniform(0.005, 0.02) * 2 ** attempt)


# ---------------------------------------------------------------- handlers

def stdout_handler(cfg):
    lock = threading.Lock()

    def handle(ev):
        line = json.dumps({"id": ev.id, "topic": ev.topic, "subject": ev.subject,
                           "attempt": ev.attempt})
        # Splice the raw payload in so it prints exactly as stored.
        with lock:
            sys.stdout.write(line[:-1] + ', "payload": ' + ev.payload_text + "}\n")
            sys.stdout.flush()
    return handle


def webhook_handler(cfg):
    if not cfg.webhook_url:
        sys.exit("OUTBOX_HANDLER=webhook needs OUTBOX_WEBHOOK_URL")

    def handle(ev):
        headers = {
            "Content-Type": "application/json",
            "X-Outbox-Event-Id": str(ev.id),
            "X-Outbox-Topic": ev.topic,
            "X-Outbox-Attempt": str(ev.attempt),
            # Receivers deduplicate on this: delivery is at least once.
            "Idempotency-Key": ev.dispatch_key or f"outbox-{ev.id}",
        }
        if ev.subject is not None:
            headers["X-Outbox-Subject"] = ev.subject
        for h in ("traceparent", "tracestate"):
            v = ev.headers.get(h)
            if isinstance(v, str) and "\r" not in v and "\n" not in v:
                headers[h] = v
        req = urllib.request.Request(cfg.webhook_url, data=ev.payload_text.encode(),
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=cfg.webhook_timeout) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            text = f"HTTP {e.code} from webhook: {e.read(200).decode('utf-8', 'replace')}"
            # 408/429/5xx may succeed later; other statuses will not.
            if e.code in (408, 429) or e.code >= 500:
                raise RuntimeError(text) from None
            raise PermanentError(text) from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"webhook unreachable: {e}") from None
    return handle


def test_handler(cfg):
    """Driven by the payload, for the end-to-end tests:
    {"sleep_ms": N, "fail": "transient"|"permanent"|null, "fail_attempts": k, "error": text}."""
    def handle(ev):
        p = ev.payload if isinstance(ev.payload, dict) else {}
        if p.get("sleep_ms"):
            time.sleep(p["sleep_ms"] / 1000.0)
        if p.get("fail") == "permanent":
            raise PermanentError(p.get("error") or "permanent test failure")
        if p.get("fail") == "transient" and ev.attempt <= p.get("fail_attempts", 1):
            raise RuntimeError(p.get("error") or "transient test failure")
    return handle


def inbox_handler(cfg):
    """An effect in PostgreSQL applied exactly once through process_once: one row
    per message in OUTBOX_INBOX_TABLE (message_id, event_id, topic, subject,
    attempt, payload) in the database OUTBOX_INBOX_DSN (default OUTBOX_DSN), as
    consumer OUTBOX_INBOX_CONSUMER. The message id is the payload's "message_id"
    when it is a string (an id the producer gave the message), else
    Event.message_id. For the tests, also driven by the payload: "effect_sleep_ms"
    and "effect_fail" act inside the transaction (a failure rolls the receipt
    back too, while attempt <= "fail_attempts"), then the `test` handler's
    fields act after the commit (a failure there means a redelivery, which is
    then a duplicate)."""
    table = sql.SQL(".").join(sql.Identifier(p) for p in cfg.inbox_table.split("."))
    insert = sql.SQL("INSERT INTO {} (message_id, event_id, topic, subject, attempt, payload) "
                     "VALUES (%s, %s, %s, %s, %s, %s::jsonb)").format(table)
    after = test_handler(cfg)
    local = threading.local()  # one connection per handler thread

    def handle(ev):
        p = ev.payload if isinstance(ev.payload, dict) else {}
        mid = p["message_id"] if isinstance(p.get("message_id"), str) else ev.message_id
        if not mid:
            raise PermanentError("no message id (outbox.outbox_id() needs outbox_ext 0.11.0)")

        def effect(cur):
            cur.execute(insert, (mid, ev.id, ev.topic, ev.subject, ev.attempt, ev.payload_text))
            if p.get("effect_sleep_ms"):
                time.sleep(p["effect_sleep_ms"] / 1000.0)
            if p.get("effect_fail") and ev.attempt <= p.get("fail_attempts", 1):
                raise RuntimeError("effect failed, rolled back")

        conn = getattr(local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            conn = local.conn = psycopg.connect(cfg.inbox_dsn, autocommit=True,
                                                application_name=cfg.name + "-inbox")
        process_once(conn, cfg.inbox_consumer, mid, effect)
        after(ev)
    return handle


def load_handler(cfg):
    builtin = {"stdout": stdout_handler, "webhook": webhook_handler, "test": test_handler,
               "inbox": inbox_handler}
    if cfg.handler in builtin:
        return builtin[cfg.handler](cfg)
    mod, _, fn = cfg.handler.partition(":")
    if not fn:
        sys.exit(f"unknown OUTBOX_HANDLER {cfg.handler!r} (stdout, webhook, test, inbox or module:function)")
    return getattr(importlib.import_module(mod), fn)


# ---------------------------------------------------------------- database

def error_text(e):
    # PostgreSQL text cannot hold NUL; the extension keeps 8 kB anyway.
    return (str(e) or type(e).__name__).replace("\x00", "")[:8000]


class Lost(Exception):
    """The connection dropped and the deadline to retry has passed."""


class Db:
    """Two connections: `listen` only waits for NOTIFY, `work` claims, acks and
    heartbeats (shared by the handler threads under a lock). Both reconnect with
    capped exponential backoff; `listen` re-LISTENs each time."""

    def __init__(self, cfg, stop):
        self.cfg, self.stop = cfg, stop
        self.lock = threading.Lock()
        self.work = None
        self.listen = None
        self.listened = False
        self.connected = False

    def _connect(self):
        c = psycopg.connect(self.cfg.dsn, autocommit=True, application_name=self.cfg.name)
        # outbox.claim refuses SERIALIZABLE (0A000): whatever the database's
        # default_transaction_isolation, this session claims at READ COMMITTED.
        c.execute("SET default_transaction_isolation = 'read committed'")
        return c

    def _backoff(self, attempt):
        d = min(self.cfg.reconnect_max, 0.1 * 2 ** attempt)
        return d / 2 + random.random() * d / 2

    def call(self, sql, params=(), deadline=None):
        """Run one statement on `work`, reconnecting on connection loss. Gives up
        (raises Lost) after `deadline` (monotonic) or, with no deadline, once the
        worker is stopping."""
        attempt = 0
        while True:
            try:
                with self.lock:
                    if self.work is None:
                        self.work = self._connect()
                        if self.connected:
                            log(f"worker={self.cfg.name} reconnected (work connection)")
                        self.connected = True
                    return self.work.execute(sql, params).fetchall()
            except psycopg.OperationalError as e:
                with self.lock:
                    if self.work is not None and not (self.work.closed or self.work.broken):
                        raise  # a real error on a healthy connection, not a drop
                    if self.work is not None:
                        self.work.close()
                    self.work = None
                delay = self._backoff(attempt)
                attempt += 1
                if (deadline is not None and time.monotonic() + delay > deadline) or \
                        (deadline is None and self.stop.is_set()):
                    raise Lost(str(e).strip()) from None
                log(f"worker={self.cfg.name} connection lost ({str(e).strip().splitlines()[0]}); "
                    f"retry in {delay:.2f}s")
                time.sleep(delay)

    def ensure_listen(self):
        """(Re)open the LISTEN connection; returns True when it was (re)opened, so
        the caller claims at once for notifications missed meanwhile."""
        if self.listen is not None and not self.listen.closed:
            return False
        attempt = 0
        while not self.stop.is_set():
            try:
                self.listen = self._connect()
                self.listen.execute("LISTEN outbox")
                if self.listened:
                    log(f"worker={self.cfg.name} reconnected, LISTEN outbox again")
                self.listened = True
                return True
            except psycopg.OperationalError as e:
                delay = self._backoff(attempt)
                attempt += 1
                log(f"worker={self.cfg.name} cannot connect ({str(e).strip().splitlines()[0]}); "
                    f"retry in {delay:.2f}s")
                self.stop.wait(delay)
        return False

    def wait(self, seconds, wanted):
        """Block until a NOTIFY for a wanted topic, `seconds`, or stop.

        A notification names a topic, not a subscription. `wanted` is the
        claim's own filter (OUTBOX_TOPICS; every topic when unset), never the
        subscription's topics: a worker of a filtered subscription wakes for
        each of its topics, and a wake-up for a topic its subscription does not
        take costs one empty claim.
        """
        end = time.monotonic() + seconds
        while not self.stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            try:
                # Short slices: SIGTERM only sets a flag, it does not end the wait.
                got = [n for n in self.listen.notifies(timeout=min(left, 0.25))]
            except psycopg.OperationalError as e:
                log(f"worker={self.cfg.name} listen connection lost ({str(e).strip().splitlines()[0]})")
                self.listen.close()
                return
            if any(wanted(n.payload) for n in got):
                return

    def close(self):
        for c in (self.work, self.listen):
            if c is not None:
                c.close()


def topic_filter(patterns):
    if not patterns:
        return lambda t: True

    def wanted(topic):
        for p in patterns:
            if p == "*" or p == topic or (p.endswith(".*") and topic.startswith(p[:-1])):
                return True
        return False
    return wanted


# ---------------------------------------------------------------- worker

CLAIM_SQL = """
SELECT id, topic, subject, dispatch_key, payload::text, headers::text, attempt, lease_token
  FROM outbox.claim(%s, %s, make_interval(secs => %s), %s::text[], %s::text)"""


class Worker:
    def __init__(self, cfg):
        self.cfg = cfg
        self.stop = threading.Event()
        self.db = Db(cfg, self.stop)
        self.handler = load_handler(cfg)
        self.pool = ThreadPoolExecutor(max_workers=cfg.concurrency)
        self.log_lock = threading.Lock()
        self.batches = 0
        self.outbox_id = None

    def record(self, ev, started, acked):
        if not self.cfg.delivery_log:
            return
        line = json.dumps({"worker": self.cfg.name, "id": ev.id, "topic": ev.topic,
                           "subject": ev.subject, "attempt": ev.attempt,
                           "started": started, "finished": time.time(), "acked": acked})
        with self.log_lock, open(self.cfg.delivery_log, "a") as f:
            f.write(line + "\n")

    def settle(self, sql, params):
        # Retrying past the lease is pointless: the event is anyone's again.
        return self.db.call(sql, params, deadline=time.monotonic() + self.cfg.lease)[0][0]

    def deliver(self, ev, unfinished):
        """Run the handler for one event and report the outcome. Returns the outcome
        name for the batch log line."""
        try:
            if self.stop.is_set():
                # Shutting down: give back events whose handler has not started.
                self.settle("SELECT outbox.fail(%s, %s, %s, interval '0')",
                            (ev.id, ev.lease_token, "worker stopping before delivery"))
                return "released"
            started = time.time()
            try:
                self.handler(ev)
            except PermanentError as e:
                state = self.settle("SELECT outbox.fail(%s, %s, %s, NULL, true)",
                                    (ev.id, ev.lease_token, error_text(e)))
                return "dead" if state == "dead" else "stale"
            except Exception as e:  # noqa: BLE001 - any handler error is transient
                retry = self.cfg.retry_in
                state = self.settle(
                    "SELECT outbox.fail(%s, %s, %s, make_interval(secs => %s))",
                    (ev.id, ev.lease_token, error_text(e), retry))
                return {"pending": "retry", "dead": "dead"}.get(state, "stale")
            acked = self.settle("SELECT outbox.ack(%s, %s)", (ev.id, ev.lease_token))
            self.record(ev, started, acked)
            return "acked" if acked else "stale"
        except Lost:
            return "lost"
        finally:
            unfinished.pop(ev.id, None)

    def heartbeat(self, unfinished, done):
        # lease/3: two missed beats still leave the lease alive.
        while not done.wait(self.cfg.lease / 3):
            live = list(unfinished.values())
            if not live:
                continue
            try:
                rows = self.db.call(
                    "SELECT t.id, outbox.extend_lease(t.id, t.tok, make_interval(secs => %s))"
                    "  FROM unnest(%s::bigint[], %s::uuid[]) AS t(id, tok)",
                    (self.cfg.lease, [e.id for e in live], [e.lease_token for e in live]),
                    deadline=time.monotonic() + self.cfg.lease / 3)
            except Lost:
                continue
            for eid, until in rows:
                if until is None and unfinished.pop(eid, None) is not None:
                    log(f"worker={self.cfg.name} lease lost for event {eid}")

    def process(self, events):
        t0 = time.monotonic()
        unfinished = {e.id: e for e in events}
        done = threading.Event()
        hb = threading.Thread(target=self.heartbeat, args=(unfinished, done), daemon=True)
        hb.start()
        try:
            outcomes = list(self.pool.map(lambda e: self.deliver(e, unfinished), events))
        finally:
            done.set()
            hb.join()
        self.batches += 1
        counts = {k: outcomes.count(k) for k in ("acked", "retry", "dead", "stale", "released", "lost")}
        log(f"worker={self.cfg.name} batch={self.batches} claimed={len(events)} "
            + " ".join(f"{k}={v}" for k, v in counts.items())
            + f" ms={int((time.monotonic() - t0) * 1000)}")

    def read_outbox_id(self):
        """outbox.outbox_id(), read once: it never changes. "" before 0.11.0."""
        try:
            return str(self.db.call("SELECT outbox.outbox_id()")[0][0])
        except psycopg.errors.UndefinedFunction:
            log(f"worker={self.cfg.name} outbox.outbox_id() missing (outbox_ext < 0.11.0): "
                "events have no message_id")
            return ""

    def run(self):
        cfg = self.cfg
        wanted = topic_filter(cfg.topics)
        log(f"worker={cfg.name} starting: handler={cfg.handler} subscription={cfg.subscription or 'default'} "
            f"topics={cfg.topics or '*'} "
            f"batch={cfg.batch_size} lease={cfg.lease}s concurrency={cfg.concurrency} poll={cfg.poll}s")
        while not self.stop.is_set():
            self.db.ensure_listen()
            if self.stop.is_set():
                break
            try:
                if self.outbox_id is None:
                    self.outbox_id = self.read_outbox_id()
                rows = self.db.call(CLAIM_SQL, (cfg.name, cfg.batch_size, cfg.lease, cfg.topics, cfg.subscription))
            except Lost:
                break
            if rows:
                # Acks may have unblocked later events of the same subjects, and
                # no NOTIFY announces that: claim again before sleeping.
                self.process([Event(r, self.outbox_id) for r in rows])
                continue
            self.db.wait(cfg.poll, wanted)
        self.pool.shutdown(wait=True)
        self.db.close()
        log(f"worker={cfg.name} stopped")


def main():
    worker = Worker(Config())

    def on_signal(signum, _frame):
        if not worker.stop.is_set():
            log(f"worker={worker.cfg.name} got signal {signum}: finishing in-flight events")
        worker.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.run()


if __name__ == "__main__":
    # A handler module's `import outbox_worker` must get this module, not a second
    # copy: otherwise its PermanentError is another class and is not caught.
    sys.modules.setdefault("outbox_worker", sys.modules[__name__])
    main()
