//! The shared table of served databases: one slot per database that has a
//! background worker, holding that database's wake-up state, plus the launcher's
//! mailbox (announcements of `CREATE EXTENSION`, and pauses asked for by
//! statements that need a database to themselves).
//!
//! Everything here lives in shared memory and exists only when the library is
//! preloaded. [`WAKE`] (one LWLock) guards the slots; [`FAST`] mirrors, per slot,
//! what every publishing commit reads without the lock (the database the slot
//! serves and a sequence-locked set of pending topic hashes).
//!
//! # Invariants
//! 1. **One slot per database.** Only the launcher assigns and frees slots, under
//!    `WAKE`, and it assigns a slot to a database only when none holds it.
//! 2. **A slot's state belongs to one database.** Topics and prepared xids are
//!    added under `WAKE` only after checking that the slot still holds the
//!    publisher's database (`DbWake::db`); a freed slot is wiped when it is next
//!    assigned.
//! 3. **Nothing committed is left without a wake-up.** A commit either adds its
//!    topics to the slot of its database (whose worker notifies them in its next
//!    pass), or finds no slot, or a slot whose worker is exiting. In the last two
//!    cases the next worker for that database starts with `overflow` set and
//!    `untracked_prepared` bumped ([`assign`]): its first pass notifies every topic
//!    with ready events, and it watches the prepared transactions it finds, so the
//!    commit is announced then. If no worker ever serves the database again, the
//!    extension or the database is gone, or `outbox.databases` now excludes it
//!    (its publishers then notify themselves, see `wakeup::effective_mode`; a
//!    transaction that was open across that change loses its wake-up, and workers
//!    find its events by polling).
//! 4. **Capacity.** [`MAX_DATABASES`] databases can be served at once. Past that,
//!    the launcher starts no worker for the extra databases and says so (a
//!    WARNING; `wakeup_status().state` there is `'not served'`, which
//!    `outbox.health()` reports as critical); their publishers stay in `background` mode and their
//!    commits are announced by the first pass of the worker they get when a slot
//!    frees (invariant 3). Within a slot, [`SHARED_TOPICS`] topics and
//!    [`SHARED_PREPARED`] prepared transactions fit between two passes; past them
//!    the next pass sweeps every ready topic, or watches `pg_prepared_xacts`.

use crate::pg::{self, SharedLatch};
use pgrx::atomics::PgAtomic;
use pgrx::lwlock::PgLwLock;
use pgrx::prelude::*;
use pgrx::shmem::*;
use std::cell::Cell;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Databases served at once.
pub const MAX_DATABASES: usize = 64;
/// Distinct topics buffered per database between two worker passes; beyond this
/// the worker falls back to "every topic with ready events".
pub const SHARED_TOPICS: usize = 64;
/// Longest topic name (bytes).
pub const TOPIC_BYTES: usize = 255;
/// Prepared transactions tracked per database until they commit or abort.
pub const SHARED_PREPARED: usize = 32;
/// Announcements of `CREATE EXTENSION` the launcher has not read yet; beyond
/// this it re-examines every database.
const ANNOUNCED: usize = 16;
/// Statements (`DROP DATABASE`, ...) pausing a database's worker at once.
pub const MAX_PAUSES: usize = 16;
/// Prepared transactions that ran `CREATE EXTENSION outbox_ext`, watched by the
/// launcher until they are resolved.
pub const MAX_PREPARED_ANNOUNCEMENTS: usize = 64;

/// Where a slot is in its life.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Status {
    /// Not assigned.
    Free,
    /// Assigned; its worker was registered and has not reported yet.
    Starting,
    /// Its worker found the extension and serves the database.
    Serving,
    /// Assigned, but no background worker process was free to start it
    /// (`max_worker_processes`); the launcher retries.
    Waiting,
    /// Its worker has exited (see [`Exit`]); the launcher frees the slot.
    Exited,
}

/// Why a worker exited.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Exit {
    /// Still running, or never started.
    None,
    /// The extension is not installed in the database.
    Absent,
    /// It was asked to leave (a pause, or the launcher no longer serves the
    /// database).
    Left,
    /// SIGTERM (`pg_terminate_backend`): the launcher starts a new one.
    Stopped,
    /// An error ended it (for example FATAL: the database was dropped meanwhile).
    Failed,
}

/// One served database's shared state.
#[derive(Copy, Clone)]
pub struct DbWake {
    /// The database (0: slot free).
    pub db: u32,
    /// Bumped at each assignment: a worker started for an earlier one finds a
    /// different number and exits.
    pub generation: u32,
    pub status: Status,
    pub exit: Exit,
    /// Leave now: set by the launcher or by a pausing statement.
    pub stop: bool,
    /// The worker's process latch, or none when no worker is attached.
    pub latch: SharedLatch,
    /// PID of the attached worker (0: none).
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

impl DbWake {
    const EMPTY: DbWake = DbWake {
        db: 0,
        generation: 0,
        status: Status::Free,
        exit: Exit::None,
        stop: false,
        latch: SharedLatch::NONE,
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
    };

    /// The topic in position `i` of the pending set.
    pub fn topic(&self, i: usize) -> &[u8] {
        &self.topics[i][..self.lens[i] as usize]
    }
}

/// A pause: database `db` is not served while backend `holder` runs a statement
/// that needs it to itself.
#[derive(Copy, Clone, Default)]
pub struct Pause {
    pub db: u32,
    pub holder: i32,
}

/// Everything under [`WAKE`].
#[derive(Copy, Clone)]
pub struct Registry {
    pub dbs: [DbWake; MAX_DATABASES],
    /// The launcher's latch and PID (none / 0 while it is not running).
    pub launcher_latch: SharedLatch,
    pub launcher_pid: i32,
    /// Databases where `CREATE EXTENSION outbox_ext` committed since the
    /// launcher last looked.
    pub announced: [u32; ANNOUNCED],
    pub nannounced: usize,
    /// More announcements than fit: the launcher re-examines every database.
    pub announce_all: bool,
    pub pauses: [Pause; MAX_PAUSES],
    /// (database, top-level xid) of prepared transactions that created the
    /// extension: announced when the launcher sees them committed.
    pub prepared_announced: [(u32, u32); MAX_PREPARED_ANNOUNCEMENTS],
    pub nprepared_announced: usize,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            dbs: [DbWake::EMPTY; MAX_DATABASES],
            launcher_latch: SharedLatch::NONE,
            launcher_pid: 0,
            announced: [0; ANNOUNCED],
            nannounced: 0,
            announce_all: false,
            pauses: [Pause::default(); MAX_PAUSES],
            prepared_announced: [(0, 0); MAX_PREPARED_ANNOUNCEMENTS],
            nprepared_announced: 0,
        }
    }
}

// SAFETY: plain Copy data; its addresses (the latches) point into shared
// memory, mapped at the same address in every process.
unsafe impl PGRXSharedMemory for Registry {}

/// The shared registry (exists only when preloaded).
// SAFETY: pgrx's contract for a shared-memory static: one unique name, and
// registered with pg_shmem_init! in `_PG_init` ([`init`]) before any use.
pub static WAKE: PgLwLock<Registry> = unsafe { PgLwLock::new(c"outbox_registry") };

/// The lock-free half of one slot, read at every publishing commit.
///
/// At thousands of commits per second nearly every commit publishes to a topic
/// that is already waiting for the worker's next pass. Such a commit needs neither
/// the `WAKE` lock nor the latch: whoever added the topic set the latch, and the
/// worker's next pass (which starts after this commit is visible) notifies it.
///
/// Protocol (a sequence lock): a publisher adding a topic under `WAKE` stores
/// its hash, then `ntopics` (release). The worker, under `WAKE`, zeroes `ntopics`
/// and then bumps `generation` *before* it takes the set; [`assign`] does the
/// same. A reader loads `generation`, scans `hashes[..ntopics]`, and trusts a hit
/// only if `generation` is unchanged afterwards and the slot still serves its
/// database; otherwise it takes the locked path. A 64-bit hash collision between
/// two topics pending in the same pass would skip one NOTIFY; workers poll anyway.
pub struct FastDb {
    /// The database the slot serves (0: free), as in `DbWake::db`.
    pub db: AtomicU32,
    pub generation: AtomicU64,
    pub ntopics: AtomicU32,
    pub hashes: [AtomicU64; SHARED_TOPICS],
}

/// Every slot's lock-free half.
pub struct Fast {
    pub dbs: [FastDb; MAX_DATABASES],
}

impl Default for Fast {
    fn default() -> Self {
        Fast {
            dbs: std::array::from_fn(|_| FastDb {
                db: AtomicU32::new(0),
                generation: AtomicU64::new(0),
                ntopics: AtomicU32::new(0),
                hashes: std::array::from_fn(|_| AtomicU64::new(0)),
            }),
        }
    }
}

// SAFETY: atomics only, no pointers: their bytes mean the same in every
// process that maps the segment.
unsafe impl PGRXSharedMemory for Fast {}

/// The lock-free half (exists only when preloaded).
// SAFETY: as for WAKE.
pub static FAST: PgAtomic<Fast> = unsafe { PgAtomic::new(c"outbox_registry_fast") };

/// Register the shared memory. Called from `_PG_init` when preloaded.
pub fn init() {
    pgrx::pg_shmem_init!(WAKE);
    pgrx::pg_shmem_init!(FAST);
}

/// A topic's hash in the lock-free set.
pub fn topic_hash(topic: &[u8]) -> u64 {
    // DefaultHasher::new() has fixed keys: every backend loads the same library,
    // so every process computes the same hash.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    topic.hash(&mut h);
    h.finish()
}

thread_local! {
    /// The slot this backend's database had last time (a hint, checked on use).
    static MY_SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The slot serving this backend's database, if any.
pub fn my_slot() -> Option<usize> {
    let db = pg::database_id();
    if db == 0 {
        return None;
    }
    let fast = FAST.get();
    let hint = MY_SLOT.get();
    if hint < MAX_DATABASES && fast.dbs[hint].db.load(Ordering::Acquire) == db {
        return Some(hint);
    }
    let found = (0..MAX_DATABASES).find(|&i| fast.dbs[i].db.load(Ordering::Acquire) == db);
    MY_SLOT.set(found.unwrap_or(usize::MAX));
    found
}

/// True when `topic` is certainly pending in slot `i` for database `db` and the
/// worker has not taken the set since: its next pass will notify it.
pub fn already_pending(i: usize, db: u32, topic: &[u8]) -> bool {
    let f = &FAST.get().dbs[i];
    let h = topic_hash(topic);
    let before = f.generation.load(Ordering::SeqCst);
    let n = (f.ntopics.load(Ordering::Acquire) as usize).min(SHARED_TOPICS);
    let hit = f.hashes[..n].iter().any(|x| x.load(Ordering::Acquire) == h);
    hit && f.generation.load(Ordering::SeqCst) == before && f.db.load(Ordering::SeqCst) == db
}

/// Add `topic` to slot `i`'s pending set (caller holds `WAKE` and has checked
/// that the slot holds its database).
pub fn add_topic(r: &mut Registry, i: usize, topic: &[u8]) {
    let s = &mut r.dbs[i];
    if (0..s.ntopics).any(|k| s.topic(k) == topic) {
        return;
    }
    if s.ntopics >= SHARED_TOPICS || topic.len() > TOPIC_BYTES {
        s.overflow = true;
        return;
    }
    let k = s.ntopics;
    s.topics[k][..topic.len()].copy_from_slice(topic);
    s.lens[k] = topic.len() as u8;
    s.ntopics += 1;
    let f = &FAST.get().dbs[i];
    f.hashes[k].store(topic_hash(topic), Ordering::Release);
    f.ntopics.store(s.ntopics as u32, Ordering::Release);
}

/// Empty slot `i`'s pending set for a taker (the worker, or [`assign`]); caller
/// holds `WAKE`.
pub fn begin_take(r: &mut Registry, i: usize) {
    let f = &FAST.get().dbs[i];
    // Empty first, then bump: a reader that sees the new generation cannot also
    // see the old count, so a hit it trusts is a topic added after this take.
    f.ntopics.store(0, Ordering::SeqCst);
    f.generation.fetch_add(1, Ordering::SeqCst);
    r.dbs[i].ntopics = 0;
}

/// Assign a free slot to `db` (the launcher, before it starts the worker).
/// Returns the slot and its generation, or None when `db` already has one or
/// every slot is taken.
pub fn assign(db: u32) -> Option<(usize, u32)> {
    let mut r = WAKE.exclusive();
    if r.dbs.iter().any(|s| s.db == db) {
        return None;
    }
    let i = r.dbs.iter().position(|s| s.db == 0)?;
    let generation = r.dbs[i].generation.wrapping_add(1);
    begin_take(&mut r, i);
    let s = &mut r.dbs[i];
    *s = DbWake { db, generation, status: Status::Starting, ..DbWake::EMPTY };
    // Invariant 3: the first pass sweeps every ready topic and watches the
    // prepared transactions it finds.
    s.overflow = true;
    s.untracked_prepared = 1;
    FAST.get().dbs[i].db.store(db, Ordering::SeqCst);
    Some((i, generation))
}

/// Free slot `i` if it still has `generation` (the launcher, once its worker is
/// gone).
pub fn free(i: usize, generation: u32) {
    let mut r = WAKE.exclusive();
    let s = &mut r.dbs[i];
    if s.generation == generation && s.db != 0 {
        s.db = 0;
        s.status = Status::Free;
        s.pid = 0;
        s.latch = SharedLatch::NONE;
        FAST.get().dbs[i].db.store(0, Ordering::SeqCst);
    }
}

/// Note that `CREATE EXTENSION outbox_ext` committed in `db`, and wake the launcher.
pub fn announce(db: u32) {
    let latch = {
        let mut r = WAKE.exclusive();
        if r.announced[..r.nannounced].contains(&db) {
        } else if r.nannounced < ANNOUNCED {
            let n = r.nannounced;
            r.announced[n] = db;
            r.nannounced += 1;
        } else {
            r.announce_all = true;
        }
        r.launcher_latch
    };
    latch.set();
}

thread_local! {
    /// Databases this backend's open transaction paused.
    static PAUSED: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Pause `dbs` until the current transaction ends: their workers leave now, and
/// the launcher starts none for them meanwhile (the ProcessUtility hook calls
/// this before `DROP DATABASE`, `ALTER DATABASE` and `CREATE DATABASE ...
/// TEMPLATE`; the pause lasts to the end of the transaction, so that a worker
/// started again sees the statement's outcome: the renamed database, or none).
/// A pause that does not fit ([`MAX_PAUSES`]) still makes the worker leave, but
/// the launcher may start it again before the statement has run.
pub fn pause(dbs: &[u32]) {
    let me = pg::my_pid();
    let mut wake = Vec::new();
    {
        let mut r = WAKE.exclusive();
        for &db in dbs {
            if !r.pauses.iter().any(|p| p.db == db && p.holder == me) {
                if let Some(p) = r.pauses.iter_mut().find(|p| p.db == 0) {
                    *p = Pause { db, holder: me };
                }
            }
            for s in r.dbs.iter_mut().filter(|s| s.db == db) {
                s.stop = true;
                wake.push(s.latch);
            }
        }
    }
    PAUSED.with(|p| p.borrow_mut().extend_from_slice(dbs));
    for l in wake {
        l.set();
    }
}

/// Transaction end (src/xact.rs): end this backend's pauses, and wake the
/// launcher to serve those databases again (those that still exist).
pub fn on_xact_end() {
    if PAUSED.with(|p| p.borrow().is_empty()) {
        return;
    }
    PAUSED.with(|p| p.borrow_mut().clear());
    let me = pg::my_pid();
    let latch = {
        let mut r = WAKE.exclusive();
        for p in r.pauses.iter_mut().filter(|p| p.holder == me) {
            *p = Pause::default();
        }
        r.launcher_latch
    };
    latch.set();
}

/// What the launcher reads of a slot.
#[derive(Clone, Copy, Debug)]
pub struct SlotView {
    pub db: u32,
    pub generation: u32,
    pub status: Status,
    pub exit: Exit,
    pub stop: bool,
    pub pid: i32,
}

/// Slot `i` as it is now.
pub fn view(i: usize) -> SlotView {
    let r = WAKE.share();
    let s = &r.dbs[i];
    SlotView { db: s.db, generation: s.generation, status: s.status, exit: s.exit, stop: s.stop, pid: s.pid }
}

/// Every assigned slot.
pub fn assigned() -> Vec<(usize, SlotView)> {
    (0..MAX_DATABASES).map(|i| (i, view(i))).filter(|(_, v)| v.db != 0).collect()
}

/// Set slot `i`'s status if it still has `generation`.
pub fn set_status(i: usize, generation: u32, status: Status) {
    let mut r = WAKE.exclusive();
    if r.dbs[i].generation == generation && r.dbs[i].db != 0 {
        r.dbs[i].status = status;
    }
}

/// Ask slot `i`'s worker to leave (if the slot still has `generation`).
pub fn stop(i: usize, generation: u32) {
    let latch = {
        let mut r = WAKE.exclusive();
        let s = &mut r.dbs[i];
        if s.generation != generation || s.db == 0 {
            return;
        }
        s.stop = true;
        s.latch
    };
    latch.set();
}

/// Note that a transaction that ran `CREATE EXTENSION outbox_ext` in `db` is
/// being prepared: `COMMIT PREPARED` runs none of its callbacks, so the launcher
/// watches `xid` and treats its commit as the announcement. False when the list
/// is full.
pub fn announce_prepared(db: u32, xid: u32) -> bool {
    let latch = {
        let mut r = WAKE.exclusive();
        let n = r.nprepared_announced;
        if n >= MAX_PREPARED_ANNOUNCEMENTS {
            return false;
        }
        r.prepared_announced[n] = (db, xid);
        r.nprepared_announced += 1;
        r.launcher_latch
    };
    latch.set();
    true
}

/// The announcements since the last call (prepared ones once committed; those
/// rolled back are dropped), and whether some did not fit.
pub fn take_announced() -> (Vec<u32>, bool) {
    let watched: Vec<(u32, u32)> = {
        let r = WAKE.share();
        r.prepared_announced[..r.nprepared_announced].to_vec()
    };
    let status: Vec<pg::XidStatus> = watched.iter().map(|&(_, x)| pg::xid_status(x)).collect();
    let mut r = WAKE.exclusive();
    let mut v = r.announced[..r.nannounced].to_vec();
    let mut keep = Vec::new();
    for (&(db, xid), st) in watched.iter().zip(&status) {
        match st {
            pg::XidStatus::InProgress => keep.push((db, xid)),
            pg::XidStatus::Committed => v.push(db),
            pg::XidStatus::Aborted => {}
        }
    }
    // Entries added since the copy above stay for the next call.
    let added: Vec<(u32, u32)> = r.prepared_announced[watched.len()..r.nprepared_announced].to_vec();
    keep.extend(added);
    r.prepared_announced[..keep.len()].copy_from_slice(&keep);
    r.nprepared_announced = keep.len();
    let all = r.announce_all;
    r.nannounced = 0;
    r.announce_all = false;
    (v, all)
}

/// Databases paused now; pauses whose backend has gone (a FATAL error ends a
/// backend without ending its transaction's callbacks) are dropped.
pub fn paused() -> Vec<u32> {
    let holders: Vec<Pause> = WAKE.share().pauses.iter().copied().filter(|p| p.db != 0).collect();
    let dead: Vec<i32> = holders.iter().map(|p| p.holder).filter(|&h| !pg::backend_alive(h)).collect();
    if !dead.is_empty() {
        let mut r = WAKE.exclusive();
        for p in r.pauses.iter_mut().filter(|p| dead.contains(&p.holder)) {
            *p = Pause::default();
        }
    }
    holders.iter().filter(|p| !dead.contains(&p.holder)).map(|p| p.db).collect()
}

/// Register (or, with None, clear) the running launcher.
pub fn set_launcher(pid: i32, latch: SharedLatch) {
    let mut r = WAKE.exclusive();
    r.launcher_pid = pid;
    r.launcher_latch = latch;
}
