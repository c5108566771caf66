//! Time arguments (`--since`, `--until`): a duration meaning "that long ago" (`30m`, `2h`,
//! `7days`, or a PostgreSQL interval such as `2 days`), or a timestamp PostgreSQL understands
//! (`2026-01-31 12:00`, `2026-01-31T12:00:00Z`). The server resolves them, so the result is in its
//! clock and time zone and agrees with `now()` in the queries that use it.

use anyhow::{anyhow, Result};
use tokio_postgres::Client;

/// Resolves a time argument to a `timestamptz` literal (its text form), evaluated on the server.
pub async fn resolve(c: &Client, flag: &str, value: &str) -> Result<String> {
    let v = value.trim();
    if let Ok(d) = humantime::parse_duration(v) {
        let micros = format!("{} microseconds", d.as_micros());
        let row = c
            .query_one("SELECT (now() - $1::text::interval)::text", &[&micros])
            .await
            .map_err(|e| super::sql_error(flag, &e))?;
        return Ok(row.get(0));
    }
    if let Ok(row) = c.query_one("SELECT $1::text::timestamptz::text", &[&v]).await {
        return Ok(row.get(0));
    }
    if let Ok(row) = c.query_one("SELECT (now() - $1::text::interval)::text", &[&v]).await {
        return Ok(row.get(0));
    }
    Err(anyhow!("bad {flag} '{value}': expected a timestamp (2026-01-31 12:00) or a duration ago (30m, 2h, 7 days)"))
}

/// Resolves an optional time argument.
pub async fn resolve_opt(c: &Client, flag: &str, value: Option<&str>) -> Result<Option<String>> {
    match value {
        Some(v) => Ok(Some(resolve(c, flag, v).await?)),
        None => Ok(None),
    }
}
