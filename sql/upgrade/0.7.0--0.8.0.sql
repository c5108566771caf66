-- 0.7.0 -> 0.8.0: the event log ring and its readers (sql/log.sql), written
-- beside the queue when outbox.log_write is on. The tables' DDL as in
-- sql/log.sql (no diff can derive a CREATE TABLE); the functions, the view
-- and their comments come from the generator.

DO $$
BEGIN
    FOR n IN 0..3 LOOP
        EXECUTE pg_catalog.format($ddl$
            CREATE TABLE outbox.log_%1$s (
                id           bigint      NOT NULL,
                txid         xid8        NOT NULL,
                lane         smallint    NOT NULL,
                topic        text        NOT NULL,
                subject      text,
                dispatch_key text,
                payload      jsonb       NOT NULL,
                headers      jsonb,
                max_attempts integer     NOT NULL,
                published_at timestamptz NOT NULL,
                deliver_at   timestamptz
            ) WITH (vacuum_truncate = false);
            CREATE INDEX log_%1$s_lane_id ON outbox.log_%1$s (lane, id);
            CREATE INDEX log_%1$s_txid ON outbox.log_%1$s (txid, lane);
        $ddl$, n);
    END LOOP;
END
$$;

-- The ring's state: one row per ring table in use. The open table (opened,
-- not sealed) is the one publishers append to; with no row at all (a fresh
-- install, before the first rotation) that is log_0. A sealed table takes no
-- new events (but see src/log/mod.rs on a publisher's stale copy) and is truncated
-- once its retention has passed since the last event written to it
-- (sealed_snap: transactions not visible in it, running at the seal or begun
-- after, may have written after the seal); its row is then deleted, and the
-- table is free. No row is made at
-- install. Written only by outbox._log_rotate, whose changes a statement trigger
-- turns into a relcache invalidation for every backend's copy, as for
-- outbox.topics.
CREATE TABLE outbox.log_state (
    n          smallint    PRIMARY KEY CHECK (n BETWEEN 0 AND 3),
    opened_at  timestamptz NOT NULL,
    sealed_at  timestamptz CHECK (sealed_at >= opened_at),
    sealed_snap pg_snapshot,
    CHECK ((sealed_at IS NULL) = (sealed_snap IS NULL))
) WITH (vacuum_truncate = false);  -- read by publishers: see event_queue
CREATE TRIGGER log_state_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.log_state
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._topics_changed();
ALTER TABLE outbox.log_state ENABLE ALWAYS TRIGGER log_state_changed;

-- Readers' positions (src/log/claim.rs): one row per (subscription, lane).
-- (lo_*) is the lane's cursor: every event of the lane visible in lo_snap is
-- finished for the subscription. (hi_*) is the window being read, when there
-- is one: the events visible in hi_snap and not in lo_snap; pos is the last id
-- of that window already put in a batch. batch is the lane's batch in flight:
-- at most one per lane, so a lane's events are handed out in order. Updated
-- by claims only (acks write the batch row alone), under _lock_row: a claim
-- skips a lane another one holds.
CREATE TABLE outbox.log_lanes (
    subscription text        NOT NULL,
    lane         smallint    NOT NULL CHECK (lane BETWEEN 0 AND 15),
    lo_snap      pg_snapshot NOT NULL,
    lo_m         bigint      NOT NULL,
    lo_xn        xid8        NOT NULL,
    hi_snap      pg_snapshot,
    hi_m         bigint,
    hi_xn        xid8,
    pos          bigint,
    batch        bigint,
    PRIMARY KEY (subscription, lane)
) WITH (fillfactor = 50, vacuum_truncate = false);  -- HOT updates by every claim

-- Batches in flight: a slice of one lane's window, leased in rounds. state is
-- src/log/batch.rs's encoding (ids, per-event state, rounds, each round's
-- lease expiry). A finished batch is deleted.
CREATE SEQUENCE outbox.log_batch_seq AS bigint;
CREATE TABLE outbox.log_batches (
    id           bigint      PRIMARY KEY,
    subscription text        NOT NULL,
    lane         smallint    NOT NULL,
    state        bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50, vacuum_truncate = false);  -- HOT updates by every ack
