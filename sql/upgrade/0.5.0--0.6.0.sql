-- 0.5.0 -> 0.6.0: background workers in every database (src/launcher.rs).
-- wakeup_status() gains the columns launcher_pid and state; a changed result
-- type needs the function dropped first (nothing depends on it in the catalog:
-- outbox.health() calls it from PL/pgSQL).
DROP FUNCTION outbox.wakeup_status();
