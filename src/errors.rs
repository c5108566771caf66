//! Error reporting with stable SQLSTATEs.
//!
//! Every error the extension raises on purpose goes through [`raise`], so callers
//! can branch on the SQLSTATE instead of parsing messages. A Rust panic would
//! surface as XX000, which the API promises never to return for bad input.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

/// SQLSTATE 22004: a required argument is NULL.
pub const NULL_VALUE: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED;
/// SQLSTATE 22023: an argument is out of range or malformed.
pub const INVALID_PARAMETER: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE;
/// SQLSTATE 54000: a payload or batch exceeds a configured limit.
pub const TOO_LARGE: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED;
/// SQLSTATE P0002: a topic is not registered while `outbox.strict_topics` is on.
pub const NO_DATA_FOUND: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_NO_DATA_FOUND;
/// SQLSTATE 42501: the current role lacks a privilege the call needs.
pub const PERMISSION: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE;
/// SQLSTATE 25006: a write in a read-only transaction.
pub const READ_ONLY: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION;
/// SQLSTATE 42P01: a relation named by OID does not exist.
pub const UNDEFINED_TABLE: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE;
/// SQLSTATE 42704: an object named by the caller (a subscription) does not exist.
pub const UNDEFINED_OBJECT: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT;
/// SQLSTATE 53400: a fixed shared-memory list is full.
pub const CONFIGURATION_LIMIT: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED;
/// SQLSTATE 55006: an object in use (a subscription with leases in flight).
pub const OBJECT_IN_USE: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_OBJECT_IN_USE;
/// SQLSTATE 0A000: a call the outbox does not serve in this context (a claim at SERIALIZABLE).
pub const FEATURE_NOT_SUPPORTED: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED;
/// SQLSTATE XX000 is reserved for internal failures (SPI errors we did not expect).
pub const INTERNAL: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_INTERNAL_ERROR;
/// 40001: a change under REPEATABLE READ or SERIALIZABLE met a concurrent one.
pub const SERIALIZATION_FAILURE: PgSqlErrorCode = PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE;

/// Raise an ERROR with the given SQLSTATE; never returns.
///
/// Messages are prefixed with `outbox:` so they are recognisable in application logs.
pub fn raise(code: PgSqlErrorCode, message: impl Into<String>) -> ! {
    let msg: String = message.into();
    ErrorReport::new(code, format!("outbox: {msg}"), "").report(PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}

/// Like [`raise`], with a HINT line.
pub fn raise_hint(code: PgSqlErrorCode, message: impl Into<String>, hint: impl Into<String>) -> ! {
    let msg: String = message.into();
    ErrorReport::new(code, format!("outbox: {msg}"), "").set_hint(hint.into()).report(PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}

/// Unwrap an SPI result. SPI errors that are real PostgreSQL errors (lock timeouts,
/// statement_timeout, disk full) are raised by PostgreSQL itself before we see them;
/// what reaches here is an SPI protocol failure, which is a bug.
pub fn spi<T>(r: Result<T, pgrx::spi::SpiError>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => raise(INTERNAL, format!("SPI failure: {e}")),
    }
}
