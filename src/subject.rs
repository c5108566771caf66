//! Subject locks: publish's per-subject ordering, with a bounded number of
//! locks per transaction whatever the number of subjects it publishes.
//!
//! Sequence ids are drawn before commit, so a smaller id can commit later.
//! publish() and publish_batch() (src/publish.rs) therefore *cover* a subject
//! before they draw its event ids, and a transaction covers a subject until it
//! ends. Two locks of the library's own lock space ([`crate::pg::LOCK_SPACE`])
//! do it:
//!
//! - the **fine lock** F(h) of a subject hash h = `hashtext(subject)`,
//!   exclusive, key ([`SUBJECT_LOCK_KEY`], h);
//! - the **coarse lock** G, one per database, key ([`COARSE_LOCK_KEY`], 0).
//!
//! A transaction is *escalated* from the moment it holds G exclusively. It
//! covers h by one of two steps, taken once per subject and transaction:
//!
//! - **Fine** (not escalated): acquire F(h), waiting; then try G in share mode
//!   without waiting and release it at once. If the try fails (an escalated
//!   transaction holds G, or one waits for it), release F(h), which this very
//!   step took and under which nothing was drawn, wait for G in share mode,
//!   release it, and start over. On success F(h) is kept to transaction end.
//! - **Coarse** (escalated): acquire F(h), waiting, and release it at once.
//!   No fine lock is kept.
//!
//! A transaction escalates (acquires G exclusively, waiting, and keeps it to
//! transaction end) when covering its new subjects by fine steps would make it
//! hold more than K = `outbox.max_subject_locks` fine locks. publish_batch
//! decides for the whole call before it covers any subject, so a batch past K
//! escalates first. An escalated transaction keeps the fine locks it took
//! before; so it holds at most K + 1 subject locks, and G's momentary share
//! locks and the coarse step's F(h) are gone before the step returns: a
//! statement of the outbox cannot fill the shared lock table, whatever the
//! number of subjects it publishes.
//!
//! # Invariant: no two transactions cover one subject at the same time
//! Say T covers h from the moment its step for h succeeds: a fine step's last
//! try of G, a coarse step's acquisition of F(h). From then on T holds F(h)
//! (fine) or G exclusively (coarse, and G was acquired before F(h)) until it
//! ends. Suppose T1 and T2 cover h at once, T2 starting at t2 while T1 covers h.
//! - Both fine: both hold F(h) exclusively at t2. Impossible.
//! - Both coarse: both hold G exclusively at t2. Impossible.
//! - T1 fine, T2 coarse: T2 acquired F(h) at t2 while T1 held it. Impossible.
//! - T1 coarse, T2 fine: T2's try of G in share mode succeeded at t2 while T1
//!   held G exclusively. Impossible.
//!
//! # Consequence: per subject, id order is commit order
//! Every id of subject h a transaction draws, it draws while it covers h, and
//! it covers h until it ends. By the invariant, of two transactions that draw
//! ids of h, one ended before the other started covering h, so before it drew
//! any; the sequence hands out increasing ids (`CACHE 1`, src/publish.rs), so
//! the one that ended first (committed, or rolled back and left nothing) has
//! the smaller ids. The log's lanes read a subject's events in id order
//! (src/log/mod.rs).
//!
//! # Deadlocks
//! A transaction waits for one of these locks while holding one only in these
//! cases: a fine step for a further subject (it holds F of its earlier ones,
//! waits for F(h) or for G), an escalation (it holds K fine locks, waits for
//! G), a coarse step (it holds G, waits for F(h)). A share lock of G and a
//! coarse step's F(h) are never held while waiting, and a fine step's F(h) only
//! across a try, which does not wait. So a transaction that publishes one
//! subject waits for these locks only while holding none of them, and none of
//! them makes anyone wait for it while it waits: it is in no deadlock cycle of
//! subject locks (K >= 1, the setting's minimum). A cycle needs a wait for an
//! F(h), whose holder and waiter both publish h, and every transaction in it
//! holds a lock while waiting, so publishes more than one subject: deadlocks
//! (40P01, PostgreSQL aborts one) remain possible only between two
//! transactions that each publish more than one subject and share one.
//! Publishers without a subject take none of these locks.
//!
//! # Subtransactions
//! A lock taken in a subtransaction that aborts is released with it, and one
//! taken in a subtransaction that commits passes to its parent. [`HELD`] and
//! [`ESCALATED`] record the subtransaction that took each lock and follow these
//! events ([`crate::xact`]): after a rollback to a savepoint taken before the
//! escalation the transaction is no longer escalated, and covers again what it
//! publishes from then on (the events drawn under the released lock are gone
//! with the savepoint).

use crate::{gucs, pg};
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// First key of the fine subject locks (0x6f757462 = "outb"); the second is
/// `hashtext(subject)`.
pub const SUBJECT_LOCK_KEY: i32 = 1_869_903_970;

/// First key of the coarse subject lock ("obsg"); its second key is 0. It
/// differs from every other first key of the library's lock space, so G is no
/// fine lock of any hash.
pub const COARSE_LOCK_KEY: i32 = 0x6f62_7367;

thread_local! {
    /// Subject hashes whose fine lock this transaction holds, each with the
    /// subtransactions that took it.
    static HELD: RefCell<HashMap<i32, Vec<pg_sys::SubTransactionId>>> = RefCell::new(HashMap::new());
    /// The subtransaction that holds G exclusively for this transaction: its
    /// own, or a committed descendant's passed up to it. None when not escalated.
    static ESCALATED: Cell<Option<pg_sys::SubTransactionId>> = const { Cell::new(None) };
}

fn holds(h: i32) -> bool {
    HELD.with(|m| m.borrow().contains_key(&h))
}

fn held_count() -> usize {
    HELD.with(|m| m.borrow().len())
}

fn escalated() -> bool {
    ESCALATED.with(|e| e.get().is_some())
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
    ESCALATED.with(|e| e.set(None));
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
    ESCALATED.with(|e| {
        if e.get() == Some(my) {
            e.set(None);
        }
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
    ESCALATED.with(|e| {
        if e.get() == Some(my) {
            e.set(Some(parent));
        }
    });
}

/// Cover the subjects `subjects` until transaction end (module docs), waiting
/// for the transactions that cover them now. Escalates first when fine steps
/// would leave this transaction holding more than `outbox.max_subject_locks`
/// fine locks.
pub fn lock_many(subjects: &[String]) {
    lock_hashes(subjects.iter().map(|s| pg::hashtext(s)).collect());
}

/// Cover one subject; see [`lock_many`].
pub fn lock(subject: &str) {
    lock_hashes(vec![pg::hashtext(subject)]);
}

/// [`lock_many`] for subject hashes.
fn lock_hashes(mut hashes: Vec<i32>) {
    // In hash order, so two fine batches over overlapping subjects take their
    // fine locks in one order and do not deadlock on each other.
    hashes.sort_unstable();
    hashes.dedup();
    hashes.retain(|h| !holds(*h));
    if hashes.is_empty() {
        return;
    }
    if !escalated() && held_count() + hashes.len() > gucs::max_subject_locks() {
        pg::advisory_xact_lock(COARSE_LOCK_KEY, 0);
        ESCALATED.with(|e| e.set(Some(pg::subxact_id())));
    }
    if escalated() {
        for h in hashes {
            // Waits for an ordinary publisher of h that covers it now; one
            // that comes later finds G taken and waits for this transaction.
            pg::advisory_xact_lock(SUBJECT_LOCK_KEY, h);
            pg::advisory_xact_unlock(SUBJECT_LOCK_KEY, h);
        }
    } else {
        for h in hashes {
            fine_step(h);
        }
    }
}

/// The fine step for a subject hash this transaction does not hold (module docs).
fn fine_step(h: i32) {
    loop {
        pg::advisory_xact_lock(SUBJECT_LOCK_KEY, h);
        if pg::try_advisory_xact_lock_shared(COARSE_LOCK_KEY, 0) {
            pg::advisory_xact_unlock_shared(COARSE_LOCK_KEY, 0);
            note_held(h);
            return;
        }
        // An escalated transaction may be waiting for F(h) in its coarse step:
        // give it back before waiting for that transaction to end.
        pg::advisory_xact_unlock(SUBJECT_LOCK_KEY, h);
        pg::advisory_xact_lock_shared(COARSE_LOCK_KEY, 0);
        pg::advisory_xact_unlock_shared(COARSE_LOCK_KEY, 0);
    }
}
