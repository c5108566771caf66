//! The library/SQL handshake: this library serves only the SQL it was built with.
//!
//! The library carries [`LIBRARY_FINGERPRINT`], a hash of every source of its
//! install script (build.rs), and its version. An install records both: its
//! version is `pg_extension.extversion`, and sql/handshake.sql defines
//! `outbox._sql_fingerprint()` with the fingerprint of the library that ran the
//! script, which is the script's own, since a package ships the two together.
//! Every upgrade script ends with the same statement, so an `ALTER EXTENSION
//! UPDATE` records the fingerprint of the library that ran it.
//!
//! [`check`] runs at the start of every pinned C entry point (src/pg/fcall.rs;
//! `_lock_row` runs inside claims that checked) and of the
//! `#[pg_extern]` functions the SQL-level API calls first; the per-database
//! background worker runs [`verdict`] each pass (src/worker.rs). A mismatch
//! raises [`MISMATCH`] (55000), whose HINT follows the direction: the SQL is older
//! (`ALTER EXTENSION outbox_ext UPDATE`, or for 0.x a clean reinstall, which no
//! upgrade script reaches), the library is older (install the matching one), or
//! the versions are equal and the fingerprints are not (an SQL change built
//! without a version bump).
//!
//! # Invariant: no verdict outlives the SQL it was taken on
//! The verdict is cached per backend with the count of function invalidations
//! it was taken under ([`crate::pg::function_generation`]). Any change of the
//! installed SQL (CREATE, ALTER ... UPDATE or DROP EXTENSION) replaces or drops
//! `outbox._sql_fingerprint()`, a pg_proc row, and so sends an invalidation that
//! every backend processes before its next statement: the count moves, and the
//! next call reads the catalogs again. A verdict taken inside a transaction that
//! later rolls back was taken on SQL that transaction changed, and the rollback
//! sends the same invalidation locally. So each call is judged against the SQL
//! its own statement sees.
//!
//! While an extension script runs ([`crate::pg::creating_extension`]) nothing is
//! checked: the script calls library functions before it records the fingerprint.

use crate::{errors, pg};
use pgrx::prelude::*;
use std::cell::RefCell;

/// SHA-256 of the install script's sources this library was built from.
pub const LIBRARY_FINGERPRINT: &str = env!("OUTBOX_SQL_FINGERPRINT");
/// The extension version this library serves.
pub const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");
/// SQLSTATE 55000 (object_not_in_prerequisite_state): the installed SQL is not
/// the one this library was built with.
pub const MISMATCH: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE;

/// What the catalogs say about the installed SQL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Installed {
    /// `pg_extension.extversion`; None when the extension is not installed.
    pub version: Option<String>,
    /// What `outbox._sql_fingerprint()` returns; None when it does not exist (0.x).
    pub fingerprint: Option<String>,
}

/// Why this library refuses the installed SQL: the message and its HINT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub message: String,
    pub hint: String,
}

/// `a.b.c` as numbers; None for anything else (a test's `1.0.1-test`).
fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let mut parts = v.split('.').map(|p| p.parse::<u64>().ok());
    let version = (parts.next()??, parts.next()??, parts.next()??);
    parts.next().is_none().then_some(version)
}

/// The verdict on `installed` for a library of `version` and `fingerprint`.
pub fn judge(installed: &Installed, version: &str, fingerprint: &str) -> Result<(), Mismatch> {
    let Some(sql_version) = installed.version.as_deref() else {
        return Ok(()); // nothing installed: nothing calls us through the extension
    };
    if sql_version == version && installed.fingerprint.as_deref() == Some(fingerprint) {
        return Ok(());
    }
    let short = |f: &str| f.chars().take(12).collect::<String>();
    let recorded = installed.fingerprint.as_deref().map_or_else(|| "none".to_string(), short);
    let message = format!(
        "the installed SQL of outbox_ext (version {sql_version}, fingerprint {recorded}) is not the SQL this \
         library serves (version {version}, fingerprint {})",
        short(fingerprint)
    );
    let hint = match (parse_version(sql_version), parse_version(version)) {
        (Some((0, _, _)), _) => "SQL of 0.x cannot be updated to 1.x in place: drain the subscriptions, \
                                 DROP EXTENSION outbox_ext, CREATE EXTENSION outbox_ext, and create the \
                                 subscriptions again (docs: operations, upgrades)."
            .to_string(),
        (Some(sql), Some(lib)) if sql < lib => "The SQL is older than the library: run ALTER EXTENSION outbox_ext \
                                               UPDATE in this database."
            .to_string(),
        (Some(sql), Some(lib)) if sql > lib => format!(
            "The library is older than the SQL: install the outbox_ext library of version {sql_version} and \
             restart the server if it preloads the library."
        ),
        (Some(_), Some(_)) => format!(
            "Version {version}'s SQL here was installed by another build: install the library of the build that \
             installed it, or reinstall the extension (drain, DROP EXTENSION, CREATE EXTENSION)."
        ),
        _ => format!("Install the outbox_ext library of version {sql_version}, or ALTER EXTENSION outbox_ext UPDATE."),
    };
    Err(Mismatch { message, hint })
}

/// Read the installed SQL's version and fingerprint from the catalogs.
fn read_installed() -> Installed {
    // The fingerprint is the literal in the recorded function's body: reading it
    // from pg_proc works when the function is missing (0.x) or has another body.
    let (version, fingerprint) = errors::spi(Spi::get_two::<String, String>(
        "SELECT (SELECT e.extversion::text FROM pg_catalog.pg_extension e WHERE e.extname = 'outbox_ext'), \
                (SELECT substring(p.prosrc FROM '[0-9a-f]{64}') FROM pg_catalog.pg_proc p \
                  WHERE p.oid = pg_catalog.to_regprocedure('outbox._sql_fingerprint()'))",
    ));
    Installed { version, fingerprint }
}

thread_local! {
    /// The last verdict and the function-invalidation count it was taken under.
    static VERDICT: RefCell<Option<(u64, Result<(), Mismatch>)>> = const { RefCell::new(None) };
}

/// The verdict on the SQL this statement sees (cached while no function
/// definition changed; see the module doc).
pub fn verdict() -> Result<(), Mismatch> {
    let generation = pg::function_generation();
    if let Some(v) = VERDICT.with(|c| c.borrow().as_ref().filter(|(g, _)| *g == generation).map(|(_, v)| v.clone())) {
        return v;
    }
    let v = judge(&read_installed(), LIBRARY_VERSION, LIBRARY_FINGERPRINT);
    VERDICT.with(|c| *c.borrow_mut() = Some((generation, v.clone())));
    v
}

/// Raise [`MISMATCH`] unless the installed SQL is this library's.
pub fn check() {
    if pg::creating_extension() {
        return;
    }
    if let Err(m) = verdict() {
        errors::raise_hint(MISMATCH, m.message, m.hint);
    }
}

/// `outbox._library_fingerprint() -> text`: what sql/handshake.sql records.
#[pg_extern(name = "_library_fingerprint", immutable, parallel_safe)]
fn library_fingerprint() -> &'static str {
    LIBRARY_FINGERPRINT
}

/// `outbox._handshake() -> text`: this session's verdict, NULL when the SQL is
/// the library's, else the message (for health() and the tests).
#[pg_extern(name = "_handshake", volatile, parallel_safe)]
fn handshake() -> Option<String> {
    verdict().err().map(|m| m.message)
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use super::*;

    fn installed(version: Option<&str>, fingerprint: Option<&str>) -> Installed {
        Installed { version: version.map(str::to_string), fingerprint: fingerprint.map(str::to_string) }
    }

    #[pg_test]
    fn the_same_version_and_fingerprint_pass() {
        assert_eq!(judge(&installed(Some("1.0.0"), Some("ab")), "1.0.0", "ab"), Ok(()));
    }

    #[pg_test]
    fn older_sql_is_told_to_update() {
        let m = judge(&installed(Some("1.0.0"), Some("ab")), "1.1.0", "cd").unwrap_err();
        assert!(m.hint.contains("ALTER EXTENSION outbox_ext UPDATE"), "{m:?}");
    }

    #[pg_test]
    fn an_older_library_is_told_to_install_the_matching_one() {
        let m = judge(&installed(Some("1.2.0"), Some("ab")), "1.1.0", "ab").unwrap_err();
        assert!(m.hint.contains("install the outbox_ext library of version 1.2.0"), "{m:?}");
    }

    #[pg_test]
    fn an_unbumped_sql_change_fails_too() {
        let m = judge(&installed(Some("1.0.0"), Some("ab")), "1.0.0", "cd").unwrap_err();
        assert!(m.hint.contains("another build"), "{m:?}");
    }

    #[pg_test]
    fn sql_of_0x_is_told_to_reinstall() {
        let m = judge(&installed(Some("0.16.0"), None), "1.0.0", "cd").unwrap_err();
        assert!(m.hint.contains("DROP EXTENSION outbox_ext, CREATE EXTENSION outbox_ext"), "{m:?}");
        assert!(m.message.contains("fingerprint none"), "{m:?}");
    }

    #[pg_test]
    fn this_install_passes() {
        assert_eq!(verdict(), Ok(()));
        assert_eq!(handshake(), None);
    }
}
