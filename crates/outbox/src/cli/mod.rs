//! The operator subcommands of `outbox` (issue 19, command-line part): `stats`, `health`, `events`,
//! `replay`, `cancel`, `topics`, `subscriptions`, `purge` and `tail`.
//!
//! Invariants:
//! - Only the extension's SQL API is used: the views `outbox.stats`, `outbox.events`,
//!   `outbox.deliveries`, `outbox.subscriptions`, `outbox.topics`, and the public functions and
//!   procedures (`replay`, `cancel`, `create_topic`, `purge`, ...). Nothing here writes a table.
//! - Every command takes `--json` and a DSN from the global `--dsn`, `OUTBOX_DSN`, or libpq's `PG*`
//!   variables (see [`conn`]). Before running, the command checks that the extension is installed.
//! - Every failure is one line on stderr (`outbox: error: ...`) and a non-zero exit status; a
//!   server error is rewritten into a hint when its cause is common (no privilege, no extension).
//! - Guardrails (replay, cancel) check every event's state before changing anything, and rely on the
//!   SQL functions' own checks too (`replay` only moves dead or cancelled events, `cancel` only
//!   pending or dead ones), so a race between the check and the call is harmless.

pub mod cancel;
pub mod conn;
pub mod events;
pub mod health;
pub mod output;
pub mod purge;
pub mod replay;
pub mod stats;
pub mod subscriptions;
pub mod tail;
pub mod time;
pub mod topics;

use std::io::{BufRead as _, IsTerminal as _, Write as _};

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};
use serde_json::{Map, Value};
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

/// Options every operator command takes. `--json` is global within the command, so it may follow
/// a nested subcommand (`outbox events ls --json`); `outbox --json events ls` sets it too. The DSN
/// is the top-level global `--dsn`/`OUTBOX_DSN` (`main.rs`), handed over after parsing.
#[derive(Debug, Clone, Default, Args)]
pub struct Common {
    /// The top-level `--dsn` (or `OUTBOX_DSN`); None: libpq's `PG*` variables (see [`conn`]).
    #[arg(skip)]
    pub dsn: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

/// The retry policy flags shared by topics and subscriptions (`create_topic`, `alter_topic`,
/// `create_subscription`, `alter_subscription`); unset flags are passed as NULL.
#[derive(Debug, Args)]
pub struct RetryPolicy {
    /// Attempts before an event is dead-lettered.
    #[arg(long)]
    pub max_attempts: Option<i32>,
    /// First retry delay (a PostgreSQL interval: 1s, 500ms, 2 minutes).
    #[arg(long)]
    pub backoff_base: Option<String>,
    /// Longest retry delay (interval).
    #[arg(long)]
    pub backoff_max: Option<String>,
    /// Lease of a claim that gives none (interval).
    #[arg(long)]
    pub default_lease: Option<String>,
}

/// The operator subcommands (flattened into the top-level command list).
#[derive(Debug, Subcommand)]
pub enum CliCommand {
    /// Counts by state per topic and subscription (outbox.stats).
    Stats(stats::StatsArgs),
    /// Run outbox.health(); exit status 0 ok, 1 warning, 2 critical, 3 unknown (Nagios style).
    Health(health::HealthArgs),
    /// List events, or show one with its payload, headers and error history.
    Events(events::EventsArgs),
    /// Put dead or cancelled events back to pending (by id, or every matching dead letter).
    Replay(replay::ReplayArgs),
    /// Cancel pending or dead events.
    Cancel(cancel::CancelArgs),
    /// List, create, alter or drop topics (per-topic policy).
    Topics(topics::TopicsArgs),
    /// List, create, drop, pause or resume subscriptions.
    Subscriptions(subscriptions::SubscriptionsArgs),
    /// Remove delivery records (or dead letters' and cancelled events' rows) past their retention.
    Purge(purge::PurgeArgs),
    /// Stream new events as they commit (LISTEN outbox plus polling), until Ctrl-C.
    Tail(tail::TailArgs),
}

impl CliCommand {
    /// The options of the command, for `main` to hand the top-level `--dsn` and `--json` over.
    pub fn common_mut(&mut self) -> &mut Common {
        match self {
            CliCommand::Stats(a) => &mut a.common,
            CliCommand::Health(a) => &mut a.common,
            CliCommand::Events(a) => &mut a.common,
            CliCommand::Replay(a) => &mut a.common,
            CliCommand::Cancel(a) => &mut a.common,
            CliCommand::Topics(a) => &mut a.common,
            CliCommand::Subscriptions(a) => &mut a.common,
            CliCommand::Purge(a) => &mut a.common,
            CliCommand::Tail(a) => &mut a.common,
        }
    }
}

/// Runs one operator command and returns the process exit status. Errors are returned for `main`
/// to print; `health` turns its own errors into status 3 (unknown).
pub async fn run(cmd: CliCommand) -> Result<i32> {
    match cmd {
        CliCommand::Stats(a) => stats::run(a).await,
        CliCommand::Health(a) => health::run(a).await,
        CliCommand::Events(a) => events::run(a).await,
        CliCommand::Replay(a) => replay::run(a).await,
        CliCommand::Cancel(a) => cancel::run(a).await,
        CliCommand::Topics(a) => topics::run(a).await,
        CliCommand::Subscriptions(a) => subscriptions::run(a).await,
        CliCommand::Purge(a) => purge::run(a).await,
        CliCommand::Tail(a) => tail::run(a).await,
    }
}

/// Rewrites a driver error into one line, with a hint for the causes operators meet most.
pub fn sql_error(context: &str, e: &tokio_postgres::Error) -> anyhow::Error {
    let base = crate::db::pg_error(e);
    let hint = match e.code().map(|c| c.code()) {
        Some("42501") => {
            " (permission denied: this command needs the outbox_admin role; GRANT outbox_admin TO the login role)"
        }
        Some("3F000") | Some("42P01") | Some("42883") => {
            " (is outbox_ext installed and up to date in this database? CREATE EXTENSION outbox_ext)"
        }
        _ => "",
    };
    anyhow!("{context}: {base}{hint}")
}

/// Runs `sql` (a query with explicit parameter casts) and returns each row as a JSON object, with
/// the column names and PostgreSQL's own JSON rendering of every type (`row_to_json`).
pub async fn json_rows(
    c: &Client,
    context: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Map<String, Value>>> {
    let wrapped = format!("SELECT row_to_json(t)::text FROM ({sql}) AS t");
    let rows = c.query(&wrapped, params).await.map_err(|e| sql_error(context, &e))?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let text: String = row.get(0);
        match serde_json::from_str(&text)? {
            Value::Object(m) => out.push(m),
            other => return Err(anyhow!("{context}: unexpected row {other}")),
        }
    }
    Ok(out)
}

/// Fails with a clear message unless the subscription exists (`outbox.subscriptions`).
pub async fn ensure_subscription(c: &Client, name: &str) -> Result<()> {
    let row = c
        .query_opt("SELECT 1 FROM outbox.subscriptions WHERE name = $1::text", &[&name])
        .await
        .map_err(|e| sql_error("outbox.subscriptions", &e))?;
    match row {
        Some(_) => Ok(()),
        None => Err(anyhow!("unknown subscription '{name}' (outbox subscriptions ls lists them)")),
    }
}

/// The SQL condition "column `col` matches the claim-style topic pattern in parameter `$n`"
/// (exact topic, `prefix.*`, or `*`; a NULL parameter matches everything), as
/// `outbox._topic_matches` defines it.
pub fn topic_match_sql(col: &str, n: usize) -> String {
    format!(
        "(${n}::text IS NULL OR ${n}::text = '*' \
         OR (right(${n}::text, 2) = '.*' AND starts_with({col}, left(${n}::text, -1))) \
         OR {col} = ${n}::text)"
    )
}

/// Asks for a typed confirmation on a terminal. Returns Ok(true) when the user typed `expected`,
/// Ok(false) when they typed something else, and an error when stdin is not a terminal (a script
/// must pass `--yes`).
pub fn confirm(question: &str, expected: &str, what: &str) -> Result<bool> {
    if !std::io::stdin().is_terminal() {
        return Err(anyhow!("refusing to {what} without --yes (stdin is not a terminal, so nothing can be confirmed)"));
    }
    eprint!("{question} Type '{expected}' to confirm: ");
    std::io::stderr().flush().ok();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    Ok(line.trim() == expected)
}

/// A progress bar on stderr for `len` steps, hidden unless stderr is a terminal (and never in JSON
/// mode, whose output is for programs).
pub fn progress_bar(len: u64, json: bool, message: &str) -> indicatif::ProgressBar {
    let bar = if json || !std::io::stderr().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(len)
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, eta {eta})",
    ) {
        bar.set_style(style);
    }
    bar.set_message(message.to_string());
    bar
}
