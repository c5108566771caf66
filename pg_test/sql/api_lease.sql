-- ack (single and batch), fail, extend_lease and backoff_delay: every transition
-- of a leased event and every fencing refusal.
\i sql/prologue.inc

-- Fresh set of claimed events: publishes n events of topic t, commits them
-- (a claim of the log sees committed events only) and claims them one claim
-- each (each event has a lease token of its own either way).
CREATE PROCEDURE pg_temp.fresh(n int, t text DEFAULT 'lease') LANGUAGE plpgsql AS $$
BEGIN
    CALL pg_temp.reset(restart => true);
    DROP TABLE IF EXISTS cl;
    PERFORM outbox.publish_batch(t, (SELECT array_agg(to_jsonb(g)) FROM generate_series(1, n) g));
    COMMIT;
    CREATE TEMP TABLE cl AS SELECT * FROM outbox.claim('w', 1, interval '10 minutes');
    FOR i IN 2..n LOOP
        INSERT INTO cl SELECT * FROM outbox.claim('w', 1, interval '10 minutes');
    END LOOP;
END $$;

-- ---------------------------------------------------------------------------
-- ack(id, token)
-- ---------------------------------------------------------------------------
CALL pg_temp.fresh(3);
SELECT outbox.ack(id, lease_token) AS ack FROM cl WHERE id = 1;
SELECT id, state, attempts, leased_by, delivered_at IS NOT NULL AS has_delivered_at,
       lease_expires_at IS NULL AS no_lease
  FROM outbox.events WHERE id = 1;
SELECT outbox.ack(id, lease_token) AS ack_twice FROM cl WHERE id = 1;
SELECT outbox.ack(2, (SELECT lease_token FROM cl WHERE id = 3)) AS other_events_token;
SELECT outbox.ack(2, gen_random_uuid()) AS random_token;
SELECT outbox.ack(999, (SELECT lease_token FROM cl WHERE id = 2)) AS unknown_id;
SELECT outbox.ack(NULL, (SELECT lease_token FROM cl WHERE id = 2)) AS null_id;
SELECT outbox.ack(2, NULL) AS null_token;
SELECT outbox.ack(NULL::bigint, NULL::uuid) AS both_null;
SELECT id, state FROM outbox.events ORDER BY id;
-- a pending event has no token: nothing acks it
SELECT outbox.publish('lease', '"pending"') AS pending_id;
SELECT outbox.ack(4, gen_random_uuid()) AS ack_pending;
-- a failed (retry-scheduled) or dead event cannot be acked with its old token
SELECT outbox.fail(id, lease_token, 'e', retry_in => '1 hour') FROM cl WHERE id = 2;
SELECT outbox.ack(id, lease_token) AS ack_after_fail FROM cl WHERE id = 2;
SELECT outbox.fail(id, lease_token, 'e', permanent => true) FROM cl WHERE id = 3;
SELECT outbox.ack(id, lease_token) AS ack_dead FROM cl WHERE id = 3;
SELECT id, state FROM outbox.events ORDER BY id;

-- ---------------------------------------------------------------------------
-- ack(ids[], tokens[])
-- ---------------------------------------------------------------------------
CALL pg_temp.fresh(6);
SELECT outbox.ack(array_agg(id ORDER BY id), array_agg(lease_token ORDER BY id)) AS acked
  FROM cl WHERE id <= 3;
-- already acked pairs, a wrong token and an unknown id count 0; current pairs count
SELECT outbox.ack(ARRAY[1, 4, 5, 999, 6],
                  ARRAY[(SELECT lease_token FROM cl WHERE id = 1), (SELECT lease_token FROM cl WHERE id = 4),
                        gen_random_uuid(), gen_random_uuid(), (SELECT lease_token FROM cl WHERE id = 6)]) AS acked;
-- the same pair twice counts once
SELECT outbox.ack(ARRAY[5, 5], ARRAY[(SELECT lease_token FROM cl WHERE id = 5), (SELECT lease_token FROM cl WHERE id = 5)]) AS dup_pair;
SELECT outbox.ack(ARRAY[]::bigint[], ARRAY[]::uuid[]) AS empty;
SELECT id, state FROM outbox.events ORDER BY id;
-- errors: nothing is applied
CALL pg_temp.fresh(2);
SELECT label, pg_temp.try_result(stmt) AS result
  FROM (VALUES
    (1, 'NULL ids', $$SELECT outbox.ack(NULL::bigint[], ARRAY[gen_random_uuid()])$$),
    (2, 'NULL tokens', $$SELECT outbox.ack(ARRAY[1::bigint], NULL::uuid[])$$),
    (3, 'shorter tokens', $$SELECT outbox.ack(ARRAY[1, 2]::bigint[], (SELECT array_agg(lease_token) FROM cl WHERE id = 1))$$),
    (4, 'longer tokens', $$SELECT outbox.ack(ARRAY[1]::bigint[], (SELECT array_agg(lease_token) FROM cl))$$),
    (5, 'NULL id element', $$SELECT outbox.ack(ARRAY[1, NULL]::bigint[], (SELECT array_agg(lease_token ORDER BY id) FROM cl))$$),
    (6, 'NULL token element', $$SELECT outbox.ack(ARRAY[1, 2]::bigint[], ARRAY[(SELECT lease_token FROM cl WHERE id = 1), NULL])$$),
    (7, 'two-dimensional', $$SELECT outbox.ack(ARRAY[[1], [2]]::bigint[], ARRAY[[gen_random_uuid()], [gen_random_uuid()]])$$),
    (8, 'empty vs one', $$SELECT outbox.ack(ARRAY[]::bigint[], ARRAY[gen_random_uuid()])$$)
  ) AS v(n, label, stmt)
 ORDER BY n;
SET outbox.max_batch_size = 1;
SELECT pg_temp.try_result($$SELECT outbox.ack((SELECT array_agg(id ORDER BY id) FROM cl), (SELECT array_agg(lease_token ORDER BY id) FROM cl))$$) AS over_max_batch;
RESET outbox.max_batch_size;
SELECT id, state FROM outbox.events ORDER BY id;

-- ---------------------------------------------------------------------------
-- fail: retry with backoff, retry_in, permanent, max attempts, stale.
-- ---------------------------------------------------------------------------
CALL pg_temp.fresh(4);
SET outbox.backoff_base = '10s';
SET outbox.backoff_max = '15s';
-- default backoff after attempt 1: base * 2^0 = 10s, equal jitter: [5s, 10s]
SELECT outbox.fail(id, lease_token, 'first') AS state FROM cl WHERE id = 1;
SELECT state, attempts, last_error, lease_expires_at IS NULL AS no_lease,
       available_at >= clock_timestamp() + interval '3 seconds' AND available_at <= clock_timestamp() + interval '10 seconds' AS in_5_to_10s,
       jsonb_array_length(errors) AS n_errors, errors -> 0 ->> 'error' AS e, errors -> 0 ->> 'attempt' AS a
  FROM outbox.events WHERE id = 1;
-- a retry-scheduled event is not claimable before its time
SELECT count(*) AS claimable_now FROM outbox.claim('w', 10);
-- second attempt: base * 2 = 20s, capped at 15s: [7.5s, 15s]
CALL pg_temp.make_due('id = 1');
CREATE TEMP TABLE again AS SELECT * FROM outbox.claim('w2', 10);
SELECT id, attempt FROM again;
SELECT outbox.fail(id, lease_token, 'second') AS state FROM again;
SELECT attempts, available_at >= clock_timestamp() + interval '5 seconds' AND available_at <= clock_timestamp() + interval '15 seconds' AS in_7_5_to_15s,
       jsonb_path_query_array(errors, '$[*].error') AS errs, jsonb_path_query_array(errors, '$[*].worker') AS workers
  FROM outbox.events WHERE id = 1;
RESET outbox.backoff_base;
RESET outbox.backoff_max;
-- a topic's backoff settings win over the GUCs
SELECT outbox.create_topic('lease.slow', backoff_base => '1 hour', backoff_max => '2 hours');
SELECT outbox.publish('lease.slow', '"slow"') AS slow_id;
CREATE TEMP TABLE slow AS SELECT * FROM outbox.claim('w', 10, topics => ARRAY['lease.slow']);
SELECT outbox.fail(id, lease_token, 'slow') FROM slow;
SELECT available_at >= clock_timestamp() + interval '29 minutes' AND available_at <= clock_timestamp() + interval '1 hour' AS in_30_to_60min
  FROM outbox.events WHERE topic = 'lease.slow';
-- explicit retry_in
SELECT outbox.fail(id, lease_token, 'later', retry_in => '5 minutes') AS state FROM cl WHERE id = 2;
SELECT available_at > clock_timestamp() + interval '4 minutes' AND available_at <= clock_timestamp() + interval '5 minutes' AS in_5min
  FROM outbox.events WHERE id = 2;
SELECT outbox.fail(id, lease_token, 'now', retry_in => '0') AS state FROM cl WHERE id = 3;
SELECT id, attempt FROM outbox.claim('w3', 10, topics => ARRAY['lease']) ORDER BY id;
-- permanent: dead at once, whatever the attempts left
SELECT outbox.fail(id, lease_token, 'poison', permanent => true) AS state FROM cl WHERE id = 4;
SELECT state, attempts, max_attempts, last_error, dead_at IS NOT NULL AS has_dead_at,
       available_at IS NULL AS no_available_at, errors -> 0 ->> 'error' AS e
  FROM outbox.events WHERE id = 4;
-- stale: the token was consumed by the fail
SELECT outbox.fail(id, lease_token, 'again') AS stale_after_fail FROM cl WHERE id = 2;
SELECT outbox.fail(id, lease_token, 'again', permanent => true) AS stale_dead FROM cl WHERE id = 4;
SELECT outbox.fail(2, gen_random_uuid(), 'x') AS random_token;
SELECT outbox.fail(999, gen_random_uuid(), 'x') AS unknown_id;
SELECT outbox.fail(NULL, gen_random_uuid(), 'x') AS null_id;
SELECT outbox.fail(2, NULL, 'x') AS null_token;
SELECT id, state, attempts FROM outbox.events ORDER BY id;

-- max attempts: the failing claim that used the last attempt goes dead.
SELECT outbox.create_topic('lease.twice', max_attempts => 2);
SELECT outbox.publish('lease.twice', '"twice"') IS NOT NULL AS published;
SELECT outbox.fail(id, lease_token, 'one', retry_in => '0') FROM outbox.claim('w', 1, topics => ARRAY['lease.twice']);
SELECT outbox.fail(id, lease_token, 'two', retry_in => '0') FROM outbox.claim('w', 1, topics => ARRAY['lease.twice']);
SELECT state, attempts, max_attempts, last_error, jsonb_path_query_array(errors, '$[*].error') AS errs
  FROM outbox.events WHERE topic = 'lease.twice';
SELECT count(*) AS claimable FROM outbox.claim('w', 1, topics => ARRAY['lease.twice']);

-- error text: NULL is stored as '(no error text)'; over 8 kB is cut at a character boundary
CALL pg_temp.fresh(3);
SELECT outbox.fail(id, lease_token, NULL, retry_in => '1 hour') FROM cl WHERE id = 1;
SELECT outbox.fail(id, lease_token, repeat('x', 10000), retry_in => '1 hour') FROM cl WHERE id = 2;
SELECT outbox.fail(id, lease_token, 'x' || repeat('é', 5000), retry_in => '1 hour') FROM cl WHERE id = 3;
SELECT id, left(last_error, 16) AS starts, octet_length(last_error) AS bytes, length(last_error) AS chars,
       errors -> 0 ->> 'error' = last_error AS history_matches
  FROM outbox.events ORDER BY id;

-- argument errors
CALL pg_temp.fresh(1);
SELECT label, pg_temp.try_result(stmt) AS result
  FROM (VALUES
    (1, 'negative retry_in', $$SELECT outbox.fail(1, (SELECT lease_token FROM cl), 'e', retry_in => '-1 second')$$),
    (2, 'retry_in 366 days', $$SELECT outbox.fail(1, (SELECT lease_token FROM cl), 'e', retry_in => '366 days')$$),
    (3, 'retry_in 13 months', $$SELECT outbox.fail(1, (SELECT lease_token FROM cl), 'e', retry_in => '13 months')$$),
    (4, 'NULL permanent', $$SELECT outbox.fail(1, (SELECT lease_token FROM cl), 'e', NULL, NULL)$$),
    (5, 'NULL permanent, stale', $$SELECT outbox.fail(1, gen_random_uuid(), 'e', NULL, NULL)$$),
    (6, 'bad retry_in, stale', $$SELECT outbox.fail(1, gen_random_uuid(), 'e', retry_in => '-1 day')$$),
    (7, 'retry_in 365 days', $$SELECT outbox.fail(1, (SELECT lease_token FROM cl), 'e', retry_in => '365 days')$$)
  ) AS v(n, label, stmt)
 ORDER BY n;
SELECT state, attempts, available_at > now() + interval '364 days' AS in_365_days FROM outbox.events;

-- ---------------------------------------------------------------------------
-- extend_lease
-- ---------------------------------------------------------------------------
CALL pg_temp.fresh(2);
SELECT outbox.extend_lease(id, lease_token, '1 hour') > clock_timestamp() + interval '59 minutes' AS extended
  FROM cl WHERE id = 1;
SELECT lease_expires_at > clock_timestamp() + interval '59 minutes' AS view_shows_new_expiry FROM outbox.events WHERE id = 1;
-- shortening is allowed too
SELECT outbox.extend_lease(id, lease_token, '1 second') <= clock_timestamp() + interval '1 second' AS shortened
  FROM cl WHERE id = 1;
-- the token is unchanged: ack still works after extending
SELECT outbox.ack(id, lease_token) AS ack_after_extend FROM cl WHERE id = 1;
SELECT outbox.extend_lease(id, lease_token, '1 hour') IS NULL AS after_ack FROM cl WHERE id = 1;
SELECT outbox.extend_lease(2, gen_random_uuid(), '1 hour') IS NULL AS random_token;
SELECT outbox.extend_lease(999, gen_random_uuid(), '1 hour') IS NULL AS unknown_id;
SELECT outbox.extend_lease(NULL, gen_random_uuid(), '1 hour') IS NULL AS null_id;
SELECT outbox.extend_lease(2, NULL, '1 hour') IS NULL AS null_token;
SELECT label, pg_temp.try_result(stmt) AS result
  FROM (VALUES
    (1, 'NULL lease', $$SELECT outbox.extend_lease(2, (SELECT lease_token FROM cl WHERE id = 2), NULL)$$),
    (2, 'zero lease', $$SELECT outbox.extend_lease(2, (SELECT lease_token FROM cl WHERE id = 2), '0')$$),
    (3, 'negative lease', $$SELECT outbox.extend_lease(2, (SELECT lease_token FROM cl WHERE id = 2), '-1 minute')$$),
    (4, 'over max_lease', $$SELECT outbox.extend_lease(2, (SELECT lease_token FROM cl WHERE id = 2), '13 hours')$$),
    (5, 'NULL lease, stale', $$SELECT outbox.extend_lease(2, gen_random_uuid(), NULL)$$)
  ) AS v(n, label, stmt)
 ORDER BY n;
-- an expired lease that nobody reclaimed yet can still be extended (its token is current)
SELECT outbox.extend_lease(id, lease_token, '10 milliseconds') IS NOT NULL AS short FROM cl WHERE id = 2;
SELECT pg_sleep(0.05);
SELECT outbox.extend_lease(id, lease_token, '1 hour') IS NOT NULL AS revived FROM cl WHERE id = 2;
SELECT count(*) AS reclaimable FROM outbox.claim('w9', 10);
SELECT outbox.ack(id, lease_token) AS ack_revived FROM cl WHERE id = 2;

-- ---------------------------------------------------------------------------
-- backoff_delay
-- ---------------------------------------------------------------------------
SELECT a AS attempt, outbox.backoff_delay(a, '1 second', '1 hour', false) AS delay
  FROM unnest(ARRAY[1, 2, 3, 4, 10, 12, 13, 30, 63, 64, 1000, 2147483647]) AS a ORDER BY a;
-- the GUCs are the defaults (1s base, 30min cap)
SELECT outbox.backoff_delay(1, jitter => false) AS d1, outbox.backoff_delay(20, jitter => false) AS d20;
SET outbox.backoff_base = '250ms';
SELECT outbox.backoff_delay(3, jitter => false) AS d3_guc_base;
RESET outbox.backoff_base;
-- jitter stays in [d/2, d]
SELECT bool_and(d BETWEEN interval '4 seconds' AND interval '8 seconds') AS jitter_in_range,
       count(DISTINCT d) > 1 AS jitter_varies
  FROM (SELECT outbox.backoff_delay(4, '1 second', '1 hour') AS d FROM generate_series(1, 200)) s;
SELECT bool_and(outbox.backoff_delay(a, '1 microsecond', '1 microsecond') = interval '1 microsecond') AS never_zero
  FROM generate_series(1, 100) a;
SELECT label, pg_temp.try_result(stmt) AS result
  FROM (VALUES
    (1, 'NULL attempt', $$SELECT outbox.backoff_delay(NULL)$$),
    (2, 'attempt 0', $$SELECT outbox.backoff_delay(0)$$),
    (3, 'attempt -1', $$SELECT outbox.backoff_delay(-1)$$),
    (4, 'zero base', $$SELECT outbox.backoff_delay(1, '0')$$),
    (5, 'negative base', $$SELECT outbox.backoff_delay(1, '-1 second')$$),
    (6, 'base 366 days', $$SELECT outbox.backoff_delay(1, '366 days')$$),
    (7, 'zero max', $$SELECT outbox.backoff_delay(1, '1 second', '0')$$),
    (8, 'max 366 days', $$SELECT outbox.backoff_delay(1, '1 second', '366 days')$$),
    (9, 'max 365 days', $$SELECT outbox.backoff_delay(100, '1 second', '365 days', false)$$),
    (10, 'NULL jitter = jitter', $$SELECT outbox.backoff_delay(1, '1 second', '1 second', NULL) BETWEEN '0.5 s' AND '1 s'$$)
  ) AS v(n, label, stmt)
 ORDER BY n;
