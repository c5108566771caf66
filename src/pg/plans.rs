//! Saved SPI plans for the hot path.
//!
//! Each statement is prepared once per backend (SPI_prepare + SPI_keepplan) and
//! reused, so a claim costs an execution, not a parse and plan. The plan cache
//! revalidates saved plans after DDL, including DROP/CREATE EXTENSION in the same
//! session, because it re-analyses the statement text.
//!
//! [`run_latest`] runs a saved statement under a snapshot taken *now*, not under
//! the transaction snapshot. Headship decisions (src/subject.rs) must see every
//! commit that preceded the subject lock they hold; a REPEATABLE READ or
//! SERIALIZABLE transaction's own snapshot may predate that lock.

use crate::errors;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::PgOid;
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// A statement of the hot path: its SQL text and parameter types.
pub struct Stmt {
    /// Unique key and SQL text.
    pub sql: &'static str,
    /// Parameter type OIDs, $1..$n.
    pub types: &'static [pg_sys::Oid],
}

thread_local! {
    static PLANS: RefCell<HashMap<&'static str, Rc<OwnedPreparedStatement>>> = RefCell::new(HashMap::new());
}

fn plan_for(client: &SpiClient<'_>, stmt: &Stmt) -> Rc<OwnedPreparedStatement> {
    if let Some(p) = PLANS.with(|m| m.borrow().get(stmt.sql).cloned()) {
        return p;
    }
    let oids: Vec<PgOid> = stmt.types.iter().map(|o| PgOid::from(*o)).collect();
    let prepared = errors::spi(client.prepare_mut(stmt.sql, &oids)).keep();
    let rc = Rc::new(prepared);
    PLANS.with(|m| m.borrow_mut().insert(stmt.sql, rc.clone()));
    rc
}

/// Run `stmt` with `args` inside an SPI connection and hand the result table to
/// `f`. `f` runs while SPI's result memory is alive (copy anything you keep).
///
/// Every statement run here, a plain SELECT too, leaves the transaction with an
/// id: pgrx's `SpiClient::update` assigns one (`GetCurrentTransactionId`) before
/// it executes.
pub fn run<R>(stmt: &Stmt, args: &[DatumWithOid<'_>], f: impl FnOnce(pgrx::spi::SpiTupleTable<'_>) -> R) -> R {
    Spi::connect_mut(|client| {
        let plan = plan_for(client, stmt);
        let table = errors::spi(client.update(&*plan, None, args));
        f(table)
    })
}

/// Run `stmt` and hand its result rows to `f`, as raw tuples ([`Rows`]), while
/// SPI's result memory is alive.
pub fn run_rows<R>(stmt: &Stmt, args: &[DatumWithOid<'_>], f: impl FnOnce(&Rows) -> R) -> R {
    run(stmt, args, |table| {
        // SAFETY: `run` has just executed the statement; SPI_tuptable and
        // SPI_processed describe the table it handed over, and nothing runs SPI
        // before `f` returns (as for `table` itself).
        let rows = unsafe { Rows::current() };
        debug_assert_eq!(rows.len(), table.len());
        f(&rows)
    })
}

/// Run `stmt` and return the first column of the first row, if any.
pub fn one<T: FromDatum + IntoDatum>(stmt: &Stmt, args: &[DatumWithOid<'_>]) -> Option<T> {
    run(stmt, args, |t| if t.is_empty() { None } else { errors::spi(t.first().get_one::<T>()) })
}

/// Run `stmt` and return how many rows it processed.
pub fn count(stmt: &Stmt, args: &[DatumWithOid<'_>]) -> usize {
    run(stmt, args, |t| t.len())
}

/// A timestamptz statement parameter from TimestampTz microseconds.
pub fn ts_param(v: i64) -> DatumWithOid<'static> {
    // SAFETY: timestamptz is a by-value int64; every value is a valid datum.
    unsafe { DatumWithOid::new(pg_sys::Datum::from(v), pg_sys::TIMESTAMPTZOID) }
}

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
    /// The result of the statement SPI ran last.
    ///
    /// # Safety
    /// SPI is connected, a statement has just run, and the `Rows` is dropped
    /// before SPI runs another one or disconnects.
    unsafe fn current() -> Rows {
        // SAFETY: the caller's contract: the globals describe the last result.
        unsafe {
            let tt = pg_sys::SPI_tuptable;
            Rows { tuptable: tt, n: if tt.is_null() { 0 } else { pg_sys::SPI_processed as usize } }
        }
    }

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

    /// Each row, deformed into one reused [`Row`].
    pub fn for_each(&self, mut f: impl FnMut(&mut Row)) {
        if self.n == 0 {
            return;
        }
        // SAFETY: a live SPI tuple table (see `current`) with `n` rows; the buffers
        // have one entry per attribute of its descriptor, as heap_deform_tuple
        // (heaptuple.c) writes.
        unsafe {
            let desc = (*self.tuptable).tupdesc;
            let types = descriptor_types(desc);
            let natts = types.len();
            let mut row = Row { values: vec![pg_sys::Datum::from(0); natts], nulls: vec![false; natts], types };
            for i in 0..self.n {
                let tuple = *(*self.tuptable).vals.add(i);
                pg_sys::heap_deform_tuple(tuple, desc, row.values.as_mut_ptr(), row.nulls.as_mut_ptr());
                f(&mut row);
            }
        }
    }

    /// Column `col` (1-based) of row `row` as a text array, NULL elements dropped.
    pub fn texts(&self, row: usize, col: i32) -> Vec<String> {
        self.datum(row, col)
            // SAFETY: the column is a text[] datum of the live tuple table.
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
        let rows = unsafe { Rows::current() };
        f(&rows)
    })
}

/// The comment that makes [`run_latest`] plan a statement generically.
pub const GENERIC_PLAN: &str = "/* generic plan */";

fn raw_plan(stmt: &Stmt) -> pg_sys::SPIPlanPtr {
    if let Some(p) = RAW_PLANS.with(|m| m.borrow().get(stmt.sql).copied()) {
        return p as pg_sys::SPIPlanPtr;
    }
    let sql = std::ffi::CString::new(stmt.sql).expect("statement text has no NUL");
    let mut types: Vec<pg_sys::Oid> = stmt.types.to_vec();
    // A statement that starts with this comment is always planned generically:
    // a plan made for one set of parameter values (a LIMIT, say) can be the
    // wrong shape for the next, and the plan cache would keep re-planning it.
    let options = if stmt.sql.starts_with(GENERIC_PLAN) { pg_sys::CURSOR_OPT_GENERIC_PLAN as i32 } else { 0 };
    // SAFETY: SPI is connected by the caller; SPI_prepare_cursor copies the text.
    let plan = unsafe { pg_sys::SPI_prepare_cursor(sql.as_ptr(), types.len() as i32, types.as_mut_ptr(), options) };
    if plan.is_null() {
        // SAFETY: SPI_prepare has just set the backend-local SPI_result.
        errors::raise(errors::INTERNAL, format!("SPI_prepare failed: {}", unsafe { pg_sys::SPI_result }));
    }
    // SAFETY: a fresh plan from SPI_prepare; kept for the life of the backend.
    unsafe { pg_sys::SPI_keepplan(plan) };
    RAW_PLANS.with(|m| m.borrow_mut().insert(stmt.sql, plan as usize));
    plan
}

/// One deformed result row, its datums pointing into SPI's result memory.
pub struct Row {
    values: Vec<pg_sys::Datum>,
    nulls: Vec<bool>,
    types: Vec<pg_sys::Oid>,
}

impl Row {
    /// Column `i` (0-based) as bool, None when NULL.
    pub fn bool(&self, i: usize) -> Option<bool> {
        (!self.nulls[i]).then(|| self.values[i].value() != 0)
    }

    /// The raw value of by-value column `i` (0-based) as i64: a bigint or a
    /// timestamptz's microseconds, 0 when NULL.
    pub fn raw_i64(&self, i: usize) -> i64 {
        self.values[i].value() as i64
    }

    /// Replace the value of column `i` (0-based), which must be a bigint or a
    /// timestamptz (panics otherwise).
    pub fn set_i64(&mut self, i: usize, v: i64) {
        assert!(matches!(self.types[i], pg_sys::INT8OID | pg_sys::TIMESTAMPTZOID), "set_i64 of another type");
        self.values[i] = pg_sys::Datum::from(v);
    }

    /// Replace the value of uuid column `i` (0-based) with `v`. The bytes
    /// are copied into the current memory context, which outlives the row's
    /// use: a result row is copied out when it is stored.
    pub fn set_uuid(&mut self, i: usize, v: &[u8; 16]) {
        assert!(self.types[i] == pg_sys::UUIDOID, "set_uuid of another type");
        // SAFETY: palloc returns 16 writable bytes (or raises); a uuid datum
        // is a pointer to its 16 bytes.
        unsafe {
            let p = pg_sys::palloc(16).cast::<u8>();
            std::ptr::copy_nonoverlapping(v.as_ptr(), p, 16);
            self.values[i] = pg_sys::Datum::from(p);
        }
        self.nulls[i] = false;
    }

    /// int4 column `i` (0-based), None when NULL or of another type.
    pub fn i32(&self, i: usize) -> Option<i32> {
        (self.types[i] == pg_sys::INT4OID && !self.nulls[i]).then(|| self.values[i].value() as i32)
    }

    /// interval column `i` (0-based), copied out; None when NULL or of another type.
    pub fn interval(&self, i: usize) -> Option<pgrx::datum::Interval> {
        if self.types[i] != pg_sys::INTERVALOID {
            return None;
        }
        // SAFETY: an interval datum of the live tuple table (or NULL).
        unsafe { pgrx::datum::Interval::from_datum(self.values[i], self.nulls[i]) }
    }

    /// Text column `i` (0-based), None when NULL or of another type.
    pub fn text(&self, i: usize) -> Option<String> {
        if self.types[i] != pg_sys::TEXTOID {
            return None;
        }
        // SAFETY: a text datum of the live tuple table (or NULL).
        unsafe { String::from_datum(self.values[i], self.nulls[i]) }
    }

    /// smallint column `i` (0-based), None when NULL or of another type.
    pub fn i16(&self, i: usize) -> Option<i16> {
        (self.types[i] == pg_sys::INT2OID && !self.nulls[i]).then(|| self.values[i].value() as i16)
    }

    /// bigint column `i` (0-based), None when NULL or of another type.
    pub fn i64(&self, i: usize) -> Option<i64> {
        (self.types[i] == pg_sys::INT8OID && !self.nulls[i]).then(|| self.values[i].value() as i64)
    }

    /// text[] column `i` (0-based), NULL elements dropped; None when NULL or of another type.
    pub fn text_array(&self, i: usize) -> Option<Vec<String>> {
        Some(self.text_array_with_nulls(i)?.into_iter().flatten().collect())
    }

    /// text[] column `i` (0-based) with its NULL elements kept in place (a
    /// 1-based array: element k is at index k - 1); None when NULL or of another type.
    pub fn text_array_with_nulls(&self, i: usize) -> Option<Vec<Option<String>>> {
        if self.types[i] != pg_sys::TEXTARRAYOID {
            return None;
        }
        // SAFETY: a text[] datum of the live tuple table (or NULL).
        unsafe { Vec::<Option<String>>::from_datum(self.values[i], self.nulls[i]) }
    }

    /// bigint[] column `i` (0-based), NULL elements dropped; None when NULL or of another type.
    pub fn i64_array(&self, i: usize) -> Option<Vec<i64>> {
        if self.types[i] != pg_sys::INT8ARRAYOID {
            return None;
        }
        // SAFETY: a bigint[] datum of the live tuple table (or NULL).
        let elems = unsafe { Vec::<Option<i64>>::from_datum(self.values[i], self.nulls[i]) }?;
        Some(elems.into_iter().flatten().collect())
    }

    /// timestamptz column `i` (0-based) in microseconds, None when NULL or of another type.
    pub fn timestamptz(&self, i: usize) -> Option<i64> {
        (self.types[i] == pg_sys::TIMESTAMPTZOID && !self.nulls[i]).then(|| self.values[i].value() as i64)
    }

    /// tid column `i` (0-based, a `ctid`), copied; None when NULL or of another type.
    pub fn tid(&self, i: usize) -> Option<pg_sys::ItemPointerData> {
        if self.types[i] != pg_sys::TIDOID || self.nulls[i] {
            return None;
        }
        // SAFETY: a tid is a by-reference fixed-size datum of the live tuple
        // table; it is copied out.
        Some(unsafe { *(self.values[i].cast_mut_ptr::<pg_sys::ItemPointerData>()) })
    }

    /// bytea column `i` (0-based), copied (detoasted); None when NULL or of another type.
    pub fn bytes(&self, i: usize) -> Option<Vec<u8>> {
        if self.types[i] != pg_sys::BYTEAOID {
            return None;
        }
        // SAFETY: a bytea datum of the live tuple table (or NULL); pgrx detoasts and copies.
        unsafe { Vec::<u8>::from_datum(self.values[i], self.nulls[i]) }
    }

    /// uuid column `i` (0-based), copied; None when NULL or of another type.
    pub fn uuid(&self, i: usize) -> Option<[u8; 16]> {
        if self.types[i] != pg_sys::UUIDOID || self.nulls[i] {
            return None;
        }
        let mut out = [0u8; 16];
        // SAFETY: a uuid datum points to its 16 bytes in the live tuple table.
        unsafe { std::ptr::copy_nonoverlapping(self.values[i].cast_mut_ptr::<u8>(), out.as_mut_ptr(), 16) };
        Some(out)
    }

    pub(super) fn types(&self) -> &[pg_sys::Oid] {
        &self.types
    }

    pub(super) fn parts(&mut self) -> (&mut [pg_sys::Datum], &mut [bool]) {
        (&mut self.values, &mut self.nulls)
    }
}

/// Column type OIDs of a tuple descriptor.
///
/// # Safety
/// `desc` must be a live tuple descriptor.
pub(super) unsafe fn descriptor_types(desc: pg_sys::TupleDesc) -> Vec<pg_sys::Oid> {
    // SAFETY: the caller's contract; PgTupleDesc::from_pg_unchecked borrows it
    // without taking ownership.
    unsafe { pgrx::PgTupleDesc::from_pg_unchecked(desc).iter().map(|a| a.atttypid).collect() }
}
