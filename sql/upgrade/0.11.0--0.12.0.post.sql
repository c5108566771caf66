-- 0.11.0 -> 0.12.0, after the new definitions.

-- A lane row restored from a dump replaces the one CREATE EXTENSION made for
-- 'default' (sql/restore.sql).
CREATE TRIGGER log_lane_restore BEFORE INSERT ON outbox.log_lanes
    FOR EACH ROW EXECUTE FUNCTION outbox._log_lane_restore();
ALTER TABLE outbox.log_lanes ENABLE ALWAYS TRIGGER log_lane_restore;

-- 'default' moves from the queue to the log, with every event of the queue in
-- its state (outbox._default_to_log, sql/subscriptions.sql). It waits for the
-- transactions that write the queue, prepared ones included.
SELECT outbox._default_to_log();
