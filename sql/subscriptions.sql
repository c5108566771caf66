-- Subscriptions (consumer groups): their policy, pausing, and where operators
-- look. Every subscription reads the log (sql/log.sql, src/log/), the
-- 'default' made at install too.
--
-- Precedence of a setting (max_attempts, backoff, default lease, dead-letter
-- policy): the subscription's, else the topic's (outbox.create_topic), else the
-- GUC (outbox.max_attempts, ...). 'default' takes the topic's dead-letter policy.

-- The name a subscription argument resolves to (NULL: 'default'), or 42704.
CREATE FUNCTION outbox._subscription(name text) RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    resolved text := outbox._check_subscription(name);
BEGIN
    PERFORM 1 FROM outbox.subscription_catalog c WHERE c.name OPERATOR(pg_catalog.=) resolved;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox: subscription % does not exist', pg_catalog.quote_literal(resolved)
            USING ERRCODE = '42704', HINT = 'List them in outbox.subscriptions.';
    END IF;
    RETURN resolved;
END
$$;

-- A subscription's max_lag, or 22023.
CREATE FUNCTION outbox._check_max_lag(max_lag interval) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF max_lag OPERATOR(pg_catalog.<=) interval '0' OR max_lag OPERATOR(pg_catalog.>) interval '100 years' THEN
        RAISE EXCEPTION 'outbox: max_lag must be > 0 and <= 100 years, got %', max_lag USING ERRCODE = '22023';
    END IF;
END
$$;

-- pg_dump dumps the catalog's rows (pg_extension_config_dump), and CREATE
-- EXTENSION on the restoring side has already made 'default': a dumped row whose
-- name exists updates that row instead of failing the restore's COPY.
CREATE FUNCTION outbox._subscription_restore() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE outbox.subscription_catalog c
       SET max_attempts = NEW.max_attempts, backoff_base = NEW.backoff_base,
           backoff_max = NEW.backoff_max, default_lease = NEW.default_lease,
           paused = NEW.paused, paused_at = NEW.paused_at,
           created_at = NEW.created_at, updated_at = NEW.updated_at,
           topics = NEW.topics, dead_letter_policy = NEW.dead_letter_policy,
           max_lag = NEW.max_lag
     WHERE c.name OPERATOR(pg_catalog.=) NEW.name;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER subscription_restore BEFORE INSERT ON outbox.subscription_catalog
    FOR EACH ROW EXECUTE FUNCTION outbox._subscription_restore();

-- claim() and fail() cache the catalog per backend (src/subscriptions.rs); any
-- change to it invalidates every backend's copy at commit, as for outbox.topics.
-- ALWAYS: a change applied with triggers off for replicas (logical replication,
-- session_replication_role = replica) must still reach the caches.
CREATE TRIGGER subscriptions_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.subscription_catalog
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._topics_changed();
ALTER TABLE outbox.subscription_catalog ENABLE ALWAYS TRIGGER subscriptions_changed;

-- Subscriptions created here read the event log (sql/log.sql, src/log/):
-- each has its own lanes, batches and exception rows, so it receives every
-- matching event whatever the others do, and publish writes nothing per
-- subscription. 'default' can be created again once it has been dropped.
CREATE FUNCTION outbox.create_subscription(
    name               text,
    topics             text[]   DEFAULT NULL,
    start              text     DEFAULT 'now',
    max_attempts       integer  DEFAULT NULL,
    backoff_base       interval DEFAULT NULL,
    backoff_max        interval DEFAULT NULL,
    default_lease      interval DEFAULT NULL,
    dead_letter_policy text     DEFAULT NULL,
    max_lag            interval DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    resolved text := outbox._check_subscription(name);
    patterns text[] := outbox._check_topic_patterns(topics);
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'outbox: subscription name must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF start IS NULL THEN
        RAISE EXCEPTION 'outbox: start must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF pg_catalog.array_ndims(topics) OPERATOR(pg_catalog.>) 1 THEN
        RAISE EXCEPTION 'outbox: topics must be a one-dimensional array' USING ERRCODE = '22023';
    END IF;
    IF start OPERATOR(pg_catalog.<>) ALL (ARRAY['now', 'earliest']) THEN
        RAISE EXCEPTION 'outbox: start must be ''now'' or ''earliest'', got %', pg_catalog.quote_literal(start)
            USING ERRCODE = '22023';
    END IF;
    PERFORM outbox._check_policy(max_attempts, backoff_base, backoff_max, default_lease,
                                 COALESCE(dead_letter_policy, 'block'), NULL, NULL);
    PERFORM outbox._check_max_lag(max_lag);
    INSERT INTO outbox.subscription_catalog AS c
           (name, max_attempts, backoff_base, backoff_max, default_lease, topics, dead_letter_policy, max_lag)
    VALUES (resolved, max_attempts, backoff_base, backoff_max, default_lease, patterns, dead_letter_policy, max_lag)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox: subscription % already exists', pg_catalog.quote_literal(resolved)
            USING ERRCODE = '42710', HINT = 'Change it with outbox.alter_subscription().';
    END IF;
    INSERT INTO outbox.subscription_activity (name) VALUES (resolved) ON CONFLICT DO NOTHING;
    -- Retention sees the new lanes only once this transaction commits, yet the
    -- events committed after the cursor below (with 'earliest', every event
    -- the log holds) are owed to the subscription already. Holding the ring
    -- tables until then makes retention's TRUNCATE, which waits 20 ms for its
    -- lock, leave them for a later run. Taken before the cursor: a truncation
    -- that committed first removed only events the cursor's snapshot sees.
    LOCK TABLE outbox.log_0, outbox.log_1, outbox.log_2, outbox.log_3 IN ACCESS SHARE MODE;
    -- Its lanes start at a cursor taken now (src/log/claim.rs): every event
    -- whose transaction commits after this one took it, whenever it was published.
    -- A restored log is rebased first (sql/restore.sql): the new lanes are
    -- this cluster's, and the rebase would replace them.
    PERFORM outbox._log_rebase();
    PERFORM outbox._log_subscribe(resolved, start);
END
$$;

COMMENT ON FUNCTION outbox.create_subscription(text, text[], text, integer, interval, interval, interval, text, interval) IS
'Create a subscription (consumer group) over the event log: it receives every event whose topic matches topics and whose transaction commits after this call''s snapshot '
'(start = ''now''; an event published before, in a transaction that commits after, is included), or every event still in the log (''earliest''). '
'Claim with outbox.claim(..., subscription => name); ack, fail and extend_lease as for any event. Publishing costs nothing per subscription. '
'Until its transaction ends it holds every ring table (ACCESS SHARE), so the log''s retention truncates none of them meanwhile; it waits for a truncation in progress to commit. '
'name may be ''default'' once ''default'' has been dropped: claims without a subscription then read this one. '
'Arguments: name (1 to 63 characters of [a-z0-9_.-], starting with a letter or digit), topics (claim''s patterns: exact names, prefixes ending in ''.*'', ''*''; NULL = every topic), '
'start (''now'' or ''earliest''), max_attempts (1..1000000), backoff_base and backoff_max (interval > 0, <= 365 days), default_lease (interval > 0, <= outbox.max_lease), '
'dead_letter_policy (''block'' or ''skip''); NULL settings follow the topic''s, else the GUCs; max_lag (interval > 0, <= 100 years; NULL, the default: none): '
'the age past which the subscription no longer holds the log''s retention, trading its completeness for storage as max_slot_wal_keep_size does for a replication slot: '
'a ring table sealed longer ago than max_lag (and than outbox.retention_delivered) is truncated even if the subscription has not read it, paused or not, and the events it had not read are lost to it '
'(counted in outbox.subscriptions.lost_events; health() warns). Returns void. '
'Errors: 22004 NULL name or start, NULL topics element; 22023 malformed name, topic pattern, start or setting (max_lag included), empty or multi-dimensional topics array; 42710 the subscription exists. '
'Nothing is created on error. As PgQ''s register_consumer, with per-event leases.';

CREATE FUNCTION outbox.drop_subscription(name text, force boolean DEFAULT false) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    resolved text;
    in_flight bigint;
BEGIN
    IF name IS NULL OR force IS NULL THEN
        RAISE EXCEPTION 'outbox: name and force must not be NULL' USING ERRCODE = '22004';
    END IF;
    resolved := outbox._subscription(name);
    -- Two drops of one subscription: the second waits, then finds it gone.
    PERFORM 1 FROM outbox.subscription_catalog c
     WHERE c.name OPERATOR(pg_catalog.=) resolved FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM outbox._subscription(resolved);
    END IF;
    -- Lanes first: a claim moves a lane only while it holds the lane's row, so
    -- this waits for those, and later claims skip the gone lanes. Then the
    -- leases are counted, after waiting for every transaction that holds one
    -- of the subscription's batches or exception rows (a claim left open
    -- included): _log_in_flight takes those locks, in the order acks and
    -- replay take them, and claims only try them. Every delete reads a
    -- snapshot taken when it runs (outbox._log_forget), at every isolation
    -- level.
    PERFORM outbox._log_forget(resolved, true);
    in_flight := outbox._log_in_flight(resolved);
    IF in_flight OPERATOR(pg_catalog.>) 0 AND NOT force THEN
        RAISE EXCEPTION 'outbox: subscription % has % leases in flight', pg_catalog.quote_literal(resolved), in_flight
            USING ERRCODE = '55006', HINT = 'Wait for the workers to finish, or pass force => true (their acks then change nothing).';
    END IF;
    -- Batches next: fail() moves a batch's events to exception rows only while
    -- the batch row exists (key-share locked). Then the exception rows, all of
    -- them committed by now, the delivery record and the activity.
    PERFORM outbox._log_forget(resolved, false);
    DELETE FROM outbox.subscription_catalog c WHERE c.name OPERATOR(pg_catalog.=) resolved;
END
$$;

COMMENT ON FUNCTION outbox.drop_subscription(text, boolean) IS
'Drop a subscription with its position in the log, its batches, retries and dead letters; the log''s retention no longer waits for it. '
'Claims without a subscription raise 42704 once ''default'' is dropped, until it is created again with create_subscription. '
'Every event stays in the log for the other subscriptions. '
'Arguments: name; force (default false: refuse while a lease it handed out has not expired; true: drop anyway, and the holders'' acks, fails and extensions then return false, ''stale'' and NULL). '
'Returns void. Errors: 22004 NULL argument; 22023 malformed name; 42704 unknown subscription; '
'55006 leases in flight without force. Nothing is dropped on error.';

CREATE FUNCTION outbox.alter_subscription(
    name          text,
    max_attempts  integer  DEFAULT NULL,
    backoff_base  interval DEFAULT NULL,
    backoff_max   interval DEFAULT NULL,
    default_lease interval DEFAULT NULL,
    max_lag       interval DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    resolved text := outbox._check_subscription(name);
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'outbox: subscription name must not be NULL' USING ERRCODE = '22004';
    END IF;
    PERFORM outbox._check_policy(max_attempts, backoff_base, backoff_max, default_lease, 'block', NULL, NULL);
    PERFORM outbox._check_max_lag(max_lag);
    -- No event row changes: claim() and fail() read these settings when they act
    -- (from their per-backend cache, src/subscriptions.rs), so a change applies
    -- to calls that start after its commit and never waits for, or stalls, a worker.
    UPDATE outbox.subscription_catalog c SET
        max_attempts  = COALESCE(alter_subscription.max_attempts, c.max_attempts),
        backoff_base  = COALESCE(alter_subscription.backoff_base, c.backoff_base),
        backoff_max   = COALESCE(alter_subscription.backoff_max, c.backoff_max),
        default_lease = COALESCE(alter_subscription.default_lease, c.default_lease),
        max_lag       = COALESCE(alter_subscription.max_lag, c.max_lag),
        updated_at    = pg_catalog.now()
     WHERE c.name OPERATOR(pg_catalog.=) resolved;
    IF NOT FOUND THEN
        PERFORM outbox._subscription(resolved);
    END IF;
END
$$;

COMMENT ON FUNCTION outbox.alter_subscription(text, integer, interval, interval, interval, interval) IS
'Change a subscription''s policy, which overrides the per-topic settings (which override the GUCs). NULL arguments leave that setting unchanged; to reset one to the topic''s, '
'UPDATE outbox.subscription_catalog SET ... = NULL as the owner. '
'Arguments: name (the subscription; NULL raises 22004), max_attempts (1..1000000: attempts a claim may start; an event that has used them goes dead at its next failure, lease expiry or claim), '
'backoff_base and backoff_max (interval > 0, <= 365 days: fail()''s capped exponential backoff), default_lease (interval > 0, <= outbox.max_lease: claim()''s lease when it passes none), '
'max_lag (interval > 0, <= 100 years: see create_subscription). '
'Applies from its commit; changes no event and never waits for workers. It does not change the dead-letter policy: a subscription''s own is set by create_subscription (dead_letter_policy), and one created without it follows its topics'' (create_topic, alter_topic). Returns void. '
'Errors: 22004 NULL name; 22023 malformed name or invalid setting; 42704 unknown subscription.';

-- Pausing: a paused subscription keeps its events (unless it has a max_lag,
-- which retention applies paused or not) and hands out none; events already
-- leased stay leased and can still be acked, failed or extended (fail() reads
-- the catalog without locking it, so a pause never waits for workers).
CREATE FUNCTION outbox._set_paused(name text, pause boolean) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    resolved text;
BEGIN
    IF name IS NULL THEN
        RAISE EXCEPTION 'outbox: subscription name must not be NULL' USING ERRCODE = '22004';
    END IF;
    resolved := outbox._subscription(name);
    UPDATE outbox.subscription_catalog c
       SET paused = pause, paused_at = CASE WHEN pause THEN pg_catalog.now() END, updated_at = pg_catalog.now()
     WHERE c.name OPERATOR(pg_catalog.=) resolved AND c.paused IS DISTINCT FROM pause;
    IF NOT FOUND THEN
        -- Already in that state, or dropped by a drop_subscription that
        -- committed while this waited for the row: as alter_subscription, a
        -- new statement (a new snapshot under READ COMMITTED) tells them
        -- apart, and raises 42704 for the drop.
        PERFORM outbox._subscription(resolved);
        RETURN false;
    END IF;
    IF NOT pause THEN
        -- Workers sleeping on LISTEN learn that there is work again.
        PERFORM outbox._wake(NULL);
    END IF;
    RETURN true;
END
$$;

CREATE FUNCTION outbox.pause_subscription(name text) RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox._set_paused(name, true) $$;

COMMENT ON FUNCTION outbox.pause_subscription(text) IS
'Pause a subscription: a claim() for it that starts after the commit returns no rows, at every isolation level; leases already held can still be acked, failed or extended. '
'Its events are kept, unless the subscription has a max_lag: that still applies while it is paused (as max_slot_wal_keep_size applies to an inactive replication slot), so events it has not read may be lost to it once their ring table is older than max_lag (see create_subscription). '
'Returns true when it paused it, false when it was already paused. Errors: 22004 NULL name; 22023 malformed name; 42704 unknown subscription, or one a drop_subscription dropped while this call waited for it. As pgq''s consumer pause and River''s queue pause.';

CREATE FUNCTION outbox.resume_subscription(name text) RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox._set_paused(name, false) $$;

COMMENT ON FUNCTION outbox.resume_subscription(text) IS
'Resume a paused subscription: claims hand out its events again, and listening workers are woken at commit. '
'Returns true when it resumed it, false when it was not paused. Errors: 22004 NULL name; 22023 malformed name; 42704 unknown subscription, or one a drop_subscription dropped while this call waited for it.';

-- Each subscription's numbers come from its lanes' windows of the log
-- (src/log/claim.rs, outbox._log_subscription_stats).
CREATE VIEW outbox.subscriptions AS
SELECT c.name, c.topics, c.paused, c.paused_at,
       l.lag_events,
       pg_catalog.now() - l.oldest_at AS lag,
       l.oldest_id AS oldest_undelivered_id,
       l.oldest_at AS oldest_undelivered_at,
       outbox._log_backlog(c.name, pg_catalog.now()) AS ready,
       l.leases_in_flight,
       l.dead_letters,
       a.last_claim_at,
       c.max_attempts, c.backoff_base, c.backoff_max, c.default_lease,
       c.created_at, c.updated_at, c.dead_letter_policy,
       c.max_lag, COALESCE(a.lost_events, 0) AS lost_events, a.lost_at
  FROM outbox.subscription_catalog c
  LEFT JOIN outbox.subscription_activity a ON a.name = c.name
  LEFT JOIN LATERAL outbox._log_subscription_stats(c.name) l ON true;

COMMENT ON VIEW outbox.subscriptions IS
'One row per subscription: name, topics (its topic filter; NULL = every topic), paused and paused_at, lag_events (events not yet delivered: pending, leased, or not yet read from the log), '
'lag (interval: age of the oldest of them), oldest_undelivered_id and oldest_undelivered_at, ready (what a claim could take now: events published and due that are not out under a lease, counted as outbox.health() counts the backlog, later events of a subject included), leases_in_flight, dead_letters, '
'last_claim_at (the last claim call for it, paused or not, noted at most once a second per session; NULL when never), '
'its policy (max_attempts, backoff_base, backoff_max, default_lease; NULL = the topic''s setting, else the GUC), created_at, updated_at, dead_letter_policy (NULL: the topic''s), '
'max_lag (NULL: none; see create_subscription), lost_events and lost_at (events retention removed before the subscription read them because it lagged past max_lag, and the last time; 0 and NULL when none). '
'Each row reads its subscription''s lanes'' windows of the log: poll it every 15 s or slower.';

-- Each subscription of the log, and each event it receives: the event's
-- delivery state there (src/log/views.rs). It is the exception row when there
-- is one (src/log/exceptions.rs); else its state in a batch in flight
-- (outbox._log_batch_states); else the lane's cursor tells: an event visible
-- in the cursor's snapshot, or in the window being read and at or below its
-- position, has been read, and is not in a batch any more, so it was acked
-- from its batch on the first try ('delivered'); any other is not read yet
-- ('pending'). Events outside the subscription's topics, and events visible
-- in its first cursor (committed before it was created), are not its own.
-- An event acked from its batch was delivered when the batch finished
-- (outbox.log_delivered, outbox._log_delivered): batch precision, and none
-- while its batch is still in flight or once retention removed the record.
CREATE VIEW outbox._log_deliveries AS
WITH subs AS MATERIALIZED (
    SELECT c.name, c.topics, c.max_attempts FROM outbox.subscription_catalog c
), b AS MATERIALIZED (
    SELECT s.name, st.id, st.state, st.attempts, st.lease_expires_at
      FROM subs s, LATERAL outbox._log_batch_states(s.name) st
), h AS MATERIALIZED (
    SELECT s.name, bh.id, bh.leased_by
      FROM subs s, LATERAL outbox._log_batch_holders(s.name) bh
), f AS MATERIALIZED (
    SELECT s.name, fd.id, pg_catalog.min(fd.delivered_at) AS delivered_at
      FROM subs s, LATERAL outbox._log_delivered(s.name, NULL) fd
     GROUP BY s.name, fd.id
)
SELECT x.subscription, x.id AS event_id, x.lane, x.topic, x.subject, x.dispatch_key, x.payload, x.headers, x.published_at,
       x.state, x.attempts, COALESCE(s.max_attempts, x.max_attempts) AS max_attempts, x.leased_by,
       CASE WHEN x.state = 'leased' THEN x.visible_at END AS lease_expires_at,
       CASE WHEN x.state = 'pending' THEN x.visible_at END AS available_at,
       x.last_error, x.errors, x.delivered_at, x.dead_at, x.cancelled_at
  FROM outbox.log_exceptions x
  JOIN subs s ON s.name = x.subscription
UNION ALL
SELECT s.name, l.id, l.lane, l.topic, l.subject, l.dispatch_key, l.payload, l.headers, l.published_at,
       COALESCE(b.state, CASE WHEN r.seen THEN 'delivered' ELSE 'pending' END),
       COALESCE(b.attempts, CASE WHEN r.seen THEN 1 ELSE 0 END),
       COALESCE(s.max_attempts, l.max_attempts), h.leased_by,
       b.lease_expires_at,
       CASE WHEN b.state = 'pending' OR (b.state IS NULL AND NOT r.seen)
            THEN GREATEST(l.published_at, l.deliver_at) END,
       NULL::text, NULL::jsonb, f.delivered_at, NULL::timestamptz, NULL::timestamptz
  FROM subs s
  JOIN outbox.log l
    ON s.topics IS NULL
       OR EXISTS (SELECT 1 FROM pg_catalog.unnest(s.topics) AS p(pattern) WHERE outbox._topic_matches(l.topic, p.pattern))
  LEFT JOIN outbox.log_lanes n ON n.subscription = s.name AND n.lane = l.lane
  LEFT JOIN b ON b.name = s.name AND b.id = l.id
  LEFT JOIN h ON h.name = s.name AND h.id = l.id
  LEFT JOIN f ON f.name = s.name AND f.id = l.id AND b.id IS NULL
  CROSS JOIN LATERAL (
      SELECT COALESCE(pg_catalog.pg_visible_in_snapshot(l.txid, n.lo_snap)
                      OR (pg_catalog.pg_visible_in_snapshot(l.txid, n.hi_snap) AND l.id <= n.pos), false) AS seen
  ) r
 WHERE NOT COALESCE(pg_catalog.pg_visible_in_snapshot(l.txid, n.start_snap), false)
   AND NOT EXISTS (SELECT 1 FROM outbox.log_exceptions x WHERE x.subscription = s.name AND x.id = l.id)
;

-- Every event of the log, with the state of 'default' where it exists and
-- the event is its own, and the events whose ring table retention has
-- emptied while 'default' still keeps a row for them (a dead letter, say).
CREATE VIEW outbox.events AS
SELECT l.id, l.topic, l.subject, l.dispatch_key, l.payload, l.headers,
       d.state, d.attempts, l.max_attempts, d.available_at, d.lease_expires_at,
       d.leased_by, d.last_error, d.errors, l.published_at, d.delivered_at, d.dead_at, d.cancelled_at
  FROM outbox.log l
  LEFT JOIN outbox._log_deliveries d ON d.subscription = 'default' AND d.event_id = l.id
UNION ALL
SELECT x.id, x.topic, x.subject, x.dispatch_key, x.payload, x.headers,
       x.state, x.attempts, x.max_attempts,
       CASE WHEN x.state = 'pending' THEN x.visible_at END,
       CASE WHEN x.state = 'leased' THEN x.visible_at END,
       x.leased_by, x.last_error, x.errors, x.published_at, x.delivered_at, x.dead_at, x.cancelled_at
  FROM outbox.log_exceptions x
 WHERE x.subscription = 'default'
   AND NOT EXISTS (SELECT 1 FROM outbox.log l WHERE l.lane = x.lane AND l.id = x.id);

COMMENT ON VIEW outbox.events IS
'Every retained event, one row each. Columns: id, topic, subject, dispatch_key, payload, headers, then the state of the default subscription (NULL when there is none, '
'or the event is not its own): state, attempts, max_attempts (the event''s), available_at (pending only), lease_expires_at (leased only), leased_by, last_error, errors (attempt history, jsonb array), '
'published_at, delivered_at, dead_at, cancelled_at: the events of the log, with the state of ''default'' there (outbox.deliveries explains the states; an event acked on its first try has its batch''s delivered_at), '
'and the events retention has removed from the log while ''default'' keeps a row of its own for them.';

CREATE VIEW outbox.deliveries AS
SELECT d.event_id, d.subscription, d.topic, d.subject, d.state, d.attempts, d.max_attempts, d.leased_by,
       d.lease_expires_at, d.available_at, d.last_error, d.errors, d.delivered_at, d.dead_at, d.cancelled_at
  FROM outbox._log_deliveries d;

COMMENT ON VIEW outbox.deliveries IS
'One row per event and subscription that receives it: event_id, subscription, topic, subject, state (pending, leased, dead, delivered, cancelled), attempts, max_attempts (the subscription''s if it sets one, else the event''s), '
'leased_by, lease_expires_at, available_at, last_error, errors (the attempt history, jsonb array), delivered_at, dead_at, cancelled_at. '
'Every retained event a subscription receives: an event it has not read yet is pending; '
'one in a batch in flight is pending, leased or delivered there (attempts 1; leased_by the worker that claimed it while it is leased); '
'one acked from its batch on the first try is delivered, delivered_at the time its batch finished (batch precision: no row is written per event; NULL while the batch is in flight or after outbox.retention_delivered); one that needed a row of its own (a failure, an expired lease, a delay, a replay, a cancel) has that row''s state, history and times. '
'An event the subscription received stays here while the log or its row is retained. Reads the whole log: filter by subscription and poll it every 15 s or slower.';

-- 'default' reads the log from its first event.
SELECT outbox._log_subscribe('default', 'earliest');
