//! `outbox health`: `outbox.health()` with a Nagios-style exit status: 0 ok, 1 warning,
//! 2 critical, 3 unknown (no connection, no extension, no privilege, or a status this version does
//! not know). The first line is a summary a monitoring system can show; then every check's
//! message.

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use super::output::{print_json, rows_table};
use super::{conn, json_rows, Common};

/// Arguments of `outbox health`.
#[derive(Debug, Args)]
pub struct HealthArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Ready events older than this are a backlog (health()'s backlog_age).
    #[arg(long, default_value = "1 minute")]
    backlog_age: String,
    /// Ready events past which the backlog is critical (health()'s backlog_critical).
    #[arg(long, default_value_t = 1000)]
    backlog_critical: i64,
}

/// The exit status for one check status.
fn status_code(status: &str) -> i32 {
    match status {
        "ok" => 0,
        "warn" => 1,
        "critical" => 2,
        _ => 3,
    }
}

/// The Nagios word for an exit status.
fn status_word(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "WARNING",
        2 => "CRITICAL",
        _ => "UNKNOWN",
    }
}

/// Runs the checks; every error is status 3 (printed as one line on stderr, and as a JSON object
/// on stdout with `--json`).
pub async fn run(args: HealthArgs) -> Result<i32> {
    match checks(&args).await {
        Ok(code) => Ok(code),
        Err(e) => {
            let line = format!("{e:#}").replace('\n', " ");
            if args.common.json {
                print_json(&json!({"status": "unknown", "exit_code": 3, "error": line}));
            }
            eprintln!("outbox: error: UNKNOWN: {line}");
            Ok(3)
        }
    }
}

async fn checks(args: &HealthArgs) -> Result<i32> {
    let c = conn::connect(&args.common).await?;
    let rows = json_rows(
        &c.client,
        "outbox.health()",
        "SELECT check_name, status, value, message \
         FROM outbox.health(backlog_age => $1::text::interval, backlog_critical => $2::bigint)",
        &[&args.backlog_age, &args.backlog_critical],
    )
    .await?;
    let code =
        rows.iter().map(|r| status_code(r.get("status").and_then(Value::as_str).unwrap_or(""))).max().unwrap_or(0);
    let failing: Vec<String> = rows
        .iter()
        .filter(|r| r.get("status").and_then(Value::as_str) != Some("ok"))
        .map(|r| {
            format!(
                "{}: {}",
                r.get("check_name").and_then(Value::as_str).unwrap_or("?"),
                r.get("message").and_then(Value::as_str).unwrap_or("")
            )
        })
        .collect();
    if args.common.json {
        let status = match code {
            0 => "ok",
            1 => "warn",
            2 => "critical",
            _ => "unknown",
        };
        print_json(&json!({"status": status, "exit_code": code, "checks": rows}));
        return Ok(code);
    }
    if failing.is_empty() {
        println!("OUTBOX OK - {} checks ok", rows.len());
    } else {
        println!("OUTBOX {} - {}", status_word(code), failing.join("; "));
    }
    let columns = [("CHECK", "check_name"), ("STATUS", "status"), ("VALUE", "value"), ("MESSAGE", "message")];
    println!("{}", rows_table(&rows, &columns, 200));
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nagios_codes() {
        assert_eq!(status_code("ok"), 0);
        assert_eq!(status_code("warn"), 1);
        assert_eq!(status_code("critical"), 2);
        assert_eq!(status_code("bogus"), 3);
        assert_eq!(status_word(2), "CRITICAL");
    }
}
