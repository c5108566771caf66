-- After the new functions and sql/security.sql: the catalog's triggers (the
-- restore trigger's function is new in this version), and the grants of the
-- replaced functions.
CREATE TRIGGER subscription_restore BEFORE INSERT ON outbox.subscription_catalog
    FOR EACH ROW EXECUTE FUNCTION outbox._subscription_restore();
CREATE TRIGGER subscriptions_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.subscription_catalog
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._topics_changed();
-- Both cache triggers fire under session_replication_role = replica too.
ALTER TABLE outbox.subscription_catalog ENABLE ALWAYS TRIGGER subscriptions_changed;
ALTER TABLE outbox.topics ENABLE ALWAYS TRIGGER topics_changed;

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
