-- Retention of what the subscriptions keep of their own: purge (rows of
-- events delivered after a retry, and the finished batches' delivery records),
-- purge_dead (dead and cancelled rows), per-topic windows, dispatch-key
-- lifetime, run_maintenance and the maintenance log. The events themselves
-- live in the log, whose retention truncates ring tables whole
-- (pg_test/py/test_log.py); a row is kept while the log holds its event.
-- Ages are faked by moving timestamps back; pg_temp.forget_log() empties the
-- ring as its retention would.
\i sql/prologue.inc

-- One event per outcome for 'default' (payload names it), each with a
-- dispatch key named after it: pending, delayed, leased, retry (a row pending
-- a retry), dead, delivered (acked from its batch), redelivered (a row acked
-- after a retry), cancelled. A claim hands out committed events only: each
-- step commits.
CREATE PROCEDURE pg_temp.states(t text DEFAULT 'ret') LANGUAGE plpgsql AS $$
BEGIN
    PERFORM outbox.publish(t, '"delayed"', dispatch_key => t || ':delayed', deliver_at => now() + interval '1 hour');
    PERFORM outbox.publish_batch(t, ARRAY['"leased"', '"retry"', '"dead"', '"delivered"', '"redelivered"', '"cancelled"']::jsonb[],
                                 dispatch_keys => ARRAY[t || ':leased', t || ':retry', t || ':dead', t || ':delivered', t || ':redelivered', t || ':cancelled']);
    COMMIT;
    PERFORM CASE c.payload
              WHEN '"delivered"' THEN outbox.ack(c.id, c.lease_token)::text
              WHEN '"dead"' THEN outbox.fail(c.id, c.lease_token, 'x', permanent => true)
              WHEN '"redelivered"' THEN outbox.fail(c.id, c.lease_token, 'x', retry_in => '0')
              WHEN '"retry"' THEN outbox.fail(c.id, c.lease_token, 'x', retry_in => '1 hour')
              WHEN '"cancelled"' THEN outbox.fail(c.id, c.lease_token, 'x', retry_in => '1 hour')
            END
       FROM outbox.claim('w', 10, interval '1 hour', ARRAY[t]) c;
    COMMIT;
    PERFORM outbox.ack(c.id, c.lease_token) FROM outbox.claim('w', 10, interval '1 hour', ARRAY[t]) c
      WHERE c.payload = '"redelivered"';
    COMMIT;
    PERFORM outbox.cancel(e.id) FROM outbox.events e WHERE e.topic = t AND e.payload = '"cancelled"';
    PERFORM outbox.publish(t, '"pending"', dispatch_key => t || ':pending');
END $$;

-- Moves every timestamp of topic t's rows, delivery records and keys back by age.
CREATE FUNCTION pg_temp.age(t text, age interval) RETURNS void LANGUAGE sql AS $$
    UPDATE outbox.log_exceptions SET published_at = published_at - age, delivered_at = delivered_at - age,
                                     dead_at = dead_at - age, cancelled_at = cancelled_at - age
     WHERE topic = t;
    UPDATE outbox.log_delivered SET finished_at = finished_at - age;
    UPDATE outbox.dispatch_keys k SET created_at = created_at - age
      FROM outbox.events e WHERE e.id = k.event_id AND e.topic = t;
$$;

-- The ring emptied, as the log's retention empties it: the events leave the
-- log, the rows of their own stay.
CREATE PROCEDURE pg_temp.forget_log() LANGUAGE sql AS $$
    TRUNCATE outbox.log_0, outbox.log_1, outbox.log_2, outbox.log_3;
$$;

CREATE VIEW pg_temp.summary AS
SELECT topic, payload #>> '{}' AS event, state FROM outbox.events ORDER BY topic, id;

-- ---------------------------------------------------------------------------
-- While the log holds the events, nothing of theirs goes, however old.
-- ---------------------------------------------------------------------------
CALL pg_temp.states();
SELECT * FROM pg_temp.summary;
SELECT pg_temp.age('ret', '400 days');
CALL outbox.purge();
CALL outbox.purge_dead('0');
SELECT * FROM pg_temp.summary;
SELECT count(*) AS delivery_records FROM outbox.log_delivered;

-- ---------------------------------------------------------------------------
-- Once the log no longer holds them: purge takes the delivered rows and the
-- delivery records, purge_dead the dead and cancelled rows; pending rows stay.
-- ---------------------------------------------------------------------------
CALL pg_temp.forget_log();
SELECT * FROM pg_temp.summary;
CALL outbox.purge();
SELECT * FROM pg_temp.summary;
SELECT count(*) AS delivery_records FROM outbox.log_delivered;
CALL outbox.purge_dead();
SELECT * FROM pg_temp.summary;
-- purge's last step removes the keys of events that have no row of their own
-- and that the log no longer holds: the dead and cancelled ones' keys wait for
-- the next purge; those of the rows still pending stay
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
CALL outbox.purge();
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;

-- ---------------------------------------------------------------------------
-- Windows: older_than, the topic's retention, the GUCs.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset();
SELECT outbox.create_topic('win.short', retention_delivered => '1 day', retention_dead => '2 days');
SELECT outbox.create_topic('win.zero', retention_delivered => '0', retention_dead => '0');
SELECT outbox.create_topic('win.unset');
-- per topic: a row delivered after a retry and a dead one, finished/died 3
-- days ago, and a fresh pair; then the ring is emptied
CREATE PROCEDURE pg_temp.pairs() LANGUAGE plpgsql AS $$
DECLARE t text;
BEGIN
    CALL pg_temp.reset();
    FOREACH t IN ARRAY ARRAY['win.short', 'win.zero', 'win.unset', 'win.unregistered'] LOOP
        PERFORM outbox.publish_batch(t, ARRAY['"old delivered"', '"old dead"', '"new delivered"', '"new dead"']::jsonb[]);
    END LOOP;
    COMMIT;
    PERFORM CASE WHEN c.payload #>> '{}' LIKE '%delivered' THEN outbox.fail(c.id, c.lease_token, 'x', retry_in => '0')
                 ELSE outbox.fail(c.id, c.lease_token, 'x', permanent => true) END
       FROM outbox.claim('w', 100) c;
    COMMIT;
    PERFORM outbox.ack(c.id, c.lease_token) FROM outbox.claim('w', 100) c;
    COMMIT;
    UPDATE outbox.log_exceptions SET delivered_at = delivered_at - interval '3 days', dead_at = dead_at - interval '3 days'
     WHERE payload #>> '{}' LIKE 'old%';
    UPDATE outbox.log_exceptions SET dead_at = dead_at - interval '1 minute' WHERE payload #>> '{}' LIKE 'new%';
    CALL pg_temp.forget_log();
END $$;
CREATE VIEW pg_temp.left_over AS
SELECT topic, string_agg(payload #>> '{}', ', ' ORDER BY id) AS events FROM outbox.events GROUP BY topic ORDER BY topic;
CALL pg_temp.pairs();
SELECT * FROM pg_temp.left_over;
-- topic windows (short: 1 day, zero: 0) and the GUC default (7 days) elsewhere
CALL outbox.purge();
CALL outbox.purge_dead();
SELECT * FROM pg_temp.left_over;
-- the GUC applies to topics without a window of their own
CALL pg_temp.pairs();
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
CALL pg_temp.pairs();
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
SELECT count(*) FILTER (WHERE outbox.fail(id, lease_token, 'x', retry_in => '0') = 'pending') AS retried FROM outbox.claim('w', 20);
SELECT count(*) FILTER (WHERE outbox.ack(id, lease_token)) AS acked FROM outbox.claim('w', 20);
SELECT count(*) FILTER (WHERE outbox.fail(id, lease_token, 'x', permanent => true) = 'dead') AS killed FROM outbox.claim('w', 5);
CALL pg_temp.forget_log();
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
-- Dispatch keys: kept while the log holds their event; removed once it does
-- not and the event has no row of its own (outbox.retention_dispatch_keys = 0),
-- or kept for the key window, then removed as orphans.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset(restart => true);
SELECT outbox.publish('keys', '"d1"', dispatch_key => 'key-delivered') AS d1;
SELECT outbox.publish('keys', '"x1"', dispatch_key => 'key-dead') AS x1;
SELECT CASE payload WHEN '"d1"' THEN outbox.ack(id, lease_token)::text
                    ELSE outbox.fail(id, lease_token, 'x', permanent => true) END AS outcome
  FROM outbox.claim('w', 10) ORDER BY id;
-- the log holds both events: their keys stay
CALL outbox.purge('0');
CALL outbox.purge_dead('0');
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
SELECT outbox.publish('keys', '"d1 again"', dispatch_key => 'key-delivered') AS deduplicated;
-- the log empties: the delivered event's key goes at once, the dead one's
-- with its row
CALL pg_temp.forget_log();
CALL outbox.purge('0');
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
CALL outbox.purge_dead('0');
CALL outbox.purge('0');
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
-- so the keys are free again: a new publish inserts a new event
SELECT outbox.publish('keys', '"d2"', dispatch_key => 'key-delivered') > 2 AS new_delivered_event;
SELECT outbox.publish('keys', '"x2"', dispatch_key => 'key-dead') > 2 AS new_dead_event;

-- keeping keys for a day: the events go, the keys stay and still deduplicate
CALL pg_temp.reset(restart => true);
SET outbox.retention_dispatch_keys = '1d';
SELECT outbox.publish('keys', '"k1"', dispatch_key => 'kept-1') AS k1;
SELECT outbox.publish('keys', '"k2"', dispatch_key => 'kept-2') AS k2;
SELECT outbox.ack(id, lease_token) FROM outbox.claim('w', 10) ORDER BY id;
CALL pg_temp.forget_log();
CALL outbox.purge('0');
SELECT count(*) AS events, (SELECT count(*) FROM outbox.dispatch_keys) AS keys FROM outbox.events;
SELECT outbox.publish('keys', '"k1 again"', dispatch_key => 'kept-1') AS dedup_after_purge;
SELECT count(*) AS events FROM outbox.events;
-- once a key is older than the window it is removed as an orphan
UPDATE outbox.dispatch_keys SET created_at = now() - interval '25 hours' WHERE dispatch_key = 'kept-1';
CALL outbox.purge('0');
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
SELECT outbox.publish('keys', '"k1 new"', dispatch_key => 'kept-1') > 2 AS new_event_after_window;
-- keys of events the log holds are never orphans, however old
UPDATE outbox.dispatch_keys SET created_at = now() - interval '400 days';
CALL outbox.purge('0');
SELECT dispatch_key FROM outbox.dispatch_keys ORDER BY 1;
RESET outbox.retention_dispatch_keys;

-- ---------------------------------------------------------------------------
-- run_maintenance and the maintenance log.
-- ---------------------------------------------------------------------------
CALL pg_temp.reset(topics => true);
SELECT count(*) FROM outbox.publish_batch('maint', ARRAY['1', '2', '3', '4', '5']::jsonb[],
                                          dispatch_keys => ARRAY['m1', 'm2', 'm3', 'm4', 'm5']);
SELECT count(*) FROM outbox.claim('w', 10) c
 WHERE CASE WHEN c.payload::int <= 3 THEN outbox.fail(c.id, c.lease_token, 'x', retry_in => '0') = 'pending'
            ELSE outbox.fail(c.id, c.lease_token, 'x', permanent => true) = 'dead' END;
SELECT count(*) FILTER (WHERE outbox.ack(id, lease_token)) AS acked FROM outbox.claim('w', 10);
CALL pg_temp.forget_log();
-- 2 delivered and 1 dead are past the default windows (7 and 30 days)
UPDATE outbox.log_exceptions SET delivered_at = delivered_at - interval '8 days' WHERE payload::int <= 2;
UPDATE outbox.log_exceptions SET dead_at = dead_at - interval '31 days' WHERE payload::int = 4;
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
