//! Claims over the log for one subscription: lanes, windows and batches
//! (docs/design/subscriptions.md, "Claiming: lanes and batches").
//!
//! Internal in 0.8.0: `outbox._log_subscribe`, `outbox._log_claim` and
//! `outbox._log_ack` run the storage that `outbox.claim` will move onto, so it
//! can be checked against real commit orders (pg_test/py/test_log_claim.py) and
//! measured against PgQ (`bench/run`) first. Failures (the exception table),
//! lease extension, attempts, pauses and retention against readers come with the
//! slices that move the public API here.
//!
//! # A claim
//! For each lane of the subscription, starting at a rotating lane so workers
//! spread out, until it has `batch_size` events:
//! 1. take the lane row with `_lock_row` semantics ([`pg::try_lock_row`]: a lane
//!    another claim holds is skipped, never waited for);
//! 2. if the lane has a batch in flight, take the batch's lock without waiting
//!    ([`BATCH_LOCK_KEY`]) and hand out what the batch allows now
//!    ([`Batch::handable`]: waiting events whose subject's earlier event is
//!    acked, and events whose round's lease expired) as a new round;
//! 3. otherwise read the lane's window (src/log/mod.rs) from where the last
//!    batch ended, at most what the claim still needs, make it the lane's batch
//!    and hand out its first round. An open window that has no more events
//!    moves the lane's cursor to its end; a fresh window with no events writes
//!    nothing.
//!
//! # Invariants, and why they hold
//! 1. **Each committed event of a lane is put in exactly one batch.** A lane's
//!    batches take consecutive pieces (`id > pos`, in id order) of consecutive
//!    windows, and the cursor moves to a window's end only once a read past
//!    `pos` finds nothing; windows read each committed event once (src/log/mod.rs).
//!    Every lane write happens under the lane's row lock, and the row read is
//!    the newest version (a changed row is skipped, not locked), so two claims
//!    never extend one lane from the same position.
//! 2. **A lane has at most one unfinished batch,** and a new one starts only
//!    when the lane's batch is gone (an ack deletes a finished batch). With one
//!    event per subject out at a time inside a batch (src/log/batch.rs), a
//!    subject's events are handed out one after another in commit order.
//! 3. **Fencing.** A token names its batch, round and random part; an ack
//!    matches it against the batch's state under the batch lock, and an expired
//!    event handed out again is in a newer round. A stale token acks nothing.
//! 4. **No lost update of a batch.** Claims and acks change a batch only while
//!    holding its advisory lock (claims try it, acks wait for it), and read it
//!    under a snapshot taken after the lock: the version changed is the newest,
//!    at every isolation level, with no serialization failure from the row.

use super::batch::{Batch, Token};
use super::{cursor, window, Cursor};
use crate::errors;
use crate::pg;
use crate::pg::catalog::outbox_relid;
use crate::pg::fcall::{Call, SetResult};
use crate::pg::plans;
use crate::sql::log::{BATCH_DELETE, BATCH_GET, BATCH_ID, BATCH_NEW, BATCH_PUT, FETCH, LANES, LANE_PUT, SUBSCRIBE};
use crate::validate;
use pgrx::datum::{DatumWithOid, Interval};
use pgrx::prelude::*;
use std::cell::Cell;
use std::collections::BTreeMap;

/// First key of the batch advisory locks (0x6f62746c = "obtl"); the second is
/// the batch id's low 32 bits (two batches that share them only serialise).
pub const BATCH_LOCK_KEY: i32 = 0x6f62_746c;

fn batch_lock_key(id: i64) -> i32 {
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
}

fn cursor_at(snap: Option<String>, m: Option<i64>, xn: Option<String>) -> Option<Cursor> {
    Some(Cursor { snapshot: snap?, m: m?, xn: xn?.parse().ok()? })
}

fn lanes(subscription: &str) -> Vec<Lane> {
    plans::run_latest(&LANES, &[subscription.into()], |rows| {
        let mut out = Vec::with_capacity(rows.len());
        rows.for_each(|r| {
            let (Some(tid), Some(lane), Some(lo)) = (r.tid(0), r.i16(1), cursor_at(r.text(2), r.i64(3), r.text(4)))
            else {
                errors::raise(errors::INTERNAL, "malformed outbox.log_lanes row");
            };
            out.push(Lane {
                tid,
                lane,
                lo,
                hi: cursor_at(r.text(5), r.i64(6), r.text(7)),
                pos: r.i64(8),
                batch: r.i64(9),
            });
        });
        out
    })
}

fn put_lane(subscription: &str, l: &Lane) {
    let xn = |c: &Cursor| c.xn.to_string();
    let (lo_xn, hi_xn) = (xn(&l.lo), l.hi.as_ref().map(xn));
    let args: [DatumWithOid<'_>; 10] = [
        subscription.into(),
        l.lane.into(),
        l.lo.snapshot.as_str().into(),
        l.lo.m.into(),
        lo_xn.as_str().into(),
        l.hi.as_ref().map(|h| h.snapshot.as_str()).into(),
        l.hi.as_ref().map(|h| h.m).into(),
        hi_xn.as_deref().into(),
        l.pos.into(),
        l.batch.into(),
    ];
    plans::run_latest(&LANE_PUT, &args, |_| ());
}

/// The batch `id`'s state, read after its lock was taken; None when an ack has
/// finished and deleted it.
fn load_batch(id: i64) -> Option<Batch> {
    let bytes = plans::run_latest(&BATCH_GET, &[id.into()], |rows| {
        let mut out = None;
        rows.for_each(|r| out = r.bytes(1));
        out
    })?;
    Some(Batch::decode(&bytes).unwrap_or_else(|e| {
        errors::raise(PgSqlErrorCode::ERRCODE_DATA_CORRUPTED, format!("outbox.log_batches row {id}: {e}"))
    }))
}

fn store_batch(id: i64, b: &Batch) {
    if b.finished() {
        plans::run_latest(&BATCH_DELETE, &[id.into()], |_| ());
    } else {
        plans::run_latest(&BATCH_PUT, &[id.into(), b.encode().into()], |_| ());
    }
}

/// What one claim call is handing out.
struct Claim<'a> {
    subscription: &'a str,
    now: i64,
    expires: i64,
    out: &'a SetResult,
}

impl Claim<'_> {
    /// Return the events at `picks` of `batch` (lane `lane`) with `token`.
    fn emit(&self, lane: i16, batch: &Batch, picks: &[usize], token: Token) {
        let ids: Vec<i64> = picks.iter().map(|&p| batch.ids()[p]).collect();
        let uuid = pgrx::Uuid::from_bytes(token.to_bytes());
        let args = [lane.into(), ids.into(), uuid.into(), plans::ts_param(self.expires)];
        plans::run_latest(&FETCH, &args, |rows| rows.for_each(|r| self.out.put_row(r)));
    }

    /// Hand out up to `left` events of lane `l` (its row held); returns how many.
    fn serve(&self, mut l: Lane, left: usize) -> usize {
        let mut dirty = false;
        if let Some(id) = l.batch {
            if !pg::try_advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(id)) {
                return 0; // an ack is changing it: the next claim serves it
            }
            match load_batch(id) {
                Some(mut b) => {
                    let picks: Vec<usize> = b.handable(self.now).into_iter().take(left).collect();
                    if picks.is_empty() {
                        return 0;
                    }
                    let token = b.hand_out(id, &picks, self.now, self.expires, pg::strong_random());
                    store_batch(id, &b);
                    self.emit(l.lane, &b, &picks, token);
                    return picks.len();
                }
                None => {
                    l.batch = None;
                    dirty = true;
                }
            }
        }
        // No batch in flight: the next piece of the open window, or a new window.
        for _ in 0..2 {
            let (hi, fresh) = match &l.hi {
                Some(h) => (h.clone(), false),
                None => (cursor(), true),
            };
            let events = window(l.lane, &l.lo, &hi.snapshot, l.pos.unwrap_or(0), Some(left as i32));
            if events.is_empty() {
                if fresh {
                    break; // nothing new; the cursor stays (an empty window writes nothing)
                }
                // The open window is read to its end: the lane moves there.
                l.lo = hi;
                l.hi = None;
                l.pos = None;
                dirty = true;
                continue;
            }
            let mut b = Batch::new(&events);
            let picks: Vec<usize> = b.handable(self.now).into_iter().take(left).collect();
            let id = plans::one::<i64>(&BATCH_ID, &[])
                .unwrap_or_else(|| errors::raise(errors::INTERNAL, "nextval returned no batch id"));
            // A new batch id: nobody else can hold its lock.
            pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(id));
            let token = b.hand_out(id, &picks, self.now, self.expires, pg::strong_random());
            let args = [id.into(), self.subscription.into(), l.lane.into(), b.encode().into()];
            plans::run_latest(&BATCH_NEW, &args, |_| ());
            l.pos = events.last().map(|e| e.0);
            l.hi = Some(hi);
            l.batch = Some(id);
            put_lane(self.subscription, &l);
            self.emit(l.lane, &b, &picks, token);
            return picks.len();
        }
        if dirty {
            put_lane(self.subscription, &l);
        }
        0
    }
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

/// `outbox._log_claim(subscription text, batch_size integer, lease interval)
/// -> TABLE(id, topic, subject, payload, headers, lease_token, lease_expires_at)`.
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention.
pub unsafe fn log_claim(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox._log_claim(text, integer, interval) (sql/log.sql).
    let call = unsafe { Call::new(fcinfo) };
    let subscription: String = call.required(0, "subscription");
    let batch_size: i32 = call.required(1, "batch_size");
    validate::batch_size(batch_size as i64);
    let lease: Interval = call.required(2, "lease");
    let lease_us = validate::lease_us("lease", &lease);
    let relid = require_relid(c"log_lanes");
    let now = pg::now();
    let lanes = lanes(&subscription);
    if lanes.is_empty() {
        errors::raise_hint(
            errors::UNDEFINED_OBJECT,
            format!("subscription '{subscription}' has no lanes in the log"),
            "Create them with outbox._log_subscribe().",
        );
    }
    let out = SetResult::begin(&call);
    let claim = Claim { subscription: &subscription, now, expires: now.saturating_add(lease_us), out: &out };
    let start = start_lane();
    let mut order: Vec<Lane> = lanes;
    order.sort_by_key(|l| (l.lane as usize + super::LANES as usize - start) % super::LANES as usize);
    let mut left = batch_size as usize;
    for l in order {
        if left == 0 {
            break;
        }
        if pg::try_lock_row(relid, l.tid) != pg::RowLock::Locked {
            continue;
        }
        left -= claim.serve(l, left);
    }
    call.finish_set()
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
    let xn = c.xn.to_string();
    let args: [DatumWithOid<'_>; 4] = [subscription.into(), c.snapshot.as_str().into(), c.m.into(), xn.as_str().into()];
    plans::run_latest(&SUBSCRIBE, &args, |rows| rows.len()) > 0
}

/// `outbox._log_ack(ids bigint[], tokens uuid[]) -> integer`: ack each event
/// held by its token; returns how many were acked (a stale or unknown token
/// acks nothing). 22004 for NULL arrays or elements, 22023 for arrays of
/// different lengths.
#[pg_extern(name = "_log_ack", volatile, parallel_unsafe)]
pub fn log_ack(ids: Option<Vec<Option<i64>>>, tokens: Option<Vec<Option<pgrx::Uuid>>>) -> i32 {
    let (Some(ids), Some(tokens)) = (ids, tokens) else {
        errors::raise(errors::NULL_VALUE, "ids and tokens must not be NULL");
    };
    if ids.len() != tokens.len() {
        errors::raise(
            errors::INVALID_PARAMETER,
            format!("ids has {} elements but tokens has {}", ids.len(), tokens.len()),
        );
    }
    validate::batch_size(ids.len().max(1) as i64);
    let mut by_batch: BTreeMap<i64, Vec<(i64, Token)>> = BTreeMap::new();
    for (id, token) in ids.into_iter().zip(tokens) {
        let (Some(id), Some(token)) = (id, token) else {
            errors::raise(errors::NULL_VALUE, "ids and tokens must not contain NULL");
        };
        let t = Token::from_bytes(*token.as_bytes());
        by_batch.entry(t.batch).or_default().push((id, t));
    }
    let mut acked = 0;
    // Batches in id order: two acks of overlapping batches take their locks in
    // one order and cannot deadlock on them.
    for (batch, items) in by_batch {
        pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(batch));
        let Some(mut b) = load_batch(batch) else { continue };
        let before = acked;
        for (id, t) in items {
            acked += b.ack(id, t).is_ok() as i32;
        }
        if acked > before {
            store_batch(batch, &b);
        }
    }
    acked
}

/// `outbox._log_extend(id bigint, token uuid, lease interval) -> timestamptz`:
/// extend the lease of the round `token` names to now + `lease` (never
/// shortening it), if `token` still holds event `id`; returns the round's lease
/// expiry, or NULL for a stale or unknown token. 22004 for NULL, 22023 for a
/// lease outside (0, outbox.max_lease].
#[pg_extern(name = "_log_extend", volatile, parallel_unsafe)]
pub fn log_extend(
    id: Option<i64>,
    token: Option<pgrx::Uuid>,
    lease: Option<Interval>,
) -> Option<pgrx::datum::TimestampWithTimeZone> {
    let (Some(id), Some(token), Some(lease)) = (id, token, lease) else {
        errors::raise(errors::NULL_VALUE, "id, token and lease must not be NULL");
    };
    let lease_us = validate::lease_us("lease", &lease);
    let t = Token::from_bytes(*token.as_bytes());
    pg::advisory_xact_lock(BATCH_LOCK_KEY, batch_lock_key(t.batch));
    let mut b = load_batch(t.batch)?;
    let expires = pg::now().saturating_add(lease_us);
    b.extend(id, t, expires).ok()?;
    store_batch(t.batch, &b);
    b.round_expiry(t.round).map(pg::timestamptz)
}
