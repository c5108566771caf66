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
use crate::pg;
use crate::registry::{self, Status, SHARED_PREPARED, WAKE};
use pgrx::prelude::*;
use std::cell::{Cell, RefCell};

/// The LISTEN channel.
pub const CHANNEL: &str = "outbox";
/// Topics noted by this backend's open transaction, tagged with the
/// subtransaction that published them.
struct Pending {
    topics: Vec<(pg_sys::SubTransactionId, String)>,
    any: Option<pg_sys::SubTransactionId>,
    due: bool,
    /// Delayed events' topics with their `deliver_at` (µs): one whose time
    /// has passed by the commit is announced by it, as an immediate publish
    /// is (the worker's due-time pass looks only at times after its last one).
    delayed: Vec<(pg_sys::SubTransactionId, String, i64)>,
}

const NOTHING: Pending = Pending { topics: Vec::new(), any: None, due: false, delayed: Vec::new() };

thread_local! {
    static PENDING: RefCell<Pending> = const { RefCell::new(NOTHING) };
    static WARNED: Cell<bool> = const { Cell::new(false) };
    static ANNOUNCE: Cell<bool> = const { Cell::new(false) };
}

/// The mode in effect for this backend: 'background' needs the preloaded library
/// (which runs the launcher, src/launcher.rs) and a database that
/// `outbox.databases` does not exclude; otherwise it degrades to 'transaction',
/// with one WARNING per session. A served database whose worker is not running
/// at the moment (starting, restarting, no free worker process) stays in
/// 'background': its next worker's first pass announces what committed meanwhile
/// (src/registry.rs, invariant 3), and `outbox.health()` reports the gap.
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
        NotifyMode::Background if !gucs::serves_current_database() => {
            if !WARNED.with(|w| w.replace(true)) {
                warning!(
                    "outbox.databases does not include this database, so no background worker serves it; using outbox.notify = 'transaction' in this session"
                );
            }
            NotifyMode::Transaction
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
    let at = deliver_at.map(|d| d.value() as i64);
    let future = at.is_some_and(|at| at > pg::now());
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
                    let at = at.unwrap_or(i64::MAX);
                    match p.delayed.iter_mut().find(|(s, t, _)| *s == sub && t == topic) {
                        Some(d) => d.2 = d.2.min(at),
                        None => p.delayed.push((sub, topic.to_string(), at)),
                    }
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
        Some(std::mem::replace(&mut *p, NOTHING))
    })
}

/// Publish the committed transaction's topics to its database's slot and wake
/// the worker. No slot, or a slot that changed hands meanwhile: the next worker
/// of this database announces the commit (src/registry.rs, invariant 3).
fn flush_committed(mut p: Pending) {
    let Some(i) = registry::my_slot() else { return };
    let db = pg::database_id();
    // Delayed events whose time passed while their transaction was open.
    let now = pg::now();
    for (s, t, at) in std::mem::take(&mut p.delayed) {
        if at <= now && !p.topics.iter().any(|(_, x)| *x == t) {
            p.topics.push((s, t));
        }
    }
    if p.any.is_none() && !p.due && p.topics.iter().all(|(_, t)| registry::already_pending(i, db, t.as_bytes())) {
        return;
    }
    let latch = {
        let mut r = WAKE.exclusive();
        if r.dbs[i].db != db {
            return;
        }
        for (_, t) in &p.topics {
            registry::add_topic(&mut r, i, t.as_bytes());
        }
        let s = &mut r.dbs[i];
        if p.any.is_some() {
            s.overflow = true;
        }
        if p.due {
            s.recheck_due = true;
        }
        s.latch
    };
    latch.set();
}

/// Hand a preparing transaction's wake-up to its database's worker: it notifies
/// once the prepared transaction commits (COMMIT PREPARED may run in another
/// session, even in another database). No slot: the next worker of this
/// database watches the prepared transactions it finds.
fn flush_prepared(p: Pending) {
    let xid = pg::top_xid_if_any();
    // A delayed event too: its time may pass before COMMIT PREPARED, and the
    // sweep after it finds every due event.
    if p.topics.is_empty() && p.any.is_none() && p.delayed.is_empty() {
        return;
    }
    let Some(i) = registry::my_slot() else { return };
    let db = pg::database_id();
    let latch = {
        let mut r = WAKE.exclusive();
        let s = &mut r.dbs[i];
        if s.db != db {
            return;
        }
        if xid != 0 && s.nprepared < SHARED_PREPARED {
            let k = s.nprepared;
            s.prepared[k] = xid;
            s.nprepared += 1;
        } else {
            // No room to track it: the worker watches pg_prepared_xacts until it
            // has seen no prepared transaction for a while, and sweeps every ready
            // topic whenever one of them is resolved (src/worker.rs).
            s.untracked_prepared += 1;
        }
        s.latch
    };
    latch.set();
}

/// Transaction end (src/xact.rs): hand the committed topics to the worker, or
/// drop them.
pub fn on_xact_event(event: pg_sys::XactEvent::Type) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_COMMIT | XACT_EVENT_PARALLEL_COMMIT => {
            if ANNOUNCE.replace(false) && gucs::preloaded() {
                registry::announce(pg::database_id());
            }
            if let Some(p) = take_pending() {
                if gucs::preloaded() {
                    flush_committed(p);
                }
            }
        }
        XACT_EVENT_PRE_PREPARE => {
            if ANNOUNCE.replace(false)
                && gucs::preloaded()
                && !registry::announce_prepared(pg::database_id(), pg::top_xid_if_any())
            {
                crate::errors::raise(
                    crate::errors::CONFIGURATION_LIMIT,
                    format!(
                        "more than {} prepared transactions have run CREATE EXTENSION outbox_ext; commit or roll back one of them first",
                        registry::MAX_PREPARED_ANNOUNCEMENTS
                    ),
                );
            }
            if let Some(p) = take_pending() {
                if gucs::preloaded() {
                    flush_prepared(p);
                }
            }
        }
        XACT_EVENT_ABORT | XACT_EVENT_PARALLEL_ABORT => {
            ANNOUNCE.set(false);
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
                p.delayed.retain(|(s, _, _)| *s != my);
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
                for (s, _, _) in p.delayed.iter_mut() {
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

/// `outbox._announce()`: called by the install script, so that the launcher
/// serves this database as soon as `CREATE EXTENSION` commits (and not only at
/// its next look at a database it has not seen: src/launcher.rs).
#[pg_extern(name = "_announce", volatile, parallel_unsafe)]
fn announce() {
    ANNOUNCE.set(true);
}

/// `outbox.wakeup_status()`: the background worker of the current database, for
/// tests and monitoring. Columns: worker_pid (0 when none runs), database (its
/// oid, 0 when not served), passes completed, topics waiting, prepared
/// transactions tracked, preloaded, launcher_pid (0 when not running), state
/// ('serving', 'starting', 'waiting' for a free worker process, 'stopped' and
/// about to be restarted, or 'not served').
#[pg_extern(volatile)]
#[allow(clippy::type_complexity)] // pgrx reads the column names from this type
fn wakeup_status() -> TableIterator<
    'static,
    (
        name!(worker_pid, i32),
        name!(database, i64),
        name!(passes, i64),
        name!(topics_waiting, i32),
        name!(prepared_waiting, i32),
        name!(preloaded, bool),
        name!(launcher_pid, i32),
        name!(state, String),
    ),
> {
    if !gucs::preloaded() {
        return TableIterator::once((0, 0, 0, 0, 0, false, 0, "not served".into()));
    }
    let db = pg::database_id();
    let r = WAKE.share();
    let row = match r.dbs.iter().find(|s| s.db == db) {
        Some(s) => {
            let state = match s.status {
                Status::Serving => "serving",
                Status::Starting => "starting",
                Status::Waiting => "waiting",
                Status::Exited => "stopped",
                Status::Free => "not served",
            };
            (
                s.pid,
                db as i64,
                s.passes as i64,
                s.ntopics as i32,
                s.nprepared as i32,
                true,
                r.launcher_pid,
                state.into(),
            )
        }
        None => (0, 0, 0, 0, 0, true, r.launcher_pid, "not served".into()),
    };
    TableIterator::once(row)
}
