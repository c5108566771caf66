"""Every statement the benchmark runs against each system, in one place.

The report prints these strings verbatim, so a reader sees exactly what was
compared. Placeholders are psycopg's %s / %(name)s; pgbench scripts use the
literal payload.
"""

import json

# One payload for every system and scenario: a typical order event, ~200 bytes.
PAYLOAD_OBJ = {
    "type": "order.created",
    "order_id": 918273645,
    "customer_id": 5551234,
    "currency": "EUR",
    "total_cents": 129900,
    "items": [{"sku": "SKU-100-RED", "qty": 2}, {"sku": "SKU-200-BLU", "qty": 1}],
    "note": "benchmark payload of about two hundred bytes",
}
PAYLOAD = json.dumps(PAYLOAD_OBJ, separators=(",", ":"))
assert 180 <= len(PAYLOAD) <= 230, len(PAYLOAD)


def jsonb_array_literal(n):
    """A jsonb[] text literal holding n copies of PAYLOAD (built once, reused)."""
    elem = '"' + PAYLOAD.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "{" + ",".join([elem] * n) + "}"


# ---------------------------------------------------------------------------
# Schema of the baselines
# ---------------------------------------------------------------------------
PLAIN_SCHEMA = """\
CREATE TABLE bench_plain (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic      text        NOT NULL,
    payload    jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    visible_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX bench_plain_visible_idx ON bench_plain (visible_at, id);"""

PGQ_SCHEMA = """\
CREATE EXTENSION pgq;
SELECT pgq.create_queue('bench_q');"""

OUTBOX_SCHEMA = "CREATE EXTENSION outbox_ext;"
# ---------------------------------------------------------------------------
# Scenario 1: publish, one event per transaction (pgbench scripts)
# ---------------------------------------------------------------------------
def _lit(s):
    return "'" + s.replace("'", "''") + "'"


PUB1 = {
    # outbox.notify is set per session through PGOPTIONS for the three outbox modes.
    "outbox": f"SELECT outbox.publish('bench.publish', {_lit(PAYLOAD)}::jsonb);\n",
    "plain": f"INSERT INTO bench_plain (topic, payload) VALUES ('bench.publish', {_lit(PAYLOAD)}::jsonb);\n",
    "plain_notify": (
        "BEGIN;\n"
        f"INSERT INTO bench_plain (topic, payload) VALUES ('bench.publish', {_lit(PAYLOAD)}::jsonb);\n"
        "SELECT pg_notify('outbox', 'bench.publish');\n"
        "END;\n"
    ),
    "pgq": f"SELECT pgq.insert_event('bench_q', 'bench.publish', {_lit(PAYLOAD)});\n",
}

# The log ring, where every publish appends its event: outbox.log_0 .. log_3,
# outbox.log_state naming the table being written (no row: log_0).
LOG_RING = [f"outbox.log_{i}" for i in range(4)]
LOG_TABLES = LOG_RING + ["outbox.log_state"]
# The outbox emptied (the ring, the readers' batches, rows of their own and
# delivery records, dispatch keys), each subscription's lanes read up to a
# cursor taken now.
LOG_RESET = ("DO $$ BEGIN TRUNCATE " + ", ".join(LOG_TABLES) + ", outbox.log_batches, outbox.log_exceptions,"
             " outbox.log_delivered, outbox.dispatch_keys;\n"
             " UPDATE outbox.log_lanes SET lo_snap = c.snap, lo_m = c.m, lo_xn = c.xn, hi_snap = NULL, hi_m = NULL,"
             " hi_xn = NULL, pos = NULL, batch = NULL, skips = NULL FROM outbox._log_cursor() AS c;"
             # lanes a reset of the readers' tables took (LOG_DRAIN_RESET) start now
             " PERFORM outbox._log_subscribe(s.name, 'now') FROM outbox.subscription_catalog s; END $$")
# VACUUM ANALYZE of what a drain of the log reads and writes.
LOG_VACUUM = "VACUUM ANALYZE " + ", ".join(LOG_RING + ["outbox.log_lanes", "outbox.log_batches", "outbox.log_exceptions"])
# What 'default' has not delivered yet.
DEFAULT_LEFT = "SELECT lag_events FROM outbox.subscriptions WHERE name = 'default'"
LOG_ROWS = "SELECT " + " + ".join(f"(SELECT count(*) FROM {t})" for t in LOG_RING)
# 1 when the installed SQL has the log ring (0.8.0 and later)
HAS_LOG_RING = "SELECT to_regclass('outbox.log_state') IS NOT NULL"

# Named subscriptions: consumer groups beside 'default'. Scenario 1 publishes
# with some of them existing, scenario 10 drains them.
HAS_SUBSCRIPTIONS = (
    "SELECT count(DISTINCT p.proname) = 2 FROM pg_proc p"
    " WHERE p.pronamespace = to_regnamespace('outbox')"
    " AND p.proname IN ('create_subscription', 'drop_subscription')"
)
SUBSCRIPTIONS_NAMED = "SELECT name FROM outbox.subscription_catalog WHERE name <> 'default' ORDER BY name"
SUBSCRIPTION_CREATE = "SELECT outbox.create_subscription(%(name)s)"
SUBSCRIPTION_DROP = "SELECT outbox.drop_subscription(%(name)s, force => true)"


# ---------------------------------------------------------------------------
# Scenario 2: publish 1,000 events per transaction (psycopg, one autocommit
# statement = one transaction; %s is a jsonb[] literal of 1,000 payloads)
# ---------------------------------------------------------------------------
PUB_BATCH = {
    "outbox_batch": "SELECT count(*) FROM outbox.publish_batch('bench.batch', %s::jsonb[])",
    "plain_multirow": "INSERT INTO bench_plain (topic, payload) SELECT 'bench.batch', p FROM unnest(%s::jsonb[]) AS p",
    "outbox_loop": "SELECT count(outbox.publish('bench.batch', p)) FROM unnest(%s::jsonb[]) AS p",
    # The application-side loop: BEGIN; 1,000 x this statement (one round trip each); COMMIT.
    "outbox_client_loop": "SELECT outbox.publish('bench.batch', %s::jsonb)",
}

# ---------------------------------------------------------------------------
# Backlog loading (not timed)
# ---------------------------------------------------------------------------
LOAD = {
    # %(n)s events per call; chunks stay below outbox.max_batch_size.
    "outbox": (
        "SELECT count(*) FROM outbox.publish_batch(%(topic)s,"
        " (SELECT array_agg(%(payload)s::jsonb) FROM generate_series(1, %(n)s::int)))"
    ),
    "outbox_subjects": (
        "SELECT count(*) FROM outbox.publish_batch(%(topic)s,"
        " (SELECT array_agg(%(payload)s::jsonb ORDER BY g) FROM generate_series(%(first)s::int, %(first)s::int + %(n)s::int - 1) g),"
        " (SELECT array_agg('subject-' || (g %% %(subjects)s::int) ORDER BY g) FROM generate_series(%(first)s::int, %(first)s::int + %(n)s::int - 1) g))"
    ),
    "plain": (
        "INSERT INTO bench_plain (topic, payload)"
        " SELECT %(topic)s, %(payload)s::jsonb FROM generate_series(1, %(n)s::int)"
    ),
    # A DO block takes no parameters: {placeholders} are filled in by the harness.
    # PgQ batches are the events between two ticks: one tick per drain batch,
    # committed between chunks so that each tick's snapshot sees its chunk.
    "pgq": """\
DO $$
BEGIN
    PERFORM pgq.set_queue_config('bench_q', 'ticker_max_count', '{batch}');
    FOR i IN 1..{chunks} LOOP
        PERFORM pgq.insert_event('bench_q', 'bench.drain', {payload_lit}) FROM generate_series(1, {batch});
        COMMIT;
        PERFORM pgq.ticker('bench_q');
        COMMIT;
    END LOOP;
END $$""",
}

# ---------------------------------------------------------------------------
# Scenario 3/6/8: drain (claim and ack as separate autocommit statements)
# ---------------------------------------------------------------------------
DRAIN = {
    "outbox": {
        "claim": "SELECT id, lease_token, topic, payload FROM outbox.claim(%(worker)s, %(batch)s::int)",
        "ack": "SELECT outbox.ack(%(ids)s::bigint[], %(tokens)s::uuid[])",
    },
    "plain": {
        "claim": (
            "WITH c AS (\n"
            "    SELECT id FROM bench_plain\n"
            "     WHERE visible_at <= now()\n"
            "     ORDER BY visible_at, id\n"
            "     LIMIT %(batch)s::int\n"
            "     FOR UPDATE SKIP LOCKED\n"
            ")\n"
            "UPDATE bench_plain p SET visible_at = now() + interval '30 seconds'\n"
            "  FROM c WHERE p.id = c.id\n"
            "RETURNING p.id, p.topic, p.payload"
        ),
        "ack": "DELETE FROM bench_plain WHERE id = ANY(%(ids)s::bigint[])",
    },
    # Scenario 10: outbox.claim with the payload cast to text in the select list
    # (as the log drain's claim does), so that every system's claim sends the
    # payload as text in the same way; the ack is outbox's.
    "outbox_text": {
        "claim": "SELECT id, lease_token, topic, payload::text FROM outbox.claim(%(worker)s, %(batch)s::int)",
        "ack": "SELECT outbox.ack(%(ids)s::bigint[], %(tokens)s::uuid[])",
    },
    "pgq": {
        "next": "SELECT pgq.next_batch('bench_q', 'bench_c')",
        "events": "SELECT ev_id, ev_type, ev_data FROM pgq.get_batch_events(%(batch_id)s)",
        "finish": "SELECT pgq.finish_batch(%(batch_id)s)",
    },
}

# Scenario 4: publishing one event per autocommit statement (the id is needed to
# match the event with its ack).
E2E_PUBLISH = {
    "outbox": "SELECT outbox.publish('bench.e2e', %(payload)s::jsonb)",
    "plain_notify": (
        "WITH i AS (INSERT INTO bench_plain (topic, payload) VALUES ('bench.e2e', %(payload)s::jsonb) RETURNING id)\n"
        "SELECT id, pg_notify('outbox', 'bench.e2e') FROM i"
    ),
    # scenario 12
    "pgq": "SELECT pgq.insert_event('bench_q', 'bench.e2e', %(payload)s)",
}

# ---------------------------------------------------------------------------
# Scenario 6: history, held snapshot, ring TRUNCATE
# ---------------------------------------------------------------------------
# 6a's history: the install's `default` subscription has acked every retained
# event; dead letters of its own (rows in outbox.log_exceptions) through the
# API: claim, fail permanently, up to 1,000 per round (nothing else is unread
# then, so every claimed event is one).
LOG_HIST_DEADLETTER = """\
SELECT count(outbox.fail(c.id, c.lease_token, 'boom', permanent => true))
  FROM outbox.claim('bench-dead', %(n)s::int) AS c"""
LOG_DELIVERED_RESET = "TRUNCATE outbox.log_delivered"
DEFAULT_STATE = (
    "SELECT lag_events, leases_in_flight, dead_letters FROM outbox.subscriptions WHERE name = 'default'"
)
# The relations a subscription of the log writes as it claims and acks (the
# ring is append-only: publish writes it once), whose n_dead_tup 6b and 8 report
# for the log variant. LOG_HOT_SHORT: their names in results.csv and the report.
LOG_HOT = ["outbox.log_lanes", "outbox.log_batches", "outbox.log_exceptions"] + LOG_RING
LOG_HOT_SHORT = [t.split(".", 1)[1] for t in LOG_HOT]
# 6a: autovacuum off for these while the history is made and measured, so the
# dead tuples of the history's claims, acks and fails stay.
LOG_WRITTEN = ["outbox.log_lanes", "outbox.log_batches", "outbox.log_exceptions"]
REL_STATS = (
    "SELECT relid::regclass::text, n_dead_tup, n_live_tup, autovacuum_count FROM pg_stat_user_tables"
    " WHERE relid = ANY(ARRAY(SELECT to_regclass(r) FROM unnest(%s::text[]) AS r))"
)
REL_SIZE = "SELECT sum(pg_total_relation_size(to_regclass(r)))::bigint FROM unnest(%s::text[]) AS r"

HOLD_XMIN = "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox.topics; -- kept open"

# 6c: the log step of maintenance (outbox._log_rotate(), what the background
# worker and run_maintenance() run), called in a loop by another session with a
# short outbox.retention_delivered, so that it seals the open ring table and
# truncates sealed ones the readers have passed while the workers drain.
ROTATE_SET = "SELECT set_config('outbox.retention_delivered', %s, false)"
ROTATE = "SELECT outbox._log_rotate()"
RING_STATE = "SELECT count(*) FILTER (WHERE sealed_at IS NOT NULL), count(*) FROM outbox.log_state"

DEAD_TUP = (
    "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables WHERE relid = %s::regclass"
)

# ---------------------------------------------------------------------------
# EXPLAIN captures
# ---------------------------------------------------------------------------
AUTO_EXPLAIN = [
    "LOAD 'auto_explain'",
    "SET auto_explain.log_min_duration = 0",
    "SET auto_explain.log_nested_statements = on",
    "SET auto_explain.log_analyze = on",
    "SET auto_explain.log_buffers = on",
]

EXPLAIN_CLAIM = "SELECT count(*) FROM outbox.claim('explain-worker', 100)"

# One blocked subject with a leased head (a slow handler) and its queued
# followers, all older than the 10,000 active subjects' events.
SETUP_BLOCKED_STMTS = [
    "SELECT outbox.publish('bench.subjects', %(payload)s::jsonb, subject => 'blocked-subject')",
    # leases the head only: a slow handler holds it
    "SELECT count(*) FROM outbox.claim('slow-handler', 1)",
    "SELECT count(*) FROM outbox.publish_batch('bench.subjects',\n"
    "    (SELECT array_agg(%(payload)s::jsonb) FROM generate_series(1, %(blocked)s::int)),\n"
    "    (SELECT array_agg('blocked-subject'::text) FROM generate_series(1, %(blocked)s::int)))",
    # run for lo..hi in chunks of 1,000 subjects: publish_batch takes one advisory
    # lock per distinct subject, and 10,000 overflow the default lock table
    "SELECT count(*) FROM outbox.publish_batch('bench.subjects',\n"
    "    (SELECT array_agg(%(payload)s::jsonb) FROM generate_series(%(lo)s::int, %(hi)s::int)),\n"
    "    (SELECT array_agg('active-' || g ORDER BY g) FROM generate_series(%(lo)s::int, %(hi)s::int) g))",
]
SETUP_BLOCKED = ";\n".join(SETUP_BLOCKED_STMTS) + ";"

# A dead letter under 'block' (the default policy) with a pile parked behind it:
# its subject's first event fails for good, then `pile` more events of it are
# published and read past by claims (each parked behind the dead letter, in
# outbox.log_exceptions); the last statement runs until they all are.
SETUP_DEAD_STMTS = [
    "SELECT outbox.publish('bench.subjects', %(payload)s::jsonb, subject => 'dead-subject')",
    "SELECT outbox.fail(c.id, c.lease_token, 'bench', permanent => true) FROM outbox.claim('bench-dlq', 1) c",
    "SELECT count(outbox.publish('bench.subjects', %(payload)s::jsonb, subject => 'dead-subject'))\n"
    "  FROM generate_series(1, %(pile)s::int)",
    "SELECT count(*) FROM outbox.claim('bench-park', 100)",
]
SETUP_DEAD = ";\n".join(SETUP_DEAD_STMTS) + ";  -- (the last one until every event of the pile is parked)"
DEAD_PARKED = "SELECT count(*) FROM outbox.log_exceptions WHERE subject = 'dead-subject' AND state = 'pending'"

SETUP_FUTURE_STMTS = [  # the ready events are published first
    "SELECT count(outbox.publish('bench.future', %(payload)s::jsonb, deliver_at => now() + interval '1 day'))\n"
    "  FROM generate_series(1, %(future)s::int)",
    "SELECT count(*) FROM outbox.publish_batch('bench.ready',\n"
    "    (SELECT array_agg(%(payload)s::jsonb) FROM generate_series(1, %(ready)s::int)))",
]
SETUP_FUTURE = ";\n".join(SETUP_FUTURE_STMTS) + ";"

# ---------------------------------------------------------------------------
# Scenario 7: many databases. Publish load: the pgbench scripts of scenario 1
# (PUB1['outbox'] with outbox.notify=background, PUB1['plain']) in every database.
# Wake-up probes: one publish per autocommit statement, each to its own topic
# (the notification's payload is the topic), heard by a LISTEN session in the same
# database.
MULTIDB_PROBE = "SELECT outbox.publish(%(topic)s, %(payload)s::jsonb)"
MULTIDB_LISTEN = "LISTEN outbox"

# ---------------------------------------------------------------------------
# Scenario 8: a session idle in a transaction that holds a transaction id. Its
# xid holds back the xmin horizon of the whole cluster (VACUUM keeps every dead
# tuple since), and the log's readers cannot read past its position in the
# ring while it is open. Publishers: E2E_PUBLISH['outbox']; workers: LISTEN
# outbox + the claim and ack of DRAIN['outbox'] (the `default` subscription).
HOLD_XID_STMTS = ["BEGIN", "SELECT txid_current()"]
HOLD_XID = "BEGIN;\nSELECT txid_current();\n-- idle in transaction for the held phase, then\nCOMMIT;"
HOLDER_STATE = "SELECT state, backend_xid::text, backend_xmin::text FROM pg_stat_activity WHERE pid = %s"

# ---------------------------------------------------------------------------
# Scenario 9: payload output. The same payload in a jsonb, a json and a text
# column of three scratch tables; read over the wire in text format in keyset
# batches, and converted to text on the server alone. The json and text columns
# hold jsonb's text form of the payload (what a log storing text would keep of
# publish's jsonb argument), so every type sends the same bytes.
PAYLOAD_TYPES = ["jsonb", "json", "text"]
PAYLOAD_TABLE = "bench_payload_{type}"
PAYLOAD_SCHEMA = "CREATE TABLE {table} (id bigint PRIMARY KEY, payload {type} NOT NULL)"
PAYLOAD_LOAD = (
    "INSERT INTO {table} (id, payload)"
    " SELECT g, %(payload)s::jsonb::text::{type} FROM generate_series(%(first)s::bigint, %(last)s::bigint) g"
)
# ids are 1..N without gaps: the batch after one that ended at id k reads id > k
PAYLOAD_READ = "SELECT payload FROM {table} WHERE id > %(after)s::bigint ORDER BY id LIMIT {batch}"
PAYLOAD_CONVERT = "SELECT sum(length(payload::text)) FROM {table}"
PAYLOAD_BYTES = "SELECT avg(octet_length(payload::text))::float8, count(*) FROM {table}"

# ---------------------------------------------------------------------------
# Scenario 10: draining the log through named subscriptions (0.9.0's public
# API). Before each drain every named subscription is dropped, then the ring,
# its state, the lanes, batches and exception rows are emptied; then the
# readers are created (create_subscription: a cursor taken now), then the
# backlog is published (publish_batch, chunks of 10,000 events, each its own
# transaction): every event goes to the log once, and each named subscription
# reads it once ('default' loses its lanes here and is not read).
LOG_READER = "bench"
LOG_DRAIN_RESET = ("TRUNCATE " + ", ".join(LOG_TABLES) + ", outbox.log_lanes, outbox.log_batches,"
                   " outbox.log_exceptions, outbox.dispatch_keys")
# The ids come back in input order (publish_batch's contract): the harness keeps
# them to check that each is acked exactly once, and knows each one's subject.
LOG_LOAD = (
    "SELECT array_agg(e.id ORDER BY e.ord) FROM outbox.publish_batch(%(topic)s,"
    " (SELECT array_agg(%(payload)s::jsonb) FROM generate_series(1, %(n)s::int))) WITH ORDINALITY AS e(id, ord)"
)
# subjects 'acct:0' .. 'acct:<subjects - 1>' round robin over the whole backlog
# (%(first)s: the position of the chunk's first event in the backlog)
LOG_LOAD_SUBJECTS = (
    "SELECT array_agg(e.id ORDER BY e.ord) FROM outbox.publish_batch(%(topic)s,"
    " (SELECT array_agg(%(payload)s::jsonb) FROM generate_series(1, %(n)s::int)),"
    " (SELECT array_agg('acct:' || (g %% %(subjects)s::int) ORDER BY g)"
    " FROM generate_series(%(first)s::int, %(first)s::int + %(n)s::int - 1) g)) WITH ORDINALITY AS e(id, ord)"
)
LOG_VACUUM = "VACUUM ANALYZE " + ", ".join(LOG_RING) + ", outbox.log_lanes"
# Left behind by a drain whose every event was acked: finished batches are
# deleted by their last ack; an exception row means an event left its batch
# (a lease expired) and was delivered again from there.
LOG_LEFT = "SELECT (SELECT count(*) FROM outbox.log_batches), (SELECT count(*) FROM outbox.log_exceptions)"
# One claim round trip and one ack round trip per batch: the ack is the batch
# form, with each event's own lease token (fenced per event; the events of one
# lane's batch round may share a token). The payload is selected as text.
LOG_DRAIN = {
    "claim": (
        "SELECT id, topic, subject, payload::text, headers, lease_token\n"
        "  FROM outbox.claim(%(worker)s, %(batch)s::int, interval '30 seconds', subscription => %(reader)s)"
    ),
    "ack": "SELECT outbox.ack(%(ids)s::bigint[], %(tokens)s::uuid[])",
}
# column of lease_token in LOG_DRAIN['claim']
LOG_TOKEN_COL = 5

# ---------------------------------------------------------------------------
# Scenario 6d: a session holds one claimed event of `default` in an open
# transaction (idle) while 2 workers drain a backlog.
HOLD_CLAIM_STMTS = ["BEGIN", "SELECT id, lease_token FROM outbox.claim('bench-holder', 1)"]
HOLD_CLAIM = ("BEGIN;\nSELECT id, lease_token FROM outbox.claim('bench-holder', 1);\n"
              "-- idle in transaction until the drain ends, then\nROLLBACK;")

# ---------------------------------------------------------------------------
# Scenario 12: streaming. Publish: E2E_PUBLISH; workers: LISTEN outbox + the
# claim and ack of DRAIN (outbox, plain); PgQ: one consumer (DRAIN['pgq']) and
# a ticker session of the harness, after the queue's configuration below.
PGQ_STREAM_CONFIG = [
    "SELECT pgq.set_queue_config('bench_q', 'ticker_max_count', '100')",
    # every ticker call that finds new events ticks
    "SELECT pgq.set_queue_config('bench_q', 'ticker_max_lag', '0')",
]
PGQ_TICK = "SELECT pgq.ticker('bench_q')"
# Rows written (inserted + updated + deleted) in each system's own tables, and
# (outbox) the rows inserted into outbox.log_exceptions; read after the
# statistics were flushed (pg_stat_clear_snapshot() first).
_ROWS = ("SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint,"
         " coalesce(sum(n_tup_ins) FILTER (WHERE relname = 'log_exceptions'), 0)::bigint"
         " FROM pg_stat_user_tables WHERE ")
ROWS_WRITTEN = {
    "outbox": _ROWS + "schemaname = 'outbox'",
    "plain_notify": _ROWS + "relid = 'bench_plain'::regclass",
    "pgq": _ROWS + "schemaname = 'pgq'",
}
