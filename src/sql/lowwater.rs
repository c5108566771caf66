//! The claim low-water mark (src/lowwater.rs): its probe, the audit, the SQL check.

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

/// First live key of the claim index at or above `from`, in the statement's
/// snapshot, with that snapshot's xmin and the clock.
pub const PROBE: Stmt = Stmt {
    sql: concat!(
        "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::int8, f.visible_at, f.id, clock_timestamp() \
            FROM (SELECT 1) AS one LEFT JOIN LATERAL ( \
                 SELECT q.visible_at, q.id FROM outbox.event_queue q \
                  WHERE ",
        crate::in_claim_index!("q"),
        " AND (q.visible_at, q.id) >= ($1, $2) \
                  ORDER BY q.visible_at, q.id LIMIT 1) AS f ON true"
    ),
    types: &[pg_sys::TIMESTAMPTZOID, pg_sys::INT8OID],
};

pub const HAS_FLOOR_SQL: Stmt =
    Stmt { sql: "SELECT to_regprocedure('outbox._visible_floor()') IS NOT NULL", types: &[] };

/// Any live event of the claim index below W (written other than through the
/// outbox functions)?
pub const BELOW: Stmt = Stmt {
    sql: concat!(
        "SELECT EXISTS (SELECT 1 FROM outbox.event_queue q \
                          WHERE ",
        crate::in_claim_index!("q"),
        " AND (q.visible_at, q.id) < ($1, $2))"
    ),
    types: &[pg_sys::TIMESTAMPTZOID, pg_sys::INT8OID],
};
