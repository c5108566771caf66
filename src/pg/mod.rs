//! The boundary to PostgreSQL internals: the only module that calls `pg_sys`
//! beyond what pgrx requires of its callers. A port to another major version
//! touches this directory only.
//!
//! Everything here is a thin, documented wrapper over a `pg_sys` call whose
//! contract the callers rely on:
//! - [`fcall`]: the v1 call interface (arguments, set results, the array reader);
//!   [`search_path`](mod@search_path): the pinned search path of the hot-path functions.
//! - [`plans`]: saved SPI plans, and [`plans::run_latest`], which runs one under a
//!   snapshot taken now (the log's reads must see every commit that preceded
//!   the locks they hold).
//! - [`heap`]: publish's direct heap insert, a port of the executor's insert path.
//! - [`catalog`]: the extension's relations and functions, a table's file node.
//! - [`advisory_xact_lock`] / [`try_advisory_xact_lock`]: the subject, lane
//!   and batch locks, called directly instead of through an SQL statement, and
//!   the share-mode variants for the log's dead-letter policy lock and the
//!   subjects' coarse lock; [`advisory_xact_unlock`] gives back a lock the
//!   subject locks take only for a moment.
//! - [`try_lock_row`]: lock one row version without waiting and without following
//!   its update chain, which `FOR UPDATE SKIP LOCKED` does (it waits).
//! - [`xid_assigned`], [`uses_xact_snapshot`], [`serializable`], [`read_only`],
//!   [`assign_xid`]: transaction state the log's cursors, retention and claim
//!   branch on; [`with_active_snapshot`] for work in a transaction callback.
//! - [`now`], [`timestamptz`], [`database_id`], [`SharedLatch`], [`notify`]:
//!   small accessors for the background worker and the wake-ups.
//! - [`quiet_rust_backtraces`]: keep Rust backtraces out of error DETAIL lines.
//!
//! Modules inside use [`crate::errors`] and each other only downwards: `fcall`
//! uses `plans` and `search_path`, `heap` uses `catalog`; none of them uses this
//! file's items.

pub mod catalog;
pub mod fcall;
pub mod heap;
pub mod plans;
pub mod search_path;
pub mod utility;

use crate::errors;
use pgrx::prelude::*;

/// `hashtext(s)` under the database's default collation, as SQL's `hashtext(s)`
/// computes it: the second key of a subject lock.
pub fn hashtext(s: &str) -> i32 {
    let d = s.into_datum().expect("text datum");
    // SAFETY: follows DirectFunctionCall1Coll (fmgr.c) with the default
    // collation: hashtext is a strict, immutable V1 function of one text
    // argument; the frame has room for that one argument and the datum lives
    // until the call returns. pgrx's direct calls pass no collation, which
    // hashtext refuses, so the call frame is built here.
    unsafe {
        let size =
            std::mem::size_of::<pg_sys::FunctionCallInfoBaseData>() + std::mem::size_of::<pg_sys::NullableDatum>();
        let fcinfo = pg_sys::palloc0(size).cast::<pg_sys::FunctionCallInfoBaseData>();
        (*fcinfo).fncollation = pg_sys::DEFAULT_COLLATION_OID;
        (*fcinfo).nargs = 1;
        let arg: *mut pg_sys::NullableDatum = std::ptr::addr_of_mut!((*fcinfo).args).cast();
        (*arg).value = d;
        (*arg).isnull = false;
        let h = pg_sys::hashtext(fcinfo).value() as i32;
        pg_sys::pfree(fcinfo.cast());
        h
    }
}

/// The library's own transaction-level locks, keyed by two int4 like
/// `pg_advisory_xact_lock(k1, k2)` and shown by `pg_locks` as `advisory`, but
/// with `objsubid` [`LOCK_SPACE`] where PostgreSQL's functions write 1 or 2.
///
/// **No session can take them from SQL.** `pg_advisory_lock` and its kin
/// build only tags with field 4 set to 1 (one int8 key) or 2 (two int4 keys),
/// and any login role may call them; with those tags a role with no outbox
/// privilege could hold a batch's or subject's lock and make publish, claim
/// and ack wait for it. Only this module builds a tag in [`LOCK_SPACE`], so
/// every holder of one of these locks is the library, inside a call that
/// ends with its transaction.
pub const LOCK_SPACE: u16 = 0x6f62;

/// The lock space of the holds of calls deferred to their commit
/// (src/log/deferred.rs): a transaction that acks, fails or extends a batch
/// event in a transaction block holds (batch, event) here until it ends.
pub const HOLD_SPACE: u16 = 0x6f63;

fn lock_tag(k1: i32, k2: i32) -> pg_sys::LOCKTAG {
    space_tag(k1, k2, LOCK_SPACE)
}

fn space_tag(k1: i32, k2: i32, space: u16) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        // SAFETY: MyDatabaseId is set once a backend has connected, before any
        // SQL function can run.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: k1 as u32,
        locktag_field3: k2 as u32,
        locktag_field4: space,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

fn acquire(k1: i32, k2: i32, mode: u32, dont_wait: bool) -> bool {
    let tag = lock_tag(k1, k2);
    // SAFETY: a transaction-level lock (sessionLock false) on a tag of ours;
    // the lock manager releases it at transaction end.
    let r = unsafe { pg_sys::LockAcquire(&tag, mode as pg_sys::LOCKMODE, false, dont_wait) };
    r != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
}

/// Wait for the exclusive lock (k1, k2), held until transaction end.
pub fn advisory_xact_lock(k1: i32, k2: i32) {
    acquire(k1, k2, pg_sys::ExclusiveLock, false);
}

/// Take the exclusive lock (k1, k2) if it is free, never wait.
pub fn try_advisory_xact_lock(k1: i32, k2: i32) -> bool {
    acquire(k1, k2, pg_sys::ExclusiveLock, true)
}

/// Wait for the lock (k1, k2) in share mode, held until transaction end.
pub fn advisory_xact_lock_shared(k1: i32, k2: i32) {
    acquire(k1, k2, pg_sys::ShareLock, false);
}

/// Take the lock (k1, k2) in share mode if no one holds it exclusively, never wait.
pub fn try_advisory_xact_lock_shared(k1: i32, k2: i32) -> bool {
    acquire(k1, k2, pg_sys::ShareLock, true)
}

/// How a hold in [`HOLD_SPACE`] is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldMode {
    /// One event's hold: conflicts with itself.
    Event,
    /// A transaction's hold of a whole batch (past its cap of event holds):
    /// conflicts with [`HoldMode::Test`] only.
    Coarse,
    /// A claim's test that no transaction holds a batch coarsely: conflicts
    /// with [`HoldMode::Coarse`] only.
    Test,
}

/// Take the hold (k1, k2) in `mode` until transaction end; waits when `wait`,
/// else returns false when another transaction holds a conflicting one.
pub fn hold(k1: i32, k2: i32, mode: HoldMode, wait: bool) -> bool {
    let tag = space_tag(k1, k2, HOLD_SPACE);
    // SAFETY: a transaction-level lock on a tag of ours, as in acquire().
    let r = unsafe { pg_sys::LockAcquire(&tag, hold_mode(mode) as pg_sys::LOCKMODE, false, !wait) };
    r != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
}

/// Give back one acquisition of the hold (k1, k2) in `mode` taken by [`hold`]
/// in the same call.
pub fn unhold(k1: i32, k2: i32, mode: HoldMode) {
    let tag = space_tag(k1, k2, HOLD_SPACE);
    // SAFETY: as in release(): one acquisition of a lock of ours taken in this call.
    unsafe { pg_sys::LockRelease(&tag, hold_mode(mode) as pg_sys::LOCKMODE, false) };
}

fn hold_mode(mode: HoldMode) -> u32 {
    match mode {
        HoldMode::Event => pg_sys::ExclusiveLock,
        HoldMode::Coarse => pg_sys::ShareLock,
        HoldMode::Test => pg_sys::RowExclusiveLock,
    }
}

fn release(k1: i32, k2: i32, mode: u32) {
    let tag = lock_tag(k1, k2);
    // SAFETY: releases one acquisition of a transaction-level lock of ours
    // that the caller took in this resource owner (the same call); LockRelease
    // only warns when it is not held, and then changes nothing.
    unsafe { pg_sys::LockRelease(&tag, mode as pg_sys::LOCKMODE, false) };
}

/// Give back one acquisition of the exclusive lock (k1, k2) before transaction
/// end. Only for a lock the caller took itself in the same call, and did not
/// hold before: a lock held by an earlier call may protect what that call did.
pub fn advisory_xact_unlock(k1: i32, k2: i32) {
    release(k1, k2, pg_sys::ExclusiveLock);
}

/// [`advisory_xact_unlock`] for a lock taken in share mode.
pub fn advisory_xact_unlock_shared(k1: i32, k2: i32) {
    release(k1, k2, pg_sys::ShareLock);
}

/// What [`try_lock_row`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowLock {
    /// The row version is the newest one and this transaction now holds it FOR UPDATE.
    Locked,
    /// Another transaction holds or is changing the row: skipped, not waited for.
    Busy,
    /// A transaction that committed after the caller's snapshot changed or deleted
    /// the row (or this transaction did, in a later command): the version read is
    /// not the newest one.
    Changed,
}

/// What [`try_lock_row`] last checked: table, role, transaction, known length.
#[derive(Clone, Copy)]
struct LockRowChecked {
    relid: pg_sys::Oid,
    user: pg_sys::Oid,
    xid: pg_sys::TransactionId,
    blocks: pg_sys::BlockNumber,
}

thread_local! {
    static LOCK_ROW_CHECKED: std::cell::Cell<Option<LockRowChecked>> = const { std::cell::Cell::new(None) };
}

/// Lock row version `tid` of table `relid` FOR UPDATE, never waiting.
///
/// `SELECT ... FOR UPDATE SKIP LOCKED` skips a row whose newest version is locked,
/// but when the version it read was updated by a transaction that has committed
/// since its snapshot, it first locks the rest of the row's update chain, and that
/// step (`heap_lock_updated_tuple`) waits for any transaction changing a newer
/// version, whatever the wait policy: a claim then waited for another worker's
/// ack, and under REPEATABLE READ it raised 40001. This lock asks the table access
/// method for the version read and nothing else (no `TUPLE_LOCK_FLAG_*`): a newer
/// version means [`RowLock::Changed`], which the caller treats as skipped.
///
/// `tid` must be a row version the calling statement read from `relid` (its
/// `ctid`); any other tid that holds no row version raises 22023. As FOR UPDATE,
/// it needs UPDATE on `relid` (42501) and a read-write transaction (25006); a
/// table that does not exist (or was dropped meanwhile) raises 42P01.
pub fn try_lock_row(relid: pg_sys::Oid, tid: pg_sys::ItemPointerData) -> RowLock {
    // SAFETY: follows ExecLockRows (nodeLockRows.c) for one row: table_tuple_lock
    // with LockWaitSkip, but without TUPLE_LOCK_FLAG_FIND_LAST_VERSION. The
    // relation is opened (and its lock kept until transaction end, as
    // FOR UPDATE keeps RowShareLock) and closed here; the slot is created for it
    // and dropped before return; `tid` is copied, so the AM may write to it; the
    // line pointer is checked by `tuple_fetch_row_version` (heap_fetch bounds-checks
    // the offset and refuses unused pointers) before `tuple_lock`, which assumes a
    // valid one.
    unsafe {
        // As FOR UPDATE: a row lock is a write (it assigns an xid), refused in a
        // read-only transaction and on a standby.
        if read_only() {
            errors::raise(errors::READ_ONLY, "cannot lock rows in a read-only transaction");
        }
        // Lock first, then look: a table dropped meanwhile is gone, not an internal error.
        let rel = pg_sys::try_relation_open(relid, pg_sys::RowShareLock as i32);
        if rel.is_null() {
            errors::raise(errors::UNDEFINED_TABLE, format!("relation with OID {} does not exist", relid.to_u32()));
        }
        // A claim calls this once per candidate row: the checks that cannot change
        // within a transaction (privilege, kind) run once per table and
        // transaction, and the table's length is asked again only for a block past
        // the length known (it cannot shrink while this lock is held).
        let user = pg_sys::GetUserId();
        let xid = pg_sys::GetTopTransactionIdIfAny();
        let known = LOCK_ROW_CHECKED
            .with(|c| c.get())
            .filter(|k| xid != pg_sys::InvalidTransactionId && k.relid == relid && k.user == user && k.xid == xid);
        if known.is_none() {
            if pg_sys::pg_class_aclcheck(relid, user, pg_sys::ACL_UPDATE as pg_sys::AclMode)
                != pg_sys::AclResult::ACLCHECK_OK
            {
                pg_sys::relation_close(rel, pg_sys::NoLock as i32);
                errors::raise(errors::PERMISSION, "permission denied to lock rows of this table");
            }
            if (*(*rel).rd_rel).relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char || (*rel).rd_tableam.is_null() {
                pg_sys::relation_close(rel, pg_sys::NoLock as i32);
                errors::raise(errors::INVALID_PARAMETER, "rows can only be locked in a plain table");
            }
        }
        let am = &*(*rel).rd_tableam;
        let (Some(fetch), Some(lock)) = (am.tuple_fetch_row_version, am.tuple_lock) else {
            pg_sys::relation_close(rel, pg_sys::NoLock as i32);
            errors::raise(errors::INVALID_PARAMETER, "the table's access method cannot lock rows");
        };
        // A tid from a scan is always in range; one written by hand may not be,
        // and reading past the end would raise a read error instead of 22023.
        let block = ((tid.ip_blkid.bi_hi as u32) << 16) | tid.ip_blkid.bi_lo as u32;
        let mut blocks = known.map_or(0, |k| k.blocks);
        if block >= blocks {
            blocks = pg_sys::RelationGetNumberOfBlocksInFork(rel, pg_sys::ForkNumber::MAIN_FORKNUM);
            if block >= blocks {
                pg_sys::relation_close(rel, pg_sys::NoLock as i32);
                errors::raise(errors::INVALID_PARAMETER, "no row version at this ctid");
            }
        }
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        let mut at = tid;
        if !fetch(rel, &mut at, &raw mut pg_sys::SnapshotAnyData, slot) {
            pg_sys::ExecDropSingleTupleTableSlot(slot);
            pg_sys::relation_close(rel, pg_sys::NoLock as i32);
            errors::raise(errors::INVALID_PARAMETER, "no row version at this ctid");
        }
        let mut at = tid;
        let mut tmfd = pg_sys::TM_FailureData::default();
        let r = lock(
            rel,
            &mut at,
            pg_sys::GetActiveSnapshot(),
            slot,
            pg_sys::GetCurrentCommandId(true),
            pg_sys::LockTupleMode::LockTupleExclusive,
            pg_sys::LockWaitPolicy::LockWaitSkip,
            0,
            &mut tmfd,
        );
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::relation_close(rel, pg_sys::NoLock as i32);
        // The lock assigned the xid if nothing had: from now on the checks hold.
        let xid = pg_sys::GetTopTransactionIdIfAny();
        LOCK_ROW_CHECKED.with(|c| c.set(Some(LockRowChecked { relid, user, xid, blocks })));
        match r {
            pg_sys::TM_Result::TM_Ok => RowLock::Locked,
            pg_sys::TM_Result::TM_WouldBlock | pg_sys::TM_Result::TM_BeingModified => RowLock::Busy,
            _ => RowLock::Changed,
        }
    }
}

/// True when the current transaction has a transaction id, i.e. it may already
/// have written something that a rollback would undo.
pub fn xid_assigned() -> bool {
    // SAFETY: reads backend-local transaction state.
    unsafe { pg_sys::GetTopTransactionIdIfAny() != pg_sys::InvalidTransactionId }
}

/// Run `f` with the transaction's snapshot active, for work done where no
/// statement runs (a transaction callback): reading a value stored out of
/// line needs an active or registered snapshot. An error in `f` leaves the
/// stack to the abort, which resets it.
pub fn with_active_snapshot<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: inside a transaction (the callers are its callbacks); the
    // snapshot pushed here is popped before returning.
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
    let r = f();
    // SAFETY: pops the snapshot pushed above; `f` leaves the stack as it found it.
    unsafe { pg_sys::PopActiveSnapshot() };
    r
}

/// Run the current transaction at READ COMMITTED if it has taken no snapshot
/// yet (what `SET TRANSACTION ISOLATION LEVEL READ COMMITTED` may do then).
pub fn read_committed_if_fresh() {
    // SAFETY: backend-local globals; the isolation level may change only before
    // the transaction's first snapshot and outside a subtransaction, the
    // conditions check_XactIsoLevel (variable.c) enforces for SET TRANSACTION.
    unsafe {
        if !pg_sys::FirstSnapshotSet && !pg_sys::IsSubTransaction() {
            pg_sys::XactIsoLevel = pg_sys::XACT_READ_COMMITTED as i32;
        }
    }
}

/// True when the current transaction runs at SERIALIZABLE.
pub fn serializable() -> bool {
    // SAFETY: reads a backend-local GUC variable (IsolationIsSerializable in xact.h).
    unsafe { pg_sys::XactIsoLevel == pg_sys::XACT_SERIALIZABLE as i32 }
}

/// True under REPEATABLE READ and SERIALIZABLE (one snapshot for the transaction).
pub fn uses_xact_snapshot() -> bool {
    // SAFETY: reads a backend-local GUC variable.
    unsafe { pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 }
}

/// True inside an explicit transaction block (BEGIN ... COMMIT), or a
/// procedure's or function's transaction that outlives the statement: what a
/// statement locks then stays locked after it returns.
pub fn in_transaction_block() -> bool {
    // SAFETY: reads backend-local transaction state.
    unsafe { pg_sys::IsTransactionBlock() }
}

/// The current subtransaction's id (callbacks track what it took).
pub fn subxact_id() -> pg_sys::SubTransactionId {
    // SAFETY: reads backend-local transaction state.
    unsafe { pg_sys::GetCurrentSubTransactionId() }
}

/// Keep Rust backtraces out of error reports.
///
/// pgrx's panic hook captures `std::backtrace::Backtrace` for every error that
/// crosses Rust frames and prints it into the ERROR's DETAIL when the server's
/// environment enables backtraces (`RUST_BACKTRACE=1`, common on developer and CI
/// machines): clients then saw 24 stack frames as DETAIL. `RUST_LIB_BACKTRACE`
/// takes precedence over `RUST_BACKTRACE` for that API only, so setting it to 0
/// silences library captures while panics printed to the server log keep theirs.
/// An operator who sets `RUST_LIB_BACKTRACE` explicitly keeps their choice. Called
/// from `_PG_init`, before any capture has cached the setting.
pub fn quiet_rust_backtraces() {
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        // The process is single-threaded here (postmaster or a backend loading us).
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
}

/// The clock (GetCurrentTimestamp): TimestampTz microseconds since 2000-01-01.
pub fn now() -> i64 {
    // SAFETY: reads the system clock; no state involved.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// A timestamptz from TimestampTz microseconds (panics outside its range, as
/// pgrx's conversion of a datum does).
pub fn timestamptz(us: i64) -> TimestampWithTimeZone {
    // SAFETY: timestamptz is a by-value int64: the datum is the value itself.
    unsafe { TimestampWithTimeZone::from_datum(pg_sys::Datum::from(us), false) }.unwrap()
}

/// OID of the database this backend is connected to (0 before it connects).
pub fn database_id() -> u32 {
    // SAFETY: a backend-local global, set once at connection.
    unsafe { pg_sys::MyDatabaseId }.to_u32()
}

/// True in a read-only transaction (and on a standby).
pub fn read_only() -> bool {
    // SAFETY: reads a backend-local GUC variable.
    unsafe { pg_sys::XactReadOnly }
}

/// Assign the current transaction its id, if it has none yet
/// (GetCurrentTransactionId); raises in a read-only transaction on a standby.
pub fn assign_xid() {
    // SAFETY: a plain call on backend-local transaction state.
    unsafe {
        pg_sys::GetCurrentTransactionId();
    }
}

/// Give the current transaction its id before an insert, and return the
/// top-level transaction's full id (`pg_current_xact_id()`). A read-only
/// transaction gets the error an INSERT gets there (25006), not the internal one
/// that assigning an id raises on a standby.
pub fn xid_for_insert() -> u64 {
    // SAFETY: PreventCommandIfReadOnly raises (25006) when XactReadOnly is set;
    // GetTopFullTransactionId assigns the id if needed, as a first write does.
    unsafe {
        if pg_sys::XactReadOnly {
            pg_sys::PreventCommandIfReadOnly(c"INSERT".as_ptr());
        }
        pg_sys::GetTopFullTransactionId().value
    }
}

/// 64 random bits from PostgreSQL's strong random source (`pg_strong_random`);
/// raises when the source fails.
pub fn strong_random() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: pg_strong_random writes exactly `len` bytes into the buffer.
    let ok = unsafe { pg_sys::pg_strong_random(b.as_mut_ptr().cast(), b.len()) };
    if !ok {
        errors::raise(errors::INTERNAL, "could not generate random bytes");
    }
    u64::from_ne_bytes(b)
}

/// The next transaction id to be assigned (ReadNextFullTransactionId), 64 bits.
pub fn next_xid() -> u64 {
    // SAFETY: reads shared transaction state under its own lock.
    unsafe { pg_sys::ReadNextFullTransactionId() }.value
}

/// The top-level transaction's full id, if it has one.
pub fn top_full_xid_if_any() -> Option<u64> {
    // SAFETY: reads backend-local transaction state.
    let x = unsafe { pg_sys::GetTopFullTransactionIdIfAny() }.value;
    (x != 0).then_some(x)
}

/// The top-level transaction's id, or 0 when it has none (32 bits, as
/// `pg_prepared_xacts.transaction` shows it).
pub fn top_xid_if_any() -> u32 {
    // SAFETY: reads backend-local transaction state.
    unsafe { pg_sys::GetTopFullTransactionIdIfAny() }.value as u32
}

/// What became of a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XidStatus {
    /// Still running (or prepared).
    InProgress,
    /// Committed.
    Committed,
    /// Aborted, or crashed.
    Aborted,
}

/// The status of transaction `xid` (TransactionIdIsInProgress, then
/// TransactionIdDidCommit, in that order as heapam_visibility.c asks).
pub fn xid_status(xid: u32) -> XidStatus {
    let xid = pg_sys::TransactionId::from(xid);
    // SAFETY: lookups of the proc array and the commit log by xid, valid for any
    // xid not older than the freeze horizon (the callers' xids are of prepared
    // transactions they saw running).
    unsafe {
        if pg_sys::TransactionIdIsInProgress(xid) {
            XidStatus::InProgress
        } else if pg_sys::TransactionIdDidCommit(xid) {
            XidStatus::Committed
        } else {
            XidStatus::Aborted
        }
    }
}

/// Run `f` in a subtransaction, as a PL/pgSQL block with an EXCEPTION clause
/// does (pl_exec.c, `exec_stmt_block`): its effects are kept when it returns,
/// undone when it raises an error whose SQLSTATE is `code` (then None); any
/// other error goes on up.
pub fn catching<R>(code: PgSqlErrorCode, f: impl FnOnce() -> R) -> Option<R> {
    // SAFETY: the subtransaction is begun and ended here, in the memory context
    // and resource owner of the caller, restored on both paths as pl_exec.c
    // restores them; an error other than `code` is re-raised after the
    // subtransaction is rolled back, so the caller's state is as before.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        let restore = || {
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
        };
        // The closure's captures are not touched again after an error: the
        // subtransaction's rollback undoes what it did in the database.
        let f = std::panic::AssertUnwindSafe(f);
        PgTryBuilder::new(move || {
            let r = f();
            pg_sys::ReleaseCurrentSubTransaction();
            restore();
            Some(r)
        })
        .catch_when(code, |_| {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
            restore();
            None
        })
        .catch_others(|e| {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
            restore();
            e.rethrow()
        })
        .execute()
    }
}

/// Abort the transaction an error left open (a background worker's recovery).
pub fn abort_current_transaction() {
    // SAFETY: AbortCurrentTransaction (xact.c) handles every transaction state,
    // including none.
    unsafe { pg_sys::AbortCurrentTransaction() }
}

/// Re-read the configuration files after SIGHUP.
pub fn reload_config() {
    // SAFETY: ProcessConfigFile with PGC_SIGHUP, as a postmaster child does on SIGHUP.
    unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) }
}

/// End the process with `code` (proc_exit runs the exit callbacks).
pub fn proc_exit(code: i32) -> ! {
    // SAFETY: proc_exit (ipc.c) runs the exit callbacks and ends the process.
    unsafe { pg_sys::proc_exit(code) }
}

/// True while `shared_preload_libraries` are being loaded (in the postmaster).
pub fn preload_in_progress() -> bool {
    // SAFETY: a process-local global set by the postmaster while it loads them.
    unsafe { pg_sys::process_shared_preload_libraries_in_progress }
}

/// The address of a process latch in shared memory, kept in our shared state
/// (the same address in every backend), or none.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct SharedLatch(usize);

impl SharedLatch {
    /// No latch.
    pub const NONE: SharedLatch = SharedLatch(0);

    /// This process's latch.
    pub fn mine() -> SharedLatch {
        // SAFETY: MyProc is this backend's PGPROC in shared memory, set once it
        // has started; procLatch lives as long as the process slot.
        SharedLatch(unsafe { std::ptr::addr_of_mut!((*pg_sys::MyProc).procLatch) } as usize)
    }

    /// Wake the latch's owner (nothing when none).
    pub fn set(self) {
        if self.0 != 0 {
            // SAFETY: a `SharedLatch` is only made by `mine`: the address of a
            // PGPROC's latch in shared memory, which stays a latch after its
            // owner exits (SetLatch on it is then harmless).
            unsafe { pg_sys::SetLatch(self.0 as *mut pg_sys::Latch) };
        }
    }
}

/// `pg_notify(channel, payload)`: queue a notification in the current transaction.
pub fn notify(channel: &str, payload: &str) {
    // SAFETY: a plain V1 function call with two text arguments.
    unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(pg_sys::pg_notify, &[channel.into_datum(), payload.into_datum()]);
    }
}

/// Register the transaction and subtransaction callbacks (once per process).
pub fn register_xact_callbacks(xact: pg_sys::XactCallback, subxact: pg_sys::SubXactCallback) {
    // SAFETY: registering static callbacks with no argument.
    unsafe {
        pg_sys::RegisterXactCallback(xact, std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(subxact, std::ptr::null_mut());
    }
}

thread_local! {
    /// Relcache invalidations this backend has processed (any relation).
    static RELCACHE_GENERATION: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

thread_local! {
    /// The relations whose invalidations [`GenerationCache`]s depend on (their
    /// OIDs in this database, as last looked up); empty until a cache loads.
    static WATCHED: std::cell::RefCell<Vec<pg_sys::Oid>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[pgrx::pg_guard]
extern "C-unwind" fn count_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // Only the watched relations and a full reset (InvalidOid) count: a session's
    // own temporary tables, ANALYZE or autovacuum of any other table would
    // otherwise make every cached copy reload on every transaction.
    let counts = relid == pg_sys::InvalidOid || WATCHED.with(|w| w.borrow().contains(&relid));
    if counts {
        RELCACHE_GENERATION.with(|g| g.set(g.get().wrapping_add(1)));
    }
}

/// Count invalidations of relation `relid` from now on (see
/// [`count_relcache_invalidations`]). A dropped relation's OID stays in the list:
/// its drop was itself an invalidation, and a few stale OIDs cost nothing.
pub fn watch_relation(relid: pg_sys::Oid) {
    WATCHED.with(|w| {
        let mut w = w.borrow_mut();
        if !w.contains(&relid) {
            w.push(relid);
        }
    });
}

/// Start counting relcache invalidations of the watched relations (once per
/// process, from `_PG_init`): the per-backend caches of the topic registry, the
/// subscription catalog and the log ring's state are valid while the count is
/// the one they were loaded under.
pub fn count_relcache_invalidations() {
    // SAFETY: registering a static callback with no argument; PostgreSQL keeps a
    // fixed number of slots and raises an error when they are full.
    unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(count_relcache_invalidation), pg_sys::Datum::from(0)) };
}

thread_local! {
    /// Invalidations of pg_proc rows (any function) this backend has processed.
    static FUNCTION_GENERATION: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

#[pgrx::pg_guard]
extern "C-unwind" fn count_function_invalidation(_arg: pg_sys::Datum, _cache: i32, _hash: u32) {
    FUNCTION_GENERATION.with(|g| g.set(g.get().wrapping_add(1)));
}

/// Start counting invalidations of function definitions (once per process, from
/// `_PG_init`). Every CREATE, REPLACE or DROP of a function, and so every
/// CREATE, ALTER ... UPDATE and DROP EXTENSION of ours, sends one to every
/// backend, which processes it before its next statement: what the handshake's
/// cached verdict (src/handshake.rs) is valid until.
pub fn count_function_invalidations() {
    // SAFETY: registering a static callback with no argument; PostgreSQL keeps a
    // fixed number of slots and raises an error when they are full.
    unsafe {
        pg_sys::CacheRegisterSyscacheCallback(
            pg_sys::SysCacheIdentifier::PROCOID as i32,
            Some(count_function_invalidation),
            pg_sys::Datum::from(0),
        )
    };
}

/// How many function-definition invalidations this backend has processed.
pub fn function_generation() -> u64 {
    FUNCTION_GENERATION.with(|g| g.get())
}

/// Whether an extension script (CREATE or ALTER EXTENSION) is running.
pub fn creating_extension() -> bool {
    // SAFETY: a plain read of a backend-local global.
    unsafe { pg_sys::creating_extension }
}

/// How many relcache invalidations of watched relations (or full resets) this
/// backend has processed.
pub fn relcache_generation() -> u64 {
    RELCACHE_GENERATION.with(|g| g.get())
}

/// A generation no count reaches: what [`load_consistent`] returns for a copy it
/// could not take without an invalidation arriving meanwhile (use it once).
const STALE: u64 = u64::MAX;

/// Run `load` (which reads catalog-like tables) until no relcache invalidation
/// was processed while it ran, and return the generation it is valid for.
///
/// A load takes its snapshot before its query locks the table, and the lock is
/// where PostgreSQL reads pending invalidations: a change that committed in
/// between is read as of the old snapshot while its invalidation is consumed
/// during the load. Comparing the count before and after catches exactly that
/// (as PostgreSQL's own `SharedInvalidMessageCounter` does for the catalogs).
pub fn load_consistent<T>(load: impl Fn() -> T) -> (u64, T) {
    for _ in 0..8 {
        let before = relcache_generation();
        let value = load();
        if relcache_generation() == before {
            return (before, value);
        }
    }
    (STALE, load())
}

/// A per-backend copy of rows read from one catalog-like table of schema outbox
/// (the topic registry, the subscription catalog, the log ring's state), valid
/// while the count of invalidations of watched relations is the one it was
/// loaded under ([`load_consistent`]). The table's statement trigger sends an
/// invalidation at commit, so any change makes every backend's copy stale; so
/// does an invalidation of another watched table, or a full reset, which are rare
/// next to the calls that read the copy.
pub struct GenerationCache<T> {
    table: &'static std::ffi::CStr,
    copy: std::cell::RefCell<Option<(u64, T)>>,
}

impl<T> GenerationCache<T> {
    /// An empty cache of rows of `outbox.<table>` (loaded on first use).
    pub const fn new(table: &'static std::ffi::CStr) -> Self {
        GenerationCache { table, copy: std::cell::RefCell::new(None) }
    }

    /// Apply `f` to the copy, loading it with `load` first when it is missing or
    /// stale. `load` must read the latest committed state (a snapshot taken
    /// now, [`plans::run_latest`]), not the transaction's snapshot: the copy is
    /// kept for later transactions, and an older snapshot would keep a change
    /// out of it until some unrelated invalidation.
    pub fn with<R>(&self, load: impl Fn() -> T, f: impl FnOnce(&T) -> R) -> R {
        let generation = relcache_generation();
        if let Some((g, value)) = self.copy.borrow().as_ref() {
            if *g == generation {
                return f(value);
            }
        }
        // Watched before the load, so a change committed during it counts.
        if let Some(relid) = catalog::outbox_relid(self.table) {
            watch_relation(relid);
        }
        let (generation, value) = load_consistent(load);
        let r = f(&value);
        *self.copy.borrow_mut() = Some((generation, value));
        r
    }
}

/// Read the invalidation messages other backends' commits have sent, running
/// the registered callbacks (`AcceptInvalidationMessages`, as every lock
/// acquisition does).
pub fn accept_invalidations() {
    // SAFETY: a plain call; callbacks run in this backend.
    unsafe { pg_sys::AcceptInvalidationMessages() }
}

/// Send a relcache invalidation for `relid` to every backend, at commit.
pub fn invalidate_relcache(relid: pg_sys::Oid) {
    // SAFETY: queues an invalidation message by OID; any OID is accepted.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(relid) }
}

/// The current value of setting `name` as SHOW prints it (with units), or None
/// when there is no such setting.
pub fn show_setting(name: &std::ffi::CStr) -> Option<String> {
    // SAFETY: GetConfigOptionByName (guc.c) with missing_ok returns NULL or a
    // palloc'd C string, copied here.
    unsafe {
        let v = pg_sys::GetConfigOptionByName(name.as_ptr(), std::ptr::null_mut(), true);
        if v.is_null() {
            None
        } else {
            Some(std::ffi::CStr::from_ptr(v).to_string_lossy().into_owned())
        }
    }
}

/// This process's PID.
pub fn my_pid() -> i32 {
    // SAFETY: a process-local global set at process start.
    unsafe { pg_sys::MyProcPid }
}

/// True while `pid` is a live backend or background worker of this cluster
/// (its PGPROC is in the proc array).
pub fn backend_alive(pid: i32) -> bool {
    // SAFETY: IsBackendPid (procarray.c) takes ProcArrayLock itself.
    pid != 0 && unsafe { pg_sys::IsBackendPid(pid) }
}

/// Run `f(arg)` when this process exits, before it detaches from shared memory:
/// also after a FATAL error, which ends the process without unwinding.
pub fn before_exit(f: extern "C-unwind" fn(i32, pg_sys::Datum), arg: u64) {
    // SAFETY: before_shmem_exit (ipc.c) keeps a fixed table of callbacks and
    // raises an error when it is full; the callback is a static function.
    unsafe { pg_sys::before_shmem_exit(Some(f), pg_sys::Datum::from(arg)) }
}

/// Release every LWLock this process holds: the first step of an exit callback,
/// which may run after an error left one held (as ProcKill does in proc.c).
pub fn release_lwlocks() {
    // SAFETY: LWLockReleaseAll (lwlock.c) releases only this process's locks.
    unsafe { pg_sys::LWLockReleaseAll() }
}
