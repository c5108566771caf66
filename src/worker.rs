//! The per-database background worker: sends coalesced wake-ups and runs
//! retention in one database.
//!
//! The launcher (src/launcher.rs) starts one per served database, in a slot of
//! the shared registry (src/registry.rs) whose number and generation it passes as
//! the worker's argument. Each pass, in its own transaction:
//! 1. takes the topics committed since the last pass from shared memory (see
//!    `wakeup`), plus every topic whose delayed events, retries or expired leases
//!    came due in the log since the last pass (src/log/due.rs), and sends one
//!    NOTIFY per topic;
//! 2. checks prepared transactions that published: once committed, it notifies;
//! 3. computes when the next delayed event comes due and sleeps until then (at
//!    most 1 s), unless its latch is set first.
//!
//! Every `outbox.maintenance_interval` it runs retention batch by batch, one
//! transaction per batch, and records the run in outbox.maintenance_runs.
//!
//! Errors in a pass are caught, logged and retried next pass. The worker exits
//! when the extension is not installed (`Exit::Absent`), when asked to leave
//! (`Exit::Left`: a statement that needs the database to itself, or the launcher
//! no longer serves it), on SIGTERM (`Exit::Stopped`) or on postmaster death; the
//! reason is left in its slot, where the launcher reads it to decide whether to
//! start another (src/launcher.rs). An exit callback records the exit even after
//! a FATAL error (`Exit::Failed`).

use crate::pg::{self, SharedLatch};
use crate::registry::{self, Exit, Status, WAKE};
use crate::sql::worker as sql;
use crate::wakeup;
use crate::{gucs, handshake, log, maintenance};
use pgrx::bgworkers::*;
use pgrx::prelude::*;
use std::time::{Duration, Instant};

/// No background worker process was free (`max_worker_processes`).
#[derive(Debug)]
pub struct NoProcess;

/// Start the worker of registry slot `slot` (assigned with `generation`); the
/// calling process (the launcher) is told when it starts and stops.
pub fn start(slot: usize, generation: u32, name: &str) -> Result<DynamicBackgroundWorker, NoProcess> {
    BackgroundWorkerBuilder::new(&format!("outbox_ext worker for {name}"))
        .set_type("outbox_ext worker")
        .set_function("outbox_worker_main")
        .set_library("outbox_ext")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(None)
        .set_argument(Some(pg_sys::Datum::from(encode(slot, generation))))
        .set_notify_pid(pg::my_pid())
        .load_dynamic()
        .map_err(|_| NoProcess)
}

fn encode(slot: usize, generation: u32) -> u64 {
    ((generation as u64) << 32) | slot as u64
}

fn decode(arg: u64) -> (usize, u32) {
    ((arg & 0xffff_ffff) as usize, (arg >> 32) as u32)
}

thread_local! {
    /// This worker's slot and its generation, once attached.
    static SLOT: std::cell::Cell<(usize, u32)> = const { std::cell::Cell::new((usize::MAX, 0)) };
}

/// Record why this worker ends (first reason wins).
fn set_exit(why: Exit) {
    let (i, generation) = SLOT.get();
    if i >= registry::MAX_DATABASES {
        return;
    }
    let mut r = WAKE.exclusive();
    let s = &mut r.dbs[i];
    if s.generation == generation && s.exit == Exit::None {
        s.exit = why;
    }
}

/// Exit callback: detach from the slot and wake the launcher.
#[pg_guard]
extern "C-unwind" fn on_exit(_code: i32, _arg: pg_sys::Datum) {
    pg::release_lwlocks();
    let (i, generation) = SLOT.get();
    let latch = {
        let mut r = WAKE.exclusive();
        let s = &mut r.dbs[i];
        if s.generation == generation && s.db != 0 {
            s.pid = 0;
            s.latch = SharedLatch::NONE;
            s.status = Status::Exited;
            if s.exit == Exit::None {
                s.exit = Exit::Failed;
            }
        }
        r.launcher_latch
    };
    latch.set();
}

/// Attach to slot `i` if it still has `generation` and is not told to stop;
/// returns its database.
fn attach(i: usize, generation: u32) -> Option<u32> {
    if i >= registry::MAX_DATABASES {
        return None;
    }
    let mut r = WAKE.exclusive();
    let s = &mut r.dbs[i];
    if s.generation != generation || s.db == 0 || s.stop || s.pid != 0 {
        return None;
    }
    s.pid = pg::my_pid();
    s.latch = SharedLatch::mine();
    SLOT.set((i, generation));
    Some(s.db)
}

fn slot() -> usize {
    SLOT.get().0
}

static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// True once SIGTERM arrived. pgrx's sigterm_received() clears the flag it reads,
/// and wait_latch() reads it too, so the first sighting is made sticky here:
/// otherwise a SIGTERM noticed during maintenance would be lost and the worker
/// would never stop. (The launcher uses it too: each process has its own flag.)
pub fn stopping() -> bool {
    use std::sync::atomic::Ordering;
    if STOP.load(Ordering::Relaxed) || BackgroundWorker::sigterm_received() {
        STOP.store(true, Ordering::Relaxed);
        return true;
    }
    false
}

/// Longest sleep between passes: bounds the latency of wake-ups for expired leases
/// and prepared transactions, which no backend signals.
const MAX_SLEEP: Duration = Duration::from_secs(1);
/// Sleep while prepared transactions are being tracked.
const PREPARED_POLL: Duration = Duration::from_millis(20);
/// After a prepared transaction that did not fit in the shared list: how long
/// the worker sweeps on a doubling schedule, and how long `pg_prepared_xacts`
/// must then stay empty before it stops watching. A PREPARE announces itself
/// before it shows in that view; this covers the gap.
const UNTRACKED_GRACE: Duration = Duration::from_secs(2);

/// Prepared transactions the shared list could not hold: the worker watches the
/// prepared transactions of its database and sweeps when one is resolved.
///
/// A transaction announces itself at PRE_PREPARE, before `pg_prepared_xacts`
/// lists it, and may be committed before the next poll ever lists it. So after
/// each announcement the worker also sweeps on a schedule that doubles from
/// [`PREPARED_POLL`] up to [`UNTRACKED_GRACE`]: a commit in that window is
/// announced within about twice its age; one later than that was listed by some
/// poll first (a prepared transaction is listed within milliseconds of
/// PRE_PREPARE), and its resolution is seen.
#[derive(Default)]
struct Untracked {
    seen: u64,
    active: bool,
    watched: Vec<u32>,
    empty_since: Option<Instant>,
    /// The latest announcement, the next scheduled sweep after it, and the
    /// interval that doubles.
    burst: Option<(Instant, Instant, Duration)>,
}

impl Untracked {
    /// A new worker: it watches the prepared transactions that exist already (its
    /// first pass sweeps every ready topic anyway), without the sweep schedule of
    /// an announcement, which would repeat that sweep for nothing.
    fn starting() -> Untracked {
        Untracked { seen: WAKE.share().dbs[slot()].untracked_prepared, active: true, ..Untracked::default() }
    }

    /// True when a sweep is due: a watched prepared transaction was resolved
    /// since the last call, or the schedule after an announcement says so.
    fn poll(&mut self) -> bool {
        let gen = WAKE.share().dbs[slot()].untracked_prepared;
        let now = Instant::now();
        if gen != self.seen {
            self.seen = gen;
            self.active = true;
            self.empty_since = None;
            self.burst = Some((now, now + PREPARED_POLL, PREPARED_POLL));
        }
        if !self.active {
            return false;
        }
        let mut scheduled = false;
        if let Some((start, next, step)) = self.burst {
            if now.duration_since(start) > UNTRACKED_GRACE {
                self.burst = None;
                scheduled = true; // the last one, at the end of the window
            } else if now >= next {
                self.burst = Some((start, now + step * 2, step * 2));
                scheduled = true;
            }
        }
        let listed = PgTryBuilder::new(|| {
            Ok::<Vec<u32>, String>(BackgroundWorker::transaction(|| {
                Spi::get_one::<Vec<i64>>(
                    "SELECT COALESCE(array_agg(transaction::text::int8), '{}') FROM pg_catalog.pg_prepared_xacts \
                      WHERE database = current_database()",
                )
                .ok()
                .flatten()
                .unwrap_or_default()
                .into_iter()
                .map(|x| x as u32)
                .collect()
            }))
        })
        .catch_others(|e| {
            pg::abort_current_transaction();
            Err(describe(&e))
        })
        .execute();
        let Ok(now_listed) = listed else {
            return true;
        };
        let resolved = self.watched.iter().any(|x| !now_listed.contains(x));
        self.watched = now_listed;
        if self.watched.is_empty() && self.burst.is_none() {
            if self.empty_since.get_or_insert_with(Instant::now).elapsed() >= UNTRACKED_GRACE {
                self.active = false;
            }
        } else {
            self.empty_since = None;
        }
        resolved || scheduled
    }
}

struct Taken {
    topics: Vec<String>,
    overflow: bool,
    recheck_due: bool,
    prepared: Vec<u32>,
}

fn take_shared() -> Taken {
    let i = slot();
    let mut r = WAKE.exclusive();
    let ntopics = r.dbs[i].ntopics;
    let topics = (0..ntopics).map(|k| String::from_utf8_lossy(r.dbs[i].topic(k)).into_owned()).collect();
    // Publishers that see their topic pending skip the lock; the generation bump
    // tells them the set is being taken (see registry::FastDb).
    registry::begin_take(&mut r, i);
    let s = &mut r.dbs[i];
    let t = Taken {
        topics,
        overflow: s.overflow,
        recheck_due: s.recheck_due,
        prepared: s.prepared[..s.nprepared].to_vec(),
    };
    s.overflow = false;
    s.recheck_due = false;
    t
}

/// Drop resolved prepared xids from shared memory; returns how many committed.
fn resolve_prepared(xids: &[u32]) -> usize {
    let mut committed = 0;
    let mut done = Vec::new();
    for &x in xids {
        match pg::xid_status(x) {
            pg::XidStatus::InProgress => continue,
            pg::XidStatus::Committed => committed += 1,
            pg::XidStatus::Aborted => {}
        }
        done.push(x);
    }
    if !done.is_empty() {
        let mut r = WAKE.exclusive();
        let s = &mut r.dbs[slot()];
        let keep: Vec<u32> = s.prepared[..s.nprepared].iter().copied().filter(|x| !done.contains(x)).collect();
        s.nprepared = keep.len();
        s.prepared[..keep.len()].copy_from_slice(&keep);
    }
    committed
}

thread_local! {
    /// Set by a pass that found the extension not installed.
    static ABSENT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// One notify pass inside a transaction. Returns microseconds until the next
/// event comes due, if any.
fn notify_pass(taken: &Taken, since: i64, now: i64, sweep_all: bool) -> Option<i64> {
    let mut topics: Vec<String> = taken.topics.clone();
    let next = Spi::connect(|c| {
        // The worker may start before CREATE EXTENSION (or after DROP EXTENSION).
        let installed = c
            .select(sql::IS_INSTALLED, None, &[])
            .ok()
            .and_then(|t| t.first().get_one::<bool>().ok().flatten())
            .unwrap_or(false);
        if !installed {
            return Err(String::new());
        }
        log::due::pass(c, since, now, sweep_all, &mut topics)
    });
    for t in &topics {
        wakeup::notify_now(t);
    }
    if !topics.is_empty() {
        debug1!("outbox worker: notified {} topic(s)", topics.len());
    }
    match next {
        Ok(Some(at)) => Some(at.saturating_sub(now)),
        Ok(None) => None,
        Err(e) if e.is_empty() => {
            ABSENT.set(true);
            None
        }
        Err(e) => {
            warning!("outbox worker: due-time query failed: {e}");
            None
        }
    }
}

/// A short description of an error caught in the worker loop.
fn describe(e: &pgrx::pg_sys::panic::CaughtError) -> String {
    use pgrx::pg_sys::panic::CaughtError;
    match e {
        CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) => {
            format!("{} (SQLSTATE {})", r.message(), r.sql_error_code().to_string().trim_start_matches("ERRCODE_"))
        }
        CaughtError::RustPanic { ereport, .. } => ereport.message().to_string(),
    }
}

/// Run one batch of a maintenance step in its own transaction, whose commit
/// releases what the batch locked (a truncated ring table); returns
/// [`maintenance::run_step`]'s (removed, done).
fn maintenance_step(step: &str) -> (i64, bool) {
    BackgroundWorker::transaction(|| maintenance::run_step(step))
}

/// A retention run in progress. The worker runs one batch per loop iteration and
/// waits `outbox.purge_delay` between batches, so that wake-ups keep flowing while
/// a large purge runs and the purge takes a bounded share of the machine (as
/// autovacuum's cost delay does). Run to completion, as before 0.2.0, a large purge
/// held back every wake-up until it finished.
struct MaintenanceRun {
    started: i64,
    step: usize,
    removed: [i64; maintenance::STEPS.len()],
    error: Option<String>,
}

fn start_maintenance() -> Option<MaintenanceRun> {
    installed().then(|| MaintenanceRun {
        started: pg::now(),
        step: 0,
        removed: [0; maintenance::STEPS.len()],
        error: None,
    })
}

/// Run the next batch of `m`; true when the run is complete (and recorded).
fn maintenance_batch(m: &mut MaintenanceRun) -> bool {
    let (step, _) = maintenance::STEPS[m.step];
    let r = PgTryBuilder::new(|| Ok(maintenance_step(step)))
        .catch_others(|e| {
            pg::abort_current_transaction();
            Err(describe(&e))
        })
        .execute();
    match r {
        // A full batch, or a truncated ring table: more may remain.
        Ok((n, false)) => m.removed[m.step] += n,
        Ok((n, true)) => {
            m.removed[m.step] += n;
            m.step += 1;
        }
        Err(e) => {
            // Every failing step is recorded, not only the last.
            let this = format!("{step}: {e}");
            m.error = Some(match m.error.take() {
                Some(prev) => format!("{prev}; {this}"),
                None => this,
            });
            m.step += 1;
        }
    }
    if m.step < maintenance::STEPS.len() {
        return false;
    }
    record_maintenance(m);
    true
}

fn record_maintenance(m: &MaintenanceRun) {
    let (started, removed, error) = (m.started, m.removed, m.error.clone());
    let _ = PgTryBuilder::new(|| {
        BackgroundWorker::transaction(|| {
            let started_ts = pg::timestamptz(started);
            // The columns come from the step list, as in outbox._log_maintenance().
            let logged = |col: &str| -> i64 {
                maintenance::STEPS.iter().zip(removed.iter()).filter(|((_, c), _)| *c == Some(col)).map(|(_, n)| *n).sum()
            };
            Spi::run_with_args(
                "INSERT INTO outbox.maintenance_runs (started_at, finished_at, purged_delivered, purged_dead, purged_keys, error) \
                 VALUES ($1, clock_timestamp(), $2, $3, $4, $5)",
                &[
                    started_ts.into(),
                    logged("purged_delivered").into(),
                    logged("purged_dead").into(),
                    logged("purged_keys").into(),
                    error.clone().into(),
                ],
            )
        })
        .map_err(|e| e.to_string())
    })
    .catch_others(|e| {
        pg::abort_current_transaction();
        Err(describe(&e))
    })
    .execute();
    if let Some(e) = error {
        warning!("outbox worker: maintenance failed: {e}");
    } else {
        debug1!("outbox worker: maintenance removed {:?}", removed);
    }
}

/// Whether the extension is installed here (own transaction).
fn installed() -> bool {
    BackgroundWorker::transaction(|| Spi::get_one::<bool>(sql::IS_INSTALLED).ok().flatten().unwrap_or(false))
}

/// True when this worker was told to leave.
fn told_to_stop() -> bool {
    WAKE.share().dbs[slot()].stop
}

/// Entry point of a per-database worker.
#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_worker_main(arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let (i, generation) = decode(arg.value() as u64);
    let Some(db) = attach(i, generation) else {
        // A worker for an earlier assignment of the slot, or told to stop before
        // it started: nothing to record.
        pg::proc_exit(0);
    };
    pg::before_exit(on_exit, 0);
    // Connects by OID: a rename does not change it. A database dropped meanwhile
    // ends the worker here with FATAL (recorded as Exit::Failed by on_exit).
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(db)), None);
    if told_to_stop() {
        set_exit(Exit::Left);
        pg::proc_exit(0);
    }
    if !installed() {
        set_exit(Exit::Absent);
        pg::proc_exit(0);
    }
    {
        let mut r = WAKE.exclusive();
        r.dbs[i].status = Status::Serving;
    }
    let name = BackgroundWorker::transaction(pg::catalog::current_database_name).unwrap_or_default();
    log!("outbox_ext worker started for database {name:?}");
    let why = serve();
    set_exit(why);
    log!("outbox_ext worker for database {name:?} stopping ({why:?})");
    pg::proc_exit(0);
}

/// How often a worker whose database's SQL fails the handshake says so.
const MISMATCH_LOG_EVERY: Duration = Duration::from_secs(60);

/// The worker's loop; returns why it ended.
fn serve() -> Exit {
    let mut last_check = pg::now();
    // Absolute time (µs) of the next known due event; i64::MAX when none.
    let mut next_due_at: i64 = 0;
    let mut last_maintenance = Instant::now();
    let mut maintenance: Option<MaintenanceRun> = None;
    let mut next_batch_at = Instant::now();
    let mut sleep = Duration::ZERO;
    // When the last pass that announced commits ran: coalescing counts from
    // there, so a due-time sweep in a quiet spell delays no commit.
    let mut last_announce = Instant::now();
    let mut untracked = Untracked::starting();
    let mut mismatch_logged: Option<Instant> = None;
    loop {
        if stopping() || !BackgroundWorker::wait_latch(Some(sleep)) {
            return Exit::Stopped;
        }
        if told_to_stop() {
            return Exit::Left;
        }
        // The handshake (src/handshake.rs): SQL this library was not built with
        // gets nothing from it, not even a NOTIFY; one line a minute says why.
        // A DROP EXTENSION meanwhile is seen by the next pass's own check.
        if let Err(m) = BackgroundWorker::transaction(handshake::verdict) {
            if mismatch_logged.is_none_or(|at: Instant| at.elapsed() >= MISMATCH_LOG_EVERY) {
                log!("outbox worker: serving nothing in this database: {} (HINT: {})", m.message, m.hint);
                mismatch_logged = Some(Instant::now());
            }
            if !installed() {
                return Exit::Absent;
            }
            sleep = MAX_SLEEP;
            continue;
        }
        mismatch_logged = None;
        // Coalesce (outbox.wakeup_coalesce, 1 ms): under a stream of commits, let
        // them gather for a moment instead of running one pass (one transaction,
        // one NOTIFY per topic) per commit; at 1 ms the worker stays under 1,000
        // passes a second however fast publishers commit. Commits arriving
        // meanwhile find their topic pending and skip the lock. A worker woken after
        // a quiet moment (no commit announced within the interval: a due-time
        // sweep does not count) does not wait at all.
        let coalesce = Duration::from_millis(gucs::wakeup_coalesce_ms() as u64);
        let since = last_announce.elapsed();
        if since < coalesce {
            std::thread::sleep(coalesce - since);
        }
        if BackgroundWorker::sighup_received() {
            pg::reload_config();
        }
        let taken = take_shared();
        let committed_prepared = if taken.prepared.is_empty() { 0 } else { resolve_prepared(&taken.prepared) };
        let untracked_resolved = untracked.poll();
        let sweep_all = taken.overflow || committed_prepared > 0 || untracked_resolved;
        let now = pg::now();
        // A pass woken only by commits just sends their NOTIFYs: no queries. The
        // queries (due events, next due time) run when something may have come
        // due: a delayed publish or retry was scheduled, the known next due time
        // passed, an overflow, or a second went by (expired leases are found then).
        let sweep = sweep_all
            || taken.recheck_due
            || now >= next_due_at
            || now.saturating_sub(last_check) >= MAX_SLEEP.as_micros() as i64;
        let result = PgTryBuilder::new(|| {
            if sweep {
                Ok(Some(BackgroundWorker::transaction(|| notify_pass(&taken, last_check, now, sweep_all))))
            } else {
                if !taken.topics.is_empty() {
                    BackgroundWorker::transaction(|| {
                        for t in &taken.topics {
                            wakeup::notify_now(t);
                        }
                    });
                }
                Ok(None)
            }
        })
        .catch_others(|e| {
            pg::abort_current_transaction();
            Err(describe(&e))
        })
        .execute();
        match result {
            Ok(Some(next)) => {
                last_check = now;
                next_due_at = next.map(|us| now.saturating_add(us)).unwrap_or(i64::MAX);
            }
            Ok(None) => {}
            Err(e) => {
                // DROP EXTENSION between the pass's check and its queries.
                if !installed() {
                    return Exit::Absent;
                }
                warning!("outbox worker: wake-up pass failed, retrying: {e}");
                // Put the topics back so they are not lost.
                if !taken.topics.is_empty() || taken.overflow {
                    WAKE.exclusive().dbs[slot()].overflow = true;
                }
                next_due_at = now.saturating_add(1_000_000);
            }
        }
        WAKE.exclusive().dbs[slot()].passes += 1;
        if ABSENT.get() {
            return Exit::Absent;
        }
        if !taken.topics.is_empty() || taken.overflow {
            last_announce = Instant::now();
        }

        let interval = gucs::maintenance_interval_ms();
        if maintenance.is_none() && interval > 0 && last_maintenance.elapsed() >= Duration::from_millis(interval as u64)
        {
            maintenance = start_maintenance();
            if maintenance.is_none() {
                last_maintenance = Instant::now();
            }
        }
        // One batch when its time has come; commits waking the worker meanwhile get
        // their NOTIFYs but do not hurry the purge.
        if let Some(m) = maintenance.as_mut() {
            if Instant::now() >= next_batch_at {
                if maintenance_batch(m) {
                    maintenance = None;
                    last_maintenance = Instant::now();
                } else {
                    next_batch_at = Instant::now() + Duration::from_millis(gucs::purge_delay_ms() as u64);
                }
            }
        }

        let now = pg::now();
        let until_sweep = (last_check.saturating_add(MAX_SLEEP.as_micros() as i64)).min(next_due_at);
        sleep = Duration::from_micros(until_sweep.saturating_sub(now).max(1000) as u64).min(MAX_SLEEP);
        if WAKE.share().dbs[slot()].nprepared > 0 || untracked.active {
            sleep = sleep.min(PREPARED_POLL);
        }
        if maintenance.is_some() {
            sleep = sleep.min(next_batch_at.saturating_duration_since(Instant::now()));
        } else if interval > 0 {
            let left = Duration::from_millis(interval as u64).saturating_sub(last_maintenance.elapsed());
            sleep = sleep.min(left.max(Duration::from_millis(1)));
        }
    }
}
