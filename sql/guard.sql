-- DROP EXTENSION guard (issue 9). PostgreSQL has no hook that vetoes dropping an
-- extension, so an event trigger owned by the extension inspects DROP EXTENSION
-- commands before they run. Dropping outbox_ext while events are pending or
-- leased raises 55006 unless the command says CASCADE or the session set
-- outbox.allow_drop = on. The check reads the command text (current_query()), so
-- it cannot see a drop issued by a function that builds the statement itself;
-- DROP SCHEMA outbox CASCADE also bypasses it. Both are documented in the README.

CREATE FUNCTION outbox._drop_guard() RETURNS event_trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    q text := lower(COALESCE(current_query(), ''));
    n bigint;
BEGIN
    IF q !~ 'outbox_ext' OR q ~ '\mcascade\M' OR current_setting('outbox.allow_drop', true) = 'on' THEN
        RETURN;
    END IF;
    SELECT count(*) INTO n FROM outbox.event_queue e WHERE e.state <> 'dead';
    IF n > 0 THEN
        RAISE EXCEPTION 'outbox: % undelivered events would be lost by DROP EXTENSION outbox_ext', n
            USING ERRCODE = '55006',
                  HINT = 'Drain or cancel them first, or say DROP EXTENSION outbox_ext CASCADE, or SET outbox.allow_drop = on.';
    END IF;
END
$$;

COMMENT ON FUNCTION outbox._drop_guard() IS
'Event trigger function: refuses DROP EXTENSION outbox_ext (SQLSTATE 55006) while pending or leased events exist, unless CASCADE or outbox.allow_drop = on.';

CREATE EVENT TRIGGER outbox_drop_guard ON ddl_command_start
    WHEN TAG IN ('DROP EXTENSION')
    EXECUTE FUNCTION outbox._drop_guard();
