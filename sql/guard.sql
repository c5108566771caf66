-- DROP EXTENSION guard. PostgreSQL has no hook that vetoes dropping an
-- extension, so an event trigger owned by the extension inspects DROP EXTENSION
-- commands before they run. Dropping outbox_ext while events are pending,
-- leased or dead raises 55006 unless the command says CASCADE or the session set
-- outbox.allow_drop = on. The check reads the command text (current_query()), so
-- it cannot see a drop issued by a function that builds the statement itself;
-- DROP SCHEMA outbox CASCADE also bypasses it. Both are documented in the README.

CREATE FUNCTION outbox._drop_guard() RETURNS event_trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- The command text without comments, lowercased; then only the DROP EXTENSION
    -- statements that name outbox_ext, so a CASCADE elsewhere in a multi-statement
    -- string does not count.
    q text := lower(regexp_replace(regexp_replace(COALESCE(current_query(), ''),
                                                  '/\*.*?\*/', ' ', 'g'),
                                   '--[^\n]*', ' ', 'g'));
    stmt text;
    names_us boolean := false;
    cascade boolean := false;
    allow text := lower(COALESCE(current_setting('outbox.allow_drop', true), 'off'));
    n bigint;
BEGIN
    FOR stmt IN SELECT m[1] FROM regexp_matches(q, '(drop\s+extension\s[^;]*)', 'g') AS m LOOP
        IF stmt ~ '\moutbox_ext\M' THEN
            names_us := true;
            -- CASCADE as the drop behaviour ends the statement after a name; after a
            -- comma it is a name in the list (DROP EXTENSION IF EXISTS a, cascade).
            cascade := cascade OR stmt ~ '[^,\s]\s+cascade\s*$';
        END IF;
    END LOOP;
    IF NOT names_us OR cascade OR allow IN ('on', 'true', 'yes', '1', 't', 'y', 'tr', 'tru', 'ye') THEN
        RETURN;
    END IF;
    -- Every subscription: what it has not delivered, and its dead letters.
    SELECT COALESCE((SELECT sum(s.lag_events + s.dead_letters) FROM outbox.subscriptions s), 0)
      INTO n;
    IF n > 0 THEN
        RAISE EXCEPTION 'outbox: % undelivered events (pending, leased or dead) would be lost by DROP EXTENSION outbox_ext', n
            USING ERRCODE = '55006',
                  HINT = 'Drain, cancel or purge them first, or say DROP EXTENSION outbox_ext CASCADE, or SET outbox.allow_drop = on.';
    END IF;
END
$$;

COMMENT ON FUNCTION outbox._drop_guard() IS
'Event trigger function: refuses DROP EXTENSION outbox_ext (SQLSTATE 55006) while a subscription has pending, leased or dead events (not yet read from the log included), unless the DROP EXTENSION statement says CASCADE or outbox.allow_drop = on.';

CREATE EVENT TRIGGER outbox_drop_guard ON ddl_command_start
    WHEN TAG IN ('DROP EXTENSION')
    EXECUTE FUNCTION outbox._drop_guard();

-- Per-subject order relies on ids being drawn in the order publishers take the
-- subject lock; with a sequence CACHE above 1 each backend pre-allocates a block
-- of ids, and a later publisher can draw a smaller id. So ALTER SEQUENCE that
-- leaves outbox.event_id_seq with a cache is refused (outbox.health() reports a
-- cache set while event triggers were off).
CREATE FUNCTION outbox._sequence_guard() RETURNS event_trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    c bigint;
BEGIN
    SELECT s.seqcache INTO c FROM pg_sequence s WHERE s.seqrelid = to_regclass('outbox.event_id_seq');
    IF c > 1 THEN
        RAISE EXCEPTION 'outbox: outbox.event_id_seq must keep CACHE 1 (got %)', c
            USING ERRCODE = '0A000',
                  HINT = 'Event ids must be drawn in subject lock order for per-subject delivery order; a sequence cache breaks it.';
    END IF;
END
$$;

COMMENT ON FUNCTION outbox._sequence_guard() IS
'Event trigger function (ddl_command_end, ALTER SEQUENCE): refuses, with SQLSTATE 0A000, a change that leaves outbox.event_id_seq with a CACHE above 1, '
'since per-subject delivery order needs ids drawn in subject lock order. Returns nothing.';

CREATE EVENT TRIGGER outbox_sequence_guard ON ddl_command_end
    WHEN TAG IN ('ALTER SEQUENCE')
    EXECUTE FUNCTION outbox._sequence_guard();
