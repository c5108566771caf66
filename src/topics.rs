//! A per-backend cache of the topic registry for the publish path.
//!
//! publish() needs the topic's max_attempts. Looking it up in SQL on every call
//! costs an index-scan node to start and stop per publish (about a tenth of its
//! time), so each backend keeps `outbox.topics` in memory. Any change to the table
//! fires a statement trigger that sends a relcache invalidation for it; a copy is
//! valid only for the count of relcache invalidations it was loaded under
//! ([`pg::load_consistent`]), so the next publish after one reloads it.
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
    /// The registry, valid for the relcache generation it was loaded under. The
    /// relid of outbox.topics is not at hand in an invalidation callback, and any
    /// relcache invalidation is rare next to publishes, so every one makes it stale.
    static CACHE: pg::GenerationCache<Registry> = const { pg::GenerationCache::new() };
}

fn load() -> Registry {
    plans::run(&LOAD, &[], |t| {
        t.map(|row| {
            let name: String = errors::spi(row.get::<String>(1)).unwrap_or_default();
            let max: Option<i32> = errors::spi(row.get::<i32>(2));
            (name, max)
        })
        .collect::<Registry>()
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
