-- 0.11.0 -> 0.12.0: the DDL no diff can derive, as in sql/log.sql; the
-- functions, comments, config dumps and grants follow.

-- Delayed events of the log ring, for the background worker's wake-ups.
DO $$
BEGIN
    FOR n IN 0..3 LOOP
        EXECUTE pg_catalog.format(
            'CREATE INDEX log_%1$s_deliver_at ON outbox.log_%1$s (deliver_at) WHERE deliver_at IS NOT NULL', n);
    END LOOP;
END
$$;
