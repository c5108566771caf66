//! The maintenance steps, as data: the background worker and `CALL
//! outbox.run_maintenance()` (the pg_cron path) both run exactly this list, in
//! this order, and record the same columns of `outbox.maintenance_runs`.
//!
//! None of the steps is needed for delivery: they reclaim space. (The log's
//! step also rebases a log restored from a dump once the restore looks over,
//! which the first claim would do anyway: src/log/restore.rs.)

use pgrx::prelude::*;

/// Rows per retention batch, at most.
pub const BATCH: i64 = 1000;

/// Rows per retention batch: [`BATCH`], or `outbox.max_batch_size` when that is
/// lower (a step asking for more would fail with 54000 every time).
pub fn batch() -> i64 {
    BATCH.min(crate::gucs::max_batch_size() as i64)
}

/// (step, column of outbox.maintenance_runs that records its count).
/// - `delivered`, `dead`, `keys`: retention of the subscriptions' rows of their
///   own and delivery records, and of orphaned dispatch keys (sql/retention.sql);
/// - `log`: truncate and rotate the log ring (src/log/mod.rs);
/// - `inbox`: retention of the inbox's records (sql/inbox.sql).
pub const STEPS: [(&str, Option<&str>); 5] = [
    ("delivered", Some("purged_delivered")),
    ("dead", Some("purged_dead")),
    ("keys", Some("purged_keys")),
    ("log", None),
    ("inbox", None),
];

/// Run one batch of `step` in the current transaction; returns (rows or, for
/// `log`, ring tables removed, whether the step is complete). A retention step
/// is complete when a batch is short of [`batch`]; `log` truncates at most one
/// table per call, whose lock lasts until the caller commits, so it is complete
/// only when a call truncated none.
pub fn run_step(step: &str) -> (i64, bool) {
    if step == "log" {
        let n = crate::log::rotate();
        return (n, n == 0);
    }
    let n = Spi::get_one_with_args::<i64>(
        "SELECT outbox._purge_step($1, NULL, $2::int4)",
        &[step.into(), (batch() as i32).into()],
    )
    .ok()
    .flatten()
    .unwrap_or(0);
    (n, n < batch())
}

/// `outbox._maintenance_steps() -> TABLE(step text, logged_as text)`: [`STEPS`].
#[pg_extern(name = "_maintenance_steps", immutable, parallel_safe)]
fn maintenance_steps() -> TableIterator<'static, (name!(step, String), name!(logged_as, Option<String>))> {
    TableIterator::new(STEPS.iter().map(|(s, c)| (s.to_string(), c.map(|c| c.to_string()))))
}

/// `outbox._maintenance_step(step text) -> TABLE(removed bigint, done boolean)`:
/// one batch of [`run_step`], for `outbox.run_maintenance()`; `done` says the
/// step has nothing more to do in this run. 22023 for a step not in the list.
#[pg_extern(name = "_maintenance_step", volatile, parallel_unsafe)]
fn maintenance_step(step: &str) -> TableIterator<'static, (name!(removed, i64), name!(done, bool))> {
    if !STEPS.iter().any(|(s, _)| *s == step) {
        crate::errors::raise(crate::errors::INVALID_PARAMETER, format!("unknown maintenance step {step:?}"));
    }
    TableIterator::once(run_step(step))
}
