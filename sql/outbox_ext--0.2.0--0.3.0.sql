-- outbox_ext 0.2.0 -> 0.3.0
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.3.0'" to load this file. \quit

-- The claim low-water mark (src/lowwater.rs): claim() starts its index scan above
-- the events already consumed. Every write that puts an event into the claim index
-- stores a visible_at above the publish floor; the C functions do it themselves,
-- replay and replay_dead through outbox._visible_floor().
CREATE FUNCTION outbox."_visible_floor"() RETURNS timestamp with time zone
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'visible_floor_wrapper';

CREATE FUNCTION outbox."_claim_low_water"() RETURNS TABLE (
	"publish_floor" timestamp with time zone,
	"low_water_at" timestamp with time zone,
	"low_water_id" bigint,
	"step_pending" bool,
	"resets" bigint
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'claim_low_water_wrapper';

CREATE FUNCTION outbox."_audit_low_water"() RETURNS bool
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'audit_low_water_wrapper';

COMMENT ON FUNCTION outbox._visible_floor() IS
'Internal: the least visible_at (timestamptz) the calling transaction may store for an event entering the claim index: the publish floor plus 1 microsecond, '
'-infinity without shared_preload_libraries. Assigns the caller''s transaction id first (src/lowwater.rs explains why). Used by replay and replay_dead. No errors.';


COMMENT ON FUNCTION outbox._claim_low_water() IS
'Internal, for tests and monitoring: one row with publish_floor (timestamptz, the floor events enter the claim index above), '
'low_water_at and low_water_id (timestamptz, bigint: the key claim() starts its index scan at in this database; -infinity and 0 when unknown), '
'step_pending (boolean: step A done, step B waiting for older transactions) and resets (bigint: times the maintenance audit found an event below the mark). '
'-infinity / 0 / false without shared_preload_libraries. No errors. See src/lowwater.rs (issue 5; the PgQ-style alternative is table rotation, anchors.md lesson 4).';


COMMENT ON FUNCTION outbox._audit_low_water() IS
'Internal: look for live events below this database''s claim low-water mark (rows written into outbox.event_queue other than through the outbox functions) '
'and forget the mark if there are any, so claims find them. Returns true when it reset the mark (boolean). Run by the maintenance worker and outbox.run_maintenance(). '
'Reads every dead index entry below the mark: about as costly as one claim without the mark. No errors of its own. See src/lowwater.rs.';


REVOKE EXECUTE ON FUNCTION outbox._visible_floor(), outbox._claim_low_water(), outbox._audit_low_water() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox._claim_low_water(), outbox._audit_low_water() TO outbox_admin;

-- A replayed event enters the claim index above the publish floor.
CREATE OR REPLACE FUNCTION outbox.replay(id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    t text;
BEGIN
    IF id IS NULL THEN
        RETURN false;
    END IF;
    -- Dead events live in the hot relation: flip them back to pending.
    UPDATE outbox.event_queue q
       SET state = 'pending', attempts = 0, visible_at = GREATEST(pg_catalog.clock_timestamp(), outbox._visible_floor()),
           lease_token = NULL, leased_by = NULL, leased_at = NULL,
           dead_at = NULL, blocks_subject = false
     WHERE q.id OPERATOR(pg_catalog.=) replay.id AND q.state OPERATOR(pg_catalog.=) 'dead'
    RETURNING q.topic INTO t;
    IF FOUND THEN
        PERFORM outbox._wake(t);
        RETURN true;
    END IF;
    -- Cancelled events live in the archive: move them back, keeping id and history.
    WITH moved AS (
        DELETE FROM outbox.event_archive a
         WHERE a.id OPERATOR(pg_catalog.=) replay.id AND a.state OPERATOR(pg_catalog.=) 'cancelled'
        RETURNING a.*
    )
    INSERT INTO outbox.event_queue (id, topic, subject, dispatch_key, payload, headers, state,
                                    attempts, max_attempts, visible_at, last_error, errors, published_at, is_head)
    SELECT m.id, m.topic, m.subject, m.dispatch_key, m.payload, m.headers, 'pending',
           0, m.max_attempts, GREATEST(pg_catalog.clock_timestamp(), outbox._visible_floor()), m.last_error, m.errors, m.published_at,
           m.subject IS NULL OR NOT EXISTS (
               SELECT 1 FROM outbox.event_queue p
                WHERE p.subject OPERATOR(pg_catalog.=) m.subject AND p.id OPERATOR(pg_catalog.<) m.id
                  AND (p.state OPERATOR(pg_catalog.<>) 'dead' OR p.blocks_subject))
      FROM moved m
    RETURNING topic INTO t;
    IF t IS NULL THEN
        RETURN false;
    END IF;
    PERFORM outbox._wake(t);
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION outbox.replay_dead(
    topic_pattern text        DEFAULT NULL,
    dead_since    timestamptz DEFAULT NULL,
    dead_until    timestamptz DEFAULT NULL,
    dry_run       boolean     DEFAULT false
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint;
BEGIN
    IF topic_pattern IS NOT NULL THEN
        PERFORM outbox._pattern_kind(topic_pattern);
    END IF;
    IF dry_run IS NULL THEN
        RAISE EXCEPTION 'outbox: dry_run must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF dry_run THEN
        SELECT pg_catalog.count(*) INTO n
          FROM outbox.event_queue q
         WHERE q.state OPERATOR(pg_catalog.=) 'dead'
           AND (topic_pattern IS NULL OR outbox._topic_matches(q.topic, topic_pattern))
           AND (dead_since IS NULL OR q.dead_at OPERATOR(pg_catalog.>=) dead_since)
           AND (dead_until IS NULL OR q.dead_at OPERATOR(pg_catalog.<) dead_until);
        RETURN n;
    END IF;
    UPDATE outbox.event_queue q
       SET state = 'pending', attempts = 0, visible_at = GREATEST(pg_catalog.clock_timestamp(), outbox._visible_floor()),
           lease_token = NULL, leased_by = NULL, leased_at = NULL,
           dead_at = NULL, blocks_subject = false
     WHERE q.state OPERATOR(pg_catalog.=) 'dead'
       AND (topic_pattern IS NULL OR outbox._topic_matches(q.topic, topic_pattern))
       AND (dead_since IS NULL OR q.dead_at OPERATOR(pg_catalog.>=) dead_since)
       AND (dead_until IS NULL OR q.dead_at OPERATOR(pg_catalog.<) dead_until);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n OPERATOR(pg_catalog.>) 0 THEN
        PERFORM outbox._wake(NULL);
    END IF;
    RETURN n;
END
$$;

-- CREATE OR REPLACE keeps the privileges but not SECURITY DEFINER.
ALTER FUNCTION outbox.replay(bigint) SECURITY DEFINER;
ALTER FUNCTION outbox.replay_dead(text, timestamptz, timestamptz, boolean) SECURITY DEFINER;

-- The pg_cron path audits the mark too.
CREATE OR REPLACE PROCEDURE outbox.run_maintenance()
LANGUAGE plpgsql
AS $$
DECLARE
    started timestamptz := pg_catalog.clock_timestamp();
    d bigint;
    x bigint;
BEGIN
    PERFORM outbox._audit_low_water();
    CALL outbox.purge(NULL, 1000, d);
    CALL outbox.purge_dead(NULL, 1000, x);
    PERFORM outbox._log_maintenance(started, d, x);
    COMMIT;
END
$$;

COMMENT ON PROCEDURE outbox.run_maintenance() IS
'One retention run with the default windows (purge, then purge_dead), recorded in outbox.maintenance_log; first it checks the claim low-water mark (outbox._audit_low_water). '
'The background worker does the same every outbox.maintenance_interval when preloaded; without preload, schedule it with pg_cron: '
'SELECT cron.schedule(''outbox-retention'', ''* * * * *'', ''CALL outbox.run_maintenance()'').';

