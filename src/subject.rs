//! Subject heads: which event of each subject may be claimed.
//!
//! An event is its subject's head when no earlier live event (pending, leased,
//! or dead under the 'block' policy) of the same subject exists. Only heads are
//! in the claim index, so events queued behind a blocked subject cost a claim
//! nothing (issue 3: 10,000 events behind one blocked subject must not slow a
//! claim of other work).
//!
//! Every path that sets or clears `is_head` holds the subject's advisory lock
//! (the one publish() takes), and runs its read in a statement that starts after
//! the lock was granted:
//! - publish computes `is_head` after taking the lock, so a head being retired
//!   concurrently has either committed (publish sees it gone) or not yet taken
//!   the lock (the retiring transaction will see the new event and promote it);
//! - ack, cancel, fail/claim to dead under 'skip', and purge_dead retire a head
//!   and then promote the subject's earliest live event. Only cancel (an
//!   operator action) waits for the lock; the others try it, and when a publisher
//!   of the subject is mid-transaction they leave the subject in
//!   outbox.subject_repairs, which the next claim() retries. So an ack never
//!   waits for an application transaction.
//! Under REPEATABLE READ a promotion can miss an event committed after the
//! retiring transaction's snapshot; the background worker's maintenance repairs
//! such heads (`outbox._purge_step('heads', ...)`), and claim's own NOT EXISTS
//! check keeps order even if a head flag were ever wrong.

use crate::plans::{self, Stmt};
use pgrx::prelude::*;

/// First key of the subject advisory locks (0x6f757462 = "outb").
pub const SUBJECT_LOCK_KEY: i32 = 1_869_903_970;

const LOCK_ONE: Stmt = Stmt {
    sql: "SELECT pg_advisory_xact_lock(1869903970, hashtext($1))",
    types: &[pg_sys::TEXTOID],
};

const LOCK_MANY: Stmt = Stmt {
    sql: "SELECT count(pg_advisory_xact_lock(1869903970, h)) FROM \
          (SELECT DISTINCT hashtext(s) AS h FROM unnest($1::text[]) AS s WHERE s IS NOT NULL ORDER BY 1) AS x",
    types: &[pg_sys::TEXTARRAYOID],
};

const TRY_LOCK_MANY: Stmt = Stmt {
    sql: "SELECT array_agg(s) FROM unnest($1::text[]) AS s \
          WHERE pg_try_advisory_xact_lock(1869903970, hashtext(s))",
    types: &[pg_sys::TEXTARRAYOID],
};

const DEFER: Stmt = Stmt {
    sql: "INSERT INTO outbox.subject_repairs (subject) SELECT s FROM unnest($1::text[]) AS s \
          ON CONFLICT DO NOTHING",
    types: &[pg_sys::TEXTARRAYOID],
};

const TAKE_DEFERRED: Stmt = Stmt {
    sql: "WITH r AS (DELETE FROM outbox.subject_repairs RETURNING subject) SELECT array_agg(subject) FROM r",
    types: &[],
};

const PROMOTE: Stmt = Stmt {
    // The new head keeps its place unless that is below the publish floor
    // (src/lowwater.rs): then it enters the claim index just above it.
    sql: "UPDATE outbox.event_queue q SET is_head = true, visible_at = GREATEST(q.visible_at, $2) \
            FROM (SELECT (SELECT min(p.id) FROM outbox.event_queue p \
                           WHERE p.subject = s AND (p.state <> 'dead' OR p.blocks_subject)) AS head \
                    FROM unnest($1::text[]) AS s) AS h \
           WHERE q.id = h.head AND NOT q.is_head",
    types: &[pg_sys::TEXTARRAYOID, pg_sys::TIMESTAMPTZOID],
};

/// Take the advisory lock of one subject (until transaction end).
pub fn lock(subject: &str) {
    plans::run(&LOCK_ONE, &[subject.into()], |_| ());
}

/// Take the advisory locks of several subjects, in hash order so that two
/// transactions locking overlapping sets cannot deadlock on them.
pub fn lock_many(subjects: &[String]) {
    if subjects.is_empty() {
        return;
    }
    plans::run(&LOCK_MANY, &[subjects.to_vec().into()], |_| ());
}

/// After heads of `subjects` were retired in this transaction: lock the subjects
/// and make each one's earliest live event its head. Returns events promoted.
pub fn promote(subjects: &[String]) -> usize {
    if subjects.is_empty() {
        return 0;
    }
    let mut list = subjects.to_vec();
    list.sort();
    list.dedup();
    lock_many(&list);
    let floor = crate::lowwater::floor_after_xid();
    plans::count(&PROMOTE, &[list.into(), crate::lowwater::ts_param(floor)])
}

/// Like [`promote`], but never waits: subjects whose lock a publisher holds are
/// left for the maintenance repair (`outbox._purge_step('heads', ...)`). For
/// retention, which must never block application transactions.
pub fn promote_nowait(subjects: &[String]) -> usize {
    if subjects.is_empty() {
        return 0;
    }
    let mut list = subjects.to_vec();
    list.sort();
    list.dedup();
    let locked: Vec<String> =
        plans::run(&TRY_LOCK_MANY, &[list.clone().into()], |t| crate::errors::spi(t.first().get_one::<Vec<String>>()))
            .unwrap_or_default();
    let busy: Vec<String> = list.into_iter().filter(|s| !locked.contains(s)).collect();
    if !busy.is_empty() {
        // A publisher of these subjects is mid-transaction; claim() retries them.
        plans::run(&DEFER, &[busy.into()], |_| ());
    }
    if locked.is_empty() {
        return 0;
    }
    let floor = crate::lowwater::floor_after_xid();
    plans::count(&PROMOTE, &[locked.into(), crate::lowwater::ts_param(floor)])
}

/// Retry promotions deferred by [`promote_nowait`]; called by claim() before it
/// looks for work. Costs one statement on an empty table when nothing is deferred.
pub fn retry_deferred() {
    let subjects: Vec<String> =
        plans::run(&TAKE_DEFERRED, &[], |t| crate::errors::spi(t.first().get_one::<Vec<String>>())).unwrap_or_default();
    if !subjects.is_empty() {
        promote_nowait(&subjects);
    }
}

/// `outbox._promote_heads(subjects text[], wait boolean DEFAULT true) -> integer`:
/// [`promote`] (or [`promote_nowait`]) for the PL/pgSQL paths (cancel, purge_dead,
/// alter_topic, the heads repair).
#[pg_extern(name = "_promote_heads", volatile, parallel_unsafe)]
fn promote_heads(subjects: Option<Vec<Option<String>>>, wait: default!(bool, true)) -> i32 {
    let list: Vec<String> = subjects.unwrap_or_default().into_iter().flatten().collect();
    if wait {
        promote(&list) as i32
    } else {
        promote_nowait(&list) as i32
    }
}
