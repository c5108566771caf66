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
use crate::pg::fcall::{Array, Call, Value};
use crate::pg::plans;
use crate::sql::lease::{ACK, ACK_BATCH, ACK_BATCH_DROP, ACK_DROP, EXTEND, FAIL_APPLY, FAIL_LOCK, FAIL_TOPIC_LOCK};
use crate::{gucs, log, lowwater, pg, subject, subscriptions, validate, wakeup};
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
    let (Some(id), Some(tok)) = (call.value(0, pg_sys::INT8OID), call.value(1, pg_sys::UUIDOID)) else {
        return false.into_datum().unwrap();
    };
    if let Some(t) = log_token(&tok) {
        return (log::claim::ack(vec![(call.required(0, "id"), t)]) > 0).into_datum().unwrap();
    }
    let stmt = if gucs::keep_delivered() { &ACK } else { &ACK_DROP };
    let (n, retired) = plans::run(stmt, &[id.param(), tok.param()], subjects_of);
    subject::promote(&retired, false);
    if n == 0 && moved_to_log() {
        return (log::claim::ack(vec![(call.required(0, "id"), uuid_of(&tok))]) > 0).into_datum().unwrap();
    }
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
    // Tokens of a log claim (named subscriptions) go to the log; the rest, and
    // every call of a worker of `default` alone, to the queue in one statement.
    let tok_elems = tok_array.elems();
    if !tok_elems.iter().flatten().any(|t| log_token(t).is_some()) {
        let (mut n, retired) = plans::run(stmt, &[ids.param(), toks.param()], subjects_of);
        subject::promote(&retired, false);
        if n < n_ids && moved_to_log() {
            let pairs = id_array.elems().into_iter().zip(tok_elems).filter_map(|(i, t)| Some((i?, t?)));
            n += log::claim::ack(pairs.map(|(i, t)| (i.datum().value() as i64, uuid_of(&t))).collect());
        }
        return (n as i32).into_datum().unwrap();
    }
    let mut queue: (Vec<i64>, Vec<pgrx::Uuid>) = (vec![], vec![]);
    let mut logged = Vec::new();
    for (id, tok) in id_array.elems().into_iter().zip(tok_elems).filter_map(|(i, t)| Some((i?, t?))) {
        let id = id.datum().value() as i64;
        match log_token(&tok) {
            Some(t) => logged.push((id, t)),
            None => {
                queue.0.push(id);
                queue.1.push(uuid_of(&tok));
            }
        }
    }
    let mut n = log::claim::ack(logged);
    if !queue.0.is_empty() {
        let asked = queue.0.len();
        let pairs: Vec<(i64, pgrx::Uuid)> = queue.0.iter().copied().zip(queue.1.iter().copied()).collect();
        let (q, retired) = plans::run(stmt, &[queue.0.into(), queue.1.into()], subjects_of);
        subject::promote(&retired, false);
        n += q;
        if q < asked && moved_to_log() {
            n += log::claim::ack(pairs);
        }
    }
    (n as i32).into_datum().unwrap()
}

fn uuid_of(v: &Value) -> pgrx::Uuid {
    // SAFETY: a non-NULL uuid datum of the call's arguments.
    unsafe { pgrx::Uuid::from_datum(v.datum(), false) }.unwrap_or_else(|| errors::raise(NULL_VALUE, "NULL token"))
}

/// After a token the queue handed out matched nothing there: whether the
/// queue has no reader any more, because `outbox._default_to_log` moved
/// `default` to the log while this call waited for the queue's lock (taking
/// it read the catalog's invalidation), so the row, with its token, is now
/// one of the log's.
fn moved_to_log() -> bool {
    !subscriptions::reads_queue(validate::DEFAULT_SUBSCRIPTION)
}

/// The token, when the log holds its lease: a claim over the log handed it
/// out (src/log/claim.rs), or no subscription reads the queue any more, so a
/// token the queue handed out can only lease a row the move to the log made
/// (`outbox._queue_to_log`, 0.12.0), which keeps it.
fn log_token(v: &Value) -> Option<pgrx::Uuid> {
    let t = uuid_of(v);
    (log::claim::is_log_token(&t) || moved_to_log()).then_some(t)
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
    let log_fail = |t: pgrx::Uuid| {
        let state = log::claim::fail(call.required(0, "id"), t, &error, retry_in, permanent);
        if state == "pending" {
            wakeup::note_due(); // the worker's next due time may now be the retry's
        }
        state.into_datum().unwrap()
    };
    if let Some(t) = log_token(&tok) {
        return log_fail(t);
    }
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
        if moved_to_log() {
            return log_fail(uuid_of(&tok));
        }
        return "stale".into_datum().unwrap();
    };
    // The subscription's settings come first (0.7.0: every event is the
    // `default` subscription's); the SQL of 0.6.0 and earlier has no catalog
    // (one syscache probe: the answer changes with ALTER EXTENSION UPDATE).
    let sub = if pg::catalog::outbox_relid(c"subscription_catalog").is_some() {
        subscriptions::lookup(validate::DEFAULT_SUBSCRIPTION).unwrap_or_default()
    } else {
        subscriptions::Settings::default()
    };
    let (state, delay_us) = sub.failure(attempts, max_attempts, base, cap, retry_in, permanent);
    let dead = state == "dead";
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
    let log_extend = |t: pgrx::Uuid| {
        let lease_us = validate::lease_us("lease", &lease);
        log::claim::extend(call.required(0, "id"), t, lease, lease_us)
    };
    let until: Option<TimestampWithTimeZone> = match log_token(&tok) {
        Some(t) => log_extend(t),
        None => {
            plans::one(&EXTEND, &[id.param(), tok.param(), lease.into(), plans::ts_param(lowwater::floor_after_xid())])
                .or_else(|| if moved_to_log() { log_extend(uuid_of(&tok)) } else { None })
        }
    };
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
