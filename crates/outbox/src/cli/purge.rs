//! `outbox purge [--dead] [--older-than D]`: retention now, through the public procedures
//! `CALL outbox.purge(...)` (delivered and cancelled events) or `CALL outbox.purge_dead(...)`
//! (dead letters). They commit after every batch, so a second connection can watch them work: the
//! progress bar polls an estimate of the rows still eligible (from `outbox.events`, with each
//! topic's retention) while the procedure runs, and the final count is the one the procedure
//! reports. `--dry-run` prints the estimate and removes nothing.

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
    common: Common,
    /// Purge dead letters (outbox.purge_dead) instead of delivered and cancelled events.
    #[arg(long)]
    dead: bool,
    /// Remove what finished more than this long ago (a PostgreSQL interval: 7 days, 12h);
    /// default: each topic's retention, else outbox.retention_delivered / outbox.retention_dead.
    #[arg(long)]
    older_than: Option<String>,
    /// Rows per committed batch.
    #[arg(long, default_value_t = 1000)]
    batch_size: i32,
    /// Print how many events are eligible; remove nothing.
    #[arg(long)]
    dry_run: bool,
}

/// How many events the purge would remove now (an estimate: the procedures also remove the log's
/// batch records and skip locked rows).
async fn eligible(c: &Client, dead: bool, older_than: &Option<String>) -> Result<i64> {
    let sql = if dead {
        "SELECT count(*) FROM outbox.events e LEFT JOIN outbox.topics t ON t.topic = e.topic \
         WHERE e.state = 'dead' AND e.dead_at < now() - coalesce($1::text::interval, t.retention_dead, \
         nullif(current_setting('outbox.retention_dead', true), '')::interval, '30 days')"
    } else {
        "SELECT count(*) FROM outbox.events e LEFT JOIN outbox.topics t ON t.topic = e.topic \
         WHERE e.state IN ('delivered', 'cancelled') AND coalesce(e.delivered_at, e.cancelled_at) < now() - \
         coalesce($1::text::interval, t.retention_delivered, \
         nullif(current_setting('outbox.retention_delivered', true), '')::interval, '7 days')"
    };
    let row = c.query_one(sql, &[older_than]).await.map_err(|e| sql_error("counting eligible events", &e))?;
    Ok(row.get(0))
}

/// Runs `outbox purge`.
pub async fn run(args: PurgeArgs) -> Result<i32> {
    let json = args.common.json;
    let c = conn::connect(&args.common).await?;
    let what = if args.dead { "dead letters" } else { "delivered and cancelled events" };
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
