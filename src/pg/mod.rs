//! PostgreSQL internals that the liveness rules depend on, behind one boundary.
//!
//! Everything here is a thin, documented wrapper over a `pg_sys` call whose
//! contract the callers rely on:
//! - [`run_latest`]: run a saved statement under a snapshot taken *now*, not under
//!   the transaction snapshot. Headship decisions (src/subject.rs) must see every
//!   commit that preceded the subject lock they hold; a REPEATABLE READ or
//!   SERIALIZABLE transaction's own snapshot may predate that lock.
//! - [`advisory_xact_lock`] / [`try_advisory_xact_lock`]: the subject locks,
//!   called directly instead of through an SQL statement.
//! - [`try_lock_row`]: lock one row version without waiting and without following
//!   its update chain, which `FOR UPDATE SKIP LOCKED` does (it waits).
//! - [`xid_assigned`], [`uses_xact_snapshot`]: transaction state the low-water
//!   mark and the subject rules branch on.
//! - [`quiet_rust_backtraces`]: keep Rust backtraces out of error DETAIL lines.

pub mod fcall;
pub mod heap;
pub mod plans;

use crate::errors;
use plans::Stmt;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use std::cell::RefCell;
use std::collections::HashMap;

thread_local! {
    /// Saved plans of [`run_latest`], keyed by SQL text (SPI_keepplan: they live
    /// for the backend, and the plan cache revalidates them after DDL).
    static RAW_PLANS: RefCell<HashMap<&'static str, usize>> = RefCell::new(HashMap::new());
}

/// Rows of a [`run_latest`] result, readable while SPI's memory is alive.
pub struct Rows {
    tuptable: *mut pg_sys::SPITupleTable,
    n: usize,
}

impl Rows {
    /// Number of rows returned.
    pub fn len(&self) -> usize {
        self.n
    }

    /// True when no row was returned.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn datum(&self, row: usize, col: i32) -> Option<pg_sys::Datum> {
        if row >= self.n {
            return None;
        }
        // SAFETY: row < n rows of the live SPI tuple table, col is 1-based and the
        // statement's result has that column (checked by the callers' SQL).
        unsafe {
            let mut isnull = false;
            let tuple = *(*self.tuptable).vals.add(row);
            let d = pg_sys::SPI_getbinval(tuple, (*self.tuptable).tupdesc, col, &mut isnull);
            (!isnull).then_some(d)
        }
    }

    /// Column `col` (1-based) of row `row` as bigint.
    pub fn i64(&self, row: usize, col: i32) -> Option<i64> {
        self.datum(row, col).map(|d| d.value() as i64)
    }

    /// Column `col` (1-based) of row `row` as a text array, NULL elements dropped.
    pub fn texts(&self, row: usize, col: i32) -> Vec<String> {
        // SAFETY: the column is a text[] datum of the live tuple table.
        self.datum(row, col)
            .and_then(|d| unsafe { Vec::<Option<String>>::from_datum(d, false) })
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .collect()
    }
}

/// Run `stmt` with `args` under a snapshot taken now (`GetLatestSnapshot`),
/// advancing the command counter so the transaction's own changes are visible,
/// and hand the result to `f` while SPI's memory is alive.
///
/// Under READ COMMITTED this is what every statement gets anyway; under
/// REPEATABLE READ and SERIALIZABLE it sees commits made after the transaction
/// snapshot was taken (the way PostgreSQL's own foreign-key checks read rows,
/// `ri_triggers.c`). A row changed by a transaction that committed after the
/// transaction snapshot is then read and written at its newest version; an update
/// of a row changed concurrently still raises a serialization failure as usual.
pub fn run_latest<R>(stmt: &Stmt, args: &[DatumWithOid<'_>], f: impl FnOnce(&Rows) -> R) -> R {
    Spi::connect_mut(|_client| {
        let plan = raw_plan(stmt);
        let mut values: Vec<pg_sys::Datum> = Vec::with_capacity(args.len());
        let mut nulls: Vec<std::ffi::c_char> = Vec::with_capacity(args.len());
        for a in args {
            match a.datum() {
                Some(d) => {
                    values.push(d.sans_lifetime());
                    nulls.push(b' ' as std::ffi::c_char);
                }
                None => {
                    values.push(pg_sys::Datum::from(0usize));
                    nulls.push(b'n' as std::ffi::c_char);
                }
            }
        }
        // SAFETY: SPI is connected (connect_mut), the plan was prepared for exactly
        // these parameter types, and the datums outlive the call.
        let rc = unsafe {
            pg_sys::SPI_execute_snapshot(
                plan,
                values.as_mut_ptr(),
                nulls.as_ptr(),
                pg_sys::GetLatestSnapshot(),
                std::ptr::null_mut(),
                false,
                true,
                0,
            )
        };
        if rc < 0 {
            errors::raise(errors::INTERNAL, format!("SPI_execute_snapshot failed: {rc}"));
        }
        // SAFETY: SPI_execute_snapshot just set SPI_tuptable / SPI_processed.
        let rows = unsafe {
            let tt = pg_sys::SPI_tuptable;
            Rows { tuptable: tt, n: if tt.is_null() { 0 } else { pg_sys::SPI_processed as usize } }
        };
        f(&rows)
    })
}

fn raw_plan(stmt: &Stmt) -> pg_sys::SPIPlanPtr {
    if let Some(p) = RAW_PLANS.with(|m| m.borrow().get(stmt.sql).copied()) {
        return p as pg_sys::SPIPlanPtr;
    }
    let sql = std::ffi::CString::new(stmt.sql).expect("statement text has no NUL");
    let mut types: Vec<pg_sys::Oid> = stmt.types.to_vec();
    // SAFETY: SPI is connected by the caller; SPI_prepare copies the text.
    let plan = unsafe { pg_sys::SPI_prepare(sql.as_ptr(), types.len() as i32, types.as_mut_ptr()) };
    if plan.is_null() {
        errors::raise(errors::INTERNAL, format!("SPI_prepare failed: {}", unsafe { pg_sys::SPI_result }));
    }
    // SAFETY: a fresh plan from SPI_prepare; kept for the life of the backend.
    unsafe { pg_sys::SPI_keepplan(plan) };
    RAW_PLANS.with(|m| m.borrow_mut().insert(stmt.sql, plan as usize));
    plan
}

/// `hashtext(s)` under the database's default collation, as SQL's `hashtext(s)`
/// computes it: the second key of a subject lock.
pub fn hashtext(s: &str) -> i32 {
    let d = s.into_datum().expect("text datum");
    // SAFETY: hashtext is a strict, immutable V1 function of one text argument;
    // the datum lives until the call returns. pgrx's direct calls pass no
    // collation, which hashtext refuses, so the call frame is built here.
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

/// `pg_advisory_xact_lock(k1, k2)`: wait for the lock, held until transaction end.
pub fn advisory_xact_lock(k1: i32, k2: i32) {
    // SAFETY: a plain V1 function call with two int4 arguments.
    unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(
            pg_sys::pg_advisory_xact_lock_int4,
            &[k1.into_datum(), k2.into_datum()],
        );
    }
}

/// `pg_try_advisory_xact_lock(k1, k2)`: take the lock if it is free, never wait.
pub fn try_advisory_xact_lock(k1: i32, k2: i32) -> bool {
    // SAFETY: a plain V1 function call with two int4 arguments; returns bool.
    unsafe {
        pgrx::fcinfo::direct_function_call_as_datum(
            pg_sys::pg_try_advisory_xact_lock_int4,
            &[k1.into_datum(), k2.into_datum()],
        )
        .is_some_and(|d| d.value() != 0)
    }
}

/// True when no other session holds advisory lock (k1, k2) at this instant: takes
/// it as a session lock and releases it at once, so nothing is left held, even if
/// an error follows (the two calls have nothing between them that can fail).
pub fn advisory_lock_is_free(k1: i32, k2: i32) -> bool {
    // SAFETY: plain V1 function calls with two int4 arguments; returns bool.
    unsafe {
        let got = pgrx::fcinfo::direct_function_call_as_datum(
            pg_sys::pg_try_advisory_lock_int4,
            &[k1.into_datum(), k2.into_datum()],
        )
        .is_some_and(|d| d.value() != 0);
        if got {
            pgrx::fcinfo::direct_function_call_as_datum(
                pg_sys::pg_advisory_unlock_int4,
                &[k1.into_datum(), k2.into_datum()],
            );
        }
        got
    }
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
    // SAFETY: the relation is opened (and its lock kept until transaction end, as
    // FOR UPDATE keeps RowShareLock) and closed here; the slot is created for it
    // and dropped before return; `tid` is copied, so the AM may write to it; the
    // line pointer is checked by `tuple_fetch_row_version` (heap_fetch bounds-checks
    // the offset and refuses unused pointers) before `tuple_lock`, which assumes a
    // valid one.
    unsafe {
        // As FOR UPDATE: a row lock is a write (it assigns an xid), refused in a
        // read-only transaction and on a standby.
        if pg_sys::XactReadOnly {
            errors::raise(errors::READ_ONLY, "cannot lock rows in a read-only transaction");
        }
        // Lock first, then look: a table dropped meanwhile is gone, not an internal error.
        let rel = pg_sys::try_relation_open(relid, pg_sys::RowShareLock as i32);
        if rel.is_null() {
            errors::raise(errors::UNDEFINED_TABLE, format!("relation with OID {} does not exist", relid.to_u32()));
        }
        if pg_sys::pg_class_aclcheck(relid, pg_sys::GetUserId(), pg_sys::ACL_UPDATE as pg_sys::AclMode)
            != pg_sys::AclResult::ACLCHECK_OK
        {
            pg_sys::relation_close(rel, pg_sys::NoLock as i32);
            errors::raise(errors::PERMISSION, "permission denied to lock rows of this table");
        }
        if (*(*rel).rd_rel).relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char || (*rel).rd_tableam.is_null() {
            pg_sys::relation_close(rel, pg_sys::NoLock as i32);
            errors::raise(errors::INVALID_PARAMETER, "rows can only be locked in a plain table");
        }
        let am = &*(*rel).rd_tableam;
        let (Some(fetch), Some(lock)) = (am.tuple_fetch_row_version, am.tuple_lock) else {
            pg_sys::relation_close(rel, pg_sys::NoLock as i32);
            errors::raise(errors::INVALID_PARAMETER, "the table's access method cannot lock rows");
        };
        // A tid from a scan is always in range; one written by hand may not be,
        // and reading past the end would raise a read error instead of 22023.
        let block = ((tid.ip_blkid.bi_hi as u32) << 16) | tid.ip_blkid.bi_lo as u32;
        if block >= pg_sys::RelationGetNumberOfBlocksInFork(rel, pg_sys::ForkNumber::MAIN_FORKNUM) {
            pg_sys::relation_close(rel, pg_sys::NoLock as i32);
            errors::raise(errors::INVALID_PARAMETER, "no row version at this ctid");
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
        match r {
            pg_sys::TM_Result::TM_Ok => RowLock::Locked,
            pg_sys::TM_Result::TM_WouldBlock | pg_sys::TM_Result::TM_BeingModified => RowLock::Busy,
            _ => RowLock::Changed,
        }
    }
}

/// OID of relation `name` in schema outbox (syscache lookups), or None when the
/// extension is not installed in this database.
pub fn outbox_relid(name: &std::ffi::CStr) -> Option<pg_sys::Oid> {
    // SAFETY: syscache lookups by name; the CStr literals outlive the calls.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return None;
        }
        let relid = pg_sys::get_relname_relid(name.as_ptr(), nsp);
        (relid != pg_sys::InvalidOid).then_some(relid)
    }
}

/// True when the installed SQL has `outbox._lock_row(oid, tid)` (0.5.0 on). A
/// library newer than the installed SQL (before `ALTER EXTENSION outbox_ext
/// UPDATE`) uses the statements of 0.4.0, so workers keep running through an
/// upgrade. Looked up in the syscache on every call (two hash probes), not cached:
/// the answer changes with ALTER EXTENSION, its rollback, or DROP and CREATE
/// EXTENSION in the same session, and the catalog, unlike the data, is read as
/// of now at every isolation level.
pub fn row_lock_installed() -> bool {
    // SAFETY: syscache probes with keys built here: a C string for the name, an
    // oidvector palloc'd in the current memory context, and the namespace oid.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"outbox".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return false;
        }
        let args = [pg_sys::OIDOID, pg_sys::TIDOID];
        let vector = pg_sys::buildoidvector(args.as_ptr(), args.len() as i32);
        let found = pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::PROCNAMEARGSNSP as i32,
            pg_sys::Datum::from(c"_lock_row".as_ptr()),
            pg_sys::Datum::from(vector),
            pg_sys::Datum::from(nsp),
            pg_sys::Datum::from(0usize),
        );
        pg_sys::pfree(vector.cast());
        found
    }
}

/// True when the current transaction has a transaction id, i.e. it may already
/// have written something that a rollback would undo.
pub fn xid_assigned() -> bool {
    // SAFETY: reads backend-local transaction state.
    unsafe { pg_sys::GetTopTransactionIdIfAny() != pg_sys::InvalidTransactionId }
}

/// True under REPEATABLE READ and SERIALIZABLE (one snapshot for the transaction).
pub fn uses_xact_snapshot() -> bool {
    // SAFETY: reads a backend-local GUC variable.
    unsafe { pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 }
}

/// The current subtransaction's id (callbacks track what it took).
pub fn subxact_id() -> pg_sys::SubTransactionId {
    // SAFETY: reads backend-local transaction state.
    unsafe { pg_sys::GetCurrentSubTransactionId() }
}

/// `max_locks_per_transaction`, the lock table's share per backend.
pub fn max_locks_per_xact() -> usize {
    // SAFETY: reads a postmaster-level GUC variable.
    (unsafe { pg_sys::max_locks_per_xact }).max(1) as usize
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
