//! `outbox.claim`: lease a batch of ready events.
//!
//! One statement does the whole claim:
//! 1. `cand` walks `event_queue_ready_idx` in (visible_at, id) order from the
//!    oldest visible event, skipping events whose subject has an earlier live
//!    event, then locks each row with `outbox._lock_row` ([`crate::pg::try_lock_row`]),
//!    skipping rows other transactions hold or changed since the snapshot. The
//!    subject check is a plain read, not a locking one, so a row another worker
//!    has locked still blocks its successors: skipping cannot hide an earlier
//!    event from the check.
//!
//! # Claims never wait
//! Every statement a claim runs either reads, or locks rows only through
//! `_lock_row` (events, and the repairs of `outbox.subject_repairs`), then
//! changes only rows it holds. Subject locks are only tried ([`crate::subject`]).
//! So nothing in a claim waits for another transaction or raises a row-lock
//! serialization failure, at any isolation level. (`FOR UPDATE SKIP LOCKED` did
//! wait, and raised 40001 under REPEATABLE READ: [`crate::pg::try_lock_row`] says
//! when.) Under SERIALIZABLE, SSI may still abort a claim's transaction with
//! 40001, as it may abort any read-write transaction.
//! 2. `upd` gives each row a new fencing token and lease, or, for an expired lease
//!    that used the last attempt, moves it to dead with "lease expired".
//! 3. The outer SELECT returns the leased rows in id order.
//!
//! The scan starts at the low-water mark ($6, $7) of src/lowwater.rs, so the
//! dead index entries of events claimed and acked before it are never read again.
//!
//! "now" is passed in as a parameter, taken from the clock when claim() starts,
//! so it can bound the index scan: a volatile clock_timestamp() in the WHERE
//! clause could only filter, and 100,000 delayed events would be read on every
//! claim.
//!
//! # Subscriptions
//! The `subscription` argument (NULL: `default`) names the consumer group the
//! claim serves. `default` claims from `event_queue`, as below; a named
//! subscription (0.9.0) claims from the log (src/log/claim.rs), after the same
//! argument checks. An unknown name raises 42704 before any event is read; a
//! paused subscription hands out nothing (and its expired leases stay as they
//! are until it resumes). The subscription's lease and max_attempts override
//! the topic's (from the per-backend cache of src/subscriptions.rs, which says
//! when a change applies); an event that has used the subscription's attempts
//! goes dead instead of being leased. A library newer than the installed SQL is
//! called with four arguments and no catalog exists: it claims as 0.6.0 did.

use crate::errors;
use crate::pg::fcall::{Array, Call, SetResult, Value};
use crate::pg::plans;
use crate::sql::claim::{CLAIM_ALL, CLAIM_ALL_040, CLAIM_TOPICS, CLAIM_TOPICS_040, NOTE_CLAIM, RAISE_LEASE};
use crate::{gucs, lowwater, pg, subject, subscriptions, validate};
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
    // SAFETY: the frame of outbox.claim(text, integer, interval, text[], text)
    // (or, before the update to 0.7.0, of claim(text, integer, interval,
    // text[])), whose argument types the reads below name (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
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
    let default_lease = Interval::from_micros(gucs::default_lease_us());
    let now = pg::now();
    // With the 0.7.0 SQL (five arguments) the catalog exists. A malformed name
    // fails with the other arguments, before anything is read or written.
    let catalog = call.nargs() >= 5;
    let subscription = catalog.then(|| {
        let name = call.arg::<String>(4).unwrap_or_else(|| validate::DEFAULT_SUBSCRIPTION.to_string());
        validate::subscription(&name);
        name
    });

    // A subscription of the log (src/log/claim.rs), or the `default` made at
    // install, which reads the queue. The catalog comes from the per-backend
    // cache: reading it writes nothing, so the low-water steps below still
    // start in a transaction that has written nothing.
    let on_log = subscription.as_deref().and_then(|name| {
        let settings = subscriptions::require(name);
        (!settings.queue).then_some((name, settings))
    });
    if let Some((name, settings)) = on_log {
        note_claim(name, now);
        if settings.paused {
            SetResult::begin(&call);
            return call.finish_set();
        }
        let lease_us = lease
            .as_ref()
            .or(settings.default_lease.as_ref())
            .and_then(validate::interval_us)
            .map_or_else(gucs::default_lease_us, |us| us as i64);
        let req = crate::log::exceptions::Request {
            subscription: name,
            settings: &settings,
            worker: &worker,
            lease_us,
            lease_fixed: lease.is_some() || settings.default_lease.is_some(),
            narrow: filter,
        };
        return crate::log::claim::claim(&call, &req, batch as usize);
    }
    // The mark first: its steps read committed state only while this
    // transaction has written nothing (src/lowwater.rs), and the retry below writes.
    let (from_t, from_id) = lowwater::claim_start();
    // The subscription's settings come from the per-backend cache
    // (src/subscriptions.rs), after claim_start: a catalog read would give the
    // transaction an id, and the low-water steps need one without.
    let settings = match subscription {
        Some(name) => {
            let settings = subscriptions::require(&name);
            note_claim(&name, now);
            if settings.paused {
                SetResult::begin(&call);
                return call.finish_set();
            }
            settings
        }
        None => subscriptions::Settings::default(),
    };
    // Which locking statements the installed SQL allows: 0.5.0 on has
    // _lock_row (one catalog lookup per claim under SQL older than 0.7.0).
    let lock_row = catalog || pg::catalog::row_lock_installed();
    subject::retry_deferred(lock_row);
    let out = SetResult::begin(&call);
    let mut args = vec![
        worker.as_str().into(),
        batch.into(),
        lease.into(),
        default_lease.into(),
        plans::ts_param(now),
        plans::ts_param(from_t),
        from_id.into(),
        settings.max_attempts.into(),
        settings.default_lease.into(),
    ];
    let stmt = match filter {
        None if lock_row => &CLAIM_ALL,
        None => &CLAIM_ALL_040,
        Some((exact, prefixes)) => {
            args.push(exact.into());
            args.push(prefixes.into());
            if lock_row {
                &CLAIM_TOPICS
            } else {
                &CLAIM_TOPICS_040
            }
        }
    };
    let mut raise: Vec<i64> = Vec::new();
    let (retired, floor): (Vec<String>, i64) = plans::run_rows(stmt, &args, |rows| {
        let mut retired = Vec::new();
        if rows.is_empty() {
            return (retired, lowwater::NONE);
        }
        // The update has assigned this transaction's id: a lease expiry at or
        // below the publish floor would sort below the low-water mark once it
        // passes, so it is raised (src/lowwater.rs). Only a claim statement
        // that ran longer than its lease, or a clock set back, can hit this.
        let floor = lowwater::floor_now();
        rows.for_each(|row| {
            let leased = row.bool(10).unwrap_or(false);
            if leased {
                if row.raw_i64(8) < floor {
                    row.set_i64(8, floor);
                    raise.push(row.raw_i64(0));
                }
                out.put_row(row);
            } else {
                // The lease expired on the last attempt and the event went dead.
                // Under the 'skip' policy its subject needs a new head.
                let blocks = row.bool(11).unwrap_or(true);
                if !blocks {
                    if let Some(s) = row.text(2) {
                        retired.push(s);
                    }
                }
            }
        });
        (retired, floor)
    });
    if !raise.is_empty() {
        plans::run(&RAISE_LEASE, &[raise.into(), plans::ts_param(floor)], |_| ());
    }
    subject::promote(&retired, false);
    call.finish_set()
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
