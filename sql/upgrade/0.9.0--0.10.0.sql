-- 0.9.0 -> 0.10.0: the default subscription can be dropped and created again,
-- over the log. The DDL no diff can derive: which storage each subscription
-- reads (0.9.0's 'default' reads the queue, every other one the log), each
-- lane's first cursor (unknown for lanes made before: NULL), the finished
-- batches' delivery record (as in sql/log.sql), and the subscriptions' age
-- cap (max_lag: a new argument of create_subscription and alter_subscription)
-- with what it cost them.

ALTER TABLE outbox.subscription_catalog
    ADD COLUMN storage text NOT NULL DEFAULT 'log' CHECK (storage IN ('queue', 'log'));
UPDATE outbox.subscription_catalog SET storage = 'queue' WHERE name = 'default';

ALTER TABLE outbox.log_lanes ADD COLUMN start_snap pg_snapshot, ADD COLUMN skips bigint[];

ALTER TABLE outbox.subscription_catalog ADD COLUMN max_lag interval CHECK (max_lag > interval '0');
ALTER TABLE outbox.subscription_activity
    ADD COLUMN lost_events bigint NOT NULL DEFAULT 0,
    ADD COLUMN lost_at timestamptz;
-- Replaced, not overloaded (calls stay unambiguous): the grants of the old
-- functions are kept here and given again on the new ones by
-- sql/upgrade/0.9.0--0.10.0.post.sql, after sql/security.sql, as in 0.7.0.
SELECT pg_catalog.set_config('outbox_ext_upgrade.acl', COALESCE((
    SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
               'old', f.old, 'new', f.new, 'grantee', a.grantee, 'grantable', a.is_grantable))
      FROM (VALUES ('outbox.create_subscription(text,text[],text,integer,interval,interval,interval,text)'::pg_catalog.regprocedure,
                    'outbox.create_subscription(text, text[], text, integer, interval, interval, interval, text, interval)'),
                   ('outbox.alter_subscription(text,integer,interval,interval,interval)'::pg_catalog.regprocedure,
                    'outbox.alter_subscription(text, integer, interval, interval, interval, interval)')) AS f(old, new)
      JOIN pg_catalog.pg_proc p ON p.oid = f.old
     CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
     WHERE a.privilege_type = 'EXECUTE')::text, '[]'), true);
DROP FUNCTION outbox.create_subscription(text, text[], text, integer, interval, interval, interval, text);
DROP FUNCTION outbox.alter_subscription(text, integer, interval, interval, interval);

CREATE TABLE outbox.log_delivered (
    subscription text        NOT NULL,
    lane         smallint    NOT NULL,
    finished_at  timestamptz NOT NULL,
    state        bytea       NOT NULL
) WITH (vacuum_truncate = false);
CREATE INDEX log_delivered_finished ON outbox.log_delivered (finished_at);
