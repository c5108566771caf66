-- publish / publish_batch: validation, limits, headers, deliver_at, traceparent,
-- dispatch-key dedupe, strict topics, and the extension's dump registration.
\i sql/prologue.inc

-- ---------------------------------------------------------------------------
-- pg_dump registration: every table and the id sequence are config tables.
-- ---------------------------------------------------------------------------
SELECT c.relname, c.relkind
  FROM pg_extension e, unnest(e.extconfig) AS x(oid) JOIN pg_class c ON c.oid = x.oid
 WHERE e.extname = 'outbox_ext'
 ORDER BY 1;
SELECT cardinality(extconfig) = cardinality(extcondition) AS conditions_match
  FROM pg_extension WHERE extname = 'outbox_ext';

-- ---------------------------------------------------------------------------
-- Basic publish: ids ascend, the event is pending and claimable at once.
-- ---------------------------------------------------------------------------
SELECT outbox.publish('orders.created', '{"n": 1}') AS id1;
SELECT outbox.publish('orders.created', '{"n": 2}', subject => 'order-1') AS id2;
SELECT id, topic, subject, dispatch_key, payload, headers, state, attempts, max_attempts,
       available_at <= now() AS ready, lease_expires_at IS NULL AS no_lease,
       leased_by, last_error, errors, delivered_at, dead_at, cancelled_at
  FROM outbox.events ORDER BY id;

-- ---------------------------------------------------------------------------
-- Topic validation (22004 NULL, 22023 malformed).
-- ---------------------------------------------------------------------------
SELECT CASE WHEN length(t) > 20 THEN left(t, 3) || '...(' || length(t) || ' chars)' ELSE t END AS topic,
       pg_temp.try(format('SELECT outbox.publish(%L, %L)', t, '{}')) AS result
  FROM unnest(ARRAY[
    'a', 'billing.invoice.paid', 'a-b_c.0', 'x.y.z.w', repeat('a', 255),
    '', 'A', 'Orders', 'a b', ' a', 'a.', '.a', 'a..b', 'a.*', '*', 'é', 'a/b', 'a:b',
    repeat('a', 256)]) WITH ORDINALITY AS u(t, n)
 ORDER BY n;
SELECT pg_temp.try($$SELECT outbox.publish(NULL, '{}')$$) AS null_topic;
SELECT pg_temp.try($$SELECT outbox.publish('a', NULL)$$) AS null_payload;

-- Any JSON value is a payload, scalars included.
SELECT pg_temp.try(format('SELECT outbox.publish(%L, %L)', 'scalars', p)) AS result
  FROM unnest(ARRAY['1', '"s"', 'true', 'null', '[]', '{}']) WITH ORDINALITY AS u(p, n)
 ORDER BY n;
SELECT payload, jsonb_typeof(payload) FROM outbox.events WHERE topic = 'scalars' ORDER BY id;

-- Subject and dispatch key: 1..1024 bytes.
SELECT pg_temp.try($$SELECT outbox.publish('a', '{}', subject => '')$$) AS empty_subject;
SELECT pg_temp.try($$SELECT outbox.publish('a', '{}', subject => repeat('s', 1025))$$) AS long_subject;
SELECT pg_temp.try($$SELECT outbox.publish('a', '{}', subject => repeat('s', 1024))$$) = 'ok' AS max_subject_ok;
SELECT pg_temp.try($$SELECT outbox.publish('a', '{}', dispatch_key => '')$$) AS empty_key;
SELECT pg_temp.try($$SELECT outbox.publish('a', '{}', dispatch_key => repeat('k', 1025))$$) AS long_key;
SELECT pg_temp.try($$SELECT outbox.publish('a', '{}', dispatch_key => repeat('k', 1024))$$) = 'ok' AS max_key_ok;

-- ---------------------------------------------------------------------------
-- Payload limit: outbox.max_payload_bytes counts the jsonb value's bytes.
-- A jsonb string of n ASCII characters takes n + 8 bytes.
-- ---------------------------------------------------------------------------
SET outbox.max_payload_bytes = 100;
SELECT pg_column_size(to_jsonb(repeat('x', 92))) - 4 AS bytes_of_92_chars;
SELECT pg_temp.try($$SELECT outbox.publish('limits', to_jsonb(repeat('x', 92)))$$) = 'ok' AS at_limit_ok;
SELECT pg_temp.try($$SELECT outbox.publish('limits', to_jsonb(repeat('x', 93)))$$) AS over_limit;
-- headers count against the same limit
SELECT pg_temp.try($$SELECT outbox.publish('limits', '1', headers => jsonb_build_object('h', repeat('x', 200)))$$) AS big_headers;
RESET outbox.max_payload_bytes;
SELECT pg_temp.try($$SELECT outbox.publish('limits', to_jsonb(repeat('x', 2000000)))$$) AS over_default_limit;
SELECT count(*) AS limit_events FROM outbox.events WHERE topic = 'limits';

-- ---------------------------------------------------------------------------
-- Headers: a JSON object of string values.
-- ---------------------------------------------------------------------------
SELECT h AS headers, pg_temp.try(format('SELECT outbox.publish(%L, %L, headers => %L)', 'hdr', '{}', h)) AS result
  FROM unnest(ARRAY['{}', '{"a": "1", "b": ""}', '[]', '"s"', '1', 'null', '{"a": 1}',
                    '{"a": null}', '{"a": {"b": "c"}}', '{"a": ["x"]}', '{"a": true}']) WITH ORDINALITY AS u(h, n)
 ORDER BY n;
SELECT headers FROM outbox.events WHERE topic = 'hdr' ORDER BY id;

-- ---------------------------------------------------------------------------
-- traceparent GUC: copied in when the caller's headers have none.
-- ---------------------------------------------------------------------------
SET outbox.traceparent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01';
SELECT outbox.publish('trace', '1') IS NOT NULL AS no_headers;
SELECT outbox.publish('trace', '2', headers => '{"k": "v"}') IS NOT NULL AS other_headers;
SELECT outbox.publish('trace', '3', headers => '{"traceparent": "00-mine-01"}') IS NOT NULL AS own_traceparent;
SET outbox.traceparent = '';
SELECT outbox.publish('trace', '4') IS NOT NULL AS empty_guc;
RESET outbox.traceparent;
SELECT outbox.publish('trace', '5') IS NOT NULL AS unset_guc;
SELECT payload, headers FROM outbox.events WHERE topic = 'trace' ORDER BY id;

-- ---------------------------------------------------------------------------
-- deliver_at: a future time delays claimability; past or -infinity means now;
-- infinity is refused.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset();
SELECT outbox.publish('delay', '"future"', deliver_at => now() + interval '1 hour') IS NOT NULL AS future;
SELECT outbox.publish('delay', '"past"', deliver_at => now() - interval '1 hour') IS NOT NULL AS past;
SELECT outbox.publish('delay', '"-inf"', deliver_at => '-infinity') IS NOT NULL AS minus_infinity;
SELECT pg_temp.try($$SELECT outbox.publish('delay', '"inf"', deliver_at => 'infinity')$$) AS infinity;
SELECT payload, available_at > now() + interval '59 minutes' AS delayed,
       available_at <= now() AS ready
  FROM outbox.events ORDER BY id;
SELECT payload, attempt FROM outbox.claim('w', 10) ORDER BY id;
-- the delayed event is still pending, untouched
SELECT payload, state, attempts FROM outbox.events WHERE state = 'pending' ORDER BY id;
-- once its time has come it is claimable
CALL pg_temp.make_due($$payload = '"future"'$$);
SELECT payload, attempt FROM outbox.claim('w', 10) ORDER BY id;

-- ---------------------------------------------------------------------------
-- strict_topics: unregistered topics are refused with P0002.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset();
SET outbox.strict_topics = on;
SELECT pg_temp.try($$SELECT outbox.publish('strict.unknown', '1')$$) AS unknown_topic;
SELECT pg_temp.try($$SELECT * FROM outbox.publish_batch('strict.unknown', ARRAY['1']::jsonb[])$$) AS unknown_topic_batch;
SELECT outbox.create_topic('strict.known');
SELECT pg_temp.try($$SELECT outbox.publish('strict.known', '1')$$) = 'ok' AS known_topic_ok;
SELECT pg_temp.try($$SELECT * FROM outbox.publish_batch('strict.known', ARRAY['1']::jsonb[])$$) = 'ok' AS known_topic_batch_ok;
-- invalid names are still 22023, not P0002
SELECT pg_temp.try($$SELECT outbox.publish('Strict', '1')$$) AS invalid_strict;
RESET outbox.strict_topics;
SELECT pg_temp.try($$SELECT outbox.publish('strict.unknown', '1')$$) = 'ok' AS lax_again_ok;
SELECT topic, count(*) FROM outbox.events GROUP BY 1 ORDER BY 1;

-- ---------------------------------------------------------------------------
-- Topic policy: max_attempts of a registered topic is stamped at publish time.
-- ---------------------------------------------------------------------------
SELECT outbox.create_topic('policy.three', max_attempts => 3);
SET outbox.max_attempts = 4;
SELECT outbox.publish('policy.three', '1') IS NOT NULL AS p1;
SELECT outbox.publish('policy.gucdefault', '1') IS NOT NULL AS p2;
RESET outbox.max_attempts;
SELECT outbox.publish('policy.gucdefault', '2') IS NOT NULL AS p3;
SELECT topic, payload, max_attempts FROM outbox.events WHERE topic LIKE 'policy.%' ORDER BY id;

-- ---------------------------------------------------------------------------
-- Dispatch keys: a retained key returns the first id and inserts nothing,
-- whatever state the first event is in.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset(restart => true);
-- (delayed, so that the claim below leaves it pending)
SELECT outbox.publish('dk', '"first"', dispatch_key => 'k-pending', deliver_at => now() + interval '1 hour') AS first_id;
SELECT outbox.publish('dk', '"second"', dispatch_key => 'k-pending') AS dup_pending;
-- the duplicate may differ in topic, payload, subject: still the first id
SELECT outbox.publish('dk.other', '"third"', subject => 's', dispatch_key => 'k-pending') AS dup_other_topic;
SELECT count(*) AS events, (SELECT count(*) FROM outbox.dispatch_keys) AS keys FROM outbox.events;
-- one key per state
SELECT outbox.publish('dk', '"leased"', dispatch_key => 'k-leased') IS NOT NULL AS leased_id;
SELECT outbox.publish('dk', '"delivered"', dispatch_key => 'k-delivered') IS NOT NULL AS delivered_id;
SELECT outbox.publish('dk', '"dead"', dispatch_key => 'k-dead') IS NOT NULL AS dead_id;
SELECT outbox.publish('dk', '"cancelled"', dispatch_key => 'k-cancelled') IS NOT NULL AS cancelled_id;
SELECT outbox.publish('dk', '"replayed"', dispatch_key => 'k-replayed') IS NOT NULL AS replayed_id;
CREATE TEMP TABLE tok AS
    SELECT c.id, c.dispatch_key AS k, c.lease_token FROM outbox.claim('w', 10, topics => ARRAY['dk']) c;
SELECT outbox.ack(id, lease_token) FROM tok WHERE k = 'k-delivered';
SELECT outbox.fail(id, lease_token, 'boom', permanent => true) FROM tok WHERE k = 'k-dead';
SELECT outbox.fail(id, lease_token, 'retry', retry_in => '1 hour') FROM tok WHERE k = 'k-cancelled';
SELECT outbox.cancel(id) FROM tok WHERE k = 'k-cancelled';
SELECT outbox.fail(id, lease_token, 'boom', permanent => true) FROM tok WHERE k = 'k-replayed';
SELECT outbox.replay(id) FROM tok WHERE k = 'k-replayed';
SELECT e.dispatch_key, e.state, outbox.publish('dk', '"again"', dispatch_key => e.dispatch_key) = e.id AS same_id
  FROM outbox.events e WHERE e.dispatch_key IS NOT NULL ORDER BY e.id;
SELECT count(*) AS events, (SELECT count(*) FROM outbox.dispatch_keys) AS keys FROM outbox.events;
-- a cancelled event replayed keeps its key too
SELECT outbox.replay(id) AS replay_cancelled FROM tok WHERE k = 'k-cancelled';
SELECT outbox.publish('dk', '"again"', dispatch_key => 'k-cancelled') = id AS dup_after_replay
  FROM tok WHERE k = 'k-cancelled';
-- keys are compared exactly
SELECT outbox.publish('dk', '"case"', dispatch_key => 'K-PENDING') <> 1 AS case_sensitive;
SELECT outbox.publish('dk', '"space"', dispatch_key => 'k-pending ') <> 1 AS trailing_space_differs;
-- the key table maps each key to its event
SELECT quote_literal(k.dispatch_key) AS key, k.event_id = e.id AS maps_to_event
  FROM outbox.dispatch_keys k LEFT JOIN outbox.events e ON e.dispatch_key = k.dispatch_key
 ORDER BY 1;

-- A key published and rolled back is free again.
BEGIN;
SELECT outbox.publish('dk', '"rolled back"', dispatch_key => 'k-rollback') IS NOT NULL AS published;
ROLLBACK;
SELECT count(*) AS rolled_back_keys FROM outbox.dispatch_keys WHERE dispatch_key = 'k-rollback';
SELECT outbox.publish('dk', '"after rollback"', dispatch_key => 'k-rollback') IS NOT NULL AS published_again;
SELECT payload FROM outbox.events WHERE dispatch_key = 'k-rollback';

-- Savepoints: a publish rolled back to a savepoint disappears, the rest stays.
BEGIN;
SELECT outbox.publish('sp', '"kept"') IS NOT NULL AS kept;
SAVEPOINT s;
SELECT outbox.publish('sp', '"dropped"', dispatch_key => 'k-sp') IS NOT NULL AS dropped;
ROLLBACK TO SAVEPOINT s;
SELECT outbox.publish('sp', '"kept too"', dispatch_key => 'k-sp') IS NOT NULL AS kept_too;
COMMIT;
SELECT payload, dispatch_key FROM outbox.events WHERE topic = 'sp' ORDER BY id;

-- ---------------------------------------------------------------------------
-- publish_batch
-- ---------------------------------------------------------------------------
CALL pg_temp.reset(restart => true);
-- ids come back in input order and ascend
SELECT array_agg(id ORDER BY ord) AS ids
  FROM outbox.publish_batch('batch', ARRAY['"a"', '"b"', '"c"']::jsonb[]) WITH ORDINALITY AS r(id, ord);
SELECT id, payload, subject, dispatch_key FROM outbox.events ORDER BY id;
-- subjects: per-subject order follows input order
SELECT array_agg(id ORDER BY ord) AS ids
  FROM outbox.publish_batch('batch.s', ARRAY['"s1-a"', '"s2-a"', '"s1-b"', '"none"', '"s2-b"']::jsonb[],
                            subjects => ARRAY['s1', 's2', 's1', NULL, 's2']) WITH ORDINALITY AS r(id, ord);
SELECT id, payload, subject FROM outbox.events WHERE topic = 'batch.s' ORDER BY id;
CREATE TEMP TABLE bt AS SELECT * FROM outbox.claim('w', 100, topics => ARRAY['batch.s']);
SELECT payload, subject FROM bt ORDER BY id;   -- heads of s1 and s2, and the subject-less event
SELECT count(*) FILTER (WHERE outbox.ack(id, lease_token)) AS acked FROM bt;
SELECT payload, subject FROM outbox.claim('w', 100, topics => ARRAY['batch.s']) ORDER BY id;
-- dispatch keys: dedupe within the batch and against retained keys
-- (ids shown as their rank among the ids returned: equal rank = same event)
CREATE TEMP TABLE bk AS
SELECT id, ord
  FROM outbox.publish_batch('batch.k', ARRAY['"k1"', '"k2"', '"k1 again"', '"nokey"', '"k2 again"']::jsonb[],
                            dispatch_keys => ARRAY['k1', 'k2', 'k1', NULL, 'k2']) WITH ORDINALITY AS r(id, ord);
INSERT INTO bk
SELECT id, ord + 5
  FROM outbox.publish_batch('batch.k', ARRAY['"k2 later"', '"k3"']::jsonb[],
                            dispatch_keys => ARRAY['k2', 'k3']) WITH ORDINALITY AS r(id, ord);
SELECT ord, dense_rank() OVER (ORDER BY id) AS id_rank, e.payload AS stored_payload
  FROM bk JOIN outbox.events e USING (id) ORDER BY ord;
SELECT payload, dispatch_key FROM outbox.events WHERE topic = 'batch.k' ORDER BY id;
-- subjects and keys together
SELECT array_agg(id ORDER BY ord) = array_agg(id ORDER BY id) AS ascending
  FROM outbox.publish_batch('batch.sk', ARRAY['1', '2']::jsonb[], ARRAY['s', 's'], ARRAY['x', NULL])
       WITH ORDINALITY AS r(id, ord);
SELECT payload, subject, dispatch_key FROM outbox.events WHERE topic = 'batch.sk' ORDER BY id;
-- traceparent applies to every event of a batch, with or without keys
SET outbox.traceparent = '00-batch-01';
SELECT count(*) FROM outbox.publish_batch('batch.t', ARRAY['1', '2']::jsonb[]);
SELECT count(*) FROM outbox.publish_batch('batch.t', ARRAY['3', '4']::jsonb[], dispatch_keys => ARRAY['t1', NULL]);
RESET outbox.traceparent;
SELECT payload, headers FROM outbox.events WHERE topic = 'batch.t' ORDER BY id;
-- batch errors; nothing is inserted
SELECT count(*) AS before_errors FROM outbox.events;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch(NULL, ARRAY['1']::jsonb[])$$) AS null_topic;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('Bad', ARRAY['1']::jsonb[])$$) AS bad_topic;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', NULL)$$) AS null_payloads;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY[]::jsonb[])$$) AS empty_payloads;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY['1', NULL]::jsonb[])$$) AS null_element;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY['1', '2']::jsonb[], ARRAY['s'])$$) AS short_subjects;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY['1']::jsonb[], NULL, ARRAY['k', 'l'])$$) AS long_keys;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY[['1'], ['2']]::jsonb[])$$) AS two_dim;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY['1', '2']::jsonb[], ARRAY['s', ''])$$) AS empty_subject;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY['1']::jsonb[], NULL, ARRAY[repeat('k', 1025)])$$) AS long_key;
SET outbox.max_payload_bytes = 100;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY['1', to_jsonb(repeat('x', 93))])$$) AS big_element;
RESET outbox.max_payload_bytes;
SET outbox.max_batch_size = 3;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY['1', '2', '3', '4']::jsonb[])$$) AS over_max_batch;
SELECT pg_temp.try($$SELECT count(*) FROM outbox.publish_batch('b', ARRAY['1', '2', '3']::jsonb[])$$) AS at_max_batch;
RESET outbox.max_batch_size;
SELECT count(*) AS after_errors FROM outbox.events WHERE topic <> 'b';
