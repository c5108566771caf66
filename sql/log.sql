-- The event log: the append-only storage that every subscription reads
-- (src/log/). publish writes every event here, and nowhere else
-- (src/publish.rs).
--
-- A fixed ring of four tables created here, so that each belongs to the
-- extension (DROP EXTENSION, grants, the upgrade's schema comparison) without
-- any DDL at run time. outbox.log_state names the one publishers write.
-- Retention empties a whole table with TRUNCATE, whose lock it waits for at
-- most 20 ms (src/log/mod.rs, invariant 4), so a held xmin leaves no dead
-- tuple in the log and nobody queues behind its cleanup for longer.
--
-- Dumped (0.11.0), with the readers' tables below: a row's txid names a
-- transaction of this cluster, so a restore is rebased into the restoring
-- cluster's ids before anyone reads it (sql/restore.sql, src/log/restore.rs).
--
-- A row is written once, by publish, and never updated or deleted (but a
-- restored row's txid, once, by the rebase: sql/restore.sql):
--   txid  the publishing transaction's id, assigned before the event's id is
--         drawn (src/publish.rs), so that a reader can find late committers
--         by transaction;
--   lane  the reader's unit of order: a subject's events share one lane
--         (hash of the subject), events without a subject go to lanes in runs
--         of 64 ids, so one lane's window reads adjacent heap pages.
-- Indexes: (lane, id) for a lane's window, (txid, lane) for the events of one
-- transaction that committed late. Both grow at their right edge. (deliver_at)
-- of delayed events only (0.12.0): the background worker's wake-up when one
-- comes due (src/worker.rs); an event published without a delay costs it
-- nothing.
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
            CREATE INDEX log_%1$s_deliver_at ON outbox.log_%1$s (deliver_at) WHERE deliver_at IS NOT NULL;
        $ddl$, n);
    END LOOP;
END
$$;

-- Every logged event, whichever ring table holds it.
CREATE VIEW outbox.log AS
SELECT 0::smallint AS ring, l.* FROM outbox.log_0 l
UNION ALL SELECT 1::smallint, l.* FROM outbox.log_1 l
UNION ALL SELECT 2::smallint, l.* FROM outbox.log_2 l
UNION ALL SELECT 3::smallint, l.* FROM outbox.log_3 l;
COMMENT ON VIEW outbox.log IS
'Every event in the log ring (outbox.log_0 .. outbox.log_3), one row each, with the ring table that holds it (ring). Columns: ring, id, txid (the publishing '
'transaction), lane, topic, subject, dispatch_key, payload, headers, max_attempts, published_at, deliver_at. Every event published, '
'until retention empties its ring table.';

-- The lane of event `id` with `subject` (src/log/mod.rs, `lane`, the one
-- publish uses): hashtext(subject) & 15, or for an event without a subject
-- its run of 64 ids, 16 lanes round. For SQL that looks one up.
CREATE FUNCTION outbox._lane(id bigint, subject text) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN subject IS NULL THEN ((id OPERATOR(pg_catalog./) 64) OPERATOR(pg_catalog.%) 16)::smallint
                ELSE (pg_catalog.hashtext(subject) OPERATOR(pg_catalog.&) 15)::smallint END
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
) WITH (vacuum_truncate = false);  -- read by publishers: see sql/schema.sql
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
    -- 0.10.0: the subscription's first cursor (create_subscription): an event
    -- visible in it was committed before the subscription and is not its own
    -- (outbox._log_deliveries). NULL for lanes made before 0.10.0 or lazily.
    start_snap   pg_snapshot,
    -- 0.10.0: events of the lane cancelled before the lane read them
    -- (outbox.cancel, src/log/cancel.rs): the claim that reads one leaves it out
    -- of its batch and drops it from here.
    skips        bigint[],
    PRIMARY KEY (subscription, lane)
) WITH (fillfactor = 50, vacuum_truncate = false);  -- HOT updates by every claim

-- Batches in flight: a slice of one lane's window, leased in rounds. state is
-- src/log/batch.rs's encoding (ids, per-event state, rounds, each round's
-- lease expiry). A finished batch is deleted. leased_by[r] (0.11.0) is the
-- worker that claimed round r: operators see who holds an event (leased_by of
-- outbox.deliveries), and an event that leaves the batch keeps its holder's
-- name in its row and attempt history; NULL for rounds handed out before.
-- A batch id fills 48 bits of a lease token (src/log/batch.rs, Token).
CREATE SEQUENCE outbox.log_batch_seq AS bigint MAXVALUE 281474976710655;
CREATE TABLE outbox.log_batches (
    id           bigint      PRIMARY KEY,
    subscription text        NOT NULL,
    lane         smallint    NOT NULL,
    state        bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    leased_by    text[]
) WITH (fillfactor = 50, vacuum_truncate = false);  -- HOT updates by every ack

-- Calls deferred to their transaction's commit (src/log/deferred.rs): an
-- ack, fail or extend_lease of a batch event made inside a transaction block
-- writes a row here instead of the shared batch row, so two transactions that
-- ack events of the same batches never wait for each other. The transaction
-- applies its rows to the batch as it commits when the batch is free; else
-- the next claim or ack that takes the batch applies them. call: 'a' ack,
-- 'f' fail, 'e' extend_lease; at: when the call was made; us: fail's
-- retry_in or extend_lease's lease (microseconds).
CREATE TABLE outbox.log_deferred (
    seq       bigint      GENERATED ALWAYS AS IDENTITY,
    batch     bigint      NOT NULL,
    id        bigint      NOT NULL,
    token     uuid        NOT NULL,
    call      "char"      NOT NULL CHECK (call IN ('a', 'f', 'e')),
    at        timestamptz NOT NULL,
    us        bigint,
    permanent boolean     NOT NULL DEFAULT false,
    error     text
) WITH (vacuum_truncate = false);
CREATE INDEX log_deferred_batch ON outbox.log_deferred (batch, seq);

-- The delivery record (0.10.0): events acked from lane batches, as the
-- encoding of a batch of delivered events (src/log/batch.rs), and when. An
-- event acked on its first try has no row of its own anywhere, so this is
-- its delivery time, at batch precision (src/log/views.rs), for
-- outbox.deliveries, outbox.events and outbox.stats. Written when a batch
-- finishes or a claim drops its acked events; a record joins the lane's row
-- opened in the last ten seconds (which takes the later time), so a trickle
-- of one-event batches costs a few bytes per event, not a row each. Removed
-- by retention after outbox.retention_delivered, and by drop_subscription.
-- Dumped, like the log (sql/restore.sql).
CREATE TABLE outbox.log_delivered (
    subscription text        NOT NULL,
    lane         smallint    NOT NULL,
    finished_at  timestamptz NOT NULL,
    state        bytea       NOT NULL,
    opened_at    timestamptz NOT NULL DEFAULT statement_timestamp()
) WITH (vacuum_truncate = false);
CREATE INDEX log_delivered_finished ON outbox.log_delivered (finished_at);
-- A lane's latest row, which a new record joins for ten seconds.
CREATE INDEX log_delivered_lane ON outbox.log_delivered (subscription, lane, finished_at);

-- Per-event state of the log's subscriptions, only for the events that need
-- one (src/log/exceptions.rs): an event that failed or whose lease expired,
-- every later event of its subject (parked behind it, so a subject keeps its
-- order while the rest of its lane moves on), a delayed event (deliver_at),
-- and an event a claim narrowed by topics did not take. A row copies its
-- event from the log, so that retention never waits for it. Most events never
-- have one: an event acked from its batch on the first try costs no row here.
--   state       'pending' (claimable from visible_at), 'leased' (visible_at is
--               the lease expiry), 'delivered' (acked after a retry: its
--               attempt history, kept for retention_delivered), 'dead'
--               (a dead letter),
--               'cancelled' (by outbox.cancel; kept for replay until
--               retention_dead);
--   attempts    deliveries started, the batch's first one included;
--   lease_token the current lease's token; an event moved here when its
--               batch lease expired keeps the batch's token, so its holder can
--               still ack it until a claim hands it out again;
--   blocks      a dead letter holds its subject's later events (the
--               dead-letter policy 'block'), or lets them go on ('skip');
--   parked_behind  an earlier row of the same subject that held it when this
--               one was written: while that row holds the subject, claims do
--               not read this one (src/log/exceptions.rs, invariant 5).
-- Dumped, like the log (sql/restore.sql).
CREATE TABLE outbox.log_exceptions (
    subscription text        NOT NULL,
    id           bigint      NOT NULL,
    lane         smallint    NOT NULL,
    topic        text        NOT NULL,
    subject      text,
    dispatch_key text,
    payload      jsonb       NOT NULL,
    headers      jsonb,
    max_attempts integer     NOT NULL,
    published_at timestamptz NOT NULL,
    state        text        NOT NULL CHECK (state IN ('pending', 'leased', 'delivered', 'dead', 'cancelled')),
    attempts     integer     NOT NULL CHECK (attempts >= 0),
    visible_at   timestamptz NOT NULL,
    lease_token  uuid,
    leased_by    text,
    last_error   text,
    errors       jsonb,
    blocks       boolean     NOT NULL DEFAULT true,
    dead_at      timestamptz,
    delivered_at timestamptz,
    cancelled_at timestamptz,
    parked_behind bigint,
    PRIMARY KEY (subscription, id)
) WITH (fillfactor = 70, vacuum_truncate = false);
-- Wake-ups (src/log/due.rs) and monitoring: claimable rows in (visible_at,
-- id) order, piles included.
CREATE INDEX log_exceptions_ready ON outbox.log_exceptions (subscription, visible_at, id)
    WHERE state IN ('pending', 'leased');
-- Claims: the claimable rows that wait behind no other row of their subject.
CREATE INDEX log_exceptions_claimable ON outbox.log_exceptions (subscription, visible_at, id)
    WHERE state IN ('pending', 'leased') AND parked_behind IS NULL;
-- Claims: the rows that wait behind another, by the row they wait behind
-- (a walk of the distinct ones, then each pile's first row).
CREATE INDEX log_exceptions_piles ON outbox.log_exceptions (subscription, parked_behind, id)
    WHERE state IN ('pending', 'leased') AND parked_behind IS NOT NULL;
-- Rows that hold their subject: the head check of a claim, and a new batch's
-- check for subjects that must continue here.
CREATE INDEX log_exceptions_open ON outbox.log_exceptions (subscription, lane, subject, id)
    WHERE subject IS NOT NULL AND (state IN ('pending', 'leased') OR (state = 'dead' AND blocks));
-- A claim's test that no other row of the subject is leased now (0.11.0:
-- src/sql/log.rs, EXC_CLAIM): one bounded probe per row it considers.
CREATE INDEX log_exceptions_leased ON outbox.log_exceptions (subscription, lane, subject, visible_at)
    WHERE state = 'leased' AND subject IS NOT NULL;
-- ack, fail and extend_lease find a row by its token.
CREATE INDEX log_exceptions_token ON outbox.log_exceptions (lease_token) WHERE lease_token IS NOT NULL;

-- Whether every reader has finished with ring table log_<n>: no lane's cursor
-- (lo_snap, lo_m, lo_xn) leaves one of its lane's events unseen (an idle
-- lane's cursor does not move, and needs not), and no lane's batch has an
-- unfinished event there (a batch slides past its cursor: src/log/batch.rs;
-- probed as "the table holds an event of the lane at or above the batch's
-- smallest unfinished id", one probe per batch). The events a cursor has not
-- seen are exactly a window's three branches (src/log/mod.rs): ids above m,
-- transactions in its xip, transactions in [xmax, xn) with ids up to m. So
-- each lane costs three index probes, whatever the table's size, and `lane + 0`
-- keeps the planner from reading a lane's history through (lane, id) for the
-- third. Runs at READ COMMITTED only (each statement sees every commit).
-- With only_subscription, that subscription's lanes alone: outbox.health()
-- names what 'default' holds.
CREATE FUNCTION outbox._log_readers_passed(n smallint, only_subscription text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    behind boolean;
BEGIN
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM outbox.log_lanes l WHERE l.subscription <> ALL (outbox._log_let_go($1))'
        '   AND ($2 IS NULL OR l.subscription = $2) AND ('
        '    EXISTS (SELECT 1 FROM outbox.%1$I e WHERE e.lane = l.lane AND e.id > l.lo_m)'
        ' OR EXISTS (SELECT 1 FROM outbox.%1$I e'
        '             WHERE e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(l.lo_snap))) AND e.lane = l.lane)'
        ' OR EXISTS (SELECT 1 FROM outbox.%1$I e'
        '             WHERE e.txid >= pg_snapshot_xmax(l.lo_snap) AND e.txid < l.lo_xn'
        '               AND e.lane + 0 = l.lane AND e.id + 0 <= l.lo_m)))'
        ' OR EXISTS (SELECT 1 FROM outbox.log_batches b, outbox._log_batch_min(b.state) AS f(id)'
        '             WHERE b.subscription <> ALL (outbox._log_let_go($1))'
        '               AND ($2 IS NULL OR b.subscription = $2)'
        '               AND EXISTS (SELECT 1 FROM outbox.%1$I e WHERE e.lane = b.lane AND e.id >= f.id))', 'log_' || n)
    INTO behind USING n, only_subscription;
    RETURN NOT behind;
END
$$;

-- The subscriptions that no longer hold ring table log_<n> (0.10.0): those
-- with a max_lag shorter than the time since the table was sealed. Every
-- event of a sealed table was written before its seal (a later write
-- restarts its retention: outbox._log_rotate), so each is older than their
-- max_lag. Empty for a table that is not sealed.
CREATE FUNCTION outbox._log_let_go(n smallint) RETURNS text[]
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT COALESCE(pg_catalog.array_agg(c.name), '{}')
      FROM outbox.subscription_catalog c
      JOIN outbox.log_state s ON s.n OPERATOR(pg_catalog.=) _log_let_go.n
     WHERE c.max_lag IS NOT NULL AND s.sealed_at OPERATOR(pg_catalog.<) (pg_catalog.now() OPERATOR(pg_catalog.-) c.max_lag)
$$;

-- Before ring table log_<n> is truncated: count, for each subscription that
-- no longer holds it (outbox._log_let_go), the events of its topics there
-- that it loses: not read by its lane yet (neither visible in the lane's
-- cursor nor in the window read up to its position), or read into its batch
-- in flight but not handed out yet (a hand-out reads the event's row), and
-- without a row of its own (those keep a copy); and add them to its
-- lost_events. An event acked, or out under a lease (its holder can still
-- ack it), is not lost. Counted before the truncation's lock is taken (the
-- count reads the whole table, and the lock would hold claims meanwhile): an
-- event read in between is counted too.
CREATE FUNCTION outbox._log_note_losses(n smallint) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    sub text;
    lost bigint;
    total bigint := 0;
BEGIN
    FOREACH sub IN ARRAY outbox._log_let_go(n) LOOP
        EXECUTE format(
            'SELECT count(*) FROM outbox.%1$I e'
            '  JOIN outbox.log_lanes l ON l.subscription = $1 AND l.lane = e.lane'
            '  JOIN outbox.subscription_catalog c ON c.name = $1'
            ' WHERE ((NOT pg_visible_in_snapshot(e.txid, l.lo_snap)'
            '         AND NOT COALESCE(pg_visible_in_snapshot(e.txid, l.hi_snap) AND e.id <= l.pos, false))'
            '        OR e.id IN (SELECT b.id FROM outbox._log_batch_states($1) b WHERE b.state = ''pending''))'
            '   AND NOT EXISTS (SELECT 1 FROM outbox.log_exceptions x WHERE x.subscription = $1 AND x.id = e.id)'
            '   AND (c.topics IS NULL OR EXISTS (SELECT 1 FROM unnest(c.topics) AS p(pattern)'
            '                                    WHERE outbox._topic_matches(e.topic, p.pattern)))', 'log_' || n)
        INTO lost USING sub;
        IF lost > 0 THEN
            UPDATE outbox.subscription_activity a
               SET lost_events = a.lost_events + lost, lost_at = now()
             WHERE a.name = sub;
            total := total + lost;
        END IF;
    END LOOP;
    RETURN total;
END
$$;

-- Whether ring table log_<n> holds an event of a transaction not visible in
-- snapshot s (running when s was taken, or begun after): written since s. Two
-- probes of the (txid, lane) index, whatever an old transaction holds back.
CREATE FUNCTION outbox._log_written_since(n smallint, s pg_snapshot) RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    found boolean;
BEGIN
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM outbox.%1$I WHERE txid = ANY (ARRAY(SELECT pg_snapshot_xip($1)))) '
                   '    OR EXISTS (SELECT 1 FROM outbox.%1$I WHERE txid >= pg_snapshot_xmax($1))', 'log_' || n)
        INTO found USING s;
    RETURN found;
END
$$;

-- Log retention, one call of the maintenance step (src/log/mod.rs):
-- 1. truncate the first sealed table that every reader has finished with and
--    that nobody has written to for outbox.retention_delivered: sealed that
--    long ago, and no row of a transaction the seal's snapshot did not see (a
--    publisher whose copy of the state was stale, or a transaction open
--    across the seal; such a row restarts the table's retention), and return
--    1 at once: the caller commits and calls again;
-- 2. otherwise seal the open table once it has been open for half that (so a
--    table holds at most half the window) and open the next, which must be
--    free, and return 0.
-- A TRUNCATE waits for its lock at most lock_timeout (20 ms, the function's
-- own setting): publishers and readers queue behind the request for no
-- longer than that, and a table in use is left for the next run. The lock
-- lasts until the caller's commit, so nothing follows a truncation in the
-- same call: claims would wait on it while the next table is checked (a
-- claim waited 121 ms behind one call that truncated two tables). Opening an
-- empty table takes no lock. Nothing a reader has not read past is truncated.
CREATE FUNCTION outbox._log_rotate() RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '20ms'
AS $$
DECLARE
    keep      interval := outbox._retention_guc('outbox.retention_delivered');
    cur       smallint;
    opened    timestamptz;
    nxt       smallint;
    r         record;
BEGIN
    -- The checks before a TRUNCATE must see every committed row: a REPEATABLE
    -- READ or SERIALIZABLE snapshot could miss rows committed while the lock
    -- was awaited. Then nothing is done (the background worker runs this step
    -- at READ COMMITTED whatever the default; src/log/mod.rs).
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN 0;
    END IF;
    -- One rotation at a time (the worker and run_maintenance() may overlap);
    -- readers of the state are not blocked by this lock mode.
    BEGIN
        LOCK TABLE outbox.log_state IN SHARE ROW EXCLUSIVE MODE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        RETURN 0;
    END;
    -- Deferred calls whose batch is gone go to their events' rows of their
    -- own (src/log/deferred.rs); as the owner, whatever role runs this step.
    BEGIN
        PERFORM outbox._log_fold_orphans();
    EXCEPTION WHEN lock_not_available THEN
        NULL;  -- a row of its own is busy: the next step forwards them
    END;
    -- A restored log is not rebased yet (sql/restore.sql): its cursors and
    -- txids are another cluster's. Rebased here once the restore looks
    -- finished (for a database no consumer claims from yet), else left to
    -- the first claim; nothing rotates before.
    IF EXISTS (SELECT 1 FROM outbox.log_restore) THEN
        IF NOT outbox._log_restore_quiet() THEN
            RETURN 0;
        END IF;
        BEGIN
            PERFORM outbox._log_rebase();
        EXCEPTION WHEN lock_not_available THEN
            RETURN 0;  -- readers hold the lanes: the next run, or their claim
        END;
    END IF;
    FOR r IN SELECT s.n, s.sealed_snap FROM outbox.log_state s
              WHERE s.sealed_at < now() - keep ORDER BY s.sealed_at LOOP
        CONTINUE WHEN NOT outbox._log_readers_passed(r.n);
        IF outbox._log_written_since(r.n, r.sealed_snap) THEN
            UPDATE outbox.log_state
               SET sealed_at = now(), sealed_snap = pg_current_snapshot()
             WHERE n = r.n;
            CONTINUE;
        END IF;
        -- Subscriptions past their max_lag lose what they have not read there;
        -- the count is undone with the subtransaction when nothing is truncated.
        BEGIN
            PERFORM outbox._log_note_losses(r.n);
            EXECUTE format('LOCK TABLE outbox.%I IN ACCESS EXCLUSIVE MODE', 'log_' || r.n);
            -- Again under the lock: nobody can add an event meanwhile.
            IF outbox._log_readers_passed(r.n) AND NOT outbox._log_written_since(r.n, r.sealed_snap) THEN
                EXECUTE format('TRUNCATE outbox.%I', 'log_' || r.n);
                DELETE FROM outbox.log_state WHERE n = r.n;
                RETURN 1;
            ELSE
                RAISE EXCEPTION 'not truncated' USING ERRCODE = 'lock_not_available';
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- in use, or changed meanwhile: the next run tries again
        END;
    END LOOP;

    SELECT s.n, s.opened_at INTO cur, opened
      FROM outbox.log_state s WHERE s.sealed_at IS NULL ORDER BY s.opened_at DESC LIMIT 1;
    IF NOT FOUND THEN
        -- Fresh install or restored without state: log_0 has been the open table.
        IF EXISTS (SELECT 1 FROM outbox.log_state WHERE n = 0) THEN
            RETURN 0;  -- log_0 is sealed and not yet free: wait for it
        END IF;
        INSERT INTO outbox.log_state (n, opened_at) VALUES (0, now());
        RETURN 0;
    END IF;
    IF opened >= now() - keep / 2 THEN
        RETURN 0;
    END IF;
    nxt := (cur + 1) % 4;
    IF EXISTS (SELECT 1 FROM outbox.log_state WHERE n = nxt) THEN
        RETURN 0;  -- the next table is not free yet: keep writing this one
    END IF;
    -- A free table is empty unless a publisher whose copy of the state was stale
    -- wrote to it after its truncation; then it is emptied first, once every
    -- reader has read past those rows.
    -- ('3:3:' sees no transaction: written since it means holding any row.)
    IF outbox._log_written_since(nxt, '3:3:'::pg_snapshot) THEN
        IF NOT outbox._log_readers_passed(nxt) THEN
            RETURN 0;
        END IF;
        BEGIN
            EXECUTE format('LOCK TABLE outbox.%I IN ACCESS EXCLUSIVE MODE', 'log_' || nxt);
            IF NOT outbox._log_readers_passed(nxt) THEN
                RETURN 0;
            END IF;
            EXECUTE format('TRUNCATE outbox.%I', 'log_' || nxt);
        EXCEPTION WHEN lock_not_available THEN
            RETURN 0;
        END;
    END IF;
    UPDATE outbox.log_state SET sealed_at = now(), sealed_snap = pg_current_snapshot()
     WHERE n = cur;
    INSERT INTO outbox.log_state (n, opened_at) VALUES (nxt, now());
    RETURN 0;
END
$$;

-- Reading the log in commit order (src/log/mod.rs, "Reading in commit order").
-- A cursor is (snap, m, xn): a snapshot taken now, the largest event id drawn
-- when it was taken (read after it), and the next transaction id (read after m).
CREATE FUNCTION outbox._log_cursor(OUT snap pg_snapshot, OUT m bigint, OUT xn xid8)
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT p.snap::pg_snapshot, p.m, p.xn::text::xid8 FROM outbox._log_cursor_parts() AS p $$;

-- The events of one lane between two cursors: committed after lo was taken and
-- before hi was, ids above `after` (a window read in pieces), in id order.
CREATE FUNCTION outbox._log_window(lane smallint, lo_snap pg_snapshot, lo_m bigint, lo_xn xid8, hi_snap pg_snapshot,
                                   after bigint DEFAULT 0, max_events integer DEFAULT NULL)
RETURNS SETOF bigint
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox._log_window_ids(lane, lo_snap::text, lo_m, lo_xn::text, hi_snap::text, after, max_events) $$;

