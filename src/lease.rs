//! Fenced lease transitions: `ack`, batch `ack`, `fail`, `extend_lease`.
//!
//! claim() gives each delivery a token that names its lease: a round of a
//! lane's batch, or a lease of a row of its own (src/log/batch.rs,
//! src/log/exceptions.rs). Every transition matches the event's id with that
//! token, so a worker whose lease expired and was handed out again cannot ack,
//! fail or extend the new holder's delivery: it gets false / 'stale' / NULL,
//! never an error (fencing tokens as in awa's leases and Kleppmann, "How to do
//! distributed locking", 2016). A token this extension did not hand out
//! matches nothing.

use crate::backoff;
use crate::errors::{self, INVALID_PARAMETER, NULL_VALUE};
use crate::pg::fcall::{Array, Call, Value};
use crate::{gucs, log, validate, wakeup};
use pgrx::prelude::*;

/// Longest error text kept per failure; longer texts are cut at a character boundary.
pub const MAX_ERROR_BYTES: usize = 8192;

/// `outbox.ack(id, lease_token) -> boolean`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn ack(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.ack(bigint, uuid) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let (Some(_), Some(tok)) = (call.value(0, pg_sys::INT8OID), call.value(1, pg_sys::UUIDOID)) else {
        return false.into_datum().unwrap();
    };
    (log::claim::ack(vec![(call.required(0, "id"), uuid_of(&tok))]) > 0).into_datum().unwrap()
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
    let pairs = id_array
        .elems()
        .into_iter()
        .zip(tok_array.elems())
        .filter_map(|(i, t)| Some((i?.datum().value() as i64, uuid_of(&t?))))
        .collect();
    (log::claim::ack(pairs) as i32).into_datum().unwrap()
}

fn uuid_of(v: &Value) -> pgrx::Uuid {
    // SAFETY: a non-NULL uuid datum of the call's arguments.
    unsafe { pgrx::Uuid::from_datum(v.datum(), false) }.unwrap_or_else(|| errors::raise(NULL_VALUE, "NULL token"))
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
    let (Some(_), Some(tok)) = (call.value(0, pg_sys::INT8OID), call.value(1, pg_sys::UUIDOID)) else {
        return "stale".into_datum().unwrap();
    };
    let state = log::claim::fail(call.required(0, "id"), uuid_of(&tok), &error, retry_in, permanent);
    if state == "pending" {
        wakeup::note_due(); // the worker's next due time may now be the retry's
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
    let lease_us = validate::lease_us("lease", &lease);
    let (Some(_), Some(tok)) = (call.value(0, pg_sys::INT8OID), call.value(1, pg_sys::UUIDOID)) else {
        return call.return_null();
    };
    match log::claim::extend(call.required(0, "id"), uuid_of(&tok), lease, lease_us) {
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
