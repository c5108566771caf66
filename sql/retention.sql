-- Retention. Events live in the log, whose ring tables retention truncates
-- whole (outbox._log_rotate, src/log/mod.rs); what is removed here row by row
-- is what a subscription keeps of its own: the exception rows
-- (outbox.log_exceptions) of finished events (delivered after a retry, dead,
-- cancelled), the finished batches' delivery record (outbox.log_delivered),
-- orphaned dispatch keys and the inbox's records. No step ever looks at a
-- pending or leased row, whatever its age. Each step deletes one batch chosen
-- with SKIP LOCKED, so it never waits on workers and two purges running at
-- once never count a row twice.
--
-- Dispatch keys: a key row is removed only once its event is below the log's
-- floor (outbox._log_floor) with no row of its own, and the key is older than
-- outbox.retention_dispatch_keys (default 0: at once). Raising that setting
-- keeps deduplicating after the events are gone.

CREATE FUNCTION outbox._retention_guc(name text) RETURNS interval
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox._setting(name)::interval $$;

-- Below which event id the log retains nothing: the smallest id the log holds
-- while a subscription reads it; the largest bigint when none does or the log
-- is empty. An event below it is in no ring table, so a dispatch
-- key or a row of its own (outbox.log_exceptions) kept for it while the log
-- held it may go. Retention asks it once per statement, as an InitPlan, and
-- compares ids: the log has no index on id alone, and a probe of the 16 lanes
-- of every ring table per key or row grew with what the log retains: run every
-- second in the one-hour soak, it went from 65 ms to 1 s a run in 11 minutes
-- (2026-12-06). Ids rise
-- with time, so an event at or above the floor that is not in the log (a
-- transaction still open far behind the others holds the floor back) keeps
-- its key and rows only until retention empties the ring tables below it.
-- One probe of each ring table's (lane, id) index per lane.
CREATE FUNCTION outbox._log_floor() RETURNS bigint
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN EXISTS (SELECT 1 FROM outbox.subscription_catalog c)
                THEN COALESCE((SELECT pg_catalog.min(f.id)
                                 FROM pg_catalog.generate_series(0, 15) AS g(lane)
                                 CROSS JOIN LATERAL (SELECT pg_catalog.min(l.id) AS id FROM outbox.log l
                                                      WHERE l.lane OPERATOR(pg_catalog.=) g.lane::smallint) AS f),
                              9223372036854775807)
                ELSE 9223372036854775807 END
$$;

CREATE FUNCTION outbox._purge_step(kind text, older_than interval, batch_size integer) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint := 0;
    more bigint;
    key_age interval := outbox._retention_guc('outbox.retention_dispatch_keys');
BEGIN
    IF kind IS NULL OR kind <> ALL (ARRAY['delivered', 'dead', 'keys', 'inbox']) THEN
        RAISE EXCEPTION 'outbox: unknown purge kind %', pg_catalog.quote_nullable(kind) USING ERRCODE = '22023';
    END IF;
    IF older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox: older_than must not be negative, got %', older_than USING ERRCODE = '22023';
    END IF;
    IF batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'outbox: batch_size must be at least 1, got %', pg_catalog.quote_nullable(batch_size) USING ERRCODE = '22023';
    END IF;
    IF batch_size > outbox._setting('outbox.max_batch_size')::integer THEN
        RAISE EXCEPTION 'outbox: batch size % exceeds outbox.max_batch_size', batch_size USING ERRCODE = '54000';
    END IF;

    IF kind = 'delivered' THEN
        -- Delivered exception rows (events that needed a retry: their attempt
        -- history), kept while the log still holds the event: until it is
        -- below outbox._log_floor(), outbox.deliveries would otherwise show
        -- it as acked from its batch on the first try.
        WITH victims AS (
            SELECT x.subscription, x.id FROM outbox.log_exceptions x
              LEFT JOIN outbox.topics t ON t.topic = x.topic
             WHERE x.state = 'delivered'
               AND x.delivered_at < pg_catalog.clock_timestamp()
                   - COALESCE(older_than, t.retention_delivered, outbox._retention_guc('outbox.retention_delivered'))
               AND x.id < (SELECT outbox._log_floor())
             LIMIT batch_size
               FOR UPDATE OF x SKIP LOCKED
        )
        DELETE FROM outbox.log_exceptions x USING victims v
         WHERE x.subscription = v.subscription AND x.id = v.id AND x.state = 'delivered';
        GET DIAGNOSTICS n = ROW_COUNT;
        -- The finished batches' delivery record, by the GUC alone (a batch
        -- spans topics); each row counts as one, so that the caller's loop
        -- goes on while some are due.
        IF n < batch_size THEN
            DELETE FROM outbox.log_delivered d
             WHERE d.ctid = ANY (ARRAY(
                   SELECT r.ctid FROM outbox.log_delivered r
                    WHERE r.finished_at < pg_catalog.clock_timestamp()
                          - COALESCE(older_than, outbox._retention_guc('outbox.retention_delivered'))
                    ORDER BY r.finished_at
                    LIMIT batch_size - n
                      FOR UPDATE SKIP LOCKED));
            GET DIAGNOSTICS more = ROW_COUNT;
            n := n + more;
        END IF;
    ELSIF kind = 'dead' THEN
        -- Dead letters and cancelled events. Their subjects need no promotion:
        -- a claim finds heads itself (src/log/exceptions.rs). Kept while the
        -- log still holds the event, as delivered rows are: the lane's cursor
        -- has passed it, so outbox.deliveries would otherwise show it as
        -- acked from its batch.
        WITH victims AS (
            SELECT x.subscription, x.id FROM outbox.log_exceptions x
              LEFT JOIN outbox.topics t ON t.topic = x.topic
             WHERE x.state IN ('dead', 'cancelled')
               AND COALESCE(x.dead_at, x.cancelled_at) < pg_catalog.clock_timestamp()
                   - COALESCE(older_than, t.retention_dead, outbox._retention_guc('outbox.retention_dead'))
               AND x.id < (SELECT outbox._log_floor())
             LIMIT batch_size
               FOR UPDATE OF x SKIP LOCKED
        )
        DELETE FROM outbox.log_exceptions x USING victims v
         WHERE x.subscription = v.subscription AND x.id = v.id AND x.state IN ('dead', 'cancelled');
        GET DIAGNOSTICS n = ROW_COUNT;
    ELSIF kind = 'inbox' THEN
        -- The inbox's records (sql/inbox.sql), oldest first, after
        -- outbox.retention_inbox; a record some transaction holds is skipped.
        DELETE FROM outbox.inbox i
         WHERE i.ctid = ANY (ARRAY(
               SELECT r.ctid FROM outbox.inbox r
                WHERE r.received_at < pg_catalog.clock_timestamp()
                      - COALESCE(older_than, outbox._retention_guc('outbox.retention_inbox'))
                ORDER BY r.received_at
                LIMIT batch_size
                  FOR UPDATE SKIP LOCKED));
        GET DIAGNOSTICS n = ROW_COUNT;
    ELSE
        -- Keys whose events are gone, once they are older than the key window:
        -- below outbox._log_floor(), with no row of its own. A key at or above
        -- the floor costs a run one comparison, not a look into the log per key.
        WITH victims AS (
            SELECT k.dispatch_key FROM outbox.dispatch_keys k
             WHERE k.created_at < pg_catalog.clock_timestamp() - GREATEST(key_age, COALESCE(older_than, interval '0'))
               AND k.event_id < (SELECT outbox._log_floor())
               AND NOT EXISTS (SELECT 1 FROM outbox.log_exceptions x WHERE x.id = k.event_id)
             LIMIT batch_size
               FOR UPDATE OF k SKIP LOCKED
        ), gone AS (
            DELETE FROM outbox.dispatch_keys k USING victims v WHERE k.dispatch_key = v.dispatch_key
            RETURNING 1
        )
        SELECT pg_catalog.count(*) INTO n FROM gone;
    END IF;
    RETURN n;
END
$$;

COMMENT ON FUNCTION outbox._purge_step(text, interval, integer) IS
'One retention batch in the caller''s transaction: kind ''delivered'' (delivered exception rows, then the finished batches'' delivery record), ''dead'' (dead and cancelled exception rows), ''keys'' (orphaned dispatch keys) or ''inbox'' (inbox records older than outbox.retention_inbox). '
'Returns rows removed (bigint). Used by outbox.purge(), outbox.purge_dead() and the background worker. Errors: 22023 bad kind, negative older_than or batch_size < 1; 54000 batch_size over outbox.max_batch_size.';

-- Between two committed batches: wait outbox.purge_delay, so that a large purge
-- takes a bounded share of the machine (autovacuum's cost delay, per batch).
CREATE FUNCTION outbox._purge_pause() RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT pg_catalog.pg_sleep(pg_catalog.date_part('epoch', outbox._setting('outbox.purge_delay')::interval)) $$;

COMMENT ON FUNCTION outbox._purge_pause() IS
'Sleeps outbox.purge_delay (ms; 0 = returns at once); returns void. Called by outbox.purge() and outbox.purge_dead() between committed batches. No errors of its own.';

-- Procedures cannot pin search_path (a SET clause forbids COMMIT), so their bodies
-- qualify every operator and call only functions that pin it.
CREATE PROCEDURE outbox.purge(older_than interval DEFAULT NULL, batch_size integer DEFAULT 1000, INOUT removed bigint DEFAULT NULL)
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
'Delete the rows of their own that subscriptions keep for events they delivered after a retry (attempt history) and finished more than older_than ago (NULL = the topic''s retention_delivered, else outbox.retention_delivered, 7 days), '
'then the finished batches'' delivery records older than that (older_than, else outbox.retention_delivered: a batch spans topics), then orphaned dispatch keys. '
'Events themselves live in the log, whose retention truncates its ring tables whole (maintenance step log); a row is kept while the log still holds its event. '
'batch_size rows per transaction (1..outbox.max_batch_size), committing after each batch, waiting outbox.purge_delay (ms, default 20) between batches and skipping rows that are locked. Never touches pending, leased or dead rows. '
'Reports the rows removed in its INOUT column removed. Run it with CALL outside an explicit transaction block. '
'Errors: 22023 negative older_than or batch_size < 1; 54000 batch_size over the limit. Batched, committed deletes as in PgQ''s and pg_partman''s maintenance procedures.';

CREATE PROCEDURE outbox.purge_dead(older_than interval DEFAULT NULL, batch_size integer DEFAULT 1000, INOUT removed bigint DEFAULT NULL)
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
'Delete the rows of their own that subscriptions keep for dead and cancelled events, dead or cancelled more than older_than ago (NULL = the topic''s retention_dead, else outbox.retention_dead, 30 days: kept for audit), '
'in committed batches of batch_size with outbox.purge_delay between them, skipping locked rows. A row is kept while the log still holds its event (its ring table goes with the log''s retention), '
'since the log''s record would show it as delivered. Reports rows removed in removed. Errors as outbox.purge().';

-- One row of outbox.maintenance_runs; counts maps a column name (the logged_as
-- of outbox._maintenance_steps()) to rows removed.
CREATE FUNCTION outbox._log_maintenance(started timestamptz, counts jsonb) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    INSERT INTO outbox.maintenance_runs (started_at, finished_at, purged_delivered, purged_dead, purged_keys)
    VALUES (started, pg_catalog.clock_timestamp(),
            COALESCE((counts ->> 'purged_delivered')::bigint, 0),
            COALESCE((counts ->> 'purged_dead')::bigint, 0),
            COALESCE((counts ->> 'purged_keys')::bigint, 0))
$$;

-- The steps and their order come from outbox._maintenance_steps(), the list the
-- background worker runs too (src/maintenance.rs), so the two cannot drift.
CREATE PROCEDURE outbox.run_maintenance()
LANGUAGE plpgsql
AS $$
DECLARE
    started timestamptz := pg_catalog.clock_timestamp();
    s record;
    b record;
    counts pg_catalog.jsonb := '{}';
BEGIN
    FOR s IN SELECT m.step, m.logged_as FROM outbox._maintenance_steps() AS m LOOP
        LOOP
            SELECT * INTO b FROM outbox._maintenance_step(s.step);
            IF s.logged_as IS NOT NULL THEN
                counts := counts OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object(s.logged_as,
                    COALESCE((counts OPERATOR(pg_catalog.->>) s.logged_as)::bigint, 0) OPERATOR(pg_catalog.+) b.removed);
            END IF;
            COMMIT;
            EXIT WHEN b.done;
            PERFORM outbox._purge_pause();
        END LOOP;
    END LOOP;
    PERFORM outbox._log_maintenance(started, counts);
    COMMIT;
END
$$;

COMMENT ON PROCEDURE outbox.run_maintenance() IS
'One maintenance run, the same steps in the same order as the background worker''s (outbox._maintenance_steps(): retention of delivered rows and delivery records, '
'of dead and cancelled rows and of orphaned dispatch keys with the default windows, then the log ring''s truncation and rotation, then the inbox''s records), each in committed batches with outbox.purge_delay between them; '
'recorded in outbox.maintenance_log (purged_delivered, purged_dead, purged_keys). None of the steps is needed for delivery. '
'Run it with CALL outside an explicit transaction block. Without preload, schedule it with pg_cron: '
'SELECT cron.schedule(''outbox-retention'', ''* * * * *'', ''CALL outbox.run_maintenance()'').';
