//! Which errors are worth retrying.
//!
//! The relay retries with backoff only what time can fix; an error that will come back identical
//! on every attempt (bad configuration, missing privilege) stops it with one line and a non-zero
//! exit, so a supervisor or an operator sees it at once instead of a log full of retries.
//!
//! PostgreSQL, by SQLSTATE class (the code `crate::db::pg_error` puts at the end of its line):
//! - permanent: `28` (authentication), `42` (privilege, undefined function or object: e.g.
//!   `42501` without `outbox_worker`), `3D` (unknown database), `3F` (unknown schema: the
//!   extension is not installed), `0A` (feature not supported), `22` (invalid parameter value:
//!   e.g. a `--lease` above `outbox.max_lease`);
//! - transient: everything else, among them `08` (connection), `57P` (server shutting down or
//!   starting up), `53` (too many connections, out of memory or disk), `40` (serialization,
//!   deadlock), `55P03` (lock timeout), `57014` (statement timeout).
//!
//! Without a SQLSTATE (the client's own errors): an invalid configuration (e.g. a DSN the driver
//! cannot use) and a TLS handshake that fails (the server has no SSL while `sslmode=require`, a
//! certificate that does not verify) are permanent, unless the handshake broke on a network error;
//! anything else (connection refused, reset, timed out, closed) is transient.
//!
//! JetStream API errors are classified in `nats.rs` (per event for publishes, at start for the
//! stream), where the error codes are.

use crate::db::ConnectError;

/// Whether an error can go away by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Retry with backoff.
    Transient,
    /// Retrying cannot help: stop.
    Permanent,
}

/// The SQLSTATE at the end of a `pg_error` line (`message (42501)`), if any.
pub fn sqlstate(line: &str) -> Option<&str> {
    let line = line.trim_end();
    let inner = line.strip_suffix(')')?;
    let open = inner.rfind('(')?;
    let code = &inner[open + 1..];
    (code.len() == 5 && code.bytes().all(|b| b.is_ascii_digit() || b.is_ascii_uppercase())).then_some(code)
}

/// The class of a SQLSTATE.
pub fn sqlstate_class(code: &str) -> Class {
    const PERMANENT: [&str; 6] = ["28", "42", "3D", "3F", "0A", "22"];
    if PERMANENT.iter().any(|p| code.starts_with(p)) {
        Class::Permanent
    } else {
        Class::Transient
    }
}

/// The class of a client-side error line (no SQLSTATE).
fn client_class(line: &str) -> Class {
    let lower = line.to_ascii_lowercase();
    if lower.contains("invalid configuration") || lower.contains("invalid connection string") {
        return Class::Permanent;
    }
    if lower.contains("error performing tls handshake") || lower.contains("server does not support tls") {
        const NETWORK: [&str; 6] = [
            "connection reset",
            "broken pipe",
            "unexpected end of file",
            "unexpected eof",
            "timed out",
            "connection refused",
        ];
        return if NETWORK.iter().any(|n| lower.contains(n)) { Class::Transient } else { Class::Permanent };
    }
    Class::Transient
}

/// The class of a database error as the relay sees it (a [`ConnectError`] or a `pg_error` line).
pub fn db_error(e: &anyhow::Error) -> Class {
    let (line, from_server) = match e.downcast_ref::<ConnectError>() {
        Some(c) => (c.message.clone(), c.from_server),
        None => (format!("{e:#}"), false),
    };
    match sqlstate(&line) {
        Some(code) => sqlstate_class(code),
        // The server refused us without a code we can read: it will refuse again.
        None if from_server => Class::Permanent,
        None => client_class(&line),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstate_is_read_from_the_end() {
        assert_eq!(sqlstate("claim: permission denied for function claim (42501)"), Some("42501"));
        assert_eq!(sqlstate("x (57P01) "), Some("57P01"));
        assert_eq!(sqlstate("connection refused (os error 111)"), None);
        assert_eq!(sqlstate("no code"), None);
    }

    #[test]
    fn sqlstate_classes() {
        for c in ["28P01", "28000", "42501", "42883", "3D000", "3F000", "0A000", "22023"] {
            assert_eq!(sqlstate_class(c), Class::Permanent, "{c}");
        }
        for c in ["08006", "08001", "57P01", "57P03", "53300", "40001", "55P03", "57014", "XX000"] {
            assert_eq!(sqlstate_class(c), Class::Transient, "{c}");
        }
    }

    #[test]
    fn client_errors() {
        let e = |s: &str| db_error(&anyhow::anyhow!("{s}"));
        assert_eq!(e("claim: permission denied for function claim (42501)"), Class::Permanent);
        assert_eq!(e("claim: terminating connection due to administrator command (57P01)"), Class::Transient);
        assert_eq!(e("error performing TLS handshake: server does not support TLS"), Class::Permanent);
        assert_eq!(e("error performing TLS handshake: connection reset by peer (os error 104)"), Class::Transient);
        assert_eq!(e("invalid configuration: both host and hostaddr are missing"), Class::Permanent);
        assert_eq!(e("error connecting to server: Connection refused (os error 111)"), Class::Transient);
        assert_eq!(e("connection closed"), Class::Transient);
        let refused = anyhow::Error::new(ConnectError {
            message: "password authentication failed for user \"x\" (28P01)".into(),
            from_server: true,
        });
        assert_eq!(db_error(&refused), Class::Permanent);
        let starting = anyhow::Error::new(ConnectError {
            message: "the database system is starting up (57P03)".into(),
            from_server: true,
        });
        assert_eq!(db_error(&starting), Class::Transient);
    }
}
