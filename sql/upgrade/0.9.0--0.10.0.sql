-- 0.9.0 -> 0.10.0: the default subscription can be dropped and created again,
-- over the log. The DDL no diff can derive: which storage each subscription
-- reads (0.9.0's 'default' reads the queue, every other one the log), and each
-- lane's first cursor (unknown for lanes made before: NULL).

ALTER TABLE outbox.subscription_catalog
    ADD COLUMN storage text NOT NULL DEFAULT 'log' CHECK (storage IN ('queue', 'log'));
UPDATE outbox.subscription_catalog SET storage = 'queue' WHERE name = 'default';

ALTER TABLE outbox.log_lanes ADD COLUMN start_snap pg_snapshot;
