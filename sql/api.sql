-- The delivery API. The hot paths (publish, claim, ack, fail, extend_lease) are C
-- functions implemented in Rust (src/publish.rs, src/claim.rs, src/lease.rs); they
-- run their statements as saved SPI plans, so they are planned once per session,
-- not once per call (a LANGUAGE sql wrapper would be planned again on every call).
--
-- Every function pins search_path, so objects in the caller's path cannot change
-- what it runs. The C functions pin it themselves (src/pg/search_path.rs):
-- a SET search_path clause cost publish() a fifth of its time.

CREATE FUNCTION outbox.publish(
    topic        text,
    payload      jsonb,
    subject      text        DEFAULT NULL,
    dispatch_key text        DEFAULT NULL,
    headers      jsonb       DEFAULT NULL,
    deliver_at   timestamptz DEFAULT NULL
) RETURNS bigint
LANGUAGE c VOLATILE PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'outbox_publish';

COMMENT ON FUNCTION outbox.publish(text, jsonb, text, text, jsonb, timestamptz) IS
'Publish one event in the caller''s transaction; returns its id (bigint). It never commits: the event exists iff the caller commits (savepoints included). '
'Arguments: topic (lowercase dot-separated segments of [a-z0-9_-], 1..255 chars), payload (any JSON value, at most outbox.max_payload_bytes bytes), '
'subject (ordering key: events of one subject are delivered in commit order; publishers of one subject are serialised by a transaction-scoped lock; past outbox.max_subject_locks distinct subjects the transaction takes its database''s coarse subject lock instead, and every publisher of a subject waits for it until it ends), '
'dispatch_key (idempotency key: a second publish with a retained key inserts nothing and returns the first event''s id), '
'headers (JSON object of string values; W3C traceparent/tracestate are passed through; outbox.traceparent is copied in when absent), '
'deliver_at (not claimable before this time; past means now). '
'Errors: 22004 NULL topic or payload; 22023 bad topic, headers not an object of strings, deliver_at = infinity; 54000 payload too large; '
'P0002 unregistered topic with outbox.strict_topics = on. '
'Follows seeds 000 (publishOutboxEvent in the caller''s transaction, dispatchKey) and 001 (publish_in_tx, subject_id).';

CREATE FUNCTION outbox.publish_batch(
    topic         text,
    payloads      jsonb[],
    subjects      text[] DEFAULT NULL,
    dispatch_keys text[] DEFAULT NULL
) RETURNS SETOF bigint
LANGUAGE c VOLATILE PARALLEL UNSAFE ROWS 1000
AS 'MODULE_PATHNAME', 'outbox_publish_batch';

COMMENT ON FUNCTION outbox.publish_batch(text, jsonb[], text[], text[]) IS
'Publish many events of one topic in one call, in the caller''s transaction; returns their ids (SETOF bigint) in input order. '
'Arguments: topic as in publish; payloads (jsonb[], 1..outbox.max_batch_size elements, none NULL); subjects and dispatch_keys (NULL, or arrays of the same length whose elements may be NULL). '
'Same validation and semantics as publish: per-subject order follows input order, a repeated dispatch key (in the batch or already retained) returns the first event''s id. '
'Errors: 22004 NULL topic, payloads or payload element; 22023 bad topic, array length mismatch, empty or oversized batch (54000 when over outbox.max_batch_size); 54000 payload too large; P0002 strict topics. Any number of distinct subjects: past outbox.max_subject_locks in the transaction, the call takes the coarse subject lock before its first subject (see publish). '
'Follows pgmq send_batch.';

-- claim, ack, fail and extend_lease plan their statements with enable_seqscan
-- off: their plans are saved once per backend (src/pg/plans.rs) and reused
-- whatever the log holds later, and a ring table that was empty, or held one
-- transaction's events, when its statistics were taken made a scan of the
-- whole table look cheapest (issue 40: claim(100) read 174,645 buffers after
-- a million events published in one transaction, 1,690 on a fresh install).
-- Each of their statements has an index to read instead
-- (pg_test/py/test_plans.py). A plan that must still scan a small table
-- (the subscription catalog, the topics) then costs 1e10, past every JIT
-- threshold, so they plan with jit off too: JIT-compiling the subscriptions'
-- lookup made a session's first claim take 450-850 ms.
CREATE FUNCTION outbox.claim(
    worker       text,
    batch_size   integer  DEFAULT 100,
    lease        interval DEFAULT NULL,
    topics       text[]   DEFAULT NULL,
    subscription text     DEFAULT NULL
) RETURNS TABLE (
    id               bigint,
    topic            text,
    subject          text,
    dispatch_key     text,
    payload          jsonb,
    headers          jsonb,
    attempt          integer,
    lease_token      uuid,
    lease_expires_at timestamptz,
    published_at     timestamptz
)
LANGUAGE c VOLATILE PARALLEL UNSAFE ROWS 100
SET enable_seqscan = off
SET jit = off
AS 'MODULE_PATHNAME', 'outbox_claim';

COMMENT ON FUNCTION outbox.claim(text, integer, interval, text[], text) IS
'Lease up to batch_size ready events of one subscription: pending events whose visible time has come, and leased events whose lease expired. '
'Never waits for another transaction: rows other transactions hold or are changing are skipped, as are rows changed since the claim''s snapshot (outbox._lock_row). '
'Order: a subject''s events in commit order; across subjects no order is promised. A claim takes the subscription''s due rows of their own first (retries, replays, delayed events whose time has come, expired leases already moved out of their batch; oldest visible time first), then new events lane by lane; '
'an expired lease still in its lane''s batch is moved out, and handed out, only when a claim reaches that batch, so a claim may return new events before it.'
'Each row carries a lease_token (fencing token) of its own and lease_expires_at = clock_timestamp() + lease. Fencing is per event: ack, fail and extend_lease match the id with the token, '
'a token acts only on the event it was handed out with (extend_lease extends that event alone), and an event handed out again gets a new one. '
'The token does not name a delivery: (id, subscription, attempt) does (a replay starts attempt again). attempt counts claims (1 on first delivery). '
'An event whose subject has an earlier pending, leased or blocking-dead event is not claimable. An expired lease that used the last attempt goes dead with error ''lease expired''. '
'Arguments: worker (non-empty name, at most 255 bytes, no control characters, recorded as leased_by), batch_size (1..outbox.max_batch_size), '
'lease (interval > 0 and <= outbox.max_lease; NULL = the subscription''s default_lease, else the topic''s, else outbox.default_lease; events a subscription of the log hands out together from one batch share the longest of their topics'' leases), topics (NULL = all; exact topic names or prefixes ending in ''.*'', or ''*''), '
'subscription (NULL = ''default''; a paused subscription returns no rows; its max_attempts and dead_letter_policy override the topic''s). '
'Result: (id, topic, subject, dispatch_key, payload, headers, attempt, lease_token, lease_expires_at, published_at). '
'Runs at READ COMMITTED or REPEATABLE READ; at SERIALIZABLE it is refused with 0A000 before it reads or changes anything (run the claiming transaction at READ COMMITTED). At those two levels, in a transaction of its own, it raises neither 40001 nor 40P01. '
'Errors: 0A000 SERIALIZABLE isolation; 22004 NULL worker or batch_size or NULL topics element; 22023 bad worker, lease, topic pattern or subscription name, or outbox.default_lease over outbox.max_lease when the lease comes from it; 42704 unknown subscription; 54000 batch_size over outbox.max_batch_size. '
'Follows the SKIP LOCKED claim of pgmq, River and Oban, with fencing tokens as in awa and Kleppmann, "How to do distributed locking" (2016).';

CREATE FUNCTION outbox._lock_row(rel oid, "row" tid) RETURNS boolean
LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 100
AS 'MODULE_PATHNAME', 'outbox_lock_row';

COMMENT ON FUNCTION outbox._lock_row(oid, tid) IS
'Internal (claim: lanes, rows of their own, activity; no role is granted it). Lock row version "row" (a ctid the calling statement read) of table rel FOR UPDATE without waiting. '
'Result: true when the transaction now holds the row; false when another transaction holds or is changing it, or when a transaction that committed after the statement''s snapshot changed it (the version read is not the newest). '
'Unlike FOR UPDATE SKIP LOCKED it never follows the row''s update chain, a step that waits for the transaction changing a newer version whatever the wait policy (PostgreSQL heapam.c, heap_lock_updated_tuple), and never raises a serialization failure. '
'Errors: 25006 in a read-only transaction (as FOR UPDATE); 42P01 rel does not exist (or was dropped while the call waited for its lock); 42501 without UPDATE on rel; 22023 rel is not a plain table, or no row version at that ctid.';

CREATE FUNCTION outbox._try_policy_lock(topic text) RETURNS boolean
LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE
AS 'MODULE_PATHNAME', 'outbox_try_policy_lock';

COMMENT ON FUNCTION outbox._try_policy_lock(text) IS
'Internal (claim: rows it turns dead; no role is granted it). Take topic''s dead-letter policy lock in share mode without waiting, held until the transaction ends '
'(a lock of the library''s own, which SQL''s advisory-lock functions cannot name). Result: true when the transaction now holds it; false when a policy change holds it. No errors.';

CREATE FUNCTION outbox._releasable(lease_token uuid, id bigint) RETURNS boolean
LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 100
AS 'MODULE_PATHNAME', 'outbox_releasable';

COMMENT ON FUNCTION outbox._releasable(uuid, bigint) IS
'Internal (claim: rows of their own whose lease ran out; no role is granted it). Whether a claim may lease event id''s row again, its lease by lease_token having run out. '
'For a token a lane batch handed out, it takes the event''s hold without waiting (held until the transaction ends) and checks that no committed deferred call by that batch waits to be applied. '
'Result: true when the claim may lease the row; false when a transaction holds the event (an ack, fail or extend_lease inside a transaction block) or a committed call on it waits. No errors.';

CREATE FUNCTION outbox.ack(id bigint, lease_token uuid) RETURNS boolean
LANGUAGE c VOLATILE PARALLEL UNSAFE
SET enable_seqscan = off
SET jit = off
AS 'MODULE_PATHNAME', 'outbox_ack';

COMMENT ON FUNCTION outbox.ack(bigint, uuid) IS
'Mark a leased event delivered for its subscription (in its batch; an event with a row of its own keeps it, state delivered, as its attempt history until retention). Returns true when lease_token is the event''s current token, '
'false otherwise (stale or unknown token, unknown id, NULL arguments): no error, nothing changes. '
'The exception: in a read-only transaction or on a standby, PostgreSQL raises 25006 for any non-NULL id and token (the call writes, whatever the token). '
'Inside a transaction block it takes effect iff that transaction commits, as it commits; until then the event stays out, even past its lease. At READ COMMITTED and REPEATABLE READ it raises neither 40001 nor 40P01, in autocommit or in a transaction block; at SERIALIZABLE it may raise 40001, as any serializable transaction may: retry the transaction. A fenced ack, as in awa.';

CREATE FUNCTION outbox.ack(ids bigint[], lease_tokens uuid[]) RETURNS integer
LANGUAGE c VOLATILE PARALLEL UNSAFE
SET enable_seqscan = off
SET jit = off
AS 'MODULE_PATHNAME', 'outbox_ack_batch';

COMMENT ON FUNCTION outbox.ack(bigint[], uuid[]) IS
'Batch ack: acknowledges each (ids[i], lease_tokens[i]) pair whose token is current; returns how many were acknowledged (integer). '
'Errors: 22004 NULL array or NULL element; 22023 arrays of different lengths or multidimensional; 54000 more than outbox.max_batch_size pairs; 25006 (from PostgreSQL) for non-empty arrays in a read-only transaction or on a standby. Nothing is applied on error.';

CREATE FUNCTION outbox.fail(
    id          bigint,
    lease_token uuid,
    error       text,
    retry_in    interval DEFAULT NULL,
    permanent   boolean  DEFAULT false
) RETURNS text
LANGUAGE c VOLATILE PARALLEL UNSAFE
SET enable_seqscan = off
SET jit = off
AS 'MODULE_PATHNAME', 'outbox_fail';

COMMENT ON FUNCTION outbox.fail(bigint, uuid, text, interval, boolean) IS
'Report a failed delivery. Returns the new state: ''pending'' (retry scheduled), ''dead'' (permanent, or attempts reached max_attempts), or ''stale'' (token not current; nothing changed). '
'Arguments: error (text kept as last_error and appended to the attempt history, which keeps the first failure, {"omitted": n} and the latest 18 once it holds 20 entries; NULL is stored as ''(no error text)''; truncated to 8 kB), '
'retry_in (delay before the retry, >= 0 and <= 365 days; NULL = capped exponential backoff: base * 2^(attempt-1) capped at backoff_max, equal jitter, never zero), '
'permanent (true dead-letters at once). max_attempts, the backoff and the dead-letter policy are the subscription''s (outbox.alter_subscription), else the topic''s, else the GUCs''. NULL id or lease_token returns ''stale''. Errors (raised before any change): 22004 NULL permanent; 22023 negative or over-long retry_in. '
'Inside a transaction block it takes effect iff that transaction commits, as it commits; until then the event stays out, even past its lease. At READ COMMITTED and REPEATABLE READ it raises neither 40001 nor 40P01, in autocommit or in a transaction block; at SERIALIZABLE it may raise 40001, as any serializable transaction may: retry the transaction. '
'Backoff and dead letters after max_attempts as in River, Oban and pg-boss.';

CREATE FUNCTION outbox.extend_lease(id bigint, lease_token uuid, lease interval) RETURNS timestamptz
LANGUAGE c VOLATILE PARALLEL UNSAFE
SET enable_seqscan = off
SET jit = off
AS 'MODULE_PATHNAME', 'outbox_extend_lease';

COMMENT ON FUNCTION outbox.extend_lease(bigint, uuid, interval) IS
'Heartbeat: set the lease expiry to clock_timestamp() + lease. Returns the new expiry (timestamptz), or NULL when the token is stale. '
'Arguments: lease (interval > 0, <= outbox.max_lease). Errors: 22004 NULL lease; 22023 zero, negative or over-long lease. '
'Inside a transaction block it takes effect iff that transaction commits, as it commits; until then the event stays out, even past its lease. At READ COMMITTED and REPEATABLE READ it raises neither 40001 nor 40P01, in autocommit or in a transaction block; at SERIALIZABLE it may raise 40001, as any serializable transaction may: retry the transaction. '
'Workers should extend about every lease/3, so one missed heartbeat does not lose the lease.';

CREATE FUNCTION outbox.backoff_delay(
    attempt      integer,
    backoff_base interval DEFAULT NULL,
    backoff_max  interval DEFAULT NULL,
    jitter       boolean  DEFAULT true
) RETURNS interval
LANGUAGE c VOLATILE PARALLEL SAFE
AS 'MODULE_PATHNAME', 'outbox_backoff_delay';

COMMENT ON FUNCTION outbox.backoff_delay(integer, interval, interval, boolean) IS
'The retry delay fail() uses after the given attempt (1-based): min(backoff_max, backoff_base * 2^(attempt-1)); with jitter, uniformly in [d/2, d]. '
'Never zero, negative or overflowing for any attempt. NULL base/max = outbox.backoff_base / outbox.backoff_max. '
'Errors: 22004 NULL attempt; 22023 attempt < 1, base or max not > 0 or over 365 days. Capped exponential backoff with equal jitter (AWS Architecture Blog, "Exponential Backoff And Jitter", 2015), as in River and Oban.';
