-- The log through pg_dump (0.11.0; src/log/restore.rs has the invariants and
-- their proof).
--
-- pg_dump keeps the log ring, its state and every reader's table, so a logical
-- dump keeps what each subscription of the log has not finished. Their rows
-- name transactions by id (a log row's txid, a lane's cursor snapshots), and
-- those ids mean nothing in the restoring cluster: an id from the dump may be
-- in that cluster's future (never visible, so never read) or its past. So a
-- restore is rebased once, by outbox._log_rebase(), before any reader uses
-- the restored state:
--   1. each subscription's unfinished restored events (not read yet, or read
--      and not acked) get a row of their own (outbox.log_exceptions, state
--      'pending'), decided in the dump's own ids, where cursors and txids still
--      agree; rows of their own (retries, dead letters, cancels) are kept;
--   2. every restored log row gets txid 2 (frozen: committed before any
--      snapshot), every lane a cursor taken by the rebase, and the batches in
--      flight are deleted (their unfinished events have rows of their own).
-- Events published into the restored database before the rebase are told
-- from restored ones by id: the restore's rows all have ids up to
-- outbox.log_restore.upto, and later ids come from the restored sequence.
--
-- Who rebases: the first claim, cancel or replay of a subscription of the
-- log, or create_subscription, whichever comes first; else the background
-- worker's log step once the restore looks finished (_log_restore_quiet).
-- Until then the log's retention waits (outbox._log_rotate).

-- Not dumped: a marker of this database, written by the restore itself.
-- upto is the largest restored event id. At most one row.
CREATE TABLE outbox.log_restore (
    one         boolean     PRIMARY KEY DEFAULT true CHECK (one),
    upto        bigint      NOT NULL,
    restored_at timestamptz NOT NULL DEFAULT now()
);
-- Claims cache whether the row exists (src/subscriptions.rs): a change
-- invalidates every backend's copy at commit, as for outbox.topics.
CREATE TRIGGER log_restore_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.log_restore
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._topics_changed();
ALTER TABLE outbox.log_restore ENABLE ALWAYS TRIGGER log_restore_changed;

-- A statement that inserts into a ring table with SQL: a restore's COPY.
-- publish inserts through the heap (src/pg/heap.rs), which fires no trigger;
-- its SQL fallback (taken only when a ring table was changed by hand) writes
-- rows of its own transaction alone, which are not a restore.
CREATE FUNCTION outbox._log_restored() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    top   bigint;
    own   boolean;
    added bigint;
    prev  bigint;
BEGIN
    SELECT pg_catalog.max(r.id), pg_catalog.bool_and(r.txid = pg_catalog.pg_current_xact_id()), pg_catalog.count(*)
      INTO top, own, added FROM new_rows r;
    IF added = 0 OR own THEN
        RETURN NULL;
    END IF;
    -- Ring tables restored at once (pg_restore --jobs) take their turn here,
    -- so that exactly one of them is the first: without the lock both could
    -- find no marker, and the second would fail on its key and lose its rows.
    LOCK TABLE outbox.log_restore IN SHARE ROW EXCLUSIVE MODE;
    SELECT r.upto INTO prev FROM outbox.log_restore r;
    -- The first restored ring table (a marker of 0 comes from the readers'
    -- tables alone): the log must hold nothing else, or this database's own
    -- events and the dump's would share ids and cursors.
    IF (prev IS NULL OR prev = 0) AND (SELECT pg_catalog.count(*) FROM outbox.log) <> added THEN
        RAISE EXCEPTION 'outbox: the log of this database is not empty; restore a dump of the log into a database whose log is empty'
            USING ERRCODE = '55000',
                  HINT = 'Restore into a new database (CREATE EXTENSION outbox_ext, then the dump).';
    END IF;
    INSERT INTO outbox.log_restore AS r (upto) VALUES (top)
        ON CONFLICT (one) DO UPDATE SET upto = GREATEST(r.upto, EXCLUDED.upto), restored_at = now();
    RETURN NULL;
END
$$;

-- A restore of the lanes: their cursors are the dumped cluster's too, so the
-- restore is rebased even when the dump's log held no event (retention had
-- emptied it, or nothing was published yet). Such a marker has upto 0: no
-- event is a restored one, and every event of the log is placed against the
-- rebase's cursor (invariant 4 of src/log/restore.rs). The extension writes
-- lanes only inside its functions (create_subscription, claim, the rebase),
-- never from a top-level COPY or INSERT into outbox.log_lanes, which is what
-- pg_restore and psql running a dump send.
CREATE FUNCTION outbox._log_lanes_restoring() RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_catalog.current_query() OPERATOR(pg_catalog.~*)
           '^\s*(copy|insert\s+into)\s+("?outbox"?\s*\.\s*)?"?log_lanes"?[\s(]'
$$;

CREATE FUNCTION outbox._log_lanes_restored() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT outbox._log_lanes_restoring() THEN
        RETURN NULL;
    END IF;
    INSERT INTO outbox.log_restore AS r (upto) VALUES (0)
        ON CONFLICT (one) DO UPDATE SET restored_at = now();
    RETURN NULL;
END
$$;
CREATE TRIGGER log_lanes_restored AFTER INSERT ON outbox.log_lanes
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._log_lanes_restored();
ALTER TABLE outbox.log_lanes ENABLE ALWAYS TRIGGER log_lanes_restored;

-- CREATE EXTENSION on the restoring side gave 'default' its lanes; a
-- dumped lane row replaces the one of the same key instead of failing the
-- restore's COPY (the rebase then places every lane again).
CREATE FUNCTION outbox._log_lane_restore() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF outbox._log_lanes_restoring() THEN
        DELETE FROM outbox.log_lanes l
         WHERE l.subscription OPERATOR(pg_catalog.=) NEW.subscription AND l.lane OPERATOR(pg_catalog.=) NEW.lane;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER log_lane_restore BEFORE INSERT ON outbox.log_lanes
    FOR EACH ROW EXECUTE FUNCTION outbox._log_lane_restore();
ALTER TABLE outbox.log_lanes ENABLE ALWAYS TRIGGER log_lane_restore;

DO $$
BEGIN
    FOR n IN 0..3 LOOP
        EXECUTE pg_catalog.format($ddl$
            CREATE TRIGGER log_restored AFTER INSERT ON outbox.log_%1$s
                REFERENCING NEW TABLE AS new_rows
                FOR EACH STATEMENT EXECUTE FUNCTION outbox._log_restored();
            ALTER TABLE outbox.log_%1$s ENABLE ALWAYS TRIGGER log_restored;
        $ddl$, n);
    END LOOP;
END
$$;

-- CREATE EXTENSION on the restoring side, or its background worker, may have
-- written the ring's state before the dump's rows arrive: a dumped row
-- replaces the one of the same table instead of failing the restore's COPY.
CREATE FUNCTION outbox._log_state_restore() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM outbox.log_state s WHERE s.n = NEW.n;
    RETURN NEW;
END
$$;
CREATE TRIGGER log_state_restore BEFORE INSERT ON outbox.log_state
    FOR EACH ROW EXECUTE FUNCTION outbox._log_state_restore();

-- Whether a restore into this database looks finished, so that the
-- background worker may rebase it (a database whose subscriptions of the log
-- see no claim would otherwise keep its log, unrotated, for ever): no ring
-- table restored for a minute, and no other session of this database is a
-- pg_restore or last ran a COPY into an outbox table (psql running a plain
-- dump). Claims rebase whatever this says; a restore by other means that
-- pauses over a minute between the ring tables and the readers' tables
-- should keep the worker off (outbox.maintenance_interval = 0) until done.
CREATE FUNCTION outbox._log_restore_quiet() RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1 FROM outbox.log_restore r
                        WHERE r.restored_at OPERATOR(pg_catalog.>) (pg_catalog.now() OPERATOR(pg_catalog.-) interval '1 minute'))
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a
                        WHERE a.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
                          AND a.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid()
                          AND (a.application_name OPERATOR(pg_catalog.=) 'pg_restore'
                               OR a.query OPERATOR(pg_catalog.~~*) 'copy outbox.%'))
$$;

-- The rebase (see the top of this file). Returns the events given a row of
-- their own, NULL when there was nothing to rebase.
CREATE FUNCTION outbox._log_rebase() RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    upto  bigint;
    cur   record;
    moved bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox.log_restore) THEN
        RETURN NULL;  -- the common case: no lock taken
    END IF;
    -- One rebase: the others wait here, then find no row. At REPEATABLE READ
    -- or SERIALIZABLE a row deleted by a rebase this snapshot does not see
    -- raises 40001 here, before anything is changed.
    LOCK TABLE outbox.log_restore IN SHARE ROW EXCLUSIVE MODE;
    DELETE FROM outbox.log_restore RETURNING log_restore.upto INTO upto;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Readers wait for the rebase, and it for them: lanes and batches change.
    LOCK TABLE outbox.log_lanes, outbox.log_batches IN EXCLUSIVE MODE;

    -- The lanes' new cursor, taken first: the events it sees get rows of
    -- their own below, and the lanes read everything it does not see.
    cur := outbox._log_cursor();
    -- Rows of their own for what each subscription has not finished: the
    -- restored events, decided in the dump's own ids (before their txids are
    -- rewritten below) as outbox._log_deliveries shows them; and the events
    -- published here since the restore that committed before the cursor,
    -- which the dump's cursors cannot place and the new one counts as read,
    -- for every subscription of their topic. Those not committed yet are read
    -- by the lanes.
    INSERT INTO outbox.log_exceptions AS x
           (subscription, id, lane, topic, subject, dispatch_key, payload, headers,
            max_attempts, published_at, state, attempts, visible_at)
    SELECT d.subscription, l.id, l.lane, l.topic, l.subject, l.dispatch_key, l.payload, l.headers,
           l.max_attempts, l.published_at, 'pending', d.attempts, GREATEST(now(), l.deliver_at)
      FROM outbox._log_deliveries d
      JOIN outbox.log l ON l.id = d.event_id
     WHERE d.event_id <= upto
       AND d.state IN ('pending', 'leased')
       AND NOT EXISTS (SELECT 1 FROM outbox.log_exceptions e
                        WHERE e.subscription = d.subscription AND e.id = d.event_id)
    UNION ALL
    SELECT c.name, l.id, l.lane, l.topic, l.subject, l.dispatch_key, l.payload, l.headers,
           l.max_attempts, l.published_at, 'pending', 0, GREATEST(now(), l.deliver_at)
      FROM outbox.subscription_catalog c
      JOIN outbox.log l
        ON c.topics IS NULL
           OR EXISTS (SELECT 1 FROM pg_catalog.unnest(c.topics) AS p(pattern) WHERE outbox._topic_matches(l.topic, p.pattern))
     WHERE l.id > upto AND pg_catalog.pg_visible_in_snapshot(l.txid, cur.snap)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS moved = ROW_COUNT;

    -- Into this cluster's ids.
    FOR n IN 0..3 LOOP
        EXECUTE pg_catalog.format('UPDATE outbox.%I SET txid = ''2'' WHERE id <= $1 AND txid <> ''2''', 'log_' || n)
          USING upto;
    END LOOP;
    DELETE FROM outbox.log_batches;
    DELETE FROM outbox.log_deferred;
    INSERT INTO outbox.log_lanes (subscription, lane, lo_snap, lo_m, lo_xn)
    SELECT c.name, g, cur.snap, cur.m, cur.xn
      FROM outbox.subscription_catalog c, pg_catalog.generate_series(0, 15) AS g
    ON CONFLICT DO NOTHING;
    UPDATE outbox.log_lanes
       SET lo_snap = cur.snap, lo_m = cur.m, lo_xn = cur.xn, hi_snap = NULL, hi_m = NULL, hi_xn = NULL,
           pos = NULL, batch = NULL, start_snap = NULL, skips = NULL;
    UPDATE outbox.log_state SET sealed_snap = cur.snap WHERE sealed_snap IS NOT NULL;
    RETURN moved;
END
$$;

-- What pg_dump keeps of the log (rebased on restore, above). The sequence of
-- batch ids too, so that a token of a restored batch never names a new one.
SELECT pg_catalog.pg_extension_config_dump('outbox.log_0', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_1', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_2', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_3', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_state', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_lanes', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_batches', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_delivered', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_exceptions', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.log_batch_seq', '');
