//! Configuration (GUCs). One static per setting, one accessor each, all under
//! `outbox.*`. Settings that vary per topic live in `outbox.topics` instead.

use pgrx::prelude::*;
use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, Ordering};

/// How committed publishes wake listening workers (`outbox.notify`).
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum NotifyMode {
    /// No notifications; workers poll.
    #[name = c"off"]
    Off,
    /// One NOTIFY per distinct topic per publishing transaction, sent at commit.
    #[name = c"transaction"]
    Transaction,
    /// Commits are recorded in shared memory; the background worker sends NOTIFY.
    #[name = c"background"]
    Background,
}

/// Lease length when claim() gets none and the topic has no default_lease.
/// 30 s: long enough for a webhook with retries, short enough that a crashed
/// worker's events come back quickly (pgmq and SQS use the same order of magnitude).
static DEFAULT_LEASE_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);
/// Upper bound for any lease or heartbeat: 12 h. A longer lease hides a crash for too long.
static MAX_LEASE_MS: GucSetting<i32> = GucSetting::<i32>::new(12 * 3600 * 1000);
/// First retry delay (doubles per attempt).
static BACKOFF_BASE_MS: GucSetting<i32> = GucSetting::<i32>::new(1_000);
/// Retry delay cap: 30 min.
static BACKOFF_MAX_MS: GucSetting<i32> = GucSetting::<i32>::new(30 * 60 * 1000);
/// Claims (including expired leases) before an event goes dead.
static MAX_ATTEMPTS: GucSetting<i32> = GucSetting::<i32>::new(10);
/// Payload size limit: 1 MB. Outbox events are notifications, not blobs.
static MAX_PAYLOAD_BYTES: GucSetting<i32> = GucSetting::<i32>::new(1024 * 1024);
/// Fine subject locks (held until commit) a transaction takes before it moves to
/// the coarse lock (src/subject.rs). Each fine lock is an entry in the shared
/// lock table, which at default settings holds about 7,800 (max_locks_per_transaction
/// 64 times the number of backends; past it every session's lock requests fail,
/// 53200); the coarse lock makes every publisher of a subject in the database
/// wait for the transaction. 256, four times the per-backend average the table
/// is sized for: transactions of a handful of subjects never come near it and
/// never make others wait, and it takes about 30 transactions at the limit at
/// once to fill the table (7 at the 1,000 this replaced).
static MAX_SUBJECT_LOCKS: GucSetting<i32> = GucSetting::<i32>::new(256);
/// Largest claim, ack or publish batch.
static MAX_BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(10_000);
/// Reject publishes to unregistered topics: a typo in a topic name then fails the
/// business transaction at once instead of dead-lettering later.
static STRICT_TOPICS: GucSetting<bool> = GucSetting::<bool>::new(false);
/// W3C traceparent copied into headers when the caller passes none.
static TRACEPARENT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
/// Notify mode when the library is preloaded (boot value 'background').
static NOTIFY_PRELOADED: GucSetting<NotifyMode> = GucSetting::<NotifyMode>::new(NotifyMode::Background);
/// Notify mode when loaded on demand (boot value 'transaction').
static NOTIFY_PLAIN: GucSetting<NotifyMode> = GucSetting::<NotifyMode>::new(NotifyMode::Transaction);
/// Rows of their own of delivered events, and the finished batches' delivery
/// records, are kept this long (s): 7 days; the log's ring tables too.
static RETENTION_DELIVERED_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 86400);
/// Dead events are kept this long for audit (s): 30 days.
static RETENTION_DEAD_S: GucSetting<i32> = GucSetting::<i32>::new(30 * 86400);
/// Inbox records are kept this long (s): 7 days (the maintenance step `inbox`).
static RETENTION_INBOX_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 86400);
/// Dispatch keys are kept at least this long (s), even after their event is purged.
/// 0 = exactly as long as the event.
static RETENTION_DISPATCH_KEYS_S: GucSetting<i32> = GucSetting::<i32>::new(0);
/// How often the background worker runs retention (ms); 0 = never.
static MAINTENANCE_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(60_000);
/// Shortest pause between two wake-up passes of the background worker.
static WAKEUP_COALESCE_MS: GucSetting<i32> = GucSetting::<i32>::new(1);
/// Pause between two retention batches (purge procedures and the worker).
static PURGE_DELAY_MS: GucSetting<i32> = GucSetting::<i32>::new(20);
/// Databases the launcher serves: a comma-separated list of names; empty = every
/// database that has the extension.
static DATABASES: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// Let DROP EXTENSION outbox_ext proceed although events are undelivered.
static ALLOW_DROP: GucSetting<bool> = GucSetting::<bool>::new(false);

/// Set once in `_PG_init`, before any other code of the library runs.
static PRELOADED: AtomicBool = AtomicBool::new(false);

/// Register every GUC. Called once from `_PG_init`.
pub fn init(preloaded: bool) {
    PRELOADED.store(preloaded, Ordering::Relaxed);
    GucRegistry::define_int_guc(
        c"outbox.default_lease",
        c"Lease length for claim() when neither the call, the subscription nor the topic sets one; over outbox.max_lease, claim() refuses it (22023).",
        c"",
        &DEFAULT_LEASE_MS,
        1,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.max_lease",
        c"Longest lease claim() or extend_lease() accepts; a topic's or subscription's default_lease written under a larger value is cut to it.",
        c"",
        &MAX_LEASE_MS,
        1,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.backoff_base",
        c"First retry delay after a failure; doubles with every attempt.",
        c"",
        &BACKOFF_BASE_MS,
        1,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.backoff_max",
        c"Cap on the retry delay.",
        c"",
        &BACKOFF_MAX_MS,
        1,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.max_attempts",
        c"Claims before an event is dead-lettered, for topics without their own setting.",
        c"Read when an event is published.",
        &MAX_ATTEMPTS,
        1,
        1_000_000,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.max_payload_bytes",
        c"Largest payload publish() accepts (bytes of the jsonb value).",
        c"",
        &MAX_PAYLOAD_BYTES,
        1,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_BYTE,
    );
    GucRegistry::define_int_guc(
        c"outbox.max_batch_size",
        c"Largest batch claim(), ack() or publish_batch() accepts.",
        c"",
        &MAX_BATCH_SIZE,
        1,
        1_000_000,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.max_subject_locks",
        c"Subject locks a transaction holds before it moves to one coarse lock (publish, publish_batch).",
        c"Each is an entry in the shared lock table until commit. A transaction that publishes more distinct subjects takes the database's coarse subject lock instead: from then until it ends, every publisher of a subject in that database waits for it (publishers without a subject never do). Lower means less of the lock table, higher means fewer transactions that hold up the others.",
        &MAX_SUBJECT_LOCKS,
        1,
        1_000_000,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"outbox.strict_topics",
        c"Reject publishes to topics that are not in outbox.topics (SQLSTATE P0002).",
        c"",
        &STRICT_TOPICS,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"outbox.allow_drop",
        c"Allow DROP EXTENSION outbox_ext while events are pending or leased.",
        c"Without it (or CASCADE) the drop guard refuses with SQLSTATE 55006.",
        &ALLOW_DROP,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"outbox.traceparent",
        c"W3C traceparent copied into the headers of events published without one.",
        c"",
        &TRACEPARENT,
        GucContext::Userset,
        GucFlags::default(),
    );
    let notify = if preloaded { &NOTIFY_PRELOADED } else { &NOTIFY_PLAIN };
    GucRegistry::define_enum_guc(
        c"outbox.notify",
        c"How publishes wake LISTEN outbox workers: off, transaction or background.",
        c"'background' needs the library in shared_preload_libraries; without it, it behaves as 'transaction' and warns once per session.",
        notify,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"outbox.retention_delivered",
        c"Default age after which outbox.purge() removes delivered rows and delivery records, and retention truncates a ring table of the log.",
        c"",
        &RETENTION_DELIVERED_S,
        0,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"outbox.retention_dead",
        c"Default age after which outbox.purge_dead() removes dead and cancelled rows.",
        c"",
        &RETENTION_DEAD_S,
        0,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"outbox.retention_inbox",
        c"Age after which maintenance removes inbox records (outbox.inbox_receive).",
        c"A duplicate that arrives later is received again: keep it longer than any redelivery can take.",
        &RETENTION_INBOX_S,
        0,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"outbox.retention_dispatch_keys",
        c"Minimum age of a dispatch key before purge may drop it; 0 = drop with its event.",
        c"Raise it to keep deduplicating after the events themselves are purged.",
        &RETENTION_DISPATCH_KEYS_S,
        0,
        i32::MAX,
        GucContext::Userset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_int_guc(
        c"outbox.maintenance_interval",
        c"How often the background worker runs retention; 0 turns it off.",
        c"",
        &MAINTENANCE_INTERVAL_MS,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.wakeup_coalesce",
        c"Shortest pause between two wake-up passes of the background worker.",
        c"Commits arriving meanwhile are announced together by the next pass; an idle worker answers the first commit at once. 0 = a pass per latch wake-up.",
        &WAKEUP_COALESCE_MS,
        0,
        1000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"outbox.purge_delay",
        c"Pause after each committed retention batch of purge(), purge_dead() and the background worker.",
        c"Paces retention like autovacuum's cost delay, so a large purge leaves the machine to the workers; 0 = no pause.",
        &PURGE_DELAY_MS,
        0,
        10_000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    // Defined in every backend, not only with preload: a publisher reads it to
    // know whether a worker will serve its database.
    GucRegistry::define_string_guc(
        c"outbox.databases",
        c"Databases the outbox background workers serve: a comma-separated list of names; empty means every database that has the extension.",
        c"Templates and databases that do not allow connections are never served. Changes take effect at reload.",
        &DATABASES,
        GucContext::Sighup,
        GucFlags::default(),
    );
    let _ = preloaded;
}

/// Default lease in microseconds.
pub fn default_lease_us() -> i64 {
    DEFAULT_LEASE_MS.get() as i64 * 1000
}
/// Maximum lease in microseconds.
pub fn max_lease_us() -> i64 {
    MAX_LEASE_MS.get() as i64 * 1000
}
/// Backoff base in microseconds.
pub fn backoff_base_us() -> i64 {
    BACKOFF_BASE_MS.get() as i64 * 1000
}
/// Backoff cap in microseconds.
pub fn backoff_max_us() -> i64 {
    BACKOFF_MAX_MS.get() as i64 * 1000
}
/// Default max attempts.
pub fn max_attempts() -> i32 {
    MAX_ATTEMPTS.get()
}
/// Payload limit in bytes.
pub fn max_payload_bytes() -> i64 {
    MAX_PAYLOAD_BYTES.get() as i64
}
/// Batch limit.
pub fn max_batch_size() -> i32 {
    MAX_BATCH_SIZE.get()
}
/// Fine subject locks a transaction takes before it escalates (src/subject.rs).
pub fn max_subject_locks() -> usize {
    MAX_SUBJECT_LOCKS.get().max(1) as usize
}
/// Strict topic registry.
pub fn strict_topics() -> bool {
    STRICT_TOPICS.get()
}
/// Session traceparent, if set and non-empty.
pub fn traceparent() -> Option<String> {
    TRACEPARENT.get().and_then(|c| c.into_string().ok()).filter(|s| !s.is_empty())
}
/// Configured notify mode (before the preload fallback).
pub fn notify_mode() -> NotifyMode {
    if preloaded() {
        NOTIFY_PRELOADED.get()
    } else {
        NOTIFY_PLAIN.get()
    }
}
/// Whether the library was loaded through shared_preload_libraries.
pub fn preloaded() -> bool {
    PRELOADED.load(Ordering::Relaxed)
}
/// Maintenance interval in ms (0 = off).
pub fn maintenance_interval_ms() -> i32 {
    MAINTENANCE_INTERVAL_MS.get()
}
/// Shortest pause between wake-up passes in ms.
pub fn wakeup_coalesce_ms() -> i32 {
    WAKEUP_COALESCE_MS.get()
}
/// Pause between retention batches in ms (0 = none).
pub fn purge_delay_ms() -> i32 {
    PURGE_DELAY_MS.get()
}
/// The names `outbox.databases` lists, or None when it is empty (every database).
pub fn database_filter() -> Option<Vec<String>> {
    let v = DATABASES.get()?;
    // Trims what outbox.health() trims (btrim of space, tab, CR, LF), so both agree.
    let names: Vec<String> = v
        .to_string_lossy()
        .split(',')
        .map(|n| n.trim_matches([' ', '\t', '\r', '\n']).to_string())
        .filter(|n| !n.is_empty())
        .collect();
    (!names.is_empty()).then_some(names)
}

/// True when `outbox.databases` lets the launcher serve database `name`.
pub fn serves(name: &str) -> bool {
    database_filter().is_none_or(|names| names.iter().any(|n| n == name))
}

thread_local! {
    /// (the `outbox.databases` value it was computed for, the answer).
    static SERVED_HERE: std::cell::RefCell<Option<(CString, bool)>> = const { std::cell::RefCell::new(None) };
}

/// True when `outbox.databases` lets the launcher serve the current database.
/// Read at every publish in `background` mode: free while the setting is empty,
/// and computed once per value of the setting otherwise.
pub fn serves_current_database() -> bool {
    let Some(v) = DATABASES.get() else { return true };
    if v.as_bytes().iter().all(|b| b.is_ascii_whitespace() || *b == b',') {
        return true;
    }
    SERVED_HERE.with(|c| {
        let mut c = c.borrow_mut();
        if let Some((seen, answer)) = c.as_ref() {
            if *seen == v {
                return *answer;
            }
        }
        let answer = crate::pg::catalog::current_database_name().is_some_and(|n| serves(&n));
        *c = Some((v, answer));
        answer
    })
}

/// `outbox._setting(name text) -> text`: the current value of an `outbox.*`
/// setting, as SHOW prints it. SQL code calls this instead of current_setting()
/// because calling it loads the library, which defines the settings: in a fresh
/// session without preload, current_setting('outbox.x') would fail with
/// "unrecognized configuration parameter" (a pg_cron job's first call is such a
/// session). Errors: 22023 for a name outside `outbox.`.
#[pg_extern(name = "_setting", stable, parallel_safe)]
fn setting(name: &str) -> Option<String> {
    if !name.starts_with("outbox.") {
        crate::errors::raise(crate::errors::INVALID_PARAMETER, format!("{name:?} is not an outbox setting"));
    }
    let c = CString::new(name).ok()?;
    // The SHOW form carries units ('12h', '7d'), so it casts to interval correctly;
    // GetConfigOption would return bare numbers in the setting's base unit.
    crate::pg::show_setting(&c)
}
