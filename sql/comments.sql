-- Comments for the functions pgrx declares from Rust (#[pg_extern]) and for the
-- internal helpers. Internal names start with '_': they are not part of the
-- public API and may change between versions.

COMMENT ON FUNCTION outbox.wakeup_status() IS
'Background worker state from shared memory, one row: worker_pid (integer, 0 when not running), database (oid served), passes (bigint, wake-up passes completed), '
'topics_waiting and prepared_waiting (integer, wake-ups queued for the next pass), preloaded (boolean: library in shared_preload_libraries). '
'Without preload: one row of zeros with preloaded = false. No errors. Follows anchors.md 3(b).3 (coalesced NOTIFY from a background worker).';

COMMENT ON FUNCTION outbox._wake(text) IS
'Internal: note a wake-up for topic (NULL = any topic) in the current transaction according to outbox.notify. Used by replay, cancel and alter_topic. Returns void; no errors.';

COMMENT ON FUNCTION outbox._promote_heads(text[], boolean) IS
'Internal: make the earliest live event of each subject its head (claimable), taking the subject locks first (wait = false skips subjects whose lock is busy). '
'Returns the number of events promoted (integer). See src/subject.rs.';

COMMENT ON FUNCTION outbox._setting(text) IS
'Internal: the SHOW form (with units) of an outbox.* setting; calling it loads the library so the setting exists in a fresh session. Errors: 22023 for a name outside outbox.';

COMMENT ON FUNCTION outbox._pattern_kind(text) IS
'Internal: classify a topic pattern as ''exact'', ''prefix'' (a.b.*) or ''all'' (*). Errors: 22004 NULL; 22023 malformed.';

COMMENT ON FUNCTION outbox._topic_matches(text, text) IS
'Internal: whether topic matches a pattern (exact, a.b.* or *). Errors as outbox._pattern_kind.';

COMMENT ON FUNCTION outbox._check_topic(text) IS
'Internal: raise 22004 for a NULL topic and 22023 for a malformed one.';

COMMENT ON FUNCTION outbox._check_policy(integer, interval, interval, interval, text, interval, interval) IS
'Internal: validate topic policy values (22023 when out of range).';

COMMENT ON FUNCTION outbox._retention_guc(text) IS
'Internal: an interval-valued outbox.* setting (retention windows).';

COMMENT ON FUNCTION outbox._log_maintenance(timestamptz, bigint, bigint) IS
'Internal: record one run of outbox.run_maintenance() in outbox.maintenance_runs.';

COMMENT ON FUNCTION outbox._topics_changed() IS
'Internal trigger function on outbox.topics: invalidates every backend''s cached copy of the topic registry (src/topics.rs).';

COMMENT ON FUNCTION outbox._visible_floor() IS
'Internal: the least visible_at (timestamptz) the calling transaction may store for an event entering the claim index: the publish floor plus 1 microsecond, '
'-infinity without shared_preload_libraries. Assigns the caller''s transaction id first (src/lowwater.rs explains why). Used by replay and replay_dead. No errors.';

COMMENT ON FUNCTION outbox._claim_low_water() IS
'Internal, for tests and monitoring: one row with publish_floor (timestamptz, the floor events enter the claim index above), '
'low_water_at and low_water_id (timestamptz, bigint: the key claim() starts its index scan at in this database; -infinity and 0 when unknown), '
'step_pending (boolean: step A done, step B waiting for older transactions) and resets (bigint: times the maintenance audit found an event below the mark). '
'-infinity / 0 / false without shared_preload_libraries. No errors. See src/lowwater.rs (issue 5; the PgQ-style alternative is table rotation, anchors.md lesson 4).';

COMMENT ON FUNCTION outbox._audit_low_water() IS
'Internal: look for live events below this database''s claim low-water mark (rows written into outbox.event_queue other than through the outbox functions) '
'and forget the mark if there are any, so claims find them. Returns true when it reset the mark (boolean). Run by the maintenance worker and outbox.run_maintenance(). '
'Reads every dead index entry below the mark: about as costly as one claim without the mark. No errors of its own. See src/lowwater.rs.';
