//! The exception table `outbox.log_exceptions`: per-event state of the log's
//! subscriptions, kept only for the events that need one (sql/log.sql).
//!
//! An event acked from its batch on the first try never has a row here. An
//! event gets one when it leaves its batch (src/log/batch.rs, "Parking"):
//! it failed, its batch lease expired, it is delayed (`deliver_at`), or a claim
//! narrowed by topics did not take it; every other event of its subject that
//! was in the batch after it (or, for a delayed or narrowed event, every event
//! of its subject in the batch) comes with it. Claims take rows from here before
//! they read their lanes.
//!
//! # Invariants, and why they hold
//! 1. **Per-subject order.** A row is claimable only when no row of its
//!    subscription, lane and subject with a smaller id holds the subject
//!    (pending, leased, or dead under the 'block' policy). A subject's events
//!    reach this table in id order: its earlier events of the same batch come
//!    with it or are done ([`super::batch::Batch`] hands out a subject's events
//!    one at a time and parks the later ones with a leaving event), and a new
//!    batch of the lane sends every event of a subject that has a holding row
//!    here ([`open_subjects`]). That check reads the table under a snapshot
//!    taken after the lane's previous batch was seen finished, and a batch
//!    finishes in the transaction that moves its last events here, so every row
//!    moved out of an earlier batch is seen.
//! 2. **Fencing.** A row's lease is its `lease_token`: a claim gives each row
//!    a new one of its own (version 8, kind 1, the md5 of a fresh
//!    [`super::batch::exception_token`] and the row's id), fail()
//!    clears it, so an ack, fail or extension with any earlier token matches
//!    nothing. A row moved here because its batch lease expired keeps the
//!    batch's token until a claim hands it out again: an expired lease can
//!    still be acked until it is claimed again.
//! 3. **Claims never wait.** Candidate rows are taken with `_lock_row`
//!    ([`crate::pg::try_lock_row`]).
//! 4. **A dead letter follows the policy its topic has when it commits.**
//!    A row of the log turns dead in two places: fail(), and a claim that
//!    finds an expired lease on the last attempt (a row moved out of its
//!    batch by that same claim included). Both hold the topic's dead-letter
//!    policy lock in share mode ([`POLICY_LOCK_KEY`], `hashtext(topic)`, a
//!    transaction-level advisory lock) from before they read the policy until
//!    they commit, and read it under a snapshot taken after the lock: fail()
//!    takes the lock, then runs [`EXC_FAIL_APPLY`] or [`EXC_INSERT`] under
//!    `run_latest`; a claim takes it inside [`EXC_CLAIM`] and, for the rows it
//!    turned dead, reads the policy again in a statement of its own
//!    ([`EXC_DEAD_POLICY`]). A policy change ([`apply_dead_letter_policy`])
//!    takes the lock exclusively after it has written the topic's new policy,
//!    then rewrites the topic's dead rows under a snapshot taken after the
//!    lock. So of a dead transition and a policy change, whichever takes the
//!    lock second runs after the other has committed and sees it: the
//!    transition reads the new policy, or the rewrite sees the new dead row.
//!    fail() waits for the lock ([`lock_topic_of`], [`fail`]), and takes it
//!    only when it turns the event dead under the topic's policy; a claim
//!    never waits (invariant 3): it tries the lock for each row it would turn
//!    dead and leaves the row for a later claim when a policy change holds
//!    it. A policy change waits for the fails and claims that turned one of
//!    its topic's rows dead until they end. The rewrite touches dead rows
//!    only, so it never waits for the row a fail() holds; it does wait for a
//!    transaction that holds a dead row's lock (cancel, replay), and if that
//!    transaction then turns another event of the topic dead, the two
//!    deadlock and PostgreSQL fails one of them with 40P01. The policy change
//!    runs here ([`apply_dead_letter_policy`]), beside the fails and claims
//!    whose lock it takes.
//! 5. **Piles cost a claim O(1) each, and hide nothing claimable.** A row
//!    written with a subject records in `parked_behind` the subject's first
//!    row here that holds it (pending, leased, or dead under 'block'), else
//!    the subject's first event of the same insert ([`EXC_INSERT`]): always a
//!    row of the same subscription, lane and subject with a smaller id. A
//!    claim ([`EXC_CLAIM`], and `CLAIM_LANES`' probe) reads such a row only while
//!    that head no longer holds the subject, and then only the pile's first
//!    unfinished row. Why that hides nothing: while the head holds the
//!    subject, it is an earlier row that holds it, so invariant 1's test
//!    refuses every row of the pile; once it does not, every pile row after
//!    the first unfinished one follows that one, pending or leased, and is
//!    refused too. The test is made against the head's state in the claim's
//!    own snapshot, so no write needs to keep `parked_behind` up to date:
//!    a replay, cancel, purge, retention's delete or a policy change to
//!    'skip' releases the pile by changing the head alone. A claim walks the
//!    distinct heads (one index probe each) instead of the parked rows, so
//!    20,000 events behind one dead letter cost it two probes
//!    (test_plans.py, `test_claim_work_does_not_grow_with_the_events_behind_a_dead_letter`).

use crate::pg::fcall::{Call, SetResult};
use crate::pg::plans;
use crate::sql::log::{
    BATCH_EXISTS, EXC_ACK, EXC_APPLY_POLICY, EXC_CLAIM, EXC_DEAD_POLICY, EXC_EVENT_TOPIC, EXC_EXTEND, EXC_FAIL_APPLY,
    EXC_FAIL_LOCK, EXC_INSERT, EXC_OPEN_SUBJECTS, LOG_EVENT_TOPIC, NOTE_LOST, SUB_HAS_MAX_LAG,
};
use crate::subscriptions::Settings;
use crate::{errors, pg};
use pgrx::datum::{DatumWithOid, Interval, TimestampWithTimeZone};
use pgrx::pg_sys;
use std::collections::HashSet;

/// Why an event leaves its batch for the exception table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Behind another event of its subject, delayed, or outside a narrowed
    /// claim's topics: pending, no attempt yet.
    Parked,
    /// Still leased to its holder (same token, expiry `visible_at`), moved
    /// out of a batch that its slow handler would otherwise hold.
    Leased,
    /// fail() with attempts left: pending from its retry time.
    Retry,
    /// fail() for good, or on its last attempt.
    Dead,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Parked => "parked",
            Kind::Leased => "leased",
            Kind::Retry => "retry",
            Kind::Dead => "dead",
        }
    }
}

/// One event moving out of a batch.
pub struct Moved {
    pub id: i64,
    pub kind: Kind,
    /// When it may be claimed again (µs; its `deliver_at` if later).
    pub visible_at: i64,
    /// The batch token an expired event keeps.
    pub token: Option<pgrx::Uuid>,
    /// The failure, for `Retry` and `Dead`.
    pub error: Option<String>,
    /// The worker that held it in the batch (its round's), when it was out.
    pub worker: Option<String>,
}

impl Moved {
    /// An event parked behind another of its subject (or delayed, or outside
    /// the claim's topics): claimable from `now`, no attempt yet.
    pub fn parked(id: i64, now: i64) -> Moved {
        Moved { id, kind: Kind::Parked, visible_at: now, token: None, error: None, worker: None }
    }
}

/// Copy the events `moved` of lane `lane` from the log into subscription
/// `subscription`'s exception rows. With `batch`, only while that batch row
/// exists (its key locked until commit): None when it is gone, because
/// drop_subscription removed it (which then waits for this transaction before
/// it removes the rows, so none outlives the subscription). Else the ids of
/// the events the log no longer holds.
///
/// Every id came from the lane's window and retention waits for readers, so
/// the log holds them, except where a subscription's `max_lag` let retention
/// pass it: then the missing events are lost to it, and those that were out
/// or failed are counted in its `lost_events` now (the log step counted the
/// waiting ones: `outbox._log_note_losses`). Without `max_lag` a missing
/// event is a broken invariant, not a race: XX000.
pub fn insert(
    subscription: &str,
    settings: &Settings,
    lane: i16,
    moved: &[Moved],
    batch: Option<i64>,
) -> Option<Vec<i64>> {
    if moved.is_empty() {
        return Some(Vec::new());
    }
    let ids: Vec<i64> = moved.iter().map(|m| m.id).collect();
    let kinds: Vec<&str> = moved.iter().map(|m| m.kind.as_str()).collect();
    let at: Vec<TimestampWithTimeZone> = moved.iter().map(|m| pg::timestamptz(m.visible_at)).collect();
    let tokens: Vec<Option<pgrx::Uuid>> = moved.iter().map(|m| m.token).collect();
    let errs: Vec<Option<&str>> = moved.iter().map(|m| m.error.as_deref()).collect();
    let workers: Vec<Option<&str>> = moved.iter().map(|m| m.worker.as_deref()).collect();
    let args: [DatumWithOid<'_>; 10] = [
        subscription.into(),
        lane.into(),
        ids.into(),
        kinds.into(),
        at.into(),
        tokens.into(),
        errs.into(),
        settings.dead_letter_policy.as_deref().into(),
        batch.into(),
        workers.into(),
    ];
    let placed: HashSet<i64> = plans::run_latest(&EXC_INSERT, &args, |rows| {
        let mut out = HashSet::new();
        rows.for_each(|r| out.extend(r.i64(0)));
        out
    });
    if placed.len() == moved.len() {
        return Some(Vec::new());
    }
    if placed.is_empty() && batch.is_some_and(|b| plans::run_latest(&BATCH_EXISTS, &[b.into()], |rows| rows.is_empty()))
    {
        return None;
    }
    let missing: Vec<&Moved> = moved.iter().filter(|m| !placed.contains(&m.id)).collect();
    if plans::run_latest(&SUB_HAS_MAX_LAG, &[subscription.into()], |rows| rows.is_empty()) {
        errors::raise(
            errors::INTERNAL,
            format!("{} of {} events to park are missing from the log", missing.len(), moved.len()),
        );
    }
    let lost = missing.iter().filter(|m| !matches!(m.kind, Kind::Parked)).count() as i64;
    if lost > 0 {
        plans::run_latest(&NOTE_LOST, &[subscription.into(), lost.into()], |_| ());
    }
    Some(missing.iter().map(|m| m.id).collect())
}

/// The subjects among `subjects` whose events must continue in the exception
/// table (a row of theirs holds them in lane `lane`).
pub fn open_subjects(subscription: &str, lane: i16, subjects: Vec<String>) -> HashSet<String> {
    if subjects.is_empty() {
        return HashSet::new();
    }
    plans::run_latest(&EXC_OPEN_SUBJECTS, &[subscription.into(), lane.into(), subjects.into()], |rows| {
        let mut out = HashSet::new();
        rows.for_each(|r| {
            if let Some(s) = r.text(0) {
                out.insert(s);
            }
        });
        out
    })
}

/// What one claim asks for.
pub struct Request<'a> {
    pub subscription: &'a str,
    pub settings: &'a Settings,
    pub worker: &'a str,
    /// The lease (µs): the call's, else the subscription's default, else the
    /// GUC's.
    pub lease_us: i64,
    /// Whether the call or the subscription set the lease; when neither did,
    /// an event whose topic sets a default_lease gets that one instead.
    pub lease_fixed: bool,
    /// The call's own topics (exact, prefixes); None: the subscription's.
    pub narrow: Option<(Vec<String>, Vec<String>)>,
}

/// Claim up to `left` exception rows into `out`; returns how many. A claim
/// calls it when its first statement found one that may be claimable
/// (src/sql/log.rs `CLAIM_LANES`), and again when it has just moved rows
/// here that are due now.
pub fn claim_due(req: &Request<'_>, now: i64, left: usize, out: &SetResult) -> usize {
    let token = pgrx::Uuid::from_bytes(super::batch::exception_token(pg::strong_random(), pg::strong_random()));
    let (exact, prefixes) = match &req.narrow {
        Some((e, p)) => (Some(e.clone()), Some(p.clone())),
        None => (None, None),
    };
    let args: [DatumWithOid<'_>; 12] = [
        req.subscription.into(),
        plans::ts_param(now),
        (left as i32).into(),
        token.into(),
        Interval::from_micros(req.lease_us).into(),
        exact.into(),
        prefixes.into(),
        req.worker.into(),
        req.settings.max_attempts.into(),
        req.settings.dead_letter_policy.as_deref().into(),
        req.lease_fixed.into(),
        Interval::from_micros(crate::gucs::max_lease_us()).into(),
    ];
    let mut dead = Vec::new();
    let n = plans::run_latest(&EXC_CLAIM, &args, |rows| {
        let mut n = 0;
        rows.for_each(|r| {
            if r.bool(10).unwrap_or(false) {
                out.put_row(r);
                n += 1;
            } else if let Some(id) = r.i64(0) {
                dead.push(id);
            }
        });
        n
    });
    super::deferred::forward_stalled();
    if !dead.is_empty() && req.settings.dead_letter_policy.is_none() {
        // The claim holds these rows' topics' policy locks now: a snapshot
        // taken after them sees any policy change that took the lock first.
        plans::run_latest(&EXC_DEAD_POLICY, &[req.subscription.into(), dead.into()], |_| ());
    }
    n
}

/// Run a change of exception rows found by their token. Each statement reads
/// under a snapshot taken now ([`plans::run_latest`]), but one that waits for
/// a concurrent claim of the row (which gives it a new token) still raises
/// 40001 at REPEATABLE READ and SERIALIZABLE once that claim commits: the row
/// it found changed after its snapshot. There the change runs in a
/// subtransaction and, after such a failure, once more: its new snapshot sees
/// the claim, so a stale token matches nothing (ack false, fail 'stale',
/// extend NULL), as at READ COMMITTED, and a current one goes through.
fn by_token<R>(f: impl Fn() -> R) -> R {
    if !pg::uses_xact_snapshot() {
        return f();
    }
    pg::catching(crate::errors::SERIALIZATION_FAILURE, &f).unwrap_or_else(f)
}

/// Ack the exception rows among (`ids`, `tokens`); returns the ids acked. A
/// delivered row keeps the event's attempt history for `retention_delivered`
/// (the maintenance step `delivered`).
pub fn ack(ids: Vec<i64>, tokens: Vec<pgrx::Uuid>) -> Vec<i64> {
    if ids.is_empty() {
        return vec![];
    }
    by_token(|| {
        plans::run_latest(&EXC_ACK, &[ids.clone().into(), tokens.clone().into()], |rows| {
            let mut out = Vec::new();
            rows.for_each(|r| out.extend(r.i64(0)));
            out
        })
    })
}

/// fail() on the exception row `id` that `token` holds: Some(new state), or
/// None when the token holds no row.
pub fn fail(id: i64, token: pgrx::Uuid, error: &str, retry_in: Option<i64>, permanent: bool) -> Option<&'static str> {
    // Under a snapshot taken now (as every exception-row change here): a
    // stale token at REPEATABLE READ is 'stale', not a serialization failure.
    let row = by_token(|| {
        plans::run_latest(&EXC_FAIL_LOCK, &[id.into(), token.into()], |rows| {
            let mut out = None;
            rows.for_each(|r| {
                out = Some((
                    r.i32(0).unwrap_or(1).max(1),
                    r.i32(1).unwrap_or(1),
                    r.interval(2),
                    r.interval(3),
                    r.text(4).unwrap_or_default(),
                ))
            });
            out
        })
    })?;
    let (attempts, max_attempts, base, cap, sub) = row;
    let settings = crate::subscriptions::lookup(&sub).unwrap_or_default();
    let (state, delay) = settings.failure(attempts, max_attempts, base, cap, retry_in, permanent);
    if state == "dead" && settings.dead_letter_policy.is_none() {
        // Only a dead transition under the topic's policy needs its lock
        // (invariant 4); the row is ours already, and a policy change rewrites
        // dead rows only, so it never waits for this one.
        if let Some(topic) = plans::run_latest(&EXC_EVENT_TOPIC, &[id.into(), token.into()], first_text) {
            lock_policy_shared(&topic);
        }
    }
    let args: [DatumWithOid<'_>; 6] = [
        id.into(),
        token.into(),
        state.into(),
        Interval::from_micros(delay).into(),
        error.into(),
        settings.dead_letter_policy.as_deref().into(),
    ];
    plans::run_latest(&EXC_FAIL_APPLY, &args, |_| ());
    Some(state)
}

/// First key of a topic's dead-letter policy lock (invariant 4): "obtp".
/// The second is `hashtext(topic)`; two topics that share it only wait for
/// each other's policy changes.
pub const POLICY_LOCK_KEY: i32 = 0x6f62_7470;

/// Take topic `topic`'s dead-letter policy lock in share mode, waiting for a
/// policy change in progress to commit: what fail() holds while it turns an
/// event dead.
fn lock_policy_shared(topic: &str) {
    pg::advisory_xact_lock_shared(POLICY_LOCK_KEY, pg::hashtext(topic));
}

/// `outbox._try_policy_lock(topic text) -> boolean`: a claim's try of the
/// policy lock in share mode for a row it would turn dead (invariant 3: a
/// claim never waits), inside its own statement ([`EXC_CLAIM`]).
///
/// # Safety
/// Called by PostgreSQL through the v1 calling convention (declared STRICT).
pub unsafe fn try_policy_lock(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    // SAFETY: the frame of outbox._try_policy_lock(text) (sql/api.sql).
    let call = unsafe { Call::new(fcinfo) };
    let topic: String = call.arg(0).unwrap_or_default();
    pg_sys::Datum::from(pg::try_advisory_xact_lock_shared(POLICY_LOCK_KEY, pg::hashtext(&topic)))
}

/// The first column of the first row, as text.
fn first_text(rows: &plans::Rows) -> Option<String> {
    let mut out = None;
    rows.for_each(|r| {
        if out.is_none() {
            out = r.text(0);
        }
    });
    out
}

/// Take the dead-letter policy lock of the topic of batch event `id` (lane
/// `lane`) before fail() writes its dead letter (invariant 4).
pub fn lock_topic_of(lane: i16, id: i64) {
    if let Some(topic) = plans::run_latest(&LOG_EVENT_TOPIC, &[lane.into(), id.into()], first_text) {
        lock_policy_shared(&topic);
    }
}

/// `outbox._log_apply_dead_letter_policy(topic text, policy text) -> boolean`:
/// the log's part of `_apply_dead_letter_policy` (sql/admin.sql), run by
/// create_topic, alter_topic and drop_topic after they have written the
/// topic's new policy: takes the topic's policy lock exclusively (waiting for
/// the fails and claims that turned one of its rows dead to end), then the
/// dead letters of `topic` in subscriptions without a dead-letter policy of
/// their own take `policy` ('block' or 'skip') ([`EXC_APPLY_POLICY`];
/// invariant 4 above). Under a snapshot taken after the lock, once more after
/// a 40001 at REPEATABLE READ or SERIALIZABLE ([`by_token`]), so a dead letter
/// committed while it waited is seen at every isolation level.
/// True when a dead letter changed. 22004 for NULL, 22023 for another policy.
#[pgrx::pg_extern(name = "_log_apply_dead_letter_policy", volatile, parallel_unsafe)]
pub fn apply_dead_letter_policy(topic: Option<&str>, policy: Option<&str>) -> bool {
    let topic = topic.unwrap_or_else(|| errors::raise(errors::NULL_VALUE, "topic must not be NULL"));
    let policy = match policy {
        None => errors::raise(errors::NULL_VALUE, "policy must not be NULL"),
        Some(p @ ("block" | "skip")) => p,
        Some(other) => errors::raise(
            errors::INVALID_PARAMETER,
            format!("dead_letter_policy must be 'block' or 'skip', not {other:?}"),
        ),
    };
    pg::advisory_xact_lock(POLICY_LOCK_KEY, pg::hashtext(topic));
    by_token(|| {
        plans::run_latest(&EXC_APPLY_POLICY, &[topic.into(), policy.into()], |rows| {
            let mut n = 0i64;
            rows.for_each(|r| n = r.i64(0).unwrap_or(0));
            n > 0
        })
    })
}

/// extend_lease on the exception row `id` that `token` holds: the new expiry.
pub fn extend(id: i64, token: pgrx::Uuid, lease: Interval) -> Option<TimestampWithTimeZone> {
    by_token(|| {
        plans::run_latest(&EXC_EXTEND, &[id.into(), token.into(), lease.into()], |rows| {
            let mut out = None;
            rows.for_each(|r| out = r.timestamptz(0).map(pg::timestamptz));
            out
        })
    })
}
