//! The event log: the append-only ring of `outbox.log_0` .. `outbox.log_3`
//! (sql/log.sql) that subscriptions will read in commit order
//! (docs/design/subscriptions.md).
//!
//! In 0.8.0 publish appends every event here when `outbox.log_write` is on,
//! beside its `outbox.event_queue` row; nothing reads the log yet, so its cost
//! can be measured (`bench/run`, scenario 1) before the claim path is built on it.
//!
//! # Invariants, and why they hold
//! 1. **A log row exists iff its publish committed.** It is inserted in the
//!    publishing (sub)transaction, next to the queue row, by the same heap insert
//!    an INSERT statement ends in ([`crate::pg::heap`]); a rollback, or a
//!    rollback to a savepoint, undoes both. A dispatch key that names an
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
//! 4. **Retention never queues anyone behind its lock.** A ring table is emptied
//!    by TRUNCATE only after `LOCK TABLE ... NOWAIT` got its ACCESS EXCLUSIVE
//!    lock at once (`outbox._log_rotate`); a table some transaction still uses is
//!    left for the next run, so publishers never wait behind a lock request
//!    queued behind an idle reader.
//!
//! Which table is written is a backend's cached copy of `outbox.log_state`
//! ([`crate::pg::GenerationCache`]), stale for at most the commit of a rotation.
//! A stale copy appends to the table just sealed; that is harmless, since a
//! sealed table is truncated only once its retention has passed since sealing,
//! and (from the slice that reads the log) only once every reader has passed it.

use crate::pg;
use crate::pg::catalog::outbox_relid;
use crate::pg::fcall::param;
use crate::pg::heap::{self, LogRow};
use crate::pg::plans;
use crate::sql::log::{APPEND_ONE, CURRENT, ROTATE};
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
    static CURRENT_TABLE: pg::GenerationCache<usize> = const { pg::GenerationCache::new() };
}

/// True when publish should append to the log: the setting is on and the
/// installed SQL has the ring (0.8.0 or later; the library may be newer than
/// the SQL until `ALTER EXTENSION outbox_ext UPDATE`).
pub fn enabled() -> bool {
    crate::gucs::log_write() && outbox_relid(c"log_state").is_some()
}

fn current() -> usize {
    CURRENT_TABLE.with(|c| {
        c.with(
            || plans::one::<i16>(&CURRENT, &[]).map_or(0, |n| n.clamp(0, 3) as usize),
            |n| *n,
        )
    })
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

/// The maintenance step `log`: truncate sealed tables past retention, rotate
/// the open one (`outbox._log_rotate`). Returns 0 (one batch always finishes
/// the step; TRUNCATE reports no row count). Nothing to do with SQL older than
/// 0.8.0.
pub fn rotate() -> i64 {
    if outbox_relid(c"log_state").is_none() {
        return 0;
    }
    let _tables: Option<i32> = plans::one(&ROTATE, &[]);
    0
}
