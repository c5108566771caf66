//! Subject heads: which event of each subject may be claimed.
//!
//! An event is its subject's head when no earlier live event (pending, leased,
//! or dead under the 'block' policy) of the same subject exists. Only heads are
//! in the claim index, so events queued behind a blocked subject cost a claim
//! nothing (10,000 events behind one blocked subject must not slow a claim of
//! other work).
//!
//! # Invariant: every live event that has no earlier live event of its subject is
//! # a head, or its subject is in `outbox.subject_repairs`, once the writing
//! # transactions have committed.
//!
//! Proof sketch. Headship is decided only under the subject's advisory lock
//! (publish, cancel and replay wait for it; promotions try it), and only by a
//! statement run under a snapshot taken after the lock was granted
//! ([`crate::pg::plans::run_latest`]), whatever the isolation level. The lock is released
//! after the holder's commit is visible, so that snapshot sees every commit of
//! every earlier holder of the lock.
//! - publish inserts e with is_head = "no earlier live event of s" as of that
//!   snapshot. An earlier head h that a concurrent transaction R is retiring is
//!   either gone in the snapshot (R committed before the lock was granted to us),
//!   or R retires it later, and then R's promotion runs under the same lock after
//!   us, or R could not get the lock (we hold it) and left s in subject_repairs.
//! - retiring a head (ack, cancel, dead under 'skip', purge of a blocking dead
//!   letter, a policy switch to 'skip') is followed, in the same transaction, by
//!   [`promote`]: with the lock held it makes the earliest live event the head;
//!   when the lock is busy (a publisher of s is mid-transaction) or the new
//!   head's row is locked, it inserts s into outbox.subject_repairs instead. That
//!   row commits or rolls back with the retirement itself. Past the transaction's
//!   lock budget it only checks that the lock is free for an instant and then
//!   promotes: a publisher that takes the lock afterwards may still see the
//!   retired head (the retirement is not committed yet) and queue its event
//!   behind it, which is right whenever the subject still has a live event (the
//!   new head, whose own retirement will promote the next); when the subject is
//!   left with no live event, s goes into outbox.subject_repairs.
//! - every claim first takes a bounded number of subject_repairs rows (SKIP
//!   LOCKED, so it never waits) and promotes them; what it cannot promote it puts
//!   back. A repair row it can see is committed, so the retirement behind it is
//!   committed too; then the lock need not be held until commit, only found free
//!   once before the promotion's snapshot: every publisher that held it earlier
//!   has ended (and is visible), and every later one sees the retirement and
//!   decides its own headship. So a claim checks each subject's lock for an
//!   instant ([`crate::pg::advisory_lock_is_free`]) and holds none of them,
//!   which bounds nothing in the lock table. A deferred promotion is retried by
//!   the next claims, and maintenance is not needed for liveness. Claim's own NOT
//!   EXISTS check keeps per-subject order even if a head flag were ever wrong.
//!
//! # Lock budget
//! Each subject lock is an entry in the shared lock table until the transaction
//! ends. Locks a transaction needs (publish, cancel, replay) are counted and
//! refused with SQLSTATE 54000 past `outbox.max_subject_locks`; locks taken only
//! to promote a head are optional and stop at `max_locks_per_transaction` per
//! transaction, deferring the rest. So no statement of the outbox can fill the
//! lock table, whatever the number of subjects it touches.

use crate::errors;
use crate::pg::plans;
use crate::sql::subject::{DEFER, PROMOTE, PROMOTE_040, TAKE_DEFERRED, TAKE_DEFERRED_040};
use crate::{gucs, lowwater, pg};
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};

/// First key of the subject advisory locks (0x6f757462 = "outb"); the second is
/// `hashtext(subject)`.
pub const SUBJECT_LOCK_KEY: i32 = 1_869_903_970;

thread_local! {
    /// Subject lock hashes this transaction holds, each with the subtransactions
    /// that took it (a lock taken in a subtransaction goes away when it aborts).
    static HELD: RefCell<HashMap<i32, Vec<pg_sys::SubTransactionId>>> = RefCell::new(HashMap::new());
}

fn holds(h: i32) -> bool {
    HELD.with(|m| m.borrow().contains_key(&h))
}

fn held_count() -> usize {
    HELD.with(|m| m.borrow().len())
}

fn note_held(h: i32) {
    let sub = pg::subxact_id();
    HELD.with(|m| {
        let mut m = m.borrow_mut();
        let owners = m.entry(h).or_default();
        if !owners.contains(&sub) {
            owners.push(sub);
        }
    });
}

/// Transaction end (commit, abort, prepare): every subject lock is gone or
/// belongs to the prepared transaction.
pub fn on_xact_end() {
    HELD.with(|m| m.borrow_mut().clear());
}

/// A subtransaction aborted: the locks it took were released.
pub fn on_subxact_abort(my: pg_sys::SubTransactionId) {
    HELD.with(|m| {
        let mut m = m.borrow_mut();
        m.retain(|_, owners| {
            owners.retain(|s| *s != my);
            !owners.is_empty()
        });
    });
}

/// A subtransaction committed: its locks now belong to its parent.
pub fn on_subxact_commit(my: pg_sys::SubTransactionId, parent: pg_sys::SubTransactionId) {
    HELD.with(|m| {
        for owners in m.borrow_mut().values_mut() {
            if let Some(i) = owners.iter().position(|s| *s == my) {
                owners.swap_remove(i);
                if !owners.contains(&parent) {
                    owners.push(parent);
                }
            }
        }
    });
}

/// Take the subject locks of `subjects` (until transaction end), waiting for them,
/// in hash order so that two transactions locking overlapping sets cannot
/// deadlock on them. Raises 54000 before taking any when this transaction would
/// then hold more than `outbox.max_subject_locks`.
pub fn lock_many(subjects: &[String]) {
    lock_hashes(subjects.iter().map(|s| pg::hashtext(s)).collect());
}

/// Take the lock of one subject; see [`lock_many`].
pub fn lock(subject: &str) {
    lock_hashes(vec![pg::hashtext(subject)]);
}

/// [`lock_many`] for lock keys already hashed.
fn lock_hashes(mut hashes: Vec<i32>) {
    hashes.sort_unstable();
    hashes.dedup();
    hashes.retain(|h| !holds(*h));
    if hashes.is_empty() {
        return;
    }
    let limit = gucs::max_subject_locks();
    if held_count() + hashes.len() > limit {
        errors::raise_hint(
            errors::TOO_LARGE,
            format!(
                "this transaction would hold {} subject locks, more than outbox.max_subject_locks ({limit})",
                held_count() + hashes.len()
            ),
            "Each distinct subject published, cancelled or replayed in a transaction holds a lock until commit: \
             split the transaction, or raise outbox.max_subject_locks together with max_locks_per_transaction.",
        );
    }
    for h in hashes {
        pg::advisory_xact_lock(SUBJECT_LOCK_KEY, h);
        note_held(h);
    }
}

/// Room left for optional (promotion) locks in this transaction.
fn promotion_room() -> usize {
    gucs::max_subject_locks().min(pg::max_locks_per_xact()).saturating_sub(held_count())
}

/// Split `list` (distinct) into subjects whose lock this transaction now holds,
/// subjects past the budget (not tried), and subjects whose lock is busy.
fn lock_for_promotion(list: Vec<String>, wait: bool) -> (Vec<String>, Vec<String>, Vec<String>) {
    let mut locked = Vec::new();
    let mut over = Vec::new();
    let mut deferred = Vec::new();
    // Hash order, as lock_many: waiting promotions must not deadlock each other.
    let mut by_hash: Vec<(i32, String)> = list.into_iter().map(|s| (pg::hashtext(&s), s)).collect();
    by_hash.sort_unstable();
    for (h, s) in by_hash {
        if holds(h) {
            locked.push(s);
        } else if promotion_room() == 0 {
            over.push(s);
        } else if wait {
            pg::advisory_xact_lock(SUBJECT_LOCK_KEY, h);
            note_held(h);
            locked.push(s);
        } else if pg::try_advisory_xact_lock(SUBJECT_LOCK_KEY, h) {
            note_held(h);
            locked.push(s);
        } else {
            deferred.push(s);
        }
    }
    (locked, over, deferred)
}

fn defer(subjects: Vec<String>) {
    if !subjects.is_empty() {
        plans::run(&DEFER, &[subjects.into()], |_| ());
    }
}

/// After heads of `subjects` were retired in this transaction: make each
/// subject's earliest live event its head, under the subject lock. Subjects it
/// cannot lock (busy when `wait` is false, or past the promotion budget) or whose
/// next head row is locked are left in outbox.subject_repairs for the next
/// claims. Never waits when `wait` is false. Returns events promoted.
pub fn promote(subjects: &[String], wait: bool) -> usize {
    if subjects.is_empty() {
        return 0;
    }
    let list: Vec<String> = subjects.iter().cloned().collect::<HashSet<_>>().into_iter().collect();
    let (locked, over, mut busy) = lock_for_promotion(list, wait);
    // Past the budget: a lock found free for an instant is enough wherever the
    // subject still has a live event (module docs); a subject left empty is
    // deferred, since a publisher that takes the lock next cannot see this
    // transaction's retirement yet.
    let (free, taken): (Vec<String>, Vec<String>) =
        over.into_iter().partition(|s| pg::advisory_lock_is_free(SUBJECT_LOCK_KEY, pg::hashtext(s)));
    busy.extend(taken);
    defer(busy);
    let lock_row = pg::catalog::row_lock_installed();
    promote_now(locked, false, lock_row) + promote_now(free, true, lock_row)
}

/// Repairs one claim takes from outbox.subject_repairs.
pub const REPAIR_BATCH: i64 = 128;

/// Promote the heads of `subjects` (distinct), each of whose locks this
/// transaction holds or found free just before (see the module docs). Defers the
/// subjects whose next head row another transaction has locked and, with
/// `defer_empty`, those that have no live event left. Returns events promoted.
fn promote_now(subjects: Vec<String>, defer_empty: bool, lock_row: bool) -> usize {
    if subjects.is_empty() {
        return 0;
    }
    let floor = lowwater::floor_after_xid();
    let stmt = if lock_row { &PROMOTE } else { &PROMOTE_040 };
    let (n, skipped, empty) = plans::run_latest(stmt, &[subjects.into(), plans::ts_param(floor)], |r| {
        (r.i64(0, 1).unwrap_or(0) as usize, r.texts(0, 2), r.texts(0, 3))
    });
    defer(skipped);
    if defer_empty {
        defer(empty);
    }
    n
}

/// Retry promotions deferred by [`promote`]; called by claim() before it looks
/// for work. Takes at most [`REPAIR_BATCH`] repairs, skips rows other transactions
/// hold, never waits, and costs one statement on an empty table when nothing is
/// deferred. A subject whose lock a publisher holds goes back into the table.
/// `lock_row`: [`pg::catalog::row_lock_installed`], which the claim has looked up.
pub fn retry_deferred(lock_row: bool) {
    let stmt = if lock_row { &TAKE_DEFERRED } else { &TAKE_DEFERRED_040 };
    let subjects = plans::run_latest(stmt, &[REPAIR_BATCH.into()], |r| r.texts(0, 1));
    if subjects.is_empty() {
        return;
    }
    let (free, busy): (Vec<String>, Vec<String>) =
        subjects.into_iter().partition(|s| pg::advisory_lock_is_free(SUBJECT_LOCK_KEY, pg::hashtext(s)));
    // The retirements behind these rows are committed: an empty subject needs
    // nothing more.
    promote_now(free, false, lock_row);
    defer(busy);
}

/// `outbox._promote_heads(subjects text[], wait boolean DEFAULT true) -> integer`:
/// [`promote`] for the PL/pgSQL paths (cancel, replay, purge_dead, alter_topic,
/// the heads repair).
#[pg_extern(name = "_promote_heads", volatile, parallel_unsafe)]
fn promote_heads(subjects: Option<Vec<Option<String>>>, wait: default!(bool, true)) -> i32 {
    let list: Vec<String> = subjects.unwrap_or_default().into_iter().flatten().collect();
    promote(&list, wait) as i32
}

/// `outbox._lock_subject(subject text) -> void`: take the subject's lock until
/// transaction end, counted against `outbox.max_subject_locks` (54000 past it), for
/// the PL/pgSQL paths that decide headship (cancel, replay).
#[pg_extern(name = "_lock_subject", volatile, parallel_unsafe)]
fn lock_subject(subject: Option<&str>) {
    if let Some(s) = subject {
        lock(s);
    }
}
