-- After the new functions: the triggers on them (sql/restore.sql, sql/inbox.sql).
DO $$
BEGIN
    FOR n IN 0..3 LOOP
        EXECUTE pg_catalog.format($ddl$
            CREATE TRIGGER log_restored AFTER INSERT ON outbox.log_%1$s
                REFERENCING NEW TABLE AS new_rows
                FOR EACH STATEMENT EXECUTE FUNCTION outbox._log_restored();
            ALTER TABLE outbox.log_%1$s ENABLE ALWAYS TRIGGER log_restored;
        $ddl$, n);
    END LOOP;
END
$$;
CREATE TRIGGER log_lanes_restored AFTER INSERT ON outbox.log_lanes
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._log_lanes_restored();
ALTER TABLE outbox.log_lanes ENABLE ALWAYS TRIGGER log_lanes_restored;
CREATE TRIGGER log_state_restore BEFORE INSERT ON outbox.log_state
    FOR EACH ROW EXECUTE FUNCTION outbox._log_state_restore();
CREATE TRIGGER identity_restore BEFORE INSERT ON outbox.identity
    FOR EACH ROW EXECUTE FUNCTION outbox._identity_restore();
