//! The log ring (src/log/mod.rs, sql/log.sql).

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
/// snapshot $5, ids above $6, at most $7 (NULL: all), in id order. The three
/// branches are the access paths: ids drawn after m (the `(lane, id)` index);
/// transactions running at the cursor, and those begun after it with an id
/// below xn (the `(txid, lane)` index: `id + 0` keeps the planner from reading
/// the lane's whole history through `(lane, id)` instead). The outer filter is
/// the definition (visible in $5, not in $2); src/log/mod.rs proves the branches
/// find every event it accepts. The snapshots are cast once (`s`), not per row.
pub const WINDOW: Stmt = Stmt {
    sql: "WITH s AS MATERIALIZED (SELECT $2::pg_snapshot AS lo, $5::pg_snapshot AS hi) \
          SELECT w.id, w.subject FROM s, LATERAL ( \
            SELECT e.id, e.txid, e.subject FROM outbox.log e \
             WHERE e.lane = $1 AND e.id > greatest($3, $6) \
            UNION ALL \
            SELECT e.id, e.txid, e.subject FROM outbox.log e \
             WHERE e.txid = ANY (ARRAY(SELECT pg_snapshot_xip(s.lo))) AND e.lane = $1 \
               AND e.id + 0 > $6 AND e.id + 0 <= $3 \
            UNION ALL \
            SELECT e.id, e.txid, e.subject FROM outbox.log e \
             WHERE e.txid >= pg_snapshot_xmax(s.lo) AND e.txid < $4::xid8 AND e.lane = $1 \
               AND e.id + 0 > $6 AND e.id + 0 <= $3 \
          ) w \
          WHERE pg_visible_in_snapshot(w.txid, s.hi) AND NOT pg_visible_in_snapshot(w.txid, s.lo) \
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

/// A subscription's lanes, starting at one cursor (`_log_subscribe`).
pub const SUBSCRIBE: Stmt = Stmt {
    sql: "INSERT INTO outbox.log_lanes (subscription, lane, lo_snap, lo_m, lo_xn) \
          SELECT $1, g, $2::pg_snapshot, $3, $4::xid8 FROM generate_series(0, 15) AS g \
          ON CONFLICT DO NOTHING RETURNING lane",
    types: &[pg_sys::TEXTOID, pg_sys::TEXTOID, pg_sys::INT8OID, pg_sys::TEXTOID],
};

/// A subscription's lanes, with each row's ctid for `_lock_row`.
pub const LANES: Stmt = Stmt {
    sql: "SELECT ctid, lane, lo_snap::text, lo_m, lo_xn::text, hi_snap::text, hi_m, hi_xn::text, pos, batch \
          FROM outbox.log_lanes WHERE subscription = $1",
    types: &[pg_sys::TEXTOID],
};

/// Write a lane's cursor, window and batch (the caller holds its row).
pub const LANE_PUT: Stmt = Stmt {
    sql: "UPDATE outbox.log_lanes SET lo_snap = $3::pg_snapshot, lo_m = $4, lo_xn = $5::xid8, \
                 hi_snap = $6::pg_snapshot, hi_m = $7, hi_xn = $8::xid8, pos = $9, batch = $10 \
           WHERE subscription = $1 AND lane = $2",
    types: &[
        pg_sys::TEXTOID,
        pg_sys::INT2OID,
        pg_sys::TEXTOID,
        pg_sys::INT8OID,
        pg_sys::TEXTOID,
        pg_sys::TEXTOID,
        pg_sys::INT8OID,
        pg_sys::TEXTOID,
        pg_sys::INT8OID,
        pg_sys::INT8OID,
    ],
};

/// A batch's state, with its ctid (claims lock it with `_lock_row`).
pub const BATCH_GET: Stmt =
    Stmt { sql: "SELECT ctid, state FROM outbox.log_batches WHERE id = $1", types: &[pg_sys::INT8OID] };

/// A batch's state, locked for an ack (waits for a claim holding it).
pub const BATCH_LOCK: Stmt =
    Stmt { sql: "SELECT state FROM outbox.log_batches WHERE id = $1 FOR UPDATE", types: &[pg_sys::INT8OID] };

pub const BATCH_NEW: Stmt = Stmt {
    sql: "INSERT INTO outbox.log_batches (id, subscription, lane, state) VALUES ($1, $2, $3, $4)",
    types: &[pg_sys::INT8OID, pg_sys::TEXTOID, pg_sys::INT2OID, pg_sys::BYTEAOID],
};

pub const BATCH_ID: Stmt = Stmt { sql: "SELECT nextval('outbox.log_batch_seq')", types: &[] };

pub const BATCH_PUT: Stmt =
    Stmt { sql: "UPDATE outbox.log_batches SET state = $2 WHERE id = $1", types: &[pg_sys::INT8OID, pg_sys::BYTEAOID] };

pub const BATCH_DELETE: Stmt = Stmt { sql: "DELETE FROM outbox.log_batches WHERE id = $1", types: &[pg_sys::INT8OID] };

/// The claimed events' rows, with the round's token and lease expiry: the
/// result columns of `outbox._log_claim`.
pub const FETCH: Stmt = Stmt {
    sql: "SELECT l.id, l.topic, l.subject, l.payload, l.headers, $3::uuid, $4::timestamptz \
          FROM outbox.log l WHERE l.lane = $1 AND l.id = ANY ($2) ORDER BY l.id",
    types: &[pg_sys::INT2OID, pg_sys::INT8ARRAYOID, pg_sys::UUIDOID, pg_sys::TIMESTAMPTZOID],
};
