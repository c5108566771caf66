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
