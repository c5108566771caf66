-- The outbox's identity and the inbox (0.11.0).
--
-- outbox.outbox_id() names this outbox to the systems it delivers to: the
-- relay (`outbox relay`) sends `<outbox id>:<event id>` as NATS JetStream's
-- Nats-Msg-Id and as the webhook-id, so a broker's or a receiver's
-- deduplication tells events of different databases apart and keeps telling
-- an event apart from itself after a dump and restore. Not a database name
-- (RENAME changes it) nor an OID (a restore changes it): a UUID made at
-- install, kept by pg_dump.

CREATE TABLE outbox.identity (
    one        boolean     PRIMARY KEY DEFAULT true CHECK (one),
    outbox_id  uuid        NOT NULL DEFAULT pg_catalog.gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox.identity DEFAULT VALUES;
SELECT pg_catalog.pg_extension_config_dump('outbox.identity', '');

-- CREATE EXTENSION on the restoring side made an identity of its own; the
-- dumped one replaces it (the restored database is the same outbox).
CREATE FUNCTION outbox._identity_restore() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM outbox.identity;
    RETURN NEW;
END
$$;
CREATE TRIGGER identity_restore BEFORE INSERT ON outbox.identity
    FOR EACH ROW EXECUTE FUNCTION outbox._identity_restore();

CREATE FUNCTION outbox.outbox_id() RETURNS uuid
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT i.outbox_id FROM outbox.identity i $$;

COMMENT ON FUNCTION outbox.outbox_id() IS
'This outbox''s identity: a UUID made by CREATE EXTENSION and kept by pg_dump (not the database''s name or OID, which RENAME and a restore change). '
'The relay sends <outbox_id>:<event id> as the NATS Nats-Msg-Id and the webhook-id, so that deduplication downstream tells databases apart. Returns uuid. No errors.';

-- The inbox: exactly-once effects for consumers that write to PostgreSQL.
-- At-least-once delivery plus a consumer that records each message it has
-- applied, in the transaction that applies it, gives an effect exactly once:
-- the record commits iff the effect does. A row per (consumer, message_id);
-- the primary key makes a concurrent duplicate wait for the first
-- transaction and then see its row (INSERT ... ON CONFLICT DO NOTHING), or
-- insert its own if the first rolled back. Dumped: it is the consumers'
-- state, as their effects are. Retention: outbox.retention_inbox, the
-- maintenance step 'inbox'.
CREATE TABLE outbox.inbox (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX inbox_received ON outbox.inbox (received_at);
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox', '');

CREATE FUNCTION outbox.inbox_receive(consumer text, message_id text) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF consumer IS NULL OR message_id IS NULL THEN
        RAISE EXCEPTION 'outbox: consumer and message_id must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF pg_catalog.length(consumer) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'outbox: consumer must be 1 to 200 characters, got %', pg_catalog.length(consumer)
            USING ERRCODE = '22023';
    END IF;
    IF pg_catalog.length(message_id) NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'outbox: message_id must be 1 to 1000 characters, got %', pg_catalog.length(message_id)
            USING ERRCODE = '22023';
    END IF;
    INSERT INTO outbox.inbox AS i (consumer, message_id) VALUES (inbox_receive.consumer, inbox_receive.message_id)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;

COMMENT ON FUNCTION outbox.inbox_receive(text, text) IS
'Inbox (idempotent consumer): call it in the consumer''s own transaction, before applying a message''s effect. Returns true the first time (consumer, message_id) is received, '
'false for a duplicate (then skip the effect). The record commits with the caller''s transaction: after a rollback, or a rollback to a savepoint taken before the call, '
'the message can be received again. A concurrent duplicate waits for the first transaction, then returns false (or true if that one rolled back); '
'at REPEATABLE READ or SERIALIZABLE it raises 40001 instead when the first committed after the caller''s snapshot (retry the transaction). '
'Arguments: consumer (1 to 200 characters, names the consumer: each consumer has its own set of ids), message_id (1 to 1000 characters, e.g. the relay''s Nats-Msg-Id or webhook-id). '
'Records are kept for outbox.retention_inbox (default 7 days, maintenance step inbox): a duplicate arriving later is received again. '
'Errors: 22004 NULL argument; 22023 empty or over-long argument. The idempotent receiver of Hohpe and Woolf, Enterprise Integration Patterns (2003).';
