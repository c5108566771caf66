//! Subject locks: publish's per-subject ordering, and their budget.
//!
//! publish() and publish_batch() take a transaction-scoped advisory lock on
//! each subject before they draw its event ids (src/publish.rs), so that per
//! subject, id order is commit order: the log's lanes read a subject's events
//! in id order (src/log/mod.rs).
//!
//! # Lock budget
//! Each subject lock is an entry in the shared lock table until the transaction
//! ends. The locks a transaction takes are counted and refused with SQLSTATE
//! 54000 past `outbox.max_subject_locks`, so no statement of the outbox can fill
//! the lock table, whatever the number of subjects it touches. The count follows
//! subtransactions: a lock taken in one that aborts is gone ([`crate::xact`]).

use crate::errors;
use crate::{gucs, pg};
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::HashMap;

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
            "Each distinct subject published in a transaction holds a lock until commit: \
             split the transaction, or raise outbox.max_subject_locks together with max_locks_per_transaction.",
        );
    }
    for h in hashes {
        pg::advisory_xact_lock(SUBJECT_LOCK_KEY, h);
        note_held(h);
    }
}
