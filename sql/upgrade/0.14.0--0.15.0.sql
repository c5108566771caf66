-- 0.14.0 -> 0.15.0: retention asks outbox._log_floor() (new) once per
-- statement instead of outbox._log_retains(id) per dispatch key and per row
-- of the log's own (sql/retention.sql): _purge_step's new body and the new
-- function follow. _log_retains has no caller left.
DROP FUNCTION outbox._log_retains(bigint);
