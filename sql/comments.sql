-- Comments for the functions pgrx declares from Rust (#[pg_extern]) and for the
-- internal helpers. Internal names start with '_': they are not part of the
-- public API and may change between versions.

COMMENT ON FUNCTION outbox.wakeup_status() IS
'The background worker of the current database, from shared memory, one row: worker_pid (integer, 0 when none runs), database (oid, 0 when not served), passes (bigint, wake-up passes completed), '
'topics_waiting and prepared_waiting (integer, wake-ups queued for the next pass), preloaded (boolean: library in shared_preload_libraries), launcher_pid (integer, 0 when the launcher is not running), '
'state (text: serving; starting; waiting = no free background worker process, max_worker_processes; stopped = exited, the launcher starts another; not served). '
'Without preload: one row of zeros with preloaded = false and state ''not served''. No errors. The worker sends one coalesced NOTIFY per topic, so publishers never take the NOTIFY queue lock at commit.';

COMMENT ON FUNCTION outbox._announce() IS
'Internal, called by the install script: at commit, tell the background launcher that this database has the extension, so that its worker starts at once. Returns void; no errors; does nothing without shared_preload_libraries.';

COMMENT ON FUNCTION outbox._wake(text) IS
'Internal: note a wake-up for topic (NULL = any topic) in the current transaction according to outbox.notify. Used by replay, cancel and alter_topic. Returns void; no errors.';

COMMENT ON FUNCTION outbox._maintenance_steps() IS
'Internal: the maintenance steps in the order both the background worker and outbox.run_maintenance() run them: (step text, logged_as text, the outbox.maintenance_runs column '
'that records the step''s count, or NULL). Steps: delivered, dead, keys (retention: outbox._purge_step()), log (the log ring: outbox._log_rotate()), inbox (the inbox''s records). No errors.';

COMMENT ON FUNCTION outbox._maintenance_step(text) IS
'Internal: one batch of a maintenance step (see outbox._maintenance_steps()) in the caller''s transaction: (removed bigint, done boolean; done = nothing more to do in this run). '
'For log, one outbox._log_rotate() call: removed = ring tables truncated (0 or 1), done once it truncated none; commit before the next call, which releases the truncated table''s lock. '
'Errors: 22023 unknown step; those of outbox._purge_step().';

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

COMMENT ON FUNCTION outbox._log_maintenance(timestamptz, jsonb) IS
'Internal: record one run of outbox.run_maintenance() in outbox.maintenance_runs; counts maps purged_delivered, purged_dead and purged_keys to rows removed (missing = 0). Returns void.';

COMMENT ON FUNCTION outbox._topics_changed() IS
'Internal trigger function on outbox.topics, outbox.subscription_catalog and outbox.log_state: invalidates every backend''s cached copy of the topic registry (src/topics.rs), of the subscriptions (src/subscriptions.rs) and of the log ring''s open table (src/log/mod.rs).';

COMMENT ON FUNCTION outbox._log_readers_passed(smallint, text) IS
'Internal: whether every lane of every log reader (outbox.log_lanes) has a cursor that sees every event of ring table outbox.log_<n> (n 0..3), i.e. the table '
'holds nothing a reader still needs (three index probes per lane); with only_subscription (default NULL: every reader), that subscription''s lanes alone. Lanes of subscriptions that no longer hold the table (outbox._log_let_go: past their max_lag) do not count. '
'Meaningful at READ COMMITTED. Returns boolean. Errors: 42P01 for n outside 0..3.';

COMMENT ON FUNCTION outbox._log_let_go(smallint) IS
'Internal (outbox._log_readers_passed): the subscriptions (text[]) whose max_lag is shorter than the time since ring table outbox.log_<n> was sealed: they no longer hold its retention. '
'Empty for a table that is not sealed. No errors.';

COMMENT ON FUNCTION outbox._log_note_losses(smallint) IS
'Internal (outbox._log_rotate, before it truncates ring table outbox.log_<n>): for each subscription of outbox._log_let_go(n), count the events of its topics there that its lanes'' cursors have not passed, '
'and add them to its lost_events (outbox.subscription_activity, with lost_at = now()). Returns the total (bigint). Errors: 42P01 for n outside 0..3.';

COMMENT ON FUNCTION outbox._check_max_lag(interval) IS
'Internal (create_subscription, alter_subscription): raise 22023 unless max_lag is NULL or > 0 and <= 100 years. Returns void.';

COMMENT ON FUNCTION outbox._log_written_since(smallint, pg_snapshot) IS
'Internal: whether ring table outbox.log_<n> (n 0..3) holds an event of a transaction not visible in snapshot s, i.e. running when s was taken or begun after (boolean): '
'written since a seal that took s. Two index probes. Errors: 42P01 for n outside 0..3.';

COMMENT ON FUNCTION outbox._log_rotate() IS
'Internal: one call of the maintenance step log (src/log/mod.rs). Truncates the first ring table (outbox.log_0 .. outbox.log_3) that every log reader has read past and that nobody '
'has written to for outbox.retention_delivered (a row written after its seal restarts that; a subscription past its max_lag does not hold a table, and loses what it had not read there: '
'outbox._log_note_losses) and returns 1 at once: its lock lasts until the caller commits, which should then call again. Otherwise, when the open table has been open for half that and the next one '
'is free, seals it and opens the next, and returns 0. A TRUNCATE waits for its lock at most 20 ms (lock_timeout) and leaves a table in use for the next run, so publishers and readers '
'queue behind it no longer than that; a second concurrent call returns 0 at once. Returns integer: 1 when it truncated a table past its retention, else 0. '
'Only at READ COMMITTED (its checks must see every committed row): in a REPEATABLE READ or SERIALIZABLE transaction it does nothing and returns 0; '
'the background worker runs it at READ COMMITTED whatever default_transaction_isolation says. No errors.';

COMMENT ON FUNCTION outbox._apply_dead_letter_policy(text, text) IS
'Internal: make the dead letters of topic, in subscriptions without a dead-letter policy of their own, follow policy (''block'' or ''skip''), releasing their subjects under ''skip'' (outbox._log_apply_dead_letter_policy); '
'used by create_topic, alter_topic and drop_topic. Returns void.';

COMMENT ON FUNCTION outbox._log_apply_dead_letter_policy(text, text) IS
'Internal, for outbox._apply_dead_letter_policy once the topic''s new policy is written: takes the topic''s dead-letter policy lock exclusively (a transaction-level advisory lock, waiting for every fail() and claim that turned one of the topic''s rows dead to end), '
'then the log''s dead letters of topic, in subscriptions without a dead-letter policy of their own, take policy (''block'' or ''skip''). '
'Runs under a snapshot taken after the lock (again after a serialization failure at REPEATABLE READ or SERIALIZABLE), so dead letters committed while it waited are seen at every isolation level. '
'Returns true when a dead letter changed (boolean). Errors: 22004 NULL topic or policy; 22023 a policy other than block or skip. See src/log/exceptions.rs, invariant 4.';

COMMENT ON FUNCTION outbox._check_subscription(text) IS
'Internal: the subscription name to use (text): ''default'' for NULL, else the argument. Errors: 22023 when malformed (1 to 63 characters of [a-z0-9_.-], starting with a letter or digit).';

COMMENT ON FUNCTION outbox._subscription(text) IS
'Internal: resolve a subscription argument (NULL = ''default'') to an existing subscription''s name (text). Errors: 22023 malformed name; 42704 unknown subscription.';

COMMENT ON FUNCTION outbox._subscription_restore() IS
'Internal trigger function on outbox.subscription_catalog: an inserted row whose name exists updates that row instead (pg_restore of a dump into a database whose CREATE EXTENSION already made ''default'').';

COMMENT ON FUNCTION outbox._log_restored() IS
'Internal statement trigger function (AFTER INSERT, transition table new_rows) on the ring tables outbox.log_0 .. outbox.log_3: a SQL insert of rows of other transactions is a restore '
'of a dump; it records the largest restored id in outbox.log_restore (sql/restore.sql); ring tables restored at once take the marker''s lock in turn. publish''s own inserts do not fire it. '
'Errors: 55000 when the first restored table finds the log holding other events (restore the log into a database whose log is empty).';

COMMENT ON FUNCTION outbox._log_lanes_restored() IS
'Internal statement trigger function (AFTER INSERT) on outbox.log_lanes: a top-level COPY or INSERT into outbox.log_lanes (a restore of a dump; the extension writes lanes only inside its own functions) '
'marks the log as restored in outbox.log_restore (upto 0 unless a ring table set it), so lanes restored without any event are rebased too (sql/restore.sql). No errors of its own.';

COMMENT ON FUNCTION outbox._log_lanes_restoring() IS
'Internal (the restore triggers on outbox.log_lanes): whether the top-level statement is a COPY or INSERT into outbox.log_lanes, which is what a restore of a dump sends (boolean). No errors.';

COMMENT ON FUNCTION outbox._log_lane_restore() IS
'Internal row trigger function (BEFORE INSERT) on outbox.log_lanes: a lane row restored from a dump replaces the one of the same subscription and lane that CREATE EXTENSION made for ''default''. No errors of its own.';

COMMENT ON FUNCTION outbox._log_state_restore() IS
'Internal trigger function on outbox.log_state: an inserted row replaces the row of the same ring table (pg_restore into a database whose maintenance already wrote the ring''s state).';

COMMENT ON FUNCTION outbox._identity_restore() IS
'Internal trigger function on outbox.identity: an inserted row (a restored dump''s) replaces the one CREATE EXTENSION made, so the restored outbox keeps its outbox_id.';

COMMENT ON FUNCTION outbox._log_restore_quiet() IS
'Internal (outbox._log_rotate): whether a restored log may be rebased by the background worker: no ring table restored for a minute and no other session of this database is '
'a pg_restore or last ran a COPY into an outbox table. Returns boolean. No errors.';

COMMENT ON FUNCTION outbox._log_rebase() IS
'Internal: rebase a log restored from a dump into this cluster''s transaction ids (sql/restore.sql, src/log/restore.rs): every event a subscription of the log had not finished '
'(unread, or in a batch and not acked) gets a row of its own, ''pending''; then restored log rows get txid 2, every lane a new cursor, and batches in flight are deleted. '
'Run by the first claim, cancel, replay, replay_dead or create_subscription after a restore, or by the log maintenance step once the restore looks finished (outbox._log_restore_quiet). Returns the events given a row (bigint), NULL when nothing waited. '
'Errors: 40001 at REPEATABLE READ or SERIALIZABLE when another transaction rebased after the snapshot.';

COMMENT ON FUNCTION outbox._set_paused(text, boolean) IS
'Internal: pause_subscription and resume_subscription. Returns true when the state changed, false when it was already so. '
'When the UPDATE finds no row to change, a new statement (a new snapshot at READ COMMITTED) checks that the subscription still exists, as alter_subscription does, so a drop_subscription that committed while the call waited raises 42704. '
'Errors: 22004 NULL name; 22023 malformed name; 42704 unknown (or just dropped) subscription.';

COMMENT ON FUNCTION outbox._log_cursor() IS
'Internal: a reader''s cursor over the log ring, taken now at every isolation level: (snap pg_snapshot, m bigint: the largest event id drawn, read after the snapshot; '
'xn xid8: the next transaction id, read after m). src/log/mod.rs explains the order. No errors.';

COMMENT ON FUNCTION outbox._log_cursor_parts() IS
'Internal: outbox._log_cursor() as (snap text, m bigint, xn bigint). No errors.';

COMMENT ON FUNCTION outbox._log_window(smallint, pg_snapshot, bigint, xid8, pg_snapshot, bigint, integer) IS
'Internal: the ids (SETOF bigint, ascending) of the log events of lane (0..15) whose transaction is visible in hi_snap and was not in the cursor (lo_snap, lo_m, lo_xn), '
'above after (default 0), at most max_events (NULL: all); read under a snapshot taken now. Consecutive windows of a lane return each committed event once, '
'in per-subject commit order (src/log/mod.rs has the proof). Errors: 22004 NULL argument, 22023 lane out of range or negative max_events.';

COMMENT ON FUNCTION outbox._log_window_ids(smallint, text, bigint, text, text, bigint, integer) IS
'Internal: outbox._log_window() with the snapshots and lo_xn as text. Errors as outbox._log_window(), and 22P02 for a malformed snapshot.';

COMMENT ON FUNCTION outbox._log_subscribe(text, text) IS
'Internal (create_subscription; claim, for a subscription restored from a dump): give a subscription its 16 lanes in outbox.log_lanes, starting at a cursor taken now (start = ''now'': '
'events whose transaction commits later) or before every logged event (''earliest''). Returns true when it made them, false when they existed. '
'Errors: 22004 NULL argument, 22023 malformed name or other start.';

COMMENT ON FUNCTION outbox._log_in_flight(text) IS
'Internal (drop_subscription): how many events the named subscription has leased out whose lease has not expired (bigint), in its batches and its exception rows. Errors: 22004 NULL subscription.';

COMMENT ON FUNCTION outbox._log_subscription_stats(text) IS
'Internal (the view outbox.subscriptions): one row for a named subscription: lag_events (bigint: events not yet delivered, read from the log or not), oldest_id and oldest_at (the oldest of them), '
'leases_in_flight (bigint, unexpired), dead_letters (bigint). Reads each lane''s window up to a cursor taken now; an event of a transaction that committed late, below a lane''s position, counts from that lane''s next read. Errors: 22004 NULL subscription.';

COMMENT ON FUNCTION outbox._log_batch_states(text) IS
'Internal (outbox._log_deliveries, hence outbox.deliveries and outbox.events): one row per event of the subscription''s batches in flight that has not left its batch: id, '
'state (''pending'': not handed out yet; ''leased'': out, lease_expires_at its claim''s expiry; ''delivered'': acked), attempts (0 or 1). Errors: 22004 NULL subscription.';

COMMENT ON FUNCTION outbox._log_batch_holders(text) IS
'Internal (outbox._log_deliveries, hence outbox.deliveries and outbox.events): one row per event out in one of the subscription''s batches in flight whose round''s worker is known: '
'id and leased_by, the worker that claimed it. Errors: 22004 NULL subscription.';

COMMENT ON FUNCTION outbox._log_backlog(text, timestamptz) IS
'Internal (outbox.health()''s backlog check): how many of the named subscription''s events (bigint) have been claimable, or waiting only behind an earlier event of their subject, '
'since published_by or earlier: unread events and events waiting in a batch published (and due, if delayed) by then, and rows of their own pending since then. '
'Events out under a lease are not counted. Errors: 22004 NULL argument.';

COMMENT ON FUNCTION outbox._log_delivered(text, timestamptz) IS
'Internal (outbox._log_deliveries): one row per event acked from one of the subscription''s finished batches (outbox.log_delivered) that finished at or after since (NULL: every one kept): '
'id and delivered_at, the time its batch finished (batch precision). Errors: 22004 NULL subscription.';

COMMENT ON FUNCTION outbox._log_cancel(text, bigint) IS
'Internal (outbox.cancel): cancel event id, which the subscription holds no row for: not read by its lane yet (a cancelled row, and the id in the lane''s skips, '
'which the claim that reads it leaves out), or waiting in the lane''s batch in flight (moved to a row with its subject''s events in the batch, then cancelled). '
'Returns false when the event is not in the log, not the subscription''s, out under a lease, delivered, or has a row of its own; false for NULL arguments. Waits for a claim moving that lane. No errors of its own.';

COMMENT ON FUNCTION outbox._log_forget(text, boolean) IS
'Internal (drop_subscription): delete its lanes (lanes = true: first, waiting for a claim that moves one), or the rest of its state '
'(lanes = false: batches, then exception rows, delivery record and activity, once its leases are counted), each under a snapshot taken when it runs, at every isolation level. '
'Returns void. Errors: 22004 NULL argument.';

COMMENT ON FUNCTION outbox._lane(bigint, text) IS
'Internal: the lane (smallint, 0-15) of event id with subject, as publish places it in the log: hashtext(subject) & 15, or (id / 64) % 16 without a subject. No errors.';

COMMENT ON FUNCTION outbox._log_floor() IS
'Internal (retention of dispatch keys and of the log''s rows of their own): the smallest event id the log holds while a subscription reads it, or 9223372036854775807 when none does or the log is empty (bigint). '
'The log retains nothing of an event below it: its dispatch key and its rows in outbox.log_exceptions may go once their retention allows. One index probe per lane and ring table. No errors.';

COMMENT ON VIEW outbox._log_deliveries IS
'Internal (outbox.deliveries, outbox.events): one row per subscription and event it receives, with its delivery state (see outbox.deliveries), and the event''s lane, dispatch_key, payload, headers and published_at.';

COMMENT ON FUNCTION outbox._check_topic_patterns(text[]) IS
'Internal (create_subscription): a topic filter as stored (text[]): NULL for every topic (NULL, or a list containing ''*''), else the patterns sorted without repeats. '
'Errors: 22023 empty array or a malformed pattern (claim''s grammar: exact topic names, prefixes ending in ''.*'', ''*''); 22004 NULL element.';

COMMENT ON FUNCTION outbox._log_detach_subject(text, text) IS
'Internal (replay and replay_dead of a named subscription): move the events of subject still in its lane''s batch to the exception table (waiting ones parked; ones out stay leased to their holder, same token and expiry), '
'so that a replayed earlier event of the subject goes before the waiting ones and never alongside one out. Waits for a claim or ack holding that lane or batch. Returns how many moved (integer); 0 for NULL arguments. No errors of its own.';

COMMENT ON FUNCTION outbox._statements() IS
'Internal (the plan test, pg_test/py/test_plans.py): every statement the claim, ack and publish paths run, one row each: name (text, file::CONST), sql (text), types (oid[]: its parameter types, $1 first). No errors.';

COMMENT ON FUNCTION outbox._log_fold_orphans() IS
'Internal (outbox._log_rotate): forwards the calls deferred to their commit (outbox.log_deferred) whose batch is gone to the events'' rows of their own, by lease token; returns how many (integer). No errors.';
COMMENT ON FUNCTION outbox._log_batch_min(bytea) IS
'Internal (outbox._log_readers_passed): the smallest id (bigint) of the waiting or out events of a batch, given its outbox.log_batches.state; NULL when it has none or the bytes are not a batch. No errors.';
