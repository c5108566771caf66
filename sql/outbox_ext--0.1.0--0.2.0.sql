-- outbox_ext 0.1.0 -> 0.2.0
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.2.0'" to load this file. \quit

-- The C functions pin their search path themselves now (src/fcall.rs,
-- pin_search_path); the per-call SET clause cost publish() a fifth of its time.
ALTER FUNCTION outbox.publish(text, jsonb, text, text, jsonb, timestamptz) RESET search_path;
ALTER FUNCTION outbox.publish_batch(text, jsonb[], text[], text[]) RESET search_path;
ALTER FUNCTION outbox.claim(text, integer, interval, text[]) RESET search_path;
ALTER FUNCTION outbox.ack(bigint, uuid) RESET search_path;
ALTER FUNCTION outbox.ack(bigint[], uuid[]) RESET search_path;
ALTER FUNCTION outbox.fail(bigint, uuid, text, interval, boolean) RESET search_path;
ALTER FUNCTION outbox.extend_lease(bigint, uuid, interval) RESET search_path;
ALTER FUNCTION outbox.backoff_delay(integer, interval, interval, boolean) RESET search_path;

-- Vacuum the hot relation after a fixed number of dead tuples (see sql/schema.sql).
ALTER TABLE outbox.event_queue SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- Retention batches pause outbox.purge_delay between them (sql/retention.sql).
CREATE FUNCTION outbox._purge_pause() RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT pg_catalog.pg_sleep(pg_catalog.date_part('epoch', outbox._setting('outbox.purge_delay')::interval)) $$;

COMMENT ON FUNCTION outbox._purge_pause() IS
'Sleeps outbox.purge_delay (ms; 0 = returns at once); returns void. Called by outbox.purge() and outbox.purge_dead() between committed batches. No errors of its own.';
ALTER FUNCTION outbox._purge_pause() SECURITY DEFINER;
REVOKE EXECUTE ON FUNCTION outbox._purge_pause() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._purge_pause() TO outbox_admin;

CREATE OR REPLACE PROCEDURE outbox.purge(older_than interval DEFAULT NULL, batch_size integer DEFAULT 1000, INOUT removed bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    n bigint;
BEGIN
    removed := 0;
    LOOP
        n := outbox._purge_step('delivered', older_than, batch_size);
        removed := removed OPERATOR(pg_catalog.+) n;
        COMMIT;
        EXIT WHEN n OPERATOR(pg_catalog.<) batch_size;
        PERFORM outbox._purge_pause();
    END LOOP;
    LOOP
        n := outbox._purge_step('keys', NULL, batch_size);
        COMMIT;
        EXIT WHEN n OPERATOR(pg_catalog.<) batch_size;
    END LOOP;
END
$$;

COMMENT ON PROCEDURE outbox.purge(interval, integer, bigint) IS
'Delete delivered and cancelled events finished more than older_than ago (NULL = the topic''s retention_delivered, else outbox.retention_delivered, 7 days), '
'batch_size rows per transaction (1..outbox.max_batch_size), committing after each batch, waiting outbox.purge_delay (ms, default 20) between batches and skipping rows that are locked. Never touches pending, leased or dead events. '
'Reports the rows removed in its INOUT column removed. Run it with CALL outside an explicit transaction block. '
'Errors: 22023 negative older_than or batch_size < 1; 54000 batch_size over the limit. Follows seed 000 (retention with audit window) and PgQ-style maintenance procedures.';

CREATE OR REPLACE PROCEDURE outbox.purge_dead(older_than interval DEFAULT NULL, batch_size integer DEFAULT 1000, INOUT removed bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    n bigint;
BEGIN
    removed := 0;
    LOOP
        n := outbox._purge_step('dead', older_than, batch_size);
        removed := removed OPERATOR(pg_catalog.+) n;
        COMMIT;
        EXIT WHEN n OPERATOR(pg_catalog.<) batch_size;
        PERFORM outbox._purge_pause();
    END LOOP;
END
$$;

COMMENT ON PROCEDURE outbox.purge_dead(interval, integer, bigint) IS
'Delete dead events whose dead_at is more than older_than ago (NULL = the topic''s retention_dead, else outbox.retention_dead, 30 days: kept for audit, seed 000), '
'in committed batches of batch_size with outbox.purge_delay between them, skipping locked rows. Reports rows removed in removed. Errors as outbox.purge().';
