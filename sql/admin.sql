-- Operator functions: replay, cancel, the topic registry. None of these is on the
-- hot path, so they are plain PL/pgSQL; each pins search_path and qualifies every
-- object it names.

-- Topic names and patterns are checked by outbox._pattern_kind and
-- outbox._check_topic (src/validate.rs), the one definition of the grammar.

-- True when topic matches one pattern (exact, 'a.b.*' or '*').
CREATE FUNCTION outbox._topic_matches(topic text, pattern text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE outbox._pattern_kind(pattern)
        WHEN 'all' THEN true
        WHEN 'prefix' THEN pg_catalog.starts_with(topic, pg_catalog.left(pattern, -1))
        ELSE topic OPERATOR(pg_catalog.=) pattern
    END
$$;

CREATE FUNCTION outbox.replay(id bigint, subscription text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    t text;
    subj text;
    sub text;
    ln smallint;
BEGIN
    -- A subscription's dead and cancelled events are its exception rows
    -- (src/log/exceptions.rs).
    sub := outbox._subscription(subscription);
    IF id IS NULL THEN
        RETURN false;
    END IF;
    PERFORM outbox._log_rebase();  -- a restored log first (sql/restore.sql)
    -- Cancelled before its lane read it (src/log/cancel.rs): the row and
    -- the lane's skip go, under the lane's lock, and the lane delivers it
    -- in its place. If a claim has read it meanwhile, it is replayed from
    -- its row below.
    SELECT x.lane, x.topic INTO ln, t FROM outbox.log_exceptions x
     WHERE x.subscription OPERATOR(pg_catalog.=) sub AND x.id OPERATOR(pg_catalog.=) replay.id
       AND x.state OPERATOR(pg_catalog.=) 'cancelled';
    IF FOUND THEN
        PERFORM 1 FROM outbox.log_lanes l
         WHERE l.subscription OPERATOR(pg_catalog.=) sub AND l.lane OPERATOR(pg_catalog.=) ln
           AND replay.id OPERATOR(pg_catalog.=) ANY (l.skips)
           FOR UPDATE;
        IF FOUND THEN
            UPDATE outbox.log_lanes l SET skips = pg_catalog.array_remove(l.skips, replay.id)
             WHERE l.subscription OPERATOR(pg_catalog.=) sub AND l.lane OPERATOR(pg_catalog.=) ln;
            DELETE FROM outbox.log_exceptions x
             WHERE x.subscription OPERATOR(pg_catalog.=) sub AND x.id OPERATOR(pg_catalog.=) replay.id;
            PERFORM outbox._wake(t);
            RETURN true;
        END IF;
        t := NULL;
    END IF;
    SELECT x.subject INTO subj FROM outbox.log_exceptions x
     WHERE x.subscription OPERATOR(pg_catalog.=) sub AND x.id OPERATOR(pg_catalog.=) replay.id
       AND x.state OPERATOR(pg_catalog.=) ANY (ARRAY['dead', 'cancelled']);
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    -- Its subject's events still in the lane's batch now follow it. The lane
    -- and the batch are locked before the row, as drop_subscription locks them.
    PERFORM outbox._log_detach_subject(sub, subj);
    UPDATE outbox.log_exceptions x
       SET state = 'pending', attempts = 0, visible_at = pg_catalog.clock_timestamp(),
           lease_token = NULL, leased_by = NULL, dead_at = NULL, cancelled_at = NULL, blocks = true
     WHERE x.subscription OPERATOR(pg_catalog.=) sub AND x.id OPERATOR(pg_catalog.=) replay.id
       AND x.state OPERATOR(pg_catalog.=) ANY (ARRAY['dead', 'cancelled'])
    RETURNING x.topic INTO t;
    IF t IS NULL THEN
        RETURN false;
    END IF;
    PERFORM outbox._wake(t);
    RETURN true;
END
$$;

COMMENT ON FUNCTION outbox.replay(bigint, text) IS
'Move a dead or cancelled event of a subscription (NULL = ''default'') back to pending, attempts reset to 0, attempt history and last_error kept. Returns true when it did, '
'false for any other state or an unknown/NULL id (pending, leased and delivered events are never replayed). '
'The event keeps its id, so it keeps its place in its subject''s order and its dispatch key: it waits for its subject''s earlier events of the subscription. '
'An event cancelled before its lane read it goes back to the lane, which delivers it in its place. Takes no subject lock. '
'Errors: 22023 malformed subscription name; 42704 unknown subscription. Dead letters are kept for replay, as pg-boss and Oban keep them.';

CREATE FUNCTION outbox.replay_dead(
    topic_pattern text        DEFAULT NULL,
    dead_since    timestamptz DEFAULT NULL,
    dead_until    timestamptz DEFAULT NULL,
    dry_run       boolean     DEFAULT false,
    subscription  text        DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint;
    sub text;
BEGIN
    sub := outbox._subscription(subscription);
    IF topic_pattern IS NOT NULL THEN
        PERFORM outbox._pattern_kind(topic_pattern);
    END IF;
    IF dry_run IS NULL THEN
        RAISE EXCEPTION 'outbox: dry_run must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF dry_run THEN
        SELECT pg_catalog.count(*) INTO n FROM outbox.log_exceptions x
         WHERE x.subscription OPERATOR(pg_catalog.=) sub AND x.state OPERATOR(pg_catalog.=) 'dead'
           AND (topic_pattern IS NULL OR outbox._topic_matches(x.topic, topic_pattern))
           AND (dead_since IS NULL OR x.dead_at OPERATOR(pg_catalog.>=) dead_since)
           AND (dead_until IS NULL OR x.dead_at OPERATOR(pg_catalog.<) dead_until);
        RETURN n;
    END IF;
    PERFORM outbox._log_rebase();  -- a restored log first (sql/restore.sql)
    -- Their subjects' events still in the lanes' batches now follow them:
    -- detached first, lanes in one order, before the rows change (the lock
    -- order of drop_subscription).
    PERFORM outbox._log_detach_subject(sub, d.subject)
       FROM (SELECT DISTINCT x.subject FROM outbox.log_exceptions x
              WHERE x.subscription OPERATOR(pg_catalog.=) sub AND x.state OPERATOR(pg_catalog.=) 'dead'
                AND x.subject IS NOT NULL
                AND (topic_pattern IS NULL OR outbox._topic_matches(x.topic, topic_pattern))
                AND (dead_since IS NULL OR x.dead_at OPERATOR(pg_catalog.>=) dead_since)
                AND (dead_until IS NULL OR x.dead_at OPERATOR(pg_catalog.<) dead_until)) d
      ORDER BY pg_catalog.hashtext(d.subject) OPERATOR(pg_catalog.&) 15, d.subject;
    UPDATE outbox.log_exceptions x
       SET state = 'pending', attempts = 0, visible_at = pg_catalog.clock_timestamp(),
           lease_token = NULL, leased_by = NULL, dead_at = NULL, blocks = true
     WHERE x.subscription OPERATOR(pg_catalog.=) sub AND x.state OPERATOR(pg_catalog.=) 'dead'
       AND (topic_pattern IS NULL OR outbox._topic_matches(x.topic, topic_pattern))
       AND (dead_since IS NULL OR x.dead_at OPERATOR(pg_catalog.>=) dead_since)
       AND (dead_until IS NULL OR x.dead_at OPERATOR(pg_catalog.<) dead_until);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n OPERATOR(pg_catalog.>) 0 THEN
        PERFORM outbox._wake(NULL);
    END IF;
    RETURN n;
END
$$;

COMMENT ON FUNCTION outbox.replay_dead(text, timestamptz, timestamptz, boolean, text) IS
'Bulk replay of the dead events of a subscription (NULL = ''default''): those whose topic matches topic_pattern (exact, ''a.b.*'' or ''*''; NULL = all) and whose dead_at is in [dead_since, dead_until) (NULL bound = open). '
'Returns how many events were replayed (bigint), or with dry_run = true how many would be, changing nothing. '
'Errors: 22023 bad pattern or subscription name; 22004 NULL dry_run; 42704 unknown subscription. A bulk redrive, as in pg-boss and PgQue.';

CREATE FUNCTION outbox.cancel(id bigint, subscription text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n bigint;
    sub text;
BEGIN
    sub := outbox._subscription(subscription);
    IF id IS NULL THEN
        RETURN false;
    END IF;
    PERFORM outbox._log_rebase();  -- a restored log first (sql/restore.sql)
    -- A pending or dead row of its own; else an event its lane has not
    -- read yet, or one waiting in the lane's batch (src/log/cancel.rs).
    -- Never a leased one: that is the worker's to ack or fail.
    UPDATE outbox.log_exceptions x
       SET state = 'cancelled', cancelled_at = pg_catalog.clock_timestamp(), lease_token = NULL, dead_at = NULL
     WHERE x.subscription OPERATOR(pg_catalog.=) sub AND x.id OPERATOR(pg_catalog.=) cancel.id
       AND x.state OPERATOR(pg_catalog.=) ANY (ARRAY['pending', 'dead']);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n OPERATOR(pg_catalog.=) 0 AND outbox._log_cancel(sub, cancel.id) THEN
        n := 1;
    END IF;
    IF n OPERATOR(pg_catalog.>) 0 THEN
        PERFORM outbox._wake(NULL);
    END IF;
    RETURN n OPERATOR(pg_catalog.>) 0;
END
$$;

COMMENT ON FUNCTION outbox.cancel(bigint, text) IS
'Cancel, for a subscription (NULL = ''default''), an event that is pending (not read yet by its lane, waiting in its lane''s batch in flight, ready, delayed, waiting for a retry or parked behind another of its subject) or dead: '
'it becomes cancelled for that subscription, and a later event of its subject may proceed. '
'Returns true when it did; false for leased, delivered, already cancelled, unknown or NULL ids, and for an event committed before the subscription or outside its topics. A leased event cannot be cancelled under a worker: fail it or let the lease expire. '
'Cancelling a dead event is how an operator unblocks a subject under the ''block'' dead-letter policy. Takes no subject lock; it waits for a claim that is moving that lane (src/log/cancel.rs). '
'Errors: 22023 malformed subscription name; 42704 unknown subscription.';

-- The topic registry.

-- publish() caches outbox.topics per backend (src/topics.rs); any change to the
-- table invalidates every backend's copy.
CREATE FUNCTION outbox._topics_changed() RETURNS trigger
LANGUAGE c AS 'MODULE_PATHNAME', 'outbox_topics_changed';
CREATE TRIGGER topics_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.topics
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._topics_changed();
-- ALWAYS, as for outbox.subscription_catalog (sql/subscriptions.sql).
ALTER TABLE outbox.topics ENABLE ALWAYS TRIGGER topics_changed;

-- A topic's dead-letter policy applies to the dead letters already there, in
-- subscriptions without a policy of their own: 'skip' releases their subjects
-- at once, 'block' starts holding them. A claim finds the subject's new head by
-- itself (src/log/exceptions.rs, invariant 4: under a snapshot taken after the
-- topic row's lock, so at every isolation level).
CREATE FUNCTION outbox._apply_dead_letter_policy(topic text, policy text) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF outbox._log_apply_dead_letter_policy(topic, policy) AND policy OPERATOR(pg_catalog.=) 'skip' THEN
        PERFORM outbox._wake(topic);
    END IF;
END
$$;

CREATE FUNCTION outbox.create_topic(
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

CREATE FUNCTION outbox._check_policy(
    max_attempts integer, backoff_base interval, backoff_max interval, default_lease interval,
    dead_letter_policy text, retention_delivered interval, retention_dead interval
) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF max_attempts IS NOT NULL AND (max_attempts OPERATOR(pg_catalog.<) 1 OR max_attempts OPERATOR(pg_catalog.>) 1000000) THEN
        RAISE EXCEPTION 'outbox: max_attempts must be between 1 and 1000000, got %', max_attempts USING ERRCODE = '22023';
    END IF;
    IF backoff_base IS NOT NULL AND (backoff_base OPERATOR(pg_catalog.<=) interval '0' OR backoff_base OPERATOR(pg_catalog.>) interval '365 days') THEN
        RAISE EXCEPTION 'outbox: backoff_base must be > 0 and <= 365 days, got %', backoff_base USING ERRCODE = '22023';
    END IF;
    IF backoff_max IS NOT NULL AND (backoff_max OPERATOR(pg_catalog.<=) interval '0' OR backoff_max OPERATOR(pg_catalog.>) interval '365 days') THEN
        RAISE EXCEPTION 'outbox: backoff_max must be > 0 and <= 365 days, got %', backoff_max USING ERRCODE = '22023';
    END IF;
    IF default_lease IS NOT NULL AND (default_lease OPERATOR(pg_catalog.<=) interval '0'
        OR default_lease OPERATOR(pg_catalog.>) outbox._setting('outbox.max_lease')::interval) THEN
        RAISE EXCEPTION 'outbox: default_lease must be > 0 and <= outbox.max_lease, got %', default_lease USING ERRCODE = '22023';
    END IF;
    IF dead_letter_policy IS NULL OR dead_letter_policy OPERATOR(pg_catalog.<>) ALL (ARRAY['block', 'skip']) THEN
        RAISE EXCEPTION 'outbox: dead_letter_policy must be ''block'' or ''skip'', got %', pg_catalog.quote_nullable(dead_letter_policy) USING ERRCODE = '22023';
    END IF;
    IF retention_delivered OPERATOR(pg_catalog.<) interval '0' OR retention_dead OPERATOR(pg_catalog.<) interval '0' THEN
        RAISE EXCEPTION 'outbox: retention intervals must not be negative' USING ERRCODE = '22023';
    END IF;
END
$$;

COMMENT ON FUNCTION outbox.create_topic(text, integer, interval, interval, interval, text, interval, interval) IS
'Register a topic with its policy; NULL settings fall back to the GUCs (outbox.max_attempts, outbox.backoff_base, outbox.backoff_max, outbox.default_lease, outbox.retention_delivered, outbox.retention_dead). '
'dead_letter_policy: ''block'' (a dead event keeps later events of its subject unclaimable until replayed or cancelled) or ''skip''. Returns void. '
'Errors: 22004 NULL topic; 22023 invalid topic or setting; 42710 topic exists. Follows PgQ set_queue_config (per-queue settings in rows, not GUCs).';

CREATE FUNCTION outbox.alter_topic(
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

COMMENT ON FUNCTION outbox.alter_topic(text, integer, interval, interval, interval, text, interval, interval) IS
'Change a registered topic''s policy; NULL arguments leave that setting unchanged (to reset a setting to the GUC default, update outbox.topics directly as the owner). '
'max_attempts applies to events published afterwards; backoff, lease, retention and the dead-letter policy apply at once (switching to ''skip'' releases subjects blocked by existing dead letters). Returns void. '
'Errors: 22004 NULL topic; 22023 invalid setting; P0002 unknown topic.';

CREATE FUNCTION outbox.drop_topic(topic text, force boolean DEFAULT false) RETURNS boolean
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
    -- Unfinished in any subscription.
    SELECT pg_catalog.count(DISTINCT d.event_id) INTO live FROM outbox._log_deliveries d
     WHERE d.topic OPERATOR(pg_catalog.=) drop_topic.topic
       AND d.state OPERATOR(pg_catalog.=) ANY ('{pending,leased,dead}'::text[]);
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

COMMENT ON FUNCTION outbox.drop_topic(text, boolean) IS
'Unregister a topic. Returns true when it was registered, false otherwise. Refuses (55006 object_in_use) while the topic has pending, leased or dead events in any subscription (reads the whole log), '
'unless force => true; forcing removes only the policy row, never events. Errors: 22004 NULL topic or force; 22023 invalid topic; 55006 undelivered events.';
