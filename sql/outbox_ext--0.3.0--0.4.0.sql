-- outbox_ext 0.3.0 -> 0.4.0
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.4.0'" to load this file. \quit

-- Liveness (issue 14): no committed event is stranded and no claim waits.
-- - Headship is decided under the subject lock from a snapshot taken after it, at
--   every isolation level (src/subject.rs); replay of a cancelled event takes the
--   subject lock.
-- - outbox.subject_repairs has no unique key (an insert never waits) and is dumped.
-- - Subject locks are bounded per transaction (outbox.max_subject_locks, 54000).
-- - One list of maintenance steps for the worker and run_maintenance().
-- - ALTER SEQUENCE outbox.event_id_seq CACHE n is refused; health() checks it.

ALTER TABLE outbox.subject_repairs DROP CONSTRAINT subject_repairs_pkey;
ALTER TABLE outbox.subject_repairs ALTER COLUMN subject SET NOT NULL;
SELECT pg_catalog.pg_extension_config_dump('outbox.subject_repairs', '');

-- Vacuum never truncates the hot queue: truncation takes an ACCESS EXCLUSIVE lock
-- that every claim and publish would wait for.
ALTER TABLE outbox.event_queue SET (vacuum_truncate = false);

CREATE FUNCTION outbox."_lock_subject"(
	"subject" TEXT /* Option < & str > */
) RETURNS void
VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'lock_subject_wrapper';

CREATE FUNCTION outbox."_maintenance_step"(
	"step" TEXT /* & str */
) RETURNS TABLE (
	"removed" bigint,  /* i64 */
	"done" bool  /* bool */
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'maintenance_step_wrapper';

CREATE FUNCTION outbox."_maintenance_steps"() RETURNS TABLE (
	"step" TEXT,  /* String */
	"logged_as" TEXT  /* Option < String > */
)
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', 'maintenance_steps_wrapper';

CREATE OR REPLACE FUNCTION outbox.replay(id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    t text;
    subj text;
BEGIN
    IF id IS NULL THEN
        RETURN false;
    END IF;
    -- Subject lock first, as publish and cancel take it: whether the replayed event
    -- leads its subject is decided under it, from a snapshot taken after it
    -- (outbox._promote_heads, src/subject.rs), whatever the isolation level.
    SELECT q.subject INTO subj FROM outbox.event_queue q
     WHERE q.id OPERATOR(pg_catalog.=) replay.id AND q.state OPERATOR(pg_catalog.=) 'dead';
    IF NOT FOUND THEN
        SELECT a.subject INTO subj FROM outbox.event_archive a
         WHERE a.id OPERATOR(pg_catalog.=) replay.id AND a.state OPERATOR(pg_catalog.=) 'cancelled';
    END IF;
    PERFORM outbox._lock_subject(subj);
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
    -- They enter as non-heads; the promotion below makes the subject's earliest
    -- live event its head.
    WITH moved AS (
        DELETE FROM outbox.event_archive a
         WHERE a.id OPERATOR(pg_catalog.=) replay.id AND a.state OPERATOR(pg_catalog.=) 'cancelled'
        RETURNING a.*
    )
    INSERT INTO outbox.event_queue (id, topic, subject, dispatch_key, payload, headers, state,
                                    attempts, max_attempts, visible_at, last_error, errors, published_at, is_head)
    SELECT m.id, m.topic, m.subject, m.dispatch_key, m.payload, m.headers, 'pending',
           0, m.max_attempts, GREATEST(pg_catalog.clock_timestamp(), outbox._visible_floor()), m.last_error, m.errors, m.published_at,
           m.subject IS NULL
      FROM moved m
    RETURNING topic INTO t;
    IF t IS NULL THEN
        RETURN false;
    END IF;
    IF subj IS NOT NULL THEN
        PERFORM outbox._promote_heads(ARRAY[subj]);
    END IF;
    PERFORM outbox._wake(t);
    RETURN true;
END
$$;

COMMENT ON FUNCTION outbox.replay(bigint) IS
'Move a dead or cancelled event back to pending, attempts reset to 0, attempt history and last_error kept. Returns true when it did, '
'false for any other state or an unknown/NULL id (pending, leased and delivered events are never replayed). '
'The event keeps its id, so it keeps its place in its subject''s order and its dispatch key. Takes the subject''s lock (waits for a publisher of that subject to finish); '
'errors: 54000 when the transaction would hold more than outbox.max_subject_locks subject locks. Follows seed 004 (dead-lettered rows are kept for replay) and pg-boss redrive.';

CREATE OR REPLACE FUNCTION outbox.cancel(id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint;
    subj text;
BEGIN
    IF id IS NULL THEN
        RETURN false;
    END IF;
    -- Subject lock first, row lock second: the order ack and publish use, so a
    -- cancel cannot deadlock with the promotion of the next head.
    SELECT q.subject INTO subj FROM outbox.event_queue q WHERE q.id OPERATOR(pg_catalog.=) cancel.id;
    IF subj IS NOT NULL THEN
        PERFORM outbox._lock_subject(subj);
    END IF;
    WITH moved AS (
        DELETE FROM outbox.event_queue q
         WHERE q.id OPERATOR(pg_catalog.=) cancel.id
           AND q.state OPERATOR(pg_catalog.=) ANY (ARRAY['pending', 'dead'])
        RETURNING q.*
    )
    INSERT INTO outbox.event_archive (id, topic, subject, dispatch_key, payload, headers, state,
                                      attempts, max_attempts, leased_by, last_error, errors,
                                      published_at, finished_at)
    SELECT m.id, m.topic, m.subject, m.dispatch_key, m.payload, m.headers, 'cancelled',
           m.attempts, m.max_attempts, m.leased_by, m.last_error, m.errors,
           m.published_at, pg_catalog.clock_timestamp()
      FROM moved m;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n OPERATOR(pg_catalog.>) 0 THEN
        -- A cancelled head of a subject may unblock the next event.
        IF subj IS NOT NULL THEN
            PERFORM outbox._promote_heads(ARRAY[subj]);
        END IF;
        PERFORM outbox._wake(NULL);
    END IF;
    RETURN n OPERATOR(pg_catalog.>) 0;
END
$$;

COMMENT ON FUNCTION outbox.cancel(bigint) IS
'Cancel an event that is pending (ready, delayed or waiting for a retry) or dead: it moves to the archive as cancelled and a later event of its subject may proceed. '
'Returns true when it did; false for leased, delivered, already cancelled, unknown or NULL ids. A leased event cannot be cancelled under a worker: fail it or let the lease expire. '
'Cancelling a dead event is how an operator unblocks a subject under the ''block'' dead-letter policy. Takes the subject''s lock (waits for a publisher of that subject to finish); '
'errors: 54000 when the transaction would hold more than outbox.max_subject_locks subject locks.';

DROP FUNCTION outbox._log_maintenance(timestamptz, bigint, bigint);

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
CREATE OR REPLACE PROCEDURE outbox.run_maintenance()
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
'One maintenance run, the same steps in the same order as the background worker''s (outbox._maintenance_steps(): the claim low-water audit, retention of delivered and cancelled events, '
'of dead letters and of orphaned dispatch keys with the default windows, then the subject-heads repair), each in committed batches with outbox.purge_delay between them; '
'recorded in outbox.maintenance_log (purged_delivered, purged_dead, purged_keys). None of the steps is needed for delivery. '
'Run it with CALL outside an explicit transaction block. Without preload, schedule it with pg_cron: '
'SELECT cron.schedule(''outbox-retention'', ''* * * * *'', ''CALL outbox.run_maintenance()'').';

CREATE OR REPLACE FUNCTION outbox.health(
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
    -- 1. Backlog age (seed 000 alerts when pending events older than 60 s exceed 1,000).
    SELECT count(*) INTO n FROM outbox.event_queue e
     WHERE e.state = 'pending' AND e.visible_at <= now() - backlog_age;
    check_name := 'backlog_age'; value := n;
    status := CASE WHEN n >= backlog_critical THEN 'critical' WHEN n > 0 THEN 'warn' ELSE 'ok' END;
    message := format('%s ready events waiting longer than %s', n, backlog_age);
    RETURN NEXT;

    -- 2. Dead letters in the last hour.
    SELECT count(*) INTO n FROM outbox.event_queue e
     WHERE e.state = 'dead' AND e.dead_at > now() - interval '1 hour';
    check_name := 'dead_letters'; value := n;
    status := CASE WHEN n >= 100 THEN 'critical' WHEN n > 0 THEN 'warn' ELSE 'ok' END;
    message := format('%s events dead-lettered in the last hour', n);
    RETURN NEXT;

    -- 3. Expired leases: workers died or handlers outlive their lease.
    SELECT count(*) INTO n FROM outbox.event_queue e
     WHERE e.state = 'leased' AND e.visible_at <= now();
    check_name := 'expired_leases'; value := n;
    status := CASE WHEN n > 0 THEN 'warn' ELSE 'ok' END;
    message := format('%s leases expired without ack or fail', n);
    RETURN NEXT;

    -- 4. The xmin horizon: a long transaction keeps vacuum from cleaning the queue.
    SELECT a.pid, a.usename, a.application_name, a.state, now() - a.xact_start AS age
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

    -- 5. Dead tuples in the hot relation.
    SELECT s.n_dead_tup, s.n_live_tup, s.last_autovacuum INTO r
      FROM pg_stat_all_tables s WHERE s.relid = 'outbox.event_queue'::regclass;
    check_name := 'dead_tuples'; value := COALESCE(r.n_dead_tup, 0);
    status := CASE WHEN COALESCE(r.n_dead_tup, 0) >= dead_tuples_warn
                        AND COALESCE(r.n_dead_tup, 0) > 2 * COALESCE(r.n_live_tup, 0) THEN 'warn' ELSE 'ok' END;
    message := format('%s dead / %s live tuples in outbox.event_queue (last autovacuum %s)',
                      COALESCE(r.n_dead_tup, 0), COALESCE(r.n_live_tup, 0), COALESCE(r.last_autovacuum::text, 'never'));
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

    -- 7. The background worker.
    SELECT * INTO w FROM outbox.wakeup_status();
    check_name := 'background_worker'; value := w.worker_pid;
    IF NOT w.preloaded THEN
        status := 'warn';
        message := 'outbox_ext is not in shared_preload_libraries: no background wake-ups or maintenance (schedule CALL outbox.run_maintenance() with pg_cron)';
    ELSIF w.worker_pid = 0 THEN
        status := 'critical';
        message := 'the outbox background worker is not running';
    ELSIF w.database <> (SELECT oid FROM pg_database WHERE datname = current_database()) THEN
        status := 'warn';
        message := format('the background worker serves another database (outbox.database = %L)', current_setting('outbox.database'));
    ELSE
        status := 'ok';
        message := format('background worker pid %s, %s passes', w.worker_pid, w.passes);
    END IF;
    RETURN NEXT;
END
$$;

COMMENT ON FUNCTION outbox.health(interval, bigint, interval, interval, bigint) IS
'Health checks, one row each: (check_name text, status ''ok''|''warn''|''critical'', value numeric, message text). '
'Checks: backlog_age (ready events older than backlog_age; critical at backlog_critical, after seed 000''s alert), dead_letters (last hour), '
'expired_leases (workers dying), xmin_horizon (age in seconds of the oldest snapshot and the session holding it; prepared transactions too), '
'dead_tuples (hot relation), id_sequence (critical when outbox.event_id_seq has a CACHE above 1, which breaks per-subject order), background_worker (running, preloaded, serving this database). Errors: 22004 NULL threshold; 22023 interval outside 0..100 years.';

-- Per-subject order relies on ids being drawn in the order publishers take the
-- subject lock; with a sequence CACHE above 1 each backend pre-allocates a block
-- of ids, and a later publisher can draw a smaller id. So ALTER SEQUENCE that
-- leaves outbox.event_id_seq with a cache is refused (outbox.health() reports a
-- cache set while event triggers were off).
CREATE FUNCTION outbox._sequence_guard() RETURNS event_trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c bigint;
BEGIN
    SELECT s.seqcache INTO c FROM pg_sequence s WHERE s.seqrelid = to_regclass('outbox.event_id_seq');
    IF c > 1 THEN
        RAISE EXCEPTION 'outbox: outbox.event_id_seq must keep CACHE 1 (got %)', c
            USING ERRCODE = '0A000',
                  HINT = 'Event ids must be drawn in subject lock order for per-subject delivery order; a sequence cache breaks it.';
    END IF;
END
$$;

COMMENT ON FUNCTION outbox._sequence_guard() IS
'Event trigger function (ddl_command_end, ALTER SEQUENCE): refuses, with SQLSTATE 0A000, a change that leaves outbox.event_id_seq with a CACHE above 1, '
'since per-subject delivery order needs ids drawn in subject lock order. Returns nothing.';

CREATE EVENT TRIGGER outbox_sequence_guard ON ddl_command_end
    WHEN TAG IN ('ALTER SEQUENCE')
    EXECUTE FUNCTION outbox._sequence_guard();

COMMENT ON FUNCTION outbox._promote_heads(text[], boolean) IS
'Internal: make the earliest live event of each subject its head (claimable), under the subject lock and from a snapshot taken after it, at any isolation level. '
'wait = false never waits for a lock. Subjects whose lock is busy, past the transaction''s promotion budget (max_locks_per_transaction) or whose next head row is locked '
'are left in outbox.subject_repairs, which every claim retries. Returns the number of events promoted (integer). No errors of its own. See src/subject.rs.';

COMMENT ON FUNCTION outbox._lock_subject(text) IS
'Internal: take a subject''s advisory lock until transaction end (NULL: nothing), waiting for it, counted against outbox.max_subject_locks. '
'Used by cancel and replay, which decide headship. Returns void. Errors: 54000 when the transaction would hold more than outbox.max_subject_locks subject locks.';

COMMENT ON FUNCTION outbox._maintenance_steps() IS
'Internal: the maintenance steps in the order both the background worker and outbox.run_maintenance() run them: (step text, logged_as text, the outbox.maintenance_runs column '
'that records the step''s count, or NULL). Steps: audit (claim low-water mark), delivered, dead, keys (retention), heads (subject-heads repair). No errors.';

COMMENT ON FUNCTION outbox._maintenance_step(text) IS
'Internal: one batch of a maintenance step (see outbox._maintenance_steps()) in the caller''s transaction: (removed bigint, done boolean; done = nothing more to do in this run). '
'Errors: 22023 unknown step; those of outbox._purge_step().';

COMMENT ON FUNCTION outbox._log_maintenance(timestamptz, jsonb) IS
'Internal: record one run of outbox.run_maintenance() in outbox.maintenance_runs; counts maps purged_delivered, purged_dead and purged_keys to rows removed (missing = 0). Returns void.';

-- Dead-letter policy changes reach dead letters already there and ones a
-- concurrent fail() or claim is creating; create_topic and drop_topic apply them too.
-- A topic's dead-letter policy applies to the dead letters already there: 'skip'
-- releases their subjects at once, 'block' starts holding them. Leased events of
-- the topic are updated too (blocks_subject only counts once an event is dead, and
-- every dead transition sets it again): the UPDATE then waits for a claim or a
-- fail() that is turning one of them dead and sees it dead, where an UPDATE of
-- dead rows alone would miss that uncommitted transition and leave it under the
-- old policy. fail() takes the topic row FOR SHARE first, so it reads a policy
-- change that is committing (src/lease.rs).
CREATE FUNCTION outbox._apply_dead_letter_policy(topic text, policy text) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    released text[];
BEGIN
    WITH changed AS (
        UPDATE outbox.event_queue q
           SET blocks_subject = (policy OPERATOR(pg_catalog.=) 'block')
         WHERE q.topic OPERATOR(pg_catalog.=) _apply_dead_letter_policy.topic
           AND q.state OPERATOR(pg_catalog.=) ANY (ARRAY['dead', 'leased']) AND q.subject IS NOT NULL
        RETURNING q.subject, q.state
    )
    SELECT pg_catalog.array_agg(DISTINCT c.subject) FILTER (WHERE c.state OPERATOR(pg_catalog.=) 'dead')
      INTO released FROM changed c;
    IF released IS NOT NULL AND policy OPERATOR(pg_catalog.=) 'skip' THEN
        PERFORM outbox._promote_heads(released);
        PERFORM outbox._wake(topic);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox.create_topic(
    topic               text,
    max_attempts        integer  DEFAULT NULL,
    backoff_base        interval DEFAULT NULL,
    backoff_max         interval DEFAULT NULL,
    default_lease       interval DEFAULT NULL,
    dead_letter_policy  text     DEFAULT 'block',
    retention_delivered interval DEFAULT NULL,
    retention_dead      interval DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_topic(topic);
    PERFORM outbox._check_policy(max_attempts, backoff_base, backoff_max, default_lease,
                                 dead_letter_policy, retention_delivered, retention_dead);
    INSERT INTO outbox.topics (topic, max_attempts, backoff_base, backoff_max, default_lease,
                               dead_letter_policy, retention_delivered, retention_dead)
    VALUES (topic, max_attempts, backoff_base, backoff_max, default_lease,
            dead_letter_policy, retention_delivered, retention_dead);
    -- Dead letters published before the topic was registered followed the default
    -- ('block'); they follow the registered policy from now on.
    IF dead_letter_policy OPERATOR(pg_catalog.<>) 'block' THEN
        PERFORM outbox._apply_dead_letter_policy(topic, dead_letter_policy);
    END IF;
EXCEPTION WHEN unique_violation THEN
    RAISE EXCEPTION 'outbox: topic % already exists', pg_catalog.quote_literal(topic)
        USING ERRCODE = '42710', HINT = 'Use outbox.alter_topic().';
END
$$;

CREATE OR REPLACE FUNCTION outbox.alter_topic(
    topic               text,
    max_attempts        integer  DEFAULT NULL,
    backoff_base        interval DEFAULT NULL,
    backoff_max         interval DEFAULT NULL,
    default_lease       interval DEFAULT NULL,
    dead_letter_policy  text     DEFAULT NULL,
    retention_delivered interval DEFAULT NULL,
    retention_dead      interval DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cur outbox.topics;
    released text[];
BEGIN
    PERFORM outbox._check_topic(topic);
    SELECT * INTO cur FROM outbox.topics t WHERE t.topic OPERATOR(pg_catalog.=) alter_topic.topic FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox: topic % is not registered', pg_catalog.quote_literal(topic) USING ERRCODE = 'P0002';
    END IF;
    PERFORM outbox._check_policy(max_attempts, backoff_base, backoff_max, default_lease,
                                 COALESCE(dead_letter_policy, cur.dead_letter_policy), retention_delivered, retention_dead);
    UPDATE outbox.topics t SET
        max_attempts        = COALESCE(alter_topic.max_attempts, t.max_attempts),
        backoff_base        = COALESCE(alter_topic.backoff_base, t.backoff_base),
        backoff_max         = COALESCE(alter_topic.backoff_max, t.backoff_max),
        default_lease       = COALESCE(alter_topic.default_lease, t.default_lease),
        dead_letter_policy  = COALESCE(alter_topic.dead_letter_policy, t.dead_letter_policy),
        retention_delivered = COALESCE(alter_topic.retention_delivered, t.retention_delivered),
        retention_dead      = COALESCE(alter_topic.retention_dead, t.retention_dead),
        updated_at          = pg_catalog.now()
     WHERE t.topic OPERATOR(pg_catalog.=) alter_topic.topic;
    IF dead_letter_policy IS NOT NULL AND dead_letter_policy OPERATOR(pg_catalog.<>) cur.dead_letter_policy THEN
        PERFORM outbox._apply_dead_letter_policy(alter_topic.topic, alter_topic.dead_letter_policy);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox.drop_topic(topic text, force boolean DEFAULT false) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    live bigint;
    policy text;
BEGIN
    PERFORM outbox._check_topic(topic);
    IF force IS NULL THEN
        RAISE EXCEPTION 'outbox: force must not be NULL' USING ERRCODE = '22004';
    END IF;
    PERFORM 1 FROM outbox.topics t WHERE t.topic OPERATOR(pg_catalog.=) drop_topic.topic FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT pg_catalog.count(*) INTO live FROM outbox.event_queue q
     WHERE q.topic OPERATOR(pg_catalog.=) drop_topic.topic;
    IF live OPERATOR(pg_catalog.>) 0 AND NOT force THEN
        RAISE EXCEPTION 'outbox: topic % has % undelivered events', pg_catalog.quote_literal(topic), live
            USING ERRCODE = '55006', HINT = 'Drain, cancel or purge them first, or pass force => true (the events stay and fall back to the GUC defaults).';
    END IF;
    DELETE FROM outbox.topics t WHERE t.topic OPERATOR(pg_catalog.=) drop_topic.topic
    RETURNING t.dead_letter_policy INTO policy;
    -- The events that stay fall back to the defaults, whose policy is 'block'.
    IF policy OPERATOR(pg_catalog.<>) 'block' THEN
        PERFORM outbox._apply_dead_letter_policy(drop_topic.topic, 'block');
    END IF;
    RETURN true;
END
$$;

COMMENT ON FUNCTION outbox._apply_dead_letter_policy(text, text) IS
'Internal: make the dead letters of topic follow policy (''block'' or ''skip''), releasing their subjects under ''skip''; used by create_topic, alter_topic and drop_topic. '
'Also updates the topic''s leased events, so a dead transition committing concurrently is not left under the old policy. Returns void.';


CREATE OR REPLACE FUNCTION outbox._purge_step(kind text, older_than interval, batch_size integer) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint := 0;
    blocked text[];
    key_age interval := outbox._retention_guc('outbox.retention_dispatch_keys');
BEGIN
    IF kind IS NULL OR kind <> ALL (ARRAY['delivered', 'dead', 'keys', 'heads']) THEN
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
        -- Rows are deleted by ctid (stable while the FOR UPDATE lock is held): the
        -- archive has no btree on id, and a join on id would scan it per batch.
        WITH victims AS (
            SELECT a.ctid AS tid FROM outbox.event_archive a
              LEFT JOIN outbox.topics t ON t.topic = a.topic
             WHERE a.finished_at < pg_catalog.clock_timestamp()
                   - COALESCE(older_than, t.retention_delivered, outbox._retention_guc('outbox.retention_delivered'))
             LIMIT batch_size
               FOR UPDATE OF a SKIP LOCKED
        ), gone AS (
            DELETE FROM outbox.event_archive a WHERE a.ctid = ANY (ARRAY(SELECT v.tid FROM victims v))
            RETURNING a.id, a.dispatch_key
        ), keys AS (
            DELETE FROM outbox.dispatch_keys k USING gone g
             WHERE k.dispatch_key = g.dispatch_key AND k.event_id = g.id
               AND k.created_at < pg_catalog.clock_timestamp() - key_age
            RETURNING 1
        )
        SELECT pg_catalog.count(*) INTO n FROM gone;
    ELSIF kind = 'dead' THEN
        WITH victims AS (
            SELECT q.id FROM outbox.event_queue q
              LEFT JOIN outbox.topics t ON t.topic = q.topic
             WHERE q.state = 'dead'
               AND q.dead_at < pg_catalog.clock_timestamp()
                   - COALESCE(older_than, t.retention_dead, outbox._retention_guc('outbox.retention_dead'))
             LIMIT batch_size
               FOR UPDATE OF q SKIP LOCKED
        ), gone AS (
            -- The state test is repeated: a replay may have won the row meanwhile.
            DELETE FROM outbox.event_queue q WHERE q.id = ANY (ARRAY(SELECT v.id FROM victims v)) AND q.state = 'dead'
            RETURNING q.id, q.dispatch_key, q.subject, q.blocks_subject
        ), keys AS (
            DELETE FROM outbox.dispatch_keys k USING gone g
             WHERE k.dispatch_key = g.dispatch_key AND k.event_id = g.id
               AND k.created_at < pg_catalog.clock_timestamp() - key_age
            RETURNING 1
        )
        SELECT pg_catalog.count(*), pg_catalog.array_agg(DISTINCT g.subject) FILTER (WHERE g.blocks_subject)
          INTO n, blocked FROM gone g;
        -- Purging a blocking dead letter unblocks its subject.
        IF blocked IS NOT NULL THEN
            PERFORM outbox._promote_heads(blocked, false);
        END IF;
    ELSIF kind = 'heads' THEN
        -- Repair of heads that writes around the outbox functions left unset (a
        -- manual INSERT, a data-only restore); the functions themselves keep heads
        -- right without it (src/subject.rs).
        SELECT pg_catalog.array_agg(DISTINCT q.subject) INTO blocked
          FROM outbox.event_queue q
         WHERE NOT q.is_head AND q.state <> 'dead'
           AND NOT EXISTS (SELECT 1 FROM outbox.event_queue p
                            WHERE p.subject = q.subject AND p.id < q.id
                              AND (p.state <> 'dead' OR p.blocks_subject));
        IF blocked IS NOT NULL THEN
            n := outbox._promote_heads(blocked, false);
        END IF;
    ELSE
        -- Keys whose events are gone, once they are older than the key window.
        WITH victims AS (
            SELECT k.dispatch_key FROM outbox.dispatch_keys k
             WHERE k.created_at < pg_catalog.clock_timestamp() - GREATEST(key_age, COALESCE(older_than, interval '0'))
               AND NOT EXISTS (SELECT 1 FROM outbox.event_queue q WHERE q.id = k.event_id)
               AND NOT EXISTS (SELECT 1 FROM outbox.event_archive a WHERE a.id = k.event_id)
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

-- Comments of the C functions whose contract changed.
COMMENT ON FUNCTION outbox.publish(text, jsonb, text, text, jsonb, timestamptz) IS
'Publish one event in the caller''s transaction; returns its id (bigint). It never commits: the event exists iff the caller commits (savepoints included). '
'Arguments: topic (lowercase dot-separated segments of [a-z0-9_-], 1..255 chars), payload (any JSON value, at most outbox.max_payload_bytes bytes), '
'subject (ordering key: events of one subject are delivered in commit order; publishers of one subject are serialised by a transaction-scoped advisory lock), '
'dispatch_key (idempotency key: a second publish with a retained key inserts nothing and returns the first event''s id), '
'headers (JSON object of string values; W3C traceparent/tracestate are passed through; outbox.traceparent is copied in when absent), '
'deliver_at (not claimable before this time; past means now). '
'Errors: 22004 NULL topic or payload; 22023 bad topic, headers not an object of strings, deliver_at = infinity; 54000 payload too large, or the subject''s lock would make the transaction hold more than outbox.max_subject_locks (default 1000) subject locks; '
'P0002 unregistered topic with outbox.strict_topics = on. '
'Follows seeds 000 (publishOutboxEvent in the caller''s transaction, dispatchKey) and 001 (publish_in_tx, subject_id).';

COMMENT ON FUNCTION outbox.publish_batch(text, jsonb[], text[], text[]) IS
'Publish many events of one topic in one call, in the caller''s transaction; returns their ids (SETOF bigint) in input order. '
'Arguments: topic as in publish; payloads (jsonb[], 1..outbox.max_batch_size elements, none NULL); subjects and dispatch_keys (NULL, or arrays of the same length whose elements may be NULL). '
'Same validation and semantics as publish: per-subject order follows input order, a repeated dispatch key (in the batch or already retained) returns the first event''s id. '
'Errors: 22004 NULL topic, payloads or payload element; 22023 bad topic, array length mismatch, empty or oversized batch (54000 when over outbox.max_batch_size); 54000 payload too large, more than 1000 distinct subjects, or more than outbox.max_subject_locks subject locks held by the transaction (each holds an advisory lock until commit); P0002 strict topics. '
'Follows pgmq send_batch.';

COMMENT ON FUNCTION outbox.fail(bigint, uuid, text, interval, boolean) IS
'Report a failed delivery. Returns the new state: ''pending'' (retry scheduled), ''dead'' (permanent, or attempts reached max_attempts), or ''stale'' (token not current; nothing changed). '
'Arguments: error (text kept as last_error and appended to the attempt history, which keeps the first failure, {"omitted": n} and the latest 18 once it holds 20 entries; NULL is stored as ''(no error text)''; truncated to 8 kB), '
'retry_in (delay before the retry, >= 0 and <= 365 days; NULL = capped exponential backoff: base * 2^(attempt-1) capped at backoff_max, equal jitter, never zero), '
'permanent (true dead-letters at once). NULL id or lease_token returns ''stale''. Errors (raised before any change): 22004 NULL permanent; 22023 negative or over-long retry_in. '
'Backoff follows seed 004 (failures back off, dead-letter after maxAttempts); the dead-letter state follows seed 000.';


-- Privileges, as sql/security.sql sets them on a fresh install.
REVOKE EXECUTE ON FUNCTION outbox._lock_subject(text), outbox._maintenance_steps(), outbox._maintenance_step(text),
    outbox._log_maintenance(timestamptz, jsonb), outbox._sequence_guard(), outbox._apply_dead_letter_policy(text, text) FROM PUBLIC;
ALTER FUNCTION outbox._log_maintenance(timestamptz, jsonb) SECURITY DEFINER;
ALTER FUNCTION outbox.replay(bigint) SECURITY DEFINER;
ALTER FUNCTION outbox.cancel(bigint) SECURITY DEFINER;
ALTER FUNCTION outbox.create_topic(text, integer, interval, interval, interval, text, interval, interval) SECURITY DEFINER;
ALTER FUNCTION outbox.alter_topic(text, integer, interval, interval, interval, text, interval, interval) SECURITY DEFINER;
ALTER FUNCTION outbox.drop_topic(text, boolean) SECURITY DEFINER;
ALTER FUNCTION outbox._purge_step(text, interval, integer) SECURITY DEFINER;
GRANT EXECUTE ON FUNCTION outbox._log_maintenance(timestamptz, jsonb), outbox._maintenance_steps(), outbox._maintenance_step(text) TO outbox_admin;
