//! What operators read of a subscription of the log, per event: the part of
//! `outbox._log_deliveries` (sql/subscriptions.sql) that only the batch
//! encoding knows.
//!
//! An event a subscription receives is, at any moment, in exactly one of three
//! places (src/log/claim.rs, src/log/exceptions.rs): an exception row, a batch
//! in flight (not parked there), or neither, when the lane's cursor has either
//! passed it (it was acked from a batch that has finished) or not read it yet.
//! The view takes the first two from their rows and the third from the lane's
//! snapshots; this module decodes the second.
//!
//! **Delivery times at batch precision.** An event acked from its batch has no
//! row of its own, by design (publish and the common ack write nothing per
//! event). The statement that deletes a finished batch keeps its encoding in
//! `outbox.log_delivered` with the time (src/log/claim.rs, `store_batch`), so
//! an event acked from it was delivered at the latest then (and at the
//! earliest when its round was handed out): [`log_delivered`] reports the
//! batch's finish time. An event is in at most one finished batch: it goes out of a batch
//! at most once (src/log/batch.rs), and a lane's windows never overlap
//! (src/log/mod.rs).

use super::batch::{Batch, State};
use crate::errors;
use crate::pg;
use crate::pg::plans;
use crate::sql::log::{BATCH_HOLDERS, BATCH_STATES, DELIVERED_BATCHES};
use pgrx::datum::TimestampWithTimeZone;
use pgrx::prelude::*;

/// `outbox._log_batch_states(subscription text)`: one row per event of the
/// subscription's batches in flight that has not left its batch: `id`,
/// `state` ('pending': waiting behind an earlier event of its subject, or not
/// handed out yet; 'leased': out, `lease_expires_at` its round's expiry, past
/// when the lease expired and no claim has moved it yet; 'delivered': acked),
/// `attempts` (0 or 1: later attempts are counted in the exception row).
/// Events parked in the exception table are left out (their row says more).
#[pg_extern(name = "_log_batch_states", stable, parallel_unsafe)]
#[allow(clippy::type_complexity)] // pgrx reads the row's columns from this tuple
pub fn log_batch_states(
    subscription: Option<&str>,
) -> TableIterator<
    'static,
    (
        name!(id, i64),
        name!(state, &'static str),
        name!(attempts, i32),
        name!(lease_expires_at, Option<TimestampWithTimeZone>),
    ),
> {
    let subscription =
        subscription.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "subscription must not be NULL"));
    let mut out = Vec::new();
    plans::run_rows(&BATCH_STATES, &[subscription.into()], |rows| {
        rows.for_each(|r| {
            let Some(b) = r.bytes(0).and_then(|bytes| Batch::decode(&bytes).ok()) else {
                return;
            };
            for (i, id) in b.ids().iter().enumerate() {
                let row = match b.state(i) {
                    State::Waiting => ("pending", 0, None),
                    State::Out(round) => ("leased", 1, b.round_expiry(round).map(pg::timestamptz)),
                    State::Done => ("delivered", 1, None),
                    State::Parked => continue,
                };
                out.push((*id, row.0, row.1, row.2));
            }
        });
    });
    TableIterator::new(out)
}

/// `outbox._log_batch_holders(subscription text)`: one row per event out in
/// one of the subscription's batches in flight whose round's worker is known:
/// `id` and `leased_by`, the worker that claimed it (a batch keeps the worker
/// of each round).
#[pg_extern(name = "_log_batch_holders", stable, parallel_unsafe)]
pub fn log_batch_holders(
    subscription: Option<&str>,
) -> TableIterator<'static, (name!(id, i64), name!(leased_by, String))> {
    let subscription =
        subscription.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "subscription must not be NULL"));
    let mut out = Vec::new();
    plans::run_rows(&BATCH_HOLDERS, &[subscription.into()], |rows| {
        rows.for_each(|r| {
            let (Some(b), Some(holders)) =
                (r.bytes(0).and_then(|bytes| Batch::decode(&bytes).ok()), r.text_array_with_nulls(1))
            else {
                return;
            };
            for (i, id) in b.ids().iter().enumerate() {
                if let State::Out(round) = b.state(i) {
                    if let Some(w) = super::claim::holder(Some(&holders), Some(round)) {
                        out.push((*id, w));
                    }
                }
            }
        });
    });
    TableIterator::new(out)
}

/// `outbox._log_delivered(subscription text, since timestamptz)`: one row per
/// event acked from one of the subscription's finished batches
/// (`outbox.log_delivered`, written when a batch finishes, src/log/claim.rs)
/// that finished at or after `since` (NULL: every one kept): `id` and
/// `delivered_at`, the time its batch finished (batch precision: no per-event
/// time is written for an event acked on its first try). Events that left
/// their batch are not here (their exception row has their own time).
#[pg_extern(name = "_log_delivered", stable, parallel_unsafe)]
pub fn log_delivered(
    subscription: Option<&str>,
    since: Option<TimestampWithTimeZone>,
) -> TableIterator<'static, (name!(id, i64), name!(delivered_at, TimestampWithTimeZone))> {
    let subscription =
        subscription.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "subscription must not be NULL"));
    let mut out = Vec::new();
    plans::run_rows(&DELIVERED_BATCHES, &[subscription.into(), since.into()], |rows| {
        rows.for_each(|r| {
            let (Some(at), Some(b)) = (r.timestamptz(0), r.bytes(1).and_then(|bytes| Batch::decode(&bytes).ok()))
            else {
                return;
            };
            let at = pg::timestamptz(at);
            for (i, id) in b.ids().iter().enumerate() {
                if b.state(i) == State::Done {
                    out.push((*id, at));
                }
            }
        });
    });
    TableIterator::new(out)
}

/// `outbox._log_batch_min(state bytea) -> bigint`: the smallest id of the
/// events of a batch (its `outbox.log_batches.state`) that still need their
/// row in the log: waiting or out (a parked one has a row of its own, a done
/// one needs nothing). NULL when there is none, or for bytes that are not a
/// batch. For retention (`outbox._log_readers_passed`): a batch slides past
/// its lane's cursor, so the cursor alone no longer says what the ring holds
/// for a reader.
#[pg_extern(name = "_log_batch_min", immutable, strict, parallel_safe)]
pub fn log_batch_min(state: &[u8]) -> Option<i64> {
    let b = Batch::decode(state).ok()?;
    (0..b.len()).filter(|&i| matches!(b.state(i), State::Waiting | State::Out(_))).map(|i| b.ids()[i]).min()
}
