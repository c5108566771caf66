-- Subscriptions (consumer groups): their policy, pausing, and where operators
-- look. 'default' reads outbox.event_queue; named subscriptions (0.9.0) read
-- the log (sql/log.sql, src/log/).
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
           topics = NEW.topics, dead_letter_policy = NEW.dead_letter_policy
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

-- Named subscriptions (0.9.0) read the event log (sql/log.sql, src/log/):
-- each has its own lanes, batches and exception rows, so it receives every
-- matching event whatever the others do, and publish writes nothing per
-- subscription. 'default' still reads outbox.event_queue.
CREATE FUNCTION outbox.create_subscription(
    name               text,
    topics             text[]   DEFAULT NULL,
    start              text     DEFAULT 'now',
    max_attempts       integer  DEFAULT NULL,
    backoff_base       interval DEFAULT NULL,
    backoff_max        interval DEFAULT NULL,
    default_lease      interval DEFAULT NULL,
    dead_letter_policy text     DEFAULT NULL
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
    INSERT INTO outbox.subscription_catalog AS c
           (name, max_attempts, backoff_base, backoff_max, default_lease, topics, dead_letter_policy)
    VALUES (resolved, max_attempts, backoff_base, backoff_max, default_lease, patterns, dead_letter_policy)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox: subscription % already exists', pg_catalog.quote_literal(resolved)
            USING ERRCODE = '42710', HINT = 'Change it with outbox.alter_subscription().';
    END IF;
    INSERT INTO outbox.subscription_activity (name) VALUES (resolved) ON CONFLICT DO NOTHING;
    -- Its lanes start at a cursor taken now (src/log/claim.rs): every event
    -- whose transaction commits after this one took it, whenever it was published.
    PERFORM outbox._log_subscribe(resolved, start);
END
$$;

COMMENT ON FUNCTION outbox.create_subscription(text, text[], text, integer, interval, interval, interval, text) IS
'Create a subscription (consumer group) over the event log: it receives every event whose topic matches topics and whose transaction commits after this call''s snapshot '
'(start = ''now''; an event published before, in a transaction that commits after, is included), or every event still in the log (''earliest''). '
'Claim with outbox.claim(..., subscription => name); ack, fail and extend_lease as for any event. Publishing costs nothing per subscription. '
'Arguments: name (1 to 63 characters of [a-z0-9_.-], starting with a letter or digit), topics (claim''s patterns: exact names, prefixes ending in ''.*'', ''*''; NULL = every topic), '
'start (''now'' or ''earliest''), max_attempts (1..1000000), backoff_base and backoff_max (interval > 0, <= 365 days), default_lease (interval > 0, <= outbox.max_lease), '
'dead_letter_policy (''block'' or ''skip''); NULL settings follow the topic''s, else the GUCs. Returns void. '
'Errors: 22004 NULL name or start, NULL topics element; 22023 malformed name, topic pattern, start or setting, empty or multi-dimensional topics array; 42710 the subscription exists. '
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
    IF resolved OPERATOR(pg_catalog.=) 'default' THEN
        RAISE EXCEPTION 'outbox: the default subscription cannot be dropped yet'
            USING ERRCODE = '0A000',
                  DETAIL = 'In 0.9.0 it is the events of outbox.event_queue; it moves onto the log in a later release.';
    END IF;
    -- Two drops of one subscription: the second waits, then finds it gone.
    PERFORM 1 FROM outbox.subscription_catalog c WHERE c.name OPERATOR(pg_catalog.=) resolved FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM outbox._subscription(resolved);
    END IF;
    -- Lanes first: a claim moves a lane only while it holds the lane's row, so
    -- this waits for those, and later claims skip the gone lanes. Then the
    -- leases are counted, after waiting for every transaction that holds one
    -- of the subscription's batches or exception rows (a claim left open
    -- included): _log_in_flight takes those locks, in the order acks and
    -- replay take them, and claims only try them.
    DELETE FROM outbox.log_lanes l WHERE l.subscription OPERATOR(pg_catalog.=) resolved;
    in_flight := outbox._log_in_flight(resolved);
    IF in_flight OPERATOR(pg_catalog.>) 0 AND NOT force THEN
        RAISE EXCEPTION 'outbox: subscription % has % leases in flight', pg_catalog.quote_literal(resolved), in_flight
            USING ERRCODE = '55006', HINT = 'Wait for the workers to finish, or pass force => true (their acks then change nothing).';
    END IF;
    -- Batches next: fail() moves a batch's events to exception rows only while
    -- the batch row exists (key-share locked). Then the exception rows, all of
    -- them visible by now.
    DELETE FROM outbox.log_batches b WHERE b.subscription OPERATOR(pg_catalog.=) resolved;
    DELETE FROM outbox.log_exceptions e WHERE e.subscription OPERATOR(pg_catalog.=) resolved;
    DELETE FROM outbox.subscription_activity a WHERE a.name OPERATOR(pg_catalog.=) resolved;
    DELETE FROM outbox.subscription_catalog c WHERE c.name OPERATOR(pg_catalog.=) resolved;
END
$$;

COMMENT ON FUNCTION outbox.drop_subscription(text, boolean) IS
'Drop a named subscription with its position in the log, its batches, retries and dead letters; the log''s retention no longer waits for it. '
'Arguments: name; force (default false: refuse while a lease it handed out has not expired; true: drop anyway, and the holders'' acks, fails and extensions then return false, ''stale'' and NULL). '
'Returns void. Errors: 22004 NULL argument; 22023 malformed name; 42704 unknown subscription; 0A000 ''default'' (it still lives in outbox.event_queue); '
'55006 leases in flight without force. Nothing is dropped on error.';

CREATE FUNCTION outbox.alter_subscription(
    name          text,
    max_attempts  integer  DEFAULT NULL,
    backoff_base  interval DEFAULT NULL,
    backoff_max   interval DEFAULT NULL,
    default_lease interval DEFAULT NULL
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
    -- No event row changes: claim() and fail() read these settings when they act
    -- (from their per-backend cache, src/subscriptions.rs), so a change applies
    -- to calls that start after its commit and never waits for, or stalls, a worker.
    UPDATE outbox.subscription_catalog c SET
        max_attempts  = COALESCE(alter_subscription.max_attempts, c.max_attempts),
        backoff_base  = COALESCE(alter_subscription.backoff_base, c.backoff_base),
        backoff_max   = COALESCE(alter_subscription.backoff_max, c.backoff_max),
        default_lease = COALESCE(alter_subscription.default_lease, c.default_lease),
        updated_at    = pg_catalog.now()
     WHERE c.name OPERATOR(pg_catalog.=) resolved;
    IF NOT FOUND THEN
        PERFORM outbox._subscription(resolved);
    END IF;
END
$$;

COMMENT ON FUNCTION outbox.alter_subscription(text, integer, interval, interval, interval) IS
'Change a subscription''s policy, which overrides the per-topic settings (which override the GUCs). NULL arguments leave that setting unchanged; to reset one to the topic''s, '
'UPDATE outbox.subscription_catalog SET ... = NULL as the owner. '
'Arguments: name (the subscription; NULL raises 22004), max_attempts (1..1000000: attempts a claim may start; an event that has used them goes dead at its next failure, lease expiry or claim), '
'backoff_base and backoff_max (interval > 0, <= 365 days: fail()''s capped exponential backoff), default_lease (interval > 0, <= outbox.max_lease: claim()''s lease when it passes none). '
'Applies from its commit; changes no event and never waits for workers. The dead-letter policy stays per topic (create_topic). Returns void. '
'Errors: 22004 NULL name; 22023 malformed name or invalid setting; 42704 unknown subscription.';

-- Pausing: a paused subscription keeps its events and hands out none; events
-- already leased stay leased and can still be acked, failed or extended (fail()
-- reads the catalog without locking it, so a pause never waits for workers).
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
'Pause a subscription: a claim() for it that starts after the commit returns no rows, at every isolation level; its events are kept, nothing ages out because of the pause, and leases already held can still be acked, failed or extended. '
'Returns true when it paused it, false when it was already paused. Errors: 22004 NULL name; 22023 malformed name; 42704 unknown subscription. As pgq''s consumer pause and River''s queue pause.';

CREATE FUNCTION outbox.resume_subscription(name text) RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox._set_paused(name, false) $$;

COMMENT ON FUNCTION outbox.resume_subscription(text) IS
'Resume a paused subscription: claims hand out its events again, and listening workers are woken at commit. '
'Returns true when it resumed it, false when it was not paused. Errors: 22004 NULL name; 22023 malformed name; 42704 unknown subscription.';

CREATE VIEW outbox.subscriptions AS
WITH q AS (
    SELECT pg_catalog.count(*) FILTER (WHERE e.state <> 'dead') AS undelivered,
           -- What a claim could take now: subject heads whose time has come,
           -- expired leases included (the claim index's rows).
           pg_catalog.count(*) FILTER (WHERE e.state <> 'dead' AND e.is_head AND e.visible_at <= pg_catalog.now()) AS ready,
           pg_catalog.count(*) FILTER (WHERE e.state = 'leased') AS leased,
           pg_catalog.count(*) FILTER (WHERE e.state = 'dead') AS dead,
           pg_catalog.min(e.id) FILTER (WHERE e.state <> 'dead') AS oldest_undelivered_id,
           pg_catalog.min(e.published_at) FILTER (WHERE e.state <> 'dead') AS oldest_undelivered_at
      FROM outbox.event_queue e
)
-- 'default' is the queue's; a named subscription's numbers come from the log
-- (src/log/claim.rs, outbox._log_subscription_stats).
SELECT c.name, c.topics, c.paused, c.paused_at,
       COALESCE(l.lag_events, q.undelivered) AS lag_events,
       pg_catalog.now() - COALESCE(l.oldest_at, q.oldest_undelivered_at) AS lag,
       COALESCE(l.oldest_id, q.oldest_undelivered_id) AS oldest_undelivered_id,
       COALESCE(l.oldest_at, q.oldest_undelivered_at) AS oldest_undelivered_at,
       q.ready,
       COALESCE(l.leases_in_flight, q.leased) AS leases_in_flight,
       COALESCE(l.dead_letters, q.dead) AS dead_letters,
       a.last_claim_at,
       c.max_attempts, c.backoff_base, c.backoff_max, c.default_lease,
       c.created_at, c.updated_at, c.dead_letter_policy
  FROM outbox.subscription_catalog c
  LEFT JOIN outbox.subscription_activity a ON a.name = c.name
  LEFT JOIN LATERAL (SELECT s.* FROM outbox._log_subscription_stats(c.name) s
                      WHERE c.name OPERATOR(pg_catalog.<>) 'default') l ON true
  LEFT JOIN q ON c.name OPERATOR(pg_catalog.=) 'default';

COMMENT ON VIEW outbox.subscriptions IS
'One row per subscription: name, topics (its topic filter; NULL = every topic, as for ''default''), paused and paused_at, lag_events (events not yet delivered: pending, leased, or not yet read from the log), '
'lag (interval: age of the oldest of them), oldest_undelivered_id and oldest_undelivered_at, ready (''default'' only: what a claim could take now: subject heads whose time has come, expired leases included), leases_in_flight, dead_letters, '
'last_claim_at (the last claim call for it, paused or not, noted at most once a second per session; NULL when never), '
'its policy (max_attempts, backoff_base, backoff_max, default_lease; NULL = the topic''s setting, else the GUC), created_at, updated_at, and dead_letter_policy (NULL: the topic''s). '
'''default'' reads the hot queue; a named subscription reads its lanes'' windows of the log (0.9.0): poll it every 15 s or slower.';

CREATE VIEW outbox.deliveries AS
SELECT e.id AS event_id, c.name AS subscription, e.topic, e.subject,
       e.state, e.attempts, COALESCE(c.max_attempts, e.max_attempts) AS max_attempts, e.leased_by, e.lease_expires_at, e.available_at,
       e.last_error, e.errors, e.delivered_at, e.dead_at, e.cancelled_at
  FROM outbox.events e
 CROSS JOIN outbox.subscription_catalog c
 WHERE c.name = 'default'
UNION ALL
-- A named subscription's events that have per-event state (src/log/exceptions.rs).
SELECT x.id, x.subscription, x.topic, x.subject,
       x.state,
       x.attempts, COALESCE(c.max_attempts, x.max_attempts), x.leased_by,
       CASE WHEN x.state = 'leased' THEN x.visible_at END,
       CASE WHEN x.state = 'pending' THEN x.visible_at END,
       x.last_error, x.errors, x.delivered_at, x.dead_at, x.cancelled_at
  FROM outbox.log_exceptions x
  JOIN outbox.subscription_catalog c ON c.name = x.subscription;

COMMENT ON VIEW outbox.deliveries IS
'One row per event and subscription with a delivery state: event_id, subscription, topic, subject, state (pending, leased, dead, delivered, cancelled), attempts, max_attempts (the subscription''s if it sets one, else the event''s), '
'leased_by, lease_expires_at, available_at, last_error, errors (the attempt history, jsonb array), delivered_at, dead_at, cancelled_at. '
'''default'': every event of outbox.events. A named subscription (0.9.0): its events that failed or whose lease expired (delivered ones too, with their history, for retention_delivered), that are delayed or wait behind such an event of their subject, its dead letters and the events cancelled for it; '
'events it received on the first try and those it has not read yet have no row here (outbox.subscriptions gives its lag).';
