-- outbox_ext storage: the relations every subscription shares. Events live
-- in the log (sql/log.sql); each subscription's progress in its lanes, batches
-- and rows of its own there. The tables here hold policy and bookkeeping.

CREATE SEQUENCE outbox.event_id_seq AS bigint;

-- Per-topic policy. A topic with no row uses the GUC defaults (outbox.max_attempts,
-- outbox.backoff_base, ...). NULL in a column also means "use the GUC".
CREATE TABLE outbox.topics (
    topic               text PRIMARY KEY,
    max_attempts        integer CHECK (max_attempts BETWEEN 1 AND 1000000),
    backoff_base        interval CHECK (backoff_base > interval '0'),
    backoff_max         interval CHECK (backoff_max > interval '0'),
    default_lease       interval CHECK (default_lease > interval '0'),
    dead_letter_policy  text NOT NULL DEFAULT 'block' CHECK (dead_letter_policy IN ('block', 'skip')),
    retention_delivered interval CHECK (retention_delivered >= interval '0'),
    retention_dead      interval CHECK (retention_dead >= interval '0'),
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now()
) WITH (vacuum_truncate = false);  -- read by every claim: see below

-- Subscriptions (consumer groups): each receives the events of its topics
-- from the log (sql/log.sql), with its own leases, retries and dead letters.
-- 'default' is the group every claim without a subscription serves. A row
-- holds the policy that overrides the per-topic settings (NULL: the topic's,
-- then the GUC), whether it is paused, its topic filter and dead-letter policy.
CREATE TABLE outbox.subscription_catalog (
    name                text PRIMARY KEY,
    max_attempts        integer CHECK (max_attempts BETWEEN 1 AND 1000000),
    backoff_base        interval CHECK (backoff_base > interval '0'),
    backoff_max         interval CHECK (backoff_max > interval '0'),
    default_lease       interval CHECK (default_lease > interval '0'),
    paused              boolean NOT NULL DEFAULT false,
    paused_at           timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    -- The topic filter (claim's patterns; NULL: every topic) and the
    -- dead-letter policy (NULL: the topic's).
    topics              text[],
    dead_letter_policy  text CHECK (dead_letter_policy IN ('block', 'skip')),
    -- The age past which a subscription of the log no longer holds
    -- the log's retention (NULL: it holds it until it has read every event).
    max_lag             interval CHECK (max_lag > interval '0')
) WITH (vacuum_truncate = false);  -- read by every claim: see below
-- 'default' exists from install (its lanes: sql/subscriptions.sql).
INSERT INTO outbox.subscription_catalog (name) VALUES ('default');

-- When each subscription was last claimed from. Kept apart from the catalog so
-- that a claim's write (at most once a second per session, and only when no other
-- transaction holds the row) never conflicts with the row lock fail() takes on
-- the policy it reads. Not dumped: it describes this server's workers.
CREATE TABLE outbox.subscription_activity (
    name           text PRIMARY KEY,
    last_claim_at  timestamptz,
    -- Events retention removed before the subscription read them,
    -- because it lagged past its max_lag (outbox._log_rotate), and when.
    lost_events    bigint NOT NULL DEFAULT 0,
    lost_at        timestamptz
) WITH (fillfactor = 50, vacuum_truncate = false);  -- HOT updates from claims
INSERT INTO outbox.subscription_activity (name) VALUES ('default');

-- Dispatch keys (idempotency keys). A key maps to the first event published with it.
-- The row lives as long as its event is retained, or longer: see outbox.purge() and
-- outbox.retention_dispatch_keys.
CREATE TABLE outbox.dispatch_keys (
    dispatch_key text PRIMARY KEY,
    event_id     bigint NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
) WITH (vacuum_truncate = false);  -- publishes with a key write here: see below
CREATE INDEX dispatch_keys_event_idx ON outbox.dispatch_keys (event_id);

-- No table the hot path reads or writes is truncated by vacuum
-- (vacuum_truncate = false): truncating a table's empty tail takes an ACCESS
-- EXCLUSIVE lock, which every claim and publish would then wait for (seen by
-- the concurrency checker), and the space is soon needed again anyway.

-- What the background worker's maintenance runs did.
CREATE SEQUENCE outbox.maintenance_run_seq AS bigint;
CREATE TABLE outbox.maintenance_runs (
    run_id            bigint PRIMARY KEY DEFAULT nextval('outbox.maintenance_run_seq'),
    started_at        timestamptz NOT NULL,
    finished_at       timestamptz,
    purged_delivered  bigint NOT NULL DEFAULT 0,
    purged_dead       bigint NOT NULL DEFAULT 0,
    purged_keys       bigint NOT NULL DEFAULT 0,
    error             text
);

SELECT pg_catalog.pg_extension_config_dump('outbox.topics', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.subscription_catalog', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.dispatch_keys', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.maintenance_runs', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.event_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.maintenance_run_seq', '');

-- outbox.events is defined with the subscriptions (sql/subscriptions.sql).

CREATE VIEW outbox.maintenance_log AS
SELECT run_id, started_at, finished_at, purged_delivered, purged_dead, purged_keys, error
  FROM outbox.maintenance_runs;
COMMENT ON VIEW outbox.maintenance_log IS
'One row per retention run of the background worker (or of outbox.run_maintenance()): when it ran, rows removed per procedure, and any error.';
