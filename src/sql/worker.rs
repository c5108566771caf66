//! The background worker's wake-up pass (src/worker.rs).

/// Whether the extension is installed in the worker's database (the worker may
/// start before CREATE EXTENSION, or run after DROP EXTENSION).
pub const IS_INSTALLED: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'outbox_ext')";

/// Topics with a claimable event due by $2 ($1 only marks the pass as a sweep).
pub const DUE_ALL: &str = concat!(
    "SELECT DISTINCT q.topic FROM outbox.event_queue q WHERE ",
    crate::in_claim_index!("q"),
    " AND q.visible_at <= $2 AND $1 IS NOT NULL"
);

/// Topics with an event that became claimable by the clock in ($1, $2]: delayed
/// publishes (visible after they were published), retries and expired leases. An
/// immediate publish was already announced by its own commit, in the mode its
/// session chose.
pub const DUE_BY_CLOCK: &str = concat!(
    "SELECT DISTINCT q.topic FROM outbox.event_queue q WHERE ",
    crate::in_claim_index!("q"),
    " AND q.visible_at > $1 AND q.visible_at <= $2",
    " AND (q.visible_at > q.published_at OR q.attempts > 0 OR q.state = 'leased')"
);

/// When the next claimable event after $1 comes due.
pub const NEXT_DUE: &str = concat!(
    "SELECT min(q.visible_at) FROM outbox.event_queue q WHERE ",
    crate::in_claim_index!("q"),
    " AND q.visible_at > $1"
);
