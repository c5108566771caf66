//! Calls inside a transaction block, deferred to the transaction's commit.
//!
//! A lane's batch is shared by every worker that claims from the lane
//! (src/log/claim.rs). An `ack`, `fail` or `extend_lease` of a batch event
//! made inside a transaction block (a worker that acks in the transaction of
//! its side effect) must take effect iff that transaction commits; written
//! into the batch row, it would keep that row locked until the transaction
//! ends, and two such transactions that ack events of two batches in opposite
//! orders would deadlock (40P01), while every claim of the lane waited.
//!
//! So such a call writes nothing shared. It
//! 1. takes the event's *hold* ([`pg::hold`] in [`pg::HOLD_SPACE`], keyed by
//!    batch and event; past [`HOLD_CAP`] event holds in one transaction, one
//!    coarse hold of the whole batch instead, so a bulk ack does not fill the
//!    lock table), kept until the transaction ends;
//! 2. reads the batch as committed, with the calls deferred on it that this
//!    transaction sees applied (committed ones no one has applied yet, and its
//!    own), and checks the token there;
//! 3. writes a row of `outbox.log_deferred` and answers as the direct call
//!    would (true, the fail's new state, the new expiry).
//!
//! As it commits ([`on_pre_commit`]), the transaction applies the rows of
//! each batch it touched whose lock is free; the holder of a batch's lock
//! applies every committed row of that batch before it reads the batch
//! (`load_locked` in src/log/claim.rs), and the maintenance sweep forwards the
//! rows of a batch that is gone ([`fold_orphans`]).
//!
//! # Invariants, and why they hold
//! 1. **A deferred call takes effect iff its transaction commits, once.** Its
//!    row is written in the transaction, so it exists iff that commits; it is
//!    applied by whoever deletes it, under the batch's lock (one applier at a
//!    time), and a deleted row is not seen again.
//! 2. **What a deferred call answers is what its application does.** Between
//!    the check (step 2) and the application, only a claim's lease expiry or
//!    another call on the same event could change the event. A claim moves an
//!    expired event out of its batch only if it can take that event's hold
//!    and test the batch's coarse hold ([`movable`]), which it keeps until it
//!    ends; another deferred call on the event waits for the hold, and a
//!    direct (autocommit) call waits for it too ([`wait_holds`]), then folds
//!    the committed rows before it checks. A row whose event was meanwhile
//!    moved to a row of its own with its token (a replayed earlier event of
//!    its subject, a claim that sent the subject to the exception table) is
//!    forwarded there by token; that row keeps the lease, and a claim leases
//!    it again only with the event's hold and once no committed call on it
//!    waits ([`releasable`]), so the forwarded call finds its token there.
//! 3. **No wait between two deferred callers on different events.** A
//!    deferred call waits only for its event's hold (or its batch's coarse
//!    hold), never for a batch row or lock: transactions that ack disjoint
//!    events never wait for each other, in any order. Applying at commit only
//!    *tries* the batch lock.
//! 4. **Nothing is stranded.** A row is applied by its own commit, by the next
//!    claim that takes the batch (the batch's flag of deferred rows makes a
//!    claim take it: src/log/claim.rs, `serve`), by any ack of the batch, or,
//!    once the batch is gone, by the sweep.

use super::batch::Token;
use super::claim::{self, Loaded, BATCH_LOCK_KEY};
use super::exceptions;
use crate::pg::{self, plans, HoldMode};
use crate::sql::log::{
    BATCH_EXISTS, DEFERRED_INSERT, DEFERRED_OF, DEFERRED_ORPHANS, DEFERRED_PENDING, DEFERRED_TAKE, FAIL_INFO,
};
use pgrx::datum::{DatumWithOid, Interval, TimestampWithTimeZone};
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;

/// Most event holds one transaction takes; its later deferred calls hold
/// their whole batch instead ([`HoldMode::Coarse`]).
pub const HOLD_CAP: usize = 64;

/// The second key of a batch's coarse hold.
const COARSE: i32 = i32::MIN;

thread_local! {
    /// The batches this transaction deferred calls on, to apply at commit.
    static TOUCHED: RefCell<BTreeSet<i64>> = const { RefCell::new(BTreeSet::new()) };
    /// How many event holds this transaction took.
    static HOLDS: Cell<usize> = const { Cell::new(0) };
    /// Batches whose committed calls a claim found waiting ([`releasable`]).
    static STALLED: RefCell<BTreeSet<i64>> = const { RefCell::new(BTreeSet::new()) };
}

/// One deferred call.
pub struct Deferred {
    pub id: i64,
    pub token: [u8; 16],
    pub call: Kind,
    /// When the call was made (µs).
    pub at: i64,
}

/// What a deferred call does.
pub enum Kind {
    Ack,
    Fail { error: String, retry_us: Option<i64>, permanent: bool },
    Extend { lease_us: i64 },
}

fn hold_key(batch: i64, id: i64) -> (i32, i32) {
    (claim::batch_lock_key(batch), id as i32)
}

/// Take the hold of event `id` of `batch` for a deferred call (module docs,
/// step 1), waiting for another holder.
fn hold(batch: i64, id: i64) {
    let n = HOLDS.with(|h| h.get());
    if n < HOLD_CAP {
        let (k1, k2) = hold_key(batch, id);
        pg::hold(k1, k2, HoldMode::Event, true);
        HOLDS.with(|h| h.set(n + 1));
    } else {
        pg::hold(claim::batch_lock_key(batch), COARSE, HoldMode::Coarse, true);
    }
}

/// For a direct call: wait until no transaction holds any of the events
/// `pairs` (batch, id), so that a deferred call on one of them has committed
/// (and is folded before this reads the batch) or is gone. Each hold is given
/// back at once: a direct call over thousands of events must not fill the
/// shared lock table (53200), and a deferred call made after this one read
/// the batch can only be one by another holder of the same token.
pub(crate) fn wait_holds(mut pairs: Vec<(i64, i64)>) {
    pairs.sort_unstable();
    pairs.dedup();
    for (batch, id) in pairs {
        let (k1, k2) = hold_key(batch, id);
        pg::hold(k1, k2, HoldMode::Event, true);
        pg::unhold(k1, k2, HoldMode::Event);
    }
}

/// Whether a claim may move event `id` of `batch` out of the batch as
/// expired: no transaction holds it or its batch (invariant 2). The holds
/// taken stay until the claim's transaction ends, so no deferred call can
/// check the event against the batch state the claim is replacing. At most
/// [`HOLD_CAP`] per transaction (the lock table is shared): past them an
/// expired event stays for the next claim.
pub(crate) fn movable(batch: i64, id: i64) -> bool {
    let n = HOLDS.with(|h| h.get());
    if n >= HOLD_CAP {
        return false;
    }
    let (k1, k2) = hold_key(batch, id);
    if !pg::hold(k1, COARSE, HoldMode::Test, false) {
        return false;
    }
    if !pg::hold(k1, k2, HoldMode::Event, false) {
        return false;
    }
    HOLDS.with(|h| h.set(n + 1));
    true
}

/// Whether a claim may lease again event `id`'s row of its own whose lease
/// by `token` ran out (invariant 2). A token a batch minted means the event
/// left its batch with its lease (a subject sent to the exception table), so
/// a deferred call by that token may be open: the claim takes the event's
/// hold as [`movable`] does. One may also have committed and wait to be
/// forwarded (its batch's lock was busy at that commit): the claim passes
/// the row over, and [`forward_stalled`] forwards it when the batch is gone
/// (a batch that exists has its deferred flag set, so the next claim of its
/// lane applies it).
pub(crate) fn releasable(token: [u8; 16], id: i64) -> bool {
    if super::batch::token_kind(&token) != super::batch::TokenKind::Batch {
        return true;
    }
    let batch = Token::from_bytes(token).batch;
    if !movable(batch, id) {
        return false;
    }
    let waiting = plans::run_latest(&DEFERRED_PENDING, &[batch.into(), id.into()], |rows| {
        let mut w = false;
        rows.for_each(|r| w = r.bool(0) == Some(true));
        w
    });
    if waiting {
        STALLED.with(|s| s.borrow_mut().insert(batch));
    }
    !waiting
}

/// After a claim's read of the exception table: forward the committed calls
/// of the batches [`releasable`] found them waiting on, when the batch is
/// gone and its lock free; the rows they answer are leased again by a later
/// claim, with the calls applied.
pub(crate) fn forward_stalled() {
    let stalled = STALLED.with(|s| std::mem::take(&mut *s.borrow_mut()));
    for batch in stalled {
        let exists = plans::run_latest(&BATCH_EXISTS, &[batch.into()], |rows| !rows.is_empty());
        if exists || !pg::try_advisory_xact_lock(BATCH_LOCK_KEY, claim::batch_lock_key(batch)) {
            continue;
        }
        forward_gone(batch);
    }
}

/// `outbox._releasable(lease_token uuid, id bigint) -> boolean`: [`releasable`],
/// for the claim's read of the exception table (`EXC_CLAIM` in src/sql/log.rs).
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention (declared STRICT).
pub unsafe fn releasable_v1(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox._releasable(uuid, bigint) (sql/api.sql).
    let call = unsafe { crate::pg::fcall::Call::new(fcinfo) };
    let token: Option<pgrx::Uuid> = call.arg(0);
    let id: Option<i64> = call.arg(1);
    let ok = match (token, id) {
        (Some(t), Some(id)) => releasable(*t.as_bytes(), id),
        _ => true,
    };
    pg_sys::Datum::from(ok)
}

fn rows(stmt: &plans::Stmt, args: &[DatumWithOid<'_>]) -> Vec<Deferred> {
    plans::run_latest(stmt, args, |rows| {
        let mut out = Vec::with_capacity(rows.len());
        rows.for_each(|r| {
            let (Some(id), Some(token), Some(call), Some(at)) = (r.i64(0), r.uuid(1), r.text(2), r.timestamptz(3))
            else {
                return;
            };
            let call = match call.as_str() {
                "a" => Kind::Ack,
                "f" => Kind::Fail {
                    error: r.text(6).unwrap_or_default(),
                    retry_us: r.i64(4),
                    permanent: r.bool(5) == Some(true),
                },
                _ => Kind::Extend { lease_us: r.i64(4).unwrap_or(0) },
            };
            out.push(Deferred { id, token, call, at });
        });
        out
    })
}

/// The batch `batch` as this transaction would leave it: read as committed,
/// with the deferred calls it sees applied in memory. None when it is gone.
fn view(batch: i64) -> Option<Loaded> {
    let mut l = claim::load_batch(batch)?;
    if l.deferred {
        for d in rows(&DEFERRED_OF, &[batch.into()]) {
            let t = Token::from_bytes(d.token);
            let _ = match d.call {
                Kind::Ack => l.batch.ack(d.id, t).map(|_| ()),
                Kind::Fail { .. } => l.batch.park(d.id, t).map(|_| ()),
                Kind::Extend { lease_us } => l.batch.extend(d.id, t, d.at.saturating_add(lease_us)).map(|_| ()),
            };
        }
    }
    Some(l)
}

/// Step 2 of a deferred call on event `id` of `batch` by `token`: the batch's
/// view, when `token` holds the event there; None sends the call to the
/// event's row of its own (moved out with its token, or unknown: stale).
fn check(batch: i64, id: i64, token: &pgrx::Uuid) -> Option<Loaded> {
    hold(batch, id);
    let l = view(batch)?;
    l.batch.holder(id, Token::from_bytes(*token.as_bytes())).ok()?;
    Some(l)
}

/// Write deferred call `d` on batch `batch` (module docs, step 3).
fn insert(batch: i64, d: &Deferred) {
    let (call, us, permanent, error) = match &d.call {
        Kind::Ack => ("a", None, false, None),
        Kind::Fail { error, retry_us, permanent } => ("f", *retry_us, *permanent, Some(error.as_str())),
        Kind::Extend { lease_us } => ("e", Some(*lease_us), false, None),
    };
    let args: [DatumWithOid<'_>; 8] = [
        batch.into(),
        d.id.into(),
        pgrx::Uuid::from_bytes(d.token).into(),
        call.into(),
        plans::ts_param(d.at),
        us.into(),
        permanent.into(),
        error.into(),
    ];
    plans::run_latest(&DEFERRED_INSERT, &args, |_| ());
    TOUCHED.with(|t| t.borrow_mut().insert(batch));
}

/// ack of event `id` of `batch` inside a transaction block: Some(true) when
/// deferred, None when the token does not hold the event in the batch.
pub(crate) fn ack(batch: i64, id: i64, token: pgrx::Uuid) -> Option<bool> {
    check(batch, id, &token)?;
    insert(batch, &Deferred { id, token: *token.as_bytes(), call: Kind::Ack, at: pg::now() });
    Some(true)
}

/// fail() inside a transaction block: the state the event takes ('pending',
/// 'dead'), or None as for [`ack`].
pub(crate) fn fail(
    batch: i64,
    id: i64,
    token: pgrx::Uuid,
    error: &str,
    retry_in: Option<i64>,
    permanent: bool,
) -> Option<&'static str> {
    let l = check(batch, id, &token)?;
    let settings = crate::subscriptions::lookup(&l.subscription).unwrap_or_default();
    let (max_attempts, base, cap) = fail_info(l.lane, id);
    let (state, _) = settings.failure(1, max_attempts, base, cap, retry_in, permanent);
    // Applied as decided now: a permanent failure, or one past the attempts.
    let call = Kind::Fail { error: error.to_string(), retry_us: retry_in, permanent: state == "dead" };
    insert(batch, &Deferred { id, token: *token.as_bytes(), call, at: pg::now() });
    Some(state)
}

/// extend_lease inside a transaction block: the new expiry, or None as for [`ack`].
pub(crate) fn extend(batch: i64, id: i64, token: pgrx::Uuid, lease_us: i64) -> Option<TimestampWithTimeZone> {
    check(batch, id, &token)?;
    let now = pg::now();
    insert(batch, &Deferred { id, token: *token.as_bytes(), call: Kind::Extend { lease_us }, at: now });
    Some(pg::timestamptz(now.saturating_add(lease_us)))
}

/// (max_attempts, backoff base, backoff cap) of event `id` of lane `lane`.
pub(crate) fn fail_info(lane: i16, id: i64) -> (i32, Option<Interval>, Option<Interval>) {
    plans::run_latest(&FAIL_INFO, &[lane.into(), id.into()], |rows| {
        let mut out = (1, None, None);
        rows.for_each(|r| out = (r.i32(0).unwrap_or(1), r.interval(1), r.interval(2)));
        out
    })
}

/// Apply the committed deferred calls of batch `batch` (its lock held) to
/// `l`, deleting them; calls whose token no longer holds its event in the
/// batch go to the event's row of its own. Returns whether the batch changed.
pub(super) fn fold(batch: i64, l: &mut Loaded) -> bool {
    let mut changed = false;
    for d in rows(&DEFERRED_TAKE, &[batch.into()]) {
        changed |= claim::apply_deferred(batch, l, &d);
    }
    changed
}

/// Forward the deferred calls of batch `batch`, which is gone, to their
/// events' rows of their own (the batch's lock held, or the batch deleted by
/// a committed transaction).
pub(crate) fn forward_gone(batch: i64) {
    for d in rows(&DEFERRED_TAKE, &[batch.into()]) {
        forward(&d);
    }
}

/// A deferred call on an event that left its batch: to its row of its own, by token.
pub(crate) fn forward(d: &Deferred) {
    let token = pgrx::Uuid::from_bytes(d.token);
    match &d.call {
        Kind::Ack => {
            exceptions::ack(vec![d.id], vec![token]);
        }
        Kind::Fail { error, retry_us, permanent } => {
            exceptions::fail(d.id, token, error, *retry_us, *permanent);
        }
        Kind::Extend { lease_us } => {
            exceptions::extend(d.id, token, Interval::from_micros(*lease_us));
        }
    }
}

/// `outbox._log_fold_orphans() -> integer`: forward the deferred calls of
/// batches that are gone to their events' rows of their own (a batch that
/// finished, or whose subscription was dropped, while a transaction that made
/// them was still open). Run by the log step (`outbox._log_rotate`). Returns
/// how many it forwarded. No errors.
#[pg_extern(name = "_log_fold_orphans", volatile, parallel_unsafe)]
pub fn fold_orphans() -> i32 {
    let rows = rows(&DEFERRED_ORPHANS, &[]);
    for d in &rows {
        forward(d);
    }
    rows.len() as i32
}

/// At PRE_COMMIT: apply this transaction's deferred calls to each batch it
/// touched whose lock is free (only tried: invariant 3); the others are
/// applied by the next holder of their lock.
pub(crate) fn on_pre_commit() {
    let touched = TOUCHED.with(|t| std::mem::take(&mut *t.borrow_mut()));
    if touched.is_empty() {
        return;
    }
    // No statement is running at PRE_COMMIT, so no snapshot is active, and a
    // batch row stored out of line (TOAST) is read back only under one (or
    // under a registered catalog snapshot, which any invalidation drops).
    pg::with_active_snapshot(|| apply_touched(touched));
}

fn apply_touched(touched: BTreeSet<i64>) {
    for batch in touched {
        if !pg::try_advisory_xact_lock(BATCH_LOCK_KEY, claim::batch_lock_key(batch)) {
            continue;
        }
        if let Some(mut l) = claim::load_locked(batch) {
            if l.changed {
                claim::put_loaded(batch, &mut l);
            }
        }
    }
}

/// At transaction end.
pub fn on_xact_end() {
    TOUCHED.with(|t| t.borrow_mut().clear());
    STALLED.with(|t| t.borrow_mut().clear());
    HOLDS.with(|h| h.set(0));
}

/// A batch's state after a deferred extend of event `id` that split its
/// round: the holders list follows (src/log/claim.rs).
pub(crate) fn extended_holders(holders: &mut Option<Vec<Option<String>>>, from: u16, to: u16) -> bool {
    if from == to {
        return false;
    }
    let Some(h) = holders.as_mut() else { return false };
    let worker = claim::holder(Some(h), Some(from));
    h.resize(usize::from(to), None);
    h[usize::from(to) - 1] = worker;
    true
}
