//! The log through pg_dump and restore (sql/restore.sql).
//!
//! pg_dump keeps the log ring, its state and the readers' tables (lanes,
//! batches, rows of their own, finished batches). Their transaction ids are
//! the dumped cluster's: a log row's `txid` and a lane's cursor snapshots
//! agree with each other, but not with any snapshot of the restoring cluster.
//! A restore is therefore **rebased** once (`outbox._log_rebase()`), before
//! any reader uses it.
//!
//! # Invariants, and why they hold
//! 1. **A restore is noticed.** Each ring table has a statement trigger,
//!    `log_restored`, that fires for SQL inserts (a restore's COPY or INSERT)
//!    and records the largest restored id in `outbox.log_restore`. publish
//!    never fires it: it inserts through the heap ([`crate::pg::heap`], which
//!    accepts exactly this trigger and no other), and its SQL fallback writes
//!    only rows of its own transaction, which the trigger ignores. The first
//!    restored table must find the log otherwise empty (55000), so restored
//!    and native events never share ids; ring tables restored at once take
//!    the marker's lock in turn, so exactly one of them is the first. The
//!    lanes carry the dumped cluster's cursors even when the dump's log held
//!    no event, so a restore of `log_lanes` (a top-level COPY or INSERT into
//!    it, which the extension itself never issues: its lanes are written
//!    inside create_subscription, claim and the rebase) sets the marker too,
//!    with `upto` 0: no event is a restored one, and every event of the log
//!    is placed by invariant 4.
//! 2. **Nobody reads a restored state before the rebase.** Claims of the log
//!    ([`rebase_if_pending`], from [`super::claim::claim`]), cancel, replay,
//!    replay_dead and create_subscription rebase first; retention of the log
//!    (`outbox._log_rotate`) does nothing else while the marker exists, and
//!    rebases itself only once the restore looks finished
//!    (`outbox._log_restore_quiet`: no ring table restored for a minute, no
//!    pg_restore and no COPY into the outbox connected), so that a database
//!    nobody claims from still gets its log rotated. The marker is
//!    cached per backend like the subscription catalog (its own statement
//!    trigger invalidates every copy at commit), so a claim costs nothing
//!    extra once rebased.
//! 3. **No unfinished event is lost, none finished is delivered again by
//!    the rebase.** Step 1 decides, in the dump's own ids, each
//!    subscription's state of each restored event exactly as
//!    `outbox._log_deliveries` (and so `outbox.deliveries`) shows it: a row
//!    of its own is kept as it is; an event a batch holds unacked, or the
//!    lane has not read, gets a row of its own, 'pending', with the attempts
//!    its batch started; an acked one, or one committed before the
//!    subscription, gets nothing. Then (step 2) every restored row gets txid
//!    2, which every snapshot sees, and every lane one cursor `C` taken by
//!    the rebase: the lanes count every restored event as read, and each
//!    unfinished one is served from its own row. Per subject, rows of their
//!    own are claimed in id order, which is commit order (src/publish.rs), and
//!    an event the lanes read later is parked behind them
//!    (src/log/exceptions.rs).
//! 4. **Events published between the restore and the rebase are delivered.**
//!    Their ids are above the restored ones (they come from the restored
//!    sequence). Those visible in `C` get a row of their own in every
//!    subscription of their topic (each existed before them: a
//!    subscription created after the restore rebases first); those not
//!    visible in `C` are in the lanes' first window after `C` (src/log/mod.rs,
//!    "The branches miss nothing": `C` is an ordinary cursor).
//! 5. **A rebase runs once.** It deletes the marker under SHARE ROW EXCLUSIVE
//!    on it, so concurrent callers wait and then find nothing; at REPEATABLE
//!    READ or SERIALIZABLE a caller whose snapshot still shows a deleted
//!    marker fails with 40001 before it changes anything.
//!
//! What a logical restore does not keep: the leases of batches in flight
//! (their events are handed out again: at-least-once), and a restored
//! event's place in `outbox.deliveries` before the subscription existed (it
//! shows as delivered). A data-only restore with `--disable-triggers` fires no
//! trigger, so nothing rebases it: restore the log with its triggers.

use crate::pg;
use crate::pg::plans;
use crate::sql::log::{REBASE, RESTORE_PENDING};

thread_local! {
    /// Whether `outbox.log_restore` has a row, valid for the count of
    /// invalidations it was read under.
    static PENDING: pg::GenerationCache<bool> = const { pg::GenerationCache::new(c"log_restore") };
}

/// True while a restored log waits for its rebase.
pub fn pending() -> bool {
    pg::accept_invalidations();
    PENDING.with(|c| {
        c.with(
            || {
                plans::run_latest(&RESTORE_PENDING, &[], |rows| {
                    let mut found = false;
                    rows.for_each(|r| found = r.bool(0).unwrap_or(false));
                    found
                })
            },
            |p| *p,
        )
    })
}

/// Rebase a restored log now if one waits (invariant 2).
pub fn rebase_if_pending() {
    if pending() {
        plans::run(&REBASE, &[], |_| ());
    }
}
