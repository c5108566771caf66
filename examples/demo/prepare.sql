-- Demo schema, run once after `pgbench -i`.

CREATE EXTENSION IF NOT EXISTS outbox_ext;

-- A key per history row, shared with the row's event (see tpcb_outbox.sql).
-- pgbench -i leaves pgbench_history empty, so every row gets one.
ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY;

-- Five attempts: the handler fails normal events at most on their first two
-- attempts, so only the poison event can use them all up and go dead.
SELECT outbox.create_topic('bank.account.updated',
                           max_attempts  => 5,
                           default_lease => interval '10 seconds');

-- Two consumers of the same events, each with its own workers, retries, dead
-- letters and order (named subscriptions, over one log): publishing writes each
-- event once, whatever the number of subscriptions.
SELECT outbox.create_subscription('ledger', topics => ARRAY['bank.*']);
SELECT outbox.create_subscription('notifications', topics => ARRAY['bank.account.*']);

CREATE SCHEMA demo;

-- Timestamps of the pgbench run, written by scripts/demo.sh. Workers start draining
-- for good once pgbench_finished is set.
CREATE TABLE demo.run (
    id               int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    pgbench_started  timestamptz,
    pgbench_finished timestamptz
);
INSERT INTO demo.run DEFAULT VALUES;

-- One row per ack() that returned true, inserted by the worker in the same
-- transaction as that ack: the row exists iff the ack committed. event_id is
-- deliberately not unique, so a second successful ack of one event would show up
-- as a duplicate here instead of being hidden by a constraint error. seq gives the
-- global delivery order (per-subject order check).
CREATE TABLE demo.deliveries (
    seq      bigserial PRIMARY KEY,
    subscription text NOT NULL,
    event_id bigint NOT NULL,
    worker   text NOT NULL,
    attempt  int NOT NULL,
    acked_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- One row per fail() call, with what it returned, in the same transaction.
CREATE TABLE demo.failures (
    subscription text NOT NULL,
    event_id  bigint NOT NULL,
    worker    text NOT NULL,
    attempt   int NOT NULL,
    result    text NOT NULL,
    error     text NOT NULL,
    failed_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Each worker's own counters, written when it exits.
CREATE TABLE demo.worker_stats (
    worker       text PRIMARY KEY,
    subscription text NOT NULL,
    batches      bigint NOT NULL,
    claimed      bigint NOT NULL,
    acked        bigint NOT NULL,
    ack_stale    bigint NOT NULL,
    fail_pending bigint NOT NULL,
    fail_dead    bigint NOT NULL,
    fail_stale   bigint NOT NULL,
    wakeups      bigint NOT NULL,
    drained      boolean NOT NULL,
    exited_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
