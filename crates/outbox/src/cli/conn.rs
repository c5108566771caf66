//! One connection for an operator command: the DSN from `--dsn`/`OUTBOX_DSN` or libpq's `PG*`
//! environment variables, TLS as the relay does it ([`crate::db::parse_dsn`]), and a check that the
//! extension is installed before any command runs.
//!
//! libpq semantics kept: an empty DSN is built from `PGHOST`, `PGPORT`, `PGUSER`, `PGDATABASE`,
//! `PGPASSWORD`, `PGSSLMODE` and `PGSSLROOTCERT`; a DSN that leaves out the host, port, user,
//! database or password takes them from those variables; with no host at all the Debian socket
//! directory (`/var/run/postgresql`) is used when it exists, else `localhost`. A `PGHOST` that
//! starts with `/` is a socket directory.

use anyhow::{anyhow, Result};
use futures::StreamExt as _;
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Client};

use super::{sql_error, Common};

/// A live connection with the name of its database.
pub struct Conn {
    /// The client; its connection task runs until the client is dropped.
    pub client: Client,
    /// One message per notification on a channel the session LISTENs to (see [`connect_listening`]).
    pub notifications: mpsc::UnboundedReceiver<String>,
}

/// Quotes a value for a libpq key/value connection string.
fn quote(v: &str) -> String {
    format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// The DSN to use: `--dsn`/`OUTBOX_DSN`, else one built from the `PG*` variables.
fn effective_dsn(common: &Common) -> String {
    if let Some(d) = common.dsn.as_deref().filter(|d| !d.trim().is_empty()) {
        return d.to_string();
    }
    let mut parts = Vec::new();
    for (var, key) in [
        ("PGHOST", "host"),
        ("PGPORT", "port"),
        ("PGUSER", "user"),
        ("PGDATABASE", "dbname"),
        ("PGPASSWORD", "password"),
        ("PGSSLMODE", "sslmode"),
        ("PGSSLROOTCERT", "sslrootcert"),
    ] {
        if let Ok(v) = std::env::var(var) {
            if !v.is_empty() {
                parts.push(format!("{key}={}", quote(&v)));
            }
        }
    }
    parts.join(" ")
}

/// Builds the driver configuration: the DSN, then the `PG*` variables for what it leaves out.
pub fn config(common: &Common) -> Result<(tokio_postgres::Config, crate::db::PgTls)> {
    let dsn = effective_dsn(common);
    let (mut cfg, tls) = crate::db::parse_dsn(&dsn, "outbox-cli")?;
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if cfg.get_hosts().is_empty() {
        match env("PGHOST") {
            Some(hosts) => {
                for h in hosts.split(',') {
                    cfg.host(h.trim());
                }
            }
            None if std::path::Path::new("/var/run/postgresql").is_dir() => {
                cfg.host("/var/run/postgresql");
            }
            None => {
                cfg.host("localhost");
            }
        }
    }
    if cfg.get_ports().is_empty() {
        if let Some(p) = env("PGPORT") {
            let port: u16 = p.parse().map_err(|_| anyhow!("bad PGPORT '{p}'"))?;
            cfg.port(port);
        }
    }
    if cfg.get_dbname().is_none() {
        if let Some(d) = env("PGDATABASE") {
            cfg.dbname(d);
        }
    }
    if cfg.get_password().is_none() {
        if let Some(p) = env("PGPASSWORD") {
            cfg.password(p);
        }
    }
    Ok((cfg, tls))
}

/// Connects, spawns the connection task, and checks that outbox_ext is installed.
pub async fn connect(common: &Common) -> Result<Conn> {
    let (cfg, tls) = config(common)?;
    let (client, mut connection) =
        cfg.connect(tls).await.map_err(|e| anyhow!("cannot connect to PostgreSQL: {}", crate::db::pg_error(&e)))?;
    let (tx, notifications) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(msg)) = messages.next().await {
            if let AsyncMessage::Notification(n) = msg {
                let _ = tx.send(n.channel().to_string());
            }
        }
    });
    let row = client
        .query_opt(
            "SELECT e.extversion, current_database()::text FROM pg_catalog.pg_extension e \
             WHERE e.extname = 'outbox_ext'",
            &[],
        )
        .await
        .map_err(|e| sql_error("checking for the extension", &e))?;
    match row {
        Some(_) => {}
        None => {
            let db: String = client
                .query_one("SELECT current_database()::text", &[])
                .await
                .map(|r| r.get(0))
                .unwrap_or_else(|_| "?".to_string());
            return Err(anyhow!(
                "the outbox_ext extension is not installed in database \"{db}\" (CREATE EXTENSION outbox_ext)"
            ));
        }
    }
    Ok(Conn { client, notifications })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_quoted_for_key_value_dsns() {
        assert_eq!(quote("a b'c"), "'a b\\'c'");
        assert_eq!(quote("x\\y"), "'x\\\\y'");
    }
}
