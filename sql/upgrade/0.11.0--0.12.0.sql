-- 0.11.0 -> 0.12.0: the DDL no diff can derive, as in sql/log.sql; the
-- functions, comments, config dumps and grants follow.

-- First of all, the locks that moving 'default' to the log takes at the end
-- (outbox._default_to_log, in the post script), in drop_subscription's order:
-- its catalog row, its activity row (claims note there before they write the
-- queue), then the queue. A publisher of 0.11.0 locks the queue before the
-- log's table it appends to, so taking the queue after the index builds
-- below (which lock the ring tables) would deadlock with it (found by review).
-- From here on publishers of the queue wait for this transaction. (Inline:
-- outbox._lock_queue_default, which does the same, is created further down.)
DO $$
DECLARE
    sub text;
BEGIN
    SELECT c.name INTO sub FROM outbox.subscription_catalog c WHERE c.storage = 'queue' FOR UPDATE;
    IF FOUND THEN
        PERFORM outbox._log_forget(sub, false);
        LOCK TABLE outbox.event_queue IN SHARE ROW EXCLUSIVE MODE;
    END IF;
END
$$;

-- Delayed events of the log ring, for the background worker's wake-ups.
DO $$
BEGIN
    FOR n IN 0..3 LOOP
        EXECUTE pg_catalog.format(
            'CREATE INDEX log_%1$s_deliver_at ON outbox.log_%1$s (deliver_at) WHERE deliver_at IS NOT NULL', n);
    END LOOP;
END
$$;
