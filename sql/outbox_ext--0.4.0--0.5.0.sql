-- outbox_ext 0.4.0 -> 0.5.0
\echo Use "ALTER EXTENSION outbox_ext UPDATE TO '0.5.0'" to load this file. \quit

-- Claims never wait (issue 14): claim and head promotion lock rows with
-- outbox._lock_row, which never follows a row's update chain. FOR UPDATE SKIP
-- LOCKED does, and then waits for the transaction changing a newer version.

COMMENT ON FUNCTION outbox.claim(text, integer, interval, text[]) IS
'Lease up to batch_size ready events: pending events whose visible time has come, and leased events whose lease expired. '
'Never waits for another transaction: rows other transactions hold or are changing are skipped, as are rows changed since the claim''s snapshot (outbox._lock_row). '
'Oldest available first. Each row gets a fresh lease_token (fencing token) and lease_expires_at = clock_timestamp() + lease; attempt counts claims (1 on first delivery). '
'An event whose subject has an earlier pending, leased or blocking-dead event is not claimable. An expired lease that used the last attempt goes dead with error ''lease expired''. '
'Arguments: worker (non-empty name, at most 255 chars, recorded as leased_by), batch_size (1..outbox.max_batch_size), '
'lease (interval > 0 and <= outbox.max_lease; NULL = topic default_lease, else outbox.default_lease), topics (NULL = all; exact topic names or prefixes ending in ''.*'', or ''*''). '
'Result: (id, topic, subject, dispatch_key, payload, headers, attempt, lease_token, lease_expires_at, published_at). '
'Errors: 22004 NULL worker or batch_size or NULL topics element; 22023 bad worker, lease or topic pattern; 54000 batch_size over outbox.max_batch_size. '
'Follows the SKIP LOCKED claim of pgmq, River and Oban, with fencing tokens as in awa and Kleppmann, "How to do distributed locking" (2016).';

CREATE FUNCTION outbox._lock_row(rel oid, "row" tid) RETURNS boolean
LANGUAGE c VOLATILE STRICT PARALLEL UNSAFE COST 100
AS 'MODULE_PATHNAME', 'outbox_lock_row';

COMMENT ON FUNCTION outbox._lock_row(oid, tid) IS
'Internal (claim and head promotion; no role is granted it). Lock row version "row" (a ctid the calling statement read) of table rel FOR UPDATE without waiting. '
'Result: true when the transaction now holds the row; false when another transaction holds or is changing it, or when a transaction that committed after the statement''s snapshot changed it (the version read is not the newest). '
'Unlike FOR UPDATE SKIP LOCKED it never follows the row''s update chain, a step that waits for the transaction changing a newer version whatever the wait policy (PostgreSQL heapam.c, heap_lock_updated_tuple), and never raises a serialization failure. '
'Errors: 42501 without UPDATE on rel; 22023 rel is not a plain table, or no row version at that ctid.';

REVOKE EXECUTE ON FUNCTION outbox._lock_row(oid, tid) FROM PUBLIC;
