//! `outbox.claim`: lease a batch of ready events of one subscription.
//!
//! This module checks the arguments and resolves the subscription; the claim
//! itself reads the log (src/log/claim.rs and src/log/exceptions.rs, which hold
//! the invariants: each committed event is handed out once per subscription,
//! per subject in commit order, fenced by its lease token).
//!
//! # Subscriptions
//! The `subscription` argument (NULL: `default`) names the consumer group the
//! claim serves. An unknown name raises 42704 before any event is read; a
//! paused subscription hands out nothing (and its expired leases stay as they
//! are until it resumes). The subscription's lease and max_attempts override
//! the topic's (from the per-backend cache of src/subscriptions.rs, which says
//! when a change applies); an event that has used the subscription's attempts
//! goes dead instead of being leased.
//!
//! # Claims never wait
//! Every row a claim changes it first takes with `outbox._lock_row`
//! ([`crate::pg::try_lock_row`]), which skips rows other transactions hold or
//! changed since the snapshot, and its advisory locks are only tried. So
//! nothing in a claim waits for another transaction or raises a row-lock
//! serialization failure, at READ COMMITTED and REPEATABLE READ. (`FOR UPDATE
//! SKIP LOCKED` would wait, and raise 40001 under REPEATABLE READ:
//! [`crate::pg::try_lock_row`] says when.)
//!
//! # Not at SERIALIZABLE
//! Under SERIALIZABLE, SSI aborts a claim's transaction with 40001 whenever its
//! reads of lanes and rows form a dangerous structure with concurrent claims,
//! acks and publishes, which many concurrent workers do all the time (135 of
//! 7,718 autocommit claims in a checker run). A claim there is refused with
//! 0A000 before it reads or writes anything, instead of failing at random; the
//! caller runs its claiming transaction at READ COMMITTED. ack, fail and
//! extend_lease stay allowed there, and retry on 40001 like any serializable
//! transaction.

use crate::errors;
use crate::pg::fcall::{Array, Call, SetResult, Value};
use crate::pg::plans;
use crate::sql::claim::NOTE_CLAIM;
use crate::{gucs, pg, subscriptions, validate};
use pgrx::prelude::*;

thread_local! {
    /// (subscription, clock in µs) of this session's last note in
    /// `outbox.subscription_activity`: claims note at most once a second.
    static NOTED: std::cell::RefCell<Option<(String, i64)>> = const { std::cell::RefCell::new(None) };
}

/// How often a session records its claims in `outbox.subscription_activity`.
const NOTE_EVERY_US: i64 = 1_000_000;

/// Note the claim in `outbox.subscription_activity`, at most once a second per
/// session and subscription.
fn note_claim(name: &str, now: i64) {
    let due = NOTED.with(|n| match &*n.borrow() {
        Some((s, at)) => s != name || now - at >= NOTE_EVERY_US,
        None => true,
    });
    if due {
        plans::run(&NOTE_CLAIM, &[name.into(), plans::ts_param(now)], |_| ());
        NOTED.with(|n| *n.borrow_mut() = Some((name.to_string(), now)));
    }
}

/// `outbox.claim(worker, batch_size, lease, topics, subscription) -> TABLE(...)`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn claim(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox.claim(text, integer, interval, text[], text),
    // whose argument types the reads below name (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    if pg::serializable() {
        errors::raise_hint(
            errors::FEATURE_NOT_SUPPORTED,
            "claim cannot run at SERIALIZABLE isolation; it runs at READ COMMITTED or REPEATABLE READ",
            "Run the claiming transaction at READ COMMITTED: SET TRANSACTION ISOLATION LEVEL READ COMMITTED \
             (in autocommit: SET default_transaction_isolation = 'read committed').",
        );
    }
    let worker: String = call.required(0, "worker");
    validate::worker(&worker);
    let batch: i32 = call.required(1, "batch_size");
    validate::batch_size(batch as i64);
    let lease: Option<Interval> = call.arg(2);
    if let Some(iv) = &lease {
        validate::lease_us("lease", iv);
    }
    let topics = call.value(3, pg_sys::TEXTARRAYOID).map(|v| {
        Array::read(v, "topics").elems().into_iter().map(|e| e.and_then(Value::text)).collect::<Vec<Option<String>>>()
    });
    let filter = validate::topic_filter(topics);
    let now = pg::now();
    // A malformed name fails with the other arguments, before anything is
    // read or written.
    let name = call.arg::<String>(4).unwrap_or_else(|| validate::DEFAULT_SUBSCRIPTION.to_string());
    validate::subscription(&name);
    let settings = subscriptions::require(&name);
    note_claim(&name, now);
    if settings.paused {
        SetResult::begin(&call);
        return call.finish_set();
    }
    // outbox.max_lease caps every lease. The call's own was checked above; a
    // session's outbox.default_lease is its own input, so it is refused like
    // the call's; a stored default written under a larger max_lease is cut to
    // the cap (documented with outbox.max_lease).
    let max = gucs::max_lease_us();
    let lease_us = match lease.as_ref().or(settings.default_lease.as_ref()).and_then(validate::interval_us) {
        Some(us) => (us as i64).min(max),
        None => validate::default_lease_us(),
    };
    let req = crate::log::exceptions::Request {
        subscription: &name,
        settings: &settings,
        worker: &worker,
        lease_us,
        lease_fixed: lease.is_some() || settings.default_lease.is_some(),
        narrow: filter,
    };
    crate::log::claim::claim(&call, &req, batch as usize)
}

/// `outbox._lock_row(rel oid, row tid) -> boolean`: [`crate::pg::try_lock_row`];
/// true when this transaction now holds the row FOR UPDATE, false when it was
/// skipped (held or being changed by another transaction, or changed since the
/// statement's snapshot).
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention (declared STRICT).
pub unsafe fn lock_row(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox._lock_row(oid, tid) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let rel = pg_sys::Oid::from(call.value(0, pg_sys::OIDOID).map(|d| d.datum().value() as u32).unwrap_or(0));
    let tid = call
        .arg::<pg_sys::ItemPointerData>(1)
        .unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "row must not be NULL"));
    pg_sys::Datum::from(pg::try_lock_row(rel, tid) == pg::RowLock::Locked)
}
