"""`outbox serve` in a headless Chromium against a cluster with events in every state: every page
loads and agrees with SQL, dead letters and their histories are listed, replay works only with the
token and the CSRF token, read-only mode shows no buttons, basic auth guards everything, bad input
gets clean 400/404 pages, and a load test times each page over 50,000 events."""

import json
import os
import statistics
import subprocess
import time
import urllib.parse

import pytest
from selenium.webdriver.common.by import By

import dashlib
from dashlib import RESULTS, TOKEN, digits, follow, sql, sql1

PAGES = ["/", "/dead", "/subjects", "/health"]


@pytest.fixture(scope="module")
def ro_server(shared_db):
    """One read-only server for the many small requests of a parametrized test."""
    s = dashlib.Server(shared_db[0])
    yield s
    s.stop()


def shot(driver, name):
    path = RESULTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def cell_text(row, css):
    return row.find_element(By.CSS_SELECTOR, css).text.strip()


# ---- pages -------------------------------------------------------------------------------------


def test_every_page_loads(shared_db, servers, driver):
    db, ids = shared_db
    s = servers(db)
    for path in PAGES + [f"/events/{ids['dead'][0]}"]:
        driver.get(s.base + path)
        assert driver.find_element(By.TAG_NAME, "h1").text, path
        assert "outbox dashboard" in driver.title, (path, driver.title)
        assert not driver.find_elements(By.CSS_SELECTOR, ".error-title"), (path, driver.page_source[:2000])
        # The stylesheet and script are served by the binary itself.
        assert driver.execute_script("return getComputedStyle(document.body).fontSize") == "14px", path
        name = "page-" + (path.strip("/").replace("/", "-") or "overview")
        shot(driver, name)
    if os.environ.get("OUTBOX_DASHBOARD_DOCS_SCREENSHOT") == "1":
        driver.get(s.base + "/")
        driver.save_screenshot(str(dashlib.REPO / "docs" / "dashboard.png"))


def test_overview_numbers_match_sql(shared_db, servers, driver):
    db, _ = shared_db
    s = servers(db)
    driver.get(s.base + "/")
    want = {
        (sub, topic): (backlog, ready, leased, dead)
        for sub, topic, backlog, ready, leased, dead in sql(
            db, "SELECT subscription, topic, ready + scheduled, ready, leased, dead FROM outbox.stats"
        )
    }
    rows = driver.find_elements(By.CSS_SELECTOR, "#topics tbody tr[data-topic]")
    got = {}
    for r in rows:
        cells = r.find_elements(By.TAG_NAME, "td")
        key = (r.get_attribute("data-subscription"), r.get_attribute("data-topic"))
        got[key] = (digits(cells[2].text), digits(cells[3].text), digits(cells[6].text), digits(cells[8].text))
    assert got == want
    subs = {
        name: (lag, leases, dead)
        for name, lag, leases, dead in sql(db, "SELECT name, lag_events, leases_in_flight, dead_letters FROM outbox.subscriptions")
    }
    got = {}
    for r in driver.find_elements(By.CSS_SELECTOR, "#subscriptions tbody tr[data-subscription]"):
        cells = r.find_elements(By.TAG_NAME, "td")
        got[r.get_attribute("data-subscription")] = (digits(cells[2].text), digits(cells[5].text), digits(cells[6].text))
    assert got == subs
    # A sparkline drawn by the server (plotters' SVG), when the extension can count deliveries.
    if dashlib.has_function(db, "delivered_per_minute"):
        assert driver.find_elements(By.CSS_SELECTOR, "#topics td.spark svg")
    # The numbers are refreshed by polling /api/stats: the footer says when.
    time.sleep(6)
    assert "refreshed" in driver.find_element(By.ID, "refreshed").text


def test_dead_letters_listed_with_history(shared_db, servers, driver):
    db, ids = shared_db
    s = servers(db)
    driver.get(s.base + "/dead")
    listed = {
        (int(r.get_attribute("data-event")), r.get_attribute("data-subscription"))
        for r in driver.find_elements(By.CSS_SELECTOR, "tr.dead-letter")
    }
    want = {(i, sub) for i, sub in sql(db, "SELECT event_id, subscription FROM outbox.deliveries WHERE state = 'dead'")}
    assert listed == want
    assert digits(driver.find_element(By.ID, "dead-total").text) == len(want)
    row = driver.find_element(By.CSS_SELECTOR, f"tr.dead-letter[data-event='{ids['dead'][1]}'][data-subscription='default']")
    row.find_element(By.TAG_NAME, "summary").click()
    history = row.find_element(By.CSS_SELECTOR, "table.errors").text
    assert "timeout 1" in history and "timeout 2" in history and "HTTP 400 bad request" in history
    shot(driver, "dead-letters-history")
    # Filters: topic and subscription.
    driver.get(s.base + "/dead?topic=cli.*&subscription=ledger")
    listed = [int(r.get_attribute("data-event")) for r in driver.find_elements(By.CSS_SELECTOR, "tr.dead-letter")]
    assert listed == ids["ledger_dead"]
    driver.get(s.base + "/dead?since=1h")
    assert len(driver.find_elements(By.CSS_SELECTOR, "tr.dead-letter")) == len(want)
    driver.get(s.base + "/dead?until=" + urllib.parse.quote("2000-01-01 00:00"))
    assert driver.find_element(By.ID, "no-dead").text == "no dead letters match"


def test_event_detail(shared_db, servers, driver):
    db, ids = shared_db
    s = servers(db)
    i = ids["ledger_dead"][0]
    driver.get(s.base + f"/events/{i}")
    assert driver.find_element(By.ID, "event-state").text == "dead"
    assert '"topic": "cli.dead"' in driver.find_element(By.ID, "payload").text
    assert "traceparent" in driver.find_element(By.ID, "headers").text
    assert "HTTP 400 bad request" in driver.find_element(By.ID, "error-history").text
    subs = {r.get_attribute("data-subscription"): r.find_element(By.CSS_SELECTOR, ".pill").text
            for r in driver.find_elements(By.CSS_SELECTOR, "#deliveries tbody tr[data-subscription]")}
    want = dict(sql(db, "SELECT subscription, state FROM outbox.deliveries WHERE event_id = %s", (i,)))
    assert subs == want and subs["ledger"] == "dead"
    shot(driver, "event-detail")


def test_a_large_payload_is_left_out_of_the_page(fresh, servers, driver):
    """A payload over the page's cap (256 KiB of JSON text) is not put in the HTML: the page
    names its size and where to read it; /api/events/{id} returns it whole."""
    db, _ids = fresh
    big = sql1(db, "SELECT outbox.publish('dash.big', jsonb_build_object('blob', repeat('x', 300000)))")
    small = sql1(db, "SELECT outbox.publish('dash.big', jsonb_build_object('blob', repeat('y', 1000)))")
    s = servers(db)
    driver.get(s.base + f"/events/{big}")
    banner = driver.find_element(By.ID, "payload-too-large").text
    size = sql1(db, "SELECT octet_length(payload::text) FROM outbox.events WHERE id = %s", (big,))
    assert f"payload of {size} bytes" in banner and f"/api/events/{big}" in banner
    assert not driver.find_elements(By.ID, "payload")
    _, _, body = s.request(f"/events/{big}")
    assert "xxxxxxxxxx" not in body and len(body) < 100_000
    st, doc = s.json(f"/api/events/{big}")
    assert st == 200 and doc["payload_truncated"] is False and doc["payload_bytes"] == size
    assert json.loads(doc["payload"]) == {"blob": "x" * 300000}
    driver.get(s.base + f"/events/{small}")
    assert '"blob": "yyyy' in driver.find_element(By.ID, "payload").text
    assert not driver.find_elements(By.ID, "payload-too-large")


def test_user_data_is_escaped(shared_db, servers, driver):
    db, ids = shared_db
    s = servers(db)
    driver.get(s.base + f"/events/{ids['evil']}")
    assert "<script>window.__pwned = 1</script>" in driver.find_element(By.ID, "payload").text
    assert "<i>hi</i>" in driver.find_element(By.ID, "headers").text
    assert driver.execute_script("return window.__pwned === undefined")
    assert not driver.find_elements(By.CSS_SELECTOR, "#payload script, #payload img, #headers i")
    _, _, body = s.request(f"/events/{ids['evil']}")
    assert "<script>window" not in body and "&lt;script&gt;" in body


def test_blocked_subjects(shared_db, servers, driver):
    db, ids = shared_db
    if not dashlib.has_function(db, "blocked_subjects"):
        pytest.skip("outbox.blocked_subjects() is not in the installed extension yet")
    s = servers(db)
    driver.get(s.base + "/subjects")
    rows = {r.get_attribute("data-subject"): r for r in driver.find_elements(By.CSS_SELECTOR, "tr.blocked-subject")}
    assert "acct-7" in rows and "order-42" in rows, driver.page_source[:3000]
    assert cell_text(rows["acct-7"], ".reason") == "retrying"
    assert cell_text(rows["order-42"], ".reason") == "dead"
    assert f"event {ids['dead_head']}" in rows["order-42"].text
    want = sql1(db, "SELECT count(*) FROM outbox.blocked_subjects()")
    assert len(rows) == want
    shot(driver, "subjects")


def test_health_page(shared_db, servers, driver):
    db, _ = shared_db
    s = servers(db)
    driver.get(s.base + "/health")
    got = [r.get_attribute("data-check") for r in driver.find_elements(By.CSS_SELECTOR, "#checks tr.check")]
    assert got == [n for (n,) in sql(db, "SELECT check_name FROM outbox.health()")]
    assert driver.find_element(By.ID, "wakeup").text
    # One row per table of schema outbox that PostgreSQL keeps statistics of, the log's among them.
    shown = {r.find_elements(By.TAG_NAME, "td")[0].text
             for r in driver.find_elements(By.CSS_SELECTOR, "#tables tbody tr")}
    want = {f"outbox.{n}" for (n,) in sql(db, "SELECT relname FROM pg_stat_all_tables WHERE schemaname = 'outbox'")}
    assert shown == want and "outbox.log_exceptions" in shown, (shown, want)
    # A session holding a snapshot is named as an xmin holder, with its pid.
    with dashlib.connect(db, autocommit=False) as holder:
        holder.execute("SET application_name = 'dash-xmin-holder'")
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox.stats")
        pid = holder.execute("SELECT pg_backend_pid()").fetchone()[0]
        driver.get(s.base + "/health")
        xmin = driver.find_element(By.ID, "xmin").text
        assert str(pid) in xmin and "dash-xmin-holder" in xmin, xmin
        shot(driver, "health-xmin-holder")
        holder.rollback()


def test_health_page_shows_the_default_subscription_warning(pg_cluster, servers, driver):
    """Issue 40, item 7: an application that claims only from named subscriptions leaves the
    install's `default` holding the log; health() says so, and the page shows it as a warning
    that names the remedy."""
    db = "dash_default_unclaimed"
    dashlib.fresh_db(db)
    with dashlib.connect(db) as c:
        c.execute("SELECT outbox.create_subscription('mailer')")
        c.execute("SELECT outbox.publish_batch('dash.mail', array_fill('{}'::jsonb, ARRAY[3]))")
        c.execute("SELECT count(*) FROM outbox.claim('dash-test', 10, subscription => 'mailer')")
    s = servers(db)
    driver.get(s.base + "/health")
    rows = driver.find_elements(By.CSS_SELECTOR, '#checks tr.check[data-check="default_subscription"]')
    assert len(rows) == 1, [r.get_attribute("data-check") for r in driver.find_elements(By.CSS_SELECTOR, "#checks tr.check")]
    assert "status-warn" in rows[0].get_attribute("class").split()
    assert "outbox.drop_subscription('default')" in rows[0].text, rows[0].text
    assert driver.find_element(By.ID, "health-status").text in ("warn", "critical")
    st, doc = s.json("/api/health")
    assert st == 200 and any(ch["check_name"] == "default_subscription" and ch["status"] == "warn"
                             for ch in doc["checks"]), doc["checks"]
    shot(driver, "health-default-unclaimed")


def test_api_endpoints(shared_db, servers):
    db, ids = shared_db
    s = servers(db)
    st, doc = s.json("/api/stats")
    assert st == 200
    assert {(r["subscription"], r["topic"], r["backlog"]) for r in doc["stats"]} == {
        (a, b, c) for a, b, c in sql(db, "SELECT subscription, topic, ready + scheduled FROM outbox.stats")
    }
    assert {r["name"] for r in doc["subscriptions"]} == {"default", "ledger"}
    # The columns the dashboard names, and no other (issue 39: one engine, nothing of the other).
    assert list(doc["subscriptions"][0]) == [
        "name", "topics", "paused", "lag_events", "lag_s", "oldest_undelivered_id", "ready", "leases_in_flight",
        "dead_letters", "last_claim_at", "lost_events"], doc["subscriptions"][0]
    st, doc = s.json("/api/health")
    assert st == 200 and doc["status"] in ("ok", "warn", "critical") and doc["checks"]
    st, doc = s.json("/api/dead?per_page=2&page=2")
    assert st == 200 and doc["filter"]["page"] == 2 and len(doc["items"]) == 2
    assert doc["total"] == sql1(db, "SELECT count(*) FROM outbox.deliveries WHERE state = 'dead'")
    st, doc = s.json(f"/api/events/{ids['delivered'][0]}")
    assert st == 200 and doc["event"]["state"] == "delivered" and doc["payload_hidden"] is False
    for path in ("/api/subjects/blocked", "/api/throughput"):
        st, doc = s.json(path)
        fn = "blocked_subjects" if "subjects" in path else "delivered_per_minute"
        assert st == (200 if dashlib.has_function(db, fn) else 501), (path, doc)


# ---- security ----------------------------------------------------------------------------------


def test_read_only_mode_has_no_buttons(shared_db, servers, driver):
    db, ids = shared_db
    s = servers(db)
    for path in ("/dead", f"/events/{ids['dead'][0]}", f"/events/{ids['pending'][0]}"):
        driver.get(s.base + path)
        assert not driver.find_elements(By.CSS_SELECTOR, "button.replay, button.cancel, form.action"), path
    assert driver.find_element(By.ID, "mode").text == "read-only"
    st, _, body = s.request(f"/events/{ids['dead'][0]}/replay", "POST", {"csrf": "x", "token": TOKEN})
    assert st == 403 and "--allow-actions" in body
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (ids["dead"][0],)) == "dead"


def test_replay_with_token(fresh, servers, driver):
    db, ids = fresh
    s = servers(db, allow_actions=True, env={"OUTBOX_DASHBOARD_TOKEN": TOKEN})
    i = ids["dead"][1]
    driver.get(s.base + "/dead")
    row = driver.find_element(By.CSS_SELECTOR, f"tr.dead-letter[data-event='{i}'][data-subscription='default']")
    form = row.find_element(By.CSS_SELECTOR, "form[action$='/replay']")
    driver.find_element(By.ID, "action-token").send_keys(TOKEN)
    shot(driver, "replay-before")
    follow(driver, form.find_element(By.CSS_SELECTOR, "button.replay"))
    assert "replayed" in driver.find_element(By.ID, "done-banner").text
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (i,)) == "pending"
    shot(driver, "replay-after")
    # The token is remembered for the tab: cancelling a pending event from its page needs no typing.
    p = ids["pending"][0]
    driver.get(s.base + f"/events/{p}")
    follow(driver, driver.find_element(By.CSS_SELECTOR, "form[action$='/cancel'] button.cancel"))
    assert "cancelled" in driver.find_element(By.ID, "done-banner").text
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (p,)) == "cancelled"
    # The ledger's own dead letter, from the event page's per-subscription row.
    j = ids["ledger_dead"][0]
    driver.get(s.base + f"/events/{j}")
    follow(driver, driver.find_element(By.CSS_SELECTOR, "#deliveries tr[data-subscription='ledger'] button.replay"))
    assert "replayed" in driver.find_element(By.ID, "done-banner").text
    assert sql1(db, "SELECT state FROM outbox.deliveries WHERE event_id = %s AND subscription = 'ledger'", (j,)) != "dead"
    # An ineligible event is refused with 409, and nothing changes.
    csrf = driver.find_element(By.CSS_SELECTOR, "input[name=csrf]").get_attribute("value")
    d = ids["delivered"][0]
    st, _, body = s.request(f"/events/{d}/replay", "POST", {"csrf": csrf, "token": TOKEN})
    assert st == 409 and "delivered" in body
    st, _, _ = s.request("/events/999999999/replay", "POST", {"csrf": csrf, "token": TOKEN})
    assert st == 404


def test_actions_without_token_are_refused(fresh, servers, driver):
    db, ids = fresh
    s = servers(db, allow_actions=True, env={"OUTBOX_DASHBOARD_TOKEN": TOKEN})
    i = ids["dead"][0]
    driver.get(s.base + f"/events/{i}")
    # A port may be reused from an earlier test's server, whose token this tab remembers.
    driver.execute_script("try { sessionStorage.clear(); } catch (e) {}")
    driver.find_element(By.ID, "action-token").clear()
    follow(driver, driver.find_element(By.CSS_SELECTOR, "form[action$='/replay'] button.replay"))
    assert driver.find_element(By.CSS_SELECTOR, ".error-title").text.startswith("403")
    assert "action token" in driver.find_element(By.ID, "error-message").text
    shot(driver, "replay-without-token")
    csrf = None
    driver.get(s.base + f"/events/{i}")
    csrf = driver.find_element(By.CSS_SELECTOR, "input[name=csrf]").get_attribute("value")
    st, _, _ = s.request(f"/events/{i}/replay", "POST", {"csrf": csrf, "token": "wrong-token-0123456789"})
    assert st == 403
    st, _, _ = s.request(f"/events/{i}/replay", "POST", {"csrf": csrf})
    assert st == 403
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (i,)) == "dead"


def test_csrf_less_post_is_refused(fresh, servers, driver):
    db, ids = fresh
    s = servers(db, allow_actions=True, env={"OUTBOX_DASHBOARD_TOKEN": TOKEN})
    i = ids["dead"][0]
    st, _, body = s.request(f"/events/{i}/replay", "POST", {"token": TOKEN})
    assert st == 403 and "CSRF" in body
    st, _, _ = s.request(f"/events/{i}/replay", "POST", {"token": TOKEN, "csrf": "0" * 64})
    assert st == 403
    driver.get(s.base + "/dead")
    csrf = driver.find_element(By.CSS_SELECTOR, "input[name=csrf]").get_attribute("value")
    # The right CSRF token from another site's page is still refused.
    st, _, _ = s.request(f"/events/{i}/replay", "POST", {"token": TOKEN, "csrf": csrf},
                         headers={"Origin": "http://evil.example"})
    assert st == 403
    st, _, _ = s.request(f"/events/{i}/replay", "POST", {"token": TOKEN, "csrf": csrf},
                         headers={"Sec-Fetch-Site": "cross-site"})
    assert st == 403
    # A body that is not a form at all.
    st, _, _ = s.request(f"/events/{i}/replay", "POST", headers={"Content-Type": "application/json"})
    assert st == 403
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (i,)) == "dead"
    # With everything right (same origin), it works; the redirect stays on this server.
    st, h, _ = s.request(f"/events/{i}/replay", "POST",
                         {"token": TOKEN, "csrf": csrf, "back": "//evil.example/x"},
                         headers={"Origin": s.base})
    assert st == 303 and h["location"].startswith(f"/events/{i}?done=replayed"), h
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (i,)) == "pending"


def test_basic_auth(shared_db, servers, driver):
    db, _ = shared_db
    env = {"OUTBOX_DASHBOARD_USER": "ops", "OUTBOX_DASHBOARD_PASSWORD": "pa ss:word"}
    s = servers(db, env=env)
    for path in ("/", "/dead", "/api/stats", "/assets/app.css", "/nope"):
        st, h, _ = s.request(path, auth=False)
        assert st == 401 and h.get("WWW-Authenticate", "").startswith("Basic"), path
    st, _, _ = s.request("/", headers={"Authorization": "Basic b3BzOndyb25n"}, auth=False)
    assert st == 401
    st, _, _ = s.request("/")
    assert st == 200
    driver.get(f"http://ops:{urllib.parse.quote('pa ss:word')}@127.0.0.1:{s.port}/")
    assert driver.find_element(By.TAG_NAME, "h1").text == "Overview"


def test_dns_rebinding_is_refused(ro_server):
    for path in ("/", "/api/stats"):
        st, _, _ = ro_server.request(path, headers={"Host": f"evil.example:{ro_server.port}"})
        assert st == 421, path
    # The refusal carries the security headers too (they wrap every layer).
    _, h, _ = ro_server.request("/", headers={"Host": f"evil.example:{ro_server.port}"})
    assert "frame-ancestors 'none'" in h["Content-Security-Policy"] and h["X-Frame-Options"] == "DENY"
    st, _, _ = ro_server.request("/", headers={"Host": f"localhost:{ro_server.port}"})
    assert st == 200


def test_start_refusals(pg_cluster):
    db = "postgres"
    r = dashlib.clilib.run(["serve", "--allow-actions", "--listen", "127.0.0.1:1"], db)
    dashlib.clilib.assert_one_line_error(r, "OUTBOX_DASHBOARD_TOKEN")
    r = dashlib.clilib.run(["serve", "--listen", "nowhere"], db)
    dashlib.clilib.assert_one_line_error(r, "--listen")
    r = dashlib.clilib.run(["serve", "--bogus"], db)
    assert r.code == 2
    dashlib.clilib.assert_one_line_error(r, "--bogus")
    r = dashlib.clilib.run(["serve", "--pool-size", "0"], db)
    dashlib.clilib.assert_one_line_error(r, "--pool-size")
    # Longer than PostgreSQL's statement_timeout can hold (2^31 - 1 ms): refused at start, not by
    # every session later.
    r = dashlib.clilib.run(["serve", "--statement-timeout", "30days"], db)
    dashlib.clilib.assert_one_line_error(r, "--statement-timeout")
    r = dashlib.clilib.run(["serve", "--allow-actions"], db, env={"OUTBOX_DASHBOARD_TOKEN": "short"})
    dashlib.clilib.assert_one_line_error(r, "too short")
    r = dashlib.clilib.run(["serve"], db, env={"OUTBOX_DASHBOARD_USER": "ops"})
    dashlib.clilib.assert_one_line_error(r, "OUTBOX_DASHBOARD_PASSWORD")
    # A database without the extension.
    r = dashlib.clilib.run(["serve", "--listen", f"127.0.0.1:{dashlib.free_port()}"], db, timeout=30)
    dashlib.clilib.assert_one_line_error(r, "not installed")


@pytest.mark.parametrize(
    "path,status",
    [
        ("/events/999999999", 404),
        ("/events/abc", 400),
        ("/events/-1", 400),
        ("/events?id=x", 400),
        ("/dead?page=0", 400),
        ("/dead?page=abc", 400),
        ("/dead?page=99999999999999999999", 400),
        ("/dead?per_page=100000", 400),
        ("/dead?topic=%3Cscript%3E", 400),
        ("/dead?subscription=nope", 400),
        ("/dead?since=yesterday-ish", 400),
        ("/subjects?subscription=nope", 400),
        ("/subjects?max_rows=0", 400),
        ("/nope", 404),
        ("/assets/nope.js", 404),
        ("/api/events/abc", 400),
        ("/api/events/999999999", 404),
        ("/api/dead?page=-4", 400),
        ("/api/throughput?minutes=0", 400),
        ("/api/nope", 404),
        # A NUL byte PostgreSQL refuses (22021) is the request's fault, not the server's.
        ("/dead?subscription=%00", 400),
        ("/api/throughput?subscription=%00", 400),
    ],
)
def test_bad_input_gets_clean_errors(ro_server, path, status):
    s = ro_server
    st, h, body = s.request(path)
    assert st == status, (path, st, body[:500])
    if path.startswith("/api/"):
        assert h["Content-Type"].startswith("application/json") and '"error"' in body
    else:
        assert h["Content-Type"].startswith("text/html") and "error-message" in body
    assert "<script>" not in body
    st, _, _ = s.request("/")
    assert st == 200, "the server must survive bad input"


def test_database_gone_is_a_clean_error(pg_cluster, servers):
    db = "dash_gone"
    dashlib.fresh_db(db)
    s = servers(db)
    assert s.request("/")[0] == 200
    with dashlib.connect("postgres") as c:
        c.execute(f"DROP DATABASE {db} WITH (FORCE)")
    for path in ("/", "/dead", "/api/stats"):
        st, _, body = s.request(path)
        # Each request may land on a session that was cut or on a new one that cannot connect.
        assert st == 503 and ("does not exist" in body or "closed" in body), (path, st, body[:300])
    assert s.p.poll() is None


def test_monitor_role_hides_payloads(shared_db, servers, driver):
    db, ids = shared_db
    if not sql1(db, "SELECT count(*) FROM pg_roles WHERE rolname = 'outbox_monitor'"):
        pytest.skip("the installed extension has no outbox_monitor role yet")
    with dashlib.connect(db) as c:
        c.execute("DROP ROLE IF EXISTS dash_monitor")
        c.execute("CREATE ROLE dash_monitor LOGIN IN ROLE outbox_monitor")
    s = servers(db, user="dash_monitor")
    driver.get(s.base + f"/events/{ids['dead'][0]}")
    assert driver.find_element(By.ID, "payload-hidden").text == "payload hidden: needs outbox_admin"
    assert "HTTP 400 bad request" in driver.find_element(By.ID, "error-history").text
    shot(driver, "event-monitor-role")
    for path in PAGES:
        st, _, body = s.request(path)
        assert st == 200, (path, body[:1000])
    st, doc = s.json(f"/api/events/{ids['dead'][0]}")
    assert st == 200 and doc["payload_hidden"] is True and doc["payload"] is None


# ---- load --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["default_only", "with_ledger"])
def test_load_page_timings(pg_cluster, servers, driver, record_testsuite_property, variant):
    """Times every page over 50,000 events and 5,000 dead letters (no threshold: the figures are
    logged, in junit.xml and timings-VARIANT.txt). The second variant adds a second subscription,
    which receives every event too, to show what each one more costs the pages."""
    db = f"dash_load_{variant}"
    dashlib.fresh_db(db)
    if variant == "with_ledger":
        with dashlib.connect(db) as c:
            c.execute("SELECT outbox.create_subscription('ledger')")
    secs = dashlib.make_load(db)
    record_testsuite_property(f"{variant} setup s", round(secs, 1))
    assert sql1(db, "SELECT count(*) FROM outbox.events") == 50_000
    assert sql1(db, "SELECT count(*) FROM outbox.events WHERE state = 'dead'") == 5_000
    s = servers(db)
    dead_id = sql1(db, "SELECT min(id) FROM outbox.events WHERE state = 'dead'")
    pages = PAGES + ["/dead?page=2", "/dead?page=100", "/dead?topic=load.t1&page=3", f"/events/{dead_id}",
                     "/api/stats", "/api/dead?page=50", "/api/throughput"]
    lines = []
    for path in pages:
        server_ms = []
        for _ in range(3):
            t0 = time.perf_counter()
            st, _, body = s.request(path)
            server_ms.append((time.perf_counter() - t0) * 1000)
            assert st == 200, (path, body[:500])
        med = round(statistics.median(server_ms), 1)
        browser = (None, None)
        if not path.startswith("/api/"):
            driver.get(s.base + path)
            browser = dashlib.nav_ms(driver)
        record_testsuite_property(f"{variant} ms {path}", med)
        lines.append(f"{path:32s} http median {med:8.1f} ms  browser response {browser[0]} ms, load {browser[1]} ms")
    driver.get(s.base + "/dead?page=100")
    assert len(driver.find_elements(By.CSS_SELECTOR, "tr.dead-letter")) == 50
    assert driver.find_element(By.ID, "page-info").text == "page 100 of 100"
    assert not driver.find_elements(By.ID, "next-page")
    follow(driver, driver.find_element(By.ID, "prev-page"))
    assert driver.find_element(By.ID, "page-info").text == "page 99 of 100"
    driver.get(s.base + "/")
    shot(driver, f"load-overview-{variant}")
    report = "\n".join(lines)
    (RESULTS / f"timings-{variant}.txt").write_text(report + "\n")
    print(f"\npage timings ({variant}: 50,000 events, 5,000 dead letters):\n" + report)


class FreezableProxy:
    """A TCP forwarder to PostgreSQL on loopback that stops forwarding while frozen: a server or
    network that stalls without closing anything."""

    def __init__(self, target_port):
        import socket
        import threading

        self.frozen = threading.Event()
        self.stop = threading.Event()
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.2)
        self.port = self.srv.getsockname()[1]
        self.target = target_port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket
        import threading

        while not self.stop.is_set():
            try:
                a, _ = self.srv.accept()
            except OSError:
                continue
            b = socket.create_connection(("127.0.0.1", self.target))
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    def _pump(self, src, dst):
        src.settimeout(0.2)
        while not self.stop.is_set():
            if self.frozen.is_set():
                time.sleep(0.05)
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.srv.close()


def test_stalled_database_is_a_504_then_recovers(shared_db, servers):
    """PostgreSQL enforces statement_timeout only while it answers: against a server that stalls
    (a frozen proxy) every request must still end, with 504, and the pages recover after."""
    proxy = FreezableProxy(dashlib.clilib.PG_PORT)
    try:
        dsn = f"host=127.0.0.1 port={proxy.port} user=postgres dbname={shared_db[0]} connect_timeout=5"
        s = dashlib.Server(shared_db[0], extra=("--dsn", dsn, "--statement-timeout", "1s", "--pool-size", "1"))
        try:
            assert s.request("/api/stats")[0] == 200
            proxy.frozen.set()
            for path in ("/api/stats", "/"):
                t0 = time.monotonic()
                st, _, body = s.request(path)
                took = time.monotonic() - t0
                assert st == 504 and took < 20, (path, st, took, body[:300])
            assert s.request("/assets/app.css")[0] == 200  # no database needed
            proxy.frozen.clear()
            deadline = time.monotonic() + 30
            while s.request("/api/stats")[0] != 200:
                assert time.monotonic() < deadline, "no recovery after the stall"
                time.sleep(0.5)
        finally:
            s.stop()
    finally:
        proxy.close()


def test_behind_a_reverse_proxy_with_public_origin(fresh, servers):
    """A TLS proxy in front of a loopback dashboard: with --public-origin its host name is served
    and its Origin accepted on actions; any other name and origin is still refused."""
    db, ids = fresh
    s = servers(db, allow_actions=True, env={"OUTBOX_DASHBOARD_TOKEN": TOKEN},
                extra=("--public-origin", "https://outbox.example.com"))
    st, _, body = s.request("/dead", headers={"Host": "outbox.example.com"})
    assert st == 200
    csrf = body.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    assert s.request("/", headers={"Host": "evil.example"})[0] == 421
    i = ids["dead"][0]
    st, _, _ = s.request(f"/events/{i}/replay", "POST", {"token": TOKEN, "csrf": csrf},
                         headers={"Origin": "https://evil.example", "Host": "outbox.example.com"})
    assert st == 403
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (i,)) == "dead"
    # The proxy forwards its own Host (here the listener's); the browser's Origin is the public one.
    st, _, _ = s.request(f"/events/{i}/replay", "POST", {"token": TOKEN, "csrf": csrf},
                         headers={"Origin": "https://outbox.example.com", "Sec-Fetch-Site": "same-origin"})
    assert st == 303
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (i,)) == "pending"
    r = dashlib.clilib.run(["serve", "--public-origin", "outbox.example.com"], db)
    dashlib.clilib.assert_one_line_error(r, "--public-origin")
