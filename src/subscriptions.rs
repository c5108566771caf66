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
use crate::sql::claim::{FORGET_BATCHES, FORGET_LANES, FORGET_REST, SUBSCRIPTIONS};
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
}

thread_local! {
    /// The catalog, valid for the count of invalidations of the watched tables
    /// it was loaded under ([`pg::GenerationCache`]).
    static CACHE: pg::GenerationCache<HashMap<String, Settings>> = const { pg::GenerationCache::new(c"subscription_catalog") };
}

/// The settings of subscription `name`, or None when it does not exist.
pub fn lookup(name: &str) -> Option<Settings> {
    pg::accept_invalidations();
    CACHE.with(|c| c.with(load, |m| m.get(name).cloned()))
}

fn load() -> HashMap<String, Settings> {
    let stmt = &SUBSCRIPTIONS;
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
                topics: row.text_array(6),
                dead_letter_policy: row.text(7),
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

/// `outbox._log_forget(subscription text, lanes boolean)`: for
/// drop_subscription, delete its lanes
/// (`lanes`: first, waiting for a claim that moves one), or the rest of its
/// state (batches, exception rows, delivery record, activity: once its leases
/// are counted). Under a snapshot taken now: at
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
