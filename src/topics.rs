//! A per-backend cache of the topic registry for the publish path and the
//! claims of the log.
//!
//! publish() needs the topic's max_attempts; a claim of the log, the topics'
//! default leases (src/log/claim.rs). Looking it up in SQL on every call
//! costs an index-scan node to start and stop per publish (about a tenth of its
//! time), so each backend keeps `outbox.topics` in memory. Any change to the table
//! fires a statement trigger that sends a relcache invalidation for it; a copy is
//! valid only for the count of the watched tables' relcache invalidations it was
//! loaded under ([`pg::GenerationCache`]), so the next publish after one reloads
//! it, reading the registry as committed then (not under a REPEATABLE READ
//! transaction's older snapshot, which would keep the change out of the copy).
//! Invalidations are transactional: other sessions see the change when it
//! commits, the changing session at its next command.

use crate::errors;
use crate::pg;
use crate::pg::fcall::Call;
use crate::pg::plans;
use crate::sql::topics::LOAD;
use pgrx::prelude::*;
use std::collections::HashMap;

/// A registered topic's settings the cache keeps (None: left to the GUC).
#[derive(Clone, Copy)]
struct Entry {
    max_attempts: Option<i32>,
    /// default_lease in microseconds.
    default_lease_us: Option<i64>,
}

/// topic -> its settings.
type Registry = HashMap<String, Entry>;

thread_local! {
    /// The registry, valid for the count of invalidations of the watched tables
    /// (outbox.topics among them) it was loaded under.
    static CACHE: pg::GenerationCache<Registry> = const { pg::GenerationCache::new(c"topics") };
}

/// The registry as committed now: under a snapshot taken now, not the
/// transaction's (a REPEATABLE READ snapshot older than a change would store
/// the old registry under the new generation, for later transactions too).
fn load() -> Registry {
    plans::run_latest(&LOAD, &[], |rows| {
        let mut map = Registry::new();
        rows.for_each(|row| {
            if let Some(name) = row.text(0) {
                let default_lease_us = row
                    .interval(2)
                    .as_ref()
                    .and_then(crate::validate::interval_us)
                    .and_then(|us| i64::try_from(us).ok());
                map.insert(name, Entry { max_attempts: row.i32(1), default_lease_us });
            }
        });
        map
    })
}

/// The registered state of `topic`: None when unregistered, Some(max_attempts)
/// when registered (whose inner None means "use outbox.max_attempts").
pub fn lookup(topic: &str) -> Option<Option<i32>> {
    CACHE.with(|c| c.with(load, |m| m.get(topic).map(|e| e.max_attempts)))
}

/// Whether any registered topic sets its own default_lease.
pub fn any_default_lease() -> bool {
    CACHE.with(|c| c.with(load, |m| m.values().any(|e| e.default_lease_us.is_some())))
}

/// The default lease (µs) of `topic` when it is registered with one.
pub fn default_lease_us(topic: &str) -> Option<i64> {
    CACHE.with(|c| c.with(load, |m| m.get(topic).and_then(|e| e.default_lease_us)))
}

/// Trigger body for `outbox._topics_changed()`: invalidate every backend's cache.
///
/// # Safety
/// Called by PostgreSQL as a statement-level trigger on outbox.topics.
pub unsafe fn topics_changed(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of the trigger function outbox._topics_changed(), which
    // takes no arguments (sql/admin.sql).
    let call = unsafe { Call::new(fcinfo) };
    let Some(relid) = call.trigger_relid() else {
        errors::raise(errors::INVALID_PARAMETER, "_topics_changed() must be called as a trigger");
    };
    pg::invalidate_relcache(relid);
    pg_sys::Datum::from(0)
}
