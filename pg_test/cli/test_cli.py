"""The `outbox` operator commands against a real cluster with events in every state: output in
table and JSON form (compared with SQL), exit codes, guardrails, and the one-line error contract."""

import signal
import subprocess
import time

import pytest

import clilib
from clilib import (
    T_DEAD,
    assert_one_line_error,
    clean_env,
    connect,
    dsn,
    outbox_bin,
    run,
    sql,
    sql1,
)


# ---- read-only commands -------------------------------------------------------------------------


def test_stats_table_and_json(shared_db):
    db, _ = shared_db
    r = run(["stats", "--json"], db)
    assert r.code == 0, r
    rows = r.json()
    want = {(s, t): (rd, d, dl, c) for s, t, rd, d, dl, c in sql(
        db, "SELECT subscription, topic, ready, dead, delivered, cancelled FROM outbox.stats")}
    got = {(x["subscription"], x["topic"]): (x["ready"], x["dead"], x["delivered"], x["cancelled"]) for x in rows}
    assert got == want
    r = run(["stats"], db)
    assert r.code == 0 and "cli.dead" in r.out and "SUBSCRIPTION" in r.out and "ledger" in r.out, r
    r = run(["stats", "--json", "--subscription", "ledger", "--topic", "cli.*"], db)
    assert {x["subscription"] for x in r.json()} == {"ledger"}


def test_health_exit_codes(shared_db, pg_cluster):
    db, _ = shared_db
    r = run(["health", "--json"], db)
    doc = r.json()
    statuses = {c["status"] for c in doc["checks"]}
    want = 2 if "critical" in statuses else 1 if "warn" in statuses else 0
    assert r.code == want == doc["exit_code"], r
    assert len(doc["checks"]) == sql1(db, "SELECT count(*) FROM outbox.health()")
    r = run(["health"], db)
    assert r.code == want
    assert r.out.startswith("OUTBOX ")
    for (msg,) in sql(db, "SELECT message FROM outbox.health() WHERE check_name = 'dead_letters'"):
        assert msg in r.out
    # No connection: UNKNOWN, 3.
    r = run(["health"], env={"OUTBOX_DSN": "host=127.0.0.1 port=1 user=postgres connect_timeout=2"})
    assert r.code == 3
    assert_one_line_error(r, "cannot connect")
    # A healthy database: 0.
    with connect("postgres") as c:
        c.execute("DROP DATABASE IF EXISTS cli_healthy WITH (FORCE)")
        c.execute("CREATE DATABASE cli_healthy")
    with connect("cli_healthy") as c:
        c.execute("CREATE EXTENSION outbox_ext")
    r = run(["health", "--json"], "cli_healthy")
    assert r.code == 0, r
    assert r.json()["status"] == "ok"


@pytest.mark.parametrize("state", ["pending", "leased", "delivered", "dead", "cancelled"])
def test_events_ls_by_state(shared_db, state):
    db, ids = shared_db
    r = run(["events", "ls", "--state", state, "--json"], db)
    assert r.code == 0, r
    assert sorted(x["id"] for x in r.json()) == sorted(ids[state])
    assert all(x["state"] == state for x in r.json())
    r = run(["events", "ls", "--state", state], db)
    assert r.code == 0
    for i in ids[state]:
        assert f" {i} " in r.out


def test_events_ls_filters(shared_db):
    db, ids = shared_db
    r = run(["events", "ls", "--json", "--topic", "cli.*", "--limit", "1000"], db)
    assert len(r.json()) == sql1(db, "SELECT count(*) FROM outbox.events WHERE topic LIKE 'cli.%'")
    r = run(["events", "ls", "--json", "--subject", "cli.dead:1"], db)
    assert [x["id"] for x in r.json()] == [ids["dead"][1]]
    r = run(["events", "ls", "--json", "--limit", "2"], db)
    assert len(r.json()) == 2
    r = run(["events", "ls", "--json", "--since", "1h"], db)
    assert len(r.json()) == 15
    r = run(["events", "ls", "--json", "--since", "2999-01-01"], db)
    assert r.json() == []
    r = run(["events", "ls", "--json", "--state", "dead", "--subscription", "ledger"], db)
    assert [x["id"] for x in r.json()] == ids["ledger_dead"]
    r = run(["events", "ls", "--since", "yesterday-ish"], db)
    assert_one_line_error(r, "--since")
    # --until is exclusive and composes with --since: the newest event's time splits the list in two.
    newest, at = sql(db, "SELECT id, published_at::text FROM outbox.events ORDER BY id DESC LIMIT 1")[0]
    r = run(["events", "ls", "--json", "--limit", "1000", "--until", at], db)
    want = sql1(db, "SELECT count(*) FROM outbox.events WHERE published_at < %s::timestamptz", (at,))
    assert len(r.json()) == want and newest not in [x["id"] for x in r.json()]
    r = run(["events", "ls", "--json", "--limit", "1000", "--since", at, "--until", "2999-01-01"], db)
    assert newest in [x["id"] for x in r.json()]
    assert_one_line_error(run(["events", "ls", "--until", "whenever"], db), "--until")


def test_events_show(shared_db):
    db, ids = shared_db
    dead = ids["dead"][0]
    r = run(["events", "show", dead, "--json"], db)
    assert r.code == 0, r
    ev = r.json()
    assert ev["state"] == "dead" and ev["attempts"] == 3
    assert ev["payload"] == {"n": 0, "topic": T_DEAD}
    assert "traceparent" in ev["headers"]
    assert [e["error"] for e in ev["errors"]] == ["timeout 1", "timeout 2", "HTTP 400 bad request"]
    assert {d["subscription"] for d in ev["deliveries"]} == {"default", "ledger"}
    r = run(["events", "show", dead], db)
    assert r.code == 0
    for needle in ("timeout 1", "timeout 2", "HTTP 400 bad request", "traceparent", '"topic": "cli.dead"', "ledger"):
        assert needle in r.out, needle
    r = run(["events", "show", ids["ledger_dead"][0], "--subscription", "ledger", "--json"], db)
    assert r.json()["state"] == "dead" and r.json()["errors"][0]["error"] == "ledger said no"


def test_subscriptions_and_topics_ls(shared_db):
    db, _ = shared_db
    r = run(["subscriptions", "ls", "--json"], db)
    got = {x["name"]: (x["lag_events"], x["dead_letters"]) for x in r.json()}
    assert got == {n: (l, d) for n, l, d in sql(db, "SELECT name, lag_events, dead_letters FROM outbox.subscriptions")}
    r = run(["subscriptions", "ls"], db)
    assert r.code == 0 and "ledger" in r.out and "default" in r.out
    r = run(["topics", "ls", "--json"], db)
    t = {x["topic"]: x for x in r.json()}
    assert t["cli.dead"]["registered"] is True and t["cli.dead"]["max_attempts"] == 3
    assert t["cli.pending"]["registered"] is False and t["cli.pending"]["backlog"] == 3
    r = run(["topics", "ls"], db)
    assert "cli.dead" in r.out and "skip" in r.out


def test_completions():
    for shell in ("bash", "zsh", "fish"):
        r = run(["completions", shell])
        assert r.code == 0 and "replay" in r.out and "subscriptions" in r.out, r


# ---- guardrails ---------------------------------------------------------------------------------


def test_replay_refuses_pending_leased_delivered(fresh):
    db, ids = fresh
    before = sql(db, "SELECT id, state, attempts FROM outbox.events ORDER BY id")
    for state in ("pending", "leased", "delivered"):
        r = run(["replay", ids[state][0]], db)
        assert_one_line_error(r, "refusing", state)
        # One bad id among good ones: nothing is replayed.
        r = run(["replay", ids["dead"][0], ids[state][0]], db)
        assert_one_line_error(r, "nothing was changed")
    assert sql(db, "SELECT id, state, attempts FROM outbox.events ORDER BY id") == before


def test_replay_by_id(fresh):
    db, ids = fresh
    r = run(["replay", ids["dead"][0], ids["cancelled"][0], "--json"], db)
    assert r.code == 0, r
    assert sorted(r.json()["changed"]) == sorted([ids["dead"][0], ids["cancelled"][0]])
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (ids["dead"][0],)) == "pending"
    r = run(["replay", ids["ledger_dead"][0], "--subscription", "ledger"], db)
    assert r.code == 0 and "replayed" in r.out, r
    assert sql1(db, "SELECT state FROM outbox.deliveries WHERE subscription = 'ledger' AND event_id = %s",
                (ids["ledger_dead"][0],)) == "pending"


def test_bulk_replay_guardrails_and_dry_run(fresh):
    db, ids = fresh
    snapshot = "SELECT event_id, subscription, state, attempts FROM outbox.deliveries ORDER BY 1, 2"
    before = sql(db, snapshot)
    r = run(["replay", "--dead"], db)
    assert_one_line_error(r, "--yes")
    r = run(["replay", "--dead", "--dry-run"], db)
    assert r.code == 0 and "3 dead events" in r.out, r
    r = run(["replay", "--dead", "--dry-run", "--json", "--sample", "2"], db)
    doc = r.json()
    assert doc["matched"] == sql1(db, "SELECT outbox.replay_dead(dry_run => true)") == 3
    assert len(doc["sample"]) == 2
    r = run(["replay", "--dead", "--dry-run", "--json", "--topic", "nope.*"], db)
    assert r.json()["matched"] == 0
    assert sql(db, snapshot) == before
    # A typed confirmation that does not match refuses too (stdin is not a terminal here anyway).
    r = run(["replay", "--dead"], db, input="3\n")
    assert_one_line_error(r, "--yes")
    assert sql(db, snapshot) == before
    r = run(["replay", "--dead", "--yes", "--json", "--batch-size", "2"], db)
    assert r.code == 0, r
    assert r.json()["replayed"] == 3
    assert sql1(db, "SELECT count(*) FROM outbox.events WHERE state = 'dead'") == 0
    assert sql1(db, "SELECT count(*) FROM outbox.deliveries WHERE subscription = 'ledger' AND state = 'dead'") == 1
    r = run(["replay", "--dead", "--yes", "--subscription", "ledger"], db)
    assert r.code == 0 and "replayed 1" in r.out, r
    assert sql1(db, "SELECT count(*) FROM outbox.deliveries WHERE state = 'dead'") == 0


def test_cancel(fresh):
    db, ids = fresh
    r = run(["cancel", ids["leased"][0]], db)
    assert_one_line_error(r, "leased")
    r = run(["cancel", ids["pending"][0], ids["dead"][0], "--json"], db)
    assert r.code == 0, r
    assert sql1(db, "SELECT count(*) FROM outbox.events WHERE id = ANY(%s) AND state = 'cancelled'",
                ([ids["pending"][0], ids["dead"][0]],)) == 2
    r = run(["cancel", ids["pending"][1], "--subscription", "ledger"], db)
    assert r.code == 0, r
    assert sql1(db, "SELECT state FROM outbox.deliveries WHERE subscription = 'ledger' AND event_id = %s",
                (ids["pending"][1],)) == "cancelled"


def test_subscription_and_topic_admin(fresh):
    db, _ = fresh
    assert run(["subscriptions", "create", "mailer", "--topics", "cli.*,orders.*", "--max-attempts", "5"], db).code == 0
    assert sql1(db, "SELECT topics FROM outbox.subscriptions WHERE name = 'mailer'") == ["cli.*", "orders.*"]
    r = run(["subscriptions", "pause", "mailer", "--json"], db)
    assert r.json()["changed"] is True
    assert sql1(db, "SELECT paused FROM outbox.subscriptions WHERE name = 'mailer'") is True
    r = run(["subscriptions", "pause", "mailer"], db)
    assert r.code == 0 and "already" in r.out
    assert run(["subscriptions", "resume", "mailer"], db).code == 0
    assert sql1(db, "SELECT paused FROM outbox.subscriptions WHERE name = 'mailer'") is False
    r = run(["subscriptions", "alter", "mailer", "--max-attempts", "9", "--backoff-base", "3s", "--json"], db)
    assert r.code == 0 and r.json()["result"] == "altered", r
    assert sql(db, "SELECT max_attempts, backoff_base::text, backoff_max FROM outbox.subscriptions WHERE name = 'mailer'") == [
        (9, "00:00:03", None)]
    assert_one_line_error(run(["subscriptions", "alter", "mailer"], db))  # no setting given
    assert_one_line_error(run(["subscriptions", "alter", "mailer", "--backoff-base=-1 s"], db), "backoff")
    assert_one_line_error(run(["subscriptions", "alter", "nosuch", "--max-attempts", "2"], db), "nosuch")
    assert sql1(db, "SELECT max_attempts FROM outbox.subscriptions WHERE name = 'mailer'") == 9
    assert_one_line_error(run(["subscriptions", "drop", "mailer"], db), "--yes")
    assert run(["subscriptions", "drop", "mailer", "--yes"], db).code == 0
    assert sql1(db, "SELECT count(*) FROM outbox.subscriptions WHERE name = 'mailer'") == 0
    assert_one_line_error(run(["subscriptions", "pause", "nosuch"], db), "nosuch")
    assert run(["topics", "create", "orders.created", "--max-attempts", "7", "--backoff-base", "2s"], db).code == 0
    assert sql(db, "SELECT max_attempts, backoff_base::text FROM outbox.topics WHERE topic = 'orders.created'") == [(7, "00:00:02")]
    assert run(["topics", "alter", "orders.created", "--dead-letter-policy", "skip"], db).code == 0
    assert sql(db, "SELECT max_attempts, dead_letter_policy FROM outbox.topics WHERE topic = 'orders.created'") == [(7, "skip")]
    assert_one_line_error(run(["topics", "create", "orders.created"], db), "exists")
    assert_one_line_error(run(["topics", "create", "Bad Topic!"], db))
    assert run(["topics", "drop", "orders.created"], db).code == 0
    assert_one_line_error(run(["topics", "drop", "orders.created"], db), "not registered")


def test_purge_on_the_log(fresh):
    """The log is retained by table (README, Retention): purge removes the finished
    batches' records, not the events acked from them, and keeps rows of their own
    (dead letters, cancels) while the log holds their events."""
    db, _ = fresh
    # A batch's record exists once the batch finished (its events may share it with pending ones).
    records = sql1(db, "SELECT count(*) FROM outbox.log_delivered")
    r = run(["purge", "--dry-run", "--older-than", "0", "--json"], db)
    assert r.code == 0, r
    assert r.json() == {"dry_run": True, "dead": False, "eligible": records}
    assert sql1(db, "SELECT count(*) FROM outbox.log_delivered") == records
    r = run(["purge", "--older-than", "0", "--json"], db)
    assert r.code == 0, r
    assert r.json()["removed"] == records == r.json()["eligible"]
    assert sql1(db, "SELECT count(*) FROM outbox.log_delivered") == 0
    assert sql1(db, "SELECT count(*) FROM outbox.events WHERE state IN ('delivered', 'cancelled')") == 6
    r = run(["purge", "--dead", "--dry-run", "--older-than", "0", "--json"], db)
    assert r.code == 0 and r.json()["eligible"] == 0, r
    r = run(["purge", "--dead", "--older-than", "0", "--json"], db)
    assert r.code == 0 and r.json()["removed"] == 0, r
    assert sql1(db, "SELECT count(*) FROM outbox.events WHERE state = 'dead'") == 3
    assert sql1(db, "SELECT count(*) FROM outbox.events WHERE state IN ('pending', 'leased')") == 6


def _drain(c, sub="default"):
    """Claims until nothing is left; returns {id: (lease_token, subject)}."""
    got = {}
    while rows := c.execute("SELECT id, lease_token, subject FROM outbox.claim('cli-test', 100, '1 hour'::interval, "
                            "subscription => %s)", (sub,)).fetchall():
        got.update({i: (tok, subj) for i, tok, subj in rows})
    return got


def test_purge_removes_rows_of_their_own_once_the_log_lets_go(pg_cluster):
    """Ported (issue 39) from the purge test of the removed engine: on the log, `outbox purge`
    removes the finished batches' delivery records and the delivered rows of their own (an event
    acked after a retry: its attempt history), `outbox purge --dead` the rows of dead letters and
    cancelled events, once no ring table holds their events any more; the dry run counts exactly
    that."""
    db = "cli_purge_rows_of_their_own"
    clilib.fresh_db(db)
    with connect(db) as c, connect(db) as admin:
        admin.execute("SET outbox.retention_delivered = 0")
        admin.execute("SELECT outbox._log_rotate()")  # log_0 recorded as open
        ids = {}
        for subj in ("a1", "a2", "a3", "retried", "dead", "cancelled"):
            ids[subj] = c.execute("SELECT outbox.publish('purge.x', '{}', subject => %s)", (subj,)).fetchone()[0]
        assert c.execute("SELECT outbox.cancel(%s)", (ids["cancelled"],)).fetchone()[0]
        out = _drain(c)
        assert set(out) == {ids[s] for s in ("a1", "a2", "a3", "retried", "dead")}, out
        for s in ("a1", "a2", "a3"):
            assert c.execute("SELECT outbox.ack(%s, %s)", (ids[s], out[ids[s]][0])).fetchone()[0]
        assert c.execute("SELECT outbox.fail(%s, %s, 'once', retry_in => '0')",
                         (ids["retried"], out[ids["retried"]][0])).fetchone()[0] == "pending"
        assert c.execute("SELECT outbox.fail(%s, %s, 'no', permanent => true)",
                         (ids["dead"], out[ids["dead"]][0])).fetchone()[0] == "dead"
        again = _drain(c)
        assert set(again) == {ids["retried"]}, again
        assert c.execute("SELECT outbox.ack(%s, %s)", (ids["retried"], again[ids["retried"]][0])).fetchone()[0]

        def own(states):
            return sql1(db, "SELECT count(*) FROM outbox.log_exceptions WHERE state = ANY(%s)", (states,))

        assert (own(["delivered"]), own(["dead", "cancelled"])) == (1, 2)
        # While the log holds the events, their rows of their own stay (only batch records go).
        records = sql1(db, "SELECT count(*) FROM outbox.log_delivered")
        assert records > 0
        r = run(["purge", "--dead", "--older-than", "0", "--json"], db)
        assert r.code == 0 and r.json()["removed"] == 0, r
        assert run(["purge", "--dry-run", "--older-than", "0", "--json"], db).json()["eligible"] == records
        # Every reader has passed them: the ring table goes.
        admin.execute("SELECT outbox._log_rotate()")  # log_0 sealed
        assert admin.execute("SELECT outbox._log_rotate()").fetchone()[0] >= 1
        assert sql1(db, "SELECT count(*) FROM outbox.log") == 0
    r = run(["purge", "--dry-run", "--older-than", "0", "--json"], db)
    assert r.json() == {"dry_run": True, "dead": False, "eligible": records + 1}, r
    assert sql1(db, "SELECT count(*) FROM outbox.log_delivered") == records  # nothing removed
    r = run(["purge", "--older-than", "0", "--json"], db)
    assert r.code == 0, r
    assert r.json()["removed"] == records + 1, r
    assert sql1(db, "SELECT count(*) FROM outbox.log_delivered") == 0
    assert (own(["delivered"]), own(["dead", "cancelled"])) == (0, 2)
    r = run(["purge", "--dead", "--dry-run", "--older-than", "0", "--json"], db)
    assert r.json()["eligible"] == 2, r
    r = run(["purge", "--dead", "--older-than", "0"], db)
    assert r.code == 0 and "removed 2 rows" in r.out, r
    assert sql1(db, "SELECT count(*) FROM outbox.log_exceptions") == 0
    # A second purge finds nothing.
    r = run(["purge", "--older-than", "0", "--json"], db)
    assert r.code == 0 and r.json()["removed"] == 0, r


def test_tail(fresh):
    db, _ = fresh
    env = clean_env({"OUTBOX_DSN": dsn(db)})
    p = subprocess.Popen([outbox_bin(), "tail", "--json", "--topic", "tail.*"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        with connect(db) as c:
            c.execute("SELECT outbox.publish('other.x', '{}')")
            for i in range(3):
                c.execute("SELECT outbox.publish('tail.x', %s::jsonb)", (f'{{"i": {i}}}',))
        lines = [p.stdout.readline() for _ in range(3)]
        import json as _json
        got = [_json.loads(x) for x in lines]
        assert [g["payload"]["i"] for g in got] == [0, 1, 2]
        assert all(g["topic"] == "tail.x" for g in got)
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "panicked" not in p.stderr.read()


# ---- errors ---------------------------------------------------------------------------------------


def test_errors_one_line(shared_db, pg_cluster):
    db, ids = shared_db
    assert_one_line_error(run(["stats"], env={"OUTBOX_DSN": "host=127.0.0.1 port=1 user=postgres connect_timeout=2"}),
                          "cannot connect")
    assert_one_line_error(run(["stats"], env={"OUTBOX_DSN": "host='unterminated"}), "connection string")
    assert_one_line_error(run(["stats"], env={"OUTBOX_DSN": dsn("nosuchdb")}), "nosuchdb")
    with connect("postgres") as c:
        c.execute("DROP DATABASE IF EXISTS cli_noext WITH (FORCE)")
        c.execute("CREATE DATABASE cli_noext")
    for args in (["stats"], ["events", "ls"], ["replay", "1"]):
        assert_one_line_error(run(args, "cli_noext"), "not installed")
    assert_one_line_error(run(["events", "show", "999999"], db), "999999")
    assert_one_line_error(run(["replay", "999999"], db), "999999")
    assert_one_line_error(run(["cancel", "999999"], db), "999999")
    assert_one_line_error(run(["events", "ls", "--subscription", "nosuch"], db), "nosuch")


def test_libpq_environment(shared_db):
    db, _ = shared_db
    r = run(["stats", "--json"], env={"PGHOST": "127.0.0.1", "PGPORT": str(__import__("clilib").PG_PORT),
                                      "PGUSER": "postgres", "PGDATABASE": db})
    assert r.code == 0, r
    assert len(r.json()) == sql1(db, "SELECT count(*) FROM outbox.stats")


@pytest.mark.parametrize("role", ["worker_only", "no_role"])
def test_no_privilege(shared_db, role):
    db, ids = shared_db
    with connect(db) as c:
        c.execute(f"DROP ROLE IF EXISTS {role}")
        c.execute(f"CREATE ROLE {role} LOGIN")
        if role == "worker_only":
            c.execute(f"GRANT outbox_worker TO {role}")
    for args in (["stats"], ["events", "ls"], ["events", "show", ids["dead"][0]], ["replay", ids["dead"][0]],
                 ["cancel", ids["pending"][0]], ["subscriptions", "ls"], ["topics", "ls"],
                 ["replay", "--dead", "--dry-run"], ["purge", "--dry-run"]):
        r = run(args, db, user=role)
        assert_one_line_error(r, "permission denied", "outbox_admin")
    r = run(["health"], db, user=role)
    assert r.code == 3
    assert_one_line_error(r, "permission denied")
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (ids["dead"][0],)) == "dead"


def test_monitor_role_reads_without_payloads(shared_db):
    """outbox_monitor (read-only, no payloads) is enough for stats, health and the lists; the
    payload of `events show` and every action need outbox_admin."""
    db, ids = shared_db
    with connect(db) as c:
        c.execute("DROP ROLE IF EXISTS monitor_only")
        c.execute("CREATE ROLE monitor_only LOGIN IN ROLE outbox_monitor")
    for args in (["stats", "--json"], ["events", "ls", "--json"], ["subscriptions", "ls", "--json"], ["topics", "ls", "--json"]):
        r = run(args, db, user="monitor_only")
        assert r.code == 0, (args, r)
    assert len(run(["events", "ls", "--json", "--state", "dead", "--limit", "1000"], db, user="monitor_only").json()) == sql1(
        db, "SELECT count(*) FROM outbox.events WHERE state = 'dead'")
    assert run(["health"], db, user="monitor_only").code in (0, 1, 2)
    assert_one_line_error(run(["replay", ids["dead"][0]], db, user="monitor_only"), "permission denied")
    assert sql1(db, "SELECT state FROM outbox.events WHERE id = %s", (ids["dead"][0],)) == "dead"


def _on_a_terminal(db, args, answer, timeout=30):
    """Runs `outbox ARGS` with stdin and stderr on a pseudo-terminal, waits for the confirmation
    prompt, types `answer`; returns (exit code, what the terminal showed, stdout)."""
    import os
    import pty
    import select

    master, slave = pty.openpty()
    env = clean_env({"OUTBOX_DSN": dsn(db)})
    p = subprocess.Popen([outbox_bin(), *[str(a) for a in args]], env=env, stdin=slave, stderr=slave,
                         stdout=subprocess.PIPE, text=True)
    os.close(slave)
    shown, deadline, answered = b"", time.monotonic() + timeout, False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                shown += chunk
            if not answered and b"to confirm:" in shown:
                os.write(master, answer.encode() + b"\n")
                answered = True
            if p.poll() is not None and not ready:
                break
        assert answered, f"no confirmation prompt: {shown!r}"
        out = p.communicate(timeout=max(1, deadline - time.monotonic()))[0]
        return p.returncode, shown.decode(errors="replace"), out
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)


def test_bulk_replay_typed_confirmation_on_a_terminal(fresh):
    """On a terminal, bulk replay asks for the count to be typed: a wrong answer replays nothing,
    the right one replays them all."""
    db, _ = fresh
    snapshot = "SELECT event_id, subscription, state, attempts FROM outbox.deliveries ORDER BY 1, 2"
    before = sql(db, snapshot)
    n = sql1(db, "SELECT outbox.replay_dead(dry_run => true)")
    assert n == 3
    code, shown, _ = _on_a_terminal(db, ["replay", "--dead"], "2")
    assert code != 0 and f"Type '{n}' to confirm" in shown and "not confirmed" in shown, shown
    assert "panicked" not in shown
    assert sql(db, snapshot) == before
    code, shown, out = _on_a_terminal(db, ["replay", "--dead"], str(n))
    assert code == 0, (shown, out)
    assert f"replayed {n}" in out, out
    assert sql1(db, "SELECT count(*) FROM outbox.events WHERE state = 'dead'") == 0


def test_json_keys_keep_the_column_order(shared_db):
    """--json objects list their keys in the order of the columns (the table's order), not sorted."""
    db, _ = shared_db
    r = run(["events", "ls", "--json", "--limit", "1"], db)
    assert list(r.json()[0])[:4] == ["id", "topic", "subject", "dispatch_key"], r.out
    r = run(["subscriptions", "ls", "--json"], db)
    assert list(r.json()[0])[:3] == ["name", "topics", "paused"], r.out


# ---- global flags (issue 39, item 9) ------------------------------------------------------------

WHSEC = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _place(where, flag, cmd):
    """`outbox FLAG CMD...` or `outbox CMD... FLAG`."""
    return [*flag, *cmd] if where == "before" else [*cmd, *flag]


@pytest.mark.parametrize("where", ["before", "after"])
def test_dsn_before_or_after_an_operator_command(shared_db, where):
    """--dsn is one global flag: `outbox --dsn X stats` and `outbox stats --dsn X` both work (no
    OUTBOX_DSN and no PG* variable here, so the flag is the only way to the database)."""
    db, ids = shared_db
    flag = ["--dsn", dsn(db)]
    r = run(_place(where, flag, ["stats", "--json"]))
    assert r.code == 0, r

    def counts(rows):
        return {(x["subscription"], x["topic"], x["ready"], x["dead"], x["delivered"]) for x in rows}

    assert counts(r.json()) == counts(run(["stats", "--json"], db).json())
    assert T_DEAD in {x["topic"] for x in r.json()}
    # A nested subcommand.
    r = run(_place(where, flag, ["events", "ls", "--state", "dead", "--json"]))
    assert r.code == 0, r
    assert sorted(x["id"] for x in r.json()) == sorted(ids["dead"])
    # The flag is what is used: one naming a missing database fails with its name, and the flag
    # goes before OUTBOX_DSN (as before the change).
    assert_one_line_error(run(_place(where, ["--dsn", dsn("cli_no_such_db")], ["stats"])), "cli_no_such_db")
    r = run(_place(where, flag, ["stats", "--json"]), env={"OUTBOX_DSN": dsn("cli_no_such_db")})
    assert r.code == 0, r


def test_json_before_the_subcommand(shared_db):
    db, _ = shared_db
    r = run(["--json", "subscriptions", "ls"], db)
    assert r.code == 0, r
    assert [(x["name"], x["lag_events"], x["dead_letters"]) for x in r.json()] == [
        (x["name"], x["lag_events"], x["dead_letters"]) for x in run(["subscriptions", "ls", "--json"], db).json()]
    # The columns `ls` names, in the view's order (issue 39: nothing of the removed engine).
    assert list(r.json()[0]) == [
        "name", "topics", "paused", "paused_at", "lag_events", "lag", "oldest_undelivered_id",
        "oldest_undelivered_at", "ready", "leases_in_flight", "dead_letters", "last_claim_at", "max_attempts",
        "backoff_base", "backoff_max", "default_lease", "created_at", "updated_at", "dead_letter_policy",
        "max_lag", "lost_events", "lost_at"]
    lines = run(["subscriptions", "ls"], db).out.splitlines()
    header = next(ln for ln in lines if "NAME" in ln)
    assert [c.strip() for c in header.replace("┆", "│").split("│") if c.strip()] == [
        "NAME", "TOPICS", "PAUSED", "LAG EVENTS", "LAG", "READY", "LEASED", "DEAD", "LAST CLAIM", "LOST"], lines


@pytest.mark.parametrize("where", ["before", "after"])
def test_dsn_before_or_after_relay(pg_cluster, where):
    """The relay takes the global --dsn in either place: it connects and creates its subscription."""
    db = f"cli_relay_dsn_{where}"
    clilib.fresh_db(db)
    sub = f"relay-{where}"
    cmd = ["relay", "--sink", "webhook", "--webhook-url", "http://127.0.0.1:9/hook", "--webhook-secret", WHSEC,
           "--metrics-listen", "off", "--subscription", sub]
    p = subprocess.Popen([outbox_bin(), *_place(where, ["--dsn", dsn(db)], cmd)], env=clean_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and p.poll() is None:
            if sql1(db, "SELECT count(*) FROM outbox.subscriptions WHERE name = %s", (sub,)) == 1:
                break
            time.sleep(0.2)
        assert p.poll() is None, p.stderr.read()
        assert sql1(db, "SELECT count(*) FROM outbox.subscriptions WHERE name = %s", (sub,)) == 1
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "panicked" not in p.stderr.read()
    # The flag is what is used (no OUTBOX_DSN, no config file here): without it there is no DSN.
    assert_one_line_error(run(cmd), "no PostgreSQL DSN")


def test_relay_dsn_flag_beats_its_config_file(pg_cluster, tmp_path):
    """The relay's precedence is kept: --dsn (or OUTBOX_DSN), then the config file's dsn."""
    db = "cli_relay_dsn_config"
    clilib.fresh_db(db)
    cfg = tmp_path / "relay.toml"
    cfg.write_text(f'sink = "webhook"\ndsn = "{dsn("cli_no_such_db")}"\n'
                   f'[webhook]\nsecrets = ["{WHSEC}"]\n[[webhook.endpoints]]\nname = "a"\nurl = "http://127.0.0.1:9/"\n')
    cmd = ["relay", "--config", str(cfg), "--metrics-listen", "off"]
    # The file's alone: its (missing) database.
    r = run(cmd, timeout=60)
    assert_one_line_error(r, "cli_no_such_db")
    # The flag, before or after, wins over it; so does OUTBOX_DSN.
    for argv, env in ((["--dsn", dsn(db), *cmd], None), ([*cmd, "--dsn", dsn(db)], None),
                      (cmd, {"OUTBOX_DSN": dsn(db)})):
        p = subprocess.Popen([outbox_bin(), *argv], env=clean_env(env), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and p.poll() is None:
                if sql1(db, "SELECT count(*) FROM outbox.subscriptions WHERE name LIKE 'relay-%'") > 0:
                    break
                time.sleep(0.2)
            assert p.poll() is None, (argv, p.stderr.read())
            assert sql1(db, "SELECT count(*) FROM outbox.subscriptions WHERE name LIKE 'relay-%'") > 0, argv
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with connect(db) as c:
            c.execute("SELECT outbox.drop_subscription(name, force => true) FROM outbox.subscriptions "
                      "WHERE name LIKE 'relay-%'")


@pytest.mark.parametrize("where", ["before", "after"])
def test_dsn_before_or_after_serve(shared_db, where):
    """`outbox --dsn X serve` and `outbox serve --dsn X` serve that database."""
    import urllib.request

    db, _ = shared_db
    port = _free_port()
    cmd = ["serve", "--listen", f"127.0.0.1:{port}"]
    p = subprocess.Popen([outbox_bin(), *_place(where, ["--dsn", dsn(db)], cmd)], env=clean_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        body, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline and p.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/stats", timeout=5) as resp:
                    body = __import__("json").loads(resp.read())
                    break
            except OSError:
                time.sleep(0.2)
        assert body is not None, p.stderr.read() if p.poll() is not None else "no answer"
        assert T_DEAD in {x["topic"] for x in body["stats"]}
        assert {x["name"] for x in body["subscriptions"]} == {"default", "ledger"}
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    assert "panicked" not in p.stderr.read()
    # The flag is what is used: a missing database refuses the start, in one line, with its name.
    r = run(_place(where, ["--dsn", dsn("cli_no_such_db")], ["serve", "--listen", f"127.0.0.1:{_free_port()}"]),
            timeout=30)
    assert_one_line_error(r, "cli_no_such_db")


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "relay"],
        ["relay", "--json"],
        ["relay", "--sink", "nats", "--json"],
        ["--json", "serve"],
        ["serve", "--json", "--listen", "127.0.0.1:1"],
        ["--json", "completions", "bash"],
        ["completions", "bash", "--json"],
    ],
)
def test_json_is_a_usage_error_where_it_means_nothing(shared_db, argv):
    """--json on a command that prints no data: exit 2, one line, nothing started or printed."""
    db, _ = shared_db
    r = run(["--dsn", dsn(db), *argv])
    assert r.code == 2, r
    assert r.out == "", r
    assert_one_line_error(r, "--json does not apply to 'outbox " + next(a for a in argv if not a.startswith("-")))
