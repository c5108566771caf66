//! The claim low-water mark: where claim() starts its index scan.
//!
//! claim() walks `event_queue_ready_idx` in (visible_at, id) order from the lowest
//! key. Every claimed and acked event leaves dead index entries behind until VACUUM
//! removes them, and they sit exactly where that walk starts. When autovacuum is
//! behind, or when an open snapshot (a REPEATABLE READ report, an idle session in a
//! transaction) holds the xmin horizon so that VACUUM may remove nothing and btree
//! may not even mark the entries killed, every claim re-reads all of them and their
//! heap tuples (PgQ sidesteps the same cost by rotating its event tables; bench 6a
//! and 6b measure it).
//!
//! So claim() starts at a low-water mark W, a key (visible_at, id) below which no
//! live event of the claim index is, now or later. Entries below W are never read
//! again, however many there are.
//!
//! "Or later" is the hard part, because an event can enter the index with an old
//! visible_at: a publish in a transaction that began long ago (visible_at = now(),
//! the transaction's start), the next event of a subject promoted to head, a retry
//! or a replay. Two mechanisms make it hold:
//!
//! 1. The publish floor F, one shared timestamp that only rises. Every write that
//!    puts an event into the claim index first has its transaction id assigned, then
//!    reads F, and stores visible_at > F (F + 1 µs when it would be lower). F trails
//!    the clock, so this never delays an event; it only stops one from sorting
//!    before events that were already claimable.
//! 2. W advances in two steps, which claims take at most every [`STEP_INTERVAL_US`]:
//!    - A: V := min(first live key, (clock, 0)); F := max(F, V.t); then N := the
//!      next transaction id.
//!    - B: once a snapshot S has xmin >= N (every transaction with an xid below N
//!      has ended), V' := the first live key in S, and W := max(W, min(V, V')).
//!
//! Why B is safe: a row version live after B is either visible in S, so its key is
//! at least V' >= W, or was written by a transaction with an xid >= N. That xid was
//! assigned after N was read, so after F had risen to V.t; the writer read F after
//! getting its xid and stored visible_at > V.t: a key above V >= W. A transaction
//! that holds an xid for long (not a read-only snapshot) only stalls step B.
//!
//! Both steps read "the first live key" from the stepping claim's own snapshot,
//! so that snapshot must show committed state only. A transaction that has already
//! written (cancelled or acked an event, claimed before) sees its own uncommitted
//! versions, which a rollback (or ROLLBACK TO SAVEPOINT) undoes: the committed
//! version could then sort below a mark computed past it. So a claim
//! takes steps only while its transaction has no xid, i.e. has written nothing;
//! claims in such transactions use the mark as it stands.
//!
//! The clock: F trails the clock, so F more than `CLOCK_SLACK_US` ahead of it
//! means the clock was set back. Every write that reads F checks this, and every
//! step before it can stall, and then starts all marks over and lowers F to the
//! clock; otherwise writes would store visible_at as far ahead as the clock went
//! back, and a stalled step B (a forgotten prepared transaction) would keep it so.
//!
//! Writes that bypass the outbox functions (a data-only restore into a live table,
//! a manual INSERT) could land below W. The maintenance run looks for such rows and
//! resets W when it finds one ([`audit`]); TRUNCATE, VACUUM FULL and a re-created
//! table change the relation's file node, which resets W too. Without
//! `shared_preload_libraries` there is no shared memory: F and W stay at -infinity
//! and claims scan from the start of the index, as before.

use crate::pg;
use crate::pg::catalog::{self, TableLock};
use crate::pg::plans::{self, ts_param};
use crate::sql::lowwater::{BELOW, HAS_FLOOR_SQL, PROBE};
use crate::{errors, gucs};
use pgrx::atomics::PgAtomic;
use pgrx::lwlock::PgLwLock;
use pgrx::prelude::*;
use pgrx::shmem::*;
use std::sync::atomic::{fence, AtomicI64, Ordering};

/// TimestampTz -infinity: no floor, no low-water mark.
pub const NONE: i64 = i64::MIN;
/// The key below every key: claims scan from the start of the index.
pub const START: (i64, i64) = (NONE, i64::MIN);
/// A floor this far above the clock means the clock was set back: start over.
const CLOCK_SLACK_US: i64 = 1_000_000;
/// Least time between two steps of one table's low-water mark, in microseconds.
/// A step costs one or two index probes; between steps a claim re-reads at most
/// the entries of the events claimed since the last step.
pub const STEP_INTERVAL_US: i64 = 10_000;
/// Databases (event_queue relations) tracked at once; beyond that, databases take
/// each other's slots and their marks restart.
const SLOTS: usize = 64;

/// The publish floor F (TimestampTz, microseconds since 2000-01-01).
pub struct Floor {
    pub t: AtomicI64,
}

impl Default for Floor {
    fn default() -> Self {
        Floor { t: AtomicI64::new(NONE) }
    }
}

// SAFETY: plain data (one atomic, no pointers): its bytes mean the same in
// every process that maps the segment.
unsafe impl PGRXSharedMemory for Floor {}

/// The shared publish floor (exists only when preloaded).
// SAFETY: pgrx's contract for a shared-memory static: one unique name, and
// registered with pg_shmem_init! in `_PG_init` ([`init`]) before any use.
pub static FLOOR: PgAtomic<Floor> = unsafe { PgAtomic::new(c"outbox_publish_floor") };

/// Low-water state of one database's `outbox.event_queue`.
#[derive(Copy, Clone)]
pub struct Slot {
    pub db: u32,
    pub rel: u32,
    /// pg_class.relfilenode when the mark was computed.
    pub node: u32,
    /// W as (visible_at, id); START when unknown.
    pub w: (i64, i64),
    /// Step A's (V.t, V.id, N), waiting for step B.
    pub pending: Option<(i64, i64, u64)>,
    /// When the last step started (GetCurrentTimestamp).
    pub last_step: i64,
    /// Bumped by every change, so a step applies only to the state it started from.
    pub generation: u64,
    /// Times the audit found a row below W and reset it.
    pub resets: u64,
}

impl Slot {
    fn key(&self) -> (u32, u32, u32) {
        (self.db, self.rel, self.node)
    }
}

impl Default for Slot {
    fn default() -> Self {
        Slot { db: 0, rel: 0, node: 0, w: START, pending: None, last_step: NONE, generation: 0, resets: 0 }
    }
}

/// Every tracked table's low-water state.
#[derive(Copy, Clone)]
pub struct Marks {
    pub slots: [Slot; SLOTS],
}

impl Default for Marks {
    fn default() -> Self {
        Marks { slots: [Slot::default(); SLOTS] }
    }
}

// SAFETY: plain Copy data, no pointers: its bytes mean the same in every
// process that maps the segment.
unsafe impl PGRXSharedMemory for Marks {}

/// The shared low-water marks (exist only when preloaded).
// SAFETY: pgrx's contract for a shared-memory static: one unique name, and
// registered with pg_shmem_init! in `_PG_init` ([`init`]) before any use.
pub static MARKS: PgLwLock<Marks> = unsafe { PgLwLock::new(c"outbox_low_water") };

/// Register the shared memory. Called from `_PG_init`.
pub fn init(preloaded: bool) {
    if preloaded {
        pgrx::pg_shmem_init!(FLOOR);
        pgrx::pg_shmem_init!(MARKS);
    }
}

fn above(f: i64) -> i64 {
    if f == NONE {
        NONE
    } else {
        f + 1
    }
}

/// The floor as it stands now, plus 1 µs (NONE without preload). Only valid for a
/// write whose transaction id is already assigned: see [`floor_after_xid`].
///
/// A floor more than `CLOCK_SLACK_US` ahead of the clock means the clock was set
/// back: every write would then store a visible_at that far in the future, so the
/// writer starts the marks over first (`clock_went_back`). Checked here, on every
/// write, and not only by claims' steps, because a stalled step B (a forgotten
/// prepared transaction) stops the steps.
pub fn floor_now() -> i64 {
    if !gucs::preloaded() {
        return NONE;
    }
    fence(Ordering::SeqCst);
    let f = FLOOR.get().t.load(Ordering::SeqCst);
    if f != NONE {
        let now = pg::now();
        if clock_went_back(f, now) {
            return above(FLOOR.get().t.load(Ordering::SeqCst));
        }
    }
    above(f)
}

/// When floor `f` is more than [`CLOCK_SLACK_US`] ahead of `now`: forget every mark
/// (no W then depends on the floor, and pending steps are dropped by their
/// generation), lower the floor to `now`, and return true.
fn clock_went_back(f: i64, now: i64) -> bool {
    if f == NONE || f.saturating_sub(now) <= CLOCK_SLACK_US {
        return false;
    }
    {
        let mut m = MARKS.exclusive();
        reset_all(&mut m);
        FLOOR.get().t.store(now, Ordering::SeqCst);
    }
    warning!("outbox: the clock went back; the claim low-water marks start over");
    true
}

/// The least visible_at (TimestampTz µs) the current transaction may store for an
/// event that enters the claim index: the publish floor F plus 1 µs, or NONE (-infinity).
///
/// Assigns the transaction id first, as the module's proof requires. In a
/// read-only transaction it assigns nothing and returns NONE: the write that
/// follows fails with 25006 anyway.
pub fn floor_after_xid() -> i64 {
    if !gucs::preloaded() || pg::read_only() {
        return NONE;
    }
    pg::assign_xid();
    floor_now()
}

/// `outbox._visible_floor() -> timestamptz`: [`floor_after_xid`] for the PL/pgSQL
/// paths (replay). Assigns the caller's transaction id. -infinity without preload.
#[pg_extern(name = "_visible_floor", volatile, parallel_unsafe)]
fn visible_floor() -> TimestampWithTimeZone {
    pg::timestamptz(floor_after_xid())
}

/// `outbox._claim_low_water() -> TABLE(publish_floor timestamptz, low_water_at
/// timestamptz, low_water_id bigint, step_pending boolean, resets bigint)`: this
/// database's state, for tests and monitoring. -infinity / 0 when unknown.
#[pg_extern(name = "_claim_low_water", volatile, parallel_safe)]
fn claim_low_water() -> TableIterator<
    'static,
    (
        name!(publish_floor, TimestampWithTimeZone),
        name!(low_water_at, TimestampWithTimeZone),
        name!(low_water_id, i64),
        name!(step_pending, bool),
        name!(resets, i64),
    ),
> {
    let ts = pg::timestamptz;
    let (f, slot) = match (gucs::preloaded(), queue_identity(TableLock::AccessShare)) {
        (true, Some((rel, node))) => {
            let db = pg::database_id();
            let m = MARKS.share();
            (FLOOR.get().t.load(Ordering::SeqCst), m.slots.iter().find(|s| s.key() == (db, rel, node)).copied())
        }
        (true, None) => (FLOOR.get().t.load(Ordering::SeqCst), None),
        _ => (NONE, None),
    };
    let s = slot.unwrap_or_default();
    TableIterator::once((ts(f), ts(s.w.0), s.w.1, s.pending.is_some(), s.resets as i64))
}

/// OID and file node of `outbox.event_queue`, locked as claim() will lock it
/// (RowExclusive) or as readers do (monitoring, the audit: AccessShare).
fn queue_identity(lock: TableLock) -> Option<(u32, u32)> {
    let relid = catalog::outbox_relid(c"event_queue")?;
    Some((relid.to_u32(), catalog::relfilenode(relid, lock)))
}

struct Probe {
    xmin: u64,
    first: Option<(i64, i64)>,
    clock: i64,
}

fn probe(from: (i64, i64)) -> Probe {
    plans::run(&PROBE, &[ts_param(from.0), from.1.into()], |t| {
        let row = t.first();
        let xmin: i64 = errors::spi(row.get::<i64>(1)).unwrap_or(0);
        let raw = |n: usize| -> Option<i64> {
            errors::spi(row.get::<TimestampWithTimeZone>(n))
                .map(|ts| ts.into_datum().map(|d| d.value() as i64).unwrap_or(NONE))
        };
        let first = match (raw(2), errors::spi(row.get::<i64>(3))) {
            (Some(v), Some(id)) => Some((v, id)),
            _ => None,
        };
        Probe { xmin: xmin as u64, first, clock: raw(4).unwrap_or(NONE) }
    })
}

thread_local! {
    /// (event_queue OID, when checked, SQL has the floor): see [`sql_ready`].
    static SQL_READY: std::cell::Cell<(u32, i64, bool)> = const { std::cell::Cell::new((0, NONE, false)) };
}

/// Whether the installed SQL applies the floor everywhere (0.3.0 and later). Until
/// `ALTER EXTENSION outbox_ext UPDATE` has run, the new library may serve 0.2.0's
/// replay functions, which write visible_at without the floor: no mark then.
/// Re-checked at most once a second until true, per table.
fn sql_ready(rel: u32, now: i64) -> bool {
    let (r, at, ok) = SQL_READY.with(|c| c.get());
    if r == rel && (ok || now.saturating_sub(at) < 1_000_000) {
        return ok;
    }
    let ok = plans::one::<bool>(&HAS_FLOOR_SQL, &[]).unwrap_or(false);
    SQL_READY.with(|c| c.set((rel, now, ok)));
    ok
}

/// Forget every mark (the clock was set back past the floor); see [`step`].
fn reset_all(m: &mut Marks) {
    for s in m.slots.iter_mut() {
        s.w = START;
        s.pending = None;
        s.generation += 1;
    }
}

/// Where this claim starts its scan: W for this database's event_queue, or
/// [`START`]. Takes a step of the mark first when one is due (module docs).
///
/// Steps are taken only by READ COMMITTED claims: step B needs a snapshot newer
/// than its transaction, and a serializable claim should not take predicate
/// locks for them. Claims at other levels use the mark as it stands.
///
/// # Errors
/// Only those of its probe statements (e.g. a statement timeout), as for claim.
pub fn claim_start() -> (i64, i64) {
    // A read-only transaction (or a standby) gets 25006 from the claim itself.
    if !gucs::preloaded() || pg::read_only() {
        return START;
    }
    let Some((rel, node)) = queue_identity(TableLock::RowExclusive) else {
        return START;
    };
    let db = pg::database_id();
    let now = pg::now();
    // Steps read the first live key in this transaction's snapshot. Once the
    // transaction has written (a cancel, an ack, an earlier claim), that snapshot
    // shows its own uncommitted changes, which a rollback would undo: a mark
    // computed from them could pass a committed event. So only a
    // transaction that has no xid yet takes steps.
    let steps = !pg::uses_xact_snapshot() && !pg::xid_assigned();
    // A clock set back makes now < last_step: a step is due then.
    let due = |s: &Slot| steps && (now < s.last_step || now.saturating_sub(s.last_step) >= STEP_INTERVAL_US);
    {
        let m = MARKS.share();
        let found = m.slots.iter().find(|s| s.key() == (db, rel, node));
        match found {
            Some(s) if !due(s) => return s.w,
            None if !steps => return START,
            _ => {}
        }
    }
    if !sql_ready(rel, now) {
        return START;
    }
    // A step is due: take it, unless another claim just did.
    let (i, generation, w, pending) = {
        let mut m = MARKS.exclusive();
        let i = match m.slots.iter().position(|s| s.key() == (db, rel, node)) {
            Some(i) => i,
            None => {
                // The table is new to us (or was truncated or re-created): drop
                // this database's old slots, then take a free slot, else the one
                // stepped least recently.
                for s in m.slots.iter_mut().filter(|s| s.db == db) {
                    *s = Slot { generation: s.generation + 1, ..Slot::default() };
                }
                let (i, _) = m.slots.iter().enumerate().min_by_key(|(_, s)| (s.db != 0, s.last_step)).unwrap();
                let s = &mut m.slots[i];
                *s = Slot { db, rel, node, generation: s.generation + 1, ..Slot::default() };
                i
            }
        };
        let s = &mut m.slots[i];
        if !due(s) {
            return s.w;
        }
        s.last_step = now;
        (i, s.generation, s.w, s.pending)
    };
    step(i, generation, w, pending, (db, rel, node))
}

fn step(
    i: usize,
    mut generation: u64,
    mut w: (i64, i64),
    pending: Option<(i64, i64, u64)>,
    id: (u32, u32, u32),
) -> (i64, i64) {
    let same = |s: &Slot| s.key() == id;
    // Before anything else, so a stalled step B cannot hide a clock set back.
    if clock_went_back(FLOOR.get().t.load(Ordering::SeqCst), pg::now()) {
        return START;
    }
    if let Some((vt, vid, n)) = pending {
        // Step B.
        let p = probe(w);
        if p.xmin < n {
            // A transaction that may have read the old floor is still running.
            return w;
        }
        let cand = match p.first {
            Some(f) if f < (vt, vid) => f,
            _ => (vt, vid),
        };
        let mut m = MARKS.exclusive();
        let s = &mut m.slots[i];
        if !same(s) || s.generation != generation {
            return if same(s) { s.w } else { START };
        }
        if cand > s.w {
            s.w = cand;
        }
        s.pending = None;
        s.generation += 1;
        generation = s.generation;
        w = s.w;
    }
    // Step A.
    let p = probe(w);
    let clock_key = (p.clock, 0);
    let v = match p.first {
        Some(f) if f < clock_key => f,
        _ => clock_key,
    };
    let floor = FLOOR.get();
    if clock_went_back(floor.t.load(Ordering::SeqCst), p.clock) {
        return START;
    }
    floor.t.fetch_max(v.0, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    let n = pg::next_xid();
    let mut m = MARKS.exclusive();
    let s = &mut m.slots[i];
    if same(s) && s.generation == generation {
        s.pending = Some((v.0, v.1, n));
        s.generation += 1;
    }
    w
}

/// `outbox._audit_low_water() -> boolean`: [`audit`] for the calling database, for
/// `outbox.run_maintenance()` (pg_cron) and operators. True when it reset the mark.
#[pg_extern(name = "_audit_low_water", volatile, parallel_unsafe)]
fn audit_low_water() -> bool {
    audit()
}

/// Check that no live event of this database's claim index lies below W, and
/// forget W (claims scan from the start again until the next steps) if one does.
/// Run by the maintenance worker. Returns true when it reset the mark.
///
/// W is read before the statement takes its snapshot: every row that snapshot
/// sees live was either live when W was computed or written after, both above W,
/// unless it bypassed the outbox functions.
pub fn audit() -> bool {
    if !gucs::preloaded() {
        return false;
    }
    let db = pg::database_id();
    let Some((rel, node)) = queue_identity(TableLock::AccessShare) else {
        return false;
    };
    let found = {
        let m = MARKS.share();
        m.slots.iter().find(|s| s.key() == (db, rel, node) && s.w != START).map(|s| s.w)
    };
    let Some(w) = found else {
        return false;
    };
    let below = plans::one::<bool>(&BELOW, &[ts_param(w.0), w.1.into()]).unwrap_or(false);
    if !below {
        return false;
    }
    let mut m = MARKS.exclusive();
    if let Some(s) = m.slots.iter_mut().find(|s| s.key() == (db, rel, node)) {
        s.w = START;
        s.pending = None;
        s.generation += 1;
        s.resets += 1;
    }
    log!("outbox: found events below the claim low-water mark (written outside the outbox functions?); claims scan from the start again");
    true
}
