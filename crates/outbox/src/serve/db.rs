//! A small pool of reconnecting PostgreSQL sessions for the dashboard, and the query helper that
//! keeps the SQLSTATE of a failure (pages react to 42501, "permission denied", by hiding what the
//! role may not read, and to 42883, "no such function", by saying the extension is too old).
//!
//! Each session is set up once: `statement_timeout` bounds every query a page makes, JIT is off, and without
//! `--allow-actions` `default_transaction_read_only = on` makes the whole dashboard unable to write.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use serde_json::{Map, Value};
use tokio::sync::Mutex;
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

/// A failed query or connection: the SQLSTATE when the server sent one, and the message on one line.
#[derive(Debug, Clone)]
pub struct DbError {
    /// The SQLSTATE (`42501`, ...), None for connection and client-side errors.
    pub code: Option<String>,
    /// One line for people.
    pub message: String,
    /// True when PostgreSQL could not be reached at all.
    pub unavailable: bool,
}

impl DbError {
    /// Permission denied (SQLSTATE 42501): the role lacks a privilege.
    pub fn is_permission_denied(&self) -> bool {
        self.code.as_deref() == Some("42501")
    }
    /// The function, table or schema does not exist (an extension older than the dashboard).
    pub fn is_missing_api(&self) -> bool {
        matches!(self.code.as_deref(), Some("42883" | "42P01" | "3F000" | "42703"))
    }
    /// The SQLSTATE and one-line message of a driver error.
    pub fn from_pg(e: &tokio_postgres::Error) -> Self {
        DbError {
            code: e.code().map(|c| c.code().to_string()),
            message: crate::db::pg_error(e),
            unavailable: e.as_db_error().is_none(),
        }
    }
}

impl std::fmt::Display for DbError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A fixed number of sessions, handed out round-robin and each reconnected when it broke.
///
/// tokio-postgres pipelines the queries of one client, so a slot is shared by every request that
/// lands on it; several slots let a slow page (stats over a large archive) not hold up the others.
pub struct Pool {
    cfg: tokio_postgres::Config,
    tls: crate::db::PgTls,
    slots: Vec<Mutex<Option<Arc<Client>>>>,
    next: AtomicUsize,
    setup: String,
}

impl Pool {
    /// A pool of `size` sessions (connected on first use).
    pub fn new(
        cfg: tokio_postgres::Config,
        tls: crate::db::PgTls,
        size: usize,
        statement_timeout: Duration,
        read_only: bool,
    ) -> Self {
        // JIT off: the monitoring views a page reads are planned at millions on a
        // fresh install (no statistics yet), and compiling that plan took about a
        // second, a page's whole statement_timeout, for a few rows.
        let mut setup = format!("SET statement_timeout = {}; SET jit = off", statement_timeout.as_millis().max(1));
        if read_only {
            setup.push_str("; SET default_transaction_read_only = on");
        }
        let slots = (0..size.max(1)).map(|_| Mutex::new(None)).collect();
        Pool { cfg, tls, slots, next: AtomicUsize::new(0), setup }
    }

    /// A live session.
    pub async fn client(&self) -> Result<Arc<Client>, DbError> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let mut slot = self.slots[i].lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        *slot = None;
        let (client, mut conn) = self.cfg.connect(self.tls.clone()).await.map_err(|e| DbError {
            code: e.code().map(|c| c.code().to_string()),
            message: format!("cannot connect to PostgreSQL: {}", crate::db::pg_error(&e)),
            unavailable: true,
        })?;
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
            while let Some(msg) = messages.next().await {
                if let Err(e) = msg {
                    tracing::warn!("dashboard: postgres connection lost: {}", crate::db::pg_error(&e));
                    break;
                }
            }
        });
        client.batch_execute(&self.setup).await.map_err(|e| DbError::from_pg(&e))?;
        let client = Arc::new(client);
        *slot = Some(client.clone());
        Ok(client)
    }
}

/// Runs `sql` and returns each row as a JSON object, PostgreSQL rendering every value
/// (`row_to_json`), so pages and the JSON API show the same values.
pub async fn rows(c: &Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Map<String, Value>>, DbError> {
    let wrapped = format!("SELECT row_to_json(t)::text FROM ({sql}) AS t");
    let rows = c.query(&wrapped, params).await.map_err(|e| DbError::from_pg(&e))?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let text: String = row.get(0);
        match serde_json::from_str(&text) {
            Ok(Value::Object(m)) => out.push(m),
            _ => {
                return Err(DbError {
                    code: None,
                    message: "unexpected row from PostgreSQL".into(),
                    unavailable: false,
                })
            }
        }
    }
    Ok(out)
}

/// One value of one row (None when there is no row).
pub async fn scalar<T>(c: &Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Option<T>, DbError>
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
{
    let row = c.query_opt(sql, params).await.map_err(|e| DbError::from_pg(&e))?;
    match row {
        None => Ok(None),
        Some(r) => r.try_get::<_, T>(0).map(Some).map_err(|e| DbError::from_pg(&e)),
    }
}
