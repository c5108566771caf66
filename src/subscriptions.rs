//! A per-backend cache of the subscription catalog for claim() and fail().
//!
//! Every claim needs its subscription's state (does it exist, is it paused, its
//! lease and max_attempts) and every fail() its backoff and max_attempts. Rather
//! than read `outbox.subscription_catalog` in SQL on each call (a query per claim),
//! each backend keeps the catalog in memory, as [`crate::topics`] keeps the topic
//! registry: any change to the table fires a statement trigger (enabled ALWAYS,
//! so replication and `session_replication_role = replica` fire it too) that
//! sends a relcache invalidation, and a copy is valid only for the count of
//! invalidations it was loaded under ([`pg::load_consistent`], which also catches
//! a change that commits while the copy is being read).
//!
//! # A pause applies to every claim that starts after its commit
//! Invalidations reach other backends when the changing transaction commits, and
//! a backend reads them at [`crate::pg::accept_invalidations`], which
//! [`lookup`] calls first. A reload reads the catalog under a snapshot taken then
//! ([`plans::run_latest`]), so it sees every commit that sent an invalidation
//! already read, at any isolation level (also under REPEATABLE READ, where the
//! transaction's own snapshot may be older). So a claim whose call starts after
//! `pause_subscription` committed finds the subscription paused. In the changing
//! session itself the invalidation applies at its next command, and an abort
//! replays it locally, so a rolled-back change is forgotten too.
//!
//! Nothing else depends on these values being current: a stale max_attempts or
//! backoff changes one retry's timing, not which rows other rows depend on.

use crate::pg;
use crate::pg::plans;
use crate::sql::claim::{
    FORGET_BATCHES, FORGET_LANES, FORGET_REST, QUEUE_CLEAR, QUEUE_LEASED, QUEUE_TO_LOG, SUBSCRIPTIONS,
    SUBSCRIPTIONS_0100, SUBSCRIPTIONS_090,
};
use crate::{backoff, errors, gucs, validate};
use pgrx::prelude::*;
use std::collections::HashMap;

/// One subscription's settings; None means "the topic's, else the GUC".
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// Claims return nothing while true.
    pub paused: bool,
    /// Attempts a claim may start.
    pub max_attempts: Option<i32>,
    /// fail()'s backoff base.
    pub backoff_base: Option<Interval>,
    /// fail()'s backoff cap.
    pub backoff_max: Option<Interval>,
    /// claim()'s lease when the call passes none.
    pub default_lease: Option<Interval>,
    /// The topic patterns a named subscription receives (None: every topic).
    pub topics: Option<Vec<String>>,
    /// 'block' or 'skip' (None: the topic's policy).
    pub dead_letter_policy: Option<String>,
    /// True for the `default` made at install, which reads `outbox.event_queue`
    /// (and for `default` under SQL older than 0.10.0); false for a
    /// subscription of the log.
    pub queue: bool,
}

thread_local! {
    /// The catalog, valid for the count of invalidations of the watched tables
    /// it was loaded under ([`pg::GenerationCache`]).
    static CACHE: pg::GenerationCache<HashMap<String, Settings>> = const { pg::GenerationCache::new(c"subscription_catalog") };
}

/// The settings of subscription `name`, or None when it does not exist. Only
/// with the SQL of 0.7.0 or later (the catalog must exist).
pub fn lookup(name: &str) -> Option<Settings> {
    pg::accept_invalidations();
    CACHE.with(|c| c.with(load, |m| m.get(name).cloned()))
}

fn load() -> HashMap<String, Settings> {
    // The SQL of 0.9.0 adds the named subscriptions' filter and policy, 0.10.0
    // the storage (before it, only `default` reads the queue).
    let named = pg::catalog::outbox_relid(c"log_exceptions").is_some();
    let storage = named && pg::catalog::outbox_column(c"subscription_catalog", c"storage");
    let stmt = match (named, storage) {
        (_, true) => &SUBSCRIPTIONS_0100,
        (true, false) => &SUBSCRIPTIONS_090,
        _ => &SUBSCRIPTIONS,
    };
    plans::run_latest(stmt, &[], |rows| {
        let mut map = HashMap::new();
        rows.for_each(|row| {
            let Some(n) = row.text(0) else { return };
            let s = Settings {
                paused: row.bool(1).unwrap_or(false),
                max_attempts: row.i32(2),
                backoff_base: row.interval(3),
                backoff_max: row.interval(4),
                default_lease: row.interval(5),
                topics: if named { row.text_array(6) } else { None },
                dead_letter_policy: if named { row.text(7) } else { None },
                queue: if storage { row.bool(8).unwrap_or(false) } else { n == validate::DEFAULT_SUBSCRIPTION },
            };
            map.insert(n, s);
        });
        map
    })
}

impl Settings {
    /// The fate of a failure of attempt `attempts` under these settings:
    /// ('dead' | 'pending', retry delay in µs). The subscription's settings
    /// first, then the topic's (`base`, `cap`, and `max_attempts` as publish
    /// recorded it), then the GUCs; `retry_in` (µs) replaces the backoff.
    pub fn failure(
        &self,
        attempts: i32,
        max_attempts: i32,
        base: Option<Interval>,
        cap: Option<Interval>,
        retry_in: Option<i64>,
        permanent: bool,
    ) -> (&'static str, i64) {
        if permanent || attempts >= self.max_attempts.unwrap_or(max_attempts) {
            return ("dead", 0);
        }
        let delay = retry_in.unwrap_or_else(|| {
            let us = |iv: Option<Interval>, guc: fn() -> i64| {
                iv.and_then(|b| validate::interval_us(&b)).map(|b| b as i64).unwrap_or_else(guc)
            };
            let base = us(self.backoff_base.or(base), gucs::backoff_base_us);
            let cap = us(self.backoff_max.or(cap), gucs::backoff_max_us);
            backoff::jittered_delay_us(attempts, base, cap, backoff::unit_random())
        });
        ("pending", delay)
    }
}

/// True when subscription `name` exists and reads `outbox.event_queue`: the
/// [`lookup`] that publish makes on every call, without copying the settings.
/// With SQL older than 0.7.0 there is no catalog: `default` reads the queue.
pub fn reads_queue(name: &str) -> bool {
    if pg::catalog::outbox_relid(c"subscription_catalog").is_none() {
        return name == validate::DEFAULT_SUBSCRIPTION;
    }
    pg::accept_invalidations();
    CACHE.with(|c| c.with(load, |m| m.get(name).is_some_and(|s| s.queue)))
}

/// [`lookup`], raising 42704 when the subscription does not exist.
pub fn require(name: &str) -> Settings {
    lookup(name).unwrap_or_else(|| {
        errors::raise_hint(
            errors::UNDEFINED_OBJECT,
            format!("subscription '{name}' does not exist"),
            "List them in outbox.subscriptions.",
        )
    })
}

/// `outbox._queue_clear(force boolean) -> bigint`: for drop_subscription of
/// the `default` made at install, which holds SHARE ROW EXCLUSIVE on the queue
/// (so every writer of it has finished): raise 55006 when a lease it handed
/// out has not expired and `force` is false, else empty the queue and
/// `outbox.subject_repairs`; returns the events removed. Both statements read
/// a snapshot taken now, not the transaction's: at REPEATABLE READ or
/// SERIALIZABLE the transaction's snapshot can predate the lock, and would
/// neither count nor delete rows that publishers committed before it.
#[pg_extern(name = "_queue_clear", volatile, parallel_unsafe)]
pub fn queue_clear(force: Option<bool>) -> i64 {
    let force = force.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "force must not be NULL"));
    let count = |rows: &plans::Rows| {
        let mut n = 0;
        rows.for_each(|r| n = r.i64(0).unwrap_or(0));
        n
    };
    let leased: i64 = plans::run_latest(&QUEUE_LEASED, &[], count);
    if leased > 0 && !force {
        errors::raise_hint(
            errors::OBJECT_IN_USE,
            format!("subscription 'default' has {leased} leases in flight"),
            "Wait for the workers to finish, or pass force => true (their acks then change nothing).",
        );
    }
    plans::run_latest(&QUEUE_CLEAR, &[], count)
}

/// `outbox._queue_to_log(subscription text) -> bigint`: for
/// `outbox._default_to_log()`, which holds SHARE ROW EXCLUSIVE on the queue
/// (every writer of it has finished) and has given `subscription` its lanes
/// at a cursor taken after that lock: move every event of the queue, and the
/// archive's cancelled ones, into rows of their own of `subscription`
/// ([`QUEUE_TO_LOG`]); returns how many. Under a snapshot taken now, as
/// [`queue_clear`], so that at REPEATABLE READ or SERIALIZABLE the rows
/// publishers committed before the lock move too: the cursor, taken later,
/// counts their events as read.
#[pg_extern(name = "_queue_to_log", volatile, parallel_unsafe)]
pub fn queue_to_log(subscription: Option<&str>) -> i64 {
    let subscription =
        subscription.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "subscription must not be NULL"));
    plans::run_latest(&QUEUE_TO_LOG, &[subscription.into()], |rows| {
        let mut n = 0;
        rows.for_each(|r| n = r.i64(0).unwrap_or(0));
        n
    })
}

/// `outbox._log_forget(subscription text, lanes boolean)`: for
/// drop_subscription of a subscription of the log, delete its lanes
/// (`lanes`: first, waiting for a claim that moves one), or the rest of its
/// state (batches, exception rows, delivery record, activity: once its leases
/// are counted). Under a snapshot taken now, as [`queue_clear`]: at
/// REPEATABLE READ or SERIALIZABLE the transaction's snapshot would miss rows
/// written after it (left behind) or find rows changed since (40001).
#[pg_extern(name = "_log_forget", volatile, parallel_unsafe)]
pub fn log_forget(subscription: Option<&str>, lanes: Option<bool>) {
    let (Some(subscription), Some(lanes)) = (subscription, lanes) else {
        errors::raise(errors::NULL_VALUE, "subscription and lanes must not be NULL")
    };
    if lanes {
        plans::run_latest(&FORGET_LANES, &[subscription.into()], |_| ());
        return;
    }
    plans::run_latest(&FORGET_BATCHES, &[subscription.into()], |_| ());
    plans::run_latest(&FORGET_REST, &[subscription.into()], |_| ());
}
