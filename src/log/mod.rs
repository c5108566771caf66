//! The event log: the append-only ring of `outbox.log_0` .. `outbox.log_3`
//! (sql/log.sql) that every subscription reads in commit order ([`claim`],
//! [`exceptions`]). publish appends every event here and nowhere else.
//!
//! # Invariants, and why they hold
//! 1. **A log row exists iff its publish committed.** It is inserted in the
//!    publishing (sub)transaction by the same heap insert an INSERT statement
//!    ends in ([`crate::pg::heap`]); a rollback, or a rollback to a savepoint,
//!    undoes it. A dispatch key that names an
//!    existing event writes neither.
//! 2. **A transaction's id is assigned before any of its events' ids is drawn,**
//!    and the row's `txid` is that top-level id. publish and publish_batch call
//!    [`crate::pg::xid_for_insert`] after the subject locks and before
//!    `nextval` (src/publish.rs). So when a reader reads the largest drawn id
//!    `m` and then the next transaction id `xn`, every transaction that drew an
//!    id `<= m` has a txid below `xn`: the bound of the design's late-committer
//!    probe.
//! 3. **A subject's events share one lane;** lanes are what a reader orders by.
//!    [`lane`] is `hashtext(subject) & 15` (the hash the subject lock already
//!    takes, [`crate::subject`]); events without a subject go to lanes in runs
//!    of [`RUN`] ids, so one lane's window reads adjacent heap pages.
//! 4. **Retention queues nobody behind its lock for more than 20 ms, and
//!    truncates nothing a reader needs.** A ring table is emptied by TRUNCATE
//!    only after its ACCESS EXCLUSIVE lock came within `lock_timeout` (20 ms,
//!    `outbox._log_rotate`'s own setting); a table some transaction still uses is
//!    left for the next run. Under that lock (no event can be added) it checks
//!    that every reader's lane cursors see all of the table's events and that no
//!    row was written after the seal, and it runs only at READ COMMITTED, so
//!    those checks see every committed row. The lock lasts until the step's
//!    transaction commits, so a call truncates one table and returns; its
//!    callers ([`crate::maintenance`], `outbox.run_maintenance()`) commit before
//!    they call again, and claims never wait behind the checks of the next
//!    table. A subscription whose create_subscription has not committed has
//!    lanes no check sees yet: it holds every ring table (ACCESS SHARE) until
//!    then, so their TRUNCATE waits out its 20 ms and leaves them.
//!
//! # Reading in commit order
//! A reader's cursor is `(S, m, xn)` ([`cursor`]): a snapshot `S` taken now (at
//! every isolation level), then `m`, the largest event id drawn so far, then
//! `xn`, the next transaction id. The window of lane `l` between a cursor
//! `(S, m, xn)` and a later snapshot `S'` is defined as the lane's events whose
//! transaction is visible in `S'` and not in `S`; [`window`] finds them through
//! two index-driven branches instead of scanning the lane:
//! - (a) ids above `m`;
//! - (b) ids at most `m` whose txid is in `xip(S)` or in `[xmax(S), xn)`.
//!
//! Branch (b) probes the `(txid, lane)` index only for the ids of `xip(S)`
//! and of `[xmax(S), xn)` that `S'` sees committed: the definition asks
//! that of every row it accepts, so nothing is lost, and a transaction still
//! open costs the branch nothing however many events it holds. Branch (a)
//! reads index entries above `m`, visible or not; a claim that finds a
//! lane's window empty while many ids were drawn past its cursor moves the
//! cursor anyway (src/log/claim.rs, `FAR_BEHIND`), so an open bulk publisher
//! is passed once, not by every claim.
//!
//! A snapshot does not list its own transaction as running (its writes are
//! visible to it); a cursor taken by a transaction that has an id lists it
//! ([`with_running`]), so "visible in `S`" always means committed when `S` was
//! taken.
//!
//! **The branches miss nothing.** Let E (id `i`, transaction T) be visible in
//! `S'` and not in `S`. If `i > m`, (a) has it. Otherwise `i` was drawn before
//! `m` was read, so (invariant 2) T had its id before that, hence before `xn`
//! was read: `txid < xn`. T is not visible in `S`, so either `txid >= xmax(S)`
//! or T was running when `S` was taken, i.e. in `xip(S)` (it committed later, as
//! E exists and is visible in `S'`). Either way (b) has it.
//!
//! **Consecutive windows deliver each committed event exactly once.** Let a
//! lane's cursors `S0, S1, ...` be taken one after another, each snapshot newer
//! than the last (so each sees every transaction the previous one saw). A
//! committed event not visible in `S0` is visible from some first `Sk+1` on:
//! it is in window `(Sk, Sk+1]` and, by the definition, in no other (earlier
//! windows' upper snapshots do not see it, later windows' lower ones do). Per
//! subject, ids are in commit order (the subject lock, src/publish.rs) and a
//! subject lives in one lane, so reading a lane's windows in turn, each in id
//! order, reads a subject in commit order: an event of a later window committed
//! after every event of the earlier ones. The query runs under a snapshot taken
//! after `S'` ([`plans::run_latest`]), so it sees every row `S'` accepts.
//!
//! A rolled-back or aborted subtransaction leaves no row to find; an event of a
//! prepared transaction waits in `xip` until COMMIT PREPARED, like any running
//! one; `txid` is the top-level id, the one snapshots list.
//!
//! Which table is written is a backend's cached copy of `outbox.log_state`
//! ([`crate::pg::GenerationCache`]). It can be older than a rotation within a
//! transaction that already held its locks when the rotation committed, so
//! that transaction may append to the table just sealed; that is harmless,
//! since retention restarts for a table written after its seal, and readers
//! read all four tables.

pub mod batch;
pub mod cancel;
pub mod claim;
pub mod deferred;
pub mod due;
pub mod exceptions;
pub mod restore;
pub mod views;

use crate::errors;
use crate::pg;
use crate::pg::fcall::param;
use crate::pg::heap::{self, LogRow};
use crate::pg::plans;
use crate::sql::log::{APPEND_ONE, CURRENT, CURSOR, ROTATE, WINDOW, WINDOW_COUNT};
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

/// Lanes per subscription: a reader orders events within a lane.
pub const LANES: i16 = 16;
/// Consecutive ids without a subject that share a lane.
pub const RUN: i64 = 64;

/// The lane of event `id`, given its subject's `hashtext` (None: no subject).
pub fn lane(id: i64, subject_hash: Option<i32>) -> i16 {
    match subject_hash {
        Some(h) => (h & (LANES as i32 - 1)) as i16,
        None => ((id / RUN) % LANES as i64) as i16,
    }
}

thread_local! {
    /// The ring table publishers append to, valid for the relcache generation it
    /// was read under.
    static CURRENT_TABLE: pg::GenerationCache<usize> = const { pg::GenerationCache::new(c"log_state") };
}

/// The open ring table, as committed now (a snapshot taken now: the copy is
/// kept for later transactions, [`pg::GenerationCache`]).
fn current() -> usize {
    let load = || {
        plans::run_latest(&CURRENT, &[], |rows| {
            let mut n = 0;
            rows.for_each(|r| n = r.i16(0).map_or(0, |v| v.clamp(0, 3) as usize));
            n
        })
    };
    CURRENT_TABLE.with(|c| c.with(load, |n| *n))
}

/// Append `rows` to the current ring table, in the caller's transaction. The
/// caller has checked [`enabled`].
pub fn append(rows: &[LogRow<'_>]) {
    let table = current();
    if heap::append_log(table, rows) {
        return;
    }
    for r in rows {
        let args: [DatumWithOid<'_>; 10] = [
            r.id.into(),
            // SAFETY: xid8 is a by-value 64-bit type; every value is a valid datum.
            unsafe { DatumWithOid::new(pg_sys::Datum::from(r.txid), pg_sys::XID8OID) },
            r.lane.into(),
            r.topic.into(),
            r.subject.into(),
            r.dispatch_key.into(),
            r.payload.param(),
            param(r.headers, pg_sys::JSONBOID),
            r.max_attempts.into(),
            param(r.deliver_at, pg_sys::TIMESTAMPTZOID),
        ];
        plans::run(&APPEND_ONE[table], &args, |_| ());
    }
}

/// One call of the maintenance step `log` (`outbox._log_rotate`): truncate one
/// sealed table past retention, or else rotate the open one, at READ
/// COMMITTED when the transaction has not taken a snapshot yet. Returns the
/// tables truncated, 0 or 1; after a 1 the caller commits, which releases the
/// table's lock, and calls again (invariant 4).
pub fn rotate() -> i64 {
    // Its checks must see every committed row (invariant 4): the background
    // worker's step transaction starts here, so it can run at READ COMMITTED
    // whatever default_transaction_isolation says. Elsewhere the SQL function
    // does nothing at another level.
    pg::read_committed_if_fresh();
    let tables: Option<i32> = plans::one(&ROTATE, &[]);
    tables.unwrap_or(0) as i64
}

/// A reader's position in the log: see the module docs.
#[derive(Clone, Debug)]
pub struct Cursor {
    /// `pg_snapshot` in its text form (`xmin:xmax:xip,...`).
    pub snapshot: String,
    /// The largest event id drawn when the snapshot was taken, read after it.
    pub m: i64,
    /// The next full transaction id, read after `m`.
    pub xn: u64,
}

/// A cursor taken now (module docs: the order of the three reads matters).
///
/// A snapshot leaves the taking transaction's own id out of its in-progress
/// list (its own writes are visible to it), so a cursor taken in a transaction
/// that has an id would count that transaction's events as seen before it
/// commits; they would then be in no window. The id is therefore put into the
/// cursor's in-progress list: the transaction's events are read by the first
/// window whose upper cursor is taken after it commits.
pub fn cursor() -> Cursor {
    let (snapshot, m) = plans::run_latest(&CURSOR, &[], |rows| {
        let mut out = (String::new(), 0);
        rows.for_each(|r| out = (r.text(0).unwrap_or_default(), r.raw_i64(1)));
        out
    });
    let snapshot = match pg::top_full_xid_if_any() {
        Some(own) => with_running(&snapshot, own),
        None => snapshot,
    };
    Cursor { snapshot, m, xn: pg::next_xid() }
}

/// `snapshot` (`pg_snapshot` text, `xmin:xmax:xip,...`) with the running
/// transaction `xid` counted as not visible. At or above `xmax` it is already;
/// below, it goes into the in-progress list. (Raising `xmax` instead would be
/// wrong: every other id between the old and the new bound, running when the
/// snapshot was taken and not listed, would turn visible.)
pub fn with_running(snapshot: &str, xid: u64) -> String {
    let mut parts = snapshot.splitn(3, ':');
    let (Some(xmin), Some(xmax), Some(xip)) = (parts.next(), parts.next(), parts.next()) else {
        errors::raise(errors::INTERNAL, format!("malformed snapshot {snapshot:?}"));
    };
    let parse = |s: &str| s.parse::<u64>().unwrap_or_else(|_| errors::raise(errors::INTERNAL, "malformed snapshot"));
    let (xmin, xmax) = (parse(xmin), parse(xmax));
    if xid >= xmax {
        return snapshot.to_string();
    }
    let mut running: Vec<u64> = xip.split(',').filter(|s| !s.is_empty()).map(parse).collect();
    running.push(xid);
    running.sort_unstable();
    running.dedup();
    let list: Vec<String> = running.iter().map(u64::to_string).collect();
    format!("{}:{}:{}", xmin.min(xid), xmax, list.join(","))
}

/// One event of a lane's window, with what a claim decides on.
#[derive(Clone, Debug)]
pub struct WindowEvent {
    pub id: i64,
    pub subject: Option<String>,
    pub topic: String,
    /// `deliver_at` in µs, when the event has one.
    pub deliver_at: Option<i64>,
}

/// The events of lane `lane`'s window between `lo` and the snapshot `hi`,
/// above `after`, at most `limit` (None: all), in id order.
pub fn window(lane: i16, lo: &Cursor, hi: &str, after: i64, limit: Option<i32>) -> Vec<WindowEvent> {
    let xn = lo.xn.to_string();
    let args: [DatumWithOid<'_>; 7] = [
        lane.into(),
        lo.snapshot.as_str().into(),
        lo.m.into(),
        xn.as_str().into(),
        hi.into(),
        after.into(),
        limit.into(),
    ];
    plans::run_latest(&WINDOW, &args, |rows| {
        let mut out = Vec::with_capacity(rows.len());
        rows.for_each(|r| {
            out.push(WindowEvent {
                id: r.raw_i64(0),
                subject: r.text(1),
                topic: r.text(2).unwrap_or_default(),
                deliver_at: r.timestamptz(3),
            })
        });
        out
    })
}

/// How many events of lane `lane` are between `lo` and the snapshot `hi`
/// above `after`, and the smallest id among them; with `filter` (exact
/// topics, prefixes), only events whose topic it passes; with
/// `published_by` (TimestampTz µs), only events available by then (published,
/// and due if delayed).
pub fn window_count(
    lane: i16,
    lo: &Cursor,
    hi: &str,
    after: i64,
    filter: &Option<(Vec<String>, Vec<String>)>,
    published_by: Option<i64>,
) -> (i64, Option<i64>) {
    let xn = lo.xn.to_string();
    let (exact, prefixes) = match filter {
        Some((e, p)) => (Some(e.clone()), Some(p.clone())),
        None => (None, None),
    };
    let args: [DatumWithOid<'_>; 10] = [
        lane.into(),
        lo.snapshot.as_str().into(),
        lo.m.into(),
        xn.as_str().into(),
        hi.into(),
        after.into(),
        None::<i32>.into(),
        exact.into(),
        prefixes.into(),
        published_by.map(pg::timestamptz).into(),
    ];
    plans::run_latest(&WINDOW_COUNT, &args, |rows| {
        let mut out = (0, None);
        rows.for_each(|r| out = (r.i64(0).unwrap_or(0), r.i64(1)));
        out
    })
}

/// `outbox._log_cursor_parts() -> (snap text, m bigint, xn bigint)`: [`cursor`],
/// for `outbox._log_cursor()`, which casts the parts to their types.
#[pg_extern(name = "_log_cursor_parts", volatile, parallel_unsafe)]
pub fn log_cursor_parts() -> TableIterator<'static, (name!(snap, String), name!(m, i64), name!(xn, i64))> {
    let c = cursor();
    TableIterator::once((c.snapshot, c.m, c.xn as i64))
}

/// `outbox._log_window_ids(lane, lo_snap, lo_m, lo_xn, hi_snap, after, max_events)`:
/// [`window`], for `outbox._log_window()`. 22023 for a lane outside 0..15, a
/// negative limit; 22004 for a NULL cursor part.
#[pg_extern(name = "_log_window_ids", volatile, parallel_unsafe)]
pub fn log_window_ids(
    lane: Option<i16>,
    lo_snap: Option<&str>,
    lo_m: Option<i64>,
    lo_xn: Option<&str>,
    hi_snap: Option<&str>,
    after: Option<i64>,
    max_events: Option<i32>,
) -> SetOfIterator<'static, i64> {
    let need = |what: &str| -> ! { errors::raise(errors::NULL_VALUE, format!("{what} must not be NULL")) };
    let lane = lane.unwrap_or_else(|| need("lane"));
    if !(0..LANES).contains(&lane) {
        errors::raise(errors::INVALID_PARAMETER, format!("lane must be between 0 and {}, not {lane}", LANES - 1));
    }
    if max_events.is_some_and(|n| n < 0) {
        errors::raise(errors::INVALID_PARAMETER, "max_events must not be negative");
    }
    let xn: u64 = lo_xn
        .unwrap_or_else(|| need("lo_xn"))
        .parse()
        .unwrap_or_else(|_| errors::raise(errors::INVALID_PARAMETER, "lo_xn must be a transaction id"));
    let lo = Cursor {
        snapshot: lo_snap.unwrap_or_else(|| need("lo_snap")).to_string(),
        m: lo_m.unwrap_or_else(|| need("lo_m")),
        xn,
    };
    let hi = hi_snap.unwrap_or_else(|| need("hi_snap"));
    SetOfIterator::new(window(lane, &lo, hi, after.unwrap_or(0), max_events).into_iter().map(|e| e.id))
}
