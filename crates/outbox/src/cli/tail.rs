//! `outbox tail [--topic PATTERN]`: print new events as they commit, for debugging, until Ctrl-C
//! (or SIGTERM, or `--limit` events).
//!
//! It LISTENs on `outbox` (the extension's wake-up channel) and also polls every `--poll`, reading
//! `outbox.events` by id. Ids are drawn before commit, so an event may commit after a later id was
//! already shown: each poll reads again the ids of the last `--late-window` of publication time
//! and skips the ids already printed. An event whose transaction stays open longer than that
//! window after publishing can be missed; `tail` is a debugging aid, not a consumer (workers use
//! `claim`).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use serde_json::Value;

use super::output::cell;
use super::{conn, json_rows, sql_error, topic_match_sql, Common};

/// Arguments of `outbox tail`.
#[derive(Debug, Args)]
pub struct TailArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Only topics matching this pattern (exact, `prefix.*` or `*`).
    #[arg(long)]
    topic: Option<String>,
    /// Start after this id instead of at the newest event.
    #[arg(long)]
    after: Option<i64>,
    /// Stop after this many events.
    #[arg(long)]
    limit: Option<u64>,
    /// Poll interval (besides notifications).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    poll: Duration,
    /// How long after its publication an event may still commit and be shown.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    late_window: Duration,
}

/// Runs `outbox tail`: 0 on Ctrl-C, SIGTERM or after `--limit` events.
pub async fn run(args: TailArgs) -> Result<i32> {
    let mut c = conn::connect(&args.common).await?;
    c.client.batch_execute("LISTEN outbox").await.map_err(|e| sql_error("LISTEN outbox", &e))?;
    let start: i64 = match args.after {
        Some(a) => a,
        None => c
            .client
            .query_one("SELECT coalesce(max(id), 0) FROM outbox.events", &[])
            .await
            .map_err(|e| sql_error("outbox.events", &e))?
            .get(0),
    };
    let sql = format!(
        "SELECT id, topic, subject, dispatch_key, published_at, \
         extract(epoch FROM now() - published_at)::float8 AS age, headers, payload \
         FROM outbox.events WHERE id > $1::bigint AND {} AND NOT (id = ANY($3::bigint[])) ORDER BY id LIMIT 1000",
        topic_match_sql("topic", 2)
    );
    let late = args.late_window.as_secs_f64();
    let mut floor = start;
    let mut seen: BTreeSet<i64> = BTreeSet::new();
    let mut printed = 0u64;
    // Both streams are made once, before the first query: a signal that arrives while a query
    // runs is then kept for the next select instead of being lost (a fresh `ctrl_c()` future per
    // loop only sees signals sent after it is polled).
    use tokio::signal::unix::{signal, SignalKind};
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    if !args.common.json {
        eprintln!("tailing events after id {start} (Ctrl-C to stop)");
    }
    loop {
        let seen_ids: Vec<i64> = seen.iter().copied().collect();
        let rows = json_rows(&c.client, "outbox.events", &sql, &[&floor, &args.topic, &seen_ids]).await?;
        for r in &rows {
            let Some(id) = r.get("id").and_then(Value::as_i64) else { continue };
            seen.insert(id);
            print_event(args.common.json, r);
            printed += 1;
            if args.limit.is_some_and(|l| printed >= l) {
                return Ok(0);
            }
        }
        // Ids of events published longer ago than the window are settled: move the floor past them.
        let mut settled = floor;
        for r in &rows {
            let age = r.get("age").and_then(Value::as_f64).unwrap_or(0.0);
            if age > late {
                settled = settled.max(r.get("id").and_then(Value::as_i64).unwrap_or(floor));
            }
        }
        floor = settled;
        seen = seen.split_off(&(floor + 1));
        if rows.len() >= 1000 {
            continue;
        }
        tokio::select! {
            _ = sigint.recv() => return Ok(0),
            _ = sigterm.recv() => return Ok(0),
            _ = c.notifications.recv() => {}
            _ = tokio::time::sleep(args.poll) => {}
        }
        // Events already printed that are now old enough no longer need remembering.
        if !seen.is_empty() {
            let oldest_needed: Option<i64> = c
                .client
                .query_one(
                    "SELECT max(id) FROM outbox.events WHERE id = ANY($1::bigint[]) \
                     AND published_at < now() - $2::text::interval",
                    &[
                        &seen.iter().copied().collect::<Vec<i64>>(),
                        &format!("{} microseconds", args.late_window.as_micros()),
                    ],
                )
                .await
                .map_err(|e| sql_error("outbox.events", &e))?
                .get(0);
            if let Some(m) = oldest_needed {
                floor = floor.max(m);
                seen = seen.split_off(&(floor + 1));
            }
        }
    }
}

fn print_event(json: bool, r: &serde_json::Map<String, Value>) {
    if json {
        let mut r = r.clone();
        r.shift_remove("age");
        println!("{}", Value::Object(r));
    } else {
        let g = |k: &str| cell(r.get(k).unwrap_or(&Value::Null));
        let subject = g("subject");
        let subject = if subject.is_empty() { String::new() } else { format!(" subject={subject}") };
        let payload = r.get("payload").map(|p| p.to_string()).unwrap_or_default();
        println!("{} #{} {}{} {}", g("published_at"), g("id"), g("topic"), subject, payload);
    }
}
