"""Helpers for the dashboard tests (pg_test/dashboard): the cluster, fixture data, `outbox serve`
processes, plain HTTP requests, and a headless Chromium driven by Selenium.

The suite's cluster is `dashtest` on 127.0.0.1:5476 with the library preloaded
(scripts/pgcluster.sh). The database helpers and the every-state fixture come from
pg_test/cli/clilib.py, pointed at this cluster. Every server process started here is stopped by
its pid, and the browser only ever talks to loopback: Selenium is given Debian's chromedriver
explicitly, so its driver manager never goes to the network.
"""

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cli"))

import clilib  # noqa: E402

# clilib's helpers read these module globals at call time: point them at this suite's cluster.
clilib.PG_CLUSTER = os.environ.get("OUTBOX_DASH_CLUSTER", "dashtest")
clilib.PG_PORT = int(os.environ.get("OUTBOX_DASH_PG_PORT", "5476"))

REPO = clilib.REPO
RESULTS = REPO / "target" / "test-results" / "dashboard"
RESULTS.mkdir(parents=True, exist_ok=True)
TOKEN = "dash-test-token-0123456789"
CHROMIUM = os.environ.get("OUTBOX_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("OUTBOX_CHROMEDRIVER", "/usr/bin/chromedriver")

connect = clilib.connect
dsn = clilib.dsn
sql = clilib.sql
sql1 = clilib.sql1
fresh_db = clilib.fresh_db


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_function(db, name):
    return sql1(
        db,
        "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = 'outbox' AND p.proname = %s",
        (name,),
    ) > 0


def populate(db):
    """clilib's events in every state (default and the `ledger` subscription), plus blocked
    subjects: one behind a retrying event, one behind a dead letter (policy `block`), and one
    event whose payload and headers try to inject markup. Returns the ids by role."""
    ids = clilib.populate(db)
    with connect(db) as c:
        def publish(topic, subject, payload, headers=None):
            return c.execute(
                "SELECT outbox.publish(%s, %s::jsonb, subject => %s, headers => %s::jsonb)",
                (topic, json.dumps(payload), subject, json.dumps(headers or {})),
            ).fetchone()[0]

        def claim(topic):
            return c.execute(
                "SELECT id, lease_token FROM outbox.claim('dash-test', 1, '1 hour'::interval, ARRAY[%s])", (topic,)
            ).fetchone()

        # Retrying head: the first event of subject acct-7 failed and waits an hour; the next waits behind it.
        ids["retry_head"] = publish("dash.retry", "acct-7", {"n": 1})
        ids["retry_waiting"] = publish("dash.retry", "acct-7", {"n": 2})
        i, tok = claim("dash.retry")
        assert i == ids["retry_head"]
        assert c.execute("SELECT outbox.fail(%s, %s, 'HTTP 503 upstream busy', retry_in => '1 hour')", (i, tok)).fetchone()[0] == "pending"
        # Dead head under the default `block` policy.
        ids["dead_head"] = publish("dash.block", "order-42", {"n": 1})
        ids["dead_waiting"] = publish("dash.block", "order-42", {"n": 2})
        i, tok = claim("dash.block")
        assert c.execute("SELECT outbox.fail(%s, %s, 'schema mismatch', permanent => true)", (i, tok)).fetchone()[0] == "dead"
        ids["dead"].append(ids["dead_head"])
        # User data that must be shown as text, never run.
        ids["evil"] = publish(
            "dash.evil",
            "<b>subj</b>",
            {"html": "<script>window.__pwned = 1</script>", "img": "<img src=x onerror=window.__pwned=2>"},
            {"x-note": "<i>hi</i>\" onmouseover=\"window.__pwned=3"},
        )
    return ids


def make_load(db, events=50_000, dead=5_000):
    """`events` events over 10 topics, of which `dead` are dead letters (each with a two-entry
    error history) and 10,000 delivered; the rest pending. Returns the seconds it took."""
    t0 = time.monotonic()
    topics = [f"load.t{i}" for i in range(10)]
    per_topic = events // len(topics)
    with connect(db) as c:
        for t in topics:
            c.execute("SELECT outbox.create_topic(%s, max_attempts => 5, dead_letter_policy => 'skip')", (t,))
        for t in topics:
            c.execute(
                "SELECT count(*) FROM outbox.publish_batch(%s, "
                "(SELECT array_agg(jsonb_build_object('n', g, 'topic', %s::text)) FROM generate_series(1, %s) g))",
                (t, t, per_topic),
            )
        left = dead
        while left > 0:
            n = min(1000, left)
            got = c.execute(
                "SELECT id, lease_token FROM outbox.claim('load', %s, '1 hour'::interval, ARRAY['load.t0','load.t1','load.t2'])",
                (n,),
            ).fetchall()
            with c.transaction():
                cur = c.cursor()
                cur.executemany(
                    "SELECT outbox.fail(%s, %s, 'load: HTTP 500 from sink', permanent => true)", got
                )
            left -= len(got)
            if not got:
                break
        for _ in range(10):
            got = c.execute(
                "SELECT array_agg(id), array_agg(lease_token) FROM outbox.claim('load', 1000, '1 hour'::interval, ARRAY['load.t5','load.t6'])"
            ).fetchone()
            if got[0]:
                c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])", got)
    return time.monotonic() - t0


class Server:
    """One `outbox serve` process on a free loopback port, stopped by pid."""

    def __init__(self, db, allow_actions=False, env=None, user="postgres", extra=()):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = RESULTS / f"serve-{self.port}.log"
        argv = [clilib.outbox_bin(), "serve", "--listen", f"127.0.0.1:{self.port}", *extra]
        if allow_actions:
            argv.append("--allow-actions")
        e = clilib.clean_env(env)
        e["OUTBOX_DSN"] = dsn(db, user)
        self.argv = argv
        log = open(self.log_path, "wb")
        self.p = subprocess.Popen(argv, env=e, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.auth = None
        if env and env.get("OUTBOX_DASHBOARD_USER"):
            self.auth = (env["OUTBOX_DASHBOARD_USER"], env["OUTBOX_DASHBOARD_PASSWORD"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise AssertionError(f"outbox serve exited with {self.p.returncode}: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise AssertionError(f"outbox serve did not listen within 30 s: {self.log()}")

    def log(self):
        return self.log_path.read_text(errors="replace")

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=15)
        assert "panicked" not in self.log(), self.log()

    def request(self, path, method="GET", data=None, headers=None, auth=True):
        """(status, headers (case-insensitive), body text) of one request; never raises on HTTP errors."""
        h = dict(headers or {})
        if auth and self.auth:
            h["Authorization"] = "Basic " + base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
        body = None
        if data is not None:
            body = urllib.parse.urlencode(data).encode()
            h.setdefault("Content-Type", "application/x-www-form-urlencoded")
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=h)
        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(req, timeout=60) as r:
                return r.status, r.headers, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read().decode(errors="replace")

    def json(self, path):
        status, _, body = self.request(path)
        return status, json.loads(body)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """Lets a test see a 303 instead of following it."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def browser():
    """A headless Chromium through Debian's chromedriver (never Selenium's driver manager)."""
    # Belt and braces: even if Selenium Manager were consulted, it must not download anything.
    os.environ.setdefault("SE_OFFLINE", "true")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1500,1000",
              "--disable-gpu", "--no-first-run", "--disable-extensions", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--metrics-recording-only",
              "--no-default-browser-check", "--disable-default-apps"):
        opts.add_argument(a)
    service = Service(executable_path=CHROMEDRIVER, log_output=str(RESULTS / "chromedriver.log"))
    d = webdriver.Chrome(service=service, options=opts)
    d.set_page_load_timeout(120)
    return d


def nav_ms(driver):
    """The last navigation's (request to response end, to load event end) in ms, from the
    Navigation Timing API."""
    t = driver.execute_script(
        "const n = performance.getEntriesByType('navigation')[0];"
        "return n ? [n.responseEnd - n.requestStart, n.loadEventEnd - n.startTime] : null;"
    )
    return (round(t[0], 1), round(t[1], 1)) if t else (None, None)


def digits(text):
    """An integer shown with thin-space separators ('50 000' -> 50000); None for empty."""
    d = "".join(ch for ch in text if ch.isdigit() or ch == "-")
    return int(d) if d else None


def follow(driver, element, timeout=60):
    """Clicks a link or submit button and waits until the browser has left the page.

    A click returns once the event is dispatched, not once the next page is in; reading the page
    (or the database) right after it races the request.

    The old page is recognised by a mark set on its window object, which a navigation replaces.
    Selenium's `staleness_of` asks about an element of the old page instead, and chromedriver can
    answer that question mid-navigation with an "unknown error" ("Node with given id does not
    belong to the document") rather than a stale-element error, which ended the wait with a
    failure (CI, test_replay_with_token). A script run while the page is being replaced may fail
    the same way, so any WebDriver error here means "not yet"."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script("window.__outboxOldPage = true;")
    element.click()

    def arrived(d):
        try:
            return d.execute_script(
                "return window.__outboxOldPage === undefined && document.readyState === 'complete';"
            )
        except WebDriverException:
            return False

    WebDriverWait(driver, timeout).until(arrived)
