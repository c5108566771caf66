-- outbox_ext storage.
--
-- The 'default' subscription made at install keeps its events in two relations
-- (every subscription of the log reads the ring of sql/log.sql instead):
--   outbox.event_queue   the hot relation: pending, leased and dead events only.
--                        Every claim touches it, so it stays small: an ack moves the
--                        row out, and retention removes dead rows.
--   outbox.event_archive delivered and cancelled events, kept for audit and for the
--                        dispatch-key window until outbox.purge() removes them.
-- outbox.events is the UNION ALL of both while that subscription exists, the one
-- place operators read; publish stops writing them once it is dropped.
--
-- Why the split: a SKIP LOCKED queue that keeps delivered rows in its claim index
-- slows down as history grows and as a held xmin keeps dead tuples (the reason
-- PgQ rotates its event tables). Here the claim index only ever covers undelivered work.

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
) WITH (vacuum_truncate = false);  -- read by every claim: see event_queue

-- Subscriptions (consumer groups): each receives the events of its topics, with
-- its own leases, retries and dead letters. 'default' is the group every claim
-- without a subscription serves; the one made at install reads
-- outbox.event_queue (storage 'queue') until it is dropped. Every other
-- subscription, a 'default' created again included (0.10.0), reads the log
-- (storage 'log', sql/log.sql). A row holds the policy that overrides the
-- per-topic settings (NULL: the topic's, then the GUC), whether it is paused,
-- and for a subscription of the log its topic filter and dead-letter policy.
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
    -- 0.9.0: the topic filter (claim's patterns; NULL: every topic) and the
    -- dead-letter policy (NULL: the topic's) of a named subscription.
    topics              text[],
    dead_letter_policy  text CHECK (dead_letter_policy IN ('block', 'skip')),
    -- 0.10.0: which storage the subscription reads. Only the 'default' made
    -- by an install before 0.12.0 reads the queue, until the upgrade moves it
    -- (outbox._default_to_log), and no function makes another one: once none
    -- does, publish writes the log alone (src/publish.rs).
    storage             text NOT NULL DEFAULT 'log' CHECK (storage IN ('queue', 'log')),
    -- 0.10.0: the age past which a subscription of the log no longer holds
    -- the log's retention (NULL: it holds it until it has read every event).
    max_lag             interval CHECK (max_lag > interval '0')
) WITH (vacuum_truncate = false);  -- read by every claim: see event_queue
-- 0.12.0: 'default' reads the log (its lanes: sql/subscriptions.sql).
INSERT INTO outbox.subscription_catalog (name, storage) VALUES ('default', 'log');

-- When each subscription was last claimed from. Kept apart from the catalog so
-- that a claim's write (at most once a second per session, and only when no other
-- transaction holds the row) never conflicts with the row lock fail() takes on
-- the policy it reads. Not dumped: it describes this server's workers.
CREATE TABLE outbox.subscription_activity (
    name           text PRIMARY KEY,
    last_claim_at  timestamptz,
    -- 0.10.0: events retention removed before the subscription read them,
    -- because it lagged past its max_lag (outbox._log_rotate), and when.
    lost_events    bigint NOT NULL DEFAULT 0,
    lost_at        timestamptz
) WITH (fillfactor = 50, vacuum_truncate = false);  -- HOT updates from claims
INSERT INTO outbox.subscription_activity (name) VALUES ('default');

CREATE TABLE outbox.event_queue (
    id              bigint PRIMARY KEY DEFAULT nextval('outbox.event_id_seq'),
    topic           text NOT NULL,
    subject         text,
    dispatch_key    text,
    payload         jsonb NOT NULL,
    headers         jsonb,
    -- 'pending' (ready or waiting for visible_at), 'leased', 'dead'. Only the
    -- extension's functions write this table, so the set is kept by code, not by
    -- a CHECK constraint: PostgreSQL re-reads and re-plans CHECK expressions on
    -- every insert, which cost publish() about 15% of its time.
    state           text NOT NULL DEFAULT 'pending',
    attempts        integer NOT NULL DEFAULT 0,
    max_attempts    integer NOT NULL,
    -- One column serves both timers so one index drives the claim:
    -- pending: when the event becomes claimable (deliver_at or retry time);
    -- leased:  when the lease expires and the event may be claimed again.
    visible_at      timestamptz NOT NULL,
    lease_token     uuid,
    leased_by       text,
    leased_at       timestamptz,
    last_error      text,
    -- Attempt history: one object per failed attempt
    -- {"attempt": n, "at": ts, "worker": w, "error": e}.
    errors          jsonb,
    published_at    timestamptz NOT NULL DEFAULT now(),
    dead_at         timestamptz,
    -- Set when the event went dead under the topic's 'block' policy: a dead event
    -- with blocks_subject keeps later events of its subject unclaimable.
    blocks_subject  boolean NOT NULL DEFAULT false,
    -- True when no earlier live event of the subject exists (always true without a
    -- subject). Only heads are in the claim index, so a subject blocked behind a
    -- dead or slow event costs a claim nothing, however many events queue behind
    -- it. publish() sets it under the subject lock; whatever retires a head
    -- (ack, cancel, dead under 'skip', purge_dead) promotes the next event under the
    -- same lock (see src/subject.rs).
    is_head         boolean NOT NULL DEFAULT true
) WITH (
    fillfactor = 80,
    -- Every event is inserted, updated by its claim and deleted by its ack, so dead
    -- tuples pile up at the rate events flow, whatever the table's size. The
    -- default trigger (20% of the table) lets a drained 100k backlog leave 20k dead
    -- tuples in front of the claim index; vacuum instead after a fixed 5,000, and
    -- unthrottled, since the table is small and every claim pays for its bloat.
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0,
    -- A vacuum that truncates a table's empty tail takes an ACCESS EXCLUSIVE lock,
    -- which every claim and publish then waits for (seen by the concurrency
    -- checker); the queue refills its pages soon anyway. No table the hot path
    -- reads or writes is truncated: topics, event_queue, event_archive,
    -- dispatch_keys, subject_repairs. Their space is reused, not returned.
    vacuum_truncate = false
);

-- The claim index: ready and leased subject heads in claim order. Dead rows and
-- events queued behind an earlier event of their subject are not in it.
CREATE INDEX event_queue_ready_idx ON outbox.event_queue (visible_at, id)
    WHERE state <> 'dead' AND is_head;
-- The per-subject ordering check: "is there an earlier live event of this subject?"
CREATE INDEX event_queue_subject_idx ON outbox.event_queue (subject, id)
    WHERE subject IS NOT NULL;
-- Retention and replay of dead letters.
CREATE INDEX event_queue_dead_idx ON outbox.event_queue (dead_at)
    WHERE state = 'dead';

CREATE TABLE outbox.event_archive (
    id              bigint NOT NULL,
    topic           text NOT NULL,
    subject         text,
    dispatch_key    text,
    payload         jsonb NOT NULL,
    headers         jsonb,
    state           text NOT NULL,   -- 'delivered' or 'cancelled' (no CHECK: see event_queue.state)
    attempts        integer NOT NULL,
    max_attempts    integer NOT NULL,
    leased_by       text,
    last_error      text,
    errors          jsonb,
    published_at    timestamptz NOT NULL,
    finished_at     timestamptz NOT NULL
) WITH (vacuum_truncate = false);  -- every ack writes here: see event_queue
-- Every ack inserts here, so the archive carries only BRIN indexes: rows arrive
-- in finished_at order and nearly in id order, so both stay selective, and a BRIN
-- insert costs the ack almost nothing where a btree primary key cost a page
-- descent per event. Ids are unique by construction (they come from
-- event_queue's primary key and move here exactly once).
CREATE INDEX event_archive_finished_brin ON outbox.event_archive USING brin (finished_at);
CREATE INDEX event_archive_id_brin ON outbox.event_archive USING brin (id) WITH (pages_per_range = 8);

-- Dispatch keys (idempotency keys). A key maps to the first event published with it.
-- The row lives as long as its event is retained, or longer: see outbox.purge() and
-- outbox.retention_dispatch_keys.
CREATE TABLE outbox.dispatch_keys (
    dispatch_key text PRIMARY KEY,
    event_id     bigint NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
) WITH (vacuum_truncate = false);  -- publishes with a key write here: see event_queue
CREATE INDEX dispatch_keys_event_idx ON outbox.dispatch_keys (event_id);

-- Subjects whose next head could not be promoted without waiting (a publisher of
-- the subject held its lock, the transaction's lock budget was spent, or the new
-- head's row was locked); every claim() retries a bounded number of them,
-- skipping rows other claims hold (src/subject.rs). No unique key: an insert must never wait for
-- another transaction's uncommitted insert of the same subject, and duplicates
-- cost one extra promotion attempt. Dumped, because a lost row could leave a
-- subject without a head until a maintenance repair.
CREATE TABLE outbox.subject_repairs (
    subject text NOT NULL
) WITH (vacuum_truncate = false);  -- every claim deletes from it: see event_queue

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
SELECT pg_catalog.pg_extension_config_dump('outbox.event_queue', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.event_archive', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.dispatch_keys', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.maintenance_runs', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.subject_repairs', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.event_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.maintenance_run_seq', '');

-- outbox.events is defined with the subscriptions (sql/subscriptions.sql): from
-- 0.10.0 it reads the log once the queue's 'default' subscription is dropped.

CREATE VIEW outbox.maintenance_log AS
SELECT run_id, started_at, finished_at, purged_delivered, purged_dead, purged_keys, error
  FROM outbox.maintenance_runs;
COMMENT ON VIEW outbox.maintenance_log IS
'One row per retention run of the background worker (or of outbox.run_maintenance()): when it ran, rows removed per procedure, and any error.';
