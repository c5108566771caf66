"""End-to-end tests of the reference workers in examples/workers/ (Python, Node.js,
Rust, shell), all driven the same way against the preloaded cluster
(OUTBOX_TEST_DSN_PRELOAD, database postgres, where the background worker sends the
NOTIFY wake-ups).

Every worker has a payload-driven test handler (OUTBOX_HANDLER=test):
{"sleep_ms": N, "fail": "transient"|"permanent", "fail_attempts": k, "error": text}
and, with OUTBOX_DELIVERY_LOG, appends one JSON line per successful handler run
({"worker", "id", "subject", "attempt", "started", "finished", "acked"}). The tests
assert on those logs and on outbox.events.

Build steps (npm ci, cargo build --release) run through examples/workers/build.sh,
once per session. A language is skipped only when its toolchain is missing.
"""

import http.server
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest

from conftest import DB

REPO = Path(__file__).resolve().parents[2]
WORKERS_DIR = REPO / "examples" / "workers"
# Worker logs and delivery logs, kept after the run for post-mortems. Not under
# target/test-results: scripts/test.sh clears that while other suites may run.
RESULTS = Path(os.environ.get("OUTBOX_WORKER_TEST_DIR", "/tmp/outbox-worker-tests"))
LANGS = ["python", "node", "rust", "shell"]

LEASE = 2.0        # short, so a 5 s handler needs the heartbeat
SLOW_MS = 5000

# ---------------------------------------------------------------- build / commands

_built = {}


def _which(tool):
    found = shutil.which(tool)
    if not found and tool == "cargo":
        cand = Path(os.environ.get("CARGO_HOME", Path.home() / ".cargo")) / "bin" / "cargo"
        found = str(cand) if cand.exists() else None
    return found


def worker_command(lang):
    """The argv that starts one worker of `lang`; builds it first (once)."""
    if lang in _built:
        ok, val = _built[lang]
        if not ok:
            pytest.skip(val) if val.startswith("SKIP") else pytest.fail(val)
        return val
    needs = {"python": [], "node": ["node", "npm"], "rust": ["cargo"], "shell": ["bash", "psql"]}[lang]
    missing = [t for t in needs if not _which(t)]
    if missing:
        msg = f"SKIP: {lang} worker not tested: toolchain missing ({', '.join(missing)} not found)"
        print(f"\n!!!!! {msg} !!!!!", file=sys.stderr)
        _built[lang] = (False, msg)
        pytest.skip(msg)
    if lang in ("node", "rust"):
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(_which(needs[0])) + os.pathsep + env.get("PATH", "")
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(WORKERS_DIR / "build.sh"), lang], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           stdin=subprocess.DEVNULL, timeout=1800)
        print(f"build.sh {lang}: {time.monotonic() - t0:.1f}s\n{r.stdout[-2000:]}", file=sys.stderr)
        if r.returncode != 0:
            _built[lang] = (False, f"build.sh {lang} failed (exit {r.returncode}):\n{r.stdout[-4000:]}")
            pytest.fail(_built[lang][1])
    cmd = {
        "python": [sys.executable, str(WORKERS_DIR / "python" / "outbox_worker.py")],
        "node": [_which("node") or "node", str(WORKERS_DIR / "node" / "worker.js")],
        "rust": [str(WORKERS_DIR / "rust" / "target" / "release" / "outbox-worker")],
        "shell": ["bash", str(WORKERS_DIR / "shell" / "outbox-worker.sh")],
    }[lang]
    _built[lang] = (True, cmd)
    return cmd


# ---------------------------------------------------------------- processes

class Worker:
    """One worker process in its own process group (so SIGKILL can take its
    children too, like a crashed container)."""

    def __init__(self, cmd, name, outdir, **settings):
        self.name = name
        self.log = outdir / f"{name}.log"
        self.out = outdir / f"{name}.out"
        self.deliveries = outdir / f"{name}.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update({"OUTBOX_WORKER_NAME": name, "OUTBOX_DELIVERY_LOG": str(self.deliveries)})
        env.update({k: str(v) for k, v in settings.items()})
        with open(self.log, "ab") as err, open(self.out, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def terminate(self, timeout=20):
        """SIGTERM to the main process only (what an orchestrator sends); returns
        the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout}s of SIGTERM")

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def tail(self, n=30):
        parts = []
        for p in (self.log, self.out):
            if p.exists():
                lines = p.read_text(errors="replace").splitlines()
                parts.append(f"--- {p} (last {min(n, len(lines))} of {len(lines)} lines)\n"
                             + "\n".join(lines[-n:]))
        return "\n".join(parts)


def read_deliveries(*workers):
    rows = []
    for w in workers:
        if w.deliveries.exists():
            for line in w.deliveries.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass  # a line cut short by SIGKILL
    return rows


def wait_until(pred, timeout, what, workers=()):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        for w in workers:
            if not w.alive():
                raise AssertionError(f"{w.name} exited early (code {w.proc.returncode}) while waiting for {what}\n{w.tail()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n"
                         + "\n".join(w.tail() for w in workers))


# ---------------------------------------------------------------- fixtures

def _clean(dsn, conn):
    DB(dsn, "preload").clean()
    conn.execute("DELETE FROM outbox.topics WHERE topic LIKE 'wk.%'")


def unfinished(conn, topic, dead=False):
    """The default subscription's events of `topic` not delivered yet (pending
    or leased; dead ones too when `dead`), from outbox.deliveries."""
    states = ["pending", "leased"] + (["dead"] if dead else [])
    return conn.execute("SELECT count(*) FROM outbox.deliveries WHERE subscription = 'default' "
                        "AND topic = %s AND state = ANY (%s)", (topic, states)).fetchone()[0]


@pytest.fixture
def dsn():
    dsn = os.environ.get("OUTBOX_TEST_DSN_PRELOAD")
    if not dsn:
        pytest.skip("OUTBOX_TEST_DSN_PRELOAD is not set (run through scripts/test.sh)")
    return dsn


@pytest.fixture
def db(dsn):
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("CREATE EXTENSION IF NOT EXISTS outbox_ext")
    running = conn.execute("SELECT worker_pid IS NOT NULL FROM outbox.wakeup_status()").fetchone()[0]
    if not running:
        # Without the background worker, notify from the publishing transaction.
        conn.execute("SET outbox.notify = 'transaction'")
    _clean(dsn, conn)
    yield conn
    _clean(dsn, conn)
    conn.close()


@pytest.fixture
def spawn(request, dsn):
    """spawn(lang, name, **settings) -> Worker; every worker is killed at teardown."""
    outdir = RESULTS / request.node.name.replace("/", "_")
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    started = []

    def start(lang, name, **settings):
        base = {"OUTBOX_DSN": dsn, "OUTBOX_LEASE": LEASE, "OUTBOX_BATCH_SIZE": 5,
                "OUTBOX_CONCURRENCY": 2, "OUTBOX_POLL_INTERVAL": 1, "OUTBOX_RETRY_IN": 0.1,
                "OUTBOX_HANDLER": "test", "OUTBOX_RECONNECT_MAX": 2}
        base.update(settings)
        w = Worker(worker_command(lang), name, outdir, **base)
        started.append(w)
        return w

    yield start
    for w in started:
        if w.alive():
            w.kill()


def fetch(conn, sql, *params):
    return conn.execute(sql, params).fetchall()


def publish_batch(conn, topic, payload_texts, subjects=None):
    return [r[0] for r in fetch(conn, "SELECT outbox.publish_batch(%s, %s::jsonb[], %s::text[])",
                                topic, payload_texts, subjects)]


def sid(lang, suffix):
    return f"wk-{lang}-{suffix}"


# ---------------------------------------------------------------- 1-3: the main run

@pytest.mark.parametrize("lang", LANGS)
def test_two_workers_deliver_everything_in_order(lang, db, spawn):
    """2,000 events over 20 subjects; 5% fail once, 3 fail permanently, one runs
    longer than the lease; two workers drain it."""
    t_start = time.monotonic()
    topic = "wk.e2e"
    db.execute("SELECT outbox.create_topic(%s, dead_letter_policy => 'skip')", (topic,))
    subjects = [f"subj-{i:02d}" for i in range(20)]
    keys = [(s, k) for k in range(100) for s in subjects]  # interleaved, 100 per subject
    rng = random.Random(6)
    special = rng.sample([key for key in keys if 5 <= key[1] < 60], 104)
    transient, permanent, slow = set(special[:100]), special[100:103], special[103]

    payloads = []
    for s, k in keys:
        p = {"seq": k, "subject": s}
        if (s, k) in transient:
            p.update(fail="transient", error=f"transient failure {s}/{k}")
        elif (s, k) in permanent:
            # Quote, backslash and non-ASCII: the error text must survive every
            # worker's quoting unchanged.
            p.update(fail="permanent", error=f"can't deliver {s}/{k}: \"bad\" \\ input ✗")
        elif (s, k) == slow:
            p.update(sleep_ms=SLOW_MS)
        payloads.append(json.dumps(p, ensure_ascii=False))
    ids = publish_batch(db, topic, payloads, [s for s, _ in keys])
    by_id = dict(zip(ids, keys))
    id_of = {key: i for i, key in by_id.items()}

    common = {"OUTBOX_TOPICS": "wk.*", "OUTBOX_POLL_INTERVAL": 0.5}
    a = spawn(lang, sid(lang, "a"), OUTBOX_CONCURRENCY=4, **common)
    b = spawn(lang, sid(lang, "b"), OUTBOX_CONCURRENCY=1, **common)
    workers = (a, b)

    def drained():
        return unfinished(db, topic) == 0
    wait_until(drained, 90, "the outbox to drain", workers)
    drain_s = time.monotonic() - t_start
    codes = [w.terminate() for w in workers]

    ctx = "\n".join(w.tail() for w in workers)
    assert codes == [0, 0], f"exit codes after SIGTERM: {codes}\n{ctx}"

    rows = read_deliveries(a, b)
    state = {r[0]: r[1:] for r in fetch(
        db, "SELECT id, state, attempts, last_error, errors FROM outbox.events WHERE topic = %s", topic)}
    perm_ids = {id_of[k] for k in permanent}

    # Every event delivered at least once (all but the 3 permanent failures).
    delivered = {i for i, (st, *_rest) in state.items() if st == "delivered"}
    assert delivered == set(ids) - perm_ids, f"not delivered: {sorted(set(ids) - perm_ids - delivered)[:20]}\n{ctx}"
    logged = [r["id"] for r in rows]
    assert set(logged) == delivered, f"delivery log and outbox.events disagree\n{ctx}"

    # Acknowledgements equal deliveries: each successful handler run was acked,
    # once, and nothing was delivered twice.
    assert all(r["acked"] is True for r in rows), [r for r in rows if r["acked"] is not True][:5]
    assert len(logged) == len(set(logged)) == len(delivered), \
        f"{len(logged)} logged deliveries, {len(set(logged))} distinct, {len(delivered)} delivered"

    # Per-subject order: by handler start time, each subject's sequence numbers rise.
    per_subject = {}
    for r in sorted(rows, key=lambda r: r["started"]):
        s, k = by_id[r["id"]]
        assert r["subject"] == s
        per_subject.setdefault(s, []).append(k)
    for s in subjects:
        expected = [k for k in range(100) if (s, k) not in permanent]
        assert per_subject.get(s) == expected, f"subject {s} delivered out of order: {per_subject.get(s)}"

    # Permanent failures: dead at the first attempt, with the handler's error text.
    for key in permanent:
        st, attempts, last_error, errors = state[id_of[key]]
        want = json.loads(payloads[keys.index(key)])["error"]
        assert (st, attempts, last_error) == ("dead", 1, want), (key, st, attempts, last_error)
        assert errors[-1]["error"] == want

    # Transient failures: one failed attempt recorded, then delivered.
    for key in transient:
        st, attempts, last_error, errors = state[id_of[key]]
        assert st == "delivered" and attempts == 2, (key, st, attempts)
        assert [e["error"] for e in errors] == [f"transient failure {key[0]}/{key[1]}"]

    # The slow event outlived its lease several times and was delivered once.
    slow_id = id_of[slow]
    st, attempts, _, errors = state[slow_id]
    slow_runs = [r for r in rows if r["id"] == slow_id]
    assert (st, attempts, errors) == ("delivered", 1, None), (st, attempts, errors)
    assert len(slow_runs) == 1 and slow_runs[0]["finished"] - slow_runs[0]["started"] >= SLOW_MS / 1000 - 0.05

    # Both instances did work, and the others are clean.
    assert {r["worker"] for r in rows} == {a.name, b.name}
    trans_ids = {id_of[k] for k in transient}
    clean = [i for i in ids if i not in perm_ids | trans_ids]
    assert all(state[i][1] == 1 and state[i][3] is None for i in clean), "unexpected retries"
    for w in workers:
        assert "batch=" in w.log.read_text(), f"{w.name} logged no batch line\n{w.tail()}"
    print(f"{lang}: drained 2000 events in {drain_s:.1f}s, "
          f"{sum(r['worker'] == a.name for r in rows)}/{sum(r['worker'] == b.name for r in rows)} per worker")


# ---------------------------------------------------------------- 4: SIGKILL mid-batch

@pytest.mark.parametrize("lang", LANGS)
def test_killed_worker_events_redelivered_after_lease(lang, db, spawn):
    topic = "wk.kill"
    n = 40
    payloads = [json.dumps({"seq": i, "sleep_ms": 300}) for i in range(n)]
    ids = publish_batch(db, topic, payloads)
    settings = dict(OUTBOX_BATCH_SIZE=6, OUTBOX_CONCURRENCY=2, OUTBOX_POLL_INTERVAL=0.5)
    a = spawn(lang, sid(lang, "a"), **settings)
    b = spawn(lang, sid(lang, "b"), **settings)

    # Mid-batch: a has finished at least one event and still holds leases.
    def a_mid_batch():
        return a.deliveries.exists() and a.deliveries.stat().st_size > 0 and fetch(
            db, "SELECT count(*) FROM outbox.events WHERE state = 'leased' AND leased_by = %s", a.name)[0][0] >= 2
    wait_until(a_mid_batch, 20, f"{a.name} to be mid-batch", (a, b))
    a.kill()
    held = dict(fetch(db, "SELECT id, extract(epoch FROM lease_expires_at)::float8 FROM outbox.events "
                          "WHERE state = 'leased' AND leased_by = %s", a.name))
    assert held, "the killed worker held no leases"
    a2 = spawn(lang, sid(lang, "a") + "-restarted", **settings)

    # While a2 runs, SIGTERM b mid-batch: it must finish or give back its events.
    def b_busy():
        return fetch(db, "SELECT count(*) FROM outbox.events WHERE state = 'leased' AND leased_by = %s",
                     b.name)[0][0] > 0
    wait_until(b_busy, 20, f"{b.name} to hold leases", (b, a2))
    t_term = time.monotonic()
    code = b.terminate(timeout=15)
    term_s = time.monotonic() - t_term
    assert code == 0, f"{b.name} exit code {code} after SIGTERM\n{b.tail()}"
    left = fetch(db, "SELECT count(*) FROM outbox.events WHERE state = 'leased' AND leased_by = %s", b.name)[0][0]
    assert left == 0, f"{b.name} exited with {left} events still leased\n{b.tail()}"

    def drained():
        return unfinished(db, topic, dead=True) == 0
    wait_until(drained, 40, "all events delivered", (a2,))
    assert a2.terminate() == 0

    rows = read_deliveries(a, b, a2)
    # A worker logs a delivery after its ack commits, so SIGKILL can land between
    # the two: such an event is delivered, by the killed worker, but not logged.
    unlogged = set(ids) - set(r["id"] for r in rows)
    if unlogged:
        found = fetch(db, "SELECT id, state, leased_by FROM outbox.events WHERE id = ANY(%s)", sorted(unlogged))
        wrong = [r for r in found if (r[1], r[2]) != ("delivered", a.name)]
        assert len(found) == len(unlogged) and not wrong, \
            f"events never delivered: {sorted(unlogged)}; in the outbox: {found}"
    for eid, expiry in held.items():
        redo = [r for r in rows if r["id"] == eid and r["worker"] != a.name]
        if not redo and eid in unlogged:
            # SIGKILL ends the worker, not its server session: an ack already
            # sent can still commit after `held` was read. Then the event was
            # delivered once, by the killed worker (checked just above).
            continue
        assert redo, f"event {eid} leased by the killed worker was not redelivered"
        # Not before the lease the killed worker held ran out (50 ms clock slack).
        assert min(r["started"] for r in redo) >= expiry - 0.05, (eid, expiry, redo)
        assert max(r["attempt"] for r in redo) >= 2, redo
    print(f"{lang}: {len(held)} leases of the killed worker redelivered; SIGTERM exit took {term_s:.1f}s")


# ---------------------------------------------------------------- 5: connection drops

def terminate_backends(db, name):
    return fetch(db, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                     "WHERE application_name = %s AND pid <> pg_backend_pid()", name)


@pytest.mark.parametrize("lang", LANGS)
def test_worker_reconnects_after_backend_terminated(lang, db, spawn):
    topic = "wk.drop"
    # A long poll: after the idle drop only a NOTIFY on a re-LISTENed connection
    # can wake the worker in time.
    w = spawn(lang, sid(lang, "w"), OUTBOX_POLL_INTERVAL=60, OUTBOX_CONCURRENCY=2)
    wait_until(lambda: len(fetch(db, "SELECT 1 FROM pg_stat_activity WHERE application_name = %s", w.name)) >= 1,
               15, "the worker to connect", (w,))
    ids = publish_batch(db, topic, [json.dumps({"seq": i, "sleep_ms": 10}) for i in range(200)],
                        [f"s{i % 10}" for i in range(200)])

    # Drop 1: under load.
    wait_until(lambda: len(read_deliveries(w)) >= 30, 20, "30 deliveries", (w,))
    killed = terminate_backends(db, w.name)
    assert killed, "no backend to terminate"

    def delivered(some):
        return fetch(db, "SELECT count(*) FROM outbox.events WHERE id = ANY(%s) AND state = 'delivered'",
                     some)[0][0] == len(some)
    wait_until(lambda: delivered(ids), 30, "delivery to continue after the drop", (w,))

    # Drop 2: while idle, waiting on LISTEN.
    time.sleep(0.5)
    old = {r[0] for r in fetch(db, "SELECT pid FROM pg_stat_activity WHERE application_name = %s", w.name)}
    terminate_backends(db, w.name)
    wait_until(lambda: {r[0] for r in fetch(db, "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                                            w.name)} - old, 15, "a new connection", (w,))
    time.sleep(1.0)  # let it reconnect fully, claim (nothing) and go back to waiting
    t0 = time.monotonic()
    more = publish_batch(db, topic, [json.dumps({"seq": i}) for i in range(5)])
    wait_until(lambda: delivered(more), 10, "events published after the idle drop (NOTIFY after re-LISTEN)", (w,))
    wake_s = time.monotonic() - t0
    assert w.terminate() == 0
    assert set(r["id"] for r in read_deliveries(w)) >= set(ids) | set(more)
    print(f"{lang}: reconnected twice; woke {wake_s:.2f}s after publish with a 60s poll interval")


# ---------------------------------------------------------------- webhook and stdout handlers

WEBHOOK_PAYLOADS = [
    '{"order": 1, "amount": 0.10000000000000000555, "note": "précis"}',
    '{"big": 123456789012345678901234567890, "neg": -1.5e-7, "exp": 1e300}',
    '{"text": "quotes \\" backslash \\\\ tab \\t newline \\n unicode ✓ 😀 \\u0001"}',
    '{"nested": {"list": [1, [2, [3, {"deep": null}]], true, false], "empty": {}, "arr": []}}',
    '[1, "two", {"three": 3}]',
    '"just a string"',
    '42',
    'null',
    '{"sql": "\'; DROP TABLE x; --", "dollar": "$$ $x$", "pct": "%s %(a)s"}',
]


class _Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        srv = self.server
        eid = int(self.headers.get("X-Outbox-Event-Id", "0"))
        with srv.lock:
            srv.requests.append((eid, {k.lower(): v for k, v in self.headers.items()}, body))
            seen = sum(1 for r in srv.requests if r[0] == eid)
        code = 200
        if eid in srv.reject:
            code = 400
        elif eid in srv.flaky and seen == 1:
            code = 503
        self.send_response(code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"no" if code >= 400 else b"ok")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("lang", LANGS)
def test_webhook_handler(lang, db, spawn):
    if lang == "shell" and not _which("curl"):
        msg = "SKIP: the shell worker's webhook handler needs curl, which is not installed"
        print(f"\n!!!!! {msg} !!!!!", file=sys.stderr)
        pytest.skip(msg)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    server.lock, server.requests = threading.Lock(), []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        topic = "wk.hook"
        texts = [WEBHOOK_PAYLOADS[i % len(WEBHOOK_PAYLOADS)] for i in range(120)]
        # 'skip': the rejected event must not hold back the rest of its subject.
        db.execute("SELECT outbox.create_topic('wk.hook', dead_letter_policy => 'skip')")
        ids = publish_batch(db, topic, texts, [f"s{i % 7}" if i % 2 else None for i in range(120)])
        other = publish_batch(db, "wk.other", ['{"not": "for this worker"}'] * 3)
        server.flaky = set(ids[5:120:10])   # 503 on the first try
        server.reject = {ids[7]}            # 400: permanent
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        w = spawn(lang, sid(lang, "hook"), OUTBOX_HANDLER="webhook", OUTBOX_WEBHOOK_URL=url,
                  OUTBOX_TOPICS="wk.hook", OUTBOX_BATCH_SIZE=10, OUTBOX_CONCURRENCY=4)
        wait_until(lambda: unfinished(db, "wk.hook") == 0, 40, "webhook deliveries", (w,))
        assert w.terminate() == 0
    finally:
        server.shutdown()
        server.server_close()

    stored = dict(fetch(db, "SELECT id, payload::text FROM outbox.events WHERE topic = 'wk.hook'"))
    published = dict(zip(ids, texts))
    reqs = server.requests
    expected = len(ids) + len(server.flaky)
    assert len(reqs) == expected, f"{len(reqs)} requests, expected {expected}\n{w.tail()}"
    for eid, headers, body in reqs:
        assert body.decode() == stored[eid], f"event {eid}: body {body!r} != stored {stored[eid]!r}"
        assert json.loads(body, parse_float=Decimal) == json.loads(published[eid], parse_float=Decimal)
        assert headers.get("content-type", "").startswith("application/json")
        assert headers.get("idempotency-key") == f"outbox-{eid}"
    assert {r[0] for r in reqs} == set(ids)
    states = dict(fetch(db, "SELECT id, state FROM outbox.events WHERE topic = 'wk.hook'"))
    assert all(states[i] == "delivered" for i in ids if i not in server.reject)
    dead = fetch(db, "SELECT state, last_error FROM outbox.events WHERE id = %s", ids[7])[0]
    assert dead[0] == "dead" and "400" in dead[1], dead
    # The topic filter kept this worker away from other topics.
    assert fetch(db, "SELECT count(*) FROM outbox.events WHERE id = ANY(%s) AND state = 'pending' "
                     "AND attempts = 0", other)[0][0] == 3


@pytest.mark.parametrize("lang", LANGS)
def test_stdout_handler(lang, db, spawn):
    texts = ['{"hello": "wörld"}', '[1, 2.50, {"x": null}]', '"s"']
    ids = publish_batch(db, "wk.print", texts, ["a", "a", None])
    w = spawn(lang, sid(lang, "print"), OUTBOX_HANDLER="stdout")
    wait_until(lambda: unfinished(db, "wk.print", dead=True) == 0, 20, "stdout deliveries", (w,))
    assert w.terminate() == 0
    lines = [json.loads(x) for x in w.out.read_text().splitlines() if x.strip()]
    assert sorted(x["id"] for x in lines) == ids, lines
    for x in lines:
        text = texts[ids.index(x["id"])]
        assert x["topic"] == "wk.print" and x["attempt"] == 1
        assert x["payload"] == json.loads(text)


# ---------------------------------------------------------------- a named subscription

@pytest.mark.parametrize("lang", LANGS)
def test_worker_claims_from_the_subscription_it_is_given(lang, db, spawn):
    """OUTBOX_SUBSCRIPTION names the subscription the worker claims from, here
    one whose topics are wk.sub.*: its events are acked there
    (outbox.deliveries), 'default' still owes every one of them, and events of
    other topics are not the subscription's. With a 60 s poll interval, events
    published while the worker idles can only arrive through the NOTIFY of
    their topic: a worker of a filtered subscription wakes on its topics."""
    sub = "wk-sub"
    db.execute("SELECT outbox.create_subscription(%s, topics => ARRAY['wk.sub.*'])", (sub,))
    ids = publish_batch(db, "wk.sub.a", [json.dumps({"seq": i}) for i in range(30)],
                        [f"s{i % 5}" for i in range(30)])
    other = publish_batch(db, "wk.other", ['{"not": "for this subscription"}'] * 3)
    w = spawn(lang, sid(lang, "sub"), OUTBOX_SUBSCRIPTION=sub, OUTBOX_POLL_INTERVAL=60)

    def states(subscription, some):
        return dict(fetch(db, "SELECT event_id, state FROM outbox.deliveries "
                              "WHERE subscription = %s AND event_id = ANY(%s)", subscription, some))

    def delivered(some):
        got = states(sub, some)
        return len(got) == len(some) and set(got.values()) == {"delivered"}

    wait_until(lambda: delivered(ids), 30, f"deliveries in subscription {sub}", (w,))
    time.sleep(1.0)  # let it claim (nothing) and go back to waiting
    more = publish_batch(db, "wk.sub.b", [json.dumps({"seq": i}) for i in range(5)])
    wait_until(lambda: delivered(more), 10, "events published while it waited (NOTIFY of wk.sub.b)", (w,))
    assert w.terminate() == 0

    rows = read_deliveries(w)
    assert sorted(r["id"] for r in rows) == sorted(ids + more), f"delivery log\n{w.tail()}"
    assert all(r["acked"] is True for r in rows), [r for r in rows if r["acked"] is not True][:5]
    # 'default' receives every event and has delivered none of them.
    dflt = states("default", ids + more + other)
    assert set(dflt) == set(ids + more + other) and set(dflt.values()) == {"pending"}, dflt
    # Outside the subscription's topics: not its events at all.
    assert states(sub, other) == {}


@pytest.mark.parametrize("lang", LANGS)
def test_worker_claims_where_the_default_isolation_is_serializable(lang, db, spawn, dsn):
    """outbox.claim refuses SERIALIZABLE (0A000): a worker whose sessions start at
    SERIALIZABLE (here through the connection's options, as a database's or a
    role's default_transaction_isolation would) sets READ COMMITTED itself and
    delivers everything."""
    serializable = psycopg.conninfo.make_conninfo(dsn, options="-c default_transaction_isolation=serializable")
    with psycopg.connect(serializable, autocommit=True) as c:
        assert sqlstate_of(c, "SELECT * FROM outbox.claim('probe', 1)") == "0A000"
    ids = publish_batch(db, "wk.ser", [json.dumps({"seq": i}) for i in range(20)], [f"s{i % 4}" for i in range(20)])
    w = spawn(lang, sid(lang, "ser"), OUTBOX_DSN=serializable, OUTBOX_TOPICS="wk.ser")
    wait_until(lambda: unfinished(db, "wk.ser", dead=True) == 0, 30, "deliveries at a SERIALIZABLE default", (w,))
    assert w.terminate() == 0
    rows = read_deliveries(w)
    assert sorted(r["id"] for r in rows) == ids, f"delivery log\n{w.tail()}"
    assert "0A000" not in w.tail(200), w.tail()


def sqlstate_of(conn, sql):
    try:
        conn.execute(sql)
    except psycopg.Error as e:
        return e.sqlstate
    return None


# ---------------------------------------------------------------- the inbox: exactly-once effects

# The consumer's database: a database of its own, not the outbox's (the inbox
# lives with the effect, so it has outbox_ext too).
INBOX_DB = "outbox_t_workers_inbox"
EFFECTS_DDL = """CREATE TABLE outbox_effects (message_id text NOT NULL, event_id bigint, topic text,
    subject text, attempt int, payload jsonb, applied_at timestamptz NOT NULL DEFAULT now())"""


@pytest.fixture(scope="module")
def _inbox_db_once():
    from scratch_db import create_db, drop_db
    admin = os.environ.get("OUTBOX_TEST_DSN_PRELOAD")
    if not admin:
        pytest.skip("OUTBOX_TEST_DSN_PRELOAD is not set (run through scripts/test.sh)")
    url = create_db(admin, INBOX_DB)
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    yield url
    drop_db(admin, INBOX_DB)


@pytest.fixture
def inbox_db(_inbox_db_once):
    with psycopg.connect(_inbox_db_once, autocommit=True) as c:
        c.execute("TRUNCATE outbox_effects, outbox.inbox")
    return _inbox_db_once


@pytest.mark.parametrize("lang", ["python", "node", "rust"])
def test_inbox_handler_applies_effects_exactly_once(lang, db, spawn, inbox_db):
    """OUTBOX_HANDLER=inbox writes one row per message into another database
    through the language's process_once. Redeliveries after a committed effect,
    effects that roll back, and the same message id in 3 events at once (the
    copies run concurrently): every message's effect exactly once. One worker's
    consumer connection is at SERIALIZABLE, where a concurrent duplicate gets
    40001: the wrapper retries it, so no event needs a second attempt for it."""
    topic = "wk.inbox"
    consumer = "wk-inbox"
    oid = str(fetch(db, "SELECT outbox.outbox_id()")[0][0])
    kinds, payloads, subjects = [], [], []
    for i in range(120):
        kind = {3: "after", 6: "rollback"}.get(i % 10, "plain")
        p = {"seq": i}
        if kind == "after":    # fails after its effect committed: redelivered, a duplicate
            p.update(fail="transient", error="failed after the commit")
        elif kind == "rollback":  # fails inside the transaction: nothing kept
            p.update(effect_fail=True)
        kinds.append(kind)
        payloads.append(json.dumps(p))
        subjects.append(f"s{i % 8}")
    for k in range(12):  # 12 messages published 3 times each, adjacent, no subject
        for j in range(3):
            kinds.append(f"dup-{k}")
            payloads.append(json.dumps({"message_id": f"dup-{k}", "copy": j, "effect_sleep_ms": 300}))
            subjects.append(None)
    ids = publish_batch(db, topic, payloads, subjects)
    kind_of = dict(zip(ids, kinds))

    serializable = psycopg.conninfo.make_conninfo(
        inbox_db, options="-c default_transaction_isolation=serializable")
    common = dict(OUTBOX_HANDLER="inbox", OUTBOX_INBOX_CONSUMER=consumer, OUTBOX_TOPICS=topic,
                  OUTBOX_BATCH_SIZE=6, OUTBOX_CONCURRENCY=3, OUTBOX_POLL_INTERVAL=0.5)
    a = spawn(lang, sid(lang, "inbox-a"), OUTBOX_INBOX_DSN=inbox_db, **common)
    b = spawn(lang, sid(lang, "inbox-b"), OUTBOX_INBOX_DSN=serializable, **common)
    wait_until(lambda: unfinished(db, topic, dead=True) == 0, 40, "the inbox events to drain", (a, b))
    assert [a.terminate(), b.terminate()] == [0, 0]
    ctx = a.tail() + "\n" + b.tail()

    with psycopg.connect(inbox_db, autocommit=True) as c:
        effects = fetch(c, "SELECT message_id, event_id, attempt FROM outbox_effects")
        receipts = [r[0] for r in fetch(c, "SELECT message_id FROM outbox.inbox WHERE consumer = %s", consumer)]
        assert str(fetch(c, "SELECT outbox.outbox_id()")[0][0]) != oid
    expected = {f"{oid}:{i}" for i in ids if not kind_of[i].startswith("dup-")} | {f"dup-{k}" for k in range(12)}
    counts = {}
    for mid, _, _ in effects:
        counts[mid] = counts.get(mid, 0) + 1
    doubled = {m: n for m, n in counts.items() if n > 1}
    assert not doubled, f"effects applied more than once: {sorted(doubled.items())[:10]}\n{ctx}"
    assert set(counts) == expected, f"missing: {sorted(expected - set(counts))[:10]}, " \
                                    f"unexpected: {sorted(set(counts) - expected)[:10]}\n{ctx}"
    assert sorted(receipts) == sorted(expected)

    state = {r[0]: r[1:] for r in fetch(
        db, "SELECT id, state, attempts, errors FROM outbox.events WHERE topic = %s", topic)}
    for mid, eid, attempt in effects:
        kind = kind_of[eid]
        if kind.startswith("dup-"):
            assert mid == kind
            continue
        assert mid == f"{oid}:{eid}"
        st, attempts, errors = state[eid]
        # "after": the effect of attempt 1 stayed, the redelivery did nothing.
        # "rollback": attempt 1 left nothing, attempt 2 applied it.
        want = {"plain": (1, 1), "after": (1, 2), "rollback": (2, 2)}[kind]
        assert (attempt, attempts) == want, (kind, eid, attempt, attempts, errors)
        if kind == "rollback":
            assert [e["error"] for e in errors] == ["effect failed, rolled back"], errors
    # Every event delivered; the concurrent duplicates needed no second attempt
    # (a 40001 is retried inside the wrapper).
    for i in ids:
        st, attempts, errors = state[i]
        assert st == "delivered", (i, kind_of[i], st, errors)
        if kind_of[i] == "plain" or kind_of[i].startswith("dup-"):
            assert (attempts, errors) == (1, None), (i, kind_of[i], attempts, errors, ctx)


def _import_python_worker():
    import importlib.util
    spec = importlib.util.spec_from_file_location("outbox_worker", WORKERS_DIR / "python" / "outbox_worker.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _effects(url, consumer):
    with psycopg.connect(url, autocommit=True) as c:
        return (sorted(r[0] for r in fetch(c, "SELECT message_id FROM outbox_effects")),
                sorted(r[0] for r in fetch(c, "SELECT message_id FROM outbox.inbox WHERE consumer = %s", consumer)))


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_python_process_once(inbox_db, isolation):
    ow = _import_python_worker()
    assert ow.message_id("f8bc", 42) == "f8bc:42"
    level = psycopg.IsolationLevel.REPEATABLE_READ if isolation == "repeatable read" else None

    def insert(mid):
        return lambda cur: cur.execute("INSERT INTO outbox_effects (message_id) VALUES (%s)", (mid,))

    with psycopg.connect(inbox_db, autocommit=True) as c, psycopg.connect(inbox_db) as c2:
        c2.isolation_level = level
        # First time applied, then a duplicate (also on another connection).
        assert ow.process_once(c, "unit", "m1", insert("m1")) is True
        assert ow.process_once(c2, "unit", "m1", insert("m1")) is False
        assert ow.process_once(c, "other", "m1", lambda cur: None) is True  # ids are per consumer
        # An exception in fn rolls back the receipt too: received again later.
        with pytest.raises(ZeroDivisionError):
            ow.process_once(c2, "unit", "m2", lambda cur: (insert("m2")(cur), 1 / 0))
        assert ow.process_once(c2, "unit", "m2", insert("m2")) is True

        # An SQL error swallowed by fn: not reported as applied.
        def swallow(cur):
            insert("m3")(cur)
            try:
                cur.execute("SELECT 1 / 0")
            except psycopg.errors.DivisionByZero:
                pass
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            ow.process_once(c, "unit", "m3", swallow)
        # Inside a transaction already: refused (it commits).
        c2.execute("SELECT 1")
        with pytest.raises(psycopg.ProgrammingError):
            ow.process_once(c2, "unit", "m4", insert("m4"))
        c2.rollback()
        assert c.info.transaction_status == c2.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _effects(inbox_db, "unit") == (["m1", "m2"], ["m1", "m2"])

    # A concurrent duplicate waits for the first and gets False; at REPEATABLE
    # READ it got 40001 first, which the wrapper retried.
    entered, release, got, ran = threading.Event(), threading.Event(), {}, []

    def slow(cur):
        insert("c1")(cur)
        entered.set()
        release.wait(10)

    def second():
        with psycopg.connect(inbox_db) as c2:
            c2.isolation_level = level
            got["second"] = ow.process_once(c2, "unit", "c1", lambda cur: ran.append(1))

    with psycopg.connect(inbox_db) as c1:
        t1 = threading.Thread(target=lambda: got.setdefault("first", ow.process_once(c1, "unit", "c1", slow)))
        t1.start()
        assert entered.wait(10)
        t2 = threading.Thread(target=second)
        t2.start()
        time.sleep(0.4)
        assert t2.is_alive(), "the duplicate did not wait for the first transaction"
        release.set()
        t1.join(10)
        t2.join(10)
    assert got == {"first": True, "second": False} and ran == [], (got, ran)
    assert _effects(inbox_db, "unit") == (["c1", "m1", "m2"], ["c1", "m1", "m2"])


NODE_PROCESS_ONCE = r"""
const { Client } = require('pg');
const { processOnce, messageId, parseDsn } = require('./worker.js');
const cfg = parseDsn(process.env.INBOX_DSN);
const insert = (mid) => (c) => c.query('INSERT INTO outbox_effects (message_id) VALUES ($1)', [mid]);
const out = {};
(async () => {
  const [c1, c2, c3] = [new Client(cfg), new Client(cfg), new Client(cfg)];
  for (const c of [c1, c2, c3]) await c.connect();
  await c3.query('SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL ' + process.env.ISOLATION);
  out.messageId = messageId('f8bc', '42');
  out.first = await processOnce(c1, 'unit', 'm1', insert('m1'));
  out.dup = await processOnce(c3, 'unit', 'm1', insert('m1'));
  try {
    await processOnce(c1, 'unit', 'm2', async (c) => { await insert('m2')(c); throw new Error('boom'); });
  } catch (e) { out.rollbackError = e.message; }
  out.again = await processOnce(c1, 'unit', 'm2', insert('m2'));
  try {
    await processOnce(c1, 'unit', 'm3', async (c) => { await insert('m3')(c); await c.query('SELECT 1/0').catch(() => {}); });
  } catch (e) { out.swallowedError = e.message; }
  // A concurrent duplicate: the second waits for the first, then false.
  let release;
  const held = new Promise((r) => { release = r; });
  let entered;
  const inside = new Promise((r) => { entered = r; });
  let secondRan = false;
  const p1 = processOnce(c2, 'unit', 'c1', async (c) => { await insert('c1')(c); entered(); await held; });
  await inside;
  let secondDone = false;
  const p2 = processOnce(c3, 'unit', 'c1', async () => { secondRan = true; }).finally(() => { secondDone = true; });
  await new Promise((r) => setTimeout(r, 400));
  out.secondWaited = !secondDone;
  release();
  out.concurrent = [await p1, await p2, secondRan];
  for (const c of [c1, c2, c3]) await c.end();
  process.stdout.write(JSON.stringify(out));
})().catch((e) => { process.stderr.write(String(e && e.stack || e)); process.exit(1); });
"""


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_node_process_once(inbox_db, isolation):
    worker_command("node")  # npm ci
    env = dict(os.environ, INBOX_DSN=inbox_db, ISOLATION=isolation)
    r = subprocess.run([_which("node"), "-e", NODE_PROCESS_ONCE], cwd=WORKERS_DIR / "node", env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"messageId": "f8bc:42", "first": True, "dup": False, "rollbackError": "boom", "again": True,
                   "swallowedError": "processOnce: fn left the transaction aborted; rolled back",
                   "secondWaited": True, "concurrent": [True, False, False]}, out
    assert _effects(inbox_db, "unit") == (["c1", "m1", "m2"], ["c1", "m1", "m2"])


PY_HANDLER_MODULE = """
import threading

import psycopg

from outbox_worker import PermanentError, process_once

local = threading.local()


def handle(ev):
    if "n" not in ev.payload:
        raise PermanentError("no n")
    if getattr(local, "conn", None) is None or local.conn.closed:
        local.conn = psycopg.connect(INBOX_DSN, autocommit=True)

    def effect(cur):
        cur.execute("INSERT INTO outbox_effects (message_id, event_id) VALUES (%s, %s)", (ev.message_id, ev.id))

    assert process_once(local.conn, "mod", ev.message_id, effect) is (ev.attempt == 1)
    # The same message again, as a redelivery would: nothing to do.
    assert process_once(local.conn, "mod", ev.message_id, effect) is False
    if ev.attempt == 1:
        raise RuntimeError("fail after the effect, to be redelivered")
"""

NODE_HANDLER_MODULE = """
const { Pool } = require(PG);
const { processOnce, PermanentError, parseDsn } = require(WORKER);

const pool = new Pool(parseDsn(INBOX_DSN));
pool.on('error', () => {});

module.exports = async (ev) => {
  if (ev.payload.n === undefined) throw new PermanentError('no n');
  const client = await pool.connect();
  try {
    const effect = (c) => c.query('INSERT INTO outbox_effects (message_id, event_id) VALUES ($1, $2)',
      [ev.messageId, ev.id]);
    if ((await processOnce(client, 'mod', ev.messageId, effect)) !== (ev.attempt === 1)) throw new Error('first');
    // The same message again, as a redelivery would: nothing to do.
    if ((await processOnce(client, 'mod', ev.messageId, effect)) !== false) throw new Error('again');
  } finally {
    client.release();
  }
  if (ev.attempt === 1) throw new Error('fail after the effect, to be redelivered');
};
"""


@pytest.mark.parametrize("lang", ["python", "node"])
def test_handler_module_uses_process_once(lang, db, spawn, inbox_db, tmp_path):
    """A handler module of one's own imports process_once and PermanentError from
    the worker, as examples/workers/README.md shows."""
    if lang == "python":
        (tmp_path / "wk_inbox_handler.py").write_text(f"INBOX_DSN = {inbox_db!r}\n" + PY_HANDLER_MODULE)
        settings = dict(OUTBOX_HANDLER="wk_inbox_handler:handle", PYTHONPATH=str(tmp_path))
    else:
        consts = {"PG": str(WORKERS_DIR / "node" / "node_modules" / "pg"),
                  "WORKER": str(WORKERS_DIR / "node" / "worker.js"), "INBOX_DSN": inbox_db}
        head = "".join(f"const {k} = {json.dumps(v)};\n" for k, v in consts.items())
        (tmp_path / "wk-inbox-handler.js").write_text(head + NODE_HANDLER_MODULE)
        settings = dict(OUTBOX_HANDLER=str(tmp_path / "wk-inbox-handler.js"))
    oid = str(fetch(db, "SELECT outbox.outbox_id()")[0][0])
    ids = publish_batch(db, "wk.mod", [json.dumps({"n": i}) for i in range(20)] + ['{"bad": 1}'])
    w = spawn(lang, sid(lang, "mod"), OUTBOX_POLL_INTERVAL=0.5, **settings)
    wait_until(lambda: unfinished(db, "wk.mod") == 0, 20, "the handler module's events", (w,))
    assert w.terminate() == 0
    with psycopg.connect(inbox_db, autocommit=True) as c:
        effects = sorted(fetch(c, "SELECT event_id, message_id FROM outbox_effects"))
    assert effects == [(i, f"{oid}:{i}") for i in ids[:20]], f"{effects}\n{w.tail()}"
    state = dict((r[0], r[1:]) for r in fetch(db, "SELECT id, state, attempts, last_error FROM outbox.events "
                                                  "WHERE topic = 'wk.mod'"))
    assert all(state[i] == ("delivered", 2, "fail after the effect, to be redelivered") for i in ids[:20]), \
        f"{state}\n{w.tail()}"
    # PermanentError imported from the worker is the worker's own class.
    assert state[ids[20]] == ("dead", 1, "no n"), f"{state[ids[20]]}\n{w.tail()}"
