//! A `ProcessUtility` hook that lets the extension step aside before statements
//! that need a database to themselves.
//!
//! `DROP DATABASE`, `ALTER DATABASE ... RENAME`, `ALTER DATABASE ... SET
//! TABLESPACE` and `CREATE DATABASE ... TEMPLATE` refuse to run while any other
//! session is connected to the database concerned: `CountOtherDBBackends`
//! (procarray.c) waits about 5 s for such sessions to leave, then fails with
//! "database is being accessed by other users". A background worker connected to
//! the database is such a session. The hook names the databases a statement
//! concerns, before the statement runs, to a handler that makes their workers
//! leave (and keeps them away until the transaction ends: src/registry.rs).

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgList;
use std::ffi::CStr;

/// What the hook calls ahead of a statement, with the OIDs of the databases the
/// statement needs to itself.
pub type Handler = fn(&[u32]);

static mut PREV: pg_sys::ProcessUtility_hook_type = None;
static mut HANDLER: Option<Handler> = None;

/// Install the hook (once, from `_PG_init`), chaining to any hook installed before.
pub fn install(handler: Handler) {
    // SAFETY: _PG_init runs once per process, before any statement; the statics
    // are only written here and read by the hook in the same process.
    unsafe {
        HANDLER = Some(handler);
        PREV = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(hook);
    }
}

/// The databases `stmt` needs no other session connected to (by name; the caller
/// resolves them).
///
/// # Safety
/// `stmt` must be a valid utility statement node.
unsafe fn concerned(stmt: *mut pg_sys::Node) -> Vec<String> {
    let name = |p: *const std::ffi::c_char| {
        // SAFETY: parse-tree strings are NUL-terminated palloc'd C strings.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    // SAFETY: each cast follows the node's tag, as standard_ProcessUtility's
    // switch does; option lists are lists of DefElem (gram.y).
    unsafe {
        if stmt.is_null() {
            return Vec::new();
        }
        match (*stmt).type_ {
            pg_sys::NodeTag::T_DropdbStmt => name((*stmt.cast::<pg_sys::DropdbStmt>()).dbname).into_iter().collect(),
            pg_sys::NodeTag::T_RenameStmt => {
                let r = &*stmt.cast::<pg_sys::RenameStmt>();
                if r.renameType == pg_sys::ObjectType::OBJECT_DATABASE {
                    name(r.subname).into_iter().collect()
                } else {
                    Vec::new()
                }
            }
            // Only SET TABLESPACE (movedb) needs the database to itself. The other
            // options (IS_TEMPLATE, ALLOW_CONNECTIONS, CONNECTION LIMIT) do not:
            // pausing for them would stop wake-ups until a migration's transaction
            // ends. The launcher's next look stops a worker whose database became a
            // template or closed to connections.
            pg_sys::NodeTag::T_AlterDatabaseStmt => {
                let a = &*stmt.cast::<pg_sys::AlterDatabaseStmt>();
                let opts = PgList::<pg_sys::DefElem>::from_pg(a.options);
                if opts.iter_ptr().any(|d| CStr::from_ptr((*d).defname) == c"tablespace") {
                    name(a.dbname).into_iter().collect()
                } else {
                    Vec::new()
                }
            }
            pg_sys::NodeTag::T_CreatedbStmt => {
                let c = &*stmt.cast::<pg_sys::CreatedbStmt>();
                let opts = PgList::<pg_sys::DefElem>::from_pg(c.options);
                let mut template = None;
                for d in opts.iter_ptr() {
                    if CStr::from_ptr((*d).defname) == c"template" && !(*d).arg.is_null() {
                        template = name(pg_sys::defGetString(d));
                    }
                }
                // Without TEMPLATE, CREATE DATABASE copies template1, a template,
                // which is never served.
                template.into_iter().collect()
            }
            _ => Vec::new(),
        }
    }
}

fn resolve(names: &[String]) -> Vec<u32> {
    names
        .iter()
        .filter_map(|n| std::ffi::CString::new(n.as_str()).ok())
        .filter_map(|c| super::catalog::database_oid(&c))
        .collect()
}

#[cfg(not(feature = "pg13"))]
#[pg_guard]
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn hook(
    pstmt: *mut pg_sys::PlannedStmt,
    query: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: the arguments are the executor's, passed on unchanged to the next
    // hook or to standard_ProcessUtility, as every ProcessUtility hook must.
    unsafe {
        let dbs = resolve(&concerned((*pstmt).utilityStmt));
        let next = || match PREV {
            Some(prev) => pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| {
                prev(pstmt, query, read_only_tree, context, params, env, dest, qc)
            }),
            None => pg_sys::standard_ProcessUtility(pstmt, query, read_only_tree, context, params, env, dest, qc),
        };
        run_around(&dbs, next);
    }
}

#[cfg(feature = "pg13")]
#[pg_guard]
unsafe extern "C-unwind" fn hook(
    pstmt: *mut pg_sys::PlannedStmt,
    query: *const std::ffi::c_char,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: as above, for PostgreSQL 13's signature (no readOnlyTree).
    unsafe {
        let dbs = resolve(&concerned((*pstmt).utilityStmt));
        let next = || match PREV {
            Some(prev) => {
                pg_sys::submodules::ffi::pg_guard_ffi_boundary(|| prev(pstmt, query, context, params, env, dest, qc))
            }
            None => pg_sys::standard_ProcessUtility(pstmt, query, context, params, env, dest, qc),
        };
        run_around(&dbs, next);
    }
}

/// Tell the handler, then run the statement.
fn run_around(dbs: &[u32], next: impl FnOnce()) {
    // SAFETY: HANDLER is written once in _PG_init, before any statement.
    if let (Some(h), false) = (unsafe { HANDLER }, dbs.is_empty()) {
        h(dbs);
    }
    next()
}
