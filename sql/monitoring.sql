-- Observability: per-topic statistics and health checks an operator or an
-- exporter can poll, built into the database so no sidecar is needed.

-- Every subscription, from its deliveries: events acked from a batch count
-- from the time the batch finished (batch precision).
CREATE VIEW outbox.stats AS
SELECT d.topic,
       pg_catalog.count(*) FILTER (WHERE d.state = 'pending' AND d.available_at <= pg_catalog.now()) AS ready,
       pg_catalog.count(*) FILTER (WHERE d.state = 'pending' AND d.available_at > pg_catalog.now()) AS scheduled,
       pg_catalog.count(*) FILTER (WHERE d.state = 'leased') AS leased,
       pg_catalog.count(*) FILTER (WHERE d.state = 'leased' AND d.lease_expires_at <= pg_catalog.now()) AS expired_leases,
       pg_catalog.count(*) FILTER (WHERE d.state = 'dead') AS dead,
       pg_catalog.count(*) FILTER (WHERE d.state = 'delivered') AS delivered,
       pg_catalog.count(*) FILTER (WHERE d.state = 'cancelled') AS cancelled,
       pg_catalog.max(pg_catalog.now() - d.available_at) FILTER (WHERE d.state = 'pending' AND d.available_at <= pg_catalog.now()) AS oldest_ready_age,
       NULL::interval AS oldest_lease_age,
       pg_catalog.count(*) FILTER (WHERE d.state = 'dead' AND d.dead_at > pg_catalog.now() - interval '1 hour') AS dead_last_hour,
       pg_catalog.count(*) FILTER (WHERE d.state = 'delivered' AND d.delivered_at > pg_catalog.now() - interval '1 minute') AS delivered_last_minute,
       pg_catalog.count(*) FILTER (WHERE d.state = 'delivered' AND d.delivered_at > pg_catalog.now() - interval '1 hour') AS delivered_last_hour,
       d.subscription
  FROM outbox._log_deliveries d
 GROUP BY d.subscription, d.topic;

COMMENT ON VIEW outbox.stats IS
'Per topic and subscription: counts by state (ready, scheduled = pending but not yet visible, leased, expired_leases, dead, delivered, cancelled), '
'oldest_ready_age and oldest_lease_age (interval; NULL: the log keeps no lease start), dead_last_hour, delivered_last_minute, delivered_last_hour, and subscription. '
'Each subscription counts its retained events (outbox.deliveries); an event acked from a batch on the first try counts as delivered when its batch finished (batch precision). '
'Reads the whole retained log: poll it every 15 s or slower.';

-- Thresholds are arguments so operators can tune alerts without a new version.
CREATE FUNCTION outbox.health(
    backlog_age        interval DEFAULT '60 seconds',
    backlog_critical   bigint   DEFAULT 1000,
    xmin_warn          interval DEFAULT '5 minutes',
    xmin_critical      interval DEFAULT '1 hour',
    dead_tuples_warn   bigint   DEFAULT 100000
) RETURNS TABLE (check_name text, status text, value numeric, message text)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint;
    r record;
    w record;
    keep interval;
    why text;
    has_default boolean := false;
    default_lag bigint := 0;
    default_claimed boolean := false;
    other_claimed text;
    held text;
BEGIN
    IF backlog_age IS NULL OR xmin_warn IS NULL OR xmin_critical IS NULL
       OR backlog_critical IS NULL OR dead_tuples_warn IS NULL THEN
        RAISE EXCEPTION 'outbox: health() thresholds must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF backlog_age < interval '0' OR backlog_age > interval '100 years'
       OR xmin_warn < interval '0' OR xmin_warn > interval '100 years'
       OR xmin_critical < interval '0' OR xmin_critical > interval '100 years' THEN
        RAISE EXCEPTION 'outbox: health() intervals must be between 0 and 100 years' USING ERRCODE = '22023';
    END IF;
    IF backlog_critical < 0 OR dead_tuples_warn < 0 THEN
        RAISE EXCEPTION 'outbox: health() counts must not be negative' USING ERRCODE = '22023';
    END IF;
    -- 0. The handshake: when the installed SQL is not this library's, every call
    -- into the library raises 55000, so say so first and read nothing more.
    why := outbox._handshake();
    check_name := 'handshake'; value := CASE WHEN why IS NULL THEN 0 ELSE 1 END;
    status := CASE WHEN why IS NULL THEN 'ok' ELSE 'critical' END;
    message := COALESCE(why, 'the installed SQL is this library''s');
    RETURN NEXT;
    IF why IS NOT NULL THEN
        RETURN;
    END IF;

    -- 1. Backlog age: by default warn when ready events wait over 60 s, critical past 1,000 of them.
    -- Every subscription's (an event two of them owe counts twice).
    n := COALESCE((SELECT sum(outbox._log_backlog(c.name, now() - backlog_age))
                     FROM outbox.subscription_catalog c), 0);
    check_name := 'backlog_age'; value := n;
    status := CASE WHEN n >= backlog_critical THEN 'critical' WHEN n > 0 THEN 'warn' ELSE 'ok' END;
    message := format('%s ready events waiting longer than %s', n, backlog_age);
    RETURN NEXT;

    -- 2. Dead letters in the last hour.
    SELECT count(*) INTO n FROM outbox.log_exceptions x
     WHERE x.state = 'dead' AND x.dead_at > now() - interval '1 hour';
    check_name := 'dead_letters'; value := n;
    status := CASE WHEN n >= 100 THEN 'critical' WHEN n > 0 THEN 'warn' ELSE 'ok' END;
    message := format('%s events dead-lettered in the last hour', n);
    RETURN NEXT;

    -- 3. Expired leases: workers died or handlers outlive their lease: rows of
    -- their own, and events still out in a batch round that expired (until a
    -- claim moves them).
    n := (SELECT count(*) FROM outbox.log_exceptions x WHERE x.state = 'leased' AND x.visible_at <= now())
       + (SELECT count(*) FROM outbox.subscription_catalog c, LATERAL outbox._log_batch_states(c.name) b
           WHERE b.state = 'leased' AND b.lease_expires_at <= now());
    check_name := 'expired_leases'; value := n;
    status := CASE WHEN n > 0 THEN 'warn' ELSE 'ok' END;
    message := format('%s leases expired without ack or fail', n);
    RETURN NEXT;

    -- 4. The xmin horizon: a long transaction keeps vacuum from cleaning the
    -- relations every claim and ack rewrites.
    -- clock_timestamp(): now() is this transaction's start, which a later one passes.
    SELECT a.pid, a.usename, a.application_name, a.state,
           GREATEST(clock_timestamp() - a.xact_start, interval '0') AS age
      INTO r
      FROM pg_stat_activity a
     WHERE a.backend_xmin IS NOT NULL AND a.xact_start IS NOT NULL AND a.pid <> pg_backend_pid()
     ORDER BY a.xact_start
     LIMIT 1;
    check_name := 'xmin_horizon';
    IF r.pid IS NULL THEN
        value := 0; status := 'ok'; message := 'no other session holds the xmin horizon';
    ELSE
        value := round(extract(epoch FROM r.age)::numeric, 3);
        status := CASE WHEN r.age >= xmin_critical THEN 'critical' WHEN r.age >= xmin_warn THEN 'warn' ELSE 'ok' END;
        message := format('oldest snapshot held for %s by pid %s (user %s, application %L, %s)',
                          date_trunc('second', r.age), r.pid, r.usename, r.application_name, r.state);
    END IF;
    RETURN NEXT;
    FOR r IN SELECT gid, now() - prepared AS age FROM pg_prepared_xacts ORDER BY prepared LIMIT 1 LOOP
        IF r.age >= xmin_warn THEN
            check_name := 'xmin_horizon'; value := round(extract(epoch FROM r.age)::numeric, 3);
            status := CASE WHEN r.age >= xmin_critical THEN 'critical' ELSE 'warn' END;
            message := format('prepared transaction %L open for %s', r.gid, date_trunc('second', r.age));
            RETURN NEXT;
        END IF;
    END LOOP;

    -- 5. Dead tuples in the log's hot relations: every claim and ack rewrites
    -- rows of the lanes, batches and exception rows (the ring tables are only
    -- appended to and truncated whole). The one with the most dead tuples.
    SELECT c.relname, s.n_dead_tup, s.n_live_tup, s.last_autovacuum INTO r
      FROM pg_stat_all_tables s JOIN pg_class c ON c.oid = s.relid
     WHERE s.relid IN ('outbox.log_lanes'::regclass, 'outbox.log_batches'::regclass,
                       'outbox.log_exceptions'::regclass, 'outbox.subscription_activity'::regclass)
     ORDER BY s.n_dead_tup DESC, c.relname
     LIMIT 1;
    check_name := 'dead_tuples'; value := COALESCE(r.n_dead_tup, 0);
    status := CASE WHEN COALESCE(r.n_dead_tup, 0) >= dead_tuples_warn
                        AND COALESCE(r.n_dead_tup, 0) > 2 * COALESCE(r.n_live_tup, 0) THEN 'warn' ELSE 'ok' END;
    message := format('%s dead / %s live tuples in outbox.%s (last autovacuum %s)',
                      COALESCE(r.n_dead_tup, 0), COALESCE(r.n_live_tup, 0), COALESCE(r.relname::text, 'log_lanes'),
                      COALESCE(r.last_autovacuum::text, 'never'));
    RETURN NEXT;

    -- 6. The id sequence: per-subject order needs ids drawn in subject lock order,
    -- which a sequence cache breaks (each backend pre-allocates a block of ids).
    -- sql/guard.sql refuses ALTER SEQUENCE ... CACHE; this catches a bypass.
    SELECT s.seqcache INTO n FROM pg_sequence s WHERE s.seqrelid = 'outbox.event_id_seq'::regclass;
    check_name := 'id_sequence'; value := n;
    IF n > 1 THEN
        status := 'critical';
        message := format('outbox.event_id_seq has CACHE %s: ids no longer follow the subject lock order, so per-subject delivery order can break; run ALTER SEQUENCE outbox.event_id_seq CACHE 1', n);
    ELSE
        status := 'ok';
        message := 'outbox.event_id_seq draws ids one at a time (CACHE 1)';
    END IF;
    RETURN NEXT;

    -- 7. The background worker of this database (src/launcher.rs).
    SELECT * INTO w FROM outbox.wakeup_status();
    check_name := 'background_worker'; value := w.worker_pid;
    IF NOT w.preloaded THEN
        status := 'warn';
        message := 'outbox_ext is not in shared_preload_libraries: no background wake-ups or maintenance (schedule CALL outbox.run_maintenance() with pg_cron)';
    ELSIF w.state = 'serving' THEN
        status := 'ok';
        message := format('background worker pid %s, %s passes', w.worker_pid, w.passes);
    ELSIF w.launcher_pid = 0 THEN
        status := 'critical';
        message := 'the outbox_ext launcher is not running, so no background worker serves this database (the postmaster restarts it within seconds; see the server log)';
    ELSIF (SELECT d.datistemplate FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()) THEN
        status := 'warn';
        message := 'this database is a template (datistemplate): templates are never served, so that CREATE DATABASE from them works; the copies are';
    ELSIF NOT EXISTS (SELECT 1 FROM pg_catalog.regexp_split_to_table(outbox._setting('outbox.databases'), ',') AS l(name)
                       WHERE pg_catalog.btrim(l.name, E' \t\r\n') <> '')
          OR EXISTS (SELECT 1 FROM pg_catalog.regexp_split_to_table(outbox._setting('outbox.databases'), ',') AS l(name)
                      WHERE pg_catalog.btrim(l.name, E' \t\r\n') = pg_catalog.current_database()) THEN
        status := 'critical';
        message := CASE w.state
            WHEN 'waiting' THEN format('no background worker process is free for this database (max_worker_processes = %s, shared with parallel query); the launcher retries every second', pg_catalog.current_setting('max_worker_processes'))
            WHEN 'starting' THEN 'the background worker of this database is starting'
            WHEN 'stopped' THEN 'the background worker of this database stopped; the launcher starts another'
            ELSE 'no background worker serves this database yet (the launcher looks at new databases every second, and serves at most 64 at once; see the server log)' END;
    ELSE
        status := 'warn';
        message := format('outbox.databases (%L) does not include this database: no background wake-ups or maintenance here, and publishers notify at commit', outbox._setting('outbox.databases'));
    END IF;
    RETURN NEXT;

    -- 8. Each subscription: paused, or not claimed from while its events wait.
    FOR r IN SELECT s.name, s.paused, s.paused_at, s.lag_events, s.lag, s.last_claim_at,
                    s.max_lag, s.lost_events, s.lost_at
               FROM outbox.subscriptions s ORDER BY s.name LOOP
        check_name := 'subscription'; value := r.lag_events;
        IF r.name = 'default' THEN
            has_default := true; default_lag := r.lag_events; default_claimed := r.last_claim_at IS NOT NULL;
        ELSIF r.last_claim_at IS NOT NULL AND other_claimed IS NULL THEN
            other_claimed := r.name;
        END IF;
        IF r.paused THEN
            status := 'warn';
            message := format('subscription %L is paused (since %s): %s events wait for it', r.name,
                              date_trunc('second', r.paused_at), r.lag_events);
        ELSIF r.lost_at > now() - interval '1 day' THEN
            -- Its max_lag let retention remove events it had not read.
            status := 'warn';
            message := format('subscription %L lagged past its max_lag (%s): retention removed %s events it had not read, the last at %s',
                              r.name, r.max_lag, r.lost_events, date_trunc('second', r.lost_at));
        ELSIF r.lag > backlog_age
              AND (r.last_claim_at IS NULL OR r.last_claim_at < now() - backlog_age) THEN
            -- A subscription holds the log's retention while it lags.
            status := 'warn';
            message := format('subscription %L has %s undelivered events, the oldest published %s ago, and no claim since %s; '
                              'it holds the log''s retention (drop it if it is gone for good)', r.name, r.lag_events,
                              date_trunc('second', r.lag),
                              COALESCE(date_trunc('second', r.last_claim_at)::text, 'the server started serving it'));
        ELSE
            status := 'ok';
            message := format('subscription %L: %s events not yet delivered, last claim %s', r.name, r.lag_events,
                              COALESCE(date_trunc('second', r.last_claim_at)::text, 'never'));
        END IF;
        RETURN NEXT;
    END LOOP;

    -- 9. 'default', made by the install, receives every event: an application
    -- that claims only from named subscriptions leaves it holding the whole
    -- ring for ever. It is kept (nothing committed is lost), and said as soon
    -- as another subscription has been claimed from and it never has, and
    -- while it alone keeps a ring table past outbox.retention_delivered.
    keep := outbox._retention_guc('outbox.retention_delivered');
    check_name := 'default_subscription'; value := default_lag; status := 'ok';
    IF NOT has_default THEN
        message := 'there is no subscription ''default'': claims without a subscription raise 42704';
    ELSE
        SELECT string_agg(format('outbox.log_%s (sealed %s)', s.n, date_trunc('second', s.sealed_at)), ', ' ORDER BY s.sealed_at)
          INTO held
          FROM outbox.log_state s
         WHERE s.sealed_at < now() - keep AND NOT outbox._log_readers_passed(s.n, 'default');
        message := NULLIF(concat_ws('; ',
            CASE WHEN NOT default_claimed AND other_claimed IS NOT NULL THEN
                format('subscription ''default'' has never been claimed from while %L has: it keeps every event undelivered (%s now) and holds each ring table', other_claimed, default_lag) END,
            CASE WHEN held IS NOT NULL THEN
                format('subscription ''default'' holds %s past outbox.retention_delivered (%s) with %s events undelivered', held, keep, default_lag) END), '');
        IF message IS NULL THEN
            message := format('subscription ''default'': %s events not yet delivered, %s, holding no ring table past outbox.retention_delivered',
                              default_lag, CASE WHEN default_claimed THEN 'claimed from' ELSE 'no subscription claimed from yet' END);
        ELSE
            status := 'warn';
            message := message || '; if no worker claims without a subscription, SELECT outbox.drop_subscription(''default'') releases the log';
        END IF;
    END IF;
    RETURN NEXT;

    -- 10. The log ring: a sealed table its retention should have
    -- truncated, or an open table its rotation should have sealed, and why.
    -- Ten minutes of slack cover the maintenance interval and a few busy runs.
    check_name := 'log_ring'; value := 0; status := 'ok'; message := NULL;
    FOR r IN SELECT s.n, s.opened_at, s.sealed_at FROM outbox.log_state s ORDER BY s.n LOOP
        IF r.sealed_at IS NOT NULL AND r.sealed_at < now() - keep - interval '10 minutes' THEN
            why := CASE WHEN NOT outbox._log_readers_passed(r.n) THEN 'a log reader has not read past its events'
                        ELSE 'no maintenance run got its lock within 20 ms, or rows were written to it after its seal' END;
            message := concat_ws('; ', message, format('outbox.log_%s, sealed %s, is not truncated: %s',
                                                       r.n, date_trunc('second', r.sealed_at), why));
        ELSIF r.sealed_at IS NULL AND r.opened_at < now() - keep - interval '10 minutes' THEN
            message := concat_ws('; ', message, format('outbox.log_%s, open since %s, is not sealed: the next ring table is not free yet',
                                                       r.n, date_trunc('second', r.opened_at)));
        ELSE
            CONTINUE;
        END IF;
        value := value + 1;
        status := 'warn';
    END LOOP;
    -- A log restored from a dump waits for its rebase (sql/restore.sql)
    -- and its retention with it.
    FOR r IN SELECT x.restored_at FROM outbox.log_restore x LOOP
        message := concat_ws('; ', message, format('the log was restored from a dump at %s and waits for its rebase (the first claim of a subscription of the log, '
                                                   'or maintenance once the restore is over); its retention waits too', date_trunc('second', r.restored_at)));
        value := value + 1;
        status := 'warn';
    END LOOP;
    message := COALESCE(message, 'the log ring rotates and truncates on time');
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.health(interval, bigint, interval, interval, bigint) IS
'Health checks, one row each: (check_name text, status ''ok''|''warn''|''critical'', value numeric, message text). '
'Checks: handshake (critical, and then the only row, when the installed SQL is not this library''s: its message is the one every call into the library raises with 55000), backlog_age (ready events older than backlog_age, summed over every subscription; critical at backlog_critical), dead_letters (last hour, every subscription), '
'expired_leases (workers dying; every subscription), xmin_horizon (age in seconds of the oldest snapshot and the session holding it; prepared transactions too), '
'dead_tuples (the log''s hot relation with the most dead tuples: outbox.log_lanes, log_batches, log_exceptions or subscription_activity; warn at dead_tuples_warn and more than twice its live tuples), id_sequence (critical when outbox.event_id_seq has a CACHE above 1, which breaks per-subject order), background_worker (ok when a background worker serves this database; critical when the launcher is down, no worker process is free or none serves it yet; warn without preload or when outbox.databases excludes this database), '
'subscription (one row per subscription, value = its undelivered events: warn when paused, when retention removed events it had not read in the last day (its max_lag), or when it has ready events older than backlog_age and no claim within backlog_age; claims note their time at most once a second per session), '
'default_subscription (value = the undelivered events of the install''s subscription ''default'', which receives every event: warn as soon as another subscription has been claimed from and ''default'' never has, '
'and while ''default'' holds a ring table sealed longer ago than outbox.retention_delivered; the message names SELECT outbox.drop_subscription(''default'') for an application that claims only from named subscriptions; ok without ''default''), '
'log_ring (value = ring tables overdue: warn when a sealed table is still there 10 minutes after outbox.retention_delivered, naming a log reader that has not read past it, '
'or when the open table has not been sealed within outbox.retention_delivered plus 10 minutes, or when a log restored from a dump waits for its rebase). Errors: 22004 NULL threshold; 22023 interval outside 0..100 years, or a negative backlog_critical or dead_tuples_warn.';

-- Subjects that cannot progress now (the dashboard's Subjects page and
-- `outbox`): per subscription, a subject's earliest unfinished event (pending,
-- leased, or dead under the 'block' policy) holds back every later event of
-- the subject (the claim contract: per-subject commit order). It is listed when
-- that event cannot be claimed now and at least one event waits behind it:
--   leased    a lease that has not expired (until = its expiry);
--   retrying  failed, waiting for its backoff (until = its next attempt);
--   delayed   published with deliver_at in the future (until = then);
--   dead      a dead letter under the 'block' dead-letter policy (until NULL:
--             until someone replays or cancels it).
-- An event of the subject out on a live lease holds it even when an earlier
-- one was replayed behind it (the event out finishes first). A head that is
-- claimable now (ready, or its lease expired) is not blocked: the next claim
-- takes it, and if that was its last attempt the claim dead-letters it, after
-- which it is listed as dead (so is an event whose attempts a lowered
-- max_attempts used up: until its next claim it shows as retrying). It reads
-- the subscriptions' deliveries (outbox._log_deliveries), so the whole
-- retained log.
CREATE FUNCTION outbox.blocked_subjects(only_subscription text DEFAULT NULL, max_rows integer DEFAULT 100)
RETURNS TABLE (subscription text, subject text, event_id bigint, topic text, state text, reason text,
               attempts integer, last_error text, until timestamptz, waiting bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
-- The planner's row estimates for these set-returning reads are far too high, so JIT
-- would compile for about a second to save milliseconds.
SET jit = off
AS $$
DECLARE
    only_sub text;
BEGIN
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 100000 THEN
        RAISE EXCEPTION 'outbox: blocked_subjects() max_rows must be between 1 and 100000, got %', max_rows
            USING ERRCODE = '22023';
    END IF;
    IF only_subscription IS NOT NULL THEN
        only_sub := outbox._subscription(only_subscription);
    END IF;
    RETURN QUERY
    WITH unfinished AS (
        SELECT d.subscription AS sub, d.subject AS subj, d.event_id AS id, d.topic AS top, d.state AS st,
               d.attempts AS att, d.last_error AS err,
               CASE d.state WHEN 'leased' THEN d.lease_expires_at WHEN 'pending' THEN d.available_at END AS vis
          FROM outbox._log_deliveries d
         WHERE d.subject IS NOT NULL AND (only_sub IS NULL OR d.subscription = only_sub)
           AND (d.state IN ('pending', 'leased')
                OR (d.state = 'dead' AND EXISTS (SELECT 1 FROM outbox.log_exceptions x
                                                  WHERE x.subscription = d.subscription AND x.id = d.event_id AND x.blocks)))
    ), ranked AS (
        -- The holder: an event of the subject out on a live lease (after a replay
        -- it may be a later one: an event out finishes first), else the earliest.
        SELECT u.*, pg_catalog.row_number() OVER w AS rn, pg_catalog.count(*) OVER w - 1 AS behind
          FROM unfinished u
        WINDOW w AS (PARTITION BY u.sub, u.subj
                     ORDER BY (u.st = 'leased' AND u.vis > pg_catalog.now()) DESC, u.id
                     ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
    )
    SELECT r.sub, r.subj, r.id, r.top, r.st,
           CASE WHEN r.st = 'dead' THEN 'dead'
                WHEN r.st = 'leased' THEN 'leased'
                WHEN r.att > 0 THEN 'retrying'
                ELSE 'delayed' END,
           r.att, r.err,
           CASE WHEN r.st = 'dead' THEN NULL ELSE r.vis END,
           r.behind
      FROM ranked r
     WHERE r.rn = 1 AND r.behind > 0
       AND (r.st = 'dead' OR r.vis > pg_catalog.now())
     ORDER BY r.behind DESC, r.sub, r.subj
     LIMIT max_rows;
END
$$;

-- Deliveries per minute (the dashboard's sparklines and `outbox`): a
-- subscription counts the events acked from its finished batches
-- by the batch's finish time (batch precision, outbox._log_delivered) and its
-- rows of their own by their delivered_at. Minutes with no delivery are rows
-- of 0, so a chart needs no gap filling; a (subscription, topic) with no
-- delivery in the window has no rows. The log's batches keep event ids, not
-- topics: an event the log no longer holds (retention) is not counted.
-- An event acked from a batch of the log counts when its whole batch has
-- finished (every event acked, failed or its lease expired), so a batch with a
-- long lease still out shows its acks late, all in one minute. Deliveries that
-- left no record (whatever retention or purge removed) are not counted.
CREATE FUNCTION outbox.delivered_per_minute(minutes integer DEFAULT 60, only_subscription text DEFAULT NULL)
RETURNS TABLE (subscription text, topic text, minute timestamptz, delivered bigint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    only_sub text;
    first_minute timestamptz;
BEGIN
    IF minutes IS NULL OR minutes < 1 OR minutes > 1440 THEN
        RAISE EXCEPTION 'outbox: delivered_per_minute() minutes must be between 1 and 1440, got %', minutes
            USING ERRCODE = '22023';
    END IF;
    IF only_subscription IS NOT NULL THEN
        only_sub := outbox._subscription(only_subscription);
    END IF;
    first_minute := pg_catalog.date_trunc('minute', pg_catalog.now()) - (minutes - 1) * interval '1 minute';
    RETURN QUERY
    WITH d AS (
        SELECT c.name AS sub, l.topic AS top, f.delivered_at AS at
          FROM outbox.subscription_catalog c
         CROSS JOIN LATERAL outbox._log_delivered(c.name, first_minute) f
          JOIN outbox.log l ON l.id = f.id
         WHERE only_sub IS NULL OR c.name = only_sub
        UNION ALL
        SELECT x.subscription, x.topic, x.delivered_at
          FROM outbox.log_exceptions x
         WHERE x.state = 'delivered' AND x.delivered_at >= first_minute
           AND (only_sub IS NULL OR x.subscription = only_sub)
    ), counted AS (
        SELECT d.sub, d.top, pg_catalog.date_trunc('minute', d.at) AS m, pg_catalog.count(*) AS n
          FROM d GROUP BY 1, 2, 3
    )
    SELECT k.sub, k.top, g.m, COALESCE(n.n, 0)
      FROM (SELECT DISTINCT c.sub, c.top FROM counted c) k
     CROSS JOIN pg_catalog.generate_series(first_minute, pg_catalog.date_trunc('minute', pg_catalog.now()), interval '1 minute') AS g(m)
      LEFT JOIN counted n ON n.sub = k.sub AND n.top = k.top AND n.m = g.m
     ORDER BY 1, 2, 3;
END
$$;

COMMENT ON FUNCTION outbox.blocked_subjects(text, integer) IS
'Subjects that cannot progress now, and why. Arguments: only_subscription (text; NULL = every subscription), max_rows (integer, 1 to 100000, default 100). '
'One row per subscription and subject whose earliest unfinished event cannot be claimed now while later events of the subject wait behind it (per-subject commit order): '
'subscription, subject, event_id and topic (the holding event), state (its delivery state: leased, pending or dead), reason (leased: a lease not yet expired; retrying: failed and waiting for its backoff; '
'delayed: deliver_at in the future; dead: a dead letter under the ''block'' dead-letter policy, which holds the subject until it is replayed or cancelled), attempts, last_error, '
'until (timestamptz: when the lease expires or the event becomes claimable; NULL for dead), waiting (bigint: events of the subject queued behind it). Most waiting first. '
'An event out on a live lease holds its subject even when an earlier one was replayed behind it. A head that is claimable now is not listed (one whose lease expired on its last attempt appears as dead once the next claim dead-letters it). Readable by outbox_monitor (no payloads). Reads the whole retained log: poll every 15 s or slower. '
'Errors: 22023 max_rows out of range or a malformed subscription name; 42704 unknown subscription.';

COMMENT ON FUNCTION outbox.delivered_per_minute(integer, text) IS
'Deliveries per minute over the last minutes, for charts. Arguments: minutes (integer, 1 to 1440, default 60: the current minute and the minutes - 1 before it), only_subscription (text; NULL = every subscription). '
'Rows: subscription, topic, minute (timestamptz, the minute''s start), delivered (bigint), ordered by subscription, topic, minute; every minute of the window has a row (0 when none) for each subscription and topic '
'with at least one delivery in the window. A subscription counts events acked from a batch when the whole batch has finished '
'(batch precision: a batch with a lease still out shows its acks late, together) and its rows of their own at their delivered_at. Not counted: events the log no longer holds, '
'and what retention or purge removed. Readable by outbox_monitor. Errors: 22023 minutes out of range or a malformed subscription name; 42704 unknown subscription.';
