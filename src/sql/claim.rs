//! Statements of claim (src/claim.rs) and of the subscription catalog
//! (src/subscriptions.rs).

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

/// Every subscription's settings, for the per-backend cache (src/subscriptions.rs).
pub const SUBSCRIPTIONS: Stmt = Stmt {
    sql: "SELECT c.name, c.paused, c.max_attempts, c.backoff_base, c.backoff_max, c.default_lease, \
                 c.topics, c.dead_letter_policy \
            FROM outbox.subscription_catalog c",
    types: &[],
};

/// A dropped subscription's lanes (drop_subscription, first).
pub const FORGET_LANES: Stmt =
    Stmt { sql: "DELETE FROM outbox.log_lanes WHERE subscription = $1", types: &[pg_sys::TEXTOID] };

/// A dropped subscription's batches (drop_subscription, once its leases are
/// counted): before its exception rows, in a statement of its own, so that
/// the next one's snapshot sees what a fail() holding a batch row wrote.
pub const FORGET_BATCHES: Stmt =
    Stmt { sql: "DELETE FROM outbox.log_batches WHERE subscription = $1", types: &[pg_sys::TEXTOID] };

/// The rest of a dropped subscription's state: exception rows, delivery
/// record, activity.
pub const FORGET_REST: Stmt = Stmt {
    sql: "WITH x AS (DELETE FROM outbox.log_exceptions WHERE subscription = $1), \
               d AS (DELETE FROM outbox.log_delivered WHERE subscription = $1) \
          DELETE FROM outbox.subscription_activity WHERE name = $1",
    types: &[pg_sys::TEXTOID],
};

/// Note when the subscription was last claimed from, only if no other
/// transaction holds or changed its activity row (`_lock_row`): a claim never
/// waits for this, and under REPEATABLE READ a row changed since the snapshot is
/// skipped, not a serialization failure.
pub const NOTE_CLAIM: Stmt = Stmt {
    sql: "UPDATE outbox.subscription_activity a SET last_claim_at = $2 \
           WHERE a.name = $1 AND outbox._lock_row('outbox.subscription_activity'::regclass::oid, a.ctid)",
    types: &[pg_sys::TEXTOID, pg_sys::TIMESTAMPTZOID],
};
