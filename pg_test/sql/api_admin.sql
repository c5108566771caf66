-- Operator API: replay, replay_dead, cancel (each allowed and refused state),
-- dead-letter policies, the topic registry and the outbox.events view.
\i sql/prologue.inc

-- One event in each state, ids 1..6 in this order:
-- 1 pending, 2 leased, 3 delivered, 4 dead, 5 cancelled, 6 pending (retry scheduled).
-- A procedure, so that the events commit before the claim: a claim never sees
-- events of its own transaction that has not committed (the log is read in
-- commit order).
CREATE PROCEDURE pg_temp.states() LANGUAGE plpgsql AS $$
BEGIN
    CALL pg_temp.reset(restart => true);
    PERFORM outbox.publish('adm', '"pending"', deliver_at => now() + interval '1 hour');
    PERFORM outbox.publish_batch('adm', ARRAY['"leased"', '"delivered"', '"dead"', '"cancelled"', '"retry"']::jsonb[]);
    COMMIT;
    DROP TABLE IF EXISTS st;
    CREATE TEMP TABLE st AS SELECT * FROM outbox.claim('w', 10, interval '1 hour');
    PERFORM outbox.ack(id, lease_token) FROM st WHERE payload = '"delivered"';
    PERFORM outbox.fail(id, lease_token, 'poison', permanent => true) FROM st WHERE payload = '"dead"';
    PERFORM outbox.fail(id, lease_token, 'x', retry_in => '1 hour') FROM st WHERE payload IN ('"cancelled"', '"retry"');
    PERFORM outbox.cancel(5);
END $$;

-- ---------------------------------------------------------------------------
-- The events view: one row per event, state-specific columns.
-- ---------------------------------------------------------------------------
CALL pg_temp.states();
SELECT id, payload, state, attempts, available_at IS NOT NULL AS has_available_at,
       lease_expires_at IS NOT NULL AS has_lease_expiry, leased_by, last_error,
       delivered_at IS NOT NULL AS has_delivered_at, dead_at IS NOT NULL AS has_dead_at,
       cancelled_at IS NOT NULL AS has_cancelled_at, jsonb_array_length(errors) AS n_errors
  FROM outbox.events ORDER BY id;
SELECT state, count(*) FROM outbox.deliveries WHERE subscription = 'default' GROUP BY 1 ORDER BY 1;

-- ---------------------------------------------------------------------------
-- cancel: pending (ready, delayed, retry-scheduled) and dead -> cancelled.
-- ---------------------------------------------------------------------------
SELECT id, (SELECT state FROM outbox.events e WHERE e.id = i) AS state_before, outbox.cancel(i) AS cancelled
  FROM generate_series(1, 6) AS i(id) ORDER BY id;
SELECT outbox.cancel(999) AS unknown_id, outbox.cancel(NULL) AS null_id;
SELECT id, payload, state, cancelled_at IS NOT NULL AS has_cancelled_at, last_error, attempts
  FROM outbox.events ORDER BY id;
-- a cancelled event keeps its history; a cancelled leased event is impossible,
-- so the leased one (2) can still be acked
SELECT outbox.ack(id, lease_token) AS ack_leased FROM st WHERE id = 2;
CALL pg_temp.states();
SELECT outbox.publish('adm', '"ready"') AS ready_id;
SELECT outbox.cancel(7) AS cancel_ready;
SELECT state FROM outbox.events WHERE id = 7;

-- ---------------------------------------------------------------------------
-- replay: dead and cancelled -> pending; nothing else.
-- ---------------------------------------------------------------------------
CALL pg_temp.states();
SELECT id, (SELECT state FROM outbox.events e WHERE e.id = i) AS state_before, outbox.replay(i) AS replayed
  FROM generate_series(1, 6) AS i(id) ORDER BY id;
SELECT outbox.replay(999) AS unknown_id, outbox.replay(NULL) AS null_id;
SELECT id, payload, state, attempts, available_at <= clock_timestamp() AS ready_now, last_error,
       jsonb_array_length(errors) AS n_errors, dead_at IS NULL AS no_dead_at, leased_by
  FROM outbox.events ORDER BY id;
-- replayed events are claimable again, first attempt again
SELECT id, payload, attempt FROM outbox.claim('w2', 10) ORDER BY id;
-- replaying twice: the second time the event is leased, so false
SELECT outbox.replay(4) AS replay_leased;

-- ---------------------------------------------------------------------------
-- replay_dead: by topic pattern, by dead_at window, dry run.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset(restart => true);
SELECT sum((SELECT count(*) FROM outbox.publish_batch(t, ARRAY['1', '2']::jsonb[]))) AS published
  FROM unnest(ARRAY['mail', 'mail.sent', 'mail.sent.x', 'mailbox', 'sms']) AS t;
SELECT id, topic FROM outbox.events ORDER BY id;
SELECT count(*) AS killed FROM outbox.claim('w', 100) c
 WHERE outbox.fail(c.id, c.lease_token, 'dead ' || c.topic, permanent => true) = 'dead';
-- spread dead_at: event n died n days ago
CALL pg_temp.set_rows('dead_at = now() - make_interval(days => id::int)', 'true');
CREATE FUNCTION pg_temp.rd(p text, since timestamptz, until timestamptz) RETURNS text LANGUAGE plpgsql AS $$
DECLARE dry bigint; n bigint; ids text;
BEGIN
    dry := outbox.replay_dead(p, since, until, true);
    n := outbox.replay_dead(p, since, until);
    SELECT string_agg(event_id::text, ',' ORDER BY event_id) INTO ids FROM outbox.deliveries
     WHERE subscription = 'default' AND state = 'pending';
    -- undo, for the next case
    CALL pg_temp.set_rows($a$state = 'dead', dead_at = now() - make_interval(days => id::int)$a$, $c$state = 'pending'$c$);
    RETURN format('dry=%s replayed=%s ids=%s', dry, n, coalesce(ids, '-'));
END $$;
SELECT label, pg_temp.rd(p, since, until) AS result
  FROM (VALUES
    (1, 'all (NULL)', NULL, NULL::timestamptz, NULL::timestamptz),
    (2, '*', '*', NULL, NULL),
    (3, 'exact mail', 'mail', NULL, NULL),
    (4, 'prefix mail.*', 'mail.*', NULL, NULL),
    (5, 'exact mail.sent', 'mail.sent', NULL, NULL),
    (6, 'no match', 'nothing', NULL, NULL),
    (7, 'since 3.5 days', NULL, now() - interval '3.5 days', NULL),
    (8, 'until 8.5 days', NULL, NULL, now() - interval '8.5 days'),
    (9, 'window [6.5, 2.5) days', NULL, now() - interval '6.5 days', now() - interval '2.5 days'),
    (10, 'prefix + window', 'mail.*', now() - interval '5.5 days', now() - interval '2.5 days'),
    (11, 'empty window', NULL, now(), now() - interval '1 day'),
    (12, 'exact bound since = dead_at', NULL, now() - interval '2 days', now() - interval '1.5 days')
  ) AS v(n, label, p, since, until)
 ORDER BY n;
SELECT label, pg_temp.try_result(stmt) AS result
  FROM (VALUES
    (1, 'bad pattern', $$SELECT outbox.replay_dead('Mail')$$),
    (2, 'bad prefix', $$SELECT outbox.replay_dead('mail*')$$),
    (3, 'empty pattern', $$SELECT outbox.replay_dead('')$$),
    (4, 'NULL dry_run', $$SELECT outbox.replay_dead(NULL, NULL, NULL, NULL)$$),
    (5, 'infinite window', $$SELECT outbox.replay_dead(NULL, '-infinity', 'infinity', true)$$)
  ) AS v(n, label, stmt)
 ORDER BY n;
SELECT state, count(*) FROM outbox.events GROUP BY 1 ORDER BY 1;

-- ---------------------------------------------------------------------------
-- Dead-letter policy 'block' (default) vs 'skip', per subject.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset();
SELECT outbox.create_topic('dl.skip', dead_letter_policy => 'skip');
SELECT outbox.create_topic('dl.block', dead_letter_policy => 'block');
-- topics: dl.block (registered block), dl.skip, dl.default (unregistered = block)
SELECT sum((SELECT count(*) FROM outbox.publish_batch(t, ARRAY['"1st"', '"2nd"', '"nosubject"']::jsonb[], ARRAY['s-' || t, 's-' || t, NULL])))
  FROM unnest(ARRAY['dl.block', 'dl.skip', 'dl.default']) AS t;
CREATE TEMP TABLE d1 AS SELECT * FROM outbox.claim('w', 100);
SELECT topic, payload FROM d1 ORDER BY id;
SELECT topic, outbox.fail(id, lease_token, 'poison', permanent => true) FROM d1 WHERE payload = '"1st"' ORDER BY id;
SELECT count(*) FILTER (WHERE outbox.ack(id, lease_token)) AS acked FROM d1 WHERE payload = '"nosubject"';
-- only the skip topic's second event is claimable
CREATE TEMP TABLE d2 AS SELECT * FROM outbox.claim('w', 100);
SELECT topic, payload FROM d2 ORDER BY id;
SELECT count(*) FILTER (WHERE outbox.ack(id, lease_token)) AS acked FROM d2;
-- block: cancelling the dead head releases the subject
SELECT outbox.cancel(id) AS cancel_dead_head FROM outbox.events WHERE topic = 'dl.block' AND state = 'dead';
SELECT topic, payload FROM outbox.claim('w', 100) ORDER BY id;
-- block: replaying the dead head puts it first again
SELECT outbox.replay(id) AS replay_dead_head FROM outbox.events WHERE topic = 'dl.default' AND state = 'dead';
CREATE TEMP TABLE d3 AS SELECT * FROM outbox.claim('w', 100, topics => ARRAY['dl.default']);
SELECT topic, payload, attempt FROM d3 ORDER BY id;
SELECT outbox.ack(id, lease_token) FROM d3;
SELECT topic, payload FROM outbox.claim('w', 100, topics => ARRAY['dl.default']) ORDER BY id;
-- a dead event from an expired lease at max attempts blocks as well
CALL pg_temp.reset();
SELECT outbox.alter_topic('dl.block', max_attempts => 1);
SELECT count(*) FROM outbox.publish_batch('dl.block', ARRAY['"a"', '"b"']::jsonb[], ARRAY['x', 'x']);
SELECT payload FROM outbox.claim('w', 10, interval '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT count(*) AS after_expiry FROM outbox.claim('w', 10);
SELECT payload, state, last_error FROM outbox.events ORDER BY id;
-- the policy is applied when the event dies: under 'skip' an expired head does not block
CALL pg_temp.reset();
SELECT outbox.alter_topic('dl.skip', max_attempts => 1);
SELECT count(*) FROM outbox.publish_batch('dl.skip', ARRAY['"a"', '"b"']::jsonb[], ARRAY['y', 'y']);
SELECT payload FROM outbox.claim('w', 10, interval '10 milliseconds');
SELECT pg_sleep(0.05);
-- (the claim that finds the expired lease dead-letters it; the next one sees "b")
SELECT count(*) AS expiring_claim FROM outbox.claim('w', 10);
SELECT payload FROM outbox.claim('w', 10);
-- alter_topic's policy change applies at once (documented), also to subjects
-- already held by a dead event
CALL pg_temp.reset();
SELECT outbox.create_topic('dl.switch');
SELECT count(*) FROM outbox.publish_batch('dl.switch', ARRAY['"a"', '"b"']::jsonb[], ARRAY['z', 'z']);
SELECT outbox.fail(id, lease_token, 'poison', permanent => true) FROM outbox.claim('w', 10);
SELECT count(*) AS blocked FROM outbox.claim('w', 10);
SELECT outbox.alter_topic('dl.switch', dead_letter_policy => 'skip');
SELECT payload AS after_switch_to_skip FROM outbox.claim('w', 10);

-- ---------------------------------------------------------------------------
-- Topic registry: create_topic / alter_topic / drop_topic.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset(topics => true);
SELECT outbox.create_topic('reg.full', 5, '2 seconds', '1 minute', '45 seconds', 'skip', '1 day', '2 days');
SELECT outbox.create_topic('reg.bare');
SELECT topic, max_attempts, backoff_base, backoff_max, default_lease, dead_letter_policy,
       retention_delivered, retention_dead, created_at = updated_at AS untouched
  FROM outbox.topics ORDER BY topic;
SELECT label, pg_temp.try_result(stmt) AS result
  FROM (VALUES
    (1, 'duplicate', $$SELECT outbox.create_topic('reg.full')$$),
    (2, 'NULL topic', $$SELECT outbox.create_topic(NULL)$$),
    (3, 'invalid topic', $$SELECT outbox.create_topic('Reg')$$),
    (4, 'pattern', $$SELECT outbox.create_topic('reg.*')$$),
    (5, 'star', $$SELECT outbox.create_topic('*')$$),
    (6, 'max_attempts 0', $$SELECT outbox.create_topic('reg.x', max_attempts => 0)$$),
    (7, 'max_attempts 1000001', $$SELECT outbox.create_topic('reg.x', max_attempts => 1000001)$$),
    (8, 'backoff_base 0', $$SELECT outbox.create_topic('reg.x', backoff_base => '0')$$),
    (9, 'backoff_base -1s', $$SELECT outbox.create_topic('reg.x', backoff_base => '-1 second')$$),
    (10, 'backoff_base 366d', $$SELECT outbox.create_topic('reg.x', backoff_base => '366 days')$$),
    (11, 'backoff_max 0', $$SELECT outbox.create_topic('reg.x', backoff_max => '0')$$),
    (12, 'default_lease 0', $$SELECT outbox.create_topic('reg.x', default_lease => '0')$$),
    (13, 'default_lease 13h', $$SELECT outbox.create_topic('reg.x', default_lease => '13 hours')$$),
    (14, 'policy bogus', $$SELECT outbox.create_topic('reg.x', dead_letter_policy => 'drop')$$),
    (15, 'policy NULL', $$SELECT outbox.create_topic('reg.x', dead_letter_policy => NULL)$$),
    (16, 'policy uppercase', $$SELECT outbox.create_topic('reg.x', dead_letter_policy => 'BLOCK')$$),
    (17, 'retention_delivered -1s', $$SELECT outbox.create_topic('reg.x', retention_delivered => '-1 second')$$),
    (18, 'retention_dead -1s', $$SELECT outbox.create_topic('reg.x', retention_dead => '-1 second')$$),
    (19, 'retention 0 ok', $$SELECT outbox.create_topic('reg.zero', retention_delivered => '0', retention_dead => '0')$$),
    (20, 'alter unknown', $$SELECT outbox.alter_topic('reg.unknown', max_attempts => 3)$$),
    (21, 'alter NULL topic', $$SELECT outbox.alter_topic(NULL)$$),
    (22, 'alter invalid topic', $$SELECT outbox.alter_topic('Reg')$$),
    (23, 'alter max_attempts 0', $$SELECT outbox.alter_topic('reg.full', max_attempts => 0)$$),
    (24, 'alter policy bogus', $$SELECT outbox.alter_topic('reg.full', dead_letter_policy => 'x')$$),
    (25, 'alter retention -1s', $$SELECT outbox.alter_topic('reg.full', retention_dead => '-1 second')$$),
    (26, 'alter lease 13h', $$SELECT outbox.alter_topic('reg.full', default_lease => '13 hours')$$),
    (27, 'drop NULL topic', $$SELECT outbox.drop_topic(NULL)$$),
    (28, 'drop invalid topic', $$SELECT outbox.drop_topic('Reg')$$),
    (29, 'drop NULL force', $$SELECT outbox.drop_topic('reg.bare', NULL)$$),
    (30, 'drop unknown', $$SELECT outbox.drop_topic('reg.unknown')$$)
  ) AS v(n, label, stmt)
 ORDER BY n;
-- alter: NULL leaves a setting unchanged
SELECT outbox.alter_topic('reg.full', max_attempts => 7);
SELECT outbox.alter_topic('reg.full', dead_letter_policy => 'block', retention_dead => '3 days');
SELECT outbox.alter_topic('reg.full');
SELECT topic, max_attempts, backoff_base, backoff_max, default_lease, dead_letter_policy,
       retention_delivered, retention_dead, updated_at >= created_at AS updated
  FROM outbox.topics ORDER BY topic;
-- max_attempts applies to events published afterwards only
SELECT outbox.publish('reg.full', '"before"') IS NOT NULL AS before;
SELECT outbox.alter_topic('reg.full', max_attempts => 2);
SELECT outbox.publish('reg.full', '"after"') IS NOT NULL AS after;
SELECT payload, max_attempts FROM outbox.events WHERE topic = 'reg.full' ORDER BY id;

-- drop: refused while the topic has pending, leased or dead events
SELECT outbox.drop_topic('reg.bare') AS drop_empty;
SELECT outbox.create_topic('reg.bare');
SELECT outbox.publish('reg.bare', '"p"') IS NOT NULL AS pending;
SELECT pg_temp.try_result($$SELECT outbox.drop_topic('reg.bare')$$) AS drop_with_pending;
CREATE TEMP TABLE rb AS SELECT * FROM outbox.claim('w', 10, topics => ARRAY['reg.bare']);
SELECT pg_temp.try_result($$SELECT outbox.drop_topic('reg.bare')$$) AS drop_with_leased;
SELECT outbox.fail(id, lease_token, 'x', permanent => true) FROM rb;
SELECT pg_temp.try_result($$SELECT outbox.drop_topic('reg.bare', false)$$) AS drop_with_dead;
SELECT outbox.replay(id) FROM rb;
SELECT outbox.ack(id, lease_token) FROM outbox.claim('w', 10, topics => ARRAY['reg.bare']);
-- only delivered events left: allowed
SELECT outbox.drop_topic('reg.bare') AS drop_delivered_only;
SELECT outbox.drop_topic('reg.bare') AS drop_again;
-- an event delivered to 'default' but not yet to another subscription still
-- holds its topic
SELECT outbox.create_subscription('reg_audit', ARRAY['reg.*']) IS NULL AS audit;
SELECT outbox.create_topic('reg.bare');
SELECT outbox.publish('reg.bare', '"audit"') IS NOT NULL AS published;
SELECT outbox.ack(id, lease_token) FROM outbox.claim('w', 10, topics => ARRAY['reg.bare']);
SELECT pg_temp.try_result($$SELECT outbox.drop_topic('reg.bare')$$) AS drop_unread_elsewhere;
SELECT outbox.ack(id, lease_token) FROM outbox.claim('w', 10, subscription => 'reg_audit');
SELECT outbox.drop_topic('reg.bare') AS drop_read_everywhere;
SELECT outbox.drop_subscription('reg_audit');
-- force: drops the policy row, the events stay and fall back to the GUC defaults
SELECT pg_temp.try_result($$SELECT outbox.drop_topic('reg.full')$$) AS drop_full;
SELECT outbox.drop_topic('reg.full', force => true) AS forced;
SELECT topic FROM outbox.topics ORDER BY 1;
SELECT payload, state, max_attempts FROM outbox.events WHERE topic = 'reg.full' ORDER BY id;
SELECT payload FROM outbox.claim('w', 10, topics => ARRAY['reg.full']) ORDER BY id;

-- wakeup_status() answers on any cluster (its values depend on preloading)
SELECT count(*) AS status_rows FROM outbox.wakeup_status();
