//! Catalog lookups: the extension's relations and functions, and a table's
//! file node.

use pgrx::pg_sys;

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

/// The lock [`relfilenode`] takes on the table (kept until transaction end).
#[derive(Clone, Copy)]
pub enum TableLock {
    /// As a reader takes it.
    AccessShare,
    /// As a writer (claim) takes it.
    RowExclusive,
}

/// `pg_class.relfilenode` of table `relid`, current as of the lock taken on it.
pub fn relfilenode(relid: pg_sys::Oid, lock: TableLock) -> u32 {
    let lockmode = match lock {
        TableLock::AccessShare => pg_sys::AccessShareLock,
        TableLock::RowExclusive => pg_sys::RowExclusiveLock,
    } as pg_sys::LOCKMODE;
    // SAFETY: table_open raises an error rather than return an invalid relation;
    // the relcache entry is read while open and closed with NoLock, keeping the
    // lock to transaction end as the executor does.
    unsafe {
        // The lock processes pending invalidations, so the file node read below is
        // current (a TRUNCATE committed elsewhere shows here).
        let rel = pg_sys::table_open(relid, lockmode);
        let node = (*(*rel).rd_rel).relfilenode.to_u32();
        pg_sys::table_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        node
    }
}
