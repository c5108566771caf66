//! Fenced lease transitions (src/lease.rs): ack, batch ack, fail, extend_lease.

use crate::pg::plans::Stmt;
use pgrx::prelude::*;

/// SQL expression: the attempt history `$h` (a jsonb array, or NULL) with the entry
/// `$e` appended, bounded to 20 elements. Once full, the history keeps the first
/// failure, then `{"omitted": n}` (failures dropped so far), then the latest 18:
/// `max_attempts` may be up to 1,000,000 (and `outbox.max_attempts` is a user
/// setting), so an unbounded history could grow one row past any size.
/// claim() (expired leases) and fail() both append through this one expression.
#[macro_export]
macro_rules! history_append {
    ($h:literal, $e:literal) => {
        concat!(
            "CASE WHEN jsonb_array_length(COALESCE(",
            $h,
            ", '[]'::jsonb)) < 20 ",
            "THEN COALESCE(",
            $h,
            ", '[]'::jsonb) || jsonb_build_array(",
            $e,
            ") ",
            // Keep the first, the marker and the latest 17 (+ the new one); a longer
            // history (written before the bound) is cut to size on its next failure.
            "ELSE jsonb_build_array(", $h, " -> 0, jsonb_build_object('omitted', ",
            "COALESCE((", $h, " -> 1 ->> 'omitted')::int8, 0) + jsonb_array_length(", $h, ") - 18 ",
            "- CASE WHEN ", $h, " -> 1 ? 'omitted' THEN 1 ELSE 0 END)) ",
            "|| jsonb_path_query_array(", $h, ", '$[last - 16 to last]') || jsonb_build_array(", $e, ")",
            " END"
        )
    };
}

macro_rules! archive_from {
    ($delete:literal) => {
        concat!(
            "WITH d AS (",
            $delete,
            " RETURNING q.*) ",
            "INSERT INTO outbox.event_archive (id, topic, subject, dispatch_key, payload, headers, state, attempts,",
            " max_attempts, leased_by, last_error, errors, published_at, finished_at) ",
            "SELECT id, topic, subject, dispatch_key, payload, headers, 'delivered', attempts, max_attempts,",
            " leased_by, last_error, errors, published_at, clock_timestamp() FROM d RETURNING subject"
        )
    };
}

pub const ACK: Stmt = Stmt {
    sql: archive_from!(
        "DELETE FROM outbox.event_queue q WHERE q.id = $1 AND q.lease_token = $2 AND q.state = 'leased'"
    ),
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID],
};

pub const ACK_DROP: Stmt = Stmt {
    sql: "DELETE FROM outbox.event_queue q WHERE q.id = $1 AND q.lease_token = $2 AND q.state = 'leased' \
          RETURNING q.subject",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID],
};

pub const ACK_BATCH_DROP: Stmt = Stmt {
    sql: "DELETE FROM outbox.event_queue q WHERE q.id = ANY ($1) AND q.state = 'leased' \
            AND q.lease_token = ($2)[array_position($1, q.id)] RETURNING q.subject",
    types: &[pg_sys::INT8ARRAYOID, pg_sys::UUIDARRAYOID],
};

pub const ACK_BATCH: Stmt = Stmt {
    sql: archive_from!(
        // id = ANY drives primary-key lookups whatever the statistics say; a join
        // with unnest() could turn into a scan of every leased row per ack.
        "DELETE FROM outbox.event_queue q WHERE q.id = ANY ($1) AND q.state = 'leased' \
           AND q.lease_token = ($2)[array_position($1, q.id)]"
    ),
    types: &[pg_sys::INT8ARRAYOID, pg_sys::UUIDARRAYOID],
};

/// The topic's policy row, FOR SHARE, before the event is locked: a concurrent
/// `alter_topic` (which locks the row FOR UPDATE) then either commits first and is
/// read by FAIL_LOCK, or waits for this transaction and sees the event dead
/// (sql/admin.sql, `_apply_dead_letter_policy`). Topic row before event row, the
/// order alter_topic takes them in.
pub const FAIL_TOPIC_LOCK: Stmt = Stmt {
    sql: "SELECT 1 FROM outbox.topics t \
           WHERE t.topic = (SELECT q.topic FROM outbox.event_queue q WHERE q.id = $1) FOR SHARE OF t",
    types: &[pg_sys::INT8OID],
};

/// The leased event and the topic's policy for its failure (fail() applies the
/// subscription's settings over it, then the GUCs).
pub const FAIL_LOCK: Stmt = Stmt {
    sql: "SELECT q.attempts, q.max_attempts, t.backoff_base, t.backoff_max, \
                 (q.subject IS NOT NULL AND COALESCE(t.dead_letter_policy, 'block') = 'block'), q.subject \
            FROM outbox.event_queue q LEFT JOIN outbox.topics t ON t.topic = q.topic \
           WHERE q.id = $1 AND q.lease_token = $2 AND q.state = 'leased' \
             FOR UPDATE OF q",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID],
};

pub const FAIL_APPLY: Stmt = Stmt {
    sql: concat!(
        "UPDATE outbox.event_queue SET ",
        "state = $2, ",
        "visible_at = CASE WHEN $2 = 'pending' THEN GREATEST(clock_timestamp() + $3, $6) ELSE visible_at END, ",
        "lease_token = NULL, ",
        "last_error = $4, ",
        "errors = ",
        crate::history_append!(
            "errors",
            "jsonb_build_object('attempt', attempts, 'at', clock_timestamp(), 'worker', leased_by, 'error', $4)"
        ),
        ", dead_at = CASE WHEN $2 = 'dead' THEN clock_timestamp() END, ",
        "blocks_subject = ($2 = 'dead' AND $5) ",
        "WHERE id = $1"
    ),
    types: &[
        pg_sys::INT8OID,
        pg_sys::TEXTOID,
        pg_sys::INTERVALOID,
        pg_sys::TEXTOID,
        pg_sys::BOOLOID,
        pg_sys::TIMESTAMPTZOID,
    ],
};

pub const EXTEND: Stmt = Stmt {
    sql: "UPDATE outbox.event_queue SET visible_at = GREATEST(clock_timestamp() + $3, $4) \
          WHERE id = $1 AND lease_token = $2 AND state = 'leased' RETURNING visible_at",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID, pg_sys::INTERVALOID, pg_sys::TIMESTAMPTZOID],
};
