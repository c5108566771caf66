//! Glue for the hand-declared C functions of the hot path.
//!
//! publish/claim/ack/fail are declared in `sql/api.sql` with their exact SQL
//! signatures and defaults, and read their arguments straight from `fcinfo`. That
//! lets jsonb payloads pass to SPI as the caller's datum, with no JSON round trip
//! through Rust, and lets claim() hand SPI's result tuples to the executor as a
//! materialized set without converting a single column.
//!
//! The one `unsafe` step of a function body is [`Call::new`]: its contract (the
//! frame is the live call's, and each read names the declared type) is what
//! makes every later read through [`Call`], [`Value`] and [`Array`] sound.

use super::plans::{descriptor_types, Row};
use super::search_path;
use crate::errors;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use std::cell::Cell;

/// Define a version-1 C function `$name` (the symbol named in `sql/api.sql`) that
/// runs `$body(fcinfo) -> pg_sys::Datum` under pgrx's panic/error guard, with the
/// search path pinned to `pg_catalog` (see [`search_path::pin`]).
#[macro_export]
macro_rules! v1_function {
    (@emit $name:ident, $finfo:ident, $call:path, $body:path) => {
        #[no_mangle]
        #[doc(hidden)]
        pub extern "C" fn $finfo() -> &'static ::pgrx::pg_sys::Pg_finfo_record {
            const V1: ::pgrx::pg_sys::Pg_finfo_record = ::pgrx::pg_sys::Pg_finfo_record { api_version: 1 };
            &V1
        }

        #[no_mangle]
        #[doc(hidden)]
        #[::pgrx::pg_guard]
        pub unsafe extern "C-unwind" fn $name(fcinfo: ::pgrx::pg_sys::FunctionCallInfo) -> ::pgrx::pg_sys::Datum {
            let call: unsafe fn(::pgrx::pg_sys::FunctionCallInfo, $crate::pg::fcall::V1Body) -> ::pgrx::pg_sys::Datum =
                $call;
            let body: $crate::pg::fcall::V1Body = $body;
            // SAFETY: PostgreSQL calls this symbol through fmgr with the frame of
            // the function sql/api.sql declares for it, which is what `$body` reads.
            unsafe { call(fcinfo, body) }
        }
    };
    // A function that runs no SQL needs no pinned path (one call per row locked).
    (unpinned $name:ident, $finfo:ident, $body:path) => {
        $crate::v1_function!(@emit $name, $finfo, $crate::pg::fcall::call_unpinned, $body);
    };
    ($name:ident, $finfo:ident, $body:path) => {
        $crate::v1_function!(@emit $name, $finfo, $crate::pg::fcall::call_pinned, $body);
    };
}

/// A V1 function body.
pub type V1Body = unsafe fn(pg_sys::FunctionCallInfo) -> pg_sys::Datum;

/// Run `body` with the search path pinned ([`search_path::pin`]).
///
/// # Safety
/// `fcinfo` is the call frame PostgreSQL passed to the function.
pub unsafe fn call_pinned(fcinfo: pg_sys::FunctionCallInfo, body: V1Body) -> pg_sys::Datum {
    // SAFETY: pin and unpin pair up within this call; an error thrown by `body`
    // skips the unpin, and the (sub)transaction abort then pops the pin.
    crate::handshake::check();
    unsafe {
        let pinned = search_path::pin();
        let result = body(fcinfo);
        search_path::unpin(pinned);
        result
    }
}

/// Run `body` as it is.
///
/// # Safety
/// `fcinfo` is the call frame PostgreSQL passed to the function.
pub unsafe fn call_unpinned(fcinfo: pg_sys::FunctionCallInfo, body: V1Body) -> pg_sys::Datum {
    // No handshake check: the one unpinned function, _lock_row, runs once per row
    // inside the library's own claim statements, whose entry point checked.
    // SAFETY: the caller's contract is `body`'s.
    unsafe { body(fcinfo) }
}

/// The call frame of a running v1 function, read through safe methods.
pub struct Call {
    fcinfo: pg_sys::FunctionCallInfo,
}

impl Call {
    /// Wrap the frame of the running call.
    ///
    /// # Safety
    /// `fcinfo` is the frame PostgreSQL passed to the running function, the
    /// `Call` does not outlive that call, and every typed read made through it
    /// ([`Call::arg`], [`Call::value`]) names the type the argument has in the
    /// function's SQL declaration (`sql/api.sql`).
    pub unsafe fn new(fcinfo: pg_sys::FunctionCallInfo) -> Call {
        Call { fcinfo }
    }

    /// Argument `n`, or None when SQL NULL.
    pub fn arg<T: FromDatum>(&self, n: usize) -> Option<T> {
        // SAFETY: `new`'s contract: a live frame and `T` the declared type;
        // pg_getarg panics (no read) when `n` is past nargs.
        unsafe { pgrx::fcinfo::pg_getarg::<T>(self.fcinfo, n) }
    }

    /// Argument `n`, raising 22004 `"<name> must not be NULL"` when NULL.
    pub fn required<T: FromDatum>(&self, n: usize, name: &str) -> T {
        match self.arg::<T>(n) {
            Some(v) => v,
            None => errors::raise(errors::NULL_VALUE, format!("{name} must not be NULL")),
        }
    }

    /// Argument `n` as it was passed (a datum of type `oid`, the declared type),
    /// or None when SQL NULL.
    pub fn value(&self, n: usize, oid: pg_sys::Oid) -> Option<Value> {
        // SAFETY: `new`'s contract: a live frame; pg_get_nullable_datum panics (no
        // read) when `n` is past nargs.
        let d = unsafe { pgrx::fcinfo::pg_get_nullable_datum(self.fcinfo, n) };
        (!d.isnull).then_some(Value { datum: d.value, oid })
    }

    /// The relation a trigger function was fired for, or None when this call is
    /// not a trigger call.
    pub fn trigger_relid(&self) -> Option<pg_sys::Oid> {
        // SAFETY: `context` of a live frame is NULL or a node; a TriggerData node
        // (checked by tag, as CALLED_AS_TRIGGER does) has an open tg_relation.
        unsafe {
            let ctx = (*self.fcinfo).context;
            if ctx.is_null() || !pgrx::is_a(ctx, pg_sys::NodeTag::T_TriggerData) {
                return None;
            }
            let td = ctx as *mut pg_sys::TriggerData;
            Some((*(*td).tg_relation).rd_id)
        }
    }

    /// Return SQL NULL.
    pub fn return_null(&self) -> pg_sys::Datum {
        // SAFETY: sets isnull of the live frame.
        unsafe { pgrx::fcinfo::pg_return_null(self.fcinfo) }
    }

    /// The datum a materialized SRF returns (its rows are in the [`SetResult`]).
    pub fn finish_set(&self) -> pg_sys::Datum {
        self.return_null()
    }
}

/// A datum of a known type, valid for the rest of the call that produced it: a
/// [`Call`] argument, an [`Array`] element, or a value built here.
#[derive(Clone, Copy)]
pub struct Value {
    datum: pg_sys::Datum,
    oid: pg_sys::Oid,
}

impl Value {
    /// A new jsonb datum in the current memory context.
    pub fn jsonb(j: pgrx::JsonB) -> Value {
        Value { datum: j.into_datum().expect("jsonb datum"), oid: pg_sys::JSONBOID }
    }

    /// The datum (for a by-value type, the value itself).
    pub fn datum(&self) -> pg_sys::Datum {
        self.datum
    }

    /// The type's OID.
    pub fn oid(&self) -> pg_sys::Oid {
        self.oid
    }

    /// A bound SPI parameter of this value.
    pub fn param(self) -> DatumWithOid<'static> {
        // SAFETY: `datum` is a value of type `oid` (how every Value is made).
        unsafe { DatumWithOid::new(self.datum, self.oid) }
    }

    /// A text value as a String (None for a type other than text).
    pub fn text(self) -> Option<String> {
        if self.oid != pg_sys::TEXTOID {
            return None;
        }
        // SAFETY: a non-NULL text datum.
        unsafe { String::from_datum(self.datum, false) }
    }

    /// Size of a varlena value as stored untoasted, header excluded; reads the
    /// header only, so a large toasted value is not fetched.
    ///
    /// Panics for a type other than jsonb or text.
    pub fn raw_size(&self) -> i64 {
        assert!(self.oid == pg_sys::JSONBOID || self.oid == pg_sys::TEXTOID, "raw_size of a non-varlena value");
        // SAFETY: a non-NULL varlena datum (checked type); toast_raw_datum_size
        // (detoast.c) reads its header or TOAST pointer only.
        (unsafe { pg_sys::toast_raw_datum_size(self.datum) }) as i64 - pg_sys::VARHDRSZ as i64
    }
}

/// A bound SPI parameter of type `oid` from `v` (NULL when None).
pub fn param(v: Option<Value>, oid: pg_sys::Oid) -> DatumWithOid<'static> {
    match v {
        Some(v) => {
            debug_assert!(v.oid == oid, "parameter of another type");
            v.param()
        }
        None => DatumWithOid::null_oid(oid),
    }
}

/// A one-dimensional array value: the one reader of array arguments.
pub struct Array {
    arr: *mut pg_sys::ArrayType,
    elem: pg_sys::Oid,
}

/// The element type of the array types the API takes.
fn element_type(array: pg_sys::Oid) -> pg_sys::Oid {
    match array {
        pg_sys::TEXTARRAYOID => pg_sys::TEXTOID,
        pg_sys::JSONBARRAYOID => pg_sys::JSONBOID,
        pg_sys::INT8ARRAYOID => pg_sys::INT8OID,
        pg_sys::UUIDARRAYOID => pg_sys::UUIDOID,
        // SAFETY: a syscache lookup by OID.
        other => unsafe { pg_sys::get_element_type(other) },
    }
}

impl Array {
    /// Read array value `v`, raising 22023 `"<what> must be a one-dimensional
    /// array"` for more dimensions. An empty array has zero dimensions.
    pub fn read(v: Value, what: &str) -> Array {
        let elem = element_type(v.oid);
        assert!(elem != pg_sys::InvalidOid, "Array::read of a non-array value");
        // SAFETY: an array datum (checked type); pg_detoast_datum (fmgr.c) returns
        // it or a detoasted copy in the current memory context, either live for
        // the rest of the call.
        let arr = unsafe { pg_sys::pg_detoast_datum(v.datum.cast_mut_ptr()) as *mut pg_sys::ArrayType };
        // SAFETY: a detoasted array header.
        let ndim = unsafe { (*arr).ndim };
        if ndim > 1 {
            errors::raise(errors::INVALID_PARAMETER, format!("{what} must be a one-dimensional array"));
        }
        Array { arr, elem }
    }

    fn ndim(&self) -> i32 {
        // SAFETY: `arr` is a detoasted array (see `read`).
        unsafe { (*self.arr).ndim }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        if self.ndim() == 0 {
            return 0;
        }
        // SAFETY: ARR_DIMS (array.h): the dimensions follow the fixed header; a
        // one-dimensional array has one.
        unsafe {
            let dims = (self.arr as *mut u8).add(std::mem::size_of::<pg_sys::ArrayType>()) as *const i32;
            *dims as usize
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when some element is NULL.
    pub fn has_nulls(&self) -> bool {
        if self.ndim() == 0 {
            return false;
        }
        // SAFETY: ARR_HASNULL (array.h) is dataoffset != 0; array_contains_nulls
        // (arrayfuncs.c) reads the null bitmap of a detoasted array.
        unsafe { (*self.arr).dataoffset != 0 && pg_sys::array_contains_nulls(self.arr) }
    }

    /// The elements (NULLs as None), without converting them.
    pub fn elems(&self) -> Vec<Option<Value>> {
        if self.ndim() == 0 {
            return Vec::new();
        }
        // SAFETY: deconstruct_array (arrayfuncs.c) of a detoasted array with its
        // element type's storage parameters; the palloc'd outputs hold `n` entries
        // and point into the array, which lives for the rest of the call.
        unsafe {
            let mut typlen: i16 = 0;
            let mut typbyval = false;
            let mut typalign: std::ffi::c_char = 0;
            pg_sys::get_typlenbyvalalign(self.elem, &mut typlen, &mut typbyval, &mut typalign);
            let mut values: *mut pg_sys::Datum = std::ptr::null_mut();
            let mut nulls: *mut bool = std::ptr::null_mut();
            let mut n: i32 = 0;
            pg_sys::deconstruct_array(
                self.arr,
                self.elem,
                typlen as i32,
                typbyval,
                typalign,
                &mut values,
                &mut nulls,
                &mut n,
            );
            (0..n as usize)
                .map(|i| if *nulls.add(i) { None } else { Some(Value { datum: *values.add(i), oid: self.elem }) })
                .collect()
        }
    }
}

/// A materialized result set under construction (ReturnSetInfo, SFRM_Materialize).
pub struct SetResult {
    store: *mut pg_sys::Tuplestorestate,
    desc: pg_sys::TupleDesc,
    /// Whether the row layout given to `put_row` was checked against `desc`.
    checked: Cell<bool>,
}

impl SetResult {
    /// Prepare the tuplestore the executor will read, in per-query memory.
    ///
    /// Raises 0A000 when called where a set cannot be accepted.
    pub fn begin(call: &Call) -> SetResult {
        // SAFETY: follows InitMaterializedSRF (funcapi.c): resultinfo is checked to
        // be a ReturnSetInfo that allows materialize mode and has an expected
        // descriptor; the descriptor copy and the tuplestore are made in the
        // query's per-query context, so they outlive this call.
        unsafe {
            let rsinfo = (*call.fcinfo).resultinfo as *mut pg_sys::ReturnSetInfo;
            if rsinfo.is_null()
                || !pgrx::is_a(rsinfo as *mut pg_sys::Node, pg_sys::NodeTag::T_ReturnSetInfo)
                || ((*rsinfo).allowedModes & pg_sys::SetFunctionReturnMode::SFRM_Materialize as i32) == 0
                || (*rsinfo).expectedDesc.is_null()
            {
                errors::raise(
                    PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                    "set-valued function called in a context that cannot accept a set",
                );
            }
            let per_query = (*(*rsinfo).econtext).ecxt_per_query_memory;
            let old = pg_sys::MemoryContextSwitchTo(per_query);
            let desc = pg_sys::CreateTupleDescCopy((*rsinfo).expectedDesc);
            let random = ((*rsinfo).allowedModes & pg_sys::SetFunctionReturnMode::SFRM_Materialize_Random as i32) != 0;
            let store = pg_sys::tuplestore_begin_heap(random, false, pg_sys::work_mem);
            pg_sys::MemoryContextSwitchTo(old);
            (*rsinfo).returnMode = pg_sys::SetFunctionReturnMode::SFRM_Materialize;
            (*rsinfo).setResult = store;
            (*rsinfo).setDesc = desc;
            SetResult { store, desc, checked: Cell::new(false) }
        }
    }

    /// Append a row deformed from an SPI result; only the first `natts` of the
    /// result descriptor are read, so trailing extra columns are ignored. The
    /// first row's column types are checked against the declared result columns
    /// (SQLSTATE XX000 when they differ).
    pub fn put_row(&self, row: &mut Row) {
        if !self.checked.get() {
            // SAFETY: `desc` is the live descriptor copy made in `begin`.
            let want: Vec<pg_sys::Oid> = unsafe { descriptor_types(self.desc) };
            let have = row.types();
            if have.len() < want.len() || have[..want.len()] != want[..] {
                errors::raise(errors::INTERNAL, "result row does not match the declared result columns");
            }
            self.checked.set(true);
        }
        let (values, nulls) = row.parts();
        // SAFETY: the row's leading column types are the result's (checked
        // above); tuplestore_putvalues copies the values into the store.
        unsafe { pg_sys::tuplestore_putvalues(self.store, self.desc, values.as_mut_ptr(), nulls.as_mut_ptr()) }
    }

    /// Append a one-column bigint row.
    pub fn put_i64(&self, value: i64) {
        let mut values = [pg_sys::Datum::from(value)];
        let mut nulls = [false];
        // SAFETY: the functions that call this return SETOF bigint (sql/api.sql): a
        // by-value datum matches the descriptor's one column.
        unsafe { pg_sys::tuplestore_putvalues(self.store, self.desc, values.as_mut_ptr(), nulls.as_mut_ptr()) }
    }
}
