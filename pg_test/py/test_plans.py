"""Claim cost that does not grow with the log, proven by counting work, not
time (issue 40, contract item 4).

- Every statement on the claim, ack and publish paths (the registry,
  `outbox._statements()`, src/sql/registry.rs) is prepared with a generic plan
  over a loaded log and must not read a ring table or `outbox.log_exceptions`
  with a sequential scan; the registry must list every statement of those
  files.
- claim(100) of 100 fresh events after a million events were published in one
  transaction and drained reads about as many buffers as the same claim on a
  fresh install (EXPLAIN (ANALYZE, BUFFERS) counts the work of the function's
  own statements in its node).

The loaded database is built once for the module (about a minute)."""

import json
import re
from pathlib import Path

import pytest

from conftest import connect
from scratch_db import create_db, drop_db

REPO = Path(__file__).resolve().parents[2]
LOADED = "outbox_plans_loaded"
FRESH = "outbox_plans_fresh"
HISTORY = 1_000_000

# Ring tables and the exception table: never read whole on a hot path.
WATCHED = re.compile(r"Seq Scan on (log_[0-3]|log_exceptions)\b")


def load(dsn, events):
    """`events` published in one transaction, then drained by claims of 1,000
    with batch acks, then VACUUM ANALYZE (realistic statistics)."""
    with connect(dsn) as c:
        c.execute("SELECT outbox.drop_subscription('default', true)")
        c.execute("SELECT outbox.create_subscription('s')")
        if events:
            c.execute("SELECT count(outbox.publish('t', jsonb_build_object('n', g))) FROM generate_series(1, %s) g",
                      (events,))
            while True:
                rows = c.execute("SELECT id, lease_token FROM outbox.claim('w', 1000, subscription => 's')").fetchall()
                if not rows:
                    break
                n = c.execute("SELECT outbox.ack(%s::bigint[], %s::uuid[])",
                              ([r[0] for r in rows], [r[1] for r in rows])).fetchone()[0]
                assert n == len(rows)
        c.execute("VACUUM ANALYZE")


@pytest.fixture(scope="module")
def loaded(plain_dsn):
    dsn = create_db(plain_dsn, LOADED)
    load(dsn, HISTORY)
    yield dsn
    drop_db(plain_dsn, LOADED)


@pytest.fixture(scope="module")
def fresh(plain_dsn):
    dsn = create_db(plain_dsn, FRESH)
    load(dsn, 0)
    yield dsn
    drop_db(plain_dsn, FRESH)


def registry_names_in_source():
    names = set()
    for f in ("claim", "log", "publish"):
        text = (REPO / "src" / "sql" / f"{f}.rs").read_text()
        for m in re.finditer(r"pub const ([A-Z_0-9]+): (?:Stmt|\[Stmt; (\d+)\])", text):
            if m.group(2):
                names |= {f"{f}::{m.group(1)}[{i}]" for i in range(int(m.group(2)))}
            else:
                names.add(f"{f}::{m.group(1)}")
    return names


def test_the_registry_lists_every_statement_of_the_hot_paths(loaded):
    with connect(loaded) as c:
        listed = {r[0] for r in c.execute("SELECT name FROM outbox._statements()").fetchall()}
    want = registry_names_in_source()
    assert want - listed == set(), "statements missing from src/sql/registry.rs"
    assert listed - want == set(), "src/sql/registry.rs lists statements that no longer exist"


def generic_plan(c, sql, types, options="COSTS OFF"):
    """The generic plan of `sql` with parameter types `types` (oids), as
    EXPLAIN (`options`) prints it."""
    c.execute("DEALLOCATE ALL")
    names = [r[0] for r in c.execute("SELECT format_type(t, NULL) FROM unnest(%s::oid[]) WITH ORDINALITY AS u(t, n) "
                                     "ORDER BY n", (types,)).fetchall()]
    params = f"({', '.join(names)})" if names else ""
    args = f"({', '.join(['NULL'] * len(names))})" if names else ""
    c.execute(f"PREPARE s{params} AS {sql}")
    return "\n".join(str(r[0]) for r in c.execute(f"EXPLAIN ({options}) EXECUTE s{args}").fetchall())


def test_the_hot_functions_plan_without_sequential_scans(loaded):
    with connect(loaded) as c:
        rows = c.execute("SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p "
                         "WHERE p.pronamespace = 'outbox'::regnamespace "
                         "AND p.proname IN ('claim', 'ack', 'fail', 'extend_lease')").fetchall()
    assert len(rows) == 5
    for fn, config in rows:
        assert "enable_seqscan=off" in (config or []), f"{fn} plans with enable_seqscan on"


def test_no_hot_statement_is_jit_compiled(loaded):
    """Under the settings claim plans with (its `SET` clauses, read from
    pg_proc), no statement of the registry gets a JIT-compiled plan. A forced
    scan of a small table costs 1e10 with enable_seqscan off, past every JIT
    threshold: the subscriptions' lookup was compiled with inlining and
    optimization, and a session's first claim took 450-850 ms."""
    jitted = []
    with connect(loaded, prepare_threshold=None) as c:
        config = c.execute("SELECT proconfig FROM pg_proc WHERE oid = "
                           "'outbox.claim(text, integer, interval, text[], text)'::regprocedure").fetchone()[0]
        for setting in config or []:
            k, v = setting.split("=", 1)
            c.execute("SELECT set_config(%s, %s, false)", (k, v))
        c.execute("SET plan_cache_mode = force_generic_plan")
        for name, sql, types in c.execute("SELECT name, sql, types FROM outbox._statements()").fetchall():
            c.execute("BEGIN")
            try:
                plan = generic_plan(c, sql, types, "FORMAT JSON")  # with costs: the JIT section shows
            finally:
                c.execute("ROLLBACK")
            if "JIT" in plan:
                jitted.append(name)
    assert not jitted, f"JIT-compiled under claim's settings ({config}): {', '.join(jitted)}"


def test_no_hot_statement_reads_a_ring_table_or_the_exception_table_whole(loaded):
    # The claim, ack, fail and extend_lease functions plan their statements with
    # enable_seqscan off (sql/api.sql): so does this test, as they would.
    offenders = {}
    with connect(loaded, prepare_threshold=None) as c:  # psycopg's own prepared statements would go with DEALLOCATE
        c.execute("SET plan_cache_mode = force_generic_plan")
        c.execute("SET enable_seqscan = off")
        for name, sql, types in c.execute("SELECT name, sql, types FROM outbox._statements()").fetchall():
            c.execute("BEGIN")
            try:
                plan = generic_plan(c, sql, types)
            finally:
                c.execute("ROLLBACK")
            if WATCHED.search(plan):
                offenders[name] = plan
    assert not offenders, "sequential scans of the log or the exception table:\n" + "\n\n".join(
        f"{n}:\n{p}" for n, p in offenders.items())


def claim_buffers(dsn, subjects=False):
    """Shared buffers (hit + read) that claim(100) of 100 fresh events touches
    (with `subjects`, each of its own subject), which must take all of them."""
    subject = "'o' || g" if subjects else "NULL"
    with connect(dsn) as c:
        c.execute(f"SELECT count(outbox.publish('t', '{{}}'::jsonb, subject => {subject})) FROM generate_series(1, 100) g")
        plan = c.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                         "SELECT * FROM outbox.claim('w', 100, subscription => 's')").fetchone()[0]
        top = (plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"]
        assert top["Actual Rows"] == 100
        rows = c.execute("SELECT id, lease_token FROM outbox.claim('w', 1, subscription => 's')").fetchall()
        assert rows == []
        return top["Shared Hit Blocks"] + top["Shared Read Blocks"]


def test_claim_work_does_not_grow_with_a_million_retained_events(loaded, fresh):
    fresh_blocks = claim_buffers(fresh)
    loaded_blocks = claim_buffers(loaded)
    print(f"claim(100) buffers: fresh install {fresh_blocks}, after {HISTORY:,} events {loaded_blocks}")
    # The same work, give or take the deeper indexes (one more level per
    # probe) and the statistics the loaded log gives its plans.
    assert loaded_blocks <= 2 * fresh_blocks + 200, (
        f"claim(100) read {loaded_blocks} buffers after {HISTORY:,} events, {fresh_blocks} on a fresh install")


PILE = 20_000
BLOCKED = "outbox_plans_blocked"


def block_a_subject(c, pile):
    """Subscription 's' (dead letters block): subject 'S' gets a dead letter,
    then `pile` more events of 'S' are published in one transaction and read
    past by claims (each parked behind the dead letter)."""
    c.execute("SELECT outbox.drop_subscription('default', true)")
    c.execute("SELECT outbox.create_subscription('s', dead_letter_policy => 'block')")
    c.execute("SELECT outbox.publish('t', '{}'::jsonb, subject => 'S')")
    (eid, tok), = c.execute("SELECT id, lease_token FROM outbox.claim('w', 1, subscription => 's')").fetchall()
    assert c.execute("SELECT outbox.fail(%s, %s, 'boom', permanent => true)", (eid, tok)).fetchone()[0] == "dead"
    if pile:
        c.execute("SELECT count(outbox.publish('t', '{}'::jsonb, subject => 'S')) FROM generate_series(1, %s)",
                  (pile,))
        for _ in range(10 * pile // 100 + 10):
            assert c.execute("SELECT count(*) FROM outbox.claim('w', 100, subscription => 's')").fetchone()[0] == 0
            if c.execute("SELECT count(*) FROM outbox.log_exceptions").fetchone()[0] == pile + 1:
                break
    assert c.execute("SELECT count(*) FROM outbox.log_exceptions").fetchone()[0] == pile + 1
    c.execute("VACUUM ANALYZE")


def test_claim_work_does_not_grow_with_the_events_behind_a_dead_letter(plain_dsn):
    """Contract item 4: 20,000 events parked behind one dead letter under
    'block' cost a claim of other subjects nothing that grows with them (0.16
    tested every parked row before its LIMIT stopped)."""
    dsn = create_db(plain_dsn, BLOCKED)
    try:
        with connect(dsn) as c:
            block_a_subject(c, 0)
        base = claim_buffers(dsn, subjects=True)
        drop_db(plain_dsn, BLOCKED)
        dsn = create_db(plain_dsn, BLOCKED)
        with connect(dsn) as c:
            block_a_subject(c, PILE)
        piled = claim_buffers(dsn, subjects=True)
        print(f"claim(100) of other subjects, buffers: one dead letter {base}, with {PILE:,} events behind it {piled}")
        assert piled <= 2 * base + 100, (
            f"claim(100) read {piled} buffers with {PILE:,} events behind a dead letter, {base} without them")
        with connect(dsn) as c:
            # Nothing behind the dead letter is handed out while it blocks ...
            assert c.execute("SELECT count(*) FROM outbox.claim('w', 100, subscription => 's')").fetchone()[0] == 0
            # ... and after a replay the dead letter comes first, then the pile in order.
            assert c.execute("SELECT outbox.replay_dead(subscription => 's')").fetchone()[0] == 1
            got = []
            while True:
                rows = c.execute("SELECT id, lease_token FROM outbox.claim('w', 100, subscription => 's')").fetchall()
                if not rows:
                    break
                assert len(rows) == 1, "one event per subject at a time"
                got.append(rows[0][0])
                assert c.execute("SELECT outbox.ack(%s, %s)", rows[0]).fetchone()[0]
                if len(got) > 50:
                    break
            ids = [r[0] for r in c.execute(
                "SELECT id FROM outbox.log_exceptions WHERE subject = 'S' ORDER BY id LIMIT 51").fetchall()]
            assert got == ids
    finally:
        drop_db(plain_dsn, BLOCKED)
