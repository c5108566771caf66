//! `outbox purge [--dead] [--older-than D]`: retention now, through the public procedures
//! `CALL outbox.purge(...)` or `CALL outbox.purge_dead(...)`.
//!
//! The log is retained by table (its ring tables are truncated whole by maintenance), so a purge
//! never removes an event from it. What it removes are the rows the log keeps beside it:
//! - `outbox purge`: the finished batches' delivery records (`outbox.log_delivered`) and the
//!   delivered rows of their own (`outbox.log_exceptions`: events acked after a retry, with their
//!   attempt history), past the delivered retention;
//! - `outbox purge --dead`: the dead letters' and cancelled events' rows of their own, past the
//!   dead retention.
//!
//! A row of its own is kept while the log still holds its event (below `outbox._log_floor()` it
//! may go). The procedures commit after every batch, so a second connection can watch them work:
//! the progress bar polls an estimate of the rows still eligible (those same tables, with each
//! topic's retention; outbox_admin reads them, as it runs the procedures) while the procedure
//! runs, and the final count is the one the procedure reports. `--dry-run` prints the estimate
//! and removes nothing.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use serde_json::json;
use tokio_postgres::Client;

use super::output::print_json;
use super::{conn, progress_bar, sql_error, Common};

/// Arguments of `outbox purge`.
#[derive(Debug, Args)]
pub struct PurgeArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Purge the rows of dead letters and cancelled events (outbox.purge_dead) instead of delivery
    /// records.
    #[arg(long)]
    dead: bool,
    /// Remove what finished more than this long ago (a PostgreSQL interval: 7 days, 12h);
    /// default: each topic's retention, else outbox.retention_delivered / outbox.retention_dead.
    #[arg(long)]
    older_than: Option<String>,
    /// Rows per committed batch.
    #[arg(long, default_value_t = 1000)]
    batch_size: i32,
    /// Print how many rows are eligible; remove nothing.
    #[arg(long)]
    dry_run: bool,
}

/// How many rows the purge would remove now (an estimate: the procedures skip locked rows). The
/// floor below which the log holds no event is read once per statement, as the procedures do.
async fn eligible(c: &Client, dead: bool, older_than: &Option<String>) -> Result<i64> {
    let sql = if dead {
        "SELECT count(*) FROM outbox.log_exceptions x LEFT JOIN outbox.topics t ON t.topic = x.topic \
         WHERE x.state IN ('dead', 'cancelled') AND coalesce(x.dead_at, x.cancelled_at) < now() - \
         coalesce($1::text::interval, t.retention_dead, \
         nullif(current_setting('outbox.retention_dead', true), '')::interval, '30 days') \
         AND x.id < (SELECT outbox._log_floor())"
    } else {
        "SELECT (SELECT count(*) FROM outbox.log_exceptions x LEFT JOIN outbox.topics t ON t.topic = x.topic \
         WHERE x.state = 'delivered' AND x.delivered_at < now() - coalesce($1::text::interval, \
         t.retention_delivered, nullif(current_setting('outbox.retention_delivered', true), '')::interval, \
         '7 days') AND x.id < (SELECT outbox._log_floor())) \
         + (SELECT count(*) FROM outbox.log_delivered d WHERE d.finished_at < now() - coalesce($1::text::interval, \
         nullif(current_setting('outbox.retention_delivered', true), '')::interval, '7 days'))"
    };
    let row = c.query_one(sql, &[older_than]).await.map_err(|e| sql_error("counting eligible rows", &e))?;
    Ok(row.get(0))
}

/// Runs `outbox purge`.
pub async fn run(args: PurgeArgs) -> Result<i32> {
    let json = args.common.json;
    let c = conn::connect(&args.common).await?;
    let what = if args.dead {
        "rows of dead letters and cancelled events"
    } else {
        "delivery records (finished batches, and events delivered after a retry)"
    };
    let before = eligible(&c.client, args.dead, &args.older_than).await?;
    if args.dry_run {
        if json {
            print_json(&json!({"dry_run": true, "dead": args.dead, "eligible": before}));
        } else {
            println!("dry run: {before} {what} are past their retention; nothing was removed");
        }
        return Ok(0);
    }
    let watcher = conn::connect(&args.common).await?;
    let proc_name = if args.dead { "outbox.purge_dead" } else { "outbox.purge" };
    let call = format!("CALL {proc_name}($1::text::interval, $2::int, NULL)");
    let bar = progress_bar(before.max(1) as u64, json, "purging");
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&args.older_than, &args.batch_size];
    let purge = c.client.query_one(&call, &params);
    tokio::pin!(purge);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let removed: i64 = loop {
        tokio::select! {
            res = &mut purge => {
                let row = res.map_err(|e| sql_error(proc_name, &e))?;
                break row.get::<_, Option<i64>>(0).unwrap_or(0);
            }
            _ = tick.tick() => {
                if let Ok(now) = eligible(&watcher.client, args.dead, &args.older_than).await {
                    bar.set_position((before - now).max(0) as u64);
                }
            }
        }
    };
    bar.finish_and_clear();
    if json {
        print_json(&json!({"dry_run": false, "dead": args.dead, "eligible": before, "removed": removed}));
    } else {
        println!("removed {removed} rows ({what}; {before} were eligible when it started)");
    }
    Ok(0)
}
