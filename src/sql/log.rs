//! The log ring (src/log.rs, sql/log.sql).

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

/// The ring table publishers append to: the open one (opened, not sealed); none
/// before the first rotation, which means `log_0`.
pub const CURRENT: Stmt = Stmt {
    sql: "SELECT n FROM outbox.log_state WHERE opened_at IS NOT NULL AND sealed_at IS NULL \
          ORDER BY opened_at DESC LIMIT 1",
    types: &[],
};

/// One row into ring table `log_<n>`, for when the direct heap path is ruled out
/// (someone added a trigger, a rule, a column...): one statement per table, so
/// each is a saved plan.
macro_rules! append_one {
    ($n:literal) => {
        Stmt {
            sql: concat!(
                "INSERT INTO outbox.log_",
                $n,
                " (id, txid, lane, topic, subject, dispatch_key, payload, headers, max_attempts, published_at, deliver_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, now(), $10)"
            ),
            types: &[
                pg_sys::INT8OID,
                pg_sys::XID8OID,
                pg_sys::INT2OID,
                pg_sys::TEXTOID,
                pg_sys::TEXTOID,
                pg_sys::TEXTOID,
                pg_sys::JSONBOID,
                pg_sys::JSONBOID,
                pg_sys::INT4OID,
                pg_sys::TIMESTAMPTZOID,
            ],
        }
    };
}

/// [`append_one`] for each ring table, by number.
pub const APPEND_ONE: [Stmt; 4] = [append_one!("0"), append_one!("1"), append_one!("2"), append_one!("3")];

/// The maintenance step `log`: seal, rotate and truncate (sql/log.sql).
pub const ROTATE: Stmt = Stmt { sql: "SELECT outbox._log_rotate()", types: &[] };

/// A cursor's snapshot and `m`, under a snapshot taken now ([`plans::run_latest`]
/// pushes it as the active one, which `pg_current_snapshot()` returns); `m` is
/// read after the snapshot was taken.
///
/// [`plans::run_latest`]: crate::pg::plans::run_latest
pub const CURSOR: Stmt = Stmt {
    sql: "SELECT pg_current_snapshot()::text, COALESCE(pg_sequence_last_value('outbox.event_id_seq'), 0)",
    types: &[],
};

/// The events of lane $1 between the cursor ($2 snapshot, $3 m, $4 xn) and the
/// snapshot $5, ids above $6, at most $7 (NULL: all), in id order. The two
/// branches are the access paths (ids drawn after m; transactions running at
/// the cursor or begun after it with an id below xn); the outer filter is the
/// definition (visible in $5, not in $2). src/log.rs proves the branches find
/// every event the filter accepts.
pub const WINDOW: Stmt = Stmt {
    sql: "SELECT w.id FROM ( \
            SELECT e.id, e.txid FROM outbox.log e \
             WHERE e.lane = $1 AND e.id > greatest($3, $6) \
            UNION ALL \
            SELECT e.id, e.txid FROM outbox.log e \
             WHERE e.lane = $1 AND e.id > $6 AND e.id <= $3 \
               AND (e.txid = ANY (ARRAY(SELECT pg_snapshot_xip($2::pg_snapshot))) \
                    OR (e.txid >= pg_snapshot_xmax($2::pg_snapshot) AND e.txid < $4::xid8)) \
          ) w \
          WHERE pg_visible_in_snapshot(w.txid, $5::pg_snapshot) \
            AND NOT pg_visible_in_snapshot(w.txid, $2::pg_snapshot) \
          ORDER BY w.id LIMIT $7",
    types: &[
        pg_sys::INT2OID,
        pg_sys::TEXTOID,
        pg_sys::INT8OID,
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
        pg_sys::INT8OID,
        pg_sys::INT4OID,
    ],
};
