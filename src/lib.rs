//! outbox_ext: the transactional outbox as a PostgreSQL extension.
//!
//! Modules, one concern each:
//! - [`publish`] — `outbox.publish`, `outbox.publish_batch` (subject locks, dispatch keys)
//! - [`claim`] — `outbox.claim` (arguments, the subscription; the claim is the log's)
//! - [`lease`] — `outbox.ack`, `outbox.fail`, `outbox.extend_lease`
//! - [`log`] — the append-only event log ring every subscription reads: lanes,
//!   batches, rows of their own, and the proofs of delivery order and fencing
//! - [`subject`] — publish's subject locks: fine per subject, one coarse lock past `outbox.max_subject_locks`
//! - [`subscriptions`] — the per-backend cache of the subscription catalog
//! - [`maintenance`] — the one list of maintenance steps
//! - [`backoff`] — retry delays
//! - [`wakeup`] — LISTEN/NOTIFY without serialising publishers
//! - [`launcher`], [`worker`] and [`registry`] — the background workers: one
//!   launcher per cluster, one worker per database with the extension (wake-ups
//!   and retention), and the shared table of served databases
//! - [`sql`] — every SQL statement the Rust code runs, and the predicates they share
//! - [`handshake`] — this library serves only the SQL it was built with
//! - [`gucs`], [`validate`], [`errors`], [`xact`] — plumbing
//! - [`pg`] — the only module that talks to PostgreSQL internals: the v1 call
//!   interface ([`pg::fcall`]), saved SPI plans ([`pg::plans`]), publish's direct
//!   heap insert ([`pg::heap`]), search-path pinning, catalog lookups, snapshots,
//!   locks and small accessors (clock, xids, database, latches)
//!
//! The schema and the SQL-level API live in `sql/`.

use pgrx::prelude::*;

pub mod backoff;
pub mod claim;
pub mod errors;
pub mod gucs;
pub mod handshake;
pub mod launcher;
pub mod lease;
pub mod log;
pub mod maintenance;
pub mod pg;
pub mod publish;
pub mod registry;
pub mod sql;
pub mod subject;
pub mod subscriptions;
pub mod topics;
pub mod validate;
pub mod wakeup;
pub mod worker;
pub mod xact;

::pgrx::pg_module_magic!(name, version);

pgrx::extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
pgrx::extension_sql_file!("../sql/api.sql", name = "api", requires = ["schema"]);
pgrx::extension_sql_file!(
    "../sql/admin.sql",
    name = "admin",
    requires = ["schema", wakeup::wake, gucs::setting, validate::pattern_kind, validate::check_topic]
);
pgrx::extension_sql_file!(
    "../sql/log.sql",
    name = "log",
    requires =
        ["admin", log::log_cursor_parts, log::log_window_ids, log::claim::log_subscribe, log::claim::log_in_flight]
);
pgrx::extension_sql_file!(
    "../sql/subscriptions.sql",
    name = "subscriptions",
    requires = ["log", validate::check_subscription, validate::check_topic_patterns]
);
pgrx::extension_sql_file!("../sql/restore.sql", name = "restore", requires = ["subscriptions"]);
pgrx::extension_sql_file!("../sql/inbox.sql", name = "inbox", requires = ["restore"]);
pgrx::extension_sql_file!(
    "../sql/retention.sql",
    name = "retention",
    requires = ["inbox", maintenance::maintenance_steps, maintenance::maintenance_step]
);
pgrx::extension_sql_file!(
    "../sql/monitoring.sql",
    name = "monitoring",
    requires = ["retention", wakeup::wakeup_status]
);
pgrx::extension_sql_file!("../sql/guard.sql", name = "guard", requires = ["monitoring"]);
pgrx::extension_sql_file!("../sql/dump_guard.sql", name = "dump_guard", requires = ["guard"]);
pgrx::extension_sql_file!("../sql/comments.sql", name = "comments", requires = ["dump_guard", wakeup::announce]);
pgrx::extension_sql_file!("../sql/announce.sql", name = "announce", requires = ["comments", wakeup::announce]);
pgrx::extension_sql_file!(
    "../sql/handshake.sql",
    name = "handshake",
    requires = ["announce", handshake::library_fingerprint, handshake::handshake]
);
pgrx::extension_sql_file!("../sql/security.sql", name = "security", finalize);

v1_function!(outbox_publish, pg_finfo_outbox_publish, publish::publish);
v1_function!(outbox_publish_batch, pg_finfo_outbox_publish_batch, publish::publish_batch);
v1_function!(outbox_claim, pg_finfo_outbox_claim, claim::claim);
v1_function!(unpinned outbox_lock_row, pg_finfo_outbox_lock_row, claim::lock_row);
v1_function!(unpinned outbox_try_policy_lock, pg_finfo_outbox_try_policy_lock, log::exceptions::try_policy_lock);
v1_function!(unpinned outbox_releasable, pg_finfo_outbox_releasable, log::deferred::releasable_v1);
v1_function!(outbox_ack, pg_finfo_outbox_ack, lease::ack);
v1_function!(outbox_ack_batch, pg_finfo_outbox_ack_batch, lease::ack_batch);
v1_function!(outbox_fail, pg_finfo_outbox_fail, lease::fail);
v1_function!(outbox_extend_lease, pg_finfo_outbox_extend_lease, lease::extend_lease);
v1_function!(outbox_backoff_delay, pg_finfo_outbox_backoff_delay, lease::backoff_delay);
v1_function!(outbox_topics_changed, pg_finfo_outbox_topics_changed, topics::topics_changed);

/// Library initialisation: GUCs, shared memory, transaction callbacks and, when
/// preloaded, the launcher and the hook that makes workers leave a database that
/// a statement needs to itself.
#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    pg::quiet_rust_backtraces();
    let preloaded = pg::preload_in_progress();
    gucs::init(preloaded);
    xact::init();
    pg::count_relcache_invalidations();
    pg::count_function_invalidations();
    if preloaded {
        registry::init();
        pg::utility::install(registry::pause);
        launcher::register();
    }
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    /// One-off setup before the test run.
    pub fn setup(_options: Vec<&str>) {}

    /// postgresql.conf settings for the test cluster.
    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
