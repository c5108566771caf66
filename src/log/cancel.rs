//! `outbox.cancel` of an event that a subscription of the log holds no row
//! for: one its lane has not read yet, or one waiting in the lane's batch in
//! flight. (An event with a row of its own, pending or dead, is cancelled by
//! the SQL function itself: sql/admin.sql.)
//!
//! # Invariants, and why they hold
//! 1. **A cancelled event is never handed out by the subscription** (until a
//!    replay). Where it stands is decided under the lane's row lock, which
//!    every claim that moves the lane also holds (src/log/claim.rs): so no
//!    claim reads or builds that lane meanwhile, and one that read the lane's
//!    row before is refused the lock on its old version and leaves the lane.
//!    - Not read yet (not visible in the lane's cursor, nor in the window read
//!      so far): a cancelled row is written and the id added to the lane's
//!      `skips`. Every committed event of the lane is in exactly one window
//!      (src/log/mod.rs), so the claim that reads it finds it in `skips`,
//!      leaves it out of the batch, and drops it from `skips`.
//!    - Waiting in the lane's batch (under the batch's lock, as acks take it):
//!      it leaves the batch for a pending row with every event of its subject
//!      still there, as a replay moves them (ones out stay leased to their
//!      holders from rows of their own, so none of the subject is handed out
//!      ahead of an earlier one), and that row is cancelled in the same
//!      transaction. An event out (leased), done or already moved is not
//!      cancelled: cancel takes pending or dead events only.
//! 2. **The subject goes on.** A cancelled row does not hold its subject
//!    (only pending, leased, and dead rows under `block` do), so later events
//!    follow as if it had been delivered; earlier ones are unaffected.
//! 3. **Replay puts it back where it was.** Replaying an event cancelled
//!    before it was read deletes its row and its skip under the lane's lock
//!    (sql/admin.sql), so the lane delivers it in its place in the subject's
//!    order; if a claim read it meanwhile (the skip is gone), it is replayed
//!    from its row like any cancelled event.

use super::batch::State;
use super::claim::{batch_lock_key, detach_positions, load_locked, own_filter, passes, put_loaded, BATCH_LOCK_KEY};
use crate::pg;
use crate::pg::plans;
use crate::sql::log::{CANCEL_ROW, CANCEL_UNREAD, EVENT_BY_ID, LANE_FOR_CANCEL};
use crate::subscriptions;
use pgrx::prelude::*;

/// `outbox._log_cancel(subscription text, id bigint) -> boolean`: cancel, for
/// a subscription of the log, event `id` that it has not read yet or that
/// waits in its lane's batch (module docs). False when the event is not in
/// the log, is not the subscription's (outside its topics, or committed
/// before it), or is leased, delivered or already has a row of its own.
#[pg_extern(name = "_log_cancel", volatile, parallel_unsafe)]
pub fn log_cancel(subscription: Option<&str>, id: Option<i64>) -> bool {
    let (Some(subscription), Some(id)) = (subscription, id) else {
        return false;
    };
    let Some(settings) = subscriptions::lookup(subscription) else { return false };
    let Some((lane, txid, topic, subject)) = plans::run_latest(&EVENT_BY_ID, &[id.into()], |rows| {
        let mut out = None;
        rows.for_each(|r| {
            if let (Some(lane), Some(txid), Some(topic)) = (r.i16(0), r.text(1), r.text(2)) {
                out = Some((lane, txid, topic, r.text(3)));
            }
        });
        out
    }) else {
        return false;
    };
    if !passes(&own_filter(&settings), &topic) {
        return false;
    }
    let args = [subscription.into(), lane.into(), txid.as_str().into(), id.into()];
    let Some((before, passed, in_window, batch)) = plans::run_latest(&LANE_FOR_CANCEL, &args, |rows| {
        let mut out = None;
        rows.for_each(|r| {
            out = Some((r.bool(0).unwrap_or(false), r.bool(1).unwrap_or(true), r.bool(2).unwrap_or(false), r.i64(3)))
        });
        out
    }) else {
        return false; // no lanes (a subscription restored from a dump): nothing read, nothing to decide by
    };
    if before {
        return false;
    }
    if !passed && !in_window {
        return plans::run_latest(&CANCEL_UNREAD, &[subscription.into(), lane.into(), id.into()], |rows| rows.len())
            > 0;
    }
    // Read into the lane's batch (which slides past the lane's cursor: an
    // event the cursor passed may still wait there): only one still waiting
    // there can be cancelled.
    let Some(batch) = batch else { return false };
    pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(batch));
    let Some(mut loaded) = load_locked(batch) else { return false };
    if loaded.changed {
        put_loaded(batch, &mut loaded);
    }
    let Some(at) = loaded.batch.position(id) else { return false };
    if loaded.batch.state(at) != State::Waiting {
        return false;
    }
    // With every event of its subject still in the batch (ones out stay
    // leased to their holders, from rows of their own), as a replay moves
    // them: the later ones then wait behind its row, in order, and go on once
    // it is cancelled. Without a subject, it alone.
    match subject.as_deref() {
        Some(s) => {
            drop(loaded);
            super::claim::log_detach_subject(Some(subscription), Some(s));
        }
        None => {
            detach_positions(subscription, lane, batch, loaded, &[at]);
        }
    }
    plans::run_latest(&CANCEL_ROW, &[subscription.into(), id.into()], |rows| rows.len()) > 0
}
