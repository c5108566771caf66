-- A dump of 0.x is refused before any of its rows arrive. 1.x keeps no 0.x
-- table, so such a restore could only half succeed: some tables' rows load and
-- others fail. pg_dump writes the extension's comment right after its CREATE
-- EXTENSION and before any table's data, and every 0.x release had the same
-- comment, which 1.x no longer uses; so a COMMENT ON EXTENSION that sets it back
-- is the mark of a 0.x dump. Refused with SQLSTATE 0A000; a restore run in one
-- transaction (pg_restore --single-transaction, psql -1) then leaves nothing.
CREATE FUNCTION outbox._dump_guard() RETURNS event_trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension e
                 JOIN pg_catalog.pg_description d
                   ON d.objoid OPERATOR(pg_catalog.=) e.oid
                  AND d.classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_extension'::pg_catalog.regclass
                WHERE e.extname OPERATOR(pg_catalog.=) 'outbox_ext'
                  AND d.description OPERATOR(pg_catalog.=)
                      'Transactional outbox: publish in your transaction, claim with fenced leases, ack/fail with backoff')
    THEN
        RAISE EXCEPTION 'outbox: this is a dump of outbox_ext 0.x, which outbox_ext 1.x does not restore'
            USING ERRCODE = '0A000',
                  HINT = 'Restore it where outbox_ext 0.x is installed, drain its subscriptions there, then move to 1.x: '
                         'DROP EXTENSION outbox_ext, CREATE EXTENSION outbox_ext, create the subscriptions again.';
    END IF;
END
$$;

COMMENT ON FUNCTION outbox._dump_guard() IS
'Event trigger function (ddl_command_end, COMMENT): refuses, with SQLSTATE 0A000, the COMMENT ON EXTENSION outbox_ext that every 0.x dump carries '
'before its data, so that a 0.x dump is refused before any of its rows load. Returns nothing.';

CREATE EVENT TRIGGER outbox_dump_guard ON ddl_command_end
    WHEN TAG IN ('COMMENT')
    EXECUTE FUNCTION outbox._dump_guard();
