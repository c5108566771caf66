-- Privileges. Three NOLOGIN roles, created if missing (roles are
-- cluster-wide, so DROP EXTENSION leaves them):
--   outbox_publisher  publish and publish_batch, nothing else;
--   outbox_worker     claim, ack, fail, extend_lease (it reads events through claim);
--   outbox_admin      replay, cancel, purge, topic management, read everything;
--   outbox_monitor    read-only (0.11.0): counts, states and errors through the
--                     monitoring views and functions, never payloads or headers.
-- Grant them to login roles: GRANT outbox_worker TO app_worker;
--
-- No role but the owner may write the tables: the API functions are SECURITY
-- DEFINER with a pinned search_path, and every value they take is bound as a
-- parameter, never spliced into SQL.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_publisher') THEN
        CREATE ROLE outbox_publisher NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_worker') THEN
        CREATE ROLE outbox_worker NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_admin') THEN
        CREATE ROLE outbox_admin NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'outbox_monitor') THEN
        CREATE ROLE outbox_monitor NOLOGIN;
    END IF;
END
$$;

REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA outbox FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;
REVOKE EXECUTE ON ALL PROCEDURES IN SCHEMA outbox FROM PUBLIC;

GRANT USAGE ON SCHEMA outbox TO outbox_publisher, outbox_worker, outbox_admin, outbox_monitor;

ALTER FUNCTION outbox.publish(text, jsonb, text, text, jsonb, timestamptz) SECURITY DEFINER;
ALTER FUNCTION outbox.publish_batch(text, jsonb[], text[], text[]) SECURITY DEFINER;
GRANT EXECUTE ON FUNCTION outbox.publish(text, jsonb, text, text, jsonb, timestamptz) TO outbox_publisher, outbox_admin;
GRANT EXECUTE ON FUNCTION outbox.publish_batch(text, jsonb[], text[], text[]) TO outbox_publisher, outbox_admin;

ALTER FUNCTION outbox.claim(text, integer, interval, text[], text) SECURITY DEFINER;
ALTER FUNCTION outbox.ack(bigint, uuid) SECURITY DEFINER;
ALTER FUNCTION outbox.ack(bigint[], uuid[]) SECURITY DEFINER;
ALTER FUNCTION outbox.fail(bigint, uuid, text, interval, boolean) SECURITY DEFINER;
ALTER FUNCTION outbox.extend_lease(bigint, uuid, interval) SECURITY DEFINER;
GRANT EXECUTE ON FUNCTION outbox.claim(text, integer, interval, text[], text) TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox.ack(bigint, uuid) TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox.ack(bigint[], uuid[]) TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox.fail(bigint, uuid, text, interval, boolean) TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox.extend_lease(bigint, uuid, interval) TO outbox_worker;
GRANT EXECUTE ON FUNCTION outbox.backoff_delay(integer, interval, interval, boolean) TO outbox_worker, outbox_admin, outbox_publisher;
-- 0.11.0: the outbox's identity (the relay) and the inbox (consumers that
-- write to PostgreSQL, the relay's workers among them).
ALTER FUNCTION outbox.outbox_id() SECURITY DEFINER;
ALTER FUNCTION outbox.inbox_receive(text, text) SECURITY DEFINER;
GRANT EXECUTE ON FUNCTION outbox.outbox_id() TO outbox_worker, outbox_admin, outbox_publisher;
GRANT EXECUTE ON FUNCTION outbox.inbox_receive(text, text) TO outbox_worker, outbox_admin;

ALTER FUNCTION outbox.replay(bigint, text) SECURITY DEFINER;
ALTER FUNCTION outbox.replay_dead(text, timestamptz, timestamptz, boolean, text) SECURITY DEFINER;
ALTER FUNCTION outbox.cancel(bigint, text) SECURITY DEFINER;
ALTER FUNCTION outbox.alter_subscription(text, integer, interval, interval, interval, interval) SECURITY DEFINER;
ALTER FUNCTION outbox.pause_subscription(text) SECURITY DEFINER;
ALTER FUNCTION outbox.resume_subscription(text) SECURITY DEFINER;
ALTER FUNCTION outbox.create_topic(text, integer, interval, interval, interval, text, interval, interval) SECURITY DEFINER;
ALTER FUNCTION outbox.alter_topic(text, integer, interval, interval, interval, text, interval, interval) SECURITY DEFINER;
ALTER FUNCTION outbox.drop_topic(text, boolean) SECURITY DEFINER;
ALTER FUNCTION outbox._purge_step(text, interval, integer) SECURITY DEFINER;
ALTER FUNCTION outbox._log_maintenance(timestamptz, jsonb) SECURITY DEFINER;
ALTER FUNCTION outbox._purge_pause() SECURITY DEFINER;
ALTER FUNCTION outbox._log_rotate() SECURITY DEFINER;
-- The log's reader functions read the id sequence and write the readers'
-- tables, which only the owner may.
ALTER FUNCTION outbox._log_cursor_parts() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_subscribe(text, text) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_in_flight(text) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_subscription_stats(text) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_batch_states(text) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_batch_holders(text) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_backlog(text, timestamptz) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_delivered(text, timestamptz) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_cancel(text, bigint) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_forget(text, boolean) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_detach_subject(text, text) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION outbox._log_rebase() SECURITY DEFINER;
ALTER FUNCTION outbox.create_subscription(text, text[], text, integer, interval, interval, interval, text, interval) SECURITY DEFINER;
ALTER FUNCTION outbox.drop_subscription(text, boolean) SECURITY DEFINER;
GRANT EXECUTE ON FUNCTION outbox.replay(bigint, text), outbox.replay_dead(text, timestamptz, timestamptz, boolean, text),
    outbox.cancel(bigint, text),
    outbox.alter_subscription(text, integer, interval, interval, interval, interval),
    outbox.pause_subscription(text), outbox.resume_subscription(text),
    outbox._subscription(text), outbox._check_subscription(text), outbox._check_max_lag(interval),
    outbox.create_topic(text, integer, interval, interval, interval, text, interval, interval),
    outbox.alter_topic(text, integer, interval, interval, interval, text, interval, interval),
    outbox.drop_topic(text, boolean),
    outbox._purge_step(text, interval, integer), outbox._log_maintenance(timestamptz, jsonb),
    outbox._maintenance_steps(), outbox._maintenance_step(text),
    outbox._purge_pause(), outbox._log_rotate(), outbox._log_readers_passed(smallint, text), outbox._log_batch_min(bytea), outbox._log_let_go(smallint), outbox._log_note_losses(smallint), outbox._log_written_since(smallint, pg_snapshot),
    outbox._log_cursor(), outbox._log_cursor_parts(),
    outbox._log_window(smallint, pg_snapshot, bigint, xid8, pg_snapshot, bigint, integer),
    outbox._log_window_ids(smallint, text, bigint, text, text, bigint, integer),
    outbox._log_subscribe(text, text), outbox._log_in_flight(text), outbox._log_subscription_stats(text), outbox._log_batch_states(text), outbox._log_batch_holders(text), outbox._log_backlog(text, timestamptz), outbox._log_delivered(text, timestamptz), outbox._log_cancel(text, bigint), outbox._log_forget(text, boolean), outbox._log_detach_subject(text, text), outbox._check_topic_patterns(text[]),
    outbox.create_subscription(text, text[], text, integer, interval, interval, interval, text, interval), outbox.drop_subscription(text, boolean),
    outbox._retention_guc(text), outbox._log_floor(), outbox._pattern_kind(text), outbox._topic_matches(text, text),
    outbox._lane(bigint, text), outbox._check_topic(text),
    outbox.health(interval, bigint, interval, interval, bigint), outbox.wakeup_status(), outbox._log_rebase(), outbox._log_restore_quiet()
    TO outbox_admin;
GRANT EXECUTE ON PROCEDURE outbox.purge(interval, integer, bigint), outbox.purge_dead(interval, integer, bigint),
    outbox.run_maintenance() TO outbox_admin;
GRANT SELECT ON ALL TABLES IN SCHEMA outbox TO outbox_admin;

-- 0.11.0: the read-only role. A view reads its tables with its owner's
-- privileges, but the functions it calls are checked against the caller
-- (CREATE VIEW, "Notes"), so the monitor gets EXECUTE on the read-only helpers
-- the views call: each is SECURITY DEFINER or reads nothing, and none returns
-- a payload or headers. outbox.events is granted column by column: selecting
-- payload or headers fails with 42501 for the monitor.
ALTER FUNCTION outbox.blocked_subjects(text, integer) SECURITY DEFINER;
ALTER FUNCTION outbox.delivered_per_minute(integer, text) SECURITY DEFINER;
GRANT EXECUTE ON FUNCTION outbox.blocked_subjects(text, integer), outbox.delivered_per_minute(integer, text)
    TO outbox_admin, outbox_monitor;
GRANT EXECUTE ON FUNCTION outbox.health(interval, bigint, interval, interval, bigint), outbox.wakeup_status(),
    outbox._log_subscription_stats(text), outbox._log_batch_states(text), outbox._log_batch_holders(text),
    outbox._log_backlog(text, timestamptz), outbox._log_delivered(text, timestamptz), outbox._topic_matches(text, text), outbox._pattern_kind(text),
    outbox._lane(bigint, text)
    TO outbox_monitor;
GRANT SELECT ON outbox.stats, outbox.subscriptions, outbox.deliveries, outbox.topics, outbox.maintenance_log TO outbox_monitor;
GRANT SELECT (id, topic, subject, dispatch_key, state, attempts, max_attempts, available_at, lease_expires_at, leased_by,
              last_error, errors, published_at, delivered_at, dead_at, cancelled_at)
    ON outbox.events TO outbox_monitor;
