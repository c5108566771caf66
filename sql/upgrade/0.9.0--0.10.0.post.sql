-- After the new functions and sql/security.sql: the grants of the replaced
-- create_subscription and alter_subscription, kept by sql/upgrade/0.9.0--0.10.0.sql.
DO $$
DECLARE
    g record;
BEGIN
    FOR g IN SELECT e ->> 'new' AS new, (e ->> 'grantee')::oid AS grantee, (e ->> 'grantable')::boolean AS grantable
               FROM pg_catalog.jsonb_array_elements(pg_catalog.current_setting('outbox_ext_upgrade.acl')::jsonb) AS e
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s', g.new,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident((SELECT r.rolname FROM pg_catalog.pg_roles r WHERE r.oid = g.grantee)) END,
            CASE WHEN g.grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$$;
