-- 0.6.0 -> 0.7.0: subscriptions (the catalog, the 'default' subscription that
-- every existing event belongs to, pausing and per-subscription policy).
--
-- claim, replay, replay_dead and cancel gain a trailing subscription argument.
-- They are replaced, not overloaded, so that every call stays unambiguous; a
-- DROP loses the grants of the old function, so they are kept in a
-- transaction-local setting here and granted again on the new signature by
-- sql/upgrade/0.6.0--0.7.0.post.sql, after sql/security.sql.
SELECT pg_catalog.set_config('outbox_ext_upgrade.acl', COALESCE((
    SELECT pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
               'old', f.old, 'new', f.new, 'grantee', a.grantee, 'grantable', a.is_grantable))
      FROM (VALUES ('outbox.claim(text,integer,interval,text[])'::pg_catalog.regprocedure,
                    'outbox.claim(text, integer, interval, text[], text)'),
                   ('outbox.replay(bigint)'::pg_catalog.regprocedure, 'outbox.replay(bigint, text)'),
                   ('outbox.replay_dead(text,timestamptz,timestamptz,boolean)'::pg_catalog.regprocedure,
                    'outbox.replay_dead(text, timestamptz, timestamptz, boolean, text)'),
                   ('outbox.cancel(bigint)'::pg_catalog.regprocedure, 'outbox.cancel(bigint, text)')) AS f(old, new)
      JOIN pg_catalog.pg_proc p ON p.oid = f.old
     CROSS JOIN LATERAL pg_catalog.aclexplode(p.proacl) AS a
     WHERE a.privilege_type = 'EXECUTE')::text, '[]'), true);

DROP FUNCTION outbox.claim(text, integer, interval, text[]);
DROP FUNCTION outbox.replay(bigint);
DROP FUNCTION outbox.replay_dead(text, timestamptz, timestamptz, boolean);
DROP FUNCTION outbox.cancel(bigint);

CREATE TABLE outbox.subscription_catalog (
    name                text PRIMARY KEY,
    max_attempts        integer CHECK (max_attempts BETWEEN 1 AND 1000000),
    backoff_base        interval CHECK (backoff_base > interval '0'),
    backoff_max         interval CHECK (backoff_max > interval '0'),
    default_lease       interval CHECK (default_lease > interval '0'),
    paused              boolean NOT NULL DEFAULT false,
    paused_at           timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now()
) WITH (vacuum_truncate = false);
INSERT INTO outbox.subscription_catalog (name) VALUES ('default');

CREATE TABLE outbox.subscription_activity (
    name           text PRIMARY KEY,
    last_claim_at  timestamptz
) WITH (fillfactor = 50, vacuum_truncate = false);
INSERT INTO outbox.subscription_activity (name) VALUES ('default');
