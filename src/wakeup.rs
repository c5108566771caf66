//! Wake-ups: tell `LISTEN outbox` workers that a topic has new claimable events,
//! without putting NOTIFY on the publishers' commit path.
//!
//! PostgreSQL serialises the commits of every transaction that issued NOTIFY (a
//! database-wide lock in PreCommit_Notify). So in the default `'background'` mode
//! publish() only remembers the topic in backend memory; a transaction callback
//! copies the topics into shared memory after the commit is visible and sets the
//! background worker's latch; the worker sends one coalesced NOTIFY per topic from
//! its own transaction, so no publisher ever takes that lock. Rolled-back
//! transactions and savepoints drop their topics, so they never notify.
//!
//! `'transaction'` mode queues the NOTIFY in the publishing transaction (PostgreSQL
//! sends it at commit, drops it on rollback, and deduplicates identical
//! notifications). `'off'` sends nothing. Notifications are hints: workers must
//! also poll (see README, "Wake-ups").

use crate::gucs::{self, NotifyMode};
use crate::pg::{self, SharedLatch};
use pgrx::atomics::PgAtomic;
use pgrx::lwlock::PgLwLock;
use pgrx::prelude::*;
use pgrx::shmem::*;
use std::cell::{Cell, RefCell};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The LISTEN channel.
pub const CHANNEL: &str = "outbox";
/// Distinct topics buffered in shared memory between two worker passes; beyond
/// this the worker falls back to "every topic with ready events".
pub const SHARED_TOPICS: usize = 64;
/// Longest topic name (bytes).
const TOPIC_BYTES: usize = 255;
/// Prepared transactions tracked until they commit or abort.
pub const SHARED_PREPARED: usize = 32;

/// Shared state between publishing backends and the background worker.
#[derive(Copy, Clone)]
pub struct WakeShared {
    /// The worker's process latch, or none when no worker is running.
    pub latch: SharedLatch,
    /// Database the running worker serves.
    pub database: u32,
    /// PID of the running worker.
    pub pid: i32,
    /// Topics committed since the worker's last pass.
    pub ntopics: usize,
    pub lens: [u8; SHARED_TOPICS],
    pub topics: [[u8; TOPIC_BYTES]; SHARED_TOPICS],
    /// More topics than fit, or a wake for "any topic": scan for ready topics.
    pub overflow: bool,
    /// A delayed event or retry was scheduled: recompute the next due time.
    pub recheck_due: bool,
    /// Top-level xids of prepared transactions that published.
    pub nprepared: usize,
    pub prepared: [u32; SHARED_PREPARED],
    /// Passes the worker has completed (for tests and monitoring).
    pub passes: u64,
    /// Bumped for each prepared transaction that published but did not fit in
    /// `prepared`: the worker then watches `pg_prepared_xacts` itself.
    pub untracked_prepared: u64,
}

impl Default for WakeShared {
    fn default() -> Self {
        WakeShared {
            latch: SharedLatch::NONE,
            database: 0,
            pid: 0,
            ntopics: 0,
            lens: [0; SHARED_TOPICS],
            topics: [[0; TOPIC_BYTES]; SHARED_TOPICS],
            overflow: false,
            recheck_due: false,
            nprepared: 0,
            prepared: [0; SHARED_PREPARED],
            passes: 0,
            untracked_prepared: 0,
        }
    }
}

// SAFETY: plain Copy data; its one address (the latch) points into shared
// memory, mapped at the same address in every process.
unsafe impl PGRXSharedMemory for WakeShared {}

/// The shared wake-up state (exists only when preloaded).
// SAFETY: pgrx's contract for a shared-memory static: one unique name, and
// registered with pg_shmem_init! in `_PG_init` ([`init`]) before any use.
pub static WAKE: PgLwLock<WakeShared> = unsafe { PgLwLock::new(c"outbox_wakeup") };

/// A lock-free view of the pending topic set, read at every publishing commit.
///
/// At thousands of commits per second nearly every commit publishes to a topic
/// that is already waiting for the worker's next pass. Such a commit needs neither
/// the `WAKE` lock nor the latch: whoever added the topic set the latch, and the
/// worker's next pass (which starts after this commit is visible) notifies it.
/// Taking `WAKE` exclusively at every commit made 16 publishers queue on it.
///
/// Protocol (a sequence lock): a publisher adding a topic under `WAKE` stores
/// its hash, then `ntopics` (release). The worker, under `WAKE`, zeroes `ntopics`
/// and then bumps `generation` *before* it takes the set. A reader loads `generation`, scans
/// `hashes[..ntopics]`, and trusts a hit only if `generation` is unchanged
/// afterwards; otherwise it takes the locked path. A 64-bit hash collision between
/// two topics pending in the same pass would skip one NOTIFY; workers poll anyway.
pub struct WakeFast {
    pub generation: AtomicU64,
    pub ntopics: AtomicU32,
    pub hashes: [AtomicU64; SHARED_TOPICS],
    /// Database the running worker serves (0: none), read by every publish().
    pub database: AtomicU32,
}

impl Default for WakeFast {
    fn default() -> Self {
        WakeFast {
            generation: AtomicU64::new(0),
            ntopics: AtomicU32::new(0),
            hashes: std::array::from_fn(|_| AtomicU64::new(0)),
            database: AtomicU32::new(0),
        }
    }
}

// SAFETY: atomics only, no pointers: their bytes mean the same in every
// process that maps the segment.
unsafe impl PGRXSharedMemory for WakeFast {}

/// The lock-free half of the wake-up state (exists only when preloaded).
// SAFETY: pgrx's contract for a shared-memory static: one unique name, and
// registered with pg_shmem_init! in `_PG_init` ([`init`]) before any use.
pub static FAST: PgAtomic<WakeFast> = unsafe { PgAtomic::new(c"outbox_wakeup_fast") };

fn topic_hash(topic: &[u8]) -> u64 {
    // DefaultHasher::new() has fixed keys: every backend loads the same library,
    // so every process computes the same hash.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    topic.hash(&mut h);
    h.finish()
}

/// True when `topic` is certainly in the pending set and the worker has not taken
/// the set since: the next pass will notify it.
fn already_pending(fast: &WakeFast, topic: &[u8]) -> bool {
    let h = topic_hash(topic);
    let before = fast.generation.load(Ordering::SeqCst);
    let n = (fast.ntopics.load(Ordering::Acquire) as usize).min(SHARED_TOPICS);
    let hit = fast.hashes[..n].iter().any(|x| x.load(Ordering::Acquire) == h);
    hit && fast.generation.load(Ordering::SeqCst) == before
}

/// Called by the worker, holding `WAKE` exclusively, before it takes the set.
pub fn begin_take(w: &mut WakeShared) {
    let fast = FAST.get();
    // Empty first, then bump: a reader that sees the new generation cannot also
    // see the old count, so a hit it trusts is a topic added after this take.
    fast.ntopics.store(0, Ordering::SeqCst);
    fast.generation.fetch_add(1, Ordering::SeqCst);
    w.ntopics = 0;
}

/// Record (or clear, with 0) the database the running worker serves.
pub fn set_worker_database(db: u32) {
    FAST.get().database.store(db, Ordering::SeqCst);
}

/// Topics noted by this backend's open transaction, tagged with the
/// subtransaction that published them.
struct Pending {
    topics: Vec<(pg_sys::SubTransactionId, String)>,
    any: Option<pg_sys::SubTransactionId>,
    due: bool,
}

thread_local! {
    static PENDING: RefCell<Pending> = const { RefCell::new(Pending { topics: Vec::new(), any: None, due: false }) };
    static WARNED: Cell<bool> = const { Cell::new(false) };
}

/// Register shared memory and the transaction callbacks. Called from `_PG_init`.
pub fn init(preloaded: bool) {
    if preloaded {
        pgrx::pg_shmem_init!(WAKE);
        pgrx::pg_shmem_init!(FAST);
    }
}

/// The mode in effect for this backend: 'background' needs the preloaded library
/// and a worker serving this database; otherwise it degrades to 'transaction'
/// (with one WARNING per session when the library is not preloaded).
pub fn effective_mode() -> NotifyMode {
    match gucs::notify_mode() {
        NotifyMode::Background if !gucs::preloaded() => {
            if !WARNED.with(|w| w.replace(true)) {
                warning!(
                    "outbox.notify = 'background' needs outbox_ext in shared_preload_libraries; using 'transaction' in this session"
                );
            }
            NotifyMode::Transaction
        }
        NotifyMode::Background => {
            let db = FAST.get().database.load(Ordering::Relaxed);
            if db != 0 && db != pg::database_id() {
                // The worker serves another database; a NOTIFY from it would not
                // reach listeners here.
                NotifyMode::Transaction
            } else {
                NotifyMode::Background
            }
        }
        m => m,
    }
}

/// Send NOTIFY outbox, topic (queued in the current transaction).
pub fn notify_now(topic: &str) {
    pg::notify(CHANNEL, topic);
}

/// Record that the current transaction published to `topic`. `deliver_at` is the
/// raw timestamptz argument, if any: a future time only needs the worker to
/// recompute its next due time.
pub fn note_publish(topic: &str, deliver_at: Option<pg_sys::Datum>) {
    let future = deliver_at.is_some_and(|d| (d.value() as i64) > pg::now());
    match effective_mode() {
        NotifyMode::Off => {}
        NotifyMode::Transaction => {
            if !future {
                notify_now(topic)
            }
        }
        NotifyMode::Background => {
            let sub = pg::subxact_id();
            PENDING.with(|p| {
                let mut p = p.borrow_mut();
                if future {
                    p.due = true;
                } else if !p.topics.iter().any(|(s, t)| *s == sub && t == topic) {
                    p.topics.push((sub, topic.to_string()));
                }
            });
        }
    }
}

/// Record that something other than a publish made events claimable or changed
/// the next due time (replay, cancel, fail with retry). `topic` None = any topic.
pub fn note_any(topic: Option<&str>) {
    match (effective_mode(), topic) {
        (NotifyMode::Off, _) => {}
        (NotifyMode::Transaction, Some(t)) => notify_now(t),
        (NotifyMode::Transaction, None) => {}
        (NotifyMode::Background, Some(t)) => note_publish(t, None),
        (NotifyMode::Background, None) => {
            let sub = pg::subxact_id();
            PENDING.with(|p| {
                let mut p = p.borrow_mut();
                p.any.get_or_insert(sub);
                p.due = true;
            });
        }
    }
}

/// Record that a retry or lease was scheduled: the worker's next due time changes.
pub fn note_due() {
    if effective_mode() == NotifyMode::Background {
        PENDING.with(|p| p.borrow_mut().due = true);
    }
}

fn take_pending() -> Option<Pending> {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if p.topics.is_empty() && p.any.is_none() && !p.due {
            return None;
        }
        Some(std::mem::replace(&mut *p, Pending { topics: Vec::new(), any: None, due: false }))
    })
}

/// Publish the committed transaction's topics to shared memory and wake the worker.
fn flush_committed(p: Pending) {
    let fast = FAST.get();
    if p.any.is_none() && !p.due && p.topics.iter().all(|(_, t)| already_pending(fast, t.as_bytes())) {
        return;
    }
    let latch = {
        let mut w = WAKE.exclusive();
        for (_, t) in &p.topics {
            let b = t.as_bytes();
            let known = (0..w.ntopics).any(|i| &w.topics[i][..w.lens[i] as usize] == b);
            if known {
                continue;
            }
            if w.ntopics >= SHARED_TOPICS || b.len() > TOPIC_BYTES {
                w.overflow = true;
            } else {
                let i = w.ntopics;
                w.topics[i][..b.len()].copy_from_slice(b);
                w.lens[i] = b.len() as u8;
                w.ntopics += 1;
                fast.hashes[i].store(topic_hash(b), Ordering::Release);
                fast.ntopics.store(w.ntopics as u32, Ordering::Release);
            }
        }
        if p.any.is_some() {
            w.overflow = true;
        }
        if p.due {
            w.recheck_due = true;
        }
        w.latch
    };
    latch.set();
}

/// Hand a preparing transaction's wake-up to the worker: it notifies once the
/// prepared transaction commits (COMMIT PREPARED may run in another session).
fn flush_prepared(p: Pending) {
    let xid = pg::top_xid_if_any();
    if p.topics.is_empty() && p.any.is_none() {
        return;
    }
    let latch = {
        let mut w = WAKE.exclusive();
        if xid != 0 && w.nprepared < SHARED_PREPARED {
            let i = w.nprepared;
            w.prepared[i] = xid;
            w.nprepared += 1;
        } else {
            // No room to track it: the worker watches pg_prepared_xacts until it
            // has seen no prepared transaction for a while, and sweeps every ready
            // topic whenever one of them is resolved (src/worker.rs).
            w.untracked_prepared += 1;
        }
        w.latch
    };
    latch.set();
}

/// Transaction end (src/xact.rs): hand the committed topics to the worker, or
/// drop them.
pub fn on_xact_event(event: pg_sys::XactEvent::Type) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT => {
            if let Some(p) = take_pending() {
                if gucs::preloaded() {
                    flush_committed(p);
                }
            }
        }
        XACT_EVENT_PRE_PREPARE => {
            if let Some(p) = take_pending() {
                if gucs::preloaded() {
                    flush_prepared(p);
                }
            }
        }
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => {
            take_pending();
        }
        _ => {}
    }
}

/// Subtransaction end (src/xact.rs): topics of an aborted savepoint are dropped,
/// those of a released one move to its parent.
pub fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    my: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
) {
    use pg_sys::SubXactEvent::*;
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        match event {
            SUBXACT_EVENT_ABORT_SUB => {
                p.topics.retain(|(s, _)| *s != my);
                if p.any == Some(my) {
                    p.any = None;
                }
            }
            SUBXACT_EVENT_COMMIT_SUB => {
                for (s, _) in p.topics.iter_mut() {
                    if *s == my {
                        *s = parent;
                    }
                }
                if p.any == Some(my) {
                    p.any = Some(parent);
                }
            }
            _ => {}
        }
    });
}

/// `outbox._wake(topic text)`: note a wake-up for `topic` (NULL = any topic) in the
/// current transaction, following outbox.notify. Used by replay() and cancel().
#[pg_extern(name = "_wake", volatile, parallel_unsafe)]
fn wake(topic: Option<&str>) {
    note_any(topic);
}

/// `outbox.wakeup_status()`: the background worker's shared state, for tests and
/// monitoring. Columns: worker_pid (0 when not running), database oid, passes
/// completed, topics waiting, prepared transactions tracked.
#[pg_extern(volatile)]
fn wakeup_status() -> TableIterator<
    'static,
    (
        name!(worker_pid, i32),
        name!(database, i64),
        name!(passes, i64),
        name!(topics_waiting, i32),
        name!(prepared_waiting, i32),
        name!(preloaded, bool),
    ),
> {
    if !gucs::preloaded() {
        return TableIterator::once((0, 0, 0, 0, 0, false));
    }
    let w = WAKE.share();
    TableIterator::once((w.pid, w.database as i64, w.passes as i64, w.ntopics as i32, w.nprepared as i32, true))
}
