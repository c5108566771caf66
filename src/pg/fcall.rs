//! Glue for the hand-declared C functions of the hot path.
//!
//! publish/claim/ack/fail are declared in `sql/api.sql` with their exact SQL
//! signatures and defaults, and read their arguments straight from `fcinfo`. That
//! lets jsonb payloads pass to SPI as the caller's datum, with no JSON round trip
//! through Rust, and lets claim() hand SPI's result tuples to the executor as a
//! materialized set without converting a single column.

use crate::errors;
use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;

/// Define a version-1 C function `$name` (the symbol named in `sql/api.sql`) that
/// runs `$body(fcinfo) -> pg_sys::Datum` under pgrx's panic/error guard, with the
/// search path pinned to `pg_catalog` (see [`pin_search_path`]).
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

/// Run `body` with the search path pinned ([`pin_search_path`]).
///
/// # Safety
/// `fcinfo` is the call frame PostgreSQL passed to the function.
pub unsafe fn call_pinned(fcinfo: pg_sys::FunctionCallInfo, body: V1Body) -> pg_sys::Datum {
    unsafe {
        let pinned = pin_search_path();
        let result = body(fcinfo);
        unpin_search_path(pinned);
        result
    }
}

/// Run `body` as it is.
///
/// # Safety
/// `fcinfo` is the call frame PostgreSQL passed to the function.
pub unsafe fn call_unpinned(fcinfo: pg_sys::FunctionCallInfo, body: V1Body) -> pg_sys::Datum {
    unsafe { body(fcinfo) }
}

/// What [`unpin_search_path`] needs to undo a pin.
pub struct Pinned(#[allow(dead_code)] i32);

/// Pin the search path to `pg_catalog` for the statements a hot-path function runs,
/// so that objects in the caller's path (a shadowing `=`, `now()`, a type) cannot
/// change them. Call [`unpin_search_path`] on the way out; on an error
/// the (sub)transaction abort removes the pin.
///
/// Why not `SET search_path` on the function, as the plpgsql functions have: that
/// clause opens a GUC nest level, sets and restores the GUC and recomputes the
/// namespace path twice per call. Measured in a 50,000-call loop it cost publish()
/// 3-6 µs of its ~17 µs. An override search path (PostgreSQL 13-16) costs a list
/// copy. Our saved plans record the path they were planned under, so under the
/// same override they are never re-planned. While the override is active, a
/// nested function's own `SET search_path` does not take effect (the override
/// wins); everything these functions run is schema-qualified, so that only
/// narrows lookups further. PostgreSQL 17 removed override search
/// paths (and caches search path lookups), so there the GUC is set as
/// `SET search_path` would.
///
/// # Safety
/// Must be paired with [`unpin_search_path`] in the same function call.
#[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16"))]
pub unsafe fn pin_search_path() -> Pinned {
    unsafe {
        // schemas = NIL, pg_catalog implicitly first, pg_temp not searched at all.
        let mut path = pg_sys::OverrideSearchPath { addCatalog: true, addTemp: false, ..Default::default() };
        pg_sys::PushOverrideSearchPath(&mut path);
    }
    Pinned(0)
}

/// Undo [`pin_search_path`].
///
/// # Safety
/// `p` must come from the matching [`pin_search_path`] call of this function call.
#[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16"))]
pub unsafe fn unpin_search_path(_p: Pinned) {
    unsafe { pg_sys::PopOverrideSearchPath() }
}

/// See the PostgreSQL 13-16 version above.
///
/// # Safety
/// Must be paired with [`unpin_search_path`] in the same function call.
#[cfg(any(feature = "pg17", feature = "pg18"))]
pub unsafe fn pin_search_path() -> Pinned {
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            c"search_path".as_ptr(),
            c"pg_catalog, pg_temp".as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
        Pinned(level)
    }
}

/// Undo [`pin_search_path`].
///
/// # Safety
/// `p` must come from the matching [`pin_search_path`] call of this function call.
#[cfg(any(feature = "pg17", feature = "pg18"))]
pub unsafe fn unpin_search_path(p: Pinned) {
    unsafe { pg_sys::AtEOXact_GUC(true, p.0) }
}

/// Argument `n`, or None when SQL NULL.
///
/// # Safety
/// `fcinfo` must be the live call's info and `n` below its nargs.
pub unsafe fn arg<T: FromDatum>(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<T> {
    unsafe { pgrx::fcinfo::pg_getarg::<T>(fcinfo, n) }
}

/// Raw datum of argument `n`, or None when SQL NULL.
///
/// # Safety
/// As [`arg`].
pub unsafe fn raw(fcinfo: pg_sys::FunctionCallInfo, n: usize) -> Option<pg_sys::Datum> {
    unsafe {
        if pgrx::fcinfo::pg_arg_is_null(fcinfo, n) {
            None
        } else {
            Some(pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, n))
        }
    }
}

/// Argument `n`, raising 22004 `"<name> must not be NULL"` when NULL.
///
/// # Safety
/// As [`arg`].
pub unsafe fn required<T: FromDatum>(fcinfo: pg_sys::FunctionCallInfo, n: usize, name: &str) -> T {
    match unsafe { arg::<T>(fcinfo, n) } {
        Some(v) => v,
        None => errors::raise(errors::NULL_VALUE, format!("{name} must not be NULL")),
    }
}

/// A bound SPI parameter from a raw datum (or NULL) of the given type.
pub fn param(d: Option<pg_sys::Datum>, oid: pg_sys::Oid) -> DatumWithOid<'static> {
    match d {
        Some(d) => unsafe { DatumWithOid::new(d, oid) },
        None => DatumWithOid::null_oid(oid),
    }
}

/// Return SQL NULL from a v1 function.
///
/// # Safety
/// `fcinfo` must be the live call's info.
pub unsafe fn return_null(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe { pgrx::fcinfo::pg_return_null(fcinfo) }
}

/// A materialized result set under construction (ReturnSetInfo, SFRM_Materialize).
pub struct SetResult {
    store: *mut pg_sys::Tuplestorestate,
    desc: pg_sys::TupleDesc,
}

impl SetResult {
    /// Prepare the tuplestore the executor will read, in per-query memory.
    ///
    /// Raises 0A000 when called where a set cannot be accepted.
    ///
    /// # Safety
    /// `fcinfo` must be the live call's info.
    pub unsafe fn begin(fcinfo: pg_sys::FunctionCallInfo) -> SetResult {
        unsafe {
            let rsinfo = (*fcinfo).resultinfo as *mut pg_sys::ReturnSetInfo;
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
            SetResult { store, desc }
        }
    }

    /// Copy a tuple (for example an SPI result row) into the result. Its layout
    /// must match the function's declared result columns.
    ///
    /// # Safety
    /// `tuple` must be a valid heap tuple with the declared layout.
    pub unsafe fn put_tuple(&self, tuple: pg_sys::HeapTuple) {
        unsafe { pg_sys::tuplestore_puttuple(self.store, tuple) }
    }

    /// Append a row from deformed values; only the first `natts` of the result
    /// descriptor are read, so trailing extra columns are ignored.
    pub fn put_values(&self, values: &mut [pg_sys::Datum], nulls: &mut [bool]) {
        unsafe { pg_sys::tuplestore_putvalues(self.store, self.desc, values.as_mut_ptr(), nulls.as_mut_ptr()) }
    }

    /// Append a one-column row.
    pub fn put_single(&self, value: pg_sys::Datum) {
        let mut values = [value];
        let mut nulls = [false];
        unsafe { pg_sys::tuplestore_putvalues(self.store, self.desc, values.as_mut_ptr(), nulls.as_mut_ptr()) }
    }
}

/// The datum a materialized SRF returns.
///
/// # Safety
/// `fcinfo` must be the live call's info.
pub unsafe fn finish_set(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe { pgrx::fcinfo::pg_return_null(fcinfo) }
}

/// Elements of a one-dimensional array datum (NULLs as None), without converting them.
///
/// # Safety
/// `d` must be an array datum whose element type is `elem`.
pub unsafe fn array_elems(d: pg_sys::Datum, elem: pg_sys::Oid, what: &str) -> Vec<Option<pg_sys::Datum>> {
    unsafe {
        let arr = pg_sys::pg_detoast_datum(d.cast_mut_ptr()) as *mut pg_sys::ArrayType;
        let ndim = (*arr).ndim;
        if ndim > 1 {
            errors::raise(errors::INVALID_PARAMETER, format!("{what} must be a one-dimensional array"));
        }
        if ndim == 0 {
            return Vec::new();
        }
        let mut typlen: i16 = 0;
        let mut typbyval = false;
        let mut typalign: std::ffi::c_char = 0;
        pg_sys::get_typlenbyvalalign(elem, &mut typlen, &mut typbyval, &mut typalign);
        let mut values: *mut pg_sys::Datum = std::ptr::null_mut();
        let mut nulls: *mut bool = std::ptr::null_mut();
        let mut n: i32 = 0;
        pg_sys::deconstruct_array(arr, elem, typlen as i32, typbyval, typalign, &mut values, &mut nulls, &mut n);
        (0..n as usize).map(|i| if *nulls.add(i) { None } else { Some(*values.add(i)) }).collect()
    }
}
