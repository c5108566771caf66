-- 0.10.0 -> 0.11.0: the log through pg_dump (sql/restore.sql), the outbox's
-- identity and the inbox (sql/inbox.sql). The DDL no diff can derive, as in
-- those files; the functions, comments, config dumps and grants follow.

CREATE TABLE outbox.log_restore (
    one         boolean     PRIMARY KEY DEFAULT true CHECK (one),
    upto        bigint      NOT NULL,
    restored_at timestamptz NOT NULL DEFAULT now()
);
CREATE TRIGGER log_restore_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.log_restore
    FOR EACH STATEMENT EXECUTE FUNCTION outbox._topics_changed();
ALTER TABLE outbox.log_restore ENABLE ALWAYS TRIGGER log_restore_changed;

CREATE TABLE outbox.identity (
    one        boolean     PRIMARY KEY DEFAULT true CHECK (one),
    outbox_id  uuid        NOT NULL DEFAULT pg_catalog.gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox.identity DEFAULT VALUES;

CREATE TABLE outbox.inbox (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX inbox_received ON outbox.inbox (received_at);

-- Who holds each round of a batch (sql/log.sql).
ALTER TABLE outbox.log_batches ADD COLUMN leased_by text[];

-- The subject test of a claim of rows of their own (sql/log.sql).
CREATE INDEX log_exceptions_leased ON outbox.log_exceptions (subscription, lane, subject, visible_at)
    WHERE state = 'leased' AND subject IS NOT NULL;
