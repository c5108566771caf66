//! Fenced lease transitions: `ack`, batch `ack`, `fail`, `extend_lease`.
//!
//! Every statement matches on (id, lease_token, state = 'leased'). claim() gives
//! each delivery a new token, so a worker whose lease expired and was reclaimed
//! cannot ack, fail or extend the new holder's delivery: it gets false / 'stale' /
//! NULL, never an error (fencing tokens as in awa's leases and Kleppmann, "How to
//! do distributed locking", 2016).
//!
//! An ack moves the row from the hot queue to the archive in one statement, so the
//! claim index never holds delivered rows.

use crate::backoff;
use crate::errors::{self, INVALID_PARAMETER, NULL_VALUE};
use crate::pg::fcall::{Array, Call};
use crate::pg::plans::{self, Stmt};
use crate::{gucs, lowwater, subject, validate, wakeup};
use pgrx::prelude::*;

/// Longest error text kept per failure; longer texts are cut at a character boundary.
pub const MAX_ERROR_BYTES: usize = 8192;

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

const ACK: Stmt = Stmt {
    sql: archive_from!(
        "DELETE FROM outbox.event_queue q WHERE q.id = $1 AND q.lease_token = $2 AND q.state = 'leased'"
    ),
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID],
};

const ACK_DROP: Stmt = Stmt {
    sql: "DELETE FROM outbox.event_queue q WHERE q.id = $1 AND q.lease_token = $2 AND q.state = 'leased' \
          RETURNING q.subject",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID],
};

const ACK_BATCH_DROP: Stmt = Stmt {
    sql: "DELETE FROM outbox.event_queue q WHERE q.id = ANY ($1) AND q.state = 'leased' \
            AND q.lease_token = ($2)[array_position($1, q.id)] RETURNING q.subject",
    types: &[pg_sys::INT8ARRAYOID, pg_sys::UUIDARRAYOID],
};

const ACK_BATCH: Stmt = Stmt {
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
const FAIL_TOPIC_LOCK: Stmt = Stmt {
    sql: "SELECT 1 FROM outbox.topics t \
           WHERE t.topic = (SELECT q.topic FROM outbox.event_queue q WHERE q.id = $1) FOR SHARE OF t",
    types: &[pg_sys::INT8OID],
};

const FAIL_LOCK: Stmt = Stmt {
    sql: "SELECT q.attempts, q.max_attempts, t.backoff_base, t.backoff_max, \
                 (q.subject IS NOT NULL AND COALESCE(t.dead_letter_policy, 'block') = 'block'), q.subject \
            FROM outbox.event_queue q LEFT JOIN outbox.topics t ON t.topic = q.topic \
           WHERE q.id = $1 AND q.lease_token = $2 AND q.state = 'leased' \
             FOR UPDATE OF q",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID],
};

const FAIL_APPLY: Stmt = Stmt {
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

const EXTEND: Stmt = Stmt {
    sql: "UPDATE outbox.event_queue SET visible_at = GREATEST(clock_timestamp() + $3, $4) \
          WHERE id = $1 AND lease_token = $2 AND state = 'leased' RETURNING visible_at",
    types: &[pg_sys::INT8OID, pg_sys::UUIDOID, pg_sys::INTERVALOID, pg_sys::TIMESTAMPTZOID],
};

/// `outbox.ack(id, lease_token) -> boolean`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn ack(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.ack(bigint, uuid) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let (Some(id), Some(tok)) = (call.value(0, pg_sys::INT8OID), call.value(1, pg_sys::UUIDOID)) else {
        return false.into_datum().unwrap();
    };
    let stmt = if gucs::keep_delivered() { &ACK } else { &ACK_DROP };
    let (n, retired) = plans::run(stmt, &[id.param(), tok.param()], subjects_of);
    subject::promote(&retired, false);
    (n > 0).into_datum().unwrap()
}

/// `outbox.ack(ids bigint[], lease_tokens uuid[]) -> integer`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn ack_batch(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.ack(bigint[], uuid[]) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let ids = call.value(0, pg_sys::INT8ARRAYOID).unwrap_or_else(|| errors::raise(NULL_VALUE, "ids must not be NULL"));
    let toks = call
        .value(1, pg_sys::UUIDARRAYOID)
        .unwrap_or_else(|| errors::raise(NULL_VALUE, "lease_tokens must not be NULL"));
    let id_array = Array::read(ids, "ids");
    let (n_ids, null_ids) = (id_array.len(), id_array.has_nulls());
    let tok_array = Array::read(toks, "lease_tokens");
    let (n_toks, null_toks) = (tok_array.len(), tok_array.has_nulls());
    if n_ids != n_toks {
        errors::raise(INVALID_PARAMETER, format!("ids has {n_ids} elements but lease_tokens has {n_toks}"));
    }
    if null_ids || null_toks {
        errors::raise(NULL_VALUE, "ids and lease_tokens must not contain NULL");
    }
    if n_ids == 0 {
        return 0i32.into_datum().unwrap();
    }
    validate::batch_size(n_ids as i64);
    let stmt = if gucs::keep_delivered() { &ACK_BATCH } else { &ACK_BATCH_DROP };
    let (n, retired) = plans::run(stmt, &[ids.param(), toks.param()], subjects_of);
    subject::promote(&retired, false);
    (n as i32).into_datum().unwrap()
}

/// Rows acknowledged and the subjects whose head they were.
fn subjects_of(t: pgrx::spi::SpiTupleTable<'_>) -> (usize, Vec<String>) {
    let n = t.len();
    let subjects = t.filter_map(|row| row.get::<String>(1).ok().flatten()).collect();
    (n, subjects)
}

fn truncate_error(mut s: String) -> String {
    if s.len() > MAX_ERROR_BYTES {
        let mut cut = MAX_ERROR_BYTES;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

/// `outbox.fail(id, lease_token, error, retry_in, permanent) -> text`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn fail(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.fail(bigint, uuid, text, interval, boolean) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let error: String = call.arg::<String>(2).unwrap_or_else(|| "(no error text)".to_string());
    let error = truncate_error(error);
    let retry_in: Option<i64> = call.arg::<Interval>(3).map(|iv| validate::delay_us("retry_in", &iv));
    let permanent: bool = call.required(4, "permanent");
    let (Some(id), Some(tok)) = (call.value(0, pg_sys::INT8OID), call.value(1, pg_sys::UUIDOID)) else {
        return "stale".into_datum().unwrap();
    };
    plans::run(&FAIL_TOPIC_LOCK, &[id.param()], |_| ());
    let row = plans::run(&FAIL_LOCK, &[id.param(), tok.param()], |t| {
        if t.is_empty() {
            return None;
        }
        let t = t.first();
        let attempts: i32 = errors::spi(t.get(1)).unwrap_or(0);
        let max_attempts: i32 = errors::spi(t.get(2)).unwrap_or(1);
        let base: Option<Interval> = errors::spi(t.get(3));
        let cap: Option<Interval> = errors::spi(t.get(4));
        let blocks: bool = errors::spi(t.get(5)).unwrap_or(true);
        let subject: Option<String> = errors::spi(t.get(6));
        Some((attempts, max_attempts, base, cap, blocks, subject))
    });
    let Some((attempts, max_attempts, base, cap, blocks, subject)) = row else {
        return "stale".into_datum().unwrap();
    };
    let dead = permanent || attempts >= max_attempts;
    let delay_us = if dead {
        0
    } else {
        retry_in.unwrap_or_else(|| {
            let base =
                base.and_then(|b| validate::interval_us(&b)).map(|b| b as i64).unwrap_or_else(gucs::backoff_base_us);
            let cap =
                cap.and_then(|c| validate::interval_us(&c)).map(|c| c as i64).unwrap_or_else(gucs::backoff_max_us);
            backoff::jittered_delay_us(attempts, base, cap, backoff::unit_random())
        })
    };
    let state = if dead { "dead" } else { "pending" };
    plans::count(
        &FAIL_APPLY,
        &[
            id.param(),
            state.into(),
            Interval::from_micros(delay_us).into(),
            error.as_str().into(),
            blocks.into(),
            // FAIL_LOCK's row lock assigned the transaction id.
            plans::ts_param(lowwater::floor_after_xid()),
        ],
    );
    if !dead {
        wakeup::note_due();
    } else if !blocks {
        // Dead under 'skip' (or no subject): the next event of the subject leads.
        if let Some(s) = subject {
            subject::promote(&[s], false);
        }
    }
    state.into_datum().unwrap()
}

/// `outbox.extend_lease(id, lease_token, lease) -> timestamptz`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn extend_lease(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.extend_lease(bigint, uuid, interval) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let lease: Interval = call.required(2, "lease");
    validate::lease_us("lease", &lease);
    let (Some(id), Some(tok)) = (call.value(0, pg_sys::INT8OID), call.value(1, pg_sys::UUIDOID)) else {
        return call.return_null();
    };
    let until: Option<TimestampWithTimeZone> =
        plans::one(&EXTEND, &[id.param(), tok.param(), lease.into(), plans::ts_param(lowwater::floor_after_xid())]);
    match until {
        Some(ts) => ts.into_datum().unwrap(),
        None => call.return_null(),
    }
}

/// `outbox.backoff_delay(attempt, backoff_base, backoff_max, jitter) -> interval`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn backoff_delay(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.backoff_delay(integer, interval, interval, boolean) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let attempt: i32 = call.required(0, "attempt");
    if attempt < 1 {
        errors::raise(INVALID_PARAMETER, format!("attempt must be at least 1, got {attempt}"));
    }
    let base = call
        .arg::<Interval>(1)
        .map(|iv| validate::positive_delay_us("backoff_base", &iv))
        .unwrap_or_else(gucs::backoff_base_us);
    let cap = call
        .arg::<Interval>(2)
        .map(|iv| validate::positive_delay_us("backoff_max", &iv))
        .unwrap_or_else(gucs::backoff_max_us);
    let jitter: bool = call.arg(3).unwrap_or(true);
    let us = if jitter {
        backoff::jittered_delay_us(attempt, base, cap, backoff::unit_random())
    } else {
        backoff::raw_delay_us(attempt, base, cap)
    };
    Interval::from_micros(us).into_datum().unwrap()
}
