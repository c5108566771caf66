//! Search-path pinning for the hot-path functions (see [`pin`]).

use pgrx::pg_sys;

/// What [`unpin`] needs to undo a pin.
pub struct Pinned(#[allow(dead_code)] i32);

/// Pin the search path to `pg_catalog` for the statements a hot-path function runs,
/// so that objects in the caller's path (a shadowing `=`, `now()`, a type) cannot
/// change them. Call [`unpin`] on the way out; on an error the (sub)transaction
/// abort removes the pin.
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
/// Must be paired with [`unpin`] in the same function call.
#[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16"))]
pub unsafe fn pin() -> Pinned {
    // SAFETY: PushOverrideSearchPath copies the struct into its own stack entry
    // (namespace.c), so a local is enough; the caller pops it (or the abort does).
    unsafe {
        // schemas = NIL, pg_catalog implicitly first, pg_temp not searched at all.
        let mut path = pg_sys::OverrideSearchPath { addCatalog: true, addTemp: false, ..Default::default() };
        pg_sys::PushOverrideSearchPath(&mut path);
    }
    Pinned(0)
}

/// Undo [`pin`].
///
/// # Safety
/// `p` must come from the matching [`pin`] call of this function call.
#[cfg(any(feature = "pg13", feature = "pg14", feature = "pg15", feature = "pg16"))]
pub unsafe fn unpin(_p: Pinned) {
    // SAFETY: the caller guarantees the top override entry is the one `pin` pushed
    // (PopOverrideSearchPath raises an error otherwise).
    unsafe { pg_sys::PopOverrideSearchPath() }
}

/// See the PostgreSQL 13-16 version above.
///
/// # Safety
/// Must be paired with [`unpin`] in the same function call.
#[cfg(any(feature = "pg17", feature = "pg18"))]
pub unsafe fn pin() -> Pinned {
    // SAFETY: follows what fmgr_security_definer (fmgr.c) does for a function's
    // SET clause: a new GUC nest level, then a GUC_ACTION_SAVE assignment, undone
    // by AtEOXact_GUC at that level; the C string literals outlive the call.
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

/// Undo [`pin`].
///
/// # Safety
/// `p` must come from the matching [`pin`] call of this function call.
#[cfg(any(feature = "pg17", feature = "pg18"))]
pub unsafe fn unpin(p: Pinned) {
    // SAFETY: `p.0` is the nest level `pin` opened, as fmgr_security_definer
    // passes its own level back to AtEOXact_GUC.
    unsafe { pg_sys::AtEOXact_GUC(true, p.0) }
}
