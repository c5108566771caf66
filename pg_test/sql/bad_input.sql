-- The bad-input matrix: every public function called with hostile
-- input. Each case is a call and the expected outcome: a SQLSTATE, 'ok' (any
-- result) or 'ok:<result>'. A failing call must leave the outbox tables as they
-- were. Every case runs in its own subtransaction that is rolled back afterwards,
-- so cases do not depend on each other. pg_test/ERRORS.md is the same matrix as
-- a table.
\i sql/prologue.inc

-- Fixture: a registered topic and one event per state. Tokens are kept in fx.
SELECT outbox.create_topic('fx.topic', max_attempts => 3);
-- The pending event is published after the claim: which three of four events
-- a claim takes is the log's choice (it reads lanes, not id order).
SELECT count(*) FROM outbox.publish_batch('fx.topic', ARRAY['"leased"', '"dead"', '"delivered"']::jsonb[],
                                          ARRAY['s1', 's2', NULL], ARRAY['k1', 'k2', 'k3']);
CREATE TEMP TABLE fx AS
    SELECT payload #>> '{}' AS name, id, lease_token FROM outbox.claim('fx', 3, interval '1 hour');
SELECT outbox.publish('fx.topic', '"pending"', dispatch_key => 'k4') IS NOT NULL AS published;
SELECT outbox.fail(id, lease_token, 'x', permanent => true) FROM fx WHERE name = 'dead';
SELECT outbox.ack(id, lease_token) FROM fx WHERE name = 'delivered';
INSERT INTO fx SELECT 'pending', id, NULL FROM outbox.events WHERE payload = '"pending"';
SELECT f.name, e.state FROM fx f JOIN outbox.events e USING (id) ORDER BY f.id;
-- A named subscription holding leases (from the log: start => 'earliest').
SELECT outbox.create_subscription('fxsub', start => 'earliest');
SELECT count(*) FROM outbox.claim('fxs', 10, interval '1 hour', subscription => 'fxsub');

-- Fingerprint of everything the extension stores.
CREATE FUNCTION pg_temp.fingerprint() RETURNS text LANGUAGE sql AS $$
    SELECT md5(concat_ws('|',
        (SELECT string_agg(k::text, ',' ORDER BY k.dispatch_key) FROM outbox.dispatch_keys k),
        (SELECT string_agg(t::text, ',' ORDER BY t.topic) FROM outbox.topics t),
        (SELECT string_agg(c::text, ',' ORDER BY c.name) FROM outbox.subscription_catalog c),
        (SELECT string_agg(l::text, ',' ORDER BY l.subscription, l.lane) FROM outbox.log_lanes l),
        (SELECT string_agg(b::text, ',' ORDER BY b.id) FROM outbox.log_batches b),
        (SELECT string_agg(x::text, ',' ORDER BY x.subscription, x.id) FROM outbox.log_exceptions x),
        (SELECT string_agg(i::text, ',' ORDER BY i.consumer, i.message_id) FROM outbox.inbox i)))
$$;

CREATE TEMP TABLE cases (n serial PRIMARY KEY, fn text NOT NULL, label text NOT NULL, call text NOT NULL, expect text NOT NULL);

-- Shorthands used in calls: a current lease token, an oversized string.
CREATE FUNCTION pg_temp.tok() RETURNS uuid LANGUAGE sql AS $$ SELECT lease_token FROM fx WHERE name = 'leased' $$;
CREATE FUNCTION pg_temp.leased_id() RETURNS bigint LANGUAGE sql AS $$ SELECT id FROM fx WHERE name = 'leased' $$;
CREATE FUNCTION pg_temp.dead_id() RETURNS bigint LANGUAGE sql AS $$ SELECT id FROM fx WHERE name = 'dead' $$;
CREATE FUNCTION pg_temp.deep(n int) RETURNS jsonb LANGUAGE sql AS $$ SELECT (repeat('[', n) || repeat(']', n))::jsonb $$;
CREATE FUNCTION pg_temp.deep_object(n int) RETURNS jsonb LANGUAGE sql AS $$ SELECT (repeat('{"a": ', n) || '"x"' || repeat('}', n))::jsonb $$;

-- ---------------------------------------------------------------------------
-- publish(topic, payload, subject, dispatch_key, headers, deliver_at)
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('publish', 'valid baseline', $$SELECT outbox.publish('a.b', '{}')$$, 'ok'),
('publish', 'NULL topic', $$SELECT outbox.publish(NULL, '{}')$$, '22004'),
('publish', 'NULL payload', $$SELECT outbox.publish('a', NULL)$$, '22004'),
('publish', 'NULL subject', $$SELECT outbox.publish('a', '{}', NULL)$$, 'ok'),
('publish', 'NULL dispatch_key', $$SELECT outbox.publish('a', '{}', 's', NULL)$$, 'ok'),
('publish', 'NULL headers', $$SELECT outbox.publish('a', '{}', 's', 'k', NULL)$$, 'ok'),
('publish', 'NULL deliver_at', $$SELECT outbox.publish('a', '{}', 's', 'k', '{}', NULL)$$, 'ok'),
('publish', 'all NULL', $$SELECT outbox.publish(NULL, NULL, NULL, NULL, NULL, NULL)$$, '22004'),
('publish', 'topic empty', $$SELECT outbox.publish('', '{}')$$, '22023'),
('publish', 'topic 255 chars', $$SELECT outbox.publish(repeat('a', 255), '{}')$$, 'ok'),
('publish', 'topic 256 chars', $$SELECT outbox.publish(repeat('a', 256), '{}')$$, '22023'),
('publish', 'topic 1 MB', $$SELECT outbox.publish(repeat('a', 1048576), '{}')$$, '22023'),
('publish', 'topic uppercase', $$SELECT outbox.publish('Orders', '{}')$$, '22023'),
('publish', 'topic space inside', $$SELECT outbox.publish('a b', '{}')$$, '22023'),
('publish', 'topic leading space', $$SELECT outbox.publish(' a', '{}')$$, '22023'),
('publish', 'topic trailing space', $$SELECT outbox.publish('a ', '{}')$$, '22023'),
('publish', 'topic tab', $$SELECT outbox.publish(E'a\tb', '{}')$$, '22023'),
('publish', 'topic newline', $$SELECT outbox.publish(E'a\n', '{}')$$, '22023'),
('publish', 'topic unicode letter', $$SELECT outbox.publish('bestellung.größe', '{}')$$, '22023'),
('publish', 'topic emoji', $$SELECT outbox.publish('🚀', '{}')$$, '22023'),
('publish', 'topic fullwidth a', $$SELECT outbox.publish('ａ', '{}')$$, '22023'),
('publish', 'topic NUL via E-string', $$SELECT outbox.publish(E'a\u0000b', '{}')$$, '42601'),
('publish', 'topic NUL via chr(0)', $$SELECT outbox.publish('a' || chr(0), '{}')$$, '54000'),
('publish', 'topic leading dot', $$SELECT outbox.publish('.a', '{}')$$, '22023'),
('publish', 'topic trailing dot', $$SELECT outbox.publish('a.', '{}')$$, '22023'),
('publish', 'topic only dot', $$SELECT outbox.publish('.', '{}')$$, '22023'),
('publish', 'topic empty segment', $$SELECT outbox.publish('a..b', '{}')$$, '22023'),
('publish', 'topic wildcard', $$SELECT outbox.publish('a.*', '{}')$$, '22023'),
('publish', 'topic star', $$SELECT outbox.publish('*', '{}')$$, '22023'),
('publish', 'topic slash', $$SELECT outbox.publish('a/b', '{}')$$, '22023'),
('publish', 'topic quote', $$SELECT outbox.publish('a''b', '{}')$$, '22023'),
('publish', 'topic SQL injection', $$SELECT outbox.publish('a''; DROP TABLE outbox.topics; --', '{}')$$, '22023'),
('publish', 'topic digits, dash, underscore', $$SELECT outbox.publish('0.-._', '{}')$$, 'ok'),
('publish', 'payload JSON null', $$SELECT outbox.publish('a', 'null')$$, 'ok'),
('publish', 'payload number', $$SELECT outbox.publish('a', '1e308')$$, 'ok'),
('publish', 'payload string', $$SELECT outbox.publish('a', '"x"')$$, 'ok'),
('publish', 'payload boolean', $$SELECT outbox.publish('a', 'false')$$, 'ok'),
('publish', 'payload empty array', $$SELECT outbox.publish('a', '[]')$$, 'ok'),
('publish', 'payload nested 10000 levels', $$SELECT outbox.publish('a', pg_temp.deep(10000))$$, 'ok'),
('publish', 'payload NUL escape', $$SELECT outbox.publish('a', '"\u0000"')$$, '22P05'),
('publish', 'payload at 1 MB limit', $$SELECT outbox.publish('a', to_jsonb(repeat('x', 1048576 - 8)))$$, 'ok'),
('publish', 'payload 1 byte over limit', $$SELECT outbox.publish('a', to_jsonb(repeat('x', 1048576 - 7)))$$, '54000'),
('publish', 'payload 10 MB', $$SELECT outbox.publish('a', to_jsonb(repeat('x', 10485760)))$$, '54000'),
('publish', 'subject empty', $$SELECT outbox.publish('a', '{}', '')$$, '22023'),
('publish', 'subject 1024 bytes', $$SELECT outbox.publish('a', '{}', repeat('s', 1024))$$, 'ok'),
('publish', 'subject 1025 bytes', $$SELECT outbox.publish('a', '{}', repeat('s', 1025))$$, '22023'),
('publish', 'subject 342 x 3-byte chars', $$SELECT outbox.publish('a', '{}', repeat('€', 342))$$, '22023'),
('publish', 'subject unicode and spaces', $$SELECT outbox.publish('a', '{}', 'Bestellung 42 — größe 🚀')$$, 'ok'),
('publish', 'dispatch_key empty', $$SELECT outbox.publish('a', '{}', NULL, '')$$, '22023'),
('publish', 'dispatch_key 1025 bytes', $$SELECT outbox.publish('a', '{}', NULL, repeat('k', 1025))$$, '22023'),
('publish', 'dispatch_key 1 MB', $$SELECT outbox.publish('a', '{}', NULL, repeat('k', 1048576))$$, '22023'),
('publish', 'dispatch_key existing', $$SELECT outbox.publish('a', '{}', NULL, 'k1') = pg_temp.leased_id()$$, 'ok:true'),
('publish', 'headers array', $$SELECT outbox.publish('a', '{}', headers => '["a"]')$$, '22023'),
('publish', 'headers string', $$SELECT outbox.publish('a', '{}', headers => '"a"')$$, '22023'),
('publish', 'headers number', $$SELECT outbox.publish('a', '{}', headers => '1')$$, '22023'),
('publish', 'headers JSON null', $$SELECT outbox.publish('a', '{}', headers => 'null')$$, '22023'),
('publish', 'headers number value', $$SELECT outbox.publish('a', '{}', headers => '{"a": 1}')$$, '22023'),
('publish', 'headers null value', $$SELECT outbox.publish('a', '{}', headers => '{"a": null}')$$, '22023'),
('publish', 'headers boolean value', $$SELECT outbox.publish('a', '{}', headers => '{"a": true}')$$, '22023'),
('publish', 'headers object value', $$SELECT outbox.publish('a', '{}', headers => '{"a": {"b": "c"}}')$$, '22023'),
('publish', 'headers array value', $$SELECT outbox.publish('a', '{}', headers => '{"a": ["b"]}')$$, '22023'),
('publish', 'headers nested 200 levels', $$SELECT outbox.publish('a', '{}', headers => pg_temp.deep_object(200))$$, '22023'),
('publish', 'headers value nested 10000 levels', $$SELECT outbox.publish('a', '{}', headers => jsonb_build_object('h', pg_temp.deep(10000)))$$, '22023'),
('publish', 'headers empty object', $$SELECT outbox.publish('a', '{}', headers => '{}')$$, 'ok'),
('publish', 'headers empty key and value', $$SELECT outbox.publish('a', '{}', headers => '{"": ""}')$$, 'ok'),
('publish', 'headers over size limit', $$SELECT outbox.publish('a', '{}', headers => jsonb_build_object('h', repeat('x', 1048576)))$$, '54000'),
('publish', 'deliver_at infinity', $$SELECT outbox.publish('a', '{}', deliver_at => 'infinity')$$, '22023'),
('publish', 'deliver_at -infinity', $$SELECT outbox.publish('a', '{}', deliver_at => '-infinity')$$, 'ok'),
('publish', 'deliver_at 4713 BC', $$SELECT outbox.publish('a', '{}', deliver_at => '4713-01-01 00:00:00+00 BC')$$, 'ok'),
('publish', 'deliver_at year 294276', $$SELECT outbox.publish('a', '{}', deliver_at => '294276-12-31 23:59:59+00')$$, 'ok'),
('publish', 'deliver_at epoch', $$SELECT outbox.publish('a', '{}', deliver_at => 'epoch')$$, 'ok');

-- ---------------------------------------------------------------------------
-- publish_batch(topic, payloads, subjects, dispatch_keys)
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('publish_batch', 'valid baseline', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1', '2']::jsonb[])$$, 'ok:2'),
('publish_batch', 'NULL topic', $$SELECT count(*) FROM outbox.publish_batch(NULL, ARRAY['1']::jsonb[])$$, '22004'),
('publish_batch', 'NULL payloads', $$SELECT count(*) FROM outbox.publish_batch('a', NULL)$$, '22004'),
('publish_batch', 'NULL subjects', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], NULL)$$, 'ok:1'),
('publish_batch', 'NULL dispatch_keys', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], NULL, NULL)$$, 'ok:1'),
('publish_batch', 'all NULL', $$SELECT count(*) FROM outbox.publish_batch(NULL, NULL, NULL, NULL)$$, '22004'),
('publish_batch', 'bad topic', $$SELECT count(*) FROM outbox.publish_batch('A.b', ARRAY['1']::jsonb[])$$, '22023'),
('publish_batch', 'empty payloads', $$SELECT count(*) FROM outbox.publish_batch('a', '{}'::jsonb[])$$, '22023'),
('publish_batch', 'NULL payload element', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1', NULL]::jsonb[])$$, '22004'),
('publish_batch', 'only NULL elements', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY[NULL, NULL]::jsonb[])$$, '22004'),
('publish_batch', 'two-dimensional payloads', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY[['1'], ['2']]::jsonb[])$$, '22023'),
('publish_batch', 'payloads lower bound 0', $$SELECT count(*) FROM outbox.publish_batch('a', '[0:1]={1,2}'::jsonb[])$$, 'ok:2'),
('publish_batch', '10001 payloads', $$SELECT count(*) FROM outbox.publish_batch('a', array_fill('1'::jsonb, ARRAY[10001]))$$, '54000'),
('publish_batch', 'payload element over limit', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1', to_jsonb(repeat('x', 1048576))])$$, '54000'),
('publish_batch', 'payload element nested 10000', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY[pg_temp.deep(10000)])$$, 'ok:1'),
('publish_batch', 'subjects shorter', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1', '2']::jsonb[], ARRAY['s'])$$, '22023'),
('publish_batch', 'subjects longer', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], ARRAY['s', 't'])$$, '22023'),
('publish_batch', 'subjects empty', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], '{}'::text[])$$, '22023'),
('publish_batch', 'subjects two-dimensional', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1', '2']::jsonb[], ARRAY[['s'], ['t']])$$, '22023'),
('publish_batch', 'subjects all NULL elements', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1', '2']::jsonb[], ARRAY[NULL, NULL]::text[])$$, 'ok:2'),
('publish_batch', 'subject element empty', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], ARRAY[''])$$, '22023'),
('publish_batch', 'subject element 1025 bytes', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], ARRAY[repeat('s', 1025)])$$, '22023'),
('publish_batch', 'keys shorter', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1', '2']::jsonb[], NULL, ARRAY['k'])$$, '22023'),
('publish_batch', 'keys empty', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], NULL, '{}'::text[])$$, '22023'),
('publish_batch', 'key element empty', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], NULL, ARRAY[''])$$, '22023'),
('publish_batch', 'key element 1025 bytes', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1']::jsonb[], NULL, ARRAY[repeat('k', 1025)])$$, '22023'),
('publish_batch', 'keys with NULL elements', $$SELECT count(*) FROM outbox.publish_batch('a', ARRAY['1', '2']::jsonb[], NULL, ARRAY['x', NULL])$$, 'ok:2'),
('publish_batch', 'same key twice', $$SELECT count(DISTINCT id) FROM outbox.publish_batch('a', ARRAY['1', '2']::jsonb[], NULL, ARRAY['x', 'x']) AS id$$, 'ok:1');

-- ---------------------------------------------------------------------------
-- claim(worker, batch_size, lease, topics)
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('claim', 'valid baseline', $$SELECT count(*) FROM outbox.claim('w')$$, 'ok:1'),
('claim', 'NULL worker', $$SELECT count(*) FROM outbox.claim(NULL)$$, '22004'),
('claim', 'NULL batch_size', $$SELECT count(*) FROM outbox.claim('w', NULL)$$, '22004'),
('claim', 'NULL lease', $$SELECT count(*) FROM outbox.claim('w', 1, NULL)$$, 'ok:1'),
('claim', 'NULL topics', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, NULL)$$, 'ok:1'),
('claim', 'all NULL', $$SELECT count(*) FROM outbox.claim(NULL, NULL, NULL, NULL)$$, '22004'),
('claim', 'worker empty', $$SELECT count(*) FROM outbox.claim('')$$, '22023'),
('claim', 'worker 255 chars', $$SELECT count(*) FROM outbox.claim(repeat('w', 255))$$, 'ok:1'),
('claim', 'worker 256 chars', $$SELECT count(*) FROM outbox.claim(repeat('w', 256))$$, '22023'),
('claim', 'worker 1 MB', $$SELECT count(*) FROM outbox.claim(repeat('w', 1048576))$$, '22023'),
('claim', 'worker newline', $$SELECT count(*) FROM outbox.claim(E'w\n1')$$, '22023'),
('claim', 'worker escape char', $$SELECT count(*) FROM outbox.claim(E'w\x1b[31m')$$, '22023'),
('claim', 'worker unicode', $$SELECT count(*) FROM outbox.claim('wörker-🚀')$$, 'ok:1'),
('claim', 'batch_size 0', $$SELECT count(*) FROM outbox.claim('w', 0)$$, '22023'),
('claim', 'batch_size -1', $$SELECT count(*) FROM outbox.claim('w', -1)$$, '22023'),
('claim', 'batch_size min int', $$SELECT count(*) FROM outbox.claim('w', -2147483648)$$, '22023'),
('claim', 'batch_size max int', $$SELECT count(*) FROM outbox.claim('w', 2147483647)$$, '54000'),
('claim', 'batch_size 10000', $$SELECT count(*) FROM outbox.claim('w', 10000)$$, 'ok:1'),
('claim', 'lease zero', $$SELECT count(*) FROM outbox.claim('w', 1, '0')$$, '22023'),
('claim', 'lease negative', $$SELECT count(*) FROM outbox.claim('w', 1, '-1 second')$$, '22023'),
('claim', 'lease 1 microsecond', $$SELECT count(*) FROM outbox.claim('w', 1, '1 microsecond')$$, 'ok:1'),
('claim', 'lease 12 h (max)', $$SELECT count(*) FROM outbox.claim('w', 1, '12 hours')$$, 'ok:1'),
('claim', 'lease over max', $$SELECT count(*) FROM outbox.claim('w', 1, '12 hours 1 second')$$, '22023'),
('claim', 'lease 1 month', $$SELECT count(*) FROM outbox.claim('w', 1, '1 month')$$, '22023'),
('claim', 'lease huge', $$SELECT count(*) FROM outbox.claim('w', 1, '178000000 years')$$, '22023'),
('claim', 'lease mixed sign', $$SELECT count(*) FROM outbox.claim('w', 1, '1 month -30 days')$$, '22023'),
('claim', 'lease infinity (PG 15 has none)', $$SELECT count(*) FROM outbox.claim('w', 1, 'infinity')$$, '22007'),
('claim', 'topics empty', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, '{}')$$, '22023'),
('claim', 'topics NULL element', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY[NULL]::text[])$$, '22004'),
('claim', 'topics NULL after *', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY['*', NULL])$$, '22004'),
('claim', 'topics empty string', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY[''])$$, '22023'),
('claim', 'topics uppercase', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY['FX.topic'])$$, '22023'),
('claim', 'topics bad after *', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY['*', 'A'])$$, '22023'),
('claim', 'topics glob', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY['fx*'])$$, '22023'),
('claim', 'topics SQL LIKE', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY['fx.%'])$$, '22023'),
('claim', 'topics regex', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY['fx\..*'])$$, '22023'),
('claim', 'topics two-dimensional', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY[['fx.topic'], ['b']])$$, '22023'),
('claim', 'topics 10000 elements', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, array_fill('fx.topic'::text, ARRAY[10000]))$$, 'ok:1'),
('claim', 'topics prefix', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, ARRAY['fx.*'])$$, 'ok:1');

-- ---------------------------------------------------------------------------
-- ack(id, token) and ack(ids[], tokens[])
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('ack', 'valid baseline', $$SELECT outbox.ack(pg_temp.leased_id(), pg_temp.tok())$$, 'ok:true'),
('ack', 'NULL id', $$SELECT outbox.ack(NULL, pg_temp.tok())$$, 'ok:false'),
('ack', 'NULL token', $$SELECT outbox.ack(pg_temp.leased_id(), NULL)$$, 'ok:false'),
('ack', 'both NULL', $$SELECT outbox.ack(NULL::bigint, NULL::uuid)$$, 'ok:false'),
('ack', 'random token', $$SELECT outbox.ack(pg_temp.leased_id(), gen_random_uuid())$$, 'ok:false'),
('ack', 'nil uuid', $$SELECT outbox.ack(pg_temp.leased_id(), '00000000-0000-0000-0000-000000000000')$$, 'ok:false'),
('ack', 'unknown id', $$SELECT outbox.ack(999999, pg_temp.tok())$$, 'ok:false'),
('ack', 'id 0', $$SELECT outbox.ack(0, pg_temp.tok())$$, 'ok:false'),
('ack', 'id -1', $$SELECT outbox.ack(-1, pg_temp.tok())$$, 'ok:false'),
('ack', 'id max bigint', $$SELECT outbox.ack(9223372036854775807, pg_temp.tok())$$, 'ok:false'),
('ack', 'dead event', $$SELECT outbox.ack(pg_temp.dead_id(), gen_random_uuid())$$, 'ok:false'),
('ack', 'token not a uuid', $$SELECT outbox.ack(1, 'not-a-uuid')$$, '22P02'),
('ack[]', 'valid baseline', $$SELECT outbox.ack(ARRAY[pg_temp.leased_id()], ARRAY[pg_temp.tok()])$$, 'ok:1'),
('ack[]', 'NULL ids', $$SELECT outbox.ack(NULL::bigint[], ARRAY[pg_temp.tok()])$$, '22004'),
('ack[]', 'NULL tokens', $$SELECT outbox.ack(ARRAY[1::bigint], NULL::uuid[])$$, '22004'),
('ack[]', 'both NULL', $$SELECT outbox.ack(NULL::bigint[], NULL::uuid[])$$, '22004'),
('ack[]', 'empty', $$SELECT outbox.ack('{}'::bigint[], '{}'::uuid[])$$, 'ok:0'),
('ack[]', 'ids longer', $$SELECT outbox.ack(ARRAY[1, 2]::bigint[], ARRAY[pg_temp.tok()])$$, '22023'),
('ack[]', 'tokens longer', $$SELECT outbox.ack(ARRAY[1]::bigint[], ARRAY[pg_temp.tok(), gen_random_uuid()])$$, '22023'),
('ack[]', 'empty ids, one token', $$SELECT outbox.ack('{}'::bigint[], ARRAY[pg_temp.tok()])$$, '22023'),
('ack[]', 'NULL id element', $$SELECT outbox.ack(ARRAY[NULL]::bigint[], ARRAY[pg_temp.tok()])$$, '22004'),
('ack[]', 'NULL token element', $$SELECT outbox.ack(ARRAY[pg_temp.leased_id()], ARRAY[NULL]::uuid[])$$, '22004'),
('ack[]', 'NULL with valid pair', $$SELECT outbox.ack(ARRAY[pg_temp.leased_id(), NULL], ARRAY[pg_temp.tok(), gen_random_uuid()])$$, '22004'),
('ack[]', 'two-dimensional', $$SELECT outbox.ack(ARRAY[[1], [2]]::bigint[], ARRAY[[gen_random_uuid()], [gen_random_uuid()]])$$, '22023'),
('ack[]', 'random tokens', $$SELECT outbox.ack(ARRAY[pg_temp.leased_id(), pg_temp.dead_id()], ARRAY[gen_random_uuid(), gen_random_uuid()])$$, 'ok:0'),
('ack[]', '10001 pairs', $$SELECT outbox.ack(array_fill(1::bigint, ARRAY[10001]), array_fill(gen_random_uuid(), ARRAY[10001]))$$, '54000'),
('ack[]', 'same pair 1000 times', $$SELECT outbox.ack(array_fill(pg_temp.leased_id(), ARRAY[1000]), array_fill(pg_temp.tok(), ARRAY[1000]))$$, 'ok:1');

-- ---------------------------------------------------------------------------
-- fail(id, token, error, retry_in, permanent)
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('fail', 'valid baseline', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e')$$, 'ok:pending'),
('fail', 'NULL id', $$SELECT outbox.fail(NULL, pg_temp.tok(), 'e')$$, 'ok:stale'),
('fail', 'NULL token', $$SELECT outbox.fail(pg_temp.leased_id(), NULL, 'e')$$, 'ok:stale'),
('fail', 'NULL error', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), NULL)$$, 'ok:pending'),
('fail', 'NULL retry_in', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e', NULL)$$, 'ok:pending'),
('fail', 'NULL permanent', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e', NULL, NULL)$$, '22004'),
('fail', 'all NULL', $$SELECT outbox.fail(NULL, NULL, NULL, NULL, NULL)$$, '22004'),
('fail', 'error empty', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), '')$$, 'ok:pending'),
('fail', 'error 10 MB', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), repeat('e', 10485760))$$, 'ok:pending'),
('fail', 'error with control chars', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), E'\x01\x1b[2J\r\n')$$, 'ok:pending'),
('fail', 'retry_in zero', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e', '0')$$, 'ok:pending'),
('fail', 'retry_in negative', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e', '-1 microsecond')$$, '22023'),
('fail', 'retry_in 365 days', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e', '365 days')$$, 'ok:pending'),
('fail', 'retry_in 366 days', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e', '366 days')$$, '22023'),
('fail', 'retry_in huge', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e', '178000000 years')$$, '22023'),
('fail', 'retry_in negative, stale token', $$SELECT outbox.fail(pg_temp.leased_id(), gen_random_uuid(), 'e', '-1 day')$$, '22023'),
('fail', 'permanent', $$SELECT outbox.fail(pg_temp.leased_id(), pg_temp.tok(), 'e', NULL, true)$$, 'ok:dead'),
('fail', 'random token', $$SELECT outbox.fail(pg_temp.leased_id(), gen_random_uuid(), 'e')$$, 'ok:stale'),
('fail', 'unknown id', $$SELECT outbox.fail(999999, pg_temp.tok(), 'e')$$, 'ok:stale'),
('fail', 'id -1', $$SELECT outbox.fail(-1, gen_random_uuid(), 'e')$$, 'ok:stale'),
('fail', 'dead event', $$SELECT outbox.fail(pg_temp.dead_id(), gen_random_uuid(), 'e')$$, 'ok:stale');

-- ---------------------------------------------------------------------------
-- extend_lease(id, token, lease)
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('extend_lease', 'valid baseline', $$SELECT outbox.extend_lease(pg_temp.leased_id(), pg_temp.tok(), '1 minute') IS NOT NULL$$, 'ok:true'),
('extend_lease', 'NULL id', $$SELECT outbox.extend_lease(NULL, pg_temp.tok(), '1 minute')$$, 'ok:NULL'),
('extend_lease', 'NULL token', $$SELECT outbox.extend_lease(pg_temp.leased_id(), NULL, '1 minute')$$, 'ok:NULL'),
('extend_lease', 'NULL lease', $$SELECT outbox.extend_lease(pg_temp.leased_id(), pg_temp.tok(), NULL)$$, '22004'),
('extend_lease', 'all NULL', $$SELECT outbox.extend_lease(NULL, NULL, NULL)$$, '22004'),
('extend_lease', 'lease zero', $$SELECT outbox.extend_lease(pg_temp.leased_id(), pg_temp.tok(), '0')$$, '22023'),
('extend_lease', 'lease negative', $$SELECT outbox.extend_lease(pg_temp.leased_id(), pg_temp.tok(), '-1 hour')$$, '22023'),
('extend_lease', 'lease over max', $$SELECT outbox.extend_lease(pg_temp.leased_id(), pg_temp.tok(), '13 hours')$$, '22023'),
('extend_lease', 'lease huge', $$SELECT outbox.extend_lease(pg_temp.leased_id(), pg_temp.tok(), '178000000 years')$$, '22023'),
('extend_lease', 'random token', $$SELECT outbox.extend_lease(pg_temp.leased_id(), gen_random_uuid(), '1 minute')$$, 'ok:NULL'),
('extend_lease', 'unknown id', $$SELECT outbox.extend_lease(999999, pg_temp.tok(), '1 minute')$$, 'ok:NULL'),
('extend_lease', 'dead event', $$SELECT outbox.extend_lease(pg_temp.dead_id(), gen_random_uuid(), '1 minute')$$, 'ok:NULL');

-- ---------------------------------------------------------------------------
-- backoff_delay(attempt, base, max, jitter)
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('backoff_delay', 'valid baseline', $$SELECT outbox.backoff_delay(3, '1 second', '1 hour', false)$$, 'ok:@ 4 secs'),
('backoff_delay', 'NULL attempt', $$SELECT outbox.backoff_delay(NULL)$$, '22004'),
('backoff_delay', 'NULL base', $$SELECT outbox.backoff_delay(1, NULL, '1 hour', false)$$, 'ok:@ 1 sec'),
('backoff_delay', 'NULL max', $$SELECT outbox.backoff_delay(30, '1 second', NULL, false)$$, 'ok:@ 30 mins'),
('backoff_delay', 'NULL jitter', $$SELECT outbox.backoff_delay(1, '1 second', '1 second', NULL) BETWEEN '0.5 s' AND '1 s'$$, 'ok:true'),
('backoff_delay', 'all NULL', $$SELECT outbox.backoff_delay(NULL, NULL, NULL, NULL)$$, '22004'),
('backoff_delay', 'attempt 0', $$SELECT outbox.backoff_delay(0)$$, '22023'),
('backoff_delay', 'attempt -1', $$SELECT outbox.backoff_delay(-1)$$, '22023'),
('backoff_delay', 'attempt min int', $$SELECT outbox.backoff_delay(-2147483648)$$, '22023'),
('backoff_delay', 'attempt max int', $$SELECT outbox.backoff_delay(2147483647, '1 second', '1 hour', false)$$, 'ok:@ 1 hour'),
('backoff_delay', 'base zero', $$SELECT outbox.backoff_delay(1, '0')$$, '22023'),
('backoff_delay', 'base negative', $$SELECT outbox.backoff_delay(1, '-1 second')$$, '22023'),
('backoff_delay', 'base 366 days', $$SELECT outbox.backoff_delay(1, '366 days')$$, '22023'),
('backoff_delay', 'base huge', $$SELECT outbox.backoff_delay(1, '178000000 years')$$, '22023'),
('backoff_delay', 'max zero', $$SELECT outbox.backoff_delay(1, '1 second', '0')$$, '22023'),
('backoff_delay', 'max negative', $$SELECT outbox.backoff_delay(1, '1 second', '-1 second')$$, '22023'),
('backoff_delay', 'max below base', $$SELECT outbox.backoff_delay(1, '1 hour', '1 second', false)$$, 'ok:@ 1 sec');

-- ---------------------------------------------------------------------------
-- replay(id), replay_dead(pattern, since, until, dry_run), cancel(id)
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('replay', 'valid baseline', $$SELECT outbox.replay(pg_temp.dead_id())$$, 'ok:true'),
('replay', 'NULL id', $$SELECT outbox.replay(NULL)$$, 'ok:false'),
('replay', 'unknown id', $$SELECT outbox.replay(999999)$$, 'ok:false'),
('replay', 'id -1', $$SELECT outbox.replay(-1)$$, 'ok:false'),
('replay', 'id max bigint', $$SELECT outbox.replay(9223372036854775807)$$, 'ok:false'),
('replay', 'leased event', $$SELECT outbox.replay(pg_temp.leased_id())$$, 'ok:false'),
('replay_dead', 'valid baseline', $$SELECT outbox.replay_dead()$$, 'ok:1'),
('replay_dead', 'NULL pattern', $$SELECT outbox.replay_dead(NULL, now() - interval '1 day', now() + interval '1 day')$$, 'ok:1'),
('replay_dead', 'NULL since/until', $$SELECT outbox.replay_dead('fx.topic', NULL, NULL, true)$$, 'ok:1'),
('replay_dead', 'NULL dry_run', $$SELECT outbox.replay_dead(NULL, NULL, NULL, NULL)$$, '22004'),
('replay_dead', 'pattern empty', $$SELECT outbox.replay_dead('')$$, '22023'),
('replay_dead', 'pattern uppercase', $$SELECT outbox.replay_dead('FX.*')$$, '22023'),
('replay_dead', 'pattern 256 chars', $$SELECT outbox.replay_dead(repeat('a', 256))$$, '22023'),
('replay_dead', 'pattern glob', $$SELECT outbox.replay_dead('fx*')$$, '22023'),
('replay_dead', 'pattern LIKE', $$SELECT outbox.replay_dead('%')$$, '22023'),
('replay_dead', 'pattern star', $$SELECT outbox.replay_dead('*', dry_run => true)$$, 'ok:1'),
('replay_dead', 'pattern prefix', $$SELECT outbox.replay_dead('fx.*', dry_run => true)$$, 'ok:1'),
('replay_dead', 'window -infinity..infinity', $$SELECT outbox.replay_dead(NULL, '-infinity', 'infinity', true)$$, 'ok:1'),
('replay_dead', 'window reversed', $$SELECT outbox.replay_dead(NULL, 'infinity', '-infinity')$$, 'ok:0'),
('replay_dead', 'window in the future', $$SELECT outbox.replay_dead(NULL, now() + interval '1 day')$$, 'ok:0'),
('cancel', 'valid baseline', $$SELECT outbox.cancel(pg_temp.dead_id())$$, 'ok:true'),
('cancel', 'NULL id', $$SELECT outbox.cancel(NULL)$$, 'ok:false'),
('cancel', 'unknown id', $$SELECT outbox.cancel(999999)$$, 'ok:false'),
('cancel', 'id -1', $$SELECT outbox.cancel(-1)$$, 'ok:false'),
('cancel', 'leased event', $$SELECT outbox.cancel(pg_temp.leased_id())$$, 'ok:false');

-- ---------------------------------------------------------------------------
-- create_topic / alter_topic / drop_topic
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('create_topic', 'valid baseline', $$SELECT outbox.create_topic('new.topic')$$, 'ok'),
('create_topic', 'NULL topic', $$SELECT outbox.create_topic(NULL)$$, '22004'),
('create_topic', 'NULL settings', $$SELECT outbox.create_topic('new.topic', NULL, NULL, NULL, NULL, 'skip', NULL, NULL)$$, 'ok'),
('create_topic', 'NULL dead_letter_policy', $$SELECT outbox.create_topic('new.topic', dead_letter_policy => NULL)$$, '22023'),
('create_topic', 'all NULL', $$SELECT outbox.create_topic(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)$$, '22004'),
('create_topic', 'topic empty', $$SELECT outbox.create_topic('')$$, '22023'),
('create_topic', 'topic 256 chars', $$SELECT outbox.create_topic(repeat('t', 256))$$, '22023'),
('create_topic', 'topic uppercase', $$SELECT outbox.create_topic('New')$$, '22023'),
('create_topic', 'topic unicode', $$SELECT outbox.create_topic('größe')$$, '22023'),
('create_topic', 'topic pattern', $$SELECT outbox.create_topic('new.*')$$, '22023'),
('create_topic', 'topic empty segment', $$SELECT outbox.create_topic('new..topic')$$, '22023'),
('create_topic', 'topic exists', $$SELECT outbox.create_topic('fx.topic')$$, '42710'),
('create_topic', 'max_attempts 0', $$SELECT outbox.create_topic('new.topic', 0)$$, '22023'),
('create_topic', 'max_attempts max int', $$SELECT outbox.create_topic('new.topic', 2147483647)$$, '22023'),
('create_topic', 'max_attempts 1000000', $$SELECT outbox.create_topic('new.topic', 1000000)$$, 'ok'),
('create_topic', 'backoff_base zero', $$SELECT outbox.create_topic('new.topic', backoff_base => '0')$$, '22023'),
('create_topic', 'backoff_base huge', $$SELECT outbox.create_topic('new.topic', backoff_base => '178000000 years')$$, '22023'),
('create_topic', 'backoff_max negative', $$SELECT outbox.create_topic('new.topic', backoff_max => '-1 second')$$, '22023'),
('create_topic', 'default_lease zero', $$SELECT outbox.create_topic('new.topic', default_lease => '0')$$, '22023'),
('create_topic', 'default_lease over max', $$SELECT outbox.create_topic('new.topic', default_lease => '1 day')$$, '22023'),
('create_topic', 'policy empty', $$SELECT outbox.create_topic('new.topic', dead_letter_policy => '')$$, '22023'),
('create_topic', 'policy uppercase', $$SELECT outbox.create_topic('new.topic', dead_letter_policy => 'SKIP')$$, '22023'),
('create_topic', 'policy 1 MB', $$SELECT outbox.create_topic('new.topic', dead_letter_policy => repeat('x', 1048576))$$, '22023'),
('create_topic', 'retention negative', $$SELECT outbox.create_topic('new.topic', retention_delivered => '-1 day')$$, '22023'),
('create_topic', 'retention huge', $$SELECT outbox.create_topic('new.topic', retention_dead => '178000000 years')$$, 'ok'),
('alter_topic', 'valid baseline', $$SELECT outbox.alter_topic('fx.topic', max_attempts => 5)$$, 'ok'),
('alter_topic', 'NULL topic', $$SELECT outbox.alter_topic(NULL)$$, '22004'),
('alter_topic', 'all NULL settings', $$SELECT outbox.alter_topic('fx.topic', NULL, NULL, NULL, NULL, NULL, NULL, NULL)$$, 'ok'),
('alter_topic', 'unknown topic', $$SELECT outbox.alter_topic('no.such.topic', max_attempts => 5)$$, 'P0002'),
('alter_topic', 'invalid topic', $$SELECT outbox.alter_topic('No.Such')$$, '22023'),
('alter_topic', 'max_attempts -1', $$SELECT outbox.alter_topic('fx.topic', max_attempts => -1)$$, '22023'),
('alter_topic', 'policy bogus', $$SELECT outbox.alter_topic('fx.topic', dead_letter_policy => 'retry')$$, '22023'),
('alter_topic', 'default_lease negative', $$SELECT outbox.alter_topic('fx.topic', default_lease => '-1 second')$$, '22023'),
('drop_topic', 'NULL topic', $$SELECT outbox.drop_topic(NULL)$$, '22004'),
('drop_topic', 'NULL force', $$SELECT outbox.drop_topic('fx.topic', NULL)$$, '22004'),
('drop_topic', 'all NULL', $$SELECT outbox.drop_topic(NULL, NULL)$$, '22004'),
('drop_topic', 'invalid topic', $$SELECT outbox.drop_topic('FX')$$, '22023'),
('drop_topic', 'pattern', $$SELECT outbox.drop_topic('fx.*')$$, '22023'),
('drop_topic', 'unknown topic', $$SELECT outbox.drop_topic('no.such.topic')$$, 'ok:false'),
('drop_topic', 'busy topic', $$SELECT outbox.drop_topic('fx.topic')$$, '55006'),
('drop_topic', 'busy topic, force', $$SELECT outbox.drop_topic('fx.topic', true)$$, 'ok:true');

-- ---------------------------------------------------------------------------
-- Retention procedures (argument checks run before their first COMMIT) and the
-- monitoring functions.
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('purge', 'older_than negative', $$CALL outbox.purge('-1 second')$$, '22023'),
('purge', 'batch_size 0', $$CALL outbox.purge(NULL, 0)$$, '22023'),
('purge', 'batch_size NULL', $$CALL outbox.purge(NULL, NULL)$$, '22023'),
('purge', 'batch_size -1', $$CALL outbox.purge(NULL, -1)$$, '22023'),
('purge', 'batch_size max int', $$CALL outbox.purge(NULL, 2147483647)$$, '54000'),
('purge', 'inside a transaction block', $$CALL outbox.purge('1 day')$$, '2D000'),
('purge_dead', 'older_than negative', $$CALL outbox.purge_dead('-1 day')$$, '22023'),
('purge_dead', 'batch_size 0', $$CALL outbox.purge_dead(NULL, 0)$$, '22023'),
('purge_dead', 'batch_size NULL', $$CALL outbox.purge_dead(NULL, NULL)$$, '22023'),
('purge_dead', 'batch_size max int', $$CALL outbox.purge_dead(NULL, 2147483647)$$, '54000'),
('health', 'NULL thresholds', $$SELECT count(*) FROM outbox.health(NULL, NULL, NULL, NULL, NULL)$$, '22004'),
('health', 'negative thresholds', $$SELECT count(*) FROM outbox.health('-1 day', -1, '-1 day', '-1 day', -1)$$, '22023'),
('health', 'huge thresholds', $$SELECT count(*) FROM outbox.health('178000000 years', 9223372036854775807, '178000000 years', '178000000 years', 9223372036854775807)$$, '22023'),
('wakeup_status', 'no arguments', $$SELECT count(*) FROM outbox.wakeup_status()$$, 'ok:1'),
('_lock_row', 'a row', $$SELECT outbox._lock_row('outbox.subscription_catalog'::regclass::oid, (SELECT ctid FROM outbox.subscription_catalog ORDER BY name LIMIT 1))$$, 'ok:true'),
('_lock_row', 'NULL row', $$SELECT outbox._lock_row('outbox.log_exceptions'::regclass::oid, NULL)$$, 'ok:NULL'),
('_lock_row', 'no such relation', $$SELECT outbox._lock_row(0, '(0,1)')$$, '42P01'),
('_lock_row', 'a view', $$SELECT outbox._lock_row('outbox.events'::regclass::oid, '(0,1)')$$, '22023'),
('_lock_row', 'an index', $$SELECT outbox._lock_row('outbox.log_exceptions_pkey'::regclass::oid, '(0,1)')$$, '22023'),
('_lock_row', 'offset past the page', $$SELECT outbox._lock_row('outbox.log_exceptions'::regclass::oid, '(0,65535)')$$, '22023'),
('_lock_row', 'offset 0', $$SELECT outbox._lock_row('outbox.log_exceptions'::regclass::oid, '(0,0)')$$, '22023'),
('_lock_row', 'block past the end', $$SELECT outbox._lock_row('outbox.log_exceptions'::regclass::oid, '(4294967294,1)')$$, '22023');

-- ---------------------------------------------------------------------------
-- Subscriptions: the subscription argument of claim, replay, replay_dead and
-- cancel, alter_subscription, pause_subscription, resume_subscription
-- ---------------------------------------------------------------------------
INSERT INTO cases (fn, label, call, expect) VALUES
('claim', 'subscription NULL', $$SELECT count(*) FROM outbox.claim('w', 1, NULL, NULL, NULL)$$, 'ok:1'),
('claim', 'subscription default', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => 'default')$$, 'ok:1'),
('claim', 'subscription unknown', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => 'nope')$$, '42704'),
('claim', 'subscription empty', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => '')$$, '22023'),
('claim', 'subscription uppercase', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => 'Default')$$, '22023'),
('claim', 'subscription leading dash', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => '-x')$$, '22023'),
('claim', 'subscription 64 chars', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => repeat('s', 64))$$, '22023'),
('claim', 'subscription 1 MB', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => repeat('s', 1048576))$$, '22023'),
('claim', 'subscription with NUL-like escape', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => E'a\x01')$$, '22023'),
('replay', 'subscription default', $$SELECT outbox.replay(pg_temp.dead_id(), 'default')$$, 'ok:true'),
('replay', 'subscription unknown', $$SELECT outbox.replay(pg_temp.dead_id(), 'nope')$$, '42704'),
('replay', 'subscription malformed, NULL id', $$SELECT outbox.replay(NULL, 'No Such')$$, '22023'),
('replay_dead', 'subscription unknown', $$SELECT outbox.replay_dead(subscription => 'nope')$$, '42704'),
('replay_dead', 'subscription default', $$SELECT outbox.replay_dead(dry_run => true, subscription => 'default')$$, 'ok:1'),
('cancel', 'subscription default', $$SELECT outbox.cancel(pg_temp.dead_id(), 'default')$$, 'ok:true'),
('cancel', 'subscription unknown', $$SELECT outbox.cancel(pg_temp.dead_id(), 'nope')$$, '42704'),
('cancel', 'subscription malformed', $$SELECT outbox.cancel(pg_temp.dead_id(), 'a/b')$$, '22023'),
('alter_subscription', 'valid baseline', $$SELECT outbox.alter_subscription('default', max_attempts => 3, default_lease => '1 minute')$$, 'ok'),
('alter_subscription', 'all NULL settings', $$SELECT outbox.alter_subscription('default')$$, 'ok'),
('alter_subscription', 'NULL name', $$SELECT outbox.alter_subscription(NULL, max_attempts => 3)$$, '22004'),
('alter_subscription', 'unknown name', $$SELECT outbox.alter_subscription('nope', max_attempts => 3)$$, '42704'),
('alter_subscription', 'malformed name', $$SELECT outbox.alter_subscription('Nope')$$, '22023'),
('alter_subscription', 'max_attempts 0', $$SELECT outbox.alter_subscription('default', max_attempts => 0)$$, '22023'),
('alter_subscription', 'max_attempts max int', $$SELECT outbox.alter_subscription('default', max_attempts => 2147483647)$$, '22023'),
('alter_subscription', 'backoff_base zero', $$SELECT outbox.alter_subscription('default', backoff_base => '0')$$, '22023'),
('alter_subscription', 'backoff_max huge', $$SELECT outbox.alter_subscription('default', backoff_max => '178000000 years')$$, '22023'),
('alter_subscription', 'default_lease over max', $$SELECT outbox.alter_subscription('default', default_lease => '1 day')$$, '22023'),
('alter_subscription', 'valid setting, bad lease', $$SELECT outbox.alter_subscription('default', max_attempts => 2, default_lease => '-1 s')$$, '22023'),
('pause_subscription', 'valid baseline', $$SELECT outbox.pause_subscription('default')$$, 'ok:true'),
('pause_subscription', 'NULL name', $$SELECT outbox.pause_subscription(NULL)$$, '22004'),
('pause_subscription', 'unknown name', $$SELECT outbox.pause_subscription('nope')$$, '42704'),
('pause_subscription', 'malformed name', $$SELECT outbox.pause_subscription(' default')$$, '22023'),
('resume_subscription', 'not paused', $$SELECT outbox.resume_subscription('default')$$, 'ok:false'),
('resume_subscription', 'NULL name', $$SELECT outbox.resume_subscription(NULL)$$, '22004'),
('resume_subscription', 'unknown name', $$SELECT outbox.resume_subscription('nope')$$, '42704'),
('create_subscription', 'valid baseline', $$SELECT outbox.create_subscription('fresh', ARRAY['fx.*', 'a.b'], 'earliest', 3, '1 s', '1 min', '30 s', 'skip')$$, 'ok'),
('create_subscription', 'NULL name', $$SELECT outbox.create_subscription(NULL)$$, '22004'),
('create_subscription', 'NULL start', $$SELECT outbox.create_subscription('fresh', start => NULL)$$, '22004'),
('create_subscription', 'NULL topics element', $$SELECT outbox.create_subscription('fresh', ARRAY['a.b', NULL])$$, '22004'),
('create_subscription', 'malformed name', $$SELECT outbox.create_subscription('Fresh')$$, '22023'),
('create_subscription', 'empty name', $$SELECT outbox.create_subscription('')$$, '22023'),
('create_subscription', 'start tomorrow', $$SELECT outbox.create_subscription('fresh', start => 'tomorrow')$$, '22023'),
('create_subscription', 'empty topics', $$SELECT outbox.create_subscription('fresh', ARRAY[]::text[])$$, '22023'),
('create_subscription', 'bad pattern', $$SELECT outbox.create_subscription('fresh', ARRAY['a.b', 'A*'])$$, '22023'),
('create_subscription', 'multi-dimensional topics', $$SELECT outbox.create_subscription('fresh', ARRAY[['a.b'], ['c.d']])$$, '22023'),
('create_subscription', 'max_attempts 0', $$SELECT outbox.create_subscription('fresh', max_attempts => 0)$$, '22023'),
('create_subscription', 'backoff_base negative', $$SELECT outbox.create_subscription('fresh', backoff_base => '-1 s')$$, '22023'),
('create_subscription', 'default_lease over max', $$SELECT outbox.create_subscription('fresh', default_lease => '1 day')$$, '22023'),
('create_subscription', 'dead_letter_policy drop', $$SELECT outbox.create_subscription('fresh', dead_letter_policy => 'drop')$$, '22023'),
('create_subscription', 'exists', $$SELECT outbox.create_subscription('fxsub')$$, '42710'),
('create_subscription', 'default exists', $$SELECT outbox.create_subscription('default')$$, '42710'),
('create_subscription', 'max_lag zero', $$SELECT outbox.create_subscription('fresh', max_lag => '0 s')$$, '22023'),
('create_subscription', 'max_lag negative', $$SELECT outbox.create_subscription('fresh', max_lag => '-1 h')$$, '22023'),
('create_subscription', 'max_lag over 100 years', $$SELECT outbox.create_subscription('fresh', max_lag => '101 years')$$, '22023'),
('alter_subscription', 'max_lag negative', $$SELECT outbox.alter_subscription('fxsub', max_lag => '-1 h')$$, '22023'),
('alter_subscription', 'max_lag zero', $$SELECT outbox.alter_subscription('fxsub', max_lag => '0 s')$$, '22023'),
('alter_subscription', 'max_lag valid', $$SELECT outbox.alter_subscription('fxsub', max_lag => '1 h')$$, 'ok'),
('drop_subscription', 'leases in flight', $$SELECT outbox.drop_subscription('fxsub')$$, '55006'),
('drop_subscription', 'forced', $$SELECT outbox.drop_subscription('fxsub', true)$$, 'ok'),
('drop_subscription', 'NULL name', $$SELECT outbox.drop_subscription(NULL)$$, '22004'),
('drop_subscription', 'NULL force', $$SELECT outbox.drop_subscription('fxsub', NULL)$$, '22004'),
('drop_subscription', 'unknown name', $$SELECT outbox.drop_subscription('nope')$$, '42704'),
('drop_subscription', 'malformed name', $$SELECT outbox.drop_subscription('No pe')$$, '22023'),
('drop_subscription', 'default, leases in flight', $$SELECT outbox.drop_subscription('default')$$, '55006'),
('inbox_receive', 'NULL consumer', $$SELECT outbox.inbox_receive(NULL, 'm')$$, '22004'),
('inbox_receive', 'NULL message_id', $$SELECT outbox.inbox_receive('c', NULL)$$, '22004'),
('inbox_receive', 'empty consumer', $$SELECT outbox.inbox_receive('', 'm')$$, '22023'),
('inbox_receive', 'empty message_id', $$SELECT outbox.inbox_receive('c', '')$$, '22023'),
('inbox_receive', 'consumer over 200 characters', $$SELECT outbox.inbox_receive(repeat('c', 201), 'm')$$, '22023'),
('inbox_receive', 'message_id over 1000 characters', $$SELECT outbox.inbox_receive('c', repeat('m', 1001))$$, '22023'),
('inbox_receive', 'valid', $$SELECT outbox.inbox_receive('c', 'm')::text$$, 'ok:true'),
('health', 'negative backlog_critical', $$SELECT count(*) FROM outbox.health(backlog_critical => -1)$$, '22023'),
('health', 'negative dead_tuples_warn', $$SELECT count(*) FROM outbox.health(dead_tuples_warn => -1)$$, '22023'),
('blocked_subjects', 'max_rows 0', $$SELECT count(*) FROM outbox.blocked_subjects(NULL, 0)$$, '22023'),
('blocked_subjects', 'max_rows NULL', $$SELECT count(*) FROM outbox.blocked_subjects(NULL, NULL)$$, '22023'),
('blocked_subjects', 'max_rows over 100000', $$SELECT count(*) FROM outbox.blocked_subjects(NULL, 100001)$$, '22023'),
('blocked_subjects', 'malformed subscription', $$SELECT count(*) FROM outbox.blocked_subjects('Bad Name')$$, '22023'),
('blocked_subjects', 'unknown subscription', $$SELECT count(*) FROM outbox.blocked_subjects('nope')$$, '42704'),
('blocked_subjects', 'valid', $$SELECT count(*) FROM outbox.blocked_subjects()$$, 'ok:0'),
('delivered_per_minute', 'minutes 0', $$SELECT count(*) FROM outbox.delivered_per_minute(0)$$, '22023'),
('delivered_per_minute', 'minutes NULL', $$SELECT count(*) FROM outbox.delivered_per_minute(NULL)$$, '22023'),
('delivered_per_minute', 'minutes over 1440', $$SELECT count(*) FROM outbox.delivered_per_minute(1441)$$, '22023'),
('delivered_per_minute', 'unknown subscription', $$SELECT count(*) FROM outbox.delivered_per_minute(60, 'nope')$$, '42704'),
('delivered_per_minute', 'valid', $$SELECT count(*) % 60 FROM outbox.delivered_per_minute(60, 'default')$$, 'ok:0'),
('claim', 'named: unknown', $$SELECT count(*) FROM outbox.claim('w', 1, subscription => 'nope')$$, '42704'),
('claim', 'named: bad lease', $$SELECT count(*) FROM outbox.claim('w', 1, '-1 s', subscription => 'fxsub')$$, '22023'),
('claim', 'named: batch over max', $$SELECT count(*) FROM outbox.claim('w', 1000000, subscription => 'fxsub')$$, '54000'),
('claim', 'named: nothing left', $$SELECT count(*) FROM outbox.claim('w', 10, subscription => 'fxsub')$$, 'ok:0'),
('ack', 'forged log token', $$SELECT outbox.ack(1, '00000000-0001-8000-8001-000000000001')$$, 'ok:false'),
('fail', 'forged log token', $$SELECT outbox.fail(1, '00000000-0001-8000-8001-000000000001', 'x')$$, 'ok:stale'),
('extend_lease', 'forged log token', $$SELECT outbox.extend_lease(1, '00000000-0001-8000-8001-000000000001', '1 min')$$, 'ok:NULL'),
('ack', 'forged exception token', $$SELECT outbox.ack(ARRAY[1, 2], ARRAY['00000000-0000-8100-8000-000000000000', gen_random_uuid()]::uuid[])$$, 'ok:0');

-- ---------------------------------------------------------------------------
-- Run every case.
-- ---------------------------------------------------------------------------
CREATE TEMP TABLE results (n int PRIMARY KEY, got text, unchanged boolean);
DO $$
DECLARE
    c record;
    before text;
    after text;
    r text;
    got text;
BEGIN
    FOR c IN SELECT * FROM cases ORDER BY n LOOP
        before := pg_temp.fingerprint();
        got := NULL;
        BEGIN
            BEGIN
                EXECUTE c.call INTO r;
                got := CASE WHEN c.expect LIKE 'ok:%' THEN 'ok:' || coalesce(r, 'NULL') ELSE 'ok' END;
            EXCEPTION WHEN OTHERS THEN
                got := SQLSTATE;
            END;
            after := pg_temp.fingerprint();
            -- Undo whatever a successful call did, so every case sees the fixture.
            RAISE EXCEPTION USING ERRCODE = 'OUTBX', MESSAGE = got, DETAIL = after;
        EXCEPTION WHEN SQLSTATE 'OUTBX' THEN
            GET STACKED DIAGNOSTICS got = MESSAGE_TEXT, after = PG_EXCEPTION_DETAIL;
        END;
        INSERT INTO results VALUES (c.n, got, before = after);
    END LOOP;
END
$$;

-- One row per case. ok: the outcome is the expected one and, for an error, the
-- outbox tables are unchanged.
SELECT c.n, c.fn, c.label, c.expect, r.got,
       r.got = c.expect AND (r.got LIKE 'ok%' OR r.unchanged) AS ok
  FROM cases c JOIN results r USING (n)
 ORDER BY c.n;

-- Summary, and the failures on their own.
SELECT count(*) AS cases, count(*) FILTER (WHERE r.got = c.expect AND (r.got LIKE 'ok%' OR r.unchanged)) AS passed
  FROM cases c JOIN results r USING (n);
SELECT c.n, c.fn, c.label, c.expect, r.got, r.unchanged
  FROM cases c JOIN results r USING (n)
 WHERE NOT (r.got = c.expect AND (r.got LIKE 'ok%' OR r.unchanged))
 ORDER BY c.n;
-- No case raised an internal error.
SELECT count(*) AS internal_errors FROM results WHERE got LIKE 'XX%';
-- The fixture itself is intact.
SELECT f.name, e.state FROM fx f JOIN outbox.events e USING (id) ORDER BY f.id;
