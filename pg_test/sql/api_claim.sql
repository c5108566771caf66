-- claim: batch sizes, leases, topic filters, attempt counting, lease expiry,
-- dead-lettering of expired leases, claim order and per-subject order.
\i sql/prologue.inc

-- claim_acked(worker, n): claim(worker, n), each event acked as it is
-- returned, so the next claim never waits behind a batch still out (the log
-- hands out one batch per lane at a time: src/log/claim.rs).
CREATE FUNCTION pg_temp.claim_acked(worker text, n integer DEFAULT 100) RETURNS SETOF jsonb LANGUAGE sql AS $$
    SELECT c.payload FROM outbox.claim(worker, n) c WHERE outbox.ack(c.id, c.lease_token)
$$;

-- Empty queue: no rows, no error.
SELECT count(*) AS claimed FROM outbox.claim('w');

-- ---------------------------------------------------------------------------
-- Result columns and the leased state.
-- ---------------------------------------------------------------------------
SELECT outbox.publish('t.a', '{"k": 1}', subject => 's', dispatch_key => 'dk-1', headers => '{"h": "v"}') AS id;
CREATE TEMP TABLE c1 AS SELECT * FROM outbox.claim('worker-1');
SELECT id, topic, subject, dispatch_key, payload, headers, attempt,
       lease_token IS NOT NULL AS has_token,
       lease_expires_at > now() + interval '29 seconds' AND lease_expires_at <= clock_timestamp() + interval '30 seconds' AS default_30s,
       published_at = (SELECT published_at FROM outbox.events e WHERE e.id = c1.id) AS published_at_matches
  FROM c1;
SELECT state, attempts, leased_by, available_at IS NULL AS no_available_at,
       lease_expires_at = (SELECT lease_expires_at FROM c1) AS expiry_matches
  FROM outbox.events;
-- a leased, unexpired event is not claimed again
SELECT count(*) AS claimed_again FROM outbox.claim('worker-2');
SELECT outbox.ack(id, lease_token) FROM c1;

-- ---------------------------------------------------------------------------
-- Batch sizes.
-- ---------------------------------------------------------------------------
SELECT count(*) FROM outbox.publish_batch('t.batch', (SELECT array_agg(to_jsonb(g)) FROM generate_series(1, 7) g));
SELECT array_agg(p ORDER BY p::int) AS first_1 FROM pg_temp.claim_acked('w', 1) p;
SELECT array_agg(p ORDER BY p::int) AS next_2 FROM pg_temp.claim_acked('w', 2) p;
SELECT array_agg(p ORDER BY p::int) AS rest FROM pg_temp.claim_acked('w', 100) p;
SELECT count(*) AS none_left FROM outbox.claim('w', 100);
-- the default batch size is 100
CALL pg_temp.reset();
SELECT count(*) FROM outbox.publish_batch('t.batch', (SELECT array_agg(to_jsonb(g)) FROM generate_series(1, 150) g));
SELECT count(*) AS default_batch FROM pg_temp.claim_acked('w');
SELECT count(*) AS remainder FROM pg_temp.claim_acked('w');
CALL pg_temp.reset();
SELECT b AS batch_size, pg_temp.try(format('SELECT count(*) FROM outbox.claim(%L, %s)', 'w', coalesce(b::text, 'NULL'))) AS result
  FROM unnest(ARRAY[NULL, 0, -1, 1, 10000, 10001, 2147483647]) WITH ORDINALITY AS u(b, n)
 ORDER BY n;
SET outbox.max_batch_size = 5;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.claim('w', 6)$$) AS over_custom_max;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.claim('w', 5)$$) AS at_custom_max;
RESET outbox.max_batch_size;

-- ---------------------------------------------------------------------------
-- Worker names: 1..255 bytes, no control characters.
-- ---------------------------------------------------------------------------
SELECT label, pg_temp.try(format('SELECT count(*) FROM outbox.claim(%s)', arg)) AS result
  FROM (VALUES (1, 'NULL', 'NULL'), (2, 'empty', quote_literal('')), (3, '255 chars', quote_literal(repeat('w', 255))),
               (4, '256 chars', quote_literal(repeat('w', 256))), (5, 'newline', quote_literal(E'a\nb')),
               (6, 'tab', quote_literal(E'a\tb')), (7, 'unicode', quote_literal('wörker-🚀')),
               (8, 'spaces', quote_literal('host 1 / pid 2'))) AS v(n, label, arg)
 ORDER BY n;

-- ---------------------------------------------------------------------------
-- Lease bounds: > 0 and <= outbox.max_lease (12h); NULL = topic default, then GUC.
-- ---------------------------------------------------------------------------
SELECT l AS lease, pg_temp.try(format('SELECT count(*) FROM outbox.claim(%L, 1, %L::interval)', 'w', l)) AS result
  FROM unnest(ARRAY['0', '-1 second', '-1 microsecond', '1 microsecond', '12 hours', '12 hours 1 microsecond',
                    '1 day', '1 month', '-1 month', '1000000 years', '1 day -24 hours', '1 day -23 hours'])
       WITH ORDINALITY AS u(l, n)
 ORDER BY n;
-- (each claim's event is acked in its statement: the next claim is then never
-- behind a batch still out)
SELECT outbox.publish('t.lease', '1') IS NOT NULL AS published;
SELECT lease_expires_at > clock_timestamp() + interval '9 minutes' AND lease_expires_at <= clock_timestamp() + interval '10 minutes' AS ten_minutes
  FROM outbox.claim('w', 1, interval '10 minutes') c WHERE outbox.ack(c.id, c.lease_token);
-- outbox.default_lease applies when neither the call nor the topic sets one
SET outbox.default_lease = '2min';
SELECT outbox.publish('t.lease', '2') IS NOT NULL AS published;
SELECT lease_expires_at > clock_timestamp() + interval '1 minute' AND lease_expires_at <= clock_timestamp() + interval '2 minutes' AS guc_2min
  FROM outbox.claim('w', 1) c WHERE outbox.ack(c.id, c.lease_token);
RESET outbox.default_lease;
-- a topic's default_lease beats the GUC, an explicit lease beats both
SELECT outbox.create_topic('t.toplease', default_lease => '1 hour');
SELECT count(*) FROM outbox.publish_batch('t.toplease', ARRAY['3', '4']::jsonb[]);
SELECT lease_expires_at > clock_timestamp() + interval '59 minutes' AND lease_expires_at <= clock_timestamp() + interval '1 hour' AS topic_1h
  FROM outbox.claim('w', 1, topics => ARRAY['t.toplease']) c WHERE outbox.ack(c.id, c.lease_token);
SELECT lease_expires_at <= clock_timestamp() + interval '5 seconds' AS explicit_5s
  FROM outbox.claim('w', 1, interval '5 seconds', ARRAY['t.toplease']) c WHERE outbox.ack(c.id, c.lease_token);
-- max_lease can be lowered (superuser setting)
SET outbox.max_lease = '1min';
SELECT pg_temp.try($$SELECT count(*) FROM outbox.claim('w', 1, interval '61 seconds')$$) AS over_custom_max_lease;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.claim('w', 1, interval '60 seconds')$$) AS at_custom_max_lease;
RESET outbox.max_lease;
CALL pg_temp.reset();

-- ---------------------------------------------------------------------------
-- Topic filters: exact names, 'prefix.*', '*'.
-- ---------------------------------------------------------------------------
CREATE TEMP TABLE topics_ref(topic text);
INSERT INTO topics_ref VALUES ('mail'), ('mail.sent'), ('mail.sent.bounce'), ('mailbox.x'), ('sms.sent'), ('other');
-- One case per filter, each on events published (and committed: a claim
-- never sees its own transaction's events) by the procedure beforehand.
CREATE TEMP TABLE topic_cases(n int, f text[], claimed text);
INSERT INTO topic_cases (n, f)
SELECT n, f::text[] FROM unnest(ARRAY[NULL, '{mail}', '{mail.sent}', '{mail.*}', '{mail.sent.*}', '{*}', '{mail,sms.*}',
                    '{nothing}', '{nothing.*}', '{mail,mail,mail.*}', '{mail.*,*}', '{*,mail}']) WITH ORDINALITY AS u(f, n);
CREATE PROCEDURE pg_temp.claim_topics() LANGUAGE plpgsql AS $$
DECLARE c record;
BEGIN
    FOR c IN SELECT n, f FROM topic_cases ORDER BY n LOOP
        CALL pg_temp.reset();
        PERFORM outbox.publish(topic, '{}') FROM topics_ref;
        COMMIT;
        UPDATE topic_cases SET claimed = coalesce(
            (SELECT string_agg(topic, ',' ORDER BY topic) FROM outbox.claim('w', 100, NULL, c.f)), '(none)')
         WHERE n = c.n;
        COMMIT;
    END LOOP;
END $$;
CALL pg_temp.claim_topics();
SELECT coalesce(f::text, 'NULL') AS filter, claimed FROM topic_cases ORDER BY n;
SELECT f AS filter, pg_temp.try(format('SELECT count(*) FROM outbox.claim(%L, 10, NULL, %L::text[])', 'w', f)) AS result
  FROM unnest(ARRAY['{}', '{NULL}', '{mail,NULL}', '{""}', '{Mail}', '{mail*}', '{.*}', '{*.mail}', '{mail.**}',
                    '{"mail. *"}', '{**}', '{Bad,*}', '{*,Bad}', '{*,NULL}']) WITH ORDINALITY AS u(f, n)
 ORDER BY n;
CALL pg_temp.reset();

-- ---------------------------------------------------------------------------
-- Claim order (README, "Claim order"): a lane hands out its events in commit order.
-- ---------------------------------------------------------------------------
SELECT count(*) FROM outbox.publish_batch('t.order', ARRAY['"a"', '"b"', '"c"']::jsonb[]);
SELECT payload FROM outbox.claim('w', 1);
SELECT payload FROM outbox.claim('w', 1);
CALL pg_temp.reset();

-- ---------------------------------------------------------------------------
-- Attempt counting and retries.
-- ---------------------------------------------------------------------------
SELECT outbox.publish('t.retry', '"r"') IS NOT NULL AS published;
CREATE TEMP TABLE r1 AS SELECT * FROM outbox.claim('w1');
SELECT attempt FROM r1;
SELECT outbox.fail(id, lease_token, 'first failure', retry_in => '0') FROM r1;
CREATE TEMP TABLE r2 AS SELECT * FROM outbox.claim('w2');
SELECT attempt, lease_token <> (SELECT lease_token FROM r1) AS new_token FROM r2;
SELECT state, attempts, last_error, jsonb_array_length(errors) AS n_errors,
       errors -> 0 ->> 'attempt' AS e_attempt, errors -> 0 ->> 'worker' AS e_worker, errors -> 0 ->> 'error' AS e_error,
       (errors -> 0 ->> 'at')::timestamptz <= clock_timestamp() AS e_at_valid
  FROM outbox.events;
SELECT outbox.ack(id, lease_token) AS ack_new FROM r2;
CALL pg_temp.reset();

-- ---------------------------------------------------------------------------
-- Lease expiry: reclaimable with a new token; counts as an attempt and records
-- 'lease expired'. The old holder is fenced off.
-- ---------------------------------------------------------------------------
SELECT outbox.publish('t.expire', '"e"') IS NOT NULL AS published;
CREATE TEMP TABLE x1 AS SELECT * FROM outbox.claim('slow-worker', 1, interval '10 milliseconds');
SELECT attempt FROM x1;
SELECT pg_sleep(0.05);
SELECT state, lease_expires_at < clock_timestamp() AS expired FROM outbox.events;
CREATE TEMP TABLE x2 AS SELECT * FROM outbox.claim('fast-worker', 1, interval '1 hour');
SELECT attempt, lease_token <> (SELECT lease_token FROM x1) AS new_token FROM x2;
SELECT state, attempts, leased_by, last_error, errors -> 0 ->> 'attempt' AS e_attempt,
       errors -> 0 ->> 'worker' AS e_worker, errors -> 0 ->> 'error' AS e_error
  FROM outbox.events;
-- the first worker's token no longer works
SELECT outbox.ack(id, lease_token) AS old_ack FROM x1;
SELECT outbox.fail(id, lease_token, 'late') AS old_fail FROM x1;
SELECT outbox.extend_lease(id, lease_token, '1 minute') IS NULL AS old_extend_refused FROM x1;
SELECT outbox.ack(ARRAY[id], ARRAY[lease_token]) AS old_batch_ack FROM x1;
SELECT state, attempts, leased_by FROM outbox.events;
SELECT outbox.ack(id, lease_token) AS new_ack FROM x2;
SELECT state, attempts FROM outbox.events;
CALL pg_temp.reset();

-- An expired lease at max attempts goes dead with 'lease expired' and is not returned.
SELECT outbox.create_topic('t.once', max_attempts => 2);
SELECT outbox.publish('t.once', '"m"') IS NOT NULL AS published;
SELECT attempt FROM outbox.claim('w-a', 1, interval '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT attempt FROM outbox.claim('w-b', 1, interval '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT count(*) AS claimed_at_max FROM outbox.claim('w-c', 1);
SELECT state, attempts, max_attempts, last_error, dead_at IS NOT NULL AS has_dead_at, leased_by,
       jsonb_path_query_array(errors, '$[*].error') AS error_list,
       jsonb_path_query_array(errors, '$[*].worker') AS worker_list,
       jsonb_path_query_array(errors, '$[*].attempt') AS attempt_list
  FROM outbox.events;
SELECT count(*) AS claimed_dead FROM outbox.claim('w-d', 1);
CALL pg_temp.reset();

-- max_attempts = 1: an expired first lease is dead at once.
SELECT outbox.alter_topic('t.once', max_attempts => 1);
SELECT outbox.publish('t.once', '"one"') IS NOT NULL AS published;
SELECT attempt FROM outbox.claim('w-a', 1, interval '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT count(*) AS reclaimed FROM outbox.claim('w-b', 1);
SELECT state, attempts, last_error FROM outbox.events;
CALL pg_temp.reset();

-- ---------------------------------------------------------------------------
-- Per-subject order: only the head of a subject is claimable; anything earlier
-- and still pending, leased or retry-scheduled holds the rest back.
-- ---------------------------------------------------------------------------
SELECT count(*) FROM outbox.publish_batch('t.subj', ARRAY['"a1"', '"b1"', '"a2"', '"free"', '"a3"', '"b2"']::jsonb[],
                                          ARRAY['a', 'b', 'a', NULL, 'a', 'b']);
CREATE TEMP TABLE s1 AS SELECT * FROM outbox.claim('w', 100);
SELECT payload FROM s1 ORDER BY id;
-- while the heads are leased nothing else of a or b is claimable
SELECT count(*) AS while_leased FROM outbox.claim('w', 100);
-- a's head fails with a retry: a2 still waits behind it
SELECT outbox.fail(id, lease_token, 'retry later', retry_in => '1 hour') FROM s1 WHERE payload = '"a1"';
SELECT count(*) AS while_retry_scheduled FROM outbox.claim('w', 100);
-- b's head is acked: b2 is next
SELECT outbox.ack(id, lease_token) FROM s1 WHERE payload = '"b1"';
SELECT payload FROM outbox.claim('w', 100) ORDER BY id;
-- a1 becomes due: it (not a2) is claimed
CALL pg_temp.make_due($$payload = '"a1"'$$);
CREATE TEMP TABLE s2 AS SELECT * FROM outbox.claim('w', 100);
SELECT payload, attempt FROM s2 ORDER BY id;
SELECT outbox.ack(id, lease_token) FROM s2;
SELECT payload FROM outbox.claim('w', 100) ORDER BY id;
-- a later event of a subject never overtakes, even when it is the oldest-visible
CALL pg_temp.reset();
SELECT outbox.publish('t.subj', '"x1"', subject => 'x', deliver_at => now() + interval '1 hour') IS NOT NULL AS x1;
SELECT outbox.publish('t.subj', '"x2"', subject => 'x') IS NOT NULL AS x2;
SELECT count(*) AS behind_delayed_head FROM outbox.claim('w', 100);
-- subjects are per subject, not per topic: one subject spans topics
SELECT outbox.publish('t.other', '"x3 other topic"', subject => 'x') IS NOT NULL AS x3;
SELECT count(*) AS other_topic_waits_too FROM outbox.claim('w', 100, topics => ARRAY['t.other']);
CALL pg_temp.make_due($$payload = '"x1"'$$);
SELECT payload FROM outbox.claim('w', 100) ORDER BY id;

-- ---------------------------------------------------------------------------
-- Isolation: a claim runs at READ COMMITTED or REPEATABLE READ; at SERIALIZABLE
-- it is refused (0A000) before it reads or changes anything, in a transaction
-- block or under default_transaction_isolation.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset();
SELECT outbox.publish('t.iso', '"iso"') IS NOT NULL AS published;
\set VERBOSITY default
BEGIN ISOLATION LEVEL SERIALIZABLE;
SELECT count(*) FROM outbox.claim('w', 100);
ROLLBACK;
SET default_transaction_isolation = 'serializable';
SELECT count(*) FROM outbox.claim('w', 100);
RESET default_transaction_isolation;
\set VERBOSITY terse
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT payload FROM outbox.claim('w', 100);
COMMIT;
