//! Subject heads (src/subject.rs): deferred promotions and the promotion itself.

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

pub const DEFER: Stmt = Stmt {
    // ON CONFLICT DO NOTHING is a no-op on 0.4.0's table (no unique key, so an
    // insert never waits); it keeps a 0.4.0 library serving 0.3.0's SQL, where
    // the subject is the primary key, from raising unique violations.
    sql: "INSERT INTO outbox.subject_repairs (subject) SELECT s FROM unnest($1::text[]) AS s ON CONFLICT DO NOTHING",
    types: &[pg_sys::TEXTARRAYOID],
};

/// Take up to $1 repairs. `lock_row` locks them as claim locks events
/// ([`crate::pg::try_lock_row`]): FOR UPDATE SKIP LOCKED would raise 40001 under
/// REPEATABLE READ for a row another claim deleted after the snapshot. The table
/// has no unique key, so inserts never wait either. `skip_locked` is 0.4.0's.
macro_rules! take_deferred_sql {
    ($pick:literal) => {
        concat!(
            "WITH d AS (DELETE FROM outbox.subject_repairs r WHERE r.ctid = ANY (ARRAY(",
            $pick,
            ")) RETURNING r.subject) SELECT array_agg(DISTINCT d.subject) FROM d"
        )
    };
}

pub const TAKE_DEFERRED: Stmt = Stmt {
    sql: take_deferred_sql!(
        "SELECT x.row FROM (SELECT x.ctid AS row FROM outbox.subject_repairs x OFFSET 0) x \
          WHERE outbox._lock_row('outbox.subject_repairs'::regclass::oid, x.row) LIMIT $1"
    ),
    types: &[pg_sys::INT8OID],
};
pub const TAKE_DEFERRED_040: Stmt = Stmt {
    sql: take_deferred_sql!("SELECT x.ctid FROM outbox.subject_repairs x LIMIT $1 FOR UPDATE SKIP LOCKED"),
    types: &[pg_sys::INT8OID],
};

/// For each subject: its earliest live event becomes the head, entering the claim
/// index above the publish floor (src/lowwater.rs). Returns how many were
/// promoted, the subjects whose next head row another transaction holds or changed
/// (skipped, never waited for), and the subjects with no live event at all.
/// `lock_row` locks as claim does ([`crate::pg::try_lock_row`]); `skip_locked` is
/// 0.4.0's statement, for a library newer than the installed SQL.
macro_rules! promote_sql {
    ($how:ident) => {
        concat!(
            "WITH h AS ( \
               SELECT s.subject, (SELECT min(p.id) FROM outbox.event_queue p \
                                   WHERE p.subject = s.subject AND ",
            crate::holds_subject!("p"),
            ") AS head \
                 FROM unnest($1::text[]) AS s(subject)), \
             c AS (",
            promote_sql!(@lock $how),
            "), \
             u AS ( \
               UPDATE outbox.event_queue q SET is_head = true, visible_at = GREATEST(q.visible_at, $2) \
                WHERE q.id = ANY (ARRAY(SELECT c.id FROM c)) RETURNING q.id) \
             SELECT (SELECT count(*) FROM u), \
                    ARRAY(SELECT h.subject FROM h JOIN outbox.event_queue q ON q.id = h.head \
                           WHERE NOT q.is_head AND q.id <> ALL (ARRAY(SELECT u.id FROM u))), \
                    ARRAY(SELECT h.subject FROM h WHERE h.head IS NULL)"
        )
    };
    (@lock lock_row) => {
        // OFFSET 0 keeps the subquery whole, so the lock is the last test a row passes.
        "SELECT r.id FROM (SELECT q.id, q.ctid AS row FROM outbox.event_queue q \
                            WHERE q.id = ANY (ARRAY(SELECT h.head FROM h WHERE h.head IS NOT NULL)) \
                              AND NOT q.is_head OFFSET 0) r \
          WHERE outbox._lock_row('outbox.event_queue'::regclass::oid, r.row)"
    };
    (@lock skip_locked) => {
        "SELECT q.id FROM outbox.event_queue q \
          WHERE q.id = ANY (ARRAY(SELECT h.head FROM h WHERE h.head IS NOT NULL)) AND NOT q.is_head \
            FOR UPDATE OF q SKIP LOCKED"
    };
}

pub const PROMOTE: Stmt = Stmt { sql: promote_sql!(lock_row), types: &[pg_sys::TEXTARRAYOID, pg_sys::TIMESTAMPTZOID] };
pub const PROMOTE_040: Stmt =
    Stmt { sql: promote_sql!(skip_locked), types: &[pg_sys::TEXTARRAYOID, pg_sys::TIMESTAMPTZOID] };
