//! A per-backend cache of the topic registry for the publish path.
//!
//! publish() needs the topic's max_attempts. Looking it up in SQL on every call
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

/// topic -> max_attempts (None: the topic exists but leaves it to the GUC).
type Registry = HashMap<String, Option<i32>>;

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
                map.insert(name, row.i32(1));
            }
        });
        map
    })
}

/// The registered state of `topic`: None when unregistered, Some(max_attempts)
/// when registered (whose inner None means "use outbox.max_attempts").
pub fn lookup(topic: &str) -> Option<Option<i32>> {
    CACHE.with(|c| c.with(load, |m| m.get(topic).copied()))
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
