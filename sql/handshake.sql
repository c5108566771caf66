-- The library/SQL handshake (src/handshake.rs): record the fingerprint of the
-- library running this script, which a package builds from the same sources as
-- the script. The library compares it with its own on the first call of each
-- session and after every change of a function definition; a mismatch is SQLSTATE
-- 55000. Every upgrade script ends with this statement too (scripts/upgrade-sql.py),
-- so ALTER EXTENSION UPDATE records the new library's fingerprint.
DO $$
BEGIN
    EXECUTE pg_catalog.format(
        'CREATE OR REPLACE FUNCTION outbox._sql_fingerprint() RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE AS %L',
        pg_catalog.format('SELECT %L::text', outbox._library_fingerprint()));
END
$$;

COMMENT ON FUNCTION outbox._sql_fingerprint() IS
'The fingerprint of the install script this database runs (its sources'' SHA-256, hex), recorded when the script ran. '
'Returns text. The library compares it with its own; see outbox._handshake(). No errors.';

COMMENT ON FUNCTION outbox._library_fingerprint() IS
'Internal: the fingerprint this library was built with (SHA-256 of its install script''s sources, hex). Returns text. '
'Called by the install and upgrade scripts to record outbox._sql_fingerprint(). No errors.';

COMMENT ON FUNCTION outbox._handshake() IS
'Internal: this session''s handshake verdict. Returns text: NULL when the installed SQL is the library''s, else the message of '
'the 55000 error every call into the library raises. No errors.';
