-- 0.7.0 -> 0.8.0: the event log ring (sql/log.sql), written beside the queue
-- when outbox.log_write is on. The tables' DDL as in sql/log.sql (no diff can
-- derive a CREATE TABLE); the function and its comment come from the generator.

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
            SELECT pg_catalog.pg_extension_config_dump('outbox.log_%1$s', '');
        $ddl$, n);
    END LOOP;
END
$$;

-- The ring's state: one row per ring table in use. The open table (opened,
-- not sealed) is the one publishers append to; with no row at all (a fresh
-- install, before the first rotation) that is log_0. A sealed table takes no
-- new events (but see src/log.rs on a publisher's stale copy) and is truncated
-- once its retention has passed; its row is then deleted, and the table is
-- free. No row is made at install, so a dump restores its rows into an empty
-- table. Written only by outbox._log_rotate, whose changes a statement trigger
-- turns into a relcache invalidation for every backend's copy, as for
-- outbox.topics.
CREATE TABLE outbox.log_state (
    n          smallint    PRIMARY KEY CHECK (n BETWEEN 0 AND 3),
    opened_at  timestamptz NOT NULL,
    sealed_at  timestamptz CHECK (sealed_at >= opened_at)
) WITH (vacuum_truncate = false);  -- read by publishers: see event_queue
SELECT pg_catalog.pg_extension_config_dump('outbox.log_state', '');
CREATE TRIGGER log_state_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.log_state
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._topics_changed();
ALTER TABLE outbox.log_state ENABLE ALWAYS TRIGGER log_state_changed;
