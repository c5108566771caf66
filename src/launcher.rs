//! The launcher: one static background worker that runs a per-database worker
//! (src/worker.rs) in every database that has the extension.
//!
//! It is connected to no database: it reads the shared catalog `pg_database`
//! ([`pg::catalog::databases`]) about once a second ([`POLL`]), and sooner when
//! its latch is set (a worker started or stopped, an announcement, a pause
//! ended). A launcher cannot read another database's `pg_extension`, so it learns
//! where the extension is from the workers themselves: it starts one in each
//! database it may serve, and a worker that finds no extension exits with
//! `Exit::Absent`; the launcher then leaves that database alone until
//! - `CREATE EXTENSION outbox_ext` commits there: the install script calls
//!   `outbox._announce()`, which tells the launcher at commit;
//! - or the launcher restarts (a cluster start, or after it was terminated).
//!
//! So a new `CREATE EXTENSION` is served within milliseconds; a database created
//! from a template that has the extension, within one poll (it is a database the
//! launcher has not seen); and a database without the extension costs one short
//! worker start when it is first seen.
//!
//! A database is served when it allows connections, is not a template
//! (`datistemplate`: a worker connected to it would make `CREATE DATABASE` from
//! it fail), is listed by `outbox.databases` (empty: all), and no statement has
//! paused it (`DROP DATABASE`, `ALTER DATABASE`, `CREATE DATABASE ... TEMPLATE`:
//! see src/pg/utility.rs and [`registry::pause`]). A worker whose database stops
//! qualifying is told to leave at the next poll.
//!
//! Worker processes come from `max_worker_processes`, shared with parallel query
//! and other extensions: the launcher takes one, and one per served database.
//! When none is free, the database's slot shows `waiting` (and
//! `outbox.health()` reports it as critical), the launcher retries at every poll,
//! and once a database has waited [`WARN_AFTER`] it logs a WARNING, at most once
//! a minute per database.
//!
//! Restarts: a worker ended by SIGTERM is started again after [`RESTART_DELAY`];
//! one that failed (an error at start, for example), after a delay that doubles
//! up to [`MAX_BACKOFF`]. The launcher itself is restarted by the postmaster one
//! second after it exits; the new launcher adopts the workers still running.

use crate::pg::{self, SharedLatch};
use crate::registry::{self, Exit, Status};
use crate::{gucs, worker};
use pgrx::bgworkers::*;
use pgrx::prelude::*;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Longest time between two looks at `pg_database`.
pub const POLL: Duration = Duration::from_secs(1);
/// Workers that have been started but have not reported yet, at most: bounds the
/// processes taken at once when the launcher first looks at many databases.
const MAX_STARTING: usize = 4;
/// Delay before a worker ended by SIGTERM is started again.
pub const RESTART_DELAY: Duration = Duration::from_secs(1);
/// Longest delay before a failing worker is started again.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Shortest time between two WARNINGs about one database.
const WARN_EVERY: Duration = Duration::from_secs(60);
/// How long a database waits for a worker process before the WARNING: when the
/// launcher starts, its first looks at every database take processes for a
/// moment, and a wait that short is not worth a WARNING (the health check shows
/// it from the first second).
const WARN_AFTER: Duration = Duration::from_secs(5);

/// Register the launcher. Called from `_PG_init` when preloaded.
pub fn register() {
    BackgroundWorkerBuilder::new("outbox_ext launcher")
        .set_type("outbox_ext launcher")
        .set_function("outbox_launcher_main")
        .set_library("outbox_ext")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(1)))
        .load();
}

/// What the launcher remembers about a database between polls.
#[derive(Default)]
struct Known {
    /// Its last worker found no extension: do not start another until told.
    absent: bool,
    /// Do not start a worker before this.
    not_before: Option<Instant>,
    /// Consecutive failed starts.
    failures: u32,
    /// Since when it waits for a worker process (None: it does not).
    waiting_since: Option<Instant>,
    last_warning: Option<Instant>,
}

/// A slot this launcher assigned or adopted.
struct Launched {
    slot: usize,
    generation: u32,
    db: u32,
    name: String,
    /// None for a worker adopted from an earlier launcher, or still waiting for
    /// a process.
    handle: Option<DynamicBackgroundWorker>,
    /// `CREATE EXTENSION` was announced while this worker ran: if it reports the
    /// extension absent, that answer may predate the commit, so ask again.
    reprobe: bool,
}

struct Launcher {
    known: HashMap<u32, Known>,
    launched: Vec<Launched>,
    /// The `outbox.databases` value last checked for names of no database.
    checked_filter: Option<Vec<String>>,
}

#[pg_guard]
extern "C-unwind" fn on_exit(_code: i32, _arg: pg_sys::Datum) {
    pg::release_lwlocks();
    registry::set_launcher(0, SharedLatch::NONE);
}

/// Entry point of the launcher.
#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // No database: only shared catalogs can be read, which is all it needs.
    BackgroundWorker::connect_worker_to_spi(None, None);
    registry::set_launcher(pg::my_pid(), SharedLatch::mine());
    pg::before_exit(on_exit, 0);
    if pg::show_setting(c"outbox.database").is_some() {
        warning!("outbox.database is no longer used: every database that has outbox_ext is served; set outbox.databases to serve only some");
    }
    let mut l = Launcher { known: HashMap::new(), launched: adopt(), checked_filter: None };
    log!("outbox_ext launcher started ({} running worker(s) adopted)", l.launched.len());
    while !worker::stopping() {
        if BackgroundWorker::sighup_received() {
            pg::reload_config();
        }
        let round = PgTryBuilder::new(std::panic::AssertUnwindSafe(|| {
            l.round();
            Ok::<(), String>(())
        }))
        .catch_others(|e| {
            pg::abort_current_transaction();
            Err(format!("{e:?}"))
        })
        .execute();
        if let Err(e) = round {
            warning!("outbox_ext launcher: {e}");
        }
        if !BackgroundWorker::wait_latch(Some(POLL)) {
            break;
        }
    }
    log!("outbox_ext launcher stopping");
    // Status 1: the postmaster restarts a static worker that exits non-zero
    // (after pg_terminate_backend); at shutdown it restarts nothing.
    pg::proc_exit(1);
}

/// Take over the slots of an earlier launcher: keep those whose worker runs,
/// free the others (a worker registered but not attached yet finds its slot freed
/// or reassigned, and exits).
fn adopt() -> Vec<Launched> {
    let mut out = Vec::new();
    for (i, v) in registry::assigned() {
        if v.pid != 0 && pg::backend_alive(v.pid) && v.status != Status::Exited {
            out.push(Launched {
                slot: i,
                generation: v.generation,
                db: v.db,
                name: v.db.to_string(),
                handle: None,
                reprobe: false,
            });
        } else {
            registry::free(i, v.generation);
        }
    }
    out
}

impl Launcher {
    fn round(&mut self) {
        let dbs = BackgroundWorker::transaction(pg::catalog::databases);
        let filter = gucs::database_filter();
        if filter != self.checked_filter {
            for n in filter.iter().flatten().filter(|n| !dbs.iter().any(|d| &d.name == *n)) {
                // Names are matched exactly (case included), like datname.
                warning!("outbox_ext launcher: outbox.databases names {n:?}, which is no database of this cluster");
            }
            self.checked_filter = filter.clone();
        }
        let paused = registry::paused();
        let wanted = |d: &pg::catalog::Database| {
            d.allow_connections
                && !d.is_template
                && filter.as_ref().is_none_or(|f| f.contains(&d.name))
                && !paused.contains(&d.oid)
        };

        // Announcements first, so that a worker's "absent" read below is not
        // trusted when CREATE EXTENSION committed after it looked.
        let (announced, all) = registry::take_announced();
        for (db, k) in self.known.iter_mut() {
            if all || announced.contains(db) {
                *k = Known { last_warning: k.last_warning, ..Known::default() };
            }
        }
        for l in self.launched.iter_mut() {
            if all || announced.contains(&l.db) {
                l.reprobe = true;
            }
        }

        self.reap();

        // Stop workers whose database no longer qualifies.
        for l in &self.launched {
            let ok = dbs.iter().any(|d| d.oid == l.db && wanted(d));
            if !ok {
                let v = registry::view(l.slot);
                if v.status == Status::Waiting {
                    registry::free(l.slot, l.generation);
                } else if !v.stop {
                    registry::stop(l.slot, l.generation);
                }
            }
        }
        self.launched.retain(|l| registry::view(l.slot).generation == l.generation && registry::view(l.slot).db != 0);

        // Retry the databases waiting for a process.
        for l in self.launched.iter_mut().filter(|l| l.handle.is_none()) {
            if registry::view(l.slot).status != Status::Waiting {
                continue;
            }
            match worker::start(l.slot, l.generation, &l.name) {
                Ok(h) => {
                    l.handle = Some(h);
                    registry::set_status(l.slot, l.generation, Status::Starting);
                    self.known.entry(l.db).or_default().waiting_since = None;
                }
                Err(worker::NoProcess) => {
                    let k = self.known.entry(l.db).or_default();
                    warn_no_process(k, &l.name);
                }
            }
        }

        // Start the databases that have no worker.
        let mut starting = self.launched.iter().filter(|l| registry::view(l.slot).status == Status::Starting).count();
        for d in dbs.iter().filter(|d| wanted(d)) {
            if starting >= MAX_STARTING {
                break;
            }
            if self.launched.iter().any(|l| l.db == d.oid) {
                continue;
            }
            let k = self.known.entry(d.oid).or_default();
            if k.absent || k.not_before.is_some_and(|t| Instant::now() < t) {
                continue;
            }
            let Some((slot, generation)) = registry::assign(d.oid) else {
                if k.last_warning.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                    k.last_warning = Some(Instant::now());
                    warning!(
                        "outbox_ext launcher: database {:?} is not served: {} databases are served already, the most one cluster can have",
                        d.name,
                        registry::MAX_DATABASES
                    );
                }
                continue;
            };
            let handle = match worker::start(slot, generation, &d.name) {
                Ok(h) => {
                    starting += 1;
                    Some(h)
                }
                Err(worker::NoProcess) => {
                    registry::set_status(slot, generation, Status::Waiting);
                    warn_no_process(k, &d.name);
                    None
                }
            };
            self.launched.push(Launched { slot, generation, db: d.oid, name: d.name.clone(), handle, reprobe: false });
        }

        // Forget databases that are gone.
        self.known.retain(|oid, _| dbs.iter().any(|d| d.oid == *oid));
    }

    /// Free the slots of workers that have exited, and decide when each database
    /// gets its next worker.
    fn reap(&mut self) {
        let mut keep = Vec::new();
        for l in self.launched.drain(..) {
            let v = registry::view(l.slot);
            if v.generation != l.generation || v.db == 0 {
                continue;
            }
            let handle_stopped =
                l.handle.as_ref().is_some_and(|h| matches!(h.pid(), Err(BackgroundWorkerStatus::Stopped)));
            let gone = v.status == Status::Exited || (handle_stopped && v.pid == 0);
            if !gone {
                if v.status == Status::Serving {
                    self.known.entry(l.db).or_default().failures = 0;
                }
                keep.push(l);
                continue;
            }
            registry::free(l.slot, l.generation);
            // A worker that exited before attaching recorded nothing: it was
            // told to stop (Left) or could not start (Failed).
            let exit = match v.exit {
                Exit::None if v.stop => Exit::Left,
                Exit::None => Exit::Failed,
                e => e,
            };
            let k = self.known.entry(l.db).or_default();
            match exit {
                Exit::Absent if !l.reprobe => k.absent = true,
                Exit::Absent | Exit::Left | Exit::None => {}
                Exit::Stopped => {
                    k.failures = 0;
                    k.not_before = Some(Instant::now() + RESTART_DELAY);
                }
                Exit::Failed => {
                    k.failures = k.failures.saturating_add(1);
                    let delay = RESTART_DELAY.saturating_mul(1 << k.failures.min(6)).min(MAX_BACKOFF);
                    k.not_before = Some(Instant::now() + delay);
                }
            }
        }
        self.launched = keep;
    }
}

fn warn_no_process(k: &mut Known, name: &str) {
    let since = *k.waiting_since.get_or_insert_with(Instant::now);
    if since.elapsed() >= WARN_AFTER && k.last_warning.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
        k.last_warning = Some(Instant::now());
        warning!(
            "outbox_ext launcher: no background worker process is free for database {name:?} (max_worker_processes = {}); retrying every second",
            pg::show_setting(c"max_worker_processes").unwrap_or_default()
        );
    }
}
