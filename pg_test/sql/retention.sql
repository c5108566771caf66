-- Retention: purge (delivered + cancelled), purge_dead, per-topic windows,
-- dispatch-key lifetime, run_maintenance and the maintenance log.
-- Ages are faked by moving timestamps back on the underlying tables.
\i sql/prologue.inc
-- The queue's row retention, against a 'default' that reads outbox.event_queue
-- (an install before 0.12.0, until the upgrade moves it). The log's retention
-- truncates ring tables: pg_test/py/test_log.py.
CALL pg_temp.default_on_queue();

-- One event per state (payload names it), each with a dispatch key named after it:
-- pending, delayed, leased, expired (leased, lease long gone), retry (pending,
-- retry scheduled), dead, delivered, cancelled.
CREATE FUNCTION pg_temp.states(t text DEFAULT 'ret') RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM outbox.publish(t, '"delayed"', dispatch_key => t || ':delayed', deliver_at => now() + interval '1 hour');
    PERFORM outbox.publish_batch(t, ARRAY['"leased"', '"expired"', '"retry"', '"dead"', '"delivered"', '"cancelled"']::jsonb[],
                                 dispatch_keys => ARRAY[t || ':leased', t || ':expired', t || ':retry', t || ':dead', t || ':delivered', t || ':cancelled']);
    PERFORM outbox.fail(c.id, c.lease_token, 'x', retry_in => '1 hour')
       FROM outbox.claim('w', 10, interval '1 hour', ARRAY[t]) c
      WHERE CASE c.payload
              WHEN '"delivered"' THEN outbox.ack(c.id, c.lease_token) IS NULL
              WHEN '"dead"' THEN outbox.fail(c.id, c.lease_token, 'x', permanent => true) IS NULL
              WHEN '"retry"' THEN true
              WHEN '"cancelled"' THEN true
              ELSE false
            END;
    PERFORM outbox.cancel(id) FROM outbox.event_queue WHERE topic = t AND payload = '"cancelled"';
    PERFORM outbox.publish(t, '"pending"', dispatch_key => t || ':pending');
END $$;

-- Moves every timestamp of topic t's events back by age.
CREATE FUNCTION pg_temp.age(t text, age interval) RETURNS void LANGUAGE sql AS $$
    UPDATE outbox.event_queue SET published_at = published_at - age, visible_at = visible_at - age,
                                  leased_at = leased_at - age, dead_at = dead_at - age
     WHERE topic = t AND payload <> '"expired"';
    -- the expired lease: lease long gone, not yet reclaimed
    UPDATE outbox.event_queue SET published_at = published_at - age, visible_at = now() - age, leased_at = now() - age
     WHERE topic = t AND payload = '"expired"';
    UPDATE outbox.event_archive SET published_at = published_at - age, finished_at = finished_at - age WHERE topic = t;
    UPDATE outbox.dispatch_keys k SET created_at = created_at - age
      FROM outbox.events e WHERE e.id = k.event_id AND e.topic = t;
$$;

CREATE VIEW pg_temp.summary AS
SELECT topic, payload #>> '{}' AS event, state FROM outbox.events ORDER BY topic, id;

-- ---------------------------------------------------------------------------
-- purge: only delivered and cancelled, however old the others are.
-- ---------------------------------------------------------------------------
SELECT pg_temp.states();
SELECT * FROM pg_temp.summary;
SELECT pg_temp.age('ret', '400 days');
-- a hostile extra: dead_at on live rows must not matter either
UPDATE outbox.event_queue SET dead_at = now() - interval '400 days' WHERE state <> 'dead';
-- default window (7 days) and an explicit one
CALL outbox.purge();
SELECT * FROM pg_temp.summary;
SELECT pg_temp.states('ret2');
SELECT pg_temp.age('ret2', '400 days');
CALL outbox.purge('0', 1);
SELECT * FROM pg_temp.summary WHERE topic = 'ret2';
-- purge_dead: only dead
CALL outbox.purge_dead();
SELECT * FROM pg_temp.summary;
-- nothing older than 0 is left to remove but live events
CALL outbox.purge('0');
CALL outbox.purge_dead('0');
SELECT * FROM pg_temp.summary;
-- their dispatch keys went with them; the live events keep theirs
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
-- and the events are still fully usable
SELECT count(*) AS claimed FROM outbox.claim('w', 100) c WHERE outbox.ack(c.id, c.lease_token);
SELECT * FROM pg_temp.summary;

-- ---------------------------------------------------------------------------
-- Windows: older_than, the topic's retention, the GUCs.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset();
SELECT outbox.create_topic('win.short', retention_delivered => '1 day', retention_dead => '2 days');
SELECT outbox.create_topic('win.zero', retention_delivered => '0', retention_dead => '0');
SELECT outbox.create_topic('win.unset');
-- per topic: a delivered and a dead event, finished/died 3 days ago, and a fresh pair
CREATE FUNCTION pg_temp.pairs() RETURNS void LANGUAGE plpgsql AS $$
DECLARE t text;
BEGIN
    CALL pg_temp.reset();
    FOREACH t IN ARRAY ARRAY['win.short', 'win.zero', 'win.unset', 'win.unregistered'] LOOP
        PERFORM outbox.publish_batch(t, ARRAY['"old delivered"', '"old dead"', '"new delivered"', '"new dead"']::jsonb[]);
    END LOOP;
    PERFORM CASE WHEN c.payload #>> '{}' LIKE '%delivered' THEN outbox.ack(c.id, c.lease_token)::text
                 ELSE outbox.fail(c.id, c.lease_token, 'x', permanent => true) END
       FROM outbox.claim('w', 100) c;
    UPDATE outbox.event_archive SET finished_at = finished_at - interval '3 days' WHERE payload #>> '{}' LIKE 'old%';
    UPDATE outbox.event_queue SET dead_at = dead_at - interval '3 days' WHERE payload #>> '{}' LIKE 'old%';
    UPDATE outbox.event_queue SET dead_at = dead_at - interval '1 minute' WHERE payload #>> '{}' LIKE 'new%';
END $$;
CREATE VIEW pg_temp.left_over AS
SELECT topic, string_agg(payload #>> '{}', ', ' ORDER BY id) AS events FROM outbox.events GROUP BY topic ORDER BY topic;
SELECT pg_temp.pairs();
-- topic windows (short: 1 day, zero: 0) and the GUC default (7 days) elsewhere
CALL outbox.purge();
CALL outbox.purge_dead();
SELECT * FROM pg_temp.left_over;
-- the GUC applies to topics without a window of their own
SELECT pg_temp.pairs();
SET outbox.retention_delivered = '2d';
SET outbox.retention_dead = '4d';
CALL outbox.purge();
CALL outbox.purge_dead();
SELECT * FROM pg_temp.left_over;
SET outbox.retention_dead = '0';
CALL outbox.purge_dead();
SELECT * FROM pg_temp.left_over;
RESET outbox.retention_delivered;
RESET outbox.retention_dead;
-- an explicit older_than overrides every window
SELECT pg_temp.pairs();
CALL outbox.purge('5 days');
CALL outbox.purge_dead('5 days');
SELECT * FROM pg_temp.left_over;
CALL outbox.purge('2 days');
SELECT * FROM pg_temp.left_over;
CALL outbox.purge_dead('30 seconds');
SELECT * FROM pg_temp.left_over;

-- ---------------------------------------------------------------------------
-- Batches: removed is the total; small batches loop until done.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset();
SELECT count(*) FROM outbox.publish_batch('batchy', (SELECT array_agg(to_jsonb(g)) FROM generate_series(1, 25) g));
SELECT count(*) FILTER (WHERE outbox.ack(id, lease_token)) AS acked FROM outbox.claim('w', 20);
SELECT count(*) FILTER (WHERE outbox.fail(id, lease_token, 'x', permanent => true) = 'dead') AS killed FROM outbox.claim('w', 5);
CALL outbox.purge('0', 3);
CALL outbox.purge_dead('0', 2);
SELECT count(*) AS left_over FROM outbox.events;
CALL outbox.purge('0', 3);
-- argument errors
SELECT label, pg_temp.try_result(stmt) AS result
  FROM (VALUES
    (1, 'negative older_than', $$SELECT outbox._purge_step('delivered', '-1 second', 10)$$),
    (2, 'batch_size 0', $$SELECT outbox._purge_step('delivered', NULL, 0)$$),
    (3, 'batch_size NULL', $$SELECT outbox._purge_step('dead', NULL, NULL)$$),
    (4, 'batch_size over max', $$SELECT outbox._purge_step('dead', NULL, 10001)$$),
    (5, 'bad kind', $$SELECT outbox._purge_step('pending', NULL, 10)$$),
    (6, 'NULL kind', $$SELECT outbox._purge_step(NULL, NULL, 10)$$)
  ) AS v(n, label, stmt)
 ORDER BY n;
CALL outbox.purge('-1 day');
CALL outbox.purge(NULL, 0);
CALL outbox.purge(NULL, -5);
CALL outbox.purge(NULL, 10001);
CALL outbox.purge_dead('-1 day');
CALL outbox.purge_dead(NULL, 0);
CALL outbox.purge_dead(NULL, 10001);
-- the procedures commit, so they refuse to run inside a transaction block
BEGIN;
CALL outbox.purge('0');
ROLLBACK;

-- ---------------------------------------------------------------------------
-- Dispatch keys: removed with their events (outbox.retention_dispatch_keys = 0),
-- or kept for the key window, then removed as orphans.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset(restart => true);
SELECT outbox.publish('keys', '"d1"', dispatch_key => 'key-delivered') AS d1;
SELECT outbox.publish('keys', '"x1"', dispatch_key => 'key-dead') AS x1;
SELECT outbox.publish('keys', '"c1"', dispatch_key => 'key-cancelled', deliver_at => now() + interval '1 day') AS c1;
SELECT CASE payload WHEN '"d1"' THEN outbox.ack(id, lease_token)::text
                    ELSE outbox.fail(id, lease_token, 'x', permanent => true) END AS outcome
  FROM outbox.claim('w', 10) ORDER BY id;
SELECT outbox.cancel(3);
-- default: key rows go with their events
CALL outbox.purge('0');
CALL outbox.purge_dead('0');
SELECT count(*) AS events, (SELECT count(*) FROM outbox.dispatch_keys) AS keys FROM outbox.events;
-- so the keys are free again: a new publish inserts a new event
SELECT outbox.publish('keys', '"d2"', dispatch_key => 'key-delivered') > 3 AS new_delivered_event;
SELECT outbox.publish('keys', '"x2"', dispatch_key => 'key-dead') > 3 AS new_dead_event;
SELECT outbox.publish('keys', '"c2"', dispatch_key => 'key-cancelled') > 3 AS new_cancelled_event;
SELECT payload, dispatch_key FROM outbox.events ORDER BY id;

-- keeping keys for a day: the events go, the keys stay and still deduplicate
CALL pg_temp.reset(restart => true);
SET outbox.retention_dispatch_keys = '1d';
SELECT outbox.publish('keys', '"k1"', dispatch_key => 'kept-1') AS k1;
SELECT outbox.publish('keys', '"k2"', dispatch_key => 'kept-2') AS k2;
SELECT outbox.ack(id, lease_token) FROM outbox.claim('w', 10) ORDER BY id;
CALL outbox.purge('0');
SELECT count(*) AS events, (SELECT count(*) FROM outbox.dispatch_keys) AS keys FROM outbox.events;
SELECT outbox.publish('keys', '"k1 again"', dispatch_key => 'kept-1') AS dedup_after_purge;
SELECT count(*) AS events FROM outbox.events;
-- once a key is older than the window it is removed as an orphan
UPDATE outbox.dispatch_keys SET created_at = now() - interval '25 hours' WHERE dispatch_key = 'kept-1';
CALL outbox.purge('0');
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
SELECT outbox.publish('keys', '"k1 new"', dispatch_key => 'kept-1') > 2 AS new_event_after_window;
-- keys of retained events are never orphans, however old
UPDATE outbox.dispatch_keys SET created_at = now() - interval '400 days';
CALL outbox.purge('0');
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
-- a key older than the window goes with its event at once
SELECT outbox.ack(id, lease_token) FROM outbox.claim('w', 10);
CALL outbox.purge('0');
SELECT count(*) AS keys FROM outbox.dispatch_keys;
RESET outbox.retention_dispatch_keys;

-- ---------------------------------------------------------------------------
-- run_maintenance and the maintenance log.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset(topics => true);
SELECT count(*) FROM outbox.publish_batch('maint', ARRAY['1', '2', '3', '4', '5']::jsonb[],
                                          dispatch_keys => ARRAY['m1', 'm2', 'm3', 'm4', 'm5']);
SELECT count(*) FROM outbox.claim('w', 10) c
 WHERE CASE WHEN c.payload::int <= 3 THEN outbox.ack(c.id, c.lease_token)
            ELSE outbox.fail(c.id, c.lease_token, 'x', permanent => true) = 'dead' END;
-- 2 delivered and 1 dead are past the default windows (7 and 30 days)
UPDATE outbox.event_archive SET finished_at = finished_at - interval '8 days' WHERE payload::int <= 2;
UPDATE outbox.event_queue SET dead_at = dead_at - interval '31 days' WHERE payload::int = 4;
CALL outbox.run_maintenance();
SELECT run_id, finished_at >= started_at AS finished, purged_delivered, purged_dead, purged_keys, error
  FROM outbox.maintenance_log ORDER BY run_id;
SELECT payload, state FROM outbox.events ORDER BY id;
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
CALL outbox.run_maintenance();
SELECT run_id, purged_delivered, purged_dead, purged_keys, error FROM outbox.maintenance_log ORDER BY run_id;

-- A new session whose first outbox call is a procedure (the library is not
-- loaded yet in that backend unless preloaded).
\c -
SET outbox.notify = off;
CALL outbox.purge('0');
CALL outbox.purge_dead('0');
CALL outbox.run_maintenance();
SELECT count(*) AS runs FROM outbox.maintenance_log;
