-- Claims never wait: claim and head promotion lock rows with outbox._lock_row,
-- which never follows a row's update chain (FOR UPDATE SKIP LOCKED does, and then
-- waits for the transaction changing a newer version). Comments cite public
-- sources instead of internal documents; health()'s body comment changed too.
-- The topic grammar has one definition: _pattern_kind and _check_topic are C.

-- Vacuum never truncates a table the hot path uses (event_queue already): the
-- truncation's ACCESS EXCLUSIVE lock made claims wait (the concurrency checker's
-- 30-minute run saw it on subject_repairs).
ALTER TABLE outbox.topics SET (vacuum_truncate = false);
ALTER TABLE outbox.event_archive SET (vacuum_truncate = false);
ALTER TABLE outbox.dispatch_keys SET (vacuum_truncate = false);
ALTER TABLE outbox.subject_repairs SET (vacuum_truncate = false);
