-- 0.8.0 -> 0.9.0: named subscriptions over the log. The DDL no diff can
-- derive: the catalog's filter and dead-letter policy, the exception table
-- (as in sql/log.sql), the batch ids' bound (tokens keep 48 bits), and the
-- internal claim functions of 0.8.0, which outbox.claim replaces.

ALTER TABLE outbox.subscription_catalog
    ADD COLUMN topics text[],
    ADD COLUMN dead_letter_policy text CHECK (dead_letter_policy IN ('block', 'skip'));

ALTER SEQUENCE outbox.log_batch_seq MAXVALUE 281474976710655;

-- 0.8.0's internal readers (no catalog row) would hold the log's retention
-- back for ever; their batches' tokens are of the old layout.
DELETE FROM outbox.log_batches b
 WHERE NOT EXISTS (SELECT 1 FROM outbox.subscription_catalog c WHERE c.name = b.subscription);
DELETE FROM outbox.log_lanes l
 WHERE NOT EXISTS (SELECT 1 FROM outbox.subscription_catalog c WHERE c.name = l.subscription);

DROP FUNCTION outbox._log_claim(text, integer, interval);
DROP FUNCTION outbox._log_ack(bigint[], uuid[]);
DROP FUNCTION outbox._log_extend(bigint, uuid, interval);

CREATE TABLE outbox.log_exceptions (
    subscription text        NOT NULL,
    id           bigint      NOT NULL,
    lane         smallint    NOT NULL,
    topic        text        NOT NULL,
    subject      text,
    dispatch_key text,
    payload      jsonb       NOT NULL,
    headers      jsonb,
    max_attempts integer     NOT NULL,
    published_at timestamptz NOT NULL,
    state        text        NOT NULL CHECK (state IN ('pending', 'leased', 'delivered', 'dead', 'cancelled')),
    attempts     integer     NOT NULL CHECK (attempts >= 0),
    visible_at   timestamptz NOT NULL,
    lease_token  uuid,
    leased_by    text,
    last_error   text,
    errors       jsonb,
    blocks       boolean     NOT NULL DEFAULT true,
    dead_at      timestamptz,
    delivered_at timestamptz,
    cancelled_at timestamptz,
    PRIMARY KEY (subscription, id)
) WITH (fillfactor = 70, vacuum_truncate = false);
-- Claims: claimable rows in (visible_at, id) order.
CREATE INDEX log_exceptions_ready ON outbox.log_exceptions (subscription, visible_at, id)
    WHERE state IN ('pending', 'leased');
-- Rows that hold their subject: the head check of a claim, and a new batch's
-- check for subjects that must continue here.
CREATE INDEX log_exceptions_open ON outbox.log_exceptions (subscription, lane, subject, id)
    WHERE subject IS NOT NULL AND (state IN ('pending', 'leased') OR (state = 'dead' AND blocks));
-- ack, fail and extend_lease find a row by its token.
CREATE INDEX log_exceptions_token ON outbox.log_exceptions (lease_token) WHERE lease_token IS NOT NULL;
