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

/// One row of `pg_database`, as the launcher needs it.
#[derive(Clone, Debug)]
pub struct Database {
    pub oid: u32,
    pub name: String,
    /// `datallowconn`: false for template0 and databases closed to connections.
    pub allow_connections: bool,
    /// `datistemplate`: a worker connected to it would make CREATE DATABASE from
    /// it fail, so templates are never served.
    pub is_template: bool,
}

/// Every database of the cluster, read from the shared catalog `pg_database`.
///
/// Works in a process connected to no database (the launcher): `pg_database` is a
/// shared catalog, so it is read with a catalog heap scan, the way autovacuum's
/// launcher reads it (`get_database_list` in autovacuum.c). Must run inside a
/// transaction.
pub fn databases() -> Vec<Database> {
    let mut out = Vec::new();
    // SAFETY: follows get_database_list (autovacuum.c): table_open of the shared
    // catalog under AccessShareLock, a catalog scan (which registers its own
    // catalog snapshot), GETSTRUCT on each tuple while the scan holds its buffer
    // pin, and the name copied out before the next tuple.
    unsafe {
        let rel = pg_sys::table_open(pg_sys::DatabaseRelationId, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let scan = pg_sys::table_beginscan_catalog(rel, 0, std::ptr::null_mut());
        loop {
            let tup = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tup.is_null() {
                break;
            }
            let form = &*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tup);
            let name = std::ffi::CStr::from_ptr(form.datname.data.as_ptr()).to_string_lossy().into_owned();
            out.push(Database {
                oid: form.oid.to_u32(),
                name,
                allow_connections: form.datallowconn,
                is_template: form.datistemplate,
            });
        }
        pg_sys::table_endscan(scan);
        pg_sys::table_close(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
    }
    out
}

/// OID of database `name`, or None when there is none.
pub fn database_oid(name: &std::ffi::CStr) -> Option<u32> {
    // SAFETY: get_database_oid (dbcommands.c) with missing_ok scans pg_database
    // and returns InvalidOid when the name is unknown.
    let oid = unsafe { pg_sys::get_database_oid(name.as_ptr(), true) };
    (oid != pg_sys::InvalidOid).then(|| oid.to_u32())
}

/// Name of the database this backend is connected to.
pub fn current_database_name() -> Option<String> {
    // SAFETY: get_database_name (dbcommands.c) returns a palloc'd copy or NULL;
    // it reads the syscache, so it needs a transaction, as every caller has.
    unsafe {
        let p = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if p.is_null() {
            return None;
        }
        let s = std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
        pg_sys::pfree(p.cast());
        Some(s)
    }
}
