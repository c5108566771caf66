//! Claims over the log for one subscription: lanes, windows and batches
//! (docs/design/subscriptions.md, "Claiming: lanes and batches"), and ack,
//! fail and extend_lease for the tokens they hand out.
//!
//! `outbox.claim` runs here once src/claim.rs has checked its arguments. A
//! lease token says where its lease is kept ([`TokenKind`]: a batch round or
//! a row of its own), so `ack`, `fail` and `extend_lease` route by token.
//!
//! # A claim
//! 1. Exception rows first (src/log/exceptions.rs): retries, expired leases,
//!    delayed and parked events whose time has come, subject heads only.
//! 2. Then each lane of the subscription, starting at a rotating lane so
//!    workers spread out, until it has `batch_size` events ([`Claim::serve`]):
//!    1. if the lane has a batch, take its lock without waiting
//!       ([`BATCH_LOCK_KEY`]; an ack holding it means the next claim serves
//!       it), move its expired events to the exception table
//!       ([`Batch::expire`]), and send events outside the call's topics there;
//!    2. while the batch cannot hand out what the claim wants, read the next
//!       piece of the lane's window (src/log/mod.rs) and append it to the
//!       batch ([`Batch::append`]; a new batch when the lane has none). A
//!       piece ([`piece_end`]) is at most what the claim still needs, at most
//!       [`MAX_SUBJECT_EVENTS`] unfinished events of one subject in the batch,
//!       and at most the claim's [`DIVERT_BUDGET`] going to the exception
//!       table; events outside the subscription's topics cost a read only.
//!       Subjects that continue in the exception table, delayed events and
//!       events outside the call's own topics go there, each with its
//!       subject's unfinished events in the batch ([`Claim::detach_keys`]): a
//!       subject's unfinished events are in the batch or in the exception
//!       table, never in both. A piece with nothing to hand out makes the next
//!       read [`PIECE_GROWTH`] times longer, so a claim of a filtered
//!       subscription reads on instead of coming back empty. An open window
//!       that has no more events moves the lane's cursor to its end; a fresh
//!       window with no events writes nothing;
//!    3. drop the batch's finished events once they are much of it
//!       ([`Batch::compact`], the acked ones kept in `outbox.log_delivered`),
//!       and hand out what the batch allows now ([`Batch::handable`]) as a new
//!       round.
//!
//!    So an event out, for however long and however often it is extended,
//!    holds only the later events of its own subject: nothing depends on how
//!    long a handler runs.
//!
//! The lane row is locked (with `_lock_row` semantics, [`pg::try_lock_row`]: a
//! lane another claim holds is skipped, never waited for) only to change it,
//! so a claim holds no lock on a lane where it found nothing. A claim outside
//! a transaction block also takes the lane's advisory lock ([`LANE_LOCK_KEY`])
//! before it reads the lane's window, without waiting: it guards nothing, and
//! spares two claims the same read; it is gone as the claim returns.
//!
//! # Invariants, and why they hold
//! 1. **Each committed event of a lane is put in the lane's batch, or in the
//!    exception table, exactly once.** A lane's pieces are consecutive
//!    (`id > pos`, in id order) pieces of consecutive windows, and the cursor
//!    moves to a window's end only once a read past `pos` finds nothing, or
//!    returns fewer events than it asked for and the piece keeps them all
//!    (the window's branches stop only at the limit);
//!    windows read each committed event once (src/log/mod.rs). Every lane
//!    write happens under the lane's row lock, and the row read is the newest
//!    version (a changed row is skipped, not locked), so two claims never
//!    extend one lane from the same position.
//! 2. **A subject has at most one event out, and they go out in commit
//!    order.** Its events enter the batch in reading order, which per subject
//!    is commit order, each behind the previous unfinished one of its subject
//!    (src/log/batch.rs); an event leaving the batch takes its subject's later
//!    ones with it, and a subject sent to the exception table goes whole, so
//!    the exception table's own rule (a subject's earliest holding row first)
//!    orders it there.
//! 3. **Fencing.** A token names its batch, its event and a random part; an
//!    ack matches it against the batch's state under the batch lock. An event
//!    leaves its batch at most once, and its later deliveries are leases of
//!    its exception row, with their own tokens (src/log/exceptions.rs). A
//!    stale token acks, fails and extends nothing.
//! 4. **No lost update of a batch.** Claims and direct (autocommit) acks
//!    change a batch only while holding its advisory lock (claims try it, acks
//!    wait for it), and read it under a snapshot taken after the lock: the
//!    version changed is the newest, at every isolation level, with no
//!    serialization failure from the row. Whoever holds the lock first applies
//!    the committed calls deferred on the batch ([`load_locked`]): an ack,
//!    fail or extend_lease inside a transaction block writes a row of
//!    `outbox.log_deferred` instead of the batch, so it holds no batch lock
//!    or row (src/log/deferred.rs proves its own invariants).
//! 5. **Retention keeps what a batch needs.** A batch slides past its lane's
//!    cursor, so `outbox._log_readers_passed` also asks every batch for its
//!    smallest unfinished id (`outbox._log_batch_min`).

use super::batch::{Batch, Token, TokenKind};
use super::deferred;
use super::exceptions::{self, Kind, Moved, Request};
use super::{cursor, window, Cursor, WindowEvent};
use crate::errors;
use crate::pg;
use crate::pg::catalog::outbox_relid;
use crate::pg::fcall::{Call, SetResult};
use crate::pg::plans;
use crate::sql::log::{
    BATCH_DELETE, BATCH_FINISH, BATCH_FINISH_TAIL, BATCH_GET, BATCH_GET_MANY, BATCH_IDS, BATCH_PUT, BATCH_PUT_HOLDERS,
    BATCH_PUT_MANY, BATCH_PUT_ROUNDS, BATCH_STATES, CLAIM_LANES, DELIVERED_INSERT, DELIVERED_JOIN, DELIVERED_TAIL,
    EXC_IN_FLIGHT, EXC_LOCK_ALL, EXC_READY_SINCE, EXC_STATS, FETCH, FETCH_MANY, FETCH_RANGE, LANES, LANES_WITH_NEWS,
    LANES_WITH_NEWS_SETTLED, LANE_LOCK, LANE_PUT, LANE_PUT_NEW_BATCH, OF_SUBJECT, PUBLISHED_AT, PUBLISHED_BY,
    SUBSCRIBE, SUBSCRIBE_LISTED, TOPICS_OF,
};
use crate::subscriptions::Settings;
use crate::validate;
use pgrx::datum::{DatumWithOid, Interval, TimestampWithTimeZone};
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};

/// First key of the batch advisory locks (0x6f62746c = "obtl"); the second is
/// the batch id's low 32 bits (two batches that share them only serialise).
pub const BATCH_LOCK_KEY: i32 = 0x6f62_746c;

/// How many window pieces one claim reads in one lane before it moves on: a
/// piece whose events all go elsewhere (outside the topics, delayed) hands
/// nothing out, and a claim must still end.
const MAX_PIECES: usize = 8;

/// First key of the lane advisory locks (0x6f626c6e = "obln"); the second is
/// [`lane_lock_key`]. A claim outside a transaction block takes its lane's
/// without waiting before it reads the lane's window, so two such claims do not
/// both read a lane's window only for one of them to find the lane row locked
/// by the other. It guards no data: the lane's row lock does
/// ([`pg::try_lock_row`]), and a claim in a transaction block, which holds
/// what it takes until that transaction ends, does not take it.
pub const LANE_LOCK_KEY: i32 = 0x6f62_6c6e;

/// The second key of lane `lane`'s advisory lock for a subscription whose name
/// hashes to `hash`; two subscriptions that share it only skip each other's lane.
fn lane_lock_key(hash: i32, lane: i16) -> i32 {
    (hash & !0xff) | i32::from(lane)
}

pub(super) fn batch_lock_key(id: i64) -> i32 {
    id as i32
}

/// One lane row of a subscription.
struct Lane {
    tid: pg_sys::ItemPointerData,
    lane: i16,
    lo: Cursor,
    hi: Option<Cursor>,
    pos: Option<i64>,
    batch: Option<i64>,
    /// Events cancelled before the lane read them (src/log/cancel.rs): the
    /// claim that reads one leaves it out of its batch and drops it from here.
    skips: Vec<i64>,
    /// The batch as the lane's row was read, without its lock, and whether
    /// deferred calls wait on it: the look of [`Claim::serve`].
    look: Option<(Batch, bool)>,
}

fn cursor_at(snap: Option<String>, m: Option<i64>, xn: Option<String>) -> Option<Cursor> {
    Some(Cursor { snapshot: snap?, m: m?, xn: xn?.parse().ok()? })
}

fn lanes(subscription: &str) -> Vec<Lane> {
    plans::run_latest(&LANES, &[subscription.into()], |rows| {
        let mut out = Vec::with_capacity(rows.len());
        rows.for_each(|r| out.push(lane_of(r)));
        out
    })
}

/// What a claim reads first ([`CLAIM_LANES`]): the subscription's lanes, the
/// largest event id drawn, and whether a row of its own may be claimable.
struct Start {
    lanes: Vec<Lane>,
    drawn: i64,
    exceptions: bool,
}

fn claim_lanes(subscription: &str, now: i64) -> Start {
    plans::run_latest(&CLAIM_LANES, &[subscription.into(), plans::ts_param(now)], |rows| {
        // No lane rows (a subscription whose lanes are still to be made)
        // tells nothing about its rows of their own: claim them.
        let mut out = Start { lanes: Vec::with_capacity(rows.len()), drawn: i64::MAX, exceptions: true };
        rows.for_each(|r| {
            out.lanes.push(lane_of(r));
            out.drawn = r.i64(13).unwrap_or(i64::MAX);
            out.exceptions = r.bool(14) != Some(false);
        });
        out
    })
}

/// A row of [`LANES`] (the first columns of [`CLAIM_LANES`]).
fn lane_of(r: &mut plans::Row) -> Lane {
    let (Some(tid), Some(lane), Some(lo)) = (r.tid(0), r.i16(1), cursor_at(r.text(2), r.i64(3), r.text(4))) else {
        errors::raise(errors::INTERNAL, "malformed outbox.log_lanes row");
    };
    let batch = r.i64(9);
    let look = batch.zip(r.bytes(11)).map(|(id, bytes)| (decode_batch(id, &bytes), r.bool(12) == Some(true)));
    Lane {
        tid,
        lane,
        lo,
        hi: cursor_at(r.text(5), r.i64(6), r.text(7)),
        pos: r.i64(8),
        batch,
        skips: r.i64_array(10).unwrap_or_default(),
        look,
    }
}

fn put_lane(subscription: &str, l: &Lane) {
    lane_args(subscription, l, None, |args| plans::run_latest(&LANE_PUT, args, |_| ()));
}

/// Write lane `l` with a new batch of state `state` whose first round is
/// `worker`'s, inserted by the same statement; returns the batch's id.
fn put_lane_new_batch(subscription: &str, l: &Lane, state: Vec<u8>, worker: &str) -> i64 {
    lane_args(subscription, l, Some((state, worker)), |args| {
        plans::run_latest(&LANE_PUT_NEW_BATCH, args, |rows| {
            let mut id = None;
            rows.for_each(|r| id = r.i64(0));
            id
        })
    })
    .unwrap_or_else(|| errors::raise(errors::INTERNAL, "the batch insert returned no id"))
}

/// The arguments of [`LANE_PUT`] for lane `l`, or of [`LANE_PUT_NEW_BATCH`]
/// with `new` (the batch's state and first worker), handed to `f`.
fn lane_args<R>(
    subscription: &str,
    l: &Lane,
    new: Option<(Vec<u8>, &str)>,
    f: impl FnOnce(&[DatumWithOid<'_>]) -> R,
) -> R {
    let xn = |c: &Cursor| c.xn.to_string();
    let (lo_xn, hi_xn) = (xn(&l.lo), l.hi.as_ref().map(xn));
    let skips = if l.skips.is_empty() { None } else { Some(l.skips.clone()) };
    let mut args: Vec<DatumWithOid<'_>> = vec![
        subscription.into(),
        l.lane.into(),
        l.lo.snapshot.as_str().into(),
        l.lo.m.into(),
        lo_xn.as_str().into(),
        l.hi.as_ref().map(|h| h.snapshot.as_str()).into(),
        l.hi.as_ref().map(|h| h.m).into(),
        hi_xn.as_deref().into(),
        l.pos.into(),
    ];
    match new {
        None => {
            args.push(l.batch.into());
            args.push(skips.into());
            f(&args)
        }
        Some((state, worker)) => {
            args.push(state.into());
            args.push(skips.into());
            args.push(worker.into());
            f(&args)
        }
    }
}

/// A batch row: its state, lane and subscription.
pub(super) struct Loaded {
    pub(super) batch: Batch,
    pub(super) lane: i16,
    pub(super) subscription: String,
    /// The worker of each round (round r at r - 1); None when its row keeps
    /// none.
    pub(super) holders: Holders,
    /// Whether deferred calls wait to be applied to it (src/log/deferred.rs).
    pub(super) deferred: bool,
    /// Whether applying them changed it ([`load_locked`]): to be written.
    pub(super) changed: bool,
}

/// Round workers of a batch ([`Loaded::holders`]).
pub(super) type Holders = Option<Vec<Option<String>>>;

/// The worker that claimed round `round` of a batch whose rounds' workers
/// are `holders` (round r at r - 1), when known.
pub(super) fn holder(holders: Option<&[Option<String>]>, round: Option<u16>) -> Option<String> {
    let r = usize::from(round?).checked_sub(1)?;
    holders?.get(r).cloned().flatten()
}

/// The batch `id`, read after its lock was taken; None when it is finished
/// (deleted) or its subscription was dropped.
pub(super) fn load_batch(id: i64) -> Option<Loaded> {
    let (bytes, lane, subscription, holders, deferred) = plans::run_latest(&BATCH_GET, &[id.into()], |rows| {
        let mut out = None;
        rows.for_each(|r| {
            out = Some((r.bytes(0), r.i16(1), r.text(2), r.text_array_with_nulls(3), r.bool(4) == Some(true)))
        });
        out
    })?;
    let (Some(bytes), Some(lane), Some(subscription)) = (bytes, lane, subscription) else {
        errors::raise(errors::INTERNAL, format!("malformed outbox.log_batches row {id}"));
    };
    Some(Loaded { batch: decode_batch(id, &bytes), lane, subscription, holders, deferred, changed: false })
}

/// The batch `id` for the holder of its lock: read after the lock was taken,
/// with the committed calls deferred on it applied (src/log/deferred.rs);
/// `changed` says whether that changed it. None when it is gone (then its
/// deferred calls go to their events' rows of their own).
pub(super) fn load_locked(id: i64) -> Option<Loaded> {
    let Some(mut l) = load_batch(id) else {
        deferred::forward_gone(id);
        return None;
    };
    if l.deferred {
        l.changed = deferred::fold(id, &mut l);
    }
    Some(l)
}

/// Write batch `id` as loaded and changed (deleted when finished).
pub(super) fn put_loaded(id: i64, l: &mut Loaded) {
    store_batch(id, &l.batch);
    l.changed = false;
}

/// Apply deferred call `d` to batch `batch` (`l`, its lock held); a call
/// whose token no longer holds its event there goes to the event's row of its
/// own. Returns whether the batch changed.
pub(super) fn apply_deferred(batch: i64, l: &mut Loaded, d: &deferred::Deferred) -> bool {
    let t = Token::from_bytes(d.token);
    let applied = match &d.call {
        deferred::Kind::Ack => l.batch.ack(d.id, t).is_ok(),
        deferred::Kind::Extend { lease_us } => match l.batch.extend(d.id, t, d.at.saturating_add(*lease_us)) {
            Ok((from, to)) => {
                if deferred::extended_holders(&mut l.holders, from, to) {
                    let h = l.holders.clone();
                    plans::run_latest(&BATCH_PUT_HOLDERS, &[batch.into(), l.batch.encode().into(), h.into()], |_| ());
                }
                true
            }
            Err(_) => false,
        },
        deferred::Kind::Fail { error, retry_us, permanent } => {
            fail_in_batch(batch, l, d.id, t, error, *retry_us, *permanent, d.at).is_some()
        }
    };
    if !applied {
        deferred::forward(d);
    }
    applied
}

/// fail() of event `id` of batch `batch` (`l`, its lock held) by token `t`
/// at `now`: parks it and the later events of its subject, and writes their
/// rows of their own (the failed one pending or dead). The new state, or
/// None when `t` does not hold the event; "stale" when the subscription was
/// dropped meanwhile. The caller writes the batch.
#[allow(clippy::too_many_arguments)]
fn fail_in_batch(
    batch: i64,
    l: &mut Loaded,
    id: i64,
    t: Token,
    error: &str,
    retry_in: Option<i64>,
    permanent: bool,
    now: i64,
) -> Option<&'static str> {
    let round = l.batch.position(id).and_then(|i| l.batch.round_of(i));
    let parked = l.batch.park(id, t).ok()?;
    let settings = crate::subscriptions::lookup(&l.subscription).unwrap_or_default();
    let (max_attempts, base, cap) = deferred::fail_info(l.lane, id);
    let (state, delay) = settings.failure(1, max_attempts, base, cap, retry_in, permanent);
    if state == "dead" && settings.dead_letter_policy.is_none() {
        // Before the dead letter is written: a concurrent alter_topic either
        // is read by its insert (a snapshot taken after the lock) or sees it
        // (invariant 4).
        exceptions::lock_topic_of(l.lane, id);
    }
    let mut moved: Vec<Moved> = parked
        .iter()
        .map(|&p| {
            if p == parked[0] {
                Moved {
                    id,
                    kind: if state == "dead" { Kind::Dead } else { Kind::Retry },
                    visible_at: now.saturating_add(delay),
                    token: None,
                    error: Some(error.to_string()),
                    worker: holder(l.holders.as_deref(), round),
                }
            } else {
                Moved::parked(l.batch.ids()[p], now)
            }
        })
        .collect();
    moved.sort_unstable_by_key(|m| m.id);
    l.changed = true;
    match exceptions::insert(&l.subscription, &settings, l.lane, &moved, Some(batch)) {
        None => Some("stale"), // the subscription was dropped meanwhile
        // Lost to the subscription's max_lag: its holder's fail() is stale.
        Some(missing) if missing.contains(&id) => Some("stale"),
        Some(_) => Some(state),
    }
}

/// The state kept in batch row `id`; bytes that do not decode are refused, not trusted (XX001).
fn decode_batch(id: i64, bytes: &[u8]) -> Batch {
    Batch::decode(bytes).unwrap_or_else(|e| {
        errors::raise(PgSqlErrorCode::ERRCODE_DATA_CORRUPTED, format!("outbox.log_batches row {id}: {e}"))
    })
}

/// The batches among `ids` that exist, decoded (read under a snapshot taken
/// now, after the caller took their locks), each with whether deferred calls
/// were applied to it (which changed it). A batch that is gone has its
/// deferred calls forwarded ([`load_locked`]).
fn load_batches(ids: Vec<i64>) -> HashMap<i64, (Batch, bool)> {
    let found = plans::run_latest(&BATCH_GET_MANY, &[ids.clone().into()], |rows| {
        let mut out = HashMap::new();
        rows.for_each(|r| {
            let (Some(id), Some(bytes)) = (r.i64(0), r.bytes(1)) else {
                errors::raise(errors::INTERNAL, "malformed outbox.log_batches row");
            };
            out.insert(id, (decode_batch(id, &bytes), r.bool(2) == Some(true)));
        });
        out
    });
    let mut out = HashMap::with_capacity(found.len());
    for id in ids {
        match found.get(&id) {
            Some((_, true)) | None => {
                if let Some(l) = load_locked(id) {
                    out.insert(id, (l.batch, l.changed));
                }
            }
            Some((b, false)) => {
                out.insert(id, (b.clone(), false));
            }
        }
    }
    out
}

/// Write batch `id`; false when its row is gone (drop_subscription removed
/// it). A finished batch is deleted, and its acked events recorded with the
/// time ([`record_delivered`]).
fn store_batch(id: i64, b: &Batch) -> bool {
    if !b.finished() {
        return plans::run_latest(&BATCH_PUT, &[id.into(), b.encode().into()], |rows| rows.len()) > 0;
    }
    let done: Vec<i64> =
        (0..b.len()).filter(|&i| b.state(i) == super::batch::State::Done).map(|i| b.ids()[i]).collect();
    if done.is_empty() {
        return plans::run_latest(&BATCH_FINISH, &[id.into()], |rows| rows.len()) > 0;
    }
    let Some((subscription, lane, tail)) = plans::run_latest(&BATCH_FINISH_TAIL, &[id.into()], |rows| {
        let mut out = None;
        rows.for_each(|r| out = r.text(0).zip(r.i16(1)).map(|(s, l)| (s, l, r.timestamptz(2).zip(r.bytes(3)))));
        out
    }) else {
        return false;
    };
    record_with_tail(&subscription, lane, &done, tail);
    true
}

/// Most events one row of `outbox.log_delivered` records.
const DELIVERED_ROW_EVENTS: usize = 4096;

/// Record the events `done`, acked from lane `lane`'s batch of `subscription`,
/// in `outbox.log_delivered` with the time: their delivery time, at batch
/// precision, with no write per event (src/log/views.rs). They join the lane's
/// row opened in the last ten seconds, which then takes the time of this
/// record (so a recorded time is at most ten seconds after the ack): a trickle
/// of batches of one event costs a few bytes per event there, not a row each
/// (issue 40). A row only the lane's batch holder
/// writes (one batch per lane at a time); one retention holds gets a new row.
fn record_delivered(subscription: &str, lane: i16, done: &[i64]) {
    if done.is_empty() {
        return;
    }
    let tail = plans::run_latest(&DELIVERED_TAIL, &[subscription.into(), lane.into()], |rows| {
        let mut out = None;
        rows.for_each(|r| out = r.timestamptz(0).zip(r.bytes(1)));
        out
    });
    record_with_tail(subscription, lane, done, tail);
}

/// [`record_delivered`] with the lane's row to join, `tail` (its time and
/// encoding, locked), already read.
fn record_with_tail(subscription: &str, lane: i16, done: &[i64], tail: Option<(i64, Vec<u8>)>) {
    if let Some((at, bytes)) = tail {
        if let Ok(old) = Batch::decode(&bytes) {
            let mut ids: Vec<i64> =
                (0..old.len()).filter(|&i| old.state(i) == super::batch::State::Done).map(|i| old.ids()[i]).collect();
            if ids.len() + done.len() <= DELIVERED_ROW_EVENTS {
                ids.extend_from_slice(done);
                ids.sort_unstable();
                ids.dedup();
                let args =
                    [subscription.into(), lane.into(), plans::ts_param(at), Batch::delivered(&ids).encode().into()];
                if plans::run_latest(&DELIVERED_JOIN, &args, |rows| rows.len()) > 0 {
                    return;
                }
            }
        }
    }
    let args = [subscription.into(), lane.into(), Batch::delivered(done).encode().into()];
    plans::run_latest(&DELIVERED_INSERT, &args, |_| ());
}

/// Whether `topic` passes a filter (exact names, prefixes); None passes all.
pub(super) fn passes(filter: &Option<(Vec<String>, Vec<String>)>, topic: &str) -> bool {
    match filter {
        None => true,
        Some((exact, prefixes)) => exact.iter().any(|e| e == topic) || prefixes.iter().any(|p| topic.starts_with(p)),
    }
}

/// The subscription's own topic filter, from its catalog row's patterns.
pub(super) fn own_filter(settings: &Settings) -> Option<(Vec<String>, Vec<String>)> {
    settings.topics.as_ref().and_then(|t| validate::topic_filter(Some(t.iter().cloned().map(Some).collect())))
}

/// What one claim call is handing out.
struct Claim<'a> {
    req: &'a Request<'a>,
    own: Option<(Vec<String>, Vec<String>)>,
    now: i64,
    expires: i64,
    out: &'a SetResult,
    /// Whether this claim moved expired events to the exception table.
    moved: Cell<bool>,
    /// Whether a round's lease depends on its events' topics: neither the
    /// call nor the subscription sets one, and some topic does.
    topic_leases: bool,
    /// Lanes with nothing in their window up to a snapshot taken at the
    /// claim's start ([`quiet_lanes`]): a claim appends nothing from them.
    quiet: Vec<i16>,
    /// Whether the claim runs in a transaction block.
    in_block: bool,
    /// hashtext of the subscription's name ([`lane_lock_key`]).
    hash: i32,
    /// Rounds handed out from batches in flight, not yet written ([`Claim::flush`]).
    pending: std::cell::RefCell<Vec<Pending>>,
    /// How many more events this claim may send to the exception table from
    /// the pieces it reads ([`DIVERT_BUDGET`]).
    divert_budget: Cell<usize>,
}

/// What [`Claim::take_batch`] found.
enum Taken {
    /// Another session holds the batch's lock.
    Busy,
    /// The batch, its lock held: (id, state, its rounds' workers, changed).
    Batch(Box<(Option<i64>, Batch, Holders, bool)>),
    /// The batch is finished and gone.
    Gone,
}

/// A round a claim handed out from a batch in flight, written and returned
/// with the claim's others ([`Claim::flush`]).
struct Pending {
    batch: i64,
    /// Whether the batch keeps its rounds' workers.
    holders: bool,
    lane: i16,
    state: Vec<u8>,
    ids: Vec<i64>,
    dense: bool,
    round: u16,
    /// Each event's token, in the order of `ids`.
    tokens: Vec<[u8; 16]>,
    expires: i64,
}

/// Whether the events `ids` (ascending) span ids that hold about four times
/// their number of the lane's events (a lane holds about one id in 16): read
/// as one index range ([`Claim::emit`]). A piece that starts with a late
/// committer's small id is read id by id instead of the lane's events between.
fn dense_ids(ids: &[i64]) -> bool {
    match (ids.first(), ids.last()) {
        (Some(&lo), Some(&hi)) => hi.saturating_sub(lo) < 64 * ids.len() as i64,
        _ => false,
    }
}

/// The ids of the events at `picks` of batch `id` (`b`), just handed out, in
/// id order, with their tokens.
fn sorted_picks(id: i64, b: &Batch, picks: &[usize]) -> (Vec<i64>, Vec<[u8; 16]>) {
    let mut pairs: Vec<(i64, [u8; 16])> = picks.iter().map(|&p| b.ids()[p]).zip(tokens_of(id, b, picks)).collect();
    pairs.sort_unstable_by_key(|p| p.0);
    pairs.into_iter().unzip()
}

/// How many finished events a batch keeps at least before a claim drops them
/// ([`Batch::compact`]): each compaction writes one row of
/// `outbox.log_delivered`, so a trickle of claims of one event costs a few
/// bytes per event there, not a row each.
const COMPACT_AT: usize = 32;

/// Write batch `id`'s state, with the whole list of its rounds' workers when
/// `holders` is given (compaction renumbered the rounds).
fn put_batch(id: i64, b: &Batch, holders: Option<&Holders>) {
    match holders {
        Some(Some(h)) => {
            plans::run_latest(&BATCH_PUT_HOLDERS, &[id.into(), b.encode().into(), h.clone().into()], |_| ());
        }
        _ => {
            plans::run_latest(&BATCH_PUT, &[id.into(), b.encode().into()], |_| ());
        }
    }
}

/// The row of its own that event `i` of batch `id` (`b`) gets when it leaves
/// the batch: one out in `round` stays leased to its holder, with its token
/// and expiry; one not out is parked, due `now`.
fn leave(id: i64, b: &Batch, i: usize, round: Option<u16>, holders: &Holders, now: i64) -> Moved {
    match round.and_then(|r| Some((r, b.round_expiry(r)?, b.token_in_round(id, i, r)?))) {
        Some((r, expires, t)) => Moved {
            id: b.ids()[i],
            kind: Kind::Leased,
            visible_at: expires,
            token: Some(pgrx::Uuid::from_bytes(t.to_bytes())),
            error: None,
            worker: holder(holders.as_deref(), Some(r)),
        },
        None => Moved::parked(b.ids()[i], now),
    }
}

/// The key a batch keeps for an event's subject ([`Batch`]): its lane's hash.
fn subject_key(subject: Option<&str>) -> Option<u32> {
    subject.map(|s| pg::hashtext(s) as u32)
}

/// The tokens of the events at `picks` of batch `id` (`b`), just handed out.
fn tokens_of(id: i64, b: &Batch, picks: &[usize]) -> Vec<[u8; 16]> {
    picks
        .iter()
        .map(|&p| {
            b.token(id, p).unwrap_or_else(|| errors::raise(errors::INTERNAL, "a picked event is not out")).to_bytes()
        })
        .collect()
}

/// The position of `lease_token` in claim()'s result rows (sql/api.sql).
const TOKEN_COLUMN: usize = 7;

impl Claim<'_> {
    /// Keep round `round` of batch `id` (`b`, lane `lane`), handed out
    /// to this claim's worker as the events at `picks`, to be written and
    /// returned by [`Claim::flush`], with the other rounds of this claim: one
    /// statement writes them all. The batch's lock is held until the claim's
    /// transaction ends, so nothing else changes the batch meanwhile.
    #[allow(clippy::too_many_arguments)]
    fn defer_round(&self, id: i64, lane: i16, b: &Batch, holders: bool, picks: &[usize], round: u16, expires: i64) {
        let (ids, tokens) = sorted_picks(id, b, picks);
        self.pending.borrow_mut().push(Pending {
            batch: id,
            holders,
            lane,
            state: b.encode(),
            dense: dense_ids(&ids),
            ids,
            round,
            tokens,
            expires,
        });
    }

    /// Write the rounds kept by [`Claim::defer_round`] (the workers of their
    /// rounds too, in batches that keep them) and return their events; a round
    /// whose batch row is gone (drop_subscription) returns nothing.
    fn flush(&self) {
        let pending = self.pending.take();
        if pending.is_empty() {
            return;
        }
        // A batch whose row keeps no workers of its rounds gets none.
        let (with, without): (Vec<&Pending>, Vec<&Pending>) = pending.iter().partition(|p| p.holders);
        let mut written: Vec<i64> = Vec::new();
        let collect = |rows: &plans::Rows| {
            let mut out = Vec::new();
            rows.for_each(|r| out.extend(r.i64(0)));
            out
        };
        let parts = |ps: &[&Pending]| -> (Vec<i64>, Vec<Vec<u8>>) {
            (ps.iter().map(|p| p.batch).collect(), ps.iter().map(|p| p.state.clone()).collect())
        };
        if !with.is_empty() {
            let (ids, states) = parts(&with);
            let rounds: Vec<i32> = with.iter().map(|p| i32::from(p.round)).collect();
            let args = [ids.into(), states.into(), rounds.into(), self.req.worker.into()];
            written.extend(plans::run_latest(&BATCH_PUT_ROUNDS, &args, collect));
        }
        if !without.is_empty() {
            let (ids, states) = parts(&without);
            written.extend(plans::run_latest(&BATCH_PUT_MANY, &[ids.into(), states.into()], collect));
        }
        // Dense rounds read a range each; sparse ones (later rounds of many
        // subjects, a lane each) are read together when there are several.
        let (together, alone): (Vec<&Pending>, Vec<&Pending>) =
            pending.iter().filter(|p| written.contains(&p.batch)).partition(|p| !p.dense);
        let (together, alone) =
            if together.len() < 2 { (vec![], [alone, together].concat()) } else { (together, alone) };
        for p in alone {
            self.emit(p.lane, &p.ids, p.dense, &p.tokens, p.expires);
        }
        if !together.is_empty() {
            let (mut lanes, mut ids, mut tokens, mut expires) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for p in &together {
                // SAFETY: timestamptz is a by-value int64; every value is a valid datum.
                let at = unsafe { TimestampWithTimeZone::from_datum(pg_sys::Datum::from(p.expires), false) };
                for (&id, token) in p.ids.iter().zip(&p.tokens) {
                    lanes.push(p.lane);
                    ids.push(id);
                    tokens.push(pgrx::Uuid::from_bytes(*token));
                    expires.push(at);
                }
            }
            let args = [lanes.into(), ids.into(), tokens.into(), expires.into()];
            plans::run_latest(&FETCH_MANY, &args, |rows| rows.for_each(|r| self.out.put_row(r)));
        }
    }

    /// The lease expiry of a round of the events at `picks` of `batch` (lane
    /// `lane`). The call's or the subscription's lease when either sets one;
    /// else each event's is its topic's default_lease, or the GUC's, and the
    /// round, which has one expiry, takes the longest of them, so no event is
    /// leased for less than its topic asks.
    fn round_expires(&self, lane: i16, batch: &Batch, picks: &[usize]) -> i64 {
        if !self.topic_leases {
            return self.expires;
        }
        let ids: Vec<i64> = picks.iter().map(|&p| batch.ids()[p]).collect();
        let longest = plans::run_latest(&TOPICS_OF, &[lane.into(), ids.into()], |rows| {
            let mut longest: Option<i64> = None;
            rows.for_each(|r| {
                let us = r.text(1).and_then(|t| crate::topics::default_lease_us(&t)).unwrap_or(self.req.lease_us);
                longest = Some(longest.map_or(us, |l| l.max(us)));
            });
            longest
        });
        // A topic's default_lease written under a larger outbox.max_lease is cut to it.
        self.now.saturating_add(longest.unwrap_or(self.req.lease_us).min(crate::gucs::max_lease_us()))
    }

    /// Return the events `ids` (in id order) of lane `lane`, each with its
    /// token in `tokens`, leased until `expires`. Dense ones ([`dense`]) are
    /// read as one index range, the events between them skipped here; sparse
    /// ones (later rounds of many subjects) id by id.
    fn emit(&self, lane: i16, ids: &[i64], dense: bool, tokens: &[[u8; 16]], expires: i64) {
        let (Some(&lo), Some(&hi)) = (ids.first(), ids.last()) else { return };
        // The statements return a placeholder token; each row gets its own here.
        let placeholder = pgrx::Uuid::from_bytes([0; 16]);
        let put = |r: &mut plans::Row| {
            if let Some(k) = r.i64(0).and_then(|id| ids.binary_search(&id).ok()) {
                r.set_uuid(TOKEN_COLUMN, &tokens[k]);
                self.out.put_row(r)
            }
        };
        if dense {
            let args =
                [lane.into(), lo.into(), hi.into(), placeholder.into(), plans::ts_param(expires), (hi - lo + 1).into()];
            plans::run_latest(&FETCH_RANGE, &args, |rows| rows.for_each(put));
        } else {
            let args = [lane.into(), ids.to_vec().into(), placeholder.into(), plans::ts_param(expires)];
            plans::run_latest(&FETCH, &args, |rows| rows.for_each(put));
        }
    }

    /// Move out of batch `id` (lane `lane`) the events whose lease expired
    /// ([`Batch::expire`]), each with the later events of its subject.
    /// Returns whether the batch changed.
    fn move_out(&self, id: i64, lane: i16, b: &mut Batch, holders: &Holders) -> bool {
        let rounds: Vec<Option<u16>> = (0..b.len()).map(|i| b.round_of(i)).collect();
        let mut rows: Vec<Moved> = Vec::new();
        // An event a transaction holds (a deferred ack, fail or extension
        // waiting for its commit) stays: src/log/deferred.rs, invariant 2.
        let expired: Vec<usize> =
            b.expired_events(self.now).into_iter().filter(|&i| deferred::movable(id, b.ids()[i])).collect();
        for (i, was_out) in b.expire_at(&expired) {
            // An expired event stays leased, its lease expired: its token
            // still acks until a claim takes it again, and that claim records
            // the expiry against the attempt.
            rows.push(leave(id, b, i, if was_out { rounds[i] } else { None }, holders, self.now));
        }
        if rows.is_empty() {
            return false;
        }
        // Expired events are due now: this claim hands them out (claim()).
        self.moved.set(true);
        rows.sort_unstable_by_key(|m| m.id);
        exceptions::insert(self.req.subscription, self.req.settings, lane, &rows, Some(id));
        true
    }

    /// Move every unfinished event of the subjects `keys` out of batch `id`
    /// (`b`, lane `lane`) to the exception table, for subjects whose later
    /// events this claim sends there: a subject's unfinished events are in
    /// the batch or in the exception table, never in both.
    /// `id` is None for a batch not inserted yet, which has nothing out.
    fn detach_keys(&self, id: Option<i64>, lane: i16, b: &mut Batch, holders: &Holders, keys: &HashSet<u32>) {
        let mut positions: Vec<usize> = keys.iter().flat_map(|&k| b.unfinished_positions(k)).collect();
        positions.sort_unstable();
        let rounds: Vec<Option<u16>> = (0..b.len()).map(|i| b.round_of(i)).collect();
        let mut rows: Vec<Moved> = b
            .detach(&positions)
            .into_iter()
            .map(|(i, _)| leave(id.unwrap_or(0), b, i, rounds[i], holders, self.now))
            .collect();
        if rows.is_empty() {
            return;
        }
        rows.sort_unstable_by_key(|m| m.id);
        if exceptions::insert(self.req.subscription, self.req.settings, lane, &rows, id).is_none() {
            // The batch row is gone although this claim holds its lock:
            // only drop_subscription deletes a locked batch's row, and the
            // claim's lane rows went with it. Nothing may be dropped silently.
            errors::raise(errors::INTERNAL, format!("batch {} of a claimed lane is gone", id.unwrap_or(0)));
        }
    }

    /// Send to the exception table, with every waiting event of their
    /// subjects, the handable events of batch `id` (`b`, lane `lane`) outside
    /// the call's narrowed topics; returns whether any moved.
    fn narrow(&self, lane: i16, id: i64, b: &mut Batch) -> bool {
        if self.req.narrow.is_none() {
            return false;
        }
        let handable = b.handable();
        if handable.is_empty() {
            return false;
        }
        let ids: Vec<i64> = handable.iter().map(|&i| b.ids()[i]).collect();
        let topics: HashMap<i64, String> = plans::run_latest(&TOPICS_OF, &[lane.into(), ids.into()], |rows| {
            let mut out = HashMap::new();
            rows.for_each(|r| {
                if let (Some(id), Some(t)) = (r.i64(0), r.text(1)) {
                    out.insert(id, t);
                }
            });
            out
        });
        let mut rows = Vec::new();
        for i in handable {
            let passes_narrow = topics.get(&b.ids()[i]).is_some_and(|t| passes(&self.req.narrow, t));
            if !passes_narrow && b.state(i) == super::batch::State::Waiting {
                for j in b.divert(i) {
                    rows.push(Moved::parked(b.ids()[j], self.now));
                }
            }
        }
        rows.sort_unstable_by_key(|m| m.id);
        exceptions::insert(self.req.subscription, self.req.settings, lane, &rows, Some(id));
        !rows.is_empty()
    }

    /// Whether the subscription takes event `e`. One outside its topics is
    /// owed nothing, and must not link its subject's events in a batch (a
    /// later one would go out while an earlier one is still out); one
    /// cancelled before it was read (`skips`) is finished already.
    fn owed(&self, e: &WindowEvent, skips: &[i64]) -> bool {
        passes(&self.own, &e.topic) && !skips.contains(&e.id)
    }

    /// Whether an owed event goes to the exception table instead of out of
    /// its batch: its subject continues there (`open`), it is delayed, or it
    /// is outside the call's narrowed topics.
    fn diverts(&self, e: &WindowEvent, open: &HashSet<String>) -> bool {
        e.subject.as_ref().is_some_and(|s| open.contains(s))
            || e.deliver_at.is_some_and(|d| d > self.now)
            || !passes(&self.req.narrow, &e.topic)
    }

    /// The subjects of the owed events of `events` (lane `lane`) that
    /// continue in the exception table.
    fn open_subjects(&self, lane: i16, events: &[WindowEvent], skips: &[i64]) -> HashSet<String> {
        let mut subjects: Vec<String> =
            events.iter().filter(|e| self.owed(e, skips)).filter_map(|e| e.subject.clone()).collect();
        subjects.sort_unstable();
        subjects.dedup();
        exceptions::open_subjects(self.req.subscription, lane, subjects)
    }

    /// Cut `events` (a window read, in id order) to the piece this claim adds
    /// to the lane's batch ([`piece_end`]): at most `k` events that stay in the
    /// batch, at most [`MAX_SUBJECT_EVENTS`] unfinished of one subject in it
    /// (counting those of `batch`), and no more
    /// events sent to the exception table than the claim's budget has left
    /// ([`DIVERT_BUDGET`]), which it charges. False when the piece is empty:
    /// its first owed event must go to the exception table and the budget is
    /// spent.
    fn cut(
        &self,
        events: &mut Vec<WindowEvent>,
        skips: &[i64],
        open: &HashSet<String>,
        k: usize,
        batch: Option<&Batch>,
    ) -> bool {
        let (end, diverted) = piece_end(
            events,
            |e| self.owed(e, skips),
            |e| self.diverts(e, open),
            |s| batch.map_or(0, |b| b.unfinished_of(pg::hashtext(s) as u32)),
            k.min(super::batch::MAX_EVENTS),
            self.divert_budget.get(),
        );
        events.truncate(end);
        self.divert_budget.set(self.divert_budget.get() - diverted);
        end > 0
    }

    /// Make `events` (the next piece of lane `lane`'s window, cut by
    /// [`Claim::cut`]) a batch: leave out what the subscription does not take,
    /// send to the exception table what must continue there (`open`: the
    /// subjects that do already), and return the batch.
    fn build(&self, lane: i16, events: &[WindowEvent], skips: &[i64], open: &HashSet<String>) -> Batch {
        let owed: Vec<&WindowEvent> = events.iter().filter(|e| self.owed(e, skips)).collect();
        let mut b = Batch::new(&owed.iter().map(|e| (e.id, subject_key(e.subject.as_deref()))).collect::<Vec<_>>());
        let mut moved = Vec::new();
        for (i, e) in owed.iter().enumerate() {
            if b.state(i) != super::batch::State::Waiting {
                continue;
            }
            if self.diverts(e, open) {
                for j in b.divert(i) {
                    moved.push(Moved::parked(b.ids()[j], self.now));
                }
            }
        }
        moved.sort_unstable_by_key(|m| m.id);
        exceptions::insert(self.req.subscription, self.req.settings, lane, &moved, None);
        b
    }

    /// Take batch `id`'s lock without waiting, then move out of it what must
    /// go (events outside the call's topics, expired leases).
    fn take_batch(&self, id: i64) -> Taken {
        if !pg::try_advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(id)) {
            return Taken::Busy;
        }
        match load_locked(id) {
            Some(Loaded { batch: mut b, holders, lane, changed: folded, .. }) => {
                if folded {
                    // A deferred fail may have parked events due now.
                    self.moved.set(true);
                }
                let changed = folded | self.narrow(lane, id, &mut b) | self.move_out(id, lane, &mut b, &holders);
                Taken::Batch(Box::new((Some(id), b, holders, changed)))
            }
            None => Taken::Gone,
        }
    }

    /// Hand out up to `left` events of lane `l`; returns how many.
    ///
    /// The lane's batch first: its lock is tried (an ack holding it means the
    /// next claim serves it), its expired events move out, and what it can
    /// hand out goes. While that is less than the claim wants, the lane's
    /// next pieces are read and appended to the batch (a new batch when the
    /// lane has none): an event out, however long, holds only the later
    /// events of its own subject. The lane row is locked (without waiting:
    /// [`pg::try_lock_row`] on the version read) only to move it, so a claim
    /// that only serves the batch holds no lock on its lane.
    fn serve(&self, mut l: Lane, relid: pg_sys::Oid, left: usize) -> usize {
        let mut locked = false;
        let lock = |locked: &mut bool| {
            *locked = *locked || pg::try_lock_row(relid, l.tid) == pg::RowLock::Locked;
            *locked
        };
        let mut dirty = false;
        let quiet = self.quiet.contains(&l.lane);
        // The lane's batch, its lock held: (id, or None while not inserted;
        // state; its rounds' workers; whether it changed).
        let mut cur: Option<(Option<i64>, Batch, Holders, bool)> = None;
        // The lane's batch when this claim has nothing to do with it but to
        // append: its lock is taken only once there is something to append,
        // so that its holders' acks do not wait for this claim (or, in a
        // transaction block, for that transaction).
        let mut later: Option<i64> = None;
        if let Some(id) = l.batch {
            // A look without the lock first (read with the lane).
            if let Some((b, deferred)) = l.look.take() {
                // Deferred calls to apply make the claim take the batch too.
                if !b.wants_claim(self.now) && !deferred {
                    if quiet {
                        return 0;
                    }
                    later = Some(id);
                }
            }
            if later.is_none() {
                match self.take_batch(id) {
                    Taken::Busy => return 0, // an ack is changing it: the next claim serves it
                    Taken::Batch(c) => cur = Some(*c),
                    Taken::Gone => {
                        // Finished, and deleted by the ack that finished it.
                        if !lock(&mut locked) {
                            return 0;
                        }
                        l.batch = None;
                        dirty = true;
                    }
                }
            }
        }
        let handable =
            |cur: &Option<(Option<i64>, Batch, Holders, bool)>| cur.as_ref().map_or(0, |c| c.1.handable().len());
        if handable(&cur) < left && !quiet {
            // A claim outside a transaction block takes the lane's reading
            // lock (see LANE_LOCK_KEY) before it reads the window.
            let mut reading = self.in_block;
            // A piece the claim hands nothing out of (outside the subscription's
            // topics, delayed, behind a subject continuing in the exception
            // table) makes the next read longer: a filtered subscription passes a
            // stretch of other topics in one claim, not in one claim per `left`
            // events of them.
            let room = |cur: &Option<(Option<i64>, Batch, Holders, bool)>| {
                super::batch::MAX_EVENTS - cur.as_ref().map_or(0, |c| c.1.len())
            };
            let mut limit = left.min(room(&cur));
            for _ in 0..MAX_PIECES {
                let want = left.saturating_sub(handable(&cur)).min(room(&cur));
                if want == 0 {
                    break;
                }
                if !reading {
                    if !pg::try_advisory_xact_lock(LANE_LOCK_KEY, lane_lock_key(self.hash, l.lane)) {
                        break; // another claim is reading this lane
                    }
                    reading = true;
                }
                let (hi, fresh) = match &l.hi {
                    Some(h) => (h.clone(), false),
                    None => (cursor(), true),
                };
                let asked = limit.max(1);
                let mut events = window(l.lane, &l.lo, &hi.snapshot, l.pos.unwrap_or(0), Some(asked as i32));
                // Fewer events than asked: the window holds no more above
                // `pos` (its branches stop only at the limit, src/sql/log.rs
                // WINDOW), so a piece that keeps them all reads it to its end.
                let read = events.len();
                let short = read < asked;
                if events.is_empty() && fresh && hi.m.saturating_sub(l.lo.m) < FAR_BEHIND {
                    break; // nothing new; the cursor stays (an empty window writes nothing)
                }
                if !lock(&mut locked) {
                    break;
                }
                if events.is_empty() {
                    // The open window is read to its end: the lane moves there.
                    l.lo = hi;
                    l.hi = None;
                    l.pos = None;
                    dirty = true;
                    continue;
                }
                if let Some(id) = later.take() {
                    // Something to append: now the batch's lock.
                    match self.take_batch(id) {
                        Taken::Busy => break,
                        Taken::Batch(c) => cur = Some(*c),
                        Taken::Gone => {
                            l.batch = None;
                            dirty = true;
                        }
                    }
                }
                let skips = l.skips.clone();
                let open = self.open_subjects(l.lane, &events, &skips);
                if !self.cut(&mut events, &skips, &open, want, cur.as_ref().map(|c| &c.1)) {
                    break; // the claim's budget of rows for the exception table is spent, or a subject is full
                }
                let piece = self.build(l.lane, &events, &skips, &open);
                // Every event of the piece is read now: a skip among them is done
                // with (each event is in exactly one window, src/log/mod.rs).
                l.skips.retain(|id| !events.iter().any(|e| e.id == *id));
                // A window read to its end moves the cursor to its upper
                // snapshot in this same write, as the empty read that would
                // follow does; one taken by this claim ends the reading, since
                // the next window could only hold what committed during the
                // claim (a claim outside a block steady-streaming one event
                // read its lane three times, two of them empty).
                let done = short && events.len() == read;
                if done {
                    l.lo = hi;
                    l.hi = None;
                    l.pos = None;
                } else {
                    l.pos = events.last().map(|e| e.id);
                    l.hi = Some(hi);
                }
                dirty = true;
                let gone: HashSet<u32> = (0..piece.len())
                    .filter(|&i| piece.state(i) == super::batch::State::Parked)
                    .filter_map(|i| piece.key(i))
                    .collect();
                let staying: Vec<(i64, Option<u32>)> = (0..piece.len())
                    .filter(|&i| piece.state(i) == super::batch::State::Waiting)
                    .map(|i| (piece.ids()[i], piece.key(i)))
                    .collect();
                match cur.as_mut() {
                    Some((id, b, holders, changed)) => {
                        if !gone.is_empty() {
                            // Those subjects continue in the exception table,
                            // whole (a batch not inserted yet has nothing out:
                            // its id names no token).
                            self.detach_keys(*id, l.lane, b, holders, &gone);
                            *changed = true;
                        }
                        if !staying.is_empty() {
                            b.append(&staying);
                            *changed = true;
                        }
                    }
                    None if !staying.is_empty() => cur = Some((None, Batch::new(&staying), None, true)),
                    None => {}
                }
                if done && fresh {
                    break;
                }
                if staying.is_empty() {
                    limit = (limit * PIECE_GROWTH).min(MAX_PIECE_EVENTS.max(left)).min(room(&cur));
                }
            }
        }
        let Some((id, mut b, mut holders, mut changed)) = cur else {
            if dirty {
                put_lane(self.req.subscription, &l);
            }
            return 0;
        };
        let Some(id) = id else {
            // A new batch: its first round goes out with its insert. The state
            // does not depend on the batch id, which the insert draws: the
            // tokens get it after.
            let picks: Vec<usize> = b.handable().into_iter().take(left).collect();
            let expires = self.round_expires(l.lane, &b, &picks);
            b.hand_out(&picks, self.now, expires, pg::strong_random());
            let id = put_lane_new_batch(self.req.subscription, &l, b.encode(), self.req.worker);
            // A new batch id, known to nobody else yet: nobody holds its lock.
            pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(id));
            l.batch = Some(id);
            let (ids, tokens) = sorted_picks(id, &b, &picks);
            self.emit(l.lane, &ids, dense_ids(&ids), &tokens, expires);
            return picks.len();
        };
        // Drop what is finished once it is much of the batch: the acked events
        // go to outbox.log_delivered (their delivery time, at claim precision).
        let mut compacted = false;
        if b.finished() || b.finished_count() >= COMPACT_AT.max(b.len() / 2) {
            let c = b.compact();
            record_delivered(self.req.subscription, l.lane, &c.done);
            holders = holders.map(|h| c.rounds_from.iter().map(|&r| holder(Some(&h), Some(r))).collect());
            compacted = true;
            changed = true;
        }
        if b.is_empty() {
            // Nothing left in flight: the batch goes, when the lane can move.
            if lock(&mut locked) {
                plans::run_latest(&BATCH_DELETE, &[id.into()], |_| ());
                l.batch = None;
                dirty = true;
            } else if changed {
                put_batch(id, &b, compacted.then_some(&holders));
            }
            if dirty {
                put_lane(self.req.subscription, &l);
            }
            return 0;
        }
        let picks: Vec<usize> = b.handable().into_iter().take(left).collect();
        if picks.is_empty() {
            if changed {
                put_batch(id, &b, compacted.then_some(&holders));
            }
            if dirty {
                put_lane(self.req.subscription, &l);
            }
            return 0;
        }
        let expires = self.round_expires(l.lane, &b, &picks);
        let round = b.hand_out(&picks, self.now, expires, pg::strong_random());
        if compacted {
            // The rounds were renumbered: the whole list of workers is written.
            if let Some(h) = holders.as_mut() {
                h.resize(usize::from(round), None);
                h[usize::from(round) - 1] = Some(self.req.worker.to_string());
            }
            put_batch(id, &b, Some(&holders));
            let (ids, tokens) = sorted_picks(id, &b, &picks);
            self.emit(l.lane, &ids, dense_ids(&ids), &tokens, expires);
        } else {
            self.defer_round(id, l.lane, &b, holders.is_some(), &picks, round, expires);
        }
        if dirty {
            put_lane(self.req.subscription, &l);
        }
        picks.len()
    }
}

thread_local! {
    /// Lane cursors (lane, snapshot, m, xn) whose late committers are settled:
    /// [`quiet_lanes`] found none of their events in the window under a
    /// snapshot whose xmin was at or above the cursor's `xn`.
    static SETTLED: RefCell<HashSet<(i16, String, i64, u64)>> = RefCell::new(HashSet::new());
}

/// How many ids may be drawn past a lane's cursor before a claim that finds
/// the lane's window empty moves the cursor anyway (a lane row write). The
/// window's first branch reads the lane's index entries above the cursor's
/// `m`, visible or not: a transaction still open with 100,000 events (ids
/// above `m`, about one in 16 in each lane) would otherwise be passed over by
/// every claim of every subscription until it commits. Once the cursor moves
/// past them, its snapshot lists that transaction as running, and the second
/// branch probes it only once it has committed. Moving a cursor across an
/// empty window is what reading a window to its end does (src/log/mod.rs:
/// consecutive windows).
const FAR_BEHIND: i64 = 1024;

/// Most cursors [`SETTLED`] keeps (lanes move on; old cursors are never asked about again).
const SETTLED_MAX: usize = 256;

/// The lanes of `all` whose window is empty: no window open, and nothing in
/// the window from their cursor up to a snapshot taken now
/// ([`LANES_WITH_NEWS`], one statement for them all). A claim reads nothing
/// from them, and passes them by unless their batch has something to hand out.
///
/// **Passing such a lane by changes nothing a claim would have done.**
/// [`Claim::serve`] reads the same window (the same definition, through the
/// same three branches, which src/log/mod.rs proves complete) from a cursor it
/// takes a moment later; up to the check's snapshot it would find the window
/// empty, and an empty fresh window writes nothing: the cursor stays. An event
/// that commits between the two snapshots is in a window that ends later; its
/// commit's wake-up (src/wakeup.rs) sends a worker to claim it, as for one
/// committed just after the claim. The check errs towards serving: it counts
/// the claimer's own uncommitted events as news (`pg_current_snapshot()`
/// leaves the taker's id out of its in-progress list, where [`cursor`] puts it),
/// and ignores topic filters, delays and skips. The check reads the lane versions
/// `all` was read from: a lane another claim moved since is one it cannot
/// lock anyway ([`pg::try_lock_row`] on the version read).
///
/// **A settled cursor's late committers need no second look.** The two
/// late-committer branches take transactions with ids below the cursor's `xn`
/// that its snapshot did not see. Once a snapshot `H` with `xmin(H) >= xn`
/// found no event of theirs in the window, none ever appears: each of those
/// transactions has ended by `H` (`xmin(H)` counts the taker's own id too, so
/// a claimer that is itself one of the cursor's late committers never settles
/// it), so it writes no more rows, and
/// `pg_visible_in_snapshot` of an id below `xmin` is true in `H` and in every
/// later snapshot, so the branches' condition on each existing row is the
/// same as under `H`. Such a cursor is remembered in [`SETTLED`] (per
/// backend, keyed by the lane and the whole cursor, so a lane that moves is
/// asked afresh; not by subscription, since the window depends only on the
/// lane, the cursor and the log) and only the branch of ids above `m` is
/// probed for it.
fn quiet_lanes(all: &[Lane], drawn: i64) -> Vec<i16> {
    let mut idle: Vec<&Lane> = all.iter().filter(|l| l.hi.is_none() && l.pos.is_none()).collect();
    if idle.is_empty() {
        return Vec::new();
    }
    let key = |l: &Lane| (l.lane, l.lo.snapshot.clone(), l.lo.m, l.lo.xn);
    let mut late: Vec<bool> = SETTLED.with(|s| {
        let s = s.borrow();
        idle.iter().map(|l| !s.contains(&key(l))).collect()
    });
    // A settled cursor has news only if an id above its `m` was drawn (the
    // check's first branch reads ids above `m`). Those lanes are quiet with
    // no check at all: the check's plan is most of an idle worker's claim.
    let mut quiet = Vec::new();
    if late.contains(&false) {
        let (mut keep, mut keep_late) = (Vec::new(), Vec::new());
        for (l, is_late) in idle.into_iter().zip(late) {
            if !is_late && drawn <= l.lo.m {
                quiet.push(l.lane);
            } else {
                keep.push(l);
                keep_late.push(is_late);
            }
        }
        if keep.is_empty() {
            return quiet;
        }
        (idle, late) = (keep, keep_late);
    }
    let settled = !late.contains(&true);
    let lanes: Vec<i16> = idle.iter().map(|l| l.lane).collect();
    let snaps: Vec<String> = idle.iter().map(|l| l.lo.snapshot.clone()).collect();
    let ms: Vec<i64> = idle.iter().map(|l| l.lo.m).collect();
    let xns: Vec<String> = idle.iter().map(|l| l.lo.xn.to_string()).collect();
    let args = [lanes.into(), snaps.into(), ms.into(), xns.into(), late.clone().into()];
    let stmt = if settled { &LANES_WITH_NEWS_SETTLED } else { &LANES_WITH_NEWS };
    let rows = plans::run_latest(stmt, &args, |rows| {
        let mut out = Vec::with_capacity(rows.len());
        rows.for_each(|r| {
            out.push((r.i16(0), r.bool(1), r.text(2).and_then(|x| x.parse::<u64>().ok()), r.i64(3).unwrap_or(0)))
        });
        out
    });
    for (i, (lane, news, xmin, drawn)) in rows.into_iter().enumerate() {
        let (Some(lane), Some(false)) = (lane, news) else { continue };
        let l = idle[i];
        if drawn.saturating_sub(l.lo.m) >= FAR_BEHIND {
            // Nothing new, but far behind the ids drawn: served, so that its
            // empty window moves the cursor (see FAR_BEHIND).
            continue;
        }
        quiet.push(lane);
        if late[i] && l.lane == lane && xmin.is_some_and(|x| x >= l.lo.xn) {
            SETTLED.with(|s| {
                let mut s = s.borrow_mut();
                if s.len() >= SETTLED_MAX {
                    s.clear();
                }
                s.insert(key(l));
            });
        }
    }
    quiet
}

/// Most events of one subject a batch takes: a subject's events go out one
/// per round, so a piece of one busy subject would make a batch of many rounds
/// (a row that grows with each, rewritten by every ack); the rest of the piece
/// is read by the lane's next batch.
pub const MAX_SUBJECT_EVENTS: usize = 16;

/// How much longer each read of a lane's window gets after a piece that
/// handed nothing out ([`Claim::serve`]), up to [`MAX_PIECE_EVENTS`].
const PIECE_GROWTH: usize = 8;

/// The longest read of a lane's window that a piece handing nothing out grows
/// to (events; a read returns id, subject, topic and deliver_at only). With
/// [`MAX_PIECES`] pieces, a claim passes up to about 17,000 events of other
/// topics per lane at batch size 1.
const MAX_PIECE_EVENTS: usize = 4096;

/// How many events one claim may send to the exception table from the
/// pieces it reads (one row each, payload included): a subject that
/// continues there (a dead letter that blocks it, say) with thousands of
/// events behind it costs each claim at most this many rows, and the lane's
/// other subjects come out within a few claims, not one claim per `left`
/// of them. A soft bound: a subject diverted in a piece takes every event of
/// it in that piece ([`Batch::divert`]), up to [`MAX_SUBJECT_EVENTS`] more.
pub const DIVERT_BUDGET: usize = 1024;

/// Where a claim cuts a window read `events` (in id order) to make its
/// piece: the number of events the piece keeps, and how many of them go to
/// the exception table. `owed` says which events the subscription takes (the
/// others pass free: they cost a batch nothing); `diverted`, which owed events
/// go to the exception table (and every later owed event of a subject one of
/// them has). The piece ends before the first owed event that would be the
/// `k + 1`-th staying in the batch, the [`MAX_SUBJECT_EVENTS`] + 1-th staying
/// of its subject, the `budget + 1`-th diverted, or the
/// [`super::batch::MAX_EVENTS`] + 1-th owed. With `events` at most `k` long
/// and nothing diverted, that is every event before the first one past its
/// subject's cap: the piece of 0.15.0, whose reads were `k` long.
pub fn piece_end(
    events: &[WindowEvent],
    owed: impl Fn(&WindowEvent) -> bool,
    diverted: impl Fn(&WindowEvent) -> bool,
    already: impl Fn(&str) -> usize,
    k: usize,
    budget: usize,
) -> (usize, usize) {
    let (mut staying, mut taken, mut sent) = (0usize, 0usize, 0usize);
    let mut per_subject: HashMap<&str, usize> = HashMap::new();
    let mut gone: HashSet<&str> = HashSet::new();
    for (i, e) in events.iter().enumerate() {
        if !owed(e) {
            continue;
        }
        if taken == super::batch::MAX_EVENTS {
            return (i, sent);
        }
        let subject = e.subject.as_deref();
        if subject.is_some_and(|s| gone.contains(s)) || diverted(e) {
            if sent == budget {
                return (i, sent);
            }
            sent += 1;
            if let Some(s) = subject {
                gone.insert(s);
            }
        } else {
            if staying == k {
                return (i, sent);
            }
            if let Some(s) = subject {
                let n = per_subject.entry(s).or_insert_with(|| already(s));
                if *n == MAX_SUBJECT_EVENTS {
                    return (i, sent);
                }
                *n += 1;
            }
            staying += 1;
        }
        taken += 1;
    }
    (events.len(), sent)
}

thread_local! {
    /// Where this backend's next claim starts among the lanes.
    static NEXT_LANE: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn start_lane() -> usize {
    NEXT_LANE.with(|n| {
        let start = if n.get() == usize::MAX { pg::my_pid() as usize } else { n.get() };
        n.set(start.wrapping_add(1));
        start % super::LANES as usize
    })
}

fn require_relid(name: &std::ffi::CStr) -> pg_sys::Oid {
    outbox_relid(name).unwrap_or_else(|| {
        errors::raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "the log reader tables do not exist; run ALTER EXTENSION outbox_ext UPDATE",
        )
    })
}

/// `outbox.claim` for a subscription that reads the log: up to `batch_size`
/// events into the call's result set (src/claim.rs has checked the arguments
/// and that the subscription exists and is not paused).
pub fn claim(call: &Call, req: &Request<'_>, batch_size: usize) -> pg_sys::Datum {
    let relid = require_relid(c"log_lanes");
    super::restore::rebase_if_pending();
    let now = pg::now();
    let out = SetResult::begin(call);
    let mut begin = claim_lanes(req.subscription, now);
    // Rows of their own first (retries, expired leases, due and parked events).
    let mut left = batch_size - if begin.exceptions { exceptions::claim_due(req, now, batch_size, &out) } else { 0 };
    if left > 0 {
        if begin.lanes.is_empty() {
            // Lanes are made by create_subscription and by a restore's rebase
            // (src/log/restore.rs); a subscription whose lanes are missing
            // anyway (rows deleted by hand) starts here. One dropped meanwhile
            // gets none (its catalog row is read, and waited for, first).
            let c = cursor();
            let xn = c.xn.to_string();
            let args: [DatumWithOid<'_>; 4] =
                [req.subscription.into(), c.snapshot.as_str().into(), c.m.into(), xn.as_str().into()];
            plans::run_latest(&SUBSCRIBE_LISTED, &args, |_| ());
            begin = claim_lanes(req.subscription, now);
        }
        let mut all = begin.lanes;
        let start = start_lane();
        all.sort_by_key(|l| (l.lane as usize + super::LANES as usize - start) % super::LANES as usize);
        let claim = Claim {
            req,
            own: own_filter(req.settings),
            now,
            expires: now.saturating_add(req.lease_us),
            out: &out,
            moved: Cell::new(false),
            topic_leases: !req.lease_fixed && crate::topics::any_default_lease(),
            quiet: quiet_lanes(&all, begin.drawn),
            in_block: pg::in_transaction_block(),
            hash: pg::hashtext(req.subscription),
            pending: Default::default(),
            divert_budget: Cell::new(DIVERT_BUDGET),
        };
        for l in all {
            if left == 0 {
                break;
            }
            if l.batch.is_none() && claim.quiet.contains(&l.lane) {
                continue;
            }
            left -= claim.serve(l, relid, left);
        }
        claim.flush();
        if left > 0 && claim.moved.get() {
            // Expired events it moved are due now: hand them out at once.
            exceptions::claim_due(req, now, left, &out);
        }
    }
    call.finish_set()
}

fn subscribe(subscription: &str, c: Cursor) -> bool {
    let xn = c.xn.to_string();
    let args: [DatumWithOid<'_>; 4] = [subscription.into(), c.snapshot.as_str().into(), c.m.into(), xn.as_str().into()];
    plans::run_latest(&SUBSCRIBE, &args, |rows| rows.len()) > 0
}

/// `outbox._log_subscribe(subscription text, start text DEFAULT 'now') -> boolean`:
/// give the subscription its 16 lanes, starting at a cursor taken now (`now`:
/// events whose transaction commits later) or before every event (`earliest`).
/// False when it has them already. 22004 for NULL, 22023 for another start.
#[pg_extern(name = "_log_subscribe", volatile, parallel_unsafe)]
pub fn log_subscribe(subscription: Option<&str>, start: default!(Option<&str>, "'now'")) -> bool {
    let subscription =
        subscription.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "subscription must not be NULL"));
    validate::subscription(subscription);
    let c = match start {
        Some("now") => cursor(),
        // Nothing is visible in a snapshot whose xmax is the first normal xid.
        Some("earliest") => Cursor { snapshot: "3:3:".into(), m: 0, xn: 3 },
        None => errors::raise(errors::NULL_VALUE, "start must not be NULL"),
        Some(other) => {
            errors::raise(errors::INVALID_PARAMETER, format!("start must be 'now' or 'earliest', not {other:?}"))
        }
    };
    subscribe(subscription, c)
}

/// `outbox._log_in_flight(subscription text) -> bigint`: the subscription's
/// leases that have not expired, in its batches and its exception rows,
/// counted once every transaction that is changing them has ended: it takes
/// each of the subscription's batch locks ([`BATCH_LOCK_KEY`], in batch id
/// order, as acks do, so the two never wait for each other in a cycle) and
/// locks its exception rows, waiting. Claims only try those locks, so a claim
/// never waits for this. For drop_subscription, after it removed the lanes: a
/// claim left open in a transaction that handed out events of a batch in
/// flight, or exception rows, is then counted.
#[pg_extern(name = "_log_in_flight", volatile, parallel_unsafe)]
pub fn log_in_flight(subscription: Option<&str>) -> i64 {
    let subscription =
        subscription.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "subscription must not be NULL"));
    let ids: Vec<i64> = plans::run_latest(&BATCH_IDS, &[subscription.into()], |rows| {
        let mut out = Vec::new();
        rows.for_each(|r| out.extend(r.i64(0)));
        out
    });
    for id in ids {
        pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(id));
    }
    plans::run_latest(&EXC_LOCK_ALL, &[subscription.into()], |_| ());
    let now = pg::now();
    let in_batches: i64 = plans::run_latest(&BATCH_STATES, &[subscription.into()], |rows| {
        let mut n = 0i64;
        rows.for_each(|r| {
            if let Some(b) = r.bytes(0).and_then(|bytes| Batch::decode(&bytes).ok()) {
                n += b.out_unexpired(now) as i64;
            }
        });
        n
    });
    let in_rows: i64 = plans::run_latest(&EXC_IN_FLIGHT, &[subscription.into(), plans::ts_param(now)], |rows| {
        let mut n = 0;
        rows.for_each(|r| n = r.i64(0).unwrap_or(0));
        n
    });
    in_batches + in_rows
}

/// `outbox._log_subscription_stats(subscription text)`: one row of what a
/// named subscription owes, for the view `outbox.subscriptions`: `lag_events`
/// (events not yet delivered: read or not, in batches, retries), `oldest_id`
/// and `oldest_at` (the oldest of them), `leases_in_flight` (unexpired),
/// `dead_letters`. Reads each lane's window up to a cursor taken now. An
/// event whose transaction committed late below a lane's position is counted
/// once that lane's next window reads it.
#[pg_extern(name = "_log_subscription_stats", volatile, parallel_unsafe)]
#[allow(clippy::type_complexity)] // pgrx reads the row's columns from this tuple
pub fn log_subscription_stats(
    subscription: Option<&str>,
) -> TableIterator<
    'static,
    (
        name!(lag_events, i64),
        name!(oldest_id, Option<i64>),
        name!(oldest_at, Option<TimestampWithTimeZone>),
        name!(leases_in_flight, i64),
        name!(dead_letters, i64),
    ),
> {
    let subscription =
        subscription.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "subscription must not be NULL"));
    let now = pg::now();
    let hi = cursor();
    // Unread events outside the subscription's topics are not owed to it.
    let filter = crate::subscriptions::lookup(subscription).as_ref().and_then(own_filter);
    let (mut lag, mut in_flight) = (0i64, 0i64);
    let mut oldest: Option<(i64, i16)> = None;
    let mut note = |id: Option<i64>, lane: i16| {
        if let Some(id) = id {
            if oldest.is_none_or(|(o, _)| id < o) {
                oldest = Some((id, lane));
            }
        }
    };
    for l in lanes(subscription) {
        let (n, min) = super::window_count(l.lane, &l.lo, &hi.snapshot, l.pos.unwrap_or(0), &filter, None);
        lag += n;
        note(min, l.lane);
        if let Some(Loaded { batch: b, .. }) = l.batch.and_then(load_batch) {
            let owed: Vec<i64> = (0..b.len())
                .filter(|&i| matches!(b.state(i), super::batch::State::Waiting | super::batch::State::Out(_)))
                .map(|i| b.ids()[i])
                .collect();
            lag += owed.len() as i64;
            note(owed.iter().min().copied(), l.lane);
            in_flight += b.out_unexpired(now) as i64;
        }
    }
    let mut oldest_at =
        oldest.and_then(|(id, lane)| plans::one::<TimestampWithTimeZone>(&PUBLISHED_AT, &[lane.into(), id.into()]));
    let (exc, exc_min, exc_at, exc_leased, dead) =
        plans::run_latest(&EXC_STATS, &[subscription.into(), plans::ts_param(now)], |rows| {
            let mut out = (0, None, None, 0, 0);
            rows.for_each(|r| {
                out = (r.i64(0).unwrap_or(0), r.i64(1), r.timestamptz(2), r.i64(3).unwrap_or(0), r.i64(4).unwrap_or(0))
            });
            out
        });
    lag += exc;
    let mut oldest_id = oldest.map(|(id, _)| id);
    if let (Some(id), Some(at)) = (exc_min, exc_at) {
        if oldest_id.is_none_or(|o| id < o) {
            oldest_id = Some(id);
            oldest_at = Some(pg::timestamptz(at));
        }
    }
    TableIterator::once((lag, oldest_id, oldest_at, in_flight + exc_leased, dead))
}

/// `outbox._log_backlog(subscription text, published_by timestamptz) -> bigint`
/// (for `outbox.health()`): how many of the subscription's events
/// are claimable, or wait only behind an earlier event of their subject, and
/// have been since `published_by` or earlier: unread ones and ones waiting
/// in a batch published (and due, if delayed) by then (the lanes' windows up
/// to a cursor taken now, as [`log_subscription_stats`] reads them), and
/// exception rows pending since then. Events out under a lease are not counted, expired
/// or not (`health()` counts expired leases apart), nor delayed ones before
/// their time. 22004 for a NULL argument.
#[pg_extern(name = "_log_backlog", volatile, parallel_unsafe)]
pub fn log_backlog(subscription: Option<&str>, published_by: Option<TimestampWithTimeZone>) -> i64 {
    let need = |what: &str| -> ! { errors::raise(errors::NULL_VALUE, format!("{what} must not be NULL")) };
    let subscription = subscription.unwrap_or_else(|| need("subscription"));
    let by: i64 =
        published_by.unwrap_or_else(|| need("published_by")).into_datum().map(|d| d.value() as i64).unwrap_or(i64::MIN);
    let hi = cursor();
    let filter = crate::subscriptions::lookup(subscription).as_ref().and_then(own_filter);
    let mut n = 0i64;
    for l in lanes(subscription) {
        n += super::window_count(l.lane, &l.lo, &hi.snapshot, l.pos.unwrap_or(0), &filter, Some(by)).0;
        if let Some(Loaded { batch: b, .. }) = l.batch.and_then(load_batch) {
            let waiting: Vec<i64> =
                (0..b.len()).filter(|&i| b.state(i) == super::batch::State::Waiting).map(|i| b.ids()[i]).collect();
            if !waiting.is_empty() {
                n += plans::one::<i64>(&PUBLISHED_BY, &[l.lane.into(), waiting.into(), plans::ts_param(by)])
                    .unwrap_or(0);
            }
        }
    }
    n + plans::one::<i64>(&EXC_READY_SINCE, &[subscription.into(), plans::ts_param(by)]).unwrap_or(0)
}

/// `outbox._log_detach_subject(subscription text, subject text) -> integer`:
/// move the events of `subject` still in its lane's batch to the exception
/// table (waiting ones parked, ones out still leased to their holder), so that
/// a replayed earlier event of the subject goes before them. Waits for a claim
/// or ack holding the lane or the batch. Returns how many moved.
#[pg_extern(name = "_log_detach_subject", volatile, parallel_unsafe)]
pub fn log_detach_subject(subscription: Option<&str>, subject: Option<&str>) -> i32 {
    let (Some(subscription), Some(subject)) = (subscription, subject) else {
        return 0;
    };
    let lane = super::lane(0, Some(pg::hashtext(subject)));
    let Some(batch) = plans::run_latest(&LANE_LOCK, &[subscription.into(), lane.into()], |rows| {
        let mut out = None;
        rows.for_each(|r| out = r.i64(0));
        out
    }) else {
        return 0;
    };
    pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(batch));
    let Some(mut loaded) = load_locked(batch) else { return 0 };
    let ids = loaded.batch.ids().to_vec();
    let mine: Vec<i64> = plans::run_latest(&OF_SUBJECT, &[lane.into(), ids.into(), subject.into()], |rows| {
        let mut out = Vec::new();
        rows.for_each(|r| out.extend(r.i64(0)));
        out
    });
    let positions: Vec<usize> = mine.iter().filter_map(|id| loaded.batch.position(*id)).collect();
    if loaded.changed {
        put_loaded(batch, &mut loaded);
    }
    detach_positions(subscription, lane, batch, loaded, &positions)
}

/// Take the events at `positions` out of batch `batch` (`b`, lane `lane`,
/// its advisory lock held) into the exception table: waiting ones parked,
/// ones out still leased to their holder with the same token and expiry.
/// Returns how many moved.
pub(super) fn detach_positions(subscription: &str, lane: i16, batch: i64, loaded: Loaded, positions: &[usize]) -> i32 {
    let Loaded { batch: mut b, holders, .. } = loaded;
    let now = pg::now();
    let detached = b.detach(positions);
    if detached.is_empty() {
        return 0;
    }
    let mut rows: Vec<Moved> =
        detached.into_iter().map(|(i, round)| leave(batch, &b, i, round, &holders, now)).collect();
    rows.sort_unstable_by_key(|m| m.id);
    let settings = crate::subscriptions::lookup(subscription).unwrap_or_default();
    exceptions::insert(subscription, &settings, lane, &rows, None);
    store_batch(batch, &b);
    rows.len() as i32
}

/// Ack log events: each id with its token (batch rounds, exception rows).
/// Returns how many were acked; a stale or unknown token acks nothing.
pub fn ack(pairs: Vec<(i64, pgrx::Uuid)>) -> usize {
    let mut by_batch: BTreeMap<i64, Vec<(i64, pgrx::Uuid)>> = BTreeMap::new();
    let mut rows: Vec<(i64, pgrx::Uuid)> = Vec::new();
    for (id, token) in pairs {
        match super::batch::token_kind(token.as_bytes()) {
            TokenKind::Batch => {
                by_batch.entry(Token::from_bytes(*token.as_bytes()).batch).or_default().push((id, token))
            }
            _ => rows.push((id, token)),
        }
    }
    let mut acked = 0;
    if pg::in_transaction_block() {
        // Deferred to the commit (src/log/deferred.rs): no batch row or lock.
        for (batch, items) in by_batch {
            for (id, token) in items {
                match deferred::ack(batch, id, token) {
                    Some(_) => acked += 1,
                    None => rows.push((id, token)),
                }
            }
        }
        let (ids, tokens): (Vec<i64>, Vec<pgrx::Uuid>) = rows.into_iter().unzip();
        return acked + exceptions::ack(ids, tokens).len();
    }
    // Holds first (a transaction's deferred call on one of these events
    // commits before this reads it), then batches in id order: two acks of
    // overlapping batches take their locks in one order and cannot deadlock
    // on them. Then one read of them all, under a snapshot taken after the
    // last lock.
    deferred::wait_holds(by_batch.iter().flat_map(|(&b, items)| items.iter().map(move |(id, _)| (b, *id))).collect());
    let ids: Vec<i64> = by_batch.keys().copied().collect();
    for &batch in &ids {
        pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(batch));
    }
    let mut states = if ids.is_empty() { HashMap::new() } else { load_batches(ids) };
    let mut puts: (Vec<i64>, Vec<Vec<u8>>) = (Vec::new(), Vec::new());
    for (batch, items) in by_batch {
        let Some((mut b, folded)) = states.remove(&batch) else {
            rows.extend(items); // finished: a moved event may be in the exception table
            continue;
        };
        let before = acked;
        for (id, token) in items {
            match b.ack(id, Token::from_bytes(*token.as_bytes())) {
                Ok(()) => acked += 1,
                // Moved out when its lease expired: its row keeps the token.
                Err(_) => rows.push((id, token)),
            }
        }
        if acked == before && !folded {
            continue;
        }
        if b.finished() {
            store_batch(batch, &b);
        } else {
            puts.0.push(batch);
            puts.1.push(b.encode());
        }
    }
    if !puts.0.is_empty() {
        plans::run_latest(&BATCH_PUT_MANY, &[puts.0.into(), puts.1.into()], |_| ());
    }
    let (ids, tokens): (Vec<i64>, Vec<pgrx::Uuid>) = rows.into_iter().unzip();
    acked + exceptions::ack(ids, tokens).len()
}

/// fail() for a log token: the new state ('pending', 'dead'), or 'stale'.
pub fn fail(id: i64, token: pgrx::Uuid, error: &str, retry_in: Option<i64>, permanent: bool) -> &'static str {
    if super::batch::token_kind(token.as_bytes()) == TokenKind::Batch {
        let t = Token::from_bytes(*token.as_bytes());
        if pg::in_transaction_block() {
            if let Some(state) = deferred::fail(t.batch, id, token, error, retry_in, permanent) {
                return state;
            }
        } else {
            deferred::wait_holds(vec![(t.batch, id)]);
            pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(t.batch));
            if let Some(mut l) = load_locked(t.batch) {
                let state = fail_in_batch(t.batch, &mut l, id, t, error, retry_in, permanent, pg::now());
                if l.changed {
                    put_loaded(t.batch, &mut l);
                }
                if let Some(state) = state {
                    return state;
                }
            }
        }
    }
    exceptions::fail(id, token, error, retry_in, permanent).unwrap_or("stale")
}

/// extend_lease for a log token: the lease's new expiry, or None when stale.
pub fn extend(id: i64, token: pgrx::Uuid, lease: Interval, lease_us: i64) -> Option<TimestampWithTimeZone> {
    if super::batch::token_kind(token.as_bytes()) == TokenKind::Batch {
        let t = Token::from_bytes(*token.as_bytes());
        if pg::in_transaction_block() {
            if let Some(at) = deferred::extend(t.batch, id, token, lease_us) {
                return Some(at);
            }
        } else {
            deferred::wait_holds(vec![(t.batch, id)]);
            pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(t.batch));
            if let Some(mut l) = load_locked(t.batch) {
                let expires = pg::now().saturating_add(lease_us);
                let d = deferred::Deferred {
                    id,
                    token: *token.as_bytes(),
                    call: deferred::Kind::Extend { lease_us },
                    at: pg::now(),
                };
                let extended = l.batch.position(id).is_some() && l.batch.holder(id, t).is_ok();
                if extended {
                    apply_deferred(t.batch, &mut l, &d);
                    put_loaded(t.batch, &mut l);
                    let round = l.batch.position(id).and_then(|i| l.batch.round_of(i));
                    return round
                        .and_then(|r| l.batch.round_expiry(r))
                        .map(pg::timestamptz)
                        .or(Some(pg::timestamptz(expires)));
                }
                if l.changed {
                    put_loaded(t.batch, &mut l);
                }
            }
        }
    }
    exceptions::extend(id, token, lease)
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;

    fn ev(id: i64, topic: &str, subject: Option<&str>) -> WindowEvent {
        WindowEvent { id, subject: subject.map(str::to_string), topic: topic.to_string(), deliver_at: None }
    }

    fn owed(e: &WindowEvent) -> bool {
        e.topic.starts_with("a.")
    }

    #[pg_test]
    fn a_piece_passes_other_topics_free_and_ends_at_k_staying() {
        let mut events: Vec<WindowEvent> = (1..=100).map(|i| ev(i, "b.x", None)).collect();
        events.push(ev(101, "a.x", None));
        events.push(ev(102, "a.x", None));
        // k = 1: the piece runs through the other topics to the first owed event.
        assert_eq!(piece_end(&events, owed, |_| false, |_| 0, 1, 0), (101, 0));
        assert_eq!(piece_end(&events, owed, |_| false, |_| 0, 2, 0), (102, 0));
    }

    #[pg_test]
    fn a_piece_caps_a_subject_that_stays_and_not_one_that_goes() {
        let events: Vec<WindowEvent> = (1..=40).map(|i| ev(i, "a.x", Some("s"))).collect();
        assert_eq!(piece_end(&events, owed, |_| false, |_| 0, 100, 0), (MAX_SUBJECT_EVENTS, 0));
        // Diverted (its subject continues in the exception table): no cap, the budget counts.
        assert_eq!(piece_end(&events, owed, |_| true, |_| 0, 100, 1024), (40, 40));
        assert_eq!(piece_end(&events, owed, |_| true, |_| 0, 100, 25), (25, 25));
        // A spent budget ends the piece before its first diverted event.
        assert_eq!(piece_end(&events, owed, |_| true, |_| 0, 100, 0), (0, 0));
    }

    #[pg_test]
    fn a_diverted_subject_takes_its_later_events_along() {
        // s's second event is delayed: every later event of s goes too, and counts.
        let events =
            vec![ev(1, "a.x", Some("s")), ev(2, "a.x", Some("s")), ev(3, "a.x", Some("s")), ev(4, "a.x", None)];
        assert_eq!(piece_end(&events, owed, |e| e.id == 2, |_| 0, 10, 2), (4, 2));
        assert_eq!(piece_end(&events, owed, |e| e.id == 2, |_| 0, 10, 1), (2, 1));
    }
}
